"""Task ingress, the pure part: a TaskRequest (topic agl.task-requests) -> a RolloutEnqueued event.

The ingress processor (processors/ingress.py), ``agl-stream enqueue`` and the gateway's
``POST /v1/tasks`` share these rules, so a request the CLI or the gateway accepts is one the
processor accepts (only the resources check and deduplication need the log, and live there).
No I/O and no clock here: the caller passes "now".

The contract for clients is docs/contract.md; what each check refuses:

- bytes that are not a TaskRequest: the codec's errors (no single-object marker, unknown
  fingerprint, malformed body or JSON text, another record type);
- a request id that is empty, longer than :data:`REQUEST_ID_MAX_CHARS` or not printable ASCII
  without spaces (:class:`InvalidTaskRequestError`);
- input or metadata over the byte limits (:class:`TaskRequestTooLargeError`, measured on the
  JSON text as agl-stream writes it: sorted keys, compact);
- a mode other than train/val/test, metadata that is not a JSON object, NaN/Infinity anywhere,
  a config with ``max_attempts < 1``, a non-positive or non-finite timeout, or a retry
  condition other than failed/timeout/unresponsive (:class:`InvalidTaskRequestError`).

The rollout id is derived from the request id (128 bits of its SHA-256), so a client knows it
without asking and the same request sent twice names the same rollout (which the rollout
processor creates once). Whether a request is new, a copy of one already enqueued (an answer,
"already enqueued", never a dead letter) or one whose rollout holds a *different* request (a
reused request id with another input, or a collision of rollout ids: refused) is decided by
:func:`classify` from what the rollout holds (:class:`HeldRequest`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, get_args

from pydantic import ValidationError

from agl_stream.errors import AglError, RecordTypeError
from agl_stream.models import RolloutEnqueued, RolloutEvent, TaskRequest
from agl_stream.models.base import AttemptStatus, RolloutMode
from agl_stream.models.rollouts import Rollout, RolloutConfig
from agl_stream.wire.codec import Codec, dump_json

if TYPE_CHECKING:
    from agl_stream.config import Settings

WRITER = "processor.ingress"
"""``RolloutEvent.writer`` of the events the ingress writes (also its DLQ ``processor``)."""

REQUEST_ID_MAX_CHARS = 128
_REQUEST_ID_RE = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no spaces: safe in logs, URLs, keys
MODES: tuple[str, ...] = get_args(RolloutMode)
RETRY_CONDITIONS: tuple[AttemptStatus, ...] = ("failed", "timeout", "unresponsive")
"""The attempt statuses a retry can follow: the fold only retries after an attempt that finished
without succeeding, so any other value would never fire and is a mistake in the request."""
_INT_MAX = 2**31 - 1  # RolloutConfig.max_attempts is an Avro int
_EVENT_NAMESPACE = uuid.UUID("5b0c6f1e-8a4e-4c1b-9a57-6d2f3c0e7a11")


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


class TaskRequestError(AglError, ValueError):
    """A task request that cannot become a rollout; the message says why (it is the DLQ reason)."""


class InvalidTaskRequestError(TaskRequestError):
    """A field has a value the contract does not allow (request id, mode, config, JSON payloads)."""


class TaskRequestTooLargeError(TaskRequestError):
    """The input or the metadata is over its byte limit."""


class UnknownResourcesError(TaskRequestError):
    """``resources_id`` names no snapshot on agl.resources."""


class RequestConflictError(TaskRequestError):
    """The request's rollout already holds a different request: its request id was used before
    for another input, or (never seen with 128-bit ids, but checked) another request id derives
    the same rollout id. Nothing is enqueued; a new task needs a new request id."""


class KeyMismatchError(TaskRequestError):
    """The Kafka key is not the request id (the contract keys requests by request id)."""


# --------------------------------------------------------------------------------------------
# Ids
# --------------------------------------------------------------------------------------------


def request_digest(request_id: str) -> bytes:
    """SHA-256 of the request id's UTF-8 bytes: the root of every id derived from it."""
    return hashlib.sha256(request_id.encode("utf-8")).digest()


