"""scientific_code: multi-step scientific coding problems, each step a function tested against numeric
targets in the sandbox (SciCode's idea, written here).

Contract
--------
* Row fields (SciCode's names): ``problem_id``, ``problem_description_main``, ``required_dependencies``
  (Python import lines, already executed for the model's code), ``sub_steps``: a list of
  ``{step_number, step_description_prompt, function_header, return_line, test_cases}``, each test case
  ``{setup, call, target, rtol, atol}`` (statements, an expression calling the step's function, the
  reference's value as a JSON number or nested lists, tolerances as ``numpy.isclose``). A row with no
  steps, a header that is not a ``def`` with a docstring, a test without a finite target or a negative
  tolerance is refused (422 naming the field) at ``/seed_session`` and ``/verify``: never a reward.
* The agent (``responses_api_agents/scicode_agent``) asks for one step at a time and sends the answer
  text of each step as ``step_answers`` (without it, the assistant messages of ``response.output`` in
  order, one per step). The code of a step is the last fenced code block of its answer.
* ``/verify`` (stateless) runs all steps of the rollout in ONE sandboxed process (``harness.py``): the
  dependencies, then for each step its code followed by its tests, in one namespace, so step k's tests
  see the code of steps 1..k as the model wrote it. The sandbox reports each test's *value*; the values
  are compared with the targets here (the targets never enter the sandbox). A step passes when its code
  defines the function and every test value matches. reward = 1.0 iff every step passes.
  ``substeps_passed`` (count), ``substeps_total``, ``substeps_passed_fraction``, ``failure_reason`` (the
  first failing step's reason, or ``pass``) and ``step_results`` (per step: ``step_number``,
  ``passed``, ``reason``, ``tests_passed``, ``tests_total``, ``detail``).
* Step reasons, all the model's doing (scored 0 for the problem): ``no_answer`` (fewer answers than
  steps), ``no_code`` (no fenced block), ``syntax_error``, ``runtime_error`` (defining it or calling it
  raised), ``missing_function`` (the header's function is not defined), ``wrong_answer`` (a value or
  shape off the target), ``not_numeric``/``too_large`` (a value that is not an array of numbers),
  ``timeout`` (a definition or test past ``step_timeout_s``, or the whole run past
  ``run_timeout_s`` after the harness started: the model's code did not finish), ``memory``,
  ``output_limit``, ``disk_quota`` (files past the sandbox's work dir quota), ``crashed`` (the process ended inside the model's code), ``tampered_output`` (a line
  with the harness's nonce that the harness did not write: the model's code can read the nonce, so the
  server reads those lines as the exact sequence and shapes the harness writes, :func:`harness_records`;
  that step and the later ones fail, never a 500).
* Infrastructure trouble is never a score: a sandbox that cannot start or whose queue is full
  (:class:`SandboxError`), or a harness that never reached its ``ready`` line (the sandbox's Python
  cannot import the dependencies), answers 503 (the failures sidecar of ``ng_collect_rollouts``).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import secrets
from collections.abc import Sequence
from functools import lru_cache
from typing import Any, ClassVar

import numpy as np
from fastapi import HTTPException
from pydantic import BaseModel, Field, field_validator

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseSeedSessionRequest,
    BaseSeedSessionResponse,
    BaseVerifyRequest,
    BaseVerifyResponse,
    ReverifyMode,
    SimpleResourcesServer,
)
from nemo_gym.kit import pyast
from nemo_gym.kit.text import last_code_block
from nemo_gym.sandbox import (
    SandboxError,
    SandboxExecResult,
    SandboxProviderConfig,
    SandboxResources,
    check_sandbox_available,
    python_argv,
    run_in_sandbox,
)
from resources_servers.scientific_code.harness import HARNESS


class ScientificCodeConfig(BaseResourcesServerConfig):
    REVERIFY_MODE: ClassVar[ReverifyMode] = ReverifyMode.STATELESS  # verify reads the row and the answers
    num_processes: int = Field(default=8, ge=1, description="Verifications at once (one sandbox run each)")
    step_timeout_s: float = Field(default=10, gt=0, description="Bound on one step's definition or one test")
    run_timeout_s: float = Field(default=120, gt=0, description="Wall and CPU bound of a rollout's whole run")
    memory_mib: int = Field(default=1024, ge=128)
    max_output_bytes: int = Field(default=2_000_000, ge=10_000)
    sandbox: SandboxProviderConfig = Field(default_factory=SandboxProviderConfig)


def _finite_numbers(value: Any, where: str) -> None:
    try:
        array = np.asarray(value, dtype=float)
    except (TypeError, ValueError):
        raise ValueError(f"{where} must be a number or nested lists of numbers") from None
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{where} must be finite")


class TestCase(BaseModel):
    __test__ = False  # not a pytest class
    setup: str = ""
    call: str = Field(min_length=1)
    target: float | list[Any]
    rtol: float = Field(default=1e-6, ge=0)
    atol: float = Field(default=1e-9, ge=0)

    @field_validator("target")
    @classmethod
    def _numeric(cls, target: Any) -> Any:
        _finite_numbers(target, "target")
        return target


class SubStep(BaseModel):
    step_number: str = Field(min_length=1)
    step_description_prompt: str = ""
    function_header: str
    return_line: str = ""
    test_cases: list[TestCase] = Field(min_length=1)

    @field_validator("function_header")
    @classmethod
    def _a_def(cls, header: str) -> str:
        function_name(header)
        return header

    @property
    def function(self) -> str:
        return function_name(self.function_header)


@lru_cache(maxsize=4096)
def function_name(header: str) -> str:
    """The name of the function a step header declares (``ValueError`` if it declares no function).
    Cached: every ``/seed_session`` and ``/verify`` of a row checks the same headers."""
    try:
        tree = pyast.parse(header + "\n    pass")
    except SyntaxError as e:
        raise ValueError(f"function_header does not parse as a def with its docstring: {e.msg}") from None
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    if len(defs) != 1:
        raise ValueError("function_header must declare exactly one function")
    return defs[0].name


class ScientificCodeRow(BaseModel):
    problem_id: str = Field(min_length=1)
    problem_description_main: str = ""
    required_dependencies: str = "import numpy as np"
    sub_steps: list[SubStep] = Field(min_length=1)

    @field_validator("required_dependencies")
    @classmethod
    def _imports(cls, dependencies: str) -> str:
        return _checked_imports(dependencies)


@lru_cache(maxsize=1024)
def _checked_imports(dependencies: str) -> str:
    """``dependencies`` if it is import lines only (``ValueError`` otherwise); cached like headers."""
    try:
        tree = pyast.parse(dependencies)
    except SyntaxError as e:
        raise ValueError(f"required_dependencies does not parse: {e.msg}") from None
    if not all(isinstance(n, ast.Import | ast.ImportFrom) for n in tree.body):
        raise ValueError("required_dependencies must hold import statements only")
    return dependencies


class ScientificCodeSeedSessionRequest(ScientificCodeRow, BaseSeedSessionRequest):
    pass


class ScientificCodeVerifyRequest(ScientificCodeRow, BaseVerifyRequest):
    step_answers: list[str] | None = None


class StepResult(BaseModel):
    step_number: str
    passed: bool
    reason: str
    tests_passed: int
    tests_total: int
    detail: str = ""


class ScientificCodeVerifyResponse(ScientificCodeVerifyRequest, BaseVerifyResponse):
    substeps_passed: int
    substeps_total: int
    substeps_passed_fraction: float
    failure_reason: str
    step_results: list[StepResult]


def extract_code(text: str | None) -> str | None:
    """The code of a step's answer: its last fenced block, python-tagged ones first (linear in the text,
    :func:`nemo_gym.kit.text.last_code_block`); None when there is none."""
    return last_code_block(text)


def answers_of(body: ScientificCodeVerifyRequest) -> list[str]:
    """Each step's answer text: the agent's ``step_answers``, else one assistant message per step."""
    if body.step_answers is not None:
        return body.step_answers
    texts = []
    for item in body.response.output:
        if getattr(item, "type", None) == "message" and getattr(item, "role", None) == "assistant":
            texts.append("".join(getattr(c, "text", "") or "" for c in item.content or []))
    return texts


def compare(value: Any, case: TestCase) -> str | None:
    """Why ``value`` does not match the case's target (None when it does)."""
    got = np.asarray(value, dtype=float)
    want = np.asarray(case.target, dtype=float)
    if got.shape != want.shape:
        return f"shape {list(got.shape)}, expected {list(want.shape)}"
    if np.allclose(got, want, rtol=case.rtol, atol=case.atol):
        return None
    error = np.abs(got - want)
    worst = int(np.nanargmax(np.where(np.isnan(error), np.inf, error))) if error.size else 0
    return (
        f"value off the target (rtol {case.rtol:g}, atol {case.atol:g}): "
        f"{float(got.flat[worst])!r} where {float(want.flat[worst])!r} was expected"
    )


