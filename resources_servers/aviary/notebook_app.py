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
  and becomes a tool error.
"""

from __future__ import annotations

import os

# Aviary imports LiteLLM, which fetches a price list over the network at import unless told not to.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import asyncio  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import resource  # noqa: E402
import shutil
import signal
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, Self

import nbformat
import zmq
from jupyter_client.kernelspec import NATIVE_KERNEL_NAME
from jupyter_client.manager import AsyncKernelManager
from pydantic import BaseModel, Field, PrivateAttr

from aviary.core import Message, Messages, TaskDataset, Tool
from aviary.envs.notebook import NBEnvironment
from aviary.envs.notebook.env import NBEnvironmentState
from resources_servers.aviary.app import AviaryResourcesServer, resolve_data_path
from resources_servers.aviary.offline import DatasetFileError, tool_of
from resources_servers.aviary.schemas import AviaryResourcesServerConfig

logger = logging.getLogger(__name__)


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


def bwrap_argv(work_dir: Path, ipc_dir: Path) -> list[str]:
    """bubblewrap around the kernel: only the system files and the Python environment, read-only (no
    repository, no task file, no home directory); writable ``work_dir`` and ``ipc_dir`` (ZMQ over Unix
    sockets there, where the connection file is too) and a private /tmp; no network; its own pid
    namespace (it sees and can signal its own processes only, and they all die with it), no
    capabilities, no further user namespaces; dies with its parent."""
    binds: list[str] = []
    for path in _python_dirs():
        binds += ["--ro-bind", path, path]
    return [
        shutil.which("bwrap") or "bwrap",
        *_system_binds(),
        "--proc", "/proc",
        "--dev", "/dev",
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


def _output_chars(content: dict[str, Any]) -> int:
    if "text" in content:
        return len(str(content["text"]))
    parts = [*(content.get("data") or {}).values(), *(content.get("traceback") or [])]
    return sum(len(str(p)) for p in parts) + len(str(content.get("evalue", "")))


class LimitedNBEnvironmentState(NBEnvironmentState):
    """Aviary's notebook state, with a kernel that is limited, killable and tied to the server."""

    limits: KernelLimits = Field(default_factory=KernelLimits)
    sandbox: bool = True
    kernel_pid: int | None = None
    ipc_dir: Path | None = None
    _cgroup: Any = PrivateAttr(default=None)  # the kernel tree's cgroups (nemo_gym.sandbox.cgroups), or None

    async def start_kernel(self) -> None:
        km = SandboxedKernelManager(kernel_name=NATIVE_KERNEL_NAME)
        # No ZMQ message larger than this reaches the server (a single print of a huge string would
        # otherwise be held in the server's memory whole); a larger one disconnects the kernel's stream.
        km.context.setsockopt(zmq.MAXMSGSIZE, MAX_KERNEL_MESSAGE_BYTES)
        if self.sandbox:
            self.ipc_dir = Path(tempfile.mkdtemp(prefix="ng-kernel-ipc-"))
            km.transport = "ipc"
            km.ip = str(self.ipc_dir / "k")
            km.connection_file = str(self.ipc_dir / "kernel.json")  # visible inside (/tmp is private there)
            km.wrapper_argv = bwrap_argv(self.work_dir, self.ipc_dir)
        km.output_chars = self.limits.output_chars
        self._kernel_manager = km
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
        (children that left the group), whatever state it is in."""
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
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

    async def _run_notebook_local(self, cell_idx: int | None = None) -> str:
        """Run the notebook's code cells (or only ``cell_idx``) in the kernel, as Aviary does, but a cell
        whose output passes ``KernelLimits.output_chars`` (its client drops the rest) or that runs past
        ``cell_execution_timeout`` is interrupted, so the kernel is free for the next cell (Aviary left it
        running, printing or looping, until its CPU limit). Both raise: the model reads why as the tool's
        error."""
        km = self.state._kernel_manager
        client = km.client()
        client.start_channels()
        try:
            for idx, cell in enumerate(self.state.cells):
                if cell.cell_type != "code" or (cell_idx is not None and idx != cell_idx):
                    continue
                cell.outputs = []
                msg_id = client.execute(cell.source)
                try:
                    async with asyncio.timeout(self.cell_execution_timeout):
                        await _collect_outputs(client, msg_id, cell)
                except (TimeoutError, _OutputLimitError) as exc:
                    await _interrupt(km, client, msg_id)
                    if isinstance(exc, _OutputLimitError):
                        raise RuntimeError(
                            f"cell {idx} printed more than {self.limits.output_chars:,} characters; it was "
                            "interrupted and its output cut"
                        ) from None
                    raise TimeoutError(
                        f"Notebook execution timed out after {self.cell_execution_timeout} seconds; the "
                        "cell was interrupted"
                    ) from None
        finally:
            client.stop_channels()
            self.state.save_nb()
            self.state.reload_nb()
        return "Executed all cells."

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
            await super().close()
        finally:
            if hasattr(self, "state"):
                self.state.kill_kernel()
                shutil.rmtree(self.state.work_dir, ignore_errors=True)


MAX_KERNEL_MESSAGE_BYTES = 16 << 20  # largest ZMQ message a kernel may send the server
_INTERRUPT_GRACE_S = 5.0  # how long an interrupted cell has to stop


class _OutputLimitError(Exception):
    """A cell's outputs passed ``KernelLimits.output_chars``."""


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


async def _collect_outputs(client: Any, msg_id: str, cell: Any) -> None:
    """The cell's outputs until the kernel is idle again. The client (:class:`BoundedOutputClient`) keeps
    a bounded part of them: once it dropped some, :class:`_OutputLimitError` is raised."""
    while True:
        msg = await client.get_iopub_msg()
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "status" and content.get("execution_state") == "idle":
            return
        output = _output_of(kind, content)
        if output is not None:
            cell.outputs.append(output)
        if getattr(client, "overflowed", False):
            raise _OutputLimitError


async def _interrupt(km: Any, client: Any, msg_id: str) -> None:
    """Interrupt the running cell and wait (bounded) for the kernel to be idle, dropping its output."""
    with contextlib.suppress(Exception):
        await km.interrupt_kernel()
    with contextlib.suppress(Exception):
        async with asyncio.timeout(_INTERRUPT_GRACE_S):
            while True:
                msg = await client.get_iopub_msg()
                if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status":
                    if msg["content"].get("execution_state") == "idle":
                        return


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
