"""Rollout aggregate events (topic agl.rollouts): an envelope and its payload records.

Partial updates keep the seed's "unset" semantics on the wire: every changeable field is
nullable and ``set_fields`` lists the fields the event sets, so "set to null" and "leave
unchanged" differ. Build them with :meth:`RolloutUpdated.of` / :meth:`AttemptUpdated.of` and
read them with ``changes()``.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, TypeAlias

from pydantic import Discriminator, Field, Tag, model_validator
from typing_extensions import Self

from agl_stream.models.base import (
    AglModel,
    AttemptStatus,
    JsonObject,
    JsonValue,
    RolloutMode,
    RolloutStatus,
    StoredSeconds,
    UnionMember,
    union_tag,
)
from agl_stream.models.rollouts import Attempt, Rollout, RolloutConfig


class _PartialUpdate(UnionMember):
    """Shared logic of events that set some fields of an entity."""

    updatable: ClassVar[tuple[str, ...]]
    """Fields the event may set, in schema order."""
    not_nullable: ClassVar[frozenset[str]] = frozenset()
    """Fields that may be set, but not to null."""

    set_fields: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check_set_fields(self) -> Self:
        unknown = [name for name in self.set_fields if name not in self.updatable]
        if unknown:
            raise ValueError(f"set_fields names fields this event cannot set: {unknown}")
        if len(set(self.set_fields)) != len(self.set_fields):
            raise ValueError(f"set_fields repeats a field: {self.set_fields}")
        for name in self.updatable:
            value = getattr(self, name)
            if name in self.set_fields:
                if value is None and name in self.not_nullable:
                    raise ValueError(f"{name} is in set_fields but null; it cannot be null")
            elif value is not None:
                raise ValueError(f"{name} has a value but is not in set_fields")
        return self

    @classmethod
    def _build(cls, fixed: dict[str, Any], changes: dict[str, Any]) -> Self:
        order = [name for name in cls.updatable if name in changes]
        unknown = sorted(set(changes) - set(cls.updatable))
        if unknown:
            raise ValueError(f"{cls.__name__} cannot set {unknown}")
        return cls(**fixed, **changes, set_fields=order)

    def changes(self) -> dict[str, Any]:
        """The fields this event sets, with their new values (``None`` means set to null)."""
        return {name: getattr(self, name) for name in self.set_fields}


class RolloutEnqueued(UnionMember):
    """A new rollout was enqueued; with ``attempt`` it starts at once (start_rollout)."""

    avro_name: ClassVar[str] = "agl.RolloutEnqueued"

    rollout: Rollout
    attempt: Attempt | None = None


class RolloutUpdated(_PartialUpdate):
    """Some fields of a rollout were changed."""

    avro_name: ClassVar[str] = "agl.RolloutUpdated"
    updatable: ClassVar[tuple[str, ...]] = (
        "input",
        "mode",
        "resources_id",
        "status",
        "config",
        "metadata",
    )
    not_nullable: ClassVar[frozenset[str]] = frozenset({"status", "config"})

    input: JsonValue = None
    mode: RolloutMode | None = None
    resources_id: str | None = None
    status: RolloutStatus | None = None
    config: RolloutConfig | None = None
    metadata: JsonObject | None = None

    @classmethod
    def of(cls, **changes: Any) -> RolloutUpdated:
        """``RolloutUpdated.of(status="running")``: set_fields follows from the arguments."""
        return cls._build({}, changes)


class AttemptStarted(UnionMember):
    """A worker started a new attempt."""

    avro_name: ClassVar[str] = "agl.AttemptStarted"

    attempt: Attempt
    worker_id: str | None = None
    manual: bool = False


class AttemptUpdated(_PartialUpdate):
    """Some fields of an attempt were changed."""

    avro_name: ClassVar[str] = "agl.AttemptUpdated"
    updatable: ClassVar[tuple[str, ...]] = (
        "status",
        "worker_id",
        "last_heartbeat_time",
        "metadata",
        "end_time",
    )
    not_nullable: ClassVar[frozenset[str]] = frozenset({"status"})

    attempt_id: str
    status: AttemptStatus | None = None
    worker_id: str | None = None
    last_heartbeat_time: StoredSeconds | None = None
    metadata: JsonObject | None = None
    end_time: StoredSeconds | None = None

    @classmethod
    def of(cls, attempt_id: str, **changes: Any) -> AttemptUpdated:
        """``AttemptUpdated.of("at-...", status="failed", end_time=t)``."""
        return cls._build({"attempt_id": attempt_id}, changes)


class AttemptHeartbeat(UnionMember):
    """An attempt is alive."""

    avro_name: ClassVar[str] = "agl.AttemptHeartbeat"

    attempt_id: str
    worker_id: str | None = None
    span_count: int = 0
    max_sequence_id: int | None = None


class RolloutCancelled(UnionMember):
    """The rollout was cancelled."""

    avro_name: ClassVar[str] = "agl.RolloutCancelled"

    reason: str | None = None


class SpanSequenceRequested(UnionMember):
    """Reserve ``count`` span sequence ids of an attempt; the reply state names the first.

    With ``span_count`` > 0 it is also the heartbeat of that many spans about to be written
    (numbered with these ids, or by the writer up to ``max_sequence_id``), folded as the
    AttemptHeartbeat with those fields would be."""

    avro_name: ClassVar[str] = "agl.SpanSequenceRequested"

    attempt_id: str
    count: int = Field(default=1, ge=1)
    span_count: int = Field(default=0, ge=0)
    max_sequence_id: int | None = None


class WatchdogFired(UnionMember):
    """An attempt is over its time budget or silent; void if a newer heartbeat arrived."""

    avro_name: ClassVar[str] = "agl.WatchdogFired"

    attempt_id: str
    status: AttemptStatus
    observed_heartbeat_time: StoredSeconds | None = None


RolloutEventPayload: TypeAlias = Annotated[
    Annotated[RolloutEnqueued, Tag(RolloutEnqueued.avro_name)]
    | Annotated[RolloutUpdated, Tag(RolloutUpdated.avro_name)]
    | Annotated[AttemptStarted, Tag(AttemptStarted.avro_name)]
    | Annotated[AttemptUpdated, Tag(AttemptUpdated.avro_name)]
    | Annotated[AttemptHeartbeat, Tag(AttemptHeartbeat.avro_name)]
    | Annotated[RolloutCancelled, Tag(RolloutCancelled.avro_name)]
    | Annotated[SpanSequenceRequested, Tag(SpanSequenceRequested.avro_name)]
    | Annotated[WatchdogFired, Tag(WatchdogFired.avro_name)],
    Discriminator(union_tag),
]

PAYLOAD_TYPES: tuple[type[UnionMember], ...] = (
    RolloutEnqueued,
    RolloutUpdated,
    AttemptStarted,
    AttemptUpdated,
    AttemptHeartbeat,
    RolloutCancelled,
    SpanSequenceRequested,
    WatchdogFired,
)


class RolloutEvent(AglModel):
    """One fact about a rollout (topic agl.rollouts, key rollout_id)."""

    avro_name: ClassVar[str] = "agl.RolloutEvent"

    event_id: str
    rollout_id: str
    time: StoredSeconds
    writer: str
    payload: RolloutEventPayload


class RolloutState(AglModel):
    """A rollout after the processor folded events (topic agl.rollout-state, compacted).

    The processor's changelog and the feed of the rollouts and attempts tables; writers get
    their answers as :class:`~agl_stream.models.replies.Reply` records on their own topic.
    """

    avro_name: ClassVar[str] = "agl.RolloutState"

    rollout: Rollout
    attempts: list[Attempt] = Field(default_factory=list)
    version: int
    cause_event_id: str
    cause_time: StoredSeconds
    next_sequence_ids: dict[str, int] = Field(default_factory=dict)
    reserved_sequence_id: int | None = None
    finished_time: StoredSeconds | None = None
    input_offset: int = -1
    span_counts: dict[str, int] = Field(default_factory=dict)
    watchers: list[str] = Field(default_factory=list)
