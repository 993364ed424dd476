"""Paths of the files written next to a rollouts file (upstream's ``nemo_gym.path_utils``).

Contract
--------
* ``failures_path_for(output)`` is the failures file the collector writes next to ``output``
  (``out.jsonl`` -> ``out_failures.jsonl``): the same path :func:`nemo_gym.collection.output_files.sidecar_paths`
  gives, so tools that read or append to it agree with ``ng_collect_rollouts``.
"""

from __future__ import annotations

from pathlib import Path

from nemo_gym.collection.output_files import sidecar_paths

__all__ = ["failures_path_for"]


def failures_path_for(output_fpath: Path | str) -> Path:
    """``<stem>_failures.jsonl`` next to ``output_fpath``."""
    return sidecar_paths(Path(output_fpath))["failures"]
