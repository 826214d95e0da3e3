"""Requests to the rollout processor and its answers (``agl.store-requests``, reply topics)."""

from __future__ import annotations

from typing import ClassVar, Literal, TypeAlias

from pydantic import Field

from agl_stream.models.base import AglModel, Int32
from agl_stream.models.events import RolloutState

StoreRequestKind: TypeAlias = Literal["claim", "watch"]
ReplyOutcome: TypeAlias = Literal["applied", "rejected", "empty", "unknown", "notice"]


class StoreRequest(AglModel):
    """A claim (dequeue) or a watch, answered on ``reply_to`` (see ``schemas/StoreRequest.avsc``)."""

    avro_name: ClassVar[str] = "agl.StoreRequest"

    request_id: str
    kind: StoreRequestKind
    reply_to: str
    time: float
    worker_id: str | None = None
    wait_seconds: float = 0.0
    rollout_id: str | None = None


class Reply(AglModel):
    """The processor's answer to one writer (see ``schemas/Reply.avsc``)."""

    avro_name: ClassVar[str] = "agl.Reply"

    request_id: str
    outcome: ReplyOutcome
    state: RolloutState | None = None
    error: str | None = None
    state_partition: Int32 = -1
    state_offset: int = -1
    covered_partitions: list[Int32] = Field(default_factory=list)


class ReplyBatch(AglModel):
    """Several answers to one writer in one record (see ``schemas/ReplyBatch.avsc``): a reply
    topic carries these beside single :class:`Reply` records, and its reader takes both
    (``agl_stream.wire.reply_wire.replies_of``)."""

    avro_name: ClassVar[str] = "agl.ReplyBatch"

    replies: list[Reply] = Field(default_factory=list)
