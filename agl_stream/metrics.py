"""Prometheus metrics of every role: the metric objects, their names, and where a process serves them.

Concurrency model: the metric objects are prometheus_client's, safe from any thread (each child
value holds its own lock); scrapes read them from the exposition server's threads. The role
label is one module global, set once per process by :func:`expose` or :func:`set_role` before
the role does any work, and only read after that. The endpoint file is written once after the
server listens and removed once at exit, by the same thread.

Every role runs in a process of its own, so each process has its own registry (the default
one, with prometheus_client's process and GC collectors) and its own endpoint. The HTTP roles
(gateway, LLM proxy, inference) serve ``GET /metrics`` on their own app, behind the same host,
origin and token rules as every other path (Prometheus sends ``authorization: Bearer``); the
others start prometheus_client's server on ``AGL_METRICS_HOST:AGL_METRICS_PORT`` (loopback by
default: it checks no token). Either way the process writes where it serves to
``<run dir>/metrics/<role>-<host>-<pid>.json``, removed on a clean exit: a file in Prometheus's
``file_sd`` format (one target group; see :func:`target_groups`), so Prometheus's
``file_sd_configs`` reads the folder as it is, and ``agl-stream status`` reads the same files
(:func:`read_endpoints`). The host in the name keeps processes of several containers sharing
the folder apart (each is pid 1 there).

Counters move once per batch or call, never once per record: an increment takes a lock, and the
processors handle tens of thousands of records a second (the skeleton adds ``len(records)`` per
partition of a fetch). Label values stay few: topics (a private reply topic counts as
``<prefix>.replies``), consumer groups, partitions, error types; never ids.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client import start_http_server as _start_http_server
from prometheus_client.metrics import MetricWrapperBase
from starlette.requests import Request
from starlette.responses import Response

from agl_stream.config import Settings
from agl_stream.logs import describe, get_logger

__all__ = [
    "ALL",
    "COMMITS",
    "CONSUMER_LAG",
    "DLQ_RECORDS",
    "FENCE_TIMEOUTS",
    "FENCE_WAIT_SECONDS",
    "FOLD_SECONDS",
    "HANDLE_SECONDS",
    "HTTP_REQUEST_SECONDS",
    "INFERENCE_REQUEST_SECONDS",
    "INGRESS_REQUESTS",
    "PROXY_CALL_SECONDS",
    "REBALANCES",
    "RECORDS_IN",
    "RECORDS_OUT",
    "RUNNER_ATTEMPTS",
    "SINK_FLUSH_SECONDS",
    "SINK_RECORDS",
    "TRAINER_STEP_SECONDS",
    "Endpoint",
    "advertised",
    "count_dlq",
    "count_out",
    "expose",
    "exposed_names",
    "metrics_endpoint",
    "parse_target_groups",
    "reachable_host",
    "read_endpoints",
    "role",
    "set_role",
    "target_groups",
    "topic_label",
]

log = get_logger("agl.metrics")

# No "<name>_created" sample beside every counter and histogram: Prometheus does not need them
# (it sees resets itself) and they double what every scrape carries.
disable_created_metrics()

ENDPOINTS_DIR = "metrics"
"""Under the run dir: one ``<role>-<host>-<pid>.json`` per process that serves metrics."""

AUTH_LABEL = "__meta_agl_auth"
"""Target label: ``bearer`` for the HTTP roles (their /metrics takes the API token where they
require it), ``none`` for prometheus_client's server (no token). Prometheus drops ``__``
labels after relabelling: a scrape job keeps or drops targets by it, nothing stores it."""
STARTED_LABEL = "__meta_agl_started"
"""Target label: when the process started serving (Unix seconds)."""
HOST_LABEL = "__meta_agl_host"
"""Target label: the host name of the process (its pid means something there only)."""

# Latency buckets from a millisecond (a fold of a small batch) to a minute (a slow trainer step
# or an LLM call that ran long).
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

RECORDS_IN = Counter(
    "agl_records_in", "Records a consumer group member handled, per topic.", ["role", "group", "topic"]
)
RECORDS_OUT = Counter("agl_records_out", "Records this process produced to Kafka, per topic.", ["role", "topic"])
DLQ_RECORDS = Counter(
    "agl_dlq_records",
    "Records sent to the dead-letter topic, by source topic and reason (error type).",
    ["role", "topic", "reason"],
)
HANDLE_SECONDS = Histogram(
    "agl_handle_seconds",
    "Time a handler took for one fetched batch (its effects acknowledged).",
    ["role", "group"],
    buckets=_SECONDS,
)
CONSUMER_LAG = Gauge(
    "agl_consumer_lag_records",
    "Records between what this member handled and the partition's high watermark.",
    ["role", "group", "topic", "partition"],
)
COMMITS = Counter("agl_commits", "Offset commits of a consumer group member, by outcome.", ["role", "group", "outcome"])
REBALANCES = Counter("agl_rebalances", "Partition assignments this member received.", ["role", "group"])
FOLD_SECONDS = Histogram(
    "agl_fold_seconds",
    "Rollout processor: time to fold one batch of events (before its effects are sent).",
    ["role"],
    buckets=_SECONDS,
)
SINK_FLUSH_SECONDS = Histogram(
    "agl_sink_flush_seconds",
    "ClickHouse sink: time of one batch's INSERT and sink_offsets record.",
    ["role", "sink"],
    buckets=_SECONDS,
)
SINK_RECORDS = Counter("agl_sink_records", "Kafka records a sink inserted into ClickHouse.", ["role", "sink"])
KAFKA_REQUESTS = Counter(
    "agl_kafka_requests", "Requests this process sent to Kafka brokers, per API (Produce, Fetch, ...).", ["role", "api"]
)
CLICKHOUSE_READS = Counter(
    "agl_clickhouse_reads", "Gateway: read queries run on the engine, per first table read.", ["role", "table"]
)
FENCE_WAIT_SECONDS = Histogram(
    "agl_fence_wait_seconds",
    "Gateway: how long a fenced read waited for the sinks (0 when already applied).",
    ["role"],
    buckets=(0.0, *_SECONDS),
)
FENCE_TIMEOUTS = Counter("agl_fence_timeouts", "Gateway: fenced reads the sinks did not catch up with.", ["role"])
TRAINER_STEP_SECONDS = Histogram(
    "agl_trainer_step_seconds", "Trainer: time of one training step on one batch.", ["role"], buckets=_SECONDS
)
PROXY_CALL_SECONDS = Histogram(
    "agl_llm_proxy_call_seconds",
    "LLM proxy: time of one call to a backend, by model and outcome.",
    ["role", "model", "outcome"],
    buckets=_SECONDS,
)
INFERENCE_REQUEST_SECONDS = Histogram(
    "agl_inference_request_seconds",
    "Inference server: time to answer one completion request.",
    ["role"],
    buckets=_SECONDS,
)
RUNNER_ATTEMPTS = Counter(
    "agl_runner_attempts",
    "Runner: attempts it claimed, by how each ended (succeeded, failed, released, already_closed, abandoned).",
    ["role", "status"],
)
TRAINING_SAMPLES = Counter(
    "agl_training_samples",
    "Triplet builder: training samples it built, and (outcome=break, reason) where trajectory "
    "aggregation had to start a new sample (branch, rewritten, drift).",
    ["role", "outcome", "reason"],
)
HTTP_REQUEST_SECONDS = Histogram(
    "agl_http_request_seconds",
    "HTTP roles (gateway, LLM proxy, inference): time to answer one request, by method, route "
    "template (``/v1/agl/rollouts/{rollout_id}``; ``unmatched`` for paths no route serves) and status.",
    ["role", "method", "route", "status"],
    buckets=_SECONDS,
)
INGRESS_REQUESTS = Counter(
    "agl_ingress_requests",
    "Ingress: task requests it handled, by outcome (enqueued; already_enqueued: a copy, answered, "
    "no dead letter; refused: sent to the DLQ).",
    ["role", "outcome"],
)

ALL: tuple[MetricWrapperBase, ...] = (
    RECORDS_IN,
    RECORDS_OUT,
    DLQ_RECORDS,
    HANDLE_SECONDS,
    CONSUMER_LAG,
    COMMITS,
    REBALANCES,
    FOLD_SECONDS,
    SINK_FLUSH_SECONDS,
    SINK_RECORDS,
    KAFKA_REQUESTS,
    CLICKHOUSE_READS,
    FENCE_WAIT_SECONDS,
    FENCE_TIMEOUTS,
    TRAINER_STEP_SECONDS,
    PROXY_CALL_SECONDS,
    INFERENCE_REQUEST_SECONDS,
    RUNNER_ATTEMPTS,
    TRAINING_SAMPLES,
    INGRESS_REQUESTS,
    HTTP_REQUEST_SECONDS,
)
"""Every metric agl-stream defines (the Grafana dashboard may use these and no others)."""

_role = "agl"


def set_role(name: str) -> None:
    """Name this process's role (the ``role`` label of every metric it reports)."""
    global _role
    _role = name


