"""agl_stream.retry (the backoff a runner and its tracer share) and logs.describe."""

from __future__ import annotations

import asyncio

import pytest

from agl_stream.logs import describe
from agl_stream.retry import FAILOVER, RESTART, Backoff, retrying

QUICK = Backoff(tries=3, first_s=0.0, max_s=0.0)


def test_delays_double_up_to_the_cap_and_are_only_ever_stretched() -> None:
    assert [FAILOVER.base(n) for n in (1, 2, 3, 4, 5)] == [1.0, 2.0, 4.0, 8.0, 15.0]
    assert Backoff(tries=1).delays() == []
    # A loop that never gives up (a runner's claims) waits the same way, capped for ever after.
    assert [FAILOVER.base(n) for n in (1, 2, 5, 6, 10_000)] == [1.0, 2.0, 15.0, 15.0, 15.0]
    for _ in range(200):  # jittered: at least the base (an outage is still outlasted), at most 1.5x
        delays = FAILOVER.delays()
        assert all(b <= d <= 1.5 * b for d, b in zip(delays, [1.0, 2.0, 4.0, 8.0, 15.0], strict=True))
        assert 30.0 <= sum(delays) <= 45.0
    assert Backoff(jitter=0.0).delays() == [1.0, 2.0, 4.0, 8.0, 15.0]
    with pytest.raises(ValueError, match="tries"):
        Backoff(tries=0)
    with pytest.raises(ValueError, match="jitter"):
        Backoff(jitter=-0.1)


def test_clients_that_failed_together_do_not_come_back_together() -> None:
    waits = {round(RESTART.after(3), 6) for _ in range(50)}  # 50 runners after the same outage
    assert len(waits) > 40 and all(2.0 <= w <= 3.0 for w in waits)


class Flaky:
    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "done"


async def test_transient_errors_are_tried_again_until_the_call_returns() -> None:
    call = Flaky(TimeoutError(), ConnectionError("reset"))
    assert await retrying(call, backoff=QUICK, what="calling") == "done"
    assert call.calls == 3


async def test_the_last_tries_error_is_raised() -> None:
    call = Flaky(TimeoutError(), TimeoutError(), ConnectionError("still down"), TimeoutError())
    with pytest.raises(ConnectionError, match="still down"):
        await retrying(call, backoff=QUICK, what="calling")
    assert call.calls == 3


async def test_a_final_error_is_raised_at_once() -> None:
    call = Flaky(ValueError("illegal transition"))
    with pytest.raises(ValueError, match="illegal"):
        await retrying(call, backoff=QUICK, what="calling", final=(ValueError,))
    assert call.calls == 1


async def test_cancellation_is_not_retried() -> None:
    call = Flaky(asyncio.CancelledError())  # type: ignore[arg-type]
    with pytest.raises(asyncio.CancelledError):
        await retrying(call, backoff=QUICK, what="calling")
    assert call.calls == 1


def test_describe_names_the_type_even_when_the_message_is_empty() -> None:
    assert describe(TimeoutError()) == "TimeoutError"
    assert describe(ConnectionError("reset by peer")) == "ConnectionError: reset by peer"
