"""Upstream NeMo Gym's module path ``nemo_gym.path_utils``, kept as a thin face for code written against upstream.

It holds exactly upstream's public names here that we implement: ``failures_path_for``, the failures
file next to a rollouts file, defined in :mod:`nemo_gym.collection.output_files` with the other files
written next to the output.
"""

from __future__ import annotations

from nemo_gym.collection.output_files import failures_path_for

__all__ = ["failures_path_for"]
