"""Sandbox sessions: one long-lived bubblewrap sandbox per rollout, with a workspace that persists across
its commands, a persistent Python kernel, and copy-on-write snapshots and forks.

Contract
--------
* :meth:`SandboxSession.start` starts one sandbox (the same isolation as a one-shot run,
  :mod:`nemo_gym.sandbox.bwrap`: every namespace, no network, uid 65534, host ``/usr`` read-only, a
  read-only root) whose only writable places are ``/workspace`` and size-capped ``/tmp`` and ``/dev/shm``
  (``tmp_size_mib`` each; the rest of ``/dev`` is read-only). Inside runs
  an agent (:mod:`nemo_gym.sandbox.session_agent`); :meth:`~SandboxSession.exec` runs a program in it
  (a string: ``/bin/sh -c``), :meth:`~SandboxSession.run_python` runs code in a persistent kernel whose
  variables survive between calls, :meth:`~SandboxSession.read_file` / :meth:`~SandboxSession.write_file`
  / :meth:`~SandboxSession.list_dir` work on the workspace (a path that resolves outside it, e.g. through
  a symlink, is refused with ``ValueError``). One operation at a time per session (they queue).
* Limits (:class:`SessionLimits`): the sandbox's memory and process count for the whole session (one
  memory and one pids cgroup, :mod:`nemo_gym.sandbox.cgroups`; without them, below); per command: wall time, CPU time, file
  size, open files, output cap (past it the command is killed and a marker line added); a disk quota on
  what the session writes to the workspace, counting what each file can become (its size even where it
  is sparse: eight sparse 255 MB files are 2 GB, not 16 KB) (checked every 0.5 s while a command runs, which is then
  stopped, and after each operation: ``error_type == "disk_quota"`` and a marker line; ``write_file``
  past it raises ``ValueError``); an idle timeout and a lifetime, after which the session is closed.
* A snapshot copies a changed file with its holes kept (``SEEK_DATA``), so it never writes more to the
  host than the session's files hold.
* Processes never outlive a command: when a command (or kernel call) returns, every other process of
  the sandbox but the agent and the kernel is killed. The kernel lives until the session closes, is
  restored, or dies (a call past its wall time is interrupted, then killed: ``[kernel restarted ...]``).
* Closed (its processes killed, its cgroups and dirs removed) by :meth:`~SandboxSession.close`, at idle
  timeout, at the end of its lifetime, at interpreter exit, and when its server dies (the agent exits at
  EOF on its stdin; the dirs of a dead server's sessions are removed by the next process that starts
  one). Using a closed session raises :class:`SessionClosedError` naming why it closed.
* At most ``max_sessions`` sessions per process; :meth:`start` waits up to ``queue_timeout_s`` for one
  to close, then raises :class:`~nemo_gym.sandbox.errors.SandboxBusyError` (servers answer 503).
* ``start(binds={host path: path inside})`` binds more host paths read-only into that session's sandbox
  (not ``/``, ``/tmp``, nor at or under ``/workspace``, ``/proc``, ``/dev``; a path under ``/tmp`` sits on
  top of the sandbox's own /tmp; a fork does not inherit them).
  ``exec(..., pool_slot=False)`` runs a program without taking one of the pool's CPU slots (a harness
  that mostly waits for its model).
* Changesets (:mod:`nemo_gym.sandbox.changes`): :meth:`~SandboxSession.export_changes` packs what the
  session wrote over its starting layer (files, dirs, symlinks, deletions) into a tar, bounded;
  :meth:`~SandboxSession.apply_changes` applies one inside another session's sandbox (never on the host).
* Snapshots: :meth:`~SandboxSession.snapshot` freezes the workspace under an id owned by this session;
  :meth:`~SandboxSession.fork` starts a new session from one, :meth:`~SandboxSession.restore` rolls this
  session back to one (the kernel restarts: kernels are NOT snapshotted). Another session's snapshot id is
  refused. :func:`prepare_workspace` unpacks a directory or tarball once per process into a public base
  that any number of sessions start from (``SandboxSession.start(workspace=...)``).
* Copy-on-write: a session's ``/workspace`` is an overlayfs of a read-only layer (a snapshot or prepared
  base, never written) and the session's own upper dir, mounted in a private mount namespace made for the
  sandbox (``unshare -m``: it goes away with the sandbox; nothing is mounted on the host). A write to a
  file of the layer copies it up first (the kernel does it: ``echo >>``, ``sed -i``, ``open('f', 'r+')``
  alike), so a fork costs a sandbox start and no copy. A snapshot is a new layer: hard links to the old
  layer's files (immutable, so sharing inodes is safe) plus copies of the files the session changed.
* Root or not (:mod:`nemo_gym.sandbox.session_mount`): root mounts the overlay in that namespace; a
  server that is not root mounts it in a user namespace of the session's own (the kernel's overlayfs,
  Linux >= 5.11, or fuse-overlayfs), and where no cgroup is writable its limits are rlimits (RLIMIT_NPROC
  set inside that namespace, RLIMIT_AS per process) plus the agent's samples of the sandbox's memory
  (past ``memory_mib`` the code is stopped: ``oom_killed``) and tasks (``pids_limit_hit``).
  :attr:`SandboxSession.enforcement` says which; docs/sandbox.md, "Sessions without root", says what each
  enforces. No way to mount here: :class:`~nemo_gym.sandbox.errors.SandboxUnavailableError` naming why.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import contextlib
import dataclasses
import logging
import marshal
import math
import os
import resource
import secrets
import shutil
import signal
import struct
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from nemo_gym.sandbox import changes, trees, workers
from nemo_gym.sandbox.bwrap import BubblewrapBackend
from nemo_gym.sandbox.cgroups import RunCgroup
from nemo_gym.sandbox.errors import SandboxBusyError, SandboxError, SandboxUnavailableError
from nemo_gym.sandbox.launch import _launcher_args
from nemo_gym.sandbox.session_mount import WorkspaceMount, workspace_mount
from nemo_gym.sandbox.slots import _SLOTS, _Slots
from nemo_gym.sandbox.spec import SandboxExecResult, SandboxProviderConfig, SandboxResources, safe_relative
from nemo_gym.sandbox.warm import _sweep_dead_owners_dirs
from nemo_gym.sandbox.workers import remove_dir_later

LOG = logging.getLogger("nemo_gym.sandbox")

SESSION_WORKDIR = "/workspace"
_AGENT = Path(__file__).with_name("session_agent.py")
# Read once, with the module: each sandbox gets it as a file of its own root (_agent_fd).
_AGENT_SOURCE = _AGENT.read_bytes()
_AGENT_INSIDE = "/opt/nemo_gym/session_agent.py"
_ROOT_PREFIX = "nemo-gym-sessions-"  # + owner pid + "-": one dir per process (layers and sessions' dirs)
_QUOTA_POLL_S = 0.5


@dataclass
class SessionLimits:
    """A session's limits. ``memory_mib`` and ``processes`` bound the whole sandbox (its commands, kernel
    and agent; ``/tmp`` counts to memory); the ``command_*`` limits and ``output_limit_bytes`` (per
    stream) apply to each command, ``file_size_mib`` and ``open_files`` to each process (RLIMIT_FSIZE,
    RLIMIT_NOFILE); ``disk_quota_mib`` bounds what the session writes to its workspace (on top of the
    layer it started from); ``idle_timeout_s`` and ``lifetime_s`` close a forgotten or overlong session. ``max_sessions`` and ``queue_timeout_s`` are per process (the
    last session started sets them, as ``max_concurrent`` does for programs)."""

    memory_mib: int = 1024
    processes: int = 128
    disk_quota_mib: int = 512
    command_wall_time_s: float = 60.0
    command_cpu_time_s: float = 60.0
    output_limit_bytes: int = 1_000_000
    file_size_mib: int = 256
    open_files: int = 256
    tmp_size_mib: int = 64
    idle_timeout_s: float = 600.0
    lifetime_s: float = 3600.0
    max_sessions: int = 64
    queue_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"SessionLimits.{f.name} must be a number > 0, got {value!r}")

    @classmethod
    def from_mapping(cls, limits: SessionLimits | Mapping[str, Any] | None) -> SessionLimits:
        if limits is None:
            return cls()
        if isinstance(limits, SessionLimits):
            return limits
        unknown = sorted(set(limits) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(
                f"Unknown session limit keys: {unknown}. Expected: {sorted(f.name for f in dataclasses.fields(cls))}"
            )
        return cls(**dict(limits))

    def _sandbox_resources(self) -> SandboxResources:
        """The whole sandbox's limits (cgroups; per-process CPU time = the lifetime) in the shared type."""
        return SandboxResources(
            memory_mib=self.memory_mib,
            processes=self.processes,
            cpu_time_s=self.lifetime_s,
            wall_time_s=self.lifetime_s,
            file_size_mib=self.file_size_mib,
            open_files=self.open_files,
            tmp_size_mib=self.tmp_size_mib,
        )


