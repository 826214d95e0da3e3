-- Spans, with the OpenTelemetry Collector ClickHouse exporter's `otel_traces` column names and
-- types (so Grafana's ClickHouse trace view works on it), plus agl-stream's rollout, attempt and
-- sequence ids and the Kafka position each row came from.
--
-- Indexes: the exporter's, less the bloom filters on attribute *values*, which cost a quarter
-- of the insert speed here (measured) for point lookups that the ORDER BY key mostly serves.
--
-- Exactly-once: the sink inserts a batch as one INSERT (one part, atomic: the table has no
-- PARTITION BY, so a batch never splits across parts) and resumes after the highest
-- (KafkaPartition, KafkaOffset) found here. ReplacingMergeTree on the span identity is the
-- backstop for engines without atomic inserts (Distributed tables on a cluster).
CREATE TABLE IF NOT EXISTS {db}.otel_traces
(
    Timestamp DateTime64(9) CODEC(Delta, ZSTD(1)),
    TraceId String CODEC(ZSTD(1)),
    SpanId String CODEC(ZSTD(1)),
    ParentSpanId String CODEC(ZSTD(1)),
    TraceState String CODEC(ZSTD(1)),
    SpanName LowCardinality(String) CODEC(ZSTD(1)),
    SpanKind LowCardinality(String) CODEC(ZSTD(1)),
    ServiceName LowCardinality(String) CODEC(ZSTD(1)),
    ResourceAttributes Map(LowCardinality(String), String) CODEC(ZSTD(1)),
    ScopeName String CODEC(ZSTD(1)),
    ScopeVersion String CODEC(ZSTD(1)),
    SpanAttributes Map(LowCardinality(String), String) CODEC(ZSTD(1)),
    Duration UInt64 CODEC(ZSTD(1)),
    StatusCode LowCardinality(String) CODEC(ZSTD(1)),
    StatusMessage String CODEC(ZSTD(1)),
    Events Nested
    (
        Timestamp DateTime64(9),
        Name LowCardinality(String),
        Attributes Map(LowCardinality(String), String)
    ) CODEC(ZSTD(1)),
    Links Nested
    (
        TraceId String,
        SpanId String,
        TraceState String,
        Attributes Map(LowCardinality(String), String)
    ) CODEC(ZSTD(1)),
    RolloutId String CODEC(ZSTD(1)),
    AttemptId String CODEC(ZSTD(1)),
    SequenceId UInt64 CODEC(ZSTD(1)),
    KafkaPartition UInt32 CODEC(ZSTD(1)),
    KafkaOffset UInt64 CODEC(Delta, ZSTD(1)),
    -- The whole span as JSON with typed attribute values (SpanAttributes above keeps the
    -- exporter's string convention, which loses types): what query_spans returns.
    SpanJson String CODEC(ZSTD(3)),
    INDEX idx_trace_id TraceId TYPE bloom_filter(0.001) GRANULARITY 1,
    INDEX idx_res_attr_key mapKeys(ResourceAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_span_attr_key mapKeys(SpanAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_duration Duration TYPE minmax GRANULARITY 1
)
ENGINE = ReplacingMergeTree(KafkaOffset)
ORDER BY (RolloutId, AttemptId, SequenceId, SpanId)
SETTINGS index_granularity = 8192;
