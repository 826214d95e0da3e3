-- Policy versions on every table, and the trainer's steps.
--
-- The version a span, attempt or rollout ran with is known where the work happens (the runner
-- tags each span of an attempt with `agentlightning.policy_version` and records it in the
-- attempt's metadata; the LLM proxy tags a call's span with the version the inference backend
-- says answered it), so the columns are derived from what the rows already hold. As DEFAULT
-- expressions they also fill rows written before this migration (computed when read) and rows
-- written by ingest views that predate it (computed when inserted).
ALTER TABLE {db}.otel_traces
    ADD COLUMN IF NOT EXISTS PolicyVersion Nullable(Int64)
    DEFAULT toInt64OrNull(SpanAttributes['agentlightning.policy_version']);

ALTER TABLE {db}.attempts
    ADD COLUMN IF NOT EXISTS policy_version Nullable(Int64)
    DEFAULT JSONExtract(ifNull(metadata, ''), 'policy_version', 'Nullable(Int64)');

-- A rollout's version is its latest attempt's: set by infra/clickhouse/ingest/rollouts.sql.
ALTER TABLE {db}.rollouts
    ADD COLUMN IF NOT EXISTS policy_version Nullable(Int64);

-- One row per training step (agl.trainer-metrics, TrainerStep). A step the trainer did again
-- after a crash (same batch) is sent again: the key makes it one row, the later one winning.
CREATE TABLE IF NOT EXISTS {db}.trainer_steps
(
    batch_id String,
    model String,
    policy_version Int64,
    step_time Float64,
    step_seconds Float64,
    idle_seconds Float64,
    tokens UInt64,
    samples UInt64,
    min_policy_version Nullable(Int64),
    staleness Nullable(Float64),
    metrics Map(LowCardinality(String), Float64),
    kafka_partition UInt32,
    kafka_offset UInt64
)
ENGINE = ReplacingMergeTree(kafka_offset)
ORDER BY batch_id;
