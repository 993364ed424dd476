"""math_with_code: math problems solved with a sandboxed Python tool; the boxed answer is checked by math-verify.

Contract
--------
* ``POST /execute_python`` ``{"code": str}`` runs the code in :mod:`nemo_gym.sandbox` (bubblewrap: no
  network, read-only system, throw-away work dir, limits from the config) with Debian's python3, where
  numpy, scipy and sympy are importable (``np``, ``numpy``, ``scipy``, ``sympy``/``sp`` are pre-imported when
  the code mentions them). Answers ``{success, stdout, stderr, error_message, result}`` (upstream's fields;
  ``result`` is the repr of a final bare expression, like a notebook cell) plus ``timed_out``,
  ``oom_killed``, ``pids_limit_hit`` and ``output_truncated``. A program that fails (exception, timeout, memory) is
  ``success: false`` with the reason in ``error_message``: the model reads it.
* State is kept per session in a persistent kernel: the session's first call starts a
  :class:`~nemo_gym.sandbox.SandboxSession` and each cell runs ONCE in its Python kernel (the model's
  namespace is kept apart from the helper that runs it, which returns ``result`` after a random token on
  stdout and strips its own frames from tracebacks). Closed at ``/verify``, ``POST /end_session``, the
  kernel's idle timeout / lifetime, and server shutdown; at most ``max_kernels`` live (past it the least
  recently used idle one is closed). A session whose kernel is gone (closed, killed by its cell, OOM) gets
  a new one at its next call with its last ``max_cells_per_session`` successful cells replayed silently.
  A sandbox that dies under a cell is the cell's error (the model reads it), not a 503.
* Where sandbox sessions cannot run (no way to mount their workspace, as root or in a user namespace;
  another backend: ``SandboxUnavailableError``) and ``kernel: auto``, the server logs it once and falls
  back to REPLAY (``kernel: replay`` asks for it): each call first re-runs the session's earlier
  successful cells (their output discarded) and then the new one, in a fresh one-shot sandbox; at most
  ``max_cells_per_session`` cells are kept (older ones are dropped, the model is told). Sessions are
  bounded by ``max_sessions`` (oldest dropped).
* ``POST /verify`` (row fields ``expected_result: str``, optional ``expected_code_contains``): the answers
  are the contents of the ``\\boxed{...}`` of the final assistant message (if none, of the last tool
  output whose stdout has one). reward = 1.0 iff there is one and math-verify finds EVERY different one
  equal to ``expected_result`` (run in :mod:`nemo_gym.kit.verify_pool`, on a worker's main thread, since
  math-verify uses ``signal.alarm``; more than ``MAX_BOXED_ANSWERS`` different ones are a 0 unchecked).
  Returns ``extracted_answer`` and ``accuracy`` (upstream's fields), ``used_python`` and
  ``failure_reason`` (``no_boxed_answer``, ``wrong_answer``, ``several_answers: ...``,
  ``too_many_answers: ...``, ``answer_check_timeout: ...``, ``missing_code: ...``).
* What the answer causes is the answer's score: parsing or comparing it past math-verify's bound
  (``math_verify_timeout_seconds``; math-verify would swallow it and answer "not equal"), or its whole
  check past the pool's (``verify_timeout_s``), is reward 0 with ``answer_check_timeout``.
* Infrastructure failures are never a reward of 0: a sandbox that cannot run answers the tool with a
  503 (the agent fails the rollout); ``expected_result`` that cannot be parsed in time raises
  :class:`~nemo_gym.kit.verify_pool.VerifyTimeoutError` (``/verify`` answers 503 of kind
  ``verify_timeout``, :mod:`nemo_gym.server_utils`), and a worker that dies a 503 of kind
  ``verify_failed``. The server refuses to START if bubblewrap is missing (naming the package).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI, HTTPException, Request
from pydantic import BaseModel, Field, PrivateAttr

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseRunRequest,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)
from nemo_gym.kit.verify_pool import VerifyTimeoutError, get_verify_pool, run_in_verify_pool
from nemo_gym.sandbox import (
    AsyncSandbox,
    SandboxError,
    SandboxExecResult,
    SandboxProviderConfig,
    SandboxResources,
    SandboxSession,
    SandboxSpec,
    SandboxUnavailableError,
    SessionClosedError,
    SessionLimits,
    check_sandbox_available,
)
from nemo_gym.server.base import get_session_id

LOG = logging.getLogger(__name__)


class PythonExecutorResourcesServerConfig(BaseResourcesServerConfig):
    max_execution_time: int = Field(default=10, ge=1, description="Wall-clock seconds per tool call")
    max_cpu_time: float = Field(default=10.0, gt=0, description="CPU seconds per tool call")
    memory_mib: int = Field(default=1024, ge=64, description="Memory cap of the program's process tree")
    max_output_chars: int = Field(default=20_000, ge=100, description="stdout/stderr kept per call")
    max_cells_per_session: int = Field(
        default=30, ge=1, description="Cells kept per session for a replay (every call in replay mode)"
    )
    max_sessions: int = Field(default=10_000, ge=1, description="Sessions remembered (oldest dropped)")
    kernel: Literal["auto", "session", "replay"] = Field(
        default="auto",
        description="auto: a persistent kernel per session where sandbox sessions work (bubblewrap; root, or "
        "a user namespace with overlayfs or fuse-overlayfs), "
        "else replay (logged); session: kernels or 503; replay: re-run earlier cells at every call",
    )
    max_kernels: int = Field(
        default=64,
        ge=1,
        description="Live kernels per server process (the least recently used idle one is closed)",
    )
    kernel_idle_timeout_s: float = Field(
        default=600.0, gt=0, description="A kernel unused this long is closed"
    )
    kernel_lifetime_s: float = Field(default=3600.0, gt=0, description="A kernel older than this is closed")
    verify_timeout_s: float = Field(default=30.0, gt=0, description="Bound on one whole answer check")
    math_verify_timeout_seconds: int = Field(
        default=5, ge=1, description="math-verify's own bound on each parse / comparison"
    )
    sandbox: SandboxProviderConfig = Field(default_factory=SandboxProviderConfig)


class ExecutePythonRequest(BaseModel):
    code: str = Field(description="The Python code to execute.")


class ExecutePythonResponse(BaseModel):
    success: bool
    stdout: str
    stderr: str
    error_message: str | None = None
    result: str | None = None
    timed_out: bool = False
    oom_killed: bool = False
    pids_limit_hit: bool = False
    output_truncated: bool = False


class PythonMathRunRequest(BaseRunRequest):
    expected_result: str
    expected_code_contains: str = ""


class PythonMathVerifyRequest(PythonMathRunRequest, BaseVerifyRequest):
    pass


class PythonMathVerifyResponse(BaseVerifyResponse):
    extracted_answer: str | None = None
    accuracy: bool = False
    used_python: bool = False
    failure_reason: str | None = None


MAX_BOXED_ANSWERS = 8  # different boxed answers checked at most; more is a 0 without a check


# The driver that runs inside the sandbox: replays earlier cells silently, then runs the new one.
_DRIVER = r"""
import ast, contextlib, io, json, re, sys
cells = json.load(open("cells.json"))
ns = {"__name__": "__main__"}

