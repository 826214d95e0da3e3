"""Records on agl.spans: one ``agl.Span``, or an ``agl.SpanBatch`` of one attempt's spans (pure).

Writers send batches: :func:`span_records` turns the spans of a flush into one record per
(rollout, attempt), split where a record would pass a byte limit, keyed by rollout id (so the
topic stays co-partitioned with agl.rollouts). Single-span records written before batches (or
by other writers) stay valid: every reader takes both forms through :func:`span_dicts_of` (the
codec's dict form, for hot loops) or :func:`spans_of` (validated models). Each span's body is
written by :mod:`agl_stream.wire.span_avro` (by hand, fastavro's bytes) where it can, by the codec
otherwise.

The ClickHouse sink does not decode spans: it hands the engine Avro bodies of ``agl.SpanBatch``
and turns a single span's body into a one-span batch body with :func:`batch_body_of_span`,
byte work only (a Span starts with its rollout_id and attempt_id strings, as does a batch).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from agl_stream.errors import MalformedRecordError, RecordTypeError
from agl_stream.models import Span
from agl_stream.wire.avro_primitives import MAX_RECORD_BYTES, avro_string, zigzag
from agl_stream.wire.codec import HEADER_SIZE, Codec
from agl_stream.wire.span_avro import WRITTEN_FOR, span_body

SPAN = "agl.Span"
SPAN_BATCH = "agl.SpanBatch"


SpanRecord = tuple[str, bytes]
"""(key: the rollout id, value: the encoded record)."""

_END_OF_ARRAY = b"\x00"


def span_records(
    spans: Iterable[Span], codec: Codec | None = None, *, max_bytes: int = MAX_RECORD_BYTES
) -> list[SpanRecord]:
    """The agl.spans records for ``spans``: as :func:`span_dict_records` gives for their dict
    forms, written from the models' own fields (no ``model_dump``)."""
    return _records(spans, codec, max_bytes)


def span_dict_records(
    spans: Iterable[Mapping[str, Any]], codec: Codec | None = None, *, max_bytes: int = MAX_RECORD_BYTES
) -> list[SpanRecord]:
    """One ``agl.SpanBatch`` record per (rollout, attempt), in the order each first appears,
    its spans in their given order; a batch that would pass ``max_bytes`` is split into
    several, consecutive records (a span larger than the limit is a record of its own).

    Spans are given in the codec's dict form (as :meth:`Codec.encode_dict` takes them). Each
    span is encoded once; a record is those bodies joined under the batch's header, which is
    byte for byte what encoding the ``SpanBatch`` would give.
    """
    return _records(spans, codec, max_bytes)


def _records(spans: Iterable[Span | Mapping[str, Any]], codec: Codec | None, max_bytes: int) -> list[SpanRecord]:
    codec = codec or Codec.default()
    header = codec.contract.schema(SPAN_BATCH).header
    # The hand-written writer serves only the schema it was written for; fastavro writes
    # whatever it declines (the same bytes, or the same error as ever).
    by_hand = codec.fingerprint(SPAN) == WRITTEN_FOR
    groups: dict[tuple[str, str], list[bytes | memoryview]] = {}
    for span in spans:
        body: bytes | memoryview | None = span_body(span) if by_hand else None
        if body is None:
            datum = span.model_dump() if isinstance(span, Span) else span
            body = memoryview(codec.encode_dict(SPAN, datum))[HEADER_SIZE:]
        ids = (span.rollout_id, span.attempt_id) if isinstance(span, Span) else (span["rollout_id"], span["attempt_id"])
        groups.setdefault(ids, []).append(body)
    records: list[SpanRecord] = []
    for (rollout_id, attempt_id), bodies in groups.items():
        prefix = avro_string(rollout_id) + avro_string(attempt_id)
        fixed = len(header) + len(prefix) + len(_END_OF_ARRAY)
        for chunk in _chunks(bodies, max_bytes - fixed):
            records.append((rollout_id, b"".join((header, prefix, zigzag(len(chunk)), *chunk, _END_OF_ARRAY))))
    return records


def _chunks(bodies: Sequence[bytes | memoryview], room: int) -> list[list[bytes | memoryview]]:
    """Consecutive runs of ``bodies`` whose size plus item count (an Avro long) fit ``room``."""
    chunks: list[list[bytes | memoryview]] = []
    current: list[bytes | memoryview] = []
    size = 0
    for body in bodies:
        if current and size + len(body) + len(zigzag(len(current) + 1)) > room:
            chunks.append(current)
            current, size = [], 0
        current.append(body)
        size += len(body)
    if current:
        chunks.append(current)
    return chunks


# --------------------------------------------------------------------------------------------
# Reading both forms
# --------------------------------------------------------------------------------------------


def span_dicts_of(codec: Codec, data: bytes) -> list[dict[str, Any]]:
    """The spans of one agl.spans record in the codec's dict form, in record order.

    Raises CodecError (RecordTypeError for a record of another type) like the codec does.
    """
    name, datum = codec.decode_dict(data)
    if name == SPAN_BATCH:
        spans: list[dict[str, Any]] = datum["spans"]
        return spans
    if name == SPAN:
        return [datum]
    raise RecordTypeError(f"expected an {SPAN} or an {SPAN_BATCH}, got a {name}")


def spans_of(codec: Codec, data: bytes) -> list[Span]:
    """The spans of one agl.spans record as validated models (MalformedRecordError if one fails:
    a batch is good or bad as a whole)."""
    dicts = span_dicts_of(codec, data)
    try:
        return [Span.model_validate(datum) for datum in dicts]
    except ValidationError as exc:
        raise MalformedRecordError(f"{SPAN} does not validate: {exc}") from exc


# --------------------------------------------------------------------------------------------
# Bytes for the ClickHouse sink
# --------------------------------------------------------------------------------------------


def batch_body_of_span(body: bytes | memoryview) -> bytes:
    """The Avro body of an ``agl.SpanBatch`` holding one span, from that span's Avro body.

    No decoding: the batch starts with the span's own first two fields (rollout_id and
    attempt_id, strings), then the array of one item. MalformedRecordError if the body is too
    short to hold the two strings (anything else wrong is the engine's to find).
    """
    end = _after_string(body, _after_string(body, 0))
    return b"".join((body[:end], zigzag(1), body, _END_OF_ARRAY))


def _after_string(body: bytes | memoryview, position: int) -> int:
    """The position after the Avro string (zig-zag length, then bytes) at ``position``."""
    value, shift = 0, 0
    while True:
        if position >= len(body) or shift > 63:
            raise MalformedRecordError(f"{SPAN}: body ends inside the length of a string")
        byte = body[position]
        position += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            break
    length = (value >> 1) ^ -(value & 1)
    if length < 0 or position + length > len(body):
        raise MalformedRecordError(f"{SPAN}: a string of {length} bytes does not fit the body")
    return position + length
