-- How one agl.Span envelope (kafka_partition, kafka_offset, record) becomes an otel_traces row.
-- The sink wraps this SELECT in a materialized view from a Null table named after the writer
-- schema's fingerprint (agl_stream/clickhouse/avro_ingest.py), so ClickHouse decodes the Avro.
-- Attribute values are stored as the OpenTelemetry Collector exporter stores them: strings as
-- they are, everything else (numbers, booleans, arrays) as JSON text.
--
-- SpanJson is the span as agl.Span JSON, for query_spans. It is assembled here rather than with
-- toJSONString(record) because ClickHouse writes the Float64 1.0 as `1`, which would come back
-- as an int: floats always get a decimal point or exponent (and NaN/Infinity as Python's json
-- and pydantic read them), Int64 is never quoted whatever output_format_json_quote_64bit_integers
-- says, and everything else goes through toJSONString.
WITH
    (x -> multiIf(isNaN(x), 'NaN', isInfinite(x), if(x > 0, 'Infinity', '-Infinity'),
                  match(toString(x), '[.e]'), toString(x), concat(toString(x), '.0'))) AS float_json,
    (x -> if(isNull(x), 'null', float_json(assumeNotNull(x)))) AS nullable_float_json,
    (v -> multiIf(isNull(v), 'null',
                  variantType(v) = 'Float64', float_json(ifNull(variantElement(v, 'Float64'), 0)),
                  variantType(v) = 'Int64', toString(variantElement(v, 'Int64')),
                  toJSONString(v))) AS scalar_json,
    (v -> if(toString(variantType(v)) = 'Array(Variant(Bool, Float64, Int64, String))',
             concat('[', arrayStringConcat(arrayMap(x -> scalar_json(x),
                                                    variantElement(v, 'Array(Variant(Bool, Float64, Int64, String))')), ','), ']'),
             scalar_json(v))) AS value_json,
    (m -> concat('{', arrayStringConcat(arrayMap((k, v) -> concat(toJSONString(k), ':', value_json(v)),
                                                 mapKeys(m), mapValues(m)), ','), '}')) AS attributes_json
SELECT
    toDateTime64(ifNull(record.start_time, 0), 9) AS Timestamp,
    record.trace_id AS TraceId,
    record.span_id AS SpanId,
    ifNull(record.parent_id, '') AS ParentSpanId,
    if(isNull(record.context), '',
       arrayStringConcat(arrayMap((k, v) -> concat(k, '=', v),
                                  mapKeys(assumeNotNull(record.context).trace_state),
                                  mapValues(assumeNotNull(record.context).trace_state)), ',')) AS TraceState,
    record.name AS SpanName,
    concat('SPAN_KIND_', upper(record.kind)) AS SpanKind,
    ResourceAttributes['service.name'] AS ServiceName,
    mapApply((k, v) -> (k, ifNull(if(variantType(v) = 'String', variantElement(v, 'String'), toJSONString(v)), 'null')),
             record.resource.attributes) AS ResourceAttributes,
    record.scope_name AS ScopeName,
    record.scope_version AS ScopeVersion,
    mapApply((k, v) -> (k, ifNull(if(variantType(v) = 'String', variantElement(v, 'String'), toJSONString(v)), 'null')),
             record.attributes) AS SpanAttributes,
    if(isNull(record.end_time) OR isNull(record.start_time), 0,
       toUInt64(greatest(0, round((assumeNotNull(record.end_time) - assumeNotNull(record.start_time)) * 1e9)))) AS Duration,
    concat('STATUS_CODE_', toString(record.status.status_code)) AS StatusCode,
    ifNull(record.status.description, '') AS StatusMessage,
    arrayMap(e -> toDateTime64(ifNull(e.timestamp, 0), 9), record.events) AS `Events.Timestamp`,
    arrayMap(e -> e.name, record.events) AS `Events.Name`,
    arrayMap(e -> mapApply((k, v) -> (k, ifNull(if(variantType(v) = 'String', variantElement(v, 'String'), toJSONString(v)), 'null')),
                           e.attributes), record.events) AS `Events.Attributes`,
    arrayMap(l -> l.context.trace_id, record.links) AS `Links.TraceId`,
    arrayMap(l -> l.context.span_id, record.links) AS `Links.SpanId`,
    arrayMap(l -> arrayStringConcat(arrayMap((k, v) -> concat(k, '=', v), mapKeys(l.context.trace_state),
                                             mapValues(l.context.trace_state)), ','), record.links) AS `Links.TraceState`,
    arrayMap(l -> mapApply((k, v) -> (k, ifNull(if(variantType(v) = 'String', variantElement(v, 'String'), toJSONString(v)), 'null')),
                           l.attributes), record.links) AS `Links.Attributes`,
    record.rollout_id AS RolloutId,
    record.attempt_id AS AttemptId,
    toUInt64(record.sequence_id) AS SequenceId,
    toUInt32(kafka_partition) AS KafkaPartition,
    toUInt64(kafka_offset) AS KafkaOffset,
    concat(
        '{"rollout_id":', toJSONString(record.rollout_id),
        ',"attempt_id":', toJSONString(record.attempt_id),
        ',"sequence_id":', toString(record.sequence_id),
        ',"trace_id":', toJSONString(record.trace_id),
        ',"span_id":', toJSONString(record.span_id),
        ',"parent_id":', ifNull(toJSONString(record.parent_id), 'null'),
        ',"name":', toJSONString(record.name),
        ',"kind":', toJSONString(record.kind),
        ',"status":', toJSONString(record.status),
        ',"attributes":', attributes_json(record.attributes),
        ',"events":[', arrayStringConcat(arrayMap(e -> concat(
            '{"name":', toJSONString(e.name),
            ',"attributes":', attributes_json(e.attributes),
            ',"timestamp":', nullable_float_json(e.timestamp), '}'), record.events), ','), ']',
        ',"links":[', arrayStringConcat(arrayMap(l -> concat(
            '{"context":', toJSONString(l.context),
            ',"attributes":', attributes_json(l.attributes), '}'), record.links), ','), ']',
        ',"start_time":', nullable_float_json(record.start_time),
        ',"end_time":', nullable_float_json(record.end_time),
        ',"context":', ifNull(toJSONString(record.context), 'null'),
        ',"parent":', ifNull(toJSONString(record.parent), 'null'),
        ',"resource":{"attributes":', attributes_json(record.resource.attributes),
        ',"schema_url":', toJSONString(record.resource.schema_url), '}',
        ',"scope_name":', toJSONString(record.scope_name),
        ',"scope_version":', toJSONString(record.scope_version), '}') AS SpanJson
