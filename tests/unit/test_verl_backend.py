"""The verl backend (VERL's FSDP engine) on the CPU with the tiny policy: it trains like the torch backend.

The engine runs for real (FSDP2 over a one-process gloo group, VERL's CPU platform shim); nothing
is mocked. Each backend builds in well under a second once VERL is imported.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedTokenizerFast
from verl import DataProto

from agl_stream.models.training import Triplet, TripletBatch, TripletRecord
from agl_stream.policy import build_model, build_tokenizer, generate, load_checkpoint, save_checkpoint
from agl_stream.ports import free_port
from agl_stream.training import (
    TRAINER_STATE_FILE,
    InvalidBatchError,
    PolicyBackend,
    TorchPolicyBackend,
    batch_to_dataproto,
    open_backend,
)
from agl_stream.training.verl_backend import (
    ENGINE_DIR,
    VERL_STATE_FILE,
    VerlFSDPBackend,
    _mini_batches,
)

# VERL's engine package says which optional engines (Megatron, VeOmni, ...) it could not import.
pytestmark = pytest.mark.filterwarnings("ignore:.* engine is not available:UserWarning")


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


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: PreTrainedTokenizerFast) -> Path:
    """The tiny random policy (seed 0) as an HF folder: what the verl engine starts from."""
    folder = tmp_path_factory.mktemp("policy") / "v0"
    save_checkpoint(build_model(seed=0), tokenizer, folder)
    return folder


def _verl(policy_dir: Path, **options: Any) -> VerlFSDPBackend:
    options.setdefault("lr", 3e-3)
    return VerlFSDPBackend(policy_dir, device="cpu", **options)


def _torch(tokenizer: PreTrainedTokenizerFast, **options: object) -> TorchPolicyBackend:
    options.setdefault("lr", 3e-3)
    return TorchPolicyBackend(build_model(seed=0), tokenizer, **options)  # type: ignore[arg-type]


def _data(rows: list[tuple[list[int], list[int], float, str]]) -> DataProto:
    """One record per (prompt, response, reward, group)."""
    records = [
        TripletRecord(
            rollout_id=f"r{i}",
            attempt_id="a",
            group_id=group,
            triplets=[Triplet(prompt_token_ids=prompt, response_token_ids=response)],
            final_reward=reward,
            policy_version=0,
            finish_time=0.0,
        )
        for i, (prompt, response, reward, group) in enumerate(rows)
    ]
    return batch_to_dataproto(TripletBatch(batch_id="tb", records=records, created_time=0.0), pad_token_id=0)


def _good_and_bad(tokenizer: PreTrainedTokenizerFast) -> DataProto:
    """Two groups, prompts and responses of different lengths (padding on both sides is exercised)."""
    short, long = tokenizer.encode("say a"), tokenizer.encode("hello there, say a")
    return _data(
        [
            (short, tokenizer.encode("a"), 1.0, "g0"),
            (short, tokenizer.encode("zz"), 0.0, "g0"),
            (long, tokenizer.encode("a!"), 1.0, "g1"),
            (long, tokenizer.encode("qqq"), 0.0, "g1"),
        ]
    )


def test_it_is_a_policy_backend_with_the_torch_backends_log_probs(
    policy_dir: Path, tokenizer: PreTrainedTokenizerFast
) -> None:
    backend = _verl(policy_dir)
    assert isinstance(backend, PolicyBackend)
    assert backend.policy_version == 0 and backend.world_size == 1
    # What the trainer reads off a backend.
    assert backend.tokenizer.pad_token_id == tokenizer.pad_token_id
    assert backend.model.config.vocab_size == len(tokenizer)
    data = _good_and_bad(tokenizer)
    log_probs = backend.log_probs(data)
    assert log_probs.shape == data.batch["responses"].shape
    assert torch.allclose(log_probs, _torch(tokenizer).log_probs(data), atol=1e-5)
    assert bool((log_probs[data.batch["response_mask"] == 0] == 0).all()), "0 at padding"


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_one_step_moves_log_probs_with_the_advantage(
    policy_dir: Path, tokenizer: PreTrainedTokenizerFast, algorithm: str
) -> None:
    backend = _verl(policy_dir, algorithm=algorithm)
    data = _good_and_bad(tokenizer)
    before = backend.log_probs(data).sum(dim=1)
    metrics = backend.step(data)
    after = backend.log_probs(data).sum(dim=1)
    rewarded = data.batch["token_level_rewards"].sum(dim=1) > 0
    assert bool((after[rewarded] > before[rewarded]).all()), "rewarded responses became more likely"
    assert bool((after[~rewarded] < before[~rewarded]).all()), "unrewarded ones less likely"
    assert all(math.isfinite(value) for value in metrics.values()), metrics
    assert metrics["updates"] == 1.0 and metrics["skipped_updates"] == 0.0
    assert metrics["policy_version"] == 1.0 == backend.policy_version
    assert metrics["recomputed_old_log_probs"] == 1.0
    # Old log-probs from the engine's own forward pass: the first update starts at ratio 1.
    assert abs(metrics["ppo_kl"]) < 1e-6 and metrics["pg_clipfrac"] == 0.0
    assert metrics["grad_norm"] > 0 and metrics["entropy"] > 0
    assert metrics["rows"] == 4 and metrics["reward_mean"] == 0.5
    assert metrics["tokens"] == float(data.batch["attention_mask"].sum())
    assert metrics["lr"] == 3e-3 and metrics["tokens_per_s"] > 0


def test_a_step_is_the_torch_backends_step(policy_dir: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    """Same weights, batch and AdamW: VERL's engine and the torch backend land on the same policy."""
    data = _good_and_bad(tokenizer)
    verl, reference = _verl(policy_dir), _torch(tokenizer, recompute_old_log_probs=True)
    m_verl, m_torch = verl.step(data), reference.step(data)
    assert m_verl["loss"] == pytest.approx(m_torch["loss"], abs=1e-6)
    assert m_verl["grad_norm"] == pytest.approx(m_torch["grad_norm"], rel=1e-5)
    assert m_verl["advantage_abs_mean"] == pytest.approx(m_torch["advantage_abs_mean"], rel=1e-6)
    assert torch.allclose(verl.log_probs(data), reference.log_probs(data), atol=1e-4)


