"""The micro-batcher: concurrent requests share a run, batches are filled in turns between callers, a failed run
fails every request of its batch (and only those), a request cancelled before its batch never runs, and SnD's
embedding batches pad and split as one forward pass per request would."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator, Sequence

import pytest
import torch

from privlm.service import Batcher, MicroBatcher


class Recorder:
    """A batch function that records each batch, and can hold a batch until released or fail on an item."""

    def __init__(self, *, hold_first: bool = False, fail_on: str | None = None) -> None:
        self.batches: list[list[str]] = []
        self.holding = threading.Event()
        self.release = threading.Event()
        self.hold_first, self.fail_on = hold_first, fail_on

    def __call__(self, items: list[str]) -> list[str]:
        self.batches.append(list(items))
        if self.hold_first and len(self.batches) == 1:
            self.holding.set()
            self.release.wait(10)
        if self.fail_on is not None and self.fail_on in items:
            raise RuntimeError(f"batch {len(self.batches)} failed")
        return [f"done:{item}" for item in items]


async def _wait_for(event: threading.Event) -> None:
    while not event.is_set():
        await asyncio.sleep(0.005)


def test_concurrent_requests_share_one_run_and_each_gets_its_own_result():
    run = Recorder()

    async def main() -> list[str]:
        batcher: Batcher[str, str] = Batcher(run, max_size=4, max_wait_ms=5_000)
        return list(await asyncio.gather(*(batcher.submit(f"item-{i}", caller=f"c{i}") for i in range(4))))

    started = time.monotonic()
    assert asyncio.run(main()) == [f"done:item-{i}" for i in range(4)]
    assert time.monotonic() - started < 4  # a full batch goes at once, not after max_wait
    assert run.batches == [[f"item-{i}" for i in range(4)]]


def test_a_lone_caller_never_waits_for_company():
    run = Recorder()

    async def main() -> None:
        batcher: Batcher[str, str] = Batcher(run, max_size=8, max_wait_ms=5_000)
        for i in range(4):
            await batcher.submit(f"item-{i}")

    started = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - started < 2.5  # not one max_wait
    assert run.batches == [[f"item-{i}"] for i in range(4)]


def test_clients_that_take_turns_come_together_in_one_batch():
    """Four clients in a loop (each sends its next request shortly after its answer), the first a little ahead:
    the next batch expects the requests waiting and the ones it just served, so the first batch's client is
    waited for, and from then on every batch holds all four (not one and three, alternating)."""
    sizes: list[int] = []
    first = threading.Event()

    def run(items: list[str]) -> list[str]:
        sizes.append(len(items))
        first.set()
        time.sleep(0.05)  # the model's work
        return items

    async def main() -> None:
        batcher: Batcher[str, str] = Batcher(run, max_size=8, max_wait_ms=500)

        async def client(i: int) -> None:
            if i:
                await _wait_for(first)  # the first client's batch runs
            for k in range(6):
                await batcher.submit(f"{i}-{k}", caller=str(i))
                await asyncio.sleep(0.02)  # the answer goes out, the next request comes in

        await asyncio.gather(*(client(i) for i in range(4)))

    asyncio.run(main())
    assert sizes[0] == 1 and sizes[1:-1] == [4] * 5 and sum(sizes) == 24, sizes


def test_batches_are_filled_in_turns_so_a_flood_does_not_starve_a_small_caller():
    run = Recorder(hold_first=True)

    async def main() -> None:
        batcher: Batcher[str, str] = Batcher(run, max_size=3, max_wait_ms=0)
        first = asyncio.ensure_future(batcher.submit("first", caller="flood"))
        await _wait_for(run.holding)  # the first batch runs: everything else queues behind it
        flood = [asyncio.ensure_future(batcher.submit(f"flood-{i}", caller="flood")) for i in range(7)]
        await asyncio.sleep(0)
        small = asyncio.ensure_future(batcher.submit("small", caller="small"))
        other = asyncio.ensure_future(batcher.submit("other", caller="other"))
        await asyncio.sleep(0.05)
        run.release.set()
        await asyncio.gather(first, *flood, small, other)

    asyncio.run(main())
    assert run.batches[0] == ["first"]
    # The flood queued first, yet the next batch takes one item from each caller in turn (the callers served
    # longest ago first: the two that were never served, in order of arrival, then the flood).
    assert run.batches[1] == ["small", "other", "flood-0"]
    assert [item for batch in run.batches[2:] for item in batch] == [f"flood-{i}" for i in range(1, 7)]


def test_a_failed_run_fails_every_request_of_its_batch_and_only_those():
    run = Recorder(hold_first=True, fail_on="bad")

    async def main() -> tuple[list[object], list[object]]:
        batcher: Batcher[str, str] = Batcher(run, max_size=3, max_wait_ms=0)
        first = asyncio.ensure_future(batcher.submit("first"))
        await _wait_for(run.holding)
        doomed = [asyncio.ensure_future(batcher.submit(item, caller=item)) for item in ("a", "bad", "b")]
        later = [asyncio.ensure_future(batcher.submit(item, caller=item)) for item in ("c", "d")]
        await asyncio.sleep(0.05)
        run.release.set()
        await first
        return (list(await asyncio.gather(*doomed, return_exceptions=True)),
                list(await asyncio.gather(*later, return_exceptions=True)))

    doomed, later = asyncio.run(main())
    assert run.batches[1] == ["a", "bad", "b"]
    assert all(isinstance(outcome, RuntimeError) and "batch 2 failed" in str(outcome) for outcome in doomed)
    assert later == ["done:c", "done:d"]


def test_a_run_that_yields_answers_each_request_as_its_result_comes():
    """The first requests of a batch go on while the run works on the others; one that breaks midway fails only the
    requests it has not answered, and one that answers too few fails the rest."""
    proceed = threading.Event()

    def run(items: list[str]) -> Iterator[str]:
        yield f"done:{items[0]}"
        proceed.wait(10)
        for item in items[1:]:
            if item == "bad":
                raise RuntimeError("broke midway")
            if item == "missing":
                return
            yield f"done:{item}"

    async def main() -> list[object]:
        batcher: Batcher[str, str] = Batcher(run, max_size=3, max_wait_ms=5_000)
        first, second, third = (asyncio.ensure_future(batcher.submit(item, caller=item)) for item in "abc")
        assert await asyncio.wait_for(first, 5) == "done:a"
        assert not second.done() and not third.done()
        proceed.set()
        outcomes: list[object] = [await second, await third]
        for items in (["d", "bad", "e"], ["f", "missing", "g"]):
            outcomes += await asyncio.gather(*(batcher.submit(item, caller=item) for item in items),
                                             return_exceptions=True)
        return outcomes

    second, third, d, bad, e, f, missing, g = asyncio.run(main())
    assert (second, third, d, f) == ("done:b", "done:c", "done:d", "done:f")
    assert isinstance(bad, RuntimeError) and str(bad) == "broke midway" and bad is e
    assert isinstance(missing, RuntimeError) and "returned 1 results for 3 items" in str(missing) and missing is g


def test_a_request_cancelled_before_its_batch_never_runs():
    run = Recorder(hold_first=True)

    async def main() -> str:
        batcher: Batcher[str, str] = Batcher(run, max_size=4, max_wait_ms=0)
        first = asyncio.ensure_future(batcher.submit("first"))
        await _wait_for(run.holding)
        gone = asyncio.ensure_future(batcher.submit("gone", caller="gone"))
        kept = asyncio.ensure_future(batcher.submit("kept", caller="kept"))
        await asyncio.sleep(0.02)
        gone.cancel()
        await asyncio.sleep(0.02)
        run.release.set()
        await first
        return await kept

    assert asyncio.run(main()) == "done:kept"
    assert run.batches == [["first"], ["kept"]]


def test_a_batch_holds_at_most_max_size_and_an_item_over_it_goes_alone():
    run = Recorder(hold_first=True)

    async def main() -> None:
        batcher: Batcher[str, str] = Batcher(run, max_size=4, max_wait_ms=0, size=len)
        first = asyncio.ensure_future(batcher.submit("x"))
        await _wait_for(run.holding)
        rest = [asyncio.ensure_future(batcher.submit(item, caller=str(i)))
                for i, item in enumerate(["aa", "bb", "cccccc", "dd"])]
        await asyncio.sleep(0.02)
        run.release.set()
        await asyncio.gather(first, *rest)

    asyncio.run(main())
    assert run.batches == [["x"], ["aa", "bb"], ["cccccc"], ["dd"]]


def test_a_batcher_moves_to_a_new_event_loop():
    """A router's batcher outlives an app's loop (a test client opened twice): the next loop gets a worker."""
    run = Recorder()
    batcher: Batcher[str, str] = Batcher(run, max_size=1, max_wait_ms=0)
    assert asyncio.run(batcher.submit("one")) == "done:one"
    assert asyncio.run(batcher.submit("two")) == "done:two"


def test_embedding_batches_pad_and_split_as_separate_forward_passes_would():
    weights = torch.randn(3, 2, generator=torch.Generator().manual_seed(0))
    calls: list[int] = []

    def forward(embeddings: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        calls.append(len(embeddings))
        return (embeddings * mask.unsqueeze(-1)).sum(dim=1) @ weights  # a masked sum: padding adds nothing

    def request(n: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, length, 3), torch.ones(n, length, dtype=torch.long)

    requests = [request(2, 5), request(1, 3), request(3, 4)]
    rows: list[int] = []

    async def main() -> Sequence[torch.Tensor]:
        batcher = MicroBatcher(forward, max_rows=6, max_wait_ms=5_000)
        batcher.on_batch = rows.append
        await batcher.start()
        try:
            return await asyncio.gather(*(batcher.submit(e, m) for e, m in requests))
        finally:
            await batcher.stop()

    pooled = asyncio.run(main())
    assert calls == [6] and rows == [6]  # one forward pass for the three requests
    for (embeddings, mask), out in zip(requests, pooled, strict=True):
        assert out.shape == (len(embeddings), 2)
        torch.testing.assert_close(out, forward(embeddings, mask))


def test_the_sizes_are_checked():
    with pytest.raises(ValueError, match="max_size"):
        Batcher(lambda items: items, max_size=0)
    with pytest.raises(ValueError, match="max_wait_ms"):
        Batcher(lambda items: items, max_wait_ms=-1)
