"""The dashboard in a real headless browser (Debian's chromium, driven by Playwright).

One module-scoped stack on the session broker (processor, gateway, ingress, triplet builder,
batcher), the LLM proxy in front of a fake OpenAI-compatible model, and a runner with
:func:`dashboard_agent`: an agent step that calls the model through the proxy with the openai
client (a prompt of hostile HTML; the model answers with a tool call), a tool span, a reward;
one task raises. The spans are the pipeline's own: the runner's root span, the openai client's
span and the proxy's span of the same call (its child), as any agent's. Every page is loaded and what
it shows is compared with SQL on the same data; a rollout's waterfall is opened, a cookbook
query runs in the console, bad input gets a message, and the overview refreshes by itself.
Screenshots of each page go to the test's temp dir (printed).

The browser is /usr/bin/chromium (`make test` installs Debian's package when it is missing); it
is never downloaded here. Without it the module fails and says how to install it.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode
from uuid import uuid4

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from agl_stream import connect
from agl_stream.agent.litagent import rollout
from agl_stream.auth import auth_headers, known_token
from agl_stream.config import Settings
from agl_stream.domain.batching import batch_id_of
from agl_stream.kafka.io import Outbox, Rejected, make_producer
from agl_stream.kafka.offsets import fence_at_end
from agl_stream.local import stack
from agl_stream.models import (
    LLM,
    PromptTemplate,
    ProxyLLM,
    TrainerStep,
    Triplet,
    TripletBatch,
    TripletRecord,
    Worker,
)
from agl_stream.ports import free_ports
from agl_stream.wire.codec import Codec
from consumers import dashboard_sql as dsql
from tests.integration.helpers import serve, start_role, stop_role
from tests.scripted_openai import scripted_openai, tool_call

pytestmark = pytest.mark.integration

CHROMIUM = Path("/usr/bin/chromium")
HOSTILE = "<img src=x onerror=\"document.title='pwned'\"><b>bold?</b>"


CALCULATOR = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}


@rollout
async def dashboard_agent(task: dict[str, Any], llm: LLM) -> float:
    from openai import AsyncOpenAI

    tracer = trace.get_tracer("tests.dashboard")
    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key or "none", max_retries=0)
    try:
        with tracer.start_as_current_span("agent.step"):
            await client.chat.completions.create(
                model=llm.model,
                messages=[{"role": "user", "content": f"{task['question']} {HOSTILE}"}],
                tools=[CALCULATOR],  # type: ignore[list-item]
            )
            with tracer.start_as_current_span("execute_tool calculator") as tool:
                tool.set_attribute("gen_ai.tool.name", "calculator")
                if task.get("broken"):
                    tool.set_status(Status(StatusCode.ERROR, "the calculator broke"))
                    raise ValueError(f"the task is broken {HOSTILE}")
    finally:
        await client.close()
    return float(task["reward"])


def _model_reply(body: dict[str, Any]) -> dict[str, Any]:
    """The scripted model answers every call with a tool call."""
    arguments = json.dumps({"expression": "6*7"})
    return {"content": "forty-two", "tool_calls": [tool_call("call-1", "calculator", arguments)]}


def _model_ids(body: dict[str, Any], message: dict[str, Any]) -> tuple[list[int], list[int]]:
    return list(range(17)), [7, 8, 9]


@dataclass
class Dash:
    settings: Settings
    url: str
    ids: dict[str, str]
    shots: Path
    page: str  # the dashboard's URL as `agl-stream dashboard` prints it: with the API token

    def rows(self, query: str) -> list[dict[str, Any]]:
        headers = auth_headers(self.settings)
        response = httpx.post(f"{self.url}/v1/sql", json={"query": query}, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
        payload = response.json()
        return [dict(zip(payload["columns"], row, strict=True)) for row in payload["rows"]]

    def value(self, query: str) -> Any:
        [row] = self.rows(query)
        return next(iter(row.values()))


TASKS: dict[str, dict[str, Any]] = {
    "t1": {"input": {"question": "one", "reward": 0.25}, "mode": "train"},
    "t2": {"input": {"question": "two", "reward": 0.75}, "mode": "train"},
    "v1": {"input": {"question": "three", "reward": 1.0}, "mode": "val"},
    "broken": {"input": {"question": "four", "reward": 0.0, "broken": True}, "mode": "train"},
}


async def _produce(settings: Settings, names: list[str]) -> dict[str, str]:
    async with connect(**settings.model_dump(exclude_none=True)) as store:
        made = await store.enqueue_many_rollouts([TASKS[n] for n in names])
        ids = {name: r.rollout_id for name, r in zip(names, made, strict=True)}
        await store.wait_for_rollouts(rollout_ids=list(ids.values()), timeout=120)
        # Every span and state the runner wrote is in ClickHouse behind these fences.
        fence = {**await fence_at_end(settings, "spans"), **await fence_at_end(settings, "rollout-state")}
        assert store.side is not None
        await store.side.query("SELECT 1", fence=fence, timeout=60)
    return ids


def _wait_sql(dash: Dash, query: str, expected: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while (got := dash.value(query)) != expected:
        assert time.monotonic() < deadline, f"{query} is {got}, not {expected}"
        time.sleep(0.2)  # another process's progress: there is nothing to be notified by


@pytest.fixture(scope="module")
def dash(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dash]:
    settings = Settings(
        kafka_bootstrap=kafka_bootstrap,
        data_dir=tmp_path_factory.mktemp("dashboard"),
        topic_prefix=f"d{uuid4().hex[:10]}",
        gateway_port=0,
        # The gateway requires its API token (as it does beyond loopback): the page must get it
        # from the URL `agl-stream dashboard` prints and send it on every request.
        require_token=True,
    )
    stack.up(settings, training=True)
    settings = stack.local_stack_settings(settings)
    runner: subprocess.Popen[bytes] | None = None
    proxy: subprocess.Popen[bytes] | None = None
    try:
        with scripted_openai(_model_reply, _model_ids) as model:
            [proxy_port] = free_ports(1)
            proxy = serve(
                *(settings, "llm-proxy", "--port", str(proxy_port), "--backend", f"tiny={model.base_url}"),
                name="proxy",
                url=f"http://127.0.0.1:{proxy_port}/health",
            )
            # The proxy asks for the stack's API token too: the agent sends it as its key.
            policy = ProxyLLM(endpoint=f"http://127.0.0.1:{proxy_port}/v1", model="tiny", api_key=known_token(settings))
            prompt = PromptTemplate(template=f"Answer {{question}} {HOSTILE}", engine="f-string")
            asyncio.run(_add_resources(settings, {"policy": policy, "prompt": prompt}))
            runner = start_role(
                settings,
                *("runner", "--agent", "tests.integration.test_dashboard:dashboard_agent", "--concurrency", "4"),
                log_name="runner",
            )
            ids = asyncio.run(_produce(settings, list(TASKS)))
            url = stack.dashboard_url(settings)
            token = known_token(settings)
            assert url is not None and token and url.endswith(f"/dashboard/?{urlencode({'token': token})}")
            base = url.split("/dashboard/")[0]
            dash = Dash(settings, base, ids, tmp_path_factory.mktemp("screenshots"), url)
            # the triplet builder writes one record per finished attempt (4); a deadline, not a speed
            # goal: on a loaded machine (load 17 on 2 cores) 60 s was not enough
            _wait_sql(dash, "SELECT count() FROM agl.triplet_records FINAL", 4, timeout=300)
            print(f"\ndashboard screenshots: {dash.shots}")
            yield dash
    finally:
        if runner is not None:
            stop_role(runner, timeout=30)
        if proxy is not None:
            stop_role(proxy, timeout=30)
        stack.down(settings)


async def _add_resources(settings: Settings, resources: dict[str, Any]) -> None:
    async with connect(**settings.model_dump(exclude_none=True)) as store:
        await store.add_resources(resources)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.fail(
            f"{CHROMIUM} is missing: install Debian's chromium (`apt-get install -y chromium`; `make test` does "
            "it when it can). The dashboard tests need a real browser and never download one."
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # --no-sandbox: CI runs as root, where chromium's sandbox refuses to start.
        launched = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture
def page(dash: Dash, browser: Any) -> Iterator[Any]:
    # dash first: its stack starts with asyncio.run, which fails once Playwright's sync API runs
    # its event loop in this thread (a test run alone would set the browser up first).
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    tab = context.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda e: errors.append(str(e)))
    tab.set_default_timeout(20_000)
    try:
        yield tab
    finally:
        context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def _shot(page: Any, dash: Dash, name: str) -> None:
    path = dash.shots / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")


def _cells(page: Any, testid: str, column: str) -> list[str]:
    return [c.strip() for c in page.locator(f'[data-testid="{testid}"] td[data-col="{column}"]').all_inner_texts()]


def test_cli_prints_the_dashboard_url(dash: Dash) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "agl_stream", "--data-dir", str(dash.settings.data_dir), "dashboard"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == dash.page


def test_without_the_token_the_page_says_how_to_get_it(page: Any, dash: Dash) -> None:
    page.goto(f"{dash.url}/dashboard/#/overview")  # the page itself needs no token: it holds no data
    page.wait_for_selector("#error:not([hidden])")
    assert page.inner_text("#error").startswith("unauthorized: this gateway requires its API token")


def test_overview_shows_what_sql_says_and_refreshes_by_itself(page: Any, dash: Dash) -> None:
    page.goto(f"{dash.page}#/overview")
    total = dash.value("SELECT count() FROM agl.rollouts FINAL")
    page.wait_for_function(
        "n => document.querySelector('[data-testid=total-rollouts]')?.textContent === String(n)", arg=total
    )
    spans = dash.value("SELECT count() FROM agl.span_facts FINAL")
    assert page.inner_text('[data-testid="total-spans"]') == f"{spans:,}"
    assert page.inner_text('[data-testid="policy-version"]') == "—"  # nothing trained: no version
    statuses = {
        r["status"]: r["n"] for r in dash.rows("SELECT status, count() AS n FROM agl.rollouts FINAL GROUP BY status")
    }
    shown = dict(zip(_cells(page, "status-table", "status"), _cells(page, "status-table", "rollouts"), strict=True))
    assert shown == {s: str(n) for s, n in statuses.items()} and statuses == {"succeeded": 3, "failed": 1}
    rewards = dash.rows("SELECT ifNull(mode, '') AS mode, mean_reward FROM agl.reward_by_mode_and_version")
    assert {r["mode"]: r["mean_reward"] for r in rewards} == {"train": 0.5, "val": 1.0}  # the broken one: no reward
    modes = _cells(page, "rewards-table", "mode")
    means = [float(v) for v in _cells(page, "rewards-table", "mean_reward")]
    assert dict(zip(modes, means, strict=True)) == {"train": 0.5, "val": 1.0}
    assert page.locator('[data-testid="chart-spans"] canvas').count() == 1  # a uPlot chart was drawn
    # The backlog: every span is applied to ClickHouse (the fixture's fence), and this stack's
    # consumer groups (processor, triplet builder, batcher, ...) are listed with theirs.
    backlog = dict(zip(_cells(page, "backlog-table", "consumer"), _cells(page, "backlog-table", "lag"), strict=True))
    assert backlog["sink clickhouse-spans"] == "0"
    groups = {c for c in backlog if c.startswith(f"{dash.settings.topic_prefix}.")}
    assert f"{dash.settings.topic_prefix}.processor.rollouts" in groups, backlog
    assert not any(".sink." in g for g in groups)  # sinks are listed once, by what they applied
    _shot(page, dash, "overview")
    # Live: a new rollout shows up without a reload. (In a thread: Playwright's sync API runs
    # an event loop in this one.)
    with ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: asyncio.run(_produce(dash.settings, ["t1"]))).result(timeout=180)
    page.wait_for_function(
        "n => document.querySelector('[data-testid=total-rollouts]')?.textContent === String(n)",
        arg=total + 1,
        timeout=30_000,
    )


def test_rollouts_table_filters_pages_and_refuses_bad_input(page: Any, dash: Dash) -> None:
    total = dash.value("SELECT count() FROM agl.rollouts FINAL")
    page.goto(f"{dash.page}#/rollouts?limit=25")
    page.wait_for_selector('[data-testid="rollouts-table"]')
    assert page.inner_text('[data-testid="rollouts-range"]') == f"1-{total} of {total}"
    newest_first = [
        r["rollout_id"]
        for r in dash.rows("SELECT rollout_id FROM agl.rollouts FINAL ORDER BY start_time DESC, rollout_id DESC")
    ]
    assert _cells(page, "rollouts-table", "rollout_id") == newest_first
    _shot(page, dash, "rollouts")
    # A filter through the form: failed ones only.
    page.select_option('form[data-testid="filters"] select[name="status"]', "failed")
    page.click('form[data-testid="filters"] button[type="submit"]')
    page.wait_for_function("() => location.hash.includes('status=failed')")
    page.wait_for_selector('[data-testid="rollouts-range"]:has-text("of 1")')
    assert _cells(page, "rollouts-table", "rollout_id") == [dash.ids["broken"]]
    # Paging: one row per page, the second page is the second newest.
    page.goto(f"{dash.page}#/rollouts?limit=1&offset=1")
    page.wait_for_selector(f'[data-testid="rollouts-range"]:has-text("2-2 of {total}")')
    assert _cells(page, "rollouts-table", "rollout_id") == newest_first[1:2]
    # Bad input: a clear message, no stack trace.
    page.goto(f"{dash.page}#/rollouts?policy_version=abc")
    page.wait_for_selector("#error:not([hidden])")
    message = page.inner_text("#error")
    assert message.startswith("bad_request: policy_version:") and "Traceback" not in message
    # the form stays, with what was typed, to be corrected
    assert page.input_value('form[data-testid="filters"] input[name="policy_version"]') == "abc"
    _shot(page, dash, "rollouts-bad-input")


REWARDED = """
SELECT r.rollout_id AS rollout_id, t.final_reward AS reward,
       toUnixTimestamp64Micro(r.start_time) / 1e6 AS start_time
