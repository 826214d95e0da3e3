"""The wire contract: load ``schemas/*.avsc``, expand them, fingerprint them, check evolution.

Each file in ``schemas/`` defines one named Avro type (record or enum) in the ``agl``
namespace and may refer to types defined in other files by name. This module resolves those
references and gives every named type:

- its *expanded* schema: one self-contained JSON schema in which every named type is defined
  inline at its first use (what external producers and other languages need),
- its Parsing Canonical Form (Avro spec) and its CRC-64-AVRO fingerprint, the 64-bit value
  that Java's ``SchemaNormalization.parsingFingerprint64`` computes over the expanded schema.

``schemas/history/<Name>.<fingerprint as 16 hex>.avsc`` holds every released version, fully
expanded. The codec accepts data written with any of them; :func:`check_compatible` proves
that a change keeps both directions readable.

Only the standard library and fastavro's schema helpers are used: no I/O beyond reading and
writing schema files.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastavro.schema import fingerprint as _fastavro_fingerprint
from fastavro.schema import parse_schema, to_parsing_canonical_form

from agl_stream.errors import SchemaCompatibilityError
from agl_stream.resources import resource_path

NAMESPACE = "agl"
JSON_LOGICAL_TYPE = "json"
HISTORY_DIRNAME = "history"

PRIMITIVES = frozenset({"null", "boolean", "int", "long", "float", "double", "bytes", "string"})
NAMED_KINDS = frozenset({"record", "error", "enum", "fixed"})

# Avro schema resolution: writer type -> reader types it can be promoted to.
PROMOTIONS: Mapping[str, frozenset[str]] = {
    "int": frozenset({"long", "float", "double"}),
    "long": frozenset({"float", "double"}),
    "float": frozenset({"double"}),
    "string": frozenset({"bytes"}),
    "bytes": frozenset({"string"}),
}

Schema = Any
"""An Avro schema as parsed JSON: a type name (str), a union (list) or a definition (dict)."""


class SchemaDefinitionError(SchemaCompatibilityError):
    """A schema file is invalid (bad JSON, unknown reference, duplicate or misnamed type) or a
    snapshot was edited: the contract cannot be loaded, so nothing can be checked."""


# --------------------------------------------------------------------------------------------
# Names and expansion
# --------------------------------------------------------------------------------------------


def qualify(name: str, namespace: str | None) -> str:
    """The full name of ``name`` referenced inside ``namespace`` (Avro name resolution)."""
    if "." in name or name in PRIMITIVES or not namespace:
        return name
    return f"{namespace}.{name}"


def definition_fullname(definition: Mapping[str, Any], enclosing_namespace: str | None) -> str:
    """Full name of a named type definition, honouring an explicit ``namespace``."""
    name = definition["name"]
    if "." in name:
        return str(name)
    namespace = definition.get("namespace", enclosing_namespace)
    return f"{namespace}.{name}" if namespace else str(name)


def _namespace_of(fullname: str) -> str | None:
    return fullname.rsplit(".", 1)[0] if "." in fullname else None


def _short_name(fullname: str) -> str:
    return fullname.rsplit(".", 1)[-1]


def _collect_definitions(schema: Schema, namespace: str | None, out: dict[str, dict[str, Any]], origin: str) -> None:
    """Index every named type defined (inline) in ``schema`` by full name."""
    if isinstance(schema, list):
        for branch in schema:
            _collect_definitions(branch, namespace, out, origin)
        return
    if not isinstance(schema, dict):
        return
    kind = schema.get("type")
    if kind in NAMED_KINDS:
        full = definition_fullname(schema, namespace)
        if full in out:
            raise SchemaDefinitionError(f"{origin}: type {full} is defined twice")
        out[full] = schema
        inner_ns = _namespace_of(full)
        for fld in schema.get("fields", ()):
            _collect_definitions(fld.get("type"), inner_ns, out, origin)
        return
    if kind == "array":
        _collect_definitions(schema.get("items"), namespace, out, origin)
    elif kind == "map":
        _collect_definitions(schema.get("values"), namespace, out, origin)
    elif isinstance(kind, (dict, list)):
        _collect_definitions(kind, namespace, out, origin)


class _Expander:
    """Inline referenced definitions at their first use; later uses stay references."""

    def __init__(self, index: Mapping[str, dict[str, Any]]) -> None:
        self.index = index
        self.defined: set[str] = set()

    def expand(self, schema: Schema, namespace: str | None, where: str) -> Schema:
        if isinstance(schema, str):
            if schema in PRIMITIVES:
                return schema
            full = qualify(schema, namespace)
            if full in self.defined:
                return full
            definition = self.index.get(full)
            if definition is None:
                raise SchemaDefinitionError(f"{where}: unknown type {schema!r} (resolved as {full})")
            return self.expand(definition, _namespace_of(full), where)
        if isinstance(schema, list):
            return [self.expand(branch, namespace, where) for branch in schema]
        if not isinstance(schema, dict):
            raise SchemaDefinitionError(f"{where}: not a schema: {schema!r}")
        kind = schema.get("type")
        if kind in NAMED_KINDS:
            full = definition_fullname(schema, namespace)
            if full in self.defined:
                raise SchemaDefinitionError(f"{where}: type {full} is defined twice")
            self.defined.add(full)
            out: dict[str, Any] = {}
            for key, value in schema.items():
                if key == "name":
                    out["name"] = _short_name(full)
                    ns = _namespace_of(full)
                    if ns:
                        out["namespace"] = ns
                elif key == "namespace":
                    continue
                elif key == "fields":
                    inner_ns = _namespace_of(full)
                    out["fields"] = [
                        {
                            **fld,
                            "type": self.expand(fld["type"], inner_ns, f"{full}.{fld['name']}"),
                        }
                        for fld in value
                    ]
                else:
                    out[key] = value
            return out
        if kind == "array":
            return {**schema, "items": self.expand(schema["items"], namespace, where)}
        if kind == "map":
            return {**schema, "values": self.expand(schema["values"], namespace, where)}
        if isinstance(kind, str) and kind in PRIMITIVES:
            return dict(schema)
        if isinstance(kind, (str, list, dict)):
            # {"type": "agl.X"} or {"type": [...]}: the wrapper adds nothing.
            return self.expand(kind, namespace, where)
        raise SchemaDefinitionError(f"{where}: schema without a valid type: {schema!r}")


def expand_schema(fullname: str, index: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """The self-contained schema of ``fullname`` with every reference resolved from ``index``."""
    if fullname not in index:
        raise SchemaDefinitionError(f"unknown type {fullname}")
    expanded = _Expander(index).expand(fullname, None, fullname)
    assert isinstance(expanded, dict)
    return expanded


# --------------------------------------------------------------------------------------------
# Canonical form and fingerprint
# --------------------------------------------------------------------------------------------


def canonical_form(schema: Schema) -> str:
    """The Avro Parsing Canonical Form of a self-contained schema."""
    return str(to_parsing_canonical_form(schema))


def fingerprint_of_canonical(canonical: str) -> int:
    """CRC-64-AVRO of a canonical form, as the unsigned 64-bit value (Java's long)."""
    # fastavro returns the little-endian bytes of the value as hex.
    return int.from_bytes(bytes.fromhex(_fastavro_fingerprint(canonical, "CRC-64-AVRO")), "little")


def fingerprint(schema: Schema) -> int:
    """CRC-64-AVRO fingerprint of a self-contained schema's Parsing Canonical Form."""
    return fingerprint_of_canonical(canonical_form(schema))


@dataclass(frozen=True)
class NamedSchema:
    """One version of one named type: its expanded schema, canonical form and fingerprint."""

    name: str
    """Full name, e.g. ``agl.Span``."""
    expanded: dict[str, Any] = field(repr=False, compare=False)
    canonical: str = field(repr=False)
    fingerprint: int
    source: Path | None = field(default=None, compare=False)

    @classmethod
    def from_expanded(cls, expanded: Mapping[str, Any], source: Path | None = None) -> NamedSchema:
        """Wrap an already self-contained schema (a history snapshot, a test's v2)."""
        schema = dict(expanded)
        if schema.get("type") not in NAMED_KINDS:
            raise SchemaDefinitionError(f"{source or 'schema'}: top level must be a named type")
        _validate(schema, source)
        canonical = canonical_form(schema)
        return cls(
            name=definition_fullname(schema, None),
            expanded=schema,
            canonical=canonical,
            fingerprint=fingerprint_of_canonical(canonical),
            source=source,
        )

    @property
    def short_name(self) -> str:
        return _short_name(self.name)

    @property
    def fingerprint_hex(self) -> str:
        """The fingerprint as 16 hex digits, most significant first (history file names)."""
        return f"{self.fingerprint:016x}"

    @property
    def header(self) -> bytes:
        """The single-object encoding header: C3 01 + the fingerprint, little-endian."""
        return b"\xc3\x01" + self.fingerprint.to_bytes(8, "little")

    @property
    def history_filename(self) -> str:
        return f"{self.short_name}.{self.fingerprint_hex}.avsc"

    def to_json(self) -> str:
        """The expanded schema as stable, human-readable JSON text (history snapshot format)."""
        return json.dumps(self.expanded, indent=2, ensure_ascii=False) + "\n"


def _validate(schema: dict[str, Any], source: Path | None) -> None:
    """Reject schemas fastavro cannot parse, and JSON defaults fastavro would share."""
    try:
        parse_schema(schema)
    except Exception as exc:  # fastavro raises several types for bad schemas
        raise SchemaDefinitionError(f"{source or schema.get('name')}: invalid schema: {exc}") from exc
    for path, fld in _fields_with_json_default(schema):
        try:
            value = json.loads(fld["default"])
        except (TypeError, ValueError) as exc:
            raise SchemaDefinitionError(
                f"{source or schema.get('name')}: {path}: default of a json field must be JSON text"
            ) from exc
        if isinstance(value, (dict, list)):
            raise SchemaDefinitionError(
                f"{source or schema.get('name')}: {path}: a json field's default must be a JSON "
                'scalar; use ["null", json] with default null for an optional object'
            )


def _fields_with_json_default(schema: Schema) -> Iterator[tuple[str, dict[str, Any]]]:
    """(record.field, field) of every json-typed field that declares a default."""
    if isinstance(schema, list):
        for branch in schema:
            yield from _fields_with_json_default(branch)
    elif isinstance(schema, dict):
        kind = schema.get("type")
        if kind in ("record", "error"):
            for fld in schema.get("fields", ()):
                ftype = fld["type"]
                if isinstance(ftype, dict) and ftype.get("logicalType") == JSON_LOGICAL_TYPE and "default" in fld:
                    yield f"{schema['name']}.{fld['name']}", fld
                yield from _fields_with_json_default(ftype)
        elif kind == "array":
            yield from _fields_with_json_default(schema.get("items"))
        elif kind == "map":
            yield from _fields_with_json_default(schema.get("values"))


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SchemaDefinitionError(f"{path}: cannot read schema: {exc}") from exc


def load_definitions(schemas_dir: Path) -> dict[str, dict[str, Any]]:
    """Every named type defined in ``schemas_dir/*.avsc``, by full name (references unresolved).

    Files may be read in any order: references are resolved afterwards, so a file may use a
    type defined in a file that sorts after it.
    """
    index: dict[str, dict[str, Any]] = {}
    for path in sorted(schemas_dir.glob("*.avsc")):
        schema = _read_json(path)
        if not isinstance(schema, dict) or schema.get("type") not in NAMED_KINDS:
            raise SchemaDefinitionError(f"{path}: top level must be a named record or enum")
        full = definition_fullname(schema, None)
        if _short_name(full) != path.stem:
            raise SchemaDefinitionError(f"{path}: defines {full}; the file must be named {_short_name(full)}.avsc")
        if _namespace_of(full) != NAMESPACE:
            raise SchemaDefinitionError(f"{path}: {full} is not in namespace {NAMESPACE!r}")
        found: dict[str, dict[str, Any]] = {}
        _collect_definitions(schema, None, found, str(path))
        for name, definition in found.items():
            if name in index:
                raise SchemaDefinitionError(f"{path}: type {name} is already defined in another file")
            index[name] = definition
    return index


def load_history(history_dir: Path) -> list[NamedSchema]:
    """The snapshots in ``history_dir``; each file name must carry its schema's fingerprint."""
    out: list[NamedSchema] = []
    if not history_dir.is_dir():
        return out
    for path in sorted(history_dir.glob("*.avsc")):
        schema = _read_json(path)
        if not isinstance(schema, dict):
            raise SchemaDefinitionError(f"{path}: not a schema object")
        named = NamedSchema.from_expanded(schema, source=path)
        if path.name != named.history_filename:
            raise SchemaDefinitionError(
                f"{path}: content has fingerprint {named.fingerprint_hex} and name "
                f"{named.short_name}; expected file name {named.history_filename} (snapshots must "
                "never be edited)"
            )
        out.append(named)
    return out


class Contract:
    """The current schemas plus every known older (or newer) writer schema."""

    def __init__(self, current: Iterable[NamedSchema], history: Iterable[NamedSchema] = ()) -> None:
        self.current: dict[str, NamedSchema] = {}
        for schema in current:
            if schema.name in self.current:
                raise SchemaDefinitionError(f"two current schemas named {schema.name}")
            self.current[schema.name] = schema
        self.history: dict[int, NamedSchema] = {}
        for schema in history:
            self.history.setdefault(schema.fingerprint, schema)
        self.known: dict[int, NamedSchema] = dict(self.history)
        for schema in self.current.values():
            self.known[schema.fingerprint] = schema

    @classmethod
    def load(cls, schemas_dir: Path | None = None, history_dir: Path | None = None) -> Contract:
        """Load ``schemas/*.avsc`` (default: the bundled folder) and its ``history/`` folder."""
        schemas_dir = schemas_dir if schemas_dir is not None else resource_path("schemas")
        history_dir = history_dir if history_dir is not None else schemas_dir / HISTORY_DIRNAME
        index = load_definitions(schemas_dir)
        current = [
            NamedSchema.from_expanded(expand_schema(name, index), source=schemas_dir / f"{_short_name(name)}.avsc")
            for name in sorted(index)
            if (schemas_dir / f"{_short_name(name)}.avsc").exists()
        ]
        return cls(current, load_history(history_dir))

    @classmethod
    def from_schemas(cls, current: Iterable[Mapping[str, Any]], history: Iterable[Mapping[str, Any]] = ()) -> Contract:
        """Build a contract from self-contained schemas (tests, tools)."""
        return cls(
            [NamedSchema.from_expanded(s) for s in current],
            [NamedSchema.from_expanded(s) for s in history],
        )

    def schema(self, name: str) -> NamedSchema:
        """The current schema of ``name`` (full name ``agl.X`` or short name ``X``)."""
        found = self.current.get(qualify(name, NAMESPACE))
        if found is None:
            raise KeyError(f"no current schema named {name!r}")
        return found

    def history_of(self, name: str) -> list[NamedSchema]:
        """Every snapshot of ``name``, in file-name order."""
        full = qualify(name, NAMESPACE)
        return [s for s in self.history.values() if s.name == full]

    def missing_snapshots(self) -> list[NamedSchema]:
        """Current schemas whose fingerprint has no snapshot in the history."""
        return [s for s in self.current.values() if s.fingerprint not in self.history]

    def compatibility_problems(self) -> list[str]:
        """Why current schemas cannot evolve from (or to) their snapshots; empty if all can."""
        problems: list[str] = []
        for schema in self.current.values():
            for old in self.history_of(schema.name):
                if old.fingerprint == schema.fingerprint:
                    continue
                try:
                    check_compatible(old, schema)
                except SchemaCompatibilityError as exc:
                    problems.append(str(exc))
        return problems

    def write_snapshots(self, history_dir: Path, schemas: Sequence[NamedSchema] | None = None) -> list[Path]:
        """Write the given (default: the missing) snapshots to ``history_dir``; return new paths."""
        todo = self.missing_snapshots() if schemas is None else list(schemas)
        history_dir.mkdir(parents=True, exist_ok=True)
        written: list[Path] = []
        for schema in todo:
            path = history_dir / schema.history_filename
            if not path.exists():
                path.write_text(schema.to_json(), encoding="utf-8")
                written.append(path)
            self.history.setdefault(schema.fingerprint, schema)
        return written


# --------------------------------------------------------------------------------------------
# Compatibility
# --------------------------------------------------------------------------------------------


class _Incompatible(Exception):
    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")


def _index_of(schema: Schema) -> dict[str, dict[str, Any]]:
    index: dict[str, dict[str, Any]] = {}
    _collect_definitions(schema, None, index, "schema")
    return index


class _Resolver:
    """Avro schema resolution (spec, "Schema Resolution"), structurally: can ``reader`` read
    everything ``writer`` can write? Logical types are ignored, as the spec says."""

    def __init__(self, writer: Schema, reader: Schema) -> None:
        self.writer_index = _index_of(writer)
        self.reader_index = _index_of(reader)
        self.seen: set[tuple[str, str]] = set()

    @staticmethod
    def _deref(schema: Schema, index: Mapping[str, dict[str, Any]], namespace: str | None) -> tuple[Schema, str | None]:
        """Resolve names to definitions and unwrap ``{"type": primitive, ...}``."""
        while True:
            if isinstance(schema, str):
                if schema in PRIMITIVES:
                    return schema, namespace
                full = qualify(schema, namespace)
                if full not in index:
                    raise _Incompatible("?", f"unknown type {schema!r}")
                schema, namespace = index[full], _namespace_of(full)
                continue
            if isinstance(schema, dict):
                kind = schema.get("type")
                if kind in NAMED_KINDS:
                    return schema, _namespace_of(definition_fullname(schema, namespace))
                if kind in ("array", "map"):
                    return schema, namespace
                schema = kind
                continue
            return schema, namespace

    @staticmethod
    def _kind(schema: Schema) -> str:
        if isinstance(schema, str):
            return schema
        if isinstance(schema, list):
            return "union"
        return str(schema["type"]) if schema["type"] != "error" else "record"

    @staticmethod
    def _describe(schema: Schema, namespace: str | None) -> str:
        if isinstance(schema, str):
            return schema
        if isinstance(schema, list):
            return "union"
        if schema.get("type") in NAMED_KINDS:
            return f"{schema['type']} {definition_fullname(schema, namespace)}"
        return str(schema.get("type"))

    def _same_name(self, w: dict[str, Any], wns: str | None, r: dict[str, Any], rns: str | None) -> bool:
        wname = definition_fullname(w, wns)
        rname = definition_fullname(r, rns)
        if wname == rname:
            return True
        aliases = {qualify(a, _namespace_of(rname)) for a in r.get("aliases", ())}
        return wname in aliases

    def _matches(self, w: Schema, wns: str | None, r: Schema, rns: str | None, promote: bool) -> bool:
        """The union-branch matching rule: same kind (and name), or promotable primitive."""
        wk, rk = self._kind(w), self._kind(r)
        if wk in PRIMITIVES:
            return wk == rk or (promote and rk in PROMOTIONS.get(wk, ()))
        if wk != rk:
            return False
        if wk in ("record", "enum", "fixed"):
            return self._same_name(w, wns, r, rns)
        return True

    def check(self, w: Schema, wns: str | None, r: Schema, rns: str | None, path: str) -> None:
        w, wns = self._deref(w, self.writer_index, wns)
        r, rns = self._deref(r, self.reader_index, rns)
        wk, rk = self._kind(w), self._kind(r)
        if wk == "union":
            for branch in w:
                self.check(branch, wns, r, rns, path)
            return
        if rk == "union":
            branches = [self._deref(b, self.reader_index, rns) for b in r]
            for promote in (False, True):
                for rb, rbns in branches:
                    if self._matches(w, wns, rb, rbns, promote):
                        self.check(w, wns, rb, rbns, path)
                        return
            raise _Incompatible(
                path,
                f"the reader's union [{', '.join(self._describe(b, n) for b, n in branches)}] "
                f"has no branch for the writer's {self._describe(w, wns)}",
            )
        if wk in PRIMITIVES or rk in PRIMITIVES:
            if wk == rk or rk in PROMOTIONS.get(wk, ()):
                return
            raise _Incompatible(
                path,
                f"the writer's {self._describe(w, wns)} cannot be read as {self._describe(r, rns)}",
            )
        if wk != rk:
            raise _Incompatible(
                path,
                f"the writer's {self._describe(w, wns)} cannot be read as {self._describe(r, rns)}",
            )
        if wk == "array":
            self.check(w["items"], wns, r["items"], rns, f"{path}[]")
            return
        if wk == "map":
            self.check(w["values"], wns, r["values"], rns, f"{path}{{}}")
            return
        if not self._same_name(w, wns, r, rns):
            raise _Incompatible(
                path,
                f"the writer's {self._describe(w, wns)} cannot be read as {self._describe(r, rns)} (names differ)",
            )
        wname, rname = definition_fullname(w, wns), definition_fullname(r, rns)
        if wk == "fixed":
            if w["size"] != r["size"]:
                raise _Incompatible(path, f"fixed {rname}: size {w['size']} cannot be read as size {r['size']}")
            return
        if wk == "enum":
            missing = [s for s in w["symbols"] if s not in r["symbols"]]
            if missing and "default" not in r:
                raise _Incompatible(
                    path,
                    f"enum {rname}: the writer's symbols {missing} are unknown to the reader, "
                    "whose enum has no default symbol",
                )
            return
        # record
        if (wname, rname) in self.seen:
            return
        self.seen.add((wname, rname))
        inner_w, inner_r = _namespace_of(wname), _namespace_of(rname)
        writer_fields = {f["name"]: f for f in w["fields"]}
        for rf in r["fields"]:
            wf = writer_fields.get(rf["name"])
            if wf is None:
                for alias in rf.get("aliases", ()):
                    wf = writer_fields.get(alias)
                    if wf is not None:
                        break
            fpath = f"{rname}.{rf['name']}"
            if wf is None:
                if "default" not in rf:
                    raise _Incompatible(fpath, "the reader has this field without a default and the writer lacks it")
                continue
            self.check(wf["type"], inner_w, rf["type"], inner_r, fpath)


def _as_schema(schema: NamedSchema | Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    if isinstance(schema, NamedSchema):
        return schema.expanded, f"{schema.name} ({schema.fingerprint_hex})"
    as_dict = dict(schema)
    label = definition_fullname(as_dict, None) if as_dict.get("type") in NAMED_KINDS else "schema"
    return as_dict, f"{label} ({fingerprint(as_dict):016x})"


def _resolve(writer: dict[str, Any], reader: dict[str, Any]) -> None:
    path = definition_fullname(reader, None) if "name" in reader else "schema"
    _Resolver(writer, reader).check(writer, None, reader, None, path)


def check_compatible(
    old: NamedSchema | Mapping[str, Any],
    new: NamedSchema | Mapping[str, Any],
    *,
    both_ways: bool = True,
) -> None:
    """Raise SchemaCompatibilityError unless ``new`` can replace ``old``.

    Backward: new code reads data written with ``old``. With ``both_ways`` (the default, and
    the promise of ``schemas/``) also forward: code that still uses ``old`` reads data written
    with ``new``. In practice: add only fields with defaults, remove only fields that had
    defaults, widen types only along Avro's promotions, add enum symbols only to enums with a
    default symbol, never add a branch to a union.
    """
    o, olabel = _as_schema(old)
    n, nlabel = _as_schema(new)
    try:
        _resolve(o, n)
    except _Incompatible as exc:
        raise SchemaCompatibilityError(
            f"backward incompatible (new code cannot read old data): {nlabel} reading data written with {olabel}: {exc}"
        ) from None
    if both_ways:
        try:
            _resolve(n, o)
        except _Incompatible as exc:
            raise SchemaCompatibilityError(
                f"forward incompatible (old code cannot read new data): {olabel} reading data "
                f"written with {nlabel}: {exc}"
            ) from None
