"""``privlm bench serve``: throughput, latency and fault tolerance of ``privlm serve`` on localhost.

The server runs in its own process; clients are asyncio tasks in this one. Each request carries a
pre-privatized batch (the client's work is not timed here: this measures the server).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import torch

from privlm.eval.data import named_task, split_dataset
from privlm.eval.provenance import provenance
from privlm.models import SplitModel
from privlm.serve.process import free_port, start_privlm, stop
from privlm.serve.wire import encode_request
from privlm.snd import Client
from privlm.snd.privatizer import SnDPrivatizer

SENTENCES_PER_REQUEST = 8
REQUESTS_PER_CLIENT = 24


def start_server(port: int, model: str) -> subprocess.Popen[bytes]:
    return start_privlm(["serve", "--model", model, "--port", str(port)], f"http://127.0.0.1:{port}/health")


def _payloads(model: SplitModel, texts: list[str]) -> list[tuple[bytes, dict[str, str]]]:
    privatizer = SnDPrivatizer(model, eta=50.0)
    out = []
    for start in range(0, len(texts), SENTENCES_PER_REQUEST):
        private = privatizer.privatize(texts[start:start + SENTENCES_PER_REQUEST])
        out.append(encode_request(private.noisy, private.attention_mask))
    return out


async def _load(url: str, payloads: list[tuple[bytes, dict[str, str]]], clients: int) -> dict[str, float]:
    latencies: list[float] = []

    async def client(index: int, http: httpx.AsyncClient) -> None:
        for k in range(REQUESTS_PER_CLIENT):
            body, headers = payloads[(index * REQUESTS_PER_CLIENT + k) % len(payloads)]
            started = time.perf_counter()
            response = await http.post("/v1/snd/encode", content=body, headers=headers)
            response.raise_for_status()
            latencies.append(time.perf_counter() - started)

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        await client(0, http)  # warm-up
        latencies.clear()
        started = time.perf_counter()
        await asyncio.gather(*(client(i, http) for i in range(clients)))
        wall = time.perf_counter() - started
    sentences = clients * REQUESTS_PER_CLIENT * SENTENCES_PER_REQUEST
    return {"clients": clients, "sentences_per_s": sentences / wall, "p50_ms": 1e3 * statistics.median(latencies),
            "p99_ms": 1e3 * float(np.percentile(latencies, 99)), "requests": len(latencies)}


@torch.inference_mode()
def plain_forward_throughput(model: SplitModel, texts: list[str], *, batch_size: int = 64) -> float:
    """Sentences/s of the model's own forward on the same sentences, in this process."""
    batches = [model.tokenize(texts[i:i + batch_size]) for i in range(0, len(texts), batch_size)]
    model.encode(model.embed_tokens(batches[0].input_ids), batches[0].attention_mask)  # warm-up
    started = time.perf_counter()
    for batch in batches:
        model.encode(model.embed_tokens(batch.input_ids), batch.attention_mask)
    return len(texts) / (time.perf_counter() - started)


def restart_check(model_name: str, model: SplitModel, texts: list[str], port: int,
                  server: subprocess.Popen[bytes]) -> dict[str, object]:
    """Restart the server mid-run: every embedding must come back once, in order."""
    client = Client(f"http://127.0.0.1:{port}", eta=1e6, denoiser=None, retries=40, backoff=0.25, batch_size=8)
    results: dict[str, object] = {}

    def restart() -> None:
        time.sleep(0.5)
        server.terminate()
        server.wait(timeout=30)
        results["server"] = start_server(port, model_name)

    import threading

    thread = threading.Thread(target=restart)
    thread.start()
    got = client.encode(texts)
    thread.join()
    clean = model.encode_texts(texts).numpy()
    cosine = (got * clean).sum(1)
    nearest = (got @ clean.T).argmax(1)
    results |= {"texts": len(texts), "returned": len(got), "in_order": bool((nearest == np.arange(len(texts))).all()),
                "min_cosine_to_own_clean_embedding": float(cosine.min()),
                "server_calls": client.last_report.server_calls,
                "failed_attempts_retried": client.retrying.failed_attempts}
    client.close()
    return results


def write_serve_report(out_dir: Path, *, model: str = "minilm", seed: int = 0) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    split_model = SplitModel.from_pretrained(model, device="cpu")
    texts = list(split_dataset(named_task("tweets-binary"), seed=seed).test.texts[:512])
    payloads = _payloads(split_model, texts)
    port = free_port()
    server = start_server(port, model)
    try:
        load = [asyncio.run(_load(f"http://127.0.0.1:{port}", payloads, clients)) for clients in (1, 8, 32)]
        plain = plain_forward_throughput(split_model, texts)
        restart = restart_check(model, split_model, texts[:400], port, server)
        server = restart.pop("server", server)  # type: ignore[assignment]
    finally:
        stop(server)
    for row in load:
        row["fraction_of_plain_forward"] = row["sentences_per_s"] / plain
    payload = {"metadata": provenance(seed=seed), "plain_forward_sentences_per_s": plain, "load": load,
               "restart": restart, "sentences_per_request": SENTENCES_PER_REQUEST}
    (out_dir / "serve.json").write_text(json.dumps(payload, indent=2) + "\n")
    lines = ["# `privlm serve` under load (localhost)", "", f"- command: `{payload['metadata']['command']}`",
             f"- git commit: `{payload['metadata']['git_commit']}`", f"- machine: {payload['metadata']['machine']}",
             f"- {SENTENCES_PER_REQUEST} sentences per request, {REQUESTS_PER_CLIENT} requests per client, "
             "tweets from the test split, fp32 safetensors payloads; server and clients share the machine", "",
             f"Plain forward of the same model in one process: {plain:.1f} sentences/s", "",
             "| clients | sentences/s | fraction of plain forward | p50 ms | p99 ms |", "|---|---|---|---|---|"]
    lines += [f"| {r['clients']} | {r['sentences_per_s']:.1f} | {r['fraction_of_plain_forward']:.2f} | "
              f"{r['p50_ms']:.1f} | {r['p99_ms']:.1f} |" for r in load]
    lines += ["", f"Restart mid-run: {restart}"]
    (out_dir / "serve.md").write_text("\n".join(lines) + "\n")
    return [out_dir / "serve.json", out_dir / "serve.md"]
