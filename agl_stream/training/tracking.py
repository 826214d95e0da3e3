"""Experiment tracking: each training step and validation pass as scalars in TensorBoard, Weights &
Biases and MLflow, through their own libraries.

The core is pure: :func:`step_scalars` maps a :class:`~agl_stream.models.TrainerStep` (what the
trainer publishes on agl.trainer-metrics) to flat metric names (``actor/pg_loss``,
``reward/mean``, ``importance/ratio_max``, ``staleness/mean``, ``perf/tokens_per_s``...), and
:func:`validation_scalars` does the same for one validation pass (``val/reward_mean``...). The
x-axis of every metric is the policy version the step produced (validations: the version
validated), so a resumed trainer continues its curves.

The shell is :class:`Tracking`: one object fanning out to the backends named in
:data:`TRACKER_ADAPTERS` (a registry of small functions, each importing its library only when
chosen, returning how to log and how to close). The backends run on a thread of their own behind
a bounded queue: :meth:`Tracking.log` never waits (a full queue drops the step, counted and
logged), a backend that fails to start or to log is logged and, after
:data:`MAX_FAILURES` failures in a row, left out; training never stalls on a tracker.
"""

from __future__ import annotations

import json
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from agl_stream.logs import describe, get_logger
from agl_stream.models import TrainerStep
from agl_stream.rl_options import TRACKERS, TrainerOptions, parse_trackers

log = get_logger("agl.tracking")

MAX_FAILURES = 3
"""A backend that fails this many times in a row is left out for the rest of the run."""

QUEUE_SIZE = 1024
"""Steps waiting for the backends; past it :meth:`Tracking.log` drops the step."""

# -- the pure core ---------------------------------------------------------------------------------

_GROUPS: tuple[tuple[str, str], ...] = (
    ("is_", "importance/"),
    ("staleness_", "staleness/"),
    ("reward_", "reward/"),
    ("advantage_", "advantage/"),
    ("response_", "response/"),
)
"""A backend metric's key prefix -> its group (the prefix is dropped: is_ratio_max -> importance/ratio_max)."""

_PERF = frozenset({"tokens", "tokens_per_s", "seconds", "rows"})
_DROPPED = frozenset({"policy_version"})  # the record's own field says it


def metric_name(key: str) -> str:
    """The tracked name of one of a backend's step metrics: grouped by prefix (:data:`_GROUPS`),
    sizes and speed under ``perf/``, the rest (losses, clip fractions, norms, lr) under ``actor/``."""
    for prefix, group in _GROUPS:
        if key.startswith(prefix) and len(key) > len(prefix):
            return group + key[len(prefix) :]
    return ("perf/" if key in _PERF else "actor/") + key


def step_scalars(step: TrainerStep, totals: Mapping[str, float] | None = None) -> dict[str, float]:
    """One training step as flat metric names -> values: the backend's metrics
    (:func:`metric_name`), the record's own fields (time, idle time, samples, staleness of the
    batch, policy version) and the trainer's running ``totals`` (under ``trainer/``)."""
    out = {metric_name(k): float(v) for k, v in step.metrics.items() if k not in _DROPPED}
    out.update(
        {
            "trainer/policy_version": float(step.policy_version),
            "perf/step_seconds": step.step_seconds,
            "perf/idle_seconds": step.idle_seconds,
            "perf/samples": float(step.samples),
        }
    )
    out.setdefault("perf/tokens", float(step.tokens))
    if step.staleness is not None:
        out["staleness/batch"] = step.staleness
    for key, value in (totals or {}).items():
        out[f"trainer/{key}"] = float(value)
    return out