def role() -> str:
    return _role


def exposed_names(metrics: Iterable[MetricWrapperBase] = ALL) -> set[str]:
    """The sample names Prometheus sees for ``metrics`` (``_total``, ``_bucket``, ...)."""
    names: set[str] = set()
    for metric in metrics:
        for family in metric.describe():
            suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(family.type, ("",))
            names.update(family.name + suffix for suffix in suffixes)
    return names


def topic_label(topic: str) -> str:
    """A topic as a label value: each client's private reply topic counts under one name."""
    head, sep, _client = topic.partition(".replies.")
    return f"{head}.replies" if sep else topic


def count_out(topic: str, records: int = 1) -> None:
    """``records`` produced to ``topic`` (once per batch or call)."""
    if records:
        RECORDS_OUT.labels(_role, topic_label(topic)).inc(records)


def count_samples(samples: int, breaks: Mapping[str, int]) -> None:
    """Count one attempt's training samples and, per reason, the calls that started a new one."""
    TRAINING_SAMPLES.labels(_role, "built", "").inc(samples)
    for reason, calls in breaks.items():
        TRAINING_SAMPLES.labels(_role, "break", reason).inc(calls)


def count_dlq(items: Iterable[tuple[str, BaseException]]) -> None:
    """Records sent to the DLQ, as (source topic, error): counted per topic and error type."""
    tally = Tally((topic_label(topic), type(error).__name__) for topic, error in items)
    for (topic, reason), n in tally.items():
        DLQ_RECORDS.labels(_role, topic, reason).inc(n)


