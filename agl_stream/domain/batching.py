"""Batching rules: finished attempts (TripletRecords) -> training batches (TripletBatches).

Pure: no I/O and no clock. Time comes in as an argument, Kafka offsets come in with each
record, and batches go out as return values; the processor (processors/batcher.py) does the
reading, writing and committing.

One :class:`Batcher` serves one source partition of ``agl.triplets``. The topic is keyed by
group id, so every rollout of a GRPO group reaches the same batcher, and a batch never mixes
partitions: everything a batcher must remember across a restart is then local to one
partition (see :class:`Recovery`).

Rules (a :class:`BatchPolicy`):

- **Units.** Without grouping every record is a unit. With ``group_size`` n, records are held
  per ``group_id`` until n have arrived; the group is then one unit, never split across
  batches. A group still incomplete ``max_group_wait_s`` after its first record is flushed
  incomplete (the default: a late group's records train, counted in ``incomplete_groups``)
  or dropped (``on_group_timeout="drop"``, counted in ``dropped_incomplete``). With ``wait_for_groups=False`` groups are
  still kept together but a linger flush ships them as they are. A group id that comes back
  after its group went out starts a new group (a task run again in a later epoch).
- **Size.** Ready units go into batches in the order they became ready (FIFO, no
  reordering) up to ``max_rollouts`` records and ``max_tokens`` prompt + response tokens. A
  batch goes out as soon as it is full: the next ready unit would not fit or a limit is
  reached. A single unit larger than a limit goes out alone (a group is never split).
- **Linger.** A partial batch goes out once its oldest unit has been ready for
  ``linger_s``; ``None`` waits for full batches only.
- **Staleness: keep and correct within the bound.** The batcher tracks the newest policy
  version it has seen. A record behind it is off-policy: it is kept and counted
  (``kept_stale``), and the trainer corrects it with importance sampling (the serving
  engine's logprobs ride with each sample). Only a record more than ``max_staleness``
  versions behind (default :data:`DEFAULT_MAX_STALENESS`) is dropped and counted
  (``dropped_stale``; ``on_stale="drop"``, the default: on arrival, and pending records when
  the newest version moves on), or with ``on_stale="keep"`` kept like the others. A group
  member dropped stale will not arrive any more: its group is complete once the others have
  (it goes out with one fewer, counted in ``incomplete_groups``) instead of waiting
  ``max_group_wait_s`` for it.
  ``max_staleness=None`` sets no bound. Records without a version are never stale. Each
  batch carries the histogram of its records' staleness (``staleness_counts``), measured
  against the newest version when the batch is made.
- **Duplicates.** A second record of an attempt (same rollout and attempt id) while the first
  is pending or among the recently batched ones is dropped and counted.
- **Validation is never trained on.** A record of a ``val`` or ``test`` rollout (its ``mode``)
  is refused on arrival and counted (``dropped_eval``), like any drop: it is good data for the
  read side (its reward, per policy version), not bad input, so it is not dead-lettered. A
  record without a mode (enqueued without one, or written before records carried it) trains.
- **Counts.** Every record ends in exactly one batch or is counted as dropped: drops are
  reported (counts and offsets) by the next batch of the partition.
- **Batch ids** are a digest of the members' (rollout_id, attempt_id) in batch order, so the
  same decision always gets the same id.

Defaults (``BatchPolicy()``, and ``agl-stream batcher`` without options): 64 records a batch,
no token limit, no grouping; with ``group_size``, groups wait up to 600 s and are then flushed
incomplete (``on_group_timeout="flush"``: late records train rather than bias training toward
fast rollouts); records up to 4 versions behind the newest are kept and counted
(``max_staleness=4``, ``kept_stale`` and ``staleness_counts``), farther ones dropped and
counted (``on_stale="drop"``, ``dropped_stale``); a partial batch goes out after 30 s
(``linger_s``).

Exactly-once across restarts, without transactions: each batch records the source offsets it
holds or reports dropped (``input_offsets``, ``dropped_offsets``) and how far the batcher had
read (``input_position``). The processor commits a partition only up to the lowest offset
still pending (:meth:`Batcher.commit_offset`), so a restart reads every pending record again;
the records after that point which had already gone into a batch are found in the batches
topic itself (:class:`Recovery`) and skipped.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from agl_stream.models import TripletBatch, TripletRecord

DEFAULT_MAX_STALENESS = 4
"""Versions a record may lag the newest one seen and still train (importance-corrected) by
default. Farther behind, the serving policy has drifted so far that truncated importance
ratios leave a sample little signal, and a batch of them mostly measures the truncation."""

OnStale = Literal["drop", "keep"]
OnGroupTimeout = Literal["flush", "drop"]
DropReason = Literal["stale", "incomplete", "duplicate", "eval"]

EVAL_MODES = frozenset({"val", "test"})
"""Rollout modes whose records the batcher refuses: validation and test rollouts measure the
policy and must not train it."""


@dataclass(frozen=True)
class BatchPolicy:
    """How records become batches (see the module docstring for the rules)."""

    max_rollouts: int = 64
    max_tokens: int | None = None
    group_size: int | None = None
    wait_for_groups: bool = True
    max_group_wait_s: float | None = 600.0
    on_group_timeout: OnGroupTimeout = "flush"
    max_staleness: int | None = DEFAULT_MAX_STALENESS
    on_stale: OnStale = "drop"
    linger_s: float | None = 30.0

    def __post_init__(self) -> None:
        if self.max_rollouts < 1:
            raise ValueError("max_rollouts must be at least 1")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1 (or None for no limit)")
        if self.group_size is not None and self.group_size < 1:
            raise ValueError("group_size must be at least 1 (or None for no grouping)")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError("max_staleness must be 0 or more (or None to keep every version)")
        for name in ("max_group_wait_s", "linger_s"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be 0 or more (or None)")
        if self.on_stale not in ("drop", "keep"):
            raise ValueError(f"on_stale must be 'drop' or 'keep', not {self.on_stale!r}")
        if self.on_group_timeout not in ("flush", "drop"):
            raise ValueError(f"on_group_timeout must be 'flush' or 'drop', not {self.on_group_timeout!r}")

    @property
    def grouping(self) -> bool:
        return self.group_size is not None


def record_tokens(record: TripletRecord) -> int:
    """Prompt plus response tokens of every triplet of the record."""
    return sum(len(t.prompt_token_ids) + len(t.response_token_ids) for t in record.triplets)


def staleness_histogram(versions: Iterable[int | None], newest: int | None) -> list[int]:
    """Element k: how many of ``versions`` are exactly k behind ``newest`` (a version above it
    counts as 0). Versions that are None are not counted; [] when none is counted."""
    if newest is None:
        return []
    counts: list[int] = []
    for version in versions:
        if version is None:
            continue
        behind = max(0, newest - version)
        if behind >= len(counts):
            counts.extend([0] * (behind + 1 - len(counts)))
        counts[behind] += 1
    return counts


def batch_id_of(records: Iterable[TripletRecord]) -> str:
    """``tb-`` + a digest of the members' (rollout_id, attempt_id), in batch order."""
    digest = hashlib.blake2b(digest_size=16)
    for record in records:
        digest.update(f"{record.rollout_id}\t{record.attempt_id}\n".encode())
    return f"tb-{digest.hexdigest()}"


