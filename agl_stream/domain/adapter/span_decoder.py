"""The adapter's input edge: agl.spans record bytes -> LeanSpans, without the codec's objects
(its output edge, TripletRecord -> bytes, is :mod:`agl_stream.domain.adapter.triplet_encoder`).

Why not the codec: fastavro builds every value of a span as a Python object (~65-150 us a span
on this 2-core box), most of it the token-id arrays (each item an Avro union, ~0.6 us an item),
and the adapter needs a few fields of each span. :class:`SpanRecordDecoder` reads an
``agl.Span`` or ``agl.SpanBatch`` body directly into
:class:`~agl_stream.domain.adapter.lean.LeanSpan` tuples: the fields the adapter reads are
decoded, everything else is stepped over (strings still checked to be UTF-8, as fastavro does;
byte runs already read, like a batch's ids and resource, compared instead of parsed), and a
token-id array is split into its varints by one ``bytes.split`` and mapped to ints through a
memo (C loops instead of one Python step per item). It is written for one schema version of
each (their fingerprints below); a test fails when they change.

It is exact or steps aside: any record it does not take whole (another schema version, an
unusual encoding, anything malformed) goes to the codec, so what is accepted, what is refused
and with which message stay the codec's (tested on corrupted records). :class:`NotFast` is how
this module and the encoder say "leave it to the codec".
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from typing import Any, cast

from agl_stream.domain.adapter.lean import (
    ADAPTER_KEYS,
    REWARD_PREFIX,
    REWARDISH_KEYS,
    LeanSpan,
    lean_attributes,
    token_ids,
)
from agl_stream.errors import MalformedRecordError
from agl_stream.models.spans import SPAN_ID_MAX_LENGTH
from agl_stream.wire.codec import HEADER_SIZE, MAGIC, Codec
from agl_stream.wire.span_records import span_dicts_of

__all__ = ["SPAN_BATCH_FINGERPRINT", "SPAN_FINGERPRINT", "NotFast", "SpanRecordDecoder", "lean_of_datum"]

SPAN = "agl.Span"
SPAN_BATCH = "agl.SpanBatch"
SPAN_FINGERPRINT = 0x482855A0550023DA
SPAN_BATCH_FINGERPRINT = 0x1B047B30BCBF0B4C
"""The schema versions the decoder reads byte by byte (schemas/Span.avsc, SpanBatch.avsc today)."""


_STATUS_CODES = 3  # agl.StatusCode symbols
_unpack_double = struct.Struct("<d").unpack_from


class NotFast(Exception):
    """The fast path does not take this record; the codec decides."""


# --------------------------------------------------------------------------------------------
# Reading: primitives (IndexError/struct.error on truncation also mean "not fast")
# --------------------------------------------------------------------------------------------


def _long(data: bytes, pos: int) -> tuple[int, int]:
    byte = data[pos]
    if byte < 0x80:
        return (byte >> 1) ^ -(byte & 1), pos + 1
    value = byte & 0x7F
    shift = 7
    pos += 1
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            break
        shift += 7
        if shift > 63:
            raise NotFast  # longer than any long: fastavro's overflow, from the codec path
    if value >> 64:
        raise NotFast
    return (value >> 1) ^ -(value & 1), pos


def _span_of(data: bytes, pos: int) -> tuple[int, int]:
    """(start, end) of the string or bytes at ``pos``."""
    size, pos = _long(data, pos)
    end = pos + size
    if size < 0 or end > len(data):
        raise NotFast
    return pos, end


def _text(data: bytes, pos: int) -> tuple[str, int]:
    start, end = _span_of(data, pos)
    return data[start:end].decode(), end


def _skip_text(data: bytes, pos: int, unchecked: list[bytes]) -> int:
    """Step over a string; its bytes go to ``unchecked`` (validated as UTF-8 in one call)."""
    start, end = _span_of(data, pos)
    text = data[start:end]
    if not text.isascii():
        unchecked.append(text)
    return end


def _double(data: bytes, pos: int) -> tuple[float, int]:
    return _unpack_double(data, pos)[0], pos + 8


# --------------------------------------------------------------------------------------------
# Reading: arrays of the attribute item union [long, double, string, boolean, null]
# --------------------------------------------------------------------------------------------

_VARINT_VALUES: dict[bytes, int] = {}
"""Memo: the bytes of a varint (up to 9) -> its zig-zag value. Token ids repeat, so after the
first few arrays almost every id is found here, in a C loop."""
_VARINT_MEMO_MAX = 1 << 18
_EVEN = bytes(range(0, 256, 2))
_HALF = bytes(b >> 1 for b in range(256))


def _longs(data: bytes, pos: int, count: int) -> tuple[list[int], int] | None:
    """``count`` items that are all of the long branch (token ids); None if they are not.
    Non-negative ids read on the fast paths come as :class:`TokenIds` (with their varints).

    Each item is a union index 0 (the byte 00) then a varint, which holds no 00 byte unless it
    is the value 0. So splitting on 00 gives the varints themselves, and the memo maps them to
    values; a piece the memo does not know (a new id, a 0, another branch) sends the array
    through the item by item reader, which teaches the memo.
    """
    seg = data[pos : pos + 2 * count]
    values = seg[1::2]
    if len(seg) == 2 * count and values.isascii() and seg[0::2].count(0) == count:
        # Every value one byte (ids < 64): halve them when none is negative (odd).
        if not values.translate(None, _EVEN):
            return token_ids(values.translate(_HALF), values), pos + 2 * count
    window = data[pos : pos + 4 * count + 2]
    pieces = window.split(b"\x00", count + 1)
    if len(pieces) == count + 2 and not pieces[0]:
        rest = len(pieces[-1]) + 1  # the separator after the last varint is not the array's
        del pieces[0], pieces[count:]
        found = list(map(_VARINT_VALUES.get, pieces))
        if None not in found:
            ints = cast("list[int]", found)
            end = pos + len(window) - rest
            if min(ints) >= 0:
                # The memo's varints hold no 00 byte, so each is the minimal one fastavro writes.
                return token_ids(ints, b"".join(pieces)), end
            return ints, end
    return _longs_one_by_one(data, pos, count)


def _longs_one_by_one(data: bytes, pos: int, count: int) -> tuple[list[int], int] | None:
    if len(_VARINT_VALUES) > _VARINT_MEMO_MAX:
        _VARINT_VALUES.clear()
    memo = _VARINT_VALUES
    out: list[int] = []
    for _ in range(count):
        if data[pos] != 0:
            return None  # an item of another branch
        start = pos + 1
        value, pos = _long(data, start)
        if value:  # 0 is the one value whose varint is the separator byte itself
            memo[data[start:pos]] = value
        out.append(value)
    return out, pos


def _item(data: bytes, pos: int, unchecked: list[bytes] | None) -> tuple[Any, int]:
    branch = data[pos]
    pos += 1
    if branch == 0:  # long
        return _long(data, pos)
    if branch == 2:  # double
        return _double(data, pos)
    if branch == 4:  # string
        if unchecked is None:
            return _text(data, pos)
        return None, _skip_text(data, pos, unchecked)
    if branch == 6:  # boolean: fastavro takes any non-zero byte as true
        return data[pos] != 0, pos + 1
    if branch == 8:  # null
        return None, pos
    raise NotFast


def _array(data: bytes, pos: int, unchecked: list[bytes] | None) -> tuple[list[Any], int]:
    """An array of the item union; ``unchecked`` given: stepped over (strings set aside)."""
    count, start = _long(data, pos)
    if count > 0:  # the usual: token ids, one block of longs, then the end
        got = _longs(data, start, count)
        if got is not None and data[got[1]] == 0:
            return got[0], got[1] + 1
    out: list[Any] = []
    count, pos = _long(data, pos)
    while count:
        if count < 0:
            count = -count
            _, pos = _long(data, pos)  # block size in bytes
        got = _longs(data, pos, count)
        if got is not None:
            items, pos = got
            out += items
        else:
            for _ in range(count):
                item, pos = _item(data, pos, unchecked)
                out.append(item)
        count, pos = _long(data, pos)
    return out, pos


def _value(data: bytes, pos: int) -> tuple[Any, int]:
    """An attribute value: union [string, long, double, boolean, null, array]."""
    branch = data[pos]
    pos += 1
    if branch == 0:
        byte = data[pos]
        if byte < 0x80 and not byte & 1:  # a short string
            end = pos + 1 + (byte >> 1)
            return data[pos + 1 : end].decode(), end
        return _text(data, pos)
    if branch == 2:
        return _long(data, pos)
    if branch == 4:
        return _double(data, pos)
    if branch == 6:
        return data[pos] != 0, pos + 1
    if branch == 8:
        return None, pos
    if branch == 10:
        return _array(data, pos, None)
    raise NotFast


def _skip_value(data: bytes, pos: int, unchecked: list[bytes]) -> int:
    branch = data[pos]
    pos += 1
    if branch == 0:
        return _skip_text(data, pos, unchecked)
    if branch == 2:
        return _long(data, pos)[1]
    if branch == 4:
        if pos + 8 > len(data):
            raise NotFast
        return pos + 8
    if branch == 6:
        data[pos]
        return pos + 1
    if branch == 8:
        return pos
    if branch == 10:
        return _array(data, pos, unchecked)[1]
    raise NotFast


_Step = Callable[[bytes, int, list[bytes]], int]
"""Steps over one value at a position: (data, position, strings to check) -> position after it."""

_KEYS = {key.encode(): key for key in ADAPTER_KEYS}
_REWARDISH = frozenset(key.encode() for key in REWARDISH_KEYS)
_REWARD_PREFIX = REWARD_PREFIX.encode()


def _attributes(data: bytes, pos: int, unchecked: list[bytes]) -> tuple[dict[str, Any], bool, int]:
    """The adapter's attributes of a span's map (see lean.is_adapter_key), stepping over the rest.

    The common encodings (one-byte lengths and counts) are read inline: a function call per
    field was most of the cost.
    """
    kept: dict[str, Any] = {}
    rewardish = False
    keys = _KEYS
    count, pos = _long(data, pos)
    while count:
        if count < 0:
            count = -count
            _, pos = _long(data, pos)
        for _ in range(count):
            byte = data[pos]
            if byte < 0x80 and not byte & 1:
                start, end = pos + 1, pos + 1 + (byte >> 1)
            else:
                start, end = _span_of(data, pos)
            raw = data[start:end]
            key = keys.get(raw)
            if key is None:
                if not raw.startswith(_REWARD_PREFIX):
                    if not raw.isascii():
                        unchecked.append(raw)
                    byte = data[end + 1]
                    if data[end] == 0 and byte < 0x80 and not byte & 1:  # a short string: the usual
                        start, pos = end + 2, end + 2 + (byte >> 1)
                        if not data[start:pos].isascii():
                            unchecked.append(data[start:pos])
                    else:
                        pos = _skip_value(data, end, unchecked)
                    continue
                key = raw.decode()
                rewardish = True
            elif raw in _REWARDISH:
                rewardish = True
            kept[key], pos = _value(data, end)
        count, pos = _long(data, pos)
    return kept, rewardish, pos


def _skip_map(data: bytes, pos: int, unchecked: list[bytes], values: _Step) -> int:
    count, pos = _long(data, pos)
    while count:
        if count < 0:
            count = -count
            _, pos = _long(data, pos)
        for _ in range(count):
            pos = values(data, _skip_text(data, pos, unchecked), unchecked)
        count, pos = _long(data, pos)
    return pos


_CONTEXT = re.compile(rb"\x02\x40[0-9a-f]{32}\x20[0-9a-f]{16}[\x00\x01]\x00")
"""[null, agl.SpanContext] holding a context with hex ids and no trace state: the usual one."""


def _skip_context(data: bytes, pos: int, unchecked: list[bytes]) -> int:
    """agl.SpanContext: trace_id, span_id, is_remote, trace_state (map of strings)."""
    pos = _skip_text(data, _skip_text(data, pos, unchecked), unchecked)
    data[pos]
    return _skip_map(data, pos + 1, unchecked, _skip_text)


def _skip_optional_context(data: bytes, pos: int, unchecked: list[bytes]) -> int:
    branch = data[pos]
    if branch == 0:
        return pos + 1
    if branch != 2:
        raise NotFast
    found = _CONTEXT.match(data, pos)
    return found.end() if found is not None else _skip_context(data, pos + 1, unchecked)


def _skip_records(data: bytes, pos: int, unchecked: list[bytes], record: _Step) -> int:
    count, pos = _long(data, pos)
    while count:
        if count < 0:
            count = -count
            _, pos = _long(data, pos)
        for _ in range(count):
            pos = record(data, pos, unchecked)
        count, pos = _long(data, pos)
    return pos


def _skip_event(data: bytes, pos: int, unchecked: list[bytes]) -> int:
    """agl.SpanEvent: name, attributes, timestamp [null, double]."""
    pos = _skip_map(data, _skip_text(data, pos, unchecked), unchecked, _skip_value)
    return _optional_double(data, pos)[1]


def _skip_link(data: bytes, pos: int, unchecked: list[bytes]) -> int:
    """agl.SpanLink: context, attributes."""
    return _skip_map(data, _skip_context(data, pos, unchecked), unchecked, _skip_value)


def _optional_double(data: bytes, pos: int) -> tuple[float | None, int]:
    branch = data[pos]
    if branch == 0:
        return None, pos + 1
    if branch == 2:
        return _unpack_double(data, pos + 1)[0], pos + 9
    raise NotFast


_IDS = re.compile(rb"\x40[0-9a-f]{32}\x20([0-9a-f]{16})")
"""trace_id and span_id as OpenTelemetry writes them (32 and 16 hex digits): the usual case,
read inline; any other id goes the codec's way (lean_of_datum)."""
_unpack_times = struct.Struct("<dxd").unpack_from  # start_time, branch, end_time