FROM agl.rollouts AS r FINAL
LEFT JOIN (SELECT rollout_id, attempt_id FROM agl.attempts FINAL ORDER BY sequence_id DESC LIMIT 1 BY rollout_id) AS a
    ON a.rollout_id = r.rollout_id
LEFT JOIN (SELECT attempt_id, final_reward FROM agl.triplet_records FINAL) AS t ON t.attempt_id = a.attempt_id
"""
"""Each rollout with its latest attempt's final reward (NULL without one), written apart from the
dashboard's query; ORDER BY is appended."""


def test_rollouts_sort_by_a_header_click_with_rewards_and_relative_times(page: Any, dash: Dash) -> None:
    page.goto(f"{dash.page}#/rollouts")
    page.wait_for_selector('[data-testid="rollouts-table"] th[data-sort="reward"]')
    # Rewards: the latest attempt's final reward (the broken task's attempt has none).
    by_id = {r["rollout_id"]: r for r in dash.rows(REWARDED)}
    assert by_id[dash.ids["t2"]]["reward"] == 0.75 and by_id[dash.ids["broken"]]["reward"] is None
    cells = zip(_cells(page, "rollouts-table", "rollout_id"), _cells(page, "rollouts-table", "reward"), strict=True)
    assert {rid: None if v == "—" else float(v) for rid, v in cells} == {rid: r["reward"] for rid, r in by_id.items()}
    # Enqueued: how long ago, the UTC time in the title.
    first = page.locator('[data-testid="rollouts-table"] td[data-col="start_time"] time').first
    assert first.inner_text().endswith(" ago") or first.inner_text() == "just now"
    rid = _cells(page, "rollouts-table", "rollout_id")[0]
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(by_id[rid]["start_time"]))
    assert (first.get_attribute("title") or "").startswith(started) and first.get_attribute("title").endswith(" UTC")
    # A click on the reward header: the server's ORDER BY reward, highest first; again: lowest first.
    for order in ("desc", "asc"):
        page.click('[data-testid="rollouts-table"] th[data-sort="reward"]')
        page.wait_for_selector(f'[data-testid="rollouts-table"] th[data-sort="reward"][aria-sort="{order}ending"]')
        assert f"sort=reward&order={order}" in page.evaluate("location.hash")
        expected = [r["rollout_id"] for r in dash.rows(f"{REWARDED} ORDER BY reward {order}, rollout_id {order}")]
        assert _cells(page, "rollouts-table", "rollout_id") == expected
        assert _cells(page, "rollouts-table", "reward")[-1] == "—"  # unknown rewards last either way
    _shot(page, dash, "rollouts-sorted-by-reward")
    # The sort is in the URL: a link reproduces it, and paging keeps it.
    page.goto(f"{dash.page}#/rollouts?sort=status&order=asc&limit=2&offset=2")
    page.wait_for_selector('[data-testid="rollouts-table"] th[data-sort="status"][aria-sort="ascending"]')
    by_status = [
        r["rollout_id"] for r in dash.rows("SELECT rollout_id FROM agl.rollouts FINAL ORDER BY status, rollout_id")
    ]
    assert _cells(page, "rollouts-table", "rollout_id") == by_status[2:4]
    # A column that is not sortable is refused by name.
    page.goto(f"{dash.page}#/rollouts?sort=input")
    page.wait_for_selector("#error:not([hidden])")
    assert page.inner_text("#error").startswith("bad_request: sort:")