@dataclass(frozen=True)
class DirEntry:
    """One entry of :meth:`SandboxSession.list_dir` (``kind``: file, dir, symlink or other)."""

    name: str
    kind: str
    size: int


@dataclass(frozen=True)
class SessionUsage:
    """:meth:`SandboxSession.usage`: bytes written to the workspace, the sandbox's memory cgroup usage,
    the CPU seconds its sandbox has used since it started (its start included; None without cpuacct)."""

    workspace_bytes: int
    memory_bytes: int | None
    cpu_time_s: float | None


@dataclass(frozen=True)
class SessionEnforcement:
    """:attr:`SandboxSession.enforcement`: how this session's workspace is mounted and its limits held
    (docs/sandbox.md, "Sessions without root"). ``mount``: ``root`` (the kernel's overlayfs, mounted by
    root), ``userns`` (the kernel's, in a user namespace of the session's own) or ``fuse``
    (fuse-overlayfs there). ``memory``: ``cgroup`` (one memory cgroup for the sandbox: OOM-killed past it)
    or ``rlimit`` (RLIMIT_AS per process, and the sandbox's total sampled every 0.2 s while user code
    runs: stopped past it). ``processes``: ``cgroup`` (one pids cgroup) or ``rlimit`` (RLIMIT_NPROC in the
    session's user namespace; ``pids_limit_hit`` from samples). ``cpu_time``: results carry the sandbox's
    CPU seconds (a cpuacct cgroup), else ``cpu_time_s`` is None."""

    mount: str
    memory: str
    processes: str
    cpu_time: bool


class SessionClosedError(SandboxError):
    """The session is closed (by ``close()``, its idle timeout, its lifetime, or its sandbox dying)."""


# -- layers (snapshots and prepared workspaces) ------------------------------------------------------


@dataclass
class _Layer:
    id: str
    path: Path
    owner: str | None  # the session that took the snapshot; None: a prepared workspace (anyone may use it)
    users: int = 0  # sessions whose workspace lies on it
    owner_open: bool = True

    def release(self) -> None:
        if self.users <= 0 and self.owner is not None and not self.owner_open:
            _LAYERS.pop(self.id, None)
            remove_dir_later(self.path)


_LAYERS: dict[str, _Layer] = {}
_PREPARED: dict[tuple[str, int, int], str] = {}
_PREPARE_LOCK: dict[int, asyncio.Lock] = {}
_ROOT: dict[str, Path] = {}  # workdir_root -> this process's dir under it
_OPEN: set[SandboxSession] = set()
_SESSION_SLOTS = _Slots()


