"""``POST /v1/detect``: the personal details the local detector finds in some texts, so that a user can check what
would be caught before sending anything.

    POST /v1/detect  {"input": "I am Maria, 34, from Seattle."}            (or a list of up to 256 texts)
    200  {"object": "list", "model": "privlm-detect",
          "data": [{"index": 0, "spans": [{"start": 5, "end": 10, "kind": "person", "score": 0.98,
                                           "source": "tagger", "text": "Maria"}, ...]}]}

Nothing leaves the machine and nothing is charged: the texts are read here by :class:`~privlm.detect.Detector`
and answered to the caller alone; the route has no upstream, no ledger and no audit log, and no text of a request is
logged. It sits behind the app's keys, as every route of the gateway (:func:`privlm.service.create_service_app`).

Limits: at most :data:`MAX_INPUTS` texts and :data:`MAX_CHARS` characters a request (the detector reads texts of
any length, so the characters bound the work one request holds), within the app's body limit; anything else is a
400 in OpenAI's error shape, naming inputs by index, never by their text. A blank text has no spans.

The detector is given, or made by a factory on first use: ``Detector.default()`` loads the tagger and the
gazetteers, so a gateway starts as fast as before and one never asked to detect never loads them; the first request
waits for the load (a load that fails is a 503 ``detector_unavailable``, and the next request tries again).
Detection runs off the event loop, on :class:`~privlm.service.Batcher`: each text is an item, concurrent requests
share batches of at most ``batch_units`` units (a unit per started :data:`UNIT_CHARS` characters of a text), filled
in turns between callers, one batch at a time in a worker thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Annotated, Literal

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, WithJsonSchema

from privlm.detect.detector import Detector
from privlm.detect.spans import Kind, Span
from privlm.service import Batcher, BearerKeys, ServiceError
from privlm.validation import check_non_negative_finite, check_positive_int

logger = logging.getLogger(__name__)

DETECT_PATH = "/v1/detect"
DETECT_MODEL = "privlm-detect"
MAX_INPUTS = 256
MAX_CHARS = 200_000  # about 50,000 tokens: some 10 s of the detector's time on two cores (20 characters a ms)
UNIT_CHARS = 2048  # a batch's unit of work: a short prompt is one unit, a long document several
BATCH_UNITS = 32  # the batch size the detector is measured at
BATCH_WAIT_MS = 5.0

DetectorSource = Detector | Callable[[], Detector]  # a detector, or a factory called once, on first use

_DESCRIPTION = ("The personal details that privlm's local detector finds in each text (typed spans, offsets in "
                "characters of the text as sent). Runs on this machine: nothing is sent upstream and nothing is "
                "charged to any privacy budget.")

_INPUT_SCHEMA = {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": MAX_INPUTS}


class DetectRequest(BaseModel):
    """What to check. The list's bounds are documented here and checked by the route, so that a request over them
    is answered with a message of its own."""

    input: str | Annotated[list[str], WithJsonSchema(_INPUT_SCHEMA)] = Field(
        description=f"A text, or a list of 1 to {MAX_INPUTS} texts (at most {MAX_CHARS:,} characters in all).")


class DetectedSpan(BaseModel):
    """``text[start:end]`` is a personal detail of ``kind``, found by the layer(s) named in ``source``."""

    start: int = Field(ge=0, description="First character (Unicode code points, from 0).")
    end: int = Field(ge=1, description="One past the last character.")
    kind: Kind
    score: float = Field(ge=0, le=1)
    source: str = Field(description='The layers that found it, joined by "+" ("pattern:phone+tagger").')
    text: str = Field(description="The detail itself, text[start:end].")


class DetectedText(BaseModel):
    index: int = Field(ge=0, description="The text's position in the request's input.")
    spans: list[DetectedSpan] = Field(description="Sorted, non-overlapping, whole words.")


class DetectList(BaseModel):
    """The spans of every text, in input order."""

    object: Literal["list"] = "list"
    data: list[DetectedText]
    model: Literal["privlm-detect"] = "privlm-detect"


class DetectorUnavailableError(RuntimeError):
    """The detector's factory failed: the route cannot detect until a later load succeeds."""


def _units(text: str) -> int:
    return 1 + len(text) // UNIT_CHARS