# -- exposition ------------------------------------------------------------------------------


async def metrics_endpoint(_request: Request) -> Response:
    """``GET /metrics`` of an HTTP role (mounted behind the app's guard)."""
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


@dataclass(frozen=True)
class Endpoint:
    """One process's metrics endpoint, as its file under ``<run dir>/metrics/`` says."""

    role: str
    pid: int
    url: str
    path: Path
    host: str = ""
    """The host name the process ran on ("": unknown); its pid means something there only."""
    token: bool = False
    """Whether the endpoint takes the API token (an HTTP role's /metrics)."""


def target_groups(name: str, pid: int, url: str, *, host: str, started: float, token: bool) -> list[dict[str, Any]]:
    """The endpoint file's content: Prometheus ``file_sd`` target groups (one) for ``url``.

    ``role`` and ``pid`` become labels of every series scraped from it; the ``__`` labels steer
    the scrape (path, scheme) or tell the readers here (auth, start, host) and are dropped after
    relabelling. Label values are strings, as ``file_sd`` requires."""
    parts = urlsplit(url)
    if not parts.scheme or not parts.netloc:
        raise ValueError(f"metrics URL {url!r} has no scheme or host: give http://host:port/metrics")
    return [
        {
            "targets": [parts.netloc],
            "labels": {
                "role": name,
                "pid": str(pid),
                "__metrics_path__": parts.path or "/metrics",
                "__scheme__": parts.scheme,
                AUTH_LABEL: "bearer" if token else "none",
                STARTED_LABEL: f"{started:.3f}",
                HOST_LABEL: host,
            },
        }
    ]


