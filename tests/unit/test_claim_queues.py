"""What a store client's polls know of the processors' queues (ClaimQueues), and how its reply
channel tells it: pure asyncio, no broker. The test plays the reply channel and the polls."""

from __future__ import annotations

import pytest

from agl_stream.config import Settings
from agl_stream.models import Rollout
from agl_stream.models.events import RolloutState
from agl_stream.models.replies import Reply
from agl_stream.store import notices
from agl_stream.store.notices import ClaimQueues
from agl_stream.store.replies import ReplyChannel

PARTITIONS = [0, 1]


@pytest.fixture(autouse=True)
def _marks_do_not_expire(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the polls know expires after 1 s; a stalled busy machine must not make it expire
    in the middle of a test."""
    monkeypatch.setattr(notices, "EMPTY_TTL_S", 3600.0)


def _state() -> RolloutState:
    rollout = Rollout.model_validate({"rollout_id": "ro-1", "input": {}, "start_time": 1.0, "status": "preparing"})
    return RolloutState(rollout=rollout, version=1, cause_event_id="ev-1", cause_time=1.0)


def _served(covered: list[int]) -> Reply:
    return Reply(request_id="claim-1", outcome="applied", state=_state(), covered_partitions=covered)


async def test_an_empty_answer_makes_polls_skip_its_partitions_until_a_notice_of_work() -> None:
    queues = ClaimQueues()
    queues.on_queue(Reply(request_id="claim-0", outcome="empty", covered_partitions=[0]))
    queues.answered(0, found_work=False)
    assert await queues.skipped(PARTITIONS) == {0}
    queues.on_queue(Reply(request_id="", outcome="notice", covered_partitions=[0]))
    assert await queues.skipped(PARTITIONS) == set()  # this poll asks
    assert await queues.skipped(PARTITIONS) == {0}  # one poll, not every idle runner


async def test_a_rollout_that_emptied_the_queue_leaves_its_partitions_skipped() -> None:
    """The claimer's other idle runners do not each ask to learn what the answer said."""
    queues = ClaimQueues()
    queues.on_queue(_served([0, 1]))
    queues.answered(0, found_work=True, left_empty=True)
    assert await queues.skipped(PARTITIONS) == {0, 1}


async def test_a_rollout_with_more_queued_makes_every_poll_ask() -> None:
    queues = ClaimQueues()
    queues.on_queue(Reply(request_id="claim-0", outcome="empty", covered_partitions=[0, 1]))
    queues.on_queue(_served([]))  # (the channel does not pass it on: it names no partitions)
    queues.answered(1, found_work=True, left_empty=False)
    assert await queues.skipped(PARTITIONS) == set()


async def test_a_notice_heard_before_the_poll_reads_its_answer_is_not_undone() -> None:
    """The channel hears replies in order; the poll that waited for the answer resumes later,
    maybe after the notice that work was queued again: that notice still wakes a poll."""
    queues = ClaimQueues()
    queues.on_queue(_served([0]))
    queues.on_queue(Reply(request_id="", outcome="notice", covered_partitions=[0]))
    queues.answered(0, found_work=True, left_empty=True)
    assert 0 not in await queues.skipped([0])


def test_the_reply_channel_passes_on_the_answers_and_notices_that_name_queues() -> None:
    channel = ReplyChannel(Settings(), "client-1")
    heard: list[Reply] = []
    channel.on_queue = heard.append
    finished = Reply(request_id="", outcome="notice", state=_state(), covered_partitions=[])
    named = [
        Reply(request_id="claim-0", outcome="empty", covered_partitions=[0]),
        _served([0]),
        Reply(request_id="", outcome="notice", covered_partitions=[0]),
    ]
    for reply in [finished, _served([]), *named]:
        channel._on_reply(reply)
    assert heard == named
