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
    """A new rollout was enqueued."""

    avro_name: ClassVar[str] = "agl.RolloutEnqueued"

    rollout: Rollout


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
    last_heartbeat_time: float | None = None
    metadata: JsonObject | None = None
    end_time: float | None = None

    @classmethod
    def of(cls, attempt_id: str, **changes: Any) -> AttemptUpdated:
        """``AttemptUpdated.of("at-...", status="failed", end_time=t)``."""
        return cls._build({"attempt_id": attempt_id}, changes)


class AttemptHeartbeat(UnionMember):
    """An attempt is alive."""

    avro_name: ClassVar[str] = "agl.AttemptHeartbeat"

    attempt_id: str
    worker_id: str | None = None


class RolloutCancelled(UnionMember):
    """The rollout was cancelled."""

    avro_name: ClassVar[str] = "agl.RolloutCancelled"

    reason: str | None = None


class RolloutRequeued(UnionMember):
    """The rollout goes back to the queue for another attempt."""

    avro_name: ClassVar[str] = "agl.RolloutRequeued"

    reason: str = ""
    previous_attempt_id: str | None = None


class EventRejected(UnionMember):
    """An earlier event was not applied."""

    avro_name: ClassVar[str] = "agl.EventRejected"

    rejected_event_id: str
    reason: str


RolloutEventPayload: TypeAlias = Annotated[
    Annotated[RolloutEnqueued, Tag(RolloutEnqueued.avro_name)]
    | Annotated[RolloutUpdated, Tag(RolloutUpdated.avro_name)]
    | Annotated[AttemptStarted, Tag(AttemptStarted.avro_name)]
    | Annotated[AttemptUpdated, Tag(AttemptUpdated.avro_name)]
    | Annotated[AttemptHeartbeat, Tag(AttemptHeartbeat.avro_name)]
    | Annotated[RolloutCancelled, Tag(RolloutCancelled.avro_name)]
    | Annotated[RolloutRequeued, Tag(RolloutRequeued.avro_name)]
    | Annotated[EventRejected, Tag(EventRejected.avro_name)],
    Discriminator(union_tag),
]

PAYLOAD_TYPES: tuple[type[UnionMember], ...] = (
    RolloutEnqueued,
    RolloutUpdated,
    AttemptStarted,
    AttemptUpdated,
    AttemptHeartbeat,
    RolloutCancelled,
    RolloutRequeued,
    EventRejected,
)


class RolloutEvent(AglModel):
    """One fact about a rollout (topic agl.rollouts, key rollout_id)."""

    avro_name: ClassVar[str] = "agl.RolloutEvent"

    event_id: str
    rollout_id: str
    time: float
    writer: str
    payload: RolloutEventPayload
