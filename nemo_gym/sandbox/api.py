"""The sandbox API: run model-written programs isolated, with hard limits, through a bounded pool.

Contract
--------
* :class:`SandboxSpec` (files, env, workdir, resources) and :class:`SandboxResources` (limits) describe a
  sandbox; :class:`AsyncSandbox` owns one throw-away work directory and runs programs in it::

      async with AsyncSandbox(provider={"backend": "bubblewrap"}, spec=SandboxSpec(files={"a.py": code})) as sb:
          result = await sb.exec(["python3", "a.py"], stdin="1 2\\n", timeout_s=5)

  ``exec`` takes an argv list, or a string run by ``/bin/sh -c``. Every ``exec`` of one sandbox sees the
  same work directory (files persist between calls, processes never do). ``stop()`` deletes it.
  :func:`run_in_sandbox` is the one-shot form (fresh work dir, one program, work dir deleted).
* The result (:class:`SandboxExecResult`): ``stdout``/``stderr`` (decoded, each capped at
  ``output_limit_bytes``; ``stdout_truncated``/``stderr_truncated`` say so, and a program that writes past
  the cap is killed), ``return_code`` (the program's exit code; ``128 + n`` if it died of signal ``n``),
  ``timed_out`` (wall clock or CPU time limit), ``oom_killed``, ``pids_limit_hit``, ``wall_time_s``,
  ``cpu_time_s`` (the whole process tree's, when a cpuacct cgroup is available) and
  ``error_type`` (``"timeout" | "oom" | "output_limit" | "disk_quota" | None``). These are the PROGRAM's
  outcomes. ``disk_quota``: the run added more than ``disk_quota_mib`` to its work dir (all files
  together; RLIMIT_FSIZE caps each): killed once seen (polled every 0.5 s), or past it when it ended; its
  stderr ends with a ``[disk quota exceeded: ...]`` line.
* Failures of the sandbox itself (backend missing, set-up failed, work dir unwritable, the queue wait
  bound passed) raise :class:`SandboxError` subclasses: callers report them as infrastructure failures,
  never as a reward of 0.
* Backends (``provider={"backend": ...}`` or :class:`SandboxProviderConfig`):
  ``bubblewrap`` (default; :mod:`nemo_gym.sandbox.bwrap`) and ``unsafe_local_subprocess`` (NO isolation:
  the program runs as this user with this machine's network and files; limits and the process-tree kill
  still apply). The unsafe one must be named explicitly and logs a warning on every sandbox start. If
  ``bwrap`` is missing, the sandbox refuses with :class:`SandboxUnavailableError` naming the package.
* Bounded pool: at most ``max_concurrent`` programs run at once per process (default: the machine's
  CPUs); further ``exec`` calls queue, each for at most ``queue_timeout_s`` (then :class:`SandboxBusyError`).
  With ``prestart`` (default) each run's bubblewrap sandbox was started while an earlier run ran (at most
  one idle per slot, each serving one run); the work dir is moved into it (``host_workdir`` may change
  at an ``exec``; contents and the in-sandbox path do not).
* ``run_on: ray`` (or ``auto`` in a run with a Ray cluster) runs each ``exec`` as a Ray task on a node of
  the run's cluster, same spec, limits and result (:mod:`nemo_gym.sandbox.ray_exec`); default ``local``.
  The task itself (``_run_on_node``: a local sandbox on the node) is defined here, since it needs
  :class:`AsyncSandbox`; the Ray backend gets it as its task function and never imports this module.
* Layout: the types live in :mod:`nemo_gym.sandbox.errors` and :mod:`nemo_gym.sandbox.spec`, the pool's
  slots in :mod:`nemo_gym.sandbox.slots`, the backends in :mod:`nemo_gym.sandbox.bwrap` (and the modules
  it names); every name this module held before stays importable from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from nemo_gym.kit.pool_stats import SANDBOX_POOL
from nemo_gym.kit.verify_pool.local import machine_cpu_count as machine_cpu_count
from nemo_gym.sandbox.errors import SandboxBusyError as SandboxBusyError
from nemo_gym.sandbox.errors import SandboxCreateError as SandboxCreateError
from nemo_gym.sandbox.errors import SandboxError as SandboxError
from nemo_gym.sandbox.errors import SandboxUnavailableError as SandboxUnavailableError
from nemo_gym.sandbox.providers.registry import (
    create_provider,
    get_provider_class,
    is_registered_provider_config,
)
from nemo_gym.sandbox.slots import _SLOTS as _SLOTS
from nemo_gym.sandbox.slots import _Slots as _Slots
from nemo_gym.sandbox.slots import sandbox_pool_size as sandbox_pool_size
from nemo_gym.sandbox.spec import UNSAFE_BACKEND as UNSAFE_BACKEND
from nemo_gym.sandbox.spec import BackendName as BackendName
from nemo_gym.sandbox.spec import ExecResult as ExecResult
from nemo_gym.sandbox.spec import SandboxExecResult as SandboxExecResult
from nemo_gym.sandbox.spec import SandboxProviderConfig as SandboxProviderConfig
from nemo_gym.sandbox.spec import SandboxResources as SandboxResources
from nemo_gym.sandbox.spec import SandboxSpec as SandboxSpec
from nemo_gym.sandbox.spec import safe_relative as safe_relative
from nemo_gym.sandbox.trees import remove_tree
from nemo_gym.sandbox.workers import remove_dir_later

_safe_relative = safe_relative  # its name here before it became public in spec (still importable)

LOG = logging.getLogger("nemo_gym.sandbox")


def _small_flat_dir(path: Path, max_entries: int = 16) -> bool:
    try:
        with os.scandir(path) as entries:
            for n, entry in enumerate(entries):
                if n >= max_entries or entry.is_dir(follow_symlinks=False):
                    return False
    except OSError:
        return False
    return True


def _bwrap():
    from nemo_gym.sandbox import bwrap

    return bwrap


def _backend_for(config: SandboxProviderConfig):  # -> backend object with async run(...)
    if config.backend == "bubblewrap":
        from nemo_gym.sandbox.bwrap import BubblewrapBackend

        return BubblewrapBackend.shared(config)
    from nemo_gym.sandbox.unsafe_local import UnsafeLocalBackend

    return UnsafeLocalBackend.shared(config)


def _runs_on_ray(config: SandboxProviderConfig) -> bool:
    if config.run_on == "local":
        return False
    if config.run_on == "ray":
        return True
    from nemo_gym.kit.verify_pool import verify_ray_address

    return verify_ray_address() is not None


def check_sandbox_available(provider: Mapping[str, Any] | SandboxProviderConfig | None = None) -> None:
    """Raise :class:`SandboxUnavailableError` (naming what to install) unless the backend can run here.
    Servers call this at start so a missing bwrap fails the server, not every request. With
    ``run_on: ray`` it checks that the run has a Ray cluster instead (the nodes check their own bwrap)."""
    if is_registered_provider_config(provider) or _is_provider_object(provider):
        return  # an outside provider checks itself when it creates a sandbox
    config = _provider_config(provider)
    if _runs_on_ray(config):
        from nemo_gym.sandbox.ray_exec import check_ray_sandbox

        check_ray_sandbox(config)
        return
    _backend_for(config).check()


def _provider_config(provider: Mapping[str, Any] | SandboxProviderConfig | None) -> SandboxProviderConfig:
    if provider is None:
        return SandboxProviderConfig()
    if isinstance(provider, SandboxProviderConfig):
        return provider
    if not isinstance(provider, Mapping):
        raise TypeError(
            f"sandbox provider must be a mapping ({{'backend': ...}} or {{registered_name: settings}}), a "
            f"SandboxProviderConfig or a provider object, got {type(provider).__name__}"
        )
    fields = set(SandboxProviderConfig.model_fields)
    if len(provider) == 1 and not set(provider) & fields:
        get_provider_class(next(iter(provider)))  # raises, naming the registered providers and the backends
    return SandboxProviderConfig.model_validate(dict(provider))


def _is_provider_object(provider: Any) -> bool:
    return (
        provider is not None
        and not isinstance(provider, (Mapping, SandboxProviderConfig))
        and callable(getattr(provider, "create", None))
        and callable(getattr(provider, "exec", None))
    )


class OutsideSandbox:
    """One sandbox of an outside provider: create, upload the spec's files, exec, stop (close + aclose)."""

    def __init__(self, provider: Any) -> None:
        self.provider = provider
        self.handle: Any = None
        self.closed = False

    def _need_handle(self) -> Any:
        if self.handle is None:
            raise RuntimeError("Sandbox has not been started")
        return self.handle

    async def start(self, spec: SandboxSpec) -> None:
        if self.closed:
            raise RuntimeError("Sandbox has been stopped")
        if self.handle is not None:
            raise RuntimeError("Sandbox is already started")
        handle = await self.provider.create(spec)
        try:
            if spec.files:
                with tempfile.TemporaryDirectory(prefix="nemo-gym-sandbox-upload-") as tmp:
                    for n, (target, content) in enumerate(spec.files.items()):
                        source = Path(tmp) / f"file-{n}"
                        source.write_bytes(content.encode() if isinstance(content, str) else content)
                        await self.provider.upload_file(handle, source, target)
        except BaseException:
            await self._close(handle)
            raise
        self.handle = handle

    async def exec(self, command: str | Sequence[str], **kwargs: Any) -> SandboxExecResult:
        if not isinstance(command, str):
            command = shlex.join(command)
        return await self.provider.exec(self._need_handle(), command, **kwargs)

    async def upload(self, local_path: Path | str, remote_path: str) -> None:
        await self.provider.upload_file(self._need_handle(), Path(local_path), remote_path)

    async def download(self, remote_path: str, local_path: Path | str) -> None:
        await self.provider.download_file(self._need_handle(), remote_path, Path(local_path))

    async def status(self) -> Any:
        return await self.provider.status(self._need_handle())

    async def _close(self, handle: Any) -> None:
        self.closed = True
        try:
            if handle is not None:
                await self.provider.close(handle)
        finally:
            aclose = getattr(self.provider, "aclose", None)
            if aclose is not None:
                await aclose()

    async def stop(self) -> None:
        if self.closed:
            return
        handle, self.handle = self.handle, None
        await self._close(handle)


