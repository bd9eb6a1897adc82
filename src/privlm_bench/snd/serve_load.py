"""``privlm bench serve``: throughput, latency and fault tolerance of ``privlm serve`` and ``privlm gateway``
on localhost.

The server and the gateway run in their own processes; clients are asyncio tasks in this one.
  - server alone: each request carries a pre-privatized batch (the client's work is not timed);
  - gateway: each request is an ``openai`` client's ``embeddings.create`` call, so the gateway does the
    client's work (tokenize, privatize, denoise) and the server round trip;
  - restart: the server is killed and restarted under a running ``Client.encode``.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import numpy as np
import torch

from privlm.models import SplitModel
from privlm.provenance import provenance
from privlm.service.process import free_port, start_privlm, stop
from privlm.snd import Client, ClientOptions, SnDPrivatizer
from privlm.wire import write_sequences
from privlm_bench.data import named_task, split_dataset

SENTENCES_PER_REQUEST = 8
REQUESTS_PER_CLIENT = 24
CLIENT_COUNTS = (1, 8, 32)
GATEWAY_ETA = 50.0
Payload = tuple[bytes, dict[str, str]]


def start_server(port: int, model: str) -> subprocess.Popen[bytes]:
    return start_privlm(["serve", "--model", model, "--port", str(port)], f"http://127.0.0.1:{port}/health")


def start_gateway(port: int, server_port: int) -> subprocess.Popen[bytes]:
    return start_privlm(["gateway", "--server", f"http://127.0.0.1:{server_port}", "--eta", f"{GATEWAY_ETA:g}",
                         "--port", str(port)], f"http://127.0.0.1:{port}/health")


def _payloads(model: SplitModel, texts: list[str]) -> list[Payload]:
    privatizer = SnDPrivatizer(model, eta=GATEWAY_ETA)
    out = []
    for start in range(0, len(texts), SENTENCES_PER_REQUEST):
        private = privatizer.privatize(texts[start:start + SENTENCES_PER_REQUEST])
        out.append(write_sequences(private.noisy, private.attention_mask))
    return out


async def _measure(send: Callable[[int, int], Awaitable[None]], clients: int, requests: int) -> dict[str, float]:
    """``clients`` concurrent loops of ``requests`` sequential calls ``send(client, k)``, after one warm-up loop."""
    latencies: list[float] = []

    async def client(index: int) -> None:
        for k in range(requests):
            started = time.perf_counter()
            await send(index, k)
            latencies.append(time.perf_counter() - started)

    await client(0)
    latencies.clear()
    started = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    wall = time.perf_counter() - started
    return {"clients": clients, "sentences_per_s": clients * requests * SENTENCES_PER_REQUEST / wall,
            "p50_ms": 1e3 * statistics.median(latencies), "p99_ms": 1e3 * float(np.percentile(latencies, 99)),
            "requests": len(latencies)}


async def _load_server(url: str, payloads: list[Payload], clients: int, requests: int) -> dict[str, float]:
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        async def send(index: int, k: int) -> None:
            body, headers = payloads[(index * requests + k) % len(payloads)]
            (await http.post("/v1/snd/encode", content=body, headers=headers)).raise_for_status()
        return await _measure(send, clients, requests)


async def _load_gateway(url: str, texts: list[str], clients: int, requests: int, *,
                        on_response: Callable[[httpx.Response], Awaitable[None]] | None = None) -> dict[str, float]:
    """``clients`` independent ``openai.AsyncOpenAI`` clients, each with its own connection pool; ``on_response``:
    called with every answer's head (its headers)."""
    try:
        import openai
    except ImportError as error:
        raise RuntimeError("the gateway benchmark drives it with the openai client: pip install openai") from error
    hooks = {"response": [on_response]} if on_response is not None else None
    sdks = [openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="local", max_retries=0, timeout=600,
                               http_client=None if hooks is None else openai.DefaultAsyncHttpxClient(event_hooks=hooks))
            for _ in range(clients)]

    model_id = (await sdks[0].models.list()).data[0].id  # the gateway names its one model

    async def send(index: int, k: int) -> None:
        start = ((index * requests + k) * SENTENCES_PER_REQUEST) % (len(texts) - SENTENCES_PER_REQUEST)
        batch = texts[start:start + SENTENCES_PER_REQUEST]
        response = await sdks[index].embeddings.create(model=model_id, input=batch)
        if len(response.data) != SENTENCES_PER_REQUEST:
            raise RuntimeError(f"the gateway answered {len(response.data)} embeddings for {SENTENCES_PER_REQUEST}")

    try:
        return await _measure(send, clients, requests)
    finally:
        for sdk in sdks:
            await sdk.close()


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
                  server: subprocess.Popen[bytes]) -> tuple[dict[str, object], subprocess.Popen[bytes]]:
    """Restart the server mid-run: every embedding must come back once, in order. Returns the new server too."""
    client = Client(f"http://127.0.0.1:{port}", eta=1e6, denoiser=None,
                    options=ClientOptions(retry_for=60, backoff=0.25, batch_size=8))
    restarted: list[subprocess.Popen[bytes]] = []

    def restart() -> None:
        time.sleep(0.5)
        server.terminate()
        server.wait(timeout=30)
        restarted.append(start_server(port, model_name))

    thread = threading.Thread(target=restart)
    thread.start()
    encoded = client.encode_with_report(texts)
    thread.join()
    got, clean = encoded.vectors, model.encode_texts(texts).numpy()
    nearest = (got @ clean.T).argmax(1)
    results: dict[str, object] = {
        "texts": len(texts), "returned": len(got), "in_order": bool((nearest == np.arange(len(texts))).all()),
        "min_cosine_to_own_clean_embedding": float((got * clean).sum(1).min()),
        "server_calls": encoded.report.server_calls, "failed_attempts_retried": client.retry.failed_attempts}
    client.close()
    return results, restarted[0]


