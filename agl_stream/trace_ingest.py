"""Decoded OTLP spans into agl.spans: sequence ids, the attempt check and the write.

Shared by both ways OTLP traces come in: the gateway's ``POST /v1/traces`` (consumers/gateway.py,
which keeps only the HTTP mapping) and the collector's Kafka topic (consumers/otlp_kafka.py).
Decoding is agl_stream/wire/otlp.py; this module is what happens after it, through a store client.

Semantics of one export (a request, or one poll batch of Kafka messages):

- Spans the store client stored before (an exporter retrying a request that succeeded) are
  left out: not numbered, counted, written or refused.
- Per attempt named in it, one SpanSequenceRequested event reserves the ids of its spans that
  carry no ``agentlightning.span_sequence_id`` (in order), and one id when all of them carry
  their own. It is also the attempt's heartbeat for these spans (their count, the highest id a
  span brought itself), and how an unknown rollout or attempt is found *before* anything is
  written. The spans of an attempt the processor refuses are refused with its reason; the
  other attempts' spans go on.
- The rest is written with one ``add_many_spans(..., counted=True)``: the spans only, no event
  (the reservation was their heartbeat). A write that fails after the reservation leaves the
  attempt counting spans that never came: the triplet builder then waits its settle time for
  them and hands the attempt out as incomplete.
- A reservation failed (processor silent, broker down, store client not started): the spans
  of the attempts reserved are written, then :class:`TracesUnavailableError`, and a retry is
  safe (the spans stored are left out of it). Failed while writing:
  :class:`TracesWriteError`: some spans may be stored, so a blind retry would store them again
  under new sequence ids.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from agl_stream.background import BackgroundClient
from agl_stream.config import Settings
from agl_stream.errors import AglError
from agl_stream.logs import get_logger
from agl_stream.models import Span
from agl_stream.store.client import AglStore
from agl_stream.store.readside import ReadSide
from agl_stream.wire import otlp

log = get_logger("agl.trace_ingest")


class TracesUnavailableError(AglError):
    """Nothing was written and a retry may succeed (the gateway answers HTTP 503)."""


class TracesWriteError(AglError):
    """Writing failed part way: some spans may be stored, so a blind retry could store them twice
    (the gateway answers HTTP 500)."""


class SpansRejectedError(AglError, ValueError):
    """Spans of an OTLP message that cannot be stored (no rollout/attempt ids, invalid ids, too
    large, an attempt the store refused); the message says how many and why."""


@dataclass
class Numbered:
    """The outcome of :func:`number_spans`, by the index of each span in its input."""

    spans: dict[int, Span] = field(default_factory=dict)
    refused: dict[int, str] = field(default_factory=dict)
    # A reservation that failed (not a refusal): its spans are in neither; the others, counted
    # already, are written before :func:`write_spans` raises, so a retry stores only the rest.
    unavailable: BaseException | None = None

    def accepted(self) -> list[Span]:
        """The numbered spans in input order."""
        return [self.spans[index] for index in sorted(self.spans)]


MAX_ATTEMPTS_PER_EXPORT = 256
"""Attempts one export may name. Each costs one event on agl.rollouts (kept for good) before the
processor can say whether the attempt exists, so one request cannot make thousands; a runner's
exporter names at most its concurrent attempts."""


async def number_spans(
    store: AglStore, spans: Sequence[otlp.DecodedSpan], max_attempts: int = MAX_ATTEMPTS_PER_EXPORT
) -> Numbered:
    """Each span of an attempt the processor knows with its sequence id; the others refused with
    the processor's reason; those the store client stored before in neither. One reservation per
    attempt, all attempts at once, each the heartbeat of its spans; the spans of attempts past
    the first ``max_attempts`` named are refused unread."""
    unstored = {id(span) for span in store.unstored_spans([decoded.span for decoded in spans])}
    by_attempt: dict[tuple[str, str], list[int]] = defaultdict(list)
    for index, decoded in enumerate(spans):
        if id(decoded.span) in unstored:
            by_attempt[(decoded.span.rollout_id, decoded.span.attempt_id)].append(index)
    attempts = list(by_attempt)
    result = Numbered()
    for pair in attempts[max_attempts:]:
        for index in by_attempt.pop(pair):
            result.refused[index] = (
                f"of an export naming more than {max_attempts} attempts (export more often, or fewer "
                "attempts per exporter)"
            )
    attempts = attempts[:max_attempts]
    reserved = await asyncio.gather(
        *(_reserve(store, pair, [spans[i] for i in by_attempt[pair]]) for pair in attempts),
        return_exceptions=True,
    )
    for pair, ids in zip(attempts, reserved, strict=True):
        if isinstance(ids, ValueError):  # the processor's verdict: unknown rollout or attempt
            for index in by_attempt[pair]:
                result.refused[index] = f"of an attempt the store refused ({ids})"
            continue
        if isinstance(ids, BaseException):
            result.unavailable = ids
            continue
        fresh = itertools.count(ids)
        for index in by_attempt[pair]:
            decoded = spans[index]
            result.spans[index] = (
                decoded.span.model_copy(update={"sequence_id": next(fresh)})
                if decoded.needs_sequence_id
                else decoded.span
            )
    return result


async def _reserve(store: AglStore, pair: tuple[str, str], spans: Sequence[otlp.DecodedSpan]) -> int:
    """The first of the ids reserved for the spans that need one (one id when none does), in
    the event that is these spans' heartbeat."""
    own = [decoded.span.sequence_id for decoded in spans if not decoded.needs_sequence_id]
    needed = sum(decoded.needs_sequence_id for decoded in spans)
    return await store.reserve_span_sequence_ids(
        *pair, max(1, needed), spans=len(spans), max_sequence_id=max(own) if own else None
    )