def preload(code):
    if re.search(r"\bnp\b|\bnumpy\b", code):
        import numpy; ns.setdefault("np", numpy); ns.setdefault("numpy", numpy)
    if re.search(r"\bscipy\b", code):
        import scipy; ns.setdefault("scipy", scipy)
    if re.search(r"\bsympy\b|\bsp\b", code):
        import sympy; ns.setdefault("sympy", sympy); ns.setdefault("sp", sympy)

for old in cells[:-1]:
    preload(old)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        exec(compile(old, "<earlier cell>", "exec"), ns)

code = cells[-1]
try:
    preload(code)
    tree = ast.parse(code, "<cell>")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, "<cell>", "exec"), ns)
    if last is not None:
        value = eval(compile(last, "<cell>", "eval"), ns)
        if value is not None:
            with open("result.txt", "w") as f:
                f.write(repr(value))
except BaseException as exc:  # show the model its own frames only
    import traceback
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.endswith("driver.py")]
    sys.stdout.flush()
    if frames:
        sys.stderr.write("Traceback (most recent call last):\n" + "".join(traceback.format_list(frames)))
    sys.stderr.write("".join(traceback.format_exception_only(type(exc), exc)))
    sys.exit(1)
"""


_KERNEL_LOST = "its variables are lost]"  # the end of SandboxSession's note on a killed kernel
_KERNEL_REPLAYED = "the cells that succeeded before this one are re-run (silently) at the next call]"
_RESULT_CAP = 10_000  # characters of a cell's result (its final expression's repr)

# Defined once in each kernel (its own namespace; the model's code runs in `ns`, which it cannot see past):
# runs a cell like _DRIVER's last one, first replaying `cells` silently when the host asks (a new kernel
# for a session that had one), then writes the token and {"ok", "result"} to the real stdout.
_KERNEL_HELPER = r"""
def __nemo_gym_cell__():
    import ast, contextlib, io, json, re, sys, traceback
    ns = {"__name__": "__main__"}

    def preload(code):
        if re.search(r"\bnp\b|\bnumpy\b", code):
            import numpy; ns.setdefault("np", numpy); ns.setdefault("numpy", numpy)
        if re.search(r"\bscipy\b", code):
            import scipy; ns.setdefault("scipy", scipy)
        if re.search(r"\bsympy\b|\bsp\b", code):
            import sympy; ns.setdefault("sympy", sympy); ns.setdefault("sp", sympy)

    def run(code, cells, token, cap):
        for old in cells:
            try:
                preload(old)
                with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                    exec(compile(old, "<earlier cell>", "exec"), ns)
            except BaseException:
                pass
        ok, result = True, None
        try:
            preload(code)
            tree = ast.parse(code, "<cell>")
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body.pop().value)
            exec(compile(tree, "<cell>", "exec"), ns)
            if last is not None:
                value = eval(compile(last, "<cell>", "eval"), ns)
                if value is not None:
                    result = repr(value)[:cap]
        except BaseException as exc:  # show the model its own frames only
            ok = False
            frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != "<nemo_gym>"]
            err = sys.__stderr__
            try:
                sys.stdout.flush()
            except Exception:
                pass
            if frames:
                err.write("Traceback (most recent call last):\n" + "".join(traceback.format_list(frames)))
            err.write("".join(traceback.format_exception_only(type(exc), exc)))
            err.flush()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        sys.__stdout__.write(token + json.dumps({"ok": ok, "result": result}))
        sys.__stdout__.flush()

    return run

