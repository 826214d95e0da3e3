-- The Kafka offsets each sink has applied: (sink, topic, partition) -> next offset to read.
-- Readers that need read-your-writes wait until the sink has passed their write's offset
-- (the "offset fence" in DESIGN.md).
CREATE TABLE IF NOT EXISTS {db}.sink_offsets
(
    Sink LowCardinality(String),
    Topic LowCardinality(String),
    Partition UInt32,
    NextOffset UInt64,
    AppliedAt DateTime64(3)
)
ENGINE = ReplacingMergeTree(NextOffset)
ORDER BY (Sink, Topic, Partition);
