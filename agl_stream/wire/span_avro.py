"""The Avro body of an ``agl.Span``, written by hand for the one schema it is (pure).

Why not fastavro: it resolves every union value by validating the value against the branches
in turn, and a span is mostly unions (each attribute value, the optional times, ids and
contexts). Measured on this machine, fastavro takes ~15 us for an empty span and ~60 us for a
2.5 KB LLM-call span, most of the runner's CPU per span; this writer takes a few
microseconds (``benchmarks/span_encode.py``).

The bytes are fastavro's, byte for byte: the same field order, the same block encoding of
maps and arrays (one block with its count, then 0; an empty one is the single 0), and the
same union branches (for an attribute value: string, long, double, boolean, null or the
array; for an array item: long, double, string, boolean, null). The writer handles exactly
the values whose branch is certain from their Python type (``type(v) is int``, not
``isinstance``: subclasses such as ``bool`` or numpy scalars are not certain) and returns
``None`` for anything else, and the caller then lets fastavro write the span: the same bytes,
or the same error, as before this writer existed. It is tied to the schema it was written
for: :data:`WRITTEN_FOR` is that schema's fingerprint, and the caller uses the writer only
while the codec's current ``agl.Span`` has it (a test fails when the schema changes, so the
writer is changed with it).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from agl_stream.wire.avro_primitives import zigzag

WRITTEN_FOR = 0x482855A0550023DA
"""Fingerprint (CRC-64-AVRO of the Parsing Canonical Form) of the ``agl.Span`` this writes."""

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_STATUS_CODES = {"UNSET": b"\x00", "OK": b"\x02", "ERROR": b"\x04"}  # enum symbol index
_pack_double = struct.Struct("<d").pack

# Union branch indexes (zig-zag) of an attribute value: string, long, double, boolean, null, array.
_V_STRING, _V_LONG, _V_DOUBLE, _V_NULL, _V_ARRAY = b"\x00", b"\x02", b"\x04", b"\x08", b"\x0a"
_V_TRUE, _V_FALSE = b"\x06\x01", b"\x06\x00"
# ... and of an array item: long, double, string, boolean, null.
_I_LONG, _I_DOUBLE, _I_STRING, _I_NULL = b"\x00", b"\x02", b"\x04", b"\x08"
_I_TRUE, _I_FALSE = b"\x06\x01", b"\x06\x00"
_NULL_BRANCH, _VALUE_BRANCH = b"\x00", b"\x02"  # [null, X]
_EMPTY = b"\x00"  # an empty map or array; also the end of a non-empty one's block


class Unsupported(Exception):
    """A value whose encoding this writer does not know for certain: fastavro's to write."""


def _long(value: int) -> bytes:
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise Unsupported("long out of range")
    return zigzag(value)


def _text(text: Any) -> bytes:
    """An Avro string: its UTF-8 length, then the bytes."""
    if type(text) is not str:
        raise Unsupported("not a str")
    data = text.encode()  # a lone surrogate raises UnicodeEncodeError: fastavro's to report
    return zigzag(len(data)) + data


_CACHE_ENTRIES = 4096
_CACHE_TEXT_BYTES = 256
_cache: dict[str, bytes] = {}


def _cached_text(text: Any) -> bytes:
    """:func:`_text` for the strings every span repeats (attribute keys, names, the attempt's
    ids, the resource): a dict hit instead of an encode. Bounded; emptied when full, so it
    follows what is being traced now. Unsynchronised on purpose: a race recomputes an entry."""
    found = _cache.get(text) if type(text) is str else None
    if found is None:
        found = _text(text)
        if len(found) <= _CACHE_TEXT_BYTES:
            if len(_cache) >= _CACHE_ENTRIES:
                _cache.clear()
            _cache[text] = found
    return found


def _optional_text(text: Any) -> bytes:
    return _NULL_BRANCH if text is None else _VALUE_BRANCH + _text(text)


def _optional_double(value: Any) -> bytes:
    if value is None:
        return _NULL_BRANCH
    if type(value) is float:
        return _VALUE_BRANCH + _pack_double(value)
    raise Unsupported("not a float")


def _item_long(value: int) -> bytes:
    return _I_LONG + _long(value)


_INT_ONLY = {int}
_cached_item_long = functools.lru_cache(maxsize=1 << 15)(_item_long)
"""An int array item (branch and value), memoised: token-id lists repeat a vocabulary's ids,
and a cache hit costs a fraction of encoding. Called only with exact ints (``lru_cache``
would take ``True`` for ``1``)."""


def _item(item: Any) -> bytes:
    kind = type(item)
    if kind is str:
        return _I_STRING + _text(item)
    if kind is int:
        return _I_LONG + _long(item)
    if kind is float:
        return _I_DOUBLE + _pack_double(item)
    if kind is bool:
        return _I_TRUE if item else _I_FALSE
    if item is None:
        return _I_NULL
    raise Unsupported(f"array item of type {kind.__name__}")


def _array_value(out: list[bytes], items: list[Any]) -> None:
    out.append(_V_ARRAY)
    if items:
        out.append(_long(len(items)))
        # Token-id lists are the long ones: all ints, told apart with C-level calls.
        if set(map(type, items)) == _INT_ONLY:
            out.append(b"".join(map(_cached_item_long, items)))
        else:
            out.append(b"".join(map(_item, items)))
    out.append(_EMPTY)


