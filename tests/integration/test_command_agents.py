"""Agents as commands, in three languages, none of which knows agl-stream: a shell script calling
the model with curl, a Node.js program with the official ``openai`` npm package, and a Python
script with the ``openai`` client (``tests/agents/``). Each runs under ``agl-stream runner
--command``, one process per attempt, and talks to the CPU model through the LLM proxy at the
``OPENAI_BASE_URL`` it is given: the triplets hold exactly the tokens the model received and
produced, with the reward the program reported. A command that fails fails its attempt.

Everything is a real process: broker, rollout processor, gateway (chDB), triplet builder, CPU
inference server, LLM proxy, runners.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from uuid import uuid4

import pytest

from agl_stream import connect, stack
from agl_stream.config import Settings
from agl_stream.kafka import broker
from agl_stream.kafka.offsets import fence_at_end
from agl_stream.models import ProxyLLM
from agl_stream.policy import build_tokenizer
from agl_stream.semconv import AGL_ATTEMPT
from tests.integration.helpers import serve, start_role, stop_role
from tests.integration.test_triplet_builder import _records_covering

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


@pytest.fixture
def served(kafka_bootstrap: str, tmp_path: Path) -> Iterator[tuple[Settings, int]]:
    """The local stack with the training roles, the CPU model and the LLM proxy: (settings, proxy port)."""
    settings = Settings(
        kafka_bootstrap=kafka_bootstrap, data_dir=tmp_path, topic_prefix=f"c{uuid4().hex[:10]}", gateway_port=0
    )
    stack.up(settings, training=True)
    model_port, proxy_port = broker.free_ports(2)
    running = stack.local_stack_settings(settings)
    started = []
    try:
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
                name="proxy",
                url=f"http://127.0.0.1:{proxy_port}/health",
            )
        )
        yield running, proxy_port
    finally:
        for process in reversed(started):
            stop_role(process, timeout=30)
        stack.down(settings)


async def test_commands_in_any_language_become_exact_triplets_with_their_rewards(served: tuple[Settings, int]) -> None:
    settings, proxy_port = served
    assert (NODE_AGENT.parent / "node_modules" / "openai").is_dir(), "run `make test` (it installs tests/agents/node)"
    tokenizer = build_tokenizer()
    async with connect(**settings.model_dump(exclude_none=True)) as store:
        await store.add_resources({"policy": ProxyLLM(endpoint=f"http://127.0.0.1:{proxy_port}/v1", model="agl-tiny")})
        for kind, command in COMMANDS.items():
            runner = start_role(
                settings, "runner", "--command", command, "--concurrency", "3", log_name=f"runner-{kind}"
            )
            try:
                made = await store.enqueue_many_rollouts(
                    [{"input": {"question": q}, "mode": "train"} for q in QUESTIONS]
                )
                finished = await store.wait_for_rollouts(rollout_ids=[r.rollout_id for r in made], timeout=300)
            finally:
                assert stop_role(runner, timeout=60) == 0, kind
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
        failing = start_role(settings, "runner", "--command", "echo no luck >&2; exit 3", log_name="runner-failing")
        try:
            [doomed] = await store.enqueue_many_rollouts([{"input": {"question": "x"}, "mode": "train"}])
            [ended] = await store.wait_for_rollouts(rollout_ids=[doomed.rollout_id], timeout=300)
        finally:
            assert stop_role(failing, timeout=60) == 0
        assert ended.status == "failed"
        [attempt] = await store.query_attempts(doomed.rollout_id)
        assert attempt.status == "failed"
