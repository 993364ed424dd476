"""nemo_gym.sandbox: the only way model-written code runs (bubblewrap isolation, limits, bounded pool).

Upstream's names ``AsyncSandbox``, ``SandboxSpec``, ``SandboxResources``, ``SandboxExecResult`` (and
``ExecResult``) are importable from here; see :mod:`nemo_gym.sandbox.api` for the contract and
:mod:`nemo_gym.sandbox.bwrap` for what the isolation consists of.
"""

from nemo_gym.sandbox.api import (
    UNSAFE_BACKEND,
    AsyncSandbox,
    ExecResult,
    SandboxBusyError,
    SandboxError,
    SandboxExecResult,
    SandboxProviderConfig,
    SandboxResources,
    SandboxSpec,
    SandboxUnavailableError,
    check_sandbox_available,
    python_argv,
    run_in_sandbox,
    sandbox_pool_size,
)

__all__ = [
    "UNSAFE_BACKEND",
    "AsyncSandbox",
    "ExecResult",
    "SandboxBusyError",
    "SandboxError",
    "SandboxExecResult",
    "SandboxProviderConfig",
    "SandboxResources",
    "SandboxSpec",
    "SandboxUnavailableError",
    "check_sandbox_available",
    "python_argv",
    "run_in_sandbox",
    "sandbox_pool_size",
]
