"""Outside sandbox providers: the interface (:mod:`.base`) and the registry (:mod:`.registry`)."""

from nemo_gym.sandbox.errors import SandboxCreateError, SandboxCreateVerificationError
from nemo_gym.sandbox.providers.base import SandboxHandle, SandboxProvider, SandboxStatus
from nemo_gym.sandbox.providers.registry import (
    create_provider,
    get_provider_class,
    list_providers,
    register_provider,
)
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
    "create_provider",
    "get_provider_class",
    "list_providers",
    "register_provider",
]