_new_tuple = tuple.__new__  # LeanSpan(...) without the Python-level __new__ of a NamedTuple


class _Memo:
    """Byte runs already read in this decoder: a span of a batch repeats its batch's rollout
    and attempt ids and, usually, the resource and scope of the spans before it. The same bytes
    read the same way, so a run that matches is stepped over in one comparison."""

    __slots__ = ("attempt_id", "head", "rollout_id", "tail")

    def __init__(self) -> None:
        self.head = b"\xff"  # never a valid start
        self.rollout_id = ""
        self.attempt_id = ""
        self.tail = b"\xff"


def _span(data: bytes, pos: int, unchecked: list[bytes], memo: _Memo) -> tuple[LeanSpan, int]:
    """One agl.Span body, fields in schema order; the usual encodings inline."""
    head = memo.head
    if data.startswith(head, pos):
        rollout_id, attempt_id = memo.rollout_id, memo.attempt_id
        pos += len(head)
    else:
        start = pos
        rollout_id, pos = _text(data, pos)
        attempt_id, pos = _text(data, pos)
        memo.head, memo.rollout_id, memo.attempt_id = data[start:pos], rollout_id, attempt_id
    byte = data[pos]
    if byte < 0x80:
        sequence_id = (byte >> 1) ^ -(byte & 1)
        pos += 1
    else:
        sequence_id, pos = _long(data, pos)
    ids = _IDS.match(data, pos)
    if ids is None:
        raise NotFast  # span_view's error or acceptance, from the codec path
    span_id = ids[1].decode()
    pos += 50
    branch = data[pos]
    if branch == 0:
        parent_id = None
        pos += 1
    elif branch == 2:
        parent_id, pos = _text(data, pos + 1)
    else:
        raise NotFast
    byte = data[pos]
    if byte < 0x80 and not byte & 1:
        end = pos + 1 + (byte >> 1)
        name = data[pos + 1 : end].decode()
        pos = end
    else:
        name, pos = _text(data, pos)
    byte = data[pos]  # kind
    if byte < 0x80 and not byte & 1:
        end = pos + 1 + (byte >> 1)
        if not data[pos + 1 : end].isascii():
            unchecked.append(data[pos + 1 : end])
        pos = end
    else:
        pos = _skip_text(data, pos, unchecked)
    if data[pos] not in (0, 2, 4):  # status: status_code (one of 3 symbols), description [null, string]
        raise NotFast
    branch = data[pos + 1]
    if branch == 0:
        pos += 2
    elif branch == 2:
        pos = _skip_text(data, pos + 2, unchecked)
    else:
        raise NotFast
    attributes, rewardish, pos = _attributes(data, pos, unchecked)
    if data[pos] == 0 and data[pos + 1] == 0:  # no events, no links
        pos += 2
    else:
        pos = _skip_records(data, pos, unchecked, _skip_event)
        pos = _skip_records(data, pos, unchecked, _skip_link)
    if data[pos] == 2 and data[pos + 9] == 2:
        start_time, end_time = _unpack_times(data, pos + 1)
        pos += 18
    else:
        start_time, pos = _optional_double(data, pos)
        end_time, pos = _optional_double(data, pos)
    pos = _skip_optional_context(data, pos, unchecked)  # context
    pos = _skip_optional_context(data, pos, unchecked)  # parent
    tail = memo.tail
    if data.startswith(tail, pos):  # resource (attributes, schema_url), scope_name, scope_version
        pos += len(tail)
    else:
        start = pos
        pos = _skip_map(data, pos, unchecked, _skip_value)
        for _ in range(3):
            pos = _skip_text(data, pos, unchecked)
        if pos <= len(data) and data[start:pos].isascii():  # only runs known to be UTF-8 are reused
            memo.tail = data[start:pos]
    fields = (rollout_id, attempt_id, sequence_id, span_id, parent_id, name, start_time, end_time)
    return _new_tuple(LeanSpan, (*fields, attributes, rewardish)), pos


