"""Sandbox backends: bubblewrap (isolated) and unsafe_local_subprocess (explicit opt-in, NOT isolated).

Contract
--------
* ``BubblewrapBackend.run(argv, ...)`` runs ``argv`` under ``bwrap`` with: every namespace unshared (no
  network: only a down-or-empty loopback of its own; its own pid namespace, so it sees and can signal only
  its own processes), a user namespace in which it is uid/gid 65534 with no capabilities and no further
  user namespaces, ``/usr`` (and the merged-usr links, ``/etc/alternatives``, ``/etc/ld.so.cache``) bound
  READ-ONLY and nothing else of the host (no repo, no /root, no /home, no /etc/passwd), a read-only root,
  a fresh /proc and /dev, a size-capped tmpfs /tmp, the work dir bound read-write at ``spec.workdir`` (the
  only writable places), its own hostname (UTS namespace), and an environment of
  only PATH/HOME/LANG/TMPDIR/thread-count variables plus what the caller passes.
* Limits: RLIMIT_CPU (then SIGXCPU/SIGKILL), RLIMIT_FSIZE, RLIMIT_NOFILE, no core files; the process count
  and memory through per-run cgroups (v1 ``pids`` and ``memory`` hierarchies, plus ``cpuacct`` to report
  the tree's CPU time, found from
  /proc/self/cgroup; a memory cgroup OOM-kills the tree and we read ``oom_kill`` to report it). Without a
  writable cgroup: RLIMIT_AS for memory, RLIMIT_NPROC for processes; as root (where RLIMIT_NPROC does
  nothing) the bubblewrap backend then REFUSES to run (:class:`SandboxUnavailableError`).
* The whole tree dies at the end, always: the outer ``bwrap`` is SIGKILLed on wall timeout / output cap /
  cancellation, its inner init dies with it (``--die-with-parent``), and the kernel kills every process of
  the pid namespace; then every pid left in the run's cgroups is SIGKILLed and the cgroups removed.
* The program's exit status comes from bwrap's ``--json-status-fd`` (written by bwrap, not reachable from
  the sandbox). A sandbox that never started (no ``child-pid`` status, or bwrap's own ``bwrap: ...`` set-up
  error while the run's pids cgroup never held more than bwrap's two processes) raises
  :class:`SandboxError` with bwrap's message: an infrastructure failure, not the program's. A program
  printing ``bwrap: ...`` itself is still the program's failure.
* ``UnsafeLocalBackend`` runs ``argv`` as this user in the work dir with an empty environment, the same
  rlimits/cgroups and process-group + cgroup kill, but NO isolation (network, files, other processes).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import json
import logging
import math
import os
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from nemo_gym.sandbox.api import (
    SandboxError,
    SandboxExecResult,
    SandboxProviderConfig,
    SandboxResources,
    SandboxUnavailableError,
)

LOG = logging.getLogger("nemo_gym.sandbox")

SANDBOX_UID = 65534
_JOIN_FAILED = 121  # exit code of the launching shell when it cannot join the cgroups or set a limit
_RUN_IDS = itertools.count()
_READ_CHUNK = 1 << 16
_BACKGROUND: set[asyncio.Future] = set()  # cgroup sweeps still running after their run returned


# ------------------------------------------------------------------------------------------------
# Per-run cgroups (v1 hierarchies).


def _own_cgroup_dirs() -> dict[str, Path]:
    dirs: dict[str, Path] = {}
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return dirs
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for controller in parts[1].split(","):
            if controller in ("pids", "memory", "cpuacct"):
                dirs[controller] = Path("/sys/fs/cgroup") / controller / parts[2].lstrip("/")
    return dirs


class _CgroupRoots:
    """This process's parent dirs for per-run cgroups, made on first use and removed at exit."""

    def __init__(self) -> None:
        self.roots: dict[str, Path] = {}
        for controller, own in _own_cgroup_dirs().items():
            _remove_stale_roots(own)
            root = own / f"nemo_gym_sandbox_{os.getpid()}"
            try:
                root.mkdir(exist_ok=True)
                probe = root / "probe"
                probe.mkdir(exist_ok=True)
                probe.rmdir()
            except OSError:
                continue
            self.roots[controller] = root
        atexit.register(self.remove)

    def remove(self) -> None:
        for root in self.roots.values():
            for child in root.glob("run_*"):
                _kill_and_remove(child)
            with contextlib.suppress(OSError):
                root.rmdir()