def _root(workdir_root: str | None) -> Path:
    """This process's sessions dir under ``workdir_root`` (made once; dead processes' ones removed)."""
    key = workdir_root or tempfile.gettempdir()
    root = _ROOT.get(key)
    if root is None or root.name.split("-")[3] != str(os.getpid()):
        base = Path(key)
        _sweep_dead_owners_dirs(base, _ROOT_PREFIX)
        root = Path(tempfile.mkdtemp(prefix=f"{_ROOT_PREFIX}{os.getpid()}-", dir=base))
        (root / "layers").mkdir()
        (root / "sessions").mkdir()
        _ROOT[key] = root
    return root


def _agent_fd() -> int:
    """A memfd holding the agent's source, inheritable, at offset 0: bubblewrap copies it into a file of
    the sandbox's own root (``--file``), read-only with that root. A bind of a host file would show its
    host path in the sandbox's /proc/self/mountinfo, and bubblewrap would open it as the server's user in
    a user namespace, which may not reach the installation (another user's dir)."""
    fd = os.memfd_create("session_agent.py", 0)  # no MFD_CLOEXEC: it goes through the launcher to bwrap
    try:
        view = memoryview(_AGENT_SOURCE)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _new_layer_dir(root: Path) -> tuple[str, Path]:
    layer_id = "ws-" + secrets.token_hex(8)
    return layer_id, root / "layers" / layer_id


def _empty_layer(root: Path) -> _Layer:
    key = f"empty:{root}"
    if key not in _LAYERS:
        path = root / "layers" / "empty"
        path.mkdir(exist_ok=True)
        _LAYERS[key] = _Layer(id=key, path=path, owner=None)
    return _LAYERS[key]


async def prepare_workspace(source: str | Path, *, workdir_root: str | None = None) -> str:
    """Unpack a directory or a tarball (``.tar``, ``.tar.gz``, ...) once per process into a read-only base
    and return its id, which any session may start from (``SandboxSession.start(workspace=id)``): a GRPO
    group's rollouts then fork one prepared workspace instead of each unpacking it. The same unchanged
    source (path, size, mtime) gives the same id. A tarball member that would land outside it (absolute
    path, ``..``, a link out, a device) raises ``ValueError`` naming it."""
    path = Path(source).resolve()
    try:
        st = path.stat()
    except OSError as exc:
        raise ValueError(f"prepared workspace {str(source)!r}: {exc}") from exc
    key = (str(path), st.st_size, st.st_mtime_ns)
    lock = _PREPARE_LOCK.setdefault(id(asyncio.get_running_loop()), asyncio.Lock())
    async with lock:
        if key in _PREPARED and _PREPARED[key] in _LAYERS:
            return _PREPARED[key]
        root = _root(workdir_root)
        layer_id, dest = _new_layer_dir(root)
        try:
            await asyncio.to_thread(_unpack, path, dest)
        except BaseException:
            remove_dir_later(dest)
            raise
        _LAYERS[layer_id] = _Layer(id=layer_id, path=dest, owner=None)
        _PREPARED[key] = layer_id
        return layer_id


def _unpack(source: Path, dest: Path) -> None:
    if source.is_dir():
        shutil.copytree(source, dest, symlinks=True)
        return
    if not tarfile.is_tarfile(source):
        raise ValueError(f"prepared workspace {str(source)!r} is neither a directory nor a tar archive")
    dest.mkdir()
    with tarfile.open(source) as tar:
        try:
            tar.extractall(dest, filter="data")
        except tarfile.FilterError as exc:
            raise ValueError(f"prepared workspace {str(source)!r}: refused member: {exc}") from exc


# A tree the sandbox's code wrote may be deeper than any recursion and its paths past PATH_MAX: the
# snapshot, the quota's count and the clean-up walk it by directory fds (nemo_gym.sandbox.trees).
def _tree_bytes(path: Path, max_entries: int | None = None) -> int | None:
    """What ``path`` holds for the quota (:func:`nemo_gym.sandbox.trees.tree_bytes`: a regular file counts
    what it can become, its size even where it is sparse). None when there are more than ``max_entries``
    entries (then the caller walks it in a thread). A tree that keeps
    being moved under the walk (dirs moved between parents while it runs: three walks in a row) counts as
    past any quota: that is the only way left to write under it unseen."""
    for _ in range(3):
        try:
            return trees.tree_bytes(path, max_entries)
        except trees.TreeChangedError:
            continue
    return sys.maxsize


async def _used_bytes(upper: Path) -> int:
    """What the session wrote: walked on the event loop when small (a thread hop costs more than a few
    dozen stats), else in a thread."""
    small = _tree_bytes(upper, max_entries=64)
    if small is not None:
        return small
    return await asyncio.to_thread(_tree_bytes, upper) or 0


# -- one running sandbox ----------------------------------------------------------------------------


