"""Sandboxed programs as Ray tasks: the Ray side of ``sandbox: {run_on: ray}`` (:mod:`nemo_gym.sandbox`).

Contract
--------
* A server whose ``sandbox:`` block says ``run_on: ray`` (or ``run_on: auto`` in a run that has a Ray
  cluster, i.e. ``ray_head_node_address`` in its config, which ``ng_run`` writes there) keeps using
  :class:`~nemo_gym.sandbox.AsyncSandbox` unchanged; every ``exec`` becomes one Ray task
  (:func:`nemo_gym.kit.verify_pool.ray_tasks.run_as_ray_task`, the helper math-verify uses too) that runs the
  program under the node's own sandbox backend (bubblewrap) with the same spec and limits, and returns
  the same :class:`~nemo_gym.sandbox.SandboxExecResult`.
* The server's local work dir stays the source of truth: its files (and the program's stdin) travel
  with the task, the task builds a fresh work dir on its node, runs the program there and sends back
  the files the program created or changed (deletions too), which are applied to the local work dir,
  so ``read_file`` and later ``exec`` calls see them as with a local sandbox. What is sent is bounded by
  ``ray_max_payload_mib``: more than that going out is a :class:`~nemo_gym.sandbox.SandboxError` naming
  the sizes; files the program wrote past that bound coming back are left out (the program's own doing,
  like truncated output; logged), symlinks and special files are never sent back.
* Each task asks for ``ray_num_cpus`` CPUs (default 1) and the custom ``ray_resources``: the cluster's
  CPUs bound how many programs run at once (each node runs at most that many), custom resources pin
  programs to nodes that offer them.
* Every failure of the cluster side is an infrastructure failure, a :class:`~nemo_gym.sandbox.SandboxError`
  (never a program outcome, so never a reward of 0): no cluster configured, the task's node or worker
  died, no node ran it within ``queue_timeout_s + wall_time_s + 15 s`` (e.g. no live node offers the
  requested resources), or the node's backend cannot run (bwrap missing there raises the node's
  :class:`~nemo_gym.sandbox.SandboxUnavailableError`).
* :func:`node_counts` says how many programs this process ran on each node (by Ray node id).
* Layering: this module sits below the API (:mod:`nemo_gym.sandbox.api`) and never imports it. The
  node side of a task runs a local :class:`~nemo_gym.sandbox.AsyncSandbox`, so it lives in the API
  module (``nemo_gym.sandbox.api._run_on_node``), which hands it to :func:`exec_on_ray` as the task
  function. ray is imported only inside the calls that need it.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from nemo_gym.sandbox.errors import SandboxError, SandboxUnavailableError
from nemo_gym.sandbox.spec import SandboxExecResult, SandboxProviderConfig, SandboxResources, safe_relative

LOG = logging.getLogger("nemo_gym.sandbox")
_QUEUE_MARGIN_S = 15.0
_node_counts: Counter[str] = Counter()


def node_counts() -> dict[str, int]:
    """Programs this process ran through Ray, per node id."""
    return dict(_node_counts)


def _address() -> str:
    from nemo_gym.kit.verify_pool import verify_ray_address

    address = verify_ray_address()
    if not address:
        raise SandboxUnavailableError(
            "sandbox.run_on is 'ray' but this run has no Ray cluster: set ray_head_node_address (or "
            "+ray_start_local=true) for ng_run, or run_on: local / auto"
        )
    return address


def check_ray_sandbox(config: SandboxProviderConfig) -> None:
    """Start-up check for ``run_on: ray``: a cluster is configured and ray is installed."""
    _address()
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        raise SandboxUnavailableError(
            "sandbox.run_on is 'ray' but the `ray` package is not installed (pip install 'nemo-gym[ray]')"
        ) from exc


def _list_tree(root: Path) -> list[str]:
    """Relative paths of the regular files under ``root``; symlinks (to files or dirs) are not followed."""
    out: list[str] = []
    for dirpath, _dirnames, filenames in os.walk(root, followlinks=False):
        for name in filenames:
            path = os.path.join(dirpath, name)
            if os.path.isfile(path) and not os.path.islink(path):
                out.append(os.path.relpath(path, root))
    return out


def _read_tree(
    root: Path, limit: int, unchanged_from: dict[str, bytes] | None = None
) -> tuple[dict[str, bytes], list[str], list[str]]:
    """The regular files under ``root`` as ``(read, present, left_out)``: ``read`` maps relative paths to
    bytes, at most ``limit`` bytes in all; ``present`` lists every regular file; ``left_out`` those that
    did not fit. Files whose bytes equal ``unchanged_from[rel]`` are present but neither read nor left out."""
    read: dict[str, bytes] = {}
    left_out: list[str] = []
    total = 0
    present = _list_tree(root)
    for rel in present:
        sent = unchanged_from.get(rel) if unchanged_from is not None else None
        try:
            with open(os.path.join(root, rel), "rb") as f:
                data = f.read(max(limit - total, len(sent) if sent is not None else 0) + 1)
        except OSError:
            left_out.append(rel)
            continue
        if sent is not None and sent == data:
            continue
        if total + len(data) > limit:
            left_out.append(rel)
            continue
        read[rel] = data
        total += len(data)
    return read, present, left_out


def _apply(host_dir: Path, changed: dict[str, bytes], keep: set[str]) -> None:
    """Make the local work dir what the node's was: files gone there (or left out) go, changed ones are written."""
    for rel in _list_tree(host_dir):
        if rel not in keep:
            (host_dir / rel).unlink(missing_ok=True)
    for rel, data in changed.items():
        target = host_dir / safe_relative(rel)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


