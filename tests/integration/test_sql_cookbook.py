"""SQL analytics end to end: every docs/sql.md cookbook query against data the pipeline produced,
and /v1/sql's formats, limits and refusals, over HTTP and through `agl-stream sql`.

One module-scoped pipeline on the real broker and the embedded engine: rollout processor,
gateway, triplet builder, batcher (small batches, short linger), CPU inference, LLM proxy and a
runner with :func:`cookbook_agent` (an LLM call through the proxy, two tool spans of which one may
fail, a reward; a flaky task that fails its first attempt and is retried; a broken one that
fails). The gateway runs with small SQL limits so that the limit tests are cheap.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import uuid4

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from agl_stream import connect
from agl_stream.agent.litagent import rollout
from agl_stream.config import Settings
from agl_stream.kafka.io import Outbox, make_producer
from agl_stream.kafka.offsets import fence_at_end
from agl_stream.local import stack
from agl_stream.local.processes import role_environment
from agl_stream.models import LLM, ProxyLLM, Rollout, RolloutConfig, TrainerStep
from agl_stream.ports import free_ports
from tests.integration.helpers import serve, start_role, stop_role

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]  # the first test also starts the pipeline

ROOT = Path(__file__).resolve().parents[2]
MAX_RESULT_ROWS = 500


# -- the agent the runner runs (imported by the runner process) ------------------------------------


@rollout
async def cookbook_agent(task: dict[str, Any], llm: LLM, rollout: Rollout) -> float:
    from openai import AsyncOpenAI

    attempt = getattr(rollout, "attempt", None)
    tracer = trace.get_tracer("tests.cookbook")
    if task["kind"] == "broken":
        raise ValueError("the task is broken")
    with tracer.start_as_current_span("agent.step"):
        if task["kind"] == "flaky" and attempt is not None and attempt.sequence_id == 1:
            raise ConnectionError("the first attempt loses its connection")
        client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key or "none", max_retries=0)
        try:
            await client.chat.completions.create(
                model=llm.model, messages=[{"role": "user", "content": task["question"]}], max_tokens=4, seed=1
            )
        finally:
            await client.close()
        for tool in ("calculator", "search"):
            with tracer.start_as_current_span(f"execute_tool {tool}") as span:
                span.set_attribute("gen_ai.operation.name", "execute_tool")
                span.set_attribute("gen_ai.tool.name", tool)
                if tool == "search" and task.get("search_fails"):
                    span.set_attribute("error.type", "TimeoutError")
                    span.set_status(Status(StatusCode.ERROR, "search timed out"))
    return float(task["reward"])


# -- the pipeline ------------------------------------------------------------------------------------

GROUP_A_REWARDS = (0.2, 0.5, 0.9)


@dataclass
class Pipeline:
    settings: Settings
    url: str
    rollouts: dict[str, str]  # name -> rollout id

    def sql(self, query: str, fmt: str = "json", timeout: float | None = None) -> httpx.Response:
        body: dict[str, Any] = {"query": query, "format": fmt}
        if timeout is not None:
            body["timeout"] = timeout
        return httpx.post(f"{self.url}/v1/sql", json=body, timeout=60)

    def rows(self, query: str) -> list[dict[str, Any]]:
        response = self.sql(query)
        assert response.status_code == 200, response.text
        payload = response.json()
        return [dict(zip(payload["columns"], row, strict=True)) for row in payload["rows"]]


def _wait(condition: Callable[[], bool], what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)  # polling another process's progress: there is nothing to be notified by


async def _steps(settings: Settings, batches: list[dict[str, Any]]) -> None:
    """The trainer steps that made versions 1, 2, ... from ``batches``, sent as the trainer sends them."""
    producer = make_producer(settings)
    await producer.start()
    try:
        typed = Outbox(settings, producer, "test")
        for version, batch in enumerate(batches, start=1):
            step = TrainerStep(
                batch_id=batch["batch_id"],
                model="agl-tiny",
                policy_version=version,
                step_time=time.time(),
                step_seconds=0.5,
                idle_seconds=0.0,
                tokens=int(batch["n_tokens"]),
                samples=int(batch["n_triplets"]),
                metrics={"loss": 0.25},
            )
            await typed.send(settings.topic("trainer-metrics"), step, key=step.batch_id)
    finally:
        await producer.stop()


async def _produce(settings: Settings, proxy_url: str) -> dict[str, str]:
    async with connect(**settings.model_dump(exclude_none=True)) as store:
        await store.add_resources({"policy": ProxyLLM(endpoint=proxy_url, model="agl-tiny")})
        retry = RolloutConfig(max_attempts=2, retry_condition=["failed"])
        tasks: dict[str, dict[str, Any]] = {
            **{
                f"a{i}": {
                    "input": {"kind": "ok", "question": f"group a, member {i}", "reward": reward},
                    "metadata": {"group_id": "grp-a"},
                }
                for i, reward in enumerate(GROUP_A_REWARDS)
            },
            "b1": {"input": {"kind": "ok", "question": "what is 7*6?", "reward": 1.0, "search_fails": True}},
            "b2": {"input": {"kind": "ok", "question": "name a color", "reward": 0.0}},
            "flaky": {"input": {"kind": "flaky", "question": "retry me", "reward": 0.7}, "config": retry},
            "broken": {"input": {"kind": "broken", "reward": 0.0}},
        }
        made = await store.enqueue_many_rollouts([{**t, "mode": "train"} for t in tasks.values()])
        ids = {name: r.rollout_id for name, r in zip(tasks, made, strict=True)}
        finished = await store.wait_for_rollouts(rollout_ids=list(ids.values()), timeout=120)
        status = {r.rollout_id: r.status for r in finished}
        assert status[ids["broken"]] == "failed" and status[ids["flaky"]] == "succeeded", status
        assert [status[ids[n]] for n in ("a0", "a1", "a2", "b1", "b2")] == ["succeeded"] * 5
        # Every span and attempt the runner wrote is in ClickHouse behind these fences.
        fence = {**await fence_at_end(settings, "spans"), **await fence_at_end(settings, "rollout-state")}
        assert store.side is not None
        await store.side.query("SELECT 1", fence=fence, timeout=60)
    return ids


@pytest.fixture(scope="module")
def pipeline(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    settings = Settings(
        kafka_bootstrap=kafka_bootstrap,
        data_dir=tmp_path_factory.mktemp("sql"),
        topic_prefix=f"q{uuid4().hex[:10]}",
        gateway_port=0,
        sql_max_result_rows=MAX_RESULT_ROWS,
        sql_max_memory_bytes=256 << 20,
    )
    stack.up(settings)
    settings = stack.local_stack_settings(settings)
    roles: list[subprocess.Popen[bytes]] = []
    try:
        roles.append(start_role(settings, "triplets", log_name="triplets"))
        roles.append(start_role(settings, "batcher", "--max-rollouts", "4", "--linger", "0.5", log_name="batcher"))
        model_port, proxy_port = free_ports(2)
        roles.append(
            serve(
                settings,
                *("inference", "--port", str(model_port), "--model-name", "agl-tiny", "--no-follow"),
                name="inference",
                url=f"http://127.0.0.1:{model_port}/health",
            )
        )
        roles.append(
            serve(
                settings,
                *("llm-proxy", "--port", str(proxy_port), "--backend", f"agl-tiny=http://127.0.0.1:{model_port}/v1"),
                name="proxy",
                url=f"http://127.0.0.1:{proxy_port}/health",
            )
        )
        _wait(lambda: all((settings.run_dir / f).exists() for f in ("triplets.ready", "batcher.ready")), "roles")
        runner = start_role(
            settings,
            *("runner", "--agent", "tests.integration.test_sql_cookbook:cookbook_agent", "--concurrency", "4"),
            log_name="runner",
        )
        roles.append(runner)
        ids = asyncio.run(_produce(settings, f"http://127.0.0.1:{proxy_port}/v1"))
        gateway_url = stack.read_stack(settings).gateway_url  # type: ignore[union-attr]
        assert gateway_url
        pipe = Pipeline(settings, gateway_url, ids)
        # The builder sends one record per finished attempt (8), the batcher batches them all.
        _wait(lambda: pipe.rows("SELECT count() AS n FROM agl.triplet_records FINAL")[0]["n"] == 8, "triplet records")
        _wait(
            lambda: pipe.rows("SELECT sum(n_records) AS n FROM agl.batches FINAL")[0]["n"] == 8,
            "batches holding every record",
        )
        # A trainer step per batch with samples, in batch order (version n from the n-th batch), on
        # the topic the trainer writes: the lineage query joins them by batch id. (The trainer
        # itself is tested elsewhere; here its start alone took minutes on a loaded machine.)
        trained = pipe.rows(
            "SELECT batch_id, n_triplets, n_tokens FROM agl.batches FINAL WHERE n_triplets > 0 ORDER BY sequence"
        )
        asyncio.run(_steps(settings, trained))
        _wait(
            lambda: pipe.rows("SELECT count() AS n FROM agl.trainer_steps FINAL")[0]["n"] == len(trained),
            "a trainer step per batch with samples",
        )
        yield pipe
    finally:
        for process in reversed(roles):
            stop_role(process, timeout=30)
        stack.down(settings)


# -- the cookbook --------------------------------------------------------------------------------------


def cookbook() -> dict[str, str]:
    """Heading -> SQL of every query in the cookbook section of docs/sql.md."""
    text = (ROOT / "docs" / "sql.md").read_text()
    section = text[text.index("## The cookbook") : text.index("## Limits")]
    found = {
        m.group(1).strip(): m.group(2).strip()
        for m in re.finditer(r"^### (.+?)\n.*?```sql\n(.*?)```", section, re.S | re.M)
    }
    assert len(found) == section.count("```sql"), "every cookbook query sits under a heading of its own"
    return found


Rows = list[dict[str, Any]]


def _by(rows: Rows, key: str) -> dict[Any, dict[str, Any]]:
    return {row[key]: row for row in rows}


def check_reward_curve(rows: Rows, p: Pipeline) -> None:
    [row] = rows  # no checkpoint was published: every attempt ran at version NULL
    assert row["policy_version"] is None and row["attempts"] == 8
    assert row["rewarded"] == 6  # a0-a2, b1, b2 and the flaky rollout's second attempt
    rewards = [*GROUP_A_REWARDS, 1.0, 0.0, 0.7]
    assert row["mean_reward"] == pytest.approx(sum(rewards) / 6, abs=1e-4)
    assert (row["min_reward"], row["max_reward"]) == (0.0, 1.0)


def check_slowest_tools(rows: Rows, p: Pipeline) -> None:
    tools = _by(rows, "tool")
    assert set(tools) == {"calculator", "search"}
    assert tools["calculator"]["calls"] == 6 and tools["search"]["calls"] == 6
    assert (tools["calculator"]["errors"], tools["search"]["errors"]) == (0, 1)
    for row in rows:
        assert 0 < row["p50_ms"] <= row["p95_ms"] <= row["p99_ms"] < 10_000


def check_latency_by_model(rows: Rows, p: Pipeline) -> None:
    model = _by(rows, "model")["agl-tiny"]
    assert model["calls"] >= 6 and model["errors"] == 0  # the proxy's spans (and the client's own, if traced)
    assert 0 < model["p50_ms"] <= model["p99_ms"] < 60_000
    assert model["input_tokens"] > 0 and model["output_tokens"] > 0


def check_latency_by_span_name(rows: Rows, p: Pipeline) -> None:
    names = _by(rows, "span_name")
    assert {"agent.step", "execute_tool search", "openai.chat.completion"} <= set(names)
    assert names["agent.step"]["spans"] == 7  # six attempts that got as far, plus the flaky first one
    # agent.step encloses the LLM call and the tools, so it is never shorter than the call
    assert names["agent.step"]["max_ms"] >= names["openai.chat.completion"]["p50_ms"]


def check_token_spend_per_task(rows: Rows, p: Pipeline) -> None:
    groups = _by(rows, "group_id")
    assert groups["grp-a"]["attempts"] == 3 and groups["grp-a"]["rollouts"] == 3
    assert groups["grp-a"]["total_tokens"] > 0
    assert "group a, member" in groups["grp-a"]["task_input"]
    assert len(rows) == 5  # grp-a, b1, b2, flaky, broken (digests of their inputs)
    assert rows == sorted(rows, key=lambda r: -r["total_tokens"])


def check_tokens_per_rollout(rows: Rows, p: Pipeline) -> None:
    by_id = _by(rows, "rollout_id")
    assert set(by_id) == {p.rollouts[n] for n in ("a0", "a1", "a2", "b1", "b2", "flaky")}
    assert by_id[p.rollouts["flaky"]]["attempts"] == 2
    for row in rows:
        assert row["llm_calls"] >= 1 and row["input_tokens"] > 0 and row["output_tokens"] > 0
        assert row["total_tokens"] == row["input_tokens"] + row["output_tokens"]


def check_tokens_per_version(rows: Rows, p: Pipeline) -> None:
    [row] = rows
    assert row["policy_version"] is None and row["attempts"] == 8 and row["triplets"] == 6
    assert row["total_tokens"] == row["prompt_token_count"] + row["response_token_count"] > 0


def check_failed_by_error_type(rows: Rows, p: Pipeline) -> None:
    kinds = {row["error_type"]: row for row in rows}
    assert {k.rsplit(".", 1)[-1] for k in kinds} == {"ValueError", "ConnectionError"}
    assert all(row["failed_attempts"] == 1 and row["statuses"] == ["failed"] for row in rows)


def check_retried(rows: Rows, p: Pipeline) -> None:
    [row] = rows
    assert row["rollout_id"] == p.rollouts["flaky"] and row["rollout_status"] == "succeeded"
    assert row["attempts"] == 2 and row["attempt_statuses"] == ["failed", "succeeded"]


def check_error_rate_by_span_name(rows: Rows, p: Pipeline) -> None:
    names = _by(rows, "span_name")
    assert names["execute_tool search"]["errors"] == 1 and names["execute_tool search"]["spans"] == 6
    assert names["execute_tool search"]["error_rate"] == pytest.approx(1 / 6, abs=1e-4)
    assert names["execute_tool search"]["top_error_types"] == ["TimeoutError"]
    assert names["agentlightning.exception"]["error_rate"] == 1.0
    assert names["agentlightning.exception"]["errors"] == 2


def check_attempt_outcomes(rows: Rows, p: Pipeline) -> None:
    assert rows == [{"attempts": 8, "succeeded": 6, "failed": 2, "lost": 0, "error_rate": 0.25}]


def check_throughput(rows: Rows, p: Pipeline) -> None:
    assert sum(row["attempts"] for row in rows) == 8 and sum(row["succeeded"] for row in rows) == 6
    for row in rows:
        assert row["worker_id"] and row["mean_seconds"] >= 0 and row["attempts_per_second"] > 0


def check_batches(rows: Rows, p: Pipeline) -> None:
    [row] = rows
    assert row["newest_policy_version"] is None and row["records"] == 8 and row["triplets"] == 6
    assert row["batches"] >= 2  # at most 4 records per batch
    assert row["mean_staleness"] == 0 and row["dropped_stale"] == 0


def check_lineage(rows: Rows, p: Pipeline) -> None:
    # Version 1 is what the first trainer step made, from one batch.
    [step] = p.rows("SELECT batch_id, samples FROM agl.trainer_steps FINAL WHERE policy_version = 1")
    assert {row["batch_id"] for row in rows} == {step["batch_id"]}
    assert len({row["sample_index"] for row in rows}) == step["samples"] > 0  # every sample it trained on
    succeeded = {p.rollouts[n] for n in ("a0", "a1", "a2", "b1", "b2", "flaky")}
    assert {row["rollout_id"] for row in rows} <= succeeded
    # Each span id is an LLM call of that attempt, found in otel_traces with its trace.
    spans = p.rows(
        "SELECT RolloutId AS rollout_id, AttemptId AS attempt_id, SpanId AS span_id, TraceId AS trace_id, "
        "toUInt8(Model != '') AS llm FROM agl.span_facts AS f FINAL "
        "JOIN (SELECT RolloutId, AttemptId, SpanId, TraceId FROM agl.otel_traces FINAL) AS o "
        "USING (RolloutId, AttemptId, SpanId)"
    )
    known = {(s["rollout_id"], s["attempt_id"], s["span_id"]): s for s in spans}
    for row in rows:
        span = known[(row["rollout_id"], row["attempt_id"], row["span_id"])]
        assert row["trace_id"] == span["trace_id"] != "" and span["llm"] == 1, (row, span)
    # Over every version, every sample of every batch is accounted for: the six triplets.
    assert p.rows("SELECT count() AS n FROM agl.batch_samples FINAL")[0]["n"] == 6


def check_longest_rollouts(rows: Rows, p: Pipeline) -> None:
    assert {row["rollout_id"] for row in rows} == set(p.rollouts.values())
    assert [row["seconds"] for row in rows] == sorted((row["seconds"] for row in rows), reverse=True)
    assert _by(rows, "rollout_id")[p.rollouts["flaky"]]["attempts"] == 2
    assert all(row["seconds"] > 0 for row in rows)


def check_spans_per_attempt(rows: Rows, p: Pipeline) -> None:
    assert len(rows) == 8
    assert [row["spans"] for row in rows] == sorted((row["spans"] for row in rows), reverse=True)
    full = [row for row in rows if row["tool_calls"] == 2]
    assert len(full) == 6 and all(row["llm_calls"] >= 1 for row in full)
    # Two exception spans, the flaky attempt's agent.step (the exception ended it with ERROR status),
    # one failed search, and the root spans of the two failed attempts (ERROR with the reason).
    assert sum(row["errors"] for row in rows) == 6


def check_triplets_per_group(rows: Rows, p: Pipeline) -> None:
    groups = _by(rows, "group_id")
    assert groups["grp-a"]["triplets"] == 3 and groups["grp-a"]["rollouts"] == 3
    assert sum(row["triplets"] for row in rows) == 6
    assert all(row["tokens"] > 0 for row in rows)


def check_grpo_group(rows: Rows, p: Pipeline) -> None:
    [row] = rows
    assert row["group_id"] == "grp-a" and row["members"] == 3 and row["rewards"] == list(GROUP_A_REWARDS)
    assert row["spread"] == pytest.approx(0.7)
    assert row["mean_reward"] == pytest.approx(sum(GROUP_A_REWARDS) / 3, abs=1e-4)


def check_slowest_llm_calls(rows: Rows, p: Pipeline) -> None:
    assert 6 <= len(rows) <= 10
    assert all(row["model"] == "agl-tiny" and row["ms"] > 0 and row["input_tokens"] > 0 for row in rows)
    assert [row["ms"] for row in rows] == sorted((row["ms"] for row in rows), reverse=True)


CHECKS: dict[str, Callable[[Rows, Pipeline], None]] = {
    "Reward curve per policy version": check_reward_curve,
    "Slowest tools (p50, p95, p99)": check_slowest_tools,
    "Latency by model": check_latency_by_model,
    "Latency percentiles by span name": check_latency_by_span_name,
    "Token spend per task": check_token_spend_per_task,
    "Token usage per rollout": check_tokens_per_rollout,
    "Token usage per policy version": check_tokens_per_version,
    "Failed attempts by error type": check_failed_by_error_type,
    "Rollouts that were retried": check_retried,
    "Error rate by span name": check_error_rate_by_span_name,
    "Attempt outcomes": check_attempt_outcomes,
    "Runners' throughput per worker": check_throughput,
    "Batches per policy version and their staleness": check_batches,
    "Traces that trained a policy version": check_lineage,
    "Longest rollouts": check_longest_rollouts,
    "Spans per attempt": check_spans_per_attempt,
    "Triplets per task group": check_triplets_per_group,
    "Rewards of a GRPO group": check_grpo_group,
    "Slowest LLM calls": check_slowest_llm_calls,
}


def test_every_cookbook_query_answers_with_the_pipelines_data(pipeline: Pipeline) -> None:
    queries = cookbook()
    assert len(queries) >= 14
    assert set(queries) == set(CHECKS), "each cookbook question has a check here"
    failures = {}
    for heading, query in queries.items():
        rows = pipeline.rows(query)
        assert rows, f"{heading}: no rows"
        try:
            CHECKS[heading](rows, pipeline)
        except AssertionError as error:
            failures[heading] = f"{error}\nrows: {rows}"
    assert not failures, json.dumps(failures, indent=2, default=str)


# -- /v1/sql: formats, limits, refusals ------------------------------------------------------------------


def test_formats_over_get_and_post(pipeline: Pipeline) -> None:
    query = "SELECT status, count() AS n FROM agl.attempts FINAL GROUP BY status ORDER BY status"
    as_json = httpx.get(f"{pipeline.url}/v1/sql", params={"query": query}, timeout=30)
    assert as_json.status_code == 200 and as_json.headers["content-type"] == "application/json"
    payload = as_json.json()
    assert payload["columns"] == ["status", "n"] and payload["rows"] == [["failed", 2], ["succeeded", 6]]
    assert payload["row_count"] == 2 and payload["types"] == ["LowCardinality(String)", "UInt64"]
    jsonl = httpx.get(f"{pipeline.url}/v1/sql", params={"query": query, "format": "jsonl"}, timeout=30)
    assert [json.loads(line) for line in jsonl.text.splitlines()] == [
        {"status": "failed", "n": 2},
        {"status": "succeeded", "n": 6},
    ]
    as_csv = httpx.post(f"{pipeline.url}/v1/sql", json={"query": query, "format": "csv"})
    assert as_csv.status_code == 200 and as_csv.text.splitlines() == ["status,n", "failed,2", "succeeded,6"]
    as_text = httpx.post(  # what a web page could send without asking: refused before it is read
        f"{pipeline.url}/v1/sql", params={"format": "csv"}, content=query, headers={"content-type": "text/plain"}
    )
    assert as_text.status_code == 415 and as_text.json()["error"] == "unsupported_media_type"
    huge = httpx.post(f"{pipeline.url}/v1/sql", json={"query": "SELECT 1 -- " + "x" * (2 << 20)})
    assert huge.status_code == 413 and huge.json()["error"] == "too_large"
    table = pipeline.sql(query, "table")
    assert table.headers["content-type"].startswith("text/plain")
    lines = table.text.splitlines()
    assert re.match(r"\s*status\s+n\s*$", lines[0]) and any(re.match(r"\s*succeeded\s+6\s*$", x) for x in lines)
    assert "2 row(s)" in table.text
    bad = httpx.get(f"{pipeline.url}/v1/sql", params={"query": "SELECT 1", "format": "xml"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"] == "bad_request"


def test_limits_are_the_engines(pipeline: Pipeline) -> None:
    slow = pipeline.sql("SELECT sum(cityHash64(number)) FROM numbers(1000000000000)", timeout=0.5)
    assert slow.status_code == 408 and slow.json()["error"] == "timeout", slow.text
    assert slow.json()["name"] == "TIMEOUT_EXCEEDED"
    many = pipeline.sql(f"SELECT number FROM numbers({MAX_RESULT_ROWS + 1})")
    assert many.status_code == 413 and many.json()["name"] == "TOO_MANY_ROWS_OR_BYTES", many.text
    assert pipeline.sql(f"SELECT number FROM numbers({MAX_RESULT_ROWS})").json()["row_count"] == MAX_RESULT_ROWS
    # Constant expressions are evaluated while the query is checked: under the same limits. One
    # huge array in one block would run past the time limit (checked between blocks): refused.
    constant = pipeline.sql("SELECT length(range(100000000))")
    assert constant.status_code == 400 and constant.json()["name"] == "ARGUMENT_OUT_OF_BOUND", constant.text
    one_block = pipeline.sql("SELECT length(arrayMap(x -> sipHash64(x), range(toUInt64(3e8))))")
    assert one_block.status_code == 400 and one_block.json()["name"] == "ARGUMENT_OUT_OF_BOUND", one_block.text
    wide = pipeline.sql("SELECT length(arrayMap(x -> repeat('x', 100), range(5000000)))")
    assert wide.status_code == 413 and wide.json()["name"] == "MEMORY_LIMIT_EXCEEDED", wide.text
    aggregates = pipeline.sql(
        "SELECT countIf(number > 0) AS c, quantileExactIf(0.5)(number, number > 0) AS q FROM numbers(3)"
    )
    assert aggregates.status_code == 200 and aggregates.json()["rows"] == [[2, 2]], aggregates.text
    functions = pipeline.sql(
        "SELECT arrayMap(x -> x * 2, [1, 2]) AS m, row_number() OVER () AS r, toString(number) AS s "
        "FROM numbers(3) ORDER BY r"
    )
    assert functions.status_code == 200 and functions.json()["row_count"] == 3, functions.text
    memory = pipeline.sql("SELECT groupArray(repeat('x', 1000)) FROM numbers(10000000)")
    assert memory.status_code == 413 and memory.json()["name"] == "MEMORY_LIMIT_EXCEEDED", memory.text
    bad = pipeline.sql("SELECT no_such_column FROM agl.rollouts")
    assert bad.status_code == 400 and bad.json()["error"] == "query_error"


REFUSED = {
    "INSERT INTO agl.rollouts (rollout_id) VALUES ('x')": "read_only",
    "CREATE TABLE agl.mine (a Int64) ENGINE = Memory": "read_only",
    "DROP TABLE agl.rollouts": "read_only",
    "ALTER TABLE agl.rollouts DELETE WHERE 1": "read_only",
    "SET max_execution_time = 1000": "read_only",
    "SELECT 1 SETTINGS max_execution_time = 1000": "read_only",
    "SHOW TABLES FROM system": "forbidden_table",  # SHOW TABLES and DESCRIBE: within agl only
    "DESCRIBE TABLE system.tables": "forbidden_table",
    "SHOW CREATE TABLE agl.rollouts": "read_only",
    "SHOW DATABASES": "read_only",
    "SELECT * FROM file('/etc/hostname', 'LineAsString')": "forbidden_function",
    "SELECT file('/etc/hostname')": "forbidden_function",
    "SELECT length(file('/proc/self/environ'))": "forbidden_function",
    "SELECT hostName(), fullHostName()": "forbidden_function",
    "SELECT getSetting('max_memory_usage')": "forbidden_function",
    "SELECT sleep(3)": "forbidden_function",
    "SELECT dictGet('any', 'attr', 1)": "forbidden_function",
    "SELECT * FROM url('http://127.0.0.1:1/', 'CSV', 'a String')": "forbidden_function",
    "SELECT (SELECT groupArray(name) FROM system.databases)": "forbidden_table",
    "SELECT * FROM system.tables": "forbidden_table",
    "SELECT count() FROM agl.rollouts WHERE rollout_id IN (SELECT name FROM system.users)": "forbidden_table",
    "WITH t AS (SELECT * FROM system.processes) SELECT count() FROM t": "forbidden_table",
    "SELECT * FROM information_schema.tables": "forbidden_table",
    "SELECT * FROM merge('system', '^tab')": "forbidden_function",
    "SELECT * FROM view(SELECT * FROM system.one)": "forbidden_function",
}


def test_writes_and_system_tables_are_refused(pipeline: Pipeline, tmp_path: Path) -> None:
    outfile = tmp_path / "out.csv"
    refused = {**REFUSED, f"SELECT * FROM agl.rollouts INTO OUTFILE '{outfile}'": "read_only"}
    for query, kind in refused.items():
        response = pipeline.sql(query)
        assert response.status_code == 403, f"{query}: {response.status_code} {response.text}"
        assert response.json()["error"] == kind, f"{query}: {response.text}"
    assert not outfile.exists()
    assert pipeline.rows("SELECT count() AS n FROM agl.rollouts FINAL") == [{"n": 7}]  # nothing was written
    assert pipeline.rows("SELECT 1 AS one") == [{"one": 1}]  # system.one, what a bare SELECT reads, is allowed


def test_show_tables_and_describe_answer_within_the_agl_database(pipeline: Pipeline) -> None:
    tables = [row["name"] for row in pipeline.rows("SHOW TABLES")]
    assert {"rollouts", "attempts", "span_facts", "reward_by_policy_version"} <= set(tables)
    assert tables == [row["name"] for row in pipeline.rows("show tables from agl")]
    columns = pipeline.rows("DESCRIBE agl.rollouts")
    assert [c["name"] for c in columns][:3] == ["rollout_id", "input", "start_time"]
    assert {c["name"]: c["type"] for c in columns}["end_time"] == "Nullable(DateTime64(6, 'UTC'))"
    assert pipeline.rows("DESC TABLE span_facts")[0] == pipeline.rows("DESCRIBE agl.span_facts")[0]


def _cli(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    env = role_environment(settings)
    return subprocess.run(
        [sys.executable, "-m", "agl_stream", "sql", *args], env=env, capture_output=True, text=True, timeout=120
    )


def test_the_cli_goes_through_the_same_checks(pipeline: Pipeline) -> None:
    query = cookbook()["Rollouts that were retried"]
    answer = _cli(pipeline.settings, "-o", "json", query)
    assert answer.returncode == 0, answer.stderr
    [row] = [json.loads(line) for line in answer.stdout.splitlines()]
    assert row["rollout_id"] == pipeline.rollouts["flaky"] and row["attempt_statuses"] == ["failed", "succeeded"]
    system = _cli(pipeline.settings, "SELECT name FROM system.tables")
    assert system.returncode == 1 and "forbidden_table" in system.stderr and "system.tables" in system.stderr
    write = _cli(pipeline.settings, "INSERT INTO agl.rollouts (rollout_id) VALUES ('x')")
    assert write.returncode == 1 and "readonly" in write.stderr


def test_span_facts_cover_spans_inserted_before_the_migration_once(tmp_path: Path) -> None:
    """Upgrading a database that already has spans: 006 backfills span_facts, and a span that both
    the view and the backfill copy (or that was inserted twice) is one row."""
    from agl_stream.clickhouse.client import get_client
    from agl_stream.clickhouse.migrations import load_migrations, migrate

    settings = Settings(data_dir=tmp_path)
    migrations = load_migrations()
    client = get_client(settings)
    try:
        migrate(client, "agl", [m for m in migrations if m.name != "analytics"])
        insert = (
            "INSERT INTO agl.otel_traces (Timestamp, SpanId, SpanName, SpanAttributes, Duration, StatusCode, "
            "RolloutId, AttemptId, SequenceId, KafkaOffset) VALUES "
            "(now64(9), 's1', 'execute_tool search', map('gen_ai.tool.name', 'search', 'error.type', 'TimeoutError'), "
            "5000000, 'STATUS_CODE_ERROR', 'ro-1', 'at-1', 1, {offset})"
        )
        client.command(insert.format(offset=10))
        migrate(client, "agl", migrations)
        backfilled = client.query("SELECT SpanId, KafkaOffset FROM agl.span_facts").result_rows
        assert backfilled == [("s1", 10)]
        client.command(insert.format(offset=11))  # the same span again, now through the view
        rows = client.query(
            "SELECT Tool, IsError, ErrorType, DurationNs, KafkaOffset FROM agl.span_facts FINAL"
        ).result_rows
        assert rows == [("search", 1, "TimeoutError", 5000000, 11)]
        assert client.query("SELECT tool, calls, errors FROM agl.latency_by_tool").result_rows == [("search", 1, 1)]
    finally:
        client.close()
