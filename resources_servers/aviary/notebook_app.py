"""A notebook data-analysis environment on ``aviary-notebook`` (``NBEnvironment``) with a local kernel.

Contract
--------
* Tasks come from a JSONL file (default ``data/notebook_tasks.jsonl``) of ``{"id", "question",
  "answer"}``; the CSV files the questions name live in ``files_dir`` (default
  ``data/notebook_files/``). The answer is a number (checked with relative tolerance ``rel_tol``,
  default 1e-6: rounding noise) or a string (checked case- and space-insensitively).
* Tools: Aviary's ``edit_cell`` (write a code cell; it runs at once) and ``list_workdir``, plus
  ``submit_answer(answer)``, which ends the episode: reward 1.0 if right, 0.0 if not. Aviary runs every
  call of a model turn; once one has ended the episode, the later ones (a second answer, a cell) are not
  run and say so (:data:`EPISODE_ENDED`, and the base server's ``answer_tools``): one answer per
  episode, whatever the turn holds. Every observation ends with Aviary's Markdown view of the notebook,
  marked as environment state (``is_env_state``), which ``aviary_agent``'s ``collapse_old_env_states``
  can collapse.
* The kernel (an ipykernel of this interpreter) runs model-written code in its own process, never
  in the server: inside bubblewrap when available (``kernel_sandbox``; :func:`bwrap_argv`: only the
  system files and the Python environment, read-only, so no repository and no task file; no network;
  its own pid namespace, no capabilities; private /tmp), in a throw-away working directory (a fresh copy
  of ``files_dir``, removed on close), in its own process group, with rlimits (address space, CPU
  seconds, file size, open files) and ``PR_SET_PDEATHSIG`` so it dies with the server process however
  that dies, and in cgroups of its whole tree (``KernelLimits.processes``, ``KernelLimits.memory_mib``;
  as root without a pids cgroup no kernel starts). Closing the env (or the server's idle reaper, or
  server shutdown) shuts the kernel down, then kills its process group and everything left in its
  cgroup. The server keeps at most ``KernelLimits.output_chars`` of one cell run's output
  (:class:`BoundedOutputClient`) and no kernel message larger than ``MAX_KERNEL_MESSAGE_BYTES``; a cell
  past that output or past ``cell_timeout_s`` is interrupted (a message on the kernel's control channel)
  and becomes a tool error. The kernel's /tmp and /dev/shm are tmpfs of ``KernelLimits.tmp_size_mib``.
* The work dir's disk quota (``KernelLimits.work_dir_quota_mib``): what the cells add to the work dir
  (and the kernel's ipc dir) beyond the task's files is counted while the kernel lives, every 0.5 s and
  after each cell (:mod:`nemo_gym.sandbox.disk_quota`). Past it the running cell is interrupted (a note
  in its output, and a tool error); one that does not stop within a second has its kernel killed, and so
  has a kernel in which something keeps writing while no cell runs (:attr:`LimitedNBEnvironmentState.
  disk_killed`: later cells fail saying why). A dir left over the quota stops nothing until it grows
  again, so the model can delete files and go on.
* Files: each episode's dirs lie under one dir per server process (:func:`_kernels_root`, named with its
  pid; a dead process's are removed by the next one): ``work`` (the kernel's, bound into its sandbox),
  ``ipc`` (its sockets) and ``notebook`` (the notebook file and its Markdown view, read and written by
  the server only, never where a cell could put a link the server would follow). ``list_workdir`` never
  follows a link and is bounded (:func:`_list_dir`). Closing the env removes them all.
"""

from __future__ import annotations

import os

# Aviary imports LiteLLM, which fetches a price list over the network at import unless told not to.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import asyncio  # noqa: E402
import atexit  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import resource  # noqa: E402
import shutil
import signal
import stat
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, Self

import nbformat
import zmq
from jupyter_client.kernelspec import NATIVE_KERNEL_NAME
from jupyter_client.manager import AsyncKernelManager
from pydantic import BaseModel, Field, PrivateAttr, model_validator

from aviary.core import Message, Messages, TaskDataset, Tool
from aviary.envs.notebook import NBEnvironment
from aviary.envs.notebook.env import NBEnvironmentState
from nemo_gym.sandbox import disk_quota, trees
from nemo_gym.sandbox.warm import _sweep_dead_owners_dirs
from nemo_gym.sandbox.workers import remove_dir_later
from resources_servers.aviary.app import AviaryResourcesServer, resolve_data_path
from resources_servers.aviary.offline import DatasetFileError, tool_of
from resources_servers.aviary.schemas import AviaryResourcesServerConfig

logger = logging.getLogger(__name__)


# Every episode's dirs live under one dir per server process, named with its pid: what a killed server's
# kernels wrote is removed by the next process that starts one (the kernels themselves die with it).
_KERNELS_PREFIX = "nemo-gym-kernels-"  # + owner pid + "-"
_KERNELS_ROOT: dict[int, Path] = {}


def _kernels_root() -> Path:
    """This process's dir for its episodes' dirs, under the temp dir (made once per process, removed at
    exit). The dirs of processes that died without cleaning up are removed first (in the sandbox's
    clean-up thread)."""
    pid = os.getpid()
    root = _KERNELS_ROOT.get(pid)
    if root is None or not root.is_dir():
        base = Path(tempfile.gettempdir())
        _sweep_dead_owners_dirs(base, _KERNELS_PREFIX)
        root = Path(tempfile.mkdtemp(prefix=f"{_KERNELS_PREFIX}{pid}-", dir=base))
        _KERNELS_ROOT[pid] = root
        atexit.register(trees.remove_tree, root)
    return root


