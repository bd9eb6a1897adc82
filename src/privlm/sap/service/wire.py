"""What the SAP vendor's server and its client exchange besides SAP messages: the routes, the media type, and the
JSON bodies as pydantic models, strict on read (no unknown field, numbers within bounds) on both sides."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from privlm.sap.config import HeadPlacement, LoraSettings, SapConfig

SESSIONS_PATH = "/v1/sap/sessions"
BOTTOMS_PATH = "/v1/sap/bottoms"
SAP_MESSAGE = "application/vnd.privlm.sap+safetensors"  # a SAP message: safetensors with its fields in the metadata
MULTIPLEX_HEADER = "serve_multiplexed_model_id"  # Ray Serve routes by it: the session id, to its replica
STEPS_DONE_HEADER = "x-privlm-steps-done"  # on every answer to an exchange, with the last checkpoint's step
CHECKPOINT_STEP_HEADER = "x-privlm-checkpoint-step"
BUNDLE_FORMAT = "privlm-sap-bottom-bundle/1"
SESSION_ID_PATTERN = r"^sap-[0-9a-f]{32}$"
_SHA256 = r"^[0-9a-f]{64}$"
_STRICT = ConfigDict(extra="forbid", strict=True)
_LORA, _CONFIG = LoraSettings(), SapConfig()  # the defaults a request leaves out


def bundle_path(blocks: int) -> str:
    return f"{BOTTOMS_PATH}/{blocks}"


class LoraRequest(BaseModel):
    """LoRA settings a customer may ask for."""

    model_config = _STRICT
    rank: int = Field(default=_LORA.rank, ge=1, le=256)
    alpha: int = Field(default=_LORA.alpha, ge=1, le=4096)
    dropout: float = Field(default=_LORA.dropout, ge=0.0, lt=1.0)
    target_modules: list[Annotated[str, StringConstraints(min_length=1, max_length=64)]] = Field(
        default_factory=lambda: list(_LORA.target_modules), min_length=1, max_length=16)


class SessionRequest(BaseModel):
    """What a customer asks for when it opens a fine-tuning session."""

    model_config = _STRICT
    blocks: int = Field(default=0, ge=0, description="Transformer blocks in the customer's bottom (the split "
                        "position).")
    n_classes: int = Field(ge=2, le=1024, description="The task's label count.")
    head: HeadPlacement = Field(description="Where the task head sits. 'vendor' (the paper's) means the returned "
                                "gradients reveal every label.")
    trainable_bottom: bool = False
    lora: LoraRequest = LoraRequest()
    learning_rate: float = Field(default=_CONFIG.learning_rate, gt=0.0, le=1.0)
    seed: int = Field(default=_CONFIG.seed, ge=0, le=2**63 - 1)
    bottom_fingerprint: str = Field(pattern=_SHA256, description="sha256 of the bottom the customer downloaded "
                                    "(bottom.json's fingerprint): a mismatched pair is refused.")

    @classmethod
    def for_config(cls, config: SapConfig, *, n_classes: int, bottom_fingerprint: str) -> SessionRequest:
        lora = config.lora
        return cls(blocks=config.blocks, n_classes=n_classes, head=config.head,
                   trainable_bottom=config.trainable_bottom, learning_rate=config.learning_rate, seed=config.seed,
                   bottom_fingerprint=bottom_fingerprint,
                   lora=LoraRequest(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                                    target_modules=list(lora.target_modules)))

    def lora_settings(self) -> LoraSettings:
        return LoraSettings(rank=self.lora.rank, alpha=self.lora.alpha, dropout=self.lora.dropout,
                            target_modules=tuple(self.lora.target_modules))


class SessionInfo(BaseModel):
    """A session's state as its owner sees it: the answer to opening, reading, checkpointing and selecting."""

    model_config = _STRICT
    id: str = Field(pattern=SESSION_ID_PATTERN)
    blocks: int = Field(ge=0)
    n_classes: int = Field(ge=2, le=1024)
    head: HeadPlacement
    trainable_bottom: bool
    steps_done: int = Field(ge=0)
    checkpoint_step: int = Field(ge=0)
    uploaded_examples: int = Field(ge=0)


class CheckpointRequest(BaseModel):
    model_config = _STRICT
    keep: bool = False


class SelectRequest(BaseModel):
    model_config = _STRICT
    step: int = Field(ge=0, le=2**62)


class BottomFacts(BaseModel):
    """What the bottom bundle's manifest says of the bottom, besides its files."""

    model_config = _STRICT
    blocks: int = Field(ge=0, le=4096)
    total_blocks: int = Field(ge=0, le=4096)
    fingerprint: str = Field(pattern=_SHA256, description="The bottom's weights fingerprint (bottom.json's).")
    model: str = Field(min_length=1, max_length=256)
    hidden_size: int = Field(ge=1, le=2**20)
    vocab_size: int = Field(ge=1, le=2**24)


class BundleEntry(BaseModel):
    model_config = _STRICT
    name: str = Field(min_length=1, max_length=512)
    sha256: str = Field(pattern=_SHA256)
    size: int = Field(ge=0)


class BottomManifest(BottomFacts):
    """``GET /v1/sap/bottoms/<blocks>``: the facts, and every file with its sha256 and size."""

    format: str = Field(pattern=f"^{re.escape(BUNDLE_FORMAT)}$")
    files: list[BundleEntry] = Field(min_length=1, max_length=256)
