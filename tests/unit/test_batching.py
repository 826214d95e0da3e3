"""The batching rules (agl_stream.domain.batching): sizes, groups, staleness, linger, ids, restarts."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from agl_stream.config import Settings
from agl_stream.domain.batching import (
    DEFAULT_MAX_STALENESS,
    Batcher,
    BatchPolicy,
    JournalEntry,
    Recovery,
    batch_id_of,
    record_tokens,
    staleness_histogram,
)
from agl_stream.models import Triplet, TripletBatch, TripletRecord

T0 = 1_700_000_000.0


def rec(
    i: int,
    group: str = "g",
    version: int | None = None,
    tokens: Sequence[int] = (3, 2),
    attempt: str | None = None,
    mode: Any = None,
) -> TripletRecord:
    """Record ``i``: one triplet per pair of (prompt, response) lengths in ``tokens``."""
    pairs = list(zip(tokens[::2], tokens[1::2], strict=True))
    return TripletRecord(
        rollout_id=f"ro-{i:012x}",
        attempt_id=attempt or f"at-{i:08x}",
        group_id=group,
        policy_version=version,
        triplets=[Triplet(prompt_token_ids=[1] * p, response_token_ids=[2] * r, reward=0.5) for p, r in pairs],
        final_reward=float(i % 3),
        finish_time=T0 + i,
        mode=mode,
    )


def feed(batcher: Batcher, records: Sequence[TripletRecord], now: float = T0, start: int = 0) -> list[TripletBatch]:
    out: list[TripletBatch] = []
    for offset, record in enumerate(records, start):
        out.extend(batcher.add(record, offset, now))
    return out


def members(batch: TripletBatch) -> list[int]:
    return batch.input_offsets


# -- sizes ------------------------------------------------------------------------------------


def test_batches_fill_up_to_max_rollouts_and_the_rest_lingers() -> None:
    batcher = Batcher(BatchPolicy(max_rollouts=3, linger_s=5.0), partition=2)
    out = feed(batcher, [rec(i) for i in range(7)])
    assert [members(b) for b in out] == [[0, 1, 2], [3, 4, 5]]
    assert [b.sequence for b in out] == [1, 2]
    assert all(b.source_partition == 2 and b.n_tokens == 15 for b in out)
    assert batcher.pending_offsets() == [6] and batcher.commit_offset() == 6
    assert batcher.next_deadline() == T0 + 5.0
    assert batcher.tick(T0 + 4.9) == []
    [last] = batcher.tick(T0 + 5.0)
    assert members(last) == [6] and last.sequence == 3
    assert batcher.commit_offset() == 7 and batcher.next_deadline() is None


def test_max_tokens_closes_a_batch_before_it_would_overflow() -> None:
    batcher = Batcher(BatchPolicy(max_rollouts=100, max_tokens=12, linger_s=None))
    out = feed(batcher, [rec(0), rec(1), rec(2)])  # 5 tokens each
    assert [members(b) for b in out] == [[0, 1]]
    # A record over the limit on its own goes out alone: it cannot be made smaller.
    out = feed(batcher, [rec(3, tokens=(10, 10))], start=3)
    assert [(members(b), b.n_tokens) for b in out] == [([2], 5), ([3], 20)]
    out = feed(batcher, [rec(4, tokens=(6, 6))], start=4)  # exactly the limit: full at once
    assert [members(b) for b in out] == [[4]]
    assert batcher.tick(T0 + 1e9) == [] and batcher.pending == 0  # linger None: nothing partial


def test_record_tokens_counts_prompt_and_response_of_every_triplet() -> None:
    assert record_tokens(rec(0, tokens=(3, 2, 10, 1))) == 16
    assert record_tokens(rec(0, tokens=())) == 0


# -- groups -----------------------------------------------------------------------------------


def test_groups_are_batched_whole_in_the_order_they_complete() -> None:
    batcher = Batcher(BatchPolicy(max_rollouts=6, group_size=3, linger_s=None))
    stream = [rec(0, "a"), rec(1, "b"), rec(2, "a"), rec(3, "c"), rec(4, "b"), rec(5, "b"), rec(6, "a")]
    assert feed(batcher, stream[:6]) == []  # b completes first, a is still one short
    assert batcher.commit_offset() == 0  # a's first record holds the commit point
    [batch] = feed(batcher, stream[6:], start=6)
    assert members(batch) == [1, 4, 5, 0, 2, 6]
    assert [r.group_id for r in batch.records] == ["b"] * 3 + ["a"] * 3
    assert batch.group_size == 3 and batch.incomplete_groups == 0
    assert batcher.pending_offsets() == [3] and batcher.commit_offset() == 3


def test_a_group_that_does_not_fit_waits_for_the_next_batch_and_an_oversize_group_goes_alone() -> None:
    batcher = Batcher(BatchPolicy(max_rollouts=4, group_size=3, linger_s=None))
    out = feed(batcher, [rec(i, "a") for i in range(3)] + [rec(i, "b") for i in range(3, 6)])
    assert [members(b) for b in out] == [[0, 1, 2]]  # b would make 6 > 4
    big = Batcher(BatchPolicy(max_rollouts=2, group_size=3, linger_s=None))
    [batch] = feed(big, [rec(i, "a") for i in range(3)])
    assert members(batch) == [0, 1, 2]  # never split, so over the limit


def test_a_group_id_seen_again_after_its_group_went_out_starts_a_new_group() -> None:
    batcher = Batcher(BatchPolicy(max_rollouts=2, group_size=2, linger_s=None))
    out = feed(batcher, [rec(0, "a"), rec(1, "a"), rec(2, "a"), rec(3, "a")])
    assert [members(b) for b in out] == [[0, 1], [2, 3]]


def test_an_incomplete_group_is_flushed_after_max_group_wait() -> None:
    policy = BatchPolicy(max_rollouts=10, group_size=3, max_group_wait_s=60.0, linger_s=0.0)
    batcher = Batcher(policy)
    feed(batcher, [rec(0, "a"), rec(1, "a"), rec(2, "b")])
    assert batcher.next_deadline() == T0 + 60.0
    assert batcher.tick(T0 + 59.0) == []
    [batch] = batcher.tick(T0 + 60.0)
    assert members(batch) == [0, 1, 2] and batch.incomplete_groups == 2


def test_an_incomplete_group_can_be_dropped_and_the_drop_is_reported_by_the_next_batch() -> None:
    policy = BatchPolicy(max_rollouts=2, group_size=2, max_group_wait_s=60.0, on_group_timeout="drop", linger_s=None)
    batcher = Batcher(policy)
    feed(batcher, [rec(0, "a"), rec(1, "b")], now=T0)
    assert batcher.tick(T0 + 60.0) == []
    # Dropped, but held until a batch reports it: a restart re-decides it instead of losing the count.
    assert batcher.pending == 0 and batcher.pending_offsets() == [0, 1] and batcher.commit_offset() == 0
    [batch] = feed(batcher, [rec(2, "c"), rec(3, "c")], start=2)
    assert members(batch) == [2, 3]
    assert (batch.dropped_incomplete, batch.dropped_offsets) == (2, [0, 1])
    assert batcher.commit_offset() == 4 and batcher.stats.dropped["incomplete"] == 2


def test_without_waiting_for_groups_a_linger_flush_ships_partial_groups_whole() -> None:
    policy = BatchPolicy(max_rollouts=10, group_size=3, wait_for_groups=False, linger_s=5.0)
    batcher = Batcher(policy)
    feed(batcher, [rec(0, "a"), rec(1, "b"), rec(2, "a")])
    assert batcher.next_deadline() == T0 + 5.0
    [batch] = batcher.tick(T0 + 5.0)
    assert members(batch) == [0, 2, 1] and batch.incomplete_groups == 2


# -- staleness --------------------------------------------------------------------------------


def test_stale_records_are_dropped_and_counted() -> None:
    batcher = Batcher(BatchPolicy(max_rollouts=2, max_staleness=1, linger_s=None))
    out = feed(batcher, [rec(0, version=5), rec(1, version=3), rec(2, version=4), rec(3, version=None)])
    [batch] = out
    assert members(batch) == [0, 2]
    assert (batch.dropped_stale, batch.dropped_offsets) == (1, [1])
    assert (batch.min_policy_version, batch.max_policy_version, batch.newest_policy_version) == (4, 5, 5)
    assert batcher.pending_offsets() == [3]  # no version: never stale


def test_held_records_are_dropped_when_the_newest_version_leaves_them_behind() -> None:
    batcher = Batcher(BatchPolicy(max_rollouts=5, group_size=3, max_staleness=1, linger_s=None))
    feed(batcher, [rec(0, "a", version=1), rec(1, "a", version=2), rec(2, "b", version=3)])
    assert batcher.pending_offsets() == [0, 1, 2] and batcher.pending == 2
    assert batcher.stats.dropped["stale"] == 1
    [batch] = feed(batcher, [rec(3, "a", version=3), rec(4, "b", version=3), rec(5, "b", version=3)], start=3)
    # Group a is complete at its third record: two members, and the one dropped will never come.
    assert members(batch) == [1, 3, 2, 4, 5]
    assert (batch.dropped_stale, batch.dropped_offsets, batch.incomplete_groups) == (1, [0], 1)


def test_a_group_does_not_wait_for_members_dropped_stale_on_arrival() -> None:
    batcher = Batcher(BatchPolicy(max_rollouts=2, group_size=3, max_staleness=1, linger_s=None))
    feed(batcher, [rec(0, "x", version=5)])  # version 5 is the newest seen
    out = feed(batcher, [rec(1, "c", version=1), rec(2, "c", version=5), rec(3, "c", version=5)], start=1)
    [batch] = out  # no 600 s wait for the third member of c: it was dropped
    assert members(batch) == [2, 3] and batch.incomplete_groups == 1 and batch.dropped_offsets == [1]
    # A group all of whose members are dropped holds nothing: only x's record is held.
    feed(batcher, [rec(i, "d", version=2) for i in range(4, 7)], start=4)
    assert batcher.pending_offsets() == [0, 4, 5, 6] and batcher.pending == 1


def test_kept_stale_records_are_counted_in_their_batch() -> None:
    batcher = Batcher(BatchPolicy(max_rollouts=3, max_staleness=0, on_stale="keep", linger_s=None))
    [batch] = feed(batcher, [rec(0, version=2), rec(1, version=1), rec(2, version=2)])
    assert members(batch) == [0, 1, 2] and batch.kept_stale == 1 and batch.dropped_stale == 0


def test_by_default_late_records_within_the_bound_train_and_only_those_beyond_it_are_dropped() -> None:
    policy = BatchPolicy()
    assert (policy.max_staleness, policy.on_stale, policy.on_group_timeout) == (DEFAULT_MAX_STALENESS, "drop", "flush")
    assert DEFAULT_MAX_STALENESS == 4
    batcher = Batcher(BatchPolicy(max_rollouts=6, linger_s=None))  # the default staleness rules
    versions = [10, 9, 6, 5, None, 8]  # 0, 1, 4, 5 (beyond the bound), no version, 2 behind
    [batch] = feed(batcher, [rec(i, version=v) for i, v in enumerate(versions)] + [rec(6, version=10)])
    assert members(batch) == [0, 1, 2, 4, 5, 6]
    assert (batch.dropped_stale, batch.dropped_offsets) == (1, [3])
    assert batch.newest_policy_version == 10
    assert batch.kept_stale == 3  # versions 9, 6 and 8: off-policy, for the trainer to correct
    assert batch.staleness_counts == [2, 1, 1, 0, 1]  # the record without a version is not counted
    assert batcher.stats.kept_stale == 3 and batcher.stats.dropped["stale"] == 1


def test_the_histogram_is_measured_against_the_newest_version_when_the_batch_is_made() -> None:
    batcher = Batcher(BatchPolicy(max_rollouts=3, linger_s=None))
    # Version 7 arrives last: the earlier records are behind it by the time the batch is made.
    [batch] = feed(batcher, [rec(0, version=5), rec(1, version=6), rec(2, version=7)])
    assert (batch.staleness_counts, batch.kept_stale) == ([1, 1, 1], 2)
    [fresh] = feed(batcher, [rec(i, version=7) for i in range(3, 6)], start=3)
    assert (fresh.staleness_counts, fresh.kept_stale) == ([3], 0)
    unversioned = Batcher(BatchPolicy(max_rollouts=1, linger_s=None))
    [batch] = feed(unversioned, [rec(0)])
    assert (batch.staleness_counts, batch.kept_stale, batch.newest_policy_version) == ([], 0, None)


def test_records_beyond_the_bound_can_be_kept_too_and_no_bound_keeps_everything() -> None:
    records = [rec(0, version=9), rec(1, version=2), rec(2, version=9)]
    [kept] = feed(Batcher(BatchPolicy(max_rollouts=3, on_stale="keep", linger_s=None)), records)
    assert members(kept) == [0, 1, 2] and kept.dropped_stale == 0
    assert kept.kept_stale == 1 and kept.staleness_counts == [2, 0, 0, 0, 0, 0, 0, 1]
    [unbounded] = feed(Batcher(BatchPolicy(max_rollouts=3, max_staleness=None, linger_s=None)), records)
    assert members(unbounded) == [0, 1, 2] and unbounded.staleness_counts == kept.staleness_counts


def test_by_default_a_late_group_is_flushed_whole_and_counted_not_dropped() -> None:
    batcher = Batcher(BatchPolicy(group_size=3, linger_s=0.0))  # default max_group_wait_s and on_group_timeout
    feed(batcher, [rec(0, "a", version=2), rec(1, "a", version=3)])
    assert batcher.next_deadline() == T0 + 600.0
    assert batcher.tick(T0 + 599.0) == []
    [batch] = batcher.tick(T0 + 600.0)
    assert members(batch) == [0, 1] and batch.incomplete_groups == 1 and batch.dropped_incomplete == 0
    assert (batch.kept_stale, batch.staleness_counts) == (1, [1, 1])


def test_staleness_histogram() -> None:
    assert staleness_histogram([5, 5, 3, None, 6], 6) == [1, 2, 0, 1]
    assert staleness_histogram([None, None], 6) == []
    assert staleness_histogram([4], None) == []
    assert staleness_histogram([7], 6) == [1]  # ahead of the newest (never, in a batcher): counted as 0


# -- validation and test records ----------------------------------------------------------------


def test_val_and_test_records_are_refused_counted_and_reported_by_the_next_batch() -> None:
    batcher = Batcher(BatchPolicy(max_rollouts=4, group_size=2, linger_s=None), partition=1)
    # A val record of a group id a training group uses does not complete (or join) that group.
    out = feed(
        batcher,
        [rec(0, "a", mode="train"), rec(1, "a", mode="val"), rec(2, "v", mode="test"), rec(3, "a", mode="train")],
    )
    assert out == [] and batcher.pending == 2
    assert batcher.stats.dropped["eval"] == 2
    # Refused, but held until a batch reports them, like every drop (a restart re-decides them).
    assert batcher.pending_offsets() == [0, 1, 2, 3] and batcher.commit_offset() == 0
    [batch] = feed(batcher, [rec(4, "b"), rec(5, "b", version=3)], start=4)  # no mode: trained on
    assert members(batch) == [0, 3, 4, 5]
    assert {r.mode for r in batch.records} == {"train", None}
    assert (batch.dropped_eval, batch.dropped_offsets) == (2, [1, 2])
    assert (batch.dropped_stale, batch.dropped_incomplete, batch.dropped_duplicate) == (0, 0, 0)
    assert batch.newest_policy_version == 3 and batcher.commit_offset() == 6


def test_a_val_record_still_moves_the_newest_policy_version() -> None:
    # Its version is a fact about the newest policy, whatever the record's mode.
    batcher = Batcher(BatchPolicy(max_rollouts=1, max_staleness=0, linger_s=None))
    assert feed(batcher, [rec(0, version=4, mode="val"), rec(1, version=3, mode="train")]) == []
    [batch] = feed(batcher, [rec(2, version=4, mode="train")], start=2)
    assert members(batch) == [2] and (batch.dropped_eval, batch.dropped_stale) == (1, 1)


# -- duplicates, ids, offsets -----------------------------------------------------------------


def test_a_second_record_of_the_same_attempt_is_dropped() -> None:
    batcher = Batcher(BatchPolicy(max_rollouts=2, linger_s=None))
    out = feed(batcher, [rec(0), rec(0), rec(1), rec(1), rec(2), rec(3)])
    assert [members(b) for b in out] == [[0, 2], [4, 5]]
    assert out[0].dropped_duplicate == 1 and out[1].dropped_duplicate == 1
    assert out[0].dropped_offsets == [1] and out[1].dropped_offsets == [3]


def test_batch_ids_are_a_digest_of_the_members() -> None:
    stream = [rec(i, "ab"[i % 2]) for i in range(8)]
    policy = BatchPolicy(max_rollouts=4, group_size=2, linger_s=None)
    first, second = feed(Batcher(policy), stream), feed(Batcher(policy), stream)
    assert [b.batch_id for b in first] == [b.batch_id for b in second]
    assert len({b.batch_id for b in first}) == 2
    assert first[0].batch_id == batch_id_of(first[0].records) and first[0].batch_id.startswith("tb-")
    assert batch_id_of([rec(1), rec(2)]) != batch_id_of([rec(2), rec(1)])


def test_repeated_and_skipped_offsets() -> None:
    batcher = Batcher(BatchPolicy(max_rollouts=5, linger_s=None), start_offset=10)
    assert batcher.commit_offset() == 10
    batcher.add(rec(10), 10, T0)
    batcher.skip(11)  # dead-lettered by the processor
    assert batcher.add(rec(10), 10, T0) == []  # delivered again: ignored
    batcher.add(rec(12), 12, T0)
    assert batcher.pending_offsets() == [10, 12] and batcher.commit_offset() == 10
    assert batcher.stats.dead_lettered == 1 and batcher.stats.records == 2


def test_policy_validation() -> None:
    for bad in ({"max_rollouts": 0}, {"max_tokens": 0}, {"group_size": 0}, {"max_staleness": -1}, {"linger_s": -1}):
        with pytest.raises(ValueError):
            BatchPolicy(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="on_stale"):
        BatchPolicy(on_stale="maybe")  # type: ignore[arg-type]


# -- restarts -----------------------------------------------------------------------------------


def recover(journal: Sequence[TripletBatch], partition: int, committed: int, lookback: int = 0) -> Recovery:
    recovery = Recovery(partition, committed, lookback=lookback)
    for batch in reversed(journal):
        if recovery.offer(JournalEntry.of(batch)):
            break
    return recovery


def test_a_restart_skips_what_the_batches_already_hold_and_continues_their_numbering() -> None:
    policy = BatchPolicy(max_rollouts=3, group_size=3, max_staleness=5, linger_s=None)
    stream = [rec(0, "a", 7), rec(1, "b", 7), rec(2, "b", 7), rec(3, "b", 7), rec(4, "c", 7)]
    stream += [rec(5, "c", 7), rec(6, "a", 7), rec(7, "c", 7), rec(8, "a", 7)]
    batcher = Batcher(policy, partition=1)
    journal = feed(batcher, stream[:6])
    assert [members(b) for b in journal] == [[1, 2, 3]]
    committed = batcher.commit_offset()
    assert committed == 0  # group a holds it back; b's batch lies after the commit point
    # Crash. A new owner reads from the committed offset with what the journal says.
    recovery = recover(journal, 1, committed)
    assert (recovery.sequence, recovery.newest_version, recovery.decided) == (1, 7, {1, 2, 3})
    restarted = Batcher(policy, partition=1, start_offset=committed, recovery=recovery)
    journal += feed(restarted, stream, start=0)
    assert [members(b) for b in journal] == [[1, 2, 3], [4, 5, 7], [0, 6, 8]]
    assert [b.sequence for b in journal] == [1, 2, 3]
    assert restarted.stats.replayed == 3


def test_a_restarted_batcher_drops_the_builders_repeat_of_an_attempt_batched_before_the_commit_point() -> None:
    # The triplet builder re-emits after its own restart what it finished since its commit point:
    # here the attempts of offsets 1 and 4 come again at offsets 8 and 9, after the batcher
    # (restarted too) committed past their first copies.
    policy = BatchPolicy(max_rollouts=2, linger_s=None)
    first = [rec(i) for i in range(6)]
    batcher = Batcher(policy, partition=0)
    journal = feed(batcher, first)
    committed = batcher.commit_offset()
    assert committed == 6 and [members(b) for b in journal] == [[0, 1], [2, 3], [4, 5]]
    then = [rec(6), rec(7), rec(1), rec(4)]

    def restarted(lookback: int) -> tuple[list[list[int]], list[int], int]:
        recovery = recover(journal, 0, committed, lookback=lookback)
        again = Batcher(policy, partition=0, start_offset=committed, recovery=recovery)
        out = feed(again, then, start=6)
        return [members(b) for b in out], again.pending_offsets(), again.stats.dropped["duplicate"]

    # Reaching back to offset 0: every batched attempt is known, both repeats are dropped.
    # (A drop stays pending until the next batch reports it.)
    assert restarted(lookback=6) == ([[6, 7]], [8, 9], 2)
    # Back to offset 3: the batches [2, 3] and [4, 5] are read, [0, 1] is not: 8 waits for a batch.
    assert restarted(lookback=3) == ([[6, 7]], [8, 9], 1)
    # Nothing before the commit point: both repeats are batched again.
    assert restarted(lookback=0) == ([[6, 7], [8, 9]], [], 0)


def test_recovery_stops_at_the_first_batch_made_before_the_commit_point() -> None:
    def entry(partition: int, position: int, *offsets: int) -> JournalEntry:
        return JournalEntry(partition, position, position, 9, offsets)

    recovery = Recovery(0, committed=10)
    assert not recovery.offer(entry(0, 30, 12, 25))
    assert not recovery.offer(entry(1, 50, 40))  # another source partition: ignored
    assert not recovery.offer(entry(0, 14, 9, 13))
    assert recovery.offer(entry(0, 10, 5))
    assert recovery.decided == {12, 25, 13} and recovery.sequence == 30 and recovery.high_offset == 30


# -- properties ---------------------------------------------------------------------------------


@dataclass
class _Outcome:
    journal: list[TripletBatch]
    held: list[int]  # drops no batch reported yet, and records still pending, at the end
    total: int


policies = st.builds(
    BatchPolicy,
    max_rollouts=st.integers(1, 6),
    max_tokens=st.one_of(st.none(), st.integers(1, 40)),
    group_size=st.one_of(st.none(), st.integers(1, 4)),
    wait_for_groups=st.booleans(),
    max_group_wait_s=st.one_of(st.none(), st.floats(0, 20)),
    on_group_timeout=st.sampled_from(["flush", "drop"]),
    max_staleness=st.one_of(st.none(), st.integers(0, 2)),
    on_stale=st.sampled_from(["drop", "keep"]),
    linger_s=st.one_of(st.none(), st.floats(0, 10)),
)


def _stream(seed: int, size: int) -> list[TripletRecord]:
    rng = random.Random(seed)
    version = 0
    out = []
    for i in range(size):
        version += rng.random() < 0.15
        lengths = [rng.randint(0, 6) for _ in range(2 * rng.randint(0, 2))]
        version_of = rng.choice([None, version, max(0, version - rng.randint(0, 3))])
        mode = rng.choice([None, "train", "train", "val", "test"])
        out.append(rec(i, f"g{rng.randint(0, 4)}", version_of, lengths, mode=mode))
    return out


def _run(policy: BatchPolicy, stream: list[TripletRecord], seed: int, crashes: bool) -> _Outcome:
    """Feed the stream with ticks, commits and (optionally) crashes that lose unacknowledged batches."""
    rng = random.Random(seed)
    journal: list[TripletBatch] = []
    unacked = 0  # batches at the end of the journal written after the last commit
    committed = 0
    batcher = Batcher(policy, partition=0)
    position = 0
    now = T0
    while position < len(stream):
        roll = rng.random()
        if roll < 0.6:
            out = batcher.add(stream[position], position, now)
            position += 1
        elif roll < 0.75:
            now += rng.choice([0.5, 3.0, 30.0])
            out = batcher.tick(now)
        elif roll < 0.92 or not crashes:
            # The processor commits after its batches are acknowledged.
            assert batcher.commit_offset() >= committed
            committed, unacked, out = batcher.commit_offset(), 0, []
        else:
            # kill -9: any suffix of the batches written since the last commit may be lost.
            lost = rng.randint(0, unacked)
            del journal[len(journal) - lost :]
            batcher = Batcher(policy, partition=0, start_offset=committed, recovery=recover(journal, 0, committed))
            position, unacked, out = committed, 0, []
        journal.extend(out)
        unacked += len(out)
    journal.extend(batcher.tick(now + 1e6))
    return _Outcome(journal, batcher.pending_offsets(), len(stream))


def _check_every_record_once(outcome: _Outcome) -> None:
    placed = Counter(o for b in outcome.journal for o in (*b.input_offsets, *b.dropped_offsets))
    placed.update(outcome.held)
    assert placed == Counter(range(outcome.total)), "each offset exactly once: batched, dropped or still held"
    ids = [b.batch_id for b in outcome.journal]
    assert len(ids) == len(set(ids))
    sequences = [b.sequence for b in outcome.journal]
    assert sequences == list(range(1, len(sequences) + 1))


@settings(max_examples=300, deadline=None)
@given(policy=policies, seed=st.integers(0, 2**32), size=st.integers(0, 60))
def test_every_record_lands_in_exactly_one_batch_or_is_counted_as_dropped(
    policy: BatchPolicy, seed: int, size: int
) -> None:
    stream = _stream(seed, size)
    outcome = _run(policy, stream, seed, crashes=False)
    _check_every_record_once(outcome)
    for batch in outcome.journal:
        assert batch.records, "no empty batches"
        assert all(r.mode not in ("val", "test") for r in batch.records), "validation is never trained on"
        assert batch.n_tokens == sum(record_tokens(r) for r in batch.records)
        assert [r.rollout_id for r in batch.records] == [stream[o].rollout_id for o in batch.input_offsets]
        over = len(batch.records) > policy.max_rollouts or (
            policy.max_tokens is not None and batch.n_tokens > policy.max_tokens
        )
        if over:  # only a single unit may exceed a limit
            assert policy.group_size is not None or len(batch.records) == 1
            assert len({r.group_id for r in batch.records}) == 1
        if policy.group_size is not None and policy.wait_for_groups and batch.incomplete_groups == 0:
            sizes = Counter(r.group_id for r in batch.records)
            assert all(n % policy.group_size == 0 for n in sizes.values()), "groups are whole"
        newest = batch.newest_policy_version
        behind = [
            newest - r.policy_version for r in batch.records if r.policy_version is not None and newest is not None
        ]
        assert batch.staleness_counts == ([behind.count(k) for k in range(max(behind) + 1)] if behind else [])
        assert batch.kept_stale == sum(1 for k in behind if k > 0)
        if policy.max_staleness is not None and policy.on_stale == "drop":
            assert all(
                r.policy_version is None or newest is None or newest - r.policy_version <= policy.max_staleness
                for r in batch.records
            )


@settings(max_examples=300, deadline=None)
@given(policy=policies, seed=st.integers(0, 2**32), size=st.integers(0, 60))
def test_crashes_at_any_point_neither_lose_nor_repeat_a_record(policy: BatchPolicy, seed: int, size: int) -> None:
    _check_every_record_once(_run(policy, _stream(seed, size), seed, crashes=True))


# -- the command line ---------------------------------------------------------------------------


def test_the_cli_options_make_the_policy(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import processors.batcher
    from agl_stream.cli.batcher_cmd import batcher

    started: list[tuple[Settings, BatchPolicy]] = []
    topics: list[dict[str, Any]] = []

    def fake_main(settings: Settings, policy: BatchPolicy, **options: Any) -> None:
        started.append((settings, policy))
        topics.append(options)

    monkeypatch.setattr(processors.batcher, "main", fake_main)
    app = typer.Typer()

    @app.callback()
    def root(ctx: typer.Context) -> None:
        ctx.obj = Settings(data_dir=tmp_path)

    app.command("batcher")(batcher)
    options = ["--max-rollouts", "16", "--max-tokens", "4096", "--group-size", "4", "--no-wait-for-groups"]
    options += ["--max-group-wait", "30", "--on-group-timeout", "drop", "--max-staleness", "2", "--on-stale", "keep"]
    result = CliRunner().invoke(app, ["batcher", *options, "--linger", "1.5"])
    assert result.exit_code == 0, result.output
    [(_, policy)] = started
    assert policy == BatchPolicy(
        max_rollouts=16,
        max_tokens=4096,
        group_size=4,
        wait_for_groups=False,
        max_group_wait_s=30.0,
        on_group_timeout="drop",
        max_staleness=2,
        on_stale="keep",
        linger_s=1.5,
    )
    assert CliRunner().invoke(app, ["batcher"]).exit_code == 0
    assert started[-1][1] == BatchPolicy()  # the CLI defaults are the policy's
    assert CliRunner().invoke(app, ["batcher", "--on-stale", "maybe"]).exit_code != 0
    replayed = ["--input-topic", "agl.triplets.replay.x", "--output-topic", "agl.triplet-batches.replay.x"]
    assert CliRunner().invoke(app, ["batcher", *replayed]).exit_code == 0
    assert topics[-1] == {"input_topic": "agl.triplets.replay.x", "output_topic": "agl.triplet-batches.replay.x"}
