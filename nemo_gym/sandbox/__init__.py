"""nemo_gym.sandbox: the only way model-written code runs (bubblewrap isolation, limits, bounded pool).

Upstream's names ``AsyncSandbox``, ``SandboxSpec``, ``SandboxResources``, ``SandboxExecResult`` (and
``ExecResult``), ``resolve_provider_config`` and ``resolve_provider_metadata`` (:mod:`nemo_gym.sandbox.config`)
the long-lived sessions with snapshots and forks (``SandboxSession``, ``SessionLimits``,
``prepare_workspace``; :mod:`nemo_gym.sandbox.session`) and the outside-provider names (``register_provider``, ``list_providers``, ``SandboxHandle``, ``SandboxStatus``,
``SandboxCreateError``, ...; :mod:`nemo_gym.sandbox.providers`) are importable from here; see :mod:`nemo_gym.sandbox.api` for the contract and
:mod:`nemo_gym.sandbox.bwrap` for what the isolation consists of.
"""

from nemo_gym.sandbox.api import AsyncSandbox, check_sandbox_available, python_argv, run_in_sandbox
from nemo_gym.sandbox.config import resolve_provider_config, resolve_provider_metadata
from nemo_gym.sandbox.errors import (
    SandboxBusyError,
    SandboxCreateError,
    SandboxCreateVerificationError,
    SandboxError,
    SandboxUnavailableError,
)
from nemo_gym.sandbox.providers.base import SandboxHandle, SandboxProvider, SandboxStatus
from nemo_gym.sandbox.providers.registry import (
    create_provider,
    get_provider_class,
    list_providers,
    register_provider,
)
from nemo_gym.sandbox.session import (
    DirEntry,
    SandboxSession,
    SessionClosedError,
    SessionEnforcement,
    SessionLimits,
    SessionUsage,
    prepare_workspace,
)
from nemo_gym.sandbox.slots import sandbox_pool_size
from nemo_gym.sandbox.spec import (
    UNSAFE_BACKEND,
    ExecResult,
    SandboxExecResult,
    SandboxProviderConfig,
    SandboxResources,
    SandboxSpec,
)

__all__ = [
    "DirEntry",
    "SandboxSession",
    "SessionClosedError",
    "SessionEnforcement",
    "SessionLimits",
    "SessionUsage",
    "prepare_workspace",
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
