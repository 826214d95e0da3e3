"""``VERL(config)``: the seed's VERL config keys -> the streaming path's roles and rollouts (pure),
and every key that cannot be used named with why."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

import agl_stream as agl
from agl_stream.algorithm import ALGORITHMS, VERL, make_algorithm
from agl_stream.algorithm.verl_config import (
    RolePlan,
    VerlConfig,
    adapter_flags,
    flatten,
    parse_verl_config,
    train_rounds,
    val_requests,
    validation_due,
    verl_roles,
)
from agl_stream.config import Settings
from agl_stream.domain.adapter import AdapterConfig
from agl_stream.errors import AlgorithmConfigError, ConfigError, DatasetError

# The seed's calc-x style config, the parts that apply here.
NESTED: dict[str, Any] = {
    "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
    "data": {"train_batch_size": 2, "max_prompt_length": 64, "max_response_length": 16},
    "actor_rollout_ref": {
        "rollout": {"n": 3},
        "actor": {
            "ppo_mini_batch_size": 1,
            "optim": {"lr": 1e-3},
            "use_kl_loss": False,
            "kl_loss_coef": 0.0,
            "entropy_coeff": 0,
            "clip_ratio_low": 0.2,
            "clip_ratio_high": 0.3,
        },
    },
    "trainer": {"val_before_train": True, "test_freq": 2, "total_epochs": 2},
}
DOTTED = {
    "algorithm.adv_estimator": "grpo",
    "algorithm.use_kl_in_reward": False,
    "data.train_batch_size": 2,
    "data.max_prompt_length": 64,
    "data.max_response_length": 16,
    "actor_rollout_ref.rollout.n": 3,
    "actor_rollout_ref.actor": {"ppo_mini_batch_size": 1, "optim.lr": 1e-3},  # mixed: nested under a dotted key
    "actor_rollout_ref.actor.use_kl_loss": False,
    "actor_rollout_ref.actor.kl_loss_coef": 0.0,
    "actor_rollout_ref.actor.entropy_coeff": 0,
    "actor_rollout_ref.actor.clip_ratio_low": 0.2,
    "actor_rollout_ref.actor.clip_ratio_high": 0.3,
    "trainer.val_before_train": True,
    "trainer.test_freq": 2,
    "trainer.total_epochs": 2,
}
PLAN = RolePlan(checkpoints=Path("/ckpt"), model_name="agl-tiny", inference_port=9001, proxy_port=9002, linger_s=5.0)


def test_nested_and_dotted_keys_are_the_same_config() -> None:
    config = parse_verl_config(NESTED)
    assert parse_verl_config(DOTTED) == config
    assert config == VerlConfig(
        train_batch_size=2,
        rollout_n=3,
        total_epochs=2,
        test_freq=2,
        val_before_train=True,
        max_prompt_length=64,
        max_response_length=16,
        trainer_options={
            "lr": 1e-3,
            "clip_ratio_low": 0.2,
            "clip_ratio_high": 0.3,
            "entropy_coeff": 0,
            "mini_batch_size": 3,  # VERL counts mini-batches in tasks; the trainer in rows (n per task)
            "max_prompt_length": 64,
            "max_response_length": 16,
        },
    )
    assert config.batch_rollouts == 6


def test_the_config_becomes_the_roles_arguments() -> None:
    roles = verl_roles(parse_verl_config(NESTED), PLAN, AdapterConfig())
    assert [(r.name, r.health_url) for r in roles] == [
        ("triplets", None),
        ("batcher", None),
        ("trainer", None),
        ("inference", "http://127.0.0.1:9001/health"),
        ("llm-proxy", "http://127.0.0.1:9002/health"),
    ]
    args = {r.name: list(r.args) for r in roles}
    assert args["batcher"] == ["batcher", "--group-size", "3", "--max-rollouts", "6", "--linger", "5"]
    assert args["trainer"] == [
        "trainer", "--checkpoints", "/ckpt", "--backend", "torch", "--model-name", "agl-tiny",
        "--proxy-endpoint", "http://127.0.0.1:9002/v1", "--algorithm", "grpo",
        "--clip-ratio-high", "0.3", "--clip-ratio-low", "0.2", "--entropy-coeff", "0", "--lr", "0.001",
        "--max-prompt-length", "64", "--max-response-length", "16", "--mini-batch-size", "3",
    ]  # fmt: skip
    assert args["inference"] == [
        "inference", "--port", "9001", "--model-name", "agl-tiny", "--default-max-tokens", "16",
    ]  # fmt: skip
    assert args["llm-proxy"] == ["llm-proxy", "--port", "9002", "--backend", "agl-tiny=http://127.0.0.1:9001/v1"]
    assert args["triplets"][:3] == ["triplets", "--settle", "2"]


def test_defaults_without_a_config() -> None:
    config = parse_verl_config(None)
    assert config == parse_verl_config({}) == parse_verl_config({"trainer": {}}) == VerlConfig()
    assert (config.train_batch_size, config.rollout_n, config.total_epochs, config.test_freq) == (4, 8, 1, -1)
    args = {r.name: list(r.args) for r in verl_roles(config, PLAN, AdapterConfig())}
    # What the config does not set is the roles' own defaults (the tiny policy's learning rate).
    assert "--lr" not in args["trainer"] and "--initial-model" not in args["trainer"]
    assert args["batcher"][:5] == ["batcher", "--group-size", "8", "--max-rollouts", "32"]


def test_a_model_path_is_the_trainers_initial_model_and_the_served_one() -> None:
    config = parse_verl_config({"actor_rollout_ref.model.path": "/models/qwen", "algorithm.adv_estimator": "rloo"})
    args = {r.name: list(r.args) for r in verl_roles(config, PLAN, AdapterConfig())}
    assert args["trainer"][-4:] == ["--initial-model", "/models/qwen", "--adv-estimator", "rloo"]
    assert args["inference"][-2:] == ["--model", "/models/qwen"]


def test_every_key_that_cannot_be_used_is_named_at_once_with_why() -> None:
    config = {
        **NESTED,
        "trainer": {**NESTED["trainer"], "n_gpus_per_node": 8, "logger": ["console", "swanlab"], "totl_epochs": 3},
        "actor_rollout_ref": {
            **NESTED["actor_rollout_ref"],
            "rollout": {"n": 0, "name": "vllm", "gpu_memory_utilization": 0.6},
            "ref": {"log_prob_micro_batch_size_per_gpu": 8},
            "model": {"path": "/m", "enable_gradient_checkpointing": True},
        },
        "critic": {"optim": {"lr": 1e-5}},
        "my_section": {"x": 1},
        "algorithm.adv_estimator": "gae",
    }
    config["algorithm"] = {"use_kl_in_reward": True, "kl_ctrl": {"kl_coef": 0.001}}
    with pytest.raises(AlgorithmConfigError) as info:
        parse_verl_config(config)
    problems = info.value.problems
    assert set(problems) == {
        "trainer.n_gpus_per_node",
        "trainer.logger",
        "trainer.totl_epochs",
        "actor_rollout_ref.rollout.n",
        "actor_rollout_ref.rollout.name",
        "actor_rollout_ref.rollout.gpu_memory_utilization",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
        "actor_rollout_ref.model.enable_gradient_checkpointing",
        "critic.optim.lr",
        "my_section.x",
        "algorithm.adv_estimator",
        "algorithm.use_kl_in_reward",
        "algorithm.kl_ctrl.kl_coef",
    }
    assert problems["trainer.totl_epochs"] == "unknown key; did you mean trainer.total_epochs?"
    assert problems["my_section.x"] == "unknown key"
    assert problems["actor_rollout_ref.rollout.n"] == "must be at least 1, got 0"
    assert "torchrun" in problems["trainer.n_gpus_per_node"]
    assert "trainer_steps" in problems["trainer.logger"]
    assert "rollout.n (the group size) applies" in problems["actor_rollout_ref.rollout.name"]
    assert "no reference policy" in problems["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"]
    assert "no critic" in problems["critic.optim.lr"]
    assert "need a critic" in problems["algorithm.adv_estimator"]
    for key in ("algorithm.use_kl_in_reward", "algorithm.kl_ctrl.kl_coef"):
        assert "reference policy" in problems[key] and "does not apply" in problems[key]
    # The message lists every key, so one run shows them all.
    assert all(key in str(info.value) for key in problems)
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("key", "value", "accepted"),
    [
        ("algorithm.use_kl_in_reward", False, True),
        ("algorithm.use_kl_in_reward", True, False),
        ("actor_rollout_ref.actor.use_kl_loss", False, True),
        ("actor_rollout_ref.actor.use_kl_loss", True, False),
        ("actor_rollout_ref.actor.kl_loss_coef", 0, True),
        ("actor_rollout_ref.actor.kl_loss_coef", 0.001, False),
        ("actor_rollout_ref.actor.kl_loss_type", "low_var_kl", False),
        ("algorithm.kl_ctrl.kl_coef", 0.0, True),
        ("algorithm.kl_ctrl.type", "fixed", False),
        ("trainer.critic_warmup", 0, True),
        ("trainer.critic_warmup", 5, False),
        ("data.val_batch_size", None, True),
        ("data.val_batch_size", 64, False),
    ],
)
def test_kl_and_other_switches_are_accepted_only_when_they_change_nothing(key: str, value: Any, accepted: bool) -> None:
    if accepted:
        assert parse_verl_config({key: value}) == VerlConfig()
        return
    with pytest.raises(AlgorithmConfigError) as info:
        parse_verl_config({key: value})
    assert list(info.value.problems) == [key]


@pytest.mark.parametrize(
    ("config", "key", "message"),
    [
        ({"data.train_batch_size": True}, "data.train_batch_size", "must be an integer"),
        ({"data.train_batch_size": "8"}, "data.train_batch_size", "must be an integer"),
        ({"actor_rollout_ref.actor.optim.lr": 0}, "actor_rollout_ref.actor.optim.lr", "must be above 0"),
        ({"actor_rollout_ref.actor.optim.lr": float("nan")}, "actor_rollout_ref.actor.optim.lr", "finite"),
        ({"actor_rollout_ref.actor.loss_agg_mode": "mean"}, "actor_rollout_ref.actor.loss_agg_mode", "not one of"),
        (
            {"actor_rollout_ref.actor.clip_ratio": 0.2, "actor_rollout_ref.actor.clip_ratio_high": 0.3},
            "actor_rollout_ref.actor.clip_ratio",
            "not both",
        ),
        (
            {"data.train_batch_size": 2, "actor_rollout_ref.actor.ppo_mini_batch_size": 4},
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            "more than data.train_batch_size",
        ),
        ({"trainer": {"total_epochs": 1}, "trainer.total_epochs": 2}, "trainer.total_epochs", "given twice"),
    ],
)
def test_bad_values_are_named(config: dict[str, Any], key: str, message: str) -> None:
    with pytest.raises(AlgorithmConfigError) as info:
        parse_verl_config(config)
    assert message in info.value.problems[key]


def test_flatten_keeps_leaf_values_that_are_lists() -> None:
    assert flatten({"a": {"b.c": [1, 2], "d": {}}}) == {"a.b.c": [1, 2]}


def test_verls_rollout_correction_reaches_the_trainer() -> None:
    """VERL 0.9's algorithm.rollout_correction names: rollout_is (None switches the correction off)
    and a numeric rollout_is_threshold become the trainer's options; the others only as no-ops."""
    corr = "algorithm.rollout_correction"
    config = parse_verl_config({f"{corr}.rollout_is": "sequence", f"{corr}.rollout_is_threshold": 3.0})
    assert config.trainer_options == {"rollout_is": "sequence", "rollout_is_threshold": 3.0}
    assert parse_verl_config({corr: {"rollout_is": None}}).trainer_options == {"off_policy_correction": "none"}
    trainer = next(r.args for r in verl_roles(config, PLAN, AdapterConfig()) if r.name == "trainer")
    assert trainer[-4:] == ("--rollout-is", "sequence", "--rollout-is-threshold", "3.0")
    assert parse_verl_config({f"{corr}.rollout_rs": None, f"{corr}.bypass_mode": False}) == VerlConfig()
    assert parse_verl_config({"actor_rollout_ref.actor.loss_agg_mode": "rollout-mean"}).trainer_options == {
        "loss_agg_mode": "rollout-mean"
    }
    with pytest.raises(AlgorithmConfigError) as info:
        parse_verl_config(
            {
                f"{corr}.rollout_is": "turn",
                f"{corr}.rollout_is_threshold": "0.5_5.0",
                f"{corr}.rollout_rs": "token_k1",
                f"{corr}.bypass_mode": True,
            }
        )
    problems = info.value.problems
    assert "not one of" in problems[f"{corr}.rollout_is"]
    assert "IcePop" in problems[f"{corr}.rollout_is_threshold"]
    assert "rejection sampling" in problems[f"{corr}.rollout_rs"]
    assert "decoupled" in problems[f"{corr}.bypass_mode"]


