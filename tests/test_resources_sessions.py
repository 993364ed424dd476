"""NeMo Gym 0.7's resources-session protocol (seed and close under a caller's ``resources_session_id``), its
contract check (``nemo_gym.testing.session_conformance``) and verifier fixtures (``nemo_gym.verifier_fixture``),
each imported from upstream's paths as a 0.7 environment imports them. The servers here are ours, written
the way a 0.7 environment writes a stateful one."""

from __future__ import annotations

import asyncio
import json
import stat
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel, PrivateAttr

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseSeedSessionRequest,
    BaseSeedSessionResponse,
    BaseVerifyRequest,
    BaseVerifyResponse,
    ResourcesCloseSessionRequest,
    ResourcesCloseSessionResponse,
    ResourcesSeedSessionRequest,
    ResourcesSeedSessionResponse,
    SimpleResourcesServer,
)
from nemo_gym.episode_types import EpisodeId, TaskId
from nemo_gym.server_utils import ServerClient
from nemo_gym.testing.session_conformance import check_resources_session_contract
from nemo_gym.verifier_fixture import (
    VerifierFixture,
    VerifierFixtureError,
    exercise_verifier_fixture,
    load_verifier_fixture,
)
from tests.conftest import serve_app

EPISODE = EpisodeId(rollout_id="rollout-1", attempt=0)
TASK = TaskId(taskset="example", task_id="0")


def _seed(
    session: str = "s-1", episode: EpisodeId = EPISODE, task: TaskId = TASK
) -> ResourcesSeedSessionRequest:
    return ResourcesSeedSessionRequest(
        resources_session_id=session, episode_id=episode, task_id=task, task_data={"city": "Oslo"}
    )


class LampRequest(BaseModel):
    on: bool


class LampVerifier:
    """Reward 1 when the answer's last tool call switched the lamp on."""

    async def verify(self, body: BaseVerifyRequest) -> BaseVerifyResponse:
        calls = [item for item in body.response.output if item.type == "function_call"]
        if not calls:
            raise ValueError("no tool call to judge")
        reward = float(json.loads(calls[-1].arguments).get("on") is True)
        return BaseVerifyResponse(**body.model_dump(), reward=reward)


class LampServer(LampVerifier, SimpleResourcesServer):
    """Keeps a lamp per resources session, by the rules a stateful 0.7 server follows."""

    config: BaseResourcesServerConfig
    _lamps: dict[str, tuple[EpisodeId, TaskId, bool]] = PrivateAttr(default_factory=dict)
    _closed: set[str] = PrivateAttr(default_factory=set)
    release_fails: bool = False

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/lamp")(self.lamp)
        return app

    async def seed_session(
        self, body: ResourcesSeedSessionRequest | BaseSeedSessionRequest
    ) -> ResourcesSeedSessionResponse | BaseSeedSessionResponse:
        if not isinstance(body, ResourcesSeedSessionRequest):
            return BaseSeedSessionResponse()
        sid = body.resources_session_id
        if sid in self._closed:
            raise ValueError(f"session {sid} is already closed")
        episode, task, _ = self._lamps.setdefault(sid, (body.episode_id, body.task_id, False))
        if (episode, task) != (body.episode_id, body.task_id):
            raise ValueError(f"session {sid} belongs to another episode or task")
        return ResourcesSeedSessionResponse(resources_session_id=sid)

    async def close_resources_session(
        self, body: ResourcesCloseSessionRequest
    ) -> ResourcesCloseSessionResponse:
        sid = body.resources_session_id
        if self.release_fails:
            raise RuntimeError("the lamp store is down")  # not recorded as closed: the caller retries
        self._lamps.pop(sid, None)
        self._closed.add(sid)
        return ResourcesCloseSessionResponse(resources_session_id=sid)

    async def lamp(self, body: LampRequest) -> dict[str, bool]:
        return {"on": body.on}


class ForgetfulServer(LampServer):
    """Breaks the contract: a close forgets the session entirely, so a late seed creates it again."""

    async def close_resources_session(
        self, body: ResourcesCloseSessionRequest
    ) -> ResourcesCloseSessionResponse:
        self._lamps.pop(body.resources_session_id, None)
        return ResourcesCloseSessionResponse(resources_session_id=body.resources_session_id)