class AsyncSandbox:
    """One throw-away work directory; programs run in it one ``exec`` at a time or concurrently."""

    def __init__(
        self,
        provider: Mapping[str, Any] | SandboxProviderConfig | Any | None = None,
        spec: SandboxSpec | None = None,
    ) -> None:
        self._spec = spec or SandboxSpec()
        self._autostarted = False
        self._outside: OutsideSandbox | None = None
        if is_registered_provider_config(provider):
            self._outside = OutsideSandbox(create_provider(provider))
        elif _is_provider_object(provider):
            self._outside = OutsideSandbox(provider)
        if self._outside is not None:
            self._config = SandboxProviderConfig()
            self._host_dir = None
            return
        self._config = _provider_config(provider)
        self._backend = _backend_for(self._config)
        self._host_dir: Path | None = None
        self._running = 0  # execs in flight in this work dir
        self._on_ray = False
        if self._config.max_concurrent is not None:
            _SLOTS.set_limit(self._config.max_concurrent)

    @property
    def spec(self) -> SandboxSpec:
        return self._spec

    @property
    def host_workdir(self) -> Path:
        """The work dir on the host. It may move (same contents) at an ``exec`` that starts while no other
        runs: the program then runs in a sandbox started ahead around a fresh dir, which becomes the work
        dir."""
        if self._host_dir is None:
            raise RuntimeError("Sandbox has not been started")
        return self._host_dir

    async def start(self, spec: SandboxSpec | None = None) -> AsyncSandbox:
        if self._autostarted and (spec is None or spec == self._spec):
            # Upstream's ``async with AsyncSandbox(...) as sb: await sb.start()``: entering already started it.
            self._autostarted = False
            return self
        self._autostarted = False
        if self._host_dir is not None:
            raise RuntimeError("Sandbox is already started")
        if spec is not None:
            self._spec = spec
        if self._outside is not None:
            await self._outside.start(self._spec)
            return self
        container = self._spec.container_fields()
        if container:
            raise SandboxUnavailableError(
                f"SandboxSpec {', '.join(container)}: the {self._config.backend} backend runs programs in a "
                "work dir over the host's read-only /usr, not in a container; leave these fields unset "
                "(or register an outside provider: nemo_gym.sandbox.register_provider)"
            )
        problems = self._spec.workdir_backend_problems()
        if problems:
            raise ValueError("; ".join(problems))
        self._on_ray = _runs_on_ray(self._config)
        if not self._on_ray:  # on Ray, the node that runs the program checks its own backend
            self._backend.check()
        if self._config.backend == UNSAFE_BACKEND:
            LOG.warning(
                "SANDBOX DISABLED (backend=unsafe_local_subprocess): model-written code runs WITHOUT isolation, "
                "as this user, with this machine's network and files"
            )
        root = self._config.workdir_root
        try:
            self._host_dir = Path(tempfile.mkdtemp(prefix="nemo-gym-sandbox-", dir=root))
            for rel, content in self._spec.files.items():
                self._write(rel, content)
        except OSError as exc:
            await self.stop()
            raise SandboxError(
                f"cannot create the sandbox work dir under {root or tempfile.gettempdir()}: {exc}"
            ) from exc
        return self

    def _write(self, rel: str, content: str | bytes) -> None:
        target = self.host_workdir / safe_relative(rel)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content.encode() if isinstance(content, str) else content)

    async def write_file(self, path: str, content: str | bytes) -> None:
        if self._outside is not None:
            with tempfile.TemporaryDirectory(prefix="nemo-gym-sandbox-upload-") as tmp:
                source = Path(tmp) / "file"
                source.write_bytes(content.encode() if isinstance(content, str) else content)
                await self._outside.upload(source, path)
            return
        self._write(path, content)

    async def read_file(self, path: str, max_bytes: int = 10_000_000) -> bytes:
        if self._outside is not None:
            with tempfile.TemporaryDirectory(prefix="nemo-gym-sandbox-download-") as tmp:
                target = Path(tmp) / "file"
                await self._outside.download(path, target)
                with open(target, "rb") as f:
                    return f.read(max_bytes)
        target = self.host_workdir / safe_relative(path)
        if target.is_symlink():
            raise ValueError(f"{path!r} is a symlink; not followed out of the sandbox")
        with open(target, "rb") as f:
            return f.read(max_bytes)

    async def upload(self, local_path: Path | str, remote_path: str) -> None:
        if self._outside is not None:
            await self._outside.upload(local_path, remote_path)
            return
        self._write(self._relative_to_workdir(remote_path), Path(local_path).read_bytes())

    async def download(self, remote_path: str, local_path: Path | str) -> None:
        if self._outside is not None:
            await self._outside.download(remote_path, local_path)
            return
        Path(local_path).write_bytes(await self.read_file(self._relative_to_workdir(remote_path)))

    def _relative_to_workdir(self, remote_path: str) -> str:
        p = PurePosixPath(remote_path)
        if p.is_absolute():
            p = p.relative_to(self._spec.workdir)
        return str(p)

    async def exec(
        self,
        command: str | Sequence[str],
        *,
        stdin: str | bytes | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_s: float | None = None,
        user: str | int | None = None,
        resources: SandboxResources | Mapping[str, Any] | None = None,
    ) -> SandboxExecResult:
        """Run one program; see the module docstring. ``timeout_s`` overrides the wall-clock limit."""
        if self._outside is not None:
            if stdin is not None or resources is not None:
                raise ValueError(
                    "AsyncSandbox.exec: stdin= and resources= apply to the built-in backends only"
                )
            return await self._outside.exec(
                command,
                cwd=cwd if cwd is not None else self._spec.workdir if self._spec.workdir_given else None,
                env=env,
                timeout_s=timeout_s,
                user=user,
            )
        if user is not None:
            raise ValueError("AsyncSandbox.exec(user=...): programs always run as the unprivileged uid 65534")
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        if not argv:
            raise ValueError("AsyncSandbox.exec: empty command")
        limits = SandboxResources.from_mapping(resources) if resources is not None else self._spec.resources
        assert isinstance(limits, SandboxResources)
        if timeout_s is not None:
            limits = SandboxResources(**{**limits.__dict__, "wall_time_s": float(timeout_s)})
        data = stdin.encode() if isinstance(stdin, str) else stdin
        host_dir = self.host_workdir  # raises unless started
        if self._on_ray:  # a Ray task runs it on a node of the cluster; the cluster's CPUs bound the pool
            from nemo_gym.sandbox.ray_exec import exec_on_ray

            return await exec_on_ray(
                self._config,
                host_dir=host_dir,
                argv=argv,
                workdir=self._spec.workdir,
                cwd=cwd,
                env={**self._spec.env, **(env or {})},
                stdin=data,
                limits=limits,
                run_on_node=_run_on_node,
            )
        sem = _SLOTS.semaphore()
        stats = SANDBOX_POOL
        stats.size = _SLOTS.limit
        stats.queued += 1
        try:
            async with asyncio.timeout(self._config.queue_timeout_s):
                await sem.acquire()
        except TimeoutError:
            stats.refused += 1
            raise SandboxBusyError(
                f"no sandbox slot became free within queue_timeout_s={self._config.queue_timeout_s:g} s "
                f"({_SLOTS.limit} programs run at once)"
            ) from None
        finally:
            stats.queued -= 1
        self._running += 1
        stats.busy += 1
        ran = False
        try:
            start = time.monotonic()
            extra: dict[str, Any] = {}
            host_dir = self.host_workdir  # (an exec that ran meanwhile may have moved it)
            take_warm = getattr(self._backend, "take_warm", None)
            if take_warm is not None and self._running == 1:
                warm = take_warm(self._spec.workdir, limits)
                if warm is not None and self._adopt(warm.bind_dir):
                    extra["warm"] = warm
                    host_dir = warm.bind_dir
                elif warm is not None:
                    warm.discard()
            result = await self._backend.run(
                argv,
                host_dir=host_dir,
                workdir=self._spec.workdir,
                cwd=cwd,
                env={**self._spec.env, **(env or {})},
                stdin=data,
                limits=limits,
                **extra,
            )
            result.wall_time_s = time.monotonic() - start
            ran = True
            if result.timed_out:
                stats.timeouts += 1
            return result
        except asyncio.CancelledError:
            ran = True  # the caller went away: not the sandbox's failure
            raise
        finally:
            self._running -= 1
            stats.busy -= 1
            stats.calls += 1
            if not ran:
                stats.failures += 1  # the backend could not run it: an infrastructure error
            sem.release()

    def _adopt(self, new_dir: Path) -> bool:
        """Move the work dir's entries into ``new_dir`` (a pre-started sandbox's fresh, empty dir on the
        same file system: renames) and make it the work dir. False (nothing changed) if that fails."""
        old = self.host_workdir
        moved: list[str] = []
        try:
            for name in os.listdir(old):
                os.rename(old / name, new_dir / name)
                moved.append(name)
        except OSError as exc:
            for name in moved:
                with contextlib.suppress(OSError):
                    os.rename(new_dir / name, old / name)
            LOG.debug("sandbox: not using a pre-started sandbox (%s)", exc)
            return False
        self._host_dir = new_dir
        remove_dir_later(old)  # empty now
        return True

    async def status(self) -> Any:
        """The outside provider's :class:`~nemo_gym.sandbox.providers.SandboxStatus` of this sandbox
        (built-in backends: RUNNING while started, else STOPPED)."""
        from nemo_gym.sandbox.providers.base import SandboxStatus

        if self._outside is not None:
            return await self._outside.status()
        return SandboxStatus.RUNNING if self._host_dir is not None else SandboxStatus.STOPPED

    async def stop(self) -> None:
        if self._outside is not None:
            await self._outside.stop()
            return
        if self._host_dir is not None:
            host_dir, self._host_dir = self._host_dir, None
            if isinstance(self._backend, _bwrap().BubblewrapBackend):
                # Gone from its path now (a rename); the files go in the sandbox clean-up thread.
                trash = host_dir.with_name(f".{host_dir.name}.removed")
                with contextlib.suppress(OSError):
                    os.rename(host_dir, trash)
                    remove_dir_later(trash)
                    return
            if _small_flat_dir(host_dir):
                remove_tree(host_dir)  # a few files: quicker than a thread hop
            else:
                await asyncio.to_thread(remove_tree, host_dir)

    async def __aenter__(self) -> AsyncSandbox:
        await self.start()
        self._autostarted = True  # one explicit start() right after entering is then a no-op
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def _run_on_node(
    provider: dict[str, Any],
    files: dict[str, bytes],
    argv: list[str],
    workdir: str,
    cwd: str | None,
    env: dict[str, str],
    stdin: bytes | None,
    limits: dict[str, Any],
    limit_back: int,
) -> tuple[SandboxExecResult, dict[str, bytes], list[str], list[str], str]:
    """Runs in a Ray task on a node: the program in a fresh local sandbox there. Returns the result, the
    files it created or changed (bounded), every file present afterwards, those left out, the node id.
    :func:`nemo_gym.sandbox.ray_exec.exec_on_ray` sends it; it lives here because it needs AsyncSandbox."""
    import ray

    from nemo_gym.sandbox.ray_exec import _read_tree

    # No pre-started sandbox on the node: a Ray worker runs one task's program and may serve unrelated
    # tasks next, so a sandbox started ahead would sit idle in it (a bwrap tree and its cgroups) until
    # the worker dies. Ray's own per-task cost dwarfs the set-up it would save.
    config = SandboxProviderConfig.model_validate({**provider, "run_on": "local", "prestart": False})
    spec = SandboxSpec(workdir=workdir, env={}, files=files, resources=SandboxResources(**limits))

    async def go() -> tuple[SandboxExecResult, dict[str, bytes], list[str], list[str]]:
        async with AsyncSandbox(provider=config, spec=spec) as sandbox:
            result = await sandbox.exec(argv, stdin=stdin, cwd=cwd, env=env)
            changed, present, left_out = await asyncio.to_thread(
                _read_tree, sandbox.host_workdir, limit_back, files
            )
            return result, changed, present, left_out

    result, changed, present, left_out = asyncio.run(go())
    return result, changed, present, left_out, ray.get_runtime_context().get_node_id()


async def run_in_sandbox(
    command: str | Sequence[str],
    *,
    files: Mapping[str, str | bytes] | None = None,
    stdin: str | bytes | None = None,
    resources: SandboxResources | Mapping[str, Any] | None = None,
    provider: Mapping[str, Any] | SandboxProviderConfig | None = None,
    env: dict[str, str] | None = None,
) -> SandboxExecResult:
    """One program in a fresh sandbox (work dir made, used once, deleted)."""
    spec = SandboxSpec(files=dict(files or {}), resources=SandboxResources.from_mapping(resources))
    sandbox = AsyncSandbox(provider=provider, spec=spec)
    async with sandbox:
        return await sandbox.exec(command, stdin=stdin, env=env)


def python_argv(config: Mapping[str, Any] | SandboxProviderConfig | None, script: str) -> list[str]:
    """argv that runs ``script`` (a work-dir path) with the sandbox's Python, isolated mode."""
    return [_provider_config(config).python, "-I", script]
