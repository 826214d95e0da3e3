"""The Avro -> ClickHouse path against the real embedded engine (no Kafka needed here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from clickhouse_connect.driver.exceptions import DatabaseError

from agl_stream.clickhouse.avro_ingest import columns_of, container, container_header, zigzag
from agl_stream.clickhouse.client import get_client
from agl_stream.config import Settings
from agl_stream.kafka.io import Fetched
from agl_stream.models import Attempt, Rollout, RolloutState, Span
from agl_stream.wire.codec import HEADER_SIZE, Codec
from agl_stream.wire.span_records import span_dict_records
from consumers.clickhouse_sink import EngineRefusedError, TableSink
from consumers.sink_specs import ROLLOUT_STATE, SPANS
from tests.integration.helpers import clickhouse
from tests.unit.test_codec import span_dict

pytestmark = pytest.mark.integration


def _squash(text: str) -> str:
    return "".join(text.split())


def test_type_mapping_matches_what_the_engine_reads(tmp_path: Path) -> None:
    codec = Codec.default()
    schemas = list(codec.contract.known.values())
    with clickhouse(Settings(data_dir=tmp_path)) as ch:
        for schema in schemas:
            path = tmp_path / f"{schema.fingerprint_hex}.avro"
            path.write_bytes(container(container_header(schema.expanded), []))
            engine = [(r[0], _squash(r[1])) for r in ch.query(f"DESCRIBE file('{path}', 'Avro')").result_rows]
            ours = [(name, _squash(kind)) for name, kind in columns_of(schema.expanded)]
            assert engine == ours, schema.name


def test_a_span_becomes_an_otel_traces_row(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    codec = Codec.default()
    span = span_dict()
    raw = codec.encode_dict("agl.Span", span)
    with clickhouse(settings) as ch:
        sink = TableSink(settings, ch)
        sink.prepare_tables()
        sink.prepare_tables()  # idempotent
        sink._insert(_fetched(sink, [raw], partition=3, first_offset=77), {})
        result = ch.query("SELECT * FROM agl.otel_traces")
        rows = [dict(zip(result.column_names, r, strict=True)) for r in result.result_rows]
    assert len(rows) == 1
    row: dict[str, Any] = rows[0]
    assert row["Timestamp"].timestamp() == pytest.approx(span["start_time"], abs=1e-6)
    assert row["Duration"] == 750_000_000
    assert (row["TraceId"], row["SpanId"], row["ParentSpanId"]) == (span["trace_id"], span["span_id"], "")
    assert (row["SpanName"], row["SpanKind"]) == ("openai.chat.completion", "SPAN_KIND_CLIENT")
    assert (row["StatusCode"], row["StatusMessage"]) == ("STATUS_CODE_OK", "")
    assert row["ServiceName"] == "agent"
    assert row["ResourceAttributes"] == {"service.name": "agent"}
    assert (row["ScopeName"], row["ScopeVersion"]) == ("scope", "1")
    # The OpenTelemetry Collector exporter's convention: strings as they are, the rest as JSON.
    assert row["SpanAttributes"] == {
        "gen_ai.system": "openai",
        "gen_ai.usage.input_tokens": "12",
        "gen_ai.request.temperature": "1",
        "stream": "false",
        "prompt_token_ids": "[1,2,3]",
        "agentlightning.reward.0.value": "0.5",
        "nothing": "null",
        "mixed": '[true,1,1,"1",null]',
    }
    assert row["Events.Name"] == ["e"] and row["Events.Attributes"] == [{"k": "1"}]
    assert row["Events.Timestamp"][0].timestamp() == pytest.approx(1.5)
    assert row["Links.TraceId"] == ["1" * 32] and row["Links.SpanId"] == ["2" * 16]
    assert row["Links.TraceState"] == ["v=1"] and row["Links.Attributes"] == [{"flag": "true"}]
    assert row["TraceState"] == ""
    assert (row["RolloutId"], row["AttemptId"], row["SequenceId"]) == ("ro-0123456789ab", "at-01234567", 3)
    assert (row["KafkaPartition"], row["KafkaOffset"]) == (3, 77)


def test_an_open_span_has_zero_duration(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    failed = span_dict(end_time=None, status={"status_code": "ERROR", "description": "boom"})
    raw = Codec.default().encode_dict("agl.Span", failed)
    with clickhouse(settings) as ch:
        sink = TableSink(settings, ch)
        sink.prepare_tables()
        sink._insert(_fetched(sink, [raw]), {})
        query = "SELECT Duration, StatusCode, StatusMessage FROM agl.otel_traces"
        [(duration, code, message)] = ch.query(query).result_rows
    assert (duration, code, message) == (0, "STATUS_CODE_ERROR", "boom")


def test_rows_carry_the_policy_version_their_work_ran_with(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    codec = Codec.default()
    tagged, untagged = span_dict(), span_dict()
    tagged["attributes"] = {**tagged["attributes"], "agentlightning.policy_version": 7}
    untagged["span_id"] = "f" * 16

    def attempt(number: int, version: int | None) -> Attempt:
        metadata = {"resources_id": "rs-000000000001", "policy_version": version} if version is not None else None
        return Attempt(
            rollout_id="ro-0123456789ab",
            attempt_id=f"at-0000000{number}",
            sequence_id=number,
            start_time=50.0 + number,
            status="failed" if number == 1 else "succeeded",
            metadata=metadata,
        )

    rollout = Rollout.model_validate(
        {"rollout_id": "ro-0123456789ab", "input": {}, "start_time": 10.0, "status": "succeeded"}
    )
    retried = RolloutState(
        rollout=rollout, attempts=[attempt(1, 4), attempt(2, 5)], version=3, cause_event_id="e", cause_time=1
    )
    fresh = Rollout.model_validate({"rollout_id": "ro-0123456789ac", "input": {}, "start_time": 11.0})
    queued = RolloutState(rollout=fresh, attempts=[], version=1, cause_event_id="e", cause_time=1)
    with clickhouse(settings) as ch:
        spans, states = TableSink(settings, ch, SPANS), TableSink(settings, ch, ROLLOUT_STATE)
        spans.prepare_tables()
        states.prepare_tables()
        spans._insert(_fetched(spans, [codec.encode_dict("agl.Span", s) for s in (tagged, untagged)]), {})
        states._insert(_fetched(states, [codec.encode(retried), codec.encode(queued)]), {})
        span_versions = ch.query("SELECT PolicyVersion FROM agl.otel_traces ORDER BY SpanId").result_rows
        attempts = ch.query("SELECT attempt_id, policy_version FROM agl.attempts FINAL ORDER BY 1").result_rows
        rollouts = ch.query("SELECT rollout_id, policy_version FROM agl.rollouts FINAL ORDER BY 1").result_rows
    assert span_versions == [(7,), (None,)]
    assert attempts == [("at-00000001", 4), ("at-00000002", 5)]
    assert rollouts == [("ro-0123456789ab", 5), ("ro-0123456789ac", None)]  # the latest attempt's


def _fetched(
    sink: TableSink, raws: list[bytes], *, partition: int = 0, first_offset: int = 0
) -> list[Fetched[memoryview]]:
    """Records as the sink's consumer hands them over (its ``prepare`` applied), at consecutive offsets."""
    out = []
    for offset, raw in enumerate(raws, start=first_offset):
        body = sink.bodies(raw)
        assert body is not None
        out.append(Fetched("t", partition, offset, b"k", body, raw, 0))
    return out


