"""Avro single-object encoding of every wire record.

A message is ``C3 01`` + the 8-byte little-endian CRC-64-AVRO fingerprint of the writer
schema + the Avro binary body. The fingerprint says which schema version wrote the body; the
codec resolves any known version (current or ``schemas/history``) to the current schema of the
same name, so new code reads old data and, once the new schema is known to it, old code reads
new data.

Two ways in and out:

- pydantic models: :meth:`Codec.encode` / :meth:`Codec.decode` (validated, convenient);
- plain dicts for hot loops: :meth:`Codec.encode_dict` / :meth:`Codec.decode_dict` (no
  pydantic; the dict form is fastavro's: JSON fields as Python objects, and a record inside a
  union of several records carries ``"-type"``).

Fields declared ``{"type": "string", "logicalType": "json"}`` hold JSON text on the wire and
Python objects in memory; importing this module registers that logical type with fastavro
(process-wide), writing JSON deterministically (sorted keys, compact separators) so re-encoding
a decoded record gives the same bytes.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Mapping
from io import BytesIO
from typing import Any, Literal, TypeVar, cast

from fastavro import parse_schema, schemaless_reader, schemaless_writer
from fastavro.read import LOGICAL_READERS
from fastavro.write import LOGICAL_WRITERS
from pydantic import ValidationError

from agl_stream.errors import (
    CodecError,
    MalformedRecordError,
    NotSingleObjectEncodedError,
    RecordTypeError,
    UnknownFingerprintError,
)
from agl_stream.models import AVRO_CONTEXT, MODELS, TYPE_KEY, AglModel
from agl_stream.wire.avro_writer import Declined, Write, compile_writer
from agl_stream.wire.contract import JSON_LOGICAL_TYPE, Contract, NamedSchema

MAGIC = b"\xc3\x01"
HEADER_SIZE = 10

M = TypeVar("M", bound=AglModel)

# --------------------------------------------------------------------------------------------
# The JSON logical type
# --------------------------------------------------------------------------------------------


def _json_writer() -> Callable[[Any], str]:
    """One C encoder built once: json.dumps builds a ``JSONEncoder`` per call for these
    options, and its ``encode`` a C encoder per call (half the cost of a short value). Built
    without the circular reference check (its ``markers`` would be shared state): a cycle, or
    anything nested too deep, raises RecursionError, which the codec reports as its own error."""
    options = json.JSONEncoder(ensure_ascii=False, allow_nan=False, sort_keys=True, separators=(",", ":"))
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # no C accelerator: the encoder's own path
        return options.encode
    chunks = make(
        None, options.default, json.encoder.encode_basestring, None, options.key_separator,
        options.item_separator, options.sort_keys, options.skipkeys, options.allow_nan,
    )  # fmt: skip

    def text(value: Any) -> str:
        return "".join(chunks(value, 0))

    return text


dump_json: Callable[[Any], str] = _json_writer()
"""JSON text exactly as the codec writes it (sorted keys, compact, no NaN/Infinity)."""


def _write_json(datum: Any, schema: Any) -> str:
    return dump_json(datum)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"JSON text holds {name}, which is not JSON (agl-stream never writes it)")


_JSON_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)
_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")
_LARGE_EXPONENT = re.compile(r"[eE]\+?\d{3}")
_LONG_NUMBER = re.compile(r"\d{300}")


def _may_not_reencode(data: str) -> bool:
    """Whether JSON text may parse into a value the writer refuses: an escaped surrogate (a lone
    one is no Unicode text), or a number too large for a float (``1e400`` parses as inf). Three
    plain searches, two of them only where a backslash or 300 characters make them possible: one
    regex of the three alternatives, tried at every position, cost ~10 us on a 200-character
    input, and every role decodes every JSON field through here."""
    return (
        ("\\u" in data and _ESCAPED_SURROGATE.search(data) is not None)
        or _LARGE_EXPONENT.search(data) is not None
        or (len(data) >= 300 and _LONG_NUMBER.search(data) is not None)
    )


def _read_json(data: str, writer_schema: Any, reader_schema: Any) -> Any:
    """JSON text -> the value, refusing what :func:`dump_json` would refuse to write (NaN,
    Infinity, numbers that overflow to infinity, lone surrogates): a record that decodes must
    encode again, or whoever folds it into state of its own fails later, far from the bad input."""
    value = _JSON_DECODER.decode(data)
    if _may_not_reencode(data):
        try:
            dump_json(value).encode("utf-8")
        except ValueError as error:  # UnicodeEncodeError included
            raise ValueError(f"JSON text holds a value JSON cannot carry ({error})") from None
    return value


def register_json_logical_type() -> None:
    """Teach fastavro the ``json`` logical type (idempotent; done on import)."""
    key = f"string-{JSON_LOGICAL_TYPE}"
    LOGICAL_WRITERS[key] = _write_json
    LOGICAL_READERS[key] = _read_json


register_json_logical_type()
JSON_WRITERS = {f"string-{JSON_LOGICAL_TYPE}": dump_json}
"""What the compiled writers apply to a JSON field before writing its text."""


def _parse(expanded: Mapping[str, Any]) -> dict[str, Any]:
    """fastavro's parsed form, with JSON-field defaults turned into the values they denote.

    fastavro fills a missing field with its default as written in the schema (JSON text for a
    json field) without applying the logical type; the contract only allows scalar JSON
    defaults, so replacing them with the parsed value is safe to share.
    """
    parsed = cast(dict[str, Any], parse_schema(dict(expanded)))
    seen: set[int] = set()

    def fix(schema: Any) -> None:
        if isinstance(schema, list):
            for branch in schema:
                fix(branch)
        elif isinstance(schema, dict):
            if id(schema) in seen:
                return
            seen.add(id(schema))
            kind = schema.get("type")
            if kind in ("record", "error"):
                for fld in schema["fields"]:
                    ftype = fld["type"]
                    if (
                        isinstance(ftype, dict)
                        and ftype.get("logicalType") == JSON_LOGICAL_TYPE
                        and isinstance(fld.get("default"), str)
                    ):
                        fld["default"] = json.loads(fld["default"])
                    fix(ftype)
            elif kind == "array":
                fix(schema["items"])
            elif kind == "map":
                fix(schema["values"])

    fix(parsed)
    return parsed


# --------------------------------------------------------------------------------------------
# Walkers: per-schema passes over a datum, compiled once, only where a schema needs them
# --------------------------------------------------------------------------------------------

Walker = Callable[[Any], Any]
"""Takes a value and returns it, or a changed copy: a walker never mutates its input."""

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class _WalkerCompiler:
    """Compiles, for one parsed schema, a walker whose behaviour at unions is ``mode``'s:

    - ``"decode"``: fastavro (``return_record_name``) returns a value of a union of several
      records as ``(name, record)``; turn it into ``{**record, "-type": name}``.
    - ``"encode"``: check that each value of a union of several records names its record
      (``"-type"`` or a tuple), since fastavro would otherwise pick the first branch whose
      fields happen to fit, and hand it on as a ``(name, record)`` pair, which fastavro writes
      as that branch at once instead of validating the value against every record of the
      union first (more than half the cost of encoding a rollout event); and tag the items
      of lists written to a union's array-of-scalars branch (span attributes) with their
      branch, which spares fastavro validating every item against every branch (twice as fast
      for token-id lists).

    Schemas where nothing applies get no walker at all (``root is None``).
    """

    def __init__(self, parsed: dict[str, Any], mode: Literal["decode", "encode"]) -> None:
        self.named: dict[str, Any] = dict(parsed.get("__named_schemas", {}))
        self.mode = mode
        self.memo: dict[str, Walker | None] = {}
        self.in_progress: set[str] = set()
        self.root = self.compile(parsed, "")

    # -- structure -----------------------------------------------------------------------

    def _definition(self, schema: Any) -> Any:
        return self.named.get(schema, schema) if isinstance(schema, str) else schema

    def _kind(self, schema: Any) -> str:
        schema = self._definition(schema)
        if isinstance(schema, str):
            return schema
        if isinstance(schema, list):
            return "union"
        kind = schema.get("type")
        return "record" if kind == "error" else str(kind)

    def compile(self, schema: Any, path: str) -> Walker | None:
        if isinstance(schema, str):
            definition = self.named.get(schema)
            return None if definition is None else self._named(schema, definition)
        if isinstance(schema, list):
            return self._union(schema, path)
        if not isinstance(schema, dict):
            return None
        kind = schema.get("type")
        if kind in ("record", "error"):
            return self._named(str(schema["name"]), schema)
        if kind == "array":
            item = self.compile(schema["items"], path + "[]")
            return None if item is None else _array_walker(item)
        if kind == "map":
            return self._map(schema["values"], path + "{}")
        return None

    def _named(self, name: str, definition: Any) -> Walker | None:
        if name in self.memo:
            return self.memo[name]
        if name in self.in_progress:  # a recursive type: bind late
            return lambda value: self._late(name, value)
        if not (isinstance(definition, dict) and definition.get("type") in ("record", "error")):
            self.memo[name] = None
            return None
        self.in_progress.add(name)
        fields = [
            (fld["name"], walker)
            for fld in definition["fields"]
            if (walker := self.compile(fld["type"], f"{name}.{fld['name']}")) is not None
        ]
        self.in_progress.discard(name)
        walker = _record_walker(fields) if fields else None
        self.memo[name] = walker
        return walker

    def _late(self, name: str, value: Any) -> Any:
        walker = self.memo.get(name)
        return value if walker is None else walker(value)

    # -- unions ----------------------------------------------------------------------------

    def _union(self, branches: list[Any], path: str) -> Walker | None:
        records = {str(self._definition(b)["name"]): b for b in branches if self._kind(b) == "record"}
        if len(records) > 1:
            subs = {name: self.compile(branch, path) for name, branch in records.items()}
            if self.mode == "decode":
                return _tag_records(subs)
            return _check_record_tags(subs, path)
        on_dict, on_list = self._union_parts(branches, path)
        if on_dict is None and on_list is None:
            return None
        return _by_python_type(on_dict, on_list)

    def _union_parts(self, branches: list[Any], path: str) -> tuple[Walker | None, Walker | None]:
        """Walkers for the dict and the list values of a union with at most one record."""
        by_kind = {self._kind(b): b for b in branches}
        on_dict = self.compile(by_kind["record"], path) if "record" in by_kind else None
        if on_dict is None and "map" in by_kind:
            on_dict = self.compile(by_kind["map"], path)
        on_list: Walker | None = None
        if "array" in by_kind:
            items = self._definition(by_kind["array"])["items"]
            on_list = self.compile(by_kind["array"], path)
            if on_list is None and self.mode == "encode" and isinstance(items, list):
                on_list = _scalar_list_tagger(items)
        return on_dict, on_list

    def _map(self, values: Any, path: str) -> Walker | None:
        if isinstance(values, list) and sum(self._kind(b) == "record" for b in values) <= 1:
            on_dict, on_list = self._union_parts(values, path)
            if on_dict is None and on_list is not None:
                return _map_of_lists_walker(on_list)  # span attributes: the hot case
        val = self.compile(values, path)
        return None if val is None else _map_walker(val)


def _record_walker(fields: list[tuple[str, Walker]]) -> Walker:
    def walk(value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        out: dict[str, Any] | None = None
        for name, walker in fields:
            if name in value:
                old = value[name]
                new = walker(old)
                if new is not old:
                    if out is None:
                        out = dict(value)
                    out[name] = new
        return value if out is None else out

    return walk


def _array_walker(item: Walker) -> Walker:
    def walk(value: Any) -> Any:
        if not isinstance(value, list):
            return value
        out: list[Any] | None = None
        for index, old in enumerate(value):
            new = item(old)
            if new is not old:
                if out is None:
                    out = list(value)
                out[index] = new
        return value if out is None else out

    return walk


def _map_walker(val: Walker) -> Walker:
    def walk(value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        out: dict[str, Any] | None = None
        for key, old in value.items():
            new = val(old)
            if new is not old:
                if out is None:
                    out = dict(value)
                out[key] = new
        return value if out is None else out

    return walk


def _map_of_lists_walker(on_list: Walker) -> Walker:
    def walk(value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        for item in value.values():
            if type(item) is list:
                return {k: on_list(v) if type(v) is list else v for k, v in value.items()}
        return value

    return walk


def _by_python_type(on_dict: Walker | None, on_list: Walker | None) -> Walker:
    def walk(value: Any) -> Any:
        if on_list is not None and type(value) is list:
            return on_list(value)
        if on_dict is not None and isinstance(value, dict):
            return on_dict(value)
        return value

    return walk


def _tag_records(subs: dict[str, Walker | None]) -> Walker:
    def tag(value: Any) -> Any:
        if isinstance(value, tuple):
            name, record = value
            sub = subs.get(name)
            if sub is not None:
                record = sub(record)
            record = dict(record)
            record[TYPE_KEY] = name
            return record
        return value

    return tag


def _check_record_tags(subs: dict[str, Walker | None], path: str) -> Walker:
    names = sorted(subs)

    def check(value: Any) -> Any:
        if isinstance(value, tuple):
            if len(value) != 2:
                raise CodecError(f"{path}: a value tagged with its record is a (name, record) pair, not {value!r:.80}")
            name, record = value
        elif isinstance(value, dict):
            name, record = value.get(TYPE_KEY), value
            if name is None:
                raise CodecError(
                    f"{path}: a value of a union of records {names} needs a {TYPE_KEY!r} key naming its record"
                )
        else:
            return value
        if name not in subs:
            raise CodecError(f"{path}: {name!r} is not one of the union's records {names}")
        sub = subs[name]
        # As a (name, record) pair: fastavro writes the named branch at once instead of
        # validating the value against every record of the union first.
        return (name, record if sub is None else sub(record))

    return check


def _scalar_list_tagger(items: list[Any]) -> Walker | None:
    """Tag each item of a list with its branch of the (primitive) item union, or give up."""
    present = {b for b in items if isinstance(b, str)}
    tags: dict[type, str] = {}
    for py_type, candidates in (
        (bool, ("boolean",)),
        (int, ("long", "int")),
        (float, ("double", "float")),
        (str, ("string",)),
        (type(None), ("null",)),
    ):
        for candidate in candidates:
            if candidate in present:
                tags[py_type] = candidate
                break
    if not tags:
        return None
    int_tag = tags.get(int)
    lo, hi = (_INT64_MIN, _INT64_MAX) if int_tag == "long" else (-(2**31), 2**31 - 1)

    def tag(value: list[Any]) -> Any:
        out: list[tuple[str, Any]] = []
        append = out.append
        for item in value:
            branch = tags.get(type(item))
            if branch is None or (branch is int_tag and not lo <= item <= hi):
                return value  # leave it to fastavro's own union resolution
            append((branch, item))
        return ("array", out)

    return tag


def _has_record_union(parsed: dict[str, Any]) -> bool:
    """Whether a schema has a union of several records (whose values need ``"-type"``)."""
    return _WalkerCompiler(parsed, "decode").root is not None


class _Writer:
    __slots__ = ("compiled", "header", "name", "needs_tags", "parsed", "prepare")

    def __init__(self, schema: NamedSchema, parsed: dict[str, Any]) -> None:
        self.name = schema.name
        self.header = schema.header
        self.parsed = parsed
        self.prepare = _WalkerCompiler(parsed, "encode").root
        self.needs_tags = _has_record_union(parsed)
        self.compiled: Callable[[Any], bytes] | None
        try:
            self.compiled = compile_writer(parsed, JSON_WRITERS)
        except Declined:
            self.compiled = None  # a type it does not write (the spans' attribute values): fastavro


class _Reader:
    __slots__ = ("name", "reader", "tagger", "writer")

    def __init__(self, name: str, writer: dict[str, Any], reader: dict[str, Any] | None) -> None:
        self.name = name
        self.writer = writer
        self.reader = reader
        self.tagger = _WalkerCompiler(reader if reader is not None else writer, "decode").root


class Codec:
    """Encodes records as Avro single-object messages and decodes any known schema version."""

    def __init__(self, contract: Contract, models: Mapping[str, type[AglModel]] | None = None):
        self.contract = contract
        self.models: dict[str, type[AglModel]] = dict(MODELS if models is None else models)
        self._writers: dict[str, _Writer] = {}
        parsed_current: dict[str, dict[str, Any]] = {}
        for name, schema in contract.current.items():
            parsed = _parse(schema.expanded)
            parsed_current[name] = parsed
            self._writers[name] = _Writer(schema, parsed)
        self._readers: dict[int, _Reader] = {}
        for fp, schema in contract.known.items():
            current = contract.current.get(schema.name)
            if current is not None and current.fingerprint == fp:
                self._readers[fp] = _Reader(schema.name, parsed_current[schema.name], None)
            else:
                # A known older (or newer) version: resolve to the current schema if there is
                # one, else read it as written.
                reader = parsed_current.get(schema.name)
                self._readers[fp] = _Reader(schema.name, _parse(schema.expanded), reader)

    @classmethod
    @functools.cache
    def default(cls) -> Codec:
        """The codec of the bundled schemas (loaded once per process)."""
        return cls(Contract.load())

    # -- introspection ---------------------------------------------------------------------

    def fingerprint(self, avro_name: str) -> int:
        """Fingerprint of the current schema of ``avro_name``."""
        self._writer(avro_name)
        return self.contract.current[avro_name].fingerprint

    def compiled_writer(
        self, avro_name: str, *, from_attributes: bool = False, arrays: Mapping[str, Write] | None = None
    ) -> Callable[[Any], bytes]:
        """A writer of ``avro_name``'s body compiled from its current schema (``avro_writer``):
        fastavro's bytes, or :class:`Declined` (at once: a schema with a type it does not write);
        for writers with their own fast paths."""
        parsed = self._writer(avro_name).parsed
        return compile_writer(parsed, JSON_WRITERS, from_attributes=from_attributes, arrays=arrays)

    def _writer(self, avro_name: str) -> _Writer:
        writer = self._writers.get(avro_name)
        if writer is None:
            raise CodecError(f"no schema named {avro_name!r} in schemas/")
        return writer

    # -- dicts (hot paths) -------------------------------------------------------------------

    def encode_dict(self, avro_name: str, datum: Mapping[str, Any]) -> bytes:
        """Encode a record given in fastavro's dict form with the current schema of its name."""
        writer = self._writers.get(avro_name)
        if writer is None:
            raise CodecError(f"no schema named {avro_name!r} in schemas/")
        if writer.compiled is not None:
            try:
                return writer.header + writer.compiled(datum)
            except Declined:
                pass  # fastavro writes it: the same bytes, or its error
            except RecursionError as exc:
                raise CodecError(f"cannot encode {avro_name}: a value is nested too deeply or holds itself") from exc
        if writer.prepare is not None:
            datum = writer.prepare(datum)
        out = BytesIO()
        out.write(writer.header)
        try:
            schemaless_writer(out, writer.parsed, datum)
        except CodecError:
            raise
        except RecursionError as exc:
            raise CodecError(f"cannot encode {avro_name}: a value is nested too deeply or holds itself") from exc
        except Exception as exc:  # fastavro and json raise ValueError, TypeError, KeyError...
            raise CodecError(f"cannot encode {avro_name}: {type(exc).__name__}: {exc}") from exc
        return out.getvalue()

    def decode_dict(self, data: bytes) -> tuple[str, dict[str, Any]]:
        """Decode a message into (Avro full name, record dict in the current schema's shape)."""
        if len(data) < HEADER_SIZE or data[:2] != MAGIC:
            raise NotSingleObjectEncodedError(_not_single_object(data))
        fp = int.from_bytes(data[2:HEADER_SIZE], "little")
        reader = self._readers.get(fp)
        if reader is None:
            raise UnknownFingerprintError(fp)
        buf = BytesIO(data)
        buf.seek(HEADER_SIZE)
        datum: Any
        try:
            if reader.tagger is None:
                datum = schemaless_reader(buf, reader.writer, reader.reader)
            else:
                datum = reader.tagger(
                    schemaless_reader(
                        buf,
                        reader.writer,
                        reader.reader,
                        return_record_name=True,
                        return_record_name_override=True,
                    )
                )
        except Exception as exc:  # EOFError, ValueError, IndexError, UnicodeDecodeError, ...
            raise MalformedRecordError(
                f"{reader.name} (writer {fp:#018x}): body is not valid Avro: {type(exc).__name__}: {exc}"
            ) from exc
        if buf.tell() != len(data):
            raise MalformedRecordError(
                f"{reader.name} (writer {fp:#018x}): {len(data) - buf.tell()} bytes after the end of the record"
            )
        return reader.name, datum

    # -- models ----------------------------------------------------------------------------

    def encode(self, record: AglModel) -> bytes:
        """Encode a model with the current schema of its ``avro_name``."""
        writer = self._writer(record.avro_name)
        datum = record.model_dump(context=AVRO_CONTEXT) if writer.needs_tags else record.model_dump()
        return self.encode_dict(writer.name, datum)

    def decode(self, data: bytes, expected: type[M]) -> M:
        """Decode a message that must hold an ``expected`` record."""
        name, datum = self.decode_dict(data)
        if name != expected.avro_name:
            raise RecordTypeError(f"expected a {expected.avro_name}, got a {name}")
        try:
            return expected.model_validate(datum)
        except ValidationError as exc:
            raise MalformedRecordError(f"{name} does not validate: {exc}") from exc


def _not_single_object(data: bytes) -> str:
    head = bytes(data[:HEADER_SIZE]).hex(" ")
    if len(data) < HEADER_SIZE:
        return f"{len(data)} bytes ({head or 'empty'}) is shorter than the 10-byte Avro single-object header"
    return (
        f"message starts with {head}, not the Avro single-object marker c3 01: it was not "
        "written by an agl-stream codec or a single-object Avro writer"
    )
