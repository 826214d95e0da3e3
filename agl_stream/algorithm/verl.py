"""``VERL(config)``: the seed's VERL algorithm (GRPO) over the streaming path.

The seed's VERL runs a synchronous loop: roll out a batch, compute advantages, update the
actor, repeat, validating every ``test_freq`` steps. Here each of those jobs is a role
(:func:`agl_stream.algorithm.verl_config.verl_roles`): the runners roll out, the triplet
builder turns each finished attempt into training samples, the batcher forms GRPO batches of
up to ``train_batch_size`` tasks times ``rollout.n`` samples (whole groups; batches form per
partition of agl.triplets, so a short one goes out after ``linger_s``), the trainer updates the
policy and publishes each version, the inference server loads it, and the LLM proxy records
every call.
This algorithm only decides what to enqueue and when, streaming as ``agl-stream demo`` does:
rounds of tasks stay in flight while the trainer trains, and runners take the newest policy at
claim time (``runner_resources = "latest"``).

Validation: every ``trainer.test_freq`` policy versions (and before training, and after the
last step, as the seed does) the validation set is enqueued once with mode ``val``. Those
rollouts carry their mode into their triplet records, and the batcher refuses them (counted:
``batches.dropped_eval``), so validation is never trained on. Each validation's mean reward is
read with SQL, printed, and kept in :attr:`VERL.validations`; per policy version it is in
ClickHouse (``reward_by_mode_and_version``). With ``trainer.logger`` naming experiment trackers,
each validation is also recorded there (``val/...`` at the validated policy version, run
``<experiment_name>-validation``), beside the trainer role's steps.

Concurrency model: one ``run`` at a time per instance, on the Trainer run's event loop; at most
one validation is in flight (a threshold crossed meanwhile starts the next when it ends).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agl_stream.algorithm.base import Algorithm, MissingComponentError, RoleSpec, RunnerResources
from agl_stream.algorithm.report import ModeReport, rewards_by_mode
from agl_stream.algorithm.verl_config import (
    InferenceEngine,
    RolePlan,
    VerlConfig,
    parse_verl_config,
    train_rounds,
    val_requests,
    validation_due,
    verl_roles,
)
from agl_stream.config import Settings
from agl_stream.domain.adapter import AdapterConfig
from agl_stream.errors import AlgorithmConfigError, ConfigError, DatasetError
from agl_stream.kafka.offsets import fence_at_end
from agl_stream.logs import get_logger
from agl_stream.models import ProxyLLM, ResourcesUpdate
from agl_stream.ports import free_ports
from agl_stream.rl_options import BackendKind, TrainerOptions

if TYPE_CHECKING:
    from agl_stream.training.tracking import Tracking

log = get_logger("agl.algorithm.verl")

POLL_S = 1.0
"""Seconds between looks at the training's progress while nothing else wakes the run: the
policy version (the store client's resources follower), the batches (a fenced SQL read) and the
trainer's progress file."""

BATCHED_SQL = "SELECT batch_id, rollout_ids FROM {db}.batches FINAL WHERE hasAny(rollout_ids, {{ids:Array(String)}})"

VERSIONS_SQL = (
    "SELECT min(policy_version) AS low, max(policy_version) AS high "
    "FROM {db}.rollouts FINAL WHERE rollout_id IN {{ids:Array(String)}}"
)


@dataclass(frozen=True)
class Validation:
    """One pass over the validation set.

    ``policy_version``: the newest version when it was enqueued. Runners take the newest version
    at claim time while the trainer goes on training, so its rollouts ran on versions
    ``min_version`` .. ``max_version`` (from the rollouts table).
    """

    number: int
    policy_version: int
    rollouts: int
    succeeded: int
    mean_reward: float | None
    min_version: int | None
    max_version: int | None
    seconds: float


class VERL(Algorithm):
    """GRPO on the streaming path, configured with the seed's VERL config keys.

    Args:
        config: the seed's VERL config (nested mappings, dotted keys, or both); see
            :mod:`agl_stream.algorithm.verl_config` for the keys that apply and what they set.
            A key that does not apply here, an unknown key or a bad value is an
            :class:`~agl_stream.errors.AlgorithmConfigError` naming it.
        trainer_cls, daemon_cls: the seed's experimental overrides; only None is accepted.
        backend: the trainer role's policy backend, "torch" (one process, CPU or one GPU) or
            "verl" (VERL's FSDP engine).
        inference_engine: "cpu" (the inference role's own server) or "vllm" (vLLM's OpenAI server,
            restarted on every published policy version; needs ``actor_rollout_ref.model.path``).
        vllm_args: more arguments for vLLM's server (``"--gpu-memory-utilization=0.5"`` ...).
        model_name: the name the policy is served and published under (default: the model
            folder's name, or "agl-tiny" for the built-in tiny policy).
        linger_s: seconds the batcher waits before a short batch goes out (the run's last one).
        settle_s: seconds the triplet builder waits for an attempt's late spans.
        rounds_in_flight: rounds of ``train_batch_size`` tasks enqueued and unfinished at once.
        timeout: seconds to wait for one round's rollouts (None: as long as they take).
        drain_timeout_s: after the last round, seconds to wait until every training rollout is in
            a batch the trainer took.
        startup_timeout_s: seconds to wait for the trainer's first policy version.

    After ``run``: ``validations`` (one :class:`Validation` per pass), ``report`` (rollouts
    and mean reward per mode) and ``policy_version`` (the newest one).
    """

    runner_resources: RunnerResources = "latest"

    def __init__(
        self,
        config: Mapping[str, Any] | None = None,
        trainer_cls: Any = None,
        daemon_cls: Any = None,
        *,
        backend: BackendKind = "torch",
        inference_engine: InferenceEngine = "cpu",
        vllm_args: Sequence[str] = (),
        model_name: str | None = None,
        linger_s: float = 30.0,
        settle_s: float = 2.0,
        rounds_in_flight: int = 2,
        timeout: float | None = None,
        drain_timeout_s: float = 300.0,
        startup_timeout_s: float = 600.0,
    ) -> None:
        if trainer_cls is not None or daemon_cls is not None:
            raise AlgorithmConfigError(
                "VERL", {"trainer_cls/daemon_cls": "no VERL trainer or daemon class here: roles do the work"}
            )
        if backend not in ("torch", "verl"):
            raise ConfigError(f"backend must be 'torch' or 'verl', not {backend!r}")
        if inference_engine not in ("cpu", "vllm"):
            raise ConfigError(f"inference_engine must be 'cpu' or 'vllm', not {inference_engine!r}")
        if rounds_in_flight < 1:
            raise ConfigError(f"rounds_in_flight must be at least 1, got {rounds_in_flight}")
        for name, value in (("linger_s", linger_s), ("settle_s", settle_s), ("drain_timeout_s", drain_timeout_s)):
            if value < 0:
                raise ConfigError(f"{name} must not be negative, got {value}")
        self.config: VerlConfig = parse_verl_config(config)
        self.backend: BackendKind = backend
        self.inference_engine: InferenceEngine = inference_engine
        self.vllm_args = tuple(vllm_args)
        self.model_name = model_name
        self.linger_s = linger_s
        self.settle_s = settle_s
        self.rounds_in_flight = rounds_in_flight
        self.timeout = timeout
        self.drain_timeout_s = drain_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.validations: list[Validation] = []
        self.report: dict[str, ModeReport] = {}
        self.policy_version: int | None = None
        self.plan: RolePlan | None = None  # set by roles(): where this run's processes live

    # -- the processes ------------------------------------------------------------------------

    def roles(self, settings: Settings) -> Sequence[RoleSpec]:
        config = self.config
        model_path = None
        if config.model_path is not None:
            model_path = Path(config.model_path).expanduser().resolve()
            if not (model_path / "config.json").is_file():
                raise ConfigError(
                    f"actor_rollout_ref.model.path: {model_path} is not a local Hugging Face model folder "
                    "(no config.json); download the model first (huggingface-cli download ... --local-dir)"
                )
            config = replace(config, model_path=str(model_path))
        name = self.model_name or (model_path.name if model_path is not None else "agl-tiny")
        if config.checkpoints is not None:
            checkpoints = Path(config.checkpoints).expanduser().resolve()
        else:
            # One folder per model: a later run on the same cluster resumes that policy (as the
            # seed's VERL resumes from default_local_dir), and its progress file keeps the
            # trainer from training on batches an earlier run already trained on.
            checkpoints = settings.data_dir / "checkpoints" / f"verl-{name}"
        inference_port, proxy_port = free_ports(2)
        self.plan = RolePlan(
            checkpoints=checkpoints,
            model_name=name,
            inference_port=inference_port,
            proxy_port=proxy_port,
            backend=self.backend,
            linger_s=self.linger_s,
            settle_s=self.settle_s,
            inference_engine=self.inference_engine,
            vllm_args=self.vllm_args,
        )
        adapter = self._adapter if self._adapter is not None else AdapterConfig()
        return verl_roles(config, self.plan, adapter)

    # -- the run ------------------------------------------------------------------------------

    async def run(self, train_dataset: Sequence[Any] | None = None, val_dataset: Sequence[Any] | None = None) -> None:
        store = self.get_store()
        plan = self.plan
        if plan is None:
            raise MissingComponentError("VERL runs under Trainer.fit, which starts the processes roles() names")
        config = self.config
        train, val = list(train_dataset or []), list(val_dataset or [])
        if not train and not config.val_only:
            raise DatasetError("VERL needs a train_dataset with at least one task (or trainer.val_only)")
        if config.val_only and not val:
            raise DatasetError("trainer.val_only needs a val_dataset with at least one task")
        if self.get_initial_resources() is not None:
            log.warning(
                "initial_resources are not published by VERL: runners use the trainer's policy snapshots "
                "(resources 'policy' and 'checkpoint')"
            )
        self.validations, self.report = [], {}
        started = time.monotonic()
        run = _Run(self, store, plan, val, tag=f"verl-{uuid.uuid4().hex[:8]}")
        run.tracking = _validation_tracking(config, plan)
        version = await run.first_version(self.startup_timeout_s)
        log.info("policy ready", version=version, proxy=plan.proxy_url, checkpoints=str(plan.checkpoints))
        try:
            if config.val_only:
                await run.validate(version)
            else:
                if val and config.val_before_train:
                    run.start_validation(version)
                await run.train(train_rounds(train, config, run.tag))
                await run.drain(self.drain_timeout_s)
                await run.last_validation()
        finally:
            await run.cancel()
            if run.tracking is not None:
                await asyncio.to_thread(run.tracking.close)
        self.report = await rewards_by_mode(store, run.rollout_ids)
        for mode, report in self.report.items():
            log.info(
                "verl rewards",
                mode=mode or "none",
                rollouts=report.rollouts,
                mean_reward=report.mean_reward,
                policy_version=self.policy_version,
                seconds=round(time.monotonic() - started, 1),
            )

    def say(self, message: str) -> None:
        """A line on the Trainer's console (when it shows progress) and in the log."""
        log.info(message)
        trainer = self._trainer_ref() if self._trainer_ref is not None else None
        console = getattr(trainer, "console", None)
        if console is not None and getattr(trainer, "progress", False):
            console.print(message)


class _Run:
    """The state of one ``VERL.run``: rollouts made, the version seen, the validation in flight."""

    def __init__(self, algorithm: VERL, store: Any, plan: RolePlan, val: list[Any], *, tag: str) -> None:
        self.algorithm = algorithm
        self.config = algorithm.config
        self.store = store
        self.plan = plan
        self.val = val
        self.tag = tag
        self.rollout_ids: list[str] = []
        self.train_ids: list[str] = []
        self.version = 0
        self.last_validated: int | None = None
        self.validation: asyncio.Task[Validation] | None = None
        self.tracking: Tracking | None = None  # trainer.logger: each validation to the trackers

    async def first_version(self, timeout: float) -> int:
        """Wait for the policy snapshot this run's trainer publishes at start (it names this run's
        proxy: an older snapshot on a shared cluster does not count)."""
        deadline = time.monotonic() + timeout
        while True:
            latest = await self.store.get_latest_resources()
            if _serves(latest, self.plan.proxy_url):
                assert latest is not None
                self.version = latest.policy_version or 0
                self.algorithm.policy_version = self.version
                self.last_validated = None if self.config.val_before_train else self.version
                return self.version
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the trainer published no policy within {timeout:.0f}s (see trainer.log in the run's log folder)"
                )
            await asyncio.sleep(POLL_S)  # the trainer process is starting (imports torch, loads the model)

    async def train(self, rounds: list[list[dict[str, Any]]]) -> None:
        """Enqueue the rounds, ``rounds_in_flight`` at a time, so rollouts never wait for training."""
        in_flight: deque[asyncio.Task[None]] = deque()
        try:
            for number, requests in enumerate(rounds, start=1):
                while len(in_flight) >= self.algorithm.rounds_in_flight:
                    await in_flight.popleft()
                    await self.look()
                made = await self.store.enqueue_many_rollouts(requests)
                ids = [r.rollout_id for r in made]
                self.rollout_ids += ids
                self.train_ids += ids
                log.info("round enqueued", round=number, of=len(rounds), rollouts=len(ids), version=self.version)
                in_flight.append(asyncio.create_task(self._wait(ids), name=f"agl-verl-round-{number}"))
            while in_flight:
                await in_flight.popleft()
                await self.look()
        finally:
            for task in in_flight:
                task.cancel()

    async def drain(self, timeout: float) -> None:
        """Wait until every training rollout is in a batch and the trainer took every such batch.

        The batcher forms batches per partition of agl.triplets (groups are spread over them by
        group id), so a round's groups may make several batches, the last ones sent after the
        linger: counting rounds would stop early. The batches come from SQL (behind a fence at
        the end of the batches topic), the batches the trainer took from its progress file.
        """
        deadline = time.monotonic() + timeout
        while True:
            await self.look()
            missing, untrained = await self._untrained()
            if not missing and not untrained:
                return
            if time.monotonic() > deadline:
                log.warning(
                    "training did not take every rollout in time",
                    rollouts_not_in_a_batch=len(missing),
                    batches_not_trained=len(untrained),
                    timeout=timeout,
                )
                return
            await asyncio.sleep(POLL_S)  # the triplet builder, batcher and trainer are working

    async def _untrained(self) -> tuple[set[str], set[str]]:
        """Training rollouts in no batch yet, and batches of them the trainer has not taken."""
        store = self.store
        fence = await fence_at_end(store.settings, "triplet-batches")
        sql = BATCHED_SQL.format(db=store.settings.clickhouse_database)
        rows = (await store.side.query(sql, {"ids": self.train_ids}, fence=fence or None, timeout=60.0)).rows
        batched = {rollout for _, rollouts in rows for rollout in rollouts}
        taken = _batches_taken(self.plan.checkpoints)
        return set(self.train_ids) - batched, {str(batch) for batch, _ in rows} - taken

    async def last_validation(self) -> None:
        """The validation in flight ends; then one on the final policy unless it had one (the
        seed validates after its last step when test_freq is set)."""
        while True:
            if self.validation is not None:
                await self.validation
                self.validation = None
            await self.look()  # the version may have moved past test_freq meanwhile: one starts
            if self.validation is None:
                break
        if self.val and self.config.test_freq > 0 and self.last_validated != self.version:
            await self.validate(self.version)

    async def look(self) -> None:
        """Read the newest policy version; start a validation when one is due."""
        latest = await self.store.get_latest_resources()
        if _serves(latest, self.plan.proxy_url):
            assert latest is not None
            self.version = max(self.version, latest.policy_version or 0)
            self.algorithm.policy_version = self.version
        if self.validation is not None and self.validation.done():
            self.validation.result()  # raises what the validation raised
            self.validation = None
        if self.val and self.validation is None and self.last_validated is not None:
            if validation_due(self.config, self.version, self.last_validated):
                self.start_validation(self.version)

    def start_validation(self, version: int) -> None:
        self.last_validated = version
        self.validation = asyncio.create_task(self.validate(version), name="agl-verl-validation")

    async def validate(self, version: int) -> Validation:
        self.last_validated = version
        began = time.monotonic()
        number = len(self.algorithm.validations) + 1
        made = await self.store.enqueue_many_rollouts(val_requests(self.val, self.tag, number))
        ids = [r.rollout_id for r in made]
        self.rollout_ids += ids
        await self._wait(ids)
        report = (await rewards_by_mode(self.store, ids)).get("val")
        low, high = await self._versions(ids)
        result = Validation(
            number=number,
            policy_version=version,
            rollouts=len(ids),
            succeeded=report.succeeded if report is not None else 0,
            mean_reward=report.mean_reward if report is not None else None,
            min_version=low,
            max_version=high,
            seconds=time.monotonic() - began,
        )
        self.algorithm.validations.append(result)
        if self.tracking is not None:
            from agl_stream.training.tracking import validation_scalars

            self.tracking.log(validation_scalars(result), step=version)
        reward = "no reward" if result.mean_reward is None else f"mean reward {result.mean_reward:.3f}"
        ran = f"v{low}" if low == high else f"v{low}..v{high}"
        self.algorithm.say(
            f"validation {number} at policy version {version}: {reward} over {result.succeeded}/{len(ids)} "
            f"rollouts (ran on {ran}, {result.seconds:.0f}s)"
        )
        return result

    async def cancel(self) -> None:
        if self.validation is not None and not self.validation.done():
            self.validation.cancel()
            await asyncio.gather(self.validation, return_exceptions=True)

    async def _wait(self, ids: list[str]) -> None:
        finished = await self.store.wait_for_rollouts(rollout_ids=ids, timeout=self.algorithm.timeout)
        if len(finished) < len(ids):
            log.warning("rollouts did not finish in time", unfinished=len(ids) - len(finished))

    async def _versions(self, ids: list[str]) -> tuple[int | None, int | None]:
        """The policy versions the rollouts ran with (read after rewards_by_mode's fence)."""
        side = self.store.side
        sql = VERSIONS_SQL.format(db=self.store.settings.clickhouse_database)
        rows = (await side.query(sql, {"ids": ids}, timeout=60.0)).rows
        low, high = rows[0] if rows else (None, None)
        return (None if low is None else int(low)), (None if high is None else int(high))


def _validation_tracking(config: VerlConfig, plan: RolePlan) -> Tracking | None:
    """The trackers ``trainer.logger`` names, for this run's validations (None: none named); the
    same project, folder and run name as the trainer role's, the run suffixed ``-validation``."""
    given = config.trainer_options
    if not given.get("track"):
        return None
    from agl_stream.training.tracking import open_tracking  # imports torch: only when tracking

    options = TrainerOptions(
        checkpoints=plan.checkpoints,
        model_name=plan.model_name,
        **{k: v for k, v in given.items() if k in ("track", "track_project", "track_run")},
    )
    return open_tracking(options, run_suffix="-validation")


def _serves(latest: ResourcesUpdate | None, proxy_url: str) -> bool:
    """Whether ``latest`` is a policy snapshot of this run's trainer (its ProxyLLM names our proxy)."""
    if latest is None or latest.policy_version is None:
        return False
    return any(isinstance(r, ProxyLLM) and r.endpoint == proxy_url for r in latest.resources.values())


def _batches_taken(checkpoints: Path) -> set[str]:
    """Ids of the batches the trainer role took (trained, or refused to the DLQ), from its
    progress file (``consumers/trainer.py``: ``progress.json``, replaced atomically per batch)."""
    try:
        progress = json.loads((checkpoints / "progress.json").read_text())
    except (OSError, ValueError):
        return set()
    return {str(b) for b in (*progress.get("trained", ()), *progress.get("skipped", ()))}
