"""The Trainer without a cluster: its arguments, refusals before any process starts, how the
agent reaches runner processes (pickled or by name), the stack plan, stopping a role group, and
the summary display."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

import agl_stream as agl
from agl_stream.agent.litagent import FunctionalLitAgent, Hook, LitAgent, rollout
from agl_stream.algorithm import Algorithm, Baseline, ModeReport
from agl_stream.config import Settings
from agl_stream.domain.adapter import AdapterConfig
from agl_stream.errors import AglError, AlgorithmError, ConfigError, DatasetError, TrainerError
from agl_stream.local import stack
from agl_stream.local.processes import RoleGroup
from agl_stream.models import Rollout
from agl_stream.trainer.progress import FitResult, show_summary
from agl_stream.trainer.shipping import as_agent, child_environment, importable_spec, ship
from consumers.runner import load_agent_file

ROLLOUT = Rollout(rollout_id="ro-000000000001", input={"q": 1}, start_time=1.0)


@rollout
def module_agent(task: dict[str, Any]) -> float:
    return float(task["q"])


class LockedAgent(LitAgent[Any]):
    """Holds a lock: cannot be pickled, so runners import it by name."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def rollout(self, task: Any, resources: Any, rollout: Any) -> float:
        return 1.0


LOCKED = LockedAgent()


class CountingHook(Hook):
    def __init__(self, label: str) -> None:
        self.label = label


def _trainer(tmp_path: Path, **options: Any) -> agl.Trainer:
    return agl.Trainer(settings=Settings(data_dir=tmp_path), progress=False, **options)


# -- arguments --------------------------------------------------------------------------------------


def test_the_seeds_arguments_are_taken() -> None:
    hook = CountingHook("h")
    trainer = agl.Trainer(
        algorithm="baseline",
        n_runners=3,
        max_rollouts=5,
        initial_resources={"prompt": agl.PromptTemplate(template="{q}", engine="f-string")},
        adapter={"agent_match": "solver"},
        llm_proxy="http://127.0.0.1:1/v1",
        hooks=hook,
        settings=Settings(),
        progress=False,
    )
    assert isinstance(trainer.algorithm, Baseline) and trainer.n_runners == 3 and trainer.max_rollouts == 5
    assert trainer.adapter == AdapterConfig(agent_match="solver") and trainer.hooks == (hook,)
    assert agl.Trainer(progress=False).adapter == AdapterConfig()  # the seed's default adapter options


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"n_runners": 0}, ConfigError, "n_runners"),
        ({"max_rollouts": 0}, ConfigError, "max_rollouts"),
        ({"runner_concurrency": 0}, ConfigError, "runner_concurrency"),
        ({"cluster": "somewhere"}, ConfigError, "auto, attach or start"),
        ({"adapter": {"no_such_option": 1}}, ConfigError, "adapter"),
        ({"adapter": 3}, ConfigError, "adapter"),
        ({"hooks": ["not a hook"]}, ConfigError, "hooks"),
        ({"algorithm": "nope"}, AlgorithmError, "no algorithm named"),
    ],
)
def test_bad_arguments_are_typed_errors(options: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message) as caught:
        agl.Trainer(progress=False, **options)
    assert isinstance(caught.value, AglError)


def test_dev_takes_fast_algorithms_only(tmp_path: Path) -> None:
    class Slow(Algorithm):
        async def run(self, train_dataset: Any = None, val_dataset: Any = None) -> None: ...

    with pytest.raises(AlgorithmError, match="FastAlgorithm"):
        _trainer(tmp_path, algorithm=Slow()).dev(module_agent, [{"q": 1}])
    assert not (tmp_path / "run").exists(), "refused before anything started"


def test_bad_datasets_and_agents_are_refused_before_anything_starts(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, algorithm=Baseline())
    with pytest.raises(DatasetError, match="train_dataset"):
        trainer.fit(module_agent, {"q": 1})
    with pytest.raises(DatasetError, match="val_dataset"):
        trainer.fit(module_agent, [{"q": 1}], tmp_path / "missing.jsonl")
    with pytest.raises(TrainerError, match="not an agent"):
        trainer.fit(42, [{"q": 1}])
    with pytest.raises(TrainerError, match="import spec"):
        trainer.fit("not a spec", [{"q": 1}])
    assert not (tmp_path / "run").exists() and not (tmp_path / "logs").exists()


def test_fit_refuses_a_running_event_loop(tmp_path: Path) -> None:
    async def inside() -> None:
        _trainer(tmp_path, algorithm=Baseline()).fit(module_agent, [{"q": 1}])

    with pytest.raises(TrainerError, match=r"asyncio\.to_thread"):
        asyncio.run(inside())


# -- how the agent reaches the runners ----------------------------------------------------------------