def test_a_rollouts_waterfall_llm_calls_rewards_and_exception(page: Any, dash: Dash) -> None:
    broken = dash.ids["broken"]
    page.goto(f"{dash.page}#/rollout/{broken}")
    page.wait_for_selector('[data-testid="waterfall"]')
    [attempt] = dash.rows(f"SELECT attempt_id FROM agl.attempts FINAL WHERE rollout_id = '{broken}'")
    where = f"RolloutId = '{broken}' AND AttemptId = '{attempt['attempt_id']}'"
    spans = dash.value(f"SELECT count() FROM agl.otel_traces FINAL WHERE {where}")
    assert page.locator('[data-testid="wf-row"]').count() == spans
    names = page.locator('[data-testid="wf-row"] .wf-name').all_inner_texts()
    # One tree: the runner's root span, the agent's step, the openai client's span of the call
    # and the proxy's span of the same call under it, each after its parent.
    assert names[0] == "agentlightning.attempt"
    assert names.index("agent.step") < names.index("chat tiny") < names.index("openai.chat.completion")
    tree = {
        r["SpanName"]: r
        for r in dash.rows(f"SELECT SpanName, SpanId, ParentSpanId, TraceId FROM agl.otel_traces FINAL WHERE {where}")
    }
    assert len({r["TraceId"] for r in tree.values()}) == 1
    assert tree["openai.chat.completion"]["ParentSpanId"] == tree["chat tiny"]["SpanId"]
    assert page.locator('[data-testid="wf-row"] .wf-bar.s-ERROR').count() >= 1  # the broken tool, in red
    exceptions = page.inner_text('[data-testid="exceptions"]')
    # the tool span and its parent, both ERROR, with the exception the agent raised (as text)
    assert "execute_tool calculator" in exceptions and "agent.step" in exceptions
    assert f"ValueError: the task is broken {HOSTILE}" in exceptions
    # The call is listed once (its two spans describe one call), by the proxy's span, with the
    # prompt and the response from its GenAI message attributes.
    calls = page.locator('[data-testid="llm-call"]')
    assert calls.count() == 1
    assert calls.first.get_attribute("data-span") == tree["openai.chat.completion"]["SpanId"]
    text = calls.first.inner_text()
    # Hostile span text is shown as text: no element was made from it.
    assert f"three {HOSTILE}" not in text and f"four {HOSTILE}" in text
    assert page.locator("main img").count() == 0 and page.title() != "pwned"
    assert "17 in / 3 out tokens" in text and "forty-two" in text
    assert "tool call calculator [call-1]" in text and '"expression": "6*7"' in text
    assert "tools offered" in text and "(tool_calls)" in text
    page.locator('[data-testid="wf-row"]', has_text="chat tiny").click()
    assert "gen_ai.usage.input_tokens" in page.inner_text('[data-testid="span-detail"]')
    _shot(page, dash, "rollout-failed")
    # A succeeded one: its reward span and its triplet record's final reward.
    page.goto(f"{dash.page}#/rollout/{dash.ids['t2']}")
    page.wait_for_selector('[data-testid="rewards"] td[data-col="value"]')
    assert _cells(page, "rewards", "value") == ["0.75"]
    final = dash.value(f"SELECT final_reward FROM agl.triplet_records FINAL WHERE rollout_id = '{dash.ids['t2']}'")
    assert _cells(page, "attempts-table", "final_reward") == [str(final)]
    _shot(page, dash, "rollout")


