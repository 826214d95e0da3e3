"""The cookbook (docs/sql.md) over 1,000,000 spans: latency of each query, in the embedded engine.

Fills a fresh embedded ClickHouse (chDB, migrations applied) with synthetic but realistic data:
``--spans`` spans in attempts of 18 (3 LLM calls with model and token usage, 4 tool calls, one
of which errors now and then, agent steps, a message, an annotation, and a reward or an
exception span), one rollout in ten retried after a failed first attempt, 2% timed-out
attempts, 5,000 task groups, 20 policy versions with a rising reward, triplet records and
triplets (3 per successful attempt, with token ids), batches of 32 records with their samples
(batch_samples: 3 per attempt, each naming one of its LLM-call spans), a trainer step per batch
(batch b makes policy version b + 1) and 64 workers.
Spans go into ``otel_traces`` in INSERTs of ``--chunk`` rows (the sink's batch size), so the
``span_facts`` materialized view runs as it does under the sink and the tables hold the parts
that many INSERTs leave; the query timings start right after the load, before background
merges have caught up (the worse case for FINAL).

Each query runs through the gateway's SqlRunner (consumers/gateway_sql.py), as ``/v1/sql`` runs
it: the engine's checks, fresh readonly clients, the limits. One warm-up, then ``--runs``
timed runs; the p50 is reported. The goal is <= 1 s per query.

Run: `python benchmarks/sql_cookbook.py [--spans 1000000]`; JSON to benchmarks/results/sql_cookbook.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from agl_stream.clickhouse.client import get_client
from agl_stream.clickhouse.migrations import migrate
from agl_stream.config import Settings
from consumers.gateway_sql import SqlRunner

ROOT = Path(__file__).resolve().parents[1]
SPANS_PER_ATTEMPT = 18
GROUPS = 5000
VERSIONS = 20

# n: the span's global index. a: its attempt (18 spans each); r: its rollout (every 11 attempts
# cover 10 rollouts, so the first rollout of each ten has a failed first attempt and a retry).
SPANS_SQL = """
INSERT INTO {db}.otel_traces
    (Timestamp, TraceId, SpanId, ParentSpanId, SpanName, SpanKind, ServiceName, ResourceAttributes, ScopeName,
     SpanAttributes, Duration, StatusCode, StatusMessage, RolloutId, AttemptId, SequenceId, KafkaPartition,
     KafkaOffset, SpanJson)
WITH
    intDiv(number, {per}) AS a,
    number % {per} AS p,
    intDiv(a * 10, 11) AS r,
    a % 11 = 0 AS failed_attempt,
    cityHash64(number) AS h,
    p < 3 AS is_llm,
    p BETWEEN 3 AND 6 AS is_tool,
    ['calculator', 'search', 'browser', 'python'][p - 2] AS tool,
    is_tool AND tool = 'search' AND h % 20 = 0 AS tool_error,
    if(a % 3 = 0, 'qwen2.5-7b-instruct', 'qwen2.5-1.5b-instruct') AS model,
    multiIf(is_llm, 'openai.chat.completion',
            is_tool, concat('execute_tool ', tool),
            p < 15, ['agent.step', 'plan', 'retrieve', 'reflect'][(p % 4) + 1],
            p = 15, 'agentlightning.message',
            p = 16, 'agentlightning.annotation',
            failed_attempt, 'agentlightning.exception',
            'agentlightning.reward') AS name,
    multiIf(is_llm, 150 + h % 1850, is_tool, 5 + h % (if(tool = 'browser', 900, 200)), 1 + h % 10) AS ms
