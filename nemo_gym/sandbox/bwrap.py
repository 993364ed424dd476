"""The bubblewrap sandbox backend (isolated), its pool of pre-started sandboxes, and this package's
backend names.

Contract
--------
* ``BubblewrapBackend.run(argv, ...)`` runs ``argv`` under ``bwrap`` with: every namespace unshared (no
  network: only a down-or-empty loopback of its own; its own pid namespace, so it sees and can signal only
  its own processes), a user namespace in which it is uid/gid 65534 with no capabilities and no further
  user namespaces, ``/usr`` (and the merged-usr links, ``/etc/alternatives``, ``/etc/ld.so.cache``) bound
  READ-ONLY and nothing else of the host (no repo, no /root, no /home, no /etc/passwd), a read-only root,
  a fresh /proc and a read-only /dev with a size-capped tmpfs /dev/shm, a size-capped tmpfs /tmp, the work dir bound read-write at ``spec.workdir`` (the
  only writable places), its own hostname (UTS namespace), and an environment of
  only PATH/HOME/LANG/TMPDIR/thread-count variables plus what the caller passes.
* Limits: RLIMIT_CPU (then SIGXCPU/SIGKILL), RLIMIT_FSIZE, RLIMIT_NOFILE, no core files; the process count
  and memory through per-run cgroups (:mod:`nemo_gym.sandbox.cgroups`: v1 ``pids`` and ``memory``, plus
  ``cpuacct`` to report the tree's CPU time; or one v2 dir with ``pids.max`` and ``memory.max`` in a
  delegated subtree, :mod:`nemo_gym.sandbox.cgroups_v2`; a memory cgroup OOM-kills the tree and
  ``oom_kill`` reports it). :meth:`check` picks the mode (logged with its reason). Without a writable cgroup: RLIMIT_AS for memory, RLIMIT_NPROC for processes; as root (where
  RLIMIT_NPROC does nothing) the bubblewrap backend then REFUSES to run (:class:`SandboxUnavailableError`).
* The whole tree dies at the end, always: the outer ``bwrap`` is SIGKILLed on wall timeout / output cap /
  cancellation, its inner init dies with it (``--die-with-parent``), and the kernel kills every process of
  the pid namespace; then every pid left in the run's cgroups is SIGKILLed and the cgroups removed.
* The program's exit status comes from bwrap's ``--json-status-fd`` (written by bwrap, not reachable from
  the sandbox). A sandbox that never started (no ``child-pid`` status, or bwrap's own ``bwrap: ...`` set-up
  error while the run's pids cgroup never held more than bwrap's two processes) raises
  :class:`SandboxError` with bwrap's message: an infrastructure failure, not the program's. A program
  printing ``bwrap: ...`` itself is still the program's failure.
* One fresh sandbox per run, started ahead (``sandbox.prestart``, default on; the sandbox itself is
  :mod:`nemo_gym.sandbox.warm`): while a run runs, the starter thread starts the next run's sandbox. A run
  takes an idle one (:meth:`BubblewrapBackend.take_warm`), which leaves the pool for good; the caller's work
  dir is renamed into its dir. At most one sandbox per pool slot waits idle (one of another work dir or
  /tmp size makes room); idle ones are killed and removed at exit (:func:`_close_all_idle`). Without an
  idle one (first run, a second run at once in one work dir, another /tmp size) the same sandbox is
  started at the run, bound to the work dir directly. Without dash (non-Debian) each run uses the
  one-shot launcher (:mod:`nemo_gym.sandbox.launch`, ``prlimit``). If pre-starting fails, runs still
  work (each starts its own) and pre-starting pauses for a minute.
* ``_CLEANUP`` / ``_STARTER`` are looked up in :mod:`nemo_gym.sandbox.workers` at each access (a forked
  child rebinds them).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from nemo_gym.sandbox import workers
from nemo_gym.sandbox.backend_base import _BackendBase
from nemo_gym.sandbox.errors import SandboxError, SandboxUnavailableError
from nemo_gym.sandbox.launch import DASH
from nemo_gym.sandbox.slots import sandbox_pool_size
from nemo_gym.sandbox.spec import SandboxResources
from nemo_gym.sandbox.trees import remove_tree
from nemo_gym.sandbox.warm import _PRESTART_PREFIX, _SWEPT, _sweep_dead_owners_dirs, _WarmSandbox

LOG = logging.getLogger("nemo_gym.sandbox")

SANDBOX_UID = 65534


def __getattr__(name: str) -> Any:  # the executors live in workers, rebound in a forked child
    if name in ("_CLEANUP", "_STARTER"):
        return getattr(workers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
        roots = self.cgroup_roots()  # picks the cgroup mode now: the start-up log says which and why
        if os.geteuid() == 0 and "pids" not in roots:
            # A root-run sandbox without a pids cgroup has no process limit at all (RLIMIT_NPROC does not
            # apply to root): a fork bomb would take the machine. Refuse rather than run unbounded.
            driver = self.cgroup_driver()
            raise SandboxUnavailableError(
                "the sandbox cannot limit processes here: it runs as root and found no writable pids cgroup, "
                f"and RLIMIT_NPROC does not apply to root (cgroup mode {driver.mode}: {driver.reason}). On "
                "cgroup v1 make /sys/fs/cgroup/pids/... writable; on cgroup v2 start the servers in a delegated "
                "scope (`systemd-run --scope -p Delegate=yes ng_run ...`); or run the servers as a non-root user"
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

    def _bwrap_argv(
        self,
        program: list[str],
        *,
        bind_dir: Path,
        workdir: str,
        chdir: str,
        env: dict[str, str],
        status_fd: int,
        tmp_bytes: int,
        extra_ro_binds: tuple[tuple[str, str], ...] = (),
        files: tuple[tuple[int, str], ...] = (),
    ) -> list[str]:
        """``extra_ro_binds``: (host path, sandbox path) pairs bound read-only (a session's ``binds``).
        They and ``ro_binds`` are bound after ``/tmp``'s tmpfs, so a host path under /tmp (a repository
        checked out there, a venv) is seen at its own path, on top of the sandbox's /tmp. ``files``: (fd,
        sandbox path) pairs: bubblewrap copies what the fd holds into a file of the sandbox's own root
        (read-only with it; a session's agent program): no mount of its own, so no host path in
        ``/proc/self/mountinfo``, as a bind would show."""
        setenv: list[str] = []
        for key, value in {**self._base_env(workdir), **env}.items():
            setenv += ["--setenv", key, value]
        extra: list[str] = []
        for path in self.config.ro_binds:
            extra += ["--ro-bind", path, path]
        for source, target in extra_ro_binds:
            extra += ["--ro-bind", source, target]
        for fd, target in files:
            extra += ["--file", str(fd), target]
        return [
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
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            # /dev/shm (POSIX shared memory: multiprocessing's locks and queues) a tmpfs capped as /tmp is,
            # and the rest of /dev read-only: bubblewrap's /dev is an unbounded tmpfs a program could fill,
            # memory no rlimit bounds (only a memory cgroup charges it).
            "--size",
            str(tmp_bytes),
            "--tmpfs",
            "/dev/shm",
            "--remount-ro",
            "/dev",
            "--size",
            str(tmp_bytes),
            "--tmpfs",
            "/tmp",
            *extra,  # after /tmp's tmpfs: a host path under /tmp stays visible at its own path
            "--bind",
            str(bind_dir),
            workdir,
            "--remount-ro",
            "/",
            "--chdir",
            chdir,
            "--clearenv",
            *setenv,
            "--json-status-fd",
            str(status_fd),
            "--",
            *program,
        ]

    def _program_argv(self, argv: list[str]) -> list[str]:
        program = list(argv)
        if program[0] in ("python", "python3"):
            program[0] = self.config.python
        return program

    def _command(self, argv, *, host_dir, workdir, cwd, env, status_fd):
        command = self._bwrap_argv(
            self._program_argv(argv),
            bind_dir=host_dir,
            workdir=workdir,
            chdir=cwd or workdir,
            env=env,
            status_fd=status_fd,
            tmp_bytes=self._tmp_bytes,
        )
        return command, None, "/"

    _tmp_bytes = 64 << 20

    # -- pre-started sandboxes -------------------------------------------------------------------

    _idle_lock = threading.Lock()  # the idle list is filled from the starter thread

    def _idle_list(self) -> list[_WarmSandbox]:
        idle = self.__dict__.setdefault("_idle", [])
        if idle and idle[0].owner_pid != os.getpid():  # a forked child: those are its parent's
            idle.clear()
        return idle

    def take_warm(self, workdir: str, limits: SandboxResources) -> _WarmSandbox | None:
        """An idle pre-started sandbox for ``workdir`` and these limits' /tmp size, removed from the pool
        (it serves exactly one run), or None. Its fresh, empty ``bind_dir`` is to become the run's work dir."""
        if not self.config.prestart or not os.path.exists(DASH):
            return None
        key = (workdir, limits.tmp_size_mib << 20)
        while True:
            with self._idle_lock:
                idle = self._idle_list()
                warm = next((w for w in idle if w.key == key), None)
                if warm is None:
                    return None
                idle.remove(warm)
            if warm.alive():
                return warm
            warm.discard()  # died while idle (killed from outside): never hand it a run

    def refill(self, workdir: str, limits: SandboxResources) -> None:
        """Start one sandbox ahead for a next run, unless as many are idle as the pool has slots."""
        if not self.config.prestart or not os.path.exists(DASH):
            return
        key = (workdir, limits.tmp_size_mib << 20)
        with self._idle_lock:
            idle = self._idle_list()
            other = None
            if len(idle) >= sandbox_pool_size():
                other = next((w for w in idle if w.key != key), None)
                if other is None:
                    return
                idle.remove(other)  # make room: the oldest idle sandbox of another shape goes
        if other is not None:
            other.discard()
        if time.monotonic() < self.__dict__.get("_prestart_paused_until", 0.0):
            return
        root = Path(self.config.workdir_root or tempfile.gettempdir())
        if root not in _SWEPT:
            _SWEPT.add(root)
            _sweep_dead_owners_dirs(root)
        try:
            bind_dir = Path(tempfile.mkdtemp(prefix=f"{_PRESTART_PREFIX}{os.getpid()}-", dir=root))
            try:
                warm = _WarmSandbox(self, bind_dir, workdir, limits, owns_dir=True)
            except BaseException:
                remove_tree(bind_dir)
                raise
        except (OSError, SandboxError) as exc:
            # Runs still work (each starts its own sandbox, and reports a real failure); retry in a minute.
            self._prestart_paused_until = time.monotonic() + 60
            LOG.warning("sandbox: cannot pre-start a sandbox under %s (retrying in 60 s): %s", root, exc)
            return
        with self._idle_lock:
            self._idle_list().append(warm)
        if not _WarmSandbox.atexit_registered:
            _WarmSandbox.atexit_registered = True
            atexit.register(_close_all_idle)

    def _schedule_refill(self, workdir: str, limits: SandboxResources) -> None:
        if self.config.prestart:  # refill() itself keeps the idle count within the pool's slots
            with contextlib.suppress(RuntimeError):  # RuntimeError: the interpreter is shutting down
                workers._STARTER.submit(self.refill, workdir, limits)

    def close_idle(self) -> None:
        """Kill every idle pre-started sandbox of this backend (at exit; tests)."""
        with self._idle_lock:
            idle = self._idle_list()
            gone, idle[:] = list(idle), []
        for warm in gone:
            warm.discard()

    async def run(self, argv, *, host_dir, workdir, cwd, env, stdin, limits, warm=None):
        self._tmp_bytes = limits.tmp_size_mib << 20
        if not os.path.exists(DASH):  # no dash: the one-shot launcher (util-linux prlimit)
            return await super().run(
                argv, host_dir=host_dir, workdir=workdir, cwd=cwd, env=env, stdin=stdin, limits=limits
            )
        if warm is None or warm.key != (workdir, self._tmp_bytes) or warm.bind_dir != host_dir:
            if warm is not None:
                warm.discard()
            warm = _WarmSandbox(self, host_dir, workdir, limits, owns_dir=False)  # started now
        warm.owns_dir = False  # its dir is the caller's work dir from now on
        # The next run's sandbox starts while this one runs (after this run's hand-over has begun).
        self._schedule_refill(workdir, limits)
        try:
            return await warm.run(argv, cwd=cwd, env=env, stdin=stdin, limits=limits)
        finally:
            warm.release()

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


def _close_all_idle() -> None:
    for backend in list(_BackendBase._shared.values()):
        if isinstance(backend, BubblewrapBackend):
            backend.close_idle()
