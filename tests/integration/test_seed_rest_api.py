"""The seed's REST API on the gateway (``/v1/agl``), driven by the seed's own code.

The seed (Agent Lightning 0.3.0) runs in its own interpreter (tests/seed_venv.py): its
``LightningStoreClient`` through a whole lifecycle (tests/seed_scripts/rest_lifecycle.py), and an
unmodified ``LitAgentRunner`` working the queue (tests/seed_scripts/rest_runner.py). What they
did is then read back through agl-stream's own store client. Everything is real: the session's
broker, the shared stack's processor and gateway (with its embedded ClickHouse).

The gateway wrote what the seed's processes sent, so this process's read fence does not cover
it: rollout states are waited for with ``wait_for_rollouts`` (the processor's answer), spans are
read until they are there, within a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from agl_stream import AglStore, connect
from agl_stream.agent.emitters import find_final_reward
from agl_stream.config import Settings
from agl_stream.local import stack
from agl_stream.models import LLM, Span
from tests.seed_venv import SEED_CHILD_ENV

pytestmark = pytest.mark.integration

T = TypeVar("T")
SCRIPTS = Path(__file__).resolve().parents[1] / "seed_scripts"
UNKNOWN_ROLLOUT = "ro-000000000bad"


@pytest.fixture
def gateway_url(stack_settings: Settings) -> str:
    recorded = stack.read_stack(stack_settings)
    assert recorded is not None and recorded.gateway_url, "the stack records its gateway"
    return recorded.gateway_url


@pytest.fixture
async def store(stack_settings: Settings) -> AsyncIterator[AglStore]:
    async with connect(**stack_settings.model_dump(exclude_none=True)) as client:
        yield client


def seed_env() -> dict[str, str]:
    """The seed's child environment: nothing of this interpreter's module path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, **SEED_CHILD_ENV}


async def run_seed_script(python: Path, script: str, *args: str, timeout: float, log: Path) -> dict[str, Any]:
    """Run a seed script to its end; the JSON object on its last stdout line."""
    with log.open("wb") as stderr:
        process = await asyncio.create_subprocess_exec(
            str(python),
            str(SCRIPTS / script),
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
            env=seed_env(),
            cwd=log.parent,  # what the seed writes beside it (its agentops.log) stays in the test's folder
        )
        try:
            stdout, _ = await asyncio.wait_for(process.communicate(), timeout)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    tail = _tail(log)
    assert process.returncode == 0, f"{script} exited with {process.returncode}; its stderr ends with:\n{tail}"
    lines = stdout.decode().strip().splitlines()
    assert lines, f"{script} printed nothing; its stderr ends with:\n{tail}"
    result: dict[str, Any] = json.loads(lines[-1])
    return result


async def wait_until(
    probe: Callable[[], Awaitable[T]], done: Callable[[T], bool], *, what: str, timeout: float = 60.0
) -> T:
    """Read until ``done`` holds (for what another process wrote: no fence of ours covers it)."""
    deadline = time.monotonic() + timeout
    while True:
        value = await probe()
        if done(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout}s; last seen: {value!r}")
        await asyncio.sleep(0.05)


