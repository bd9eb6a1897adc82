"""`privlm bench chat`'s measurement code, on the stub upstream served in this process (no timing assertions)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest
from fastapi import Request
from starlette.responses import Response
from typer.testing import CliRunner

from privlm.provenance import provenance
from privlm_bench.chat.load import (
    FLOOR_BATCH,
    PROMPTS,
    STUB_ANSWER,
    ChatBenchSetting,
    Floors,
    LoadResult,
    Timing,
    added,
    chat_markdown,
    chat_results,
    comparisons,
    create_stub_upstream,
    gateway_args,
    measure_floor,
    measure_upstream,
    prompt_order,
    requests_per_second,
    run_load,
    sse_content,
    stub_pieces,
    summarize,
    throughput,
    write_chat_report,
)
from tests.service.localhost import serving
from tests.support.chat import fake_privacy


def test_summarize_gives_the_percentiles_of_known_latencies_in_ms():
    figures = summarize([i / 1000 for i in range(100, 0, -1)])  # 1 ms .. 100 ms, in any order
    assert figures["n"] == 100
    assert figures["p50_ms"] == pytest.approx(50.5)  # halfway between the 50th and 51st
    assert figures["p99_ms"] == pytest.approx(99.01)  # 99 + 0.01 * (100 - 99), linear interpolation
    assert figures["mean_ms"] == pytest.approx(50.5)
    one = summarize([0.25])
    assert one["p50_ms"] == one["p99_ms"] == pytest.approx(250.0)
    with pytest.raises(ValueError, match="seconds"):
        summarize([])


def test_throughput_is_answered_requests_over_the_wall_time():
    assert requests_per_second(40, 2.0) == pytest.approx(20.0)
    result = LoadResult(clients=4, requests_per_client=3, wall_s=0.5,
                        timings=[Timing(0.1, 0.05, 7), Timing(0.2, 0.07, 9)] + [Timing(0.3)] * 8,
                        errors=["RuntimeError: HTTP 503: busy", "RuntimeError: HTTP 503: busy"])
    row = result.row(upstream="stub", path="gateway", mode="streaming")
    assert row["answered"] == 10 and row["errors"] == 2 and row["first_error"].endswith("busy")
    assert row["requests_per_s"] == pytest.approx(20.0)  # the failures count for nothing
    assert row["ttft"]["n"] == 2 and row["ttft"]["p50_ms"] == pytest.approx(60.0)
    assert row["latency"]["n"] == 10 and row["mean_tokens_perturbed"] == pytest.approx(8.0)
    with pytest.raises(ValueError, match="wall_s"):
        requests_per_second(1, 0.0)


def test_the_gateway_is_compared_with_the_direct_row_at_the_same_load():
    def row(path, p50, p99, rps, mode="non-streaming", clients=1):
        figures = {"p50_ms": p50, "p99_ms": p99}
        return {"upstream": "stub", "path": path, "mode": mode, "clients": clients, "requests_per_s": rps,
                "latency": figures, "ttft": figures if mode == "streaming" else None}

    one = added(row("direct", 2.0, 5.0, 400.0), row("gateway", 52.0, 80.0, 20.0))
    assert one["added_latency_p50_ms"] == pytest.approx(50.0) and one["added_latency_p99_ms"] == pytest.approx(75.0)
    assert one["added_ttft_p50_ms"] is None and one["throughput_fraction"] == pytest.approx(0.05)
    rows = [row("direct", 1.0, 2.0, 10.0, "streaming", 8), row("gateway", 4.0, 9.0, 5.0, "streaming", 8),
            row("direct", 1.0, 2.0, 10.0, clients=32)]  # no gateway row: no comparison
    [streaming] = comparisons(rows)
    assert streaming["clients"] == 8 and streaming["added_ttft_p99_ms"] == pytest.approx(7.0)


def test_the_throughput_is_set_against_the_floor_at_8_clients():
    def row(path, clients, rps, p50):
        figures = {"p50_ms": p50, "p99_ms": 2 * p50}
        return {"upstream": "stub", "path": path, "mode": "non-streaming", "clients": clients, "requests_per_s": rps,
                "latency": figures, "ttft": None}

    rows = [row("direct", 1, 500.0, 2.0), row("gateway", 1, 6.0, 150.0), row("gateway-int8", 1, 8.0, 110.0),
            row("direct", 8, 600.0, 10.0), row("gateway", 8, 9.0, 900.0), row("gateway-int8", 8, 12.0, 650.0)]
    floors = {"gateway": {"requests_per_s": 10.0, "single_requests_per_s": 6.5},
              "gateway-int8": {"requests_per_s": 16.0, "single_requests_per_s": 9.0}}
    fp32, int8 = throughput(rows, floors)
    assert fp32["path"] == "gateway" and fp32["requests_per_s"] == {"1": 6.0, "8": 9.0}
    assert fp32["ratio_to_floor"] == pytest.approx(0.9) and int8["ratio_to_floor"] == pytest.approx(0.75)
    assert fp32["added_latency_ms"]["8"] == {"p50": pytest.approx(890.0), "p99": pytest.approx(1780.0)}
    assert throughput(rows, floors, upstream="serve-llm") == []
    [one] = throughput([r for r in rows if r["clients"] == 1], {"gateway": floors["gateway"]})
    assert one["ratio_to_floor"] is None  # no row at 8 clients


def test_the_floor_times_batches_of_one_prompt_requests_through_the_privacy_step():
    floor = measure_floor(fake_privacy(), PROMPTS, batch=4, batches=3)
    assert len(floor["batch_s"]) == 3 and len(floor["single_s"]) == 4
    assert floor["requests_per_s"] == pytest.approx(4 / floor["median_batch_s"])
    assert floor["single_requests_per_s"] == pytest.approx(1 / floor["median_single_s"])

    def broken(*_: object) -> object:
        raise RuntimeError("gone")

    with pytest.raises(RuntimeError, match="the floor's privacy step failed"):
        measure_floor(fake_privacy(broken), PROMPTS, batch=2, batches=1)
    floors = Floors({"gateway": fake_privacy()}, list(PROMPTS), batches=2)
    floors.measure("at the start", log=lambda _: None)
    floors.measure("later", log=lambda _: None)
    [(path, pooled)] = floors.figures().items()
    assert path == "gateway" and pooled["measured"] == ["at the start", "later"]
    assert len(pooled["batch_s"]) == 4 and len(pooled["single_s"]) == 2 * FLOOR_BATCH


def test_the_int8_gateway_is_the_same_gateway_with_its_device_model_int8():
    fp32 = gateway_args(1, "http://up", epsilon=6.0, logit_bound=Path("b.json"), max_in_flight=64)
    int8 = gateway_args(1, "http://up", epsilon=6.0, logit_bound=Path("b.json"), max_in_flight=64, int8=True)
    assert int8[:len(fp32)] == fp32 and int8[len(fp32):] == ["--device-model-int8", "--device", "cpu"]
    assert fp32[fp32.index("--chat-memory") + 1] == "off"  # every request perturbed afresh


def test_sse_lines_give_their_content():
    chunk = {"choices": [{"index": 0, "delta": {"content": "Hi"}}]}
    assert sse_content(f"data: {json.dumps(chunk)}") == "Hi"
    assert sse_content('data: {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}') == ""
    assert sse_content("data: [DONE]") is None and sse_content("") is None and sse_content(": ping") is None


def test_the_stub_streams_its_answer_in_the_asked_number_of_pieces():
    pieces = stub_pieces(16)
    assert len(pieces) == 16 and all(pieces) and "".join(pieces) == STUB_ANSWER
    with pytest.raises(ValueError, match="chunks"):
        stub_pieces(0)
    with serving(create_stub_upstream(chunks=5)) as url:
        body = {"model": "any", "messages": [{"role": "user", "content": "hello"}], "stream": True}
        lines = [line for line in httpx.post(f"{url}/v1/chat/completions", json=body).text.splitlines() if line]
        contents = [sse_content(line) for line in lines if line.startswith("data:")]
        assert [c for c in contents if c] == stub_pieces(5) and lines[-1] == "data: [DONE]"
        whole = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": False}).json()
        assert whole["choices"][0]["message"]["content"] == STUB_ANSWER
        assert httpx.post(f"{url}/v1/chat/completions", json={"model": "any"}).status_code == 400


def test_prompts_are_assigned_by_the_seed():
    assert prompt_order(3, len(PROMPTS)) == prompt_order(3, len(PROMPTS))
    assert sorted(prompt_order(3, len(PROMPTS))) == list(range(len(PROMPTS)))
    assert prompt_order(3, len(PROMPTS)) != prompt_order(4, len(PROMPTS))


def test_a_failed_request_is_recorded_and_the_client_goes_on():
    async def send(http: httpx.AsyncClient, client: int, k: int) -> Timing:
        if k == 1:
            raise RuntimeError("HTTP 503: busy")
        return Timing(0.01)

    with serving(create_stub_upstream()) as url:
        result = asyncio.run(run_load(url, send, clients=3, requests_per_client=4))
    assert len(result.timings) == 9 and result.errors == ["RuntimeError: HTTP 503: busy"] * 3 and result.wall_s > 0


def _stand_in_gateway():
    """The stub with the header a gateway adds: what the measurement reads from a gateway."""
    app = create_stub_upstream()

    @app.middleware("http")
    async def report(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        response = await call_next(request)
        response.headers["x-privlm-tokens-perturbed"] = "3"
        return response

    return app


def test_a_run_on_the_stub_writes_every_figure(tmp_path):
    setting = ChatBenchSetting(requests_per_client=3, clients=(1, 2), warmup_requests=1, stub_chunks=16, seed=5)
    blocks: list[tuple[int, str]] = []
    with serving(create_stub_upstream()) as direct, serving(_stand_in_gateway()) as gateway:
        rows = asyncio.run(measure_upstream("stub", {"direct": direct, "gateway": gateway}, setting,
                                            before=lambda clients, mode: blocks.append((clients, mode))))
    assert len(rows) == 2 * 2 * 2  # clients x modes x paths
    assert blocks == [(1, "non-streaming"), (1, "streaming"), (2, "non-streaming"), (2, "streaming")]
    for row in rows:
        assert row["errors"] == 0 and row["answered"] == row["clients"] * 3 and row["requests_per_s"] > 0
        assert row["latency"]["n"] == row["answered"]
        assert (row["ttft"] is not None) == (row["mode"] == "streaming")
        assert (row["mean_tokens_perturbed"] == 3.0) == (row["path"] == "gateway")
    payload = chat_results(setting, rows, meta=provenance(seed=setting.seed, command=["privlm", "bench", "chat"]),
                           commands={"stub": ["python", "-c", "serve_stub(1, 16)"]})
    files = write_chat_report(tmp_path, payload)
    assert [f.name for f in files] == ["results.json", "results.md"]
    saved = json.loads(files[0].read_text())
    meta = saved["metadata"]
    assert meta["seed"] == 5 and meta["git_commit"] and meta["command"] == "privlm bench chat"
    assert meta["machine"]["cpu_count"] >= 1 and meta["machine"]["torch_threads"] >= 1
    assert saved["setting"]["clients"] == [1, 2] and saved["setting"]["requests_per_client"] == 3
    assert saved["gateway"]["mechanism"] == "cape" and saved["gateway"]["epsilon_per_token"] == 6.0
    assert len(saved["rows"]) == 8 and len(saved["comparisons"]) == 4 and len(saved["prompts"]) == len(PROMPTS)
    assert {"OMP_NUM_THREADS"} <= set(saved["environment"]["thread_variables"])
    markdown = files[1].read_text()
    assert markdown == chat_markdown(saved)
    assert "| stub | streaming | 2 |" in markdown and "| stub | gateway | non-streaming | 1 |" in markdown


def test_the_command_refuses_bad_sizes():
    import privlm_bench.cli.chat  # noqa: F401 - registers the command
    from privlm.cli import app

    runner = CliRunner()
    for args in (["--clients", "1,0"], ["--clients", "a"], ["--requests-per-client", "0"], ["--epsilon", "-1"]):
        result = runner.invoke(app, ["bench", "chat", *args])
        assert result.exit_code == 2, (args, result.output)


def test_the_setting_checks_its_sizes():
    with pytest.raises(ValueError, match="max_tokens"):
        ChatBenchSetting(max_tokens=0)
    with pytest.raises(ValueError, match="clients"):
        ChatBenchSetting(clients=())
    with pytest.raises(ValueError, match="warmup_requests"):
        ChatBenchSetting(warmup_requests=-1)


@pytest.mark.slow
def test_the_logit_bound_is_calibrated_on_smollm2_and_saved_for_the_gateway(smollm2_lm, tmp_path):
    from privlm.cape import LogitBound
    from privlm_bench.chat.load import calibrate_bound

    figures = calibrate_bound(tmp_path / "bound.json")
    bound = LogitBound.load(tmp_path / "bound.json")
    assert bound.value == figures["value"] > 0 and bound.n_texts == figures["n_texts"] > 0
    bound.check_model(smollm2_lm.weights_fingerprint)