class DefaultServer(SimpleResourcesServer):
    config: BaseResourcesServerConfig

    async def verify(self, body: BaseVerifyRequest) -> BaseVerifyResponse:
        return BaseVerifyResponse(**body.model_dump(), reward=0.0)


def _server(cls: type[SimpleResourcesServer] = LampServer) -> Any:
    config = BaseResourcesServerConfig(host="127.0.0.1", port=8080, entrypoint="", name="lamp")
    return cls(config=config, server_client=MagicMock(spec=ServerClient))


# ------------------------------------------------------------------------------------------------
# Seed and close.


async def test_seed_and_close_follow_the_rules_when_called_directly() -> None:
    server = _server()
    first = await server.seed_session(_seed())
    assert (
        first
        == await server.seed_session(_seed())
        == ResourcesSeedSessionResponse(resources_session_id="s-1")
    )
    with pytest.raises(ValueError, match="another episode"):
        await server.seed_session(_seed(episode=EpisodeId(rollout_id="rollout-2")))
    close = ResourcesCloseSessionRequest(resources_session_id="s-1", episode_id=EPISODE)
    assert await server.close_resources_session(close) == await server.close_resources_session(close)
    with pytest.raises(ValueError, match="already closed"):
        await server.seed_session(_seed())
    # A legacy seed (an agent's /run) is still answered the old way.
    assert await server.seed_session(BaseSeedSessionRequest()) == BaseSeedSessionResponse()


def test_the_routes_over_real_http_take_both_seeds_and_close_with_the_run_token() -> None:
    """Served by uvicorn: /seed_session takes a 0.7 seed (answered with its id) and a task row (an agent's
    seed, answered as before); /close_session releases; the bodies are checked (unknown fields refused)."""
    server = _server()
    with serve_app(server.setup_webserver()) as url, httpx.Client(base_url=url, trust_env=False) as client:
        seeded = client.post("/seed_session", json=_seed("s-http").model_dump(mode="json"))
        assert seeded.status_code == 200 and seeded.json()["resources_session_id"] == "s-http", seeded.text
        assert "s-http" in server._lamps
        row = client.post("/seed_session", json={"responses_create_params": {"input": "hi"}, "city": "Oslo"})
        assert row.status_code == 200 and "resources_session_id" not in row.json(), row.text
        close = {"resources_session_id": "s-http", "episode_id": EPISODE.model_dump(mode="json")}
        closed = client.post("/close_session", json=close)
        assert closed.status_code == 200 and closed.json() == {"resources_session_id": "s-http"}, closed.text
        assert "s-http" not in server._lamps and "s-http" in server._closed
        extra = client.post("/close_session", json={**close, "extra": 1})
        assert extra.status_code == 422 and "extra" in extra.text, extra.text
        again = client.post("/seed_session", json=_seed("s-http").model_dump(mode="json"))
        assert again.status_code >= 400, again.text


def test_a_server_serving_its_tools_over_mcp_announces_them_in_resources_tools() -> None:
    """With expose_tools_over_mcp, a 0.7 seed's answer names the MCP endpoint in ``resources_tools`` (and
    stays a valid ResourcesSeedSessionResponse); a task row's seed still gets it under ``mcp``; the
    protocol's routes (/close_session among them) are never offered as tools."""
    pytest.importorskip("mcp", reason="the `mcp` extra is not installed")
    from nemo_gym.base_resources_server import NEMO_GYM_MCP_SESSION_TOKEN_HEADER
    from nemo_gym.server.mcp import RESERVED_PATHS

    config = BaseResourcesServerConfig(host="127.0.0.1", port=8080, name="lamp", expose_tools_over_mcp=True)
    server = LampServer(config=config, server_client=MagicMock(spec=ServerClient))
    with serve_app(server.setup_webserver(), lifespan="on") as url:
        with httpx.Client(base_url=url, trust_env=False) as client:
            seeded = client.post("/seed_session", json=_seed("s-mcp").model_dump(mode="json"))
            answer = ResourcesSeedSessionResponse.model_validate(seeded.json())
            assert answer.resources_tools is not None and answer.resources_tools.server_name == "lamp"
            assert NEMO_GYM_MCP_SESSION_TOKEN_HEADER in answer.resources_tools.headers
            row = client.post("/seed_session", json={"responses_create_params": {"input": "hi"}})
            assert row.json()["mcp"]["server_name"] == "lamp", row.text
    assert "/close_session" in RESERVED_PATHS


