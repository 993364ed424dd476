"""law_discovery: find a hidden physical law by running experiments (NewtonBench's idea, written here).

Contract
--------
* Row fields: ``task_id``, ``domain``, ``law`` (:class:`LawSpec`: the hidden ``expression`` over the
  ``variables`` (each ``{low, high, unit}``), the ``target`` it gives, the measurement ``noise`` (relative
  standard deviation) and the noise ``seed``), ``max_experiments`` and ``responses_create_params`` (what
  the model sees: the system described, the variables and their ranges; never the law). A row whose law
  does not parse or whose ranges are empty is refused (422 naming the field) at ``/seed_session`` and
  ``/verify``: a broken row is never a reward.
* Tools, for the session ``/seed_session`` opened:

  - ``POST /run_experiment`` ``{"inputs": {<variable>: number, ...}}`` -> ``{"inputs", "<target>"}``: the
    law's value times ``1 + noise * N(0, 1)``, the noise drawn from the row's seed and the experiment's
    index (the same rollout gets the same measurements). Missing, unknown, non-finite or out-of-range
    inputs and experiments beyond ``max_experiments`` answer ``{"error": ...}`` saying what (a tool
    result the model reads, not an HTTP error).
  - ``POST /fit_check`` ``{"expression"}`` -> ``{"rmsle", "experiments"}``: how far a candidate law is from
    this session's measurements (root mean squared log error), or ``{"error"}`` for a law that does not
    parse.
  - ``POST /submit_law`` ``{"expression"}`` -> ``{"recorded": true, "expression"}`` or ``{"error"}``: the
    syntax is checked here so the model can fix it; the law itself is judged only by ``/verify``.

* ``/verify`` judges the last ``submit_law`` call of the response (stateless: a stored rollout
  re-verifies). In the verify pool (sympy is CPU-heavy): the submitted law has the hidden law's *form*
  when both, expanded, match with every number outside an exponent taken as a free constant
  (``expressions.form``); its RMSLE against the hidden law (no noise, floats) over ``held_out_points``
  points drawn across the variables' ranges. Reward 1.0 when the form matches and the RMSLE is at most
  ``rmsle_threshold``; ``partial_credit`` (0.5) when only the RMSLE is; else 0.0. ``failure_reason``:
  ``pass``, ``numeric_only``, ``wrong_law``, ``no_law`` (never submitted), ``unparseable``,
  ``unknown_symbols``, ``too costly to compare`` (the law passes a static cost bound of
  :func:`expressions.parse_law`, or its check ran past ``form_budget_seconds`` of CPU inside the worker,
  which aborts it); each is the model's doing, scored 0 with the reason, ``failure_detail`` in words.
  Metrics: ``symbolic_match``, ``rmsle``, ``experiments_used`` (``run_experiment`` calls),
  ``submitted_law``.
* Only what the model cannot cause is an HTTP 503 (never a 0): the verify pool's own timeout
  (``verify_timeout_seconds``, wall clock, far above the CPU budget) or a crashed worker. Sessions are
  bounded by ``max_sessions`` and dropped at ``/verify``.
"""

from __future__ import annotations

import functools
import math
import random
from typing import Any, ClassVar

import orjson
from fastapi import FastAPI, HTTPException, Request
from pydantic import BaseModel, Field, PrivateAttr, field_validator, model_validator

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseSeedSessionRequest,
    BaseSeedSessionResponse,
    BaseVerifyRequest,
    BaseVerifyResponse,
    ReverifyMode,
    SimpleResourcesServer,
)
from nemo_gym.kit.verify_pool import get_verify_pool, run_in_verify_pool
from nemo_gym.server.base import get_session_id
from nemo_gym.server.resources import function_calls
from resources_servers.law_discovery.expressions import (
    TOO_COSTLY,
    Law,
    LawSyntaxError,
    OutOfBudget,
    TooCostlyError,
    UnknownSymbolsError,
    cpu_budget,
    evaluate,
    forget_cached_forms,
    form,
    parse_law,
    parse_row_law,
    rmsle,
    rmsle_of_measurements,
    same_form,
)