__nemo_gym_cell__ = __nemo_gym_cell__()
"""


def _cell_call(code: str, replay: list[str], token: str) -> str:
    """What the kernel runs for one cell: define the helper if this kernel is new, then call it (the last
    line is an expression whose value is None, so the kernel prints nothing of its own)."""
    return (
        f"if '__nemo_gym_cell__' not in globals(): exec(compile({_KERNEL_HELPER!r}, '<nemo_gym>', 'exec'))\n"
        f"__nemo_gym_cell__({code!r}, {replay!r}, {token!r}, {_RESULT_CAP})\n"
    )


async def _close(state: _SessionState) -> None:
    """Close a session's kernel (idempotent); its kept cells stay for a replay."""
    kernel, state.kernel = state.kernel, None
    if kernel is not None:
        await kernel.close("its rollout session ended")


def _boxed_answers(text: str) -> list[str]:
    """The contents of every complete ``\\boxed{...}`` of ``text`` (nested braces balanced), in order."""
    out: list[str] = []
    start = text.find("\\boxed{")
    while start >= 0:
        begin = i = start + len("\\boxed{")
        depth = 1
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth:  # never closes: neither does any box after it
            break
        answer = text[begin : i - 1].strip()
        if answer:
            out.append(answer)
        start = text.find("\\boxed{", i)
    return out


