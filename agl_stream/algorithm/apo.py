"""``APO``: Automatic Prompt Optimization by textual gradients and beam search (the seed's APO).

The search keeps a beam of prompt templates. In each round every beam prompt (repeated up to
``beam_width`` parents) branches ``branch_factor`` times: it runs a batch of training tasks,
a critique model reads the template with those rollouts' results and says what is wrong with
it (the "textual gradient"), and an edit model rewrites the template by that critique. The
beam and its new children are scored on a batch of validation tasks and the best
``beam_width`` go on; the round's leader is scored on the whole validation set, and the best
of those is the result.

How it maps onto the store (docs/design-notes.md, "APO"):

* each candidate prompt is a resources snapshot of its own (``add_resources``: the initial
  resources with the prompt replaced), so its rollouts pin it and any runner, anywhere, runs
  exactly that prompt (the runners' default ``pinned`` resources);
* a score is SQL on the read side: the rollouts a candidate ran, through
  :func:`agl_stream.algorithm.report.rewards_by_mode` (a rollout without a reward counts 0);
  a candidate already scored on the same validation tasks is not run again;
* the critique reads the training rollouts' spans through the store (``query_spans``);
* at the end the best prompt's snapshot is published again (``update_resources``), so it is
  the latest resources: a runner or server that takes the latest runs it.

The critique and edit models are any OpenAI-compatible endpoints (the ``openai`` client), each
with its own base URL, key and model. The pure parts are :mod:`.apo_core`.

Concurrency model: one ``run`` at a time per instance, on the Trainer run's event loop. The
branches of a round run concurrently (their rollouts, critiques and edits overlap); the scores
and the history are written only from that loop.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
import uuid
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast

import openai

from agl_stream.algorithm.apo_core import (
    Candidate,
    ChatMessage,
    RolloutResult,
    check_parameters,
    check_template,
    critique_messages,
    edit_messages,
    index_batches,
    parents_for_round,
    parse_edit,
    rollout_result,
    score_of,
    select_beam,
)
from agl_stream.algorithm.base import Algorithm
from agl_stream.algorithm.report import ModeReport, rewards_by_mode
from agl_stream.errors import AglError, AlgorithmConfigError, DatasetError
from agl_stream.logs import get_logger
from agl_stream.models import PromptTemplate

log = get_logger("agl.algorithm.apo")

Role = Literal["critique", "edit"]
T = TypeVar("T")


class ModelEndpointError(AglError):
    """The critique or the edit model's endpoint failed (unreachable, refused, no such model)."""

    def __init__(self, role: Role, model: str, base_url: str, error: BaseException) -> None:
        self.role = role
        self.model = model
        self.base_url = base_url
        prefix = "gradient" if role == "critique" else "apply_edit"
        super().__init__(
            f"APO's {role} model {model!r} at {base_url} failed: {type(error).__name__}: {error}. Check that this "
            f"endpoint is up and serves OpenAI chat completions, that it knows the model ({prefix}_model) and that "
            f"the key is right ({prefix}_api_key, else OPENAI_API_KEY); set {prefix}_base_url to use another endpoint"
        )


@dataclass(frozen=True)
class PromptScore:
    """One scoring of a prompt: in round ``round`` (0: the seed before the search), its mean
    reward over ``tasks`` validation tasks (``full``: the whole validation set)."""

    round: int
    resources_id: str
    prompt: str
    score: float
    tasks: int
    full: bool


@dataclass(frozen=True)
class _Endpoint:
    role: Role
    client: Any  # openai.AsyncOpenAI, or what the caller gave in its place
    model: str
    base_url: str
    owned: bool  # made here, so closed here


