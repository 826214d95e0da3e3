"""One interpreter of store-contract sequences, for the seed's store and for agl-stream's.

A sequence is data: a list of operations on a LightningStore with symbolic references
(``{"op": "enqueue_rollout", "input": {...}, "as": "r1"}``, ``{"op": "dequeue_rollout",
"worker": "w1"}``, ``{"op": "update_attempt", "rollout": "r1", "attempt": "latest", "status":
"failed"}``). :class:`Interpreter` runs it against a store and records, per operation, an
observation with every id replaced by its symbol and every clock value by whether it is set, so
that two stores can be compared observation by observation.

Run as a script (by the seed's own python, ``tests/integration/test_seed_contract.py`` does it)
it reads ``{"sequences": {name: [op, ...]}}`` on stdin, runs each sequence against a fresh
``InMemoryLightningStore`` of Agent Lightning 0.3.0 and prints ``{name: [observation, ...]}``
as JSON. Imported (by the test), it runs the same sequences against agl-stream's client. This
module imports neither store at module level: the two never meet in one interpreter.

Symbols: a rollout is named by the ``as`` of the operation that made it; an attempt by its
rollout's symbol and sequence number (``r1.a2``), named when first seen; a resources snapshot by
the ``as`` of ``add_resources``; a worker ``w1`` is the worker id ``<tag>-w1`` (each run has its
own tag, so runs on one store never share workers). An id nobody named shows as ``?`` (say,
another test's rollout in a shared queue). Argument values that are not symbols pass through
as given (``"ro-000000000bad"``: an id no store knows).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

__all__ = ["Backend", "Interpreter", "run_sequences"]

Observation = dict[str, Any]


class Backend(Protocol):
    """What differs between the two stores' client libraries (not their behaviour)."""

    def config(self, spec: Mapping[str, Any]) -> Any:
        """A RolloutConfig from its fields."""

    def resources(self, spec: Mapping[str, Any]) -> Any:
        """Named resources: ``{name: {"model": ...}}`` as LLM resources."""

    def span(self, rollout_id: str, attempt_id: str, sequence_id: int, name: str) -> Any:
        """A finished span of an attempt."""

    def enqueue_request(self, fields: Mapping[str, Any]) -> Any:
        """One request of enqueue_many_rollouts."""

    async def dequeue_within(self, store: Any, worker_id: str | None, seconds: float) -> Any:
        """A claim that may wait up to ``seconds`` for a rollout to become claimable (after a
        watchdog verdict, say); the store's own way, never a fixed sleep."""


