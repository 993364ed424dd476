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
* State is kept per session, notebook-like, BY REPLAY: each call first re-runs the session's earlier
  successful cells (their output discarded) and then the new one, in a fresh sandbox. So variables,
  functions and imports carry over; files written in the work dir and random state do not, and the
  replayed cells count against the call's CPU/wall limits. At most ``max_cells_per_session`` cells are
  kept (older ones are dropped, the model is told). ``POST /end_session`` forgets the session; ``/verify``
  does too. Sessions never verified are bounded by ``max_sessions`` (oldest dropped).
* ``POST /verify`` (row fields ``expected_result: str``, optional ``expected_code_contains``): the answer is
  the content of the last ``\\boxed{...}`` in the final assistant message (if none, in the tool outputs'
  stdout). reward = 1.0 iff math-verify finds it equal to ``expected_result`` (run in
  :mod:`nemo_gym.kit.verify_pool`, on a worker's main thread, since math-verify uses ``signal.alarm``).
  Returns ``extracted_answer`` and ``accuracy`` (upstream's fields) and ``used_python``.
* Infrastructure failures are never a reward of 0: a sandbox that cannot run answers the tool with a
  503 (the agent fails the rollout). A check that runs out of time, math-verify's own bound
  (``math_verify_timeout_seconds`` per parse / comparison; math-verify would swallow it and answer
  "not equal") or the pool's (``verify_timeout_s``), raises
  :class:`~nemo_gym.kit.verify_pool.VerifyTimeoutError`: ``/verify`` answers 503 of kind ``verify_timeout``
  (:mod:`nemo_gym.server_utils`), and a worker that dies a 503 of kind ``verify_failed``. The server
  refuses to START if bubblewrap is missing (naming the package).
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from pydantic import BaseModel, Field, PrivateAttr

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseRunRequest,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)
from nemo_gym.kit.verify_pool import VerifyTimeoutError, run_in_verify_pool
from nemo_gym.sandbox import (
    AsyncSandbox,
    SandboxError,
    SandboxProviderConfig,
    SandboxResources,
    SandboxSpec,
    check_sandbox_available,
)
from nemo_gym.server.base import get_session_id


class PythonExecutorResourcesServerConfig(BaseResourcesServerConfig):
    max_execution_time: int = Field(default=10, ge=1, description="Wall-clock seconds per tool call")
    max_cpu_time: float = Field(default=10.0, gt=0, description="CPU seconds per tool call")
    memory_mib: int = Field(default=1024, ge=64, description="Memory cap of the program's process tree")
    max_output_chars: int = Field(default=20_000, ge=100, description="stdout/stderr kept per call")
    max_cells_per_session: int = Field(default=30, ge=1)
    max_sessions: int = Field(default=10_000, ge=1)
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


def _extract_boxed_answer(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (nested braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth, begin = start + len("\\boxed{"), 1, start + len("\\boxed{")
    while i < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    if depth:
        return None
    answer = text[begin : i - 1].strip()
    return answer or None


def _strip_delimiters(s: str) -> str:
    s = s.strip()
    for left, right in (("\\(", "\\)"), ("\\[", "\\]"), ("$$", "$$"), ("$", "$")):
        if s.startswith(left) and s.endswith(right) and len(s) >= len(left) + len(right):
            s = s[len(left) : len(s) - len(right)].strip()
    return s


def check_answer(expected: str, answer: str, timeout_seconds: int = 5) -> bool:
    """math-verify equivalence of two LaTeX/plain answers. Runs in a verify-pool worker (main thread).

    Equal when math-verify shows them equal or their whitespace-normalised texts are the same. A parse
    or comparison past ``timeout_seconds`` raises :class:`VerifyTimeoutError` (math-verify itself would
    swallow the timeout and answer "not equal"): not knowing is not a wrong answer.
    """
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    def parsed(text: str, what: str) -> list[Any]:
        try:
            return parse(f"${_strip_delimiters(text)}$", parsing_timeout=timeout_seconds, raise_on_error=True)
        except TimeoutException as e:  # a BaseException
            raise VerifyTimeoutError(f"math-verify timed out parsing {what} {text[:200]!r}: {e}") from None
        except Exception:  # not math: only the text comparison below can match it
            return []

    gold, pred = parsed(expected, "expected_result"), parsed(answer, "the answer")
    if gold and pred:
        try:
            if verify(gold, pred, timeout_seconds=timeout_seconds, raise_on_error=True):
                return True
        except TimeoutException as e:
            raise VerifyTimeoutError(
                f"math-verify timed out comparing {answer[:200]!r} with expected_result {expected[:200]!r}: {e}"
            ) from None
        except Exception:  # sympy could not compare them: not shown equal
            pass
    return " ".join(_strip_delimiters(expected).split()) == " ".join(_strip_delimiters(answer).split())


class PythonExecutorResourcesServer(SimpleResourcesServer):
    config: PythonExecutorResourcesServerConfig

    _cells: OrderedDict[str, list[str]] = PrivateAttr(default_factory=OrderedDict)

    def model_post_init(self, context: Any) -> None:
        super().model_post_init(context)
        check_sandbox_available(self.config.sandbox)  # refuse to start without bubblewrap

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/execute_python")(self.execute_python)
        app.post("/end_session")(self.end_session)
        return app

    def _limits(self) -> SandboxResources:
        return SandboxResources(
            memory_mib=self.config.memory_mib,
            cpu_time_s=self.config.max_cpu_time,
            wall_time_s=float(self.config.max_execution_time),
            output_limit_bytes=self.config.max_output_chars * 4,
        )

    async def execute_python(self, request: Request, body: ExecutePythonRequest) -> ExecutePythonResponse:
        session_id = get_session_id(request)
        history = self._cells.pop(session_id, [])
        self._cells[session_id] = history  # most recently used at the end
        while len(self._cells) > self.config.max_sessions:
            self._cells.popitem(last=False)
        dropped = len(history) >= self.config.max_cells_per_session
        cells = (
            [*history[-(self.config.max_cells_per_session - 1) :], body.code]
            if dropped
            else [*history, body.code]
        )
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
        error = None
        if run.timed_out:
            error = f"Execution timed out (limit {self.config.max_execution_time} s wall, {self.config.max_cpu_time:g} s CPU)"
        elif run.oom_killed:
            error = f"Out of memory (limit {self.config.memory_mib} MiB)"
        elif run.error_type == "output_limit":
            error = "Output limit exceeded; the program was stopped"
        elif run.return_code != 0:
            error = _last_error_line(run.stderr) or f"exit code {run.return_code}"
        if error is None:
            self._cells[session_id] = cells
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

    async def end_session(self, request: Request) -> ExecutePythonResponse:
        self._cells.pop(get_session_id(request), None)
        return ExecutePythonResponse(success=True, stdout="", stderr="")

    async def verify(self, request: Request, body: PythonMathVerifyRequest) -> PythonMathVerifyResponse:
        self._cells.pop(get_session_id(request), None)
        actual = None
        used_python = False
        for item in reversed(body.response.output):
            if item.type == "message" and getattr(item, "role", None) == "assistant":
                text = "".join(c.text for c in item.content if getattr(c, "type", None) == "output_text")
                actual = _extract_boxed_answer(text)
                break
        for item in body.response.output:
            if item.type == "function_call" and item.name == "execute_python":
                used_python = True
        if actual is None:  # upstream's fallback: a boxed answer printed by the executed code
            for item in reversed(body.response.output):
                if item.type == "function_call_output":
                    try:
                        stdout = json.loads(item.output).get("stdout", "")
                    except (json.JSONDecodeError, AttributeError, TypeError):
                        stdout = str(item.output)
                    actual = _extract_boxed_answer(stdout)
                    if actual is not None:
                        break
        accuracy = False
        if actual is not None:
            # A timeout or a dead worker raises a VerifyPoolError: HTTP 503 (nemo_gym.server_utils).
            accuracy = await run_in_verify_pool(
                check_answer,
                body.expected_result,
                actual,
                self.config.math_verify_timeout_seconds,
                timeout=self.config.verify_timeout_s,
            )
        if accuracy and body.expected_code_contains:
            code = " ".join(
                str(json.loads(i.arguments).get("code", ""))
                for i in body.response.output
                if i.type == "function_call" and i.name == "execute_python" and _is_json_object(i.arguments)
            )
            accuracy = body.expected_code_contains in code
        return PythonMathVerifyResponse.from_request(
            body,
            reward=1.0 if accuracy else 0.0,
            extracted_answer=actual,
            accuracy=accuracy,
            used_python=used_python,
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