# One thread, alive as long as the process, that starts every kernel process (see _async_launch_kernel).
_KERNEL_LAUNCHER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kernel-launch")


class SandboxedKernelManager(AsyncKernelManager):
    """A kernel manager whose kernel command can be wrapped (in bubblewrap), and whose clients keep a
    bounded part of a cell's output (``output_chars``, :class:`BoundedOutputClient`)."""

    def client(self, **kwargs: Any) -> Any:
        client = super().client(**kwargs)
        limit = getattr(self, "output_chars", None)
        return BoundedOutputClient(client, limit) if limit else client

    def format_kernel_cmd(self, extra_arguments: list[str] | None = None) -> list[str]:
        cmd = super().format_kernel_cmd(extra_arguments)
        return [*getattr(self, "wrapper_argv", []), *cmd]

    async def _async_launch_kernel(self, kernel_cmd: list[str], **kw: Any) -> None:
        """Start the kernel process on the launcher thread, not on the event loop: jupyter_client's
        ``Popen`` (fork and exec of the server's large process, with a ``preexec_fn``) blocks for
        0.1-0.2 s, more under load, and stalled every other request of the server. The thread never
        exits before the process does: the kernel's ``PR_SET_PDEATHSIG`` (and bubblewrap's
        ``--die-with-parent``) fire when the *thread* that forked it exits."""
        launch = super()._async_launch_kernel
        await asyncio.get_running_loop().run_in_executor(
            _KERNEL_LAUNCHER, lambda: asyncio.run(launch(kernel_cmd, **kw))
        )


def _python_dirs() -> list[str]:
    """Where the kernel's interpreter and its packages live (resolved): the virtual environment and the
    Python it was made from. Not this repository, whose task files hold the answers."""
    import sys

    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix}
    return sorted({str(Path(d).resolve()) for d in dirs})


