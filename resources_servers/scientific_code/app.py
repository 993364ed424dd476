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
  ``output_limit``, ``crashed`` (the process ended inside the model's code).
* Infrastructure trouble is never a score: a sandbox that cannot start or whose queue is full
  (:class:`SandboxError`), or a harness that never reached its ``ready`` line (the sandbox's Python
  cannot import the dependencies), answers 503 (the failures sidecar of ``ng_collect_rollouts``).
"""

from __future__ import annotations

import ast
import asyncio
import json
import re
import secrets
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
        tree = ast.parse(header + "\n    pass")
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
        tree = ast.parse(dependencies)
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


_FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)```", re.S)


def extract_code(text: str | None) -> str | None:
    """The last fenced code block of ``text`` (python-tagged ones first); None when there is none."""
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(text or "")]
    python = [body for lang, body in blocks if lang in ("python", "py", "python3")]
    chosen = python or [body for _, body in blocks]
    return chosen[-1] if chosen and chosen[-1].strip() else None


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
        return harness_records(run, nonce, len(steps))

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
            if record["code"] == "missing":
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


def harness_records(run: SandboxExecResult, nonce: str, n_steps: int) -> list[dict[str, Any]]:
    """Per step: ``{"code": status, "detail", "tests": {index: record}}``; steps the harness never
    reached get the reason the run ended with. 503 when the harness never became ready."""
    records: list[dict[str, Any]] = [{"code": None, "detail": "", "tests": {}} for _ in range(n_steps)]
    ready = False
    prefix = nonce + " "
    for line in run.stdout.splitlines():
        if not line.startswith(prefix):
            continue
        try:
            record = json.loads(line[len(prefix) :])
        except json.JSONDecodeError:
            continue  # a line cut by the output limit
        if record.get("ready"):
            ready = True
        elif "test" in record:
            records[record["step"]]["tests"][record["test"]] = record
        elif "step" in record:
            records[record["step"]].update(code=record["code"], detail=record.get("detail", ""))
    if not ready:
        tail = run.stderr[-1500:].strip()
        raise HTTPException(
            503,
            "the sandbox's Python did not start the test harness (not scored): "
            f"return code {run.return_code}, timed out {run.timed_out}: {tail}",
        )
    if run.timed_out:
        ended, why = "timeout", f"the whole run passed its limit ({run.wall_time_s:.1f} s)"
    elif run.oom_killed or "MemoryError" in run.stderr[-2000:]:
        ended, why = "memory", "the process ran out of memory"
    elif run.error_type == "output_limit":
        ended, why = "output_limit", "the process wrote more than the output limit"
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
