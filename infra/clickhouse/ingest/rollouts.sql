-- How one agl.RolloutState envelope (kafka_partition, kafka_offset, record) becomes a rollouts
-- row. JSON payloads (input, metadata) arrive as JSON text and stay so; config is a record and
-- becomes JSON text that RolloutConfig validates.
SELECT
    record.rollout.rollout_id AS rollout_id,
    record.rollout.input AS input,
    fromUnixTimestamp64Micro(toInt64(round(record.rollout.start_time * 1e6)), 'UTC') AS start_time,
    fromUnixTimestamp64Micro(toInt64(round(record.rollout.end_time * 1e6)), 'UTC') AS end_time,
    CAST(record.rollout.mode AS Nullable(String)) AS mode,
    record.rollout.resources_id AS resources_id,
    toString(record.rollout.status) AS status,
    toJSONString(record.rollout.config) AS config,
    record.rollout.metadata AS metadata,
    toUInt64(record.version) AS version,
    record.cause_event_id AS cause_event_id,
    fromUnixTimestamp64Micro(toInt64(round(record.cause_time * 1e6)), 'UTC') AS cause_time,
    fromUnixTimestamp64Micro(toInt64(round(record.finished_time * 1e6)), 'UTC') AS finished_time,
    -- The latest attempt's (the runner records it in the attempt's metadata).
    if(empty(record.attempts), NULL,
       JSONExtract(ifNull(arrayElement(record.attempts, -1).metadata, ''), 'policy_version', 'Nullable(Int64)'))
        AS policy_version,
    toUInt32(kafka_partition) AS kafka_partition,
    toUInt64(kafka_offset) AS kafka_offset