# -- what is enqueued --------------------------------------------------------------------------


def test_rounds_hold_train_batch_size_tasks_each_repeated_n_times_in_its_own_group() -> None:
    config = parse_verl_config(
        {"data.train_batch_size": 2, "actor_rollout_ref.rollout.n": 3, "trainer.total_epochs": 2}
    )
    train = [{"q": i} for i in range(3)]
    rounds = train_rounds(train, config, "run")
    # Epochs end to end, then cut: 6 tasks in rounds of 2; only the last round could be short.
    assert [len(r) for r in rounds] == [6, 6, 6]
    for requests in rounds:
        assert all(r["mode"] == "train" for r in requests)
        groups = [r["metadata"]["group_id"] for r in requests]
        assert groups[0:3] == [groups[0]] * 3 and groups[3:6] == [groups[3]] * 3 and groups[0] != groups[3]
        assert requests[0]["input"] == requests[2]["input"]
    tasks = [r["input"]["q"] for requests in rounds for r in requests[::3]]
    assert sorted(tasks[:3]) == sorted(tasks[3:]) == [0, 1, 2]  # each epoch runs every task once
    assert len({r["metadata"]["group_id"] for requests in rounds for r in requests}) == 6
    assert train_rounds(train, config, "run") == rounds  # the seed's order: same seed, same rounds
    unshuffled = train_rounds(train, parse_verl_config({"data.shuffle": False, "data.train_batch_size": 2}), "r")
    assert [[r["input"]["q"] for r in requests[::8]] for requests in unshuffled] == [[0, 1], [2]]


