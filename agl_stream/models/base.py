"""Shared pieces of the wire records: the base class, statuses and JSON payload types."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, TypeAlias

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

RolloutStatus: TypeAlias = Literal["queuing", "preparing", "running", "succeeded", "failed", "cancelled", "requeuing"]
"""queuing (initial) -> preparing -> running -> succeeded, failed, cancelled; requeuing: retry."""

AttemptStatus: TypeAlias = Literal["preparing", "running", "succeeded", "failed", "unresponsive", "timeout"]
WorkerStatus: TypeAlias = Literal["idle", "busy", "unknown"]
RolloutMode: TypeAlias = Literal["train", "val", "test"]
StatusCode: TypeAlias = Literal["UNSET", "OK", "ERROR"]

Int32: TypeAlias = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
"""An Avro ``int``. Avro reads one as a varint of any length, so a damaged record can carry a
value past 32 bits that no writer could write back: refused here, at the model."""

MAX_EPOCH_SECONDS = 9_200_000_000.0
"""2261-07-18: the last second ClickHouse's DateTime64(9) can hold (nanoseconds in an Int64)."""
EpochSeconds: TypeAlias = Annotated[float, Field(ge=0.0, le=MAX_EPOCH_SECONDS, allow_inf_nan=False)]
"""A point in time as seconds since the epoch: finite, from 1970 to 2261 (NaN, infinities and
1e300 are refused with a clear error at the edge instead of failing in the engine)."""


def stored_seconds(value: float) -> float:
    """``value`` to the nearest microsecond: the time an event or state will carry once built."""
    return round(value * 1_000_000) / 1_000_000


StoredSeconds: TypeAlias = Annotated[EpochSeconds, AfterValidator(stored_seconds)]
"""A time of the store's state (rollouts, attempts, workers, resources, their events): to the
nearest microsecond, as its tables keep it (DateTime64(6); the ingest SQL rounds the same way,
in the same float arithmetic), so a time read back from ClickHouse equals the one the processor
answered with. Spans keep :data:`EpochSeconds` (their table holds nanoseconds)."""

QUEUING_STATUSES: frozenset[str] = frozenset({"queuing", "requeuing"})
RUNNING_STATUSES: frozenset[str] = frozenset({"preparing", "running"})
TERMINAL_STATUSES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})

JsonValue: TypeAlias = Any
"""Any JSON value (dict, list, str, int, float, bool, None); JSON text on the wire."""
JsonObject: TypeAlias = dict[str, Any]
"""A JSON object; JSON text on the wire."""

TYPE_KEY = "-type"
"""In the dict form, the key naming the Avro record of a value inside a union of several
records (fastavro's own convention, which its writer understands)."""

AVRO_CONTEXT: dict[str, bool] = {"avro": True}
"""Serialization context that makes union members add :data:`TYPE_KEY` (see UnionMember)."""


class AglModel(BaseModel):
    """Base of every wire record. ``avro_name`` is the full name of the mirrored Avro schema."""

    model_config = ConfigDict(extra="forbid")

    avro_name: ClassVar[str]


class UnionMember(AglModel):
    """A record that appears in an Avro union together with other records.

    Dumped with ``context=AVRO_CONTEXT`` it carries ``"-type": avro_name`` so the Avro writer
    picks the right branch; validation accepts (and checks) that key from decoded dicts.
    """

    @model_validator(mode="before")
    @classmethod
    def _strip_type_tag(cls, data: Any) -> Any:
        if isinstance(data, dict) and TYPE_KEY in data:
            tag = data[TYPE_KEY]
            if tag != cls.avro_name:
                raise ValueError(f"record tagged {tag!r} cannot be a {cls.avro_name}")
            data = {k: v for k, v in data.items() if k != TYPE_KEY}
        return data

    @model_serializer(mode="wrap")
    def _add_type_tag(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> Any:
        out = handler(self)
        context = info.context
        if isinstance(out, dict) and isinstance(context, dict) and context.get("avro"):
            out[TYPE_KEY] = self.avro_name
        return out


def union_tag(value: Any) -> str | None:
    """Pydantic discriminator for unions of UnionMember: the model's or the dict's Avro name."""
    if isinstance(value, dict):
        tag = value.get(TYPE_KEY)
        return tag if isinstance(tag, str) else None
    return getattr(value, "avro_name", None)
