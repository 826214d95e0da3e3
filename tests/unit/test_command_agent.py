"""Agents as commands: the environment and reward rules (pure), and real processes run by
``CommandAgent`` (``/bin/sh``; no broker: the runner around it is tested in integration)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from agl_stream.agent.command_agent import (
    OUTPUT_TAIL_BYTES,
    TASK_ENV_LIMIT,
    CommandAgent,
    CommandError,
    OtlpTarget,
    command_environment,
    endpoint_of,
    failure_message,
    parse_reward,
)
from agl_stream.models import LLM, PromptTemplate, ProxyLLM
from agl_stream.store.types import AttemptedRollout

# -- pure rules -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stdout", "file", "expected"),
    [
        ('thinking...\n{"reward": 0.75}\n\n', None, 0.75),
        ("1\n", None, 1.0),
        ('{"reward": null}', None, None),
        ("null", None, None),
        ("all done, no reward\n", None, None),
        ("", None, None),
        ('"a json string"', None, None),
        ("[1, 2]", None, None),
        ('{"reward": 0.1}', "0.5", 0.5),  # the file wins
        ("", '{"reward": -2}', -2.0),
        ("", "null", None),
    ],
)
def test_the_reward_comes_from_the_file_else_the_last_stdout_line(
    stdout: str, file: str | None, expected: float | None
) -> None:
    assert parse_reward(stdout, file) == expected


@pytest.mark.parametrize(
    ("stdout", "file", "says"),
    [
        ('{"score": 1}', None, "without a 'reward' key"),
        ('{"reward": "high"}', None, "finite number or null"),
        ('{"reward": true}', None, "finite number or null"),
        ("", "not json", "the reward file is not JSON"),
        ("", "NaN", "finite number or null"),
        ("", '"0.5"', "finite number or null"),
    ],
)
def test_a_malformed_reward_is_a_clear_error(stdout: str, file: str | None, says: str) -> None:
    with pytest.raises(CommandError, match=says):
        parse_reward(stdout, file)


def test_a_proxy_llm_becomes_the_attempts_route_and_an_llm_stays_as_it_is() -> None:
    proxy = ProxyLLM(endpoint="http://127.0.0.1:9/v1", model="m")
    template = PromptTemplate(template="x", engine="f-string")
    routed = endpoint_of({"prompt": template, "policy": proxy}, "ro-1", "at-1")
    assert routed is not None
    assert (routed.base_url, routed.model, routed.api_key) == (
        "http://127.0.0.1:9/rollout/ro-1/attempt/at-1/v1",
        "m",
        "agl-stream",
    )
    plain = endpoint_of({"llm": LLM(endpoint="http://h/v1", model="n", api_key="k")}, "ro-1", "at-1")
    assert plain is not None and (plain.base_url, plain.api_key) == ("http://h/v1", "k")
    assert endpoint_of({"prompt": template}, "ro-1", "at-1") is None


def test_the_environment_holds_the_task_ids_endpoint_and_trace_context(tmp_path: Path) -> None:
    endpoint = endpoint_of({"p": ProxyLLM(endpoint="http://p/v1", model="m")}, "ro-1", "at-2")
    env = command_environment(
        task_json='{"q": 1}',
        task_file=tmp_path / "task.json",
        reward_file=tmp_path / "reward.json",
        rollout_id="ro-1",
        attempt_id="at-2",
        mode="val",
        endpoint=endpoint,
        trace_context={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"},
        base={"PATH": "/bin", "AGL_TASK": "stale"},
    )
    assert env["PATH"] == "/bin" and env["AGL_TASK"] == '{"q": 1}'
    assert (env["AGL_ROLLOUT_ID"], env["AGL_ATTEMPT_ID"], env["AGL_MODE"]) == ("ro-1", "at-2", "val")
    assert env["OPENAI_BASE_URL"] == "http://p/rollout/ro-1/attempt/at-2/v1" and env["AGL_MODEL"] == "m"
    assert env["TRACEPARENT"].startswith("00-111") and "TRACESTATE" not in env
    big = command_environment(
        task_json="x" * TASK_ENV_LIMIT,
        task_file=tmp_path / "task.json",
        reward_file=tmp_path / "reward.json",
        rollout_id="ro-1",
        attempt_id="at-2",
        mode=None,
        endpoint=None,
        trace_context={},
        base={"AGL_TASK": "stale"},
    )
    assert "AGL_TASK" not in big and "OPENAI_BASE_URL" not in big and big["AGL_MODE"] == ""
    # Spans the process exports belong to the attempt; without a target no exporter settings.
    assert big["OTEL_RESOURCE_ATTRIBUTES"] == "agentlightning.rollout_id=ro-1,agentlightning.attempt_id=at-2"
    assert not any(key.startswith("OTEL_EXPORTER_OTLP") for key in big)


def test_an_otlp_target_becomes_the_sdks_standard_variables(tmp_path: Path) -> None:
    env = command_environment(
        task_json="{}",
        task_file=tmp_path / "task.json",
        reward_file=tmp_path / "reward.json",
        rollout_id="ro-1",
        attempt_id="at-2",
        mode="train",
        endpoint=None,
        trace_context={},
        base={"OTEL_RESOURCE_ATTRIBUTES": "team=rl"},
        otlp=OtlpTarget("http://127.0.0.1:9/v1/traces", {"authorization": "Bearer a b,c"}),
    )
    assert env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == "http://127.0.0.1:9/v1/traces"
    assert env["OTEL_EXPORTER_OTLP_TRACES_HEADERS"] == "authorization=Bearer%20a%20b%2Cc"  # percent-encoded
    assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    # the runner's own resource attributes are kept, the attempt's ids added after them
    assert env["OTEL_RESOURCE_ATTRIBUTES"] == "team=rl,agentlightning.rollout_id=ro-1,agentlightning.attempt_id=at-2"
    # ... and the OpenTelemetry SDK reads them back as meant
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.util.re import parse_env_headers

    assert parse_env_headers(env["OTEL_EXPORTER_OTLP_TRACES_HEADERS"], liberal=True) == {
        "authorization": "Bearer a b,c"
    }
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OTEL_RESOURCE_ATTRIBUTES", env["OTEL_RESOURCE_ATTRIBUTES"])
        attributes = Resource.create().attributes
    assert (attributes["team"], attributes["agentlightning.attempt_id"]) == ("rl", "at-2")


def test_a_failure_names_the_status_or_signal_and_the_end_of_stderr() -> None:
    assert (
        failure_message(3, "line 1\nboom\n")
        == "the agent command exited with status 3; the end of its stderr:\nline 1\nboom"
    )
    assert failure_message(-9, "") == "the agent command was killed by signal 9 (no stderr)"


def test_an_empty_command_or_a_bad_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        CommandAgent("  ")
    with pytest.raises(ValueError, match="positive"):
        CommandAgent("true", timeout_s=0)


# -- real processes -------------------------------------------------------------------------------

RID, AID = "ro-00000000abcd", "at-0000ef01"


def _rollout(task: Any, mode: str = "train") -> AttemptedRollout:
    return AttemptedRollout.model_validate(
        {
            "rollout_id": RID,
            "input": task,
            "start_time": 1.0,
            "mode": mode,
            "attempt": {
                "rollout_id": "ro-00000000abcd",
                "attempt_id": "at-0000ef01",
                "sequence_id": 1,
                "start_time": 1.0,
            },
        }
    )


def _run(agent: CommandAgent, task: Any = None, resources: dict[str, Any] | None = None) -> float | None:
    return asyncio.run(agent.rollout_async(task, resources or {}, _rollout(task)))


def test_the_process_gets_its_task_ids_and_endpoint_and_returns_its_reward(tmp_path: Path) -> None:
    seen = tmp_path / "seen.json"
    script = (
        "import json, os, pathlib, sys;"
        f"pathlib.Path({str(seen)!r}).write_text(json.dumps({{k: os.environ.get(k) for k in "
        "('AGL_TASK', 'AGL_ROLLOUT_ID', 'AGL_ATTEMPT_ID', 'AGL_MODE', 'OPENAI_BASE_URL', 'AGL_MODEL')} | "
        "{'file': json.loads(pathlib.Path(os.environ['AGL_TASK_FILE']).read_text()), 'cwd': os.getcwd(), "
        "'listing': os.listdir('.')}));"
        "print('working'); print(json.dumps({'reward': 0.25}))"
    )
    agent = CommandAgent(f"python3 -c {json.dumps(script)}")
    proxy = ProxyLLM(endpoint="http://127.0.0.1:9/v1", model="agl-tiny")
    assert _run(agent, {"question": "2+2"}, {"policy": proxy}) == 0.25
    env = json.loads(seen.read_text())
    assert json.loads(env["AGL_TASK"]) == env["file"] == {"question": "2+2"}
    assert (env["AGL_ROLLOUT_ID"], env["AGL_ATTEMPT_ID"], env["AGL_MODE"]) == (
        "ro-00000000abcd",
        "at-0000ef01",
        "train",
    )
    assert env["OPENAI_BASE_URL"] == "http://127.0.0.1:9/rollout/ro-00000000abcd/attempt/at-0000ef01/v1"
    assert env["AGL_MODEL"] == "agl-tiny"
    assert sorted(env["listing"]) == ["task.json"]  # a clean directory of its own
    assert not Path(env["cwd"]).exists()  # removed after the attempt


def test_the_reward_file_is_read_and_wins_over_stdout() -> None:
    assert _run(CommandAgent('echo 0.9 > "$AGL_REWARD_FILE"; echo 0.1')) == 0.9


def test_a_failing_command_fails_with_its_status_and_stderr() -> None:
    with pytest.raises(CommandError, match=r"exited with status 7; the end of its stderr:\nno model"):
        _run(CommandAgent("echo no model >&2; exit 7"))


def test_endless_output_is_kept_to_its_tail() -> None:
    # 4 MiB of stdout, then the reward: only the last 64 KiB are kept, and the reward is in them.
    command = "head -c 4194304 /dev/zero | tr '\\0' 'x'; echo; echo 0.5"
    assert _run(CommandAgent(command)) == 0.5
    assert OUTPUT_TAIL_BYTES == 64 * 1024


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()


def _wait_gone(pid: int, seconds: float = 60.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_a_timeout_stops_the_whole_process_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    # A child that ignores SIGTERM: the group gets SIGKILL after the grace.
    command = f"sh -c 'trap \"\" TERM; echo $$ > {pidfile}; while :; do sleep 1; done' & wait"
    agent = CommandAgent(command, timeout_s=1.0, stop_grace_s=1.0)
    with pytest.raises(CommandError, match="ran past its timeout"):
        _run(agent)
    assert _wait_gone(int(pidfile.read_text()))


def test_a_run_ends_with_its_shell_even_while_a_child_it_left_holds_the_output(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    # The background sleep keeps stdout open: waiting for the pipes would wait for it (a
    # regression runs into the timeout and fails, rather than hanging the test).
    agent = CommandAgent(
        f"sh -c 'echo $$ > {pidfile}; exec sleep 600' & while [ ! -s {pidfile} ]; do sleep 0.01; done; echo 0.5",
        timeout_s=120,
    )
    assert _run(agent) == 0.5
    assert _wait_gone(int(pidfile.read_text()))  # stopped with the command's group


def test_a_cancellation_at_any_point_of_the_start_stops_the_process_group(tmp_path: Path) -> None:
    """Cancelled after 0, 1, 2, ... turns of the event loop: before the process exists, while
    asyncio connects its pipes (where asyncio alone would kill the shell and wait for the pipes
    its child holds), and once it runs. Every run ends promptly and leaves nothing running."""

    async def busy_loop() -> None:
        while True:  # each turn of the loop takes 20 ms, as on a busy machine: the child runs meanwhile
            time.sleep(0.02)  # noqa: ASYNC251 (blocking the loop is the point)
            await asyncio.sleep(0)

    async def cancel_after(turns: int, pidfile: Path) -> None:
        agent = CommandAgent(f"sh -c 'echo $$ > {pidfile}; exec sleep 600' & wait", stop_grace_s=5.0)
        task = asyncio.create_task(agent.rollout_async(None, {}, _rollout(None)))
        busy = asyncio.create_task(busy_loop())
        for _ in range(turns):
            await asyncio.sleep(0)
        task.cancel()
        try:
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), 120)  # a hang fails here, not at 600 s
        finally:
            busy.cancel()

    for turns in range(12):
        pidfile = tmp_path / f"child-{turns}.pid"
        asyncio.run(cancel_after(turns, pidfile))
        if pidfile.exists() and pidfile.read_text().strip():
            assert _wait_gone(int(pidfile.read_text())), f"cancelled after {turns} turns, the child lives on"


def test_cancelling_the_attempt_stops_the_process_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    agent = CommandAgent(f"sh -c 'echo $$ > {pidfile}; exec sleep 600' & wait", stop_grace_s=5.0)

    async def cancel_once_started() -> None:
        task = asyncio.create_task(agent.rollout_async(None, {}, _rollout(None)))
        deadline = time.monotonic() + 60
        while not pidfile.exists() or not pidfile.read_text().strip():
            assert time.monotonic() < deadline, "the command never started"
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_once_started())
    assert _wait_gone(int(pidfile.read_text()))
