"""APO's pure parts (agl_stream.algorithm.apo_core) and its checks, without a stack."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from itertools import islice
from types import SimpleNamespace
from typing import Any, cast

import httpx
import openai
import pytest

import agl_stream as agl
from agl_stream.algorithm import ALGORITHMS, APO, ModelEndpointError, make_algorithm
from agl_stream.algorithm.apo import _Search
from agl_stream.algorithm.apo_core import (
    Candidate,
    RolloutResult,
    check_template,
    critique_messages,
    edit_messages,
    index_batches,
    parents_for_round,
    parse_edit,
    rollout_result,
    score_of,
    select_beam,
    template_fields,
)
from agl_stream.algorithm.report import REWARD_VALUE_KEY, ModeReport
from agl_stream.errors import AlgorithmConfigError, DatasetError
from agl_stream.models import LLM, PromptTemplate, Span
from agl_stream.wire.semconv import AGL_EXCEPTION, AGL_MESSAGE

# -- parameters -------------------------------------------------------------------------------------


def test_apo_is_exported_and_registered() -> None:
    assert agl.APO is APO
    assert ALGORITHMS["apo"] is APO
    made = make_algorithm({"name": "apo", "beam_rounds": 2, "gradient_model": "critic"})
    assert isinstance(made, APO) and made.beam_rounds == 2 and made.gradient_model == "critic"


def test_every_bad_parameter_is_named_in_one_error() -> None:
    with pytest.raises(AlgorithmConfigError) as caught:
        APO(
            beam_width=0,
            branch_factor=-1,
            beam_rounds=1.5,  # type: ignore[arg-type]
            gradient_batch_size=True,  # a bool is no count
            val_batch_size=0,
            diversity_temperature=3.0,
            rollout_batch_timeout=0,
            gradient_model=" ",
            gradient_base_url="localhost:8000",
        )
    error = caught.value
    assert error.algorithm == "APO"
    assert set(error.problems) == {
        "beam_width",
        "branch_factor",
        "beam_rounds",
        "gradient_batch_size",
        "val_batch_size",
        "diversity_temperature",
        "rollout_batch_timeout",
        "gradient_model",
        "gradient_base_url",
    }
    assert "positive integer, got 0" in error.problems["beam_width"]
    assert "http(s) URL" in error.problems["gradient_base_url"]
    assert isinstance(error, ValueError)  # the seed raised ValueError: its callers' handlers still work


def test_a_client_that_is_no_openai_client_is_refused() -> None:
    with pytest.raises(AlgorithmConfigError, match="async_openai_client"):
        APO("http://localhost:8000/v1")


def test_the_seed_prompt_comes_from_the_initial_resources() -> None:
    prompt = PromptTemplate(template="Classify: {text}", engine="f-string")
    llm = LLM(endpoint="http://127.0.0.1:1/v1", model="m")
    apo = APO()
    apo.set_initial_resources({"llm": llm, "main": prompt})
    assert apo.get_seed_prompt_template() == ("main", prompt)
    # A prompt given as a plain mapping counts too (initial resources may come from JSON).
    as_json = {"resource_type": "prompt_template", "template": "x {y}", "engine": "f-string"}
    apo.set_initial_resources({"other": as_json})
    assert apo.get_seed_prompt_template()[1].template == "x {y}"

    apo.set_initial_resources({"llm": llm})
    with pytest.raises(AlgorithmConfigError, match="no PromptTemplate among them"):
        apo.get_seed_prompt_template()
    named = APO(prompt_resource="missing")
    named.set_initial_resources({"main": prompt})
    with pytest.raises(AlgorithmConfigError, match="'missing' is no PromptTemplate"):
        named.get_seed_prompt_template()
    with pytest.raises(ValueError, match="no best prompt yet"):
        APO().get_best_prompt()


async def test_run_refuses_missing_datasets() -> None:
    apo = APO()
    apo.set_store(object())
    apo.set_initial_resources({"p": PromptTemplate(template="{x}", engine="f-string")})
    with pytest.raises(DatasetError, match="train_dataset"):
        await apo.run([], [{"x": 1}])
    with pytest.raises(DatasetError, match="val_dataset"):
        await apo.run([{"x": 1}], None)


# -- batches and the beam ---------------------------------------------------------------------------


def test_batches_run_every_task_once_per_pass_and_never_twice_in_a_batch() -> None:
    batches = list(islice(index_batches(10, 4, random.Random(3)), 15))  # 60 slots: 6 passes
    assert all(len(b) == 4 and len(set(b)) == 4 for b in batches)
    counts = Counter(i for b in batches for i in b)
    assert set(counts) == set(range(10)) and max(counts.values()) - min(counts.values()) <= 1
    # Seeded: the same seed, the same batches.
    assert batches == list(islice(index_batches(10, 4, random.Random(3)), 15))


def test_a_batch_as_large_as_the_dataset_is_the_whole_dataset_every_time() -> None:
    for batch in islice(index_batches(5, 16, random.Random(0)), 4):
        assert sorted(batch) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        next(index_batches(0, 3, random.Random(0)))


def _candidate(rid: str, text: str | None = None) -> Candidate:
    prompt = PromptTemplate(template=text or f"prompt {rid}: {{x}}", engine="f-string")
    return Candidate(resources_id=rid, prompt=prompt, resources={"p": prompt}, round=0)


def test_parents_repeat_a_short_beam() -> None:
    a, b = _candidate("a"), _candidate("b")
    assert parents_for_round([a, b], 3) == [a, b, a]
    assert parents_for_round([a, b], 2) == [a, b]
    with pytest.raises(ValueError):
        parents_for_round([], 2)


def test_the_beam_keeps_the_best_and_an_equal_child_does_not_displace_its_parent() -> None:
    parent, same, better, worse, unscored = (_candidate(x) for x in ("parent", "same", "better", "worse", "none"))
    scores = {"parent": 0.5, "same": 0.5, "better": 0.75, "worse": 0.25}
    assert select_beam([parent, same, better, worse, unscored], scores, 2) == [better, parent]
    assert select_beam([parent, same, unscored, worse], scores, 4) == [parent, same, worse, unscored]
    # The same template twice counts once (the earlier one stays).
    twin = _candidate("twin", parent.prompt.template)
    assert select_beam([parent, twin, worse], {**scores, "twin": 1.0}, 3) == [parent, worse]


def test_a_score_counts_rollouts_without_a_reward_as_zero() -> None:
    report = ModeReport(mode="val", rollouts=4, succeeded=3, failed=1, cancelled=0, rewarded=3, mean_reward=0.8)
    assert score_of(report, 4) == pytest.approx(0.6)  # 2.4 over 4 rollouts
    assert score_of(None, 4) == 0.0
    nothing = ModeReport(mode="val", rollouts=2, succeeded=0, failed=2, cancelled=0, rewarded=0, mean_reward=None)
    assert score_of(nothing, 2) == 0.0


# -- what the critique reads ------------------------------------------------------------------------


def _span(sequence_id: int, name: str, attributes: dict[str, Any]) -> Span:
    return Span(
        rollout_id="ro-1",
        attempt_id="at-1",
        sequence_id=sequence_id,
        trace_id="1" * 32,
        span_id=f"{sequence_id:016x}",
        name=name,
        attributes=attributes,
    )


def _text(content: str) -> dict[str, str]:
    return {"type": "text", "content": content}


def test_a_rollout_result_holds_the_final_reward_and_what_the_agent_logged() -> None:
    spans = [
        _span(1, AGL_MESSAGE, {"agentlightning.message.body": "answer: positive; expected: negative"}),
        _span(
            2,
            "openai.chat.completion",
            {
                "gen_ai.input.messages": json.dumps([{"role": "user", "parts": [_text("Classify: bad day")]}]),
                "gen_ai.output.messages": json.dumps([{"role": "assistant", "parts": [_text("positive")]}]),
            },
        ),
        _span(3, AGL_EXCEPTION, {"exception.type": "KeyError", "exception.message": "'label'"}),
        _span(4, "agentlightning.annotation", {REWARD_VALUE_KEY: 0.5}),
        _span(5, "agentlightning.annotation", {REWARD_VALUE_KEY: 0.0}),
        _span(6, AGL_MESSAGE, {"agentlightning.message.body": "x" * 5000}),
    ]
    result = rollout_result({"text": "bad day"}, "succeeded", spans)
    assert result.reward == 0.0  # the last reward span, as the SQL score reads it
    assert rollout_result({}, "succeeded", list(reversed(spans))).reward == 0.0  # by sequence id
    assert result.status == "succeeded" and result.task == {"text": "bad day"}
    assert result.notes[:4] == (
        "message: answer: positive; expected: negative",
        "model asked: [user] Classify: bad day",
        "model answered: [assistant] positive",
        "error: KeyError: 'label'",
    )
    assert len(result.notes[4]) < 700  # a long message is cut
    assert rollout_result({}, "failed", []).reward is None
    # Spans recorded before the proxy wrote the GenAI conventions' current keys read as well.
    earlier = _span(1, "openai.chat.completion", {"gen_ai.prompt": '[{"role": "user", "content": "hi"}]'})
    assert rollout_result({}, "succeeded", [earlier]).notes == ("model asked: [user] hi",)


def test_the_critique_chat_shows_the_template_and_every_run() -> None:
    results = [
        RolloutResult(task={"text": "great"}, status="succeeded", reward=1.0, notes=("message: ok",)),
        RolloutResult(task={"text": "awful"}, status="failed", reward=None),
    ]
    system, user = critique_messages("Say the sentiment of {text}", results)
    assert system["role"] == "system" and "textual" not in system["content"].lower()  # our own words
    text = user["content"]
    assert "<template>\nSay the sentiment of {text}\n</template>" in text
    assert "Runs of the agent with it: 2, mean reward 0.500." in text
    assert '### Run 1\nTask: {"text": "great"}\nEnded: succeeded; reward: 1\nLogged:\n- message: ok' in text
    assert "### Run 2" in text and "Ended: failed; reward: none reported\nLogged: nothing" in text


def test_the_edit_chat_lists_the_placeholders_to_keep() -> None:
    system, user = edit_messages("Classify {text} for {user[name]}", "1. Ask for one word.")
    assert "<prompt>" in system["content"]
    assert "Placeholders to keep, each exactly once or more: {text}, {user}" in user["content"]
    assert user["content"].endswith("The reviewer's advice:\n1. Ask for one word.")
    _, jinja = edit_messages("Classify {{ text }}", "advice", engine="jinja")
    assert "Placeholders" not in jinja["content"]


# -- what an edit answer means ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ("<prompt>\nClassify {text}. One word.\n</prompt>", "Classify {text}. One word."),
        ("Here it is:\n<PROMPT>Classify {text}</PROMPT>\nHope it helps", "Classify {text}"),
        # The instruction's tags quoted first, then the answer: the last block wins.
        ("Between <prompt> and </prompt> as asked:\n<prompt>New {text}</prompt>", "New {text}"),
        ("```text\nFenced {text}\n```", "Fenced {text}"),
        ("  Bare answer {text}  \n", "Bare answer {text}"),
        ("<prompt>cut off before the end", None),
        ("<prompt>  </prompt>", None),
        ("", None),
        (None, None),
    ],
)
def test_parse_edit(answer: str | None, expected: str | None) -> None:
    assert parse_edit(answer) == expected


def test_template_checks_keep_the_placeholders_of_the_parent() -> None:
    parent = PromptTemplate(template="Classify {text}", engine="f-string")
    assert template_fields("a {text} b {task[x]} {{literal}} {obj.attr!r:>3}") == {"text", "task", "obj"}
    assert check_template(parent, "Classify this: {text}. Answer with one word.") is None
    assert check_template(parent, "Classify {text} {{as JSON}}") is None
    assert check_template(parent, "Classify the sentence") == "it drops {text}"
    assert check_template(parent, "Classify {text} for {user}") == "it adds {user}"
    assert "positional" in (check_template(parent, "Classify {text} {}") or "")
    assert "braces do not parse" in (check_template(parent, "Classify {text") or "")
    # Templates of other engines are not f-strings: nothing to check here.
    assert check_template(PromptTemplate(template="{{ x }}", engine="jinja"), "{% bad") is None


# -- endpoints ----------------------------------------------------------------------------------------


async def test_a_failing_endpoint_raises_an_error_naming_it_and_what_to_do() -> None:
    async def refuse(**_: Any) -> Any:
        # openai types the request as the httpx it uses (httpx2 in recent releases, httpx in older
        # ones, both allowed by pyproject): any Request does here, the error only keeps it.
        request = cast(Any, httpx.Request("POST", "http://127.0.0.1:9/v1/chat/completions"))
        raise openai.APIConnectionError(request=request)

    client = SimpleNamespace(
        chat=SimpleNamespace(completions=SimpleNamespace(create=refuse)), base_url="http://127.0.0.1:9/v1"
    )
    apo = APO(client, gradient_model="critic", apply_edit_model="editor")
    search = _Search(apo, None, [{"x": 1}], [{"x": 2}], "p", {})
    with pytest.raises(ModelEndpointError) as caught:
        await search.chat("edit", [{"role": "user", "content": "hi"}])
    message = str(caught.value)
    assert "APO's edit model 'editor' at http://127.0.0.1:9/v1 failed: APIConnectionError" in message
    assert "apply_edit_base_url" in message and "apply_edit_api_key" in message
    assert caught.value.role == "edit"


async def test_endpoints_are_made_per_base_url_and_closed_by_the_run() -> None:
    apo = APO(gradient_base_url="http://127.0.0.1:9/v1", apply_edit_base_url="http://127.0.0.1:10/v1")
    endpoints = apo.endpoints()
    assert str(endpoints["critique"].client.base_url).startswith("http://127.0.0.1:9/v1")
    assert str(endpoints["edit"].client.base_url).startswith("http://127.0.0.1:10/v1")
    assert all(e.owned for e in endpoints.values())
    same = APO(gradient_base_url="http://127.0.0.1:9/v1").endpoints()
    assert same["critique"].client is same["edit"].client  # the edit model defaults to the critique's endpoint
    for made in (endpoints, same):
        for endpoint in made.values():
            await endpoint.client.close()


async def test_a_failing_branch_cancels_the_others_before_the_error_goes_on() -> None:
    from agl_stream.algorithm.apo import _all

    cancelled: list[str] = []

    async def slow() -> int:
        try:
            await asyncio.Event().wait()  # never set: only cancellation ends it
        except asyncio.CancelledError:
            cancelled.append("slow")
            raise
        return 0

    async def failing() -> int:
        raise ModelEndpointError("critique", "m", "http://x/v1", RuntimeError("down"))

    async def fine() -> int:
        return 1

    with pytest.raises(ModelEndpointError):
        await _all([slow(), failing()])
    assert cancelled == ["slow"]
    assert await _all([fine(), fine()]) == [1, 1]


async def test_an_endpoint_nobody_serves_is_named_with_the_settings_to_check() -> None:
    import socket

    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    apo = APO(gradient_model="critic", gradient_base_url=f"http://127.0.0.1:{port}/v1", request_timeout=5.0)
    search = _Search(apo, None, [{"x": 1}], [{"x": 2}], "p", {})
    try:
        with pytest.raises(ModelEndpointError, match=rf"critique model 'critic' at http://127.0.0.1:{port}/v1/ failed"):
            await search.chat("critique", [{"role": "user", "content": "hi"}])
    finally:
        await search.close()