def test_a_span_batch_becomes_one_row_per_span_at_its_offset(tmp_path: Path) -> None:
    """Batches and single spans in one INSERT; every span comes back from SpanJson as it was sent."""
    settings = Settings(data_dir=tmp_path)
    codec = Codec.default()
    spans = [span_dict(sequence_id=seq, span_id=f"{seq:016x}") for seq in (1, 2, 3)]
    single = span_dict(sequence_id=4, span_id=f"{4:016x}", attempt_id="at-00000002")
    [(_, batch)] = span_dict_records(spans, codec)
    with clickhouse(settings) as ch:
        sink = TableSink(settings, ch, SPANS)
        sink.prepare_tables()
        sink._insert(_fetched(sink, [batch, codec.encode_dict("agl.Span", single)], first_offset=10), {})
        rows = ch.query("SELECT SequenceId, KafkaOffset, SpanJson FROM agl.otel_traces ORDER BY SequenceId").result_rows
        assert sink.applied_offsets() == {0: 12}
    assert [(seq, offset) for seq, offset, _ in rows] == [(1, 10), (2, 10), (3, 10), (4, 11)]
    assert [Span.model_validate_json(js) for *_, js in rows] == [Span.model_validate(s) for s in (*spans, single)]


def test_bytes_after_a_valid_body_forge_no_rows_and_lose_none(tmp_path: Path) -> None:
    """A record whose value is a valid span followed by more bytes (here: the body of another
    span with an offset of its own) is one row at its own offset; its neighbours all land."""
    settings = Settings(data_dir=tmp_path)
    codec = Codec.default()
    spans = [span_dict(sequence_id=seq, span_id=f"{seq:016x}") for seq in (1, 2, 3)]
    forged = span_dict(sequence_id=99, span_id=f"{99:016x}")
    raws = [codec.encode_dict("agl.Span", s) for s in spans]
    tail = zigzag(0) + zigzag(10**12) + codec.encode_dict("agl.Span", forged)[HEADER_SIZE:]
    raws[1] += tail
    with clickhouse(settings) as ch:
        sink = TableSink(settings, ch, SPANS)
        sink.prepare_tables()
        sink._insert(_fetched(sink, raws, first_offset=20), {})
        rows = ch.query("SELECT SequenceId, KafkaOffset FROM agl.otel_traces ORDER BY SequenceId").result_rows
        assert sink.applied_offsets() == {0: 23}
    assert [tuple(r) for r in rows] == [(1, 20), (2, 21), (3, 22)]