class ScientificCodeServer(SimpleResourcesServer):
    config: ScientificCodeConfig

    def model_post_init(self, context: Any) -> None:
        super().model_post_init(context)
        check_sandbox_available(self.config.sandbox)  # refuse to start without the sandbox
        self._semaphore = asyncio.Semaphore(self.config.num_processes)

    async def seed_session(self, body: ScientificCodeSeedSessionRequest) -> BaseSeedSessionResponse:
        return BaseSeedSessionResponse()  # the row is valid (else 422); no state is kept

    async def run_steps(self, row: ScientificCodeRow, codes: list[str | None]) -> list[dict[str, Any]]:
        """The harness's records for these codes (one per step), or HTTPException(503) when the sandbox
        could not run them."""
        nonce = secrets.token_hex(16)
        steps = [
            {
                "code": code,
                "function": step.function,
                "tests": [{"setup": c.setup, "call": c.call} for c in step.test_cases],
            }
            for step, code in zip(row.sub_steps, codes, strict=True)
        ]
        config = {
            "dependencies": row.required_dependencies,
            "step_timeout_s": self.config.step_timeout_s,
            "steps": steps,
        }
        limits = SandboxResources(
            memory_mib=self.config.memory_mib,
            cpu_time_s=self.config.run_timeout_s,
            wall_time_s=self.config.run_timeout_s,
            output_limit_bytes=self.config.max_output_bytes,
        )
        try:
            run = await run_in_sandbox(
                python_argv(self.config.sandbox, "harness.py"),
                files={"harness.py": HARNESS, "steps.json": json.dumps(config)},
                stdin=nonce + "\n",
                resources=limits,
                provider=self.config.sandbox,
            )
        except SandboxError as exc:
            raise HTTPException(503, f"the code sandbox could not run (not scored): {exc}") from exc
        return harness_records(run, nonce, [len(step.test_cases) for step in row.sub_steps])

    async def verify(self, body: ScientificCodeVerifyRequest) -> ScientificCodeVerifyResponse:
        answers = answers_of(body)
        steps = body.sub_steps
        codes = [extract_code(a) for a in answers[: len(steps)]]
        codes += [None] * (len(steps) - len(codes))
        if any(c is not None for c in codes):
            async with self._semaphore:
                records = await self.run_steps(body, codes)
        else:
            records = [{"code": "missing", "tests": {}} for _ in steps]
        results = []
        for k, (step, record) in enumerate(zip(steps, records, strict=True)):
            if record["code"] == "missing" and not record.get("tampered"):
                reason = "no_answer" if k >= len(answers) else "no_code"
                results.append(
                    StepResult(
                        step_number=step.step_number,
                        passed=False,
                        reason=reason,
                        tests_passed=0,
                        tests_total=len(step.test_cases),
                    )
                )
                continue
            results.append(judge_step(step, record))
        passed = sum(r.passed for r in results)
        first_failure = next((r.reason for r in results if not r.passed), "pass")
        return ScientificCodeVerifyResponse.from_request(
            body,
            reward=1.0 if passed == len(steps) else 0.0,
            substeps_passed=passed,
            substeps_total=len(steps),
            substeps_passed_fraction=passed / len(steps),
            failure_reason=first_failure,
            step_results=results,
        )


