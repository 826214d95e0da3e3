-- Times as DateTime64(6, 'UTC') instead of Float64 seconds since the epoch, so SQL reads them as
-- times: Grafana's time macros, toStartOfMinute and friends, readable results.
--
-- MODIFY COLUMN converts the rows already there in place: ClickHouse reads a Float64 of seconds
-- as that instant and keeps the microseconds (truncating below them; the wire's floats carry
-- about 0.2 us of precision at today's epoch). None of these columns is in a sorting or version
-- key (the keys are ids and Kafka offsets), so every one can be modified. A rerun after a crash
-- half-way modifies to the type a column already has: a no-op.
--
-- Ingest views made before this migration (one per writer schema, named after its fingerprint)
-- still select Float64; the engine casts their values to the column's type on insert, with the
-- same conversion. The store and the dashboard read these columns back as float seconds
-- (agl_stream/clickhouse/times.py), as the models hold them.
ALTER TABLE {db}.rollouts
    MODIFY COLUMN start_time DateTime64(6, 'UTC'),
    MODIFY COLUMN end_time Nullable(DateTime64(6, 'UTC')),
    MODIFY COLUMN cause_time DateTime64(6, 'UTC'),
    MODIFY COLUMN finished_time Nullable(DateTime64(6, 'UTC'));

ALTER TABLE {db}.attempts
    MODIFY COLUMN start_time DateTime64(6, 'UTC'),
    MODIFY COLUMN end_time Nullable(DateTime64(6, 'UTC')),
    MODIFY COLUMN last_heartbeat_time Nullable(DateTime64(6, 'UTC'));

ALTER TABLE {db}.resources
    MODIFY COLUMN create_time DateTime64(6, 'UTC'),
    MODIFY COLUMN update_time DateTime64(6, 'UTC');

ALTER TABLE {db}.workers
    MODIFY COLUMN last_heartbeat_time Nullable(DateTime64(6, 'UTC')),
    MODIFY COLUMN last_dequeue_time Nullable(DateTime64(6, 'UTC')),
    MODIFY COLUMN last_busy_time Nullable(DateTime64(6, 'UTC')),
    MODIFY COLUMN last_idle_time Nullable(DateTime64(6, 'UTC'));

ALTER TABLE {db}.triplets
    MODIFY COLUMN finish_time DateTime64(6, 'UTC');

ALTER TABLE {db}.triplet_records
    MODIFY COLUMN finish_time DateTime64(6, 'UTC');

ALTER TABLE {db}.batches
    MODIFY COLUMN created_time DateTime64(6, 'UTC');

ALTER TABLE {db}.trainer_steps
    MODIFY COLUMN step_time DateTime64(6, 'UTC');

ALTER TABLE {db}.dead_letters
    MODIFY COLUMN time DateTime64(6, 'UTC');

-- A view keeps the column types it was created with: made again, its first/last finish times
-- are DateTime64 too.
CREATE OR REPLACE VIEW {db}.reward_by_policy_version AS
SELECT
    policy_version,
    count() AS attempts,
    countIf(final_reward IS NOT NULL) AS rewarded,
    avg(final_reward) AS mean_reward,
    quantile(0.5)(final_reward) AS median_reward,
    min(final_reward) AS min_reward,
    max(final_reward) AS max_reward,
    min(finish_time) AS first_finish_time,
    max(finish_time) AS last_finish_time
FROM {db}.triplet_records FINAL
GROUP BY policy_version;

CREATE OR REPLACE VIEW {db}.reward_by_mode_and_version AS
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
