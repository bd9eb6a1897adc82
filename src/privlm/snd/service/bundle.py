"""What an SnD client downloads once: tokenizer files, the word-embedding rows, the model facts and
the denoisers, in a generic :class:`privlm.service.Bundle` (sha256 per file)."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath

import torch
from safetensors.torch import load_file
from safetensors.torch import save as save_safetensors
from transformers import AutoTokenizer

from privlm.models import SplitModel, TokenEmbedder
from privlm.service import Bundle, ServerError, check_file_name, public_config, public_model_name
from privlm.snd.artefacts import WEIGHTS_FILE
from privlm.snd.card import CARD_FILE, read_card

BUNDLE_FORMAT = "privlm-snd-bundle/1"
BUNDLE_PATH = "/v1/snd/bundle"


def model_facts(model: SplitModel) -> dict[str, object]:
    """What a client learns of the model: no filesystem paths; ``fingerprint`` covers the embedding rows
    (the client checks it), ``weights_fingerprint`` every weight (each encode answer must carry it)."""
    return {"name": public_model_name(str(model.name)), "fingerprint": model.fingerprint,
            "weights_fingerprint": model.weights_fingerprint, "dim": model.hidden_size,
            "vocab_size": model.vocab_size, "max_length": model.max_length, "normalize": model.normalize,
            "pooling": model.pooling, "clip_norm": model.max_embedding_norm, "config": public_config(model.config_dict)}


def is_snd_bundle_file(name: str) -> bool:
    """Whether an SnD bundle may hold ``name``: ``model.json``, ``embeddings.safetensors``,
    ``tokenizer/<file>``, ``denoisers/<name>/denoiser.safetensors`` (``WEIGHTS_FILE``) and
    ``denoisers/<name>/denoiser.json`` (``CARD_FILE``), each part a plain name
    (:func:`privlm.service.check_file_name`). Server and client both use it."""
    try:
        parts = PurePosixPath(check_file_name(name)).parts
    except ServerError:
        return False
    return (parts in (("model.json",), ("embeddings.safetensors",))
            or (len(parts) == 2 and parts[0] == "tokenizer")
            or (len(parts) == 3 and parts[0] == "denoisers" and parts[2] in (WEIGHTS_FILE, CARD_FILE)))


def snd_bundle(model: SplitModel, denoiser_dirs: Sequence[Path]) -> Bundle:
    """The bundle a server offers for ``model`` and the given denoiser folders; every file name passes
    :func:`is_snd_bundle_file`, the set a client accepts."""
    facts = model_facts(model)
    denoisers: list[dict[str, object]] = []
    bundle = Bundle(format=BUNDLE_FORMAT, facts={"model": facts, "denoisers": denoisers})

    def add(name: str, content: bytes) -> None:
        if not is_snd_bundle_file(name):
            raise ValueError(f"{name!r} is not a file an SnD bundle may hold (clients would refuse the bundle)")
        bundle.add(name, content)

    add("model.json", json.dumps(facts, sort_keys=True, default=str).encode())
    add("embeddings.safetensors", save_safetensors({"embeddings": model.embedding_matrix.float().cpu().contiguous()}))
    with tempfile.TemporaryDirectory() as folder:
        model.require_tokenizer().save_pretrained(folder)
        for path in sorted(Path(folder).iterdir()):
            add(f"tokenizer/{path.name}", path.read_bytes())
    for directory in denoiser_dirs:
        card = read_card(directory)
        name = check_file_name(Path(directory).name)
        add(f"denoisers/{name}/{WEIGHTS_FILE}", (Path(directory) / WEIGHTS_FILE).read_bytes())
        add(f"denoisers/{name}/{CARD_FILE}", (Path(directory) / CARD_FILE).read_bytes())
        denoisers.append({"name": name, "eta_range": list(card.eta_range), "variant": card.config.variant,
                          "fingerprint": card.base_model.fingerprint})
    return bundle


def bundle_embedder(folder: Path, *, device: str | torch.device = "auto") -> TokenEmbedder:
    """The client half from a downloaded bundle, checked against the fingerprint it advertises."""
    facts = json.loads((folder / "model.json").read_text())
    embedder = TokenEmbedder(AutoTokenizer.from_pretrained(folder / "tokenizer"),
                             load_file(str(folder / "embeddings.safetensors"))["embeddings"],
                             config=facts["config"], max_length=facts["max_length"], normalize=facts["normalize"],
                             name=facts["name"], device=device)
    if embedder.fingerprint != facts["fingerprint"]:
        raise ServerError("the bundle's embedding rows do not match the model fingerprint it advertises")
    return embedder


def choose_denoiser(manifest: Mapping[str, object], folder: Path, eta: float, denoiser: str | None) -> Path | None:
    """``auto``: the SnD denoiser whose eta range holds eta (else the first, with a warning at load)."""
    if denoiser is None:
        return None
    offered = manifest.get("denoisers")
    if not isinstance(offered, list) or not all(isinstance(d, dict) for d in offered):
        raise ServerError("the bundle manifest's denoiser list is malformed")
    names = [check_file_name(d.get("name")) for d in offered]
    if denoiser != "auto":
        if denoiser not in names:
            raise ValueError(f"server offers denoisers {names}, not {denoiser!r}")
        return folder / "denoisers" / denoiser
    snd = [d for d in offered if d.get("variant") == "snd"]
    if not snd:
        raise ValueError("the server offers no SnD denoiser; pass denoiser=None to use e_n as it comes")
    for offer in snd:
        bounds = offer.get("eta_range")
        if not (isinstance(bounds, list) and len(bounds) == 2 and all(isinstance(b, int | float) for b in bounds)):
            raise ServerError("the bundle manifest gives a denoiser without a numeric eta_range [low, high]")
    fitting = [d for d in snd if d["eta_range"][0] <= eta <= d["eta_range"][1]]
    return folder / "denoisers" / check_file_name((fitting or snd)[0]["name"])