def test_sql_console_runs_a_cookbook_query_and_shows_errors(page: Any, dash: Dash) -> None:
    page.goto(f"{dash.page}#/sql")
    page.wait_for_selector('[data-testid="schema-table"]')
    tables = page.locator('[data-testid="schema-table"] summary').all_inner_texts()
    assert {"rollouts", "attempts", "otel_traces", "span_facts"} <= set(tables)
    page.locator('[data-testid="cookbook"]', has_text="Attempt outcomes").click()
    page.wait_for_selector('[data-testid="sql-table"]')
    [expected] = dash.rows("SELECT attempts, succeeded, failed FROM agl.attempt_error_rate")
    for column in ("attempts", "succeeded", "failed"):
        assert _cells(page, "sql-table", column) == [str(expected[column])]
    # Two numeric columns make a chart.
    page.fill('[data-testid="sql-editor"]', "SELECT number AS x, number * number AS y FROM numbers(5)")
    page.click('[data-testid="sql-run"]')
    page.wait_for_selector('[data-testid="sql-chart"] canvas')
    _shot(page, dash, "sql")
    page.fill('[data-testid="sql-editor"]', "SELECT * FROM system.tables")
    page.click('[data-testid="sql-run"]')
    assert page.inner_text('[data-testid="sql-error"]').startswith("forbidden_table: refused")
    page.fill('[data-testid="sql-editor"]', "SELEC nonsense")
    page.click('[data-testid="sql-run"]')
    page.wait_for_selector('[data-testid="sql-error"]:has-text("query_error")')


