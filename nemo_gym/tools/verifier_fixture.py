"""Verifier fixtures: a resources server's scorer checked against cases it ships, without starting a server
(NeMo Gym 0.7's ``nemo_gym.verifier_fixture``; our face at that path imports the names from here).

A fixture names a factory for a fresh server (or bare verifier), the request model a case's ``request``
is validated into, and a JSONL file of cases, one object per line:

* ``{"name", "kind": "full_reward", "request", "expected_reward"}``: a right answer; its reward must be the
  best end of the environment's declared ``reward_range`` (the upper one when higher is better).
* ``"zero_reward"``: a wrong answer, scored at the other end.
* ``"malformed"`` with ``expected_error`` (no ``expected_reward``): the verifier must raise, and the error's
  text must contain ``expected_error``.
* ``"determinism"``: scored twice, each on a fresh server after ``reseed``; both rewards must be equal.
  Required (and only played) when the environment declares ``determinism: seeded``.

Every played case's reward must be a finite number inside the range and equal its ``expected_reward``;
``update_expected=True`` writes the observed rewards back instead (atomically, the file's mode kept).
Whatever is wrong is a :class:`VerifierFixtureError` naming the file and line, or the case.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import tempfile
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

CaseKind = Literal["full_reward", "zero_reward", "malformed", "determinism"]
Invocation = Callable[[Any, BaseModel], Any | Awaitable[Any]]
DETERMINISM_VALUES = ("seeded", "stochastic", "unknown")


class VerifierFixtureError(ValueError):
    """The fixture is invalid, or the verifier does not do what it says."""


@dataclass(frozen=True)
class VerifierFixture:
    """``server_factory()`` builds a fresh object with ``verify`` (or one ``invoke(server, request)`` scores);
    ``reseed(server, request)`` restores a seeded state before a determinism case is scored."""

    server_factory: Callable[[], Any]
    request_model: type[BaseModel]
    cases_path: str | Path
    invoke: Invocation | None = None
    reseed: Invocation | None = None


class VerifierFixtureCase(BaseModel):
    """One line of a fixture file."""

    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)

    name: str = Field(min_length=1)
    kind: CaseKind
    request: dict[str, Any]
    expected_reward: Annotated[float, Field(strict=True, allow_inf_nan=False)] | None = None
    expected_error: str | None = None

    @model_validator(mode="after")
    def _one_expectation(self) -> VerifierFixtureCase:
        if self.kind == "malformed":
            if not self.expected_error or self.expected_reward is not None:
                raise ValueError("a malformed case needs expected_error and must not set expected_reward")
        elif self.expected_reward is None or self.expected_error is not None:
            raise ValueError(f"a {self.kind} case needs expected_reward and must not set expected_error")
        return self


@dataclass(frozen=True)
class VerifierFixtureResult:
    name: str
    kind: CaseKind
    observed_rewards: tuple[float, ...] = ()


def load_verifier_fixture(path: str | Path) -> list[VerifierFixtureCase]:
    """The cases of a fixture file, each line validated (blank lines skipped)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeError) as exc:
        raise VerifierFixtureError(f"cannot read the verifier fixture {path}: {exc}") from exc
    cases = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            cases.append(VerifierFixtureCase.model_validate(json.loads(line)))
        except json.JSONDecodeError as exc:
            raise VerifierFixtureError(f"{where}: not JSON ({exc.msg})") from exc
        except ValidationError as exc:
            first = exc.errors(include_url=False, include_input=False)[0]
            field = ".".join(str(p) for p in first["loc"])
            raise VerifierFixtureError(f"{where}: {field + ': ' if field else ''}{first['msg']}") from exc
    if not cases:
        raise VerifierFixtureError(f"the verifier fixture {path} has no cases")
    return cases


def _reward_of(result: Any, case: VerifierFixtureCase) -> float:
    reward = result.get("reward") if isinstance(result, Mapping) else getattr(result, "reward", result)
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise VerifierFixtureError(f"case {case.name!r}: the verifier returned no finite reward: {reward!r}")
    return float(reward)


async def _await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def _score(fixture: VerifierFixture, case: VerifierFixtureCase, *, reseed: bool = False) -> Any:
    """What the verifier returns for ``case`` on a fresh server (raises what it raises)."""
    try:
        server = fixture.server_factory()
    except Exception as exc:
        raise VerifierFixtureError(f"case {case.name!r}: server_factory failed: {exc}") from exc
    request = fixture.request_model.model_validate(case.request)
    if reseed:
        if fixture.reseed is None:
            raise VerifierFixtureError(f"case {case.name!r}: a determinism case needs the fixture's reseed")
        await _await(fixture.reseed(server, request))
    if fixture.invoke is not None:
        return await _await(fixture.invoke(server, request))
    verify = getattr(server, "verify", None)
    if not callable(verify):
        raise VerifierFixtureError("server_factory returned an object without a verify method")
    return await _await(verify(request))


