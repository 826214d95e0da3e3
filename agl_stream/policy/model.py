"""The tiny policy: a character-level tokenizer, a random-weight Qwen2 model, checkpoints, sampling.

Everything is built from code (nothing is downloaded) and is small enough to train and serve on
a laptop CPU: the default model has ~80k parameters over a 64-token vocabulary.

Log-probabilities: every ``logprob`` this module reports is the log-softmax of the model's *raw*
logits (temperature 1, no top-p truncation), whatever temperature and top-p were used to sample.
That is the quantity a trainer recomputes for the current policy (``log_prob``) and needs for the
behaviour policy (``old_log_prob``); vLLM's default (``logprobs_mode=raw_logprobs``) reports the
same thing.
"""

from __future__ import annotations

import os
import secrets
import shutil
import string
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<|im_end|>"  # ChatML's end of turn doubles as end of sequence
IM_START_TOKEN = "<|im_start|>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, IM_START_TOKEN, UNK_TOKEN)

# Lowercase only (input is lowercased by the normalizer): a small action space is what lets a
# tiny random policy learn anything in minutes. 4 special tokens + 60 characters = 64 ids.
ALPHABET = string.digits + string.ascii_lowercase + " \n" + ".,!?:;'\"-+*/=()[]%#_<>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

DEFAULT_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    # Untied: with tied random embeddings the argmax echoes the last input token forever.
    "tie_word_embeddings": False,
}

FinishReason = Literal["stop", "length"]


def build_tokenizer(alphabet: str = ALPHABET) -> PreTrainedTokenizerFast:
    """A character-level tokenizer with ChatML special tokens and chat template.

    Ids: 0 ``<pad>``, 1 ``<|im_end|>`` (eos), 2 ``<|im_start|>``, 3 ``<unk>``, then one id per
    character of ``alphabet`` in order. Text is lowercased first; characters outside the
    alphabet become ``<unk>``. Role names are spelled in characters, not special tokens, so a
    word like "user" inside a message is ordinary text.
    """
    chars = list(dict.fromkeys(alphabet))
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *chars])}
    core = Tokenizer(WordLevel(vocab, unk_token=UNK_TOKEN))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()  # characters join without separators
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=[IM_START_TOKEN],
        clean_up_tokenization_spaces=False,
        padding_side="left",
        model_max_length=DEFAULT_CONFIG["max_position_embeddings"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(seed: int = 0, *, vocab_size: int | None = None, **overrides: Any) -> PreTrainedModel:
    """A randomly initialised Qwen2ForCausalLM; the same seed gives the same weights.

    ``overrides`` are Qwen2Config fields (hidden_size, num_hidden_layers, ...). ``vocab_size``
    defaults to the size of :func:`build_tokenizer`'s vocabulary.
    """
    options = {**DEFAULT_CONFIG, **overrides}
    config = Qwen2Config(
        vocab_size=vocab_size if vocab_size is not None else len(SPECIAL_TOKENS) + len(dict.fromkeys(ALPHABET)),
        pad_token_id=SPECIAL_TOKENS.index(PAD_TOKEN),
        eos_token_id=SPECIAL_TOKENS.index(EOS_TOKEN),
        bos_token_id=None,
        **options,
    )
    # Seeded inside a forked RNG so building a model never disturbs the caller's random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    return model.eval()


def save_checkpoint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, directory: str | Path) -> None:
    """Write model (safetensors) and tokenizer to ``directory``, all or nothing.

    Everything is written to a sibling temporary folder that is then renamed, so a reader never
    sees a half-written checkpoint. An existing ``directory`` is replaced (moved aside, then
    deleted); publish each policy version to a new directory so readers never race that swap.
    """
    target = Path(directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _fsync_tree(tmp)
        if target.exists():
            old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _fsync_tree(folder: Path) -> None:
    # The rename must not reach the disk before the files it publishes.
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())


