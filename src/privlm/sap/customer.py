"""The customer: keeps its texts, its labels, the bottom model and (optionally) the head; privatizes what it sends.

A frozen bottom privatizes every training example once and uploads it (:meth:`Customer.upload`); a trainable
bottom privatizes each batch as it is used, so every epoch is a new release of every example. Every release is
charged to the ledger, when there is one, before it leaves, and kept in the customer's log of releases
(:attr:`Customer.released`), from which its account is read (:attr:`Customer.account`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from privlm.accounting import Ledger, charge
from privlm.mechanisms import PrivacyUnit, Spend, make_generator
from privlm.models import check_texts
from privlm.models.batching import pad_ids
from privlm.models.partition import BottomModel, make_head
from privlm.sap import messages
from privlm.sap.config import SapConfig
from privlm.sap.cti import CtiReport, contributing_tokens
from privlm.sap.privatizer import EmbeddingPrivatizer, HiddenStatePrivatizer, Privatizer, Release
from privlm.sap.transport import Transport

_Reply = TypeVar("_Reply", messages.TopOutput, messages.CutGradient, messages.StepDone)


@dataclass(frozen=True)
class TokenizedTexts:
    """Token ids per text (special tokens included, cut to max_length) and how many texts were cut."""

    ids: list[list[int]]
    truncated: int

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class ReleaseRecord:
    """One release as the customer's log keeps it (no values): the spend it was charged, and its positions."""

    spend: Spend
    examples: int
    noised: int
    exact: int
    exempt: int

    @classmethod
    def of(cls, release: Release) -> ReleaseRecord:
        return cls(spend=release.spend, examples=int(release.released.any(dim=1).sum()),
                   noised=int(release.noised.sum()), exact=int(release.exact.sum()), exempt=int(release.exempt.sum()))


@dataclass(frozen=True)
class PrivacyAccount:
    """Everything the customer released, read from its log (:attr:`Customer.released`): the spends it was charged
    (eta-tokens, or eta-hidden-states for a deeper bottom), positions by treatment, releases per example."""

    eta_tokens: float = 0.0
    unit: str = PrivacyUnit.ETA_TOKEN.value
    releases: int = 0
    noised_positions: int = 0
    exact_positions: int = 0
    exempt_positions: int = 0

    @classmethod
    def of(cls, released: Sequence[ReleaseRecord]) -> PrivacyAccount:
        units = {record.spend.unit for record in released}
        if len(units) > 1:  # one customer's bottom has one depth: never two metrics in one total
            raise ValueError(f"an account counts one unit, not {sorted(units)}")
        return cls(eta_tokens=sum(record.spend.amount for record in released),
                   unit=next(iter(units), PrivacyUnit.ETA_TOKEN).value,
                   releases=sum(record.examples for record in released),
                   noised_positions=sum(record.noised for record in released),
                   exact_positions=sum(record.exact for record in released),
                   exempt_positions=sum(record.exempt for record in released))

    def to_dict(self) -> dict[str, float | str]:
        return {"eta_tokens": self.eta_tokens, "unit": self.unit, "example_releases": self.releases,
                "noised_positions": self.noised_positions, "exact_positions": self.exact_positions,
                "exempt_positions": self.exempt_positions}


def check_labels(labels: Sequence[int] | np.ndarray, *, n: int, n_classes: int) -> torch.Tensor:
    array = np.asarray(labels)
    if array.ndim != 1 or array.shape[0] != n:
        raise ValueError(f"labels must be one id per text ({n}), got shape {array.shape}")
    if array.dtype.kind not in "iu" or (n and (array.min() < 0 or array.max() >= n_classes)):
        raise ValueError(f"labels must be integer class ids in [0, {n_classes}) (the head has {n_classes} classes)")
    return torch.as_tensor(array, dtype=torch.long)


def check_every_class_present(labels: torch.Tensor, n_classes: int) -> None:
    """Training labels must hold every class: a class with no example is one the head cannot learn."""
    counts = torch.bincount(labels, minlength=n_classes)
    empty = [c for c in range(n_classes) if counts[c] == 0]
    if empty:
        raise ValueError(f"class {empty[0]} has no training examples (of {n_classes} classes): the head cannot learn"
                         " it")


def tokenize_texts(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], max_length: int, *,
                   what: str = "texts") -> TokenizedTexts:
    """Token ids cut to ``max_length`` (special tokens included); the number of texts cut is reported."""
    check_texts(texts)
    if not texts:
        raise ValueError(f"{what} must not be empty")
    full = tokenizer(list(texts), add_special_tokens=True)["input_ids"]
    cut = tokenizer(list(texts), add_special_tokens=True, truncation=True, max_length=max_length)["input_ids"]
    truncated = sum(len(a) != len(b) for a, b in zip(full, cut, strict=True))
    return TokenizedTexts(ids=[list(ids) for ids in cut], truncated=truncated)


