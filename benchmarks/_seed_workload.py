"""The client side of benchmarks/compare_seed.py: the same workload code against either store.

Standard library only, plus the store's own client, so that one copy of the loops runs in two
interpreters: benchmarks/compare_seed.py imports this module for the agl-stream side (in the
project's venv), and the seed's venv runs it as a script for Agent Lightning 0.3.0's
``LightningStoreClient`` (``python _seed_workload.py --role runner --server http://...``). It
never imports agl_stream.

Roles (one process each):

* ``runner``: ``--runners`` coroutines that loop dequeue_rollout(worker_id=...) -> add_many_spans
  (``--spans`` spans, each with a ``--span-bytes`` string attribute) -> update_attempt(...,
  status="succeeded"); when dequeue returns None they sleep ``--poll`` seconds (the seed's
  polling style) and try again. A rollout whose input carries ``t0`` is a probe: the runner
  records time.time() - t0 at its claim.
* ``algorithm``: on ``go``, enqueues ``--rollouts`` rollouts with enqueue_many_rollouts in batches
  of ``--batch``, then calls wait_for_rollouts(rollout_ids=<still unfinished>, timeout=0.1) again
  and again until all are done (``--wait-timeout 0``: non-blocking calls 0.1 s apart); on
  ``probe``, enqueues ``--probes`` single rollouts one at a time (``--probe-interval`` apart,
  input {"t0": time.time() before the call}) and waits for them the same way.

Protocol with the parent: commands are lines on stdin (``go``, ``probe``, ``stop``; end of
input means ``stop``), answers are JSON lines on the process's original stdout (stdout itself
is redirected to stderr, so nothing a library prints can garble them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

WAIT_TIMEOUT = 0.1  # the seed's LightningStoreClient refuses more than 0.1 s per wait_for_rollouts call
IDLE_WAIT = 0.1  # with --wait-timeout 0, the pause between wait_for_rollouts calls


@dataclass
class Side:
    """What differs between the two stores: opening a client, building requests and spans."""

    open_store: Callable[[], Awaitable[Any]]
    enqueue_requests: Callable[[list[dict[str, Any]]], Sequence[Any]]
    make_spans: Callable[[str, str, list[str]], Sequence[Any]]
    close_store: Callable[[Any], Awaitable[None]]
    counts: Callable[[], dict[str, float]] | None = None
    """This process's request counters so far (agl-stream: Kafka requests per API), or None."""


class Channel:
    """JSON lines to the parent on the original stdout; command lines from stdin.

    A ``stop`` (or the end of stdin) that arrives while the role is busy rather than waiting for a
    command cancels the task given to :meth:`listen`, if any: the role stops at once.
    """

    def __init__(self) -> None:
        self._out: TextIO = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)  # stray prints go to stderr (the parent's log file), not into the protocol
        sys.stdout = sys.stderr
        self._commands: asyncio.Queue[str] | None = None
        self._cancel: asyncio.Task[Any] | None = None
        self._awaiting = False

    def send(self, event: str, **fields: Any) -> None:
        self._out.write(json.dumps({"event": event, **fields}) + "\n")
        self._out.flush()

    def listen(self, cancel_on_stop: asyncio.Task[Any] | None) -> None:
        """Start reading commands (a thread: stdin may be a pipe or a terminal)."""
        loop = asyncio.get_running_loop()
        self._commands = asyncio.Queue()
        self._cancel = cancel_on_stop

        def read() -> None:
            for line in sys.stdin:
                loop.call_soon_threadsafe(self._arrived, line.strip())
            loop.call_soon_threadsafe(self._arrived, "stop")

        threading.Thread(target=read, name="commands", daemon=True).start()

    def _arrived(self, command: str) -> None:
        assert self._commands is not None
        self._commands.put_nowait(command)
        if command == "stop" and not self._awaiting and self._cancel is not None:
            self._cancel.cancel()

    async def command(self) -> str:
        assert self._commands is not None, "listen() first"
        self._awaiting = True
        try:
            return await self._commands.get() or "stop"
        finally:
            self._awaiting = False


