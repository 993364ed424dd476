"""The interface an outside sandbox provider implements (upstream's ``nemo_gym.sandbox.providers.base``).

Contract
--------
* A provider is an object with ``name`` and the async methods ``create(spec) -> SandboxHandle``,
  ``exec(handle, command, *, cwd, env, timeout_s, user) -> SandboxExecResult``,
  ``upload_file(handle, source_path, target_path)``, ``download_file(handle, source_path, target_path)``,
  ``status(handle) -> SandboxStatus``, ``close(handle)`` and ``aclose()`` (:class:`SandboxProvider`).
  Environments register one with :func:`nemo_gym.sandbox.register_provider` and name it in
  ``AsyncSandbox(provider={name: settings})``; the settings are the provider class's keyword arguments.
* :class:`SandboxHandle` is the provider's receipt for one sandbox (``raw`` is the provider's own state).
* :class:`SandboxCreateError` means a sandbox could not be created or made ready: an infrastructure
  failure (a :class:`~nemo_gym.sandbox.errors.SandboxError`), never a reward.
* The spec, limits and result types are the ones the built-in backends use
  (:mod:`nemo_gym.sandbox.spec`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from nemo_gym.sandbox.errors import SandboxCreateError, SandboxCreateVerificationError
from nemo_gym.sandbox.spec import ExecResult, SandboxExecResult, SandboxResources, SandboxSpec

__all__ = [
    "ExecResult",
    "SandboxCreateError",
    "SandboxCreateVerificationError",
    "SandboxExecResult",
    "SandboxHandle",
    "SandboxProvider",
    "SandboxResources",
    "SandboxSpec",
    "SandboxStatus",
]


class SandboxStatus(StrEnum):
    """Where a provider's sandbox is in its life."""

    STARTING = "starting"
    RUNNING = "running"
    STOPPED = "stopped"
    ERROR = "error"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class SandboxHandle:
    """One sandbox of a provider: its id, the provider's name and the provider's own state (``raw``)."""

    sandbox_id: str
    provider_name: str
    raw: Any = None


@runtime_checkable
class SandboxProvider(Protocol):
    """What :class:`~nemo_gym.sandbox.AsyncSandbox` calls on an outside provider."""

    name: str

    async def create(self, spec: SandboxSpec) -> SandboxHandle: ...

    async def exec(
        self,
        handle: SandboxHandle,
        command: str,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_s: float | None = None,
        user: str | int | None = None,
    ) -> SandboxExecResult: ...

    async def upload_file(self, handle: SandboxHandle, source_path: Path, target_path: str) -> None: ...

    async def download_file(self, handle: SandboxHandle, source_path: str, target_path: Path) -> None: ...

    async def status(self, handle: SandboxHandle) -> SandboxStatus: ...

    async def close(self, handle: SandboxHandle) -> None: ...

    async def aclose(self) -> None: ...
