"""Schema evolution: the history mechanism, both directions, and what must be refused."""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from agl_stream.cli.schemas_cmd import schemas_app
from agl_stream.errors import CodecError, SchemaCompatibilityError, UnknownFingerprintError
from agl_stream.models import Span, TripletBatch, TripletRecord, Worker
from agl_stream.resources import resource_path
from agl_stream.wire.codec import Codec
from agl_stream.wire.contract import (
    Contract,
    NamedSchema,
    SchemaDefinitionError,
    check_compatible,
    expand_schema,
    load_definitions,
)

CURRENT = Contract.load()


def expanded(name: str) -> dict[str, Any]:
    """A private copy of a current schema, fully expanded."""
    return copy.deepcopy(CURRENT.schema(name).expanded)


def _walk(schema: Any) -> Iterator[dict[str, Any]]:
    if isinstance(schema, list):
        for branch in schema:
            yield from _walk(branch)
    elif isinstance(schema, dict):
        yield schema
        for fld in schema.get("fields", ()):
            yield from _walk(fld["type"])
        for key in ("items", "values"):
            if key in schema:
                yield from _walk(schema[key])


def definition(schema: dict[str, Any], name: str) -> dict[str, Any]:
    """The named definition ``name`` (short name) inside an expanded schema."""
    for node in _walk(schema):
        if node.get("name") == name and node.get("type") in ("record", "enum"):
            return node
    raise KeyError(name)