CSV_QUERY = (
    "SELECT rollout_id, concat('a,\"b\" ', ifNull(toString(reward), 'none')) AS quoted, reward, start_time "
    f"FROM ({REWARDED}) ORDER BY rollout_id"
)


def test_sql_console_keeps_the_query_in_the_url_and_downloads_the_gateways_csv(page: Any, dash: Dash) -> None:
    # A link with the query runs it.
    page.goto(f"{dash.page}#/sql?{urlencode({'q': CSV_QUERY})}")
    page.wait_for_selector('[data-testid="sql-table"], [data-testid="sql-error"]')
    assert page.locator('[data-testid="sql-error"]').count() == 0, page.inner_text('[data-testid="sql-error"]')
    assert page.input_value('[data-testid="sql-editor"]') == CSV_QUERY
    assert _cells(page, "sql-table", "rollout_id") == [r["rollout_id"] for r in dash.rows(CSV_QUERY)]
    # The CSV download is /v1/sql's CSV of that query, byte for byte.
    with page.expect_download() as got:
        page.click('[data-testid="sql-csv"]')
    download = got.value
    assert download.suggested_filename == "query.csv"
    response = httpx.post(
        f"{dash.url}/v1/sql",
        json={"query": CSV_QUERY, "format": "csv"},
        headers=auth_headers(dash.settings),
        timeout=60,
    )
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/csv")
    assert Path(download.path()).read_bytes() == response.content
    assert response.content.count(b"\n") == len(dash.rows(CSV_QUERY)) + 1  # and a header line
    # Running another query puts it in the URL; going back runs the one before.
    other = "SELECT count() AS n FROM agl.rollouts FINAL"
    page.fill('[data-testid="sql-editor"]', other)
    page.click('[data-testid="sql-run"]')
    page.wait_for_function("q => new URLSearchParams(location.hash.split('?')[1]).get('q') === q", arg=other)
    page.wait_for_selector('[data-testid="sql-table"] td[data-col="n"]')
    page.go_back()
    page.wait_for_selector('[data-testid="sql-table"] td[data-col="quoted"]')
    assert page.input_value('[data-testid="sql-editor"]') == CSV_QUERY