async def test_the_seed_client_drives_a_whole_lifecycle(
    seed_python: Path, gateway_url: str, store: AglStore, tmp_path: Path
) -> None:
    out = await run_seed_script(
        seed_python, "rest_lifecycle.py", gateway_url, timeout=240, log=tmp_path / "lifecycle.log"
    )
    assert out["health"] == [200, {"status": "ok"}]

    resources = out["resources"]
    assert resources["versions"] == [1, 2] and resources["latest"] == [resources["id"], 2]
    assert resources["by_id_model"] == "m-2" and resources["by_id_api_key"] == "sk-seed"  # a runner needs the key
    assert resources["listed"] == [[resources["id"], 2]] and resources["listed_total"] == 1
    assert resources["missing"] is None

    first = out["first_attempt"]
    assert first["claimed"] == ["preparing", 1, "preparing", out["ids"]["worker"]]
    assert first["resources_id"] == resources["id"]
    assert first["rollout_status_after_spans"] == "running"
    # One span through add_span, one through add_otel_span, one through the OTLP exporter.
    assert [name for name, _, _ in first["spans"]] == ["seed.rest", "seed.otel", "seed.otlp"]
    assert [via for _, _, via in first["spans"]] == [None, "add_otel_span", "otlp"]
    sequence_ids = [sequence_id for _, sequence_id, _ in first["spans"]]
    assert sequence_ids == sorted(set(sequence_ids)) and first["span_total"] == 3
    assert first["by_name"] == ["seed.otlp"]
    assert first["page"] == [["seed.otel"], 1, 1, 3]
    assert out["failed"] == ["failed", "requeuing"]  # max_attempts=2, retried on failure

    second = out["second_attempt"]
    assert second["sequence_id"] == 2 and second["updated"] == ["succeeded", {"score": 1}]
    assert second["attempts"] == [[1, "failed"], [2, "succeeded"]] and second["latest"] == 2

    more = out["more"]
    assert more["many"] == [["queuing", None, resources["id"]], ["queuing", "val", resources["id"]]]
    assert more["edited"] == {"edited": True} and more["cancelled"] == "cancelled"
    assert more["manual"][:2] == [1, f"seed-{out['tag']}-w2"]
    assert more["direct"] == ["preparing", "preparing", f"seed-{out['tag']}-w3", resources["id"]]

    queries = out["queries"]
    assert queries["finished"] and queries["finished_statuses"] == ["cancelled", "succeeded", "succeeded"]
    assert queries["first_page"] == [queries["first_page_expected"], 4]
    assert queries["done"] and queries["done_have_attempts"]
    worker = out["ids"]["worker"]
    assert queries["worker"] == [worker, {"cpu": 0.5}, {"cpu": 0.5}]
    assert queries["workers"] == sorted([worker, f"seed-{out['tag']}-w2", f"seed-{out['tag']}-w3"])
    statistics = queries["statistics"]
    assert statistics["name"] == "AglStore" and statistics["total_rollouts"] >= 4 and statistics["total_spans"] >= 3
    assert statistics["uptime"] > 0

    # Unknown ids: reads of one item are None, changes are refused with 404 (once: no retries;
    # update_resources creates the id, as the seed does),
    # an illegal transition with 400.
    assert out["unknown"] == {
        "get_rollout": None,
        "latest_attempt": None,
        "worker": None,
        "update_attempt": 404,
        "update_resources": None,  # created, as the seed does
        "next_sequence_id": 404,
        "illegal": 400,
    }

    # What the seed's client did is agl-stream's state: read it back through our own client.
    rid = out["ids"]["rollout"]
    [finished] = await store.wait_for_rollouts(rollout_ids=[rid], timeout=30)
    assert finished.status == "succeeded" and finished.metadata == {"origin": "seed-client"}
    spans = await wait_until(lambda: store.query_spans(rid), lambda found: len(found) >= 3, what=f"the spans of {rid}")
    assert [s.name for s in spans] == ["seed.rest", "seed.otel", "seed.otlp"]
    assert spans[0].attributes == {"step": 1, "tags": ["a", "b"]}


async def test_an_unmodified_seed_runner_completes_rollouts(
    seed_python: Path, gateway_url: str, store: AglStore, tmp_path: Path
) -> None:
    await store.add_resources({"llm": LLM(endpoint="http://127.0.0.1:9/v1", model="runner-model")})
    log = tmp_path / "runner.log"
    with log.open("wb") as stderr:
        runner = await asyncio.create_subprocess_exec(
            str(seed_python),
            str(SCRIPTS / "rest_runner.py"),
            gateway_url,
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
            env=seed_env(),
        )
    try:
        assert runner.stdout is not None
        ready = await asyncio.wait_for(runner.stdout.readline(), 120)
        assert ready.strip() == b"ready", _tail(log)
        rollouts = [await store.enqueue_rollout({"n": n}, mode="train") for n in (1, 2, 3)]
        ids = [r.rollout_id for r in rollouts]
        finished = await store.wait_for_rollouts(rollout_ids=ids, timeout=180)
        assert {r.rollout_id: r.status for r in finished} == dict.fromkeys(ids, "succeeded"), _tail(log)
        for n, rid in zip((1, 2, 3), ids, strict=True):
            spans = await wait_until(
                functools.partial(store.query_spans, rid),
                lambda found: find_final_reward(found) is not None and bool(_named(found, "agentlightning.message")),
                what=f"the reward and message spans of {rid}",
            )
            assert find_final_reward(spans) == pytest.approx(n / 10)
            [message] = _named(spans, "agentlightning.message")  # through the tracer's OTLP exporter
            assert "scoring" in str(message.attributes)
            attempt = await store.get_latest_attempt(rid)
            assert attempt is not None and attempt.status == "succeeded" and attempt.worker_id == "Worker-0"
        worker = await wait_until(
            lambda: store.get_worker_by_id("Worker-0"),
            lambda found: found is not None and bool(found.heartbeat_stats),
            what="the runner's heartbeat",
        )
        assert worker is not None and worker.last_heartbeat_time is not None
    finally:
        await _stop(runner)
    assert runner.returncode == 0, _tail(log)


