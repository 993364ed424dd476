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
