"""The training loop against a vendor that reports itself behind: it rewinds and replays while that leads somewhere,
and gives up (``VendorBehindError``) when it cannot resume or is sent back again and again from the same point."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest

from privlm.sap import Forward, InProcessTransport, SapConfig, VendorBehindError, connect, fine_tune
from privlm.sap.messages import CustomerMessage, VendorMessage
from privlm.sap.training import MAX_REWINDS_WITHOUT_PROGRESS, Parties
from tests.sap.conftest import LABELS, TEXTS

CONFIG = SapConfig(blocks=0, eta=None, head="customer", epochs=2, batch_size=2)  # 4 steps an epoch
NEVER_GIVES_UP = 50  # refusals after which the loop is deemed never to give up


class BehindAt:
    """The in-process vendor, reported behind (before it sees anything) on the training steps ``behind_at`` says.

    ``checkpointed``: the vendor checkpoints every step (it resumes where it was: the customer can rewind) or
    never (it resumes at step 0, where this customer keeps no state: it cannot)."""

    def __init__(self, inner: InProcessTransport, behind_at: Callable[[int, int], bool], *, checkpointed: bool) -> None:
        self.inner, self.behind_at, self.checkpointed = inner, behind_at, checkpointed
        self.traffic = inner.traffic
        self.refused: Counter[int] = Counter()

    @property
    def checkpoint_step(self) -> int | None:
        return self.inner.vendor.steps_done if self.checkpointed else None

    def exchange(self, message: CustomerMessage) -> VendorMessage:
        if isinstance(message, Forward) and message.train and self.behind_at(message.step, self.refused[message.step]):
            self.refused[message.step] += 1
            if self.refused.total() > NEVER_GIVES_UP:
                raise AssertionError("the training loop never gave up")
            raise VendorBehindError(f"the vendor is behind step {message.step}")
        return self.inner.exchange(message)

    def keep(self, step: int) -> None:
        self.inner.keep(step)

    def select(self, step: int) -> None:
        self.inner.select(step)

    def resumed_at(self) -> int:
        return self.inner.vendor.steps_done


def _parties(make_parts, behind_at: Callable[[int, int], bool], *,  # type: ignore[no-untyped-def]
             checkpointed: bool = True) -> tuple[Parties, BehindAt]:
    parties = connect(make_parts(CONFIG), config=CONFIG, n_classes=2)
    transport = BehindAt(parties.transport, behind_at, checkpointed=checkpointed)
    parties.customer.transport = transport
    return parties, transport


def _fit(parties: Parties):  # type: ignore[no-untyped-def]
    return fine_tune(parties, TEXTS, LABELS, TEXTS[:4], LABELS[:4])


def test_a_vendor_behind_now_and_then_is_followed_to_the_end(make_parts) -> None:  # type: ignore[no-untyped-def]
    """Sent back once at each of more steps than the limit: every rewind got further, so none is a stall."""
    behind_steps = range(1, MAX_REWINDS_WITHOUT_PROGRESS + 3)
    parties, _ = _parties(make_parts, lambda step, refusals: step in behind_steps and refusals == 0)
    result = _fit(parties)
    assert result.rewinds == len(behind_steps) and result.steps == 8
    assert [vars(e) for e in result.epochs] == [vars(e) for e in _fit(_parties(make_parts, lambda *_: False)[0]).epochs]


def test_a_vendor_always_behind_at_one_step_is_given_up(make_parts) -> None:  # type: ignore[no-untyped-def]
    parties, transport = _parties(make_parts, lambda step, _: step == 1)
    with pytest.raises(VendorBehindError, match="giving up"):
        _fit(parties)
    assert transport.refused == {1: MAX_REWINDS_WITHOUT_PROGRESS + 1}


def test_a_vendor_that_resumes_where_the_customer_kept_nothing_is_given_up(make_parts) -> None:  # type: ignore[no-untyped-def]
    parties, transport = _parties(make_parts, lambda step, _: step == 2, checkpointed=False)
    with pytest.raises(VendorBehindError, match="cannot resume"):
        _fit(parties)
    assert transport.refused == {2: 1}