# What the harness writes (harness.py): anything else tagged with its nonce was written by the model's code.
STEP_STATUSES = frozenset({"ok", "missing", "syntax_error", "runtime_error", "timeout", "missing_function"})
TEST_ERRORS = frozenset({"runtime_error", "timeout", "not_numeric", "too_large"})
MAX_VALUE_ELEMENTS = 200_000  # the harness's MAX_ELEMENTS: a bigger value is its too_large error


class _Tampered(Exception):
    """A line with the harness's nonce that the harness did not write where it was read."""


class _Ended(Exception):
    """The harness's lines stop here (the run ended)."""


def _parsed(text: str) -> dict[str, Any]:
    try:
        record = json.loads(text)
    except (ValueError, RecursionError) as e:  # not JSON, an integer past Python's digit limit, deep nesting
        raise _Tampered(f"a line that is not a JSON record ({type(e).__name__})") from None
    if not isinstance(record, dict):
        raise _Tampered(f"a line that is a JSON {type(record).__name__}, not a record")
    return record


def _index(value: Any) -> bool:
    return type(value) is int  # not a bool, not a float


def _step_record(record: dict[str, Any], k: int) -> dict[str, Any]:
    if (
        record.keys() != {"step", "code", "detail"}
        or not _index(record["step"])
        or record["step"] != k
        or record["code"] not in STEP_STATUSES
        or not isinstance(record["detail"], str)
    ):
        raise _Tampered(f"{_shown(record)} where step {k + 1}'s record was due")
    return record