def test_the_engine_keeps_inserted_tokens_out_of_the_loss(policy_dir: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    """A trajectory sample (tool tokens 30 31 inserted, mask [1, 1, 0, 0, 1]) beside a plain answer: the
    engine's loss mask and token count are the batch's response_mask, as in the torch backend."""
    prompt = tokenizer.encode("say a")
    merged = Triplet(prompt_token_ids=prompt, response_token_ids=[7, 8, 30, 31, 9], response_mask=[1, 1, 0, 0, 1])
    records = [
        TripletRecord(
            rollout_id=f"r{i}", attempt_id="a", group_id="g", triplets=[t], final_reward=1.0 - i, finish_time=0.0
        )
        for i, t in enumerate([merged, Triplet(prompt_token_ids=prompt, response_token_ids=[12, 13])])
    ]
    data = batch_to_dataproto(TripletBatch(batch_id="tb", records=records, created_time=0.0), pad_token_id=0)
    verl, reference = _verl(policy_dir), _torch(tokenizer, recompute_old_log_probs=True)
    m_verl, m_torch = verl.step(data), reference.step(data)
    # Ratio 1: token-mean loss = -(3 - 2) / sqrt(2) / 5 over the 5 loss tokens (GRPO's +-1/sqrt(2)).
    assert m_verl["loss"] == pytest.approx(-1 / 2**0.5 / 5, rel=1e-4)
    assert m_verl["loss"] == pytest.approx(m_torch["loss"], abs=1e-6)
    assert m_verl["grad_norm"] == pytest.approx(m_torch["grad_norm"], rel=1e-5)
    assert m_verl["entropy"] == pytest.approx(m_torch["entropy"], rel=1e-5)
    assert m_verl["response_tokens"] == 5.0
    assert torch.allclose(verl.log_probs(data), reference.log_probs(data), atol=1e-4)


@pytest.mark.parametrize("correction", ["truncate", "mask"])
def test_importance_weights_and_rollout_mean_are_the_torch_backends(
    policy_dir: Path, tokenizer: PreTrainedTokenizerFast, correction: str
) -> None:
    """The engine's log-probs off the trainer's (ratios exp(+-0.8): some over a cap of 1.5) and one
    rollout of two samples: VERL's engine, given the weights as rollout_is_weights, lands where the
    torch backend does, with rollout-mean riding on token-sum."""
    data = _good_and_bad(tokenizer)
    data.non_tensor_batch["rollout_id"][1] = data.non_tensor_batch["rollout_id"][0]  # r0 has two samples
    shift = torch.tensor([[0.8], [-0.8], [0.3], [-0.3]]) * data.batch["response_mask"]
    data.batch["rollout_log_probs"] = _torch(tokenizer).log_probs(data) - shift
    options: dict[str, Any] = {
        "off_policy_correction": correction,
        "rollout_is_threshold": 1.5,
        "loss_agg_mode": "rollout-mean",
    }
    verl, reference = _verl(policy_dir, **options), _torch(tokenizer, **options)
    m_verl, m_torch = verl.step(data), reference.step(data)
    share = "is_truncated_share" if correction == "truncate" else "is_masked_share"
    assert m_verl[share] == m_torch[share] > 0 and m_verl["is_ratio_max"] == pytest.approx(math.exp(0.8), rel=1e-4)
    assert m_verl["rollouts"] == 3.0 and m_verl["staleness_0"] == 4.0
    for key in ("loss", "pg_loss"):
        assert m_verl[key] == pytest.approx(m_torch[key], abs=1e-6), key
    assert m_verl["grad_norm"] == pytest.approx(m_torch["grad_norm"], rel=1e-5)
    assert m_verl["entropy"] == pytest.approx(m_torch["entropy"], rel=1e-5)
    assert torch.allclose(verl.log_probs(data), reference.log_probs(data), atol=1e-4)
    with pytest.raises(ValueError, match="rollout-mean"):
        _verl(policy_dir, loss_agg_mode="rollout-mean", entropy_coeff=0.01)


def test_save_and_load_round_trip(policy_dir: Path, tokenizer: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    data = _good_and_bad(tokenizer)
    backend = _verl(policy_dir, lr=5e-3, mini_batch_size=2)
    backend.step(data)
    backend.save(tmp_path / "v1", extra_state={"batch_id": "tb", "offsets": {"0": 41}})
    assert (tmp_path / "v1" / VERL_STATE_FILE).is_file() and (tmp_path / "v1" / ENGINE_DIR).is_dir()
    assert not (tmp_path / "v1" / TRAINER_STATE_FILE).exists()

    # The folder is a plain HF checkpoint for the inference side (and the torch backend).
    model, _ = load_checkpoint(tmp_path / "v1")
    prompts = [tokenizer.encode("say a"), tokenizer.encode("hello")]
    exported = TorchPolicyBackend(model, tokenizer, lr=1e-3)
    assert torch.allclose(exported.log_probs(data), backend.log_probs(data), atol=1e-5)
    assert generate(model, tokenizer, prompts, 4, seed=5)[0].logprobs

    loaded = VerlFSDPBackend.load(tmp_path / "v1", device="cpu")
    assert loaded.policy_version == 1 and loaded.options == backend.options
    assert loaded.extra_state == {"batch_id": "tb", "offsets": {"0": 41}}
    assert torch.equal(loaded.log_probs(data), backend.log_probs(data))
    # VERL's engine checkpoint brought the optimizer state: the next step is the same step.
    m1, m2 = backend.step(data), loaded.step(data)
    assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-7) and loaded.policy_version == 2 == backend.policy_version
    assert torch.allclose(loaded.log_probs(data), backend.log_probs(data), atol=1e-6)

    assert VerlFSDPBackend.load(tmp_path / "v1", device="cpu", lr=1e-4).options.lr == 1e-4
    backend.save(tmp_path / "policy-only", optimizer=False)
    assert (tmp_path / "policy-only" / "config.json").is_file()
    with pytest.raises(FileNotFoundError, match=VERL_STATE_FILE):
        VerlFSDPBackend.load(tmp_path / "policy-only", device="cpu")


def test_mini_batches_and_epochs_make_several_updates(policy_dir: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    data = _good_and_bad(tokenizer)
    metrics = _verl(policy_dir, mini_batch_size=2, ppo_epochs=2, shuffle=True).step(data)
    assert metrics["updates"] == 4.0 and metrics["policy_version"] == 1.0
    # After the first update the policy has moved from the one that produced the old log-probs.
    assert metrics["ppo_kl"] != 0.0


def test_rollout_log_probs_are_used_when_asked(policy_dir: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    # off_policy_correction "none": the batch's old log-probs are used as they are (no recomputation).
    backend = _verl(policy_dir, recompute_old_log_probs=False, off_policy_correction="none")
    gens = generate(build_model(seed=0), tokenizer, [tokenizer.encode("say a")] * 2, max_new_tokens=3, seed=1)
    records = [
        TripletRecord(
            rollout_id=f"r{i}",
            attempt_id="a",
            group_id="g",
            triplets=[
                Triplet(
                    prompt_token_ids=g.prompt_token_ids,
                    response_token_ids=g.response_token_ids,
                    response_logprobs=g.logprobs,
                )
            ],
            final_reward=float(i),
            policy_version=0,
            finish_time=0.0,
        )
        for i, g in enumerate(gens)
    ]
    data = batch_to_dataproto(TripletBatch(batch_id="tb", records=records, created_time=0.0), pad_token_id=0)
    # The sampler saw exactly what the engine sees: the behaviour policy is the current one.
    assert torch.allclose(backend.log_probs(data), data.batch["old_log_probs"], atol=1e-5)
    metrics = backend.step(data)
    assert metrics["recomputed_old_log_probs"] == 0.0 and abs(metrics["ppo_kl"]) < 1e-5


def test_bad_batches_and_options_are_refused(policy_dir: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    backend = _verl(policy_dir)
    data = _good_and_bad(tokenizer)
    with pytest.raises(InvalidBatchError, match="token_level_rewards"):
        backend.step(data.select(batch_keys=["input_ids", "attention_mask", "position_ids", "responses"]))
    with pytest.raises(InvalidBatchError, match="uid"):
        backend.step(DataProto(batch=data.batch, non_tensor_batch={}, meta_info={}))
    one_token = _data([(tokenizer.encode("say a"), [5], 1.0, "g0")])
    with pytest.raises(InvalidBatchError, match="reinforce_plus_plus"):
        _verl(policy_dir, algorithm="ppo").step(one_token)  # VERL's whitening needs two loss tokens
    assert backend.policy_version == 0
    with pytest.raises(ValueError, match="without a critic"):
        _verl(policy_dir, adv_estimator="gae")
    with pytest.raises(ValueError, match="strategy"):
        _verl(policy_dir, strategy="megatron")


def test_open_backend_picks_by_name(policy_dir: Path, tmp_path: Path) -> None:
    torch_backend = open_backend("torch", None, lr=1e-3)
    assert isinstance(torch_backend, TorchPolicyBackend)
    verl_backend = open_backend("verl", policy_dir, lr=1e-3, device="cpu")
    assert isinstance(verl_backend, VerlFSDPBackend) and verl_backend.policy_version == 0
    verl_backend.save(tmp_path / "v0")
    resumed = open_backend("verl", tmp_path / "v0", device="cpu")
    assert isinstance(resumed, VerlFSDPBackend) and resumed.options.lr == 1e-3
    with pytest.raises(ValueError, match="backend"):
        open_backend("jax", None, lr=1e-3)  # type: ignore[arg-type]


def test_mini_batches_give_every_rank_rows() -> None:
    order = torch.arange(10)
    assert [len(c) for c in _mini_batches(order, 4, ranks=1)] == [4, 4, 2]
    assert [len(c) for c in _mini_batches(order, 4, ranks=4)] == [4, 6]
    assert [len(c) for c in _mini_batches(order, 10, ranks=8)] == [10]
    assert torch.equal(torch.cat(list(_mini_batches(order, 3, ranks=2))), order)


def _six_rows(tokenizer: PreTrainedTokenizerFast) -> DataProto:
    extra = tokenizer.encode("ok, say b")
    rows = [
        (tokenizer.encode("say a"), tokenizer.encode("a"), 1.0, "g0"),
        (tokenizer.encode("say a"), [7, 8], 0.0, "g0"),
    ]
    rows += [(extra, tokenizer.encode("b"), 1.0, "g1"), (extra, tokenizer.encode("bb?"), 0.5, "g1")]
    rows += [(tokenizer.encode("hello there"), [9], 0.0, "g2"), (tokenizer.encode("hello there"), [10, 11], 1.0, "g2")]
    return _data(rows)


def _two_rank_worker(folder: Path) -> None:
    """Run by torchrun on 2 ranks: rank 0 drives, rank 1 follows; results go to folder/result.json."""
    torch.set_num_threads(1)
    tokenizer = build_tokenizer()
    # Mini-batches of 3 rows over 2 ranks: each rank trains on an uneven share (2 and 1 rows).
    backend = _verl(folder / "v0", mini_batch_size=3)
    if backend.rank != 0:
        backend.follow()
        VerlFSDPBackend.load(folder / "v1", device="cpu").follow()
        return
    data = _six_rows(tokenizer)
    metrics = backend.step(data)
    backend.save(folder / "v1", extra_state={"ranks": 2})
    after = backend.log_probs(data)
    backend.close()
    resumed = VerlFSDPBackend.load(folder / "v1", device="cpu")
    result = {
        "world_size": backend.world_size,
        "metrics": metrics,
        "log_probs": after.tolist(),
        "resumed_log_probs": resumed.log_probs(data).tolist(),
        "resumed_version": resumed.policy_version,
        "resumed_extra_state": resumed.extra_state,
    }
    resumed.close()
    (folder / "result.json").write_text(json.dumps(result))


def test_two_ranks_train_like_one(policy_dir: Path, tokenizer: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    """torchrun with 2 CPU ranks (FSDP2 shards over gloo): rank 0's calls are replayed by rank 1, the
    data-parallel update equals the one-process update, and a 2-rank checkpoint resumes on 2 ranks."""
    save_checkpoint(build_model(seed=0), tokenizer, tmp_path / "v0")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        __file__,
        str(tmp_path),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=180)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)  # torchrun and the ranks it started, by its group
            process.wait()
    assert process.returncode == 0, output.decode(errors="replace")[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["world_size"] == 2 and result["metrics"]["updates"] == 2.0
    assert result["resumed_version"] == 1 and result["resumed_extra_state"] == {"ranks": 2}
    two_ranks = torch.tensor(result["log_probs"])
    assert torch.equal(torch.tensor(result["resumed_log_probs"]), two_ranks)

    data = _six_rows(tokenizer)
    one_rank = _verl(policy_dir, mini_batch_size=3)
    metrics = one_rank.step(data)
    assert metrics["updates"] == 2.0
    assert metrics["loss"] == pytest.approx(result["metrics"]["loss"], abs=1e-5)
    assert torch.allclose(one_rank.log_probs(data), two_ranks, atol=1e-5)


if __name__ == "__main__":
    _two_rank_worker(Path(sys.argv[1]))