def _system_binds() -> list[str]:
    """The host's system files a Python kernel needs, read-only: /usr, the /bin and /lib links or dirs, the
    loader cache, the alternatives links and the local time zone. Nothing else of /etc, /root or /home."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32"):
        path = Path(top)
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), top]
        elif path.is_dir():
            args += ["--ro-bind", top, top]
    for etc in ("/etc/alternatives", "/etc/ld.so.cache", "/etc/localtime"):
        if Path(etc).exists():
            args += ["--ro-bind", etc, etc]
    return args


def bwrap_argv(work_dir: Path, ipc_dir: Path, tmp_bytes: int = 256 << 20) -> list[str]:
    """bubblewrap around the kernel: only the system files and the Python environment, read-only (no
    repository, no task file, no home directory); writable ``work_dir`` and ``ipc_dir`` (ZMQ over Unix
    sockets there, where the connection file is too), a private /tmp and /dev/shm (tmpfs of
    ``tmp_bytes`` each; the rest of /dev read-only: bubblewrap's own /dev is a tmpfs without a bound); no
    network; its own pid namespace (it sees and can signal its own processes only, and they all die
    with it), no capabilities, no further user namespaces; dies with its parent."""
    binds: list[str] = []
    for path in _python_dirs():
        binds += ["--ro-bind", path, path]
    return [
        shutil.which("bwrap") or "bwrap",
        *_system_binds(),
        "--proc", "/proc",
        "--dev", "/dev",
        "--size", str(tmp_bytes),
        "--tmpfs", "/dev/shm",
        "--remount-ro", "/dev",
        "--size", str(tmp_bytes),
        "--tmpfs", "/tmp",
        *binds,  # after the tmpfs: a Python environment under /tmp (a CI clone) stays visible
        "--bind", str(work_dir), str(work_dir),
        "--bind", str(ipc_dir), str(ipc_dir),
        "--remount-ro", "/",
        "--unshare-user",
        "--unshare-ipc",
        "--unshare-net",
        "--unshare-uts",
        "--unshare-pid",
        "--unshare-cgroup-try",
        "--disable-userns",
        "--cap-drop", "ALL",
        "--die-with-parent",
        "--new-session",
        # ipykernel exits when its parent is pid 1 unless told its parent is pid 1: in the kernel's pid
        # namespace its parent is bubblewrap's init, pid 1. It dies with that init anyway.
        "--setenv", "JPY_PARENT_PID", "1",
        "--chdir", str(work_dir),
        "--",
    ]  # fmt: skip


class KernelLimits(BaseModel):
    """Limits applied to each kernel (``setrlimit`` before it starts; the process count by a pids cgroup
    of its whole tree; the output by what the server keeps of it)."""

    address_space_bytes: int = Field(default=2 * 1024**3, gt=0)
    cpu_seconds: int = Field(default=600, gt=0)
    file_size_bytes: int = Field(default=256 * 1024**2, gt=0)
    open_files: int = Field(default=512, gt=0)
    processes: int = Field(
        default=512,
        gt=0,
        description="Processes and threads of the kernel's tree at once (a pids cgroup, where the machine has one)",
    )
    memory_mib: int = Field(
        default=4096,
        gt=0,
        description="Memory of the kernel's whole tree (a memory cgroup, where there is one)",
    )
    output_chars: int = Field(
        default=1_000_000,
        gt=0,
        description="What the server keeps of one cell run's output (each output counts 200 more); the rest "
        "is dropped with a note",
    )
    work_dir_quota_mib: int = Field(
        default=1024,
        gt=0,
        description="What the kernel's work dir may hold, all files together (each counts its size, and at "
        "least 4 KiB): a cell that writes past it is interrupted, a writer left running without a cell "
        "gets the kernel killed",
    )
    tmp_size_mib: int = Field(
        default=256, gt=0, description="Size of the sandboxed kernel's /tmp and /dev/shm (tmpfs: memory)"
    )


def _kernel_preexec(limits: KernelLimits, procs_files: list[str] | None = None) -> Any:
    """A ``preexec_fn`` for the kernel: die with the server, join the kernel's cgroups (``procs_files``),
    then apply the rlimits."""

    def apply() -> None:
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
        for path in procs_files or []:  # checked after the start (LimitedNBEnvironmentState.start_kernel)
            try:
                with open(path, "w") as f:
                    f.write(str(os.getpid()))
            except OSError:
                pass
        resource.setrlimit(resource.RLIMIT_AS, (limits.address_space_bytes,) * 2)
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds,) * 2)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_size_bytes,) * 2)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files,) * 2)

    return apply


def _kernel_cgroup(limits: KernelLimits) -> Any:
    """Fresh cgroups for one kernel's process tree, ``pids.max`` = ``limits.processes`` and the memory
    bound ``limits.memory_mib`` (the sandbox's cgroup driver: :mod:`nemo_gym.sandbox.cgroups`); None where
    this machine gives no pids cgroup and the server is not root (then only the process group bounds the
    tree). A model's cell can fork (a fork bomb would take the host's process table), allocate in many
    processes (RLIMIT_AS bounds each, not their sum), and its children can leave the kernel's process group
    (``setsid``): the cgroup holds the count and the memory, and closing the kernel kills everything in it.
    As root without a pids cgroup nothing would bound a fork bomb (RLIMIT_NPROC does not apply to root):
    no kernel starts then, as no sandboxed program does (docs/sandbox.md)."""
    from nemo_gym.sandbox.backend_base import _BackendBase
    from nemo_gym.sandbox.errors import SandboxError, SandboxUnavailableError
    from nemo_gym.sandbox.spec import SandboxResources

    problem = kernel_cgroup_problem()
    if problem:
        raise SandboxUnavailableError(problem)
    driver = _BackendBase.cgroup_driver()
    if "pids" not in driver.roots:
        return None
    try:
        return driver.create(SandboxResources(memory_mib=limits.memory_mib, processes=limits.processes))
    except SandboxError as e:
        logger.warning("the kernel runs without its cgroups: %s", e)
        return None


def kernel_cgroup_problem() -> str | None:
    """Why sandboxed kernels cannot be bounded in processes here (None: they can)."""
    from nemo_gym.sandbox.backend_base import _BackendBase

    driver = _BackendBase.cgroup_driver()
    if "pids" not in driver.roots and os.geteuid() == 0:
        return (
            "the notebook kernel cannot be limited in processes here: the server runs as root and found no "
            f"writable pids cgroup (cgroup mode {driver.mode}: {driver.reason}); see docs/sandbox.md"
        )
    return None


_OUTPUT_TYPES = frozenset({"stream", "execute_result", "display_data", "error"})
_OUTPUT_OVERHEAD = 200  # what one output costs the server beyond its text (a NotebookNode)


class BoundedOutputClient:
    """A kernel client that keeps at most ``limit`` characters of one cell run's output (Aviary's
    notebook runner stores every output message of a cell in the server's memory, and a cell can print
    gigabytes): once past it, the run's further outputs are dropped and one note says so. Everything else
    is the wrapped client's."""

    def __init__(self, client: Any, limit: int) -> None:
        self._client, self._limit = client, limit
        self._used, self._msg_id, self._noted = 0, None, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    @property
    def overflowed(self) -> bool:
        """Whether this cell run's output passed the limit (its later outputs are being dropped)."""
        return self._noted

    def execute(self, *args: Any, **kwargs: Any) -> str:
        self._msg_id = self._client.execute(*args, **kwargs)
        self._used, self._noted = 0, False
        return self._msg_id

    async def get_iopub_msg(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        while True:
            msg = await self._client.get_iopub_msg(*args, **kwargs)
            if msg["msg_type"] not in _OUTPUT_TYPES or msg["parent_header"].get("msg_id") != self._msg_id:
                return msg
            self._used += _OUTPUT_OVERHEAD + _output_chars(msg["content"])
            if self._used <= self._limit:
                return msg
            if not self._noted:  # once: the note in place of this output; later ones are dropped
                self._noted = True
                note = f"\n[... the output past {self._limit} characters was not kept ...]\n"
                return {**msg, "msg_type": "stream", "content": {"name": "stderr", "text": note}}


_LIST_MAX_ENTRIES = 1000  # what list_workdir shows at most
_LIST_MAX_DEPTH = 16


class _ListFull(Exception):
    pass


def _list_dir(root: Path) -> dict[str, Any]:
    """The work dir as Aviary's ``list_workdir`` shows it (``{"files": [...], "directories": {}, "<dir>":
    {...}}``), walked on the host by directory fds (:func:`nemo_gym.sandbox.trees.walk_paths`): never
    through a symlink (a link is listed by its name, as a file: Aviary's listing followed a link a cell
    made to any dir of the host), at most :data:`_LIST_MAX_ENTRIES` entries and :data:`_LIST_MAX_DEPTH`
    levels (a note says what was left out)."""
    top: dict[str, Any] = {}
    index: dict[str, dict[str, Any]] = {"": top}
    count = 0

    def visit(_fd: int, rel: str, st: os.stat_result) -> bool:
        nonlocal count
        parent_rel, _, name = rel.rpartition("/")
        parent = index.get(parent_rel)
        if parent is None:
            return False
        if count >= _LIST_MAX_ENTRIES:
            raise _ListFull
        count += 1
        if not stat.S_ISDIR(st.st_mode):
            parent.setdefault("files", []).append(name)
            return False
        parent.setdefault("directories", {})
        if rel.count("/") + 1 >= _LIST_MAX_DEPTH:
            parent[name] = {"...": f"not listed: deeper than {_LIST_MAX_DEPTH} levels"}
            return False
        parent[name] = index[rel] = {}
        return True

    try:
        trees.walk_paths(root, visit)
    except _ListFull:
        top["..."] = f"not listed: the entries past the first {_LIST_MAX_ENTRIES}"
    except OSError as exc:  # the tree changed under the walk: what was seen
        top["..."] = f"not listed: the rest ({exc.strerror or exc})"
    return top


def _output_chars(content: dict[str, Any]) -> int:
    if "text" in content:
        return len(str(content["text"]))
    parts = [*(content.get("data") or {}).values(), *(content.get("traceback") or [])]
    return sum(len(str(p)) for p in parts) + len(str(content.get("evalue", "")))


class LimitedNBEnvironmentState(NBEnvironmentState):
    """Aviary's notebook state, with a kernel that is limited, killable and tied to the server, a work dir
    whose total size is bounded (:meth:`passed_quota`, watched while the kernel lives), and the notebook
    file beside the work dir, out of the kernel's reach."""

    limits: KernelLimits = Field(default_factory=KernelLimits)
    sandbox: bool = True
    kernel_pid: int | None = None
    ipc_dir: Path | None = None
    disk_note: str | None = None  # what the work dir's quota stopped last (the model reads it)
    disk_killed: str | None = None  # why the quota killed the kernel (its variables are lost)
    _cgroup: Any = PrivateAttr(default=None)  # the kernel tree's cgroups (nemo_gym.sandbox.cgroups), or None
    _disk_watch: asyncio.Task | None = PrivateAttr(default=None)
    _disk_base: int = PrivateAttr(default=0)  # what the work dir held at the start (the task's files)
    _disk_ceiling: int = PrivateAttr(default=0)  # past the quota: what the cells had added when last stopped
    _cell_stop: asyncio.Event | None = PrivateAttr(default=None)  # the running cell's; set: stop it

    @model_validator(mode="after")
    def post_init(self) -> Self:
        """Replaces Aviary's check that the notebook lies in the work dir: here it lies beside it, in a dir
        only the server writes (:meth:`CSVAnalysisEnv._set_work_dir`), so a link a cell puts in the work
        dir is never followed by the server's reads and writes of the notebook. A fresh notebook."""
        self._nb = nbformat.v4.new_notebook()
        self._nb.metadata.kernelspec = self.language.make_kernelspec()
        return self

    def get_container_path(self, path: Path) -> Path:
        """A path as the model is shown it: relative to the work dir (the notebook: its name)."""
        return (
            Path(path.relative_to(self.work_dir)) if path.is_relative_to(self.work_dir) else Path(path.name)
        )

    async def start_kernel(self) -> None:
        km = SandboxedKernelManager(kernel_name=NATIVE_KERNEL_NAME)
        # No ZMQ message larger than this reaches the server (a single print of a huge string would
        # otherwise be held in the server's memory whole); a larger one disconnects the kernel's stream.
        km.context.setsockopt(zmq.MAXMSGSIZE, MAX_KERNEL_MESSAGE_BYTES)
        if self.sandbox:
            self.ipc_dir = self.work_dir.parent / "ipc"  # beside the work dir: removed with it
            self.ipc_dir.mkdir(mode=0o700, exist_ok=True)
            km.transport = "ipc"
            km.ip = str(self.ipc_dir / "k")
            km.connection_file = str(self.ipc_dir / "kernel.json")  # visible inside (/tmp is private there)
            km.wrapper_argv = bwrap_argv(self.work_dir, self.ipc_dir, self.limits.tmp_size_mib << 20)
        km.output_chars = self.limits.output_chars
        self._kernel_manager = km
        self._disk_base = await self.disk_used()  # the task's files: what the cells add is what counts
        self._cgroup = _kernel_cgroup(self.limits)
        procs_files = self._cgroup.procs_files() if self._cgroup is not None else []
        await km.start_kernel(
            cwd=str(self.work_dir),
            preexec_fn=_kernel_preexec(self.limits, procs_files),
            env=_kernel_env(self.work_dir),
        )
        # Interrupts go as a message on the control channel: ipykernel then signals itself. A signal from
        # here would reach bubblewrap, not the kernel (it runs in a session of its own in the sandbox).
        km.kernel_spec.interrupt_mode = "message"
        provisioner = self._kernel_manager.provisioner
        self.kernel_pid = getattr(provisioner, "pid", None)
        if procs_files and self.kernel_pid is not None:
            joined = all(str(self.kernel_pid) in Path(f).read_text().split() for f in procs_files)
            if not joined:
                logger.warning(
                    "kernel %s did not join its pids cgroup: its process count is not bounded",
                    self.kernel_pid,
                )
        self._disk_ceiling = self.quota_bytes
        self._disk_watch = asyncio.get_running_loop().create_task(self._watch_disk())

    # -- the work dir's disk quota ----------------------------------------------------------------

    @property
    def quota_bytes(self) -> int:
        return self.limits.work_dir_quota_mib << 20

    async def disk_used(self) -> int:
        """What the kernel's writable dirs hold for the quota (:mod:`nemo_gym.sandbox.disk_quota`)."""
        return await disk_quota.used_bytes([self.work_dir, *([self.ipc_dir] if self.ipc_dir else [])])

    def passed_quota(self, used: int) -> bool:
        """Whether the dirs, holding ``used`` bytes, just went past the quota: the cells added more than
        the quota to what the task's files took, and more than when the quota last stopped something (so
        a dir left over it, which the model may clean up, stops nothing until it grows again). Sets
        :attr:`disk_note` when it did."""
        added, quota = used - self._disk_base, self.quota_bytes
        if added <= quota:
            self._disk_ceiling = quota
            return False
        if added <= self._disk_ceiling:
            return False
        self._disk_ceiling = added
        self.disk_note = (
            f"the cells wrote {added / 2**20:.1f} MiB to the work dir, past its disk quota of "
            f"{self.limits.work_dir_quota_mib} MiB (all files together)"
        )
        return True

    def settle_disk(self, used: int) -> None:
        """A stopped cell's writes are in: what the dirs hold now is the ceiling, until they shrink."""
        self._disk_ceiling = max(self.quota_bytes, used - self._disk_base)

    def cell_started(self) -> asyncio.Event:
        self._cell_stop = asyncio.Event()
        return self._cell_stop

    def cell_ended(self) -> None:
        self._cell_stop = None

    async def _watch_disk(self) -> None:
        """While the kernel lives: every 0.5 s, past the quota, stop the running cell (its runner
        interrupts it, and kills the kernel if it does not stop), or, with no cell running (a thread or
        process a cell left keeps writing), kill the kernel."""
        while True:
            await asyncio.sleep(disk_quota.POLL_S)
            stop = self._cell_stop
            if stop is not None and stop.is_set():
                continue  # the cell's runner is stopping it
            if not self.passed_quota(await self.disk_used()):
                continue
            if stop is not None:
                stop.set()
                continue
            self.disk_killed = (
                f"{self.disk_note}, and what an earlier cell started kept writing while no cell ran"
            )
            logger.info("kernel %s killed: %s", self.kernel_pid, self.disk_killed)
            self.kill_kernel()
            return

    async def close(self) -> None:
        try:
            async with asyncio.timeout(10):
                await self._kernel_manager.shutdown_kernel(now=False)
        except BaseException as e:  # noqa: BLE001 - the kill below is the guarantee
            logger.warning("kernel shutdown failed (%s); killing it", type(e).__name__)
        finally:
            self.kill_kernel()

    def kill_kernel(self) -> None:
        """Kill the kernel's process group (it runs in its own session) and everything left in its cgroup
        (children that left the group), whatever state it is in; stop watching its work dir."""
        watch, self._disk_watch = self._disk_watch, None
        try:
            current = asyncio.current_task()
        except RuntimeError:  # no running loop (interpreter exit)
            current = None
        if watch is not None and watch is not current:
            watch.cancel()
        if self.kernel_pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.kernel_pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.kernel_pid, signal.SIGKILL)
        cgroup, self._cgroup = self._cgroup, None
        if cgroup is not None:
            cgroup.destroy()


