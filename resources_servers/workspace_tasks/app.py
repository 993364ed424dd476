"""workspace_tasks: terminal and repository tasks in a workspace that lives for the rollout, checked by
hidden tests in a fork of the final workspace.

Contract
--------
* Row fields: ``task_id`` (one of :data:`~resources_servers.workspace_tasks.tasks.TASKS_BY_ID`; a
  missing or unknown one is refused with 422 naming it, at ``/seed_session`` and ``/verify``, so a
  broken row never starts a rollout), ``kind`` (informative) and ``responses_create_params`` (the
  prompt says what to do; the hidden tests are never in it).
* Every task's workspace is built once per process when the server starts (``tasks.build_workspace``:
  files, and the ``git`` CLI for the merge tasks) and prepared once
  (:func:`nemo_gym.sandbox.prepare_workspace`); each rollout's sandbox is a copy-on-write
  :class:`~nemo_gym.sandbox.SandboxSession` over it (no network, uid 65534, host ``/usr`` read-only),
  started at the rollout's first tool call and kept per rollout by
  :class:`nemo_gym.sandbox.rollouts.RolloutSandboxes` (closed at ``/verify``, ``/end_session``, its
  idle timeout / lifetime, eviction past ``max_rollouts``, and server shutdown).
* Tools (the names agent harnesses use):

  - ``POST /bash`` ``{"command": str}`` -> ``{"output": str, "exit_code": int | null, "timed_out": bool}``:
    the command runs in ``/bin/bash`` in ``/workspace`` (stdout and stderr interleaved in ``output``,
    which keeps its first and last ``max_output_chars / 2`` characters with a note of what was cut);
    ``exit_code`` is null when the command was killed at ``command_timeout_s``. Files persist across
    calls; background processes do not outlive their command.
  - ``POST /str_replace_based_edit_tool`` (Anthropic's text-editor tool): ``command`` in ``view``,
    ``create``, ``str_replace``, ``insert``; ``path`` relative to ``/workspace`` or absolute under it;
    ``file_text`` (create), ``old_str``/``new_str`` (str_replace), ``insert_line``/``new_str`` (insert:
    after that line, 0 = at the top), ``view_range`` ``[start, end]`` (end -1: to the end). Answers
    ``{"output": str, "is_error": bool}``; the model's mistakes (a path outside ``/workspace`` or a
    symlink out of it, ``old_str`` missing or not unique, a missing argument, a line out of range) are
    ``is_error: true`` with a sentence saying what, never an HTTP error.
* ``POST /verify``: the rollout's workspace is snapshotted and forked into a fresh sandbox (or, when no
  tool ran, a fresh one starts from the task's workspace); the hidden tests (``tasks.PRELUDE`` + the
  task's ``hidden_tests``) are sent on the runner's stdin (never written to the workspace). Reward 1.0
  iff every test passes; ``tests_passed`` is the fraction passed, with ``passed_count``, ``test_count``,
  ``failed_tests`` (name: first line of the error) and ``failure_reason`` (None, ``"N of M hidden tests
  failed"``, or why the tests stopped). The rollout's sandbox is closed afterwards. The hidden tests judge
  behaviour on inputs they make up at every run (``tasks.PRELUDE``'s ``RANDOM``: second inputs, a unit
  test planted in tests/, files of random names) and a merge as the repository stores it, so a script
  that recognises a test's probe and answers just that probe fails.
* An agent that runs its own sandbox (``harness_agent`` with ``workspace: resources_server``: a CLI
  harness such as mini-swe-agent) gets the task's starting workspace from ``POST /export_workspace``
  (the rollout's session cookie; ``{"tar_base64": ...}``, the workspace this server built, never its
  hidden tests; not a tool, so the model cannot call it) and sends what it changed in the ``/verify``
  body as ``workspace_changes`` (base64 of a :mod:`nemo_gym.sandbox.changes` changeset). ``/verify`` applies
  it to the rollout's workspace (a fresh sandbox on the task's workspace when no tool ran) inside that
  sandbox, then snapshots and forks it for the hidden tests as for any rollout; the changeset is not
  echoed. A changeset the workspace cannot take (a command of the applier killed, past the disk quota) is
  a 0 with ``failure_reason`` ("the agent's workspace changes could not be applied ..."); one that is not
  base64 or not a tar is the caller's mistake, a 422.
* Verdicts come from where the workspace's code cannot write (:data:`_RUNNER`). The runner is
  non-dumpable (no process of the sandbox's uid can ptrace it, read its memory or open its fds through
  /proc), ignores every signal it may ignore, never runs a test or the workspace's code itself, and is
  the only process holding the stdout the server reads. Each test runs in a child of its own (its own
  session, stdio on /dev/null, its verdict on a pipe only it holds, non-dumpable too); the workspace's
  code runs only in that child's subprocesses: commands through ``sh`` and, through ``load(m).f(...)``,
  a fresh process that imports ``m``, calls ``f`` and hands back the result or exception as a Python
  literal the child parses (``ast.literal_eval``). So printing, exiting, monkeypatching, an object equal
  to everything, forking, or writing to any fd it has changes only what its own calls return and its
  commands print, which is what the tests judge.
* Bounds: a test still running at ``test_timeout_s`` is SIGKILLed by the runner, with its process group
  and every process started since the runner (so is whatever a finished test left), and fails; tests
  not started by the runner's budget (``verify_timeout_s`` less a margin) fail as not run.
* The model's doing is a 0, never a 503: the runner prints ``ready`` before any of the workspace's code
  can run, so from then on a killed or stopped runner (past ``verify_timeout_s``), a sandbox whose agent
  died or stopped answering, and out of memory are failed tests with that reason.
* Infrastructure is never a reward: a sandbox that cannot start (SandboxUnavailableError: no way to mount
  its workspace, as root or in a user namespace; the session bound: SandboxBusyError) or fails, a rollout whose workspace was lost (its sandbox closed at its idle
  timeout or lifetime), or a runner that does not get ready (hidden tests that do not load, a missing
  ``python3`` or ``prctl``) answer 503 (the collector files the rollout in its failures sidecar). A
  workspace of any shape is snapshotted (``nemo_gym.sandbox.trees``: any depth, paths past PATH_MAX,
  sparse files), so no tree the model builds turns into one. The server refuses to start if bubblewrap
  is missing.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import posixpath
import re
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from fastapi import FastAPI, HTTPException, Request
from pydantic import BaseModel, Field, PrivateAttr, field_validator

from nemo_gym.kit.text import head_tail
from nemo_gym.sandbox import (
    SandboxError,
    SandboxProviderConfig,
    SandboxSession,
    SessionClosedError,
    SessionLimits,
    check_sandbox_available,
    prepare_workspace,
)
from nemo_gym.sandbox.rollouts import RolloutSandbox, RolloutSandboxes
from nemo_gym.server.base import get_session_id
from nemo_gym.server.resources import (
    BaseResourcesServerConfig,
    BaseSeedSessionRequest,
    BaseSeedSessionResponse,
    BaseVerifyRequest,
    BaseVerifyResponse,
    ReverifyMode,
    SimpleResourcesServer,
)
from resources_servers.workspace_tasks.tasks import PRELUDE, TASKS, TASKS_BY_ID, Task, build_workspace

WORKSPACE = "/workspace"


class WorkspaceTasksConfig(BaseResourcesServerConfig):
    REVERIFY_MODE: ClassVar[ReverifyMode] = ReverifyMode.UNSUPPORTED  # verify reads the rollout's sandbox

    command_timeout_s: float = Field(default=30.0, gt=0, description="Wall seconds per bash command")
    max_output_chars: int = Field(default=10_000, ge=200, description="Characters of a tool's output kept")
    memory_mib: int = Field(default=1024, ge=64, description="Memory of a rollout's whole sandbox")
    disk_quota_mib: int = Field(default=256, ge=1, description="What a rollout may write to its workspace")
    max_sandboxes: int = Field(default=64, ge=1, description="Live sandboxes per process (then queue, 503)")
    max_rollouts: int = Field(default=10_000, ge=1, description="Rollouts remembered (oldest dropped)")
    idle_timeout_s: float = Field(default=600.0, gt=0, description="A sandbox unused this long is closed")
    lifetime_s: float = Field(default=3600.0, gt=0, description="A sandbox older than this is closed")
    test_timeout_s: int = Field(default=20, ge=1, description="Bound on one hidden test (past it: failed)")
    verify_timeout_s: float = Field(default=180.0, gt=0, description="Bound on the whole hidden-test run")
    sandbox: SandboxProviderConfig = Field(default_factory=SandboxProviderConfig)


class TaskRow(BaseModel):
    task_id: str = Field(description="The task (its workspace and hidden tests)")
    kind: str | None = None

    @field_validator("task_id")
    @classmethod
    def _known(cls, task_id: str) -> str:
        if task_id not in TASKS_BY_ID:
            raise ValueError(f"unknown task_id {task_id!r}; known: {', '.join(sorted(TASKS_BY_ID))}")
        return task_id


class WorkspaceSeedSessionRequest(TaskRow, BaseSeedSessionRequest):
    pass


class WorkspaceVerifyRequest(TaskRow, BaseVerifyRequest):
    workspace_changes: str | None = Field(
        default=None,
        description="An agent that ran its own sandbox (harness_agent, workspace: resources_server): base64 of "
        "the changeset tar of what it changed in the task's workspace (nemo_gym.sandbox.changes), applied to "
        "the rollout's workspace before the hidden tests",
    )


class ExportWorkspaceResponse(BaseModel):
    tar_base64: str = Field(description="The task's starting workspace as a tar, base64 (no hidden tests)")


class WorkspaceVerifyResponse(BaseVerifyResponse):
    task_id: str
    kind: str | None = None
    tests_passed: float = 0.0
    passed_count: int = 0
    test_count: int = 0
    failed_tests: dict[str, str] = Field(default_factory=dict)
    failure_reason: str | None = None  # None when every test passed
    commands_run: int = 0
    edits_made: int = 0


@dataclass
class _Task:
    """What the server keeps per rollout besides its sandbox (``RolloutSandbox.data``)."""

    task_id: str
    commands_run: int = 0  # counted here, not from the response: any agent (tool calls or bash_agent)
    edits_made: int = 0


class BashRequest(BaseModel):
    command: str = Field(description="The shell command to run in /workspace")


class BashResponse(BaseModel):
    output: str
    exit_code: int | None
    timed_out: bool = False


class EditRequest(BaseModel):
    command: Literal["view", "create", "str_replace", "insert"]
    path: str
    file_text: str | None = None
    old_str: str | None = None
    new_str: str | None = None
    insert_line: int | None = None
    view_range: list[int] | None = None


class EditResponse(BaseModel):
    output: str
    is_error: bool = False


class _ToolError(Exception):
    """The model's mistake with a tool: its message is the tool's output."""


def workspace_path(path: str) -> str:
    """``path`` (relative to /workspace or absolute under it) as a path relative to the workspace
    (``.`` for itself); anything that leaves the workspace is a :class:`_ToolError`. Symlinks are the
    sandbox's to refuse (``SandboxSession`` does not follow one out)."""
    if not path or not path.strip():
        raise _ToolError("Error: `path` is empty; give a path under /workspace")
    full = posixpath.normpath(path if path.startswith("/") else posixpath.join(WORKSPACE, path))
    if full == WORKSPACE:
        return "."
    if not full.startswith(WORKSPACE + "/"):
        raise _ToolError(
            f"Error: the path {path!r} is outside /workspace; this tool only works on files under /workspace"
        )
    return full[len(WORKSPACE) + 1 :]


