"""Fair turns on a shared resource: round-robin between callers, first come first served within one.

A service cuts each request into short pieces of work (a batch of texts, say) and runs each piece in
a turn: ``async with scheduler.turn(caller): ...``. At most ``capacity`` turns run at once. When a turn
ends, the next goes to the caller who has waited longest since its last turn, so a caller with one
small request waits for at most the pieces already running, however much work others have queued.
"""

from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from privlm.validation import check_positive_int


class FairScheduler:
    def __init__(self, capacity: int = 1) -> None:
        self.capacity = check_positive_int("capacity", capacity)
        self.running = 0
        self._waiting: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()  # in order of arrival
        self._holding: Counter[str] = Counter()  # turns each caller holds now
        self._last_turn: dict[str, int] = {}  # when each waiting or running caller last got a turn
        self._turns = 0

    @property
    def waiting(self) -> int:
        return sum(len(queue) for queue in self._waiting.values())

    @asynccontextmanager
    async def turn(self, caller: str) -> AsyncIterator[None]:
        """Wait for ``caller``'s turn, hold it for the block, then hand it on."""
        if self.running < self.capacity and not self._waiting:
            self._grant(caller)
        else:
            ticket: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiting.setdefault(caller, deque()).append(ticket)
            try:
                await ticket  # _hand_on grants the turn before it wakes us
            except asyncio.CancelledError:
                if ticket.done() and not ticket.cancelled():  # the turn was handed over as we were cancelled
                    self._end(caller)
                else:
                    self._forget(caller, ticket)
                raise
        try:
            yield
        finally:
            self._end(caller)

    def _grant(self, caller: str) -> None:
        self.running += 1
        self._holding[caller] += 1
        self._turns += 1
        self._last_turn[caller] = self._turns

    def _end(self, caller: str) -> None:
        self.running -= 1
        self._holding[caller] -= 1
        if not self._holding[caller]:
            del self._holding[caller]
            if caller not in self._waiting:
                self._last_turn.pop(caller, None)
        self._hand_on()

    def _hand_on(self) -> None:
        """Give free turns to the waiting callers who were served longest ago (never: first)."""
        while self.running < self.capacity and self._waiting:
            caller = min(self._waiting, key=lambda c: self._last_turn.get(c, 0))  # ties: first to arrive
            queue = self._waiting[caller]
            ticket = queue.popleft()
            if not queue:
                del self._waiting[caller]
            if not ticket.cancelled():
                self._grant(caller)
                ticket.set_result(None)

    def _forget(self, caller: str, ticket: asyncio.Future[None]) -> None:
        queue = self._waiting.get(caller)
        if queue is not None and ticket in queue:
            queue.remove(ticket)
            if not queue:
                del self._waiting[caller]
                if caller not in self._holding:
                    self._last_turn.pop(caller, None)