def _kernel_env(work_dir: Path) -> dict[str, str]:
    """A small environment for the kernel: no secrets of the server's environment are passed on."""
    keep = ("PATH", "LANG", "LC_ALL", "PYTHONPATH", "VIRTUAL_ENV", "TZ")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    home = work_dir / ".home"
    home.mkdir(exist_ok=True)
    env.update(
        HOME=str(home), MPLBACKEND="Agg", MPLCONFIGDIR=str(home / ".mpl"), IPYTHONDIR=str(home / ".ipython")
    )
    return env


# What a call gets once the episode has ended (Aviary runs every call of a model turn, in order): only the
# first submit_answer counts, so a turn of several answers cannot collect a reward for each, or for any.
EPISODE_ENDED = (
    "Error: the episode has already ended (an earlier call of this turn ended it); this call was not run."
)


class CSVAnalysisEnv(NBEnvironment[LimitedNBEnvironmentState]):
    """Answer a question about CSV files by writing and running notebook cells, then submit."""

    STATE_CLS = LimitedNBEnvironmentState

    def __init__(
        self,
        *,
        question: str,
        answer: str | float,
        files_dir: Path,
        rel_tol: float = 1e-6,
        limits: KernelLimits | None = None,
        cell_timeout_s: int = 120,
        sandbox: bool = True,
    ):
        super().__init__(
            work_dir=files_dir, use_tmp_work_dir=True, use_docker=False, cell_execution_timeout=cell_timeout_s
        )
        self.question = question
        self.answer = answer
        self.rel_tol = rel_tol
        self.limits = limits or KernelLimits()
        self.sandbox = sandbox

    def _set_work_dir(self) -> tuple[Path, Path]:
        """A fresh dir per episode under this process's kernels' dir (:func:`_kernels_root`): ``work``, a
        copy of ``files_dir`` (the kernel's: bound into its sandbox, its cwd), ``ipc`` (the kernel's ZMQ
        sockets, made at its start) and ``notebook`` (the notebook file and its Markdown view, which only
        the server reads and writes: never a path a cell can replace with a link). Returns the notebook's
        path and the work dir, as Aviary's does."""
        self._cleanup_tmp_work_dir()
        episode = Path(tempfile.mkdtemp(prefix="env-", dir=_kernels_root()))
        work = episode / "work"
        if self.work_dir.is_dir():
            shutil.copytree(self.work_dir, work)
        else:
            work.mkdir()
        (episode / "notebook").mkdir(mode=0o700)
        return episode / "notebook" / self.NOTEBOOK_NAME, work

    def _cleanup_tmp_work_dir(self) -> None:
        """Remove the episode's dirs (what its cells wrote, at any depth, in dirs a cell locked) in the
        sandbox's clean-up thread: renamed away at once, so its path is free."""
        state = getattr(self, "state", None)
        if state is None:
            return
        episode = state.work_dir.parent
        if not episode.parent.name.startswith(_KERNELS_PREFIX) or not episode.exists():
            return  # not a dir this module made (or already removed)
        trash = episode.with_name(f".{episode.name}.removed")
        try:
            os.rename(episode, trash)
        except OSError:
            trash = episode
        remove_dir_later(trash)

    async def reset(self) -> tuple[Messages, list[Tool]]:
        nb_path, work_dir = self._set_work_dir()
        self.state = await LimitedNBEnvironmentState.create(
            nb_path=nb_path,
            work_dir=work_dir,
            language=self.language,
            use_docker=False,
            limits=self.limits,
            sandbox=self.sandbox,
        )
        # Aviary's tools, their schemas built once per env class (offline.tool_of), not per episode.
        self.tools = [tool_of(self.edit_cell), tool_of(self.list_workdir), tool_of(self.submit_answer)]
        intro = Message(
            content="Use the notebook to analyse the CSV files in the working directory and answer: "
            f"{self.question}\nRun code with edit_cell, then call submit_answer with the final answer only."
        )
        return [intro, self.get_env_state_msg()], self.tools

    async def edit_cell(self, contents: str, idx: int | None = None) -> str:
        if self.state.done:
            return EPISODE_ENDED
        return await super().edit_cell(contents, idx)

    edit_cell.__doc__ = NBEnvironment.edit_cell.__doc__  # the tool's description: Aviary's, unchanged

    async def list_workdir(self) -> str:
        return json.dumps(await asyncio.to_thread(_list_dir, self.state.work_dir), indent=2)

    list_workdir.__doc__ = NBEnvironment.list_workdir.__doc__  # the tool's description: Aviary's

    async def _run_notebook_local(self, cell_idx: int | None = None) -> str:
        """Run the notebook's code cells (or only ``cell_idx``) in the kernel, as Aviary does, but a cell
        whose output passes ``KernelLimits.output_chars`` (its client drops the rest), that runs past
        ``cell_execution_timeout``, or that writes its work dir past ``KernelLimits.work_dir_quota_mib``
        is interrupted, so the kernel is free for the next cell (Aviary left it running, printing or
        looping, until its CPU limit). A cell that the quota stopped and that does not stop when
        interrupted has its kernel killed. All raise: the model reads why as the tool's error (a cell
        over the quota also in its output)."""
        state = self.state
        if state.disk_killed:
            raise RuntimeError(
                f"the kernel was killed at its work dir's disk quota: {state.disk_killed}. Its variables are "
                "lost and no cell can run"
            )
        km = state._kernel_manager
        client = km.client()
        client.start_channels()
        try:
            # Until the kernel answered on the shell channel and its iopub messages reach this client: a
            # subscriber joins late, and a fast cell's busy/idle sent before it joined were lost (the wait for
            # the cell's idle then ran to the timeout). A dead kernel is told by the cell's run below.
            with contextlib.suppress(RuntimeError):
                await client.wait_for_ready(timeout=_READY_WAIT_S)
            for idx, cell in enumerate(state.cells):
                if cell.cell_type != "code" or (cell_idx is not None and idx != cell_idx):
                    continue
                cell.outputs = []
                stop = state.cell_started()
                try:
                    msg_id = client.execute(cell.source)
                    try:
                        async with asyncio.timeout(self.cell_execution_timeout):
                            await _collect_outputs(client, msg_id, cell, stop)
                    except _DiskQuotaError:
                        stopped = await _interrupt(km, client, msg_id, _DISK_INTERRUPT_GRACE_S)
                        await self._stopped_for_disk(idx, cell, killed=not stopped)
                    except (TimeoutError, _OutputLimitError) as exc:
                        await _interrupt(km, client, msg_id)
                        if isinstance(exc, _OutputLimitError):
                            raise RuntimeError(
                                f"cell {idx} printed more than {self.limits.output_chars:,} characters; it "
                                "was interrupted and its output cut"
                            ) from None
                        raise TimeoutError(
                            f"Notebook execution timed out after {self.cell_execution_timeout} seconds; the "
                            "cell was interrupted"
                        ) from None
                    # It ended: what it wrote is counted once more (past the quota between two looks).
                    if stop.is_set() or state.passed_quota(await state.disk_used()):
                        await self._stopped_for_disk(idx, cell, killed=False, ended=True)
                finally:
                    state.cell_ended()
        finally:
            client.stop_channels()
            state.save_nb()
            state.reload_nb()
        return "Executed all cells."

    async def _stopped_for_disk(self, idx: int, cell: Any, *, killed: bool, ended: bool = False) -> None:
        """Cell ``idx`` wrote past the work dir's quota: note it in the cell's output and raise the tool
        error the model reads. ``killed``: it did not stop when interrupted, so the kernel is killed."""
        state = self.state
        if killed:
            state.disk_killed = f"{state.disk_note}, and cell {idx} did not stop when interrupted"
            state.kill_kernel()
            what = "it did not stop when interrupted, so the kernel was killed (its variables are lost)"
        else:
            state.settle_disk(await state.disk_used())
            what = ("it ran to its end" if ended else "it was interrupted") + ". Delete files to go on"
        note = f"[disk quota: cell {idx} wrote too much: {state.disk_note}; {what}.]"
        cell.outputs.append(nbformat.v4.new_output(output_type="stream", name="stderr", text=note + "\n"))
        raise RuntimeError(note)

    async def submit_answer(self, answer: str) -> str:
        """Submit the final answer to the question. This ends the episode.

        Args:
            answer: The answer only (a number or a short text), without explanation.
        """
        if self.state.done:  # one answer per episode: a second call of the same turn changes nothing
            return EPISODE_ENDED
        self.state.done = True
        self.state.answer = answer
        correct = answers_match(answer, self.answer, self.rel_tol)
        self.state.total_reward += 1.0 if correct else 0.0
        return "Correct." if correct else "Incorrect."

    async def close(self) -> None:
        try:
            await super().close()  # shuts the kernel down, then _cleanup_tmp_work_dir
        finally:
            if hasattr(self, "state"):
                self.state.kill_kernel()
                self._cleanup_tmp_work_dir()


