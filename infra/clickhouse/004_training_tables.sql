-- Training data: triplets per finished attempt (agl.triplets) and training batches
-- (agl.triplet-batches), materialized by the ClickHouse sinks (consumers/clickhouse_sink.py; the
-- row transforms are infra/clickhouse/ingest/<table>.sql). Columns are the models' field names
-- (agl_stream/models/training.py) plus derived counts; JSON payloads are JSON text; times are
-- float seconds since the epoch, as on the wire.
--
-- Every table is a ReplacingMergeTree read with FINAL: these sinks resume from their committed
-- Kafka offsets, so a crash between INSERT and commit, a replay of the topic, or a batch the
-- batcher sent twice (same batch_id) inserts rows again; the key makes the copies one row.
-- The version is the Kafka offset: one key lives in one partition (triplets are keyed by
-- group id, batches are written to their source partition), so the latest write wins.

-- One row per triplet (one LLM call of an attempt turned into a training sample).
-- response_logprobs is empty when the call did not record them.
CREATE TABLE IF NOT EXISTS {db}.triplets
(
    rollout_id String,
    attempt_id String,
    group_id String,
    resources_id Nullable(String),
    policy_version Nullable(Int64),
    triplet_index UInt32,
    prompt_tokens UInt32,
    response_tokens UInt32,
    prompt_token_ids Array(Int64) CODEC(ZSTD(3)),
    response_token_ids Array(Int64) CODEC(ZSTD(3)),
    response_logprobs Array(Float64) CODEC(ZSTD(3)),
    reward Nullable(Float64),
    metadata String CODEC(ZSTD(3)),
    prompt_extra Nullable(String) CODEC(ZSTD(3)),
    response_extra Nullable(String) CODEC(ZSTD(3)),
    final_reward Nullable(Float64),
    finish_time Float64,
    kafka_partition UInt32,
    kafka_offset UInt64
)
ENGINE = ReplacingMergeTree(kafka_offset)
ORDER BY (rollout_id, attempt_id, triplet_index);

-- One row per finished attempt (TripletRecord) with its totals, for reward and token analytics
-- without reading the token arrays.
CREATE TABLE IF NOT EXISTS {db}.triplet_records
(
    rollout_id String,
    attempt_id String,
    group_id String,
    resources_id Nullable(String),
    policy_version Nullable(Int64),
    n_triplets UInt32,
    prompt_tokens UInt64,
    response_tokens UInt64,
    final_reward Nullable(Float64),
    finish_time Float64,
    kafka_partition UInt32,
    kafka_offset UInt64
)
ENGINE = ReplacingMergeTree(kafka_offset)
ORDER BY (rollout_id, attempt_id);

-- One row per training batch (TripletBatch). Members are listed by id (rollout_ids[i],
-- attempt_ids[i], input_offsets[i]: the record's offset in agl.triplets partition
-- source_partition); their triplets are in `triplets`. mean_final_reward is over the records
-- that have one (NULL when none has). The dropped_* counts are records the batcher dropped
-- since the previous batch of the same source partition.
CREATE TABLE IF NOT EXISTS {db}.batches
(
    batch_id String,
    sequence UInt64,
    source_partition Nullable(UInt32),
    created_time Float64,
    n_records UInt32,
    n_triplets UInt32,
    n_tokens UInt64,
    min_policy_version Nullable(Int64),
    max_policy_version Nullable(Int64),
    newest_policy_version Nullable(Int64),
    group_size Nullable(UInt32),
    group_ids Array(String),
    incomplete_groups UInt32,
    mean_final_reward Nullable(Float64),
    rollout_ids Array(String),
    attempt_ids Array(String),
    input_offsets Array(UInt64),
    input_position UInt64,
    kept_stale UInt32,
    dropped_stale UInt32,
    dropped_incomplete UInt32,
    dropped_duplicate UInt32,
    dropped_offsets Array(UInt64),
    kafka_partition UInt32,
    kafka_offset UInt64
)
ENGINE = ReplacingMergeTree(kafka_offset)
ORDER BY batch_id;
