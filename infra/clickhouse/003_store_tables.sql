-- The store's state tables, materialized from the compacted state topics by the ClickHouse sink
-- (consumers/clickhouse_sink.py; the row transforms are infra/clickhouse/ingest/<table>.sql).
-- Columns are the models' field names (agl_stream/models); JSON payloads are JSON text.
--
-- Every table is a ReplacingMergeTree read with FINAL: the state sinks resume from their
-- committed Kafka offsets, so a crash between INSERT and commit inserts a batch again, and a
-- replay from the start of a topic re-inserts everything; the version column makes the newest
-- row win no matter in which order copies arrive. Each row also keeps the Kafka position it
-- came from.

-- One row per rollout: its latest RolloutState (agl.rollout-state, key rollout_id). `version`
-- counts the events folded into the state, so it orders the states of one rollout even when a
-- replay delivers an older one later. Rollouts the processor forgot (tombstones) stay here.
CREATE TABLE IF NOT EXISTS {db}.rollouts
(
    rollout_id String,
    input String CODEC(ZSTD(3)),
    start_time Float64,
    end_time Nullable(Float64),
    mode LowCardinality(Nullable(String)),
    resources_id Nullable(String),
    status LowCardinality(String),
    config String,
    metadata Nullable(String) CODEC(ZSTD(3)),
    version UInt64,
    cause_event_id String,
    cause_time Float64,
    finished_time Nullable(Float64),
    kafka_partition UInt32,
    kafka_offset UInt64
)
ENGINE = ReplacingMergeTree(version)
ORDER BY rollout_id;

-- One row per attempt, from the same RolloutState records (every state lists all attempts of
-- its rollout), versioned by the state's version.
CREATE TABLE IF NOT EXISTS {db}.attempts
(
    rollout_id String,
    attempt_id String,
    sequence_id UInt64,
    start_time Float64,
    end_time Nullable(Float64),
    status LowCardinality(String),
    worker_id Nullable(String),
    last_heartbeat_time Nullable(Float64),
    metadata Nullable(String) CODEC(ZSTD(3)),
    version UInt64,
    kafka_partition UInt32,
    kafka_offset UInt64
)
ENGINE = ReplacingMergeTree(version)
ORDER BY (rollout_id, sequence_id);

-- One row per resources snapshot id (agl.resources, one partition). update_resources writes a
-- new record under the same id; the record with the highest offset is the current one, and the
-- highest offset overall is the latest snapshot. `resources` is the JSON object that
-- ResourcesUpdate.resources validates.
CREATE TABLE IF NOT EXISTS {db}.resources
(
    resources_id String,
    create_time Float64,
    update_time Float64,
    version Int64,
    resources String CODEC(ZSTD(3)),
    kafka_partition UInt32,
    kafka_offset UInt64
)
ENGINE = ReplacingMergeTree(kafka_offset)
ORDER BY resources_id;

-- One row per worker: its latest heartbeat (agl.workers, key worker_id). Versioned by offset:
-- one worker's records share a partition, so the log order is the order they were written in,
-- which is also what Kafka's compaction keeps. status and the assignment columns are what the
-- heartbeat said; queries derive the live values from the attempts table.
CREATE TABLE IF NOT EXISTS {db}.workers
(
    worker_id String,
    status LowCardinality(String),
    heartbeat_stats Nullable(String) CODEC(ZSTD(3)),
    last_heartbeat_time Nullable(Float64),
    last_dequeue_time Nullable(Float64),
    last_busy_time Nullable(Float64),
    last_idle_time Nullable(Float64),
    current_rollout_id Nullable(String),
    current_attempt_id Nullable(String),
    kafka_partition UInt32,
    kafka_offset UInt64
)
ENGINE = ReplacingMergeTree(kafka_offset)
ORDER BY worker_id;
