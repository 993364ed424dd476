"""What every ``ng_*`` command does around its own work: the one place its exits are decided.

Contract
--------
* :func:`command` wraps a command's ``main(argv)``. Its output may go to a pipe that closes early
  (``ng_help | head -1``, ``ng_reward_profile ... | head``): then the command stops quietly, with exit
  status 141 (128 + SIGPIPE, what a shell reports for any program cut off that way), never a
  traceback, and stdout is pointed at /dev/null so nothing more is written to the closed pipe at exit.
* A Ctrl+C that reaches the wrapper (the command did not handle it itself) ends with one line on
  stderr and exit status 130, never a traceback. Commands that clean up on Ctrl+C (``ng_run``,
  ``ng_collect_rollouts``) do that first and exit with their own status.
* ``SystemExit`` passes through, after stdout is flushed inside the guard (so a closed pipe at that
  flush is handled as above).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import TypeVar

EXIT_BROKEN_PIPE = 141
EXIT_INTERRUPTED = 130

F = TypeVar("F", bound=Callable[..., object])


def _silence_stdout() -> None:
    """Point stdout at /dev/null: the reader is gone, and Python flushes stdout again at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout already closed or not a real file
        pass


def command(name: str) -> Callable[[F], F]:
    """Decorate an ``ng_*`` entry point named ``name`` (see the module docstring)."""

    def wrap(main: F) -> F:
        @functools.wraps(main)
        def run(*args: object, **kwargs: object) -> object:
            try:
                try:
                    result = main(*args, **kwargs)
                finally:
                    sys.stdout.flush()
                return result
            except BrokenPipeError:
                _silence_stdout()
                raise SystemExit(EXIT_BROKEN_PIPE) from None
            except KeyboardInterrupt:
                sys.stderr.write(f"{name}: interrupted\n")
                raise SystemExit(EXIT_INTERRUPTED) from None

        return run  # type: ignore[return-value]

    return wrap
