"""Replies spliced from an encoded state are the codec's bytes exactly, alone or batched."""

from __future__ import annotations

import pytest

from agl_stream.errors import RecordTypeError
from agl_stream.models import Reply, ReplyBatch, Rollout, RolloutConfig, RolloutState
from agl_stream.wire.codec import Codec
from agl_stream.wire.reply_wire import ReplyEncoder, replies_of

CODEC = Codec.default()
STATE = RolloutState(
    rollout=Rollout(
        rollout_id="ro-0123456789ab",
        input={"q": "2+2", "ü": [1, 2.5, None]},
        start_time=1.5,
        status="queuing",
        config=RolloutConfig(),
    ),
    version=3,
    cause_event_id="e-1",
    cause_time=2.0,
    watchers=["agl.replies.client-1"],
)


REPLIES = [
    Reply(request_id="r-1", outcome="applied", state=STATE, state_partition=3, state_offset=123456789),
    Reply(request_id="", outcome="notice", state=STATE, state_partition=0, state_offset=0),
    Reply(request_id="r-2", outcome="rejected", error="unknown rollout id ro-x: ünïcode"),
    Reply(request_id="r-3", outcome="empty", covered_partitions=[0, 1, 2, 63]),
    Reply(request_id="r-4", outcome="unknown"),
    Reply(request_id="r-5", outcome="applied", state_partition=1, state_offset=-1),
]
ENCODER = ReplyEncoder(CODEC)


def _body(reply: Reply) -> bytes:
    return ENCODER.body(
        reply.request_id,
        reply.outcome,
        state_body=None if reply.state is None else ENCODER.state_body(CODEC.encode(reply.state)),
        error=reply.error,
        state_partition=reply.state_partition,
        state_offset=reply.state_offset,
        covered_partitions=reply.covered_partitions,
    )


@pytest.mark.parametrize("reply", REPLIES)
def test_spliced_replies_equal_the_codecs_encoding(reply: Reply) -> None:
    spliced = ENCODER.header + _body(reply)
    assert spliced == CODEC.encode(reply)
    assert CODEC.decode(spliced, Reply) == reply
    assert ENCODER.records([_body(reply)]) == [spliced]  # one answer: a plain agl.Reply
    assert replies_of(CODEC, spliced) == [reply]


def test_answers_to_one_writer_go_as_one_batch_in_order() -> None:
    [record] = ENCODER.records([_body(r) for r in REPLIES])
    assert record == CODEC.encode(ReplyBatch(replies=REPLIES))
    assert replies_of(CODEC, record) == REPLIES


@pytest.mark.parametrize("limit", [1, 200, 400, 1_000, 10_000])
def test_batches_stay_under_the_record_limit_and_keep_the_order(limit: int) -> None:
    bodies = [_body(r) for r in REPLIES * 3]
    records = ENCODER.records(bodies, limit=limit)
    assert [reply for record in records for reply in replies_of(CODEC, record)] == REPLIES * 3
    for record in records:
        # Over the limit only as a lone answer, which goes as it always went.
        assert len(record) <= limit or len(replies_of(CODEC, record)) == 1
    if limit == 1:
        assert len(records) == len(bodies)  # nothing fits: each answer alone
    if limit == 10_000:
        assert len(records) == 1
    assert ENCODER.records([]) == []


def test_a_record_of_another_type_on_a_reply_topic_is_refused_typed() -> None:
    with pytest.raises(RecordTypeError, match=r"agl\.Reply or an agl\.ReplyBatch"):
        replies_of(CODEC, CODEC.encode(STATE))