def _remove_stale_roots(parent: Path) -> None:
    """Remove the per-process cgroup dirs of processes that died without cleaning up (killed servers)."""
    for root in parent.glob("nemo_gym_sandbox_*"):
        pid = root.name.rsplit("_", 1)[1]
        if not pid.isdigit() or Path(f"/proc/{pid}").exists():
            continue
        for child in root.glob("run_*"):
            _kill_and_remove(child, within=1.0)
        with contextlib.suppress(OSError):
            root.rmdir()


def _pids_in(cgroup: Path) -> list[int]:
    try:
        return [int(p) for p in (cgroup / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def _kill_and_remove(cgroup: Path, within: float = 5.0, remove: bool = True) -> bool:
    """SIGKILL everything in ``cgroup`` until it is empty, then (``remove``) rmdir it. True when it got empty."""
    deadline = time.monotonic() + within
    while True:
        pids = _pids_in(cgroup)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            LOG.error("sandbox cgroup %s still has processes %s after SIGKILL", cgroup, pids)
            return False
        time.sleep(0.005)
    if not remove:
        return True
    for _ in range(200):
        try:
            cgroup.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:  # a just-killed task is still leaving
            time.sleep(0.005)
    return True


@dataclass
class _RunCgroups:
    pids: Path | None
    memory: Path | None
    cpuacct: Path | None = None

    @classmethod
    def create(cls, roots: dict[str, Path], limits: SandboxResources) -> _RunCgroups:
        name = f"run_{next(_RUN_IDS)}"
        made = cls(pids=None, memory=None)
        try:
            if "pids" in roots:
                made.pids = roots["pids"] / name
                made.pids.mkdir()
                (made.pids / "pids.max").write_text(str(limits.processes))
            if "memory" in roots and limits.memory_mib is not None:
                made.memory = roots["memory"] / name
                made.memory.mkdir()
                limit = str(limits.memory_mib << 20)
                (made.memory / "memory.limit_in_bytes").write_text(limit)
                with contextlib.suppress(OSError):  # only with swap accounting
                    (made.memory / "memory.memsw.limit_in_bytes").write_text(limit)
            if "cpuacct" in roots:
                made.cpuacct = roots["cpuacct"] / name
                made.cpuacct.mkdir()
        except OSError as exc:
            made.destroy()
            raise SandboxError(f"cannot set up the sandbox's cgroups: {exc}") from exc
        return made

    def _dirs(self) -> tuple[Path | None, ...]:
        return (self.pids, self.memory, self.cpuacct)

    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self._dirs() if d is not None]

    def cpu_time_s(self) -> float | None:
        """CPU seconds used by every process of the run (cpuacct), or None without that cgroup."""
        if self.cpuacct is None:
            return None
        try:
            return int((self.cpuacct / "cpuacct.usage").read_text()) / 1e9
        except (OSError, ValueError):
            return None

    def oom_killed(self) -> bool:
        if self.memory is None:
            return False
        with contextlib.suppress(OSError, ValueError):
            for line in (self.memory / "memory.oom_control").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value) > 0
        return False

    def peak_processes(self) -> int | None:
        if self.pids is None:
            return None
        try:
            return int((self.pids / "pids.peak").read_text())
        except (OSError, ValueError):
            return None

    def pids_limit_hit(self) -> bool:
        if self.pids is None:
            return False
        with contextlib.suppress(OSError, ValueError):
            for line in (self.pids / "pids.events").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "max":
                    return int(value) > 0
        return False

    def try_remove_empty(self) -> bool:
        """Remove the cgroups if they are already empty (the common case, without blocking). True if done."""
        for attr in ("pids", "memory", "cpuacct"):
            d = getattr(self, attr)
            if d is None:
                continue
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                return False
            setattr(self, attr, None)
        return True

    def destroy(self, remove: bool = True) -> bool:
        ok = True
        for d in self._dirs():
            if d is not None:
                ok = _kill_and_remove(d, remove=remove) and ok
        return ok


# ------------------------------------------------------------------------------------------------
# Running one process with caps, limits and a guaranteed kill.