SELECT
    toDateTime64(1767225600 + a * 0.05 + p * 0.002, 9),
    lower(hex(cityHash64(a, 'trace'))),
    lower(hex(cityHash64(number, 'span'))),
    if(p = 7, '', lower(hex(cityHash64(a * {per} + 7, 'span')))),
    name,
    if(is_llm, 'SPAN_KIND_CLIENT', 'SPAN_KIND_INTERNAL'),
    'agent',
    map('agentlightning.rollout_id', concat('ro-', leftPad(toString(r), 9, '0')), 'service.name', 'agent'),
    'agentlightning',
    mapFilter((k, v) -> v != '', map(
        'gen_ai.system', if(is_llm, 'openai', ''),
        'gen_ai.request.model', if(is_llm, model, ''),
        'gen_ai.response.model', if(is_llm, model, ''),
        'gen_ai.usage.input_tokens', if(is_llm, toString(200 + h % 600), ''),
        'gen_ai.usage.output_tokens', if(is_llm, toString(20 + h % 200), ''),
        'gen_ai.tool.name', if(is_tool, tool, ''),
        'gen_ai.operation.name', multiIf(is_llm, 'chat', is_tool, 'execute_tool', ''),
        'error.type', if(tool_error, 'TimeoutError', ''),
        'exception.type', if(name = 'agentlightning.exception', ['ValueError', 'ConnectionError'][(a % 2) + 1], ''),
        'agentlightning.reward.0.name', if(name = 'agentlightning.reward', 'primary', ''),
        'agentlightning.reward.0.value', if(name = 'agentlightning.reward', toString((h % 100) / 100), ''))),
    toUInt64(ms * 1000000 + h % 1000000),
    if(tool_error OR name = 'agentlightning.exception', 'STATUS_CODE_ERROR', 'STATUS_CODE_OK'),
    if(tool_error, 'search timed out', ''),
    concat('ro-', leftPad(toString(r), 9, '0')),
    concat('at-', leftPad(toString(a), 9, '0')),
    p + 1,
    toUInt32(r % 4),
    number,
    concat('{{"name":"', name, '","attributes":{{}},"pad":"', repeat('x', 300), '"}}')
FROM numbers({start}, {count})
"""

ROLLOUTS_SQL = """
INSERT INTO {db}.rollouts
    (rollout_id, input, start_time, end_time, mode, resources_id, status, config, metadata, version,
     cause_event_id, cause_time, finished_time, kafka_partition, kafka_offset)
SELECT
    concat('ro-', leftPad(toString(number), 9, '0')),
    concat('{{"question":"task ', toString(number % {groups}), '"}}'),
    1767225600 + number * 0.055,
    1767225600 + number * 0.055 + 0.9 + (cityHash64(number) % 1000) / 100,
    'train', 'rs-1', if(number % 50 = 7, 'failed', 'succeeded'), '{{"max_attempts":2}}', NULL, 6,
    '', 0, NULL, toUInt32(number % 4), number
FROM numbers({rollouts})
"""

ATTEMPTS_SQL = """
INSERT INTO {db}.attempts
    (rollout_id, attempt_id, sequence_id, start_time, end_time, status, worker_id, last_heartbeat_time, metadata,
     version, kafka_partition, kafka_offset)
WITH intDiv(number * 10, 11) AS r
SELECT
    concat('ro-', leftPad(toString(r), 9, '0')),
    concat('at-', leftPad(toString(number), 9, '0')),
    if(number % 11 = 1, 2, 1),
    1767225600 + number * 0.05,
    1767225600 + number * 0.05 + 0.8 + (cityHash64(number) % 1000) / 100,
    multiIf(number % 11 = 0, 'failed', r % 50 = 7, 'timeout', 'succeeded'),
    concat('worker-', toString(number % 64)),
    NULL, NULL, 6, toUInt32(r % 4), number
FROM numbers({attempts})
"""

RECORDS_SQL = """
INSERT INTO {db}.triplet_records
    (rollout_id, attempt_id, group_id, resources_id, policy_version, n_triplets, prompt_tokens, response_tokens,
     final_reward, finish_time, kafka_partition, kafka_offset)
WITH intDiv(number * 10, 11) AS r, number % 11 = 0 OR r % 50 = 7 AS failed, intDiv(number * {versions}, {attempts}) AS v
SELECT
    concat('ro-', leftPad(toString(r), 9, '0')),
    concat('at-', leftPad(toString(number), 9, '0')),
    concat('g-', toString(r % {groups})),
    'rs-1', v,
    if(failed, 0, 3), if(failed, 0, 192), if(failed, 0, 96),
    if(failed, NULL, least(1.0, 0.1 + v * 0.03 + (cityHash64(number) % 100) / 300)),
    1767225600 + number * 0.05 + 1, toUInt32(r % 4), number
FROM numbers({attempts})
"""

TRIPLETS_SQL = """
INSERT INTO {db}.triplets
    (rollout_id, attempt_id, group_id, resources_id, policy_version, triplet_index, prompt_tokens, response_tokens,
     prompt_token_ids, response_token_ids, response_logprobs, reward, metadata, prompt_extra, response_extra,
     final_reward, finish_time, kafka_partition, kafka_offset)