def _fast(data: bytes, batch: bool, memo: _Memo) -> list[LeanSpan]:
    unchecked: list[bytes] = []
    spans: list[LeanSpan] = []
    pos = HEADER_SIZE
    if batch:
        pos = _skip_text(data, _skip_text(data, pos, unchecked), unchecked)  # the batch's rollout and attempt
        count, pos = _long(data, pos)
        while count:
            if count < 0:
                count = -count
                _, pos = _long(data, pos)
            for _ in range(count):
                span, pos = _span(data, pos, unchecked, memo)
                spans.append(span)
            count, pos = _long(data, pos)
    else:
        span, pos = _span(data, pos, unchecked, memo)
        spans.append(span)
    if pos != len(data):
        raise NotFast
    if unchecked:
        # What fastavro would have decoded: one UTF-8 check for all of it. The separator
        # (ASCII) keeps a sequence cut at the end of one string from completing in the next.
        b"\n".join(unchecked).decode()
    return spans


# --------------------------------------------------------------------------------------------
# The decoder
# --------------------------------------------------------------------------------------------


def _checked_id(datum: dict[str, Any], name: str) -> str:
    value = datum.get(name)
    if not isinstance(value, str) or not 0 < len(value) <= SPAN_ID_MAX_LENGTH:
        raise MalformedRecordError(f"agl.Span: {name} {str(value)[:64]!r} is not 1 to {SPAN_ID_MAX_LENGTH} characters")
    return value