def add_field(schema: dict[str, Any], record: str, field: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(schema)
    definition(out, record)["fields"].append(field)
    return out


def remove_field(schema: dict[str, Any], record: str, name: str) -> dict[str, Any]:
    out = copy.deepcopy(schema)
    target = definition(out, record)
    target["fields"] = [f for f in target["fields"] if f["name"] != name]
    return out


def change_field(
    schema: dict[str, Any], record: str, name: str, change: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    out = copy.deepcopy(schema)
    for fld in definition(out, record)["fields"]:
        if fld["name"] == name:
            change(fld)
    return out


def add_symbol(schema: dict[str, Any], enum: str, symbol: str) -> dict[str, Any]:
    out = copy.deepcopy(schema)
    definition(out, enum)["symbols"].append(symbol)
    return out


def codec_of(current: dict[str, Any], *known: dict[str, Any]) -> Codec:
    """A codec whose current schema is ``current`` and which also knows ``known`` writers."""
    return Codec(Contract.from_schemas([current], known), models={})


WORKER_V1 = expanded("Worker")
# v2: a field added with a default, a defaulted field removed, an enum symbol added to an
# enum that has a default symbol.
WORKER_V2 = add_symbol(
    remove_field(
        add_field(WORKER_V1, "Worker", {"name": "region", "type": "string", "default": "eu"}),
        "Worker",
        "last_dequeue_time",
    ),
    "WorkerStatus",
    "draining",
)

WORKER_DATUM = {
    "worker_id": "w-1",
    "status": "busy",
    "heartbeat_stats": {"cpu": 0.5},
    "last_heartbeat_time": 10.0,
    "last_dequeue_time": 9.0,
    "last_busy_time": 8.0,
    "last_idle_time": None,
    "current_rollout_id": "ro-0123456789ab",
    "current_attempt_id": "at-01234567",
}


# --------------------------------------------------------------------------------------------
# Both directions through the codec
# --------------------------------------------------------------------------------------------


def test_v2_is_compatible_both_ways() -> None:
    check_compatible(WORKER_V1, WORKER_V2)
    check_compatible(WORKER_V2, WORKER_V1)


def test_new_code_reads_old_data() -> None:
    old, new = codec_of(WORKER_V1), codec_of(WORKER_V2, WORKER_V1)
    data = old.encode_dict("agl.Worker", WORKER_DATUM)
    name, datum = new.decode_dict(data)
    assert name == "agl.Worker"
    assert datum["region"] == "eu"  # the added field's default
    assert "last_dequeue_time" not in datum  # the removed field is skipped
    assert datum["status"] == "busy" and datum["heartbeat_stats"] == {"cpu": 0.5}


def test_old_code_reads_new_data() -> None:
    new = codec_of(WORKER_V2)
    old = codec_of(WORKER_V1, WORKER_V2)  # the new schema shipped to old readers first
    datum = {k: v for k, v in WORKER_DATUM.items() if k != "last_dequeue_time"}
    data = new.encode_dict("agl.Worker", {**datum, "status": "draining", "region": "us"})
    _, read = old.decode_dict(data)
    assert read["status"] == "unknown"  # an unknown symbol falls back to the enum default
    assert read["last_dequeue_time"] is None  # the removed field's old default
    assert "region" not in read
    # ... and the current model accepts what the old schema reads.
    assert Worker.model_validate(read).status == "unknown"


def test_old_code_without_the_new_schema_reports_the_fingerprint() -> None:
    new, old = codec_of(WORKER_V2), codec_of(WORKER_V1)
    data = new.encode_dict("agl.Worker", {**WORKER_DATUM, "region": "us"})
    with pytest.raises(UnknownFingerprintError) as info:
        old.decode_dict(data)
    assert info.value.fingerprint == NamedSchema.from_expanded(WORKER_V2).fingerprint


def test_the_bundled_codec_resolves_history_to_the_current_models() -> None:
    """An older Span (before scope_version existed) decodes into today's Span model."""
    span_v0 = remove_field(expanded("Span"), "Span", "scope_version")
    check_compatible(span_v0, CURRENT.schema("Span"))
    contract = Contract(CURRENT.current.values(), [*CURRENT.history.values(), NamedSchema.from_expanded(span_v0)])
    reader = Codec(contract)
    writer = codec_of(span_v0)
    datum = {
        "rollout_id": "ro-0123456789ab",
        "attempt_id": "at-01234567",
        "sequence_id": 1,
        "trace_id": "a" * 32,
        "span_id": "b" * 16,
        "parent_id": None,
        "name": "old",
        "kind": "INTERNAL",
        "status": {"status_code": "OK", "description": None},
        "attributes": {"n": 1, "f": 1.0, "b": True},
        "events": [],
        "links": [],
        "start_time": 1.0,
        "end_time": 2.0,
        "context": None,
        "parent": None,
        "resource": {"attributes": {}, "schema_url": ""},
        "scope_name": "s",
    }
    span = reader.decode(writer.encode_dict("agl.Span", datum), Span)
    assert span.scope_version == ""
    assert span.attributes == {"n": 1, "f": 1.0, "b": True}
    assert [type(v) for v in span.attributes.values()] == [int, float, bool]


# The releases before triplet records carried their rollout's mode.
TRIPLET_RECORD_V0 = "schemas/history/TripletRecord.ab487a7e4d054dbd.avsc"
TRIPLET_BATCH_V0 = "schemas/history/TripletBatch.21dfbe7e152ae434.avsc"


def _triplet_record_datum(**extra: Any) -> dict[str, Any]:
    return {
        "rollout_id": "ro-0123456789ab",
        "attempt_id": "at-01234567",
        "group_id": "g",
        "resources_id": None,
        "policy_version": 2,
        "triplets": [],
        "final_reward": 0.5,
        "finish_time": 1.0,
        **extra,
    }


def test_triplet_records_and_batches_written_before_the_mode_field_decode_without_a_mode() -> None:
    record_v0 = json.loads(resource_path(TRIPLET_RECORD_V0).read_text())
    batch_v0 = json.loads(resource_path(TRIPLET_BATCH_V0).read_text())
    for old, new in ((record_v0, "TripletRecord"), (batch_v0, "TripletBatch")):
        check_compatible(old, CURRENT.schema(new).expanded)  # both directions
    reader = Codec.default()  # the bundled contract knows the old versions from history/
    record = reader.decode(codec_of(record_v0).encode_dict("agl.TripletRecord", _triplet_record_datum()), TripletRecord)
    assert record.mode is None and record.policy_version == 2  # no mode: the batcher trains on it
    batch_datum = {"batch_id": "tb-1", "records": [_triplet_record_datum()], "created_time": 1.0}
    batch = reader.decode(codec_of(batch_v0).encode_dict("agl.TripletBatch", batch_datum), TripletBatch)
    assert batch.dropped_eval == 0 and [r.mode for r in batch.records] == [None]
    assert batch.staleness_counts == [] and batch.kept_stale == 0  # older than the staleness histogram


# The release before batches carried their staleness histogram.
TRIPLET_BATCH_BEFORE_HISTOGRAM = "schemas/history/TripletBatch.9b7041f2f6a540e7.avsc"


def test_batches_written_before_the_staleness_histogram_read_with_none_and_old_readers_skip_it() -> None:
    old_schema = json.loads(resource_path(TRIPLET_BATCH_BEFORE_HISTOGRAM).read_text())
    assert "staleness_counts" not in {f["name"] for f in old_schema["fields"]}
    check_compatible(old_schema, CURRENT.schema("TripletBatch").expanded)  # both directions
    datum = {"batch_id": "tb-1", "records": [_triplet_record_datum()], "created_time": 1.0, "kept_stale": 2}
    batch = Codec.default().decode(codec_of(old_schema).encode_dict("agl.TripletBatch", datum), TripletBatch)
    assert batch.staleness_counts == [] and batch.kept_stale == 2
    new = TripletBatch(batch_id="tb-2", created_time=1.0, kept_stale=1, staleness_counts=[3, 0, 1])
    data = Codec.default().encode(new)
    assert Codec.default().decode(data, TripletBatch) == new
    _, read = codec_of(old_schema, CURRENT.schema("TripletBatch").expanded).decode_dict(data)
    assert "staleness_counts" not in read and read["kept_stale"] == 1


def test_old_readers_skip_the_mode_of_new_triplet_records() -> None:
    record_v0 = json.loads(resource_path(TRIPLET_RECORD_V0).read_text())
    old = codec_of(record_v0, CURRENT.schema("TripletRecord").expanded)  # the new snapshot shipped first
    data = Codec.default().encode(TripletRecord.model_validate(_triplet_record_datum(mode="val")))
    _, read = old.decode_dict(data)
    assert "mode" not in read and read["rollout_id"] == "ro-0123456789ab"
    assert Codec.default().decode(data, TripletRecord).mode == "val"


def test_json_fields_added_later_get_their_default_as_a_value() -> None:
    v2 = add_field(
        WORKER_V1,
        "Worker",
        {"name": "labels", "type": ["null", {"type": "string", "logicalType": "json"}], "default": None},
    )
    v2 = add_field(
        v2, "Worker", {"name": "weight", "type": {"type": "string", "logicalType": "json"}, "default": "1.5"}
    )
    check_compatible(WORKER_V1, v2)
    _, datum = codec_of(v2, WORKER_V1).decode_dict(codec_of(WORKER_V1).encode_dict("agl.Worker", WORKER_DATUM))
    assert datum["labels"] is None
    assert datum["weight"] == 1.5


def test_json_object_defaults_are_refused() -> None:
    v2 = add_field(
        WORKER_V1, "Worker", {"name": "labels", "type": {"type": "string", "logicalType": "json"}, "default": "{}"}
    )
    with pytest.raises(SchemaDefinitionError, match="JSON scalar"):
        NamedSchema.from_expanded(v2)


# --------------------------------------------------------------------------------------------
# What check_compatible must refuse, and why
# --------------------------------------------------------------------------------------------


def test_field_added_without_default() -> None:
    v2 = add_field(WORKER_V1, "Worker", {"name": "region", "type": "string"})
    with pytest.raises(SchemaCompatibilityError, match=r"backward.*agl\.Worker\.region.*without a default"):
        check_compatible(WORKER_V1, v2)
    # The codec agrees: new code cannot read old data.
    data = codec_of(WORKER_V1).encode_dict("agl.Worker", WORKER_DATUM)
    with pytest.raises(CodecError):
        codec_of(v2, WORKER_V1).decode_dict(data)


def test_field_removed_without_default() -> None:
    v2 = remove_field(WORKER_V1, "Worker", "worker_id")
    check_compatible(WORKER_V1, v2, both_ways=False)  # new code still reads old data
    with pytest.raises(SchemaCompatibilityError, match=r"forward.*agl\.Worker\.worker_id"):
        check_compatible(WORKER_V1, v2)
    data = codec_of(v2).encode_dict("agl.Worker", {k: v for k, v in WORKER_DATUM.items() if k != "worker_id"})
    with pytest.raises(CodecError):
        codec_of(WORKER_V1, v2).decode_dict(data)


def test_type_changed_incompatibly() -> None:
    v2 = change_field(WORKER_V1, "Worker", "worker_id", lambda f: f.update(type="long"))
    with pytest.raises(
        SchemaCompatibilityError, match=r"agl\.Worker\.worker_id: the writer's string cannot be read as long"
    ):
        check_compatible(WORKER_V1, v2)


def test_promotion_is_one_way() -> None:
    config = expanded("RolloutConfig")
    v2 = change_field(config, "RolloutConfig", "max_attempts", lambda f: f.update(type="long"))
    check_compatible(config, v2, both_ways=False)  # int data reads as long
    with pytest.raises(SchemaCompatibilityError, match=r"forward.*long cannot be read as int"):
        check_compatible(config, v2)


def test_enum_symbol_added_without_default() -> None:
    v2 = add_symbol(expanded("Rollout"), "RolloutStatus", "paused")
    check_compatible(expanded("Rollout"), v2, both_ways=False)
    with pytest.raises(SchemaCompatibilityError, match=r"forward.*\['paused'\].*no default symbol"):
        check_compatible(expanded("Rollout"), v2)


def test_union_branch_added_to_the_event_envelope() -> None:
    event = expanded("RolloutEvent")
    v2 = copy.deepcopy(event)
    payload = next(f for f in v2["fields"] if f["name"] == "payload")
    payload["type"].append({"type": "record", "name": "RolloutPaused", "namespace": "agl", "fields": []})
    check_compatible(event, v2, both_ways=False)
    with pytest.raises(SchemaCompatibilityError, match=r"has no branch for the writer's record agl\.RolloutPaused"):
        check_compatible(event, v2)


def test_renamed_record_needs_an_alias() -> None:
    v2 = expanded("AttemptHeartbeat")
    v2["name"] = "Heartbeat"
    with pytest.raises(SchemaCompatibilityError, match="names differ"):
        check_compatible(expanded("AttemptHeartbeat"), v2, both_ways=False)
    v2["aliases"] = ["agl.AttemptHeartbeat"]
    check_compatible(expanded("AttemptHeartbeat"), v2, both_ways=False)


def test_nullable_widening_and_narrowing() -> None:
    v2 = change_field(WORKER_V1, "Worker", "worker_id", lambda f: f.update(type=["null", "string"], default=None))
    check_compatible(WORKER_V1, v2, both_ways=False)
    with pytest.raises(SchemaCompatibilityError, match="the writer's null cannot be read as string"):
        check_compatible(WORKER_V1, v2)


# --------------------------------------------------------------------------------------------
# The snapshots
# --------------------------------------------------------------------------------------------


def test_every_schema_is_snapshotted() -> None:
    """Fails when a schema changed without a snapshot, or incompatibly with an older one.

    Fix: make the change compatible (defaults!), then run `agl-stream schemas snapshot`.
    """
    contract = Contract.load()
    missing = [f"{s.name} ({s.fingerprint_hex})" for s in contract.missing_snapshots()]
    assert not missing, f"run `agl-stream schemas snapshot`; not in schemas/history: {missing}"
    for schema in contract.current.values():
        for old in contract.history_of(schema.name):
            check_compatible(old, schema)
    assert contract.compatibility_problems() == []


def test_snapshot_files_are_self_contained_and_named_by_fingerprint() -> None:
    history = resource_path("schemas") / "history"
    files = sorted(history.glob("*.avsc"))
    assert files
    for path in files:
        schema = NamedSchema.from_expanded(json.loads(path.read_text()))
        assert path.name == f"{schema.short_name}.{schema.fingerprint:016x}.avsc"


def test_references_resolve_regardless_of_file_order() -> None:
    index = load_definitions(resource_path("schemas"))
    rollout = expand_schema("agl.Rollout", index)
    config = next(f for f in rollout["fields"] if f["name"] == "config")
    assert config["type"]["name"] == "RolloutConfig"  # inlined, not a dangling name
    enqueued = expand_schema("agl.RolloutEnqueued", index)
    assert json.dumps(enqueued).count('"name": "RolloutConfig"') == 1  # defined once


# --------------------------------------------------------------------------------------------
# The CLI
# --------------------------------------------------------------------------------------------


@pytest.fixture
def schema_copy(tmp_path: Path) -> Path:
    target = tmp_path / "schemas"
    shutil.copytree(resource_path("schemas"), target)
    return target


def _run(*args: str) -> Any:
    return CliRunner().invoke(schemas_app, list(args))


def test_cli_check_passes_on_the_bundled_schemas(schema_copy: Path) -> None:
    result = _run("check", "--schemas-dir", str(schema_copy))
    assert result.exit_code == 0, result.output
    assert "compatible" in result.output


def test_cli_snapshot_then_check(schema_copy: Path) -> None:
    path = schema_copy / "Worker.avsc"
    schema = json.loads(path.read_text())
    schema["fields"].append({"name": "region", "type": "string", "default": "eu"})
    path.write_text(json.dumps(schema))
    result = _run("check", "--schemas-dir", str(schema_copy))
    assert result.exit_code == 1
    assert "not snapshotted: agl.Worker" in result.output
    result = _run("snapshot", "--schemas-dir", str(schema_copy))
    assert result.exit_code == 0, result.output
    assert "Worker." in result.output
    assert _run("check", "--schemas-dir", str(schema_copy)).exit_code == 0


def test_cli_refuses_an_incompatible_change(schema_copy: Path) -> None:
    path = schema_copy / "Worker.avsc"
    schema = json.loads(path.read_text())
    schema["fields"].append({"name": "region", "type": "string"})
    path.write_text(json.dumps(schema))
    result = _run("check", "--schemas-dir", str(schema_copy))
    assert result.exit_code == 1
    assert "agl.Worker.region" in result.output and "without a default" in result.output
    before = sorted(p.name for p in (schema_copy / "history").iterdir())
    assert _run("snapshot", "--schemas-dir", str(schema_copy)).exit_code == 1
    assert sorted(p.name for p in (schema_copy / "history").iterdir()) == before


def test_edited_snapshot_is_detected(schema_copy: Path) -> None:
    snapshot = next((schema_copy / "history").glob("Worker.*.avsc"))
    schema = json.loads(snapshot.read_text())
    schema["fields"].append({"name": "sneaky", "type": "string", "default": ""})
    snapshot.write_text(json.dumps(schema))
    with pytest.raises(SchemaDefinitionError, match="never be edited"):
        Contract.load(schema_copy)


def test_dangling_reference_is_reported(schema_copy: Path) -> None:
    (schema_copy / "RolloutConfig.avsc").unlink()
    with pytest.raises(SchemaDefinitionError, match=r"unknown type 'agl\.RolloutConfig'"):
        Contract.load(schema_copy)


def test_cli_show_prints_a_self_contained_schema() -> None:
    result = _run("show", "TaskRequest")
    assert result.exit_code == 0
    shown = NamedSchema.from_expanded(json.loads(result.stdout))
    assert shown.fingerprint == CURRENT.schema("TaskRequest").fingerprint
    assert shown.header.hex(" ") in result.stderr
    assert _run("show", "Nope").exit_code == 1