def _test_record(record: dict[str, Any], k: int, i: int) -> dict[str, Any]:
    where = f"{_shown(record)} where test {i + 1} of step {k + 1} was due"
    if not (
        _index(record.get("step"))
        and record["step"] == k
        and _index(record.get("test"))
        and record["test"] == i
    ):
        raise _Tampered(where)
    if record.keys() == {"step", "test", "error", "detail"}:
        if record["error"] not in TEST_ERRORS or not isinstance(record["detail"], str):
            raise _Tampered(where)
        return record
    if record.keys() != {"step", "test", "value"}:
        raise _Tampered(where)
    try:
        value = np.asarray(record["value"])
    except (ValueError, TypeError, OverflowError):  # ragged lists, objects
        raise _Tampered(where) from None
    if value.dtype.kind not in "fi" or value.size > MAX_VALUE_ELEMENTS:  # text, None, bools, huge integers
        raise _Tampered(where)
    return {**record, "value": value}


def _shown(record: dict[str, Any]) -> str:
    text = json.dumps(record, default=str)
    return text if len(text) <= 120 else text[:117] + "..."


def harness_records(run: SandboxExecResult, nonce: str, test_counts: Sequence[int]) -> list[dict[str, Any]]:
    """Per step (``test_counts[k]``: step k's number of tests): ``{"code": status, "detail", "tests":
    {index: record}, "ended": (reason, why), "tampered": None | why}``. Steps the harness never reached get
    the reason the run ended with. 503 when the harness never became ready.

    The harness's lines are read as the exact sequence it writes: ``ready``, then per step its record and,
    when the step is ``ok``, one record per test in order, then ``done``. The model's code runs in the
    harness's process and can read the nonce, so it can write lines too: a nonce line out of that sequence,
    or not of the harness's shape (types, keys, indices, values that are not arrays of numbers), is
    ``tampered``: that step and every later one fail (``tampered_output``, the model's 0); the lines after
    it are not read. Text after the last newline is a line the run ended in the middle of: not read."""
    n_steps = len(test_counts)
    records: list[dict[str, Any]] = [
        {"code": None, "detail": "", "tests": {}, "tampered": None} for _ in range(n_steps)
    ]
    prefix = nonce + " "
    lines = [line[len(prefix) :] for line in run.stdout.split("\n")[:-1] if line.startswith(prefix)]
    ready = False
    if lines:
        with contextlib.suppress(_Tampered):
            ready = _parsed(lines[0]) == {"ready": True}  # before it no model code has run
    if not ready:
        tail = run.stderr[-1500:].strip()
        raise HTTPException(
            503,
            "the sandbox's Python did not start the test harness (not scored): "
            f"return code {run.return_code}, timed out {run.timed_out}: {tail}",
        )
    remaining = iter(lines[1:])

    def next_record() -> dict[str, Any]:
        line = next(remaining, None)
        if line is None:
            raise _Ended
        return _parsed(line)

    k = 0
    try:
        for k in range(n_steps):
            step = _step_record(next_record(), k)
            records[k].update(code=step["code"], detail=step["detail"])
            if step["code"] != "ok":
                continue
            for i in range(test_counts[k]):
                records[k]["tests"][i] = _test_record(next_record(), k, i)
        if next_record() != {"done": True}:
            raise _Tampered("a line where the harness's last line was due")
        next_record()
        raise _Tampered("a line after the harness's last line")
    except _Ended:
        pass
    except _Tampered as e:
        for j in range(k, n_steps):
            records[j]["tampered"] = (
                f"the harness's output was tampered with: {e} (the model's code wrote it with the nonce)"
                if j == k
                else f"not judged: the harness's output was tampered with in step {k + 1}"
            )
    if run.timed_out:
        ended, why = "timeout", f"the whole run passed its limit ({run.wall_time_s:.1f} s)"
    elif run.oom_killed or "MemoryError" in run.stderr[-2000:]:
        ended, why = "memory", "the process ran out of memory"
    elif run.error_type == "output_limit":
        ended, why = "output_limit", "the process wrote more than the output limit"
    elif run.error_type == "disk_quota":
        ended, why = "disk_quota", "the process wrote more files than its work dir's disk quota"
    else:
        ended, why = "crashed", f"the process ended (code {run.return_code}): {run.stderr[-300:].strip()}"
    for record in records:
        record["ended"] = (ended, why)
    return records


