"""Outside sandbox providers: the interface (:mod:`.base`) and the registry (:mod:`.registry`)."""

from nemo_gym.sandbox.providers.base import (
    ExecResult,
    SandboxCreateError,
    SandboxCreateVerificationError,
    SandboxExecResult,
    SandboxHandle,
    SandboxProvider,
    SandboxResources,
    SandboxSpec,
    SandboxStatus,
)
from nemo_gym.sandbox.providers.registry import (
    create_provider,
    get_provider_class,
    list_providers,
    register_provider,
)

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
    "create_provider",
    "get_provider_class",
    "list_providers",
    "register_provider",
]