def validation_scalars(validation: Any) -> dict[str, float]:
    """One validation pass (the VERL algorithm's ``Validation``, or a mapping of its fields) as
    ``val/...`` metrics; fields that are None (no reward, no versions known) are left out."""
    data: Mapping[str, Any] = asdict(validation) if is_dataclass(validation) else validation  # type: ignore[arg-type]
    out: dict[str, float] = {}
    for key, name in (
        ("mean_reward", "val/reward_mean"),
        ("rollouts", "val/rollouts"),
        ("succeeded", "val/succeeded"),
        ("seconds", "val/seconds"),
        ("min_version", "val/min_policy_version"),
        ("max_version", "val/max_policy_version"),
    ):
        if data.get(key) is not None:
            out[name] = float(data[key])
    rollouts = data.get("rollouts") or 0
    if rollouts:
        out["val/success_share"] = float(data.get("succeeded") or 0) / float(rollouts)
    return out


# -- configuration ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrackingConfig:
    """Where and under which names the chosen backends record.

    ``directory``: TensorBoard writes ``<directory>/tensorboard/<project>/<run>``, W&B its run
    folders under ``<directory>/wandb`` (``WANDB_DIR`` wins), MLflow ``sqlite:///<directory>/mlflow.db``
    (``MLFLOW_TRACKING_URI`` wins). ``params``: the run's options (W&B config, MLflow params,
    TensorBoard text).
    """

    trackers: tuple[str, ...]
    directory: Path
    project: str = "agl-stream"
    run: str = "trainer"
    params: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, options: TrainerOptions, *, run_suffix: str = "") -> TrackingConfig | None:
        """The trainer options' tracking (None when ``track`` names no backend). The directory
        defaults to ``<checkpoints>/tracking``, the run name to the checkpoints folder's name."""
        trackers = parse_trackers(options.track)
        if not trackers:
            return None
        directory = options.track_dir or options.checkpoints / "tracking"
        run = (options.track_run or Path(options.checkpoints).resolve().name or "trainer") + run_suffix
        params = {f.name: _param(getattr(options, f.name)) for f in fields(options)}
        return cls(trackers, Path(directory), options.track_project, run, params)


def _param(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else value


# -- the backends ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Backend:
    """An opened tracker: how to log one step's scalars and how to close it."""

    log: Callable[[Mapping[str, float], int], None]
    close: Callable[[], None]


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name) or "run"


def open_tensorboard(config: TrackingConfig) -> Backend:
    from torch.utils.tensorboard import SummaryWriter

    path = config.directory / "tensorboard" / _safe_name(config.project) / _safe_name(config.run)
    writer = SummaryWriter(log_dir=str(path))
    if config.params:
        rows = "\n".join(f"| {k} | {v} |" for k, v in sorted(config.params.items()))
        writer.add_text("options", "| option | value |\n|---|---|\n" + rows, 0)

    def write(scalars: Mapping[str, float], step: int) -> None:
        for name, value in scalars.items():
            writer.add_scalar(name, value, step)
        writer.flush()

    return Backend(write, writer.close)


def open_wandb(config: TrackingConfig) -> Backend:
    import wandb

    directory = os.environ.get("WANDB_DIR") or str(config.directory)
    Path(directory).mkdir(parents=True, exist_ok=True)
    run = wandb.init(
        project=config.project,
        name=config.run,
        dir=directory,
        config=dict(config.params),
        reinit="create_new",
        settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
    )

    def write(scalars: Mapping[str, float], step: int) -> None:
        run.log(dict(scalars), step=step)

    return Backend(write, run.finish)