def parse_target_groups(data: object, path: Path) -> list[Endpoint]:
    """The endpoints a ``file_sd`` file (read from ``path``) lists; a target group that is not
    one of ours (no role or pid label) is skipped, a malformed file raises ``ValueError``."""
    if not isinstance(data, list):
        raise ValueError(f"{path}: not a file_sd list of target groups")
    found = []
    for group in data:
        if not isinstance(group, dict) or not isinstance(group.get("labels"), dict):
            raise ValueError(f"{path}: a target group without labels")
        labels: dict[str, Any] = group["labels"]
        if "role" not in labels or "pid" not in labels:
            continue
        scheme, metrics_path = str(labels.get("__scheme__", "http")), str(labels.get("__metrics_path__", "/metrics"))
        for target in group.get("targets") or []:
            found.append(
                Endpoint(
                    str(labels["role"]),
                    int(labels["pid"]),
                    f"{scheme}://{target}{metrics_path}",
                    path,
                    host=str(labels.get(HOST_LABEL, "")),
                    token=labels.get(AUTH_LABEL) == "bearer",
                )
            )
    return found


def read_endpoints(settings: Settings) -> list[Endpoint]:
    """Every endpoint file of the run dir (a half-written or foreign file is skipped)."""
    found: list[Endpoint] = []
    for path in sorted((settings.run_dir / ENDPOINTS_DIR).glob("*.json")):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            found.extend(parse_target_groups(json.loads(path.read_text()), path))
    return found


def _endpoint_file(settings: Settings, name: str) -> Path:
    return settings.run_dir / ENDPOINTS_DIR / f"{name}-{socket.gethostname()}-{os.getpid()}.json"


def _write_endpoint(path: Path, name: str, url: str, *, token: bool) -> None:
    groups = target_groups(name, os.getpid(), url, host=socket.gethostname(), started=time.time(), token=token)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")  # not *.json: neither Prometheus nor status reads it half-written
    tmp.write_text(json.dumps(groups))
    tmp.replace(path)  # atomic: a reader sees no file or the whole one


@contextlib.contextmanager
def advertised(settings: Settings, name: str, url: str, *, token: bool = True) -> Iterator[Path]:
    """Record that this process (role ``name``) serves its metrics at ``url`` while inside;
    ``token``: the endpoint takes the API token (an HTTP role's /metrics, behind its guard)."""
    set_role(name)
    path = _endpoint_file(settings, name)
    _write_endpoint(path, name, url, token=token)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def reachable_host(bound: str, resolve: Callable[[str], str] = socket.gethostbyname) -> str:
    """The address others reach a listener bound to ``bound`` at: a wildcard bind is advertised
    as this host's own address (in a container, its address on the container network)."""
    if bound not in ("0.0.0.0", "::", ""):
        return bound
    try:
        return resolve(socket.gethostname())
    except OSError:
        return socket.gethostname()


@contextlib.contextmanager
def expose(settings: Settings, name: str) -> Iterator[str | None]:
    """Serve this process's metrics (role ``name``) from prometheus_client's HTTP server while
    inside; yields the URL, or None when ``AGL_METRICS`` is off."""
    set_role(name)
    if not settings.metrics:
        yield None
        return
    server, _thread = _serve(settings.metrics_host, settings.metrics_port)
    bound, port = server.server_address[:2]
    host = reachable_host(str(bound))
    url = f"http://[{host}]:{port}/metrics" if ":" in host else f"http://{host}:{port}/metrics"
    try:
        with advertised(settings, name, url, token=False):
            log.info("metrics served", url=url)
            yield url
    finally:
        server.shutdown()
        server.server_close()


def _serve(host: str, port: int) -> tuple[Any, Any]:
    try:
        return _start_http_server(port, addr=host)
    except OSError as error:
        if port == 0:
            raise
        # Several instances of a role on one host cannot share a fixed port: the later ones
        # take any free port; the endpoint file says which.
        log.warning("metrics port taken; serving on any free port", port=port, error=describe(error))
        return _start_http_server(0, addr=host)