def _shown(rel: str) -> str:
    return WORKSPACE if rel == "." else f"{WORKSPACE}/{rel}"


def _lines(text: str) -> list[str]:
    """A file's lines without their newlines (an empty file has none; a last newline ends a line)."""
    lines = text.split("\n")
    return lines[:-1] if text.endswith("\n") or not text else lines


def _numbered(lines: list[str], first: int) -> str:
    return "\n".join(f"{i:6}\t{line}" for i, line in enumerate(lines, start=first))


# The hidden-test runner (``python3 -I -c _RUNNER`` in the checking sandbox): reads {"source", "tests",
# "timeout", "budget"} on stdin and writes JSON lines on its stdout: {"ready": true} once it is set up,
# {"test", "ok", "error"} per test, {"done": true} at the end ({"infra": why} if it cannot set up). It
# never runs a test or the workspace's code itself, and it is the only process that holds its stdout: each
# test runs in a child (forked, its own session and process group) whose stdin/stdout/stderr are /dev/null
# and whose verdict comes back on a pipe of its own; the workspace's code runs only in that child's
# subprocesses (``sh``, ``load``), which inherit none of those pipes. The runner, and so every test child,
# is non-dumpable: a process of the same uid can neither ptrace it, read its memory nor open its fds through
# /proc. A test still running at its bound is SIGKILLed from here, its process group and every process
# started since the runner with it (whatever group it moved to); so is whatever a finished test left
# behind. The signals a process may ignore are ignored here (a test child gets the defaults back).
_RUNNER = r"""
import ctypes, json, os, select, signal, sys, time, traceback


def say(**item):
    data = (json.dumps(item) + "\n").encode()
    while data:
        data = data[os.write(1, data):]


def refuse(why):
    say(infra=why)
    os._exit(3)


libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(4, 0, 0, 0, 0) != 0 or libc.prctl(3, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE 0, then check
    refuse("the runner cannot make itself non-dumpable (prctl errno %d)" % ctypes.get_errno())
KEEP_DEFAULT = {signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD}
for sig in signal.valid_signals():
    if sig not in KEEP_DEFAULT:
        try:
            signal.signal(sig, signal.SIG_IGN)
        except (OSError, ValueError, RuntimeError):
            pass
try:
    req = json.loads(sys.stdin.buffer.read())
    ns = {"__name__": "hidden_tests"}
    exec(compile(req["source"], "<hidden tests>", "exec"), ns)
    missing = [name for name in req["tests"] if not callable(ns.get(name))]
    if missing:
        raise NameError("no test function %s" % ", ".join(missing))
except BaseException:
    refuse("the hidden tests do not load: " + traceback.format_exc()[-1500:])


def stat(pid):
    with open("/proc/%d/stat" % pid, "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()  # [state, ppid, ..., starttime at 19]


ME = os.getpid()
KEEP = {ME}  # this runner and its ancestors (the sandbox's agent and init)
pid = ME
while pid > 1:
    pid = int(stat(pid)[1])
    KEEP.add(pid)
BORN = int(stat(ME)[19])


def reap():
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def sweep():
    # SIGKILL every live process started since this runner but this runner, until none is left.
    end = time.monotonic() + 5
    while time.monotonic() < end:
        found = False
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) in KEEP:
                continue
            try:
                st = stat(int(name))
                if st[0] in (b"Z", b"X") or int(st[19]) < BORN:
                    continue
                os.kill(int(name), signal.SIGKILL)
                found = True
            except (OSError, IndexError, ValueError):
                pass
        reap()
        if not found:
            return
        time.sleep(0.005)


def child(name, w):
    # One test, in a new session: no stdio, no fd but the verdict pipe, the default signal handlers.
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.closerange(3, w)
        os.closerange(w + 1, 1 << 16)
        try:  # out of memory, the kernel kills the test's processes (they inherit it), not the runner
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")
        except OSError:
            pass
        for sig in signal.valid_signals():
            if sig not in KEEP_DEFAULT:
                try:
                    signal.signal(sig, signal.SIG_DFL)
                except (OSError, ValueError, RuntimeError):
                    pass
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as Python starts (subprocess restores them)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        ok, error = True, ""
        try:
            ns[name]()
        except BaseException as exc:
            ok = False
            error = "".join(traceback.format_exception_only(type(exc), exc)).strip() or type(exc).__name__
        verdict = (json.dumps({"ok": ok, "error": error[:500]}) + "\n").encode()
        while verdict:
            verdict = verdict[os.write(w, verdict):]
    finally:
        os._exit(0)


def run(name, seconds, why_killed):
    # The test's error (None: it passed).
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError as exc:
        os.close(r)
        os.close(w)
        return "the test could not start: %s" % exc
    if pid == 0:
        child(name, w)
    os.close(w)
    pidfd = os.pidfd_open(pid)
    poller = select.poll()
    poller.register(r, select.POLLIN)
    poller.register(pidfd, select.POLLIN)
    data = b""
    end = time.monotonic() + seconds
    exited = killed = False
    while not exited:
        left = end - time.monotonic()
        if left <= 0:
            killed = True
            break
        for fd, _ in poller.poll(left * 1000):
            if fd == pidfd:
                exited = True
            elif len(data) < 65536:
                chunk = os.read(r, 65536)
                data += chunk
                if not chunk:
                    poller.unregister(r)
            else:
                poller.unregister(r)
    if killed:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except OSError:
                pass
    os.set_blocking(r, False)
    try:
        while len(data) < 65536:
            chunk = os.read(r, 65536)
            if not chunk:
                break
            data += chunk
    except BlockingIOError:
        pass
    _, status = os.waitpid(pid, 0)
    os.close(r)
    os.close(pidfd)
    sweep()
    if killed:
        return why_killed
    try:
        verdict = json.loads(data.decode())
        return None if verdict["ok"] is True else str(verdict["error"]) or "failed"
    except (ValueError, KeyError, TypeError):
        if os.WIFSIGNALED(status):
            return "the test's process was killed by signal %d before it reported" % os.WTERMSIG(status)
        return "the test's process exited with code %d before it reported" % os.WEXITSTATUS(status)


say(ready=True)
budget_end = time.monotonic() + req["budget"]
for name in req["tests"]:
    left = budget_end - time.monotonic()
    if left <= 0.05:
        error = "not run: the hidden tests used up their %g s" % req["budget"]
    elif left < req["timeout"]:
        error = run(name, left, "killed: the hidden tests used up their %g s" % req["budget"])
    else:
        error = run(name, req["timeout"], "the test took longer than %g s: killed" % req["timeout"])
    say(test=name, ok=error is None, error=(error or "")[:500])
say(done=True)
"""


