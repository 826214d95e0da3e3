-- SQL analytics (docs/sql.md): one narrow, deduplicated fact table fed by a materialized view
-- from otel_traces, and plain views that aggregate it and the state/training tables.
--
-- Why not aggregate in the materialized views: a view sees every INSERT, and the same span can
-- be inserted twice (the tracer re-sends a partial batch after a record error; a Distributed
-- table is not atomic), as can every attempt (each RolloutState lists all attempts again) and
-- every TripletRecord (the builder is at-least-once). sum/count/quantile states would count the
-- copies. So the materialized view only projects each span onto a few typed columns, into a
-- ReplacingMergeTree keyed like otel_traces: copies collapse, and the aggregating views below
-- read it with FINAL. The other facts (attempts, rollouts, triplet_records, batches) already
-- live in keyed tables; their views read them with FINAL too.
--
-- Rows inserted before this migration: the view is created first, then the existing spans are
-- copied with INSERT ... SELECT (no POPULATE: it misses rows inserted while it runs). A span
-- inserted between the two statements arrives through both paths and collapses by its key; a
-- rerun after a crash half-way does the same.

-- One row per span, with what the analytics group by: span name, tool, model, error type, and
-- the GenAI token usage. Tool: the GenAI convention's gen_ai.tool.name, else `tool.name`.
-- Model: the answer's gen_ai.response.model, else the request's. Errors: ERROR status or an
-- agentlightning.exception span; the type from error.type (LLM proxy) or exception.type.
-- PolicyVersion: agentlightning.policy_version where the writer set it (NULL otherwise).
CREATE TABLE IF NOT EXISTS {db}.span_facts
(
    RolloutId String,
    AttemptId String,
    SequenceId UInt64,
    SpanId String,
    Timestamp DateTime64(9) CODEC(Delta, ZSTD(1)),
    SpanName LowCardinality(String),
    Tool LowCardinality(String),
    Model LowCardinality(String),
    DurationNs UInt64 CODEC(ZSTD(1)),
    IsError UInt8,
    ErrorType LowCardinality(String),
    InputTokens UInt64 CODEC(ZSTD(1)),
    OutputTokens UInt64 CODEC(ZSTD(1)),
    PolicyVersion Nullable(Int64),
    KafkaOffset UInt64 CODEC(Delta, ZSTD(1))
)
ENGINE = ReplacingMergeTree(KafkaOffset)
ORDER BY (RolloutId, AttemptId, SequenceId, SpanId);

CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.span_facts_mv TO {db}.span_facts AS
SELECT
    RolloutId,
    AttemptId,
    SequenceId,
    SpanId,
    Timestamp,
    SpanName,
    coalesce(nullIf(SpanAttributes['gen_ai.tool.name'], ''), SpanAttributes['tool.name']) AS Tool,
    coalesce(nullIf(SpanAttributes['gen_ai.response.model'], ''), SpanAttributes['gen_ai.request.model']) AS Model,
    Duration AS DurationNs,
    toUInt8(StatusCode = 'STATUS_CODE_ERROR' OR SpanName = 'agentlightning.exception') AS IsError,
    if(IsError = 1,
       coalesce(nullIf(SpanAttributes['error.type'], ''), nullIf(SpanAttributes['exception.type'], ''), 'unknown'),
       '') AS ErrorType,
    toUInt64OrZero(SpanAttributes['gen_ai.usage.input_tokens']) AS InputTokens,
    toUInt64OrZero(SpanAttributes['gen_ai.usage.output_tokens']) AS OutputTokens,
    toInt64OrNull(SpanAttributes['agentlightning.policy_version']) AS PolicyVersion,
    KafkaOffset
FROM {db}.otel_traces;

INSERT INTO {db}.span_facts
SELECT
    RolloutId,
    AttemptId,
    SequenceId,
    SpanId,
    Timestamp,
    SpanName,
    coalesce(nullIf(SpanAttributes['gen_ai.tool.name'], ''), SpanAttributes['tool.name']) AS Tool,
    coalesce(nullIf(SpanAttributes['gen_ai.response.model'], ''), SpanAttributes['gen_ai.request.model']) AS Model,
    Duration AS DurationNs,
    toUInt8(StatusCode = 'STATUS_CODE_ERROR' OR SpanName = 'agentlightning.exception') AS IsError,
    if(IsError = 1,
       coalesce(nullIf(SpanAttributes['error.type'], ''), nullIf(SpanAttributes['exception.type'], ''), 'unknown'),
       '') AS ErrorType,
    toUInt64OrZero(SpanAttributes['gen_ai.usage.input_tokens']) AS InputTokens,
    toUInt64OrZero(SpanAttributes['gen_ai.usage.output_tokens']) AS OutputTokens,
    toInt64OrNull(SpanAttributes['agentlightning.policy_version']) AS PolicyVersion,
    KafkaOffset
FROM {db}.otel_traces;

