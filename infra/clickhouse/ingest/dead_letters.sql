-- How one agl.DlqRecord envelope (kafka_partition, kafka_offset, record) becomes a dead_letters
-- row: everything but the rejected bytes, of which only the count kept is (see
-- infra/clickhouse/010_dead_letters.sql).
SELECT
    record.source_topic AS source_topic,
    toUInt32(kafka_partition) AS kafka_partition,
    toUInt64(kafka_offset) AS kafka_offset,
    fromUnixTimestamp64Micro(toInt64(round(record.time * 1e6)), 'UTC') AS time,
    record.source_partition AS source_partition,
    record.source_offset AS source_offset,
    record.key AS key,
    record.reason AS reason,
    record.error_type AS error_type,
    record.processor AS processor,
    record.value_size AS value_size,
    toUInt64(length(record.value)) AS value_kept,
    record.value_sha256 AS value_sha256
