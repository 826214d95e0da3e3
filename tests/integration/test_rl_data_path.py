"""End to end on CPU: an agent calls the CPU model through the LLM proxy inside a rollout, and the
triplets on agl.triplets hold exactly the token ids the model received and produced, and the
reward the agent returned.

Everything is a real process: broker, rollout processor, gateway (chDB), triplet builder, CPU
inference server, LLM proxy, runner.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from uuid import uuid4

import pytest

from agl_stream import connect
from agl_stream.config import Settings
from agl_stream.kafka.offsets import fence_at_end
from agl_stream.local import stack
from agl_stream.models import ProxyLLM
from agl_stream.policy import build_tokenizer
from agl_stream.ports import free_ports
from agl_stream.wire.semconv import AGL_ATTEMPT
from tests.integration.helpers import serve, start_role, stop_role
from tests.integration.test_triplet_builder import _records_covering

pytestmark = pytest.mark.integration


@pytest.fixture
def training_stack(kafka_bootstrap: str, tmp_path: Path) -> Iterator[Settings]:
    settings = Settings(
        kafka_bootstrap=kafka_bootstrap, data_dir=tmp_path, topic_prefix=f"e{uuid4().hex[:10]}", gateway_port=0
    )
    stack.up(settings, training=True)
    try:
        yield stack.local_stack_settings(settings)
    finally:
        stack.down(settings)


async def test_an_agents_model_calls_become_exact_triplets(training_stack: Settings) -> None:
    model_port, proxy_port = free_ports(2)
    model = serve(
        training_stack,
        "inference",
        "--port",
        str(model_port),
        "--model-name",
        "agl-tiny",
        "--no-follow",
        name="inference",
        url=f"http://127.0.0.1:{model_port}/health",
    )
    proxy = serve(
        training_stack,
        "llm-proxy",
        "--port",
        str(proxy_port),
        "--backend",
        f"agl-tiny=http://127.0.0.1:{model_port}/v1",
        name="proxy",
        url=f"http://127.0.0.1:{proxy_port}/health",
    )
    runner = start_role(training_stack, "runner", "--agent", "tests.integration.agents:ask_model", log_name="runner")
    try:
        async with connect(**training_stack.model_dump(exclude_none=True)) as store:
            await store.add_resources(
                {"policy": ProxyLLM(endpoint=f"http://127.0.0.1:{proxy_port}/v1", model="agl-tiny")}
            )
            questions = ["what is 2+2?", "say hi", "count to 3", "name a color", "7*6=?"]
            made = await store.enqueue_many_rollouts(
                [{"input": {"question": q, "seed": i}, "mode": "train"} for i, q in enumerate(questions)]
            )
            finished = await store.wait_for_rollouts(rollout_ids=[r.rollout_id for r in made], timeout=180)
            assert [r.status for r in finished] == ["succeeded"] * len(made)
            records = {
                r.rollout_id: r for r in await _records_covering(training_stack, {r.rollout_id for r in made}, 120)
            }
            tokenizer = build_tokenizer()
            assert store.side is not None
            await store.side.query("SELECT 1", fence=await fence_at_end(training_stack, "spans"))  # spans are queryable
            for rollout in made:
                record = records[rollout.rollout_id]
                question = rollout.input["question"]  # type: ignore[index]
                [triplet] = record.triplets
                expected_prompt = tokenizer.apply_chat_template(
                    [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
                )
                assert not isinstance(expected_prompt, str)  # tokenize=True
                if not isinstance(expected_prompt, list):  # transformers 5 returns a BatchEncoding
                    expected_prompt = list(expected_prompt["input_ids"])
                assert triplet.prompt_token_ids == expected_prompt
                spans = await store.query_spans(rollout.rollout_id, "latest")
                [message] = [s for s in spans if s.name == "agentlightning.message"]
                answer = str(message.attributes["agentlightning.message.body"])
                assert tokenizer.decode(triplet.response_token_ids, skip_special_tokens=True) == answer
                assert triplet.response_logprobs is not None
                assert len(triplet.response_logprobs) == len(triplet.response_token_ids)
                assert all(lp <= 0.0 for lp in triplet.response_logprobs)
                assert record.final_reward == pytest.approx(len(answer) / 10)
                assert triplet.reward == pytest.approx(len(answer) / 10)
                [call] = [s for s in spans if s.name == "openai.chat.completion"]
                assert call.attributes["response_token_ids"] == triplet.response_token_ids
                # One trace, one tree: the proxy's span is a child of the agent's openai client
                # span (its request carried traceparent), and every span descends from the root.
                [root] = [s for s in spans if s.name == AGL_ATTEMPT]
                assert root.parent_id is None and {s.trace_id for s in spans} == {root.trace_id}
                by_id = {s.span_id: s for s in spans}
                client = by_id[call.parent_id]  # type: ignore[index]
                assert client.attributes["gen_ai.request.model"] == "agl-tiny" and client.kind == "CLIENT"
                for span in spans:
                    while span.parent_id is not None:
                        span = by_id[span.parent_id]
                    assert span is root
    finally:
        assert stop_role(runner, timeout=60) == 0
        stop_role(proxy, timeout=30)
        stop_role(model, timeout=30)
