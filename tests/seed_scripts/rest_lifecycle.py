"""The seed's own HTTP client (Agent Lightning 0.3.0's ``LightningStoreClient``) through a whole
rollout lifecycle against an agl-stream gateway's ``/v1/agl``.

Run by the seed's python (``tests/integration/test_seed_rest_api.py`` does it), never imported
by agl-stream's: ``python rest_lifecycle.py <gateway url>``. It prints one JSON object of what it
observed (ids, statuses, counts, the HTTP statuses of refused calls) on its last stdout line;
the test asserts on it. Everything else goes to stderr.

The queue may hold other tests' rollouts (one stack serves the session), so claims repeat until
they get this script's own rollout.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
import uuid
from typing import Any

import aiohttp
from agentlightning.store.client_server import LightningStoreClient
from agentlightning.types import (
    LLM,
    AttemptedRollout,
    EnqueueRolloutRequest,
    PromptTemplate,
    RolloutConfig,
    Span,
)
from agentlightning.utils.otlp import LightningStoreOTLPExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

CLAIM_TRIES = 500


async def claim(client: LightningStoreClient, rollout_id: str, worker_id: str) -> AttemptedRollout:
    """Dequeue until ``rollout_id`` comes up (claims of other tests' leftovers are dropped)."""
    for _ in range(CLAIM_TRIES):
        claimed = await client.dequeue_rollout(worker_id=worker_id)
        if claimed is not None and claimed.rollout_id == rollout_id:
            return claimed
    raise AssertionError(f"{rollout_id} was never dequeued")


async def status_of(call: Any) -> int | None:
    """The HTTP status a refused call raised with (None when it did not raise)."""
    try:
        await call
    except aiohttp.ClientResponseError as error:
        return error.status
    return None


async def main(url: str) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    worker, other_worker, direct_worker = f"seed-{tag}-w1", f"seed-{tag}-w2", f"seed-{tag}-w3"
    out: dict[str, Any] = {"tag": tag, "seconds": {}}
    started = time.monotonic()

    def lap(phase: str) -> None:
        out["seconds"][phase] = round(time.monotonic() - started, 3)

    client = LightningStoreClient(url, retry_delays=(), health_retry_delays=())
    try:
        async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/agl/health") as response:
            out["health"] = [response.status, await response.json()]

        # -- resources --
        added = await client.add_resources(
            {
                "llm": LLM(endpoint="http://127.0.0.1:9/v1", model="m-1", api_key="sk-seed"),
                "prompt": PromptTemplate(template="Q: {q}", engine="f-string"),
            }
        )
        updated = await client.update_resources(
            added.resources_id, {"llm": LLM(endpoint="http://127.0.0.1:9/v1", model="m-2", api_key="sk-seed")}
        )
        latest = await client.get_latest_resources()
        by_id = await client.get_resources_by_id(added.resources_id)
        listed = await client.query_resources(resources_id=added.resources_id)
        assert latest is not None and by_id is not None
        out["resources"] = {
            "id": added.resources_id,
            "versions": [added.version, updated.version],
            "latest": [latest.resources_id, latest.version],
            "by_id_model": by_id.resources["llm"].model,  # type: ignore[union-attr]
            "by_id_api_key": by_id.resources["llm"].api_key,  # type: ignore[union-attr]
            "listed": [[r.resources_id, r.version] for r in listed.items],
            "listed_total": listed.total,
            "missing": await client.get_resources_by_id("rs-000000000bad"),
        }

        lap("resources")

        # -- enqueue, claim, spans on the first attempt --
        rollout = await client.enqueue_rollout(
            input={"question": "2+2"},
            mode="train",
            resources_id=added.resources_id,
            config=RolloutConfig(max_attempts=2, retry_condition=["failed"]),
            metadata={"origin": "seed-client"},
        )
        rid = rollout.rollout_id
        first = await claim(client, rid, worker)
        aid = first.attempt.attempt_id
        sequence_id = await client.get_next_span_sequence_id(rid, aid)
        await client.add_span(
            Span.from_attributes(
                attributes={"step": 1, "tags": ["a", "b"]},
                rollout_id=rid,
                attempt_id=aid,
                sequence_id=sequence_id,
                name="seed.rest",
            )
        )
        memory = InMemorySpanExporter()
        recorder = TracerProvider()
        recorder.add_span_processor(SimpleSpanProcessor(memory))
        with recorder.get_tracer("seed-script").start_as_current_span("seed.otel", attributes={"via": "add_otel_span"}):
            pass
        [readable] = memory.get_finished_spans()
        await client.add_otel_span(rid, aid, readable)
        # The seed's tracer path: its OTLP exporter, pointed at the client's traces endpoint.
        exporter = LightningStoreOTLPExporter()
        exporter.enable_store_otlp(client.otlp_traces_endpoint(), rid, aid)
        exporting = TracerProvider()
        exporting.add_span_processor(SimpleSpanProcessor(exporter))
        with exporting.get_tracer("seed-script").start_as_current_span("seed.otlp", attributes={"via": "otlp"}):
            pass  # the simple processor exports when the span ends, before this block is left
        running = await client.get_rollout_by_id(rid)
        spans = await client.query_spans(rid, aid)
        only = await client.query_spans(rid, "latest", name="seed.otlp")
        paged = await client.query_spans(rid, aid, limit=1, offset=1)
        assert running is not None
        out["first_attempt"] = {
            "claimed": [first.status, first.attempt.sequence_id, first.attempt.status, first.attempt.worker_id],
            "resources_id": first.resources_id,
            "rollout_status_after_spans": running.status,
            "spans": [[s.name, s.sequence_id, s.attributes.get("via")] for s in spans.items],
            "span_total": spans.total,
            "by_name": [s.name for s in only.items],
            "page": [[s.name for s in paged.items], paged.limit, paged.offset, paged.total],
        }
        lap("first_attempt")
        failed = await client.update_attempt(rid, aid, status="failed")
        requeued = await client.get_rollout_by_id(rid)
        assert requeued is not None
        out["failed"] = [failed.status, requeued.status]

        # -- the retry succeeds --
        second = await claim(client, rid, worker)
        succeeded = await client.update_attempt(rid, "latest", status="succeeded", metadata={"score": 1})
        attempts = await client.query_attempts(rid)
        newest = await client.get_latest_attempt(rid)
        assert newest is not None
        out["second_attempt"] = {
            "sequence_id": second.attempt.sequence_id,
            "updated": [succeeded.status, succeeded.metadata],
            "attempts": [[a.sequence_id, a.status] for a in attempts.items],
            "latest": newest.sequence_id,
        }

        lap("second_attempt")

        # -- more rollouts: many at once, an update, a cancel, a manual attempt, a started one --
        many = await client.enqueue_many_rollouts(
            [EnqueueRolloutRequest(input={"n": 1}), EnqueueRolloutRequest(input={"n": 2}, mode="val")]
        )
        m1, m2 = many[0].rollout_id, many[1].rollout_id
        edited = await client.update_rollout(m1, metadata={"edited": True})
        cancelled = await client.update_rollout(m2, status="cancelled")
        manual = await client.start_attempt(m1, worker_id=other_worker)
        await client.update_attempt(m1, manual.attempt.attempt_id, status="succeeded")
        direct = await client.start_rollout(input={"direct": True}, mode="test", worker_id=direct_worker)
        out["more"] = {
            "many": [[r.status, r.mode, r.resources_id] for r in many],
            "edited": edited.metadata,
            "cancelled": cancelled.status,
            "manual": [manual.attempt.sequence_id, manual.attempt.worker_id, manual.status],
            "direct": [direct.status, direct.attempt.status, direct.attempt.worker_id, direct.resources_id],
        }
        mine = [rid, m1, m2, direct.rollout_id]

        lap("more")

        # -- waits, queries, workers, statistics --
        waited = [rid, m1, m2, direct.rollout_id, "ro-000000000bad"]
        finished = await client.wait_for_rollouts(rollout_ids=waited, timeout=0.1)  # the client's longest
        first_page = await client.query_rollouts(rollout_id_in=mine, sort_by="start_time", limit=2)
        done = await client.query_rollouts(rollout_id_in=mine, status_in=["succeeded"])
        heartbeat = await client.update_worker(worker, {"cpu": 0.5})
        seen_worker = await client.get_worker_by_id(worker)
        workers = await client.query_workers(worker_id_contains=tag)
        assert seen_worker is not None
        out["queries"] = {
            "finished": sorted([r.rollout_id for r in finished]) == sorted([rid, m1, m2]),
            "finished_statuses": sorted(r.status for r in finished),
            "first_page": [[r.rollout_id for r in first_page.items], first_page.total],
            "first_page_expected": mine[:2],
            "done": sorted(r.rollout_id for r in done.items) == sorted([rid, m1]),
            "done_have_attempts": all(isinstance(r, AttemptedRollout) for r in done.items),
            "worker": [heartbeat.worker_id, heartbeat.heartbeat_stats, seen_worker.heartbeat_stats],
            "workers": sorted(w.worker_id for w in workers.items),
            "statistics": await client.statistics(),
        }

        lap("queries")

        # -- what the seed's client makes of unknown ids --
        out["unknown"] = {
            "get_rollout": await client.get_rollout_by_id("ro-000000000bad"),
            "latest_attempt": await client.get_latest_attempt("ro-000000000bad"),
            "worker": await client.get_worker_by_id(f"seed-{tag}-nobody"),
            "update_attempt": await status_of(client.update_attempt("ro-000000000bad", "latest", status="failed")),
            "update_resources": await status_of(client.update_resources(f"rs-{tag}-new", {})),
            "next_sequence_id": await status_of(client.get_next_span_sequence_id("ro-000000000bad", "at-1")),
            "illegal": await status_of(client.update_attempt(rid, "latest", status="running")),
        }
        lap("unknown")
        out["ids"] = {"rollout": rid, "many": [m1, m2], "direct": direct.rollout_id, "worker": worker}
    finally:
        await client.close()
    return out


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    result = asyncio.run(main(sys.argv[1]))
    print(json.dumps(result, default=str))
