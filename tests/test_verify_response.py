"""``BaseVerifyResponse.from_request``: the request echoed, the verdict only from the verifier."""

from __future__ import annotations

import pytest
from pydantic import ConfigDict

from nemo_gym.base_resources_server import BaseVerifyRequest, BaseVerifyResponse
from nemo_gym.tools.testing import text_response


class LenientRequest(BaseVerifyRequest):
    model_config = ConfigDict(extra="allow")  # as several upstream environments declare
    expected: str


class ScoredResponse(LenientRequest, BaseVerifyResponse):
    extracted: str | None = None
    partial: float = 0.0


def test_a_stored_line_posted_again_gets_a_fresh_verdict() -> None:
    stored = {
        "responses_create_params": {"input": "q"},
        "response": text_response("42"),
        "expected": "42",
        "reward": 0.0,  # the old verdict and outputs ride along on a stored rollout line
        "extracted": "41",
        "partial": 0.5,
        "note": "a task field of the row",
    }
    body = LenientRequest.model_validate(stored)
    with pytest.raises(TypeError, match="multiple values for keyword argument 'reward'"):
        ScoredResponse(**body.model_dump(), reward=1.0)  # upstream's idiom, on such a body
    out = ScoredResponse.from_request(body, reward=1.0, extracted="42")
    assert (out.reward, out.extracted, out.partial) == (1.0, "42", 0.0)  # partial: not the stale 0.5
    assert out.expected == "42" and out.model_extra == {"note": "a task field of the row"}
    assert out.response.output_text == "42"


class LooseResponse(BaseVerifyResponse):
    response: dict  # declared differently from the request's: it gets the dumped value


def test_fields_of_the_same_type_are_handed_over_others_are_dumped_and_validated() -> None:
    body = BaseVerifyRequest.model_validate(
        {"responses_create_params": {"input": "q"}, "response": text_response("7")}
    )
    out = BaseVerifyResponse.from_request(body, reward=0.5)
    # Not dumped and validated again (that was most of a small verifier's cost): the same objects.
    assert out.response is body.response and out.responses_create_params is body.responses_create_params
    assert out.model_dump() == {**body.model_dump(), "reward": 0.5}
    loose = LooseResponse.from_request(body, reward=1.0)
    assert isinstance(loose.response, dict) and loose.response == body.response.model_dump()
