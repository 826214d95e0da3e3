"""Avro writers compiled from a parsed schema: fastavro's bytes, without its per-value union search.

fastavro writes a value of a union by validating it against the branches in turn, and the
store's records are mostly optional fields (``["null", T]``): encoding a rollout event spent
most of its ~20 us there. :func:`compile_writer` turns a schema (fastavro's parsed form) into
nested closures once; each union picks its branch from the value's exact Python type or its
record tag in one comparison. A writer only writes what it can write exactly as fastavro
would; anything else (a value whose branch is not certain, a missing field fastavro would fill
from its default, an int out of range, text that is not Unicode) raises :class:`Declined`, and
the caller hands the whole record to fastavro, so the bytes, or the error, are what they always
were (tested byte for byte against fastavro on every record type).

Pure: no I/O, no state beyond the compiled closures.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from typing import Any

from agl_stream.wire.avro_primitives import zigzag

__all__ = ["Declined", "Out", "Write", "compile_writer"]

Out = list[bytes]
Write = Callable[[Any, Out], None]

_INT32 = (-(2**31), 2**31 - 1)
_INT64 = (-(2**63), 2**63 - 1)
_TYPE_KEY = "-type"  # how a model dump names its branch of a union of records


class Declined(Exception):
    """This writer cannot be sure of fastavro's bytes for the value (or, raised by
    :func:`compile_writer`, for any value of the schema): let fastavro write it."""


def compile_writer(
    schema: Any,
    logical: Mapping[str, Callable[[Any], Any]] | None = None,
    *,
    from_attributes: bool = False,
    arrays: Mapping[str, Write] | None = None,
) -> Callable[[Any], bytes]:
    """A function ``datum -> bytes`` for ``schema`` (fastavro's parsed form); :class:`Declined`
    at once for a schema with a type it does not write (a union of primitives, ``fixed``, an
    unknown logical type), so that its records go straight to fastavro instead of being tried
    twice on a hot path.

    ``logical``: converters for logical types by ``"<type>-<logicalType>"`` (fastavro's key),
    applied before the value is written; any other logical type is declined.
    ``from_attributes``: records are read as objects (a model's fields), not dicts.
    ``arrays``: writers of whole arrays by item type (``"long"``: token ids through a table).
    """
    write = _Compiler(logical or {}, from_attributes, arrays or {}).compile(schema)

    def encode(datum: Any) -> bytes:
        out: Out = []
        write(datum, out)
        return b"".join(out)

    return encode


def _int(lo: int, hi: int) -> Write:
    def write(value: Any, out: Out) -> None:
        if type(value) is not int or not lo <= value <= hi:
            raise Declined
        out.append(zigzag(value))

    return write


def _null(value: Any, out: Out) -> None:
    if value is not None:
        raise Declined


def _boolean(value: Any, out: Out) -> None:
    if type(value) is not bool:
        raise Declined
    out.append(b"\x01" if value else b"\x00")


def _packed(fmt: str) -> Write:
    pack = struct.Struct(fmt).pack

    def write(value: Any, out: Out) -> None:
        if type(value) is not float:
            raise Declined
        out.append(pack(value))

    return write


def _string(value: Any, out: Out) -> None:
    if type(value) is not str:
        raise Declined
    try:
        data = value.encode()
    except UnicodeEncodeError:
        raise Declined from None
    out += (zigzag(len(data)), data)


def _bytes(value: Any, out: Out) -> None:
    if type(value) is not bytes:
        raise Declined
    out += (zigzag(len(value)), value)


_PRIMITIVES: dict[str, Write] = {
    "null": _null,
    "boolean": _boolean,
    "int": _int(*_INT32),
    "long": _int(*_INT64),
    "float": _packed("<f"),
    "double": _packed("<d"),
    "string": _string,
    "bytes": _bytes,
}


class _Compiler:
    def __init__(
        self, logical: Mapping[str, Callable[[Any], Any]], from_attributes: bool, arrays: Mapping[str, Write]
    ) -> None:
        self.logical = logical
        self.from_attributes = from_attributes
        self.arrays = arrays
        self.named: dict[str, Write] = {}
        self.records: set[str] = set()

    def compile(self, schema: Any) -> Write:
        if isinstance(schema, str):
            if schema in _PRIMITIVES:
                return _PRIMITIVES[schema]
            return self._reference(schema)
        if isinstance(schema, list):
            return self._union(schema)
        kind = schema["type"]
        if "logicalType" in schema:
            return self._logical(schema)
        if kind == "record":
            return self._record(schema)
        if kind == "enum":
            return self._enum(schema)
        if kind == "array":
            items = schema["items"]
            if isinstance(items, str) and items in self.arrays:
                return self.arrays[items]
            return self._array(self.compile(items))
        if kind == "map":
            return self._map(self.compile(schema["values"]))
        if isinstance(kind, str) and kind in _PRIMITIVES:
            return _PRIMITIVES[kind]
        raise Declined  # fixed, or anything this writer was not written for

    def _reference(self, name: str) -> Write:
        named = self.named

        def write(value: Any, out: Out) -> None:  # looked up at call time: a record may hold itself
            named[name](value, out)

        if name not in named:
            raise Declined
        return write

    def _logical(self, schema: dict[str, Any]) -> Write:
        convert = self.logical.get(f"{schema['type']}-{schema['logicalType']}")
        base = _PRIMITIVES.get(schema["type"])
        if convert is None or base is None:
            raise Declined

        def write(value: Any, out: Out) -> None:
            try:
                converted = convert(value)
            except Exception:
                raise Declined from None  # fastavro raises it again, as it always did
            base(converted, out)

        return write

    def _record(self, schema: dict[str, Any]) -> Write:
        fields: list[tuple[str, Write]] = []
        self.records.add(schema["name"])
        self.named[schema["name"]] = lambda value, out: write(value, out)  # while its fields compile
        fields += [(field["name"], self.compile(field["type"])) for field in schema["fields"]]

        def write(value: Any, out: Out) -> None:
            if type(value) is not dict:
                raise Declined
            try:
                for name, write_field in fields:
                    write_field(value[name], out)
            except KeyError:
                raise Declined from None  # fastavro would write the field's default

        if self.from_attributes:

            def write(value: Any, out: Out) -> None:
                try:
                    for name, write_field in fields:
                        write_field(getattr(value, name), out)
                except AttributeError:
                    raise Declined from None

        self.named[schema["name"]] = write
        return write

    def _enum(self, schema: dict[str, Any]) -> Write:
        indexes = {symbol: zigzag(i) for i, symbol in enumerate(schema["symbols"])}

        def write(value: Any, out: Out) -> None:
            if type(value) is not str or (index := indexes.get(value)) is None:
                raise Declined
            out.append(index)

        self.named[schema["name"]] = write
        return write

    @staticmethod
    def _array(items: Write) -> Write:
        def write(value: Any, out: Out) -> None:
            if type(value) is not list:
                raise Declined
            if value:
                out.append(zigzag(len(value)))
                for item in value:
                    items(item, out)
            out.append(b"\x00")

        return write

    @staticmethod
    def _map(values: Write) -> Write:
        def write(value: Any, out: Out) -> None:
            if type(value) is not dict:
                raise Declined
            if value:
                out.append(zigzag(len(value)))
                for key, item in value.items():
                    _string(key, out)
                    values(item, out)
            out.append(b"\x00")

        return write

    def _union(self, branches: list[Any]) -> Write:
        names = [_branch_name(branch) for branch in branches]
        if len(branches) == 2 and names[0] == "null" and names[1] not in ("null", None):
            other = self.compile(branches[1])

            def optional(value: Any, out: Out) -> None:
                if value is None:
                    out.append(b"\x00")
                else:
                    out.append(b"\x02")
                    other(value, out)

            return optional
        compiled = [self.compile(branch) for branch in branches]
        records = {
            name: (zigzag(i), compiled[i], i)
            for i, (branch, name) in enumerate(zip(branches, names, strict=True))
            if name is not None and (name in self.records or (isinstance(branch, dict) and branch["type"] == "record"))
        }
        null_index = zigzag(names.index("null")) if "null" in names else None
        if len(records) + (null_index is not None) != len(branches):
            raise Declined  # a union of other kinds (span attribute values): fastavro's search decides

        def tagged(value: Any, out: Out) -> None:
            if value is None and null_index is not None:
                out.append(null_index)
                return
            if type(value) is tuple and len(value) == 2:
                name, record = value
            elif type(value) is dict:
                name, record = value.get(_TYPE_KEY), value
            else:
                raise Declined
            branch = records.get(name)
            if branch is None:
                raise Declined
            out.append(branch[0])
            branch[1](record, out)

        return tagged


def _branch_name(branch: Any) -> str | None:
    if isinstance(branch, str):
        return branch
    if isinstance(branch, dict):
        name = branch.get("name")
        return name if isinstance(name, str) else (branch["type"] if isinstance(branch["type"], str) else None)
    return None
