"""What SnD costs the client: time, bytes on the wire, peak memory (``privlm bench snd --cost``).

Peak memory is measured in fresh subprocesses (``python -m privlm_bench.snd.cost client|full``) that
load only what each side needs: the client loads the tokenizer, the word-embedding rows and the
denoiser; "full" loads the whole model to run it locally. Each reports its peak resident set.
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import torch

from privlm.models import SplitModel, TokenEmbedder
from privlm.snd.artefacts import default_denoiser_dir, load_denoiser
from privlm.snd.privatizer import SnDPrivatizer

DTYPE_BYTES = {"fp32": 4, "fp16": 2}


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def wire_bytes(token_counts: Sequence[int], dim: int) -> dict[str, float]:
    """Mean bytes per sentence: upload = n tokens x d values + an n-byte mask; download = d values."""
    mean_tokens = sum(token_counts) / len(token_counts)
    out: dict[str, float] = {"mean_tokens": mean_tokens}
    for name, size in DTYPE_BYTES.items():
        out[f"upload_bytes_{name}"] = mean_tokens * (dim * size + 1)
        out[f"download_bytes_{name}"] = dim * size
    return out


@torch.inference_mode()
def client_timing(model: SplitModel, texts: Sequence[str], *, eta: float, denoiser: str, batch_size: int = 32,
                  repeats: int = 3) -> dict[str, float]:
    """Seconds per sentence: client privatize, client denoise, server encode, and a full local forward."""
    net, card = load_denoiser(default_denoiser_dir(model.name) if denoiser == "default" else denoiser, model=model)
    privatizer = SnDPrivatizer(model, eta=eta, clip=card.training.clip)
    batches = [list(texts[i:i + batch_size]) for i in range(0, len(texts), batch_size)]
    private = [privatizer.privatize(b) for b in batches]
    server_out = [model.encode(p.noisy, p.attention_mask) for p in private]

    def denoise_all() -> None:
        for p, e_n in zip(private, server_out, strict=True):
            eta_rows = torch.full((len(e_n),), eta, device=e_n.device)
            net(e_n, p.noisy, p.noise, p.attention_mask, eta_rows)

    n = len(texts)
    timings = {
        "client_privatize_s": _median_seconds(lambda: [privatizer.privatize(b) for b in batches], repeats) / n,
        "client_denoise_s": _median_seconds(denoise_all, repeats) / n,
        "server_encode_s": _median_seconds(lambda: [model.encode(p.noisy, p.attention_mask) for p in private],
                                           repeats) / n,
        "local_full_forward_s": _median_seconds(lambda: model.encode_texts(list(texts), batch_size=batch_size),
                                                repeats) / n,
    }
    timings["client_total_s"] = timings["client_privatize_s"] + timings["client_denoise_s"]
    timings["client_vs_local_forward"] = timings["client_total_s"] / timings["local_full_forward_s"]
    return timings


def peak_memory_mb(role: str, *, model: str, denoiser: str, texts: Sequence[str], eta: float) -> float:
    """Peak RSS (MiB) of a fresh process doing only ``role``'s work on ``texts``."""
    payload = json.dumps({"role": role, "model": model, "denoiser": denoiser, "texts": list(texts), "eta": eta})
    result = subprocess.run([sys.executable, "-m", "privlm_bench.snd.cost"], input=payload, capture_output=True,
                            text=True, check=True, timeout=600)
    return float(json.loads(result.stdout.strip().splitlines()[-1])["peak_mb"])


def _run_role(role: str, model: str, denoiser: str, texts: list[str], eta: float) -> None:
    with torch.inference_mode():
        if role == "client":
            client = TokenEmbedder.from_pretrained(model, device="cpu")
            net, _ = load_denoiser(default_denoiser_dir(model) if denoiser == "default" else denoiser, model=client)
            private = SnDPrivatizer(client, eta=eta).privatize(texts)
            e_n = torch.zeros(len(texts), client.hidden_size)  # stands in for the server's answer
            net(e_n, private.noisy, private.noise, private.attention_mask, torch.full((len(texts),), eta))
        elif role == "full":
            SplitModel.from_pretrained(model, device="cpu").encode_texts(texts)
        elif role != "baseline":
            raise ValueError(f"role must be client, full or baseline, got {role!r}")
    print(json.dumps({"peak_mb": _peak_rss_mb()}))


def _peak_rss_mb() -> float:
    """This process's peak RSS. Linux: VmHWM, which restarts at exec (ru_maxrss would include the
    parent's pages from before the fork)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


if __name__ == "__main__":
    request = json.loads(sys.stdin.read())
    _run_role(request["role"], request["model"], request["denoiser"], request["texts"], request["eta"])