def test_the_contract_check_passes_a_server_that_keeps_it_and_names_what_another_breaks() -> None:
    check_resources_session_contract(_server().setup_webserver(), _seed("c-1"), keeps_state=True)
    # The default server keeps nothing: it passes without state, and has nothing to refuse with.
    check_resources_session_contract(
        _server(DefaultServer).setup_webserver(), _seed("c-2"), keeps_state=False
    )
    with pytest.raises(AssertionError, match="a seed after its close created session 'c-3' again"):
        check_resources_session_contract(
            _server(DefaultServer).setup_webserver(), _seed("c-3"), keeps_state=True
        )
    with pytest.raises(AssertionError, match="a seed after its close created session 'c-4' again"):
        check_resources_session_contract(
            _server(ForgetfulServer).setup_webserver(), _seed("c-4"), keeps_state=True
        )
    failing = _server()
    failing.release_fails = True
    with pytest.raises(AssertionError, match=r"close: /close_session answered 500"):
        check_resources_session_contract(failing.setup_webserver(), _seed("c-5"), keeps_state=True)
    assert "c-5" not in failing._closed  # a failed release is not recorded as closed


class MaskingServer(DefaultServer):
    """Masks its verdict when the row says its judge is down (0.7's verify-response failure fields)."""

    async def verify(self, body: BaseVerifyRequest) -> BaseVerifyResponse:
        if "judge down" in str(body.responses_create_params.input):
            return BaseVerifyResponse(
                **body.model_dump(),
                reward=0.0,
                mask_sample=True,
                failure_kind="judge_failed",
                failure_reason="the judge answered 503",
            )
        return BaseVerifyResponse(**body.model_dump(), reward=1.0)


def test_verify_answers_carry_the_failure_fields_only_when_set() -> None:
    server = _server(MaskingServer)
    with serve_app(server.setup_webserver()) as url, httpx.Client(base_url=url, trust_env=False) as client:
        for text, expected in (
            ("judge down", {"reward": 0.0, "mask_sample": True, "failure_kind": "judge_failed"}),
            ("fine", {"reward": 1.0}),
        ):
            body = _call(True)
            body["responses_create_params"]["input"] = text
            answer = client.post("/verify", json=body).json()
            assert {
                k: answer[k] for k in ("reward", "mask_sample", "failure_kind") if k in answer
            } == expected
            assert ("failure_reason" in answer) == (text == "judge down"), answer


# ------------------------------------------------------------------------------------------------
# Verifier fixtures.


def _call(on: Any) -> dict[str, Any]:
    return {
        "responses_create_params": {"input": "Switch the lamp on."},
        "response": {
            "id": "r",
            "created_at": 0,
            "model": "m",
            "object": "response",
            "output": [
                {"type": "function_call", "name": "lamp", "call_id": "c", "arguments": json.dumps({"on": on})}
            ],
            "parallel_tool_calls": False,
            "tool_choice": "auto",
            "tools": [],
        },
    }


def _no_call() -> dict[str, Any]:
    body = _call(True)
    body["response"]["output"] = []
    return body


GOOD_CASES = [
    {"name": "switched on", "kind": "full_reward", "request": _call(True), "expected_reward": 1.0},
    {"name": "left off", "kind": "zero_reward", "request": _call(False), "expected_reward": 0.0},
    {"name": "no call", "kind": "malformed", "request": _no_call(), "expected_error": "no tool call"},
    {"name": "again", "kind": "determinism", "request": _call(True), "expected_reward": 1.0},
]


def _fixture(tmp_path: Path, cases: list[Any], **fields: Any) -> VerifierFixture:
    path = tmp_path / "verifier_cases.jsonl"
    path.write_text("".join((c if isinstance(c, str) else json.dumps(c)) + "\n" for c in cases))
    return VerifierFixture(
        server_factory=LampVerifier, request_model=BaseVerifyRequest, cases_path=path, **fields
    )


def _exercise(fixture: VerifierFixture, **options: Any) -> Any:
    options = {"reward_range": (0.0, 1.0), "determinism": "unknown", **options}
    return asyncio.run(exercise_verifier_fixture(fixture, **options))