def test_total_training_steps_keeps_the_first_rounds() -> None:
    config = parse_verl_config(
        {"data.train_batch_size": 1, "trainer.total_training_steps": 2, "trainer.total_epochs": 5}
    )
    assert len(train_rounds([{"q": 1}, {"q": 2}], config, "t")) == 2


def test_validation_runs_every_task_once_as_val() -> None:
    requests = val_requests(["a", "b"], "run", 3)
    assert [(r["input"], r["mode"]) for r in requests] == [("a", "val"), ("b", "val")]
    assert requests[0]["metadata"]["group_id"] != requests[1]["metadata"]["group_id"]
    assert "val3" in requests[0]["metadata"]["group_id"]


def test_validation_is_due_every_test_freq_versions() -> None:
    every_two = parse_verl_config({"trainer.test_freq": 2})
    assert [validation_due(every_two, v, 0) for v in range(4)] == [False, False, True, True]
    assert not validation_due(parse_verl_config({"trainer.test_freq": 0}), 10, 0)
    assert not validation_due(VerlConfig(), 10, 0)  # -1, VERL's default: never during training


# -- the adapter and the algorithm object ------------------------------------------------------


def test_adapter_settings_become_the_triplet_builders_flags() -> None:
    adapter = AdapterConfig(llm_call_match="chat", agent_match="solver", exclude_llm_call_in_reward=False)
    assert adapter_flags(adapter) == [
        "--llm-call-match", "chat", "--agent-match", "solver", "--reward-match", "first_occurrence",
        "--no-exclude-llm-call-in-reward",
    ]  # fmt: skip
    with pytest.raises(ConfigError, match="final_reward_to_last"):
        adapter_flags(AdapterConfig(final_reward_to_last=True))
    assert adapter_flags(AdapterConfig(aggregation="trajectory"))[-2:] == ["--aggregation", "trajectory"]
    assert "--aggregation" not in adapter_flags(AdapterConfig())  # the default: the flag's own default