def test_one_insert_is_one_part_however_the_engine_would_squash_it(tmp_path: Path) -> None:
    """The "data" resume policy needs one part per INSERT. The engine writes a part per block
    it squashed (ARRAY JOIN yields blocks of max_block_size rows, squashed up to 256 MB by
    default: 100k spans of 1.9 KB made two parts); small blocks here show it with 3,000 spans."""
    settings = Settings(data_dir=tmp_path)
    codec = Codec.default()
    spans = [span_dict(sequence_id=seq, span_id=f"{seq:016x}") for seq in range(1, 3001)]
    records = [
        value for start in range(0, 3000, 100) for _, value in span_dict_records(spans[start : start + 100], codec)
    ]
    parts = "SELECT count() FROM system.parts WHERE database = 'agl' AND table = 'otel_traces' AND active"
    with clickhouse(settings) as setup:
        TableSink(settings, setup, SPANS).prepare_tables()
    small_blocks = get_client(
        settings, max_block_size=100, min_insert_block_size_rows=100, min_insert_block_size_bytes=10_000
    )
    try:
        small_blocks.command("SYSTEM STOP MERGES agl.otel_traces")
        sink = TableSink(settings, small_blocks, SPANS)
        plain = _fetched(sink, records[:15])
        block = container(sink.header, [(r.partition, r.offset, r.value) for r in plain])
        small_blocks.raw_insert(sink.ingest_table, insert_block=block, fmt="Avro")
        assert int(str(small_blocks.command(parts))) > 1  # what the session alone does
        small_blocks.command("TRUNCATE TABLE agl.otel_traces")
        sink._insert(_fetched(sink, records), {})
        assert int(str(small_blocks.command(parts))) == 1
        assert int(str(small_blocks.command("SELECT count() FROM agl.otel_traces"))) == 3000
    finally:
        small_blocks.close()


def test_the_probe_finds_the_records_the_engine_refuses_and_writes_nothing(tmp_path: Path) -> None:
    """A NaN start time is valid Avro and a valid Span, but no DateTime64: the engine refuses
    the block. The probe names that record alone (a batch is refused whole)."""
    settings = Settings(data_dir=tmp_path)
    codec = Codec.default()
    good = [span_dict(sequence_id=seq, span_id=f"{seq:016x}") for seq in range(1, 9)]
    nan = span_dict(sequence_id=9, span_id=f"{9:016x}", start_time=float("nan"))
    raws = [
        span_dict_records(good[:3], codec)[0][1],
        span_dict_records([good[3], nan, good[4]], codec)[0][1],
        codec.encode_dict("agl.Span", good[5]),
        span_dict_records(good[6:], codec)[0][1],
    ]
    with clickhouse(settings) as ch:
        sink = TableSink(settings, ch, SPANS)
        sink.prepare_tables()
        records = _fetched(sink, raws)
        with pytest.raises(DatabaseError, match="DateTime64"):
            sink._insert(records, {})
        kept, refused = sink._split_refused(records)
        assert [r.offset for r in kept] == [0, 2, 3]
        [bad] = refused
        assert bad.offset == 1 and isinstance(bad.error, EngineRefusedError) and "DateTime64" in str(bad.error)
        assert int(str(ch.command("SELECT count() FROM agl.otel_traces"))) == 0  # probing writes nothing
        sink._insert(kept, {})
        assert int(str(ch.command("SELECT count() FROM agl.otel_traces"))) == 6
        assert sink._split_refused(kept) == (kept, [])  # a block the engine takes has no bad record
