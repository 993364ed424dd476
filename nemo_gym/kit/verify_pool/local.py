"""The local verify pool: a bounded pool of worker processes on this machine.

Contract
--------
* :meth:`VerifyPool.run` (``await pool.run(fn, *args, timeout=seconds, **kwargs)``) runs
  ``fn(*args, **kwargs)`` in a worker process and returns its result. ``fn``, its arguments and its
  result must be picklable; ``fn`` must be importable by the worker (a module-level function; one
  defined in a server's ``app.py`` works, since workers are started with ``spawn`` and re-import the
  main module the way :mod:`multiprocessing` does).
* ``fn`` runs on the worker process's MAIN thread, one call at a time per worker, so libraries that use
  ``signal.alarm`` / ``signal.signal`` (math-verify) work there. Never in a thread pool.
* The pool is bounded: at most ``max_workers`` calls run at once (default: the CPUs this process may
  use, :func:`machine_cpu_count`); further calls wait their turn. Workers start lazily and are reused.
* Every call has a bound: past ``timeout`` seconds the worker running it is killed (SIGKILL) and replaced,
  and the call raises :class:`~nemo_gym.kit.verify_pool.errors.VerifyTimeoutError`. A worker that dies
  during a call (segfault, OOM kill, ``os._exit``) raises
  :class:`~nemo_gym.kit.verify_pool.errors.VerifyWorkerCrashedError` naming its exit status (both
  :class:`~nemo_gym.kit.verify_pool.errors.VerifyPoolError` subclasses, see that module). An exception
  raised by ``fn`` itself is re-raised in the caller unchanged (its traceback from the worker is
  attached as a note); one that cannot be pickled becomes a ``VerifyPoolError`` with it. ``fn`` may
  raise ``VerifyTimeoutError`` itself (a library's own time bound ran out): the caller gets the same
  error as for the pool's own bound.
* Cancelling the awaiting coroutine kills the worker running the call (its state is unknown).
* Workers die with their parent: they are daemonic, and each asks the kernel for SIGKILL when the process
  that started it dies (``PR_SET_PDEATHSIG``), so a killed server leaves no worker behind.
* :meth:`VerifyPool.warm_up` (``pool.warm_up(fn, *args, timeout=...)``, from a server's ``on_startup``)
  runs ``fn`` once per worker in the background, so imports do not count against the first checks'
  timeouts; a failed warm-up is logged, never raised.
* :func:`get_verify_pool` is the process-wide pool (sized to the machine, created on first use; what it
  does is counted in :data:`nemo_gym.kit.pool_stats.VERIFY_POOL` for the metrics);
  :class:`VerifyPool` can also be used directly (its own size, ``await pool.aclose()``).
* Never imports ray. :mod:`nemo_gym.kit.verify_pool` re-exports every name.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from nemo_gym.kit.pool_stats import VERIFY_POOL, PoolStats
from nemo_gym.kit.verify_pool.errors import VerifyPoolError, VerifyTimeoutError, VerifyWorkerCrashedError

T = TypeVar("T")

__all__ = ["VerifyPool", "get_verify_pool", "machine_cpu_count"]


def machine_cpu_count() -> int:
    """CPUs this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _worker_main(conn: multiprocessing.connection.Connection, parent_pid: int) -> None:
    die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before the death signal was armed
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the server; it stops us
    while True:
        try:
            fn, args, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply: tuple[Any, ...] = ("ok", fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the caller
            reply = ("err", exc, traceback.format_exc())
        try:
            conn.send(reply)
        except Exception as exc:  # the result or exception does not pickle
            detail = reply[2] if reply[0] == "err" else ""
            conn.send(
                (
                    "err",
                    VerifyPoolError(
                        f"{fn!r} returned a value that cannot be sent back (not picklable): {exc}"
                    ),
                    detail,
                )
            )


class _Worker:
    def __init__(self, ctx: multiprocessing.context.BaseContext) -> None:
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_worker_main, args=(child, os.getpid()), daemon=True, name="nemo-gym-verify"
        )
        self.process.start()
        child.close()

    def alive(self) -> bool:
        return self.process.is_alive()

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self.process.kill()
        with contextlib.suppress(Exception):
            self.process.join(timeout=5)
        with contextlib.suppress(Exception):
            self.conn.close()


@contextlib.contextmanager
def counted_call(stats: PoolStats) -> Iterator[None]:
    """One verify call in ``stats`` (:mod:`nemo_gym.kit.pool_stats`): busy while it runs, then a call, and a
    timeout or an infrastructure failure by the pool error it raises (local workers and Ray tasks alike)."""
    stats.busy += 1
    try:
        yield
    except VerifyTimeoutError:
        stats.timeouts += 1
        raise
    except VerifyPoolError:
        stats.failures += 1
        raise
    finally:
        stats.busy -= 1
        stats.calls += 1


def _exit_description(code: int | None) -> str:
    if code is None:
        return "an unknown status"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _log_warm_up_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logging.getLogger("nemo_gym").warning("verify pool warm-up failed: %s", task.exception())


