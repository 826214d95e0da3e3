"""The torch policy backend on CPU with the tiny policy: VERL's maths moves the weights the right way."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast
from verl import DataProto
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
from verl.utils import torch_functional as verl_F

from agl_stream.models.training import Triplet, TripletBatch, TripletRecord
from agl_stream.policy import Generation, build_model, build_tokenizer, generate
from agl_stream.training import (
    TRAINER_STATE_FILE,
    InvalidBatchError,
    PolicyBackend,
    TorchPolicyBackend,
    batch_to_dataproto,
)


@pytest.fixture(autouse=True, scope="module")
def _few_threads() -> Iterator[None]:
    # Two shared cores: more threads only contend (and the results do not depend on it).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


def _backend(tokenizer: PreTrainedTokenizerFast, **options: object) -> TorchPolicyBackend:
    options.setdefault("lr", 1e-2)
    return TorchPolicyBackend(build_model(seed=0), tokenizer, **options)  # type: ignore[arg-type]


def _data(groups: Sequence[Sequence[tuple[list[int], list[int], float, list[float] | None]]]) -> DataProto:
    """One record per (prompt, response, reward, logprobs), grouped as given."""
    records = [
        TripletRecord(
            rollout_id=f"r{g}-{i}",
            attempt_id="a",
            group_id=f"g{g}",
            triplets=[Triplet(prompt_token_ids=p, response_token_ids=r, response_logprobs=lp)],
            final_reward=reward,
            policy_version=0,
            finish_time=0.0,
        )
        for g, group in enumerate(groups)
        for i, (p, r, reward, lp) in enumerate(group)
    ]
    return batch_to_dataproto(TripletBatch(batch_id="tb", records=records, created_time=0.0), pad_token_id=0)


def _from_generations(gens: list[Generation], rewards: list[float], group_size: int) -> DataProto:
    items = [(g.prompt_token_ids, g.response_token_ids, rw, g.logprobs) for g, rw in zip(gens, rewards, strict=True)]
    return _data([items[i : i + group_size] for i in range(0, len(items), group_size)])


def _sequence_log_probs(backend: TorchPolicyBackend, data: DataProto) -> torch.Tensor:
    return backend.log_probs(data).sum(dim=1)


def _weights(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_it_is_a_policy_backend(tokenizer: PreTrainedTokenizerFast) -> None:
    assert isinstance(_backend(tokenizer), PolicyBackend)


def test_recomputed_log_probs_match_the_sampler(tokenizer: PreTrainedTokenizerFast) -> None:
    """The trainer's forward pass sees exactly what generate() saw (padding, positions, alignment)."""
    backend = _backend(tokenizer, micro_batch_size=3)
    prompts = [tokenizer.encode("say a"), tokenizer.encode("a much longer prompt, say b")]
    gens = generate(backend.model, tokenizer, prompts * 4, max_new_tokens=6, seed=1)
    data = _from_generations(gens, [1.0, 0.0] * 4, group_size=2)
    assert torch.allclose(backend.log_probs(data), data.batch["old_log_probs"], atol=1e-5)
    metrics = backend.step(data)
    # Old log-probs from the sampler = the current policy: ratio 1, nothing clipped on the first pass.
    assert abs(metrics["ppo_kl"]) < 1e-5 and metrics["pg_clipfrac"] == 0.0
    # With the engine's log-probs the trainer recomputes its own (off-policy correction, truncate by
    # default); here both are the same policy's: importance ratios of 1, none truncated.
    assert metrics["recomputed_old_log_probs"] == 1.0
    assert metrics["is_ratio_mean"] == pytest.approx(1.0, abs=1e-4) and metrics["is_truncated_share"] == 0.0
    assert metrics["staleness_0"] == 8.0 and metrics["staleness_max"] == 0.0
    # Without correction the sampler's log-probs are the old ones, as asked.
    assert _backend(tokenizer, off_policy_correction="none").step(data)["recomputed_old_log_probs"] == 0.0


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_one_step_moves_log_probs_with_the_advantage(tokenizer: PreTrainedTokenizerFast, algorithm: str) -> None:
    backend = _backend(tokenizer, algorithm=algorithm, lr=3e-3)
    prompt = tokenizer.encode("say a")
    good, bad = tokenizer.encode("a"), tokenizer.encode("z")
    data = _data([[(prompt, good, 1.0, None), (prompt, bad, 0.0, None)]])
    before = _sequence_log_probs(backend, data)
    metrics = backend.step(data)
    after = _sequence_log_probs(backend, data)
    assert after[0] > before[0], "the rewarded response became more likely"
    assert after[1] < before[1], "the unrewarded one in the same group less likely"
    assert metrics["recomputed_old_log_probs"] == 1.0
    assert metrics["updates"] == 1.0 and metrics["policy_version"] == 1.0 == backend.policy_version
    assert metrics["reward_mean"] == 0.5
    assert metrics["tokens"] == 2 * len(prompt) + 2 and metrics["response_tokens"] == 2
    assert metrics["advantage_mean"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["seconds"] > 0 and metrics["tokens_per_s"] > 0


def test_grpo_advantages_are_verls(tokenizer: PreTrainedTokenizerFast) -> None:
    prompt = tokenizer.encode("hi")
    data = _data(
        [
            [(prompt, [5], 1.0, None), (prompt, [6, 7], 0.0, None), (prompt, [8], 0.0, None)],
            [(prompt, [9], 0.25, None), (prompt, [10], 0.75, None)],
        ]
    )
    expected, _ = compute_grpo_outcome_advantage(
        data.batch["token_level_rewards"], data.batch["response_mask"], data.non_tensor_batch["uid"]
    )
    metrics = _backend(tokenizer).step(data)
    in_loss = data.batch["response_mask"].bool()
    assert metrics["advantage_abs_mean"] == pytest.approx(float(expected[in_loss].abs().mean()), rel=1e-6)


def test_micro_batches_add_up_to_the_whole_batch(tokenizer: PreTrainedTokenizerFast) -> None:
    prompts = [tokenizer.encode("say a"), tokenizer.encode("hello, say b")]
    gens = generate(build_model(seed=0), tokenizer, prompts * 3, max_new_tokens=5, seed=7)
    data = _from_generations(gens, [1.0, 0.0, 0.5, 0.0, 1.0, 0.2], group_size=3)
    whole, pieces = _backend(tokenizer, micro_batch_size=6), _backend(tokenizer, micro_batch_size=1)
    grads: dict[str, list[torch.Tensor]] = {}
    for name, backend in (("whole", whole), ("pieces", pieces)):
        # Compared before AdamW, which turns float noise in near-zero gradients into full-size steps.
        def keep_grads(opt: torch.optim.Optimizer, args: Any, kwargs: Any, name: str = name) -> None:
            grads[name] = [p.grad.clone() for g in opt.param_groups for p in g["params"] if p.grad is not None]

        backend.optimizer.register_step_pre_hook(keep_grads)
    m_whole, m_pieces = whole.step(data), pieces.step(data)
    assert m_whole["loss"] == pytest.approx(m_pieces["loss"], abs=1e-6)
    assert m_whole["grad_norm"] == pytest.approx(m_pieces["grad_norm"], rel=1e-5)
    assert len(grads["whole"]) == len(grads["pieces"]) > 0
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(grads["whole"], grads["pieces"], strict=True))