def _attributes(out: list[bytes], attributes: Any, *, cache_values: bool = False) -> None:
    if type(attributes) is not dict:
        raise Unsupported("attributes not a dict")
    if not attributes:
        out.append(_EMPTY)
        return
    append = out.append
    append(_long(len(attributes)))
    for key, value in attributes.items():
        append(_cached_text(key))
        kind = type(value)
        if kind is str:
            append(_V_STRING)
            append(_cached_text(value) if cache_values else _text(value))
        elif kind is int:
            # Out of int64's range fastavro would choose the double branch: _long leaves it to it.
            append(_V_LONG + _long(value))
        elif kind is float:
            append(_V_DOUBLE + _pack_double(value))
        elif kind is bool:
            append(_V_TRUE if value else _V_FALSE)
        elif value is None:
            append(_V_NULL)
        elif kind is list:
            _array_value(out, value)
        else:
            raise Unsupported(f"attribute value of type {kind.__name__}")
    append(_EMPTY)


def _fields(value: Any) -> Mapping[str, Any]:
    """A record's fields: a dict (the codec's dict form) or a model's own (a pydantic model
    keeps exactly its fields in ``__dict__``). A dict missing a field raises KeyError below,
    and fastavro fills the default instead: it decides."""
    if type(value) is dict:
        return value
    if isinstance(value, BaseModel):
        return value.__dict__
    raise Unsupported(f"record of type {type(value).__name__}")


def _context(out: list[bytes], value: Any, ids: tuple[str, str, bytes, bytes]) -> None:
    """A SpanContext; ``ids``: the span's own trace and span id and their encodings, reused
    when the context holds the same ids (a span's own context always does)."""
    fields = _fields(value)
    trace_id, span_id = fields["trace_id"], fields["span_id"]
    out.append(ids[2] if trace_id == ids[0] and type(trace_id) is str else _text(trace_id))
    out.append(ids[3] if span_id == ids[1] and type(span_id) is str else _text(span_id))
    remote = fields["is_remote"]
    if type(remote) is not bool:
        raise Unsupported("is_remote not a bool")
    out.append(b"\x01" if remote else b"\x00")
    state = fields["trace_state"]
    if type(state) is not dict:
        raise Unsupported("trace_state not a dict")
    if state:
        out.append(_long(len(state)))
        for key, text in state.items():
            out.append(_text(key))
            out.append(_text(text))
    out.append(_EMPTY)


def _write_span(out: list[bytes], span: Any) -> None:
    fields = _fields(span)
    append = out.append
    append(_cached_text(fields["rollout_id"]))
    append(_cached_text(fields["attempt_id"]))
    sequence_id = fields["sequence_id"]
    if type(sequence_id) is not int:
        raise Unsupported("sequence_id not an int")
    append(_long(sequence_id))
    trace_id, span_id = fields["trace_id"], fields["span_id"]
    ids = (trace_id, span_id, _text(trace_id), _text(span_id))
    append(ids[2])
    append(ids[3])
    append(_optional_text(fields["parent_id"]))
    append(_cached_text(fields["name"]))
    append(_cached_text(fields["kind"]))
    status = _fields(fields["status"])
    code = status["status_code"]
    if type(code) is not str or code not in _STATUS_CODES:
        raise Unsupported("unknown status code")
    append(_STATUS_CODES[code])
    append(_optional_text(status["description"]))
    _attributes(out, fields["attributes"])
    events = fields["events"]
    if type(events) is not list:
        raise Unsupported("events not a list")
    if events:
        append(_long(len(events)))
        for event in events:
            event_fields = _fields(event)
            append(_cached_text(event_fields["name"]))
            _attributes(out, event_fields["attributes"])
            append(_optional_double(event_fields["timestamp"]))
    append(_EMPTY)
    links = fields["links"]
    if type(links) is not list:
        raise Unsupported("links not a list")
    if links:
        append(_long(len(links)))
        for link in links:
            link_fields = _fields(link)
            _context(out, link_fields["context"], ids)
            _attributes(out, link_fields["attributes"])
    append(_EMPTY)
    append(_optional_double(fields["start_time"]))
    append(_optional_double(fields["end_time"]))
    for name in ("context", "parent"):
        context = fields[name]
        if context is None:
            append(_NULL_BRANCH)
        else:
            append(_VALUE_BRANCH)
            _context(out, context, ids)
    resource = _fields(fields["resource"])
    _attributes(out, resource["attributes"], cache_values=True)
    append(_cached_text(resource["schema_url"]))
    append(_cached_text(fields["scope_name"]))
    append(_cached_text(fields["scope_version"]))


def span_body(span: Any) -> bytes | None:
    """The Avro body of ``span`` (an ``agl.Span`` model or its dict form) under the schema
    :data:`WRITTEN_FOR`, or None when it holds anything this writer does not handle for
    certain (a missing field, a value of another type, a long out of range, text that is not
    valid Unicode): then fastavro must write it."""
    out: list[bytes] = []
    try:
        _write_span(out, span)
    except (Unsupported, KeyError, UnicodeError):
        return None
    return b"".join(out)
