-- The training sample's full shape on triplets rows, and the staleness histogram on batches.
--
-- A triplets row is one training sample: one LLM call in transition mode, or several calls of
-- one attempt merged into one token sequence in trajectory mode (agl-stream triplets
-- --aggregation). These columns come from the Triplet fields added with trajectory aggregation
-- and off-policy correction:
-- - response_mask: per response token, 1 where the policy generated it, 0 on tokens inserted
--   between calls (tool results, user and environment turns). Empty: every response token was
--   generated (transition samples, and records written before the field existed).
-- - calls: the LLM calls merged into the sample (1 in transition mode).
-- - span_ids: the LLM-call spans the sample was built from, in call order.
-- - policy_versions: per call, the version of the model server that answered it (NULL where the
--   server named none; empty in records written before the field existed).
-- batches.staleness_counts[k + 1] counts the batch's records exactly k versions behind its newest
-- policy version (what the trainer corrects with importance sampling; empty in batches written
-- before the field existed).
--
-- The ingest transforms (infra/clickhouse/ingest/) fill these columns for new rows; rows inserted
-- before this migration read the defaults (empty arrays, calls 1). Consuming the topics again (a
-- new sink group, or its offsets reset) fills them for old records too: ReplacingMergeTree keeps
-- one row per key.
ALTER TABLE {db}.triplets
    ADD COLUMN IF NOT EXISTS response_mask Array(UInt8) CODEC(ZSTD(3)),
    ADD COLUMN IF NOT EXISTS calls UInt32 DEFAULT 1,
    ADD COLUMN IF NOT EXISTS span_ids Array(String),
    ADD COLUMN IF NOT EXISTS policy_versions Array(Nullable(Int64));

ALTER TABLE {db}.batches
    ADD COLUMN IF NOT EXISTS staleness_counts Array(UInt32);
