"""CPU-heavy verification off the event loop: a bounded pool of worker processes, or Ray tasks.

Contract
--------
* ``await run_in_verify_pool(fn, *args, timeout=seconds, **kwargs)`` runs ``fn(*args, **kwargs)`` in a
  worker process of the process-wide pool (:func:`get_verify_pool`) and returns its result. ``fn``,
  its arguments and its result must be picklable; ``fn`` must be importable by the worker (a module-level
  function; one defined in a server's ``app.py`` works, since workers are started with ``spawn`` and
  re-import the main module the way :mod:`multiprocessing` does).
* ``fn`` runs on the worker's MAIN thread, so libraries that use ``signal.alarm`` (math-verify) work; at
  most ``max_workers`` calls run at once (default: the CPUs this process may use,
  :func:`machine_cpu_count`). Past ``timeout`` seconds the worker is killed and the call raises
  :class:`VerifyTimeoutError`; a worker that dies during a call raises :class:`VerifyWorkerCrashedError`.
  Both are :class:`VerifyPoolError` subclasses: infrastructure failures for the caller to report, NEVER
  a reward of 0, each carrying its ``kind`` (:data:`VERIFY_TIMEOUT_KIND`, :data:`VERIFY_FAILED_KIND`)
  that our servers answer with HTTP 503. An exception raised by ``fn`` itself is re-raised unchanged.
  The pool's details: :mod:`nemo_gym.kit.verify_pool.local`; the errors': :mod:`nemo_gym.kit.verify_pool.errors`.
* On a Ray cluster: when the run's config has ``ray_head_node_address`` (``ng_run`` writes it there for
  every server when it joins or starts a cluster, see :mod:`nemo_gym.run.ray`) or
  :func:`set_verify_ray_address` was called, :func:`run_in_verify_pool` runs each call as a Ray task on
  the cluster instead (:mod:`nemo_gym.kit.verify_pool.ray_tasks`), with the same API, bounds and errors.
  Otherwise the local pool runs it and ray is never imported. ``set_verify_ray_address("")`` forces the
  local pool.
* Layout: the errors (:mod:`~nemo_gym.kit.verify_pool.errors`, no imports) sit below both runners, the
  local pool (:mod:`~nemo_gym.kit.verify_pool.local`) and the Ray task runner
  (:mod:`~nemo_gym.kit.verify_pool.ray_tasks`, which imports ray and is imported only when a cluster is
  used; the sandbox's Ray backend runs its programs through it too). Every public name is importable
  from here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from nemo_gym.kit.verify_pool.errors import VERIFY_ERROR_KINDS as VERIFY_ERROR_KINDS
from nemo_gym.kit.verify_pool.errors import VERIFY_FAILED_KIND as VERIFY_FAILED_KIND
from nemo_gym.kit.verify_pool.errors import VERIFY_TIMEOUT_KIND as VERIFY_TIMEOUT_KIND
from nemo_gym.kit.verify_pool.errors import VerifyPoolError as VerifyPoolError
from nemo_gym.kit.verify_pool.errors import VerifyTimeoutError as VerifyTimeoutError
from nemo_gym.kit.verify_pool.errors import VerifyWorkerCrashedError as VerifyWorkerCrashedError

if TYPE_CHECKING:
    from nemo_gym.kit.verify_pool.local import VerifyPool as VerifyPool
    from nemo_gym.kit.verify_pool.local import get_verify_pool as get_verify_pool
    from nemo_gym.kit.verify_pool.local import machine_cpu_count as machine_cpu_count

T = TypeVar("T")
# The local pool's names load with it, on first use (multiprocessing, ctypes): every server process
# imports this package for its errors (nemo_gym.server.base), few of them run a pool.
_LOCAL_NAMES = frozenset({"VerifyPool", "get_verify_pool", "machine_cpu_count"})


def __getattr__(name: str) -> Any:
    if name in _LOCAL_NAMES:
        from nemo_gym.kit.verify_pool import local

        value = getattr(local, name)
        globals()[name] = value  # later lookups are plain attribute reads
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "VERIFY_ERROR_KINDS",
    "VERIFY_FAILED_KIND",
    "VERIFY_TIMEOUT_KIND",
    "VerifyPool",
    "VerifyPoolError",
    "VerifyTimeoutError",
    "VerifyWorkerCrashedError",
    "get_verify_pool",
    "machine_cpu_count",
    "run_in_verify_pool",
    "set_verify_ray_address",
    "verify_ray_address",
]


_ray_address_override: str | None = None


def set_verify_ray_address(address: str | None) -> None:
    """Run verification as Ray tasks on the cluster at ``address``; ``""`` forces the local pool;
    ``None`` goes back to reading ``ray_head_node_address`` from this process's config."""
    global _ray_address_override
    _ray_address_override = address


def verify_ray_address() -> str | None:
    """The Ray cluster verification runs on, or None for the local pool."""
    if _ray_address_override is not None:
        return _ray_address_override or None
    from nemo_gym.config.keys import RAY_HEAD_NODE_ADDRESS_KEY_NAME
    from nemo_gym.config.process import current_global_config_dict

    cfg = current_global_config_dict()
    address = cfg.get(RAY_HEAD_NODE_ADDRESS_KEY_NAME) if cfg is not None else None
    return str(address) if address else None


async def run_in_verify_pool(fn: Callable[..., T], /, *args: Any, timeout: float, **kwargs: Any) -> T:
    """Run ``fn`` in the local pool (``get_verify_pool().run(...)``), or as a Ray task when a cluster is
    configured (see the module docstring); same errors either way."""
    if not timeout or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    address = verify_ray_address()
    if address:
        from nemo_gym.kit.pool_stats import VERIFY_POOL
        from nemo_gym.kit.verify_pool.local import counted_call
        from nemo_gym.kit.verify_pool.ray_tasks import run_as_ray_task

        with counted_call(VERIFY_POOL):  # the cluster queues and runs it: no local queue to count
            return await run_as_ray_task(address, fn, args, kwargs, timeout)
    get_pool = globals().get("get_verify_pool") or __getattr__("get_verify_pool")
    return await get_pool().run(fn, *args, timeout=timeout, **kwargs)
