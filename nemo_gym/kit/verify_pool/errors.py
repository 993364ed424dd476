"""The verify pool's failures: what a caller gets when a verification could not be carried out.

Contract
--------
* :class:`VerifyTimeoutError` (a time bound ran out: the pool's, the Ray task's, or the library's own,
  e.g. math-verify's ``signal.alarm``) and :class:`VerifyWorkerCrashedError` (the worker process, Ray
  worker or node died during the call) are :class:`VerifyPoolError` subclasses: infrastructure failures
  for the caller to report, NEVER a reward of 0.
* Every error class carries its ``kind`` (:data:`VERIFY_TIMEOUT_KIND` ``"verify_timeout"`` for both
  timeouts, :data:`VERIFY_FAILED_KIND` ``"verify_failed"`` otherwise). Every server of ours answers one
  that escapes a handler with HTTP 503 and ``{"error": {"kind", "server", "path", "message"}}``
  (:mod:`nemo_gym.server.base`); the collector files it in the failures sidecar under that kind, and a
  server answering it is not counted as down (it answered).
* Plain classes, no imports: both runners (the local pool, :mod:`nemo_gym.kit.verify_pool.local`, and the
  Ray task runner, :mod:`nemo_gym.kit.verify_pool.ray_tasks`) raise them, so neither imports the other.
  :mod:`nemo_gym.kit.verify_pool` re-exports every name.
"""

from __future__ import annotations

__all__ = [
    "VERIFY_ERROR_KINDS",
    "VERIFY_FAILED_KIND",
    "VERIFY_TIMEOUT_KIND",
    "VerifyPoolError",
    "VerifyTimeoutError",
    "VerifyWorkerCrashedError",
]


VERIFY_TIMEOUT_KIND = "verify_timeout"
VERIFY_FAILED_KIND = "verify_failed"
VERIFY_ERROR_KINDS = frozenset({VERIFY_TIMEOUT_KIND, VERIFY_FAILED_KIND})


class VerifyPoolError(RuntimeError):
    """The verification could not be carried out (infrastructure failure, never a reward of 0)."""

    kind: str = VERIFY_FAILED_KIND


class VerifyTimeoutError(VerifyPoolError):
    """The check ran past a time bound: the pool's (its worker was killed) or the library's own."""

    kind = VERIFY_TIMEOUT_KIND


class VerifyWorkerCrashedError(VerifyPoolError):
    """The worker process died while running the call."""
