"""Work as Ray tasks: the Ray side of :func:`nemo_gym.kit.verify_pool.run_in_verify_pool` (heavy verification)
and of the sandbox's ``run_on: ray`` (:mod:`nemo_gym.sandbox.ray_exec`).

Contract
--------
* :func:`run_as_ray_task` runs ``fn(*args, **kwargs)`` as one Ray task on the cluster at ``address``
  (joined once per process, on a helper thread so the event loop never blocks) and returns its
  result, with the same errors as the local pool:

  - past ``timeout`` seconds the task is force-cancelled (its worker killed) and
    :class:`~nemo_gym.kit.verify_pool.errors.VerifyTimeoutError` is raised;
  - a task whose worker or node dies raises :class:`~nemo_gym.kit.verify_pool.errors.VerifyWorkerCrashedError`
    (tasks are never retried: a verification that crashed a worker is reported, not repeated);
  - any other Ray failure raises :class:`~nemo_gym.kit.verify_pool.errors.VerifyPoolError`;
  - an exception raised by ``fn`` itself is re-raised unchanged (the worker's traceback as a note).

  All three are infrastructure failures for the caller to report, never a reward of 0.
* Ray runs a task on its worker process's main thread, so ``signal.alarm`` users (math-verify) work.
* Each task asks for ``num_cpus`` CPUs (default 1) and any custom ``resources`` (to pin it to nodes
  that offer them): the cluster's CPUs bound how many run at once.
* Cancelling the awaiting coroutine force-cancels the task.
* ``fn`` must be picklable by cloudpickle; the modules it uses must be importable on the cluster's nodes.
* Imports ray at import time: import this module only once a cluster is configured (the verify pool and
  the sandbox import it inside the call that needs it).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import ray
import ray.exceptions

from nemo_gym.kit.ray_quiet import drop_not_main_thread_warning, restore_python_sigterm_handler
from nemo_gym.kit.verify_pool.errors import VerifyPoolError, VerifyTimeoutError, VerifyWorkerCrashedError

_init_lock = threading.Lock()
_remote_fns: dict[tuple[Any, ...], Any] = {}


def _ensure_connected(address: str) -> None:
    with _init_lock:
        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False, configure_logging=False)


def _remote(fn: Callable[..., Any], num_cpus: float, resources: dict[str, float] | None) -> Any:
    key = (fn, num_cpus, tuple(sorted((resources or {}).items())))
    remote = _remote_fns.get(key)
    if remote is None:
        remote = _remote_fns[key] = ray.remote(fn).options(
            num_cpus=num_cpus, resources=resources or None, max_retries=0
        )
    return remote


async def run_as_ray_task(
    address: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    timeout: float,
    num_cpus: float = 1.0,
    resources: dict[str, float] | None = None,
) -> Any:
    """Run ``fn`` as a Ray task; see the module docstring."""
    if not ray.is_initialized():
        drop_not_main_thread_warning()  # joined from a worker thread: Ray's warning about that is noise
        try:
            await asyncio.wait_for(asyncio.to_thread(_ensure_connected, address), timeout=60)
        except TimeoutError:
            raise VerifyPoolError(f"could not join the Ray cluster at {address} within 60 s") from None
        except Exception as e:
            raise VerifyPoolError(f"could not join the Ray cluster at {address}: {e}") from e
        # Back on the server's event-loop thread (its main thread): a SIGTERM from the launcher is a
        # normal stop, so Ray's failure-signal handler must not print a crash stack for it.
        restore_python_sigterm_handler()
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        ref = _remote(fn, num_cpus, resources).remote(*args, **kwargs)
    except Exception as e:  # cloudpickle could not serialise the call
        raise VerifyPoolError(f"cannot send {name!r} and its arguments to a Ray task: {e}") from e
    try:
        return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout)
    except TimeoutError:
        ray.cancel(ref, force=True)
        raise VerifyTimeoutError(
            f"{name!r} ran past its {timeout:g} s timeout; its Ray task was killed"
        ) from None
    except asyncio.CancelledError:
        ray.cancel(ref, force=True)
        raise
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, BaseException) and not isinstance(cause, ray.exceptions.RayError):
            try:
                cause.add_note(f"in a Ray task:\n{e}")
            except Exception:
                pass
            raise cause from None
        raise VerifyPoolError(f"{name!r} failed as a Ray task: {e}") from e
    except (
        ray.exceptions.WorkerCrashedError,
        ray.exceptions.NodeDiedError,
        ray.exceptions.LocalRayletDiedError,
        ray.exceptions.TaskCancelledError,
    ) as e:
        raise VerifyWorkerCrashedError(f"the Ray task running {name!r} died: {type(e).__name__}: {e}") from e
    except ray.exceptions.RayError as e:
        raise VerifyPoolError(f"{name!r} could not run as a Ray task: {type(e).__name__}: {e}") from e


__all__ = ["run_as_ray_task"]
