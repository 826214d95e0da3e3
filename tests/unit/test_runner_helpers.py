"""The runner's pure parts: loading an agent by name, checking what an agent returned."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider

from agl_stream.agent.litagent import FunctionalLitAgent, LitAgent
from agl_stream.models import Span
from consumers.runner import check_result, load_agent


class ClassAgent(LitAgent[str]):
    def rollout(self, task: str, resources: object, rollout: object) -> float:
        return 1.0


INSTANCE = ClassAgent()


def plain(task: str) -> float:
    return 0.0


def test_load_agent_takes_instances_classes_and_functions() -> None:
    assert load_agent("tests.unit.test_runner_helpers:INSTANCE") is INSTANCE
    assert isinstance(load_agent("tests.unit.test_runner_helpers:ClassAgent"), ClassAgent)
    wrapped = load_agent("tests.unit.test_runner_helpers:plain")
    assert isinstance(wrapped, FunctionalLitAgent) and wrapped.func is plain


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon", "pkg.module:name"),
        ("no.such.module:agent", "cannot import"),
        ("tests.unit.test_runner_helpers:missing", "no attribute"),
        ("tests.unit.test_runner_helpers:pytest", "not a LitAgent"),
    ],
)
def test_load_agent_explains_bad_specs(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_agent(spec)


def test_check_result_accepts_what_the_runner_can_record() -> None:
    span = Span(rollout_id="ro-1", attempt_id="at-1", sequence_id=1, trace_id="0" * 32, span_id="0" * 16, name="s")
    provider = TracerProvider()
    with provider.get_tracer("t").start_as_current_span("otel") as otel:
        pass
    for ok in (None, 1.0, 0, -2, [], [span], [otel, span]):
        check_result(ok)
    for bad, message in ((True, "not bool"), ("1.0", "not str"), ({"r": 1}, "not dict"), ([span, 3], "int")):
        with pytest.raises(TypeError, match=message.split()[-1]):
            check_result(bad)


@pytest.mark.parametrize("workers", ["1", "3"])
def test_an_unknown_resources_mode_is_refused_before_any_runner_starts(workers: str) -> None:
    import typer
    from typer.testing import CliRunner

    from agl_stream.cli.roles_cmd import runner
    from agl_stream.config import Settings

    app = typer.Typer()
    app.command()(runner)
    args = ["--agent", "tests.integration.agents:llm_like", "--workers", workers, "--resources", "newest"]
    result = CliRunner().invoke(app, args, obj=Settings())
    assert result.exit_code == 2 and "pinned or latest" in result.output
