"""Before and after: the load of `privlm bench serve`, run against an older privlm and this one, interleaved.

    git worktree add /tmp/privlm-old 51ff2a9        # the commit before the gateway served requests concurrently
    python benchmarks/serve/compare_gateways.py --old-src /tmp/privlm-old/src --out benchmarks/serve/before-after.json

Each round starts a fresh server and gateway from each code base in turn (the older code through
PYTHONPATH) and measures the server alone and the gateway with `openai` clients, with the same code
(`privlm_bench.snd.serve_load`) driving both. Requests the gateway refuses are counted, not timed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

import openai

from privlm.models import SplitModel
from privlm.provenance import provenance
from privlm.service.process import free_port, stop
from privlm_bench.data import named_task, split_dataset
from privlm_bench.snd import serve_load


async def gateway_load(url: str, texts: list[str], clients: int, requests: int) -> dict[str, float]:
    sdks = [openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600) for _ in range(clients)]
    refused = 0

    async def send(index: int, k: int) -> None:
        nonlocal refused
        size = serve_load.SENTENCES_PER_REQUEST
        start = ((index * requests + k) * size) % (len(texts) - size)
        try:
            await sdks[index].embeddings.create(model="privlm-snd", input=texts[start:start + size])
        except openai.APIStatusError:
            refused += 1

    row = await serve_load._measure(send, clients, requests)
    for sdk in sdks:
        await sdk.close()
    done = clients * requests - refused
    return row | {"refused": refused, "sentences_per_s": row["sentences_per_s"] * done / (clients * requests)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old-src", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=12)
    options = parser.parse_args()
    model = SplitModel.from_pretrained("minilm", device="cpu")
    texts = list(split_dataset(named_task("tweets-binary"), seed=0).test.texts[:512])
    payloads = serve_load._payloads(model, texts)
    rows = []
    for round_ in range(options.rounds):
        for code in ("old", "new"):
            os.environ.pop("PYTHONPATH", None)
            if code == "old":
                os.environ["PYTHONPATH"] = str(options.old_src)
            port, gateway_port = free_port(), free_port()
            server = serve_load.start_server(port, "minilm")
            gateway = serve_load.start_gateway(gateway_port, port)
            try:
                for clients in serve_load.CLIENT_COUNTS:
                    alone = asyncio.run(serve_load._load_server(f"http://127.0.0.1:{port}", payloads, clients,
                                                                options.requests))
                    via = asyncio.run(gateway_load(f"http://127.0.0.1:{gateway_port}", texts, clients,
                                                   options.requests))
                    rows.append({"round": round_, "code": code, "clients": clients,
                                 "server_sentences_per_s": alone["sentences_per_s"],
                                 "gateway_sentences_per_s": via["sentences_per_s"], "gateway_p50_ms": via["p50_ms"],
                                 "gateway_p99_ms": via["p99_ms"], "gateway_refused": via["refused"]})
                    print(rows[-1], flush=True)
            finally:
                stop(gateway, server)
    command = ["python", "benchmarks/serve/compare_gateways.py", *sys.argv[1:]]
    payload = {"metadata": provenance(seed=0, command=command) | {
                   "old_src": str(options.old_src), "requests_per_client": options.requests,
                   "sentences_per_request": serve_load.SENTENCES_PER_REQUEST},
               "rows": rows}
    options.out.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
