"""Agents that know nothing of agl-stream, run unchanged and turned into training data.

Commands in three languages: a shell script calling the model with curl, a Node.js program with
the official ``openai`` npm package, and a Python script with the ``openai`` client
(``tests/agents/``). Each runs under ``agl-stream runner --command``, one process per attempt,
and talks to the CPU model through the LLM proxy at the ``OPENAI_BASE_URL`` it is given: the
triplets hold exactly the tokens the model received and produced, with the reward the program
reported. A command that fails fails its attempt.

OTLP: a program that exports a span of its own over OTLP under `$TRACEPARENT` (the runner gives
it the gateway's receiver in the standard `OTEL_*` variables) joins the attempt's tree.

Frameworks: the calculator example written with LangGraph and with the OpenAI Agents SDK
(``examples/calculator/calc_agent.py``), traced through OpenTelemetry's GenAI instrumentations.
A scripted model plays the calculator behind the same proxy (the tiny policy cannot call tools):
one tree per attempt (the framework's agent and tool spans, one chat span per model call, the
proxy's span under it), two exact triplets per rollout.

Everything is a real process: broker, rollout processor, gateway (chDB), triplet builder, CPU
inference server, LLM proxy, runners. One stack serves the module.
"""

from __future__ import annotations

import json
import shlex
import sys
import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest

from agl_stream import AglStore, connect
from agl_stream.agent.emitters import find_final_reward
from agl_stream.config import Settings
from agl_stream.kafka.offsets import fence_at_end
from agl_stream.local import stack
from agl_stream.models import ProxyLLM, Rollout, Span
from agl_stream.policy import build_tokenizer
from agl_stream.ports import free_ports
from agl_stream.wire.semconv import AGL_ATTEMPT
from examples.calculator import calc_agent as calculator
from tests.integration.helpers import serve, start_role, stop_role
from tests.integration.test_triplet_builder import _records_covering
from tests.scripted_openai import scripted_openai, tool_call

pytestmark = pytest.mark.integration

AGENTS = Path(__file__).resolve().parent.parent / "agents"
NODE_AGENT = AGENTS / "node" / "agent.js"
COMMANDS = {
    "shell": f"sh {shlex.quote(str(AGENTS / 'agent.sh'))}",
    "node": f"node {shlex.quote(str(NODE_AGENT))}",
    "python": f"{shlex.quote(sys.executable)} {shlex.quote(str(AGENTS / 'agent.py'))}",
}
QUESTIONS = ["what is 2+2?", "say hi", "count to 3"]
FORWARDS_TRACEPARENT = {"shell", "node"}  # the Python script sends the openai client's headers only


TASKS = calculator.load_tasks(calculator.TRAIN_FILE)[:3]


@dataclass
class CalculatorScript:
    """The scripted model: for a task's question, a calculator call with its expression; once the
    tool answered, that value as the answer. Its token ids (ids of the prompt's and the answer's
    characters) are recorded per question, in call order, for the triplets to be compared with."""

    calls: dict[str, list[tuple[list[int], list[int]]]] = field(default_factory=lambda: defaultdict(list))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reply(self, body: dict[str, Any]) -> str | dict[str, Any]:
        messages = body["messages"]
        question = next(m["content"] for m in messages if m["role"] == "user")
        [task] = [t for t in TASKS if t["question"] == question]
        answered = [m for m in messages if m["role"] == "tool"]
        if not answered:
            arguments = json.dumps({"expression": task["expression"]})
            return {"content": None, "tool_calls": [tool_call("call-1", "calculator", arguments)]}
        return f"ANSWER: {answered[-1]['content']}"

    def token_ids(self, body: dict[str, Any], message: dict[str, Any]) -> tuple[list[int], list[int]]:
        prompt = json.dumps(body["messages"])[-200:]
        answer = str(message.get("content") or json.dumps(message.get("tool_calls")))
        ids = ([4 + ord(c) % 60 for c in prompt], [*(4 + ord(c) % 60 for c in answer[:80]), 1])
        question = next(m["content"] for m in body["messages"] if m["role"] == "user")
        with self.lock:
            self.calls[question].append(ids)
        return ids


@dataclass
class Served:
    settings: Settings
    proxy_port: int
    script: CalculatorScript