class _Sandbox:
    """The running sandbox of a session (replaced on restore): its process, cgroups and overlay dirs."""

    def __init__(
        self, proc: asyncio.subprocess.Process, cgroups: RunCgroup, dirs: Path, mount: WorkspaceMount
    ) -> None:
        self.proc = proc
        self.cgroups = cgroups
        self.dirs = dirs  # upper/, work/, merged/
        self.mount = mount
        self.nproc: int | None = None  # RLIMIT_NPROC set in its user namespace (not root, no pids cgroup)
        self.stderr_tail = bytearray()
        self.stderr_task: asyncio.Task | None = None
        self.dead = False
        self.stale = 0  # answers still to come for requests whose caller was cancelled

    @property
    def upper(self) -> Path:
        return self.dirs / "upper"

    def kill(self) -> None:
        """Kill the tree now; its cgroups and dirs go in the clean-up thread."""
        if self.dead:
            return
        self.dead = True
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        if self.stderr_task is not None:
            self.stderr_task.cancel()
        cgroups, dirs = self.cgroups, self.dirs

        def clean_up() -> None:
            cgroups.destroy()  # every process gone: the private mount namespace (the overlay) with them
            path = dirs.with_name(f".{dirs.name}.removed")
            try:
                os.rename(dirs, path)
            except OSError:
                path = dirs
            trees.remove_tree(path)

        try:
            workers._CLEANUP.submit(clean_up)
        except RuntimeError:  # interpreter shutting down
            clean_up()

    async def reap(self) -> None:
        """Wait (bounded) for the killed tree's outer process, so its pipes close with it."""
        with contextlib.suppress(TimeoutError, ProcessLookupError):
            await asyncio.wait_for(self.proc.wait(), 5)

    async def drain_stderr(self) -> None:
        assert self.proc.stderr is not None
        while chunk := await self.proc.stderr.read(65536):
            self.stderr_tail = (self.stderr_tail + chunk)[-4000:]

    async def send(self, message: dict[str, Any]) -> None:
        """A request: marshal (built into the agent's Python, which then needs no json import)."""
        assert self.proc.stdin is not None
        data = marshal.dumps(message)
        self.proc.stdin.write(struct.pack(">I", len(data)) + data)
        await self.proc.stdin.drain()

    async def receive(self) -> dict[str, Any]:
        """An answer: JSON, parsed by a real parser (what the sandbox writes is never unmarshalled).
        Answers to requests whose caller was cancelled come first, in order: they are skipped."""
        assert self.proc.stdout is not None
        while True:
            head = await self.proc.stdout.readexactly(4)
            body = await self.proc.stdout.readexactly(struct.unpack(">I", head)[0])
            if self.stale:
                self.stale -= 1
                continue
            return orjson.loads(body)

    def abandon(self) -> None:
        """The caller of the request in flight went away (cancelled): stop what it runs now, and skip its
        answer when it comes, so the next request reads its own."""
        self.stale += 1
        if self.proc.stdin is not None and not self.dead:
            data = marshal.dumps({"op": "cancel", "reason": "cancelled"})
            with contextlib.suppress(Exception):
                self.proc.stdin.write(struct.pack(">I", len(data)) + data)


# -- the session -----------------------------------------------------------------------------------


