"""What a client downloads once: tokenizer files, the word-embedding rows, the model facts, the
denoisers. Every file is addressed by its sha256, so the client can verify and cache it."""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import save as save_safetensors

from privlm.models import SplitModel
from privlm.snd.artefacts import CARD_FILE, WEIGHTS_FILE, read_card


@dataclass(frozen=True)
class BundleFile:
    name: str
    content: bytes

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.content).hexdigest()


def model_facts(model: SplitModel) -> dict[str, object]:
    return {"name": model.name, "fingerprint": model.fingerprint, "dim": model.hidden_size,
            "vocab_size": model.vocab_size, "max_length": model.max_length, "normalize": model.normalize,
            "pooling": model.pooling, "clip_norm": model.max_embedding_norm, "config": model.config_dict}


def build_bundle(model: SplitModel, denoiser_dirs: Sequence[Path]) -> tuple[dict[str, object], dict[str, BundleFile]]:
    """The manifest (JSON) and the files it lists, by name."""
    files: dict[str, BundleFile] = {}

    def add(name: str, content: bytes) -> None:
        files[name] = BundleFile(name, content)

    add("model.json", json.dumps(model_facts(model), sort_keys=True, default=str).encode())
    add("embeddings.safetensors", save_safetensors({"embeddings": model.embedding_matrix.float().cpu().contiguous()}))
    with tempfile.TemporaryDirectory() as folder:
        model.tokenizer.save_pretrained(folder)
        for path in sorted(Path(folder).iterdir()):
            add(f"tokenizer/{path.name}", path.read_bytes())
    denoisers = []
    for directory in denoiser_dirs:
        card = read_card(directory)
        name = Path(directory).name
        add(f"denoisers/{name}/{WEIGHTS_FILE}", (Path(directory) / WEIGHTS_FILE).read_bytes())
        add(f"denoisers/{name}/{CARD_FILE}", (Path(directory) / CARD_FILE).read_bytes())
        denoisers.append({"name": name, "eta_range": card["eta_range"], "variant": card["config"]["variant"],
                          "fingerprint": card["base_model"]["fingerprint"]})
    manifest = {"format": "privlm-snd-bundle/1", "model": model_facts(model), "denoisers": denoisers,
                "files": [{"name": f.name, "sha256": f.sha256, "size": len(f.content),
                           "url": f"/v1/snd/bundle/files/{f.name}"} for f in files.values()]}
    return manifest, files