def test_agents_are_taken_in_every_form_fit_accepts() -> None:
    assert as_agent(module_agent) is module_agent
    assert as_agent("pkg.module:agent") == "pkg.module:agent"
    assert isinstance(as_agent(LockedAgent), LockedAgent)

    def plain(task: Any) -> float:
        return 0.0

    wrapped = as_agent(plain)
    assert isinstance(wrapped, FunctionalLitAgent) and wrapped.func is plain


def test_module_level_agents_have_an_import_spec() -> None:
    assert importable_spec(module_agent) == "tests.unit.test_trainer_api:module_agent"
    assert importable_spec(LOCKED) == "tests.unit.test_trainer_api:LOCKED"
    assert importable_spec(LockedAgent()) is None  # an instance no module holds


def test_a_local_agent_is_pickled_by_value_and_loads_in_a_runner(tmp_path: Path) -> None:
    offset = 10.0  # a closure over local state: only pickling by value carries it

    @rollout
    def local(task: dict[str, Any]) -> float:
        return task["q"] + offset

    local.set_trainer(threading.Thread())  # a weak reference: not carried to the runners
    args = ship(local, [CountingHook("first")], tmp_path / "run")
    assert args == ["--agent-file", str(tmp_path / "run" / "agent.pkl")]
    assert stat.S_IMODE(os.stat(args[1]).st_mode) == 0o600
    agent, hooks = load_agent_file(Path(args[1]))
    assert agent.rollout({"q": 1}, {}, ROLLOUT) == 11.0
    assert [h.label for h in hooks if isinstance(h, CountingHook)] == ["first"]
    with pytest.raises(ValueError, match="no trainer"):
        agent.get_trainer()


def test_an_unpicklable_agent_travels_by_name_or_is_refused(tmp_path: Path) -> None:
    assert ship(LOCKED, [], tmp_path) == ["--agent", "tests.unit.test_trainer_api:LOCKED"]
    with_hooks = ship(LOCKED, [CountingHook("h")], tmp_path)
    agent, hooks = load_agent_file(Path(with_hooks[1]))
    assert agent is LOCKED and len(hooks) == 1  # imported by the runner (here: the same module)
    with pytest.raises(TrainerError, match="cannot be pickled"):
        ship(LockedAgent(), [], tmp_path)
    assert ship("pkg.module:agent", [], tmp_path) == ["--agent", "pkg.module:agent"]


def test_an_agent_file_that_is_not_one_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "agent.pkl"
    path.write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="cannot load the agent"):
        load_agent_file(path)
    with pytest.raises(ValueError, match="cannot read"):
        load_agent_file(tmp_path / "missing.pkl")


def test_runner_processes_import_what_this_process_can() -> None:
    entries = child_environment()["PYTHONPATH"].split(os.pathsep)
    assert all(os.path.isdir(entry) for entry in entries)
    assert {p for p in sys.path if p and os.path.isdir(p)} <= set(entries)


def test_the_runner_command_takes_one_way_to_the_agent() -> None:
    import typer
    from typer.testing import CliRunner

    from agl_stream.cli.roles_cmd import runner

    app = typer.Typer()
    app.command()(runner)
    for args in ([], ["--agent", "a.b:c", "--agent-file", "x.pkl"], ["--agent", "a.b:c", "--command", "true"]):
        result = CliRunner().invoke(app, args, obj=Settings())
        words = " ".join(result.output.replace("│", " ").split())  # the error panel wraps the message
        assert result.exit_code == 2 and "one of --agent, --agent-file or --command" in words, result.output
    result = CliRunner().invoke(app, ["--agent", "a.b:c", "--command-timeout", "5"], obj=Settings())
    assert result.exit_code == 2 and "--command only" in " ".join(result.output.replace("│", " ").split())


# -- the stack and the processes ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "running", "gateway", "plan"),
    [
        ("auto", True, False, "attach"),
        ("auto", False, True, "attach"),
        ("auto", False, False, "start"),
        ("attach", True, False, "attach"),
        ("start", False, True, "start"),
    ],
)
def test_a_run_attaches_to_a_running_cluster_or_starts_one(mode: Any, running: bool, gateway: bool, plan: str) -> None:
    assert stack.session_plan(mode, stack_running=running, gateway_configured=gateway) == plan


def test_impossible_stack_plans_say_why() -> None:
    with pytest.raises(stack.StackError, match="nothing to attach to"):
        stack.session_plan("attach", stack_running=False, gateway_configured=False)
    with pytest.raises(stack.StackError, match="agl-stream down"):
        stack.session_plan("start", stack_running=True, gateway_configured=False)


def _sleeper(*, ignore_term: bool = False) -> subprocess.Popen[bytes]:
    code = "import signal, time\n"
    code += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore_term else ""
    code += "print('up', flush=True)\ntime.sleep(60)\n"  # the child's own work, not synchronisation
    process = subprocess.Popen([sys.executable, "-u", "-c", code], stdout=subprocess.PIPE)
    assert process.stdout is not None and process.stdout.readline() == b"up\n"  # its handlers are set
    return process