class SandboxSession:
    """One rollout's long-lived sandbox; see the module docstring. Start with :meth:`start` (or
    ``async with await SandboxSession.start(...)``), end with :meth:`close`."""

    def __init__(
        self,
        config: SandboxProviderConfig,
        limits: SessionLimits,
        layer: _Layer,
        binds: tuple[tuple[str, str], ...] = (),
    ) -> None:
        """Not started: use :meth:`start` / :meth:`fork`."""
        self.id = "session-" + secrets.token_hex(8)
        self.limits = limits
        self._config = config
        self._binds = binds
        self._backend = BubblewrapBackend.shared(config)
        assert isinstance(self._backend, BubblewrapBackend)
        self._layer = layer
        self._sandbox: _Sandbox | None = None
        self._lock = asyncio.Lock()
        self._closed: str | None = None
        self._busy = False
        self._started_at = time.monotonic()
        self._last_used = self._started_at
        self._watchdog: asyncio.Task | None = None
        self._slot: asyncio.Semaphore | None = None
        self._snapshots: set[str] = set()
        self._mount: WorkspaceMount | None = None

    # -- lifecycle ---------------------------------------------------------------------------------

    @classmethod
    async def start(
        cls,
        *,
        workspace: str | Path | None = None,
        files: Mapping[str, str | bytes] | None = None,
        limits: SessionLimits | Mapping[str, Any] | None = None,
        provider: Mapping[str, Any] | SandboxProviderConfig | None = None,
        binds: Mapping[str, str] | None = None,
    ) -> SandboxSession:
        """Start a session. ``workspace``: a prepared workspace's id, or a directory / tarball (prepared
        once per process, :func:`prepare_workspace`); ``files`` are written over it (relative paths).
        ``binds``: more host paths bound READ-ONLY into this session's sandbox (host path -> absolute path
        inside, not ``/`` or ``/tmp``, outside ``/workspace``, ``/proc``, ``/dev``; a fork does not inherit
        them).
        Waits for a free session slot up to ``limits.queue_timeout_s`` (then SandboxBusyError)."""
        config = _session_config(provider)
        limits = SessionLimits.from_mapping(limits)
        extra = _checked_binds(binds)
        root = _root(config.workdir_root)
        if workspace is None:
            layer = _empty_layer(root)
        elif str(workspace) in _LAYERS:
            layer = _LAYERS[str(workspace)]
            if layer.owner is not None:
                raise ValueError(
                    f"workspace {str(workspace)!r} is a session's snapshot: start from it with that session's "
                    "fork(), not start()"
                )
        else:
            layer = _LAYERS[await prepare_workspace(workspace, workdir_root=config.workdir_root)]
        session = cls(config, limits, layer, extra)
        await session._open(files)
        return session

    async def _open(self, files: Mapping[str, str | bytes] | None) -> None:
        self._backend.check()
        self._mount = workspace_mount(_root(self._config.workdir_root))
        _SESSION_SLOTS.set_limit(self.limits.max_sessions)
        sem = _SESSION_SLOTS.semaphore()
        try:
            async with asyncio.timeout(self.limits.queue_timeout_s):
                await sem.acquire()
        except TimeoutError:
            raise SandboxBusyError(
                f"no sandbox session slot became free within queue_timeout_s={self.limits.queue_timeout_s:g} s "
                f"({_SESSION_SLOTS.limit} sessions per process: SessionLimits.max_sessions)"
            ) from None
        self._slot = sem
        self._layer.users += 1
        _OPEN.add(self)
        _register_atexit()
        try:
            self._sandbox = await self._launch(files)
        except BaseException:
            await self.close("start failed")
            raise
        self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    async def _launch(self, files: Mapping[str, str | bytes] | None = None) -> _Sandbox:
        root = _root(self._config.workdir_root)
        dirs = Path(tempfile.mkdtemp(prefix=f"{self.id}-", dir=root / "sessions"))
        for name in ("upper", "work", "merged"):
            (dirs / name).mkdir()
        # The overlay is mounted from inside ``dirs`` with these names (session_mount): the layer is
        # reached through this link, so the mount's options name no host path.
        (dirs / "lower").symlink_to(self._layer.path)
        for rel, content in (files or {}).items():
            target = dirs / "upper" / safe_relative(rel)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content.encode() if isinstance(content, str) else content)
        for p in (self._layer.path, dirs):
            if any(c in str(p) for c in ",:\\\"'"):
                raise SandboxError(f"session dir {str(p)!r} has a character overlayfs options cannot carry")
        resources = self.limits._sandbox_resources()
        mount = self._mount or workspace_mount(root)
        cgroups = self._backend.cgroup_driver().create(resources, always_memory=True)
        # Not root and no pids cgroup: RLIMIT_NPROC, set inside the session's user namespace (so that it
        # counts the session's tasks, not all of this user's), never by the launcher before it.
        nproc = None
        if not mount.privileged and not cgroups.limits_processes:
            nproc = min(self.limits.processes, _hard_nproc())
        null = os.open(os.devnull, os.O_WRONLY)
        agent = -1
        try:
            agent = _agent_fd()
            inner = self._backend._bwrap_argv(
                [self._config.python, "-I", "-S", _AGENT_INSIDE],
                bind_dir=dirs / "merged",
                workdir=SESSION_WORKDIR,
                chdir=SESSION_WORKDIR,
                env={},
                status_fd=null,
                tmp_bytes=resources.tmp_size_mib << 20,
                extra_ro_binds=self._binds,
                files=((agent, _AGENT_INSIDE),),
            )
            launcher = _launcher_args(
                resources,
                cgroups.procs_files(),
                memory_by_cgroup=cgroups.memory_limited,
                pids_by_cgroup=cgroups.limits_processes or not mount.privileged,
            )
            mounting = mount.argv(dirs, nproc)
            argv = [*launcher, *mounting, *inner]
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                pass_fds=(null, agent),
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                cwd="/",
                start_new_session=True,
                limit=1 << 20,
            )
        except OSError as exc:
            cgroups.destroy()
            trees.remove_tree(dirs)
            raise SandboxError(f"cannot start the session's sandbox: {exc}") from exc
        finally:
            os.close(null)
            if agent >= 0:
                os.close(agent)
        sandbox = _Sandbox(proc, cgroups, dirs, mount)
        sandbox.nproc = nproc
        sandbox.stderr_task = asyncio.get_running_loop().create_task(sandbox.drain_stderr())
        try:
            hello = await asyncio.wait_for(sandbox.receive(), 30)
            if not hello.get("hello"):
                raise SandboxError(f"the session's agent said {hello!r} instead of hello")
        except (asyncio.IncompleteReadError, TimeoutError, ValueError) as exc:
            with contextlib.suppress(TimeoutError, ProcessLookupError):
                await asyncio.wait_for(proc.wait(), 2)
            await asyncio.sleep(0)
            tail = sandbox.stderr_tail.decode(errors="replace")
            sandbox.kill()
            raise SandboxError(
                f"the session's sandbox did not start ({type(exc).__name__}; exit {proc.returncode}): {tail[-800:]}"
            ) from None
        except BaseException:
            sandbox.kill()
            raise
        return sandbox

    async def _watch(self) -> None:
        """Close the session at its idle timeout or the end of its lifetime."""
        while self._closed is None:
            now = time.monotonic()
            end = self._started_at + self.limits.lifetime_s
            idle_end = self._last_used + self.limits.idle_timeout_s
            if now >= end:
                await self.close(f"its lifetime of {self.limits.lifetime_s:g} s ended")
                return
            if now >= idle_end and not self._busy:
                await self.close(f"it was idle for {self.limits.idle_timeout_s:g} s")
                return
            # While an operation runs the idle clock is stopped: look again within a second.
            wake = min(end, now + 1.0) if self._busy else min(end, idle_end)
            await asyncio.sleep(max(0.05, wake - now))

    async def close(self, reason: str = "close() was called") -> None:
        """Kill the sandbox (a running command with it) and remove the session's dirs. Idempotent."""
        if self._closed is not None:
            return
        self._closed = reason
        _OPEN.discard(self)
        if self._sandbox is not None:
            self._sandbox.kill()
            await self._sandbox.reap()
        if self._watchdog is not None and self._watchdog is not asyncio.current_task():
            self._watchdog.cancel()
        self._layer.users -= 1
        self._layer.release()
        for snap in list(self._snapshots):
            layer = _LAYERS.get(snap)
            if layer is not None:
                layer.owner_open = False
                layer.release()
        if self._slot is not None:
            self._slot.release()
            self._slot = None

    def _close_now(self) -> None:
        """At interpreter exit: kill and remove synchronously."""
        self._closed = self._closed or "the process exited"
        if self._sandbox is not None:
            self._sandbox.kill()

    async def __aenter__(self) -> SandboxSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def usage(self) -> SessionUsage:
        """What the session holds now: the bytes it wrote to its workspace (what the quota counts), its
        sandbox's memory and CPU time (None without those cgroups). For benchmarks and a server's metrics."""
        sandbox = self._check_open()
        return SessionUsage(
            workspace_bytes=await _used_bytes(sandbox.upper),
            memory_bytes=sandbox.cgroups.memory_bytes(),
            cpu_time_s=sandbox.cgroups.cpu_time_s(),
        )

    @property
    def enforcement(self) -> SessionEnforcement:
        """How this session's workspace is mounted and its limits held here (see :class:`SessionEnforcement`)."""
        sandbox = self._check_open()
        return SessionEnforcement(
            mount=sandbox.mount.kind,
            memory="cgroup" if sandbox.cgroups.memory_limited else "rlimit",
            processes="cgroup" if sandbox.cgroups.limits_processes else "rlimit",
            cpu_time=sandbox.cgroups.cpu_time_s() is not None,
        )

    @property
    def closed(self) -> str | None:
        """Why the session closed, or None while it is open."""
        return self._closed

    # -- operations --------------------------------------------------------------------------------

    def _check_open(self) -> _Sandbox:
        if self._closed is not None:
            raise SessionClosedError(f"sandbox session {self.id} is closed: {self._closed}")
        assert self._sandbox is not None
        return self._sandbox

    async def _request(self, message: dict[str, Any], timeout_s: float, *, watch_quota: bool = False) -> dict:
        """Send one request and wait for the answer (bounded: the op's own limit + 10 s). A sandbox that
        stops answering closes the session (SessionClosedError)."""
        sandbox = self._check_open()
        quota_task: asyncio.Task | None = None
        try:
            # What the workspace holds before the command runs (measured first: the command may write at once).
            held = await _used_bytes(sandbox.upper) if watch_quota else 0
            await sandbox.send(message)
            if watch_quota:
                quota_task = asyncio.get_running_loop().create_task(self._watch_quota(sandbox, held))
            async with asyncio.timeout(timeout_s + 10):
                return await sandbox.receive()
        except asyncio.CancelledError:
            sandbox.abandon()
            raise
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, ValueError) as exc:
            oom = sandbox.cgroups.oom_killed()
            why = (
                "its sandbox was OOM-killed"
                if oom
                else f"its sandbox stopped answering ({type(exc).__name__})"
            )
            await self.close(self._closed or why)
            raise SessionClosedError(f"sandbox session {self.id} is closed: {self._closed}") from None
        finally:
            if quota_task is not None:
                quota_task.cancel()

    async def _watch_quota(self, sandbox: _Sandbox, held: int) -> None:
        """Stop the running command once the workspace holds more than the quota, or, when it began
        over the quota, more than it ``held`` then: a command that deletes files to get back under it
        runs (on a busy machine it may take longer than one poll), one that adds to it is stopped."""
        bound = max(self.limits.disk_quota_mib << 20, held)
        while True:
            await asyncio.sleep(_QUOTA_POLL_S)
            if await _used_bytes(sandbox.upper) > bound:
                await sandbox.send({"op": "cancel", "reason": "disk_quota"})
                return

    async def _op(
        self, message: dict[str, Any], timeout_s: float, *, user_code: bool, slot: bool = True
    ) -> tuple[dict, dict]:
        async with self._lock:
            sandbox = self._check_open()
            self._busy = True
            try:
                before = _counters(sandbox.cgroups)
                start = time.monotonic()
                if user_code and not slot:
                    reply = await self._request(message, timeout_s, watch_quota=True)
                elif user_code:
                    sem = _command_slot()
                    async with asyncio.timeout(self._config.queue_timeout_s):
                        await sem.acquire()
                    try:
                        reply = await self._request(message, timeout_s, watch_quota=True)
                    finally:
                        sem.release()
                else:
                    reply = await self._request(message, timeout_s)
                after = _counters(sandbox.cgroups)
                after["wall"] = time.monotonic() - start
                after["used"] = await _used_bytes(sandbox.upper)
                delta = {k: after[k] - before.get(k, 0) for k in after}
                if sandbox.nproc is not None and isinstance(reply.get("peak_tasks"), int):
                    # RLIMIT_NPROC counts the sandbox's tasks and the few outside its pid namespace. Within
                    # one of the limit counts as hit: the task whose fork was refused often exits at once
                    # (a shell that cannot fork does), so the samples after it see the limit less one.
                    if reply["peak_tasks"] + sandbox.mount.outside_tasks >= sandbox.nproc - 1:
                        delta["pids_max"] += 1
                return reply, delta
            except TimeoutError:
                raise SandboxBusyError(
                    f"no sandbox slot became free within queue_timeout_s={self._config.queue_timeout_s:g} s"
                ) from None
            finally:
                self._busy = False
                self._last_used = time.monotonic()

    def _result(self, reply: dict, delta: dict, cap: int) -> SandboxExecResult:
        stdout = base64.b64decode(reply.get("stdout", "")).decode(errors="replace")
        stderr = base64.b64decode(reply.get("stderr", "")).decode(errors="replace")
        rc = int(reply["rc"])
        reason = reply.get("reason")
        oom = delta["oom"] > 0 or reason == "memory"
        timed_out = reason == "timeout" or rc == 128 + signal.SIGXCPU
        over = delta["used"] > self.limits.disk_quota_mib << 20
        if reply.get("out_trunc"):
            stdout += f"\n[output truncated: more than {cap} bytes; the command was stopped]\n"
        if reply.get("err_trunc"):
            stderr += f"\n[output truncated: more than {cap} bytes; the command was stopped]\n"
        if reason == "memory":
            stderr += (
                f"\n[out of memory: the sandbox's processes held {int(reply.get('memory', 0)) / 2**20:.0f} MiB, "
                f"past memory_mib={self.limits.memory_mib}; stopped]\n"
            )
        if reply.get("kernel_lost"):
            stderr += "\n[kernel restarted: it did not stop in time or died; its variables are lost]\n"
        if over or reason == "disk_quota":
            stderr += (
                f"\n[workspace over its disk quota: {delta['used'] / 2**20:.1f} MiB written, quota "
                f"{self.limits.disk_quota_mib} MiB; delete files to go on]\n"
            )
        error_type = None
        if timed_out:
            error_type = "timeout"
        elif oom:
            error_type = "oom"
        elif reason == "output_limit":
            error_type = "output_limit"
        elif over or reason == "disk_quota":
            error_type = "disk_quota"
        return SandboxExecResult(
            stdout=stdout,
            stderr=stderr,
            return_code=rc,
            error_type=error_type,
            timed_out=timed_out,
            oom_killed=oom,
            pids_limit_hit=delta["pids_max"] > 0,
            stdout_truncated=bool(reply.get("out_trunc")),
            stderr_truncated=bool(reply.get("err_trunc")),
            wall_time_s=delta["wall"],
            cpu_time_s=delta.get("cpu"),
        )

    async def exec(
        self,
        cmd: str | Sequence[str],
        stdin: str | bytes | None = None,
        timeout: float | None = None,
        *,
        env: Mapping[str, str] | None = None,
        pool_slot: bool = True,
    ) -> SandboxExecResult:
        """Run a program in ``/workspace`` (a string: ``/bin/sh -c``). ``timeout``: wall seconds (default
        ``limits.command_wall_time_s``, never more). Processes it leaves in the background are killed
        when it returns. The result is the program's (timeouts, OOM, caps, quota), never an exception.
        ``pool_slot=False``: the program does not take one of the pool's CPU slots while it runs (a
        long-lived program that mostly waits, such as an agent harness calling its model; the session
        bound and the sandbox's cgroups still hold it)."""
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        if not argv:
            raise ValueError("SandboxSession.exec: empty command")
        wall = (
            min(float(timeout), self.limits.command_wall_time_s)
            if timeout
            else self.limits.command_wall_time_s
        )
        data = stdin.encode() if isinstance(stdin, str) else stdin
        message = {
            "op": "exec",
            "argv": argv,
            "stdin": data,
            "env": dict(env or {}),
            "timeout": wall,
            **self._rlimits(),
        }
        reply, delta = await self._op(message, wall, user_code=True, slot=pool_slot)
        return self._result(reply, delta, self.limits.output_limit_bytes)

    async def run_python(self, code: str, timeout: float | None = None) -> SandboxExecResult:
        """Run ``code`` in the session's persistent Python kernel (variables survive between calls; a last
        expression's value is printed, as in a REPL). ``return_code``: 0, 1 for an exception (traceback
        on stderr), 130 when interrupted at the wall time (the variables survive), 137 when the kernel
        had to be killed (restarted at the next call, its variables lost: said on stderr)."""
        wall = (
            min(float(timeout), self.limits.command_wall_time_s)
            if timeout
            else self.limits.command_wall_time_s
        )
        message = {"op": "py", "code": code, "timeout": wall, **self._rlimits()}
        message["session_cpu"] = math.ceil(self.limits.lifetime_s)
        reply, delta = await self._op(message, wall + 2, user_code=True)
        return self._result(reply, delta, self.limits.output_limit_bytes)

    def _rlimits(self) -> dict[str, int]:
        sandbox = self._check_open()
        return {
            "cpu": max(1, math.ceil(self.limits.command_cpu_time_s)),
            "cap": self.limits.output_limit_bytes,
            # No memory cgroup: the agent sums its sandbox's memory while user code runs and stops the code
            # past the limit; no pids cgroup: it reports the most tasks it saw (RLIMIT_NPROC refuses forks).
            "watch_mem": 0 if sandbox.cgroups.memory_limited else self.limits.memory_mib << 20,
            "watch_tasks": 0 if sandbox.cgroups.limits_processes else 1,
        }

    async def read_file(self, path: str, max_bytes: int = 10_000_000) -> bytes:
        """The file's bytes (up to ``max_bytes``). ``ValueError`` when it is missing, not a file, or
        resolves outside the workspace (a symlink out is refused, not followed)."""
        reply, _ = await self._op({"op": "read", "path": path, "max": max_bytes}, 30, user_code=False)
        if "error" in reply:
            raise ValueError(f"read_file {path!r}: {reply['error']}")
        return base64.b64decode(reply["data"])

    async def write_file(self, path: str, content: str | bytes) -> None:
        """Write a file in the workspace (parents made). ``ValueError`` outside the workspace or past the
        disk quota."""
        data = content.encode() if isinstance(content, str) else content
        sandbox = self._check_open()
        used = await _used_bytes(sandbox.upper)
        if used + len(data) > self.limits.disk_quota_mib << 20:
            raise ValueError(
                f"write_file {path!r}: {len(data)} bytes would pass the workspace's disk quota of "
                f"{self.limits.disk_quota_mib} MiB ({used / 2**20:.1f} MiB written)"
            )
        message = {"op": "write", "path": path, "data": data}
        reply, _ = await self._op(message, 30, user_code=False)
        if "error" in reply:
            raise ValueError(f"write_file {path!r}: {reply['error']}")

    async def list_dir(self, path: str = ".") -> list[DirEntry]:
        """The entries of a workspace directory, sorted by name (symlinks not followed)."""
        reply, _ = await self._op({"op": "list", "path": path}, 30, user_code=False)
        if "error" in reply:
            raise ValueError(f"list_dir {path!r}: {reply['error']}")
        return [DirEntry(e["name"], e["kind"], int(e["size"])) for e in reply["entries"]]

    # -- changesets (nemo_gym.sandbox.changes) ------------------------------------------------------

    async def export_changes(self, *, max_bytes: int, include: Callable[[str], bool] | None = None) -> bytes:
        """What this session wrote to its workspace on top of the layer it started from (its ``files``
        too), as a changeset tar (:func:`nemo_gym.sandbox.changes.pack_upper`: new and changed files,
        dirs and symlinks, deletions). ``include`` may leave regular files out by their relative path.
        Past ``max_bytes``: :class:`~nemo_gym.sandbox.changes.ChangesTooLargeError` (a ValueError)."""
        async with self._lock:
            sandbox = self._check_open()
            try:
                return await asyncio.to_thread(
                    changes.pack_upper,
                    sandbox.upper,
                    max_bytes=max_bytes,
                    include=include,
                    opaque_xattrs=sandbox.mount.opaque_xattrs,
                    fuse_markers=sandbox.mount.fuse_markers,
                )
            except trees.TreeChangedError as exc:
                raise SandboxError(f"cannot export session {self.id}'s changes: {exc}") from exc
            finally:
                self._last_used = time.monotonic()

    async def apply_changes(self, data: bytes, timeout: float | None = None) -> SandboxExecResult:
        """Apply a changeset (:meth:`export_changes` of a session on the same starting layer) to this
        workspace, inside the sandbox (``changes.APPLY_SOURCE`` as the sandbox's uid, so nothing of it
        reaches the host). The result's stdout is the applier's JSON line (applied, skipped, the first
        skipped member and why); return code 2: the data is not a tar."""
        return await self.exec(
            [self._config.python, "-I", "-S", "-c", changes.APPLY_SOURCE], stdin=data, timeout=timeout
        )

    # -- snapshots ---------------------------------------------------------------------------------

    async def snapshot(self) -> str:
        """Freeze the workspace (not ``/tmp``, not the kernel's variables) under a new id owned by this
        session: its layer's files hard-linked, the files it changed copied. The id is valid for this
        session's :meth:`fork` and :meth:`restore` until the session closes (and while a fork uses it)."""
        async with self._lock:
            sandbox = self._check_open()
            root = _root(self._config.workdir_root)
            layer_id, dest = _new_layer_dir(root)
            lower = self._layer.path

            mount = sandbox.mount

            def build() -> None:
                trees.link_tree(lower, dest)
                trees.apply_upper(sandbox.upper, dest, mount.opaque_xattrs, fuse_markers=mount.fuse_markers)

            try:
                await asyncio.to_thread(build)
            except OSError as exc:
                remove_dir_later(dest)
                raise SandboxError(f"cannot snapshot session {self.id}: {exc}") from exc
            _LAYERS[layer_id] = _Layer(id=layer_id, path=dest, owner=self.id)
            self._snapshots.add(layer_id)
            self._last_used = time.monotonic()
            return layer_id

    def _own_snapshot(self, snapshot_id: str) -> _Layer:
        self._check_open()
        layer = _LAYERS.get(snapshot_id)
        if layer is None or snapshot_id not in self._snapshots:
            raise ValueError(
                f"snapshot {snapshot_id!r} is not one of session {self.id}'s snapshots (a session may fork or "
                "restore only its own)"
            )
        return layer

    async def fork(
        self, snapshot_id: str, *, limits: SessionLimits | Mapping[str, Any] | None = None
    ) -> SandboxSession:
        """A new session (same provider; these session limits or this one's) whose workspace starts as
        the snapshot. Costs a sandbox start: nothing is copied."""
        layer = self._own_snapshot(snapshot_id)
        session = SandboxSession(
            self._config, SessionLimits.from_mapping(limits) if limits else self.limits, layer
        )
        await session._open(None)
        return session

    async def restore(self, snapshot_id: str) -> None:
        """Roll this session's workspace back to one of its snapshots. Its sandbox restarts (a fresh
        kernel, a fresh /tmp); the session id, limits and lifetime stay."""
        layer = self._own_snapshot(snapshot_id)
        async with self._lock:
            old = self._check_open()
            old.kill()
            await old.reap()
            old_layer, self._layer = self._layer, layer
            layer.users += 1
            old_layer.users -= 1
            old_layer.release()
            try:
                self._sandbox = await self._launch()
            except BaseException:
                self._sandbox = None
                await self.close("its sandbox could not restart at restore()")
                raise
            self._last_used = time.monotonic()


