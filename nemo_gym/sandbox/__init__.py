"""nemo_gym.sandbox: the only way model-written code runs (bubblewrap isolation, limits, bounded pool).

Upstream's names ``AsyncSandbox``, ``SandboxSpec``, ``SandboxResources``, ``SandboxExecResult`` (and
``ExecResult``), ``resolve_provider_config`` and ``resolve_provider_metadata`` (:mod:`nemo_gym.sandbox.config`)
and the outside-provider names (``register_provider``, ``list_providers``, ``SandboxHandle``, ``SandboxStatus``,
``SandboxCreateError``, ...; :mod:`nemo_gym.sandbox.providers`) are importable from here; see :mod:`nemo_gym.sandbox.api` for the contract and
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
from nemo_gym.sandbox.config import resolve_provider_config, resolve_provider_metadata
from nemo_gym.sandbox.providers import (
    SandboxCreateError,
    SandboxCreateVerificationError,
    SandboxHandle,
    SandboxProvider,
    SandboxStatus,
    create_provider,
    get_provider_class,
    list_providers,
    register_provider,
)

__all__ = [
    "SandboxCreateError",
    "SandboxCreateVerificationError",
    "SandboxHandle",
    "SandboxProvider",
    "SandboxStatus",
    "create_provider",
    "get_provider_class",
    "list_providers",
    "register_provider",
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
    "resolve_provider_config",
    "resolve_provider_metadata",
    "run_in_sandbox",
    "sandbox_pool_size",
]