def test_trace_aggregation_reaches_the_triplet_builder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Agent Lightning's agentlightning.trace_aggregator.level, or Trainer(adapter=...)'s aggregation,
    becomes the builder's --aggregation, which its real command turns back into the adapter's."""
    import processors.triplets
    from agl_stream.cli import commands

    started: dict[str, Any] = {}
    monkeypatch.setattr(processors.triplets, "main", lambda settings, **kw: started.update(kw))
    app = typer.Typer()

    @app.callback()
    def root(ctx: typer.Context) -> None:
        ctx.obj = Settings(data_dir=tmp_path)

    commands.register(app)
    level = "agentlightning.trace_aggregator.level"
    nested = {"agentlightning": {"trace_aggregator": {"level": "trajectory"}}}
    assert parse_verl_config(nested) == VerlConfig(aggregation="trajectory")
    cases: list[tuple[dict[str, Any], AdapterConfig]] = [
        (nested, AdapterConfig(agent_match="solver")),
        ({}, AdapterConfig(aggregation="trajectory")),
    ]
    for config, adapter in cases:
        triplets = next(r.args for r in verl_roles(parse_verl_config(config), PLAN, adapter) if r.name == "triplets")
        assert triplets[-2:] == ("--aggregation", "trajectory")
        result = CliRunner().invoke(app, list(triplets))
        assert result.exit_code == 0, result.output
        assert started["adapter"] == adapter.model_copy(update={"aggregation": "trajectory"})
    # Transition (the builder's own default) adds no flag; a level the adapter contradicts, or an
    # unknown one, is refused.
    roles = verl_roles(parse_verl_config({level: "transition"}), PLAN, AdapterConfig())
    assert roles[0].name == "triplets" and "--aggregation" not in roles[0].args
    # Without a level, trajectory is VERL's default, unless the adapter sets its own aggregation.
    roles = verl_roles(parse_verl_config({}), PLAN, AdapterConfig(agent_match="solver"))
    assert roles[0].args[-2:] == ("--aggregation", "trajectory")
    roles = verl_roles(parse_verl_config({}), PLAN, AdapterConfig(aggregation="transition"))
    assert "--aggregation" not in roles[0].args
    with pytest.raises(ConfigError, match="set one of them"):
        verl_roles(parse_verl_config({level: "transition"}), PLAN, AdapterConfig(aggregation="trajectory"))
    with pytest.raises(AlgorithmConfigError) as info:
        parse_verl_config({level: "episode"})
    assert "not one of" in info.value.problems[level]


def test_verl_is_registered_by_name_and_refuses_the_seeds_class_overrides() -> None:
    assert ALGORITHMS["verl"] is VERL and ALGORITHMS["grpo"] is VERL and agl.VERL is VERL
    made = make_algorithm({"name": "verl", "config": {"actor_rollout_ref": {"rollout": {"n": 2}}}})
    assert isinstance(made, VERL) and made.config.rollout_n == 2 and made.runner_resources == "latest"
    assert isinstance(make_algorithm("grpo"), VERL)
    with pytest.raises(AlgorithmConfigError, match="trainer_cls"):
        VERL({}, trainer_cls=object)
    with pytest.raises(AlgorithmConfigError, match="ray_kwargs"):
        make_algorithm({"name": "verl", "config": {"ray_kwargs": {"ray_init": {"num_cpus": 4}}}})


def test_roles_choose_ports_and_checkpoints_and_check_the_model_folder(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    algorithm = VERL({"data.train_batch_size": 1}, linger_s=1.5)
    roles = {r.name: r.args for r in algorithm.roles(settings)}
    plan = algorithm.plan
    assert plan is not None and plan.checkpoints == tmp_path / "checkpoints" / "verl-agl-tiny"
    assert plan.inference_port != plan.proxy_port
    assert roles["batcher"][-2:] == ("--linger", "1.5")
    assert f"http://127.0.0.1:{plan.proxy_port}/v1" in roles["trainer"]

    with pytest.raises(ConfigError, match=r"config\.json"):
        VERL({"actor_rollout_ref.model.path": str(tmp_path / "missing")}).roles(settings)
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    algorithm = VERL({"actor_rollout_ref.model.path": str(model), "trainer.default_local_dir": str(tmp_path / "c")})
    roles = {r.name: r.args for r in algorithm.roles(settings)}
    assert algorithm.plan is not None and algorithm.plan.model_name == "my-model"
    assert roles["trainer"][:3] == ("trainer", "--checkpoints", str(tmp_path / "c"))


def test_the_roles_arguments_parse_with_the_real_commands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each role's arguments, given to its real `agl-stream` command (the role's main replaced)."""
    import consumers.inference
    import consumers.trainer
    import processors.batcher
    import processors.triplets
    from agl_stream.cli import commands

    started: dict[str, Any] = {}
    monkeypatch.setattr(consumers.trainer, "main", lambda settings, options: started.update(trainer=options))
    monkeypatch.setattr(processors.batcher, "main", lambda settings, policy, **kw: started.update(batcher=policy))
    monkeypatch.setattr(processors.triplets, "main", lambda settings, **kw: started.update(triplets=kw))
    monkeypatch.setattr(consumers.inference, "main", lambda *a, **kw: started.update(inference=kw))
    app = typer.Typer()  # the real sub-commands on an app of the test's own

    @app.callback()
    def root(ctx: typer.Context) -> None:
        ctx.obj = Settings(data_dir=tmp_path)

    commands.register(app)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    given = {**NESTED, "algorithm": {"adv_estimator": "rloo"}, "actor_rollout_ref.model.path": str(model)}
    config = parse_verl_config(given)
    adapter = AdapterConfig(agent_match="solver", exclude_llm_call_in_reward=False)
    for role in verl_roles(config, PLAN, adapter):
        if role.name == "llm-proxy":
            continue  # its module loads LiteLLM; its two options are checked above
        result = CliRunner().invoke(app, list(role.args))
        assert result.exit_code == 0, (role.name, result.output)
    trainer = started["trainer"]
    assert (trainer.lr, trainer.clip_ratio_low, trainer.clip_ratio_high, trainer.mini_batch_size) == (1e-3, 0.2, 0.3, 3)
    assert (trainer.adv_estimator, trainer.initial_model, trainer.max_response_length) == ("rloo", model, 16)
    assert (started["batcher"].group_size, started["batcher"].max_rollouts, started["batcher"].linger_s) == (3, 6, 5.0)
    # No trace_aggregator.level and no aggregation of the adapter's own: trajectory, VERL's default.
    assert started["triplets"]["adapter"] == adapter.model_copy(update={"aggregation": "trajectory"})
    assert (started["inference"]["checkpoint"], started["inference"]["default_max_tokens"]) == (model, 16)