def test_sql_chart_has_one_y_axis_per_unit(page: Any, dash: Dash) -> None:
    def chart(query: str) -> tuple[int, list[str]]:
        page.goto(f"{dash.page}#/sql?{urlencode({'q': query})}")
        page.wait_for_selector('[data-testid="sql-chart"] canvas')
        box = page.locator('[data-testid="sql-chart"]')
        # uPlot makes one element per axis it draws: x and each y axis.
        axes = box.locator(".u-axis").count() - 1
        assert int(box.get_attribute("data-y-axes") or "0") == axes
        return axes, json.loads(box.get_attribute("data-y-scales") or "[]")

    # Units by name: a count and a size in bytes, two axes.
    axes, scales = chart("SELECT number AS x, number * 2 AS n, number * 1000000 AS size_bytes FROM numbers(5)")
    assert axes == 2 and scales == ["y0", "y1"]
    _shot(page, dash, "sql-chart-two-axes")
    # No unit in the names: by order of magnitude (a and c share an axis, b is 10^5 times larger).
    axes, scales = chart("SELECT number AS x, number AS a, number * 100000 AS b, number * 3 AS c FROM numbers(5)")
    assert axes == 2 and scales == ["y0", "y1", "y0"]
    # One unit: one axis.
    axes, scales = chart("SELECT number AS x, number AS a, number * 3 AS b FROM numbers(5)")
    assert axes == 1 and scales == ["y0", "y0"]


def test_resources_and_workers_pages(page: Any, dash: Dash) -> None:
    page.goto(f"{dash.page}#/workers")
    page.wait_for_selector('[data-testid="workers-table"]')
    workers = [r["worker_id"] for r in dash.rows("SELECT worker_id FROM agl.workers FINAL ORDER BY worker_id")]
    assert _cells(page, "workers-table", "worker_id") == workers
    # The module's runner is alive: none gone.
    assert not any(c.startswith("gone") for c in _cells(page, "workers-table", "status"))
    _shot(page, dash, "workers")
    page.goto(f"{dash.page}#/resources")
    page.wait_for_selector("main h2")
    count = dash.value("SELECT count() FROM agl.resources FINAL")
    assert count >= 1 and page.inner_text("main h2") == f"Resources ({count})"
    # The prompt template is shown as its text (hostile markup included, as text).
    page.wait_for_selector('[data-testid="resource"] pre:has-text("Answer {question}")')
    assert HOSTILE in page.inner_text('[data-testid="resource"]') and page.locator("main img").count() == 0
    _shot(page, dash, "resources")


async def _silent_worker(settings: Settings, worker_id: str, last_heard: float) -> None:
    """A worker record as a runner writes one, last heard from at ``last_heard``."""
    producer = make_producer(settings)
    await producer.start()
    try:
        worker = Worker(
            worker_id=worker_id, status="idle", heartbeat_stats={"live_attempts": 0}, last_heartbeat_time=last_heard
        )
        await Outbox(settings, producer, "test").send(settings.topic("workers"), worker, key=worker_id)
    finally:
        await producer.stop()


def test_a_runner_that_stopped_and_a_silent_one_read_as_gone(page: Any, dash: Dash) -> None:
    stopped = f"runner-stops-{uuid4().hex[:6]}"
    silent = f"runner-silent-{uuid4().hex[:6]}"
    runner = start_role(
        dash.settings,
        *("runner", "--agent", "tests.integration.test_dashboard:dashboard_agent", "--worker-id", stopped),
        log_name="runner-stops",
    )
    try:
        _wait_sql(dash, f"SELECT count() FROM agl.workers FINAL WHERE worker_id = '{stopped}'", 1, timeout=180)
        page.goto(f"{dash.page}#/workers")
        page.wait_for_selector(f'[data-testid="workers-table"] td[data-col="worker_id"]:text-is("{stopped}")')
        shown = dict(
            zip(_cells(page, "workers-table", "worker_id"), _cells(page, "workers-table", "status"), strict=True)
        )
        assert not shown[stopped].startswith("gone"), shown  # running: heard from just now
    finally:
        assert stop_role(runner, timeout=60) == 0  # SIGTERM: a clean stop
    # Its last record says it stopped; its recorded status stays what it was (the seed's statuses).
    said = "JSONExtractBool(ifNull(heartbeat_stats, ''), 'stopped')"
    _wait_sql(dash, f"SELECT {said} FROM agl.workers FINAL WHERE worker_id = '{stopped}'", True)
    with ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: asyncio.run(_silent_worker(dash.settings, silent, time.time() - 3600))).result(timeout=120)
    _wait_sql(dash, f"SELECT count() FROM agl.workers FINAL WHERE worker_id = '{silent}'", 1)
    page.wait_for_selector(
        f'[data-testid="workers-table"] td[data-col="worker_id"]:text-is("{silent}")', timeout=30_000
    )
    shown = dict(zip(_cells(page, "workers-table", "worker_id"), _cells(page, "workers-table", "status"), strict=True))
    assert shown[stopped].startswith("gone (stopped ") and shown[stopped].endswith(" ago)"), shown
    assert shown[silent] == "gone (no heartbeat for 60 min)", shown
    # The module's runner, alive, is not.
    alive = [w for w in shown if w not in (stopped, silent)]
    assert alive and not any(shown[w].startswith("gone") for w in alive), shown
    _shot(page, dash, "workers-gone")