def judge_step(step: SubStep, record: dict[str, Any]) -> StepResult:
    """A step's verdict from the harness's record of it (values compared with the targets here)."""
    total = len(step.test_cases)
    ended, why = record["ended"]

    def failed(reason: str, detail: str, passed: int = 0) -> StepResult:
        return StepResult(
            step_number=step.step_number,
            passed=False,
            reason=reason,
            tests_passed=passed,
            tests_total=total,
            detail=detail[:500],
        )

    if record["tampered"]:
        return failed("tampered_output", record["tampered"])
    if record["code"] is None:
        return failed(ended, why)
    if record["code"] != "ok":
        return failed(record["code"], record["detail"])
    passed, first = 0, None
    for i, case in enumerate(step.test_cases):
        test = record["tests"].get(i)
        if test is None:
            problem = (ended, f"test {i + 1}: {why}")
        elif "error" in test:
            problem = (test["error"], f"test {i + 1} ({case.call[:80]}): {test.get('detail', '')}")
        else:
            mismatch = compare(test["value"], case)
            problem = (
                None if mismatch is None else ("wrong_answer", f"test {i + 1} ({case.call[:80]}): {mismatch}")
            )
        if problem is None:
            passed += 1
        elif first is None:
            first = problem
    if first is not None:
        return failed(first[0], first[1], passed)
    return StepResult(
        step_number=step.step_number, passed=True, reason="pass", tests_passed=passed, tests_total=total
    )


if __name__ == "__main__":
    ScientificCodeServer.run_webserver()
