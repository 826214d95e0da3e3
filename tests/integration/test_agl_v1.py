"""Agent Lightning 1.0's protocol on the LLM proxy (``llm-proxy --agl-v1-model``), tried with
1.0.2 itself.

1.0.2's rollout manager (the trainer's side) and its LocalReconciler (the controller) run
unmodified in their own Python 3.12 venv (``tests/seed_venv.py``) against a real stack: the
manager registers the scripted model's endpoint, enqueues three tasks and waits; the controller
starts 1.0's agent (``tests/agl_v1_scripts/agent.py``: the openai client through the proxy URL it
is given, and a reward event) in one process per rollout and reports each state. What 1.0 reads
back (states, exact token ids, rewards, the terminal cursor) is checked, and so is what
agl-stream gains: the rollouts, the spans under attempt "0" and the triplet records its own
pipeline made. A second test asks the routes what 1.0's server answers to edge cases.

Everything is a real process: broker, rollout processor, gateway (chDB), triplet builder, the LLM
proxy, 1.0's controller and agents; only the model is scripted (token ids as vLLM returns them).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import uuid4

import httpx
import pytest

from agl_stream import connect
from agl_stream.config import Settings
from agl_stream.kafka.offsets import fence_at_end
from agl_stream.local import stack
from agl_stream.ports import free_ports
from tests.integration.helpers import serve, stop_role
from tests.integration.test_triplet_builder import _records_covering
from tests.scripted_openai import scripted_openai
from tests.seed_venv import ensure_agl_v1_venv

pytestmark = pytest.mark.integration

SCRIPTS = Path(__file__).resolve().parent.parent / "agl_v1_scripts"
KEY = "v1-test-key"
MODEL = "org/scripted-v1"
ANSWERS = {"what is 2+2?": "4", "capital of France?": "Paris", "doomed": "-"}
TASKS: list[dict[str, Any]] = [
    {"question": "what is 2+2?", "expected": "4", "fail": False},
    {"question": "capital of France?", "expected": "Lyon", "fail": False},  # answered, but wrong: reward 0
    {"question": "doomed", "expected": "-", "fail": True},  # the agent raises: the rollout fails
]


@dataclass
class Script:
    """The model: a fixed answer per question, token ids derived from the text, recorded per question."""

    calls: dict[str, list[tuple[list[int], list[int]]]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reply(self, body: dict[str, Any]) -> str:
        return ANSWERS[body["messages"][-1]["content"]]

    def token_ids(self, body: dict[str, Any], message: dict[str, Any]) -> tuple[list[int], list[int]]:
        question = body["messages"][-1]["content"]
        ids = ([7 + ord(c) % 50 for c in question], [*(7 + ord(c) % 50 for c in message["content"]), 2])
        with self.lock:
            self.calls.setdefault(question, []).append(ids)
        return ids


@dataclass
class Served:
    settings: Settings
    url: str
    backend: str
    script: Script
    requests: list[dict[str, Any]]


@pytest.fixture(scope="module")
def served(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    settings = Settings(
        kafka_bootstrap=kafka_bootstrap,
        data_dir=tmp_path_factory.mktemp("agl-v1"),
        topic_prefix=f"v{uuid4().hex[:10]}",
        gateway_port=0,
    )
    stack.up(settings, training=True)
    running = stack.local_stack_settings(settings)
    [port] = free_ports(1)
    script = Script()
    exits = ExitStack()
    proxy = None
    try:
        model = exits.enter_context(scripted_openai(script.reply, script.token_ids))
        proxy = serve(
            running,
            "llm-proxy",
            "--port",
            str(port),
            "--agl-v1-model",
            MODEL,
            "--agl-v1-key",
            KEY,
            name="proxy",
            url=f"http://127.0.0.1:{port}/healthz",
        )
        yield Served(running, f"http://127.0.0.1:{port}", model.base_url, script, model.requests)
    finally:
        if proxy is not None:
            stop_role(proxy, timeout=30)
        exits.close()
        stack.down(settings)


async def test_agent_lightning_1_0_runs_unmodified_and_its_rollouts_become_training_data(served: Served) -> None:
    python = ensure_agl_v1_venv()
    env = {**os.environ, "PYTHONPATH": str(SCRIPTS), "PYTHONUNBUFFERED": "1"}
    env.pop("VIRTUAL_ENV", None)
    run = await asyncio.to_thread(
        subprocess.run,
        [str(python), str(SCRIPTS / "driver.py"), served.url, KEY, MODEL, served.backend, json.dumps(TASKS)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    completed = {c["input"]["question"]: c for c in result["completed"]}
    assert sorted(completed) == sorted(t["question"] for t in TASKS)

    # What 1.0's trainer reads back: states, exact token ids, the reward on the last triplet.
    for task in TASKS:
        rollout = completed[task["question"]]
        if task["fail"]:
            assert rollout["rollout_state"] == "failed" and rollout["triplets"] == []
            assert "exited with code 1" in rollout["error_message"]
            continue
        assert rollout["rollout_state"] == "succeeded", rollout
        [(prompt_ids, response_ids)] = served.script.calls[task["question"]]
        [triplet] = rollout["triplets"]
        assert triplet["prompt"]["token_ids"] == prompt_ids
        assert triplet["response"]["token_ids"] == response_ids
        reward = 1.0 if ANSWERS[task["question"]] == task["expected"] else 0.0
        assert rollout["final_reward"] == reward and triplet["reward"] == reward
        assert [e["event_type"] for e in rollout["events"]] == ["model_request", "reward"]
        request = rollout["events"][0]["data"]["request"]
        assert request["model"] == MODEL and request["messages"] == [{"role": "user", "content": task["question"]}]
    # The proxy rewrote the body as 1.0's does: its model name and the train temperature.
    assert {(r["model"], r["temperature"]) for r in served.requests} == {(MODEL, 1.0)}
    ids = {c["rollout_id"] for c in result["completed"]}
    assert ids <= {item["rollout_id"] for item in result["terminal"]["items"]}

    # What agl-stream keeps: the rollouts, their spans under attempt "0", its own triplet records.
    async with connect(**served.settings.model_dump(exclude_none=True)) as store:
        assert store.side is not None
        await store.side.query("SELECT 1", fence=await fence_at_end(served.settings, "spans"))
        await store.side.query("SELECT 1", fence=await fence_at_end(served.settings, "rollout-state"))
        good = [completed[t["question"]] for t in TASKS if not t["fail"]]
        records = {
            r.rollout_id: r for r in await _records_covering(served.settings, {c["rollout_id"] for c in good}, 300)
        }
        for task in TASKS:
            rollout = completed[task["question"]]
            stored = await store.get_rollout_by_id(rollout["rollout_id"])
            assert stored is not None and stored.mode == "train"
            assert stored.status == ("failed" if task["fail"] else "succeeded")
            if task["fail"]:
                continue
            spans = await store.query_spans(rollout["rollout_id"], "0")
            assert {s.attempt_id for s in spans} == {"0"} and len(spans) == 2
            [record] = [records[rollout["rollout_id"]]]
            [triplet] = record.triplets
            assert triplet.prompt_token_ids == rollout["triplets"][0]["prompt"]["token_ids"]
            assert triplet.response_token_ids == rollout["triplets"][0]["response"]["token_ids"]
            assert record.final_reward == rollout["final_reward"]


def test_the_routes_answer_as_agent_lightning_1_0s_server(served: Served) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=served.url, timeout=120) as http:
        # Auth: /healthz is open; everything else needs the key (Bearer or x-api-key).
        assert http.get("/healthz").json() == {"status": "ok"}
        refused = http.get("/api/rollouts", params={"state_in": "queuing"})
        assert refused.status_code == 401 and refused.json()["detail"] == "Invalid or missing API key"
        assert http.get("/api/rollouts", params={"state_in": "queuing"}, headers={"x-api-key": KEY}).status_code == 200
        assert http.get("/proxy/state", headers={"Authorization": "Bearer wrong"}).status_code == 401

        # Create: the caller's ids; a retried create (even with another input) answers the rollout as it is.
        rid = uuid4().hex
        made = http.post(
            "/api/rollouts", json=[{"rollout_id": rid, "input": {"q": 1}, "is_train": False}], headers=auth
        )
        assert made.status_code == 201
        [rollout] = made.json()
        assert rollout["status"]["state"] == "queuing" and rollout["is_train"] is False
        assert rollout["config"] == {"timeout_seconds": 3600, "local": None, "k8s": None}
        assert rollout["metadata"] == {"batch_idx": None, "sample_idx_in_batch": None}
        again = http.post("/api/rollouts", json=[{"rollout_id": rid, "input": {"q": 2}}], headers=auth).json()
        assert again == [rollout]
        [generated] = http.post("/api/rollouts", json=[{"input": "x"}], headers=auth).json()
        assert len(generated["rollout_id"]) == 32
        bad = http.post("/api/rollouts", json=[{"rollout_id": "../x", "input": 1}], headers=auth)
        assert bad.status_code == 422 and isinstance(bad.json()["detail"], list)
        json_type = {**auth, "content-type": "application/json"}
        assert http.post("/api/rollouts", content=b"{", headers=json_type).status_code == 400

        # Reads: one rollout (404 unknown), listings by state (state_in required).
        got = http.get(f"/api/rollouts/{rid}", headers=auth).json()
        assert got == {"rollout": rollout, "attempts": []}
        missing = http.get("/api/rollouts/nope", headers=auth)
        assert missing.status_code == 404 and missing.json() == {"detail": "Rollout not found: nope"}
        assert http.get("/api/rollouts", headers=auth).status_code == 422
        queued = http.get("/api/rollouts", params={"state_in": ["queuing", "running"]}, headers=auth).json()
        assert rid in {r["rollout_id"] for r in queued}

        # PATCH: 1.0's transitions, 409 outside them (the same state too), 422 for unknown keys.
        patch = {"status": {"state": "running", "last_attempt_id": "0"}}
        running = http.patch(f"/api/rollouts/{rid}", json=patch, headers=auth).json()
        assert running["status"]["state"] == "running" and running["status"]["version"] == 2
        assert running["status"]["last_attempt_id"] == "0"
        conflict = http.patch(f"/api/rollouts/{rid}", json=patch, headers=auth)
        assert conflict.status_code == 409
        assert conflict.json() == {"detail": f"Rollout {rid}: cannot transition running -> running"}
        assert http.patch(f"/api/rollouts/{rid}", json={"status": {"colour": "red"}}, headers=auth).status_code == 422
        unchanged = http.patch(f"/api/rollouts/{rid}", json={}, headers=auth).json()
        assert unchanged == running

        # Events: 200 with the event; the triplet view keeps the value, the source and the reason.
        url = f"/api/rollouts/{rid}/attempt/0/events"
        posted = http.post(url, json={"event_type": "reward", "data": {"value": 0.5, "message": "m"}}, headers=auth)
        assert posted.status_code == 200 and posted.json()["data"] == {"value": 0.5, "message": "m"}
        http.post(url, json={"event_type": "note", "data": {"text": "hi"}}, headers=auth).raise_for_status()
        events = http.get(f"/api/rollouts/{rid}/events", headers=auth).json()
        assert [(e["event_type"], e["data"]) for e in events] == [
            ("reward", {"value": 0.5, "message": "m"}),
            ("note", {"text": "hi"}),
        ]
        trimmed = http.get(f"/api/rollouts/{rid}/events", params={"format": "triplet"}, headers=auth).json()
        assert trimmed[0]["data"] == {"value": 0.5}
        only = http.get(f"/api/rollouts/{rid}/events", params={"event_type": "note"}, headers=auth).json()
        assert [e["event_type"] for e in only] == ["note"]
        assert (
            http.post(f"/api/rollouts/{rid}/attempt/9/events", json={"event_type": "x"}, headers=auth).status_code
            == 404
        )
        huge = {"event_type": "note", "data": {"blob": "x" * (5 << 20)}}  # over a record's size, under a body's
        too_large = http.post(url, json=huge, headers=auth)
        assert too_large.status_code == 413 and "too large" in too_large.json()["detail"]

        finished = http.patch(
            f"/api/rollouts/{rid}", json={"status": {"state": "failed", "error_message": "boom"}}, headers=auth
        ).json()
        assert finished["status"]["state"] == "failed" and finished["status"]["error_message"] == "boom"
        page = http.get("/api/rollouts/terminal", params={"after": 0, "limit": 1000}, headers=auth).json()
        assert {"rollout_id": rid, "state": "failed", "data_id": "", "is_train": False} in page["items"]
        assert page["next_after"] == len(page["items"]) == page["total_terminal"]
        caught_up = http.get("/api/rollouts/terminal", params={"after": page["next_after"]}, headers=auth).json()
        assert caught_up == {"items": [], "next_after": page["next_after"], "total_terminal": page["total_terminal"]}
        assert http.delete(f"/api/rollouts/{rid}", headers=auth).status_code == 204

        # The proxy path: 1.0's checks in 1.0's order, the pause gate, no model -> 503.
        [live] = http.post("/api/rollouts", json=[{"input": {"q": "p"}}], headers=auth).json()
        base = f"/proxy/rollout/{live['rollout_id']}/attempt/0/mode"
        chat = {"model": "m", "messages": [{"role": "user", "content": "what is 2+2?"}]}
        assert http.post(f"{base}/test/openai/v1/chat/completions", json=chat, headers=auth).status_code == 404
        assert http.post(f"{base}/train/openai/v1/embeddings", json=chat, headers=auth).status_code == 404
        unknown = http.post(
            "/proxy/rollout/nope/attempt/0/mode/train/openai/v1/chat/completions", json=chat, headers=auth
        )
        assert unknown.status_code == 404
        not_json = http.post(f"{base}/train/openai/v1/chat/completions", content=b"[", headers=json_type)
        assert not_json.json() == {"detail": "Invalid JSON in request body"}
        array = http.post(f"{base}/train/openai/v1/chat/completions", json=[1], headers=auth)
        assert array.status_code == 400 and array.json() == {"detail": "Request body must be a JSON object"}
        assert http.delete("/api/models", headers=auth).json() == {"status": "ok"}
        none = http.post(f"{base}/val/openai/v1/chat/completions", json=chat, headers=auth)
        assert none.status_code == 503 and none.json() == {"detail": f"No servers available for model '{MODEL}'"}
        models = [{"model": MODEL, "endpoint": served.backend}]
        registered = http.post("/api/models", json=models, headers=auth)
        assert registered.status_code == 201 and registered.json() == [{**models[0], "version": 0}]
        state = http.post("/proxy/pause", json={"reason": "weights"}, headers=auth).json()
        assert state == {"paused": True, "retry_after_seconds": 5, "reason": "weights", "inflight": 0}
        held = http.post(f"{base}/val/openai/v1/chat/completions", json=chat, headers=auth)
        assert held.status_code == 429 and held.headers["retry-after"] == "5" and held.headers["x-agl-paused"] == "true"
        assert http.post("/proxy/resume", headers=auth).json()["paused"] is False
        answered = http.post(f"{base}/val/openai/v1/chat/completions", json=chat, headers=auth)
        assert answered.status_code == 200 and answered.json()["choices"][0]["message"]["content"] == "4"
        assert served.requests[-1]["temperature"] == 0.7  # val mode's
        assert http.get("/proxy/state", headers=auth).json()["inflight"] == 0