async def test_the_seeds_own_trainer_dev_runs_its_baseline_with_initial_resources(
    seed_python: Path, gateway_url: str, store: AglStore, tmp_path: Path
) -> None:
    tag = f"dev-{uuid.uuid4().hex[:8]}"
    out = await run_seed_script(
        seed_python, "trainer_dev.py", gateway_url, tag, timeout=300, log=tmp_path / "trainer_dev.log"
    )
    # The runner thread got the initial resources with each task (Baseline published them).
    assert out["seen"] == {str(n): f"{tag}: say {n}" for n in (1, 2, 3)}

    # What it did is agl-stream's state: the resources it created under "default", its rollouts
    # with their modes and those resources, finished, with the agent's reward as a span.
    resources = await store.get_resources_by_id("default")
    assert resources is not None and resources.resources["prompt"].template == f"{tag}: say {{n}}"  # type: ignore[union-attr]

    async def mine() -> list[Any]:
        return [r for r in await store.query_rollouts() if isinstance(r.input, dict) and r.input.get("tag") == tag]

    rollouts = await wait_until(
        mine, lambda found: len(found) == 3 and all(r.status == "succeeded" for r in found), what="its 3 rollouts"
    )
    by_n = {r.input["n"]: r for r in rollouts}
    assert {n: (r.mode, r.resources_id) for n, r in by_n.items()} == {
        1: ("train", resources.resources_id),
        2: ("train", resources.resources_id),
        3: ("val", resources.resources_id),
    }
    for n, rollout in by_n.items():
        spans = await wait_until(
            functools.partial(store.query_spans, rollout.rollout_id),
            lambda found: find_final_reward(found) is not None,
            what=f"the reward span of {rollout.rollout_id}",
        )
        assert find_final_reward(spans) == pytest.approx(n / 10)


def _tail(log: Path) -> str:
    """The end of a seed process's stderr, for a failure message."""
    return log.read_text(errors="replace")[-4000:]


def _named(spans: list[Span], name: str) -> list[Span]:
    return [s for s in spans if s.name == name]


async def _stop(process: asyncio.subprocess.Process) -> None:
    """SIGTERM (the runner finishes its rollout and exits), SIGKILL if it does not within 30 s."""
    if process.returncode is not None:
        return
    process.terminate()
    try:
        await asyncio.wait_for(process.wait(), 30)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()


async def test_bad_requests_get_the_seeds_status_codes_with_a_json_error(gateway_url: str) -> None:
    async with httpx.AsyncClient(base_url=f"{gateway_url}/v1/agl", timeout=30) as http:

        async def refused(method: str, path: str, status: int, kind: str, **options: Any) -> dict[str, Any]:
            response = await http.request(method, path, **options)
            assert response.status_code == status, response.text
            assert response.headers["content-type"].startswith("application/json")
            body: dict[str, Any] = response.json()
            assert body["error"] == kind and body["message"] and body["detail"], body
            return body

        update = {"json": {"status": "failed"}}
        not_found = await refused("POST", f"/rollouts/{UNKNOWN_ROLLOUT}", 404, "not_found", **update)
        assert UNKNOWN_ROLLOUT in not_found["message"]
        await refused("POST", f"/rollouts/{UNKNOWN_ROLLOUT}/attempts/latest", 404, "not_found", **update)
        await refused("POST", f"/rollouts/{UNKNOWN_ROLLOUT}/attempts", 404, "not_found")
        body = {"rollout_id": UNKNOWN_ROLLOUT, "attempt_id": "at-00000bad"}
        await refused("POST", "/spans/next", 404, "not_found", json=body)
        enqueue = {"rollouts": [{"input": 1, "resources_id": "rs-000000000bad"}]}
        await refused("POST", "/queues/rollouts/enqueue", 404, "not_found", json=enqueue)

        invalid = await refused(
            "POST", "/queues/rollouts/enqueue", 422, "invalid_request", json={"rollouts": [{"mode": "bogus"}]}
        )
        assert {tuple(d["loc"]) for d in invalid["detail"]} == {
            ("body", "rollouts", 0, "input"),
            ("body", "rollouts", 0, "mode"),
        }
        not_json = {"content": b'{"rollouts": [', "headers": {"content-type": "application/json"}}
        await refused("POST", "/queues/rollouts/enqueue", 422, "malformed_json", **not_json)
        await refused("POST", "/waits/rollouts", 422, "invalid_request", json={"rollout_ids": "ro-1"})
        await refused("GET", "/rollouts", 400, "bad_request", params={"limit": "0"})
        await refused("POST", f"/rollouts/{UNKNOWN_ROLLOUT}", 400, "bad_request", json={"status": None})

        # Reads of one unknown item answer null, as the seed's client expects.
        assert (await http.get(f"/rollouts/{UNKNOWN_ROLLOUT}")).json() is None
        assert (await http.get("/resources/rs-000000000bad")).json() is None
        unknown_route = await http.get("/no-such-route")
        assert unknown_route.status_code == 404 and unknown_route.json() == {"detail": "Not Found"}
