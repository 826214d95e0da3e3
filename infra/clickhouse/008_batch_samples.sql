-- Lineage: which spans trained which policy version (docs/sql.md, "Traces that trained a policy
-- version"; the dashboard's version page).
--
-- One row per sample of a training batch, from the batch itself (agl.triplet-batches, the
-- ClickHouse sink's TRIPLET_BATCHES target batch_samples; transform
-- infra/clickhouse/ingest/batch_samples.sql), not from the triplets table: the batch is what the
-- trainer read, and a replay with other settings may write other triplets for the same attempt.
-- sample_index is the sample's position in the batch (records in batch order, each record's
-- samples in call order): the row order the trainer builds its tensors in. span_ids are the
-- LLM-call spans the sample was built from, in call order (a record written before
-- Triplet.span_ids existed gives the one span id of its metadata). policy_version is the version
-- that served the attempt; the version the batch trained is trainer_steps.policy_version of the
-- same batch_id (one step per batch), so "which traces trained version N" is one join.
--
-- ReplacingMergeTree read with FINAL, keyed like the batch: a batch the batcher sent twice, or
-- the topic consumed again by the sink, is one set of rows. Batches sunk before this migration
-- have no rows here; consuming agl.triplet-batches again (a new sink group, or its offsets
-- reset) fills them.
CREATE TABLE IF NOT EXISTS {db}.batch_samples
(
    batch_id String,
    sample_index UInt32,
    rollout_id String,
    attempt_id String,
    group_id String,
    triplet_index UInt32,
    policy_version Nullable(Int64),
    span_ids Array(String),
    calls UInt32,
    prompt_tokens UInt32,
    response_tokens UInt32,
    reward Nullable(Float64),
    final_reward Nullable(Float64),
    kafka_partition UInt32,
    kafka_offset UInt64,
    -- "which version did this span train": has(span_ids, '<span id>') skips granules by this index
    INDEX span_ids_bloom span_ids TYPE bloom_filter GRANULARITY 4
)
ENGINE = ReplacingMergeTree(kafka_offset)
ORDER BY (batch_id, sample_index);