def test_training_is_deterministic_and_mini_batches_make_several_updates(tokenizer: PreTrainedTokenizerFast) -> None:
    prompt = tokenizer.encode("say a")
    data = _data([[(prompt, [5 + i], float(i % 2), None) for i in range(4)]])
    one, two = (_backend(tokenizer, mini_batch_size=2, ppo_epochs=2, shuffle=True, seed=3) for _ in range(2))
    m1, m2 = one.step(data), two.step(data)
    assert m1["updates"] == 4.0 == m2["updates"]
    assert m1["loss"] == m2["loss"]
    a, b = _weights(one.model), _weights(two.model)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_batch_with_nothing_in_the_loss_changes_nothing(tokenizer: PreTrainedTokenizerFast) -> None:
    prompt = tokenizer.encode("say a")
    data = _data([[(prompt, [5], 1.0, None), (prompt, [6], 0.0, None)]])
    data.batch["response_mask"].zero_()
    backend = _backend(tokenizer)
    before = _weights(backend.model)
    metrics = backend.step(data)
    assert metrics["updates"] == 0.0 and backend.policy_version == 0
    after = _weights(backend.model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def _multi_turn(tool_logprob: float = 0.0) -> DataProto:
    """A group of two: a trajectory sample (tool tokens 30 31 inserted between two calls, mask
    [1, 1, 0, 0, 1]) rewarded 1, and a two-token answer rewarded 0."""
    prompt = [32, 14, 38, 40, 14]
    triplets = [
        Triplet(
            prompt_token_ids=prompt,
            response_token_ids=[7, 8, 30, 31, 9],
            response_logprobs=[-2.0, -2.5, tool_logprob, tool_logprob, -3.0],
            response_mask=[1, 1, 0, 0, 1],
        ),
        Triplet(prompt_token_ids=prompt, response_token_ids=[12, 13], response_logprobs=[-2.2, -2.8]),
    ]
    records = [
        TripletRecord(
            rollout_id=f"r{i}", attempt_id="a", group_id="g", triplets=[t], final_reward=1.0 - i, finish_time=0.0
        )
        for i, t in enumerate(triplets)
    ]
    return batch_to_dataproto(TripletBatch(batch_id="tb", records=records, created_time=0.0), pad_token_id=0)


def test_inserted_tokens_are_out_of_the_loss_entropy_and_token_count(tokenizer: PreTrainedTokenizerFast) -> None:
    data = _multi_turn()
    # The made-up sampler log-probs are not the policy's: no importance weights, to see the plain loss.
    backend = _backend(tokenizer, recompute_old_log_probs=True, off_policy_correction="none")
    b = data.batch
    with torch.no_grad():
        logits = backend.model(
            input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
        ).logits
    mask = b["response_mask"].float()
    entropy = verl_F.entropy_from_logits(logits[:, -6:-1].float())
    metrics = backend.step(data)
    # Ratio 1 (old log-probs recomputed): token-mean PPO loss = -sum(advantage over loss tokens) / their
    # count. GRPO gives +-1/sqrt(2): -(3 - 2) / sqrt(2) / 5; with the tool tokens in, -(5 - 2) / sqrt(2) / 7.
    assert metrics["pg_loss"] == pytest.approx(-1 / 2**0.5 / 5, rel=1e-4)
    assert metrics["response_tokens"] == 5.0
    assert metrics["entropy"] == pytest.approx(float((entropy * mask).sum() / mask.sum()), rel=1e-4)
    assert metrics["advantage_abs_mean"] == pytest.approx(1 / 2**0.5, rel=1e-4)


def test_old_log_probs_of_inserted_tokens_change_nothing(tokenizer: PreTrainedTokenizerFast) -> None:
    """The sampler's logprobs are 0.0 on inserted tokens (never sampled); any value there is ignored."""
    for correction in ("none", "truncate"):
        runs = []
        for tool_logprob in (0.0, -4.0):
            backend = _backend(tokenizer, entropy_coeff=0.01, off_policy_correction=correction)
            runs.append((backend.step(_multi_turn(tool_logprob)), _weights(backend.model)))
        (m1, w1), (m2, w2) = runs
        for key in ("loss", "pg_loss", "ppo_kl", "pg_clipfrac", "entropy", "grad_norm"):
            assert m1[key] == m2[key], key
        if correction == "none":
            assert m1["ppo_kl"] != 0.0  # the given old log-probs are not the policy's: the KL term is live
        else:  # the importance ratios of the loss tokens only
            assert m1["is_ratio_mean"] == m2["is_ratio_mean"] != 1.0
        assert all(torch.equal(w1[k], w2[k]) for k in w1)


def _sampled(tokenizer: PreTrainedTokenizerFast) -> DataProto:
    """Four responses of different lengths in two groups, with the tiny policy's (seed 0) log-probs as
    the engine's (``rollout_log_probs``)."""
    a, b = tokenizer.encode("say a"), tokenizer.encode("hello, say b")
    data = _data([[(a, [5], 1.0, None), (a, [6, 7, 8], 0.0, None)], [(b, [9, 10], 0.0, None), (b, [11], 1.0, None)]])
    data.batch["rollout_log_probs"] = _backend(tokenizer).log_probs(data)
    return data


@pytest.mark.parametrize(("shift", "weight"), [(0.5, 0.5), (1.0, 0.0)])
def test_importance_weights_reach_the_loss(tokenizer: PreTrainedTokenizerFast, shift: float, weight: float) -> None:
    """The engine's log-probs ``shift`` below the trainer's: ratio exp(shift) on every token. On the
    first pass PPO's own ratio is 1, so the policy loss is the uncorrected one times the weight:
    exp(0.5) under the cap of 2; exp(1) truncated to 2, or masked to 0."""
    data = _sampled(tokenizer)
    data.batch["rollout_log_probs"] = data.batch["rollout_log_probs"] - shift * data.batch["response_mask"]
    plain = _backend(tokenizer, off_policy_correction="none", recompute_old_log_probs=True).step(data)
    truncated = _backend(tokenizer).step(data)
    masked = _backend(tokenizer, off_policy_correction="mask").step(data)
    assert plain["recomputed_old_log_probs"] == truncated["recomputed_old_log_probs"] == 1.0
    assert plain["pg_loss"] != 0.0 and plain["is_ratio_mean"] == pytest.approx(math.exp(shift), rel=1e-4)
    assert truncated["pg_loss"] == pytest.approx(plain["pg_loss"] * min(math.exp(shift), 2.0), rel=1e-4)
    assert truncated["is_ratio_max"] == pytest.approx(math.exp(shift), rel=1e-4)
    assert truncated["is_truncated_share"] == (1.0 if shift == 1.0 else 0.0)
    expected_masked = plain["pg_loss"] * (math.exp(shift) if weight else 0.0)
    assert masked["pg_loss"] == pytest.approx(expected_masked, rel=1e-4, abs=1e-9)
    assert masked["is_masked_share"] == truncated["is_truncated_share"]


def test_rollout_mean_in_a_step(tokenizer: PreTrainedTokenizerFast) -> None:
    """With one sample per rollout, rollout-mean is seq-mean-token-mean; with a rollout's sample given
    twice (as two samples of it), its loss and gradient stay the same."""
    data = _sampled(tokenizer)
    by_rollout = _backend(tokenizer, loss_agg_mode="rollout-mean", entropy_coeff=0.01).step(data)
    by_sequence = _backend(tokenizer, loss_agg_mode="seq-mean-token-mean", entropy_coeff=0.01).step(data)
    for key in ("loss", "pg_loss", "grad_norm"):
        assert by_rollout[key] == pytest.approx(by_sequence[key], rel=1e-5, abs=1e-6), key
    twice = DataProto.concat([data, data[:1]])
    twice.non_tensor_batch["triplet_index"][-1] = 1  # the same rollout's second sample
    again = _backend(tokenizer, loss_agg_mode="rollout-mean", entropy_coeff=0.01).step(twice)
    assert again["rollouts"] == by_rollout["rollouts"] == 4.0 and again["rows"] == 5.0
    for key in ("loss", "pg_loss", "grad_norm"):
        assert again[key] == pytest.approx(by_rollout[key], rel=1e-5, abs=1e-6), key


def test_a_malformed_dataproto_is_an_invalid_batch(tokenizer: PreTrainedTokenizerFast) -> None:
    prompt = tokenizer.encode("say a")
    data = _data([[(prompt, [5], 1.0, None)]])
    backend = _backend(tokenizer)
    with pytest.raises(InvalidBatchError, match="lacks token_level_rewards"):
        backend.step(
            data.select(batch_keys=["input_ids", "attention_mask", "position_ids", "responses", "response_mask"])
        )
    no_groups = DataProto(batch=data.batch, non_tensor_batch={}, meta_info={})
    with pytest.raises(InvalidBatchError, match="uid"):
        backend.step(no_groups)


def test_unsupported_options_are_refused(tokenizer: PreTrainedTokenizerFast) -> None:
    with pytest.raises(ValueError, match="without a critic"):
        _backend(tokenizer, adv_estimator="gae")
    with pytest.raises(ValueError, match="algorithm"):
        _backend(tokenizer, algorithm="dpo")
    with pytest.raises(ValueError, match="lr"):
        _backend(tokenizer, lr=0.0)
    with pytest.raises(ValueError, match="off_policy_correction"):
        _backend(tokenizer, off_policy_correction="clip")
    with pytest.raises(ValueError, match="loss_agg_mode"):
        _backend(tokenizer, loss_agg_mode="episode-mean")


def test_a_few_steps_learn_a_trivial_task(tokenizer: PreTrainedTokenizerFast) -> None:
    """Reward 1 for responses that start with "a": sampled reward goes from ~1/60 to most samples."""
    backend = _backend(tokenizer, lr=1e-2, micro_batch_size=64)
    target = tokenizer.convert_tokens_to_ids("a")
    prompts = [tokenizer.encode(f"say a {i}") for i in range(8)]
    group_size = 8

    def sample(seed: int) -> tuple[list[Generation], list[float]]:
        gens = generate(backend.model, tokenizer, [p for p in prompts for _ in range(group_size)], 2, seed=seed)
        return gens, [float(g.response_token_ids[0] == target) for g in gens]

    _, rewards = sample(seed=10_000)
    before = sum(rewards) / len(rewards)
    for step in range(12):
        gens, rewards = sample(seed=step * 1000)
        backend.step(_from_generations(gens, rewards, group_size))
    _, rewards = sample(seed=10_000)
    after = sum(rewards) / len(rewards)
    assert before < 0.1
    assert after > 0.5, f"mean reward {before} -> {after}"
    assert backend.policy_version == 12


def test_save_and_load_round_trip(tokenizer: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    prompt = tokenizer.encode("say a")
    data = _data([[(prompt, [5], 1.0, None), (prompt, [6, 7], 0.0, None)]])
    backend = _backend(tokenizer, lr=5e-3, micro_batch_size=1)
    backend.step(data)
    backend.save(tmp_path / "v1", extra_state={"batch_id": "tb", "offsets": {"0": 41}})
    assert (tmp_path / "v1" / TRAINER_STATE_FILE).is_file() and (tmp_path / "v1" / "config.json").is_file()

    loaded = TorchPolicyBackend.load(tmp_path / "v1")
    assert loaded.policy_version == 1 and loaded.options == backend.options
    assert loaded.extra_state == {"batch_id": "tb", "offsets": {"0": 41}}
    prompts = [prompt, tokenizer.encode("hello")]
    assert generate(backend.model, tokenizer, prompts, 8, seed=5) == generate(
        loaded.model, tokenizer, prompts, 8, seed=5
    )
    # The optimizer state came along: the next step is the same step.
    m1, m2 = backend.step(data), loaded.step(data)
    assert m1["loss"] == m2["loss"] and loaded.policy_version == 2
    a, b = _weights(backend.model), _weights(loaded.model)
    assert all(torch.equal(a[k], b[k]) for k in a)

    assert TorchPolicyBackend.load(tmp_path / "v1", lr=1e-4).options.lr == 1e-4
    backend.save(tmp_path / "policy-only", optimizer=False)
    with pytest.raises(FileNotFoundError, match=TRAINER_STATE_FILE):
        TorchPolicyBackend.load(tmp_path / "policy-only")
