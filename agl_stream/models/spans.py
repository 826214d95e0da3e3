"""Spans: OpenTelemetry spans tagged with their rollout, attempt and sequence id."""

from __future__ import annotations

from typing import Annotated, ClassVar, TypeAlias

from annotated_types import Ge, Le
from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr, StringConstraints

from agl_stream.models.base import AglModel, EpochSeconds, StatusCode

Int64: TypeAlias = Annotated[StrictInt, Ge(-(2**63)), Le(2**63 - 1)]
AttributeScalar: TypeAlias = StrictBool | Int64 | StrictFloat | StrictStr | None
AttributeValue: TypeAlias = AttributeScalar | list[AttributeScalar]
"""An OpenTelemetry attribute value. bool, int and float stay distinct on the wire (Avro
union branches boolean, long, double), so ``True``, ``1`` and ``1.0`` round-trip as such."""
Attributes: TypeAlias = dict[str, AttributeValue]

SPAN_ID_MAX_LENGTH = 128
TraceId: TypeAlias = Annotated[str, StringConstraints(min_length=1, max_length=SPAN_ID_MAX_LENGTH)]
SpanId: TypeAlias = Annotated[str, StringConstraints(min_length=1, max_length=SPAN_ID_MAX_LENGTH)]
"""Trace and span ids: OpenTelemetry writes 32 and 16 lower-case hex digits, and so do the
tracer and the OTLP receiver; the seed's store takes any text (its users write ``"t1"``), so
any id of 1 to 128 characters is a span's."""


class SpanContext(AglModel):
    """OpenTelemetry span context."""

    avro_name: ClassVar[str] = "agl.SpanContext"

    trace_id: TraceId
    span_id: SpanId
    is_remote: bool = False
    trace_state: dict[str, str] = Field(default_factory=dict)


class SpanStatus(AglModel):
    """OpenTelemetry span status."""

    avro_name: ClassVar[str] = "agl.SpanStatus"

    status_code: StatusCode = "UNSET"
    description: str | None = None


class SpanEvent(AglModel):
    """An event inside a span."""

    avro_name: ClassVar[str] = "agl.SpanEvent"

    name: str
    attributes: Attributes = Field(default_factory=dict)
    timestamp: EpochSeconds | None = None


class SpanLink(AglModel):
    """A link to another span."""

    avro_name: ClassVar[str] = "agl.SpanLink"

    context: SpanContext
    attributes: Attributes = Field(default_factory=dict)


class OtelResource(AglModel):
    """The OpenTelemetry resource that produced a span."""

    avro_name: ClassVar[str] = "agl.OtelResource"

    attributes: Attributes = Field(default_factory=dict)
    schema_url: str = ""


class Span(AglModel):
    """A span (topic agl.spans, key rollout_id). Times are seconds since the epoch."""

    avro_name: ClassVar[str] = "agl.Span"

    rollout_id: str
    attempt_id: str
    sequence_id: int
    trace_id: TraceId
    span_id: SpanId
    parent_id: str | None = None
    name: str
    kind: str = "INTERNAL"
    status: SpanStatus = Field(default_factory=SpanStatus)
    attributes: Attributes = Field(default_factory=dict)
    events: list[SpanEvent] = Field(default_factory=list)
    links: list[SpanLink] = Field(default_factory=list)
    start_time: EpochSeconds | None = None
    end_time: EpochSeconds | None = None
    context: SpanContext | None = None
    parent: SpanContext | None = None
    resource: OtelResource = Field(default_factory=OtelResource)
    scope_name: str = ""
    scope_version: str = ""


class SpanBatch(AglModel):
    """Spans of one attempt in one record (topic agl.spans, key rollout_id).

    Written by :func:`agl_stream.wire.span_records.span_records`; agl.spans carries these beside
    single :class:`Span` records, and every reader takes both (``span_records.spans_of``).
    """

    avro_name: ClassVar[str] = "agl.SpanBatch"

    rollout_id: str
    attempt_id: str
    spans: list[Span] = Field(default_factory=list)
