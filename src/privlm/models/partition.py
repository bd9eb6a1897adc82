"""A model cut at any depth: a bottom part (the customer's) and a top part (the vendor's).

    k = 0:  bottom = word-embedding rows X = E[ids]                      (the embedding layer)
            top    = position/type embeddings + all N blocks + pooling (+ head)
    k >= 1: bottom = full embeddings + blocks 1..k, output H_k (B, L, d)
            top    = blocks k+1..N + pooling (+ head)

so top(bottom(ids)) is the whole model's pooled output. Both parts are independent modules (deep copies):
the bottom holds none of the top's weights, and the vendor exports only the bottom, as safetensors plus a
config whose ``fingerprint`` (sha256 of the bottom's weights) the top records, so a mismatched pair is refused.

Families: BERT-like encoders (``encoder.layer`` blocks, bidirectional mask) are supported. A family is an
:class:`Anatomy` in :data:`ANATOMIES`: where its embeddings and blocks live, how its embeddings turn word rows
into the first hidden states (``embed``), and how a run of its blocks is called (``run_blocks``: a causal mask
for decoders, and for Llama the rotary position embeddings, computed once and passed to every block). What GPT-2
and Llama need besides: :func:`split_model` takes the word table from inside the embeddings module, and theirs
sits beside it (``wte``/``wpe``; ``embed_tokens`` with no embeddings module), so the cut of the embeddings has to
become a hook of the family too.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt
from safetensors.torch import load_file, save_file
from transformers import PretrainedConfig, PreTrainedModel
from transformers.masking_utils import create_bidirectional_mask

from privlm.models.fingerprints import weights_sha256
from privlm.models.loading import model_family
from privlm.models.pooling import POOLERS, Pooling, choose_pooling
from privlm.validation import check_float_tensor, validated

BOTTOM_WEIGHTS = "bottom.safetensors"
BOTTOM_CONFIG = "bottom.json"
BOTTOM_FORMAT: Literal["privlm-sap-bottom/1"] = "privlm-sap-bottom/1"
EmbedFn = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
BlocksFn = Callable[[torch.nn.ModuleList, PretrainedConfig, torch.Tensor, torch.Tensor], torch.Tensor]


def _run_bidirectional(layers: torch.nn.ModuleList, config: PretrainedConfig, hidden: torch.Tensor,
                       attention_mask: torch.Tensor) -> torch.Tensor:
    """Encoder blocks, each called as ``block(hidden, mask)`` with one bidirectional mask for all."""
    mask = create_bidirectional_mask(config=config, inputs_embeds=hidden, attention_mask=attention_mask)
    for block in layers:
        hidden = block(hidden, mask)
    return hidden


def _embed(embeddings: torch.nn.Module, words: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The family's embeddings applied to word rows, with the positions the whole model would give the ids.

    RoBERTa-style embeddings number positions from ``padding_idx + 1`` and skip pads; given only embeddings they
    would count from the first column, which differs under left padding. The mask says where the pads are.
    """
    if not hasattr(embeddings, "create_position_ids_from_input_ids"):
        return embeddings(inputs_embeds=words)  # BERT: absolute positions 0..L-1 whatever the padding
    present = attention_mask.to(torch.long)
    padding_idx = int(embeddings.padding_idx)  # type: ignore[arg-type]  # an int attribute of the HF module
    positions = present.cumsum(dim=1) * present + padding_idx
    return embeddings(inputs_embeds=words, position_ids=positions)


@dataclass(frozen=True)
class Anatomy:
    """One family: where it keeps its parts (attribute paths from ``model.base_model``), how its embeddings
    turn word rows into hidden states, and how a run of its blocks is called."""

    embeddings: str
    word_embeddings: str
    blocks: str
    embed: EmbedFn = _embed
    run_blocks: BlocksFn = _run_bidirectional


ANATOMIES: dict[str, Anatomy] = {
    kind: Anatomy("embeddings", "embeddings.word_embeddings", "encoder.layer")
    for kind in ("bert", "roberta", "xlm-roberta", "camembert", "electra")
}


def _anatomy(config: PretrainedConfig) -> Anatomy:
    if config.model_type not in ANATOMIES:
        raise ValueError(f"splitting a {config.model_type!r} model at a block is not supported yet; supported: "
                         f"{', '.join(sorted(ANATOMIES))}")
    width = getattr(config, "embedding_size", config.hidden_size)
    if width != config.hidden_size:  # ELECTRA-small: a projection outside the embeddings, not modelled here
        raise ValueError(f"splitting a {config.model_type!r} model whose embedding size ({width}) differs from its "
                         f"hidden size ({config.hidden_size}) is not supported yet")
    return ANATOMIES[config.model_type]


def _get(module: torch.nn.Module, path: str) -> Any:
    for name in path.split("."):
        module = getattr(module, name)
    return module