def _distinct(answers: list[str]) -> list[str]:
    """The answers without repeats (whitespace-normalised), first occurrence kept."""
    return list(dict.fromkeys(" ".join(a.split()) for a in answers))


def _strip_delimiters(s: str) -> str:
    s = s.strip()
    for left, right in (("\\(", "\\)"), ("\\[", "\\]"), ("$$", "$$"), ("$", "$")):
        if s.startswith(left) and s.endswith(right) and len(s) >= len(left) + len(right):
            s = s[len(left) : len(s) - len(right)].strip()
    return s


def grade_answers(expected: str, answers: list[str], timeout_seconds: int = 5) -> tuple[str, str | None]:
    """math-verify equivalence of every answer with ``expected``. Runs in a verify-pool worker (main thread).

    An answer is equal when math-verify shows it equal or their whitespace-normalised texts are the same.
    Returns ``(verdict, detail)``: ``right`` (every answer is equal), ``wrong`` (``detail``: the first that
    is not), ``answer_timeout`` (parsing or comparing an answer ran past ``timeout_seconds``: the answer
    made the check slow, so it is the answer's 0; math-verify itself would swallow the timeout and say
    "not equal") or ``expected_timeout`` (parsing ``expected_result`` alone ran past it: a data problem the
    model cannot cause, answered 503 by the caller).
    """
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    def parsed(text: str) -> list[Any]:
        try:
            return parse(f"${_strip_delimiters(text)}$", parsing_timeout=timeout_seconds, raise_on_error=True)
        except TimeoutException:  # a BaseException
            raise
        except Exception:  # not math: only the text comparison below can match it
            return []

    try:
        gold = parsed(expected)
    except TimeoutException as e:
        return "expected_timeout", f"math-verify timed out parsing expected_result {expected[:200]!r}: {e}"
    plain_expected = " ".join(_strip_delimiters(expected).split())
    for answer in answers:
        if " ".join(_strip_delimiters(answer).split()) == plain_expected:
            continue
        try:
            pred = parsed(answer)
        except TimeoutException:
            return "answer_timeout", f"math-verify could not parse the answer within {timeout_seconds} s"
        equal = False
        if gold and pred:
            try:
                equal = bool(verify(gold, pred, timeout_seconds=timeout_seconds, raise_on_error=True))
            except TimeoutException:
                return (
                    "answer_timeout",
                    "math-verify could not compare the answer with expected_result within "
                    f"{timeout_seconds} s",
                )
            except Exception:  # sympy could not compare them: not shown equal
                equal = False
        if not equal:
            return "wrong", answer
    return "right", None


def warm_up_worker() -> str:
    """Import math-verify (sympy, the LaTeX grammar) in a pool worker before the first real answer."""
    return grade_answers("1", ["1"])[0]


