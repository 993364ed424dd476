"""Where the sandbox's Ray backend used to live; it is :mod:`nemo_gym.sandbox.ray_exec` now.

Contract
--------
* Its public names (:func:`~nemo_gym.sandbox.ray_exec.check_ray_sandbox`,
  :func:`~nemo_gym.sandbox.ray_exec.exec_on_ray`, which now takes the node-side task as ``run_on_node``,
  and :func:`~nemo_gym.sandbox.ray_exec.node_counts`) stay importable from here. Nothing in nemo_gym
  imports this module: the backend belongs to the sandbox package, below :mod:`nemo_gym.sandbox.api`.
"""

from __future__ import annotations

from nemo_gym.sandbox.ray_exec import check_ray_sandbox as check_ray_sandbox
from nemo_gym.sandbox.ray_exec import exec_on_ray as exec_on_ray
from nemo_gym.sandbox.ray_exec import node_counts as node_counts

__all__ = ["check_ray_sandbox", "exec_on_ray", "node_counts"]
