"""What each ClickHouse sink reads and writes: one :class:`SinkSpec` per topic (its record type,
its target tables and their transforms in infra/clickhouse/ingest/, how it resumes), and the DDL
of the ingest pipeline a spec makes (a Null table per writer schema, a materialized view per
target). Declarations and pure functions; the sinks that run them are consumers/clickhouse_sink.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from agl_stream.clickhouse import avro_ingest, times
from agl_stream.config import Settings
from agl_stream.errors import MalformedRecordError
from agl_stream.models import ResourcesUpdate
from agl_stream.resources import resource_path
from agl_stream.wire import span_records
from agl_stream.wire.codec import dump_json

ResumePolicy = Literal["data", "committed"]
Lane = Literal["store", "training"]
"""The sinks of a process (the gateway's, ``agl-stream sink``) share one consumer per lane:
``store``, the tables the store's fenced reads wait on (spans, rollout states, workers,
resources), busy with every rollout; ``training``, the bulky training tables (triplets, batches,
trainer steps) and the dead letters, whose records come in bursts and MBs. A fetch lists every
partition of its consumer's topics (aiokafka has no incremental fetch sessions), so one consumer
for all of them made each of the store's fetches carry the idle training partitions; two keep
the idle stack's requests low and a store read from waiting behind a batch's INSERT."""

PythonRows = Callable[[Any], dict[str, Any]]
"""Turns a decoded record (the topic's model) into one row; raises CodecError if it cannot."""


@dataclass(frozen=True)
class AlsoReads:
    """Another record type a topic carries, and how a body of it (in its current schema)
    becomes a body of the spec's record, so one INSERT still takes the whole batch."""

    record: str
    to_body: Callable[[memoryview], bytes]


@dataclass(frozen=True)
class Target:
    """One table a topic is materialized into, and the SELECT that makes its rows."""

    table: str
    transform: str = ""  # file under infra/clickhouse/ingest/; `{db}` is replaced by the database


@dataclass(frozen=True)
class SinkSpec:
    """One topic -> one Null ingest table -> one materialized view per target table."""

    name: str  # also names the consumer group and the sink_offsets rows
    topic: str  # short name, without the prefix
    record: str  # Avro full name of the topic's values
    targets: tuple[Target, ...]
    ingest: str  # base name of the Null tables, one per writer schema fingerprint
    resume: ResumePolicy = "committed"
    position_columns: tuple[str, str] = ("kafka_partition", "kafka_offset")  # of targets[0], for "data"
    skip_tombstones: bool = False  # compacted topics: a null value forgets a key, it is not an error
    batch_size: int = 10_000
    flush_ms: int = 200  # how long a batch may linger after its first record
    # The busy sinks linger AGL_SINK_LINGER_MS instead (5 s by default) at every load: every
    # INSERT costs the engine tens of ms whatever its size (the views' plans, a part per target
    # table, their merges), so one INSERT should carry what arrived over seconds, as ClickHouse's
    # own Kafka engine does (it flushes every 7.5 s). A reader waiting on a fence of the topic
    # (``wanted``) ends the linger at once, so it costs latency only to readers the sink cannot
    # hear (SQL, the dashboard).
    lingers: bool = False
    python_rows: PythonRows | None = None  # decode in Python and insert rows into targets[0]
    # Rows come from the items of this array field of the record (the views read each item as
    # `record`, through an ARRAY JOIN), e.g. the spans of an agl.SpanBatch.
    explode: str | None = None
    also: tuple[AlsoReads, ...] = ()  # other record types of the topic, turned into `record`
    batch_bytes: int = 64 << 20  # a batch also ends once its records hold this many bytes
    # Which of the process's sink consumers reads the topic (see sinks_group_id).
    lane: Lane = "store"
    # Compacted state topics: of several records of one key in a batch only the newest makes a
    # row (the table keeps the newest version anyway); the others count as applied.
    latest_per_key: bool = False

    @property
    def table(self) -> str:
        """The primary table: the one "data" resumes from."""
        return self.targets[0].table

    def group_id(self, settings: Settings) -> str:
        """The group of this sink run on its own (``TableSink.run``)."""
        return f"{settings.topic_prefix}.sink.{self.name}"


def sinks_group_id(settings: Settings, lane: Lane = "store") -> str:
    """The group of the sinks of ``lane`` run together on one consumer."""
    return f"{settings.topic_prefix}.sinks.{lane}"


# agl.spans carries agl.SpanBatch records (one attempt's spans) and single agl.Span records:
# a single span's body becomes a one-span batch body (bytes only), so every sink batch is one
# INSERT of batches, exploded into rows by the view. All rows of a record share its offset.
SPANS = SinkSpec(
    "clickhouse-spans",
    "spans",
    span_records.SPAN_BATCH,
    (Target("otel_traces", "otel_traces.sql"),),
    ingest="otel_traces",
    resume="data",
    position_columns=("KafkaPartition", "KafkaOffset"),
    explode="spans",
    also=(AlsoReads(span_records.SPAN, span_records.batch_body_of_span),),
    batch_bytes=16 << 20,  # ~10,000 spans' worth, what one INSERT held before batches
    # A small span INSERT costs the engine ~60-90 ms (the span view's plan, otel_traces' part,
    # span_facts' view): a 200 ms linger made up to five a second at a light, steady load.
    lingers=True,
)
# State topics: every INSERT costs the engine ~25-40 ms of CPU whatever its size, so a batch
# lingers (``lingers``) and one INSERT carries many states. (At flush_ms=0 a light load, 20
# rollouts/s, made one INSERT per state record: the gateway spent a core on them; at 200 ms,
# 2.4 INSERTs a second per table, 19% of a core; at 1 s, one a second per table.)
ROLLOUT_STATE = SinkSpec(
    "clickhouse-rollout-state",
    "rollout-state",
    "agl.RolloutState",
    (Target("rollouts", "rollouts.sql"), Target("attempts", "attempts.sql")),
    ingest="rollout_state",
    skip_tombstones=True,
    lingers=True,
    latest_per_key=True,
)


REDACTED = "[redacted]"
"""What the ``resources`` table holds in place of an API key: every SQL caller can read the table.
The store reads resources with their keys from the agl.resources topic."""


def resources_row(update: ResourcesUpdate) -> dict[str, Any]:
    """A resources row; ``resources`` is the JSON object ResourcesUpdate.resources validates, the
    times are DateTime64 microsecond ticks."""
    contents = update.model_dump(mode="json")["resources"]
    for resource in contents.values():
        if isinstance(resource, dict) and resource.get("api_key") is not None:
            resource["api_key"] = REDACTED
    try:
        resources = dump_json(contents)
    except ValueError as exc:  # NaN/Infinity in a JSON payload: not representable as JSON
        raise MalformedRecordError(f"resources {update.resources_id} cannot be written as JSON: {exc}") from exc
    return {
        "resources_id": update.resources_id,
        "create_time": times.micros(update.create_time),
        "update_time": times.micros(update.update_time),
        "version": update.version,
        "resources": resources,
    }


RESOURCES = SinkSpec(
    "clickhouse-resources",
    "resources",
    "agl.ResourcesUpdate",
    (Target("resources"),),
    ingest="resources",
    skip_tombstones=True,
    flush_ms=0,
    python_rows=resources_row,
)
WORKERS = SinkSpec(
    "clickhouse-workers",
    "workers",
    "agl.Worker",
    (Target("workers", "workers.sql"),),
    ingest="workers",
    skip_tombstones=True,
    lingers=True,
    latest_per_key=True,
)
# Training data: a TripletRecord can be MBs of token ids and a TripletBatch up to 16 MiB, so
# batches of records are counted in hundreds, not thousands. Two targets for triplets (one
# INSERT is not atomic across them) and batches a batcher may send twice: both resume from the
# committed offset and rely on ReplacingMergeTree + FINAL (infra/clickhouse/004_training_tables.sql).
TRIPLETS = SinkSpec(
    "clickhouse-triplets",
    "triplets",
    "agl.TripletRecord",
    (Target("triplets", "triplets.sql"), Target("triplet_records", "triplet_records.sql")),
    ingest="triplets",
    batch_size=500,
    lane="training",
)
# A batch becomes its batches row and one batch_samples row per sample (the lineage: which
# attempts and spans a batch trained on, infra/clickhouse/008_batch_samples.sql).
TRIPLET_BATCHES = SinkSpec(
    "clickhouse-triplet-batches",
    "triplet-batches",
    "agl.TripletBatch",
    (Target("batches", "batches.sql"), Target("batch_samples", "batch_samples.sql")),
    ingest="triplet_batches",
    batch_size=50,
    flush_ms=0,
    lane="training",
)
TRAINER_STEPS = SinkSpec(
    "clickhouse-trainer-steps",
    "trainer-metrics",
    "agl.TrainerStep",
    (Target("trainer_steps", "trainer_steps.sql"),),
    ingest="trainer_steps",
    flush_ms=0,
    lane="training",
)
# Dead letters (agl.dlq), counted by reason and source in SQL and on the dashboard; their bytes
# are not copied (infra/clickhouse/010_dead_letters.sql says why). A DLQ record the engine
# refused would be dead-lettered to agl.dlq by this sink like any other: a new DlqRecord made by
# the sink itself (its source topic agl.dlq), which is read back once, not in a loop.
DEAD_LETTERS = SinkSpec(
    "clickhouse-dead-letters",
    "dlq",
    "agl.DlqRecord",
    (Target("dead_letters", "dead_letters.sql"),),
    ingest="dead_letters",
    batch_size=1000,  # a DLQ record holds up to 64 KiB of what it rejected
    flush_ms=200,
    lane="training",
)
SPECS: tuple[SinkSpec, ...] = (
    SPANS,
    ROLLOUT_STATE,
    RESOURCES,
    WORKERS,
    TRIPLETS,
    TRIPLET_BATCHES,
    TRAINER_STEPS,
    DEAD_LETTERS,
)


def ingest_ddl(
    spec: SinkSpec, database: str, fingerprint_hex: str, record_schema: dict[str, Any], *, probe: bool = False
) -> list[str]:
    """The Null table for one writer schema and a materialized view into each target table.

    Named after the writer schema's fingerprint: a new schema version gets new ones and the old
    ones stay valid for data still in flight.

    ``probe``: the same pipeline (``..._probe``) into Null copies of the targets, made afresh
    (so they have the targets' current columns). An INSERT there runs the engine's decoding and
    transforms and writes nothing: it tells which records the engine refuses.
    """
    if spec.python_rows is not None:
        return []
    suffix = "_probe" if probe else ""
    null_table = avro_ingest.ingest_table(database, spec.ingest, fingerprint_hex) + suffix
    columns = ", ".join(f"`{name}` {kind}" for name, kind in avro_ingest.columns_of(record_schema))
    statements = []
    if probe:
        for target in spec.targets:
            statements += [
                f"DROP VIEW IF EXISTS {null_table}_mv_{target.table}",
                f"DROP TABLE IF EXISTS {database}.{target.table}{suffix}",
                f"CREATE TABLE {database}.{target.table}{suffix} AS {database}.{target.table} ENGINE = Null",
            ]
    statements.append(f"CREATE TABLE IF NOT EXISTS {null_table} ({columns}) ENGINE = Null")
    source = null_table
    if spec.explode is not None:
        # One row per item, presented to the transform as `record` (as if each item had come
        # alone); the view still triggers on the Null table, the innermost one.
        source = (
            f"(SELECT kafka_partition, kafka_offset, item AS record FROM "
            f"(SELECT kafka_partition, kafka_offset, record AS outer_record FROM {null_table}) "
            f"ARRAY JOIN outer_record.{spec.explode} AS item)"
        )
    for target in spec.targets:
        # str.replace, not str.format: the transforms are full of JSON braces.
        transform = resource_path(f"infra/clickhouse/ingest/{target.transform}").read_text()
        statements.append(
            f"CREATE MATERIALIZED VIEW IF NOT EXISTS {null_table}_mv_{target.table} "
            f"TO {database}.{target.table}{suffix} AS {transform.replace('{db}', database)} FROM {source}"
        )
    return statements