def test_a_fixture_whose_cases_hold_passes_and_reports_each_case(tmp_path: Path) -> None:
    results = _exercise(_fixture(tmp_path, GOOD_CASES))
    assert [(r.name, r.kind, r.observed_rewards) for r in results] == [
        ("switched on", "full_reward", (1.0,)),
        ("left off", "zero_reward", (0.0,)),
        ("no call", "malformed", ()),
    ]  # the determinism case is played only for a seeded environment
    reseeds: list[bool] = []
    fixture = _fixture(tmp_path, GOOD_CASES, reseed=lambda server, request: reseeds.append(True))
    seeded = _exercise(fixture, determinism="seeded")
    assert seeded[-1].observed_rewards == (1.0, 1.0) and len(reseeds) == 2
    # Lower is better: the ends swap.
    swapped = [
        {**GOOD_CASES[0], "kind": "zero_reward"},
        {**GOOD_CASES[1], "kind": "full_reward"},
        GOOD_CASES[2],
    ]
    assert len(_exercise(_fixture(tmp_path, swapped), higher_is_better=False)) == 3


@pytest.mark.parametrize(
    "cases, options, message",
    [
        (GOOD_CASES[:2], {}, "has no case of kind malformed"),
        (GOOD_CASES[:3], {"determinism": "seeded"}, "has no case of kind determinism"),
        (
            [{**GOOD_CASES[0], "expected_reward": 0.5}, *GOOD_CASES[1:3]],
            {},
            "case 'switched on': reward 1.0, expected_reward 0.5",
        ),
        (
            [GOOD_CASES[0], {**GOOD_CASES[1], "request": _call(True)}, GOOD_CASES[2]],
            {},
            "zero_reward case 'left off': reward 1.0, not the range's worst end 0.0",
        ),
        (
            [*GOOD_CASES[:2], {**GOOD_CASES[2], "request": _call(True)}],
            {},
            "malformed case 'no call': the verifier raised nothing",
        ),
        (
            [*GOOD_CASES[:2], {**GOOD_CASES[2], "expected_error": "lamp exploded"}],
            {},
            "the error does not contain 'lamp exploded'",
        ),
        (GOOD_CASES[:3], {"reward_range": (0.0, 0.5)}, "reward 1.0 is outside [0.0, 0.5]"),
        (GOOD_CASES[:3], {"reward_range": (1.0, 0.0)}, "low <= high"),
        (GOOD_CASES[:3], {"determinism": "sometimes"}, "determinism must be one of"),
        (GOOD_CASES, {"determinism": "seeded"}, "a determinism case needs the fixture's reseed"),
    ],
)
def test_a_fixture_that_does_not_hold_is_an_error_naming_the_case(
    tmp_path: Path, cases: list[Any], options: dict[str, Any], message: str
) -> None:
    with pytest.raises(VerifierFixtureError, match=message.replace("(", r"\(").replace("[", r"\[")):
        _exercise(_fixture(tmp_path, cases), **options)


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", ":2: not JSON"),
        (json.dumps({**GOOD_CASES[0], "expected_error": "x"}), ":2: .*must not set expected_error"),
        (json.dumps({**GOOD_CASES[2], "expected_error": None}), ":2: .*needs expected_error"),
        (json.dumps({**GOOD_CASES[0], "kind": "partial"}), ":2: kind: Input should be"),
        (json.dumps({**GOOD_CASES[0], "grade": "A"}), ":2: grade: Extra inputs"),
        (json.dumps({**GOOD_CASES[0], "expected_reward": "1"}), ":2: expected_reward"),
    ],
)
def test_a_bad_line_is_an_error_naming_the_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "cases.jsonl"
    path.write_text(json.dumps(GOOD_CASES[0]) + "\n" + line + "\n")
    with pytest.raises(VerifierFixtureError, match=f"{path}{message}"):
        load_verifier_fixture(path)
    path.write_text("\n\n")
    with pytest.raises(VerifierFixtureError, match="has no cases"):
        load_verifier_fixture(path)


def test_update_expected_writes_the_observed_rewards_back_keeping_the_file_mode(tmp_path: Path) -> None:
    stale = [
        {**GOOD_CASES[0], "expected_reward": 0.25},
        {**GOOD_CASES[1], "expected_reward": 0.75},
        GOOD_CASES[2],
    ]
    fixture = _fixture(tmp_path, stale)
    path = Path(fixture.cases_path)
    path.chmod(0o640)
    _exercise(fixture, update_expected=True)
    assert [c.expected_reward for c in load_verifier_fixture(path)] == [1.0, 0.0, None]
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    _exercise(fixture)  # now it holds
