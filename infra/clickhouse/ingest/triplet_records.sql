-- How one agl.TripletRecord envelope becomes a triplet_records row: the attempt and its totals.
SELECT
    record.rollout_id AS rollout_id,
    record.attempt_id AS attempt_id,
    record.group_id AS group_id,
    record.resources_id AS resources_id,
    record.policy_version AS policy_version,
    toUInt32(length(record.triplets)) AS n_triplets,
    toUInt64(arraySum(t -> length(t.prompt_token_ids), record.triplets)) AS prompt_tokens,
    toUInt64(arraySum(t -> length(t.response_token_ids), record.triplets)) AS response_tokens,
    record.final_reward AS final_reward,
    fromUnixTimestamp64Micro(toInt64(round(record.finish_time * 1e6)), 'UTC') AS finish_time,
    CAST(record.mode AS Nullable(String)) AS mode,
    toUInt32(kafka_partition) AS kafka_partition,
    toUInt64(kafka_offset) AS kafka_offset