ROLLOUT_ID_HEX = 32
"""Hex digits of SHA-256(request_id) in a derived rollout id: 128 bits, so finding two request
ids with one rollout id takes ~2**64 hashes (48 bits, the first version's, took 24 s of CPU)."""
LEGACY_ROLLOUT_ID_HEX = 12
"""What the first version kept (``ro-`` + 12 hex); rollouts it made are still recognized."""


def rollout_id_for(request_id: str) -> str:
    """``ro-`` + the first 32 hex digits of SHA-256(request_id as UTF-8) (docs/contract.md)."""
    return "ro-" + request_digest(request_id).hex()[:ROLLOUT_ID_HEX]


def legacy_rollout_id_for(request_id: str) -> str:
    """The rollout id the first version derived (``ro-`` + 12 hex of the same digest): a copy of
    a request enqueued before 128-bit ids is found under it (see :func:`classify`)."""
    return "ro-" + request_digest(request_id).hex()[:LEGACY_ROLLOUT_ID_HEX]


def event_id_for(request_id: str) -> str:
    """The enqueue event's id: a UUIDv5 of the request id, so a re-sent event is byte-identical."""
    return str(uuid.uuid5(_EVENT_NAMESPACE, request_id))


def line_request_id(line: str, line_number: int, salt: str = "") -> str:
    """The request id of a task-file line that has none: stable across runs of the same file.

    A digest of (salt, line number, the line's text): rerunning a file, or a file that grew at
    its end, names the same requests again; ``salt`` makes a deliberate second run new tasks.
    """
    digest = hashlib.sha256(f"{salt}\n{line_number}\n{line.strip()}".encode()).hexdigest()
    return "line-" + digest[:32]


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IngressLimits:
    max_input_bytes: int = 512 * 1024
    max_metadata_bytes: int = 64 * 1024

    @classmethod
    def of(cls, settings: Settings) -> IngressLimits:
        return cls(settings.ingress_max_input_bytes, settings.ingress_max_metadata_bytes)


def _json_size(value: Any, what: str, problems: list[str]) -> int:
    try:
        return len(dump_json(value).encode("utf-8"))
    except (ValueError, TypeError) as exc:  # NaN/Infinity, lone surrogates, a value JSON cannot hold
        problems.append(f"{what} is not valid JSON ({exc})")
    except RecursionError:
        problems.append(f"{what} is JSON nested too deeply to write")
    return 0