@dataclass
class _SessionState:
    """One rollout session's notebook: its live kernel (None until the first call, or after it was closed)
    and the last ``max_cells_per_session`` cells that ran without an error (replayed only into a NEW kernel:
    after the old one was lost, evicted or idle-closed, and always in replay mode)."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    kernel: SandboxSession | None = None
    cells: list[str] = field(default_factory=list)
    needs_replay: bool = False


class PythonExecutorResourcesServer(SimpleResourcesServer):
    config: PythonExecutorResourcesServerConfig

    _sessions: OrderedDict[str, _SessionState] = PrivateAttr(default_factory=OrderedDict)
    _mode: str = PrivateAttr(default="kernel")
    _closing: set[asyncio.Task] = PrivateAttr(default_factory=set)
    _token: str = PrivateAttr(default_factory=lambda: "\x00nemo-gym-cell-" + secrets.token_hex(8) + "\x00")

    def model_post_init(self, context: Any) -> None:
        super().model_post_init(context)
        check_sandbox_available(self.config.sandbox)  # refuse to start without bubblewrap
        self._mode = "replay" if self.config.kernel == "replay" else "kernel"

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/execute_python")(self.execute_python)
        app.post("/end_session")(self.end_session)
        return app

    async def on_shutdown(self) -> None:
        """Nothing outlives the server: close every live kernel."""
        sessions, self._sessions = list(self._sessions.values()), OrderedDict()
        await asyncio.gather(*(_close(s) for s in sessions), return_exceptions=True)
        await super().on_shutdown()

    def _limits(self) -> SandboxResources:
        return SandboxResources(
            memory_mib=self.config.memory_mib,
            cpu_time_s=self.config.max_cpu_time,
            wall_time_s=float(self.config.max_execution_time),
            output_limit_bytes=self.config.max_output_chars * 4,
        )

    def _session_limits(self) -> SessionLimits:
        return SessionLimits(
            memory_mib=self.config.memory_mib,
            processes=SandboxResources().processes,  # as a one-shot run
            command_wall_time_s=float(self.config.max_execution_time),
            command_cpu_time_s=self.config.max_cpu_time,
            # The cell's result rides on stdout after the user's output: room for it on top of the cap.
            output_limit_bytes=self.config.max_output_chars * 4 + _RESULT_CAP + 200,
            idle_timeout_s=self.config.kernel_idle_timeout_s,
            lifetime_s=self.config.kernel_lifetime_s,
            max_sessions=self.config.max_kernels,
            queue_timeout_s=self.config.sandbox.queue_timeout_s,
        )

    def _state(self, session_id: str) -> _SessionState:
        state = self._sessions.pop(session_id, None) or _SessionState()
        self._sessions[session_id] = state  # most recently used at the end
        while len(self._sessions) > self.config.max_sessions:
            _, old = self._sessions.popitem(last=False)
            if old.kernel is not None:
                task = asyncio.get_running_loop().create_task(_close(old))
                self._closing.add(task)  # the loop keeps only a weak reference to a task
                task.add_done_callback(self._closing.discard)
        return state

    async def execute_python(self, request: Request, body: ExecutePythonRequest) -> ExecutePythonResponse:
        state = self._state(get_session_id(request))
        async with state.lock:  # one cell at a time per session, as in a notebook
            if self._mode == "kernel":
                try:
                    return await self._execute_in_kernel(state, body.code)
                except SandboxUnavailableError as exc:
                    if self.config.kernel == "session":
                        raise HTTPException(
                            status_code=503, detail=f"the Python kernel could not start: {exc}"
                        ) from exc
                    LOG.warning(
                        "math_with_code: no persistent kernels here (%s); running cells by replay "
                        "(kernel: replay silences this)",
                        exc,
                    )
                    self._mode = "replay"
            return await self._execute_by_replay(state, body.code)

    async def _make_room(self, state: _SessionState) -> None:
        """At ``max_kernels`` live kernels, close the least recently used idle one (its session gets a new
        kernel, with its cells replayed, at its next call) rather than make this rollout wait."""
        live = [s for s in self._sessions.values() if s.kernel is not None and s.kernel.closed is None]
        excess = len(live) - self.config.max_kernels + 1
        for victim in live:  # least recently used first; a busy one is skipped (then start() queues)
            if excess <= 0:
                break
            if victim is not state and not victim.lock.locked():
                await _close(victim)
                excess -= 1

    async def _execute_in_kernel(self, state: _SessionState, code: str) -> ExecutePythonResponse:
        try:
            if state.kernel is None or state.kernel.closed is not None:
                state.needs_replay = bool(state.cells)
                await self._make_room(state)
                state.kernel = await SandboxSession.start(
                    limits=self._session_limits(), provider=self.config.sandbox
                )
            replay = state.cells if state.needs_replay else []
            run = await state.kernel.run_python(_cell_call(code, replay, self._token))
        except SessionClosedError as exc:
            # The sandbox died under the cell (the cell killed its kernel's parent, ran the whole sandbox out
            # of memory, or outlived the session's lifetime): the model's cell failed, not the server. The
            # next call gets a new kernel with the session's successful cells replayed.
            await _close(state)
            oom = "OOM" in str(exc)
            reason = str(exc).split(" is closed: ", 1)[-1]
            return ExecutePythonResponse(
                success=False,
                stdout="",
                stderr="",
                error_message=f"Out of memory (limit {self.config.memory_mib} MiB)"
                if oom
                else f"The Python kernel died: {reason}; {_KERNEL_REPLAYED[:-1]}",
                oom_killed=oom,
            )
        except SandboxUnavailableError:
            raise
        except SandboxError as exc:
            raise HTTPException(status_code=503, detail=f"the Python sandbox could not run: {exc}") from exc
        state.needs_replay = False
        stdout, meta = run.stdout, None
        cut = stdout.rfind(self._token)
        if cut >= 0:
            try:
                meta = json.loads(stdout[cut + len(self._token) :])
            except json.JSONDecodeError:
                meta = None
            stdout = stdout[:cut]
        stderr = run.stderr
        if run.return_code == 137:  # the kernel was killed: the next call's new kernel gets the replay
            state.needs_replay = bool(state.cells)
            stderr = stderr.replace(_KERNEL_LOST, _KERNEL_REPLAYED)
        error = self._error(run)
        if error is None and not (meta and meta.get("ok")):
            error = _last_error_line(run.stderr) or f"exit code {run.return_code}"
        if error is None:
            state.cells = [*state.cells, code][-self.config.max_cells_per_session :]
        cap = self.config.max_output_chars
        return ExecutePythonResponse(
            success=error is None,
            stdout=stdout[:cap],
            stderr=stderr[-cap:],
            error_message=error,
            result=meta.get("result") if meta and error is None else None,
            timed_out=run.timed_out,
            oom_killed=run.oom_killed,
            pids_limit_hit=run.pids_limit_hit,
            output_truncated=run.stdout_truncated or run.stderr_truncated or len(stdout) > cap,
        )

    def _error(self, run: SandboxExecResult) -> str | None:
        """The sandbox's own verdict on a run, in the words the model reads (None: the program decides)."""
        if run.timed_out:
            return f"Execution timed out (limit {self.config.max_execution_time} s wall, {self.config.max_cpu_time:g} s CPU)"
        if run.oom_killed:
            return f"Out of memory (limit {self.config.memory_mib} MiB)"
        if run.error_type == "output_limit" or run.stdout_truncated or run.stderr_truncated:
            return "Output limit exceeded; the program was stopped"
        if run.error_type == "disk_quota":
            return "Disk quota exceeded; the program was stopped"
        return None

    async def _execute_by_replay(self, state: _SessionState, code: str) -> ExecutePythonResponse:
        """Without persistent kernels: re-run the session's earlier successful cells, then the new one."""
        history = state.cells
        dropped = len(history) >= self.config.max_cells_per_session
        cells = [*history[-(self.config.max_cells_per_session - 1) :], code] if dropped else [*history, code]
        spec = SandboxSpec(
            files={"driver.py": _DRIVER, "cells.json": json.dumps(cells)}, resources=self._limits()
        )
        try:
            async with AsyncSandbox(provider=self.config.sandbox, spec=spec) as sandbox:
                run = await sandbox.exec(["python3", "-I", "driver.py"])
                result_text = None
                if run.ok:
                    try:
                        result_text = (await sandbox.read_file("result.txt", 10_000)).decode(errors="replace")
                    except (FileNotFoundError, ValueError):
                        result_text = None
        except SandboxError as exc:
            raise HTTPException(status_code=503, detail=f"the Python sandbox could not run: {exc}") from exc

        cap = self.config.max_output_chars
        error = self._error(run)
        if error is None and run.return_code != 0:
            error = _last_error_line(run.stderr) or f"exit code {run.return_code}"
        if error is None:
            state.cells = cells
        if dropped and error is None:
            error_note = f"(note: only the last {self.config.max_cells_per_session} cells are kept)"
            run.stderr = f"{run.stderr}\n{error_note}".lstrip()
        return ExecutePythonResponse(
            success=error is None,
            stdout=run.stdout[:cap],
            stderr=run.stderr[-cap:],
            error_message=error,
            result=result_text,
            timed_out=run.timed_out,
            oom_killed=run.oom_killed,
            pids_limit_hit=run.pids_limit_hit,
            output_truncated=run.stdout_truncated or run.stderr_truncated or len(run.stdout) > cap,
        )

    async def _forget(self, request: Request) -> None:
        state = self._sessions.pop(get_session_id(request), None)
        if state is not None:
            await _close(state)

    async def end_session(self, request: Request) -> ExecutePythonResponse:
        await self._forget(request)
        return ExecutePythonResponse(success=True, stdout="", stderr="")

    async def on_startup(self) -> None:
        await super().on_startup()
        # A cold worker spends seconds importing sympy: warm every worker now, in the background, so the
        # first answers' math_verify_timeout_seconds measures the check, not the imports.
        get_verify_pool().warm_up(warm_up_worker, timeout=300)

    async def verify(self, request: Request, body: PythonMathVerifyRequest) -> PythonMathVerifyResponse:
        await self._forget(request)
        answers: list[str] = []
        used_python = False
        for item in reversed(body.response.output):
            if item.type == "message" and getattr(item, "role", None) == "assistant":
                text = "".join(c.text for c in item.content if getattr(c, "type", None) == "output_text")
                answers = _boxed_answers(text)
                break
        for item in body.response.output:
            if item.type == "function_call" and item.name == "execute_python":
                used_python = True
        if not answers:  # upstream's fallback: a boxed answer printed by the executed code
            for item in reversed(body.response.output):
                if item.type == "function_call_output":
                    try:
                        stdout = json.loads(item.output).get("stdout", "")
                    except (json.JSONDecodeError, AttributeError, TypeError, RecursionError):
                        stdout = str(item.output)
                    answers = _boxed_answers(str(stdout))
                    if answers:
                        break
        distinct = _distinct(answers)
        actual = answers[-1] if answers else None
        reason: str | None = None
        if not distinct:
            reason = "no_boxed_answer"
        elif len(distinct) > MAX_BOXED_ANSWERS:
            reason = (
                f"too_many_answers: {len(distinct)} different boxed answers (at most {MAX_BOXED_ANSWERS})"
            )
        else:
            try:
                verdict, detail = await run_in_verify_pool(
                    grade_answers,
                    body.expected_result,
                    distinct,
                    self.config.math_verify_timeout_seconds,
                    timeout=self.config.verify_timeout_s,
                )
            except VerifyTimeoutError as exc:  # the pool's bound: this answer's check ran past it
                verdict, detail = (
                    "answer_timeout",
                    f"the check of the answer ran past verify_timeout_s: {exc}",
                )
            if verdict == "expected_timeout":  # the row's expected_result: not the model's doing (503)
                raise VerifyTimeoutError(detail)
            if verdict == "answer_timeout":
                reason = f"answer_check_timeout: {detail}"
            elif verdict == "wrong":
                reason = (
                    "wrong_answer"
                    if len(distinct) == 1
                    else f"several_answers: {len(distinct)} different boxed answers, "
                    f"{str(detail)[:100]!r} is wrong"
                )
        accuracy = reason is None
        if accuracy and body.expected_code_contains:
            code = " ".join(
                str(json.loads(i.arguments).get("code", ""))
                for i in body.response.output
                if i.type == "function_call" and i.name == "execute_python" and _is_json_object(i.arguments)
            )
            accuracy = body.expected_code_contains in code
            reason = None if accuracy else "missing_code: the executed code lacks expected_code_contains"
        return PythonMathVerifyResponse.from_request(
            body,
            reward=1.0 if accuracy else 0.0,
            extracted_answer=actual,
            accuracy=accuracy,
            used_python=used_python,
            failure_reason=reason,
        )


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (json.JSONDecodeError, TypeError):
        return False


_ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b.*$", re.M)


def _last_error_line(stderr: str) -> str | None:
    lines = [m.group(0) for m in _ERROR_LINE.finditer(stderr)]
    return lines[-1] if lines else None


if __name__ == "__main__":
    PythonExecutorResourcesServer.run_webserver()
