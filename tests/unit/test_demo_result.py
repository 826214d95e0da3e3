"""The demo's verdict on learning: reward means over rollouts, not over policy versions."""

from __future__ import annotations

import pytest

from agl_stream.demo.loop import DemoResult


def test_a_version_with_two_rollouts_cannot_swing_the_mean() -> None:
    seen = [(0, 54, 0.156), (1, 2, 0.375), (2, 25, 0.191), (7, 15, 0.293), (8, 5, 0.375), (9, 12, 0.335)]
    first, last = DemoResult(versions=seen, seconds=1.0, rollouts=113).first_and_last()
    assert first == pytest.approx((54 * 0.156 + 2 * 0.375 + 25 * 0.191) / 81)
    assert last == pytest.approx((15 * 0.293 + 5 * 0.375 + 12 * 0.335) / 32)


def test_no_rollouts_means_zero() -> None:
    assert DemoResult(versions=[], seconds=0.0, rollouts=0).first_and_last() == (0.0, 0.0)