class LawDiscoveryConfig(BaseResourcesServerConfig):
    REVERIFY_MODE: ClassVar[ReverifyMode] = ReverifyMode.STATELESS  # verify reads the row and the response
    rmsle_threshold: float = Field(default=0.05, gt=0)
    partial_credit: float = Field(default=0.5, ge=0, le=1)
    held_out_points: int = Field(default=200, ge=10, le=10_000)
    held_out_seed: int = 20261126
    verify_timeout_seconds: float = Field(default=30, gt=0)
    form_budget_seconds: float = Field(default=3, gt=0)
    max_sessions: int = Field(default=100_000, ge=1)

    @model_validator(mode="after")
    def _budget_within_timeout(self) -> LawDiscoveryConfig:
        if self.form_budget_seconds >= self.verify_timeout_seconds:
            raise ValueError(
                f"form_budget_seconds ({self.form_budget_seconds:g}) must be below verify_timeout_seconds "
                f"({self.verify_timeout_seconds:g}): a law past its budget is the model's 0, a pool timeout a 503"
            )
        return self


class VariableSpec(BaseModel):
    low: float
    high: float
    unit: str = ""

    @field_validator("high")
    @classmethod
    def _range(cls, high: float, info: Any) -> float:
        low = info.data.get("low")
        if low is not None and not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise ValueError(f"the range must be finite with low < high, got [{low}, {high}]")
        return high


class LawSpec(BaseModel):
    target: str
    expression: str
    variables: dict[str, VariableSpec] = Field(min_length=1)
    noise: float = Field(default=0.0, ge=0, le=1)
    seed: int = 0

    def parsed(self) -> Law:
        """The hidden law; ``HTTPException(422)`` naming ``law.expression`` if the row's law is broken."""
        try:
            return parse_row_law(self.expression, tuple(self.variables), self.target)
        except LawSyntaxError as e:
            raise HTTPException(422, f"bad row: law.expression {self.expression!r}: {e}") from None


class LawRow(BaseModel):
    task_id: str = ""
    domain: str = ""
    law: LawSpec
    max_experiments: int = Field(default=40, ge=1, le=10_000)


class LawSeedSessionRequest(LawRow, BaseSeedSessionRequest):
    pass


class RunExperimentRequest(BaseModel):
    inputs: dict[str, Any] = Field(description="A value for every variable of the system, by name.")


class ExpressionRequest(BaseModel):
    expression: str = Field(description="A law in the variables, e.g. 3.2*x**2/y (Python arithmetic).")


class LawVerifyRequest(LawRow, BaseVerifyRequest):
    pass


class LawVerifyResponse(LawVerifyRequest, BaseVerifyResponse):
    failure_reason: str
    symbolic_match: bool
    rmsle: float | None
    experiments_used: int
    submitted_law: str | None
    failure_detail: str | None = None


class _Session:
    __slots__ = ("spec", "law", "max_experiments", "measurements")

    def __init__(self, spec: LawSpec, law: Law, max_experiments: int) -> None:
        self.spec = spec
        self.law = law
        self.max_experiments = max_experiments
        self.measurements: list[tuple[dict[str, float], float]] = []


