"""The agent API without a broker: resource injection by type and name, sync/async, results."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agl_stream.agent.litagent import FunctionalLitAgent, LitAgent, rollout
from agl_stream.models import LLM, Attempt, PromptTemplate, ProxyLLM, Rollout
from agl_stream.store.types import AttemptedRollout

POLICY = LLM(endpoint="http://127.0.0.1:9/v1", model="policy")
JUDGE = LLM(endpoint="http://127.0.0.1:8/v1", model="judge")
PROXY = ProxyLLM(endpoint="http://127.0.0.1:7/v1", model="proxied", api_key="k", sampling_parameters={"t": 0.5})
PROMPT = PromptTemplate(template="Solve {task}", engine="f-string")


def _rollout(mode: str | None = "train") -> AttemptedRollout:
    return AttemptedRollout(
        rollout_id="ro-000000000001",
        input={"q": 1},
        start_time=0.0,
        mode=mode,
        attempt=Attempt(rollout_id="ro-000000000001", attempt_id="at-00000001", sequence_id=1, start_time=0.0),
    )


def test_resources_are_injected_by_type() -> None:
    seen: dict[str, Any] = {}

    @rollout
    def agent(task: dict[str, int], llm: LLM, prompt: PromptTemplate, ro: Rollout) -> float:
        seen.update(task=task, llm=llm, prompt=prompt, rollout=ro)
        return 1.0

    result = agent.rollout({"q": 1}, {"judge": JUDGE, "p": PROMPT, "policy": POLICY}, _rollout())
    assert result == 1.0
    assert seen["llm"] is JUDGE  # the first LLM resource, as the seed picks it
    assert seen["prompt"] is PROMPT and seen["rollout"].rollout_id == "ro-000000000001"


def test_a_parameter_named_like_a_resource_gets_that_resource() -> None:
    @rollout
    def agent(task: Any, policy: LLM, judge: LLM) -> tuple[str, str]:
        return policy.model, judge.model

    assert agent.rollout(None, {"judge": JUDGE, "policy": POLICY}, _rollout()) == ("policy", "judge")


def test_seed_parameter_names_work_without_annotations() -> None:
    @rollout
    def agent(task, llm, prompt_template, rollout, resources):  # type: ignore[no-untyped-def]
        return llm.model, prompt_template.template, rollout.rollout_id, sorted(resources)

    got = agent.rollout("t", {"a": POLICY, "b": PROMPT}, _rollout())
    assert got == ("policy", "Solve {task}", "ro-000000000001", ["a", "b"])


def test_a_proxy_llm_becomes_an_llm_on_the_attempts_url() -> None:
    @rollout
    def agent(task: Any, llm: LLM) -> LLM:
        return llm

    llm = agent.rollout(None, {"policy": PROXY}, _rollout())
    assert isinstance(llm, LLM)
    assert llm.endpoint == "http://127.0.0.1:7/rollout/ro-000000000001/attempt/at-00000001/v1"
    assert (llm.model, llm.api_key, llm.sampling_parameters) == ("proxied", "k", {"t": 0.5})

    @rollout
    def raw(task: Any, llm: ProxyLLM) -> ProxyLLM:
        return llm

    assert raw.rollout(None, {"policy": PROXY}, _rollout()) is PROXY


def test_missing_required_resource_says_what_is_missing() -> None:
    @rollout
    def agent(task: Any, llm: LLM) -> None:
        return None

    with pytest.raises(ValueError, match=r"'llm'.*resources: p \(PromptTemplate\)"):
        agent.rollout(None, {"p": PROMPT}, _rollout())

    @rollout
    def optional(task: Any, llm: LLM | None = None) -> LLM | None:
        return llm

    assert optional.rollout(None, {}, _rollout()) is None


def test_async_functions_are_async_agents() -> None:
    @rollout
    async def agent(task: int, llm: LLM) -> float:
        await asyncio.sleep(0)
        return task * 2.0

    assert agent.is_async()
    assert asyncio.run(agent.rollout_async(21, {"x": POLICY}, _rollout())) == 42.0
    with pytest.raises(RuntimeError, match="async"):
        agent.rollout(21, {"x": POLICY}, _rollout())
    assert asyncio.run(agent(3, POLICY)) == 6.0  # still callable as the plain function


def test_decorating_a_function_without_a_task_parameter_fails() -> None:
    def no_params() -> None:
        return None

    with pytest.raises(TypeError, match="task"):
        FunctionalLitAgent(no_params)


def test_litagent_modes_and_async_detection() -> None:
    class Both(LitAgent[str]):
        def training_rollout(self, task: str, resources: Any, rollout: Rollout) -> float:
            return 1.0

        def validation_rollout(self, task: str, resources: Any, rollout: Rollout) -> float:
            return 0.0

    class Async(LitAgent[str]):
        async def rollout_async(self, task: str, resources: Any, rollout: Rollout) -> float:
            return 0.5

    class Plain(LitAgent[str]):
        def rollout(self, task: str, resources: Any, rollout: Rollout) -> float:
            return 0.25

    assert not Both().is_async() and Async().is_async() and not Plain().is_async()
    assert Both().training_rollout("t", {}, _rollout()) == 1.0
    assert Plain().validation_rollout("t", {}, _rollout("val")) == 0.25
    assert asyncio.run(Async().validation_rollout_async("t", {}, _rollout())) == 0.5
    with pytest.raises(NotImplementedError, match="rollout"):
        agent: LitAgent[str] = LitAgent()
        agent.rollout("t", {}, _rollout())