def open_mlflow(config: TrackingConfig) -> Backend:
    from mlflow.entities import Metric, Param
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    config.directory.mkdir(parents=True, exist_ok=True)
    uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{config.directory.resolve() / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(config.project)
    if experiment is not None:
        experiment_id = experiment.experiment_id
    else:
        try:
            experiment_id = client.create_experiment(config.project)
        except MlflowException:  # another process (the trainer, the algorithm) made it meanwhile
            made = client.get_experiment_by_name(config.project)
            if made is None:
                raise
            experiment_id = made.experiment_id
    run_id = client.create_run(experiment_id, run_name=config.run).info.run_id
    params = [Param(k, json.dumps(v) if not isinstance(v, str) else v) for k, v in sorted(config.params.items())]
    if params:
        client.log_batch(run_id, params=[Param(p.key, p.value[:6000]) for p in params])

    def write(scalars: Mapping[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        client.log_batch(run_id, metrics=[Metric(k, v, now, step) for k, v in scalars.items()])

    return Backend(write, lambda: client.set_terminated(run_id))


TRACKER_ADAPTERS: dict[str, Callable[[TrackingConfig], Backend]] = {
    "tensorboard": open_tensorboard,
    "wandb": open_wandb,
    "mlflow": open_mlflow,
}
"""Tracker name (:data:`agl_stream.rl_options.TRACKERS`) -> the function that opens it."""
assert tuple(TRACKER_ADAPTERS) == TRACKERS


# -- the shell -------------------------------------------------------------------------------------

_CLOSE = object()


class Tracking:
    """Fans each step's scalars out to the configured backends, on a thread of its own.

    Thread-safety: :meth:`log` and :meth:`close` may be called from any one thread; the backends
    are opened, written and closed on the tracking thread only.
    """

    def __init__(
        self,
        config: TrackingConfig,
        *,
        adapters: Mapping[str, Callable[[TrackingConfig], Backend]] | None = None,
        queue_size: int = QUEUE_SIZE,
    ) -> None:
        self.config = config
        self._adapters = dict(TRACKER_ADAPTERS if adapters is None else adapters)
        unknown = [name for name in config.trackers if name not in self._adapters]
        if unknown:
            raise ValueError(f"unknown tracker(s) {unknown}: {', '.join(self._adapters)}")
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self.dropped = 0
        self.failed: dict[str, str] = {}  # tracker -> why it was left out
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="agl-tracking", daemon=True)
        self._thread.start()

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        """Queue one step's scalars; never blocks (a full queue drops them, counted in ``dropped``)."""
        if self._closed:
            return
        try:
            self._queue.put_nowait((dict(scalars), int(step)))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 100 == 0:
                log.warning("tracking is behind: step dropped", step=step, dropped=self.dropped)

    def close(self, timeout: float = 60.0) -> None:
        """Write what is queued, close every backend, and wait for that up to ``timeout`` seconds."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(_CLOSE, timeout=timeout)
        except queue.Full:
            log.warning("tracking did not drain before close", queued=self._queue.qsize())
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("tracking backends did not close in time", timeout=timeout)

    def _work(self) -> None:
        backends: dict[str, Backend] = {}
        for name in self.config.trackers:
            try:
                backends[name] = self._adapters[name](self.config)
                log.info("tracking", tracker=name, run=self.config.run, directory=str(self.config.directory))
            except Exception as error:  # a tracker must never stop training
                self.failed[name] = describe(error)
                log.error("tracker did not start; training goes on without it", tracker=name, error=describe(error))
        failures = dict.fromkeys(backends, 0)
        while True:
            item = self._queue.get()
            if item is _CLOSE:
                break
            scalars, step = item
            for name, backend in list(backends.items()):
                try:
                    backend.log(scalars, step)
                    failures[name] = 0
                except Exception as error:
                    failures[name] += 1
                    log.warning("tracker failed to log a step", tracker=name, step=step, error=describe(error))
                    if failures[name] >= MAX_FAILURES:
                        self.failed[name] = describe(error)
                        log.error("tracker left out after repeated failures", tracker=name, failures=failures[name])
                        self._close_one(name, backends.pop(name))
        for name, backend in backends.items():
            self._close_one(name, backend)

    @staticmethod
    def _close_one(name: str, backend: Backend) -> None:
        try:
            backend.close()
        except Exception as error:
            log.warning("tracker did not close cleanly", tracker=name, error=describe(error))


def open_tracking(options: TrainerOptions, *, run_suffix: str = "") -> Tracking | None:
    """A started :class:`Tracking` for the trainer options' ``track`` (None when it names none)."""
    config = TrackingConfig.of(options, run_suffix=run_suffix)
    return None if config is None else Tracking(config)
