"""Loading Hugging Face models offline, by family."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    T5EncoderModel,
)

from privlm.models.pooling import Pooling
from privlm.models.sources import (
    ModelSource,
    gguf_cache_path,
    publish_directory,
    resolve_source,
    staging_directory,
)

log = logging.getLogger(__name__)

ENCODER_TYPES = frozenset({"bert", "roberta", "distilbert", "xlm-roberta", "camembert", "mpnet", "electra"})
DECODER_TYPES = frozenset({"gpt2", "llama", "mistral", "qwen2", "qwen3"})
T5_TYPES = frozenset({"t5", "mt5", "umt5"})


def model_family(config: PretrainedConfig) -> str:
    """``encoder`` (BERT-like), ``decoder`` (GPT-2, Llama) or ``t5`` (its encoder only)."""
    kind = config.model_type
    if kind in ENCODER_TYPES:
        return "encoder"
    if kind in DECODER_TYPES:
        return "decoder"
    if kind in T5_TYPES:
        return "t5"
    supported = sorted(ENCODER_TYPES | DECODER_TYPES | T5_TYPES)
    raise ValueError(f"model type {kind!r} is not supported; supported types: {', '.join(supported)}")


@dataclass(frozen=True)
class SentenceTransformerConfig:
    """What a sentence-transformers folder says about pooling, normalisation and length."""

    pooling: Pooling
    normalize: bool
    max_seq_length: int | None


def read_sentence_transformer_config(path: Path) -> SentenceTransformerConfig | None:
    """Parse ``modules.json`` and the pooling config, or None if ``path`` is a plain HF folder."""
    modules_file = path / "modules.json"
    if not modules_file.exists():
        return None
    modules = json.loads(modules_file.read_text())
    types = {m["type"].rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
    pooling: Pooling = "cls"
    if "Pooling" in types:
        config = json.loads((path / types["Pooling"] / "config.json").read_text())
        known: tuple[tuple[str, Pooling], ...] = (
            ("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "cls"), ("pooling_mode_lasttoken", "last"))
        modes = [mode for key, mode in known if config.get(key)]
        others = [k for k, v in config.items() if k.startswith("pooling_mode") and v and k not in (
            "pooling_mode_mean_tokens", "pooling_mode_cls_token", "pooling_mode_lasttoken")]
        if len(modes) != 1 or others:
            raise ValueError(f"unsupported sentence-transformers pooling in {path}: {config}")
        pooling = modes[0]
    max_seq_length = None
    bert_config = path / "sentence_bert_config.json"
    if bert_config.exists():
        max_seq_length = json.loads(bert_config.read_text()).get("max_seq_length")
    return SentenceTransformerConfig(pooling=pooling, normalize="Normalize" in types,
                                     max_seq_length=max_seq_length)


def materialise_gguf(source: ModelSource) -> Path:
    """De-quantize a GGUF model once into a safetensors folder in privlm's cache; return that folder."""
    target = gguf_cache_path(source)
    if (target / "config.json").exists():
        return target
    from safetensors.torch import save_model

    log.info("converting %s to safetensors in %s (once)", source.gguf_file, target)
    model = AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file, local_files_only=True)
    build = staging_directory(target)
    save_model(model, str(build / "model.safetensors"))  # handles the tied embedding/head weights
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the copy is plain fp32 weights
    config.save_pretrained(build)
    tokenizer.save_pretrained(build)
    publish_directory(build, target)
    return target


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    family: str
    source: ModelSource
    path: Path
    sentence_transformer: SentenceTransformerConfig | None


def load_pretrained(name_or_path: str | Path, *, device: torch.device, dtype: torch.dtype = torch.float32,
                    causal_lm_head: bool = True) -> LoadedModel:
    """Load model and tokenizer for ``name_or_path`` from local files only.

    Decoders keep their LM head (``causal_lm_head``) because Cape needs the logits.
    """
    source = resolve_source(name_or_path)
    path = materialise_gguf(source) if source.gguf_file else source.path
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    family = model_family(config)
    model_class: type[T5EncoderModel | AutoModelForCausalLM | AutoModel]
    if family == "t5":
        model_class = T5EncoderModel
    elif family == "decoder" and causal_lm_head:
        model_class = AutoModelForCausalLM
    else:
        model_class = AutoModel
    model: PreTrainedModel = model_class.from_pretrained(path, local_files_only=True, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    torch.nn.Module.to(model, device).eval()  # Module.to: transformers' own override confuses type checkers
    return LoadedModel(model=model, tokenizer=tokenizer, family=family, source=source, path=path,
                       sentence_transformer=read_sentence_transformer_config(path))
