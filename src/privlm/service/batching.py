"""Dynamic micro-batching: concurrent requests share one run of a batched function (one forward pass).

:class:`Batcher` batches any items. The next batch expects the requests that were waiting before the last one
answered anyone, and as many as it took (under a steady load, each caller served comes back with its next
request): it goes once they are there, or when it is full, or ``max_wait_ms`` after it could have started,
whichever is first. So a lone client never waits for company, and clients that take turns on the model end up in
one batch instead of alternating in two.

A batch holds at most ``max_size`` units of work (an item's ``size``; the item that crosses the cap is still
taken, so an item larger than the cap is a batch of its own). Batches are filled in turns between callers, as
:class:`~privlm.service.scheduling.FairScheduler` hands out turns: the next item comes from the caller served
longest ago, so a caller with one request waits for at most the batch that is running (and ``max_wait_ms`` for
company), however many others have queued. ``run`` works in a worker thread (the event loop keeps accepting
requests) on the items in the order taken, and returns one result per item, or yields them one by one (each
request then goes on as soon as its result comes); if it raises, every request of the batch not yet answered gets
the error. A request cancelled before its batch is taken never reaches ``run``.

The worker starts on the first ``submit`` (or ``start``) in the running event loop, so a batcher needs no
lifespan of its own; ``stop`` ends it and fails whatever waits.

:class:`MicroBatcher` is SnD's use of it: encode requests of (B, n, d) privatized sequences, right-padded to the
longest sequence of the batch and pooled in one forward pass of at most ``max_rows`` sentences.
"""

from __future__ import annotations

import asyncio
import functools
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from privlm.validation import check_non_negative_finite, check_positive_int

T = TypeVar("T")
R = TypeVar("R")


@dataclass(eq=False)
class _Entry(Generic[T, R]):
    item: T
    size: int
    caller: str
    future: asyncio.Future[R] = field(repr=False)


class Batcher(Generic[T, R]):
    """``run(items) -> results`` (one per item, in order; a list, or an iterator that yields them as they come) on
    batches of concurrent ``submit(item, caller=)`` calls (see the module doc)."""

    def __init__(self, run: Callable[[list[T]], Iterable[R]], *, max_size: int = 64, max_wait_ms: float = 5.0,
                 size: Callable[[T], int] | None = None, on_batch: Callable[[int], None] | None = None) -> None:
        self.run = run
        self.max_size = check_positive_int("max_size", max_size)
        self.max_wait = check_non_negative_finite("max_wait_ms", max_wait_ms) / 1000
        self.size = size or (lambda _: 1)
        self.on_batch = on_batch  # called with each batch's total size, as it starts
        self._waiting: OrderedDict[str, deque[_Entry[T, R]]] = OrderedDict()  # callers in order of arrival
        self._holding: Counter[str] = Counter()  # items each caller has in the running batch
        self._last_turn: dict[str, int] = {}  # when each waiting or running caller last had an item taken
        self._turns = 0
        self._taken = 0  # items in the last batch: each caller served is expected back for the next one
        self._waiting_before_answers: int | None = None  # requests waiting as its first answer went out
        self._loop: asyncio.AbstractEventLoop | None = None
        self._arrived = asyncio.Event()
        self._worker: asyncio.Task[None] | None = None

    @property
    def waiting(self) -> int:
        return sum(len(queue) for queue in self._waiting.values())

    async def start(self) -> None:
        self._ensure_worker()

    async def stop(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)
        self._fail_waiting(RuntimeError("the batcher stopped"))

    async def submit(self, item: T, *, caller: str = "") -> R:
        """``item``'s result, once a batch holding it has run (its error if the batch's run raised)."""
        loop = self._ensure_worker()
        entry: _Entry[T, R] = _Entry(item, check_positive_int("size", self.size(item)), caller, loop.create_future())
        self._waiting.setdefault(caller, deque()).append(entry)
        self._arrived.set()
        try:
            return await entry.future
        except asyncio.CancelledError:
            self._forget(entry)  # not taken yet: it never runs
            raise

    # --- the worker -------------------------------------------------------------------------------------------
    def _ensure_worker(self) -> asyncio.AbstractEventLoop:
        """The worker of the running loop; a batcher used from a new loop (a restarted app) starts afresh."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._fail_waiting(RuntimeError("the batcher moved to another event loop"))
            self._loop, self._arrived, self._worker = loop, asyncio.Event(), None
            self._holding.clear()
            self._last_turn.clear()
            self._taken, self._waiting_before_answers = 0, None
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._work())
        return loop

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._collect()
            try:
                if self.on_batch is not None:
                    self.on_batch(sum(entry.size for entry in batch))
                await asyncio.to_thread(self._run, batch, loop)
            except asyncio.CancelledError:
                _settle(batch, error=RuntimeError("the batcher stopped"))
                raise
            except Exception as error:  # the requests not answered yet get the error
                _settle(batch, error=error)
            finally:
                self._done(batch)

    def _run(self, batch: list[_Entry[T, R]], loop: asyncio.AbstractEventLoop) -> None:
        """``run`` on the batch (in the worker thread), each result handed to its request as soon as it comes: a
        ``run`` that yields its results lets the first requests go on while it works on the others."""
        answered = 0
        for result in self.run([entry.item for entry in batch]):
            if answered == len(batch):
                raise RuntimeError(f"the batch function returned more results than the {len(batch)} items")
            if not answered:  # who waits before any caller could come back
                loop.call_soon_threadsafe(self._note_waiting)
            loop.call_soon_threadsafe(functools.partial(_settle, batch[answered:answered + 1], results=[result]))
            answered += 1
        if answered != len(batch):
            raise RuntimeError(f"the batch function returned {answered} results for {len(batch)} items")

    async def _collect(self) -> list[_Entry[T, R]]:
        """The next batch: the batching decision, written once."""
        loop = asyncio.get_running_loop()
        while True:
            # Those waiting before the last batch answered anyone, and as many as it took: they come back
            waiting = self._waiting_before_answers
            expected = (len(self._live()) if waiting is None else waiting) + self._taken
            while not self._waiting:
                self._arrived.clear()
                await self._arrived.wait()
            deadline = loop.time() + self.max_wait
            while not self._enough(expected):
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), timeout=remaining)
                except TimeoutError:
                    break
            batch = self._take()
            if batch:  # else every waiting request was cancelled meanwhile
                self._taken, self._waiting_before_answers = len(batch), None
                return batch

    def _note_waiting(self) -> None:
        self._waiting_before_answers = len(self._live())

    def _live(self) -> list[_Entry[T, R]]:
        return [entry for queue in self._waiting.values() for entry in queue if not entry.future.done()]

    def _enough(self, expected: int) -> bool:
        """Company enough: a full batch, or every request expected."""
        waiting = self._live()
        return sum(entry.size for entry in waiting) >= self.max_size or len(waiting) >= expected

    def _take(self) -> list[_Entry[T, R]]:
        """Items in turns between callers, each from the caller served longest ago (never: first to arrive)."""
        batch: list[_Entry[T, R]] = []
        size = 0
        while self._waiting and size < self.max_size:
            caller = min(self._waiting, key=lambda c: self._last_turn.get(c, 0))
            queue = self._waiting[caller]
            entry = queue.popleft()
            if not queue:
                del self._waiting[caller]
            if entry.future.done():  # cancelled while waiting
                continue
            self._turns += 1
            self._last_turn[caller] = self._turns
            self._holding[caller] += 1
            batch.append(entry)
            size += entry.size
        for caller in list(self._last_turn):  # callers whose every waiting request was cancelled
            if caller not in self._waiting and caller not in self._holding:
                del self._last_turn[caller]
        return batch

    def _done(self, batch: list[_Entry[T, R]]) -> None:
        for entry in batch:
            self._holding[entry.caller] -= 1
            if not self._holding[entry.caller]:
                del self._holding[entry.caller]
                if entry.caller not in self._waiting:
                    self._last_turn.pop(entry.caller, None)

    def _forget(self, entry: _Entry[T, R]) -> None:
        queue = self._waiting.get(entry.caller)
        if queue is not None and entry in queue:
            queue.remove(entry)
            if not queue:
                del self._waiting[entry.caller]
                if entry.caller not in self._holding:
                    self._last_turn.pop(entry.caller, None)

    def _fail_waiting(self, error: Exception) -> None:
        entries = [entry for queue in self._waiting.values() for entry in queue]
        self._waiting.clear()
        loop = self._loop
        if not entries or loop is None or loop.is_closed():
            return
        if loop is asyncio.get_running_loop():
            _settle(entries, error=error)
        else:  # their futures belong to the other loop
            loop.call_soon_threadsafe(functools.partial(_settle, entries, error=error))


def _settle(entries: Sequence[_Entry[T, R]], *, results: Sequence[R] | None = None,
            error: Exception | None = None) -> None:
    """Each entry's result (or ``error``), unless its caller has gone (cancelled)."""
    for i, entry in enumerate(entries):
        if entry.future.done():
            continue
        if results is not None:
            entry.future.set_result(results[i])
        else:
            entry.future.set_exception(error or RuntimeError("no result"))


