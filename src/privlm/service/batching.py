"""Dynamic micro-batching: concurrent encode requests share one forward pass.

A request waits at most ``max_wait_ms`` for company, and a batch holds at most ``max_rows``
sentences. Requests are right-padded to the longest sequence in the batch; the model runs in a
worker thread so the event loop keeps accepting requests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class _Pending:
    embeddings: torch.Tensor
    attention_mask: torch.Tensor
    future: asyncio.Future[torch.Tensor] = field(repr=False)


class MicroBatcher:
    def __init__(self, run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *, max_rows: int = 64,
                 max_wait_ms: float = 5.0, on_batch: Callable[[int], None] | None = None) -> None:
        self.run, self.max_rows, self.max_wait = run, max_rows, max_wait_ms / 1000
        self.on_batch = on_batch
        self.queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._worker: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._worker = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)

    async def submit(self, embeddings: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        future: asyncio.Future[torch.Tensor] = asyncio.get_running_loop().create_future()
        await self.queue.put(_Pending(embeddings, attention_mask, future))
        return await future

    async def _collect(self) -> list[_Pending]:
        batch = [await self.queue.get()]
        rows = len(batch[0].embeddings)
        deadline = time.monotonic() + self.max_wait
        while rows < self.max_rows:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                item = await asyncio.wait_for(self.queue.get(), timeout=remaining)
            except TimeoutError:
                break
            batch.append(item)
            rows += len(item.embeddings)
        return batch

    async def _loop(self) -> None:
        while True:
            batch = await self._collect()
            try:
                embeddings, mask = _pad_and_stack(batch)
                pooled = await asyncio.to_thread(self.run, embeddings, mask)
                if self.on_batch is not None:
                    self.on_batch(len(embeddings))
                start = 0
                for item in batch:
                    stop = start + len(item.embeddings)
                    if not item.future.done():
                        item.future.set_result(pooled[start:stop])
                    start = stop
            except Exception as error:
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(error)


def _pad_and_stack(batch: list[_Pending]) -> tuple[torch.Tensor, torch.Tensor]:
    """One (rows, longest, d) float32 batch and its mask; shorter requests are right-padded with zeros."""
    length = max(item.embeddings.shape[1] for item in batch)
    pad = torch.nn.functional.pad
    embeddings = [pad(item.embeddings.float(), (0, 0, 0, length - item.embeddings.shape[1])) for item in batch]
    masks = [pad(item.attention_mask, (0, length - item.attention_mask.shape[1])) for item in batch]
    return torch.cat(embeddings), torch.cat(masks)
