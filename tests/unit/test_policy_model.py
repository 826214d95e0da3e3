"""The tiny policy: tokenizer, model, checkpoints and sampling (CPU, a few seconds in all)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import BatchEncoding, PreTrainedModel, PreTrainedTokenizerFast

from agl_stream.policy import (
    ALPHABET,
    EOS_TOKEN,
    IM_START_TOKEN,
    PAD_TOKEN,
    StepToken,
    build_model,
    build_tokenizer,
    generate,
    load_checkpoint,
    save_checkpoint,
)
from agl_stream.policy.model import _nucleus


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return build_model(seed=0)


def _chat_prompt(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer.encode(rendered, add_special_tokens=False))


# -- tokenizer ---------------------------------------------------------------------------------


def test_tokenizer_is_character_level_and_round_trips(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "what is 2+2? answer: 4.\n(ok) [x] #1 50% a_b <c> 'q' \"d\" -/*=;!,"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)  # one id per character
    assert tokenizer.decode(ids) == text
    assert len(tokenizer) == 4 + len(ALPHABET) == 64
    assert tokenizer.pad_token == PAD_TOKEN and tokenizer.pad_token_id == 0
    assert tokenizer.eos_token == EOS_TOKEN and tokenizer.eos_token_id == 1


def test_tokenizer_lowercases_and_maps_unknown_characters_to_unk(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("Hi\tÉ", add_special_tokens=False)
    assert tokenizer.decode(ids) == "hi<unk><unk>"
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hi"


def test_chat_template_is_chatml_and_role_names_are_plain_text(tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the user says hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nthe user says hi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    specials = [i for i in ids if i in tokenizer.all_special_ids]
    assert specials == [tokenizer.convert_tokens_to_ids(t) for t in [IM_START_TOKEN, EOS_TOKEN] * 2 + [IM_START_TOKEN]]
    assert tokenizer.decode(ids) == text
    # transformers 5 returns a BatchEncoding when tokenizing: the same ids.
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert isinstance(encoded, BatchEncoding)
    assert list(encoded["input_ids"]) == ids


# -- model -------------------------------------------------------------------------------------


def test_build_model_is_deterministic_per_seed_and_leaves_global_rng_alone(tokenizer: PreTrainedTokenizerFast) -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a, b, c = build_model(seed=7), build_model(seed=7), build_model(seed=8)
    assert torch.rand(1) == expected_next
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name
    assert any(not torch.equal(x, z) for x, z in zip(a.state_dict().values(), c.state_dict().values(), strict=True))
    assert a.config.vocab_size == len(tokenizer)
    assert sum(p.numel() for p in a.parameters()) < 200_000  # tiny on purpose
    assert build_model(seed=0, num_hidden_layers=1, hidden_size=32).config.num_hidden_layers == 1


# -- generation --------------------------------------------------------------------------------


def test_generate_shapes_finish_reasons_and_text(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> None:
    prompts = [_chat_prompt(tokenizer, "2+2?"), _chat_prompt(tokenizer, "a much longer question, padded left")]
    results = generate(model, tokenizer, prompts, max_new_tokens=12, temperature=1.0, top_p=1.0, seed=0)
    assert len(results) == 2
    for prompt, gen in zip(prompts, results, strict=True):
        assert gen.prompt_token_ids == prompt
        assert 1 <= len(gen.response_token_ids) <= 12
        assert len(gen.logprobs) == len(gen.response_token_ids)
        assert gen.top_logprobs == [[] for _ in gen.response_token_ids]
        assert gen.text == tokenizer.decode(gen.response_token_ids, skip_special_tokens=True)
        if gen.finish_reason == "stop":
            assert gen.response_token_ids[-1] == tokenizer.eos_token_id
        else:
            assert gen.finish_reason == "length" and len(gen.response_token_ids) == 12
        assert tokenizer.pad_token_id not in gen.response_token_ids  # never sampled
        assert tokenizer.unk_token_id not in gen.response_token_ids


def test_generate_is_deterministic_with_a_seed_whatever_the_batch(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast
) -> None:
    prompt = _chat_prompt(tokenizer, "pick a digit")
    first = generate(model, tokenizer, [prompt] * 4, 16, 1.0, 0.9, seed=42)
    again = generate(model, tokenizer, [prompt] * 4, 16, 1.0, 0.9, seed=42)
    assert [g.response_token_ids for g in first] == [g.response_token_ids for g in again]
    assert len({tuple(g.response_token_ids) for g in first}) > 1  # rows draw differently
    # The same row seeds inside a different batch (another, shorter prompt in front).
    mixed = generate(model, tokenizer, [prompt[:3], *[prompt] * 4], 16, 1.0, 0.9, seed=[7, 42, 43, 44, 45])
    assert [g.response_token_ids for g in mixed[1:]] == [g.response_token_ids for g in first]
    other = generate(model, tokenizer, [prompt] * 4, 16, 1.0, 0.9, seed=1)
    assert [g.response_token_ids for g in other] != [g.response_token_ids for g in first]


def test_greedy_decoding_takes_the_most_likely_token(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast
) -> None:
    prompt = _chat_prompt(tokenizer, "hello")
    [gen] = generate(model, tokenizer, [prompt], 8, temperature=0.0, top_p=1.0, top_logprobs=3)
    for token, logprob, top in zip(gen.response_token_ids, gen.logprobs, gen.top_logprobs, strict=True):
        assert len(top) == 3
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        candidates = [(t, v) for t, v in top if t not in (tokenizer.pad_token_id, tokenizer.unk_token_id)]
        assert (token, logprob) == candidates[0]


def test_logprobs_are_raw_log_probabilities_of_a_recomputed_forward_pass(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast
) -> None:
    prompts = [_chat_prompt(tokenizer, "x"), _chat_prompt(tokenizer, "a longer prompt here")]
    # Temperature and top-p shape sampling only: the reported logprobs are temperature-1 ones.
    results = generate(model, tokenizer, prompts, 10, temperature=0.7, top_p=0.8, seed=3)
    for gen in results:
        assert all(lp <= 0.0 for lp in gen.logprobs)
        ids = torch.tensor([gen.prompt_token_ids + gen.response_token_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float()
        start = len(gen.prompt_token_ids)
        expected = torch.log_softmax(logits[start - 1 : -1], dim=-1)
        recomputed = expected[torch.arange(len(gen.response_token_ids)), torch.tensor(gen.response_token_ids)]
        assert torch.allclose(recomputed, torch.tensor(gen.logprobs), atol=1e-5)
        assert math.isclose(float(expected[0].exp().sum()), 1.0, rel_tol=1e-5)


def test_stop_strings_and_stop_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> None:
    prompt = _chat_prompt(tokenizer, "count")
    [free] = generate(model, tokenizer, [prompt], 24, 0.0, 1.0)
    text = free.text
    assert len(text) >= 4, "greedy output too short for this test"
    stop = text[2:4]
    [cut] = generate(model, tokenizer, [prompt], 24, 0.0, 1.0, stop=[stop, "never-there"])
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.index(stop)]
    # The ids run up to the token that completed the stop string; the text leaves the stop string out.
    assert str(tokenizer.decode(cut.response_token_ids, skip_special_tokens=True)).endswith(stop)
    stop_id = free.response_token_ids[1]
    [by_id] = generate(model, tokenizer, [prompt], 24, 0.0, 1.0, stop_token_ids=[stop_id])
    assert by_id.finish_reason == "stop" and by_id.stop_reason == stop_id
    assert by_id.response_token_ids == free.response_token_ids[: free.response_token_ids.index(stop_id) + 1]
    assert by_id.text == tokenizer.decode(by_id.response_token_ids[:-1], skip_special_tokens=True)


def test_on_step_reports_every_token_in_order(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> None:
    prompts = [_chat_prompt(tokenizer, "a"), _chat_prompt(tokenizer, "bb")]
    steps: list[list[StepToken]] = []
    results = generate(model, tokenizer, prompts, 10, 1.0, 1.0, seed=5, on_step=steps.append)
    for row, gen in enumerate(results):
        events = [e for step in steps for e in step if e.row == row]
        assert [e.token_id for e in events] == gen.response_token_ids
        assert [e.logprob for e in events] == gen.logprobs
        assert events[-1].finish_reason == gen.finish_reason
        assert all(e.finish_reason is None for e in events[:-1])
        assert events[-1].text == gen.text


def test_nucleus_keeps_the_smallest_set_reaching_top_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = _nucleus(probs, 0.7)
    assert torch.allclose(kept, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    assert torch.equal(_nucleus(probs, 1.0), probs)
    assert torch.allclose(_nucleus(probs, 0.1), torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_generate_rejects_bad_arguments(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> None:
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, tokenizer, [[5]], 0)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, tokenizer, [[5]], 1, top_p=0.0)
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, tokenizer, [[]], 1)
    with pytest.raises(ValueError, match="token ids"):
        generate(model, tokenizer, [[64]], 1)


# -- checkpoints -------------------------------------------------------------------------------


def test_checkpoint_round_trip_gives_identical_outputs(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    target = tmp_path / "policy-v1"
    save_checkpoint(model, tokenizer, target)
    assert (target / "model.safetensors").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left
    loaded_model, loaded_tokenizer = load_checkpoint(target)
    assert loaded_tokenizer.encode("abc 123") == tokenizer.encode("abc 123")
    assert loaded_tokenizer.chat_template == tokenizer.chat_template
    prompt = _chat_prompt(loaded_tokenizer, "same?")
    before = generate(model, tokenizer, [prompt] * 2, 12, 1.0, 1.0, seed=9)
    after = generate(loaded_model, loaded_tokenizer, [prompt] * 2, 12, 1.0, 1.0, seed=9)
    assert [(g.response_token_ids, g.logprobs) for g in before] == [(g.response_token_ids, g.logprobs) for g in after]


def test_save_checkpoint_replaces_an_existing_directory(tokenizer: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    target = tmp_path / "latest"
    save_checkpoint(build_model(seed=1), tokenizer, target)
    save_checkpoint(build_model(seed=2), tokenizer, target)
    loaded, _ = load_checkpoint(target)
    expected = build_model(seed=2).state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in loaded.state_dict().items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_load_checkpoint_of_a_missing_directory_fails_clearly(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_checkpoint(tmp_path / "nothing")
