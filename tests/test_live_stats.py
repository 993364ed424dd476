"""LiveStats' arithmetic and bounds (no servers): the numbers the collector's live stats are built on.

The end-to-end proof (a real collection scraped mid-run, the aggregate file's ``live`` block against the
rows written) is in tests/test_rollout_collection.py and tests/test_e2e_collect_rollouts.py.
"""

from __future__ import annotations

import random
import statistics

import pytest

from nemo_gym.collection.live_stats import FAILURE_KINDS, LiveStats, failure_label


def test_running_reward_tokens_and_parent() -> None:
    now = [0.0]
    parent = LiveStats(clock=lambda: now[0])
    a, b = LiveStats(parent, clock=lambda: now[0]), LiveStats(parent, clock=lambda: now[0])
    rng = random.Random(0)
    rewards_a = [rng.uniform(-1, 3) for _ in range(500)]
    rewards_b = [rng.choice([0.0, 1.0]) for _ in range(300)]
    for r in rewards_a:
        a.rollout_ok(r, {"response": {"usage": {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5}}})
    for r in rewards_b:
        b.rollout_ok(r, {"response": {"usage": {"input_tokens": "x", "total_tokens": True}}})  # not counted
    a.rollout_failed("timeout")
    b.rollout_not_persisted()
    a.plan(10)
    b.plan(5)
    now[0] = 4.0
    assert a.reward.mean == pytest.approx(statistics.fmean(rewards_a))
    assert a.reward.std == pytest.approx(statistics.pstdev(rewards_a))
    assert parent.reward.std == pytest.approx(statistics.pstdev(rewards_a + rewards_b))
    assert a.tokens == {"input_tokens": 1500, "output_tokens": 1000, "total_tokens": 2500}
    assert b.tokens == dict.fromkeys(a.tokens, 0) and parent.tokens == a.tokens
    assert (parent.ok, parent.n_failed, parent.not_persisted, parent.planned) == (800, 1, 1, 15)
    d = parent.to_dict()
    assert (
        d["rollouts_per_s"] == 200.0
        and d["tokens_per_s"] == 625.0
        and d["failures_by_kind"] == {"timeout": 1}
    )
    post = a.postfix()
    assert post["rollouts/s"] == "125.0" and post["failed"] == "1 (timeout 1)" and post["tok/s"] == "625"
    a.finish()
    now[0] = 8.0
    assert a.elapsed == 4.0 and parent.elapsed == 8.0


def test_failure_labels_are_bounded() -> None:
    assert failure_label("timeout") == "timeout"
    assert failure_label("ZeroDivisionError") == "other" and failure_label(None) == "other"
    assert failure_label("timeout", reported=True) == "environment_reported"
    assert {failure_label(f"kind{i}") for i in range(1000)} == {"other"}
    assert "other" in FAILURE_KINDS
