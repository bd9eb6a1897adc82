"""What an SnD client downloads once: tokenizer files, the word-embedding rows, the model facts and
the denoisers, in a generic :class:`privlm.service.Bundle` (sha256 per file). Its manifest is typed here
(:class:`SnDManifest`): the server writes it through these models, the client validates it on read."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, PositiveFloat, PositiveInt, StringConstraints
from safetensors.torch import load_file
from safetensors.torch import save as save_safetensors
from transformers import AutoTokenizer

from privlm.models import SplitModel, TokenEmbedder
from privlm.models.pooling import Pooling
from privlm.service import Bundle, ServerError, check_file_name, public_config, public_model_name
from privlm.snd.artefacts import WEIGHTS_FILE
from privlm.snd.card import CARD_FILE, read_card
from privlm.snd.denoiser import Variant

BUNDLE_FORMAT = "privlm-snd-bundle/1"
BUNDLE_PATH = "/v1/snd/bundle"
Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelFacts(_Strict):
    """What a client learns of the model: no filesystem paths; ``fingerprint`` covers the embedding rows
    (the client checks it), ``weights_fingerprint`` every weight (each encode answer must carry it)."""

    name: str
    fingerprint: Sha256
    weights_fingerprint: Sha256
    dim: PositiveInt
    vocab_size: PositiveInt
    max_length: PositiveInt
    normalize: bool
    pooling: Pooling
    clip_norm: PositiveFloat
    config: dict[str, Any]


class DenoiserOffer(_Strict):
    name: str  # a plain file name, checked where it becomes a path (choose_denoiser)
    eta_range: tuple[float, float]
    variant: Variant
    fingerprint: str  # of the base model it was trained for


class SnDManifest(_Strict):
    """What ``GET /v1/snd/bundle`` answers; a client reads it with :func:`privlm.service.sdk.fetch_bundle`."""

    format: Literal["privlm-snd-bundle/1"]
    model: ModelFacts
    denoisers: list[DenoiserOffer]
    files: list[dict[str, Any]]  # names, sizes and sha256, checked by privlm.service.download_bundle


def model_facts(model: SplitModel) -> ModelFacts:
    return ModelFacts(name=public_model_name(str(model.name)), fingerprint=model.fingerprint,
                      weights_fingerprint=model.weights_fingerprint, dim=model.hidden_size,
                      vocab_size=model.vocab_size, max_length=model.max_length, normalize=model.normalize,
                      pooling=model.pooling, clip_norm=model.max_embedding_norm,
                      config=public_config(model.config_dict))


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
    :func:`is_snd_bundle_file`, the set a client accepts, and the manifest is an :class:`SnDManifest`."""
    facts = model_facts(model)
    offers: list[DenoiserOffer] = []
    bundle = Bundle(format=BUNDLE_FORMAT)

    def add(name: str, content: bytes) -> None:
        if not is_snd_bundle_file(name):
            raise ValueError(f"{name!r} is not a file an SnD bundle may hold (clients would refuse the bundle)")
        bundle.add(name, content)

    add("model.json", facts.model_dump_json().encode())
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
        offers.append(DenoiserOffer(name=name, eta_range=card.eta_range, variant=card.config.variant,
                                    fingerprint=card.base_model.fingerprint))
    bundle.facts = {"model": facts.model_dump(mode="json"), "denoisers": [o.model_dump(mode="json") for o in offers]}
    SnDManifest.model_validate(bundle.manifest())  # the server offers only what a client reads
    return bundle


def bundle_embedder(folder: Path, *, device: str | torch.device = "auto") -> TokenEmbedder:
    """The client half from a downloaded bundle, checked against the fingerprint it advertises."""
    facts = ModelFacts.model_validate_json((folder / "model.json").read_text())
    embedder = TokenEmbedder(AutoTokenizer.from_pretrained(folder / "tokenizer"),
                             load_file(str(folder / "embeddings.safetensors"))["embeddings"],
                             config=facts.config, max_length=facts.max_length, normalize=facts.normalize,
                             name=facts.name, device=device)
    if embedder.fingerprint != facts.fingerprint:
        raise ServerError("the bundle's embedding rows do not match the model fingerprint it advertises")
    return embedder


def choose_denoiser(manifest: SnDManifest, folder: Path, eta: float, denoiser: str | None) -> Path | None:
    """``auto``: the SnD denoiser whose eta range holds eta (else the first, with a warning at load)."""
    if denoiser is None:
        return None
    names = [check_file_name(offer.name) for offer in manifest.denoisers]
    if denoiser != "auto":
        if denoiser not in names:
            raise ValueError(f"server offers denoisers {names}, not {denoiser!r}")
        return folder / "denoisers" / denoiser
    snd = [offer for offer in manifest.denoisers if offer.variant == "snd"]
    if not snd:
        raise ValueError("the server offers no SnD denoiser; pass denoiser=None to use e_n as it comes")
    fitting = [offer for offer in snd if offer.eta_range[0] <= eta <= offer.eta_range[1]]
    return folder / "denoisers" / (fitting or snd)[0].name