MAX_KERNEL_MESSAGE_BYTES = 16 << 20  # largest ZMQ message a kernel may send the server
_INTERRUPT_GRACE_S = 5.0  # how long an interrupted cell has to stop
_READY_WAIT_S = 60.0  # how long a new client waits for the kernel's channels (a bound on a busy machine)
# ... when it wrote past the work dir's quota: it may still be writing at the disk's speed meanwhile (a cell
# that stops on KeyboardInterrupt stops within milliseconds).
_DISK_INTERRUPT_GRACE_S = 1.0


class _OutputLimitError(Exception):
    """A cell's outputs passed ``KernelLimits.output_chars``."""


class _DiskQuotaError(Exception):
    """The work dir's quota watcher asked the running cell to stop."""


def _output_of(kind: str, content: dict[str, Any]) -> Any:
    """The notebook output of one iopub message of a cell (None for other kinds), as Aviary builds it."""
    if kind == "stream":
        return nbformat.v4.new_output(output_type="stream", name=content["name"], text=content["text"])
    if kind == "execute_result":
        return nbformat.v4.new_output(
            output_type="execute_result",
            data=content.get("data", {}),
            metadata=content.get("metadata", {}),
            execution_count=content.get("execution_count"),
        )
    if kind == "display_data":
        return nbformat.v4.new_output(
            output_type="display_data", data=content.get("data", {}), metadata=content.get("metadata", {})
        )
    if kind == "error":
        return nbformat.v4.new_output(
            output_type="error",
            ename=content.get("ename", ""),
            evalue=content.get("evalue", ""),
            traceback=content.get("traceback", []),
        )
    return None


