"""Triplet batches -> VERL DataProto: exact tensors for hand-made batches, truncation, validation."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from verl import DataProto

from agl_stream.errors import AglError
from agl_stream.models.training import Triplet, TripletBatch, TripletRecord
from agl_stream.training import InvalidBatchError, batch_to_dataproto

PAD = 0


def _record(rollout: str, group: str, triplets: list[Triplet], **fields: Any) -> TripletRecord:
    return TripletRecord(
        rollout_id=rollout,
        attempt_id=f"{rollout}-a",
        group_id=group,
        triplets=triplets,
        finish_time=0.0,
        **fields,
    )


def _batch(*records: TripletRecord) -> TripletBatch:
    return TripletBatch(batch_id="tb-1", records=list(records), created_time=0.0)


def _hand_made() -> TripletBatch:
    r1 = _record(
        "r1",
        "g1",
        [
            Triplet(prompt_token_ids=[5, 6, 7], response_token_ids=[8, 9], response_logprobs=[-0.1, -0.2]),
            Triplet(
                prompt_token_ids=[5],
                response_token_ids=[10, 11, 12],
                response_logprobs=[-0.3, -0.4, -0.5],
                reward=0.5,
            ),
        ],
        final_reward=1.0,
        policy_version=3,
        resources_id="res-3",
    )
    r2 = _record(
        "r2",
        "g1",
        [Triplet(prompt_token_ids=[4, 5], response_token_ids=[6], response_logprobs=[-0.6])],
        final_reward=0.0,
        policy_version=2,
    )
    r3 = _record("r3", "g2", [], final_reward=1.0, policy_version=3)  # no triplets: skipped
    return _batch(r1, r2, r3)


def _long(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long)


def test_tensors_of_a_hand_made_batch() -> None:
    data = batch_to_dataproto(_hand_made(), pad_token_id=PAD)
    b = data.batch
    assert len(data) == 3
    assert torch.equal(b["prompts"], _long([[5, 6, 7], [0, 0, 5], [0, 4, 5]]))
    assert torch.equal(b["responses"], _long([[8, 9, 0], [10, 11, 12], [6, 0, 0]]))
    assert torch.equal(b["input_ids"], _long([[5, 6, 7, 8, 9, 0], [0, 0, 5, 10, 11, 12], [0, 4, 5, 6, 0, 0]]))
    assert torch.equal(b["attention_mask"], _long([[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]]))
    assert torch.equal(b["position_ids"], _long([[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3], [0, 0, 1, 2, 2, 2]]))
    assert torch.equal(b["response_mask"], _long([[1, 1, 0], [1, 1, 1], [1, 0, 0]]))
    # "final" rewards: every triplet of an attempt gets its final reward, on its last token.
    expected_rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    assert torch.equal(b["token_level_rewards"], expected_rewards)
    assert torch.equal(b["token_level_scores"], expected_rewards)
    assert b["token_level_rewards"].dtype == torch.float32
    old = torch.tensor([[-0.1, -0.2, 0.0], [-0.3, -0.4, -0.5], [-0.6, 0.0, 0.0]])
    assert torch.allclose(b["old_log_probs"], old)
    assert torch.equal(b["rollout_log_probs"], b["old_log_probs"])
    # The response region of the attention mask is VERL's own response mask.
    assert torch.equal(b["attention_mask"][:, -3:], b["response_mask"])

    nt = data.non_tensor_batch
    assert all(isinstance(v, np.ndarray) and v.dtype == object and v.shape == (3,) for v in nt.values())
    assert list(nt["uid"]) == ["g1", "g1", "g1"]
    assert list(nt["rollout_id"]) == ["r1", "r1", "r2"]
    assert list(nt["attempt_id"]) == ["r1-a", "r1-a", "r2-a"]
    assert list(nt["triplet_index"]) == [0, 1, 0]
    assert list(nt["policy_version"]) == [3, 3, 2]
    assert list(nt["resources_id"]) == ["res-3", "res-3", None]

    meta = data.meta_info
    assert meta["batch_id"] == "tb-1"
    assert (meta["n_rows"], meta["n_records"], meta["n_groups"], meta["n_empty_records"]) == (3, 2, 1, 1)
    assert (meta["n_prompt_tokens"], meta["n_response_tokens"]) == (6, 6)
    assert (meta["min_policy_version"], meta["max_policy_version"]) == (2, 3)
    assert meta["has_old_log_probs"] is True
    assert (meta["n_truncated_prompts"], meta["n_truncated_responses"], meta["n_missing_rewards"]) == (0, 0, 0)


def test_triplet_rewards_fall_back_to_the_final_reward() -> None:
    data = batch_to_dataproto(_hand_made(), pad_token_id=PAD, reward_mode="triplet")
    expected = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.5], [0.0, 0.0, 0.0]])
    assert torch.equal(data.batch["token_level_rewards"], expected)


def test_missing_rewards_are_filled_counted_or_refused() -> None:
    batch = _batch(
        _record("r1", "g", [Triplet(prompt_token_ids=[4], response_token_ids=[5, 6])]),
        _record("r2", "g", [Triplet(prompt_token_ids=[4], response_token_ids=[7], reward=2.0)]),
    )
    data = batch_to_dataproto(batch, pad_token_id=PAD)
    assert torch.equal(data.batch["token_level_rewards"], torch.tensor([[0.0, 0.0], [0.0, 0.0]]))
    assert data.meta_info["n_missing_rewards"] == 2
    data = batch_to_dataproto(batch, pad_token_id=PAD, reward_mode="triplet", missing_reward=-1.0)
    assert torch.equal(data.batch["token_level_rewards"], torch.tensor([[0.0, -1.0], [2.0, 0.0]]))
    assert data.meta_info["n_missing_rewards"] == 1
    with pytest.raises(InvalidBatchError, match="no reward") as caught:
        batch_to_dataproto(batch, pad_token_id=PAD, missing_reward=None)
    assert caught.value.rollout_id == "r1"


def test_without_logprobs_everywhere_there_are_no_old_log_probs() -> None:
    batch = _batch(
        _record("r1", "g", [Triplet(prompt_token_ids=[4], response_token_ids=[5], response_logprobs=[-1.0])]),
        _record("r2", "g", [Triplet(prompt_token_ids=[4], response_token_ids=[7])]),
    )
    data = batch_to_dataproto(batch, pad_token_id=PAD)
    assert "old_log_probs" not in data.batch.keys()
    assert "rollout_log_probs" not in data.batch.keys()
    assert data.meta_info["has_old_log_probs"] is False


def test_truncation_keeps_prompt_ends_and_response_starts() -> None:
    data = batch_to_dataproto(_hand_made(), pad_token_id=PAD, max_prompt_length=2, max_response_length=2)
    b = data.batch
    assert torch.equal(b["prompts"], _long([[6, 7], [0, 5], [4, 5]]))
    assert torch.equal(b["responses"], _long([[8, 9], [10, 11], [6, 0]]))
    assert torch.equal(b["attention_mask"], _long([[1, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 0]]))
    assert torch.equal(b["position_ids"], _long([[0, 1, 2, 3], [0, 0, 1, 2], [0, 1, 2, 2]]))
    # Row 0's prompt was cut: it stays in its group's statistics (reward kept) but out of the loss.
    assert torch.equal(b["response_mask"], _long([[0, 0], [1, 1], [1, 0]]))
    assert torch.equal(b["token_level_rewards"], torch.tensor([[0.0, 1.0], [0.0, 1.0], [0.0, 0.0]]))
    assert torch.allclose(b["old_log_probs"], torch.tensor([[-0.1, -0.2], [-0.3, -0.4], [-0.6, 0.0]]))
    meta = data.meta_info
    assert (meta["n_truncated_prompts"], meta["n_truncated_responses"], meta["n_masked_rows"]) == (1, 1, 1)

    data = batch_to_dataproto(_hand_made(), pad_token_id=PAD, max_prompt_length=2, train_truncated_prompts=True)
    assert torch.equal(data.batch["response_mask"], _long([[1, 1, 0], [1, 1, 1], [1, 0, 0]]))
    assert data.meta_info["n_masked_rows"] == 0


def _multi_turn() -> TripletBatch:
    """A trajectory sample (two calls, tool tokens 30 31 inserted between them) and a plain triplet."""
    merged = Triplet(
        prompt_token_ids=[5, 6],
        response_token_ids=[7, 8, 30, 31, 9],
        response_logprobs=[-0.1, -0.2, 0.0, 0.0, -0.5],
        response_mask=[1, 1, 0, 0, 1],
        calls=2,
    )
    plain = Triplet(prompt_token_ids=[5], response_token_ids=[12, 13, 14, 15, 16, 17], response_logprobs=[-0.3] * 6)
    return _batch(_record("r1", "g", [merged], final_reward=1.0), _record("r2", "g", [plain], final_reward=0.5))


def test_the_triplets_response_mask_is_the_loss_mask_after_padding() -> None:
    data = batch_to_dataproto(_multi_turn(), pad_token_id=PAD)
    b = data.batch
    assert torch.equal(b["responses"], _long([[7, 8, 30, 31, 9, 0], [12, 13, 14, 15, 16, 17]]))
    # Inserted tokens are attended to (later tokens are predicted from them) but out of the loss.
    assert torch.equal(b["attention_mask"][:, -6:], _long([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]))
    assert torch.equal(b["response_mask"], _long([[1, 1, 0, 0, 1, 0], [1, 1, 1, 1, 1, 1]]))
    assert torch.equal(b["token_level_rewards"], torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0, 0.0], [0, 0, 0, 0, 0, 0.5]]))
    assert torch.allclose(b["old_log_probs"][0], torch.tensor([-0.1, -0.2, 0.0, 0.0, -0.5, 0.0]))
    meta = data.meta_info
    assert (meta["n_response_tokens"], meta["n_inserted_tokens"], meta["n_loss_tokens"]) == (11, 2, 9)
    assert meta["n_masked_rows"] == 0


@pytest.mark.parametrize(
    ("limit", "mask", "logprobs", "reward_at"),
    [
        (4, [1, 1, 0, 0], [-0.1, -0.2, 0.0, 0.0], 1),  # cut inside the tool tokens: reward on the last generated
        (3, [1, 1, 0], [-0.1, -0.2, 0.0], 1),
        (2, [1, 1], [-0.1, -0.2], 1),
        (1, [1], [-0.1], 0),
    ],
)
def test_truncation_cuts_the_mask_with_the_response_and_its_logprobs(
    limit: int, mask: list[int], logprobs: list[float], reward_at: int
) -> None:
    data = batch_to_dataproto(_multi_turn(), pad_token_id=PAD, max_response_length=limit)
    b = data.batch
    assert torch.equal(b["responses"][0], torch.tensor([7, 8, 30, 31, 9][:limit]))
    assert torch.equal(b["response_mask"], _long([mask, [1] * limit]))
    assert torch.allclose(b["old_log_probs"][0], torch.tensor(logprobs))
    expected = torch.zeros(limit)
    expected[reward_at] = 1.0
    assert torch.equal(b["token_level_rewards"][0], expected)
    assert data.meta_info["n_loss_tokens"] == sum(mask) + limit


def test_a_cut_prompt_masks_the_whole_trajectory_row_unless_asked() -> None:
    data = batch_to_dataproto(_multi_turn(), pad_token_id=PAD, max_prompt_length=1)
    assert torch.equal(data.batch["response_mask"], _long([[0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]]))
    data = batch_to_dataproto(_multi_turn(), pad_token_id=PAD, max_prompt_length=1, train_truncated_prompts=True)
    assert torch.equal(data.batch["response_mask"], _long([[1, 1, 0, 0, 1, 0], [1, 1, 1, 1, 1, 1]]))


def test_dataproto_supports_verl_slicing() -> None:
    data = batch_to_dataproto(_hand_made(), pad_token_id=PAD)
    first, second = data[:2], data[2:]
    assert list(first.non_tensor_batch["rollout_id"]) == ["r1", "r1"]
    assert torch.equal(second.batch["responses"], _long([[6, 0, 0]]))
    again = DataProto.concat([first, second])
    assert torch.equal(again.batch["input_ids"], data.batch["input_ids"])
    assert list(again.non_tensor_batch["uid"]) == list(data.non_tensor_batch["uid"])


def _one(triplet: Triplet, **fields: Any) -> TripletBatch:
    return _batch(_record("r1", "g", [triplet], final_reward=1.0, **fields))


@pytest.mark.parametrize(
    ("triplet", "reason"),
    [
        (Triplet(prompt_token_ids=[4], response_token_ids=[]), "empty response"),
        (Triplet(prompt_token_ids=[], response_token_ids=[5]), "empty prompt"),
        (Triplet(prompt_token_ids=[4], response_token_ids=[5, 6], response_logprobs=[-0.1]), "1 response logprobs"),
        (Triplet(prompt_token_ids=[4, -1], response_token_ids=[5]), "prompt token id -1"),
        (Triplet(prompt_token_ids=[4], response_token_ids=[-3]), "response token id -3"),
        (Triplet(prompt_token_ids=[4], response_token_ids=[5], response_logprobs=[math.nan]), "not finite"),
        (Triplet(prompt_token_ids=[4], response_token_ids=[5], reward=math.inf), "reward inf"),
        (Triplet(prompt_token_ids=[4], response_token_ids=[5, 6], response_mask=[1]), "1 response mask values"),
        (Triplet(prompt_token_ids=[4], response_token_ids=[5, 6], response_mask=[1, 2]), "not 0 or 1"),
    ],
)
def test_invalid_triplets_raise_a_typed_error(triplet: Triplet, reason: str) -> None:
    with pytest.raises(InvalidBatchError) as caught:
        batch_to_dataproto(_one(triplet), pad_token_id=PAD, reward_mode="triplet")
    error = caught.value
    assert isinstance(error, AglError) and isinstance(error, ValueError)
    assert reason in error.reason
    assert (error.batch_id, error.rollout_id, error.attempt_id, error.triplet_index) == ("tb-1", "r1", "r1-a", 0)
    assert "batch tb-1" in str(error) and "rollout r1" in str(error)


def test_token_ids_beyond_the_vocabulary_are_refused_when_it_is_known() -> None:
    batch = _one(Triplet(prompt_token_ids=[4], response_token_ids=[64]))
    assert len(batch_to_dataproto(batch, pad_token_id=PAD)) == 1
    with pytest.raises(InvalidBatchError, match=r"response token id 64 is not \[0, 64\)"):
        batch_to_dataproto(batch, pad_token_id=PAD, vocab_size=64)


def test_a_batch_without_triplets_is_refused() -> None:
    with pytest.raises(InvalidBatchError, match="no triplets"):
        batch_to_dataproto(_batch(), pad_token_id=PAD)
    with pytest.raises(InvalidBatchError, match="no triplets"):
        batch_to_dataproto(_batch(_record("r1", "g", [], final_reward=1.0)), pad_token_id=PAD)


def test_bad_arguments_are_value_errors() -> None:
    with pytest.raises(ValueError, match="pad_token_id"):
        batch_to_dataproto(_hand_made(), pad_token_id=-1)
    with pytest.raises(ValueError, match="max_prompt_length"):
        batch_to_dataproto(_hand_made(), pad_token_id=PAD, max_prompt_length=0)
    with pytest.raises(ValueError, match="reward_mode"):
        batch_to_dataproto(_hand_made(), pad_token_id=PAD, reward_mode="best")  # type: ignore[arg-type]
