-- How one agl.TripletBatch envelope becomes batch_samples rows: one per sample (triplet), in
-- batch order (records in order, each record's triplets in order), numbered from 0.
-- positions[n] = (record index, triplet index), both from 1.
WITH
    arrayFlatten(arrayMap(
        (r, i) -> arrayMap(j -> (i, j), arrayEnumerate(r.triplets)),
        record.records, arrayEnumerate(record.records))) AS positions,
    arrayJoin(arrayEnumerate(positions)) AS n,
    record.records[positions[n].1] AS member,
    member.triplets[positions[n].2] AS triplet
SELECT
    record.batch_id AS batch_id,
    toUInt32(n - 1) AS sample_index,
    member.rollout_id AS rollout_id,
    member.attempt_id AS attempt_id,
    member.group_id AS group_id,
    toUInt32(positions[n].2 - 1) AS triplet_index,
    member.policy_version AS policy_version,
    -- Records written before Triplet.span_ids existed: the one span id the adapter put in metadata.
    if(empty(triplet.span_ids),
       arrayFilter(s -> s != '', [JSONExtractString(triplet.metadata, 'span_id')]),
       triplet.span_ids) AS span_ids,
    toUInt32(triplet.calls) AS calls,
    toUInt32(length(triplet.prompt_token_ids)) AS prompt_tokens,
    toUInt32(length(triplet.response_token_ids)) AS response_tokens,
    triplet.reward AS reward,
    member.final_reward AS final_reward,
    toUInt32(kafka_partition) AS kafka_partition,
    toUInt64(kafka_offset) AS kafka_offset