async def _dead_letter(settings: Settings, tag: str) -> None:
    """Two bad task requests for the ingress to dead-letter (bytes that are no Avro, a record of
    another type), and one dead letter about agl.spans written as any role writes one."""
    producer = make_producer(settings)
    await producer.start()
    try:
        topic = settings.topic("task-requests")
        await (await producer.send(topic, f"<b>garbage</b> {HOSTILE}".encode(), key=f"g-{tag}".encode()))
        await (await producer.send(topic, Codec.default().encode(Worker(worker_id="w")), key=f"w-{tag}".encode()))
        error = ValueError(f"a span that broke {HOSTILE}")
        await Outbox(settings, producer, "test").reject([Rejected(settings.topic("spans"), 1, 2, None, b"x", error)])
    finally:
        await producer.stop()


def test_dead_letters_page_counts_by_source_and_lists_the_newest(page: Any, dash: Dash) -> None:
    tag = uuid4().hex[:8]
    with ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: asyncio.run(_dead_letter(dash.settings, tag))).result(timeout=120)
    requests = dash.settings.topic("task-requests")
    _wait_sql(dash, f"SELECT count() FROM agl.dead_letters FINAL WHERE key IN ('g-{tag}', 'w-{tag}')", 2, timeout=120)
    _wait_sql(
        dash, f"SELECT count() FROM agl.dead_letters FINAL WHERE source_topic = '{dash.settings.topic('spans')}'", 1
    )
    counts = dash.rows(
        "SELECT source_topic, processor, error_type, count() AS n FROM agl.dead_letters FINAL "
        "GROUP BY source_topic, processor, error_type ORDER BY n DESC, max(time) DESC"
    )
    newest = dash.rows(
        "SELECT concat(toString(kafka_partition), ':', toString(kafka_offset)) AS id, reason FROM agl.dead_letters "
        "FINAL ORDER BY time DESC, kafka_partition DESC, kafka_offset DESC"
    )
    assert {(r["source_topic"], r["error_type"]) for r in counts} >= {
        (requests, "NotSingleObjectEncodedError"),
        (requests, "RecordTypeError"),
        (dash.settings.topic("spans"), "ValueError"),
    }
    page.goto(f"{dash.page}#/dlq")
    page.wait_for_selector('[data-testid="dlq-newest"]')
    assert page.inner_text('[data-testid="dlq-total"]') == str(len(newest))
    assert _cells(page, "dlq-counts", "error_type") == [r["error_type"] for r in counts]
    assert [int(n) for n in _cells(page, "dlq-counts", "n")] == [r["n"] for r in counts]
    assert _cells(page, "dlq-newest", "id") == [r["id"] for r in newest]
    # A hostile reason is shown as text.
    assert f"a span that broke {HOSTILE}" in page.inner_text('[data-testid="dlq-newest"]')
    assert page.locator("main img").count() == 0 and page.title() != "pwned"
    _shot(page, dash, "dead-letters")
    # One source: a link in the counts narrows both tables to it.
    page.locator('[data-testid="dlq-counts"] td[data-col="source_topic"] a', has_text=requests).first.click()
    page.wait_for_selector(f'[data-testid="dlq-source"]:has-text("{requests}")')
    only = [
        r["id"]
        for r in dash.rows(
            "SELECT concat(toString(kafka_partition), ':', toString(kafka_offset)) AS id FROM agl.dead_letters FINAL "
            f"WHERE source_topic = '{requests}' ORDER BY time DESC, kafka_partition DESC, kafka_offset DESC"
        )
    ]
    page.wait_for_function(
        "n => document.querySelector('[data-testid=dlq-total]')?.textContent === String(n)", arg=len(only)
    )
    assert _cells(page, "dlq-newest", "id") == only
    assert set(_cells(page, "dlq-newest", "source_topic")) == {requests}
    # Bad input: a clear message.
    page.goto(f"{dash.page}#/dlq?limit=0")
    page.wait_for_selector("#error:not([hidden])")
    assert page.inner_text("#error").startswith("bad_request: limit:")


