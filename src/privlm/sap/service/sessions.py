"""The vendor's fine-tuning sessions, without HTTP: create, exchange SAP messages, checkpoint, export.

One :class:`VendorSessions` holds the vendor's model and serves many customers' sessions, each a
:class:`privlm.sap.Vendor` over its own copy of the top, behind its own lock. A session belongs to the principal
that created it (an HMAC of its API key); any other principal is told it does not exist. Sessions live in a
:class:`SessionStore`: uploads are stored before they are acknowledged, and the training state is checkpointed
at creation, every ``checkpoint_every`` steps and on request, so a restarted vendor (or another replica reading
the same store) resumes a session from its last checkpoint. The customer learns the checkpoint's step with every
answer and resends what came after it.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from privlm.models.partition import BottomModel, split_model
from privlm.models.pooling import Pooling
from privlm.sap.messages import (
    MAX_ABS_VALUE,
    Forward,
    OutputGradient,
    ProtocolError,
    Upload,
    VendorMessage,
    from_bytes,
    to_bytes,
)
from privlm.sap.service.store import SessionNotFoundError, SessionStore, new_session_id
from privlm.sap.service.wire import CHECKPOINT_STEP_HEADER, STEPS_DONE_HEADER, SessionInfo, SessionRequest
from privlm.sap.vendor import Vendor
from privlm.validation import check_positive_finite, check_positive_int


@dataclass(frozen=True)
class SessionLimits:
    """Bounds on what one session may hold and one message may carry."""

    max_sessions: int = 16  # in memory; more are kept in the store and restored when used
    max_sessions_per_key: int = 8  # stored, per API key
    max_examples: int = 100_000
    max_upload_bytes: int = 4 * 2**30  # stored uploads per session
    max_batch: int = 256
    max_tokens: int = 512
    max_message_bytes: int = 64 * 2**20
    max_abs_value: float = MAX_ABS_VALUE  # per entry of an uploaded or forwarded representation and of a gradient

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if name == "max_abs_value":
                check_positive_finite(name, value)
            else:
                check_positive_int(name, value)


@dataclass
class _Session:
    vendor: Vendor
    request: SessionRequest
    owner: str
    checkpoint_step: int = 0
    generation: str | None = None  # of the checkpoint this state was written as or restored from
    used: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)


class VendorSessions:
    """Sessions over one base model, split at the positions in ``bottoms`` (blocks -> the exported bottom)."""

    def __init__(self, model: torch.nn.Module, *, bottoms: Mapping[int, BottomModel], pooling: Pooling,
                 store: SessionStore, checkpoint_every: int = 50, limits: SessionLimits | None = None,
                 shared: bool = False) -> None:
        """``shared``: other processes (replicas) serve the same sessions from the same store, so a session held
        here is used only while the store's checkpoint is the one it last wrote or read; else it is reloaded."""
        self.model, self.bottoms, self.pooling, self.store = model, dict(bottoms), pooling, store
        self.shared = shared
        self.checkpoint_every = check_positive_int("checkpoint_every", checkpoint_every)
        self.limits = limits or SessionLimits()
        positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        offset = 2 if getattr(getattr(model, "config", None), "model_type", "") in ("roberta", "xlm-roberta",
                                                                                    "camembert") else 0
        self.max_tokens = min(self.limits.max_tokens, positions - offset) if isinstance(positions, int) \
            else self.limits.max_tokens  # past the position table the model cannot run: a 413, not a crash
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()
        self.steps_taken = 0

    # --- sessions -----------------------------------------------------------------------------------------
    def _vendor(self, request: SessionRequest) -> Vendor:
        if request.blocks not in self.bottoms:
            raise ProtocolError(f"blocks={request.blocks} is not offered; this vendor splits at "
                                f"{sorted(self.bottoms)}", limit="blocks")
        fingerprint = self.bottoms[request.blocks].config.fingerprint
        if request.bottom_fingerprint != fingerprint:
            raise ProtocolError(f"bottom_fingerprint {request.bottom_fingerprint[:12]}… is not the bottom this vendor "
                                f"exports at blocks={request.blocks} ({fingerprint[:12]}…)", status=409,
                                limit="bottom_fingerprint")
        _, top = split_model(self.model, request.blocks, pooling=self.pooling,  # type: ignore[arg-type]
                             n_classes=request.n_classes if request.head == "vendor" else None,
                             head_seed=request.seed)
        if top.bottom_fingerprint != fingerprint:
            raise RuntimeError("the model changed since its bottoms were exported")
        try:
            return Vendor(top, lora=request.lora_settings(), learning_rate=request.learning_rate,
                          send_cut_gradient=request.trainable_bottom, seed=request.seed,
                          max_abs_value=self.limits.max_abs_value)
        except ValueError as error:  # peft: target modules that are not in the top, or not layers it can adapt
            raise ProtocolError(f"LoRA cannot adapt {request.lora.target_modules} in this model: {error}",
                                status=400, limit="lora.target_modules") from None

    def _make_room(self) -> None:
        """Below ``max_sessions`` in memory: the least recently used idle session is checkpointed and dropped from
        memory (the store keeps it; it is restored when next used). All busy: a 429."""
        while len(self._sessions) >= self.limits.max_sessions:
            for session_id, session in sorted(self._sessions.items(), key=lambda item: item[1].used):
                if session.lock.acquire(blocking=False):
                    try:
                        self._checkpoint(session_id, session)
                        del self._sessions[session_id]
                    finally:
                        session.lock.release()
                    break
            else:
                raise ProtocolError(f"all max_sessions={self.limits.max_sessions} sessions in memory are busy; retry",
                                    status=429, limit="max_sessions")

    def create(self, request: SessionRequest, owner: str) -> SessionInfo:
        with self._lock:
            owned = sum(1 for sid in self.store.session_ids() if self.store.record(sid).get("owner") == owner)
            if owned >= self.limits.max_sessions_per_key:
                raise ProtocolError(f"this key holds max_sessions_per_key={self.limits.max_sessions_per_key} "
                                    "sessions; delete one first", status=429, limit="max_sessions_per_key")
            self._make_room()
            vendor = self._vendor(request)
            session_id = new_session_id()
            self.store.create(session_id, {"request": request.model_dump(), "owner": owner,
                                           "created": time.time()})
            session = _Session(vendor=vendor, request=request, owner=owner)
            self._checkpoint(session_id, session)
            self._sessions[session_id] = session
            return self._info(session_id, session)

    def _get(self, session_id: str, owner: str) -> _Session:
        with self._lock:
            session = self._sessions.get(session_id)
            if session is not None and self.shared and self.store.generation(session_id) != session.generation:
                session = None  # another replica moved it on since: this copy is stale
            if session is None:
                session = self._restore(session_id, owner)
            if session.owner != owner:
                raise SessionNotFoundError("no such session")
            session.used = time.monotonic()
            return session

    def _restore(self, session_id: str, owner: str) -> _Session:
        """A session this process does not hold (a restart, another replica): rebuilt from the store, for its
        owner only (checked before anything is loaded)."""
        if self.store.record(session_id).get("owner") != owner:
            raise SessionNotFoundError("no such session")
        self._make_room()
        stored = self.store.load(session_id)
        request = SessionRequest.model_validate(stored.record["request"])
        session = _Session(vendor=self._vendor(request), request=request, owner=str(stored.record["owner"]))
        for upload in stored.uploads:
            session.vendor.handle(from_bytes(upload))  # type: ignore[arg-type]
        if stored.checkpoint is not None:
            session.vendor.load_training_state(*stored.checkpoint)
            session.checkpoint_step = session.vendor.steps_done
            session.generation = stored.checkpoint[1].get("generation")
        self._sessions[session_id] = session
        return session

    def info(self, session_id: str, owner: str) -> SessionInfo:
        return self._info(session_id, self._get(session_id, owner))

    @staticmethod
    def _info(session_id: str, session: _Session) -> SessionInfo:
        request = session.request
        return SessionInfo(id=session_id, blocks=request.blocks, n_classes=request.n_classes, head=request.head,
                           trainable_bottom=request.trainable_bottom, steps_done=session.vendor.steps_done,
                           checkpoint_step=session.checkpoint_step, uploaded_examples=len(session.vendor.uploaded))

    def delete(self, session_id: str, owner: str) -> None:
        session = self._get(session_id, owner)
        with session.lock, self._lock:  # after any exchange in flight on it, which could write to the store
            self._sessions.pop(session_id, None)
            self.store.delete(session_id)

    def forget(self, session_id: str) -> None:
        """Drop a session from memory only (tests: what a restart does); the store keeps it."""
        with self._lock:
            self._sessions.pop(session_id, None)

    # --- messages -----------------------------------------------------------------------------------------
    def _check_size(self, message: object, session: _Session) -> None:
        limits = self.limits
        batch = message.batch if isinstance(message, Upload | Forward) else None
        if batch is not None and isinstance(batch.values, torch.Tensor) and batch.values.ndim == 3:
            rows, tokens = batch.values.shape[:2]
            if rows > limits.max_batch:
                raise ProtocolError(f"a batch of {rows} rows exceeds max_batch={limits.max_batch}", status=413,
                                    limit="max_batch")
            if tokens > self.max_tokens:
                raise ProtocolError(f"sequences of {tokens} positions exceed max_tokens={self.max_tokens}",
                                    status=413, limit="max_tokens")
        if isinstance(message, Upload) and isinstance(message.batch.values, torch.Tensor) \
                and len(session.vendor.uploaded) + int(message.batch.values.shape[0]) > limits.max_examples:
            raise ProtocolError(f"the session would hold more than max_examples={limits.max_examples} uploaded "
                                "examples", status=413, limit="max_examples")
        if isinstance(message, Forward) and message.batch is None and isinstance(message.example_ids, torch.Tensor) \
                and message.example_ids.numel() > limits.max_batch:
            raise ProtocolError(f"{message.example_ids.numel()} example ids exceed max_batch={limits.max_batch}",
                                status=413, limit="max_batch")

    def exchange(self, session_id: str, owner: str, body: bytes) -> tuple[bytes, dict[str, str]]:
        """One customer message (SAP message bytes) in, the vendor's answer out, with the session's step and
        checkpoint step. A bad message changes nothing."""
        session = self._get(session_id, owner)
        message = from_bytes(body, max_bytes=self.limits.max_message_bytes)
        if not isinstance(message, Upload | Forward | OutputGradient):
            raise ProtocolError(f"the vendor does not take {type(message).__name__} messages")
        self._check_size(message, session)
        with session.lock:
            fresh = isinstance(message, Upload) and self._check_upload(session_id, session, message, body)
            before = dict(session.vendor.uploaded) if fresh else {}
            reply: VendorMessage = session.vendor.handle(message)
            if fresh:
                self._store_upload(session_id, session, message, body, before)  # type: ignore[arg-type]
                if self.shared:
                    self._checkpoint(session_id, session)  # a new generation: other replicas reload the uploads
            elif isinstance(message, OutputGradient) and session.vendor.steps_done > session.checkpoint_step \
                    and (self.shared or session.vendor.steps_done % self.checkpoint_every == 0):
                self._checkpoint(session_id, session)  # shared: every step, so a replica never serves a stale one
            if isinstance(message, OutputGradient):
                self.steps_taken += 1
            return to_bytes(reply), self._headers(session)

    def _store_upload(self, session_id: str, session: _Session, message: Upload, body: bytes,
                      before: dict[int, Any]) -> None:
        try:
            self.store.add_upload(session_id, body)
        except OSError:  # not durable: not accepted either
            for example_id in message.batch.example_ids.tolist():
                if example_id in before:
                    session.vendor.uploaded[example_id] = before[example_id]
                else:
                    session.vendor.uploaded.pop(example_id, None)
            raise

    def _check_upload(self, session_id: str, session: _Session, message: Upload, body: bytes) -> bool:
        """Whether the upload is new. The same rows sent again (a retry) are not stored twice; other values for
        ids already held are refused (the uploads are the training set: it does not change under a session)."""
        batch = message.batch.check(hidden_size=session.vendor.top.hidden_size, max_abs=self.limits.max_abs_value)
        held = [i for i in batch.example_ids.tolist() if i in session.vendor.uploaded]
        if not held:
            if self.store.upload_bytes(session_id) + len(body) > self.limits.max_upload_bytes:
                raise ProtocolError(f"the session's uploads would exceed max_upload_bytes="
                                    f"{self.limits.max_upload_bytes}", status=413, limit="max_upload_bytes")
            return True
        for row, example_id in enumerate(batch.example_ids.tolist()):
            values, _ = session.vendor.uploaded.get(example_id, (None, None))
            length = int(batch.attention_mask[row].sum())
            if values is None or not torch.equal(values, batch.values[row, :length]):
                raise ProtocolError("an upload must hold new example ids only, or resend held ones exactly (a "
                                    "retry): these mix them, or change held values", status=409, limit="example_ids")
        return False

    @staticmethod
    def _headers(session: _Session) -> dict[str, str]:
        return {STEPS_DONE_HEADER: str(session.vendor.steps_done), CHECKPOINT_STEP_HEADER: str(session.checkpoint_step)}

    def _checkpoint(self, session_id: str, session: _Session, *, keep: bool = False) -> None:
        tensors, facts = session.vendor.training_state()
        generation = uuid.uuid4().hex
        self.store.save_checkpoint(session_id, tensors, facts | {"generation": generation}, keep=keep)
        session.checkpoint_step, session.generation = session.vendor.steps_done, generation

    def checkpoint(self, session_id: str, owner: str, keep: bool = False) -> SessionInfo:
        """Checkpoint now; ``keep`` files it under its step too, for :meth:`select` (the customer keeps one per
        epoch and selects the best on its own validation data)."""
        session = self._get(session_id, owner)
        with session.lock:
            self._checkpoint(session_id, session, keep=keep)
        return self._info(session_id, session)

    def select(self, session_id: str, owner: str, step: int) -> SessionInfo:
        """Serve the adapter of the checkpoint kept at ``step`` (training ends there: the customer chose it)."""
        session = self._get(session_id, owner)
        with session.lock:
            try:
                tensors, _ = self.store.kept_checkpoint(session_id, step)
            except KeyError as error:
                raise ProtocolError(str(error.args[0]), status=404, limit="step") from None
            adapter = {k.removeprefix("adapter."): v for k, v in tensors.items() if k.startswith("adapter.")}
            session.vendor.load_adapter_state(adapter)
            self._checkpoint(session_id, session)  # durable, and a new generation: every replica serves it
        return self._info(session_id, session)

    def adapter(self, session_id: str, owner: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The trained adapter (LoRA, and the head when it sits at the vendor), for its owner."""
        session = self._get(session_id, owner)
        with session.lock:
            state = session.vendor.adapter_state()
        request = session.request
        return state, {"lora": request.lora.model_dump(), "blocks": request.blocks, "head": request.head,
                       "n_classes": request.n_classes, "steps_done": session.vendor.steps_done,
                       "bottom_fingerprint": request.bottom_fingerprint}

    @property
    def session_count(self) -> int:
        return len(self._sessions)
