-- Dead letters: one row per record on agl.dlq (the gateway's sink DEAD_LETTERS, transform
-- infra/clickhouse/ingest/dead_letters.sql), for counting them by reason and source in SQL and on
-- the dashboard. `agl-stream dlq` reads the topic itself (docs/dlq.md).
--
-- The rejected bytes are not copied here: every SQL caller can read this table, and a dead letter
-- holds whatever its writer sent (an API key in a resources update, which the resources table
-- redacts). value_size, value_kept (bytes of it the DLQ record holds, at most 64 KiB) and
-- value_sha256 describe the original; its bytes stay on the topic, under Kafka's access control.
-- key is the source record's key (an id: rollout, request, resources; its first 1 KiB).
--
-- One row per DLQ record, keyed by its position on agl.dlq: the record's key is its source topic,
-- so one source's dead letters share a partition. ReplacingMergeTree read with FINAL: a batch the
-- sink applies twice (a crash between INSERT and commit) counts once. time is when the record was
-- rejected (seconds since the epoch), as the other tables' times.
CREATE TABLE IF NOT EXISTS {db}.dead_letters
(
    source_topic LowCardinality(String),
    kafka_partition UInt32,
    kafka_offset UInt64,
    time Float64,
    source_partition Int32,
    source_offset Int64,
    key Nullable(String),
    reason String CODEC(ZSTD(3)),
    error_type LowCardinality(String),
    processor LowCardinality(String),
    value_size Int64,
    value_kept UInt64,
    value_sha256 String
)
ENGINE = ReplacingMergeTree
ORDER BY (source_topic, kafka_partition, kafka_offset);