# -- the run, against a store of the test's own -----------------------------------------------


class _FakeSide:
    def __init__(self, store: _FakeStore) -> None:
        self.store = store

    async def query(self, sql: str, parameters: Any = None, **_: Any) -> Any:
        from agl_stream.store.readside import QueryResult

        ids = list(parameters["ids"])
        if "batches" in sql:  # every training rollout batched (one batch each), as the trainer took them
            return QueryResult(["batch_id", "rollout_ids"], [[f"tb-{rid}", [rid]] for rid in ids])
        versions = [self.store.ran_on[rid] for rid in ids]
        return QueryResult(["low", "high"], [[min(versions), max(versions)]])


class _FakeStore:
    """Rollouts finish when waited for; every finished training round makes one policy version."""

    def __init__(self, settings: Settings, proxy_url: str) -> None:
        self.settings = settings
        self.proxy_url = proxy_url
        self.side = _FakeSide(self)
        self.version = 0
        self.modes: dict[str, str] = {}
        self.ran_on: dict[str, int] = {}

    async def enqueue_many_rollouts(self, requests: list[dict[str, Any]]) -> list[Any]:
        from types import SimpleNamespace

        made = []
        for request in requests:
            rid = f"ro-{len(self.modes):012x}"
            self.modes[rid] = request["mode"]
            self.ran_on[rid] = self.version
            made.append(SimpleNamespace(rollout_id=rid))
        return made

    async def wait_for_rollouts(self, *, rollout_ids: list[str], timeout: float | None) -> list[str]:
        await asyncio.sleep(0)  # other tasks run, as while real rollouts run
        if self.modes[rollout_ids[0]] == "train":
            self.version += 1
        return rollout_ids

    async def get_latest_resources(self) -> Any:
        from agl_stream.models import ModelCheckpoint, ProxyLLM, ResourcesUpdate

        checkpoint = ModelCheckpoint(uri="/c", model="agl-tiny", policy_version=self.version)
        policy = ProxyLLM(endpoint=self.proxy_url, model="agl-tiny")
        resources = {"checkpoint": checkpoint, "policy": policy}
        return ResourcesUpdate(resources_id="rs-1", create_time=0, update_time=0, version=1, resources=resources)