async def write_spans(store: AglStore, numbered: Numbered) -> None:
    """Write the numbered spans, whose heartbeats their reservations were; then
    TracesUnavailableError if a reservation failed (a retry stores the rest: what this client
    stored is left out)."""
    spans = numbered.accepted()
    if spans:
        try:
            await store.add_many_spans(spans, counted=True)
        except Exception as error:
            raise TracesWriteError(
                f"writing {len(spans)} spans failed part way ({type(error).__name__}: {error}); some may be stored"
            ) from error
    if (failed := numbered.unavailable) is not None:
        raise TracesUnavailableError(
            f"reserving span sequence ids failed ({type(failed).__name__}: {failed}); the spans of the other "
            "attempts are stored, retry later for the rest"
        ) from failed


class TraceIngest:
    """A store client started in the background, and :meth:`export` for decoded requests.

    The client runs with the given settings; one that failed to start is started again by the
    next caller of :meth:`store` (the first exports may come before the broker is reachable).
    """

    def __init__(self, settings: Settings, *, read_side: ReadSide | None = None) -> None:
        self.settings = settings
        self.read_side = read_side  # where the client reads (the gateway's engine, in process)
        self._client = BackgroundClient[AglStore](
            "trace store client", self._open, _close_store, TracesUnavailableError
        )

    def start(self, gateway_url: str | None = None) -> None:
        """Start the store client in the background; ``gateway_url`` is the read side to use when
        the settings name none (the gateway passes its own URL)."""
        if self.settings.gateway_url is None and gateway_url is not None:
            self.settings = self.settings.model_copy(update={"gateway_url": gateway_url})
        self._client.start()

    async def _open(self) -> AglStore:
        store = AglStore(self.settings, read_side=self.read_side)
        try:
            return await store.start()
        except Exception as error:
            log.warning("the trace store client did not start", error=f"{type(error).__name__}: {error}")
            raise

    async def store(self) -> AglStore:
        return await self._client.get("the store client cannot start")

    async def close(self) -> None:
        await self._client.close()

    async def export(self, decoded: otlp.DecodedTraces) -> tuple[int, str]:
        """Number and write one request's spans; ``(rejected_spans, message)`` for OTLP's
        ``partial_success`` (a message with 0 rejected is a warning)."""
        rejected = Counter(decoded.rejected)
        message = ""
        if decoded.spans:
            store = await self.store()
            numbered = await number_spans(store, decoded.spans)
            rejected.update(numbered.refused.values())
            try:
                await write_spans(store, numbered)
            except TracesWriteError as error:
                raise TracesWriteError(f"{error}, so the request is not to be retried") from error
        rejected_count = sum(rejected.values())
        if rejected:
            message = otlp.rejection_message(rejected, decoded.total) + (f"; {message}" if message else "")
        if message:
            log.warning(
                "OTLP export not fully accepted", rejected=rejected_count, total=decoded.total, reason=message[:500]
            )
        return rejected_count, message


async def _close_store(store: AglStore) -> None:
    await store.close()