@dataclass
class BatcherStats:
    """Totals since the batcher was created (the batches carry the per-batch counts)."""

    records: int = 0
    batches: int = 0
    batched: int = 0
    replayed: int = 0  # skipped: a batch written before the restart already decided them
    dead_lettered: int = 0
    kept_stale: int = 0  # batched while behind the newest version (importance-corrected)
    incomplete_groups: int = 0
    dropped: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class JournalEntry:
    """What recovery needs from one batch in the batches topic (see :class:`Recovery`)."""

    source_partition: int | None
    sequence: int
    input_position: int
    newest_policy_version: int | None
    decided: tuple[int, ...]  # input offsets plus dropped offsets
    keys: tuple[tuple[str, str], ...] = ()  # (rollout id, attempt id) of the batched records

    @classmethod
    def of(cls, batch: TripletBatch) -> JournalEntry:
        return cls(
            batch.source_partition,
            batch.sequence,
            batch.input_position,
            batch.newest_policy_version,
            (*batch.input_offsets, *batch.dropped_offsets),
            tuple((r.rollout_id, r.attempt_id) for r in batch.records),
        )

    @classmethod
    def of_dict(cls, batch: Mapping[str, Any]) -> JournalEntry:
        """From a decoded agl.TripletBatch dict (spares validating every record of the batch)."""
        return cls(
            batch.get("source_partition"),
            int(batch.get("sequence") or 0),
            int(batch.get("input_position") or 0),
            batch.get("newest_policy_version"),
            (*batch.get("input_offsets", ()), *batch.get("dropped_offsets", ())),
            tuple((str(r.get("rollout_id")), str(r.get("attempt_id"))) for r in batch.get("records", ())),
        )