async def _fake_rewards(store: _FakeStore, ids: list[str], **_: Any) -> dict[str, Any]:
    from agl_stream.algorithm import ModeReport

    reports = {}
    for mode in {store.modes[rid] for rid in ids}:
        n = sum(store.modes[rid] == mode for rid in ids)
        reports[mode] = ModeReport(mode, n, n, 0, 0, n, 0.5)
    return reports


@pytest.mark.parametrize(("test_freq", "expected"), [(2, [0, 2, 4, 5]), (1, [0, 1, 2, 3, 4, 5]), (-1, [0])])
def test_the_run_validates_first_every_test_freq_versions_and_on_the_final_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, test_freq: int, expected: list[int]
) -> None:
    import agl_stream.algorithm.verl as verl_module

    async def no_fence(*_: Any) -> dict[str, Any]:
        return {}

    monkeypatch.setattr(verl_module, "POLL_S", 0.0)
    monkeypatch.setattr(verl_module, "fence_at_end", no_fence)
    monkeypatch.setattr(verl_module, "rewards_by_mode", _fake_rewards)
    monkeypatch.setattr(verl_module, "_batches_taken", lambda _: {f"tb-ro-{i:012x}" for i in range(100)})
    config = {"data.train_batch_size": 1, "actor_rollout_ref.rollout.n": 2, "trainer.test_freq": test_freq}
    algorithm = VERL({**config, "data.shuffle": False})
    algorithm.plan = PLAN
    store = _FakeStore(Settings(data_dir=tmp_path), PLAN.proxy_url)
    algorithm.set_store(store)

    async def run() -> None:
        await algorithm.run(train_dataset=[{"q": i} for i in range(5)], val_dataset=["v1", "v2"])
        assert {t for t in asyncio.all_tasks() if t is not asyncio.current_task()} == set()  # nothing left running

    asyncio.run(run())
    versions = [v.policy_version for v in algorithm.validations]
    # At most one validation in flight: a threshold crossed meanwhile starts the next when it ends,
    # so the versions between are not always exact multiples; the first is before training, the
    # last on the final policy (however close to the one before, as the seed does on its last step).
    assert versions[0] == 0 and versions[-1] == (5 if test_freq > 0 else 0)
    assert versions == sorted(set(versions)) and set(versions) <= set(expected)
    assert all(b - a >= test_freq for a, b in itertools.pairwise(versions[:-1]))
    assert all(v.rollouts == 2 and v.mean_reward == 0.5 for v in algorithm.validations)
    assert algorithm.policy_version == 5 and set(algorithm.report) == {"train", "val"}
    assert sum(mode == "train" for mode in store.modes.values()) == 10  # 5 tasks x rollout.n


def test_the_run_needs_its_processes_and_data(tmp_path: Path) -> None:
    algorithm = VERL()
    algorithm.set_store(_FakeStore(Settings(data_dir=tmp_path), PLAN.proxy_url))
    with pytest.raises(agl.algorithm.MissingComponentError, match=r"Trainer\.fit"):
        asyncio.run(algorithm.run(train_dataset=[1]))
    algorithm.plan = PLAN
    with pytest.raises(DatasetError, match="train_dataset"):
        asyncio.run(algorithm.run(train_dataset=[]))
    with pytest.raises(DatasetError, match="val_dataset"):
        asyncio.run(_val_only(tmp_path))


async def _val_only(tmp_path: Path) -> None:
    algorithm = VERL({"trainer.val_only": True})
    algorithm.plan = PLAN
    algorithm.set_store(_FakeStore(Settings(data_dir=tmp_path), PLAN.proxy_url))
    await algorithm.run(train_dataset=[1], val_dataset=[])