def load_checkpoint(directory: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Load what :func:`save_checkpoint` wrote, or any local Hugging Face causal-LM folder
    (``AutoModelForCausalLM`` in float32; the tokenizer from its ``tokenizer.json``, else
    ``AutoTokenizer``; nothing is downloaded).

    The tokenizer must be a fast one (every current chat model ships a ``tokenizer.json``),
    since the inference server decodes token by token with it. A tokenizer without a pad token
    (Llama's, for one) gets eos as its pad token, as VERL and TRL do: padding is always masked,
    so the id only has to exist. Chat requests need the tokenizer's chat template; without one
    only completions work (the inference server says so when it loads the folder).
    """
    path = Path(directory)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no checkpoint in {path} (config.json missing)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    if (path / "tokenizer.json").is_file():
        # The saved pipeline exactly as written: AutoTokenizer would pick the class of the
        # config's model type, which may rebuild the pre-tokenizer and normalizer its own way
        # (it does for the tiny policy's character tokenizer, a Qwen2 model type).
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    else:  # only a slow tokenizer's files: transformers converts it
        tokenizer = AutoTokenizer.from_pretrained(path, use_fast=True, local_files_only=True)
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ValueError(
            f"{path}: the tokenizer {type(tokenizer).__name__} is not a fast tokenizer (no tokenizer.json)"
        )
    if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval(), tokenizer


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The tokens that end a response: the tokenizer's eos and the model's generation config's
    (chat models list their end-of-turn token there, as vLLM reads it)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    config = getattr(model, "generation_config", None)
    configured = getattr(config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif isinstance(configured, (list, tuple)):
        ids.update(int(t) for t in configured)
    return ids


@dataclass(frozen=True)
class Generation:
    """One sampled response.

    ``response_token_ids`` include the token that ended the response (eos, a stop token, or the
    last character of a stop string); ``text`` leaves out special tokens and a matched stop
    string. ``logprobs[i]`` is the raw (temperature 1) log-probability of
    ``response_token_ids[i]``; ``top_logprobs[i]`` holds the ``top_logprobs`` most likely
    (token id, raw log-probability) pairs at that step (empty lists when none were asked for).
    """

    prompt_token_ids: list[int]
    response_token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    text: str
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass(frozen=True)
class StepToken:
    """A token sampled for one row in one step (what ``on_step`` callbacks receive).

    ``text`` is the row's response text so far (special tokens left out, cut before a matched
    stop string).
    """

    row: int
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]
    text: str
    finish_reason: FinishReason | None
    stop_reason: str | int | None


@dataclass
class _Row:
    prompt: list[int]
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None


def _generators(seed: int | Sequence[int | None] | None, rows: int) -> list[torch.Generator]:
    if seed is None or isinstance(seed, int):
        seeds: list[int | None] = [None if seed is None else seed + i for i in range(rows)]
    else:
        seeds = list(seed)
        if len(seeds) != rows:
            raise ValueError(f"{len(seeds)} seeds for {rows} prompts")
    generators = []
    for value in seeds:
        generator = torch.Generator()
        # Rows without a seed draw fresh entropy, so unseeded calls never repeat each other.
        generator.manual_seed(secrets.randbits(63) if value is None else value % (1 << 63))
        generators.append(generator)
    return generators


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero out tokens outside the smallest set whose probability reaches ``top_p`` (renormalised)."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of strictly more likely tokens
    outside = before >= top_p
    # The most likely token always stays, even for a top_p that is 0.0 as a float32 (1e-300).
    outside[..., 0] = False
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)


def _cut_at_stop(text: str, stop: Sequence[str], searched_from: int) -> tuple[str, str | None]:
    """The text cut before the earliest stop string found at or after ``searched_from``."""
    best: tuple[int, str] | None = None
    for s in stop:
        found = text.find(s, max(0, searched_from - len(s) + 1))
        if found >= 0 and (best is None or found < best[0]):
            best = (found, s)
    return (text, None) if best is None else (text[: best[0]], best[1])


@torch.inference_mode()
def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    prompt_token_ids: list[list[int]],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int | Sequence[int | None] | None = None,
    *,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    top_logprobs: int = 0,
    suppress_token_ids: Sequence[int] | None = None,
    on_step: Callable[[list[StepToken]], None] | None = None,
) -> list[Generation]:
    """Sample one response per prompt, batched with left padding.

    ``temperature`` 0 is greedy decoding. ``seed``: an int gives row ``i`` the seed
    ``seed + i``; a sequence gives each row its own seed (``None``: unseeded). With seeds the
    result is deterministic and does not depend on which other prompts share the batch (up to
    float rounding between batch shapes). A response ends at eos, at a ``stop_token_ids``
    token, when its decoded text contains a ``stop`` string (finish_reason "stop"), or after
    ``max_new_tokens`` tokens ("length"). ``on_step`` is called after every step with the
    tokens sampled for the rows still running (from the calling thread).

    ``suppress_token_ids`` are never sampled (default: the pad and unk tokens, which are not
    text: a pad id inside a response would read as padding to a trainer). Reported logprobs
    stay the raw ones over the whole vocabulary.
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    if temperature < 0:
        raise ValueError("temperature must be >= 0")
    if not 0.0 < top_p <= 1.0:
        raise ValueError("top_p must be in (0, 1]")
    if not prompt_token_ids or any(not prompt for prompt in prompt_token_ids):
        raise ValueError("every prompt needs at least one token")
    vocab_size = int(model.config.vocab_size)
    if any(not 0 <= t < vocab_size for prompt in prompt_token_ids for t in prompt):
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")

    rows = [_Row(list(p), g) for p, g in zip(prompt_token_ids, _generators(seed, len(prompt_token_ids)), strict=True)]
    model_eos = eos_token_ids(model, tokenizer)
    eos_ids = model_eos | set(stop_token_ids)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    want_text = bool(stop) or on_step is not None
    if suppress_token_ids is None:
        # A pad token that is also eos (a model without a pad token of its own) must stay sampleable.
        defaults = (tokenizer.pad_token_id, tokenizer.unk_token_id)
        suppress_token_ids = [t for t in defaults if t is not None and t not in model_eos]
    suppressed = torch.tensor(sorted({t for t in suppress_token_ids if 0 <= t < vocab_size}), dtype=torch.long)

    width = max(len(r.prompt) for r in rows)
    input_ids = torch.tensor([[pad_id] * (width - len(r.prompt)) + r.prompt for r in rows], dtype=torch.long)
    attention_mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in rows])
    # Explicit positions: left padding must not shift where each prompt starts.
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    output = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True)

    for _step in range(max_new_tokens):
        logits = output.logits[:, -1, :].float()
        raw = torch.log_softmax(logits, dim=-1)
        chosen = _sample(logits.index_fill(-1, suppressed, float("-inf")), rows, temperature, top_p)
        top = raw.topk(min(top_logprobs, vocab_size), dim=-1) if top_logprobs > 0 else None
        events: list[StepToken] = []
        for i, row in enumerate(rows):
            if row.finish_reason is not None:
                continue
            token = int(chosen[i])
            row.tokens.append(token)
            row.logprobs.append(float(raw[i, token]))
            row.tops.append(
                [(int(t), float(v)) for t, v in zip(top.indices[i], top.values[i], strict=True)] if top else []
            )
            if token in eos_ids:
                row.finish_reason = "stop"
                row.stop_reason = None if token in model_eos else token
            if want_text and row.stop_reason is None:
                before = len(row.text)
                text = str(tokenizer.decode(row.tokens, skip_special_tokens=True))
                row.text, matched = _cut_at_stop(text, stop, before) if stop else (text, None)
                if matched is not None:
                    row.finish_reason, row.stop_reason = "stop", matched
            if row.finish_reason is None and len(row.tokens) >= max_new_tokens:
                row.finish_reason = "length"
            if on_step is not None:
                events.append(
                    StepToken(i, token, row.logprobs[-1], row.tops[-1], row.text, row.finish_reason, row.stop_reason)
                )
        if on_step is not None and events:
            on_step(events)
        if all(row.finish_reason is not None for row in rows):
            break
        # Finished rows keep decoding pad tokens so the batch keeps its shape; their output is ignored.
        next_ids = torch.tensor([[r.tokens[-1] if r.finish_reason is None else pad_id] for r in rows])
        attention_mask = torch.cat([attention_mask, torch.ones(len(rows), 1, dtype=attention_mask.dtype)], dim=-1)
        position_ids = position_ids[:, -1:] + 1
        output = model(
            input_ids=next_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=output.past_key_values,
            use_cache=True,
        )

    results = []
    for row in rows:
        if not want_text:
            # A stop token id ends the response without being part of its text (as in vLLM).
            kept = row.tokens[:-1] if isinstance(row.stop_reason, int) else row.tokens
            row.text = str(tokenizer.decode(kept, skip_special_tokens=True))
        assert row.finish_reason is not None
        results.append(
            Generation(
                prompt_token_ids=row.prompt,
                response_token_ids=row.tokens,
                logprobs=row.logprobs,
                finish_reason=row.finish_reason,
                text=row.text,
                stop_reason=row.stop_reason,
                top_logprobs=row.tops,
            )
        )
    return results


def _sample(logits: torch.Tensor, rows: list[_Row], temperature: float, top_p: float) -> torch.Tensor:
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    scaled = logits / temperature
    if bool((~torch.isfinite(scaled) & torch.isfinite(logits)).any()):
        # A temperature so close to 0 (1e-300) that the logits overflow: its limit is greedy.
        return logits.argmax(dim=-1)
    probs = _nucleus(torch.softmax(scaled, dim=-1), top_p)
    # One generator per row: a row's draws depend on its own seed only, not on its batch mates.
    return torch.stack(
        [
            torch.multinomial(probs[i], 1, generator=row.generator)[0] if row.finish_reason is None else torch.tensor(0)
            for i, row in enumerate(rows)
        ]
    )