async def exec_on_ray(
    config: SandboxProviderConfig,
    *,
    host_dir: Path,
    argv: list[str],
    workdir: str,
    cwd: str | None,
    env: dict[str, str],
    stdin: bytes | None,
    limits: SandboxResources,
    run_on_node: Callable[..., tuple[SandboxExecResult, dict[str, bytes], list[str], list[str], str]],
) -> SandboxExecResult:
    """Run one program of an :class:`~nemo_gym.sandbox.AsyncSandbox` as a Ray task; see the module docstring.
    ``run_on_node`` is the task (``nemo_gym.sandbox.api._run_on_node``): it gets the provider config, the
    files, argv, workdir, cwd, env, stdin, the limits and the cap on what comes back."""
    from nemo_gym.kit.verify_pool.errors import VerifyPoolError, VerifyTimeoutError
    from nemo_gym.kit.verify_pool.ray_tasks import run_as_ray_task

    address = _address()
    cap = int(config.ray_max_payload_mib * 2**20)
    files, present, too_big = await asyncio.to_thread(_read_tree, host_dir, cap)
    size = sum(len(d) for d in files.values()) + len(stdin or b"")
    if too_big or size > cap:
        raise SandboxError(
            f"the sandbox's files and stdin come to more than sandbox.ray_max_payload_mib="
            f"{config.ray_max_payload_mib:g} MiB ({len(present)} files; {too_big[:3]} did not fit): too "
            "much to send with a Ray task; raise the cap or use run_on: local"
        )
    timeout = config.queue_timeout_s + limits.wall_time_s + _QUEUE_MARGIN_S
    args = (
        config.model_dump(),
        files,
        list(argv),
        workdir,
        cwd,
        env,
        stdin,
        dict(limits.__dict__),
        cap,
    )
    try:
        result, changed, after, left_out, node = await run_as_ray_task(
            address,
            run_on_node,
            args,
            {},
            timeout,
            num_cpus=config.ray_num_cpus,
            resources=dict(config.ray_resources) or None,
        )
    except VerifyTimeoutError as exc:
        raise SandboxError(
            f"no node of the Ray cluster ran the program within {timeout:g} s (queue_timeout_s + "
            f"wall_time_s + {_QUEUE_MARGIN_S:g} s; does a live node offer ray_resources="
            f"{dict(config.ray_resources)} and {config.ray_num_cpus:g} CPU?): {exc}"
        ) from exc
    except VerifyPoolError as exc:
        raise SandboxError(f"the sandbox's Ray task failed (not the program's fault): {exc}") from exc
    _node_counts[node] += 1
    if left_out:
        LOG.warning(
            "sandbox on Ray node %s: %d file(s) the program wrote were not sent back (over "
            "ray_max_payload_mib=%g): %s",
            node,
            len(left_out),
            config.ray_max_payload_mib,
            left_out[:5],
        )
    await asyncio.to_thread(_apply, host_dir, changed, set(after) - set(left_out))
    return result


__all__ = ["check_ray_sandbox", "exec_on_ray", "node_counts"]
