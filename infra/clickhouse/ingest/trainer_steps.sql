-- How one agl.TrainerStep envelope (kafka_partition, kafka_offset, record) becomes a
-- trainer_steps row.
SELECT
    record.batch_id AS batch_id,
    record.model AS model,
    record.policy_version AS policy_version,
    fromUnixTimestamp64Micro(toInt64(round(record.step_time * 1e6)), 'UTC') AS step_time,
    record.step_seconds AS step_seconds,
    record.idle_seconds AS idle_seconds,
    toUInt64(record.tokens) AS tokens,
    toUInt64(record.samples) AS samples,
    record.min_policy_version AS min_policy_version,
    record.staleness AS staleness,
    CAST(record.metrics AS Map(LowCardinality(String), Float64)) AS metrics,
    toUInt32(kafka_partition) AS kafka_partition,
    toUInt64(kafka_offset) AS kafka_offset