-- Final reward per policy version, one row per finished attempt (triplet_records FINAL: a
-- record the builder sent twice counts once). Attempts without a reward are counted, not
-- averaged.
CREATE VIEW IF NOT EXISTS {db}.reward_by_policy_version AS
SELECT
    policy_version,
    count() AS attempts,
    countIf(final_reward IS NOT NULL) AS rewarded,
    avg(final_reward) AS mean_reward,
    quantile(0.5)(final_reward) AS median_reward,
    min(final_reward) AS min_reward,
    max(final_reward) AS max_reward,
    min(finish_time) AS first_finish_time,
    max(finish_time) AS last_finish_time
FROM {db}.triplet_records FINAL
GROUP BY policy_version;

-- Latency percentiles in milliseconds (spans still open, Duration 0, are left out).
CREATE VIEW IF NOT EXISTS {db}.latency_by_span_name AS
SELECT
    SpanName AS span_name,
    count() AS spans,
    quantiles(0.5, 0.95, 0.99)(DurationNs / 1e6) AS q,
    q[1] AS p50_ms,
    q[2] AS p95_ms,
    q[3] AS p99_ms,
    max(DurationNs) / 1e6 AS max_ms
FROM {db}.span_facts FINAL
WHERE DurationNs > 0
GROUP BY SpanName;

CREATE VIEW IF NOT EXISTS {db}.latency_by_tool AS
SELECT
    Tool AS tool,
    count() AS calls,
    countIf(IsError = 1) AS errors,
    quantiles(0.5, 0.95, 0.99)(DurationNs / 1e6) AS q,
    q[1] AS p50_ms,
    q[2] AS p95_ms,
    q[3] AS p99_ms
FROM {db}.span_facts FINAL
WHERE Tool != '' AND DurationNs > 0
GROUP BY Tool;

CREATE VIEW IF NOT EXISTS {db}.latency_by_model AS
SELECT
    Model AS model,
    count() AS calls,
    countIf(IsError = 1) AS errors,
    quantiles(0.5, 0.95, 0.99)(DurationNs / 1e6) AS q,
    q[1] AS p50_ms,
    q[2] AS p95_ms,
    q[3] AS p99_ms,
    sum(InputTokens) AS input_tokens,
    sum(OutputTokens) AS output_tokens
FROM {db}.span_facts FINAL
WHERE Model != '' AND DurationNs > 0
GROUP BY Model;

-- Token usage as the LLM calls reported it (gen_ai.usage.*), per rollout.
CREATE VIEW IF NOT EXISTS {db}.token_usage_by_rollout AS
SELECT
    RolloutId AS rollout_id,
    uniqExact(AttemptId) AS attempts,
    countIf(Model != '') AS llm_calls,
    sum(InputTokens) AS input_tokens,
    sum(OutputTokens) AS output_tokens,
    sum(InputTokens) + sum(OutputTokens) AS total_tokens
FROM {db}.span_facts FINAL
GROUP BY RolloutId;

-- Token usage as trained on (the triplets' token ids), per task group and per policy version.
-- group_id is metadata["group_id"] or a digest of (input, mode): one task, whatever its rollouts.
CREATE VIEW IF NOT EXISTS {db}.token_usage_by_task AS
SELECT
    group_id,
    count() AS attempts,
    uniqExact(rollout_id) AS rollouts,
    sum(n_triplets) AS triplets,
    sum(triplet_records.prompt_tokens) AS prompt_token_count,
    sum(triplet_records.response_tokens) AS response_token_count,
    prompt_token_count + response_token_count AS total_tokens,
    avg(final_reward) AS mean_reward
FROM {db}.triplet_records FINAL
GROUP BY group_id;

CREATE VIEW IF NOT EXISTS {db}.token_usage_by_version AS
SELECT
    policy_version,
    count() AS attempts,
    sum(n_triplets) AS triplets,
    sum(triplet_records.prompt_tokens) AS prompt_token_count,
    sum(triplet_records.response_tokens) AS response_token_count,
    prompt_token_count + response_token_count AS total_tokens
FROM {db}.triplet_records FINAL
GROUP BY policy_version;

-- Error rates: of spans by name, and of attempts by final status.
CREATE VIEW IF NOT EXISTS {db}.error_rate_by_span_name AS
SELECT
    SpanName AS span_name,
    count() AS spans,
    countIf(IsError = 1) AS errors,
    errors / spans AS error_rate,
    topKIf(3)(ErrorType, IsError = 1) AS top_error_types
FROM {db}.span_facts FINAL
GROUP BY SpanName;

CREATE VIEW IF NOT EXISTS {db}.attempt_error_rate AS
SELECT
    count() AS attempts,
    countIf(status = 'succeeded') AS succeeded,
    countIf(status = 'failed') AS failed,
    countIf(status IN ('timeout', 'unresponsive')) AS lost,
    countIf(status IN ('failed', 'timeout', 'unresponsive')) / count() AS error_rate
FROM {db}.attempts FINAL
WHERE status IN ('succeeded', 'failed', 'timeout', 'unresponsive')