DASH = "/bin/dash"


def _launcher_args(
    limits: SandboxResources, procs_files: list[str], *, memory_by_cgroup: bool, pids_by_cgroup: bool
) -> list[str]:
    """argv prefix that joins the run's cgroups, sets the rlimits, then execs the rest.

    With dash (Debian's /bin/sh) one shell does both (``ulimit``: -f counts 512-byte blocks, -v KiB);
    elsewhere the shell joins the cgroups and util-linux ``prlimit`` sets the limits (one exec more)."""
    cpu = max(1, math.ceil(limits.cpu_time_s))
    join = f'for f in {" ".join(_sh_quote(p) for p in procs_files)}; do echo $$ > "$f" || exit {_JOIN_FAILED}; done; '
    if not procs_files:
        join = ""
    if os.path.exists(DASH):
        ulimits = [
            f"ulimit -S -t {cpu}",
            f"ulimit -H -t {cpu + 1}",
            f"ulimit -f {-(-limits.file_size_bytes // 512)}",
            f"ulimit -n {limits.open_files}",
            "ulimit -c 0",
        ]
        if not memory_by_cgroup and limits.memory_mib is not None:
            ulimits.append(f"ulimit -v {limits.memory_mib << 10}")
        if not pids_by_cgroup:
            ulimits.append(f"ulimit -p {limits.processes}")
        script = join + " && ".join(ulimits) + f' || exit {_JOIN_FAILED}; exec "$@"'
        return [DASH, "-c", script, "sandbox-launch"]
    prlimit = [
        "prlimit",
        f"--cpu={cpu}:{cpu + 1}",
        f"--fsize={limits.file_size_bytes}",
        f"--nofile={limits.open_files}",
        "--core=0",
    ]
    if not memory_by_cgroup and limits.memory_mib is not None:
        prlimit.append(f"--as={limits.memory_mib << 20}")
    if not pids_by_cgroup:
        prlimit.append(f"--nproc={limits.processes}")
    return ["/bin/sh", "-c", join + 'exec "$@"', "sandbox-launch", *prlimit, "--"]


def _sh_quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


async def _read_capped(
    stream: asyncio.StreamReader, cap: int, overflow: Callable[[], None]
) -> tuple[bytes, bool]:
    buf = bytearray()
    while True:
        chunk = await stream.read(_READ_CHUNK)
        if not chunk:
            return bytes(buf), False
        room = cap - len(buf)
        if len(chunk) > room:
            buf += chunk[:room]
            overflow()
            return bytes(buf), True
        buf += chunk


def _parse_status(raw: bytes) -> dict[str, int]:
    out: dict[str, int] = {}
    text = raw.decode(errors="replace")
    decoder, pos = json.JSONDecoder(), 0
    while pos < len(text):
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            break
        try:
            doc, pos = decoder.raw_decode(text, pos)
        except ValueError:
            break
        if isinstance(doc, dict):
            out.update({k: v for k, v in doc.items() if isinstance(v, int)})
    return out