@pytest.fixture(scope="module")
def served(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The local stack with the training roles, the CPU model, the scripted model and the LLM
    proxy in front of both (models ``agl-tiny`` and ``scripted``)."""
    settings = Settings(
        kafka_bootstrap=kafka_bootstrap,
        data_dir=tmp_path_factory.mktemp("agents"),
        topic_prefix=f"c{uuid4().hex[:10]}",
        gateway_port=0,
    )
    stack.up(settings, training=True)
    model_port, proxy_port = free_ports(2)
    running = stack.local_stack_settings(settings)
    started = []
    script = CalculatorScript()
    stack_exit = ExitStack()
    try:
        scripted = stack_exit.enter_context(scripted_openai(script.reply, script.token_ids))
        started.append(
            serve(
                running,
                "inference",
                "--port",
                str(model_port),
                "--model-name",
                "agl-tiny",
                "--no-follow",
                name="inference",
                url=f"http://127.0.0.1:{model_port}/health",
            )
        )
        started.append(
            serve(
                running,
                "llm-proxy",
                "--port",
                str(proxy_port),
                "--backend",
                f"agl-tiny=http://127.0.0.1:{model_port}/v1",
                "--backend",
                f"scripted={scripted.base_url}",
                name="proxy",
                url=f"http://127.0.0.1:{proxy_port}/health",
            )
        )
        yield Served(running, proxy_port, script)
    finally:
        for process in reversed(started):
            stop_role(process, timeout=30)
        stack_exit.close()
        stack.down(settings)


async def _run(
    store: AglStore, settings: Settings, name: str, runner_args: list[str], requests: list[dict[str, Any]]
) -> tuple[list[Rollout], list[Rollout]]:
    """Enqueue ``requests``, run them under one runner process (``agl-stream runner <args>``) until
    they finish, stop it; (the rollouts made, the rollouts as they finished)."""
    runner = start_role(settings, "runner", *runner_args, log_name=f"runner-{name}")
    try:
        made = await store.enqueue_many_rollouts(requests)
        finished = await store.wait_for_rollouts(rollout_ids=[r.rollout_id for r in made], timeout=300)
    finally:
        assert stop_role(runner, timeout=60) == 0, name
    return made, finished


async def test_commands_in_any_language_become_exact_triplets_with_their_rewards(served: Served) -> None:
    settings, proxy_port = served.settings, served.proxy_port
    assert (NODE_AGENT.parent / "node_modules" / "openai").is_dir(), "run `make test` (it installs tests/agents/node)"
    tokenizer = build_tokenizer()
    async with connect(**settings.model_dump(exclude_none=True)) as store:
        await store.add_resources({"policy": ProxyLLM(endpoint=f"http://127.0.0.1:{proxy_port}/v1", model="agl-tiny")})
        for kind, command in COMMANDS.items():
            made, finished = await _run(
                store,
                settings,
                kind,
                ["--command", command, "--concurrency", "3"],
                [{"input": {"question": q}, "mode": "train"} for q in QUESTIONS],
            )
            assert [r.status for r in finished] == ["succeeded"] * len(made), (kind, settings.data_dir)
            records = {r.rollout_id: r for r in await _records_covering(settings, {r.rollout_id for r in made}, 300)}
            # The proxy's spans are not under this client's fence: wait for ClickHouse to hold agl.spans' end.
            assert store.side is not None
            await store.side.query("SELECT 1", fence=await fence_at_end(settings, "spans"))
            for rollout in made:
                record = records[rollout.rollout_id]
                [triplet] = record.triplets
                question = rollout.input["question"]  # type: ignore[index]
                expected = tokenizer.apply_chat_template(
                    [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
                )
                if not isinstance(expected, list):  # transformers 5 returns a BatchEncoding
                    expected = list(expected["input_ids"])  # type: ignore[index]
                assert triplet.prompt_token_ids == expected, kind
                spans = await store.query_spans(rollout.rollout_id, "latest")
                [call] = [s for s in spans if s.attributes.get("response_token_ids")]
                assert call.attributes["response_token_ids"] == triplet.response_token_ids, kind
                [root] = [s for s in spans if s.name == AGL_ATTEMPT]
                if kind in FORWARDS_TRACEPARENT:  # the call's span is a child of the attempt's root
                    assert (call.trace_id, call.parent_id) == (root.trace_id, root.span_id), kind
                else:  # a program that sends no trace context: the call starts a trace of its own
                    assert call.parent_id is None, kind
                answer = tokenizer.decode(triplet.response_token_ids, skip_special_tokens=True)
                reward = 0.5 if kind == "shell" else len(answer) / 10  # what each program reports
                assert record.final_reward == pytest.approx(reward), (kind, answer)

        # A command that fails (status 3) fails its attempt; the runner goes on.
        [doomed], [ended] = await _run(
            store,
            settings,
            "failing",
            ["--command", "echo no luck >&2; exit 3"],
            [{"input": {"question": "x"}, "mode": "train"}],
        )
        assert ended.status == "failed"
        [attempt] = await store.query_attempts(doomed.rollout_id)
        assert attempt.status == "failed"


async def test_a_commands_own_spans_exported_over_otlp_join_the_attempts_trace(served: Served) -> None:
    settings = served.settings
    command = f"{shlex.quote(sys.executable)} {shlex.quote(str(AGENTS / 'otlp_agent.py'))}"
    async with connect(**settings.model_dump(exclude_none=True)) as store:
        made, finished = await _run(
            store, settings, "otlp", ["--command", command], [{"input": {"question": q}} for q in QUESTIONS]
        )
        assert [r.status for r in finished] == ["succeeded"] * len(made), settings.data_dir
        # The program's span came through the gateway's OTLP receiver, not the runner's export.
        assert store.side is not None
        await store.side.query("SELECT 1", fence=await fence_at_end(settings, "spans"))
        for rollout in made:
            spans = await store.query_spans(rollout.rollout_id, "latest")
            [root] = [s for s in spans if s.name == AGL_ATTEMPT]
            [plan] = [s for s in spans if s.name == "agent.plan"]
            assert (plan.trace_id, plan.parent_id) == (root.trace_id, root.span_id)
            assert plan.attributes["plan.steps"] == 3 and plan.attempt_id == root.attempt_id
            assert find_final_reward(spans) == 0.25


FRAMEWORKS = {
    "langgraph": "examples.calculator.calc_agent:langgraph_calculator_agent",
    "agents-sdk": "examples.calculator.calc_agent:agents_sdk_calculator_agent",
}

CHAT_SCOPES = {
    "langgraph": "opentelemetry.instrumentation.genai.langchain",
    "agents-sdk": "opentelemetry.instrumentation.genai.openai",
}


def _ancestors(span: Span, by_id: dict[str, Span]) -> list[Span]:
    chain = []
    while span.parent_id is not None:
        span = by_id[span.parent_id]
        chain.append(span)
    return chain


@pytest.mark.parametrize("framework", list(FRAMEWORKS))
async def test_framework_agents_are_one_trace_and_exact_triplets(served: Served, framework: str) -> None:
    settings, script = served.settings, served.script
    async with connect(**settings.model_dump(exclude_none=True)) as store:
        proxied = ProxyLLM(endpoint=f"http://127.0.0.1:{served.proxy_port}/v1", model="scripted")
        resources = await store.add_resources({"policy": proxied})
        with script.lock:
            script.calls.clear()
        made, finished = await _run(
            store,
            settings,
            framework,
            ["--agent", FRAMEWORKS[framework], "--concurrency", "3"],
            [{"input": task, "mode": "train", "resources_id": resources.resources_id} for task in TASKS],
        )
        assert [r.status for r in finished] == ["succeeded"] * len(made), (framework, settings.data_dir)
        records = {r.rollout_id: r for r in await _records_covering(settings, {r.rollout_id for r in made}, 300)}
        assert store.side is not None
        await store.side.query("SELECT 1", fence=await fence_at_end(settings, "spans"))
        for rollout in made:
            question = rollout.input["question"]  # type: ignore[index]
            record = records[rollout.rollout_id]
            assert record.final_reward == 1.0, framework  # the scripted model answers with the tool's value
            # Two calls (the tool call, the answer), each an exact triplet.
            assert [(t.prompt_token_ids, t.response_token_ids) for t in record.triplets] == script.calls[question]
            spans = await store.query_spans(rollout.rollout_id, "latest")
            by_id = {s.span_id: s for s in spans}
            [root] = [s for s in spans if s.name == AGL_ATTEMPT]
            assert {s.trace_id for s in spans} == {root.trace_id}, framework
            assert all(s is root or _ancestors(s, by_id)[-1] is root for s in spans), framework
            names = [s.name for s in spans]
            assert "invoke_agent calculator_agent" in names, (framework, names)
            [tool] = [s for s in spans if s.name == "execute_tool calculator"]
            assert tool.attributes["gen_ai.tool.name"] == "calculator"
            # Each model call: the proxy's span under the call's one chat span (LangChain's for
            # LangGraph, the openai client's for the Agents SDK), inside the agent's span.
            proxied_calls = [s for s in spans if s.name == "openai.chat.completion"]
            assert len(proxied_calls) == 2, (framework, names)
            assert names.count("chat scripted") == 2, (framework, names)  # not one per instrumentation
            for call in proxied_calls:
                client, *above = _ancestors(call, by_id)
                assert client.kind == "CLIENT" and client.name == "chat scripted", (framework, client.name)
                assert client.scope_name == CHAT_SCOPES[framework], client.scope_name
                assert any(s.name == "invoke_agent calculator_agent" for s in above), (framework, names)