WITH intDiv(number, 3) AS a, intDiv(a * 10, 11) AS r, intDiv(a * {versions}, {attempts}) AS v
SELECT
    concat('ro-', leftPad(toString(r), 9, '0')),
    concat('at-', leftPad(toString(a), 9, '0')),
    concat('g-', toString(r % {groups})),
    'rs-1', v, toUInt32(number % 3), 64, 32,
    arrayMap(i -> toInt64(cityHash64(number, i) % 60000), range(64)),
    arrayMap(i -> toInt64(cityHash64(number, i, 1) % 60000), range(32)),
    arrayMap(i -> -((cityHash64(number, i, 2) % 1000) / 250), range(32)),
    if(number % 3 = 2, least(1.0, 0.1 + v * 0.03), NULL),
    '{{}}', NULL, NULL, least(1.0, 0.1 + v * 0.03), 1767225600 + a * 0.05 + 1, toUInt32(r % 4), number
FROM numbers({attempts} * 3)
WHERE NOT (a % 11 = 0 OR r % 50 = 7)
"""

BATCHES_SQL = """
INSERT INTO {db}.batches
    (batch_id, sequence, source_partition, created_time, n_records, n_triplets, n_tokens, min_policy_version,
     max_policy_version, newest_policy_version, group_size, group_ids, incomplete_groups, mean_final_reward,
     rollout_ids, attempt_ids, input_offsets, input_position, kept_stale, dropped_stale, dropped_incomplete,
     dropped_duplicate, dropped_offsets, kafka_partition, kafka_offset)
WITH intDiv(number * 32 * {versions}, {attempts}) AS v
SELECT
    concat('tb-', leftPad(toString(number), 8, '0')), number, toUInt32(number % 4),
    1767225600 + number * 1.6, 32, 90, 90 * 288, greatest(0, v - toInt64(number % 3)), v, v, 8,
    arrayMap(i -> concat('g-', toString((number * 4 + i) % {groups})), range(4)), 0, 0.1 + v * 0.03,
    [], [], [], number * 32, 0, toUInt32(number % 7 = 0), 0, 0, [], toUInt32(number % 4), number
FROM numbers(intDiv({attempts}, 32))
"""

# One sample per LLM call of each batch's 32 attempts (3 each, span ids as SPANS_SQL makes them:
# the attempt's spans 0-2), in the batches above; one trainer step per batch, batch b making
# policy version b + 1 (the lineage query's join).
BATCH_SAMPLES_SQL = """
INSERT INTO {db}.batch_samples
    (batch_id, sample_index, rollout_id, attempt_id, group_id, triplet_index, policy_version, span_ids, calls,
     prompt_tokens, response_tokens, reward, final_reward, kafka_partition, kafka_offset)
WITH intDiv(number, 96) AS b, intDiv(number, 3) AS a, number % 3 AS k, intDiv(a * 10, 11) AS r
SELECT
    concat('tb-', leftPad(toString(b), 8, '0')), toUInt32(number % 96),
    concat('ro-', leftPad(toString(r), 9, '0')), concat('at-', leftPad(toString(a), 9, '0')),
    concat('g-', toString(r % {groups})), toUInt32(k), intDiv(a * {versions}, {attempts}),
    [lower(hex(cityHash64(a * {per} + k, 'span')))], 1, 64, 32, NULL, 0.5, toUInt32(b % 4), b
FROM numbers(intDiv({attempts}, 32) * 96)
"""

TRAINER_STEPS_SQL = """
INSERT INTO {db}.trainer_steps
    (batch_id, model, policy_version, step_time, step_seconds, idle_seconds, tokens, samples, min_policy_version,
     staleness, metrics, kafka_partition, kafka_offset)
SELECT concat('tb-', leftPad(toString(number), 8, '0')), 'agl-tiny', number + 1, 1767225600 + number * 1.6 + 1,
       0.8, 0.1, 96 * 96, 96, number, 0, map('loss', 0.5), 0, number
FROM numbers(intDiv({attempts}, 32))
"""

WORKERS_SQL = """
INSERT INTO {db}.workers
    (worker_id, status, heartbeat_stats, last_heartbeat_time, last_dequeue_time, last_busy_time, last_idle_time,
     current_rollout_id, current_attempt_id, kafka_partition, kafka_offset)
