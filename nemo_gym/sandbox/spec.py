"""What a sandbox is asked for and what a run returns: limits, spec, result, provider config.

Contract
--------
* :class:`SandboxResources` (per-program limits, upstream's keys kept), :class:`SandboxSpec` (files, env,
  work dir, limits) and :class:`SandboxProviderConfig` (a server config's ``sandbox:`` block) validate at
  construction and raise ``ValueError`` / pydantic's ``ValidationError`` naming the bad key or value.
* :class:`SandboxExecResult` (alias :data:`ExecResult`) is one program's outcome, as a backend reports it.
* Plain data: no processes, no files touched. Imported by the API (:mod:`nemo_gym.sandbox.api`, which
  re-exports every name) and by the backends, so neither imports the other for its types.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

UNSAFE_BACKEND = "unsafe_local_subprocess"
DEFAULT_WORKDIR = "/sandbox"
BackendName = Literal["bubblewrap", "unsafe_local_subprocess"]


@dataclass
class SandboxResources:
    """Limits for every program run in a sandbox.

    ``cpu``/``memory_mib``/``disk_gib``/``gpu``/``gpu_type`` keep upstream's keys: ``memory_mib`` is the
    memory cap of the program's whole process tree; ``disk_gib`` caps each written file (RLIMIT_FSIZE) when
    ``file_size_mib`` is not given, and what the run adds to its work dir when ``disk_quota_mib`` is not
    given; ``cpu`` (cores) is accepted and not enforced (the CPU-time limit and the pool bound are); a GPU
    cannot be requested.

    ``disk_quota_mib`` (default 512) bounds the total a run adds to its work dir (all files together;
    :mod:`nemo_gym.sandbox.disk_quota`): watched while the program runs, which is killed past it, and
    counted when it ends (``error_type == "disk_quota"``).
    """

    cpu: float | None = None
    memory_mib: int | None = 512
    disk_gib: int | None = None
    gpu: int | None = None
    gpu_type: str | None = None
    cpu_time_s: float = 10.0
    wall_time_s: float = 20.0
    file_size_mib: int | None = None
    open_files: int = 256
    processes: int = 64
    output_limit_bytes: int = 1_000_000
    tmp_size_mib: int = 64
    disk_quota_mib: int | None = None

    def __post_init__(self) -> None:
        if self.gpu:
            raise ValueError("SandboxResources.gpu: the bubblewrap sandbox cannot give a program a GPU")
        for name in (
            "cpu_time_s",
            "wall_time_s",
            "open_files",
            "processes",
            "output_limit_bytes",
            "tmp_size_mib",
        ):
            if getattr(self, name) is None or getattr(self, name) <= 0:
                raise ValueError(f"SandboxResources.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("memory_mib", "disk_quota_mib"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"SandboxResources.{name} must be > 0 or None, got {value!r}")

    @classmethod
    def from_mapping(cls, resources: Mapping[str, Any] | SandboxResources | None) -> SandboxResources:
        if resources is None:
            return cls()
        if isinstance(resources, SandboxResources):
            return resources
        allowed = set(cls.__dataclass_fields__)
        unknown = sorted(set(resources) - allowed)
        if unknown:
            raise ValueError(f"Unknown sandbox resource keys: {unknown}. Expected keys: {sorted(allowed)}")
        return cls(**dict(resources))

    @property
    def file_size_bytes(self) -> int:
        if self.file_size_mib is not None:
            return self.file_size_mib << 20
        if self.disk_gib is not None:
            return self.disk_gib << 30
        return 64 << 20

    @property
    def disk_quota_bytes(self) -> int:
        """What one run may add to its work dir, all files together."""
        if self.disk_quota_mib is not None:
            return self.disk_quota_mib << 20
        if self.disk_gib is not None:
            return self.disk_gib << 30
        return 512 << 20


@dataclass
class SandboxSpec:
    """What a sandbox starts with. ``files`` maps paths to their text (for the built-in backends: paths
    relative to the work dir, default ``/sandbox``).

    Upstream's container-provider fields are accepted so environments build their specs unchanged, and an
    outside provider (:mod:`nemo_gym.sandbox.providers`) gets the spec as built. For the built-in backends
    (:meth:`workdir_backend_problems`, checked when the sandbox starts): ``ttl_s``, ``ready_timeout_s`` and
    ``provider_options`` do not apply to a work dir and are ignored; ``image``, ``entrypoint`` and
    ``ports`` need a container and are refused, naming the field."""

    image: str | None = None
    workdir: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str | bytes] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    resources: SandboxResources | Mapping[str, Any] = field(default_factory=SandboxResources)
    ttl_s: int | float | None = None
    ready_timeout_s: int | float | None = None
    entrypoint: list[str] | None = None
    provider_options: dict[str, Any] = field(default_factory=dict)
    ports: tuple[int, ...] | list[int] = field(default_factory=tuple)
    workdir_given: bool = field(init=False, repr=False, compare=False, default=False)

    def __post_init__(self) -> None:
        self.resources = SandboxResources.from_mapping(self.resources)
        self.workdir_given = self.workdir is not None
        if self.workdir is None:
            self.workdir = DEFAULT_WORKDIR
        for port in self.ports:
            if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
                raise ValueError(f"SandboxSpec.ports: {port!r} is not a TCP port number")

    def container_fields(self) -> list[str]:
        """The set fields only a container provider can honour (``image``, ``entrypoint``, ``ports``)."""
        return [
            f"{name}={getattr(self, name)!r}"
            for name in ("image", "entrypoint", "ports")
            if getattr(self, name)
        ]

    def workdir_backend_problems(self) -> list[str]:
        """Why the built-in (work dir) backends cannot run this spec; empty when they can."""
        problems = []
        workdir = PurePosixPath(str(self.workdir))
        if not workdir.is_absolute() or workdir.parts[1:2] in (("usr",), ("proc",), ("dev",), ("tmp",)):
            problems.append(
                f"SandboxSpec.workdir must be an absolute path outside /usr /proc /dev /tmp: {self.workdir!r}"
            )
        for path in self.files:
            try:
                safe_relative(path)
            except ValueError as e:
                problems.append(f"SandboxSpec.files: {e}")
        return problems


@dataclass
class SandboxExecResult:
    stdout: str
    stderr: str
    return_code: int
    error_type: str | None = None
    timed_out: bool = False
    oom_killed: bool = False
    pids_limit_hit: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    wall_time_s: float = 0.0
    cpu_time_s: float | None = None  # the whole tree's CPU seconds (None without a cpuacct cgroup)

    @property
    def ok(self) -> bool:
        return self.return_code == 0 and self.error_type is None


ExecResult = SandboxExecResult


class SandboxProviderConfig(BaseModel):
    """How programs are sandboxed (a server config's ``sandbox:`` block)."""

    model_config = ConfigDict(extra="forbid")

    backend: BackendName = Field(
        default="bubblewrap",
        description="bubblewrap, or unsafe_local_subprocess to run model code WITHOUT isolation (never in training)",
    )
    python: str = Field(
        default="/usr/bin/python3",
        description="The interpreter programs see as `python3` (Debian's, with apt python3-numpy/-sympy/-scipy)",
    )
    max_concurrent: int | None = Field(default=None, ge=1, description="Programs run at once; default: CPUs")
    queue_timeout_s: float = Field(default=600.0, gt=0, description="Longest wait for a free pool slot")
    workdir_root: str | None = Field(
        default=None, description="Where work dirs are made; default: the temp dir"
    )
    ro_binds: list[str] = Field(
        default_factory=list, description="Extra host paths bound read-only at the same path (e.g. a venv)"
    )
    prestart: bool = Field(
        default=True,
        description="Start each next sandbox (namespaces, mounts, cgroups) ahead, while the current program "
        "runs; at most one idle per pool slot, each serves one run. false: start each at its exec",
    )
    run_on: Literal["local", "ray", "auto"] = Field(
        default="local",
        description="Where programs run: this machine, the run's Ray cluster (nemo_gym.sandbox.ray_exec), or "
        "auto (the cluster when the run has one)",
    )
    ray_resources: dict[str, float] = Field(
        default_factory=dict, description="run_on ray: custom Ray resources each program's task asks for"
    )
    ray_num_cpus: float = Field(
        default=1.0, ge=0, description="run_on ray: CPUs each program's task asks for"
    )
    ray_max_payload_mib: float = Field(
        default=64.0,
        gt=0,
        description="run_on ray: cap on the files + stdin sent with a program (and sent back)",
    )


def safe_relative(path: str) -> PurePosixPath:
    """``path`` as a relative path that stays inside the work dir; ``ValueError`` for an absolute one,
    one with ``..`` or an empty one."""
    p = PurePosixPath(path)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise ValueError(f"sandbox file path must be relative and stay inside the work dir: {path!r}")
    return p
