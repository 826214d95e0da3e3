-- How one agl.TripletBatch envelope becomes a batches row: the batch's own fields, its members
-- by id, and counts derived from its records (the triplets themselves are in `triplets`).
WITH arrayFilter(x -> isNotNull(x), arrayMap(r -> r.final_reward, record.records)) AS rewards
SELECT
    record.batch_id AS batch_id,
    toUInt64(record.sequence) AS sequence,
    CAST(record.source_partition AS Nullable(UInt32)) AS source_partition,
    record.created_time AS created_time,
    toUInt32(length(record.records)) AS n_records,
    toUInt32(arraySum(r -> length(r.triplets), record.records)) AS n_triplets,
    toUInt64(record.n_tokens) AS n_tokens,
    record.min_policy_version AS min_policy_version,
    record.max_policy_version AS max_policy_version,
    record.newest_policy_version AS newest_policy_version,
    CAST(record.group_size AS Nullable(UInt32)) AS group_size,
    arrayDistinct(arrayMap(r -> r.group_id, record.records)) AS group_ids,
    toUInt32(record.incomplete_groups) AS incomplete_groups,
    if(empty(rewards), NULL, arrayAvg(arrayMap(x -> assumeNotNull(x), rewards))) AS mean_final_reward,
    arrayMap(r -> r.rollout_id, record.records) AS rollout_ids,
    arrayMap(r -> r.attempt_id, record.records) AS attempt_ids,
    arrayMap(o -> toUInt64(o), record.input_offsets) AS input_offsets,
    toUInt64(record.input_position) AS input_position,
    toUInt32(record.kept_stale) AS kept_stale,
    toUInt32(record.dropped_stale) AS dropped_stale,
    toUInt32(record.dropped_incomplete) AS dropped_incomplete,
    toUInt32(record.dropped_duplicate) AS dropped_duplicate,
    arrayMap(o -> toUInt64(o), record.dropped_offsets) AS dropped_offsets,
    toUInt32(kafka_partition) AS kafka_partition,
    toUInt64(kafka_offset) AS kafka_offset