async def _reward(fixture: VerifierFixture, case: VerifierFixtureCase, *, reseed: bool = False) -> float:
    try:
        result = await _score(fixture, case, reseed=reseed)
    except VerifierFixtureError:
        raise
    except Exception as exc:
        raise VerifierFixtureError(f"case {case.name!r} raised: {exc!r}") from exc
    return _reward_of(result, case)


def _range(reward_range: Sequence[float]) -> tuple[float, float]:
    if len(reward_range) != 2:
        raise VerifierFixtureError(f"reward_range must be two numbers (low, high), not {reward_range!r}")
    low, high = reward_range
    if any(
        isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) for v in (low, high)
    ):
        raise VerifierFixtureError(f"reward_range must be two finite numbers, not {reward_range!r}")
    if low > high:
        raise VerifierFixtureError(f"reward_range must be (low, high) with low <= high, not {reward_range!r}")
    return float(low), float(high)


def _rewrite(path: Path, cases: list[VerifierFixtureCase]) -> None:
    """Replace ``path`` with ``cases`` in one rename (a reader sees the old file or the new one)."""
    if path.is_symlink() or not path.is_file():
        raise VerifierFixtureError(f"will not replace {path}: not a regular file")
    text = "".join(
        json.dumps(c.model_dump(mode="json", exclude_none=True), sort_keys=True) + "\n" for c in cases
    )
    fd, scratch = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(scratch, path.stat().st_mode & 0o777)
        os.replace(scratch, path)
    except OSError as exc:
        raise VerifierFixtureError(f"cannot rewrite {path}: {exc}") from exc
    finally:
        Path(scratch).unlink(missing_ok=True)


async def exercise_verifier_fixture(
    fixture: VerifierFixture,
    *,
    reward_range: Sequence[float],
    higher_is_better: bool = True,
    determinism: str | Enum,
    update_expected: bool = False,
) -> tuple[VerifierFixtureResult, ...]:
    """Score every case the environment's ``determinism`` calls for and check it (module docstring)."""
    path = Path(fixture.cases_path)
    cases = load_verifier_fixture(path)
    low, high = _range(reward_range)
    if not isinstance(higher_is_better, bool):
        raise VerifierFixtureError(f"higher_is_better must be true or false, not {higher_is_better!r}")
    mode = str(getattr(determinism, "value", determinism))
    if mode not in DETERMINISM_VALUES:
        raise VerifierFixtureError(
            f"determinism must be one of {', '.join(DETERMINISM_VALUES)}, not {mode!r}"
        )
    best, worst = (high, low) if higher_is_better else (low, high)
    needed = {"full_reward", "zero_reward", "malformed"} | ({"determinism"} if mode == "seeded" else set())
    missing = sorted(needed - {c.kind for c in cases})
    if missing:
        raise VerifierFixtureError(f"{path} has no case of kind {', '.join(missing)} (each is required)")

    results: list[VerifierFixtureResult] = []
    observed: dict[int, float] = {}
    for index, case in enumerate(cases):
        if case.kind == "determinism" and mode != "seeded":
            continue
        if case.kind == "malformed":
            try:
                await _score(fixture, case)
            except VerifierFixtureError:
                raise
            except Exception as exc:
                if case.expected_error not in str(exc):
                    raise VerifierFixtureError(
                        f"malformed case {case.name!r}: the error does not contain {case.expected_error!r}: {exc}"
                    ) from exc
            else:
                raise VerifierFixtureError(f"malformed case {case.name!r}: the verifier raised nothing")
            results.append(VerifierFixtureResult(case.name, case.kind))
            continue
        reward = await _reward(fixture, case, reseed=case.kind == "determinism")
        if not low <= reward <= high:
            raise VerifierFixtureError(f"case {case.name!r}: reward {reward} is outside [{low}, {high}]")
        rewards = [reward]
        if case.kind in ("full_reward", "zero_reward"):
            end = best if case.kind == "full_reward" else worst
            if reward != end:
                which = "best" if case.kind == "full_reward" else "worst"
                raise VerifierFixtureError(
                    f"{case.kind} case {case.name!r}: reward {reward}, not the range's {which} end {end}"
                )
        else:
            again = await _reward(fixture, case, reseed=True)
            rewards.append(again)
            if again != reward:
                raise VerifierFixtureError(
                    f"determinism case {case.name!r}: {reward}, then {again} on a fresh server after reseed"
                )
        if update_expected:
            observed[index] = reward
        elif reward != case.expected_reward:
            raise VerifierFixtureError(
                f"case {case.name!r}: reward {reward}, expected_reward {case.expected_reward}"
            )
        results.append(VerifierFixtureResult(case.name, case.kind, tuple(rewards)))

    if update_expected:
        updated = [
            c.model_copy(update={"expected_reward": observed[i]}) if i in observed else c
            for i, c in enumerate(cases)
        ]
        if updated != cases:
            _rewrite(path, updated)
    return tuple(results)