def _finite_number(value: Any) -> bool:
    """A JSON number that is a float in range (bool is no number; an int too large for a float
    is none either: ``math.isfinite`` would raise OverflowError on it)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _shown(value: Any) -> str:
    """``value`` for a message: repr, cut short (a huge number or text stays readable)."""
    try:
        text = repr(value)
    except ValueError:  # an int past the digit limit of str(), maybe inside a list
        return f"a {type(value).__name__} too large to show"
    return text if len(text) <= 160 else text[:157] + "..."


def _positive_seconds(config: Mapping[str, Any], name: str, problems: list[str]) -> None:
    value = config.get(name)
    if value is None:
        return
    if not _finite_number(value) or value <= 0:
        problems.append(f"config.{name} must be a positive number of seconds or null, not {_shown(value)}")


def _check_config(config: Any, problems: list[str]) -> None:
    if config is None:
        return
    if not isinstance(config, Mapping):
        problems.append(f"config must be an object or null, not {type(config).__name__}")
        return
    attempts = config.get("max_attempts", 1)
    if isinstance(attempts, bool) or not isinstance(attempts, int) or not 1 <= attempts <= _INT_MAX:
        problems.append(f"config.max_attempts must be an integer from 1 to {_INT_MAX}, not {_shown(attempts)}")
    _positive_seconds(config, "timeout_seconds", problems)
    _positive_seconds(config, "unresponsive_seconds", problems)
    conditions = config.get("retry_condition", [])
    if not isinstance(conditions, list):
        problems.append(f"config.retry_condition must be a list, not {type(conditions).__name__}")
    else:
        unknown = [c for c in conditions if c not in RETRY_CONDITIONS]
        if unknown:
            problems.append(
                f"config.retry_condition may hold only {', '.join(RETRY_CONDITIONS)} (statuses a retry can "
                f"follow), not {', '.join(map(_shown, unknown))}"
            )


def validate_request(datum: Mapping[str, Any], limits: IngressLimits) -> TaskRequest:
    """A TaskRequest from its dict form (the codec's, or parsed JSON), or the reasons it is refused.

    Every problem is reported at once, joined with "; ". Size problems win the error type
    (:class:`TaskRequestTooLargeError`), since fixing them means a different request.
    """
    if not isinstance(datum, Mapping):
        raise InvalidTaskRequestError(f"a task request is a JSON object, not {type(datum).__name__}")
    problems: list[str] = []
    too_large: list[str] = []
    request_id = datum.get("request_id")
    if not isinstance(request_id, str):
        problems.append(f"request_id must be a string, not {type(request_id).__name__}")
    elif not 1 <= len(request_id) <= REQUEST_ID_MAX_CHARS or not _REQUEST_ID_RE.fullmatch(request_id):
        problems.append(
            f"request_id must be 1 to {REQUEST_ID_MAX_CHARS} printable ASCII characters without spaces, "
            f"not {request_id[:160]!r}"
        )
    if "input" not in datum:
        problems.append("input is missing")
    else:
        size = _json_size(datum["input"], "input", problems)
        if size > limits.max_input_bytes:
            too_large.append(f"input is {size:,} bytes of JSON, over the {limits.max_input_bytes:,}-byte limit")
    mode = datum.get("mode")
    if mode is not None and mode not in MODES:
        problems.append(f"mode must be one of {', '.join(MODES)} or null, not {_shown(mode)}")
    metadata = datum.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, Mapping):
            problems.append(f"metadata must be a JSON object or null, not {type(metadata).__name__}")
        else:
            size = _json_size(metadata, "metadata", problems)
            if size > limits.max_metadata_bytes:
                too_large.append(
                    f"metadata is {size:,} bytes of JSON, over the {limits.max_metadata_bytes:,}-byte limit"
                )
    resources_id = datum.get("resources_id")
    if resources_id is not None and (
        not isinstance(resources_id, str) or not 1 <= len(resources_id) <= 128 or not _utf8(resources_id)
    ):
        problems.append(f"resources_id must be a resources snapshot id or null, not {_shown(resources_id)}")
    request_time = datum.get("request_time")
    if request_time is not None and not _finite_number(request_time):
        problems.append(f"request_time must be a finite number of seconds or null, not {_shown(request_time)}")
    _check_config(datum.get("config"), problems)
    if too_large:
        raise TaskRequestTooLargeError("; ".join(too_large + problems))
    if problems:
        raise InvalidTaskRequestError("; ".join(problems))
    try:
        return TaskRequest.model_validate(datum)
    except ValidationError as exc:  # what the checks above do not cover: unknown fields, types
        raise InvalidTaskRequestError(_pydantic_reasons(exc)) from exc


def _utf8(text: str) -> bool:
    """Whether ``text`` is Unicode text (a lone surrogate, which JSON's ``\\ud800`` makes, is not:
    the codec could not write it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _pydantic_reasons(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in error['loc']) or 'request'}: {error['msg']}" for error in exc.errors())


def decode_request(codec: Codec, data: bytes, limits: IngressLimits) -> TaskRequest:
    """Decode a message of agl.task-requests and validate it (CodecError or TaskRequestError)."""
    name, datum = codec.decode_dict(data)
    if name != TaskRequest.avro_name:
        raise RecordTypeError(
            f"expected a {TaskRequest.avro_name} record, got a {name}: agl.task-requests carries only task requests"
        )
    return validate_request(datum, limits)


def check_key(key: bytes | None, request: TaskRequest) -> None:
    """The Kafka key must be the request id (UTF-8), so duplicates meet in one partition."""
    if key != request.request_id.encode("utf-8"):
        shown = "no key" if key is None else f"key {key[:160]!r}"
        raise KeyMismatchError(f"{shown} is not the request_id {request.request_id!r}: key each request by its id")


def request_from_json(value: Any, limits: IngressLimits, *, default_request_id: str | None = None) -> TaskRequest:
    """A request given as a JSON object (``POST /v1/tasks``, a task-file line).

    ``input`` and ``metadata`` are JSON values here, not JSON text as in Avro. Without a
    ``request_id`` the ``default_request_id`` is used (an error when there is none).
    """
    if isinstance(value, Mapping) and value.get("request_id") is None and default_request_id is not None:
        value = {**value, "request_id": default_request_id}
    return validate_request(value, limits)


def request_from_line(line: str, line_number: int, limits: IngressLimits, *, salt: str = "") -> TaskRequest:
    """One line of a task file (JSON Lines): a request; no request_id -> :func:`line_request_id`."""
    try:
        value = json.loads(line)
    except ValueError as exc:  # JSONDecodeError, or an integer past str()'s digit limit
        raise InvalidTaskRequestError(f"not JSON: {exc}") from exc
    except RecursionError:
        raise InvalidTaskRequestError("not JSON this reader can take: nested too deeply") from None
    return request_from_json(value, limits, default_request_id=line_request_id(line, line_number, salt))


# --------------------------------------------------------------------------------------------
# The rollout
# --------------------------------------------------------------------------------------------


def enqueue_event(request: TaskRequest, now: float) -> RolloutEvent:
    """The RolloutEnqueued event a valid request becomes (key: its rollout id, on agl.rollouts).

    The rollout starts at ``now`` (when the ingress enqueued it; ``request_time`` is the client's
    clock and stays the client's), with the request's input, mode, resources, config (defaults
    when null) and metadata unchanged.
    """
    rollout_id = rollout_id_for(request.request_id)
    rollout = Rollout(
        rollout_id=rollout_id,
        input=request.input,
        start_time=now,
        mode=request.mode,
        resources_id=request.resources_id,
        status="queuing",
        config=request.config if request.config is not None else RolloutConfig(),
        metadata=request.metadata,
    )
    return RolloutEvent(
        event_id=event_id_for(request.request_id),
        rollout_id=rollout_id,
        time=now,
        writer=WRITER,
        payload=RolloutEnqueued(rollout=rollout),
    )


# --------------------------------------------------------------------------------------------
# New, already enqueued, or conflicting
# --------------------------------------------------------------------------------------------

INPUT_DIGEST_BYTES = 16


def input_digest(value: Any) -> bytes:
    """The first 16 bytes of SHA-256 of the input's JSON text as the codec writes it (sorted keys,
    compact): equal for equal inputs, and computable by ClickHouse from the stored text
    (``substring(SHA256(input), 1, 16)``), since the rollouts table keeps that very text."""
    return hashlib.sha256(dump_json(value).encode("utf-8")).digest()[:INPUT_DIGEST_BYTES]


@dataclass(frozen=True)
class HeldRequest:
    """What an existing rollout tells about the request that made it.

    ``request_digest`` (SHA-256 of the request id) is known where the request itself was seen
    (the ingress's memory, the batch at hand); a rollout read from ClickHouse tells only its
    input (rollouts carry no request id), and a rollout found under its legacy 12-hex id is
    marked ``legacy``.
    """

    rollout_id: str
    input_digest: bytes
    request_digest: bytes | None = None
    legacy: bool = False

    @classmethod
    def of(cls, request: TaskRequest) -> HeldRequest:
        """What the rollout of ``request`` holds once it is enqueued."""
        return cls(rollout_id_for(request.request_id), input_digest(request.input), request_digest(request.request_id))


@dataclass(frozen=True)
class AlreadyEnqueued:
    """The answer to a copy of a request already enqueued: it changed nothing."""

    request_id: str
    rollout_id: str

    def __str__(self) -> str:
        return (
            f"already enqueued: request_id {self.request_id!r} is rollout {self.rollout_id}; this copy changed nothing"
        )


def classify(request: TaskRequest, held: HeldRequest | None) -> AlreadyEnqueued | None:
    """None: the request is new (enqueue it). :class:`AlreadyEnqueued`: a copy of a request whose
    rollout exists (a retry, a re-run of a task file, a re-read after a crash): answer it, it is
    no dead letter. :class:`RequestConflictError` when the rollout holds a different request:

    - another request id derives the same rollout id (a collision: a different
      ``request_digest``; with 128 bits never seen, but a second task must not be answered with
      the first one's rollout and never run);
    - this request id was enqueued before with a different input (a reused request id).

    A rollout found only under the request's legacy 12-hex id counts as this request's when it
    holds the same input; otherwise it is another request that collided in 48 bits, and the
    request is new (its own 32-hex rollout id is free).
    """
    if held is None:
        return None
    same_input = held.input_digest == input_digest(request.input)
    if held.legacy:
        return AlreadyEnqueued(request.request_id, held.rollout_id) if same_input else None
    if held.request_digest is not None and held.request_digest != request_digest(request.request_id):
        raise RequestConflictError(
            f"rollout id collision: request_id {request.request_id!r} derives rollout {held.rollout_id}, which "
            "already holds a request with another request_id; nothing was enqueued: send it with another request_id"
        )
    if not same_input:
        raise RequestConflictError(
            f"request_id {request.request_id!r} was already enqueued as rollout {held.rollout_id} with a different "
            "input; nothing was enqueued: a request id names one task, send a new task with a new request_id"
        )
    return AlreadyEnqueued(request.request_id, held.rollout_id)


def is_copy(existing: Rollout, enqueued: Rollout) -> bool:
    """Whether an enqueue of a rollout that already exists is a copy of the request that made it
    (same rollout id, same input): the rule :func:`classify` applies, for the rollout processor's
    last check (an ingress re-sending after a crash, a copy that met no earlier check). Such an
    enqueue changes nothing and is an answer, not a dead letter; another input is a conflict."""
    return existing.rollout_id == enqueued.rollout_id and input_digest(existing.input) == input_digest(enqueued.input)


def stored_rollouts_query(database: str, request_ids: Iterable[str]) -> tuple[str, dict[str, Any]]:
    """SQL and parameters asking ClickHouse what the rollouts of these requests hold: the
    rollout id and the input digest (:func:`input_digest`, hex) of each request's derived
    rollout and of its legacy 12-hex one, those that exist. Rows for :func:`held_from_rows`."""
    ids = {rollout_id_for(i) for i in request_ids} | {legacy_rollout_id_for(i) for i in request_ids}
    sql = (
        "SELECT rollout_id, lower(hex(substring(SHA256(input), 1, {digest:UInt8}))) "
        f"FROM {database}.rollouts FINAL WHERE rollout_id IN {{ids:Array(String)}}"
    )
    return sql, {"ids": sorted(ids), "digest": INPUT_DIGEST_BYTES}


def held_from_rows(rows: Iterable[Sequence[Any]]) -> dict[str, HeldRequest]:
    """The answer to :func:`stored_rollouts_query`, by rollout id (legacy ids marked ``legacy``)."""
    held: dict[str, HeldRequest] = {}
    for rollout_id, digest in ((str(row[0]), str(row[1])) for row in rows):
        legacy = len(rollout_id) == len("ro-") + LEGACY_ROLLOUT_ID_HEX
        held[rollout_id] = HeldRequest(rollout_id, bytes.fromhex(digest), legacy=legacy)
    return held


def stored_for(stored: Mapping[str, HeldRequest], request_id: str) -> HeldRequest | None:
    """What the stored rollout of ``request_id`` holds: under its own id, else its legacy one."""
    return stored.get(rollout_id_for(request_id)) or stored.get(legacy_rollout_id_for(request_id))


class RecentRequests:
    """What the rollouts this process enqueued lately hold (the newest ``capacity``).

    The rollout processor's refusal of a second enqueue of a known rollout is the guarantee;
    this is what answers the common case (a client retrying soon) without asking ClickHouse,
    and the one place that knows each rollout's request id, so it tells a collision from a copy.
    Per rollout: its id and 48 bytes (the request digest, the input digest), ~250 B in all.
    """

    def __init__(self, capacity: int = 200_000) -> None:
        self.capacity = capacity
        self._held: OrderedDict[str, bytes] = OrderedDict()

    def held(self, rollout_id: str) -> HeldRequest | None:
        packed = self._held.get(rollout_id)
        if packed is None:
            return None
        return HeldRequest(rollout_id, packed[32:], packed[:32])

    def __contains__(self, rollout_id: str) -> bool:
        return rollout_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def add(self, held: HeldRequest) -> None:
        assert held.request_digest is not None, "the ingress remembers requests it saw"
        self._held[held.rollout_id] = held.request_digest + held.input_digest
        self._held.move_to_end(held.rollout_id)
        while len(self._held) > self.capacity:
            self._held.popitem(last=False)