def lean_of_datum(datum: dict[str, Any]) -> LeanSpan:
    """A LeanSpan of a decoded agl.Span dict (the codec's dict form), with the model's checks
    of the ids (models.spans.TraceId: 1 to 128 characters); the Avro schema guarantees every
    type."""
    _checked_id(datum, "trace_id")
    span_id = _checked_id(datum, "span_id")
    attributes, rewardish = lean_attributes(datum["attributes"])
    return LeanSpan(
        datum["rollout_id"],
        datum["attempt_id"],
        datum["sequence_id"],
        span_id,
        datum["parent_id"],
        datum["name"],
        datum["start_time"],
        datum["end_time"],
        attributes,
        rewardish,
    )


class SpanRecordDecoder:
    """agl.spans record bytes -> the LeanSpans in it, in record order.

    Raises CodecError like the codec does (RecordTypeError for a record of another type,
    MalformedRecordError for ids the Span model refuses): a record is good or bad as a
    whole.
    """

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        current = (codec.fingerprint(SPAN), codec.fingerprint(SPAN_BATCH))
        # Written for these schema versions; any other current schema turns the fast path off.
        self.fast = current == (SPAN_FINGERPRINT, SPAN_BATCH_FINGERPRINT)
        self.fast_records = 0
        self.codec_records = 0
        self._memo = _Memo()

    def decode(self, data: bytes) -> list[LeanSpan]:
        if self.fast and len(data) > HEADER_SIZE and data[:2] == MAGIC:
            fingerprint = int.from_bytes(data[2:HEADER_SIZE], "little")
            if fingerprint == SPAN_BATCH_FINGERPRINT or fingerprint == SPAN_FINGERPRINT:
                try:
                    spans = _fast(data, fingerprint == SPAN_BATCH_FINGERPRINT, self._memo)
                except (NotFast, IndexError, struct.error, UnicodeDecodeError):
                    pass
                else:
                    self.fast_records += 1
                    return spans
        self.codec_records += 1
        return self.slow(data)

    def slow(self, data: bytes) -> list[LeanSpan]:
        """Through the codec (any schema version it knows; its errors)."""
        return [lean_of_datum(datum) for datum in span_dicts_of(self.codec, data)]