def test_a_role_group_stops_newest_first_and_kills_what_ignores_sigterm(tmp_path: Path) -> None:
    group = RoleGroup(Settings(data_dir=tmp_path), tmp_path)
    for name, role, process in (
        ("gateway-like", "llm-proxy", _sleeper()),
        ("runner-0", "runner", _sleeper()),
        ("runner-1", "runner", _sleeper(ignore_term=True)),
    ):
        group.processes[name], group.roles[name] = process, role
    codes = group.stop(timeout=1.0)
    assert codes == {"gateway-like": -signal.SIGTERM, "runner-0": -signal.SIGTERM, "runner-1": -signal.SIGKILL}
    assert group.exited() == codes


# -- the summary -------------------------------------------------------------------------------------------


def test_the_summary_shows_each_mode_from_sql(tmp_path: Path) -> None:
    result = FitResult(
        run_id="fit-1",
        seconds=3.2,
        modes={"train": ModeReport("train", 4, 4, 0, 0, 4, 0.5), "val": ModeReport("val", 2, 1, 1, 0, 0, None)},
        rollout_ids=["a"] * 6,
        policy_version=None,
        stack_started=True,
        log_dir=tmp_path,
    )
    console = Console(record=True, width=140)
    show_summary(console, result)
    text = console.export_text()
    assert "0.5000" in text and "val" in text and "6 rollouts in 3.2s" in text
    assert result.mean_reward("train") == 0.5 and result.mean_reward("test") is None


# -- the processes of a run ----------------------------------------------------------------------------------


class FakeGroup(RoleGroup):
    """Records what a run would start; nothing is started."""

    def __init__(self, tmp_path: Path) -> None:
        super().__init__(Settings(data_dir=tmp_path), tmp_path)
        self.started: list[tuple[str, tuple[str, ...], dict[str, str] | None]] = []
        self.waited: list[tuple[str, str]] = []

    def start(self, *args: str, name: str, env: Any = None) -> Any:
        self.started.append((name, args, env))
        self.roles[name] = args[0]
        return None

    def wait_http(self, name: str, url: str, budget_s: float | None = None) -> None:
        self.waited.append((name, url))


class Streaming(Algorithm):
    """An algorithm that needs roles of its own, as VERL will."""

    runner_resources = "latest"

    def roles(self, settings: Settings) -> list[agl.algorithm.RoleSpec]:
        return [
            agl.algorithm.RoleSpec("triplets", ("triplets", "--settle", "2")),
            agl.algorithm.RoleSpec("inference", ("inference", "--port", "1"), health_url="http://127.0.0.1:1/health"),
        ]


def test_a_run_starts_the_algorithms_roles_then_the_runners(tmp_path: Path) -> None:
    group = FakeGroup(tmp_path)
    trainer = _trainer(tmp_path, n_runners=2, max_rollouts=7, runner_concurrency=3)
    trainer._start_processes(group, Settings(data_dir=tmp_path), Streaming(), "pkg.module:agent", "fit-1")
    assert [name for name, _, _ in group.started] == ["triplets", "inference", "runner-0", "runner-1"]
    assert group.waited == [("inference", "http://127.0.0.1:1/health")]
    _, runner_args, env = group.started[2]
    assert runner_args[:3] == ("runner", "--agent", "pkg.module:agent")
    options = dict(zip(runner_args[3::2], runner_args[4::2], strict=True))
    assert options == {
        "--concurrency": "3",
        "--grace": "10.0",
        "--resources": "latest",
        "--max-rollouts": "7",
        "--worker-id": "fit-1-runner-0",
    }
    assert env is not None and "PYTHONPATH" in env


class Exited:
    def __init__(self, code: int | None) -> None:
        self.returncode = code
        self.pid = 1

    def poll(self) -> int | None:
        return self.returncode


def test_a_process_that_exits_while_needed_ends_the_run_with_its_log(tmp_path: Path) -> None:
    from agl_stream.trainer.trainer import _watch

    group = RoleGroup(Settings(data_dir=tmp_path), tmp_path)
    group.processes = {"inference": Exited(3), "runner-0": Exited(None)}  # type: ignore[dict-item]
    group.roles = {"inference": "inference", "runner-0": "runner"}
    (tmp_path / "inference.log").write_text("CUDA out of memory\n")
    with pytest.raises(TrainerError, match=r"inference exited with code 3(.|\n)*CUDA out of memory"):
        asyncio.run(_watch(group))
    group.processes = {"runner-0": Exited(0), "runner-1": Exited(0)}  # type: ignore[dict-item]
    group.roles = {"runner-0": "runner", "runner-1": "runner"}
    with pytest.raises(TrainerError, match="every runner exited"):
        asyncio.run(_watch(group))
