"""Any HF causal LM folder as the policy (a random Llama with a word-level tokenizer and no pad
token, tests/hf_model.py): loading, sampling until its eos, one training step, the saved folder."""

from __future__ import annotations

from pathlib import Path

import torch

from agl_stream.models import Triplet, TripletBatch, TripletRecord
from agl_stream.policy import eos_token_ids, generate, load_checkpoint
from agl_stream.training import TorchPolicyBackend, batch_to_dataproto
from tests.hf_model import CHAT_TEMPLATE, build_hf_model_folder


def test_a_folder_without_a_pad_token_loads_with_eos_as_pad_and_its_chat_template(tmp_path: Path) -> None:
    model, tokenizer = load_checkpoint(build_hf_model_folder(tmp_path / "m"))
    assert model.dtype == torch.float32 and type(model).__name__ == "LlamaForCausalLM"
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 1
    assert tokenizer.chat_template == CHAT_TEMPLATE
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<s> user : hello </s> <s> assistant : "


def test_eos_that_is_also_the_pad_token_still_ends_responses(tmp_path: Path) -> None:
    model, tokenizer = load_checkpoint(build_hf_model_folder(tmp_path / "m"))
    model.generation_config.eos_token_id = [1, 7]  # a chat model's end-of-turn token besides eos
    assert eos_token_ids(model, tokenizer) == {1, 7}
    # Make eos (id 1) by far the likeliest token: it must be sampled, not suppressed as padding.
    push = torch.zeros(model.config.vocab_size)
    push[1] = 100.0
    model.lm_head.register_forward_hook(lambda _module, _inputs, logits: logits + push)
    [result] = generate(model, tokenizer, [[0, 3, 6]], 5, temperature=0.0)
    assert result.response_token_ids == [1] and result.finish_reason == "stop" and result.stop_reason is None


def test_one_training_step_on_an_hf_folder_saves_an_hf_folder(tmp_path: Path) -> None:
    model, tokenizer = load_checkpoint(build_hf_model_folder(tmp_path / "m"))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    records = [
        TripletRecord(
            rollout_id=f"ro-{i:012d}",
            attempt_id=f"at-{i:08d}",
            group_id="g",
            triplets=[Triplet(prompt_token_ids=[0, 3, 6, 8], response_token_ids=[10 + i, 11, 1], reward=float(i % 2))],
            final_reward=float(i % 2),
            policy_version=0,
            finish_time=0.0,
        )
        for i in range(4)
    ]
    data = batch_to_dataproto(
        TripletBatch(batch_id="tb-1", records=records, created_time=0.0), pad_token_id=tokenizer.pad_token_id
    )
    backend = TorchPolicyBackend(model, tokenizer, lr=0.05)
    metrics = backend.step(data)
    assert metrics["updates"] == 1 and backend.policy_version == 1
    backend.save(tmp_path / "v1")
    saved, saved_tokenizer = load_checkpoint(tmp_path / "v1")
    assert saved_tokenizer.chat_template == CHAT_TEMPLATE and saved_tokenizer.pad_token_id == 1
    assert any(not p.detach().equal(before[name]) for name, p in saved.named_parameters())
