"""The loaded policy and its generation worker: one thread, requests that sample alike batched."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from transformers import PreTrainedModel, PreTrainedTokenizerFast

from agl_stream.logs import get_logger
from agl_stream.policy import Generation, StepToken, generate

log = get_logger("agl.inference")

# -- the loaded policy and the generation worker ---------------------------------------------


@dataclass(frozen=True)
class Policy:
    """Weights and tokenizer of one policy version (immutable: swapping replaces the object)."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerFast
    version: int
    source: str  # "random(seed=N)" or the checkpoint directory

    @property
    def max_model_len(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 1024))

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)


@dataclass(frozen=True)
class Sampling:
    """What must be equal for two jobs to share a batch."""

    max_new_tokens: int
    temperature: float
    top_p: float
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    top_logprobs: int = 0


@dataclass
class Job:
    prompts: list[list[int]]
    seeds: list[int | None]
    sampling: Sampling
    on_step: Callable[[list[StepToken]], None] | None = None  # called on the worker thread
    started: asyncio.Future[Policy] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    done: asyncio.Future[list[Generation]] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Engine:
    """Runs jobs one batch at a time on a single thread, batching the queued jobs that sample alike."""

    def __init__(self, policy: Policy, *, max_batch_rows: int = 64) -> None:
        self.policy = policy
        self.max_batch_rows = max_batch_rows
        self._pending: list[Job] = []
        self._wake = asyncio.Event()
        # One thread: torch already uses the cores for one batch; two batches would only contend.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="agl-generate")
        self.batches = 0

    def submit(self, job: Job) -> Job:
        self._pending.append(job)
        self._wake.set()
        return job

    async def run(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._pending:
                    batch = self._take_batch()
                    await self._run_batch(batch)
        finally:
            for job in self._pending:
                for future in (job.started, job.done):
                    if not future.done():
                        future.set_exception(RuntimeError("the inference server is stopping"))
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _take_batch(self) -> list[Job]:
        """The oldest job plus every queued job with the same sampling, up to max_batch_rows."""
        first = self._pending[0]
        batch, rest, rows = [], [], 0
        for job in self._pending:
            fits = rows + len(job.prompts) <= self.max_batch_rows
            if job is first or (job.sampling == first.sampling and fits):
                batch.append(job)
                rows += len(job.prompts)
            else:
                rest.append(job)
        self._pending = rest
        return batch

    async def _run_batch(self, batch: list[Job]) -> None:
        policy = self.policy  # read once: a swap during the batch applies to the next one
        for job in batch:
            if not job.started.done():
                job.started.set_result(policy)
        owners: list[tuple[Job, int]] = [(job, i) for job in batch for i in range(len(job.prompts))]
        sampling = batch[0].sampling

        def on_step(events: list[StepToken]) -> None:
            by_job: dict[int, tuple[Job, list[StepToken]]] = {}
            for event in events:
                job, local = owners[event.row]
                if job.on_step is not None:
                    entry = by_job.setdefault(id(job), (job, []))
                    entry[1].append(dataclasses.replace(event, row=local))  # rows of the job, not the batch
            for job, job_events in by_job.values():
                assert job.on_step is not None
                job.on_step(job_events)

        def work() -> list[Generation]:
            return generate(
                policy.model,
                policy.tokenizer,
                [p for job in batch for p in job.prompts],
                sampling.max_new_tokens,
                sampling.temperature,
                sampling.top_p,
                [s for job in batch for s in job.seeds],
                stop=sampling.stop,
                stop_token_ids=sampling.stop_token_ids,
                top_logprobs=sampling.top_logprobs,
                on_step=on_step if any(job.on_step for job in batch) else None,
            )

        try:
            results = await asyncio.get_running_loop().run_in_executor(self._executor, work)
        except Exception as error:
            log.exception("generation failed", rows=len(owners))
            for job in batch:
                if not job.done.done():
                    job.done.set_exception(error)
            return
        self.batches += 1
        start = 0
        for job in batch:
            if not job.done.done():
                job.done.set_result(results[start : start + len(job.prompts)])
            start += len(job.prompts)
