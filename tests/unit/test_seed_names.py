"""`import agl_stream as agl` offers what `import agentlightning as agl` (0.3.0) offers for the
store, agents and types: the same names, the same fields, the same behaviour where tested."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import agl_stream as agl
from agl_stream.models import Rollout

# The seed's public names for the store, agents and types (agentlightning 0.3.0, written here).
SEED_NAMES = [
    "Algorithm", "Attempt", "AttemptStatus", "AttemptedRollout", "Baseline", "EnqueueRolloutRequest",
    "FastAlgorithm", "Hook", "LLM", "LitAgent", "Trainer", "algo",
    "LightningStore", "LightningStoreCapabilities", "LightningStoreStatistics", "NamedResources",
    "OtelResource", "PromptTemplate", "ProxyLLM", "Resource", "ResourcesUpdate", "Rollout", "RolloutConfig",
    "RolloutMode", "RolloutStatus", "Span", "SpanContext", "StatusCode", "Task", "TaskInput", "TraceStatus",
    "Triplet", "Worker", "WorkerStatus", "emit_annotation", "emit_exception", "emit_message", "emit_object",
    "emit_reward", "find_final_reward", "find_reward_spans", "get_message_value", "get_object_value",
    "get_reward_value", "get_rewards_from_span", "is_reward_span", "llm_rollout", "prompt_rollout", "rollout",
]  # fmt: skip


@pytest.mark.parametrize("name", SEED_NAMES)
def test_each_of_the_seeds_names_resolves(name: str) -> None:
    assert getattr(agl, name) is not None
    assert name in agl.__all__


def test_records_have_the_seeds_fields() -> None:
    assert {"max_attempts", "retry_condition", "timeout_seconds", "unresponsive_seconds"} <= set(
        agl.RolloutConfig.model_fields
    )
    request = agl.EnqueueRolloutRequest(input={"q": 1}, mode="train", config=agl.RolloutConfig(max_attempts=2))
    assert dict(request) == {
        "input": {"q": 1}, "mode": "train", "resources_id": None,
        "config": agl.RolloutConfig(max_attempts=2), "metadata": None,
    }  # fmt: skip
    assert agl.TraceStatus(status_code="ERROR", description="boom").description == "boom"
    assert agl.Task(rollout_id="ro-1", input="x").metadata == {}


def test_prompt_template_format_fills_f_strings_only() -> None:
    assert agl.PromptTemplate(template="Hi {name}", engine="f-string").format(name="Ada") == "Hi Ada"
    with pytest.raises(NotImplementedError, match="jinja"):
        agl.PromptTemplate(template="Hi {{ name }}", engine="jinja").format(name="Ada")


ROLLOUT = Rollout(rollout_id="ro-000000000001", input={"q": 1}, start_time=1.0)


def test_llm_rollout_and_prompt_rollout_take_the_seeds_signatures() -> None:
    llm = agl.LLM(endpoint="http://127.0.0.1:1/v1", model="m", sampling_parameters={})
    proxy = agl.ProxyLLM(endpoint="http://127.0.0.1:2/v1", model="m", sampling_parameters={})
    prompt = agl.PromptTemplate(template="Q: {q}", engine="f-string")

    @agl.llm_rollout
    def plain(task: Any, llm: Any) -> float:
        assert isinstance(llm, agl.LLM)
        return 1.0

    @agl.llm_rollout(strip_proxy=False)
    def raw(task: Any, llm: Any, rollout: Any) -> str:
        return type(llm).__name__ + ":" + rollout.rollout_id

    @agl.prompt_rollout
    async def tuned(task: Any, prompt_template: Any) -> str:
        return str(prompt_template.format(**task))

    assert plain.rollout({"q": 1}, {"main": llm}, ROLLOUT) == 1.0
    assert raw.rollout({"q": 1}, {"main": proxy}, ROLLOUT) == "ProxyLLM:ro-000000000001"
    assert asyncio.run(tuned.rollout_async({"q": 2}, {"p": prompt}, ROLLOUT)) == "Q: 2"


def test_lit_agent_accessors() -> None:
    class Agent(agl.LitAgent[Any]):
        def rollout(self, task: Any, resources: Any, rollout: Any) -> None:
            return None

    class Runner:
        tracer = "the runner's tracer"

    agent, runner = Agent(), Runner()
    with pytest.raises(ValueError, match="no runner"):
        _ = agent.runner
    agent.set_runner(runner)
    assert agent.runner is runner and agent.get_runner() is runner and agent.tracer == "the runner's tracer"
    with pytest.raises(ValueError, match="no trainer"):
        agent.get_trainer()
