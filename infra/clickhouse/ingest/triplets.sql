-- How one agl.TripletRecord envelope becomes triplets rows: one per triplet, numbered from 0 in
-- call order (an attempt without triplets gives none; triplet_records still has it).
WITH
    arrayJoin(arrayEnumerate(record.triplets)) AS position,
    record.triplets[position] AS triplet
SELECT
    record.rollout_id AS rollout_id,
    record.attempt_id AS attempt_id,
    record.group_id AS group_id,
    record.resources_id AS resources_id,
    record.policy_version AS policy_version,
    toUInt32(position - 1) AS triplet_index,
    toUInt32(length(triplet.prompt_token_ids)) AS prompt_tokens,
    toUInt32(length(triplet.response_token_ids)) AS response_tokens,
    triplet.prompt_token_ids AS prompt_token_ids,
    triplet.response_token_ids AS response_token_ids,
    triplet.response_logprobs AS response_logprobs,
    triplet.reward AS reward,
    triplet.metadata AS metadata,
    triplet.prompt_extra AS prompt_extra,
    triplet.response_extra AS response_extra,
    record.final_reward AS final_reward,
    fromUnixTimestamp64Micro(toInt64(round(record.finish_time * 1e6)), 'UTC') AS finish_time,
    CAST(record.mode AS Nullable(String)) AS mode,
    arrayMap(m -> toUInt8(m), triplet.response_mask) AS response_mask,
    toUInt32(triplet.calls) AS calls,
    triplet.span_ids AS span_ids,
    triplet.policy_versions AS policy_versions,
    toUInt32(kafka_partition) AS kafka_partition,
    toUInt64(kafka_offset) AS kafka_offset
