"""Waiting for the processor's answers (StoreWrites.answers): pure asyncio, no broker.

The answers are futures the reply channel resolves; here the test resolves them itself."""

from __future__ import annotations

import asyncio
import gc
from typing import Any, cast

import pytest

from agl_stream.config import Settings
from agl_stream.errors import AglError
from agl_stream.kafka.io import Outbox
from agl_stream.models.replies import Reply
from agl_stream.store.replies import RejectedError, ReplyChannel
from agl_stream.store.writes import StoreWrites


def _writes() -> StoreWrites:
    # answers() reads neither the outbox nor the reply channel: the futures stand for them.
    return StoreWrites(Settings(), cast(Outbox, None), cast(ReplyChannel, None), "test", lambda *_: None)


def _futures(n: int) -> list[asyncio.Future[Reply]]:
    loop = asyncio.get_running_loop()
    return [loop.create_future() for _ in range(n)]


async def test_answers_come_back_in_the_order_asked() -> None:
    replies = _futures(3)
    waiting = asyncio.create_task(_writes().answers(replies, timeout=60))
    for index in (2, 0, 1):
        replies[index].set_result(Reply(request_id=f"r{index}", outcome="applied"))
    answers = await waiting
    assert [a.request_id for a in answers] == ["r0", "r1", "r2"]


async def test_a_rejection_raises_without_waiting_for_the_other_answers() -> None:
    replies = _futures(2)
    waiting = asyncio.create_task(_writes().answers(replies, timeout=60))
    replies[1].set_exception(RejectedError("unknown rollout"))
    with pytest.raises(RejectedError, match="unknown rollout"):
        await waiting  # replies[0] never answers: the call ends on the rejection alone
    replies[0].cancel()


async def test_no_answer_in_time_is_the_stores_error() -> None:
    replies = _futures(1)
    with pytest.raises(AglError):
        await _writes().answers(replies, timeout=0.01)  # nothing ever answers it
    assert not replies[0].done()  # left for ReplyChannel.expecting to cancel


async def test_nothing_asked_is_nothing_answered() -> None:
    assert await _writes().answers([], timeout=60) == []


async def test_a_cancelled_wait_leaves_no_error_for_asyncio_to_log() -> None:
    """A runner stopped while it waits for a claim's answer: nothing "never retrieved" is left
    behind (wait_for over gather left one, which asyncio logged at shutdown)."""
    gc.collect()  # what earlier tests left for the collector is theirs: let it go before watching
    loop = asyncio.get_running_loop()
    logged: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: logged.append(context))
    try:
        replies = _futures(1)
        waiting = asyncio.create_task(_writes().answers(replies, timeout=60))
        await asyncio.sleep(0)  # let it start waiting
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        replies[0].cancel()  # what ReplyChannel.expecting does on leaving
        del waiting
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    # The defect's signature: a future holding a CancelledError nobody retrieved. Other garbage
    # collected here (an HTTP client of an earlier test closing on its closed loop) is not ours.
    assert [c for c in logged if isinstance(c.get("exception"), asyncio.CancelledError)] == []
