"""Keep a normal start and stop of a process that joins Ray free of crash-like output.

Contract
--------
* ``ray.init`` called off the main thread (the launcher's Ray thread, a server joining from a worker
  thread) logs "SIGTERM handler is not set because current thread is not the main thread": not a
  problem here (we do not want Ray's handler, which turns SIGTERM into ``sys.exit``).
  :func:`drop_not_main_thread_warning` filters exactly that record out of Ray's logger; every other
  Ray log record is untouched.
* Ray's core worker installs a failure-signal handler that prints a stack ("*** SIGTERM received at
  time=... ***", "PC: @ ...") for SIGTERM too, before passing the signal on, so a server stopped the
  normal way looked as if it had crashed. :func:`restore_python_sigterm_handler`, called on the main
  thread after ``ray.init``, puts the process's own SIGTERM handling back (what Python had installed:
  uvicorn's graceful stop, ng_run's stop flag, or the default). Crash signals (SIGSEGV, SIGABRT,
  SIGBUS, SIGILL, SIGFPE) keep Ray's handler and its stacks.
"""

from __future__ import annotations

import logging
import signal
import threading

NOT_MAIN_THREAD_WARNING = "SIGTERM handler is not set because current thread is not the main thread"
_RAY_WORKER_LOGGER = "ray._private.worker"


class _DropNotMainThreadWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return NOT_MAIN_THREAD_WARNING not in record.getMessage()


def drop_not_main_thread_warning() -> None:
    """Filter Ray's "SIGTERM handler is not set" warning (idempotent)."""
    logger = logging.getLogger(_RAY_WORKER_LOGGER)
    if not any(isinstance(f, _DropNotMainThreadWarning) for f in logger.filters):
        logger.addFilter(_DropNotMainThreadWarning())


def restore_python_sigterm_handler() -> bool:
    """Reinstall Python's SIGTERM handler over Ray's failure-signal handler; False off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return False
    handler = signal.getsignal(signal.SIGTERM)
    if handler is None:  # installed outside Python: leave it
        return False
    signal.signal(signal.SIGTERM, handler)
    return True