class HiddenTestResult(BaseModel):
    passed: list[str]
    failed: dict[str, str]
    complete: bool  # the runner reported every test (False: the agent's code killed it or the sandbox)
    stopped: str | None = None  # why the runner did not report every test

    @property
    def total(self) -> int:
        return len(self.passed) + len(self.failed)

    @property
    def failure_reason(self) -> str | None:
        if not self.failed:
            return None
        if self.stopped:
            return self.stopped
        return f"{len(self.failed)} of {self.total} hidden tests failed"


class VerifyInfraError(Exception):
    """The hidden tests could not be run (not the agent's doing): a 503."""


async def run_hidden_tests(
    session: SandboxSession, task: Task, test_timeout_s: float, timeout_s: float
) -> HiddenTestResult:
    """Run ``task``'s hidden tests in ``session`` (its workspace as it is): see the module docstring.
    Raises :class:`VerifyInfraError` when the runner did not get ready (nothing of the workspace's had run
    yet); anything after that (tests failed, killed, the runner or the whole sandbox killed or stopped)
    is the workspace's doing: a result whose unreported tests failed."""
    names = task.test_names
    wall = min(timeout_s, session.limits.command_wall_time_s)
    request = {
        "source": PRELUDE + "\n" + task.hidden_tests,
        "tests": names,
        "timeout": test_timeout_s,
        "budget": wall - min(10.0, wall / 4),  # the runner's own end, before the sandbox's
    }
    try:
        run = await session.exec(["python3", "-I", "-c", _RUNNER], stdin=json.dumps(request), timeout=wall)
    except SessionClosedError as exc:
        # The sandbox's own processes died or stopped answering (its agent killed, out of memory): only the
        # runner, and through it the workspace's code, ran in it. Closed from here (its lifetime): infra.
        if session.closed is None or not session.closed.startswith("its sandbox"):
            raise VerifyInfraError(f"the hidden tests of {task.task_id} could not run: {exc}") from exc
        return _result(names, {}, f"the sandbox died while the hidden tests ran ({session.closed})")
    except SandboxError as exc:
        raise VerifyInfraError(f"the hidden tests of {task.task_id} could not run: {exc}") from exc
    ready = complete = False
    infra: str | None = None
    reported: dict[str, str | None] = {}
    for line in run.stdout.split("\n"):
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if not isinstance(item, dict):
            continue
        if item.get("ready") is True:
            ready = True
        elif item.get("done") is True:
            complete = True
        elif "infra" in item:
            infra = str(item["infra"])
        elif item.get("test") in names and item["test"] not in reported:
            reported[item["test"]] = None if item.get("ok") is True else str(item.get("error") or "failed")
    if not ready:
        detail = infra or f"exit code {run.return_code}: {run.stderr[-500:]}"
        raise VerifyInfraError(f"the hidden-test runner of {task.task_id} did not start: {detail}")
    if complete and len(reported) == len(names):
        return _result(names, reported, None)
    if run.timed_out:
        why = f"the test runner was stopped: still running after {wall:g} s"
    elif run.oom_killed:
        why = "the test runner was killed: out of memory"
    elif run.error_type == "disk_quota":
        why = "the test runner was stopped: the workspace passed its disk quota"
    else:
        why = f"the test runner was killed (exit code {run.return_code})"
    return _result(names, reported, why)