@dataclass
class Recovery:
    """What a batcher restarting on a source partition learns from the batches it wrote.

    The processor commits a partition up to its lowest pending offset, so after a restart it
    reads again from ``committed``; some records after that point are already in batches (or
    were reported dropped). Feed the batches topic's records to :meth:`offer`, newest first,
    until it returns True. ``input_position`` never decreases along the topic (a restarted
    batcher continues from the newest batch's value), and every offset a batch decided is below
    its ``input_position``; so once a batch has ``input_position <= committed``, neither it nor
    anything older holds an offset at or after ``committed``.

    The newest batch also carries the sequence number to continue from and the newest policy
    version seen, which staleness is measured against.

    Repeats: the triplet builder may emit an attempt's record again after a restart (it re-reads
    from its own commit point), possibly after this partition's commit point moved past the first
    copy. The running batcher drops such a repeat from memory; a restarted one learns the
    attempts batched from the ``lookback`` source offsets before the commit point (``recent``,
    newest first), so a repeat of those is dropped too. A repeat of an attempt batched earlier
    than that is not recognised: ``lookback`` bounds what a restart reads.
    """

    partition: int
    committed: int
    lookback: int = 0
    sequence: int = 0
    newest_version: int | None = None
    high_offset: int = 0
    decided: set[int] = field(default_factory=set)
    recent: list[tuple[str, str]] = field(default_factory=list)
    found: bool = False  # a batch of this partition was seen
    done: bool = False

    def offer(self, entry: JournalEntry) -> bool:
        """Take the next older batch; True once older ones cannot matter."""
        if self.done:
            return True
        if entry.source_partition != self.partition:
            return False  # another source partition sharing the output partition
        if not self.found:
            self.found = True
            self.sequence = entry.sequence
            self.newest_version = entry.newest_policy_version
            self.high_offset = entry.input_position
        if entry.input_position <= self.committed - self.lookback:
            self.done = True
            return True
        self.decided.update(o for o in entry.decided if o >= self.committed)
        self.recent.extend(reversed(entry.keys))
        return False


@dataclass
class _Member:
    offset: int
    record: TripletRecord
    tokens: int


@dataclass(eq=False)
class _Unit:
    """Records that go into one batch together: a single record or a whole group."""

    members: list[_Member]
    ready_since: float
    group_id: str | None = None

    @property
    def tokens(self) -> int:
        return sum(m.tokens for m in self.members)


@dataclass
class _OpenGroup:
    members: list[_Member]
    started: float
    lost: int = 0  # members dropped stale: they count as arrived, so the group does not wait for them