_RESERVED_INSIDE = (SESSION_WORKDIR, "/proc", "/dev", "/opt/nemo_gym")


def _checked_binds(binds: Mapping[str, str] | None) -> tuple[tuple[str, str], ...]:
    """``start(binds=...)`` as (host path, sandbox path) pairs: an existing host path, an absolute normalised
    sandbox path that is not ``/`` or ``/tmp`` and not at or under a place the sandbox itself makes (a path
    under /tmp is bound on top of the sandbox's /tmp)."""
    out = []
    for host, inside in (binds or {}).items():
        if not os.path.exists(host):
            raise ValueError(f"binds: the host path {host!r} does not exist")
        if not inside.startswith("/") or os.path.normpath(inside) != inside or inside == "/":
            raise ValueError(f"binds: {inside!r} must be an absolute, normalised path inside the sandbox")
        if inside == "/tmp" or any(inside == r or inside.startswith(r + "/") for r in _RESERVED_INSIDE):
            raise ValueError(f"binds: {inside!r} is at or under a path the sandbox makes itself")
        out.append((str(host), inside))
    return tuple(out)


def _counters(cgroups: RunCgroup) -> dict[str, float]:
    counters = {"oom": cgroups.oom_kills(), "pids_max": cgroups.pids_limit_events()}
    cpu = cgroups.cpu_time_s()
    if cpu is not None:  # without cpuacct (not root) a result's cpu_time_s is None
        counters["cpu"] = cpu
    return counters