class VerifyPool:
    """A bounded pool of worker processes; see the module docstring."""

    def __init__(
        self, max_workers: int | None = None, *, mp_context: str = "spawn", stats: PoolStats | None = None
    ) -> None:
        if max_workers is not None and max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self._max_workers = max_workers or machine_cpu_count()
        # Where this pool reports what it does (the process-wide pool: nemo_gym.kit.pool_stats.VERIFY_POOL).
        self._stats = stats
        if stats is not None:
            stats.size = self._max_workers
        self._ctx = multiprocessing.get_context(mp_context)
        self._idle: deque[_Worker] = deque()
        self._busy: set[_Worker] = set()
        self._slots: asyncio.Semaphore | None = None
        self._slots_loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._warmups: list[asyncio.Task[Any]] = []

    @property
    def max_workers(self) -> int:
        return self._max_workers

    def warm_up(self, fn: Callable[..., Any], /, *args: Any, timeout: float) -> list[asyncio.Task[Any]]:
        """Run ``fn(*args)`` once per worker, in the background, from the running event loop: a cold
        worker spends seconds importing (sympy, a grammar), which would otherwise count against the first
        real checks' timeouts. Call it from a server's ``on_startup``; a warm-up that fails is logged, never
        raised (the checks themselves will report a real problem). Returns the tasks (awaiting them is
        optional)."""
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(self.run(fn, *args, timeout=timeout)) for _ in range(self._max_workers)]
        self._warmups = tasks  # referenced until done (the loop keeps only weak references)
        for task in tasks:
            task.add_done_callback(_log_warm_up_failure)
        return tasks

    def worker_pids(self) -> list[int]:
        """Pids of the live worker processes (idle and busy)."""
        return [w.process.pid for w in [*self._idle, *self._busy] if w.process.pid is not None]

    async def run(self, fn: Callable[..., T], /, *args: Any, timeout: float, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` in a worker; see the module docstring for the errors it raises."""
        if self._closed:
            raise VerifyPoolError("the verify pool is closed")
        if not timeout or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots_loop is not loop:  # a semaphore belongs to one loop
            self._slots, self._slots_loop = asyncio.Semaphore(self._max_workers), loop
        stats = self._stats
        if stats is None:
            stats = PoolStats()  # a pool of the caller's own: counted nowhere
        stats.queued += 1
        try:
            await self._slots.acquire()
        finally:
            stats.queued -= 1
        try:
            with counted_call(stats):
                worker = self._take_worker()
                self._busy.add(worker)
                keep = False
                try:
                    result, keep = await self._call(worker, fn, args, kwargs, timeout)
                    return result
                finally:
                    self._busy.discard(worker)
                    if keep and not self._closed:
                        self._idle.append(worker)
                    else:
                        worker.kill()
        finally:
            self._slots.release()

    def _take_worker(self) -> _Worker:
        while self._idle:
            worker = self._idle.popleft()
            if worker.alive():
                return worker
            worker.kill()
        return _Worker(self._ctx)

    async def _call(
        self,
        worker: _Worker,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float,
    ) -> tuple[Any, bool]:
        """Returns (result, worker reusable). Raises on failure (the worker is then discarded)."""
        try:
            worker.conn.send((fn, args, kwargs))
        except (BrokenPipeError, EOFError, ConnectionResetError) as exc:
            worker.process.join(timeout=1)
            raise VerifyWorkerCrashedError(
                f"verify worker (pid {worker.process.pid}) died before it got the call "
                f"({_exit_description(worker.process.exitcode)})"
            ) from exc
        except Exception as exc:  # pickling the call failed
            raise VerifyPoolError(
                f"cannot send {fn!r} and its arguments to a worker (not picklable): {exc}"
            ) from exc

        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        conn_fd, sentinel = worker.conn.fileno(), worker.process.sentinel
        loop.add_reader(conn_fd, wake)
        loop.add_reader(sentinel, wake)
        try:
            async with asyncio.timeout(timeout):
                await ready
        except TimeoutError:
            raise VerifyTimeoutError(
                f"{getattr(fn, '__qualname__', fn)!r} ran past its {timeout:g} s timeout; its worker was killed"
            ) from None
        finally:
            loop.remove_reader(conn_fd)
            loop.remove_reader(sentinel)
            # uvloop's add_reader leaves the pipe non-blocking; the reply below and the next call's send are
            # whole-message reads and writes, which fail with EAGAIN past the pipe's buffer on such a pipe.
            with contextlib.suppress(OSError):
                os.set_blocking(conn_fd, True)

        if worker.conn.poll():
            try:
                reply = worker.conn.recv()
            except (EOFError, OSError):
                reply = None
            if reply is not None:
                if reply[0] == "ok":
                    return reply[1], True
                exc, tb = reply[1], reply[2]
                if tb:
                    with contextlib.suppress(Exception):
                        exc.add_note(f"in the verify worker (pid {worker.process.pid}):\n{tb}")
                raise exc
        worker.process.join(timeout=5)
        raise VerifyWorkerCrashedError(
            f"verify worker (pid {worker.process.pid}) died while running "
            f"{getattr(fn, '__qualname__', fn)!r} ({_exit_description(worker.process.exitcode)})"
        )

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Kill every worker. Calls in flight fail with VerifyWorkerCrashedError."""
        self._closed = True
        for worker in [*self._idle, *self._busy]:
            worker.kill()
        self._idle.clear()


_default_pool: VerifyPool | None = None


def get_verify_pool() -> VerifyPool:
    """The process-wide pool, sized to the machine, created on first use."""
    global _default_pool
    if _default_pool is None or _default_pool._closed:
        _default_pool = VerifyPool(stats=VERIFY_POOL)
    return _default_pool