class _BackendBase:
    _shared: dict[tuple, _BackendBase] = {}
    _cgroup_roots: _CgroupRoots | None = None

    def __init__(self, config: SandboxProviderConfig) -> None:
        self.config = config

    @classmethod
    def shared(cls, config: SandboxProviderConfig) -> _BackendBase:
        key = (cls.__name__, config.model_dump_json())
        if key not in _BackendBase._shared:
            _BackendBase._shared[key] = cls(config)
        return _BackendBase._shared[key]

    @classmethod
    def cgroup_roots(cls) -> dict[str, Path]:
        if _BackendBase._cgroup_roots is None:
            _BackendBase._cgroup_roots = _CgroupRoots()
            roots = _BackendBase._cgroup_roots.roots
            if "pids" not in roots and os.geteuid() == 0:
                LOG.warning(
                    "sandbox: no writable pids cgroup, and RLIMIT_NPROC does not apply to root: "
                    "the process-count limit is NOT enforced"
                )
        return _BackendBase._cgroup_roots.roots

    def check(self) -> None:
        if not os.path.exists(DASH) and shutil.which("prlimit") is None:
            raise SandboxUnavailableError(
                "the sandbox needs `prlimit` (Debian package util-linux): apt-get install util-linux"
            )

    def _command(
        self,
        argv: list[str],
        *,
        host_dir: Path,
        workdir: str,
        cwd: str | None,
        env: dict[str, str],
        status_fd: int,
    ) -> tuple[list[str], dict[str, str] | None, str | None]:
        raise NotImplementedError

    def _base_env(self, home: str) -> dict[str, str]:
        return {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": home,
            "LANG": "C.UTF-8",
            "TMPDIR": "/tmp",
            "PYTHONDONTWRITEBYTECODE": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }

    async def run(
        self,
        argv: list[str],
        *,
        host_dir: Path,
        workdir: str,
        cwd: str | None,
        env: dict[str, str],
        stdin: bytes | None,
        limits: SandboxResources,
    ) -> SandboxExecResult:
        roots = self.cgroup_roots()
        cgroups = _RunCgroups.create(roots, limits)  # a few cgroupfs writes: microseconds
        status_r, status_w = os.pipe()
        os.set_blocking(status_r, False)
        proc: asyncio.subprocess.Process | None = None
        kill_reason: list[str] = []
        try:
            inner, proc_env, proc_cwd = self._command(
                argv, host_dir=host_dir, workdir=workdir, cwd=cwd, env=env, status_fd=status_w
            )
            full = [
                *_launcher_args(
                    limits,
                    cgroups.procs_files(),
                    memory_by_cgroup=cgroups.memory is not None,
                    pids_by_cgroup=cgroups.pids is not None,
                ),
                *inner,
            ]
            try:
                proc = await asyncio.create_subprocess_exec(
                    *full,
                    stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                    env=proc_env if proc_env is not None else {"PATH": "/usr/bin:/bin"},
                    cwd=proc_cwd,
                    pass_fds=(status_w,),
                    start_new_session=True,
                )
            except OSError as exc:
                raise SandboxError(f"cannot start the sandbox ({full[0]}): {exc}") from exc
            finally:
                os.close(status_w)
                status_w = -1

            def kill(reason: str) -> None:
                if not kill_reason:
                    kill_reason.append(reason)
                if proc is not None and proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)

            async def feed() -> None:
                if stdin is None or proc is None or proc.stdin is None:
                    return
                try:
                    proc.stdin.write(stdin)
                    await proc.stdin.drain()
                except (BrokenPipeError, ConnectionResetError):
                    pass
                finally:
                    with contextlib.suppress(Exception):
                        proc.stdin.close()

            cap = limits.output_limit_bytes
            assert proc.stdout is not None and proc.stderr is not None
            out_task = asyncio.ensure_future(_read_capped(proc.stdout, cap, lambda: kill("output_limit")))
            err_task = asyncio.ensure_future(_read_capped(proc.stderr, cap, lambda: kill("output_limit")))
            everything = asyncio.gather(out_task, err_task, feed(), proc.wait())
            try:
                await asyncio.wait_for(asyncio.shield(everything), limits.wall_time_s)
            except TimeoutError:
                kill("timeout")
            if proc.returncode is None or not everything.done():
                # Killed: the pid namespace goes with bwrap; the cgroup sweep gets anything else.
                await asyncio.to_thread(cgroups.destroy, False)
                try:
                    await asyncio.wait_for(asyncio.shield(everything), 10)
                except TimeoutError:
                    everything.cancel()
                    raise SandboxError(
                        "the sandboxed program's output pipes stayed open after it was killed"
                    ) from None
            (stdout, out_trunc), (stderr, err_trunc), _, outer_rc = everything.result()
            status = b""
            with contextlib.suppress(BlockingIOError, OSError):
                while chunk := os.read(status_r, 65536):
                    status += chunk
            return self._result(
                status=_parse_status(status),
                outer_rc=outer_rc,
                stdout=stdout,
                stderr=stderr,
                out_trunc=out_trunc,
                err_trunc=err_trunc,
                kill_reason=kill_reason[0] if kill_reason else None,
                cgroups=cgroups,
                limits_cpu=math.ceil(limits.cpu_time_s),
            )
        finally:
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            if status_w >= 0:
                os.close(status_w)
            os.close(status_r)
            if not cgroups.try_remove_empty():
                # The tree is dead or dying (bwrap is gone, so is its pid namespace); its last tasks may
                # still be exiting. Sweep and remove the cgroups in the background: the result is ready.
                task = asyncio.ensure_future(asyncio.to_thread(cgroups.destroy))
                _BACKGROUND.add(task)
                task.add_done_callback(_BACKGROUND.discard)
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(proc.wait(), 5)

    def _program_rc(
        self, status: dict[str, int], outer_rc: int, stderr: bytes, kill_reason: str | None
    ) -> int:
        raise NotImplementedError

    def _check_started(self, rc: int, stderr: bytes, cgroups: _RunCgroups, kill_reason: str | None) -> None:
        """Raise SandboxError if the sandbox failed before the program started (backend-specific)."""

    def _result(
        self,
        *,
        status: dict[str, int],
        outer_rc: int,
        stdout: bytes,
        stderr: bytes,
        out_trunc: bool,
        err_trunc: bool,
        kill_reason: str | None,
        cgroups: _RunCgroups,
        limits_cpu: float,
    ) -> SandboxExecResult:
        if outer_rc == _JOIN_FAILED and "child-pid" not in status and kill_reason is None:
            raise SandboxError(
                f"the sandbox could not join its cgroups or set its limits: {stderr.decode(errors='replace')[-500:]}"
            )
        rc = self._program_rc(status, outer_rc, stderr, kill_reason)
        self._check_started(rc, stderr, cgroups, kill_reason)
        oom = cgroups.oom_killed() or (
            cgroups.memory is None and b"MemoryError" in stderr[-4000:] and rc != 0
        )
        cpu_used = cgroups.cpu_time_s()
        # SIGXCPU at the soft CPU limit; SIGKILL at the hard one (soft + 1 s) if the program handled SIGXCPU.
        cpu_out = rc == 128 + signal.SIGXCPU or (
            rc == 128 + signal.SIGKILL and not oom and cpu_used is not None and cpu_used >= limits_cpu
        )
        timed_out = kill_reason == "timeout" or cpu_out
        error_type = None
        if timed_out:
            error_type = "timeout"
        elif oom:
            error_type = "oom"
        elif kill_reason == "output_limit":
            error_type = "output_limit"
        return SandboxExecResult(
            stdout=stdout.decode(errors="replace"),
            stderr=stderr.decode(errors="replace"),
            return_code=rc,
            error_type=error_type,
            timed_out=timed_out,
            oom_killed=oom,
            pids_limit_hit=cgroups.pids_limit_hit(),
            stdout_truncated=out_trunc,
            stderr_truncated=err_trunc,
            cpu_time_s=cpu_used,
        )


