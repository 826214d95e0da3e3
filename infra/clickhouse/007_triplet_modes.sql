-- The rollout's mode (train, val, test) on training data, and the batcher's count of the
-- validation and test records it refused (they are never trained on).
--
-- TripletRecord.mode is an optional Avro field (NULL for records written before it existed and
-- for rollouts enqueued without a mode); the ingest transforms (infra/clickhouse/ingest/) fill
-- these columns for new rows, and rows inserted before this migration read NULL / 0.
ALTER TABLE {db}.triplets
    ADD COLUMN IF NOT EXISTS mode LowCardinality(Nullable(String));

ALTER TABLE {db}.triplet_records
    ADD COLUMN IF NOT EXISTS mode LowCardinality(Nullable(String));

ALTER TABLE {db}.batches
    ADD COLUMN IF NOT EXISTS dropped_eval UInt32 DEFAULT 0;

-- Final reward per mode and policy version (validation numbers per version: WHERE mode = 'val').
-- One row per finished attempt, as in reward_by_policy_version, which counts every mode.
CREATE VIEW IF NOT EXISTS {db}.reward_by_mode_and_version AS
SELECT
    mode,
    policy_version,
    count() AS attempts,
    countIf(final_reward IS NOT NULL) AS rewarded,
    avg(final_reward) AS mean_reward,
    min(finish_time) AS first_finish_time,
    max(finish_time) AS last_finish_time
FROM {db}.triplet_records FINAL
GROUP BY mode, policy_version;
