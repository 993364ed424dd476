"""code_gen: competitive programming; the model's program is run against the row's unit tests in the sandbox.

Contract
--------
* No tools. ``POST /verify`` takes the row (``verifier_metadata.unit_tests`` = ``{inputs: [str], outputs:
  [str], fn_name: str | null}``, upstream's LiveCodeBench format; optional ``verifier_metadata.difficulty``)
  plus the response. The program is the fenced code block of the final answer text (the ```python one,
  or any fence when none is tagged); none -> reward 0 with ``failure_reason: "no_code"``; several
  different candidate blocks -> reward 0 with ``failure_reason: "several_programs"``.
* Each unit test runs as its own sandboxed process (:mod:`nemo_gym.sandbox`: no network, read-only system,
  throw-away work dir, per-test limits ``unit_test_timeout_secs`` wall and CPU, ``memory_mib``), all tests
  of a row in parallel through the sandbox's bounded pool. stdin/stdout tests (``fn_name`` null): the test
  passes when stdout equals the expected output line by line, ignoring trailing whitespace (an expected
  integer token must be that exact number; other numbers compare with a 1e-6 relative tolerance; ASCII
  digits only). Call-based tests (``fn_name`` set, LeetCode style): each input is one JSON value per line
  (the arguments), the function is ``Solution().<fn_name>`` or a top-level ``<fn_name>``, and its return
  value, as JSON, must equal the expected JSON (:func:`json_values_equal`: the same shape, a tuple is a
  list, a bare ``3`` is not ``[3]``, booleans are not numbers, integers exact, floats within 1e-6).
* reward = 1.0 iff every test passes (``reasoning_format_penalty`` instead when the answer breaks the
  <think> format, as upstream). ``result`` = per-test booleans, ``pass_fraction`` = passed / total,
  ``failure_reason`` = the first failing test's reason (``compile_error``, ``runtime_error``,
  ``wrong_answer``, ``timeout``, ``memory``, ``output_limit``, ``disk_quota``), ``metadata.tests`` = each
  test's reason,
  CPU and wall seconds and (capped) stderr tail. All of these are the program's fault: reward 0 with the reason recorded.
* A sandbox that cannot run (bubblewrap missing, set-up failure, the queue bound passed) is an
  infrastructure failure: ``/verify`` answers 503, never a reward of 0. A row without valid unit tests is a
  422 naming the field. At most ``num_processes`` verifications run at once (each may run many tests).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from decimal import Decimal, InvalidOperation
from typing import Any

from fastapi import HTTPException
from pydantic import BaseModel, ConfigDict, Field, model_validator

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseRunRequest,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)
from nemo_gym.reward_profile import compute_pass_majority_metrics, highest_k_metrics
from nemo_gym.sandbox import (
    AsyncSandbox,
    SandboxError,
    SandboxExecResult,
    SandboxProviderConfig,
    SandboxResources,
    SandboxSpec,
    check_sandbox_available,
)


class CompCodingResourcesServerConfig(BaseResourcesServerConfig):
    num_processes: int = Field(default=8, ge=1, description="Verifications at once (each runs all its tests)")
    unit_test_timeout_secs: float = Field(default=10, gt=0, description="Wall and CPU seconds per unit test")
    debug: bool = False
    reasoning_format_penalty: float = 0.0
    memory_mib: int = Field(default=512, ge=32, description="Memory cap per unit test (process tree)")
    max_output_bytes: int = Field(
        default=4_000_000, ge=1024, description="stdout kept per test; more fails it"
    )
    disk_quota_mib: int = Field(
        default=512, ge=1, description="What one test's program may write to its work dir, all files together"
    )
    sandbox: SandboxProviderConfig = Field(default_factory=SandboxProviderConfig)


class UnitTests(BaseModel):
    inputs: list[str]
    outputs: list[str]
    fn_name: str | None = None

    @model_validator(mode="after")
    def _same_length(self) -> UnitTests:
        if len(self.inputs) != len(self.outputs):
            raise ValueError(f"unit_tests has {len(self.inputs)} inputs but {len(self.outputs)} outputs")
        if not self.inputs:
            raise ValueError("unit_tests has no tests")
        return self


class CodeGenVerifierMetadata(BaseModel):
    model_config = ConfigDict(extra="allow")

    unit_tests: UnitTests
    difficulty: str | None = None


class CompCodingRunRequest(BaseRunRequest):
    pass


class CompCodingVerifyRequest(CompCodingRunRequest, BaseVerifyRequest):
    verifier_metadata: CodeGenVerifierMetadata


class CompCodingVerifyResponse(BaseVerifyResponse):
    extracted_model_output: str | None = None
    extracted_model_code: str | None = None
    result: list[bool] | None = None
    metadata: dict[str, Any] | None = None
    unit_tests_time_taken: float | None = None
    reasoning_format_violation_rate: float = 0.0
    difficulty: str | None = None
    pass_fraction: float = 0.0
    failure_reason: str | None = None


_FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)```", re.S)
PYTHON_TAGS = ("python", "py", "python3")


class SeveralProgramsError(ValueError):
    """The answer holds more than one different program: which one is the answer is not said."""


def extract_code(text: str) -> str | None:
    """The program of an answer: its python-tagged code block (any fenced block when none is tagged);
    None if there is none. Several *different* candidate blocks raise :class:`SeveralProgramsError`: the
    format asks for one final solution block, and running only the last would let a policy list
    several programs at no cost (the same block repeated is one program)."""
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(text or "")]
    if not blocks:
        return None
    python = [body for lang, body in blocks if lang in PYTHON_TAGS]
    candidates = [b for b in (python or [body for _, body in blocks]) if b.strip()]
    if not candidates:
        return None
    if len({b.strip() for b in candidates}) > 1:
        raise SeveralProgramsError(f"{len(candidates)} different code blocks")
    return candidates[-1]


_CALL_DRIVER = r"""
import json, sys
sys.setrecursionlimit(100000)
fn_name = sys.argv[1]
args = [json.loads(line) for line in sys.stdin.read().splitlines() if line.strip()]
ns = {"__name__": "solution"}
exec(compile(open("solution.py").read(), "solution.py", "exec"), ns)
target = ns["Solution"]() if "Solution" in ns else None
fn = getattr(target, fn_name, None) if target is not None else None
if fn is None:
    fn = ns.get(fn_name)
