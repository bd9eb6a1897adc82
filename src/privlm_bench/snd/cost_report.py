"""``privlm bench snd --cost``: the client's time, bytes and memory, with provenance."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from privlm.models import SplitModel
from privlm.provenance import provenance
from privlm_bench.data import named_task, split_dataset
from privlm_bench.snd.cost import client_timing, peak_memory_mb, wire_bytes

N_SENTENCES = 256
ETA = 50.0


def write_cost_report(out_dir: Path, *, model: str = "minilm", seed: int = 0, device: str = "auto",
                      denoiser: str = "default") -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    split_model = SplitModel.from_pretrained(model, device=device)
    test = split_dataset(named_task("tweets-binary"), seed=seed).test
    texts = list(test.subset(np.arange(N_SENTENCES)).texts)
    figures: dict[str, float] = {"sentences": len(texts), "eta": ETA, "batch_size": 32}
    figures |= client_timing(split_model, texts, eta=ETA, denoiser=denoiser)
    figures |= wire_bytes(split_model.token_counts(texts), split_model.hidden_size)
    for role in ("baseline", "client", "full"):
        figures[f"peak_rss_mb_{role}"] = peak_memory_mb(role, model=model, denoiser=denoiser, texts=texts[:32],
                                                        eta=ETA)
    meta = provenance(seed=seed)
    (out_dir / "cost.json").write_text(json.dumps({"metadata": meta, "figures": figures}, indent=2) + "\n")
    f = figures
    lines = [
        "# SnD client cost", "", f"- command: `{meta['command']}`",
        f"- git commit: `{meta['git_commit']}`", f"- machine: {meta['machine']}",
        f"- {f['sentences']} test tweets, batch 32, eta = {ETA:g}, median of 3 runs", "",
        "| quantity | value |", "|---|---|",
        f"| client privatize (tokenize + embed + noise + clip), ms/sentence | {1e3 * f['client_privatize_s']:.3f} |",
        f"| client denoise, ms/sentence | {1e3 * f['client_denoise_s']:.3f} |",
        f"| client total, ms/sentence | {1e3 * f['client_total_s']:.3f} |",
        f"| server encode (for reference), ms/sentence | {1e3 * f['server_encode_s']:.3f} |",
        f"| full local forward of the model, ms/sentence | {1e3 * f['local_full_forward_s']:.3f} |",
        f"| client / full local forward | {f['client_vs_local_forward']:.2f} |",
        f"| mean tokens per sentence | {f['mean_tokens']:.1f} |",
        f"| upload bytes/sentence, fp32 / fp16 | {f['upload_bytes_fp32']:.0f} / {f['upload_bytes_fp16']:.0f} |",
        f"| download bytes/sentence, fp32 / fp16 | {f['download_bytes_fp32']:.0f} / {f['download_bytes_fp16']:.0f} |",
        f"| peak RSS, python + torch only (MiB) | {f['peak_rss_mb_baseline']:.0f} |",
        f"| peak RSS, SnD client: tokenizer + embeddings + denoiser (MiB) | {f['peak_rss_mb_client']:.0f} |",
        f"| peak RSS, full local model (MiB) | {f['peak_rss_mb_full']:.0f} |",
    ]
    (out_dir / "cost.md").write_text("\n".join(lines) + "\n")
    return [out_dir / "cost.json", out_dir / "cost.md"]