class BottomConfig(BaseModel):
    """What the customer needs to rebuild and check the bottom: the model config and the split depth. The
    transformers config is ``model_config`` in the file (a name pydantic reserves for itself)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, serialize_by_alias=True)

    model_name: str
    model_type: str
    blocks: NonNegativeInt
    total_blocks: PositiveInt
    hidden_size: PositiveInt
    vocab_size: PositiveInt
    transformers_config: dict[str, Any] = Field(alias="model_config")
    fingerprint: str = ""  # sha256 of the bottom's weights
    format: Literal["privlm-sap-bottom/1"] = BOTTOM_FORMAT


class _Blocks(torch.nn.Module):
    """A run of transformer blocks, called as the family calls them."""

    def __init__(self, blocks: torch.nn.ModuleList, config: PretrainedConfig, anatomy: Anatomy) -> None:
        super().__init__()
        self.layer = blocks
        self._config = config
        self._run = anatomy.run_blocks

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self._run(self.layer, self._config, hidden, attention_mask)


class BottomModel(torch.nn.Module):
    """The customer's part: token ids -> the representation at the cut (B, L, d)."""

    def __init__(self, config: BottomConfig, word_embeddings: torch.nn.Embedding,
                 embeddings: torch.nn.Module | None, blocks: _Blocks | None) -> None:
        super().__init__()
        self.config = config
        self.word_embeddings = word_embeddings
        self.embeddings = embeddings  # k >= 1: full embeddings (it owns word_embeddings too)
        self.blocks = blocks
        self._embed = ANATOMIES[config.model_type].embed

    @property
    def depth(self) -> int:
        return self.config.blocks

    @property
    def vocabulary(self) -> torch.Tensor:
        """The word-embedding table (|V|, d): what the embedding privatizer projects onto."""
        return self.word_embeddings.weight

    def embed_words(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.word_embeddings(input_ids)

    def forward_from_words(self, word_embeddings: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The bottom applied to word-embedding rows (or any relaxation of them, for inversion attacks)."""
        if self.embeddings is None or self.blocks is None:
            return word_embeddings
        hidden = self._embed(self.embeddings, word_embeddings, attention_mask)
        return self.blocks(hidden, attention_mask)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.forward_from_words(self.embed_words(input_ids), attention_mask)

    def save(self, directory: str | Path) -> Path:
        """``bottom.safetensors`` + ``bottom.json`` (with the weights' fingerprint); returns the directory."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {name: tensor.detach().cpu().contiguous() for name, tensor in self.state_dict().items()}
        if self.embeddings is not None:  # the table is stored once, under embeddings.word_embeddings
            state.pop("word_embeddings.weight", None)
        save_file(state, str(directory / BOTTOM_WEIGHTS))
        (directory / BOTTOM_CONFIG).write_text(json.dumps(self.config.model_dump(), indent=1, sort_keys=True))
        return directory


class TopModel(torch.nn.Module):
    """The vendor's part: the representation at the cut -> pooled representation h (B, d), or logits with a head."""

    def __init__(self, *, blocks: _Blocks, embeddings: torch.nn.Module | None, pooling: Pooling,
                 bottom_fingerprint: str, depth: int, hidden_size: int, head: torch.nn.Linear | None,
                 embed: EmbedFn = _embed) -> None:
        super().__init__()
        self._embed = embed
        self.embeddings = embeddings  # k = 0: position/type embeddings and LayerNorm (no word table)
        self.blocks = blocks
        self.pooling = pooling
        self.head = head
        self.bottom_fingerprint = bottom_fingerprint
        self.depth = depth
        self.hidden_size = hidden_size

    def represent(self, cut: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The pooled representation h (B, d) of the cut-layer input (B, L, d)."""
        check_float_tensor("cut", cut, ndim=3)
        if cut.shape[-1] != self.hidden_size:
            raise ValueError(f"the cut representation has dimension {cut.shape[-1]}, the top expects "
                             f"{self.hidden_size}")
        hidden = cut if self.embeddings is None else self._embed(self.embeddings, cut, attention_mask)
        hidden = self.blocks(hidden, attention_mask)
        return POOLERS[self.pooling](hidden, attention_mask)

    def forward(self, cut: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Logits (B, classes) with a head, else the pooled representation (B, d)."""
        pooled = self.represent(cut, attention_mask)
        return pooled if self.head is None else self.head(pooled)


def make_head(hidden_size: int, n_classes: int, *, seed: int = 0) -> torch.nn.Linear:
    """The task head: a linear layer d -> classes, initialised from ``seed`` (never the global RNG)."""
    if isinstance(n_classes, bool) or not isinstance(n_classes, int) or n_classes < 2:
        raise ValueError(f"n_classes must be an integer of at least 2, got {n_classes!r}")
    head = torch.nn.utils.skip_init(torch.nn.Linear, hidden_size, n_classes)  # no default init: no global RNG
    generator = torch.Generator().manual_seed(seed)
    bound = 1 / hidden_size**0.5
    with torch.no_grad():
        head.weight.uniform_(-bound, bound, generator=generator)
        head.bias.zero_()
    return head


def split_model(model: PreTrainedModel, blocks: int, *, pooling: Pooling | None = None,
                n_classes: int | None = None, head_seed: int = 0, name: str | None = None
                ) -> tuple[BottomModel, TopModel]:
    """Cut ``model`` after its embeddings and ``blocks`` transformer blocks (0 <= blocks < N).

    ``pooling`` defaults to the family's; ``n_classes`` adds a linear task head to the top.
    """
    base = model.base_model
    config: PretrainedConfig = model.config
    anatomy = _anatomy(config)
    layers = _get(base, anatomy.blocks)
    total = len(layers)
    if isinstance(blocks, bool) or not isinstance(blocks, int) or not 0 <= blocks < total:
        raise ValueError(f"blocks must be an integer in [0, {total - 1}] (the model has {total} blocks and the "
                         f"top needs at least one), got {blocks!r}")
    pooling = choose_pooling(model_family(config), pooling)
    embeddings = _get(base, anatomy.embeddings)
    word = _get(base, anatomy.word_embeddings)
    # Deep copies: the two parts share no tensor with each other or with ``model``.
    if blocks == 0:
        bottom_word, bottom_embeddings, bottom_blocks = copy.deepcopy(word), None, None
        top_embeddings = copy.deepcopy(embeddings, memo={id(word): None})  # no word table at the vendor's top
    else:
        bottom_embeddings = copy.deepcopy(embeddings)
        bottom_word = _get(bottom_embeddings, anatomy.word_embeddings.split(".", 1)[1])
        bottom_blocks = _Blocks(copy.deepcopy(torch.nn.ModuleList(layers[:blocks])), config, anatomy)
        top_embeddings = None
    bottom_config = BottomConfig(model_name=name or str(config.name_or_path or config.model_type),
                                 model_type=config.model_type, blocks=blocks, total_blocks=total,
                                 hidden_size=config.hidden_size, vocab_size=config.vocab_size,
                                 model_config=config.to_dict())
    bottom = BottomModel(bottom_config, bottom_word, bottom_embeddings, bottom_blocks).eval()
    bottom.config = bottom_config.model_copy(update={"fingerprint": weights_sha256(bottom)})
    top_blocks = _Blocks(copy.deepcopy(torch.nn.ModuleList(layers[blocks:])), config, anatomy)
    head = None
    if n_classes is not None:  # on the model's device and dtype, so the top runs where the model does
        head = make_head(config.hidden_size, n_classes, seed=head_seed).to(device=word.weight.device,
                                                                          dtype=word.weight.dtype)
    top = TopModel(blocks=top_blocks, embeddings=top_embeddings, pooling=pooling,
                   bottom_fingerprint=bottom.config.fingerprint, depth=blocks, hidden_size=config.hidden_size,
                   head=head, embed=anatomy.embed).eval()
    return bottom, top


def load_bottom(directory: str | Path, *, expected_fingerprint: str | None = None) -> BottomModel:
    """Rebuild the customer's bottom from ``bottom.safetensors`` + ``bottom.json``; check its fingerprint."""
    from transformers import AutoConfig, AutoModel

    directory = Path(directory)
    raw = json.loads((directory / BOTTOM_CONFIG).read_text())
    if not isinstance(raw, dict) or raw.get("format") != BOTTOM_FORMAT:
        found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise ValueError(f"{directory / BOTTOM_CONFIG} is not a privlm bottom model (format {found!r})")
    config = validated(BottomConfig, raw, refusal=f"{directory / BOTTOM_CONFIG} is not a valid bottom config")
    model_config = AutoConfig.for_model(config.model_type, **{
        k: v for k, v in config.transformers_config.items() if k not in ("model_type", "transformers_version")})
    with torch.random.fork_rng(devices=[]):  # the shell's random init must not move the caller's global RNG
        shell = AutoModel.from_config(model_config)
    bottom, _ = split_model(shell, config.blocks, name=config.model_name)
    state = load_file(str(directory / BOTTOM_WEIGHTS))
    if config.blocks > 0 and "embeddings.word_embeddings.weight" in state:
        state["word_embeddings.weight"] = state["embeddings.word_embeddings.weight"]
    try:
        missing, unexpected = bottom.load_state_dict(state, strict=False)
    except RuntimeError as error:  # a tensor of the wrong shape
        raise ValueError(f"{directory / BOTTOM_WEIGHTS} does not match a {config.blocks}-block bottom: "
                         f"{error}") from None
    if missing or unexpected:
        raise ValueError(f"{directory / BOTTOM_WEIGHTS} does not match a {config.blocks}-block bottom: "
                         f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    fingerprint = weights_sha256(bottom)
    if fingerprint != config.fingerprint:
        raise ValueError(f"the bottom's weights hash to {fingerprint[:12]}…, its config says "
                         f"{config.fingerprint[:12]}…: the files are corrupt or mismatched")
    if expected_fingerprint is not None and fingerprint != expected_fingerprint:
        raise ValueError(f"this bottom ({fingerprint[:12]}…) is not the one the vendor's top was split from "
                         f"({expected_fingerprint[:12]}…)")
    bottom.config = config
    return bottom.eval()
