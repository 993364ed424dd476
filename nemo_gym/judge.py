"""Upstream NeMo Gym's module path ``nemo_gym.judge``, kept as a thin face for code written against upstream.

It holds exactly upstream's public names here that we implement, each imported from the module of ours
that defines it; the code and its contract live in :mod:`nemo_gym.kit.judge`. Our own code imports from the
defining modules (tests/test_architecture.py checks both).
"""

from __future__ import annotations

from nemo_gym.errors import raise_for_status
from nemo_gym.kit.judge import JudgeError, call_judge, judge_failsafe, reraise_judge_errors

__all__ = [
    "JudgeError",
    "call_judge",
    "judge_failsafe",
    "raise_for_status",
    "reraise_judge_errors",
]