SELECT concat('worker-', toString(number)), 'busy', '{{}}', 1767229000, NULL, NULL, NULL, NULL, NULL, 0, number
FROM numbers(64)
"""


def cookbook(path: Path = ROOT / "docs" / "sql.md") -> list[tuple[str, str]]:
    """(heading, SQL) of every query in the cookbook section of docs/sql.md."""
    text = path.read_text()
    section = text[text.index("## The cookbook") : text.index("## Limits")]
    return [
        (m.group(1).strip(), m.group(2).strip())
        for m in re.finditer(r"^### (.+?)\n.*?```sql\n(.*?)```", section, re.S | re.M)
    ]


def load(settings: Settings, spans: int, chunk: int) -> dict[str, Any]:
    db = settings.clickhouse_database
    client = get_client(settings)
    try:
        migrate(client, db)
        attempts = spans // SPANS_PER_ATTEMPT
        rollouts = attempts * 10 // 11 + 1
        started = time.perf_counter()
        for start in range(0, spans, chunk):
            client.command(SPANS_SQL.format(db=db, per=SPANS_PER_ATTEMPT, start=start, count=min(chunk, spans - start)))
        spans_s = time.perf_counter() - started
        shape = {
            "db": db,
            "groups": GROUPS,
            "versions": VERSIONS,
            "attempts": attempts,
            "rollouts": rollouts,
            "per": SPANS_PER_ATTEMPT,
        }
        for sql in (
            ROLLOUTS_SQL,
            ATTEMPTS_SQL,
            RECORDS_SQL,
            TRIPLETS_SQL,
            BATCHES_SQL,
            BATCH_SAMPLES_SQL,
            TRAINER_STEPS_SQL,
            WORKERS_SQL,
        ):
            client.command(sql.format(**shape))
        counts = {
            table: int(client.command(f"SELECT count() FROM {db}.{table}"))  # type: ignore[arg-type]
            for table in (
                "otel_traces",
                "span_facts",
                "rollouts",
                "attempts",
                "triplet_records",
                "triplets",
                "batches",
                "batch_samples",
                "trainer_steps",
            )
        }
        parts = int(
            client.command(  # type: ignore[arg-type]
                f"SELECT count() FROM system.parts WHERE database = '{db}' AND table IN ('otel_traces', 'span_facts') "
                "AND active"
            )
        )
    finally:
        client.close()
    return {
        "spans_insert_s": round(spans_s, 2),
        "spans_per_s": round(spans / spans_s),
        "rows": counts,
        "active_parts_after_load": parts,
    }


def measure(settings: Settings, runs: int) -> list[dict[str, Any]]:
    """Per query: p50/max through SqlRunner (what /v1/sql costs, checks and clients included) and
    the p50 of the bare query on an open client (the engine's share)."""
    runner = SqlRunner(settings)
    # Also keeps the engine open, as the gateway's sinks and query pool do: chDB shuts the engine
    # down when its last connection closes, and SqlRunner closes its own after each query.
    bare = get_client(settings)
    results = []
    try:
        for heading, sql in cookbook():
            result = runner.run_sync(sql)  # warm-up; also checks that it answers
            timings, engine = [], []
            for _ in range(runs):
                started = time.perf_counter()
                runner.run_sync(sql)
                timings.append((time.perf_counter() - started) * 1000)
                started = time.perf_counter()
                bare.query(sql)
                engine.append((time.perf_counter() - started) * 1000)
            results.append(
                {
                    "question": heading,
                    "rows": len(result.rows),
                    "p50_ms": round(statistics.median(timings), 1),
                    "max_ms": round(max(timings), 1),
                    "engine_p50_ms": round(statistics.median(engine), 1),
                    "within_1s": statistics.median(timings) <= 1000,
                }
            )
            print(
                f"{results[-1]['p50_ms']:8.1f} ms ({results[-1]['engine_p50_ms']:7.1f} in the engine)  {heading}",
                flush=True,
            )
    finally:
        bare.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=1_000_000)
    parser.add_argument("--chunk", type=int, default=10_000, help="Spans per INSERT (the sink's batch size).")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "sql_cookbook.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="agl-sql-bench-") as data_dir:
        settings = Settings(data_dir=Path(data_dir))
        loaded = load(settings, args.spans, args.chunk)
        print(json.dumps(loaded), flush=True)
        queries = measure(settings, args.runs)
    report = {
        "spans": args.spans,
        "load_average_1m_at_end": os.getloadavg()[0],
        "engine": "chDB (embedded), through SqlRunner as /v1/sql runs queries",
        "cpus": os.cpu_count(),
        "runs_per_query": args.runs,
        "load": loaded,
        "queries": queries,
        "all_within_1s": all(q["within_1s"] for q in queries),
        "slowest_p50_ms": max(q["p50_ms"] for q in queries),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "queries"}, indent=2))


if __name__ == "__main__":
    main()