def payloads(count: int, size: int) -> list[str]:
    """``count`` strings of ``size`` characters (random hex: the payload does not compress away)."""
    return [secrets.token_hex((size + 1) // 2)[:size] for _ in range(count)]


async def run_runner(
    side: Side,
    channel: Channel,
    name: str,
    runners: int,
    spans: int,
    span_bytes: int,
    poll: float,
    claim_wait: float = 0.0,
) -> None:
    channel.listen(None)  # a runner handles stop itself: it finishes the attempts it holds
    store = await side.open_store()
    stop = asyncio.Event()
    probe_latency: list[float] = []
    stats = {"claimed": 0, "completed": 0, "empty_dequeues": 0, "errors": 0}
    last_completion = 0.0
    errors: list[str] = []

    async def worker(worker_id: str) -> None:
        nonlocal last_completion
        while not stop.is_set():
            try:
                # agl-stream's long poll when asked for (the seed's dequeue has no wait).
                wait = {"wait": claim_wait} if claim_wait > 0 else {}
                claimed = await store.dequeue_rollout(worker_id=worker_id, **wait)
                if claimed is None:
                    stats["empty_dequeues"] += 1
                    await asyncio.sleep(poll)
                    continue
                claimed_at = time.time()
                stats["claimed"] += 1
                task = claimed.input
                is_probe = isinstance(task, dict) and "t0" in task
                if is_probe:
                    probe_latency.append(claimed_at - float(task["t0"]))
                attempt_id = claimed.attempt.attempt_id
                await store.add_many_spans(side.make_spans(claimed.rollout_id, attempt_id, payloads(spans, span_bytes)))
                await store.update_attempt(claimed.rollout_id, attempt_id, status="succeeded")
                if not is_probe:
                    stats["completed"] += 1
                    last_completion = time.time()
            except asyncio.CancelledError:
                raise
            except Exception as error:
                stats["errors"] += 1
                if len(errors) < 5:
                    errors.append(f"{worker_id}: {type(error).__name__}: {error}")
                    traceback.print_exc()
                await asyncio.sleep(poll)

    try:
        # One dequeue per process before the clock starts (agl-stream: joins the claimers' group).
        first = await store.dequeue_rollout(worker_id=f"{name}-warm-up")
        if first is not None:
            raise RuntimeError("the queue was not empty at the start")
        tasks = [asyncio.create_task(worker(f"{name}-{j}")) for j in range(runners)]
        channel.send("ready", pid=os.getpid())
        while await channel.command() != "stop":
            pass
        stop.set()
        _, pending = await asyncio.wait(tasks, timeout=5)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        channel.send(
            "result",
            **stats,
            last_completion=last_completion,
            probe_latency=probe_latency,
            error_samples=errors,
            counts=side.counts() if side.counts is not None else {},
        )
    finally:
        await side.close_store(store)


async def _wait_all(
    store: Any, ids: list[str], timeout: float, on_progress: Callable[[int], None] | None = None
) -> int:
    """The seed's waiting pattern: short wait_for_rollouts calls until every rollout is done."""
    remaining = set(ids)
    calls = 0
    while remaining:
        finished = await store.wait_for_rollouts(rollout_ids=list(remaining), timeout=timeout)
        calls += 1
        for rollout in finished:
            remaining.discard(rollout.rollout_id)
        if on_progress is not None:
            on_progress(len(ids) - len(remaining))
        if remaining and timeout <= 0:
            await asyncio.sleep(IDLE_WAIT)  # a non-blocking check: pause between them
    return calls


async def run_algorithm(
    side: Side, channel: Channel, rollouts: int, batch: int, probes: int, probe_interval: float, wait_timeout: float
) -> None:
    channel.listen(asyncio.current_task())  # a stop while enqueuing or waiting ends the algorithm at once
    store = await side.open_store()
    try:
        channel.send("ready", pid=os.getpid())
        if await channel.command() != "go":
            return
        ids: list[str] = []
        enqueue_seconds = 0.0
        first_enqueue = time.time()
        for start in range(0, rollouts, batch):
            requests = side.enqueue_requests([{"i": i} for i in range(start, min(rollouts, start + batch))])
            began = time.perf_counter()
            enqueued = await store.enqueue_many_rollouts(requests)
            enqueue_seconds += time.perf_counter() - began
            ids.extend(r.rollout_id for r in enqueued)
            channel.send("enqueued", count=len(ids))
        all_enqueued = time.time()
        calls = await _wait_all(store, ids, wait_timeout, lambda done: channel.send("progress", done=done))
        channel.send(
            "main_done",
            first_enqueue=first_enqueue,
            all_enqueued=all_enqueued,
            all_seen_done=time.time(),
            enqueue_seconds=enqueue_seconds,
            wait_calls=calls,
            unique_ids=len(set(ids)),
            counts=side.counts() if side.counts is not None else {},
        )
        if await channel.command() != "probe":
            return
        probe_ids: list[str] = []
        for _ in range(probes):
            t0 = time.time()
            rollout = await store.enqueue_rollout({"t0": t0})
            probe_ids.append(rollout.rollout_id)
            await asyncio.sleep(probe_interval)  # pacing the probes into an idle queue, not synchronisation
        await _wait_all(store, probe_ids, wait_timeout)
        channel.send("probes_done")
        while await channel.command() != "stop":
            pass
    finally:
        await side.close_store(store)


def seed_side(server: str) -> Side:
    """Agent Lightning 0.3.0's HTTP client (the seed venv's python only)."""
    from agentlightning.store.client_server import LightningStoreClient  # type: ignore[import-not-found]
    from agentlightning.types import EnqueueRolloutRequest, Span  # type: ignore[import-not-found]

    async def open_store() -> Any:
        return LightningStoreClient(server)

    def enqueue_requests(inputs: list[dict[str, Any]]) -> Sequence[Any]:
        return [EnqueueRolloutRequest(input=task) for task in inputs]

    def make_spans(rollout_id: str, attempt_id: str, texts: list[str]) -> Sequence[Any]:
        now = time.time()
        return [
            Span.from_attributes(
                attributes={"step": i, "payload": text},
                rollout_id=rollout_id,
                attempt_id=attempt_id,
                sequence_id=i + 1,
                name="agent.step",
                start_time=now,
                end_time=now,
            )
            for i, text in enumerate(texts)
        ]

    async def close_store(store: Any) -> None:
        await store.close()

    return Side(open_store, enqueue_requests, make_spans, close_store)


def add_role_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--role", choices=["runner", "algorithm"], required=True)
    parser.add_argument("--name", default="runner")
    parser.add_argument("--runners", type=int, default=8)
    parser.add_argument("--spans", type=int, default=5)
    parser.add_argument("--span-bytes", type=int, default=1024)
    parser.add_argument("--poll", type=float, default=0.01)
    parser.add_argument("--claim-wait", type=float, default=0.0)
    parser.add_argument("--rollouts", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--probes", type=int, default=100)
    parser.add_argument("--probe-interval", type=float, default=0.05)
    parser.add_argument("--wait-timeout", type=float, default=WAIT_TIMEOUT)


def run_role(side: Side, args: argparse.Namespace) -> None:
    channel = Channel()
    try:
        if args.role == "runner":
            asyncio.run(
                run_runner(
                    side, channel, args.name, args.runners, args.spans, args.span_bytes, args.poll, args.claim_wait
                )
            )
        else:
            asyncio.run(
                run_algorithm(
                    side, channel, args.rollouts, args.batch, args.probes, args.probe_interval, args.wait_timeout
                )
            )
    except asyncio.CancelledError:
        channel.send("stopped")  # told to stop while busy
    except BaseException as error:
        channel.send("failed", error=f"{type(error).__name__}: {error}")
        raise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_role_arguments(parser)
    parser.add_argument("--server", required=True, help="the seed store server, http://host:port")
    args = parser.parse_args()
    run_role(seed_side(args.server), args)


if __name__ == "__main__":
    main()