def _deep_copy(state: Any) -> Any:
    """A state dict with every tensor cloned (``copy.deepcopy`` would share nothing either, but keeps no grad)."""
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: _deep_copy(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_deep_copy(v) for v in state)
    return state


@dataclass(frozen=True)
class CustomerState:
    """The customer's side of a training step boundary: what :meth:`Customer.load_state` rewinds to."""

    step: int
    head: dict[str, Any] | None
    head_optimizer: dict[str, Any] | None
    bottom: dict[str, Any] | None
    bottom_optimizer: dict[str, Any] | None


class Customer:
    """The customer's party, driving the protocol through ``transport``."""

    def __init__(self, bottom: BottomModel, tokenizer: PreTrainedTokenizerBase, transport: Transport, *,
                 config: SapConfig, n_classes: int, ledger: Ledger | None = None, principal: str = "customer",
                 vendor_fingerprint: str | None = None) -> None:
        if vendor_fingerprint is not None and vendor_fingerprint != bottom.config.fingerprint:
            raise ValueError(f"this bottom ({bottom.config.fingerprint[:12]}…) is not the one the vendor's top was "
                             f"split from ({vendor_fingerprint[:12]}…)")
        if config.blocks != bottom.depth:
            raise ValueError(f"config.blocks is {config.blocks} but the bottom has {bottom.depth} blocks")
        if isinstance(n_classes, bool) or not isinstance(n_classes, int) or n_classes < 2:
            raise ValueError(f"n_classes must be an integer >= 2, got {n_classes!r}")
        self.bottom, self.tokenizer, self.transport, self.config = bottom, tokenizer, transport, config
        self.n_classes, self.ledger, self.principal = n_classes, ledger, principal
        self.device = bottom.vocabulary.device
        self.head = make_head(bottom.config.hidden_size, n_classes, seed=config.seed) if config.head == "customer" \
            else None
        trainable = list(self.head.parameters()) if self.head is not None else []
        self.head_optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate) if trainable else None
        self.bottom.requires_grad_(config.trainable_bottom)
        self.bottom_optimizer = (torch.optim.AdamW(self.bottom.parameters(), lr=config.bottom_learning_rate)
                                 if config.trainable_bottom else None)
        self.generator = make_generator(config.noise_seed, device=self.device)
        self.cti: CtiReport | None = None
        self.privatizer: Privatizer = self._make_privatizer(())
        self.released: list[ReleaseRecord] = []  # every release made and charged, in order: the account's source
        self.step = 0
        # Training-step releases by step, kept only when asked (a remote client that may have to replay steps):
        # a replayed step resends its release unchanged, uncharged, and draws no new noise.
        self.keep_releases = False
        self.sent_releases: dict[int, Release] = {}

    @property
    def account(self) -> PrivacyAccount:
        """What this customer released and was charged so far, from its log of releases."""
        return PrivacyAccount.of(self.released)

    # --- set-up ---------------------------------------------------------------------------------------------
    def _make_privatizer(self, exempt: Sequence[int]) -> Privatizer:
        if self.config.blocks == 0:
            return EmbeddingPrivatizer(self.bottom.vocabulary, eta=self.config.eta, exempt_ids=exempt,
                                       exempt_eta=self.config.exempt_eta,
                                       special_ids=self.tokenizer.all_special_ids)
        return HiddenStatePrivatizer(eta=self.config.eta, clip_norm=self.config.clip_norm)

    def tokenize(self, texts: Sequence[str]) -> TokenizedTexts:
        """Token ids cut to ``config.max_length``; the number cut is reported, never hidden."""
        return tokenize_texts(self.tokenizer, texts, self.config.max_length)

    def identify_contributing_tokens(self, train: TokenizedTexts, labels: torch.Tensor) -> CtiReport | None:
        """CTI on the customer's own training data (when ``config.cti``); the exempt list stays here."""
        if not self.config.cti:
            return None
        special = set(self.tokenizer.all_special_ids)
        self.cti = contributing_tokens([[t for t in ids if t not in special] for ids in train.ids], labels.numpy(),
                                       vocab_size=self.bottom.config.vocab_size, n_classes=self.n_classes,
                                       share=self.config.cti_share, alpha=self.config.cti_alpha, ignore_ids=special)
        self.privatizer = self._make_privatizer(self.cti.exempt_ids)
        return self.cti

    # --- releases -------------------------------------------------------------------------------------------
    def release(self, ids: Sequence[Sequence[int]], example_ids: Sequence[int], *, note: str,
                keep_graph: bool = False, sent: Release | None = None
                ) -> tuple[messages.PrivatizedBatch, torch.Tensor | None, Release]:
        """Run the bottom on ``ids``, charge the release, privatize. With ``keep_graph`` also return the tensor
        whose gradient trains the bottom (straight-through the privatizer). ``sent``: a release of these ids
        already made (and charged): it is resent as it was, with no new noise and no new charge."""
        input_ids, mask = pad_ids(ids, self.tokenizer.pad_token_id or 0, self.device)
        if sent is None:
            charge(self.ledger, self.principal, [self.privatizer.spend_of(input_ids, mask)], note=note)
        with torch.set_grad_enabled(keep_graph):
            cut = self.bottom(input_ids, mask)
        if sent is not None:
            if tuple(sent.values.shape) != tuple(cut.shape):
                raise ValueError("the release to resend does not match these ids")
            release = sent
        else:
            release = self.privatizer.privatize(cut, input_ids, mask, generator=self.generator)
            self.released.append(ReleaseRecord.of(release))
        batch = messages.PrivatizedBatch(example_ids=torch.as_tensor(list(example_ids), dtype=torch.long),
                                         values=release.values.detach().float().cpu(), attention_mask=mask.cpu())
        attached = self.privatizer.straight_through(cut, release) if keep_graph else None
        return batch, attached, release

    def upload(self, train: TokenizedTexts, *, batch_size: int = 256) -> int:
        """A frozen bottom: privatize every training example once and send it; returns how many the vendor holds."""
        if self.config.trainable_bottom:
            raise ValueError("a trainable bottom privatizes per batch; there is nothing to upload")
        stored = 0
        for start in range(0, len(train), batch_size):
            index = list(range(start, min(start + batch_size, len(train))))
            batch, _, _ = self.release([train.ids[i] for i in index], index, note="sap upload")
            reply = self._exchange(messages.Upload(batch=batch, bottom_fingerprint=self.bottom.config.fingerprint))
            if not isinstance(reply, messages.Uploaded):
                raise messages.ProtocolError(f"the vendor answered an upload with {type(reply).__name__}")
            if isinstance(reply.stored, bool) or not isinstance(reply.stored, int) or reply.stored < index[-1] + 1:
                raise messages.ProtocolError(f"the vendor says it holds {reply.stored!r} examples after "
                                             f"{index[-1] + 1} were sent")
            stored = reply.stored
        return stored

    def _exchange(self, message: messages.CustomerMessage) -> object:
        return self.transport.exchange(message)

    # --- training and inference -----------------------------------------------------------------------------
    def _loss_gradient(self, output: torch.Tensor, labels: torch.Tensor) -> tuple[float, torch.Tensor]:
        """Loss and dL/d(output) for the vendor's output; with the head here, the head's gradient too."""
        values = output.detach().clone().requires_grad_(True)
        logits = values if self.head is None else self.head(values)
        loss = torch.nn.functional.cross_entropy(logits, labels)
        loss.backward()
        assert values.grad is not None
        return float(loss.detach()), values.grad.detach()

    def train_step(self, train: TokenizedTexts, labels: torch.Tensor, example_ids: Sequence[int]) -> float:
        """One step of Algorithm 1 on the examples ``example_ids``; returns the batch loss."""
        attached = batch = None
        if self.config.trainable_bottom:
            batch, attached, release = self.release([train.ids[i] for i in example_ids], example_ids,
                                                    note="sap training batch", keep_graph=True,
                                                    sent=self.sent_releases.get(self.step))
            if self.keep_releases:
                self.sent_releases[self.step] = release
        message = messages.Forward(step=self.step, example_ids=torch.as_tensor(list(example_ids), dtype=torch.long),
                                   train=True, bottom_fingerprint=self.bottom.config.fingerprint, batch=batch)
        values = self._output_values(self._exchange(message), len(example_ids))
        if self.head_optimizer is not None:
            self.head_optimizer.zero_grad(set_to_none=True)
        loss, gradient = self._loss_gradient(values, labels[list(example_ids)])
        reply = self._exchange(messages.OutputGradient(step=self.step, gradient=gradient))
        cut_gradient = None  # nothing here changes until the reply is checked
        if attached is not None:
            cut = self._expect(reply, messages.CutGradient, step=self.step)
            cut_gradient = messages.check_tensor("gradient", cut.gradient, shape=tuple(attached.shape),
                                                 dtype=torch.float32)
        else:
            self._expect(reply, messages.StepDone, step=self.step)
        self.step += 1
        if self.head_optimizer is not None:
            self.head_optimizer.step()
        if attached is not None and cut_gradient is not None and self.bottom_optimizer is not None:
            self.bottom_optimizer.zero_grad(set_to_none=True)
            attached.backward(cut_gradient.to(attached))
            self.bottom_optimizer.step()
        return loss

    def state(self) -> CustomerState:
        """A copy of everything a training step changes here, to rewind to (see :meth:`load_state`)."""
        def copy(obj: torch.nn.Module | torch.optim.Optimizer | None) -> dict[str, Any] | None:
            return None if obj is None else _deep_copy(obj.state_dict())
        return CustomerState(step=self.step, head=copy(self.head), head_optimizer=copy(self.head_optimizer),
                             bottom=copy(self.bottom) if self.config.trainable_bottom else None,
                             bottom_optimizer=copy(self.bottom_optimizer))

    def load_state(self, state: CustomerState) -> None:
        """Rewind to ``state`` (the vendor resumed from a checkpoint at ``state.step``). The steps that follow
        resend the releases kept in ``sent_releases`` (``keep_releases``) unchanged: no new noise, no new charge;
        the noise generator is never rewound, so no noise is ever used twice. The account is not rewound either:
        it counts what was released."""
        if self.head is not None and state.head is not None and self.head_optimizer is not None:
            self.head.load_state_dict(state.head)
            self.head_optimizer.load_state_dict(_deep_copy(state.head_optimizer))
        if self.bottom_optimizer is not None and state.bottom is not None:
            self.bottom.load_state_dict(state.bottom)
            self.bottom_optimizer.load_state_dict(_deep_copy(state.bottom_optimizer))
        self.step = state.step

    @staticmethod
    def _expect(reply: object, kind: type[_Reply], *, step: int) -> _Reply:
        """``reply`` if it is a ``kind`` for ``step``: a reply to another step is refused, never applied."""
        if not isinstance(reply, kind):
            raise messages.ProtocolError(f"expected {kind.__name__} from the vendor, got {type(reply).__name__}")
        if reply.step != step:
            raise messages.ProtocolError(f"the vendor answered step {step} with a {kind.__name__} for step "
                                         f"{reply.step}")
        return reply

    def _output_values(self, reply: object, rows: int) -> torch.Tensor:
        """The top's output for ``rows`` examples: logits (rows, C), or the representation (rows, d) when the head
        is here; checked like any message from the other party (kind, step, shape, dtype, finiteness)."""
        output = self._expect(reply, messages.TopOutput, step=self.step)
        expected_kind = "logits" if self.head is None else "representation"
        if output.output != expected_kind:
            raise messages.ProtocolError(f"expected {expected_kind} from the vendor, got {output.output}")
        width = self.n_classes if self.head is None else self.bottom.config.hidden_size
        return messages.check_tensor("values", output.values, shape=(rows, width), dtype=torch.float32)

    def predict_released(self, batch: messages.PrivatizedBatch) -> torch.Tensor:
        """Class probabilities (n, C) for an already released batch (reusing a release costs nothing)."""
        message = messages.Forward(step=self.step, example_ids=batch.example_ids, train=False,
                                   bottom_fingerprint=self.bottom.config.fingerprint, batch=batch)
        values = self._output_values(self._exchange(message), len(batch.example_ids))
        with torch.no_grad():
            logits = values if self.head is None else self.head(values)
        return torch.softmax(logits.float(), dim=-1)

    def release_for_inference(self, texts: TokenizedTexts, *, batch_size: int = 256) -> list[messages.PrivatizedBatch]:
        """Privatize texts for inference (charged like any release)."""
        batches = []
        for start in range(0, len(texts), batch_size):
            index = list(range(start, min(start + batch_size, len(texts))))
            batch, _, _ = self.release([texts.ids[i] for i in index], index, note="sap inference")
            batches.append(batch)
        return batches

    def predict(self, texts: TokenizedTexts, *, batch_size: int = 256,
                released: list[messages.PrivatizedBatch] | None = None) -> torch.Tensor:
        """Class probabilities (n, C): privatize (or reuse ``released``), ask the vendor, apply the head here."""
        batches = released if released is not None else self.release_for_inference(texts, batch_size=batch_size)
        return torch.cat([self.predict_released(batch) for batch in batches])