async def _collect_outputs(client: Any, msg_id: str, cell: Any, stop: asyncio.Event | None = None) -> None:
    """The cell's outputs until the kernel is idle again. The client (:class:`BoundedOutputClient`) keeps
    a bounded part of them: once it dropped some, :class:`_OutputLimitError` is raised; once ``stop`` is
    set (the work dir's quota), :class:`_DiskQuotaError`."""
    if stop is None:
        return await _collect_until_idle(client, msg_id, cell)
    collect = asyncio.ensure_future(_collect_until_idle(client, msg_id, cell))
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({collect, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        if not collect.done():
            collect.cancel()
            await asyncio.gather(collect, return_exceptions=True)
    if collect.cancelled():
        raise _DiskQuotaError
    return collect.result()


async def _collect_until_idle(client: Any, msg_id: str, cell: Any) -> None:
    while True:
        msg = await client.get_iopub_msg()
        if not _of_cell(msg, msg_id):
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "status" and content.get("execution_state") == "idle":
            return
        output = _output_of(kind, content)
        if output is not None:
            cell.outputs.append(output)
        if getattr(client, "overflowed", False):
            raise _OutputLimitError


def _of_cell(msg: dict[str, Any], msg_id: str) -> bool:
    """Whether an iopub message is of the cell run ``msg_id``. Its parent's type counts too: the kernel
    manager's session numbers its messages as the client's does, so the interrupt request's own busy/idle
    statuses can carry the cell's msg_id (taken for the cell's idle, they ended the wait for a cell that
    ignores SIGINT at once)."""
    parent = msg["parent_header"]
    return parent.get("msg_id") == msg_id and parent.get("msg_type", "execute_request") == "execute_request"


async def _interrupt(km: Any, client: Any, msg_id: str, grace_s: float = _INTERRUPT_GRACE_S) -> bool:
    """Interrupt the running cell and wait (``grace_s``) for the kernel to be idle, dropping its output.
    Whether it became idle within the grace."""
    with contextlib.suppress(Exception):
        await km.interrupt_kernel()
    with contextlib.suppress(Exception):
        async with asyncio.timeout(grace_s):
            while True:
                msg = await client.get_iopub_msg()
                if _of_cell(msg, msg_id) and msg["msg_type"] == "status":
                    if msg["content"].get("execution_state") == "idle":
                        return True
    return False


def answers_match(proposed: Any, expected: Any, rel_tol: float) -> bool:
    """Numbers within ``rel_tol`` (relative), else texts equal ignoring case, spaces and a final period."""
    text = str(proposed).strip().rstrip(".").replace(",", "")
    if isinstance(expected, int | float) and not isinstance(expected, bool):
        try:
            value = float(text)
        except ValueError:
            return False
        return abs(value - float(expected)) <= rel_tol * max(abs(float(expected)), 1e-9)
    return " ".join(text.lower().split()) == " ".join(str(expected).lower().split())


class NotebookServerConfig(AviaryResourcesServerConfig):
    files_dir: str | None = Field(default=None, description="Directory copied into each kernel's work dir.")
    kernel_limits: KernelLimits = Field(default_factory=KernelLimits)
    cell_timeout_s: int = Field(default=120, gt=0)
    kernel_sandbox: Literal["auto", "bwrap", "none"] = Field(
        default="auto", description="Run the kernel in bubblewrap (auto: when bwrap is installed)."
    )
    rel_tol: float = Field(
        default=1e-6,
        ge=0,
        description="Relative tolerance of a numeric answer: rounding noise only (1e-3 paid 11050 for 11046)",
    )
    max_live_envs: int = Field(default=8, ge=1, description="Live kernels at once.")
    idle_timeout_s: float = Field(default=300.0, gt=0)


class NotebookTaskDataset(TaskDataset[CSVAnalysisEnv]):
    DEFAULT_FILE = "notebook_tasks.jsonl"

    def __init__(self, path: Path, files_dir: Path, config: NotebookServerConfig):
        self.path, self.files_dir, self.config = path, files_dir, config
        self.tasks: list[tuple[str, str | float]] = []
        for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetFileError(f"{path}:{line_no}: not valid JSON ({e})") from None
            q, a = obj.get("question"), obj.get("answer")
            if not isinstance(q, str) or not q.strip():
                raise DatasetFileError(f"{path}:{line_no}: field 'question' must be a non-empty string")
            if not isinstance(a, str | int | float) or isinstance(a, bool):
                raise DatasetFileError(f"{path}:{line_no}: field 'answer' must be a number or a string")
            self.tasks.append((q, a))
        if not files_dir.is_dir():
            raise DatasetFileError(f"files_dir {files_dir} is not a directory")
        have_bwrap = shutil.which("bwrap") is not None
        if config.kernel_sandbox == "bwrap" and not have_bwrap:
            raise DatasetFileError(
                "kernel_sandbox: bwrap, but bubblewrap is not installed (apt-get install bubblewrap)"
            )
        self.sandbox = config.kernel_sandbox == "bwrap" or (config.kernel_sandbox == "auto" and have_bwrap)
        problem = kernel_cgroup_problem() if self.sandbox else None
        if problem:
            raise DatasetFileError(problem)
        if not self.sandbox:
            logger.warning(
                "notebook kernels run WITHOUT a sandbox (kernel_sandbox=%s)", config.kernel_sandbox
            )

    @classmethod
    def from_config(cls, config: NotebookServerConfig) -> Self:
        files = resolve_data_path(config.files_dir, "notebook_files")
        return cls(resolve_data_path(config.dataset_jsonl_fpath, cls.DEFAULT_FILE), files, config)

    def __len__(self) -> int:
        return len(self.tasks)

    def get_new_env_by_idx(self, idx: int) -> CSVAnalysisEnv:
        question, answer = self.tasks[idx]
        c = self.config
        return CSVAnalysisEnv(
            question=question,
            answer=answer,
            files_dir=self.files_dir,
            rel_tol=c.rel_tol,
            limits=c.kernel_limits,
            cell_timeout_s=c.cell_timeout_s,
            sandbox=self.sandbox,
        )


class NotebookResourcesServer(AviaryResourcesServer[CSVAnalysisEnv, NotebookTaskDataset]):
    config: NotebookServerConfig
    dataset: NotebookTaskDataset = Field(
        default_factory=lambda data: NotebookTaskDataset.from_config(data["config"])
    )


if __name__ == "__main__":
    NotebookResourcesServer.run_webserver()