def write_serve_report(out_dir: Path, *, model: str = "minilm", seed: int = 0,
                       requests_per_client: int = REQUESTS_PER_CLIENT) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    split_model = SplitModel.from_pretrained(model, device="cpu")
    texts = list(split_dataset(named_task("tweets-binary"), seed=seed).test.texts[:512])
    payloads = _payloads(split_model, texts)
    port, gateway_port = free_port(), free_port()
    server = start_server(port, model)
    gateway = None
    try:
        load = [asyncio.run(_load_server(f"http://127.0.0.1:{port}", payloads, n, requests_per_client))
                for n in CLIENT_COUNTS]
        gateway = start_gateway(gateway_port, port)
        via_gateway = [asyncio.run(_load_gateway(f"http://127.0.0.1:{gateway_port}", texts, n, requests_per_client))
                       for n in CLIENT_COUNTS]
        stop(gateway)
        gateway = None
        plain = plain_forward_throughput(split_model, texts)
        restart, server = restart_check(model, split_model, texts[:400], port, server)
    finally:
        stop(server, *([gateway] if gateway else []))
    for row in load:
        row["fraction_of_plain_forward"] = row["sentences_per_s"] / plain
    at = {int(r["clients"]): r["sentences_per_s"] for r in via_gateway}
    server_at = {int(r["clients"]): r["sentences_per_s"] for r in load}
    gateway_ratios = {"8_clients_over_1_client": at[8] / at[1],
                      "8_clients_over_server_alone_at_8": at[8] / server_at[8]}
    meta = provenance(seed=seed)
    payload = {"metadata": meta, "plain_forward_sentences_per_s": plain, "load": load,
               "gateway": via_gateway, "gateway_ratios": gateway_ratios, "gateway_eta": GATEWAY_ETA,
               "restart": restart, "sentences_per_request": SENTENCES_PER_REQUEST,
               "requests_per_client": requests_per_client}
    (out_dir / "serve.json").write_text(json.dumps(payload, indent=2) + "\n")
    (out_dir / "serve.md").write_text(_markdown(meta, requests_per_client, plain, load, via_gateway, gateway_ratios,
                                                restart))
    return [out_dir / "serve.json", out_dir / "serve.md"]


def _markdown(meta: dict[str, object], requests_per_client: int, plain: float, load: list[dict[str, float]],
              via_gateway: list[dict[str, float]], ratios: dict[str, float], restart: dict[str, object]) -> str:
    table = ["| clients | sentences/s | p50 ms | p99 ms |", "|---|---|---|---|"]
    lines = ["# `privlm serve` and `privlm gateway` under load (localhost)", "", f"- command: `{meta['command']}`",
             f"- git commit: `{meta['git_commit']}`", f"- machine: {meta['machine']}",
             f"- {SENTENCES_PER_REQUEST} sentences per request, {requests_per_client} requests per client, "
             "tweets from the test split; server, gateway and clients share the machine", "",
             "## Server alone (fp32 safetensors payloads, privatized beforehand)", "",
             f"Plain forward of the same model in one process: {plain:.1f} sentences/s", "",
             "| clients | sentences/s | fraction of plain forward | p50 ms | p99 ms |", "|---|---|---|---|---|"]
    lines += [f"| {r['clients']} | {r['sentences_per_s']:.1f} | {r['fraction_of_plain_forward']:.2f} | "
              f"{r['p50_ms']:.1f} | {r['p99_ms']:.1f} |" for r in load]
    lines += ["", f"## Through the gateway (`openai` clients, eta = {GATEWAY_ETA:g}, shipped denoiser)", "", *table]
    lines += [f"| {r['clients']} | {r['sentences_per_s']:.1f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} |"
              for r in via_gateway]
    lines += ["", f"Gateway at 8 clients: {ratios['8_clients_over_1_client']:.2f} x its 1-client throughput, "
                  f"{ratios['8_clients_over_server_alone_at_8']:.2f} x the server alone at 8 clients.",
              "", f"Restart mid-run: {restart}"]
    return "\n".join(lines) + "\n"