class _DetectRoute:
    """The detect route's steps and the state its requests share (:func:`detect_router`): the detector, loaded
    once, and the batcher that runs it."""

    def __init__(self, detector: DetectorSource, *, max_inputs: int, max_chars: int, batch_units: int,
                 batch_wait_ms: float) -> None:
        self.max_inputs, self.max_chars = max_inputs, max_chars
        self._detector: Detector | None = detector if isinstance(detector, Detector) else None
        self._make = None if isinstance(detector, Detector) else detector
        self._loading = threading.Lock()
        self.batcher: Batcher[str, list[Span]] = Batcher(self._detect_batch, max_size=batch_units,
                                                         max_wait_ms=batch_wait_ms, size=_units)

    def detector(self) -> Detector:
        """The detector, made on the first call (blocking: called in the batcher's worker thread)."""
        with self._loading:
            if self._detector is None:
                assert self._make is not None
                try:
                    self._detector = self._make()
                except Exception as error:  # the operator's problem: logged in full, answered by its type only
                    logger.warning("the detector could not be loaded: %s: %s", type(error).__name__, error)
                    raise DetectorUnavailableError(type(error).__name__) from error
            return self._detector

    def _detect_batch(self, texts: list[str]) -> list[list[Span]]:
        return self.detector().detect(texts)

    def check(self, texts: Sequence[str]) -> None:
        """The request's limits, or a 400 that names inputs by index."""
        if not 1 <= len(texts) <= self.max_inputs:
            split = "; split it" if texts else ""
            raise ServiceError(400, f"input must hold 1 to {self.max_inputs} texts, got {len(texts)}{split}",
                               param="input", code="max_inputs_per_request")
        total = sum(len(text) for text in texts)
        if total > self.max_chars:
            raise ServiceError(400, f"the request holds {total:,} characters, more than the {self.max_chars:,} "
                                    "allowed per request; split it", param="input", code="max_chars_per_request")
        for i, text in enumerate(texts):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate: JSON can carry it, no tokenizer can read it
                raise ServiceError(400, f"input[{i}] is not valid Unicode (it holds a lone surrogate code point)",
                                   param="input", code="invalid_input") from None

    async def spans(self, texts: Sequence[str], caller: str) -> list[list[Span]]:
        """Each text's spans (a blank text has none, and never waits for a batch)."""
        wanted = [i for i, text in enumerate(texts) if text.strip()]
        try:
            found = await asyncio.gather(*(self.batcher.submit(texts[i], caller=caller) for i in wanted))
        except DetectorUnavailableError as error:
            raise ServiceError(503, f"the detector could not be loaded ({error}); the gateway's log says why",
                               type="server_error", code="detector_unavailable") from None
        spans: list[list[Span]] = [[] for _ in texts]
        for i, text_spans in zip(wanted, found, strict=True):
            spans[i] = text_spans
        return spans

    async def detect(self, request: DetectRequest, caller: str) -> Response:
        texts = [request.input] if isinstance(request.input, str) else request.input
        self.check(texts)
        found = await self.spans(texts, caller)
        content = await asyncio.to_thread(_render, texts, found)  # a large answer is not written on the event loop
        return Response(content, media_type="application/json")


def _render(texts: Sequence[str], found: Sequence[Sequence[Span]]) -> bytes:
    """The answer, :class:`DetectList` as JSON."""
    data = [{"index": i, "spans": [span.as_dict(text) for span in spans]}
            for i, (text, spans) in enumerate(zip(texts, found, strict=True))]
    return json.dumps({"object": "list", "data": data, "model": DETECT_MODEL}, ensure_ascii=False).encode()


def detect_router(detector: DetectorSource, *, auth: BearerKeys, max_inputs: int = MAX_INPUTS,
                  max_chars: int = MAX_CHARS, batch_units: int = BATCH_UNITS,
                  batch_wait_ms: float = BATCH_WAIT_MS) -> APIRouter:
    """``POST /v1/detect`` (see the module doc) with ``detector`` (or a factory of it, called once on first use);
    mount it behind ``auth``, the app's keys. ``auth`` names the callers who take turns on the detector (on an
    open service, every request is a caller of its own)."""
    route = _DetectRoute(detector, max_inputs=check_positive_int("max_inputs", max_inputs),
                         max_chars=check_positive_int("max_chars", max_chars),
                         batch_units=check_positive_int("batch_units", batch_units),
                         batch_wait_ms=check_non_negative_finite("batch_wait_ms", batch_wait_ms))

    async def detect(request: DetectRequest, principal: str = Depends(auth.dependency)) -> Response:
        """Which personal details the local detector finds in each text. Nothing leaves the machine and nothing is
        charged."""
        return await route.detect(request, caller=auth.fair_caller(principal))

    router = APIRouter(tags=["detect"])
    router.post(DETECT_PATH, response_class=JSONResponse, summary="Find personal details, locally (nothing is sent "
                "or charged)", description=_DESCRIPTION,
                responses={200: {"model": DetectList, "description": "Each text's spans, in input order"}})(detect)
    return router


__all__ = ["DETECT_MODEL", "DETECT_PATH", "MAX_CHARS", "MAX_INPUTS", "DetectList", "DetectRequest", "DetectedSpan",
           "DetectedText", "DetectorSource", "detect_router"]
