-- How one agl.Worker envelope (a heartbeat) becomes a workers row.
SELECT
    record.worker_id AS worker_id,
    toString(record.status) AS status,
    record.heartbeat_stats AS heartbeat_stats,
    fromUnixTimestamp64Micro(toInt64(round(record.last_heartbeat_time * 1e6)), 'UTC') AS last_heartbeat_time,
    fromUnixTimestamp64Micro(toInt64(round(record.last_dequeue_time * 1e6)), 'UTC') AS last_dequeue_time,
    fromUnixTimestamp64Micro(toInt64(round(record.last_busy_time * 1e6)), 'UTC') AS last_busy_time,
    fromUnixTimestamp64Micro(toInt64(round(record.last_idle_time * 1e6)), 'UTC') AS last_idle_time,
    record.current_rollout_id AS current_rollout_id,
    record.current_attempt_id AS current_attempt_id,
    toUInt32(kafka_partition) AS kafka_partition,
    toUInt64(kafka_offset) AS kafka_offset