class APO(Algorithm):
    """Automatic Prompt Optimization: textual gradients and a beam search over prompt templates.

    The initial resources (``Trainer(initial_resources=...)``) hold the seed prompt, a
    :class:`PromptTemplate`, beside whatever else the agent needs (its ``LLM``); every
    candidate runs with those resources and its own prompt. Needs a train dataset (rollouts the
    critique reads) and a validation dataset (the scores).

    Args:
        async_openai_client: the seed's argument: an ``openai.AsyncOpenAI`` for both models
            when no base URL is given for them (None: one is made per model from the
            arguments below, closed at the end of the run).
        gradient_model, apply_edit_model: the critique (textual gradient) and edit models.
        gradient_base_url, gradient_api_key: the critique model's OpenAI-compatible endpoint
            (None: the client's default, ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``).
        apply_edit_base_url, apply_edit_api_key: the edit model's endpoint (None: the critique's).
        diversity_temperature: sampling temperature of both models (more: more varied edits).
        gradient_batch_size: training tasks each branch runs for its critique.
        val_batch_size: validation tasks the candidates of a round are compared on (the whole
            set when it has no more).
        beam_width: prompts kept after each round (and parents per round).
        branch_factor: edits made from each parent per round.
        beam_rounds: rounds of the search.
        rollout_batch_timeout: seconds to wait for one batch's rollouts (None: no limit); an
            unfinished rollout counts reward 0.
        run_initial_validation: score the seed prompt on the whole validation set first.
        prompt_resource: the name of the resource to optimize (None: the first PromptTemplate).
        seed: seeds the order of the tasks in batches (None: a new order every run).
        request_timeout: seconds one critique or edit request may take.

    After ``run``: :attr:`best_prompt` and :attr:`best_score` (the best round leader's score on
    the whole validation set, or the seed's), :attr:`best_resources_id`, :attr:`seed_score`,
    :attr:`history` (every scoring: round, prompt, score) and :attr:`report` (rollouts and mean
    reward per mode).
    """

    def __init__(
        self,
        async_openai_client: Any = None,
        *,
        gradient_model: str = "gpt-5-mini",
        apply_edit_model: str = "gpt-4.1-mini",
        gradient_base_url: str | None = None,
        gradient_api_key: str | None = None,
        apply_edit_base_url: str | None = None,
        apply_edit_api_key: str | None = None,
        diversity_temperature: float = 1.0,
        gradient_batch_size: int = 4,
        val_batch_size: int = 16,
        beam_width: int = 4,
        branch_factor: int = 4,
        beam_rounds: int = 3,
        rollout_batch_timeout: float | None = 3600.0,
        run_initial_validation: bool = True,
        prompt_resource: str | None = None,
        seed: int | None = 0,
        request_timeout: float = 120.0,
    ) -> None:
        check_parameters(
            {
                "gradient_model": gradient_model,
                "apply_edit_model": apply_edit_model,
                "gradient_base_url": gradient_base_url,
                "apply_edit_base_url": apply_edit_base_url,
                "diversity_temperature": diversity_temperature,
                "gradient_batch_size": gradient_batch_size,
                "val_batch_size": val_batch_size,
                "beam_width": beam_width,
                "branch_factor": branch_factor,
                "beam_rounds": beam_rounds,
                "rollout_batch_timeout": rollout_batch_timeout,
                "request_timeout": request_timeout,
            }
        )
        if async_openai_client is not None and not hasattr(async_openai_client, "chat"):
            raise AlgorithmConfigError(
                "APO", {"async_openai_client": f"an openai.AsyncOpenAI, got a {type(async_openai_client).__name__}"}
            )
        self.async_openai_client = async_openai_client
        self.gradient_model = gradient_model
        self.apply_edit_model = apply_edit_model
        self.gradient_base_url = gradient_base_url
        self.gradient_api_key = gradient_api_key
        self.apply_edit_base_url = apply_edit_base_url
        self.apply_edit_api_key = apply_edit_api_key
        self.diversity_temperature = diversity_temperature
        self.gradient_batch_size = gradient_batch_size
        self.val_batch_size = val_batch_size
        self.beam_width = beam_width
        self.branch_factor = branch_factor
        self.beam_rounds = beam_rounds
        self.rollout_batch_timeout = rollout_batch_timeout
        self.run_initial_validation = run_initial_validation
        self.prompt_resource = prompt_resource
        self.seed = seed
        self.request_timeout = request_timeout
        self.best_prompt: PromptTemplate | None = None
        self.best_score: float | None = None
        self.best_resources_id: str | None = None
        self.seed_score: float | None = None
        self.history: list[PromptScore] = []
        self.report: dict[str, ModeReport] = {}

    def get_best_prompt(self) -> PromptTemplate:
        """The best prompt found (the seed's name for it); ValueError before a run."""
        if self.best_prompt is None:
            raise ValueError("APO has no best prompt yet: run it with Trainer.fit")
        return self.best_prompt

    def get_seed_prompt_template(self) -> tuple[str, PromptTemplate]:
        """The name and the template of the prompt to optimize, from the initial resources."""
        resources = self.get_initial_resources()
        if not resources:
            raise AlgorithmConfigError(
                "APO",
                {"initial_resources": "none given: Trainer(initial_resources={'prompt': PromptTemplate(...), ...})"},
            )
        found = {name: _as_prompt(value) for name, value in resources.items()}
        prompts = {name: prompt for name, prompt in found.items() if prompt is not None}
        if self.prompt_resource is not None:
            if self.prompt_resource not in prompts:
                raise AlgorithmConfigError(
                    "APO",
                    {
                        "prompt_resource": f"{self.prompt_resource!r} is no PromptTemplate of the initial resources "
                        f"(they hold {sorted(resources)})"
                    },
                )
            return self.prompt_resource, prompts[self.prompt_resource]
        if not prompts:
            raise AlgorithmConfigError(
                "APO", {"initial_resources": f"no PromptTemplate among them ({sorted(resources)}): APO optimizes one"}
            )
        name = next(iter(prompts))
        return name, prompts[name]

    async def run(self, train_dataset: Sequence[Any] | None = None, val_dataset: Sequence[Any] | None = None) -> None:
        store = self.get_store()
        train, val = list(train_dataset or []), list(val_dataset or [])
        if not train:
            raise DatasetError(
                "APO needs a train_dataset with at least one task: its rollouts are what the critique reads"
            )
        if not val:
            raise DatasetError("APO needs a val_dataset with at least one task: the prompts are scored on it")
        name, seed_prompt = self.get_seed_prompt_template()
        base = dict(self.get_initial_resources() or {})
        self.best_prompt, self.best_score, self.best_resources_id, self.seed_score = None, None, None, None
        self.history, self.report = [], {}
        search = _Search(self, store, train, val, name, base)
        try:
            await search.run(seed_prompt)
        finally:
            await search.close()
        self.report = await rewards_by_mode(store, search.rollout_ids)

    def say(self, message: str) -> None:
        """A line on the Trainer's console (when it shows progress) and in the log."""
        log.info(message)
        trainer = self._trainer_ref() if self._trainer_ref is not None else None
        console = getattr(trainer, "console", None)
        if console is not None and getattr(trainer, "progress", False):
            console.print(message, markup=False, highlight=False)

    # -- endpoints ------------------------------------------------------------------------------

    def endpoints(self) -> dict[Role, _Endpoint]:
        """The critique and edit models' clients (made here unless the caller gave one)."""
        made: dict[tuple[str | None, str | None], Any] = {}
        found: dict[Role, _Endpoint] = {}
        edit_url = self.apply_edit_base_url or self.gradient_base_url
        edit_key = self.apply_edit_api_key or self.gradient_api_key
        for role, model, url, key in (
            ("critique", self.gradient_model, self.gradient_base_url, self.gradient_api_key),
            ("edit", self.apply_edit_model, edit_url, edit_key),
        ):
            role = cast(Role, role)
            if url is None and self.async_openai_client is not None:
                client = self.async_openai_client
                found[role] = _Endpoint(role, client, model, str(getattr(client, "base_url", "?")), owned=False)
                continue
            if (url, key) not in made:  # one client (one connection pool) per endpoint and key
                made[(url, key)] = openai.AsyncOpenAI(
                    base_url=url,
                    api_key=key or os.environ.get("OPENAI_API_KEY") or "none",  # a local server needs none
                    timeout=self.request_timeout,
                    max_retries=2,
                )
            client = made[(url, key)]
            found[role] = _Endpoint(role, client, model, str(client.base_url), owned=True)
        return found