@dataclass(frozen=True)
class _Sequences:
    embeddings: torch.Tensor
    attention_mask: torch.Tensor


class MicroBatcher:
    """SnD's encode requests on a :class:`Batcher`: ``run(embeddings, mask) -> pooled`` on one (rows, longest, d)
    batch of at most ``max_rows`` sentences (a request larger than that is a batch of its own)."""

    def __init__(self, run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *, max_rows: int = 64,
                 max_wait_ms: float = 5.0, on_batch: Callable[[int], None] | None = None) -> None:
        self.forward = run
        self.batcher: Batcher[_Sequences, torch.Tensor] = Batcher(
            self._run, max_size=max_rows, max_wait_ms=max_wait_ms, size=lambda s: len(s.embeddings),
            on_batch=on_batch)

    @property
    def on_batch(self) -> Callable[[int], None] | None:
        """Called with the sentences of each batch (the server's histogram)."""
        return self.batcher.on_batch

    @on_batch.setter
    def on_batch(self, observe: Callable[[int], None] | None) -> None:
        self.batcher.on_batch = observe

    async def start(self) -> None:
        await self.batcher.start()

    async def stop(self) -> None:
        await self.batcher.stop()

    async def submit(self, embeddings: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return await self.batcher.submit(_Sequences(embeddings, attention_mask))

    def _run(self, batch: list[_Sequences]) -> list[torch.Tensor]:
        embeddings, mask = _pad_and_stack(batch)
        pooled = self.forward(embeddings, mask)
        return list(pooled.split([len(s.embeddings) for s in batch]))


def _pad_and_stack(batch: Sequence[_Sequences]) -> tuple[torch.Tensor, torch.Tensor]:
    """One (rows, longest, d) float32 batch and its mask; shorter requests are right-padded with zeros."""
    length = max(item.embeddings.shape[1] for item in batch)
    pad = torch.nn.functional.pad
    embeddings = [pad(item.embeddings.float(), (0, 0, 0, length - item.embeddings.shape[1])) for item in batch]
    masks = [pad(item.attention_mask, (0, length - item.attention_mask.shape[1])) for item in batch]
    return torch.cat(embeddings), torch.cat(masks)