def _command_slot() -> asyncio.Semaphore:
    """A command or kernel call is a program like any other: it takes one of the pool's slots."""
    return _SLOTS.semaphore()


def _session_config(provider: Mapping[str, Any] | SandboxProviderConfig | None) -> SandboxProviderConfig:
    config = (
        provider
        if isinstance(provider, SandboxProviderConfig)
        else SandboxProviderConfig.model_validate(dict(provider or {}))
    )
    if config.backend != "bubblewrap":
        raise SandboxUnavailableError(
            f"sandbox sessions need the bubblewrap backend (got backend={config.backend!r})"
        )
    if config.run_on == "ray":
        raise SandboxUnavailableError("sandbox sessions run on this machine: run_on must be local or auto")
    return config


def _hard_nproc() -> int:
    """This process's hard RLIMIT_NPROC (a session's limit cannot pass it: not root cannot raise it)."""
    hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    return sys.maxsize if hard == resource.RLIM_INFINITY else hard


_ATEXIT: list[bool] = []


def _register_atexit() -> None:
    if not _ATEXIT:
        _ATEXIT.append(True)
        atexit.register(_close_all)


def _close_all() -> None:
    for session in list(_OPEN):
        session._close_now()
    for root in _ROOT.values():
        if root.name.split("-")[3] == str(os.getpid()):
            trees.remove_tree(root)