async def _all(calls: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Await every call concurrently; when one raises, the others are cancelled (and awaited)
    before the error goes on, so none of them outlives the run's model clients."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _as_prompt(value: Any) -> PromptTemplate | None:
    if isinstance(value, PromptTemplate):
        return value
    if isinstance(value, Mapping) and value.get("resource_type") == "prompt_template":
        return PromptTemplate.model_validate(dict(value))
    return None


class _Search:
    """The state of one ``APO.run``: the candidates, their scores, the rollouts made."""

    def __init__(
        self, algorithm: APO, store: Any, train: list[Any], val: list[Any], name: str, base: dict[str, Any]
    ) -> None:
        self.algorithm = algorithm
        self.store = store
        self.train = train
        self.val = val
        self.name = name
        self.base = base
        self.tag = f"apo-{uuid.uuid4().hex[:8]}"
        rng = random.Random(algorithm.seed)
        self.train_batches = index_batches(len(train), algorithm.gradient_batch_size, rng)
        self.val_batches = index_batches(len(val), algorithm.val_batch_size, rng)
        self.endpoints = algorithm.endpoints()
        self.rollout_ids: list[str] = []
        self.texts: set[str] = set()  # every template of the search: an edit that repeats one is not new
        # (resources id, validation task indices) -> score: a candidate runs a validation batch once.
        self.scores: dict[tuple[str, tuple[int, ...]], float] = {}

    async def close(self) -> None:
        owned = {id(e.client): e.client for e in self.endpoints.values() if e.owned}
        for client in owned.values():
            await client.close()

    async def run(self, seed_prompt: PromptTemplate) -> None:
        algorithm = self.algorithm
        everything = tuple(range(len(self.val)))
        seed = await self.publish(seed_prompt, round=0, parent=None)
        beam = [seed]
        best, best_score = seed, None
        if algorithm.run_initial_validation:
            best_score = (await self.score([seed], everything, round=0))[seed.resources_id]
            algorithm.seed_score = best_score
            algorithm.say(f"APO seed prompt: score {best_score:.3f} on {len(self.val)} validation tasks")
        for number in range(1, algorithm.beam_rounds + 1):
            began = time.monotonic()
            parents = parents_for_round(beam, algorithm.beam_width)
            branches = [
                (parent, [self.train[i] for i in next(self.train_batches)])
                for parent in parents
                for _ in range(algorithm.branch_factor)
            ]
            made = await _all([self.branch(parent, tasks, number) for parent, tasks in branches])
            children = [child for child in made if child is not None]
            batch = tuple(sorted(next(self.val_batches)))
            pool = [*beam, *children]
            scores = await self.score(pool, batch, round=number)
            if algorithm.seed_score is None and seed.resources_id in scores:
                algorithm.seed_score = scores[seed.resources_id]  # no initial validation: its first score
            beam = select_beam(pool, scores, algorithm.beam_width)
            leader = beam[0]
            leader_score = scores[leader.resources_id]
            if batch != everything:
                leader_score = (await self.score([leader], everything, round=number))[leader.resources_id]
            improved = best_score is None or leader_score > best_score
            if improved:
                best, best_score = leader, leader_score
            algorithm.say(
                f"APO round {number}/{algorithm.beam_rounds}: {len(children)} new prompt(s) from {len(branches)} "
                f"edit(s); leader scores {leader_score:.3f} on {len(self.val)} validation tasks"
                f"{' (new best)' if improved else ''} ({time.monotonic() - began:.0f}s)"
            )
            self.keep_best(best, best_score)
        self.keep_best(best, best_score)
        # The best prompt becomes the latest resources: whatever runs with the latest runs it.
        await self.store.update_resources(best.resources_id, dict(best.resources))
        shown = "not scored" if best_score is None else f"score {best_score:.3f}"
        seed_shown = "not scored" if algorithm.seed_score is None else f"{algorithm.seed_score:.3f}"
        algorithm.say(
            f"APO best prompt (round {best.round}, resources {best.resources_id}): {shown}; seed prompt "
            f"{seed_shown}\n{best.prompt.template}"
        )

    def keep_best(self, best: Candidate, score: float | None) -> None:
        self.algorithm.best_prompt = best.prompt
        self.algorithm.best_score = score
        self.algorithm.best_resources_id = best.resources_id

    async def publish(self, prompt: PromptTemplate, *, round: int, parent: str | None) -> Candidate:
        """The prompt as a resources snapshot of its own: the initial resources, this prompt."""
        resources = {**self.base, self.name: prompt}
        self.texts.add(prompt.template)
        update = await self.store.add_resources(resources)
        log.info("apo candidate published", resources_id=update.resources_id, round=round, parent=parent)
        return Candidate(update.resources_id, prompt, resources, round, parent)

    async def branch(self, parent: Candidate, tasks: list[Any], round: int) -> Candidate | None:
        """One edit of ``parent``: run ``tasks``, critique, edit; the new candidate, or None
        when a model's answer gives none (logged)."""
        ids = await self.enqueue(parent, tasks, mode="train", round=round)
        finished = {r.rollout_id: r.status for r in await self.wait(ids)}
        results = await self.results(ids, tasks, finished)
        context = {"round": round, "parent": parent.resources_id}
        critique = await self.chat("critique", critique_messages(parent.prompt.template, results))
        if not critique or not critique.strip():
            log.warning("apo: the critique model answered nothing; this branch makes no edit", **context)
            return None
        answer = await self.chat("edit", edit_messages(parent.prompt.template, critique, engine=parent.prompt.engine))
        text = parse_edit(answer)
        if text is None:
            log.warning("apo: the edit model's answer holds no template", answer=(answer or "")[:200], **context)
            return None
        problem = check_template(parent.prompt, text)
        if problem is not None:
            log.warning("apo: edited template refused", why=problem, template=text[:200], **context)
            return None
        if text in self.texts:
            log.info("apo: the edit repeats a prompt of the search", **context)
            return None
        return await self.publish(
            PromptTemplate(template=text, engine=parent.prompt.engine), round=round, parent=parent.resources_id
        )

    async def results(self, ids: list[str], tasks: list[Any], finished: Mapping[str, str]) -> list[RolloutResult]:
        """What the critique reads of each rollout, from its latest attempt's spans."""
        # Behind a fence at the end of the spans topic: every span of these finished rollouts
        # is readable after it (the runners flush an attempt's spans before reporting it).
        await rewards_by_mode(self.store, ids)
        results = []
        for rollout_id, task in zip(ids, tasks, strict=True):
            spans = await self.store.query_spans(rollout_id, "latest")
            results.append(rollout_result(task, finished.get(rollout_id, "unfinished"), spans))
        return results

    async def score(self, pool: Sequence[Candidate], batch: tuple[int, ...], *, round: int) -> dict[str, float]:
        """Each candidate's score on the validation tasks ``batch`` (run once per candidate and
        batch), from SQL; every new scoring goes into the history."""
        todo = [c for c in pool if (c.resources_id, batch) not in self.scores]
        tasks = [self.val[i] for i in batch]
        runs = {c.resources_id: await self.enqueue(c, tasks, mode="val", round=round) for c in todo}
        await self.wait([rid for ids in runs.values() for rid in ids])
        fenced = True
        for candidate in todo:
            ids = runs[candidate.resources_id]
            # One fence covers them all: the read side applies offsets in order.
            report = (await rewards_by_mode(self.store, ids, fenced=fenced)).get("val")
            fenced = False
            value = score_of(report, len(ids))
            self.scores[(candidate.resources_id, batch)] = value
            self.algorithm.history.append(
                PromptScore(
                    round=round,
                    resources_id=candidate.resources_id,
                    prompt=candidate.prompt.template,
                    score=value,
                    tasks=len(ids),
                    full=len(batch) == len(self.val),
                )
            )
            log.info("apo score", round=round, resources_id=candidate.resources_id, score=value, tasks=len(ids))
        return {c.resources_id: self.scores[(c.resources_id, batch)] for c in pool}

    async def enqueue(
        self, candidate: Candidate, tasks: list[Any], *, mode: Literal["train", "val"], round: int
    ) -> list[str]:
        purpose = "critique" if mode == "train" else "score"
        metadata = {"apo": {"run": self.tag, "round": round, "purpose": purpose}}
        requests = [
            {"input": task, "mode": mode, "resources_id": candidate.resources_id, "metadata": metadata}
            for task in tasks
        ]
        ids = [r.rollout_id for r in await self.store.enqueue_many_rollouts(requests)]
        self.rollout_ids += ids
        return ids

    async def wait(self, ids: list[str]) -> list[Any]:
        finished: list[Any] = await self.store.wait_for_rollouts(
            rollout_ids=ids, timeout=self.algorithm.rollout_batch_timeout
        )
        if len(finished) < len(ids):
            log.warning(
                "apo: rollouts did not finish in time; they count reward 0",
                unfinished=len(ids) - len(finished),
                timeout=self.algorithm.rollout_batch_timeout,
            )
        return finished

    async def chat(self, role: Role, messages: list[ChatMessage]) -> str | None:
        """The model's answer (None: it gave no text); ModelEndpointError when the call fails."""
        endpoint = self.endpoints[role]
        try:
            response = await endpoint.client.chat.completions.create(
                model=endpoint.model,
                messages=cast(Any, messages),
                temperature=self.algorithm.diversity_temperature,
            )
        except openai.OpenAIError as error:
            raise ModelEndpointError(role, endpoint.model, endpoint.base_url, error) from error
        choices = getattr(response, "choices", None) or []
        content = choices[0].message.content if choices else None
        return content if isinstance(content, str) else None