class Batcher:
    """The batching state machine of one source partition.

    ``add`` and ``tick`` return the batches to write, in order. Offsets must arrive in
    increasing order (a repeated or older offset is ignored); an offset the caller dealt with
    itself (dead-lettered) is passed to :meth:`skip` so the commit point can move past it.
    """

    def __init__(
        self,
        policy: BatchPolicy,
        *,
        partition: int | None = None,
        start_offset: int = 0,
        recovery: Recovery | None = None,
        recent_attempts: int = 100_000,
    ) -> None:
        self.policy = policy
        self.partition = partition
        self.next_offset = start_offset
        self.sequence = recovery.sequence if recovery else 0
        self.newest_version = recovery.newest_version if recovery else None
        # input_position of the next batch: never below what an earlier batch said (Recovery).
        self.high_offset = max(start_offset, recovery.high_offset if recovery else 0)
        self._decided = {o for o in (recovery.decided if recovery else ()) if o >= start_offset}
        self._open: dict[str, _OpenGroup] = {}
        self._ready: deque[_Unit] = deque()
        self._drops: list[tuple[int, DropReason]] = []
        self._pending_keys: set[tuple[str, str]] = set()
        self._recent: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._recent_capacity = recent_attempts
        for key in reversed(recovery.recent) if recovery else ():
            self._remember(key)
        self.stats = BatcherStats()

    # -- input ------------------------------------------------------------------------------

    def add(self, record: TripletRecord, offset: int, now: float) -> list[TripletBatch]:
        """Take the record at ``offset``; return the batches it completes."""
        if not self._advance(offset):
            return []
        if offset in self._decided:
            self._decided.discard(offset)
            self.stats.replayed += 1
            self._observe_version(record.policy_version, now)
            self._remember((record.rollout_id, record.attempt_id))
            return []
        self.stats.records += 1
        self._observe_version(record.policy_version, now)
        if record.mode in EVAL_MODES:
            self._drop(offset, "eval")
            return []
        key = (record.rollout_id, record.attempt_id)
        if key in self._pending_keys or key in self._recent:
            self._drop(offset, "duplicate")
            return []
        if self.policy.on_stale == "drop" and self._is_stale(record):
            self._drop(offset, "stale")
            if self._waits_for_groups():
                group = self._open.setdefault(record.group_id, _OpenGroup([], now))
                group.lost += 1
                self._close_if_complete(record.group_id, group, now)
            return self._emit(now, force=False)
        member = _Member(offset, record, record_tokens(record))
        self._pending_keys.add(key)
        if self.policy.group_size is None:
            self._ready.append(_Unit([member], now))
        else:
            group = self._open.setdefault(record.group_id, _OpenGroup([], now))
            group.members.append(member)
            self._close_if_complete(record.group_id, group, now)
        return self._emit(now, force=False)

    def skip(self, offset: int) -> None:
        """The caller handled ``offset`` itself (e.g. dead-lettered it): not pending here."""
        if self._advance(offset):
            self._decided.discard(offset)
            self.stats.dead_lettered += 1

    def tick(self, now: float) -> list[TripletBatch]:
        """Apply the clock: expire groups that waited too long, flush a lingering batch."""
        policy = self.policy
        if policy.grouping and policy.wait_for_groups and policy.max_group_wait_s is not None:
            for group_id, group in list(self._open.items()):
                if now - group.started >= policy.max_group_wait_s:
                    del self._open[group_id]
                    if not group.members:  # only members dropped stale: nothing to flush
                        continue
                    if policy.on_group_timeout == "flush":
                        self._ready.append(_Unit(group.members, now, group_id))
                    else:
                        for member in group.members:
                            self._forget(member)
                            self._drop(member.offset, "incomplete")
        out = self._emit(now, force=False)
        linger = self._linger_deadline()
        if linger is not None and now >= linger:
            if policy.grouping and not policy.wait_for_groups:
                for group_id, group in self._open.items():
                    if group.members:
                        self._ready.append(_Unit(group.members, group.started, group_id))
                self._open.clear()
            out.extend(self._emit(now, force=True))
        return out

    # -- what the processor needs -------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """The earliest time at which :meth:`tick` may do something (None: nothing to wait for)."""
        deadlines = []
        policy = self.policy
        if policy.grouping and policy.wait_for_groups and policy.max_group_wait_s is not None and self._open:
            deadlines.append(min(g.started for g in self._open.values()) + policy.max_group_wait_s)
        linger = self._linger_deadline()
        if linger is not None:
            deadlines.append(linger)
        return min(deadlines) if deadlines else None

    def pending_offsets(self) -> list[int]:
        """Offsets not yet in a batch: held records, and drops no batch has reported yet."""
        offsets = [m.offset for g in self._open.values() for m in g.members]
        offsets += [m.offset for u in self._ready for m in u.members]
        offsets += [o for o, _ in self._drops]
        return sorted(offsets)

    def commit_offset(self) -> int:
        """The offset the source partition may be committed at: nothing below it is pending."""
        pending = self.pending_offsets()
        return pending[0] if pending else self.next_offset

    @property
    def pending(self) -> int:
        """Records held for a batch (not counting unreported drops)."""
        return sum(len(g.members) for g in self._open.values()) + sum(len(u.members) for u in self._ready)

    # -- internals ----------------------------------------------------------------------------

    def _advance(self, offset: int) -> bool:
        if offset < self.next_offset:
            return False  # delivered again within this run: already handled
        self.next_offset = offset + 1
        self.high_offset = max(self.high_offset, self.next_offset)
        return True

    def _is_stale(self, record: TripletRecord) -> bool:
        k = self.policy.max_staleness
        v = record.policy_version
        return k is not None and v is not None and self.newest_version is not None and self.newest_version - v > k

    def _observe_version(self, version: int | None, now: float) -> None:
        if version is None or (self.newest_version is not None and version <= self.newest_version):
            return
        self.newest_version = version
        if self.policy.max_staleness is not None and self.policy.on_stale == "drop":
            self._prune_stale(now)

    def _waits_for_groups(self) -> bool:
        return self.policy.group_size is not None and self.policy.wait_for_groups

    def _close_if_complete(self, group_id: str, group: _OpenGroup, now: float) -> None:
        """Every member of the group arrived or was dropped stale: it is ready (an emptied one is gone)."""
        size = self.policy.group_size
        if size is None or len(group.members) + group.lost < size:
            return
        del self._open[group_id]
        if group.members:
            self._ready.append(_Unit(group.members, now, group_id))

    def _prune_stale(self, now: float) -> None:
        """Drop held records the newest version has left behind. A group counts them as lost, so
        it is complete once its other members arrived."""
        for group_id, group in list(self._open.items()):
            kept = self._keep_fresh(group.members)
            group.lost += len(group.members) - len(kept)
            group.members = kept
            if self._waits_for_groups():
                self._close_if_complete(group_id, group, now)
            elif not group.members:
                del self._open[group_id]
        for unit in self._ready:
            unit.members = self._keep_fresh(unit.members)
        self._ready = deque(u for u in self._ready if u.members)

    def _keep_fresh(self, members: list[_Member]) -> list[_Member]:
        fresh = []
        for member in members:
            if self._is_stale(member.record):
                self._forget(member)
                self._drop(member.offset, "stale")
            else:
                fresh.append(member)
        return fresh

    def _remember(self, key: tuple[str, str]) -> None:
        self._recent[key] = None
        if len(self._recent) > self._recent_capacity:
            self._recent.popitem(last=False)

    def _forget(self, member: _Member) -> None:
        self._pending_keys.discard((member.record.rollout_id, member.record.attempt_id))

    def _drop(self, offset: int, reason: DropReason) -> None:
        self._drops.append((offset, reason))
        self.stats.dropped[reason] += 1

    def _linger_deadline(self) -> float | None:
        linger = self.policy.linger_s
        if linger is None:
            return None
        since = [self._ready[0].ready_since] if self._ready else []
        if self.policy.grouping and not self.policy.wait_for_groups and self._open:
            since.append(min(g.started for g in self._open.values()))
        return min(since) + linger if since else None

    def _emit(self, now: float, *, force: bool) -> list[TripletBatch]:
        out = []
        while self._ready:
            count = self._full_batch_units()
            if count is None:
                if not force:
                    break
                count = len(self._ready)
            out.append(self._make_batch([self._ready.popleft() for _ in range(count)], now))
        return out

    def _full_batch_units(self) -> int | None:
        """How many units from the front of the ready queue make a full batch (None: not yet)."""
        max_rollouts, max_tokens = self.policy.max_rollouts, self.policy.max_tokens
        rollouts = tokens = count = 0
        for unit in self._ready:
            size, unit_tokens = len(unit.members), unit.tokens
            if count and (
                rollouts + size > max_rollouts or (max_tokens is not None and tokens + unit_tokens > max_tokens)
            ):
                return count  # the next unit does not fit: this is as full as FIFO order allows
            rollouts, tokens, count = rollouts + size, tokens + unit_tokens, count + 1
            if rollouts >= max_rollouts or (max_tokens is not None and tokens >= max_tokens):
                return count
        return None

    def _make_batch(self, units: list[_Unit], now: float) -> TripletBatch:
        members = [m for unit in units for m in unit.members]
        records = [m.record for m in members]
        versions = [r.policy_version for r in records if r.policy_version is not None]
        drops, self._drops = self._drops, []
        reasons = Counter(reason for _, reason in drops)
        staleness_counts = staleness_histogram((r.policy_version for r in records), self.newest_version)
        kept_stale = sum(staleness_counts[1:])
        size = self.policy.group_size
        incomplete = sum(1 for u in units if size is not None and len(u.members) < size)
        self.sequence += 1
        batch = TripletBatch(
            batch_id=batch_id_of(records),
            records=records,
            created_time=now,
            min_policy_version=min(versions) if versions else None,
            max_policy_version=max(versions) if versions else None,
            n_tokens=sum(m.tokens for m in members),
            sequence=self.sequence,
            source_partition=self.partition,
            input_offsets=[m.offset for m in members],
            input_position=self.high_offset,
            newest_policy_version=self.newest_version,
            group_size=size,
            incomplete_groups=incomplete,
            kept_stale=kept_stale,
            staleness_counts=staleness_counts,
            dropped_stale=reasons["stale"],
            dropped_incomplete=reasons["incomplete"],
            dropped_duplicate=reasons["duplicate"],
            dropped_eval=reasons["eval"],
            dropped_offsets=sorted(o for o, _ in drops),
        )
        for member in members:
            key = (member.record.rollout_id, member.record.attempt_id)
            self._pending_keys.discard(key)
            self._remember(key)
        self.stats.batches += 1
        self.stats.batched += len(members)
        self.stats.kept_stale += kept_stale
        self.stats.incomplete_groups += incomplete
        return batch
