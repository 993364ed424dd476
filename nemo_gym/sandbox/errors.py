"""The sandbox's exceptions: failures of the sandbox itself, never the program's.

Contract
--------
* :class:`SandboxError` (and its subclasses) means the sandbox could not run the program: callers report
  it as an infrastructure failure, never as a reward of 0. A program's own failure (exit code, timeout,
  OOM, output cap) is a :class:`~nemo_gym.sandbox.spec.SandboxExecResult`, not an exception.
* This module imports nothing of the sandbox: every other sandbox module may import it.
"""

from __future__ import annotations


class SandboxError(RuntimeError):
    """The sandbox could not run the program (an infrastructure failure, never the program's fault)."""


class SandboxUnavailableError(SandboxError):
    """The sandbox backend is not installed or cannot work on this machine."""


class SandboxBusyError(SandboxError):
    """The program waited longer than ``queue_timeout_s`` for a free slot of the pool."""


class SandboxCreateError(SandboxError):
    """A sandbox could not be created or made ready (upstream's name; outside providers raise it)."""


class SandboxCreateVerificationError(SandboxCreateError):
    """A sandbox was created but failed the provider's readiness check."""
