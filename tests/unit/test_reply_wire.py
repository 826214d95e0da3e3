"""Replies spliced from an encoded state are the codec's bytes exactly."""

from __future__ import annotations

import pytest

from agl_stream.models import Reply, Rollout, RolloutConfig, RolloutState
from agl_stream.wire.codec import Codec
from agl_stream.wire.reply_wire import ReplyEncoder

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


@pytest.mark.parametrize(
    "reply",
    [
        Reply(request_id="r-1", outcome="applied", state=STATE, state_partition=3, state_offset=123456789),
        Reply(request_id="", outcome="notice", state=STATE, state_partition=0, state_offset=0),
        Reply(request_id="r-2", outcome="rejected", error="unknown rollout id ro-x: ünïcode"),
        Reply(request_id="r-3", outcome="empty", covered_partitions=[0, 1, 2, 63]),
        Reply(request_id="r-4", outcome="unknown"),
        Reply(request_id="r-5", outcome="applied", state_partition=1, state_offset=-1),
    ],
)
def test_spliced_replies_equal_the_codecs_encoding(reply: Reply) -> None:
    encoder = ReplyEncoder(CODEC)
    body = None if reply.state is None else encoder.state_body(CODEC.encode(reply.state))
    spliced = encoder.encode(
        reply.request_id,
        reply.outcome,
        state_body=body,
        error=reply.error,
        state_partition=reply.state_partition,
        state_offset=reply.state_offset,
        covered_partitions=reply.covered_partitions,
    )
    assert spliced == CODEC.encode(reply)
    assert CODEC.decode(spliced, Reply) == reply