class Interpreter:
    """Runs one sequence against one store; ``observations`` holds what each step saw."""

    def __init__(self, store: Any, backend: Backend, tag: str, initial_resources_id: str | None) -> None:
        self.store = store
        self.backend = backend
        self.tag = tag
        self.ids: dict[str, str] = {}  # symbol -> id
        self.symbols: dict[str, str] = {}  # id -> symbol
        self.initial_resources_id = initial_resources_id
        if initial_resources_id is not None:
            # The latest snapshot before the sequence (another test's on a shared store).
            self.symbols[initial_resources_id] = "<initial>"
        self.observations: list[Observation] = []

    # -- symbols -------------------------------------------------------------------------

    def _bind(self, symbol: str | None, real_id: str) -> None:
        if symbol is not None and real_id not in self.symbols:
            self.ids[symbol] = real_id
            self.symbols[real_id] = symbol

    def _id(self, symbol: Any) -> Any:
        if symbol is None or not isinstance(symbol, str):
            return symbol
        return self.ids.get(symbol, symbol)

    def _worker(self, symbol: str | None) -> str | None:
        return None if symbol is None else f"{self.tag}-{symbol}"

    def _symbol(self, real_id: str | None) -> str | None:
        if real_id is None:
            return None
        if real_id.startswith(f"{self.tag}-"):
            return real_id[len(self.tag) + 1 :]
        return self.symbols.get(real_id, "?")

    def _resources_symbol(self, resources_id: str | None) -> str | None:
        if resources_id is None:
            return "<initial>" if self.initial_resources_id is None else None
        return self._symbol(resources_id)

    # -- observations ----------------------------------------------------------------------

    def _attempt(self, attempt: Any) -> Observation:
        rollout = self._symbol(attempt.rollout_id)
        if rollout != "?":
            self._bind(f"{rollout}.a{attempt.sequence_id}", attempt.attempt_id)
        return {
            "attempt": self._symbol(attempt.attempt_id),
            "sequence_id": attempt.sequence_id,
            "status": attempt.status,
            "worker": self._symbol(attempt.worker_id),
            "ended": attempt.end_time is not None,
            "heartbeat": attempt.last_heartbeat_time is not None,
            "metadata": attempt.metadata,
        }

    def _rollout(self, rollout: Any, symbol: str | None = None) -> Observation | None:
        if rollout is None:
            return None
        self._bind(symbol, rollout.rollout_id)
        config = rollout.config
        seen: Observation = {
            "rollout": self._symbol(rollout.rollout_id),
            "status": rollout.status,
            "input": rollout.input,
            "mode": rollout.mode,
            "resources": self._resources_symbol(rollout.resources_id),
            "metadata": rollout.metadata,
            "config": {
                "timeout_seconds": config.timeout_seconds,
                "unresponsive_seconds": config.unresponsive_seconds,
                "max_attempts": config.max_attempts,
                "retry_condition": list(config.retry_condition),
            },
            "ended": rollout.end_time is not None,
        }
        attempt = getattr(rollout, "attempt", None)
        seen["attempt"] = None if attempt is None else self._attempt(attempt)
        return seen

    def _resources_update(self, update: Any, symbol: str | None = None) -> Observation | None:
        if update is None:
            return None
        self._bind(symbol, update.resources_id)
        return {
            "resources": self._resources_symbol(update.resources_id),
            "version": update.version,
            "models": {name: getattr(r, "model", None) for name, r in update.resources.items()},
        }

    def _worker_seen(self, worker: Any) -> Observation | None:
        if worker is None:
            return None
        return {
            "worker": self._symbol(worker.worker_id),
            "status": worker.status,
            "heartbeat_stats": worker.heartbeat_stats,
            "current_rollout": self._symbol(worker.current_rollout_id),
            "current_attempt": self._symbol(worker.current_attempt_id),
            "heartbeat": worker.last_heartbeat_time is not None,
        }

    def _span(self, span: Any) -> Observation:
        return {
            "rollout": self._symbol(span.rollout_id),
            "attempt": self._symbol(span.attempt_id),
            "sequence_id": span.sequence_id,
            "name": span.name,
        }

    # -- operations ------------------------------------------------------------------------

    async def run(self, ops: Sequence[Mapping[str, Any]]) -> list[Observation]:
        for op in ops:
            started = time.monotonic()
            try:
                result = await self._run_op(op)
            except Exception as error:  # the error's kind is the observation
                kind = "ValueError" if isinstance(error, ValueError) else type(error).__name__
                result = {"error": kind}
                if not isinstance(error, ValueError):
                    result["message"] = str(error)[:300]
            seen = {"op": op["op"], "result": result}
            if op.get("timed"):
                seen["seconds"] = round(time.monotonic() - started, 2)
            self.observations.append(seen)
        return self.observations

    def _rollout_args(self, op: Mapping[str, Any]) -> dict[str, Any]:
        args: dict[str, Any] = {"input": op.get("input")}
        for key in ("mode", "metadata"):
            if key in op:
                args[key] = op[key]
        if "config" in op:
            args["config"] = self.backend.config(op["config"])
        if "resources" in op:
            args["resources_id"] = self._id(op["resources"])
        return args

    async def _run_op(self, op: Mapping[str, Any]) -> Any:
        store = self.store
        name = op["op"]
        if name == "enqueue_rollout":
            return self._rollout(await store.enqueue_rollout(**self._rollout_args(op)), op.get("as"))
        if name == "enqueue_many_rollouts":
            requests = [self.backend.enqueue_request(self._rollout_args(r)) for r in op["requests"]]
            made = await store.enqueue_many_rollouts(requests)
            return [self._rollout(r, r_op.get("as")) for r, r_op in zip(made, op["requests"], strict=True)]
        if name == "start_rollout":
            args = self._rollout_args(op)
            if "worker" in op:
                args["worker_id"] = self._worker(op["worker"])
            return self._rollout(await store.start_rollout(**args), op.get("as"))
        if name == "dequeue_rollout":
            worker = self._worker(op.get("worker"))
            if op.get("within"):
                return self._rollout(await self.backend.dequeue_within(store, worker, float(op["within"])))
            return self._rollout(await store.dequeue_rollout(worker_id=worker))
        if name == "start_attempt":
            args = {"worker_id": self._worker(op["worker"])} if "worker" in op else {}
            return self._rollout(await store.start_attempt(self._id(op["rollout"]), **args))
        if name == "update_attempt":
            fields = {k: op[k] for k in ("status", "metadata") if k in op}
            if "worker" in op:
                fields["worker_id"] = self._worker(op["worker"])
            attempt = await store.update_attempt(self._id(op["rollout"]), self._id(op["attempt"]), **fields)
            return self._attempt(attempt)
        if name == "update_rollout":
            fields = {k: op[k] for k in ("status", "mode", "metadata", "input") if k in op}
            if "config" in op:
                fields["config"] = self.backend.config(op["config"])
            if "resources" in op:
                fields["resources_id"] = self._id(op["resources"])
            return self._rollout(await store.update_rollout(self._id(op["rollout"]), **fields))
        if name == "get_rollout_by_id":
            return self._rollout(await store.get_rollout_by_id(self._id(op["rollout"])))
        if name == "get_latest_attempt":
            attempt = await store.get_latest_attempt(self._id(op["rollout"]))
            return None if attempt is None else self._attempt(attempt)
        if name == "query_attempts":
            return [self._attempt(a) for a in await store.query_attempts(self._id(op["rollout"]))]
        if name == "query_rollouts":
            filters = {
                k: op[k] for k in ("status_in", "sort_by", "sort_order", "limit", "offset", "filter_logic") if k in op
            }
            if "rollout_id_in" in op:
                filters["rollout_id_in"] = [self._id(s) for s in op["rollout_id_in"]]
            found = [self._rollout(r) for r in await store.query_rollouts(**filters)]
            # Rollouts no step named are another test's, on a store shared with it.
            found = [r for r in found if r is not None and r["rollout"] != "?"]
            if "sort_by" not in op:
                # Neither contract orders an unsorted query: compared as a set.
                found.sort(key=lambda r: json.dumps(r, sort_keys=True))
            return found
        if name == "wait_for_rollouts":
            ids = [self._id(s) for s in op["rollouts"]]
            done = await store.wait_for_rollouts(rollout_ids=ids, timeout=op.get("timeout"))
            # "in arbitrary order", says the contract
            return sorted((self._rollout(r) for r in done), key=lambda r: json.dumps(r, sort_keys=True))
        if name == "add_resources":
            return self._resources_update(await store.add_resources(self.backend.resources(op["resources"])), op["as"])
        if name == "update_resources":
            update = await store.update_resources(self._id(op["target"]), self.backend.resources(op["resources"]))
            return self._resources_update(update)
        if name == "get_latest_resources":
            return self._resources_update(await store.get_latest_resources())
        if name == "get_resources_by_id":
            return self._resources_update(await store.get_resources_by_id(self._id(op["target"])))
        if name == "update_worker":
            args = {"heartbeat_stats": op["stats"]} if "stats" in op else {}
            return self._worker_seen(await store.update_worker(self._worker(op["worker"]), **args))
        if name == "get_worker_by_id":
            return self._worker_seen(await store.get_worker_by_id(self._worker(op["worker"])))
        if name == "query_workers":
            args = {k: op[k] for k in ("status_in",) if k in op}
            workers = await store.query_workers(worker_id_contains=self.tag, sort_by="worker_id", **args)
            return [self._worker_seen(w) for w in workers]
        if name == "add_span":
            span = self.backend.span(
                self._id(op["rollout"]), self._id(op["attempt"]), op["sequence_id"], op.get("name", "step")
            )
            added = await store.add_span(span)
            return None if added is None else self._span(added)
        if name == "add_many_spans":
            spans = [
                self.backend.span(
                    self._id(s["rollout"]), self._id(s["attempt"]), s["sequence_id"], s.get("name", "step")
                )
                for s in op["spans"]
            ]
            return [self._span(s) for s in await store.add_many_spans(spans)]
        if name == "query_spans":
            attempt = op.get("attempt")
            filters = {k: op[k] for k in ("name", "name_contains", "sort_order", "limit") if k in op}
            spans = await store.query_spans(self._id(op["rollout"]), self._id(attempt), **filters)
            return [self._span(s) for s in spans]
        if name == "get_next_span_sequence_id":
            return await store.get_next_span_sequence_id(self._id(op["rollout"]), self._id(op["attempt"]))
        if name == "get_many_span_sequence_ids":
            pairs = [(self._id(r), self._id(a)) for r, a in op["pairs"]]
            return list(await store.get_many_span_sequence_ids(pairs))
        raise KeyError(f"no such operation {name!r}")