def _result(names: list[str], reported: dict[str, str | None], stopped: str | None) -> HiddenTestResult:
    """The tests reported (name -> error, None: passed); the others failed, not run because ``stopped``."""
    passed = [n for n in names if n in reported and reported[n] is None]
    failed = {n: reported.get(n) or f"not run: {stopped}" for n in names if n not in passed}
    return HiddenTestResult(passed=passed, failed=failed, complete=stopped is None, stopped=stopped)


class WorkspaceTasksServer(SimpleResourcesServer):
    config: WorkspaceTasksConfig

    _rollouts: RolloutSandboxes = PrivateAttr()
    _workspaces: Path | None = PrivateAttr(default=None)
    _prepared: dict[str, str] = PrivateAttr(default_factory=dict)
    _exported: dict[str, str] = PrivateAttr(default_factory=dict)  # task id -> its workspace's tar, base64

    def model_post_init(self, context: Any) -> None:
        super().model_post_init(context)
        check_sandbox_available(self.config.sandbox)  # refuse to start without bubblewrap
        self._rollouts = RolloutSandboxes(self.config.max_rollouts)

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/bash")(self.bash)
        app.post("/str_replace_based_edit_tool")(self.str_replace_based_edit_tool)
        app.post("/end_session")(self.end_session)
        app.post("/export_workspace")(self.export_workspace)
        return app

    async def on_startup(self) -> None:
        await super().on_startup()
        root = Path(tempfile.mkdtemp(prefix="nemo-gym-workspace-tasks-"))

        def build_all() -> None:
            for task in TASKS:
                build_workspace(task, root / task.task_id)

        await asyncio.to_thread(build_all)
        self._workspaces = root

    async def on_shutdown(self) -> None:
        """Nothing outlives the server: close every rollout's sandbox, remove the built workspaces."""
        await self._rollouts.close_all()
        if self._workspaces is not None:
            await asyncio.to_thread(shutil.rmtree, self._workspaces, True)
        await super().on_shutdown()

    # -- sandboxes ---------------------------------------------------------------------------------

    def _limits(self, *, for_verify: bool = False) -> SessionLimits:
        wall = self.config.verify_timeout_s if for_verify else self.config.command_timeout_s
        return SessionLimits(
            memory_mib=self.config.memory_mib,
            disk_quota_mib=self.config.disk_quota_mib,
            command_wall_time_s=wall,
            command_cpu_time_s=wall,
            output_limit_bytes=max(1_000_000, self.config.max_output_chars * 4),
            idle_timeout_s=self.config.idle_timeout_s,
            lifetime_s=self.config.lifetime_s,
            max_sessions=self.config.max_sandboxes,
            queue_timeout_s=self.config.sandbox.queue_timeout_s,
        )

    async def _workspace_id(self, task_id: str) -> str:
        if task_id not in self._prepared:
            if self._workspaces is None:
                raise HTTPException(status_code=503, detail="the task workspaces are not built yet")
            self._prepared[task_id] = await prepare_workspace(
                self._workspaces / task_id, workdir_root=self.config.sandbox.workdir_root
            )
        return self._prepared[task_id]

    async def _start(self, task_id: str) -> SandboxSession:
        try:
            return await SandboxSession.start(
                workspace=await self._workspace_id(task_id),
                limits=self._limits(),
                provider=self.config.sandbox,
            )
        except SandboxError as exc:
            raise HTTPException(
                status_code=503, detail=f"the workspace sandbox could not start: {exc}"
            ) from exc

    def _rollout(self, request: Request) -> RolloutSandbox:
        entry = self._rollouts.get(get_session_id(request))
        if entry is None:
            raise HTTPException(
                status_code=400,
                detail="no task is set up for this session: call /seed_session with the task row first",
            )
        return entry

    async def seed_session(
        self, request: Request, body: WorkspaceSeedSessionRequest
    ) -> BaseSeedSessionResponse:
        self._rollouts.put(get_session_id(request), _Task(body.task_id))
        return BaseSeedSessionResponse()

    async def export_workspace(self, request: Request) -> ExportWorkspaceResponse:
        """The rollout's task's starting workspace, for an agent that runs its own sandbox on it (not a
        tool: the model never calls it). Built by this server; the hidden tests are never in it."""
        task_id = self._rollout(request).data.task_id
        if task_id not in self._exported:
            if self._workspaces is None:
                raise HTTPException(status_code=503, detail="the task workspaces are not built yet")
            self._exported[task_id] = await asyncio.to_thread(_tar_base64, self._workspaces / task_id)
        return ExportWorkspaceResponse(tar_base64=self._exported[task_id])

    async def end_session(self, request: Request) -> dict[str, bool]:
        entry = self._rollouts.pop(get_session_id(request))
        if entry is not None:
            await entry.close("its rollout session ended")
        return {"ended": entry is not None}

    # -- tools -------------------------------------------------------------------------------------

    async def bash(self, request: Request, body: BashRequest) -> BashResponse:
        entry = self._rollout(request)
        cap = self.config.max_output_chars
        if not body.command.strip():
            return BashResponse(output="Error: `command` is empty", exit_code=None)
        async with entry.lock:
            entry.data.commands_run += 1
            sandbox, restarted = await entry.ensure(lambda: self._start(entry.data.task_id))
            note = (
                "[the previous sandbox had closed; the workspace was reset to the task's start]\n"
                if restarted
                else ""
            )
            try:
                # bash with stderr on stdout (one interleaved stream, as a terminal shows it).
                run = await sandbox.exec(
                    ["/bin/sh", "-c", 'exec /bin/bash -c "$1" 2>&1', "bash", body.command]
                )
            except SessionClosedError as exc:
                # The command took the sandbox down with it (e.g. ran it out of memory): the model's doing.
                await entry.close("its sandbox died")
                reason = str(exc).split(" is closed: ", 1)[-1]
                text = f"[the sandbox died under this command: {reason}; the next command starts from the task's workspace again]"
                return BashResponse(output=note + text, exit_code=None)
            except SandboxError as exc:
                raise HTTPException(status_code=503, detail=f"the workspace sandbox failed: {exc}") from exc
        output = run.stdout + run.stderr  # stderr: the sandbox's own notes (output cap, disk quota)
        if run.timed_out:
            output += f"\n[the command was killed: it ran longer than {self.config.command_timeout_s:g} s]"
        elif run.oom_killed:
            output += f"\n[the command was killed: out of memory ({self.config.memory_mib} MiB)]"
        return BashResponse(
            output=note + head_tail(output, cap),
            exit_code=None if run.timed_out else run.return_code,
            timed_out=run.timed_out,
        )

    async def str_replace_based_edit_tool(self, request: Request, body: EditRequest) -> EditResponse:
        entry = self._rollout(request)
        async with entry.lock:
            sandbox, _ = await entry.ensure(lambda: self._start(entry.data.task_id))
            try:
                output = await self._edit(sandbox, body)
            except _ToolError as exc:
                return EditResponse(output=str(exc), is_error=True)
            except SessionClosedError as exc:
                await entry.close("its sandbox died")
                return EditResponse(output=f"Error: the sandbox closed: {exc}", is_error=True)
            except SandboxError as exc:
                raise HTTPException(status_code=503, detail=f"the workspace sandbox failed: {exc}") from exc
            entry.data.edits_made += body.command in ("create", "str_replace", "insert")
        return EditResponse(output=head_tail(output, self.config.max_output_chars))

    async def _read_text(self, sandbox: SandboxSession, rel: str) -> str:
        try:
            data = await sandbox.read_file(rel, max_bytes=2_000_000)
        except ValueError as exc:
            raise _ToolError(f"Error: cannot read {_shown(rel)}: {_sandbox_reason(exc)}") from None
        try:
            return data.decode()
        except UnicodeDecodeError:
            raise _ToolError(f"Error: {_shown(rel)} is not a UTF-8 text file") from None

    async def _write_text(self, sandbox: SandboxSession, rel: str, text: str) -> None:
        try:
            await sandbox.write_file(rel, text)
        except ValueError as exc:
            raise _ToolError(f"Error: cannot write {_shown(rel)}: {_sandbox_reason(exc)}") from None

    async def _edit(self, sandbox: SandboxSession, body: EditRequest) -> str:
        rel = workspace_path(body.path)
        shown = _shown(rel)
        if body.command == "view":
            return await self._view(sandbox, rel, body.view_range)
        if body.command == "create":
            if body.file_text is None:
                raise _ToolError("Error: `file_text` is required for command create")
            if rel == ".":
                raise _ToolError("Error: cannot create /workspace itself; give a file path")
            await self._write_text(sandbox, rel, body.file_text)
            return f"File created successfully at: {shown}"
        if body.command == "str_replace":
            if not body.old_str:
                raise _ToolError("Error: `old_str` is required (and not empty) for command str_replace")
            text = await self._read_text(sandbox, rel)
            count = text.count(body.old_str)
            if count == 0:
                raise _ToolError(
                    f"Error: No replacement was performed, old_str `{body.old_str}` did not appear verbatim in {shown}."
                )
            if count > 1:
                lines = [
                    i + 1 for i, line in enumerate(text.split("\n")) if body.old_str.split("\n")[0] in line
                ]
                raise _ToolError(
                    f"Error: No replacement was performed. Multiple occurrences of old_str `{body.old_str}` in "
                    f"lines {lines}. Please ensure it is unique"
                )
            new = body.new_str or ""
            start = text.index(body.old_str)
            await self._write_text(sandbox, rel, text.replace(body.old_str, new, 1))
            first = text[:start].count("\n") + 1
            lines = text.replace(body.old_str, new, 1).split("\n")
            lo, hi = max(1, first - 4), min(len(lines), first + new.count("\n") + 4)
            return (
                f"The file {shown} has been edited. Here's the result of running `cat -n` on a snippet of {shown}:\n"
                f"{_numbered(lines[lo - 1 : hi], lo)}\nReview the changes and make sure they are as expected."
            )
        # insert
        if body.insert_line is None or body.new_str is None:
            raise _ToolError("Error: `insert_line` and `new_str` are required for command insert")
        text = await self._read_text(sandbox, rel)
        lines = _lines(text)
        if not 0 <= body.insert_line <= len(lines):
            raise _ToolError(
                f"Error: Invalid `insert_line` parameter: {body.insert_line}. It should be within the range of "
                f"lines of the file: [0, {len(lines)}]"
            )
        new_lines = body.new_str.split("\n")
        if body.new_str.endswith("\n"):
            new_lines = new_lines[:-1]
        result = lines[: body.insert_line] + new_lines + lines[body.insert_line :]
        await self._write_text(
            sandbox, rel, "\n".join(result) + ("\n" if text.endswith("\n") or not text else "")
        )
        lo = max(1, body.insert_line - 3)
        hi = min(len(result), body.insert_line + len(new_lines) + 4)
        return (
            f"The file {shown} has been edited. Here's the result of running `cat -n` on a snippet of the edited "
            f"file:\n{_numbered(result[lo - 1 : hi], lo)}\nReview the changes and make sure they are as expected."
        )

    async def _view(self, sandbox: SandboxSession, rel: str, view_range: list[int] | None) -> str:
        try:
            entries = await sandbox.list_dir(rel)
        except ValueError:
            entries = None
        if entries is not None:
            if view_range is not None:
                raise _ToolError("Error: `view_range` is not allowed when `path` is a directory")
            shown = _shown(rel)
            out = [
                f"Here are the files and directories up to 2 levels deep in {shown}, excluding hidden items:",
                shown,
            ]
            for e in entries:
                if e.name.startswith("."):
                    continue
                child = e.name if rel == "." else f"{rel}/{e.name}"
                out.append(_shown(child) + ("/" if e.kind == "dir" else ""))
                if e.kind == "dir":
                    try:
                        inner = await sandbox.list_dir(child)
                    except ValueError:
                        inner = []
                    out += [
                        f"{_shown(child)}/{i.name}" + ("/" if i.kind == "dir" else "")
                        for i in inner
                        if not i.name.startswith(".")
                    ]
            return "\n".join(out)
        text = await self._read_text(sandbox, rel)
        lines = _lines(text)
        first = 1
        if view_range is not None:
            if len(view_range) != 2:
                raise _ToolError("Error: `view_range` must be two integers [start, end] (end -1: to the end)")
            start, end = view_range
            if not 1 <= start <= max(1, len(lines)) or (end != -1 and not start <= end <= len(lines)):
                raise _ToolError(
                    f"Error: Invalid `view_range` {view_range}: the file has {len(lines)} lines "
                    "(start in [1, lines], end in [start, lines] or -1)"
                )
            lines = lines[start - 1 :] if end == -1 else lines[start - 1 : end]
            first = start
        return f"Here's the result of running `cat -n` on {_shown(rel)}:\n{_numbered(lines, first)}"

    # -- verify ------------------------------------------------------------------------------------

    async def verify(self, request: Request, body: WorkspaceVerifyRequest) -> WorkspaceVerifyResponse:
        task = TASKS_BY_ID[body.task_id]
        changes = None
        if body.workspace_changes is not None:
            try:
                changes = base64.b64decode(body.workspace_changes, validate=True)
            except ValueError as exc:
                raise HTTPException(
                    status_code=422, detail=f"workspace_changes is not base64: {exc}"
                ) from exc
        entry = self._rollouts.pop(get_session_id(request))
        try:
            async with asyncio.timeout(self.config.verify_timeout_s + 60):
                result = await self._check(task, entry, changes)
        except VerifyInfraError as exc:
            raise HTTPException(status_code=503, detail=str(exc)) from exc
        except TimeoutError as exc:
            raise HTTPException(status_code=503, detail=f"verifying {task.task_id} took too long") from exc
        finally:
            if entry is not None:
                await entry.close("its rollout was verified")
        fraction = len(result.passed) / result.total if result.total else 0.0
        return WorkspaceVerifyResponse.from_request(
            body,
            reward=1.0 if result.total and not result.failed else 0.0,
            kind=task.kind,
            tests_passed=fraction,
            passed_count=len(result.passed),
            test_count=result.total,
            failed_tests=result.failed,
            failure_reason=result.failure_reason,
            commands_run=entry.data.commands_run if entry is not None else 0,
            edits_made=entry.data.edits_made if entry is not None else 0,
            workspace_changes=None,  # applied, not echoed: a whole changeset is no part of the rollout's line
        )

    async def _check(
        self, task: Task, entry: RolloutSandbox | None, changes: bytes | None = None
    ) -> HiddenTestResult:
        """Fork the rollout's final workspace (or start the untouched one) and run the hidden tests there.
        ``changes`` (an agent's own sandbox's changeset) are applied to the rollout's workspace first."""
        limits = self._limits(for_verify=True)
        applied: SandboxSession | None = None
        try:
            if changes is not None:
                if entry is not None and entry.sandbox is not None and entry.live:
                    target = entry.sandbox
                else:
                    target = applied = await self._start(task.task_id)
                outcome = await self._apply_changes(target, changes)
                if outcome is not None:
                    return _result(task.test_names, {}, outcome)
                snapshot = await target.snapshot()
                checker = await target.fork(snapshot, limits=limits)
            elif entry is not None and entry.sandbox is not None:
                if not entry.live:
                    raise VerifyInfraError(
                        f"the rollout's workspace was lost: its sandbox closed ({entry.sandbox.closed})"
                    )
                async with entry.lock:
                    snapshot = await entry.sandbox.snapshot()
                    checker = await entry.sandbox.fork(snapshot, limits=limits)
            else:
                checker = await SandboxSession.start(
                    workspace=await self._workspace_id(task.task_id),
                    limits=limits,
                    provider=self.config.sandbox,
                )
        except SandboxError as exc:
            raise VerifyInfraError(f"the checking sandbox could not start: {exc}") from exc
        finally:
            if applied is not None:
                await applied.close("its changes were applied and forked")
        try:
            return await run_hidden_tests(
                checker, task, self.config.test_timeout_s, self.config.verify_timeout_s
            )
        finally:
            await checker.close("the hidden tests ran")

    async def _apply_changes(self, session: SandboxSession, changes: bytes) -> str | None:
        """Apply an agent's changeset to the rollout's workspace (inside its sandbox). None when applied;
        else why not (a changeset the workspace cannot take, e.g. past its disk quota: the model's
        doing, as it made the files). Not a tar at all: the caller's mistake, 422."""
        try:
            run = await session.apply_changes(changes, timeout=self.config.command_timeout_s)
        except SessionClosedError as exc:
            return f"the agent's workspace changes could not be applied: {exc}"
        if run.return_code == 2:
            raise HTTPException(
                status_code=422, detail=f"workspace_changes is not a changeset tar: {run.stdout[:300]}"
            )
        if run.return_code != 0 or run.error_type is not None:
            why = run.error_type or f"exit code {run.return_code}"
            return f"the agent's workspace changes could not be applied ({why}): {run.stderr[-300:]}"
        return None


def _tar_base64(root: Path) -> str:
    """A built workspace (this server's own, shallow) as a tar, base64."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for child in sorted(root.iterdir()):
            tar.add(child, arcname=child.name)
    return base64.b64encode(buffer.getvalue()).decode()


def _sandbox_reason(exc: ValueError) -> str:
    """The sandbox's reason without the repeated ``read_file 'path':`` prefix and an exception's name
    (``read_file '.': ValueError: '.' is not a file in the workspace`` -> ``'.' is not a file ...``)."""
    text = str(exc)
    text = text.split(": ", 1)[1] if ": " in text else text
    return re.sub(r"^[A-Za-z]*(Error|Exception): ", "", text)


if __name__ == "__main__":
    WorkspaceTasksServer.run_webserver()