class BubblewrapBackend(_BackendBase):
    _binds_cache: list[str] | None = None
    _checked_for_path: str | None = None  # the PATH under which check() last passed

    def check(self) -> None:
        if self._checked_for_path is not None and self._checked_for_path == os.environ.get("PATH", ""):
            return
        self._check()
        self._checked_for_path = os.environ.get("PATH", "")

    def _check(self) -> None:
        if shutil.which("bwrap") is None:
            raise SandboxUnavailableError(
                "the sandbox needs bubblewrap, which is not installed: install the Debian package `bubblewrap` "
                "(apt-get install bubblewrap; .ci/run does it). Running model code WITHOUT a sandbox needs the "
                "explicit opt-in `sandbox: {backend: unsafe_local_subprocess}`."
            )
        super().check()
        if not Path(self.config.python).exists():
            raise SandboxUnavailableError(
                f"the sandbox's Python {self.config.python!r} does not exist: install Debian's python3 with "
                "apt-get install python3 python3-numpy python3-sympy python3-scipy, or set sandbox.python"
            )
        if os.geteuid() == 0 and "pids" not in self.cgroup_roots():
            # A root-run sandbox without a pids cgroup has no process limit at all (RLIMIT_NPROC does not
            # apply to root): a fork bomb would take the machine. Refuse rather than run unbounded.
            raise SandboxUnavailableError(
                "the sandbox cannot limit processes here: it runs as root and found no writable pids cgroup "
                "(cgroup v1 /sys/fs/cgroup/pids/...), and RLIMIT_NPROC does not apply to root. Make that "
                "hierarchy writable, or run the servers as a non-root user"
            )

    @classmethod
    def _system_binds(cls) -> list[str]:
        if cls._binds_cache is None:
            args = ["--ro-bind", "/usr", "/usr"]
            for top in ("/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32"):
                p = Path(top)
                if p.is_symlink():
                    args += ["--symlink", os.readlink(p), top]
                elif p.is_dir():
                    args += ["--ro-bind", top, top]
            for etc in ("/etc/alternatives", "/etc/ld.so.cache", "/etc/localtime"):
                if Path(etc).exists():
                    args += ["--ro-bind", etc, etc]
            cls._binds_cache = args
        return cls._binds_cache

    def _command(self, argv, *, host_dir, workdir, cwd, env, status_fd):
        home = workdir
        setenv: list[str] = []
        for key, value in {**self._base_env(home), **env}.items():
            setenv += ["--setenv", key, value]
        extra: list[str] = []
        for path in self.config.ro_binds:
            extra += ["--ro-bind", path, path]
        program = list(argv)
        if program[0] in ("python", "python3"):
            program[0] = self.config.python
        command = [
            "bwrap",
            "--unshare-all",
            "--unshare-user",
            "--disable-userns",
            "--uid",
            str(SANDBOX_UID),
            "--gid",
            str(SANDBOX_UID),
            "--die-with-parent",
            "--new-session",
            "--cap-drop",
            "ALL",
            "--hostname",
            "sandbox",
            *self._system_binds(),
            *extra,
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--size",
            str(self._tmp_bytes),
            "--tmpfs",
            "/tmp",
            "--bind",
            str(host_dir),
            workdir,
            "--remount-ro",
            "/",
            "--chdir",
            cwd or workdir,
            "--clearenv",
            *setenv,
            "--json-status-fd",
            str(status_fd),
            "--",
            *program,
        ]
        return command, None, "/"

    _tmp_bytes = 64 << 20

    async def run(self, argv, *, host_dir, workdir, cwd, env, stdin, limits):
        self._tmp_bytes = limits.tmp_size_mib << 20
        return await super().run(
            argv, host_dir=host_dir, workdir=workdir, cwd=cwd, env=env, stdin=stdin, limits=limits
        )

    def _check_started(self, rc, stderr, cgroups, kill_reason):
        # bwrap reports a set-up failure (e.g. a bind source missing) as exit code 1 with "bwrap: ..." on
        # stderr, which a program could print too. Only bwrap's two processes ever existed in the run's
        # pids cgroup if the program never started (outer bwrap + namespace init; the program is a third).
        if rc != 1 or not stderr.startswith(b"bwrap: ") or kill_reason is not None:
            return
        peak = cgroups.peak_processes()
        if peak is None or peak <= 2:
            raise SandboxError(
                f"bubblewrap could not start the sandbox: {stderr.decode(errors='replace')[:800]}"
            )

    def _program_rc(self, status, outer_rc, stderr, kill_reason):
        if "exit-code" in status:
            return status["exit-code"]
        if kill_reason is not None:
            return 128 + signal.SIGKILL  # we killed it (timeout / output cap)
        if "child-pid" not in status:
            raise SandboxError(
                f"bubblewrap could not start the sandbox (exit {outer_rc}): {stderr.decode(errors='replace')[-800:]}"
            )
        # bwrap itself died without reporting: the memory cgroup's OOM killer or the CPU limit got it.
        return 128 - outer_rc if outer_rc < 0 else outer_rc


class UnsafeLocalBackend(_BackendBase):
    """NO ISOLATION. Only for machines without bubblewrap, by explicit opt-in."""

    def _command(self, argv, *, host_dir, workdir, cwd, env, status_fd):
        program = list(argv)
        if program[0] in ("python", "python3"):
            program[0] = self.config.python
        run_cwd = str(host_dir / cwd.removeprefix(workdir).lstrip("/")) if cwd else str(host_dir)
        return program, {**self._base_env(str(host_dir)), "TMPDIR": str(host_dir), **env}, run_cwd

    def _program_rc(self, status, outer_rc, stderr, kill_reason):
        if kill_reason is not None and outer_rc < 0:
            return 128 - outer_rc
        return 128 - outer_rc if outer_rc < 0 else outer_rc
