"""`privlm bench hardening`'s driver, end to end on the tiny model and tiny sizes (real subprocesses)."""

from __future__ import annotations

import json
import socket
import threading
from dataclasses import replace

import pytest

from privlm.provenance import git_commit
from privlm.wire.tensors import Limits
from privlm_bench.snd.hardening import MIB, QUICK, Body, HardeningRun, chunked_post, legal_texts, run_hardening
from tests.models.tiny import tiny_bert_folder


def test_legal_texts_hit_the_token_target_within_the_per_input_maximum(tiny_bert):
    corpus = ["the cat sat on the mat .", "a dog , the w1 w2 w3 sat"]
    texts, counts = legal_texts(tiny_bert, corpus, inputs=5, tokens=123)
    assert len(texts) == 5 and sum(counts) == 123 and max(counts) <= tiny_bert.max_length
    assert counts == tiny_bert.token_counts(texts)


def test_chunked_post_reads_an_answer_sent_before_the_whole_body():
    listener = socket.create_server(("127.0.0.1", 0))

    def refuse_after_a_little() -> None:
        connection, _ = listener.accept()
        with connection:
            connection.recv(65536)
            connection.sendall(b"HTTP/1.1 413 Content Too Large\r\ncontent-length: 4\r\nconnection: close\r\n\r\nbig!")

    thread = threading.Thread(target=refuse_after_a_little)
    thread.start()
    result = chunked_post("127.0.0.1", listener.getsockname()[1], "/", Body(total_bytes=64 * 2**20, chunk=2**16),
                          headers={}, timeout=20)
    thread.join()
    listener.close()
    assert result.status == 413 and result.outcome == "answered_early" and result.message == "big!"
    assert result.sent_mib < 64


@pytest.mark.slow
def test_the_driver_runs_on_tiny_sizes_and_records_its_provenance(tmp_path):
    model = tiny_bert_folder(tmp_path / "tiny")
    over_server_limit = Limits(dim=1).max_request_bytes // MIB + 1  # the server's limit, plus a MiB
    # corpus_texts: a few hundred tokens of requests need few texts (the whole corpus took 3 s to tokenize)
    sizes = replace(QUICK, upload_mib=over_server_limit, cap_s=20.0, inputs=8, token_cap=200, issue_tokens=400,
                    corpus_texts=64)
    files = run_hardening(HardeningRun(out_dir=tmp_path / "out", model=str(model), label="test", sizes=sizes,
                                       command=["privlm", "bench", "hardening"], log=lambda _: None,
                                       fresh_services=False, denoiser="none"))
    assert [f.name for f in files] == ["results.json", "results.md"]
    payload = json.loads(files[0].read_text())
    meta, f3, f7 = payload["metadata"], payload["finding_3"], payload["finding_7"]
    assert meta["label"] == "test" and meta["source"]["git_commit"] == git_commit()
    assert meta["source"]["privlm_imported_from"].endswith("privlm/__init__.py")
    assert f3["server_upload"]["status"] == 413  # over the limit (early or not: the last MiB may be in flight)
    for case in [f3["server_upload"], *f3["gateway_uploads"]]:  # every case got an answer, memory was sampled
        assert isinstance(case["status"], int) and case["rss"]["peak_mib"] >= case["rss"]["baseline_mib"] > 0
    assert f7["small_alone"]["answered_200"] == sizes.alone_tries
    big = f7["max_size_legal"]
    assert big["status"] == 200 and big["tokens"] == 199 and big["embeddings"] == 8
    assert big["other_caller"]["sent"] == len(big["other_caller"]["latencies_s"])
    assert f7["issue_shape"]["tokens"] == 400 and f7["small_request_bound"]["bound_s"] > 0
    assert "| server /v1/snd/encode |" in files[1].read_text()
