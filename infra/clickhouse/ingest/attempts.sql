-- How one agl.RolloutState envelope becomes attempts rows: one per attempt it lists, each
-- versioned by the state's version (a later state carries every attempt again).
WITH arrayJoin(record.attempts) AS attempt
SELECT
    attempt.rollout_id AS rollout_id,
    attempt.attempt_id AS attempt_id,
    toUInt64(attempt.sequence_id) AS sequence_id,
    fromUnixTimestamp64Micro(toInt64(round(attempt.start_time * 1e6)), 'UTC') AS start_time,
    fromUnixTimestamp64Micro(toInt64(round(attempt.end_time * 1e6)), 'UTC') AS end_time,
    toString(attempt.status) AS status,
    attempt.worker_id AS worker_id,
    fromUnixTimestamp64Micro(toInt64(round(attempt.last_heartbeat_time * 1e6)), 'UTC') AS last_heartbeat_time,
    attempt.metadata AS metadata,
    toUInt64(record.version) AS version,
    toUInt32(kafka_partition) AS kafka_partition,
    toUInt64(kafka_offset) AS kafka_offset
