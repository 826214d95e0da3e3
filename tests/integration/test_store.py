"""The LightningStore contract against the real stack: broker, rollout processor, gateway + chDB.

One stack serves the module (see the `stack_settings` fixture); each test works on rollouts
of its own.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from agl_stream import UNSET, AglStore, AttemptedRollout, connect
from agl_stream.config import Settings
from agl_stream.domain.queue import claim_attempt_id
from agl_stream.ids import new_event_id
from agl_stream.kafka.offsets import end_offsets
from agl_stream.models import LLM, Reply, RolloutConfig, Span, StoreRequest
from agl_stream.store import writes as client_module
from agl_stream.store.notices import EMPTY_TTL_S
from agl_stream.store.replies import REPLY_HEADER, REPLY_STATE_HEADER, RejectedError
from agl_stream.wire.codec import Codec

pytestmark = pytest.mark.integration


@pytest.fixture
async def store(stack_settings: Settings) -> AsyncIterator[AglStore]:
    async with connect(**stack_settings.model_dump(exclude_none=True)) as client:
        yield client


async def _claim(store: AglStore, rollout_id: str, worker_id: str = "w-1", tries: int = 200) -> object:
    """Dequeue until the given rollout comes up (other tests' rollouts may be queued too)."""
    for _ in range(tries):
        claimed = await store.dequeue_rollout(worker_id=worker_id)
        if claimed is not None and claimed.rollout_id == rollout_id:
            return claimed
    raise AssertionError(f"{rollout_id} was never dequeued")


def _span(rollout_id: str, attempt_id: str, sequence_id: int, name: str = "step") -> Span:
    return Span(
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        sequence_id=sequence_id,
        trace_id=f"{sequence_id:032x}",
        span_id=f"{sequence_id:016x}",
        name=name,
        attributes={"reward": 0.5, "ok": True},
        start_time=1.0,
        end_time=2.0,
    )


async def test_enqueue_dequeue_run_succeed(store: AglStore) -> None:
    rollout = await store.enqueue_rollout({"question": "2+2"}, mode="train", metadata={"k": "v"})
    assert rollout.status == "queuing" and rollout.rollout_id.startswith("ro-")
    claimed = await _claim(store, rollout.rollout_id, "w-7")
    assert claimed.status == "preparing"  # type: ignore[attr-defined]
    attempt = claimed.attempt  # type: ignore[attr-defined]
    assert attempt.sequence_id == 1 and attempt.status == "preparing" and attempt.worker_id == "w-7"
    await store.add_span(_span(rollout.rollout_id, attempt.attempt_id, 1))
    running = await store.get_rollout_by_id(rollout.rollout_id)
    assert running is not None and running.status == "running"
    latest = await store.get_latest_attempt(rollout.rollout_id)
    assert latest is not None and latest.status == "running" and latest.last_heartbeat_time is not None
    done = await store.update_attempt(rollout.rollout_id, "latest", status="succeeded")
    assert done.status == "succeeded" and done.end_time is not None
    [finished] = await store.wait_for_rollouts(rollout_ids=[rollout.rollout_id], timeout=120)
    assert finished.status == "succeeded" and finished.end_time is not None
    spans = await store.query_spans(rollout.rollout_id, "latest")
    assert [s.sequence_id for s in spans] == [1] and spans[0].attributes == {"reward": 0.5, "ok": True}


async def test_spans_for_an_attempt_another_client_claimed_are_accepted_and_seen(stack_settings: Settings) -> None:
    options = stack_settings.model_dump(exclude_none=True)
    async with connect(**options) as claimer, connect(**options) as tracer:
        rollout = await claimer.enqueue_rollout({"q": "spans"})
        claimed = await _claim(claimer, rollout.rollout_id)
        aid = claimed.attempt.attempt_id  # type: ignore[attr-defined]
        # The tracer never saw this attempt: its spans wait for the processor's verdict.
        await tracer.add_many_spans([_span(rollout.rollout_id, aid, 1), _span(rollout.rollout_id, aid, 2)])
        # The claimer knows it: its span only waits for the broker, yet its read sees the effect.
        await claimer.add_span(_span(rollout.rollout_id, aid, 3))
        latest = await claimer.get_latest_attempt(rollout.rollout_id)
        assert latest is not None and latest.status == "running" and latest.last_heartbeat_time is not None
        assert [s.sequence_id for s in await claimer.query_spans(rollout.rollout_id, aid)] == [1, 2, 3]


async def test_a_read_of_one_rollout_waits_for_that_rollouts_writes_only(store: AglStore) -> None:
    # Two running attempts; spans of both only waited for the broker (their heartbeats unfolded).
    one, two = await store.enqueue_rollout({"q": 1}), await store.enqueue_rollout({"q": 2})
    first, second = await _claim(store, one.rollout_id), await _claim(store, two.rollout_id)
    await store.add_span(_span(one.rollout_id, first.attempt.attempt_id, 1))  # type: ignore[attr-defined]
    await store.add_span(_span(two.rollout_id, second.attempt.attempt_id, 1))  # type: ignore[attr-defined]
    # A read of the first sees its own span's effect (running), whatever the second's stand.
    running = await store.get_rollout_by_id(one.rollout_id)
    assert running is not None and running.status == "running"
    assert [s.sequence_id for s in await store.query_spans(one.rollout_id, "latest")] == [1]
    # A rollout this client never wrote about reads at once (nothing of it to wait for).
    assert await store.get_rollout_by_id("ro-000000000000") is None
    assert await store.query_spans("ro-000000000000", "latest") == []
    latest = await store.get_latest_attempt(two.rollout_id)
    assert latest is not None and latest.status == "running"


async def test_start_rollout_creates_the_first_attempt(store: AglStore) -> None:
    started = await store.start_rollout({"q": 1})
    assert started.status == "preparing" and started.attempt.sequence_id == 1
    attempts = await store.query_attempts(started.rollout_id)
    assert [a.attempt_id for a in attempts] == [started.attempt.attempt_id]


async def test_changes_to_unknown_ids_raise_value_error_and_reads_answer_empty(store: AglStore) -> None:
    with pytest.raises(ValueError, match="unknown rollout"):
        await store.update_rollout("ro-000000000bad", status="failed")
    with pytest.raises(ValueError):
        await store.start_attempt("ro-000000000bad")
    rollout = await store.enqueue_rollout({"q": 2})
    with pytest.raises(ValueError, match="attempt"):
        await store.update_attempt(rollout.rollout_id, "at-00000bad", status="failed")
    with pytest.raises(ValueError):
        await store.get_next_span_sequence_id(rollout.rollout_id, "at-00000bad")
    with pytest.raises(ValueError, match="attempt"):  # spans of an attempt this client never saw are checked
        await store.add_many_spans([_span(rollout.rollout_id, "at-00000bad", 1)])
    with pytest.raises(ValueError, match="do not exist"):
        await store.enqueue_rollout({"q": 3}, resources_id="rs-000000000bad")
    assert await store.get_rollout_by_id("ro-000000000bad") is None
    # Reads answer empty for an unknown id, as the seed's stores do.
    assert await store.query_attempts("ro-000000000bad") == []
    assert await store.get_latest_attempt("ro-000000000bad") is None
    assert await store.query_spans("ro-000000000bad") == []
    assert await store.query_spans(rollout.rollout_id, "at-00000bad") == []


async def test_update_rollout_keeps_unset_fields(store: AglStore) -> None:
    rollout = await store.enqueue_rollout({"q": 4}, metadata={"a": 1}, mode="val")
    updated = await store.update_rollout(rollout.rollout_id, metadata=None)
    assert updated.metadata is None and updated.mode == "val" and updated.input == {"q": 4}
    updated = await store.update_rollout(rollout.rollout_id, mode=UNSET, status="cancelled")
    assert updated.status == "cancelled" and updated.mode == "val" and updated.end_time is not None


async def test_retries_follow_the_rollout_config(store: AglStore) -> None:
    config = RolloutConfig(max_attempts=2, retry_condition=["failed"])
    rollout = await store.enqueue_rollout({"q": 5}, config=config)
    first = await _claim(store, rollout.rollout_id)
    await store.update_attempt(rollout.rollout_id, first.attempt.attempt_id, status="failed")  # type: ignore[attr-defined]
    requeued = await store.get_rollout_by_id(rollout.rollout_id)
    assert requeued is not None and requeued.status == "requeuing"
    second = await _claim(store, rollout.rollout_id)
    assert second.attempt.sequence_id == 2  # type: ignore[attr-defined]
    await store.update_attempt(rollout.rollout_id, "latest", status="failed")
    final = await store.get_rollout_by_id(rollout.rollout_id)
    assert final is not None and final.status == "failed"
    assert [a.sequence_id for a in await store.query_attempts(rollout.rollout_id)] == [1, 2]


async def test_span_sequence_ids_strictly_increase(store: AglStore) -> None:
    started = await store.start_rollout({"q": 6})
    rid, aid = started.rollout_id, started.attempt.attempt_id
    first = await store.get_next_span_sequence_id(rid, aid)
    many = await store.get_many_span_sequence_ids([(rid, aid)] * 3)
    assert [first, *many] == list(range(first, first + 4))
    await store.add_span(_span(rid, aid, 100))
    assert await store.get_next_span_sequence_id(rid, aid) == 101


async def test_resources_latest_and_update(store: AglStore) -> None:
    llm = LLM(resource_type="llm", endpoint="http://127.0.0.1:1/v1", model="m", sampling_parameters={})
    first = await store.add_resources({"policy": llm})
    assert (await store.get_latest_resources()).resources_id == first.resources_id  # type: ignore[union-attr]
    updated = await store.update_resources(first.resources_id, {"policy": llm.model_copy(update={"model": "m2"})})
    assert updated.version == first.version + 1
    fetched = await store.get_resources_by_id(first.resources_id)
    assert fetched is not None and fetched.resources["policy"].model == "m2"  # type: ignore[union-attr]
    started = await store.start_rollout({"q": 7})
    assert started.resources_id == first.resources_id  # start_rollout resolves the latest
    fresh_id = f"rs-new-{uuid.uuid4().hex[:8]}"
    created = await store.update_resources(fresh_id, {"policy": llm})  # a new id is created, as the seed does
    assert (created.resources_id, created.version) == (fresh_id, 1)
    assert (await store.get_latest_resources()).resources_id == fresh_id  # type: ignore[union-attr]


async def test_api_keys_reach_the_store_but_never_the_sql_tables(store: AglStore) -> None:
    key = f"sk-{uuid.uuid4().hex}"
    llm = LLM(resource_type="llm", endpoint="http://127.0.0.1:1/v1", model="m", api_key=key, sampling_parameters={})
    added = await store.add_resources(
        {"policy": llm, "template": {"resource_type": "prompt_template", "template": "hi", "engine": "f-string"}}
    )
    for fetched in (await store.get_resources_by_id(added.resources_id), await store.get_latest_resources()):
        assert fetched is not None and fetched.resources["policy"].api_key == key  # type: ignore[union-attr]
    [listed] = await store.query_resources(resources_id=added.resources_id)
    assert listed.resources["policy"].api_key == "[redacted]"  # type: ignore[union-attr]
    rows = await store.side.query(  # type: ignore[union-attr]
        f"SELECT count() AS n FROM {store.settings.clickhouse_database}.resources "
        "WHERE position(toString(resources), {key:String}) > 0",
        {"key": key},
        fence={store.topics["resources"]: dict(store.fence[store.topics["resources"]])},
    )
    assert rows.dicts() == [{"n": 0}]


async def test_concurrent_claimers_claim_each_rollout_once(stack_settings: Settings) -> None:
    options = stack_settings.model_dump(exclude_none=True)
    async with connect(**options) as producer:
        rollouts = await producer.enqueue_many_rollouts([{"input": {"i": i}} for i in range(200)])
    wanted = {r.rollout_id for r in rollouts}
    claims: dict[str, list[str]] = {}

    async def claimer(index: int) -> None:
        async with connect(**options) as client:
            idle = 0
            while idle < 20 and not wanted <= claims.keys():
                claimed = await client.dequeue_rollout(worker_id=f"w-{index}")
                if claimed is None:
                    idle += 1
                    continue
                idle = 0
                claims.setdefault(claimed.rollout_id, []).append(claimed.attempt.attempt_id)

    await asyncio.gather(*(claimer(i) for i in range(8)))
    assert wanted <= claims.keys()
    assert all(len(claims[rid]) == 1 for rid in wanted), "a rollout was claimed twice"


async def test_a_claim_sent_again_gets_the_rollout_it_claimed_and_no_second_one(store: AglStore) -> None:
    """A claimer whose answer was lost (a broker failing over) sends the same claim again: the
    copies, at once or after the claim was served, all name one rollout and one attempt."""
    await store.enqueue_many_rollouts([{"input": {"i": i}} for i in range(3)])
    topic = store.settings.topic("store-requests")
    request = StoreRequest(
        request_id=new_event_id(), kind="claim", reply_to=store._replies.topic, time=time.time(), worker_id="w-again"
    )
    # The first copy's answer is lost (nobody waits for it); the second may find the claim in
    # the same batch, in flight or folded; the third finds it folded.
    await store._records.send(topic, request, key=request.request_id, partition=0)
    answers = [await store._claim(topic, 0, request) for _ in range(2)]
    assert [a.outcome for a in answers] == ["applied"] * 2
    claimed = {a.state.rollout.rollout_id for a in answers if a.state is not None}
    assert len(claimed) == 1
    [rollout_id] = claimed
    attempts = await store.query_attempts(rollout_id)
    assert [a.attempt_id for a in attempts] == [claim_attempt_id(request.request_id)]
    await store.update_attempt(rollout_id, attempts[0].attempt_id, status="succeeded")


async def test_an_event_whose_answer_is_lost_is_found_in_its_rollouts_state(
    stack_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An answer lost on its way (a broker failing over) does not fail the call: the event is in
    the log, and the state the processor folded it into is the answer."""
    monkeypatch.setattr(client_module, "ANSWER_RECHECK_S", 0.5)
    options = stack_settings.model_dump(exclude_none=True)
    async with connect(**options) as writer, connect(**options) as other:
        [rollout] = await writer.enqueue_many_rollouts([{"input": {"lost": True}}])
        # Its answers now go to another client's topic: for this client they are lost.
        writer._state_header = [(REPLY_HEADER, other._replies.topic.encode()), (REPLY_STATE_HEADER, b"1")]
        updated = await writer.update_rollout(rollout.rollout_id, metadata={"answer": "lost"})
        assert updated.metadata == {"answer": "lost"}
        # Read-your-writes holds: the read is fenced on the state record the recovered answer names.
        assert (await writer.get_rollout_by_id(rollout.rollout_id)).metadata == {"answer": "lost"}  # type: ignore[union-attr]


async def test_illegal_transitions_are_errors_not_silent(store: AglStore) -> None:
    started = await store.start_rollout({"q": 8})
    await store.update_attempt(started.rollout_id, started.attempt.attempt_id, status="succeeded")
    with pytest.raises(RejectedError, match="succeeded"):
        await store.update_attempt(started.rollout_id, started.attempt.attempt_id, status="running")


async def test_oversize_input_is_refused_before_it_is_sent(store: AglStore) -> None:
    with pytest.raises(ValueError, match="limit"):
        await store.enqueue_rollout({"blob": "x" * 2_000_000})


async def test_watchdog_times_out_then_retries_then_fails(store: AglStore) -> None:
    config = RolloutConfig(timeout_seconds=0.5, max_attempts=2, retry_condition=["timeout"])
    rollout = await store.enqueue_rollout({"q": 9}, config=config)
    await _claim(store, rollout.rollout_id)
    await _claim(store, rollout.rollout_id)  # requeued by the watchdog after the first timed out
    [final] = await store.wait_for_rollouts(rollout_ids=[rollout.rollout_id], timeout=30)
    assert final.status == "failed"
    attempts = await store.query_attempts(rollout.rollout_id)
    assert [(a.sequence_id, a.status) for a in attempts] == [(1, "timeout"), (2, "timeout")]


async def test_garbage_on_the_rollouts_topic_is_dead_lettered_and_the_processor_goes_on(
    store: AglStore, stack_settings: Settings
) -> None:
    from agl_stream.kafka.io import make_producer
    from agl_stream.models import DlqRecord
    from agl_stream.wire.codec import Codec
    from tests.integration.helpers import read_topic

    producer = make_producer(stack_settings)
    await producer.start()
    try:
        sent = await producer.send_and_wait(
            stack_settings.topic("rollouts"), b"not avro at all", key=b"ro-garbage00000"
        )
    finally:
        await producer.stop()
    rollout = await store.enqueue_rollout({"after": "garbage"})  # the processor still folds events
    assert (await store.get_rollout_by_id(rollout.rollout_id)) is not None
    records = [
        Codec.default().decode(r.value, DlqRecord)
        for r in await read_topic(stack_settings, stack_settings.topic("dlq"), 1)
    ]
    ours = [r for r in records if (r.source_partition, r.source_offset) == (sent.partition, sent.offset)]
    assert ours and ours[0].value == b"not avro at all" and ours[0].error_type == "NotSingleObjectEncodedError"


async def test_an_oversize_event_is_dead_lettered_with_its_size_and_the_processor_goes_on(
    store: AglStore, stack_settings: Settings
) -> None:
    """Written past the client's own check (by any producer): a 2 MB enqueue whose state could
    never be written; compressed, it fits the topic. It costs one DLQ record, not a crashed or
    stuck processor."""
    from agl_stream.kafka.io import make_producer
    from agl_stream.models import Rollout, RolloutEnqueued, RolloutEvent
    from tests.integration.helpers import dlq_records

    rollout_id = "ro-0000000000ff"
    event = RolloutEvent(
        event_id="ev-oversize",
        rollout_id=rollout_id,
        time=1.0,
        writer="test",
        payload=RolloutEnqueued(
            rollout=Rollout(rollout_id=rollout_id, input={"blob": "x" * 2_000_000}, start_time=1.0)
        ),
    )
    value = Codec.default().encode(event)
    producer = make_producer(stack_settings, compression_type="gzip")
    await producer.start()
    try:
        sent = await producer.send_and_wait(stack_settings.topic("rollouts"), value, key=rollout_id.encode())
    finally:
        await producer.stop()
    [dead] = await dlq_records(
        stack_settings, 1, lambda r: (r.source_partition, r.source_offset) == (sent.partition, sent.offset)
    )
    assert dead.error_type == "OversizeRecordError" and "over the 1,000,000-byte limit" in dead.reason
    assert dead.value_size == len(value) and len(dead.value) < len(value)
    after = await store.enqueue_rollout({"after": "oversize"})
    assert (await store.get_rollout_by_id(after.rollout_id)) is not None
    assert await store.get_rollout_by_id(rollout_id) is None


async def test_query_rollouts_filters_sorts_and_pages(store: AglStore) -> None:
    tag = uuid.uuid4().hex[:6]
    made = [await store.enqueue_rollout({"tag": tag, "i": i}) for i in range(5)]
    ids = [r.rollout_id for r in made]
    await store.update_rollout(ids[0], status="cancelled")
    mine = await store.query_rollouts(rollout_id_in=ids, sort_by="rollout_id", sort_order="desc")
    assert [r.rollout_id for r in mine] == sorted(ids, reverse=True)
    page = await store.query_rollouts(rollout_id_in=ids, sort_by="rollout_id", limit=2, offset=1)
    assert [r.rollout_id for r in page] == sorted(ids)[1:3]
    cancelled = await store.query_rollouts(rollout_id_in=ids, status_in=["cancelled"])
    assert [r.rollout_id for r in cancelled] == [ids[0]]
    either = await store.query_rollouts(rollout_id_in=[ids[1]], status_in=["cancelled"], filter_logic="or")
    assert {r.rollout_id for r in either} >= {ids[0], ids[1]}
    legacy = await store.query_rollouts(rollout_ids=[ids[2]], status=["queuing"])
    assert [r.rollout_id for r in legacy] == [ids[2]]
    with pytest.raises(ValueError):
        await store.query_rollouts(sort_by="no_such_field")


async def test_rollouts_pin_the_latest_resources_and_start_rollout_takes_a_worker(store: AglStore) -> None:
    llm = LLM(resource_type="llm", endpoint="http://127.0.0.1:1/v1", model="pin", sampling_parameters={})
    latest = await store.add_resources({"policy": llm})
    queued = await store.enqueue_rollout({"pin": 1})
    [many] = await store.enqueue_many_rollouts([{"input": {"pin": 2}}])
    worker = f"w-{uuid.uuid4().hex[:6]}"
    started = await store.start_rollout({"pin": 3}, worker_id=worker)
    assert {queued.resources_id, many.resources_id, started.resources_id} == {latest.resources_id}
    fetched = await store.get_rollout_by_id(queued.rollout_id)
    assert fetched is not None and fetched.resources_id == latest.resources_id
    assert started.attempt.worker_id == worker
    # Reads return a rollout with its latest attempt once it has one, as the seed's stores do.
    again = await store.get_rollout_by_id(started.rollout_id)
    assert isinstance(again, AttemptedRollout) and again.attempt.attempt_id == started.attempt.attempt_id
    assert not isinstance(fetched, AttemptedRollout)  # still queued: no attempt yet
    listed = await store.query_rollouts(rollout_id_in=[queued.rollout_id, started.rollout_id])
    assert {r.rollout_id: isinstance(r, AttemptedRollout) for r in listed} == {
        queued.rollout_id: False,
        started.rollout_id: True,
    }
    busy = await store.get_worker_by_id(worker)
    assert busy is not None and busy.status == "busy" and busy.current_rollout_id == started.rollout_id


async def test_workers_follow_their_attempts(store: AglStore) -> None:
    worker = f"w-{uuid.uuid4().hex[:6]}"
    beat = await store.update_worker(worker, heartbeat_stats={"gpu": 0.5})
    assert beat.heartbeat_stats == {"gpu": 0.5} and beat.last_heartbeat_time is not None
    rollout = await store.enqueue_rollout({"w": worker})
    claimed = await _claim(store, rollout.rollout_id, worker)
    busy = await store.get_worker_by_id(worker)
    assert busy is not None and busy.status == "busy" and busy.current_rollout_id == rollout.rollout_id
    await store.update_attempt(rollout.rollout_id, claimed.attempt.attempt_id, status="succeeded")  # type: ignore[attr-defined]
    idle = await store.get_worker_by_id(worker)
    assert idle is not None and idle.status == "idle"
    assert worker in {w.worker_id for w in await store.query_workers(status_in=["idle"])}
    stats = await store.statistics()
    assert stats["total_rollouts"] >= 1 and stats["total_workers"] >= 1


async def test_an_empty_claim_leaves_its_worker_idle_as_the_seed_does(store: AglStore) -> None:
    await _drain(store)
    fresh, worker = f"w-{uuid.uuid4().hex[:6]}", f"w-{uuid.uuid4().hex[:6]}"
    assert await store.dequeue_rollout(worker_id=fresh) is None
    idle = await store.get_worker_by_id(fresh)
    assert idle is not None and idle.status == "idle" and idle.last_dequeue_time is not None
    rollout = await store.enqueue_rollout({"idle": worker})
    claimed = await store.dequeue_rollout(worker_id=worker)
    assert claimed is not None and claimed.rollout_id == rollout.rollout_id
    assert (await store.get_worker_by_id(worker)).status == "busy"  # type: ignore[union-attr]
    # Nothing left to claim: idle, though it still names the attempt it runs (the seed's rule).
    assert await store.dequeue_rollout(worker_id=worker) is None
    after = await store.get_worker_by_id(worker)
    assert after is not None and after.status == "idle"
    assert (after.current_rollout_id, after.current_attempt_id) == (rollout.rollout_id, claimed.attempt.attempt_id)
    beat = await store.update_worker(worker, heartbeat_stats={"load": 1})  # a heartbeat keeps it idle
    assert beat.status == "idle" and beat.heartbeat_stats == {"load": 1}
    again = await store.start_attempt(rollout.rollout_id, worker_id=worker)  # busy on its new attempt
    busy = await store.get_worker_by_id(worker)
    assert busy is not None and busy.status == "busy" and busy.current_attempt_id == again.attempt.attempt_id
    assert busy.heartbeat_stats == {"load": 1}


async def test_spans_of_an_unknown_attempt_are_refused_and_not_stored(store: AglStore) -> None:
    started = await store.start_rollout({"refused": "spans"})
    assert started.metadata == {}  # none given: an empty mapping, as the seed stores it
    with pytest.raises(ValueError, match="attempt"):
        await store.add_many_spans([_span(started.rollout_id, "at-00000bad", 1)])
    await store.add_span(_span(started.rollout_id, started.attempt.attempt_id, 2))
    assert [(s.attempt_id, s.sequence_id) for s in await store.query_spans(started.rollout_id)] == [
        (started.attempt.attempt_id, 2)
    ]


async def test_add_otel_span_assigns_sequence_ids_and_spans_filter(store: AglStore) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("agent"), tracer.start_as_current_span("openai.chat.completion"):
        pass
    inner, outer = exporter.get_finished_spans()
    started = await store.start_rollout({"otel": True})
    rid, aid = started.rollout_id, started.attempt.attempt_id
    first = await store.add_otel_span(rid, aid, outer)
    second = await store.add_otel_span(rid, aid, inner)
    assert first is not None and second is not None and second.sequence_id > first.sequence_id
    assert (await store.get_rollout_by_id(rid)).status == "running"  # type: ignore[union-attr]
    llm = await store.query_spans(rid, "latest", name_contains="openai")
    assert [s.name for s in llm] == ["openai.chat.completion"] and llm[0].parent_id == first.span_id
    by_parent_or_name = await store.query_spans(rid, aid, parent_id=first.span_id, name="agent", filter_logic="or")
    assert {s.name for s in by_parent_or_name} == {"agent", "openai.chat.completion"}
    newest_first = await store.query_spans(rid, sort_order="desc", limit=1)
    assert [s.sequence_id for s in newest_first] == [second.sequence_id]
    assert await store.query_spans(rid, "at-00000bad") == []  # an unknown attempt has none, as in the seed
    # The same span again is a duplicate: not stored twice, answered None (the seed's contract).
    assert await store.add_otel_span(rid, aid, outer, sequence_id=first.sequence_id) is None
    assert len(await store.query_spans(rid)) == 2


async def test_wait_for_rollouts_returns_the_finished_subset_at_its_timeout(store: AglStore) -> None:
    done = await store.start_rollout({"w": 1})
    await store.update_attempt(done.rollout_id, "latest", status="succeeded")
    pending = await store.enqueue_rollout({"w": 2})
    started = asyncio.get_running_loop().time()
    result = await store.wait_for_rollouts(rollout_ids=[done.rollout_id, pending.rollout_id], timeout=0.5)
    waited = asyncio.get_running_loop().time() - started
    assert [r.rollout_id for r in result] == [done.rollout_id]
    assert 0.5 <= waited < 30.0  # the timeout, not the first answer, ended it
    # A rollout finishing while we wait ends the wait early.
    waiter = asyncio.create_task(store.wait_for_rollouts(rollout_ids=[pending.rollout_id], timeout=30))
    await store.update_rollout(pending.rollout_id, status="cancelled")
    [cancelled] = await asyncio.wait_for(waiter, 60)
    assert cancelled.status == "cancelled"
    # An id no store knows is left out and logged, as the seed does: a typo must not end a run.
    assert await store.wait_for_rollouts(rollout_ids=["ro-000000000bad"], timeout=0.1) == []
    both = await store.wait_for_rollouts(rollout_ids=[pending.rollout_id, "ro-000000000bad"], timeout=0.1)
    assert [r.rollout_id for r in both] == [pending.rollout_id]


async def test_an_undecodable_store_request_is_dead_lettered_and_claims_go_on(
    store: AglStore, stack_settings: Settings
) -> None:
    from agl_stream.kafka.io import make_producer
    from tests.integration.helpers import dlq_records

    producer = make_producer(stack_settings)
    await producer.start()
    try:
        bad = await producer.send_and_wait(stack_settings.topic("store-requests"), b"\x00broken request", key=b"x")
    finally:
        await producer.stop()
    rollout = await store.enqueue_rollout({"after": "bad request"})
    await _claim(store, rollout.rollout_id)
    wanted = (stack_settings.topic("store-requests"), bad.partition, bad.offset)
    [found] = await dlq_records(
        stack_settings, 1, lambda r: (r.source_topic, r.source_partition, r.source_offset) == wanted
    )
    assert found.processor == "processor.rollouts"


async def test_sequence_ids_are_counted_per_attempt(store: AglStore) -> None:
    one = await store.start_rollout({"seq": 1})
    two = await store.start_rollout({"seq": 2})
    a = (one.rollout_id, one.attempt.attempt_id)
    b = (two.rollout_id, two.attempt.attempt_id)
    ids = await store.get_many_span_sequence_ids([a, b, a, b, a])
    assert [ids[0], ids[2], ids[4]] == list(range(ids[0], ids[0] + 3))
    assert [ids[1], ids[3]] == list(range(ids[1], ids[1] + 2))
    # A second attempt of the same rollout counts on its own, from where the rollout stands.
    await store.update_attempt(one.rollout_id, "latest", status="failed")
    retry = await store.start_attempt(one.rollout_id)
    assert retry.attempt.sequence_id == 2
    [first_of_retry] = await store.get_many_span_sequence_ids([(one.rollout_id, retry.attempt.attempt_id)])
    assert first_of_retry >= 1
    assert await store.get_next_span_sequence_id(*a) == ids[4] + 1  # the old attempt's counter moved on alone
    with pytest.raises(ValueError):
        await store.get_many_span_sequence_ids([a, (one.rollout_id, "at-00000bad")])


async def test_enqueue_many_keeps_order_and_one_claimer_gets_them_oldest_first(store: AglStore) -> None:
    tag = uuid.uuid4().hex[:6]
    made = await store.enqueue_many_rollouts([{"input": {"tag": tag, "i": i}, "mode": "val"} for i in range(24)])
    assert [r.input for r in made] == [{"tag": tag, "i": i} for i in range(24)]
    assert all(r.status == "queuing" and r.mode == "val" for r in made)
    wanted = [r.rollout_id for r in made]
    claimed: list[str] = []
    for _ in range(400):
        if set(wanted) <= set(claimed):
            break
        got = await store.dequeue_rollout(worker_id="w-fifo")
        if got is not None:
            claimed.append(got.rollout_id)
    # Across all four partitions, not just within each: one processor serves every partition.
    assert [rid for rid in claimed if rid in set(wanted)] == wanted


async def test_attempt_reads_of_a_rollout_without_attempts(store: AglStore) -> None:
    rollout = await store.enqueue_rollout({"no": "attempts"})
    assert await store.query_attempts(rollout.rollout_id) == []
    assert await store.get_latest_attempt(rollout.rollout_id) is None
    manual = await store.start_attempt(rollout.rollout_id)  # a manual attempt, outside the queue
    assert manual.status == "preparing" and manual.attempt.sequence_id == 1
    latest = await store.get_latest_attempt(rollout.rollout_id)
    assert latest is not None and latest.attempt_id == manual.attempt.attempt_id


async def test_resources_query_sorts_pages_and_misses(store: AglStore) -> None:
    llm = LLM(resource_type="llm", endpoint="http://127.0.0.1:1/v1", model="q", sampling_parameters={})
    made = [await store.add_resources({"policy": llm.model_copy(update={"model": f"q{i}"})}) for i in range(3)]
    ids = [r.resources_id for r in made]
    for rid in ids:
        [only] = await store.query_resources(resources_id=rid)
        assert only.resources_id == rid
    ordered = [r.resources_id for r in await store.query_resources(sort_by="resources_id") if r.resources_id in ids]
    assert ordered == sorted(ids)
    page = await store.query_resources(sort_by="resources_id", sort_order="desc", limit=1)
    assert page[0].resources_id >= max(ids)
    assert await store.get_resources_by_id("rs-000000000bad") is None
    latest = await store.get_latest_resources()
    assert latest is not None and latest.resources_id == ids[-1]


async def test_capabilities_describe_the_client(store: AglStore) -> None:
    capabilities = store.capabilities
    assert capabilities["async_safe"] is True and capabilities["thread_safe"] is False


async def test_a_client_receives_only_answers_to_its_own_requests(stack_settings: Settings) -> None:
    options = stack_settings.model_dump(exclude_none=True)
    stores = [await connect(**options) for _ in range(4)]
    sent: list[set[str]] = [set() for _ in stores]
    received: list[list[Any]] = [[] for _ in stores]
    for index, client in enumerate(stores):
        channel = client._replies
        expect, on_reply = channel.expect, channel._on_reply

        def recording_expect(request_id: str, index: int = index, expect: Any = expect) -> Any:
            sent[index].add(request_id)
            return expect(request_id)

        def recording_on_reply(reply: Reply, index: int = index, on_reply: Any = on_reply) -> None:
            received[index].append(reply)
            on_reply(reply)

        channel.expect = recording_expect  # type: ignore[method-assign]
        channel._on_reply = recording_on_reply  # type: ignore[method-assign]
    try:
        algorithm, *runners = stores
        made = await algorithm.enqueue_many_rollouts([{"input": {"i": i}} for i in range(30)])
        ids = {r.rollout_id for r in made}

        async def run(store: AglStore, worker: str) -> None:
            while True:
                claimed = await store.dequeue_rollout(worker_id=worker)
                if claimed is None:
                    return
                spans = [_span(claimed.rollout_id, claimed.attempt.attempt_id, 1)]
                await store.add_many_spans(spans)
                await store.update_attempt(claimed.rollout_id, claimed.attempt.attempt_id, status="succeeded")

        await asyncio.gather(*(run(s, f"w-own-{i}") for i, s in enumerate(runners)))
        finished = await algorithm.wait_for_rollouts(rollout_ids=list(ids), timeout=60)
        assert {r.rollout_id for r in finished} == ids
    finally:
        for client in stores:
            await client.close()
    for index, replies in enumerate(received):
        answers = [r for r in replies if r.outcome != "notice"]
        notices = [r for r in replies if r.outcome == "notice" and r.state is not None]  # not keepalives
        foreign = [r for r in answers if r.request_id not in sent[index]]
        print(f"client {index}: {len(answers)} answers, {len(notices)} notices, {len(foreign)} foreign")
        assert foreign == []
        if index > 0:
            assert notices == [], "only the enqueuer hears when a rollout finishes"
    assert {r.state.rollout.rollout_id for r in received[0] if r.outcome == "notice" and r.state} == ids
    assert sum(len(r) for r in received[1:]) > 0


async def test_repeated_waits_ask_the_read_side_only_for_ids_never_seen(
    store: AglStore, stack_settings: Settings
) -> None:
    async with connect(**stack_settings.model_dump(exclude_none=True)) as other:
        mine = await store.enqueue_many_rollouts([{"input": {"mine": i}} for i in range(3)])
        theirs = await other.enqueue_rollout({"theirs": True})
        for rollout in [*mine, theirs]:
            claimed = await _claim(other, rollout.rollout_id, "w-wait")
            await other.update_attempt(rollout.rollout_id, claimed.attempt.attempt_id, status="succeeded")  # type: ignore[attr-defined]
    queries: list[str] = []
    rows = store._rows

    async def counting_rows(query: Any, *sources: str, key: str | None = None, worker: str | None = None) -> Any:
        queries.append(str(query))
        return await rows(query, *sources, key=key, worker=worker)

    store._rows = counting_rows  # type: ignore[method-assign]
    ids = [r.rollout_id for r in mine] + [theirs.rollout_id]
    for _ in range(1000):
        done = await store.wait_for_rollouts(rollout_ids=ids, timeout=0.01)
        assert [r.rollout_id for r in done] == ids and {r.status for r in done} == {"succeeded"}
    # The enqueuer was told; the other client's rollout was watched once; nothing was queried.
    assert queries == []
    assert await store.wait_for_rollouts(rollout_ids=["ro-00000000dead"], timeout=0.01) == []
    assert len(queries) == 1  # only the id the processor does not hold went to the read side


async def test_reply_topics_of_gone_clients_are_pruned_and_live_ones_kept(
    store: AglStore, stack_settings: Settings
) -> None:
    from aiokafka.admin import NewTopic

    from agl_stream.kafka.admin import admin_client
    from agl_stream.store.replies import prune_reply_topics, reply_topic

    gone = reply_topic(stack_settings, f"gone-{uuid.uuid4().hex[:8]}")  # a client killed before any keepalive
    admin = admin_client(stack_settings)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(gone, 1, 1)])
        deleted = await prune_reply_topics(stack_settings, idle_s=60)
        assert gone in deleted
        assert store._replies.topic not in deleted  # its keepalive is recent
        left = set(await admin.list_topics())
        assert store._replies.topic in left and gone not in left
    finally:
        await admin.close()
    # The live client still gets its answers.
    rollout = await store.enqueue_rollout({"after": "prune"})
    assert (await store.get_rollout_by_id(rollout.rollout_id)) is not None


async def _drain(store: AglStore) -> None:
    """Claim whatever other tests left queued, so the queue holds only what a test enqueues."""
    for _ in range(500):
        if await store.dequeue_rollout(worker_id="w-drain") is None:
            return
    raise AssertionError("the queue never ran dry")


async def test_the_queue_contract_holds_on_every_repetition(store: AglStore) -> None:
    """The seed's queue, repeated (intermittent failures show only on repetition): a claim right
    after one's own enqueues sees them, oldest first across partitions; a failed attempt with
    retries left is requeuing at once, and the next claim gets it."""
    await _drain(store)
    config = RolloutConfig(max_attempts=2, retry_condition=["failed"])
    for round_ in range(25):
        made = [(await store.enqueue_rollout({"round": round_, "i": i}, config=config)).rollout_id for i in range(3)]
        claimed = [await store.dequeue_rollout(worker_id="w-rep") for _ in made]
        assert [c.rollout_id if c else None for c in claimed] == made, round_
        first = claimed[0]
        assert first is not None
        await store.update_attempt(first.rollout_id, "latest", status="failed")
        requeued = await store.get_rollout_by_id(first.rollout_id)
        assert requeued is not None and requeued.status == "requeuing", round_
        again = await store.dequeue_rollout(worker_id="w-rep")
        assert again is not None and again.rollout_id == first.rollout_id and again.attempt.sequence_id == 2
        for rollout_id in made:
            await store.update_attempt(rollout_id, "latest", status="succeeded")
        assert await store.dequeue_rollout(worker_id="w-rep") is None, round_


async def test_a_timed_out_attempt_is_requeued_and_reclaimable_on_every_repetition(store: AglStore) -> None:
    await _drain(store)
    # Long enough that the second attempt outlives the reads below on a loaded machine.
    config = RolloutConfig(timeout_seconds=1.5, max_attempts=2, retry_condition=["timeout"])
    for round_ in range(4):
        rollout = await store.enqueue_rollout({"timeout round": round_}, config=config)
        first = await store.dequeue_rollout(worker_id="w-slow")
        assert first is not None and first.rollout_id == rollout.rollout_id
        again = await store.dequeue_rollout(worker_id="w-next", wait=10.0)  # held until the watchdog requeues
        assert again is not None and again.rollout_id == rollout.rollout_id and again.attempt.sequence_id == 2
        attempts = await store.query_attempts(rollout.rollout_id)
        assert [a.status for a in attempts] == ["timeout", "preparing"], round_
        await store.update_attempt(rollout.rollout_id, "latest", status="succeeded")


async def test_idle_runners_of_one_client_do_not_each_ask_an_empty_queue(stack_settings: Settings) -> None:
    """Eight runners of one client poll the seed's way (a claim, 10 ms apart when nothing is
    queued) while rollouts arrive one at a time and each is claimed and finished. A claim that
    takes the last queued rollout says so, and finishing an attempt queues nothing: so the
    other seven runners do not each ask the processor afterwards (that was seven empty claims a
    rollout). Counted on the broker: the records of agl.store-requests. What is left: about one
    claim a rollout, and, when a client's knowledge expires (``EMPTY_TTL_S``, 1 s), at most a
    claim per runner."""
    options = stack_settings.model_dump(exclude_none=True)
    requests_topic = stack_settings.topic("store-requests")
    runners = 8
    async with connect(**options) as algorithm, connect(**options) as polling:
        await _drain(polling)
        claimed: list[str] = []
        stop = asyncio.Event()

        async def runner(index: int) -> None:
            while not stop.is_set():
                attempt = await polling.dequeue_rollout(worker_id=f"poller-{index}")
                if attempt is None:
                    await asyncio.sleep(0.01)  # the seed's polling loop, not a wait on state
                    continue
                claimed.append(attempt.rollout_id)
                await polling.update_attempt(attempt.rollout_id, attempt.attempt.attempt_id, status="succeeded")

        tasks = [asyncio.create_task(runner(i)) for i in range(runners)]
        try:
            before = sum((await end_offsets(stack_settings, requests_topic)).values())
            began = time.monotonic()
            for _ in range(20):
                rollout = await algorithm.enqueue_rollout({"poll": "idle"})
                deadline = time.monotonic() + 60
                while rollout.rollout_id not in claimed:
                    assert time.monotonic() < deadline, "a rollout was not claimed in 60 s"
                    await asyncio.sleep(0.01)
            took = time.monotonic() - began
            sent = sum((await end_offsets(stack_settings, requests_topic)).values()) - before
        finally:
            stop.set()
            await asyncio.gather(*tasks)
    assert len(claimed) == len(set(claimed))
    # Before: >= 7 x 20 = 140 (every idle runner asked after each claim and each finish).
    assert sent <= 2 * len(claimed) + runners * (took / EMPTY_TTL_S + 1), (sent, len(claimed), took)