if fn is None:
    sys.exit(f"no function {fn_name!r} (neither Solution().{fn_name} nor a top-level {fn_name})")
result = fn(*args)
sys.stdout.write("\n@@RESULT@@" + json.dumps(result))
"""


_INTEGER = re.compile(r"[+-]?[0-9]+")
_NUMBER = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[+-]?(?:inf|infinity)", re.I)


def _number(text: str) -> Decimal | None:
    """``text`` as an exact decimal number: ASCII digits only (no ``1_000``, no other scripts' digits),
    None when it is not a number."""
    if not _NUMBER.fullmatch(text):
        return None
    try:
        return Decimal(text)
    except (InvalidOperation, ValueError):
        return None


def _tokens_equal(got: str, want: str) -> bool:
    """One output token against the expected one. An expected integer must be that exact number
    (``3`` or ``3.0``: never ``2.880067194370816e+18`` for ``2880067194370816120``, nor an off-by-one
    within a relative tolerance); other expected numbers compare with a 1e-6 relative tolerance."""
    if got == want:
        return True
    g, w = _number(got), _number(want)
    if g is None or w is None:
        return False
    if _INTEGER.fullmatch(want):
        return g == w
    if g.is_infinite() or w.is_infinite():
        return g == w
    return math.isclose(float(g), float(w), rel_tol=1e-6, abs_tol=1e-9)


def stdout_matches(actual: str, expected: str) -> bool:
    got = [line.rstrip() for line in actual.strip().splitlines()]
    want = [line.rstrip() for line in expected.strip().splitlines()]
    if got == want:
        return True
    if len(got) != len(want):
        return False
    for g, w in zip(got, want, strict=True):
        gt, wt = g.split(), w.split()
        if len(gt) != len(wt) or not all(_tokens_equal(a, b) for a, b in zip(gt, wt, strict=True)):
            return False
    return True


def json_values_equal(got: Any, want: Any) -> bool:
    """A call's JSON result against the expected JSON value: the same shape (a bare value is not a
    one-element list), booleans only as booleans (``true`` is not ``1``), an expected integer exactly (an
    integral float such as ``3.0`` counts), an expected float within a 1e-6 relative tolerance."""
    if isinstance(want, bool) or isinstance(got, bool):
        return type(want) is type(got) and want == got
    if isinstance(want, int):
        if isinstance(got, int):
            return got == want
        return isinstance(got, float) and math.isfinite(got) and got.is_integer() and int(got) == want
    if isinstance(want, float):
        return isinstance(got, int | float) and (got == want or math.isclose(got, want, rel_tol=1e-6))
    if isinstance(want, list):
        return (
            isinstance(got, list)
            and len(got) == len(want)
            and all(json_values_equal(g, w) for g, w in zip(got, want, strict=True))
        )
    if isinstance(want, dict):
        return (
            isinstance(got, dict)
            and got.keys() == want.keys()
            and all(json_values_equal(got[k], want[k]) for k in want)
        )
    return type(got) is type(want) and got == want


def _call_matches(actual: str, expected: str) -> bool:
    if "@@RESULT@@" not in actual:
        return False
    try:
        got = json.loads(actual.rsplit("@@RESULT@@", 1)[1])
        want = json.loads(expected)
    except (ValueError, RecursionError):
        return False
    return json_values_equal(got, want)


def _reason(run: SandboxExecResult, passed: bool) -> str | None:
    if passed:
        return None
    if run.timed_out:
        return "timeout"
    if run.oom_killed or "MemoryError" in run.stderr[-2000:]:
        return "memory"
    if run.error_type == "output_limit":
        return "output_limit"
    if run.error_type == "disk_quota":
        return "disk_quota"
    if run.return_code != 0:
        tail = run.stderr[-2000:]
        if "SyntaxError" in tail or "IndentationError" in tail:
            return "compile_error"
        return "runtime_error"
    return "wrong_answer"


class CompCodingResourcesServer(SimpleResourcesServer):
    config: CompCodingResourcesServerConfig

    def model_post_init(self, context: Any) -> None:
        super().model_post_init(context)
        check_sandbox_available(self.config.sandbox)  # refuse to start without bubblewrap
        self._semaphore = asyncio.Semaphore(self.config.num_processes)

    @staticmethod
    def _has_reasoning_format_violation(response: Any) -> bool:
        final = response.output_text or ""
        if "<think>" in final or "</think>" in final:
            return True
        reasoning = ""
        for item in response.output or []:
            if getattr(item, "type", None) == "reasoning":
                for summary in getattr(item, "summary", []) or []:
                    reasoning += getattr(summary, "text", "") or ""
        return reasoning.count("<think>") > 1 or reasoning.count("</think>") > 1

    def _limits(self) -> SandboxResources:
        t = float(self.config.unit_test_timeout_secs)
        return SandboxResources(
            memory_mib=self.config.memory_mib,
            cpu_time_s=t,
            wall_time_s=t + 1.0,  # the CPU limit decides for busy programs; wall catches sleepers
            output_limit_bytes=self.config.max_output_bytes,
            disk_quota_mib=self.config.disk_quota_mib,
        )

    async def _run_tests(
        self, code: str, tests: UnitTests
    ) -> list[tuple[bool, str | None, str, float | None, float]]:
        files: dict[str, str] = {"solution.py": code}
        if tests.fn_name:
            files["call_driver.py"] = _CALL_DRIVER
            argv = ["python3", "-I", "call_driver.py", tests.fn_name]
        else:
            argv = ["python3", "-I", "solution.py"]
        spec = SandboxSpec(files=files, resources=self._limits())

        async def one(stdin: str, expected: str) -> tuple[bool, str | None, str, float | None, float]:
            # One work dir per test: parallel tests never see each other's files.
            async with AsyncSandbox(provider=self.config.sandbox, spec=spec) as sandbox:
                run = await sandbox.exec(argv, stdin=stdin)
            if run.ok:
                passed = (
                    _call_matches(run.stdout, expected)
                    if tests.fn_name
                    else stdout_matches(run.stdout, expected)
                )
            else:
                passed = False
            return passed, _reason(run, passed), run.stderr[-1000:], run.cpu_time_s, run.wall_time_s

        return await asyncio.gather(*(one(i, o) for i, o in zip(tests.inputs, tests.outputs, strict=True)))

    async def verify(self, body: CompCodingVerifyRequest) -> CompCodingVerifyResponse:
        model_out = body.response.output_text
        tests = body.verifier_metadata.unit_tests
        difficulty = body.verifier_metadata.difficulty
        try:
            code = extract_code(model_out) if model_out and model_out.strip() else None
        except SeveralProgramsError as exc:
            return CompCodingVerifyResponse.from_request(
                body,
                reward=0.0,
                extracted_model_output=model_out,
                result=[False] * len(tests.inputs),
                failure_reason="several_programs",
                metadata={"detail": f"{exc}: answer with one final solution block"},
                difficulty=difficulty,
            )
        if code is None:
            return CompCodingVerifyResponse.from_request(
                body,
                reward=0.0,
                extracted_model_output=model_out,
                result=[False] * len(tests.inputs),
                failure_reason="no_code",
                difficulty=difficulty,
            )
        async with self._semaphore:
            start = time.monotonic()
            try:
                outcomes = await self._run_tests(code, tests)
            except SandboxError as exc:
                raise HTTPException(
                    status_code=503, detail=f"the code sandbox could not run (not scored): {exc}"
                ) from exc
            taken = time.monotonic() - start
        result = [o[0] for o in outcomes]
        reasons = [o[1] for o in outcomes]
        has_violation = self._has_reasoning_format_violation(body.response)
        all_passed = all(result)
        reward = self.config.reasoning_format_penalty if has_violation else (1.0 if all_passed else 0.0)
        tests_meta = [
            {
                "passed": passed,
                "reason": reason,
                "cpu_time_s": cpu,
                "wall_time_s": round(wall, 4),
                **({"stderr": err} if (reason and reason != "wrong_answer") or self.config.debug else {}),
            }
            for passed, reason, err, cpu, wall in outcomes
        ]
        return CompCodingVerifyResponse.from_request(
            body,
            reward=reward,
            extracted_model_output=model_out,
            extracted_model_code=code,
            result=result,
            metadata={"tests": tests_meta},
            unit_tests_time_taken=taken,
            reasoning_format_violation_rate=1.0 if has_violation else 0.0,
            difficulty=difficulty,
            pass_fraction=sum(result) / len(result),
            failure_reason=next((r for r in reasons if r), None),
        )

    @staticmethod
    def _code_score_fn(r: dict[str, Any]) -> dict[str, float]:
        return {"accuracy": float(r["reward"] > 0)}

    def compute_metrics(self, tasks: list[list[dict[str, Any]]]) -> dict[str, Any]:
        """pass@k / majority@k of accuracy over each task's rollouts (answers: the extracted code)."""
        metrics, _, _, _ = compute_pass_majority_metrics(
            tasks, score_fn=self._code_score_fn, answer_key="extracted_model_code"
        )
        return metrics

    def get_key_metrics(self, agent_metrics: dict[str, Any]) -> dict[str, Any]:
        key = {k: v for k, v in agent_metrics.items() if k in ("mean/reward", "mean/pass_fraction")}
        key.update(highest_k_metrics(agent_metrics, "pass@{k}", score_names=["accuracy"]))
        return key


if __name__ == "__main__":
    CompCodingResourcesServer.run_webserver()
