"""``nemo_gym.judge`` against a real model server (the scripted model, over HTTP), and ``nemo_gym.prompt``.

A judge call returns the validated reply; transient error statuses are retried a bounded number of
times; every other failure is a JudgeError naming the server, path and status; and a verify that
hits a judge failure answers 502 (a failure, recorded as such), never a reward.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
import pytest

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)
from nemo_gym.client.server_client import close_shared_session
from nemo_gym.errors import UpstreamError
from nemo_gym.judge import JudgeError, call_judge, judge_failsafe, reraise_judge_errors
from nemo_gym.kit.prompt import PromptConfigError
from nemo_gym.openai_utils import NeMoGymResponse
from nemo_gym.prompt import (
    PromptConfig,
    apply_prompt_to_row,
    fill_prompt,
    load_prompt_config,
    materialize_prompts,
    validate_prompt_compatibility,
)
from nemo_gym.server_utils import ServerClient
from nemo_gym.tools.testing import get, running_servers, server_url
from tests.conftest import serve_app

BOUND_S = 60.0
JUDGE = "policy_model"  # the scripted model plays the judge


@pytest.fixture(scope="module")
def judge_run() -> Iterator[Any]:
    scripts = [
        {"contains": "ALWAYS_503", "turns": [{"http_error": 503}]},
        {"contains": "ALWAYS_400", "turns": [{"http_error": 400}]},
        {"contains": "JUDGE_ME", "turns": [{"text": "Verdict: [[A>B]]"}]},
    ]
    extra = {"policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": scripts}}}}
    with running_servers([], extra) as helper:
        yield helper


def _requests_answered(helper: Any) -> int:
    return int(get(server_url(helper, JUDGE) + "/stats").json()["requests"])


def _params(text: str) -> dict[str, Any]:
    return {"input": [{"role": "user", "content": text}]}


async def test_call_judge_returns_the_validated_reply(judge_run: Any) -> None:
    client = ServerClient.load_from_global_config(judge_run.head_server_config)
    try:
        reply = await asyncio.wait_for(
            call_judge(
                client,
                server_name=JUDGE,
                url_path="/v1/responses",
                json=_params("JUDGE_ME"),
                response_model=NeMoGymResponse,
            ),
            BOUND_S,
        )
        assert isinstance(reply, NeMoGymResponse) and "[[A>B]]" in reply.output_text
    finally:
        await close_shared_session()


async def test_transient_statuses_are_retried_a_bounded_number_of_times(judge_run: Any) -> None:
    client = ServerClient.load_from_global_config(judge_run.head_server_config)
    before = _requests_answered(judge_run)
    try:
        with pytest.raises(JudgeError) as failure:
            await asyncio.wait_for(
                call_judge(
                    client,
                    server_name=JUDGE,
                    url_path="/v1/responses",
                    json=_params("ALWAYS_503"),
                    response_model=NeMoGymResponse,
                    max_tries=3,
                    backoff_s=0.01,
                ),
                BOUND_S,
            )
    finally:
        await close_shared_session()
    assert _requests_answered(judge_run) - before == 3  # tried exactly max_tries times, then gave up
    err = failure.value
    assert err.status == 503 and err.server == JUDGE and err.path == "/v1/responses"
    assert "still failing after 3 tries" in str(err) and "scripted HTTP 503" in str(err)
    assert b"scripted HTTP 503" in err.response_content  # the raw body, as upstream's errors carry it
    assert isinstance(err, UpstreamError) and err.kind == "judge_failed"


async def test_other_failures_are_judge_errors_at_once(judge_run: Any) -> None:
    client = ServerClient.load_from_global_config(judge_run.head_server_config)
    before = _requests_answered(judge_run)
    try:
        with pytest.raises(JudgeError, match="answered HTTP 400") as bad_request:
            await call_judge(
                client,
                server_name=JUDGE,
                url_path="/v1/responses",
                json=_params("ALWAYS_400"),
                response_model=NeMoGymResponse,
            )
        assert _requests_answered(judge_run) - before == 1  # a client error is not retried
        assert bad_request.value.status == 400

        class Verdict(NeMoGymResponse):
            verdict: str  # the reply has no such field

        with pytest.raises(JudgeError, match="not a Verdict"):
            await call_judge(
                client,
                server_name=JUDGE,
                url_path="/v1/responses",
                json=_params("JUDGE_ME"),
                response_model=Verdict,
            )
        with pytest.raises(JudgeError, match="No server instance named 'no_such_judge'"):
            await call_judge(
                client,
                server_name="no_such_judge",
                url_path="/v1/responses",
                json={},
                response_model=NeMoGymResponse,
            )
    finally:
        await close_shared_session()


async def test_unreachable_judge_is_a_judge_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    cfg = {"dead_judge": {"responses_api_models": {"scripted_model": {"host": "127.0.0.1", "port": port}}}}
    client = ServerClient(global_config_dict=cfg, max_retries=1, backoff_s=0.01, auth_token="t")
    try:
        with pytest.raises(JudgeError) as failure:
            await asyncio.wait_for(
                call_judge(
                    client,
                    server_name="dead_judge",
                    url_path="/v1/responses",
                    json={},
                    response_model=NeMoGymResponse,
                    backoff_s=0.01,
                ),
                BOUND_S,
            )
    finally:
        await close_shared_session()
    assert failure.value.server == "dead_judge" and "connection_error" in str(failure.value)


async def test_reraise_judge_errors() -> None:
    async def boom() -> None:
        raise RuntimeError("socket closed")

    with pytest.raises(JudgeError, match="RuntimeError: socket closed") as e:
        await reraise_judge_errors(boom())
    assert isinstance(e.value.__cause__, RuntimeError)
    original = JudgeError("as is")
    with pytest.raises(JudgeError) as same:

        async def judge_fails() -> None:
            raise original

        await reraise_judge_errors(judge_fails())
    assert same.value is original and str(original) == "as is"

    async def fine() -> int:
        return 7

    assert await reraise_judge_errors(fine()) == 7


# ------------------------------------------------------------------------------------------------
# A judged environment: a judge outage is a failure, never reward 0.


class JudgedConfig(BaseResourcesServerConfig):
    judge_name: str = JUDGE


class JudgedServer(SimpleResourcesServer):
    config: JudgedConfig

    @judge_failsafe
    async def verify(self, body: BaseVerifyRequest) -> BaseVerifyResponse:
        question = body.responses_create_params.input[-1].content
        reply = await call_judge(
            self.server_client,
            server_name=self.config.judge_name,
            url_path="/v1/responses",
            json=_params(str(question)),
            response_model=NeMoGymResponse,
            backoff_s=0.01,
        )
        return BaseVerifyResponse(**body.model_dump(), reward=1.0 if "[[A>B]]" in reply.output_text else 0.0)


def test_a_judge_outage_in_verify_is_a_502_naming_the_judge(judge_run: Any) -> None:
    client = ServerClient.load_from_global_config(judge_run.head_server_config)
    server = JudgedServer(config=JudgedConfig(name="judged", port=0), server_client=client)

    def verify_body(text: str) -> dict[str, Any]:
        return {
            "responses_create_params": _params(text),
            "response": {
                "output": [
                    {
                        "type": "message",
                        "role": "assistant",
                        "content": [{"type": "output_text", "text": "x"}],
                    }
                ]
            },
        }

    with serve_app(server.setup_webserver()) as url:
        port = urlsplit(url).port
        ok = httpx.post(
            f"http://127.0.0.1:{port}/verify", json=verify_body("JUDGE_ME"), timeout=BOUND_S, trust_env=False
        )
        assert ok.status_code == 200 and ok.json()["reward"] == 1.0
        down = httpx.post(
            f"http://127.0.0.1:{port}/verify",
            json=verify_body("ALWAYS_503"),
            timeout=BOUND_S,
            trust_env=False,
        )
    assert down.status_code == 502, down.text
    body = down.json()
    assert "reward" not in body
    inner = body["error"]["inner"]
    assert inner["kind"] == "judge_failed" and inner["server"] == JUDGE and inner["status"] == 503


# ------------------------------------------------------------------------------------------------
# Prompt configs.


def test_prompt_config_load_fill_and_apply(tmp_path: Path) -> None:
    path = tmp_path / "prompt.yaml"
    path.write_text("system: You answer {{in braces}}.\nuser: 'Question: {question} ({level})'\n")
    config = load_prompt_config(str(path))
    assert config == PromptConfig(system="You answer {{in braces}}.", user="Question: {question} ({level})")
    row = {"question": "2+2?", "level": "easy", "responses_create_params": {"temperature": 0.5}}
    assert fill_prompt(config, row) == [
        {"role": "system", "content": "You answer {in braces}."},
        {"role": "user", "content": "Question: 2+2? (easy)"},
    ]
    applied = apply_prompt_to_row(row, config)
    assert applied["responses_create_params"] == {"temperature": 0.5, "input": fill_prompt(config, row)}
    assert row["responses_create_params"] == {"temperature": 0.5}  # the input row is not modified
    with pytest.raises(KeyError, match=r"needs field 'level'.*Row fields: \['question'\]"):
        fill_prompt(config, {"question": "q"})
    with pytest.raises(ValueError, match=r"rows 1\)"):
        validate_prompt_compatibility([row, {"responses_create_params": {"input": "hi"}}], config)


def test_prompt_config_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("system: only a system prompt\n")
    with pytest.raises(PromptConfigError, match=rf"{bad}: user: Field required"):
        load_prompt_config(bad)
    with pytest.raises(PromptConfigError, match="Cannot read prompt config"):
        load_prompt_config(tmp_path / "missing.yaml")
    typo = tmp_path / "typo.yaml"
    typo.write_text("user: '{q}'\nsytem: x\n")
    with pytest.raises(PromptConfigError, match="sytem: Extra inputs are not permitted"):
        load_prompt_config(typo)


def test_materialize_prompts(tmp_path: Path) -> None:
    prompt = tmp_path / "prompt.yaml"
    prompt.write_text("user: 'Solve: {problem}'\n")
    src = tmp_path / "in.jsonl"
    src.write_bytes(
        b'{"problem": "1+1", "expected_answer": "2"}\n\n{"problem": "2+3", "expected_answer": "5"}\n'
    )
    out = tmp_path / "sub" / "out.jsonl"
    assert materialize_prompts(src, prompt, out) == 2
    rows = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert rows[1]["responses_create_params"]["input"] == [{"role": "user", "content": "Solve: 2+3"}]
    assert rows[0]["prompt_config_used"] == str(prompt) and rows[0]["expected_answer"] == "2"

    broken = tmp_path / "broken.jsonl"
    broken.write_bytes(b'{"problem": "1+1"}\n{"question": "no problem field"}\n')
    with pytest.raises(ValueError, match=rf"{broken}:2: .*needs field 'problem'"):
        materialize_prompts(broken, prompt, tmp_path / "never.jsonl")
    assert not (tmp_path / "never.jsonl").exists()  # nothing half-written
