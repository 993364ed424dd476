"""example_session_state_mgmt: a counter that lives for one rollout, keyed by the session id.

Contract
--------
* ``POST /seed_session`` (the task row; needs ``initial_count: int``) creates this session's counter
  at ``initial_count``, or resets it if the session already has one. The session is the signed
  cookie the server issues (``request.state.session_id``); the agent sends it back on every call.
* ``POST /increment_counter`` ``{"count": int}`` adds ``count`` (may be negative) -> ``{"success": true}``.
* ``POST /get_counter_value`` ``{}`` -> ``{"count": <current value>}``.
* ``POST /verify`` (the row plus the response; needs ``expected_count: int``): reward 1.0 iff this
  session's counter equals ``expected_count``, the model read it with ``get_counter_value`` at least
  once (its answer is in the response), and the final answer (the last assistant message, with no
  tool call after it) states the counter's value as a whole number (:func:`stated_numbers`); else
  0.0 with ``failure_reason`` saying why (``None`` for 1.0). Every prompt asks for the value, and a
  row whose counter must not change would otherwise pay for doing and saying nothing. Also returns
  ``final_count`` and ``abs_count_error`` = |final_count - expected_count|. The session's counter is
  dropped here, so memory stays flat over any number of rollouts.
* A session with no counter (never seeded, already verified, or a missing/forged cookie, which
  always yields a fresh session id) never sees another session's counter: its tool calls fail with
  an error the model is shown, and its /verify fails with a 500 rather than scoring 0.0 (a lost
  counter is an infrastructure problem, not the model's mistake).
* Counters of sessions that are seeded but never verified (failed rollouts) are bounded by
  ``max_sessions``: past it, the least recently seeded counter is dropped.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import orjson
from fastapi import FastAPI, Request
from pydantic import BaseModel, Field, PrivateAttr

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseSeedSessionRequest,
    BaseSeedSessionResponse,
    BaseVerifyRequest,
    BaseVerifyResponse,
    ReverifyMode,
    SimpleResourcesServer,
)
from nemo_gym.openai_utils import text_of_message
from nemo_gym.server.base import get_session_id


class ExampleSessionStateMgmtConfig(BaseResourcesServerConfig):
    REVERIFY_MODE: ClassVar[ReverifyMode] = (
        ReverifyMode.UNSUPPORTED
    )  # verify reads the session's counter, which a stored rollout does not carry
    max_sessions: int = Field(default=100_000, ge=1)


class UnknownSessionError(LookupError):
    """The request's session has no counter."""


class CounterSeedSessionRequest(BaseSeedSessionRequest):
    initial_count: int


class IncrementCounterRequest(BaseModel):
    count: int = Field(description="The amount to add to the counter (negative to subtract).")


class IncrementCounterResponse(BaseModel):
    success: bool


class GetCounterValueRequest(BaseModel):
    pass


class GetCounterValueResponse(BaseModel):
    count: int


class CounterVerifyRequest(BaseVerifyRequest):
    expected_count: int


class CounterVerifyResponse(BaseVerifyResponse):
    final_count: int
    abs_count_error: int
    failure_reason: str | None = None


# A whole number as written in prose: optional sign (ASCII or U+2212), ASCII digits, optional thousands
# commas; not part of a longer number, a decimal or a word ("17" in "x17", "17.5" or "1,7" is no match).
_WHOLE_NUMBER = re.compile(
    r"(?<![0-9A-Za-z.,])([-\u2212]?)([0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?![0-9]|[.,][0-9])"
)


def stated_numbers(text: str) -> set[int]:
    """The whole numbers ``text`` states (see ``_WHOLE_NUMBER``)."""
    return {
        (-1 if sign else 1) * int(digits.replace(",", "")) for sign, digits in _WHOLE_NUMBER.findall(text)
    }


def _field(item: Any, name: str) -> Any:
    return item.get(name) if isinstance(item, dict) else getattr(item, name, None)


def counter_was_read(output: list[Any]) -> bool:
    """Whether ``output`` holds an answer of ``get_counter_value`` (``{"count": <int>}``)."""
    for item in output:
        if _field(item, "type") != "function_call_output" or not isinstance(_field(item, "output"), str):
            continue
        try:
            value = orjson.loads(_field(item, "output"))
        except orjson.JSONDecodeError:
            continue
        if isinstance(value, dict) and set(value) == {"count"} and type(value["count"]) is int:
            return True
    return False


def final_answer(output: list[Any]) -> str | None:
    """The text of the last assistant message of ``output`` when no tool call follows it, else None."""
    for item in reversed(output):
        kind = _field(item, "type")
        if kind == "function_call":
            return None
        if kind == "message" and _field(item, "role") in (None, "assistant"):
            return text_of_message(item)
    return None


def failure(final_count: int, expected_count: int, output: list[Any]) -> str | None:
    """Why a rollout whose counter ends at ``final_count`` earns nothing; None when it earns 1.0."""
    if final_count != expected_count:
        return f"the counter ends at {final_count}, not at the expected {expected_count}"
    if not counter_was_read(output):
        return "the counter was never read with get_counter_value, so the value told cannot come from it"
    answer = final_answer(output)
    if answer is None:
        return "no final answer: the last turn made tool calls"
    if final_count not in stated_numbers(answer):
        return f"the final answer does not state the counter's value ({final_count}) as a whole number"
    return None


class ExampleSessionStateMgmtServer(SimpleResourcesServer):
    config: ExampleSessionStateMgmtConfig

    # session id -> counter. Handlers never await while touching it, so on the single event loop
    # every read-modify-write is atomic. Insertion order is seeding order (for the max_sessions bound).
    _counters: dict[str, int] = PrivateAttr(default_factory=dict)

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/increment_counter")(self.increment_counter)
        app.post("/get_counter_value")(self.get_counter_value)
        return app

    def _seeded_session_id(self, request: Request) -> str:
        session_id = get_session_id(request)
        if session_id not in self._counters:
            raise UnknownSessionError(
                "This session has no counter: call /seed_session first (with the session cookie it returns), "
                "or the session already ended with /verify."
            )
        return session_id

    async def seed_session(
        self, request: Request, body: CounterSeedSessionRequest
    ) -> BaseSeedSessionResponse:
        session_id = get_session_id(request)
        self._counters.pop(session_id, None)  # re-seeding moves it to the newest end
        self._counters[session_id] = body.initial_count
        while len(self._counters) > self.config.max_sessions:
            del self._counters[next(iter(self._counters))]
        return BaseSeedSessionResponse()

    async def increment_counter(
        self, request: Request, body: IncrementCounterRequest
    ) -> IncrementCounterResponse:
        session_id = self._seeded_session_id(request)
        self._counters[session_id] += body.count
        return IncrementCounterResponse(success=True)

    async def get_counter_value(
        self, request: Request, body: GetCounterValueRequest
    ) -> GetCounterValueResponse:
        return GetCounterValueResponse(count=self._counters[self._seeded_session_id(request)])

    async def verify(self, request: Request, body: CounterVerifyRequest) -> CounterVerifyResponse:
        final_count = self._counters.pop(self._seeded_session_id(request))
        reason = failure(final_count, body.expected_count, body.response.output)
        return CounterVerifyResponse.from_request(
            body,
            reward=0.0 if reason else 1.0,
            final_count=final_count,
            abs_count_error=abs(final_count - body.expected_count),
            failure_reason=reason,
        )


if __name__ == "__main__":
    ExampleSessionStateMgmtServer.run_webserver()