async def run_sequences(
    sequences: Mapping[str, Sequence[Mapping[str, Any]]],
    backend: Backend,
    open_store: Callable[[], Awaitable[Any]],
    *,
    tag: Callable[[str], str],
    before: Callable[[Any], Awaitable[str | None]] | None = None,
    concurrently: bool = False,
) -> dict[str, list[Observation]]:
    """Each sequence against the store ``open_store`` gives for it; ``before`` prepares the
    store and returns the latest resources id at the start (None on a fresh store).
    ``concurrently`` runs the sequences at once (each must have a store of its own): their
    waits for the watchdog overlap."""

    async def run(name: str, ops: Sequence[Mapping[str, Any]]) -> list[Observation]:
        store = await open_store()
        initial = await before(store) if before is not None else None
        return await Interpreter(store, backend, tag(name), initial).run(ops)

    if concurrently:
        done = await asyncio.gather(*(run(name, ops) for name, ops in sequences.items()))
        return dict(zip(sequences, done, strict=True))
    return {name: await run(name, ops) for name, ops in sequences.items()}


# -- the seed's side (its own python only) ---------------------------------------------------


class SeedBackend:
    """Agent Lightning 0.3.0's types."""

    def __init__(self) -> None:
        from agentlightning.types import LLM, EnqueueRolloutRequest, RolloutConfig, Span

        self._llm, self._request, self._config, self._span = LLM, EnqueueRolloutRequest, RolloutConfig, Span

    def config(self, spec: Mapping[str, Any]) -> Any:
        return self._config(**spec)

    def resources(self, spec: Mapping[str, Any]) -> Any:
        return {
            name: self._llm(endpoint="http://127.0.0.1:1/v1", model=r["model"], sampling_parameters={})
            for name, r in spec.items()
        }

    def span(self, rollout_id: str, attempt_id: str, sequence_id: int, name: str) -> Any:
        return self._span.from_attributes(
            attributes={"step": sequence_id},
            rollout_id=rollout_id,
            attempt_id=attempt_id,
            sequence_id=sequence_id,
            name=name,
            trace_id=f"{sequence_id:032x}",
            span_id=f"{sequence_id:016x}",
            start_time=1.0,
            end_time=2.0,
        )

    def enqueue_request(self, fields: Mapping[str, Any]) -> Any:
        return self._request(**fields)

    async def dequeue_within(self, store: Any, worker_id: str | None, seconds: float) -> Any:
        # The seed's watchdog runs inside store calls (every call with scan_debounce_seconds=0):
        # a claim re-asked until the verdict made the rollout claimable, up to the deadline.
        deadline = time.monotonic() + seconds
        while True:
            claimed = await store.dequeue_rollout(worker_id=worker_id)
            if claimed is not None or time.monotonic() >= deadline:
                return claimed
            await asyncio.sleep(0.02)


def _main() -> None:
    import logging

    from agentlightning.store.memory import InMemoryLightningStore

    logging.disable(logging.WARNING)  # the seed logs what it skips; stdout carries only JSON
    request = json.load(sys.stdin)

    async def fresh_store() -> Any:
        # The watchdog scans on every store call, not once in 10 s: timeouts show when due.
        return InMemoryLightningStore(scan_debounce_seconds=0)

    results = asyncio.run(
        run_sequences(
            request["sequences"], SeedBackend(), fresh_store, tag=lambda name: request["tag"], concurrently=True
        )
    )
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    _main()