def measure(spec: LawSpec, law: Law, inputs: dict[str, Any], index: int) -> dict[str, float] | str:
    """One noisy measurement (``{<variable>..., <target>: value}``) or the error the model is shown."""
    names = list(spec.variables)
    missing = [n for n in names if n not in inputs]
    unknown = [n for n in inputs if n not in spec.variables]
    if missing or unknown:
        parts = [
            f"missing {', '.join(missing)}" if missing else "",
            f"unknown {', '.join(unknown)}" if unknown else "",
        ]
        return (
            f"inputs must name exactly the variables {', '.join(names)} ({'; '.join(p for p in parts if p)})"
        )
    point: dict[str, float] = {}
    for name, value in inputs.items():
        v = spec.variables[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"{name} must be a finite number, got {value!r}"
        if not v.low <= value <= v.high:
            return f"{name}={value} is outside the apparatus range [{v.low}, {v.high}] {v.unit}".rstrip()
        point[name] = float(value)
    try:
        value = evaluate(law, point)
    except ValueError:
        return f"the apparatus gives no reading at {point}"
    rng = random.Random(f"{spec.seed}:{index}")
    noisy = value * (1 + spec.noise * rng.gauss(0.0, 1.0))
    return {**point, spec.target: float(f"{noisy:.6g}")}


def held_out(spec: LawSpec, count: int, seed: int) -> list[dict[str, float]]:
    """Points spread over the variables' ranges (log-uniform where a range spans more than a factor of
    10 of positive values), the same for every verification of a row."""
    rng = random.Random(f"{seed}:{spec.expression}")
    points = []
    for _ in range(count):
        point = {}
        for name, v in spec.variables.items():
            if v.low > 0 and v.high / v.low > 10:
                point[name] = math.exp(rng.uniform(math.log(v.low), math.log(v.high)))
            else:
                point[name] = rng.uniform(v.low, v.high)
        points.append(point)
    return points


Judgement = tuple[str, bool, float | None, str | None]  # (failure_reason, form matches, RMSLE, detail)


@functools.lru_cache(maxsize=256)
def _truth_form(expression: str, variables: tuple[str, ...]) -> Any:
    """The form of a row's law (the rows of a group share it; computed outside the model's budget)."""
    return form(parse_law(expression, variables))


def judge_law(
    submitted: str, spec_json: bytes, threshold: float, held_out_count: int, seed: int, budget_seconds: float
) -> Judgement:
    """(failure_reason, form matches, RMSLE, detail) of ``submitted`` against the row's law. Runs in a
    verify-pool worker (sympy); arguments are plain bytes and numbers so they pickle cheaply. The
    submission's numeric check and form run under a CPU budget of ``budget_seconds``: past it (or past the
    static bounds of :func:`parse_law`) the law is ``too costly to compare``, the model's 0, and the
    worker is free again at once."""
    spec = LawSpec.model_validate_json(spec_json)
    variables = tuple(spec.variables)
    truth = parse_law(spec.expression, variables, spec.target)
    try:
        law = parse_law(submitted, variables, spec.target)
    except UnknownSymbolsError as e:
        return "unknown_symbols", False, None, str(e)
    except TooCostlyError as e:
        return TOO_COSTLY, False, None, str(e)
    except LawSyntaxError as e:
        return "unparseable", False, None, str(e)
    truth_form = _truth_form(spec.expression, variables)
    detail = None
    try:
        with cpu_budget(budget_seconds):
            error = rmsle(law, truth, held_out(spec, held_out_count, seed))
            try:
                matches = bool(form(law) == truth_form)
            except Exception as e:  # noqa: BLE001 - sympy failing on the model's law: no form to match
                matches, detail = False, f"the form could not be worked out ({type(e).__name__})"
    except OutOfBudget:
        forget_cached_forms()
        return (
            TOO_COSTLY,
            False,
            None,
            f"{TOO_COSTLY}: the check ran past its {budget_seconds:g} s CPU budget",
        )
    if error <= threshold:
        return ("pass" if matches else "numeric_only"), matches, error, detail
    return "wrong_law", matches, (error if math.isfinite(error) else None), detail


def warm_up_worker() -> None:
    """Import sympy in a pool worker before the first answer (seconds, once per worker)."""
    same_form("2*x", "3*x", ["x"])


class LawDiscoveryServer(SimpleResourcesServer):
    config: LawDiscoveryConfig
    _sessions: dict[str, _Session] = PrivateAttr(default_factory=dict)

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/run_experiment")(self.run_experiment)
        app.post("/fit_check")(self.fit_check)
        app.post("/submit_law")(self.submit_law)
        return app

    async def on_startup(self) -> None:
        await super().on_startup()
        get_verify_pool().warm_up(warm_up_worker, timeout=300)

    def _session(self, request: Request) -> _Session:
        session = self._sessions.get(get_session_id(request))
        if session is None:
            raise LookupError(
                "no experiment is set up for this session: call /seed_session with the task row first"
            )
        return session

    async def seed_session(self, request: Request, body: LawSeedSessionRequest) -> BaseSeedSessionResponse:
        session_id = get_session_id(request)
        self._sessions.pop(session_id, None)
        self._sessions[session_id] = _Session(body.law, body.law.parsed(), body.max_experiments)
        while len(self._sessions) > self.config.max_sessions:
            del self._sessions[next(iter(self._sessions))]
        return BaseSeedSessionResponse()

    async def run_experiment(self, request: Request, body: RunExperimentRequest) -> dict[str, Any]:
        session = self._session(request)
        if len(session.measurements) >= session.max_experiments:
            return {
                "error": f"the experiment budget of this task ({session.max_experiments}) is used up: submit a law"
            }
        result = measure(session.spec, session.law, body.inputs, len(session.measurements))
        if isinstance(result, str):
            return {"error": result}
        target = session.spec.target
        session.measurements.append(({k: v for k, v in result.items() if k != target}, result[target]))
        return result

    async def fit_check(self, request: Request, body: ExpressionRequest) -> dict[str, Any]:
        session = self._session(request)
        try:
            law = parse_law(body.expression, session.spec.variables, session.spec.target)
        except LawSyntaxError as e:
            return {"error": str(e)}
        if not session.measurements:
            return {"error": "no measurements yet: run an experiment first"}
        error = rmsle_of_measurements(law, session.measurements)
        return {"rmsle": error if math.isfinite(error) else None, "experiments": len(session.measurements)}

    async def submit_law(self, request: Request, body: ExpressionRequest) -> dict[str, Any]:
        session = self._session(request)
        try:
            law = parse_law(body.expression, session.spec.variables, session.spec.target)
        except LawSyntaxError as e:
            return {"error": f"{e}; submit again"}
        return {"recorded": True, "expression": law.text}

    async def verify(self, request: Request, body: LawVerifyRequest) -> LawVerifyResponse:
        self._sessions.pop(get_session_id(request), None)
        body.law.parsed()  # a broken row is a 422, never a reward
        submissions = function_calls(body.response, "submit_law")
        experiments = len(function_calls(body.response, "run_experiment"))
        submitted = _expression_of(submissions[-1]) if submissions else None
        if submitted is None:
            reason, matches, error, detail = "no_law", False, None, None
        else:
            reason, matches, error, detail = await run_in_verify_pool(
                judge_law,
                submitted,
                body.law.model_dump_json().encode(),
                self.config.rmsle_threshold,
                self.config.held_out_points,
                self.config.held_out_seed,
                self.config.form_budget_seconds,
                timeout=self.config.verify_timeout_seconds,
            )
        reward = {"pass": 1.0, "numeric_only": self.config.partial_credit}.get(reason, 0.0)
        return LawVerifyResponse.from_request(
            body,
            reward=reward,
            failure_reason=reason,
            symbolic_match=matches,
            rmsle=error,
            experiments_used=experiments,
            submitted_law=submitted,
            failure_detail=detail,
        )


def _expression_of(call: Any) -> str:
    """The ``expression`` argument of a submit_law call ('' when its arguments are not that)."""
    try:
        arguments = orjson.loads(call.arguments)
    except orjson.JSONDecodeError:
        return ""
    value = arguments.get("expression") if isinstance(arguments, dict) else None
    return value if isinstance(value, str) else ""


if __name__ == "__main__":
    LawDiscoveryServer.run_webserver()