async def _train_on(settings: Settings, records: list[TripletRecord], version: int) -> str:
    """A batch of ``records`` and the trainer step that made ``version`` from it, on the topics the
    batcher and the trainer write (the gateway's sinks materialize both)."""
    batch = TripletBatch(batch_id=batch_id_of(records), records=records, created_time=time.time())
    step = TrainerStep(
        batch_id=batch.batch_id,
        model="agl-tiny",
        policy_version=version,
        step_time=time.time(),
        step_seconds=0.5,
        idle_seconds=0.0,
        tokens=sum(len(t.prompt_token_ids) + len(t.response_token_ids) for r in records for t in r.triplets),
        samples=sum(len(r.triplets) for r in records),
        metrics={"loss": 0.25},
    )
    producer = make_producer(settings)
    await producer.start()
    try:
        typed = Outbox(settings, producer, "test")
        await typed.send(settings.topic("triplet-batches"), batch, key=batch.batch_id)
        await typed.send(settings.topic("trainer-metrics"), step, key=batch.batch_id)
    finally:
        await producer.stop()
    return batch.batch_id


def test_a_versions_page_shows_the_batches_rollouts_and_spans_that_trained_it(page: Any, dash: Dash) -> None:
    """Last in the module: it adds a trained version, which the overview would then show."""
    version = 7
    members = [dash.ids["t1"], dash.ids["t2"]]
    calls = dash.rows(
        "SELECT RolloutId AS rollout_id, AttemptId AS attempt_id, SpanId AS span_id, TraceId AS trace_id "
        f"FROM agl.otel_traces FINAL WHERE SpanName = 'openai.chat.completion' AND RolloutId IN {tuple(members)} "
        "ORDER BY RolloutId, AttemptId"
    )
    assert {c["rollout_id"] for c in calls} == set(members), calls
    records = [
        TripletRecord(
            rollout_id=c["rollout_id"],
            attempt_id=c["attempt_id"],
            group_id="g-dash",
            triplets=[Triplet(prompt_token_ids=[1, 2, 3], response_token_ids=[4, 5], span_ids=[c["span_id"]])],
            final_reward=0.5,
            finish_time=time.time(),
        )
        for c in calls
    ]
    with ThreadPoolExecutor(1) as pool:
        batch_id = pool.submit(lambda: asyncio.run(_train_on(dash.settings, records, version))).result(timeout=120)
    _wait_sql(dash, f"SELECT count() FROM agl.batch_samples FINAL WHERE batch_id = '{batch_id}'", len(records))
    _wait_sql(dash, f"SELECT count() FROM agl.trainer_steps FINAL WHERE policy_version = {version}", 1)
    lineage = dash.rows(dsql.trained_by_version("agl").replace("{version:Int64}", str(version)))
    assert [(r["rollout_id"], r["span_id"], r["trace_id"]) for r in lineage] == [
        (c["rollout_id"], c["span_id"], c["trace_id"]) for c in calls
    ]

    page.goto(f"{dash.page}#/version/{version}")
    page.wait_for_selector('[data-testid="version-spans-table"]')
    assert page.inner_text('[data-testid="version"]') == str(version)
    assert page.inner_text('[data-testid="version-rollouts"]') == "2"
    assert page.inner_text('[data-testid="version-spans"]') == "2"
    assert page.inner_text('[data-testid="version-traces"]') == str(len({c["trace_id"] for c in calls}))
    assert _cells(page, "version-batches-table", "batch_id") == [batch_id]
    assert _cells(page, "version-attempts", "rollout_id") == [c["rollout_id"] for c in calls]
    assert _cells(page, "version-spans-table", "span_id") == [r["span_id"] for r in lineage]
    assert _cells(page, "version-spans-table", "trace_id") == [r["trace_id"] for r in lineage]
    assert "FROM agl.batch_samples FINAL" in (page.text_content('[data-testid="version-sql"]') or "")  # folded
    _shot(page, dash, "version")
    # A span links to its attempt's waterfall with the span selected.
    page.locator('[data-testid="version-spans-table"] td[data-col="span_id"] a').first.click()
    page.wait_for_selector('[data-testid="span-detail"] h3')
    assert page.inner_text('[data-testid="rollout-id"]') == lineage[0]["rollout_id"]
    assert lineage[0]["span_id"] in page.inner_text('[data-testid="span-detail"]')
    # The trainer steps on the overview link here.
    page.goto(f"{dash.page}#/overview")
    page.locator('[data-testid="steps-table"] td[data-col="policy_version"] a', has_text=str(version)).click()
    page.wait_for_selector('[data-testid="version-spans-table"]')
    # Bad input and a version nothing trained: a clear message, the form stays.
    page.goto(f"{dash.page}#/version/abc")
    page.wait_for_selector("#error:not([hidden])")
    assert page.inner_text("#error").startswith("bad_request: version:")
    assert page.input_value('form[data-testid="version-form"] input[name="version"]') == "abc"
    page.goto(f"{dash.page}#/version/99")
    page.wait_for_selector('#error:has-text("not_found")')
    assert "no trainer step made policy version 99" in page.inner_text("#error")
