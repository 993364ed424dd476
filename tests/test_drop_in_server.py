"""Upstream NeMo Gym's server-side API works here unchanged (sessions, set-up steps, client, responses,
config keys, resources-server endpoints). Servers run under real uvicorn on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest.mock import AsyncMock, MagicMock

import httpx
import pytest
from fastapi import FastAPI, HTTPException, Request
from omegaconf import OmegaConf
from pydantic import ValidationError

from nemo_gym.auth import AUTH_TOKEN_ENV_VAR_NAME
from nemo_gym.base_resources_server import (
    BaseMultiRewardVerifyResponse,
    BaseResourcesServerConfig,
    BaseRunRequest,
    BaseSeedSessionRequest,
    BaseSeedSessionResponse,
    BaseVerifyRequest,
    BaseVerifyResponse,
    ReverifyMode,
    SimpleResourcesServer,
)
from nemo_gym.config_types import BaseServerConfig, DatasetConfig, Domain
from nemo_gym.errors import UpstreamError
from nemo_gym.server.startup import config_problems
from nemo_gym.server_utils import (
    SESSION_ID_KEY,
    BaseServer,
    ServerClient,
    SimpleServer,
    get_first_server_config_dict,
    get_response_json,
    raise_for_status,
    request,
)
from nemo_gym.tools.testing import metric_value as value
from nemo_gym.tools.testing import scrape
from tests.conftest import serve_app

REPO = Path(__file__).resolve().parents[1]
ROW = {"responses_create_params": {"input": "hi"}}
RESPONSE = {"id": "r", "created_at": 0, "model": "m", "object": "response", "output": []}


class CounterConfig(BaseResourcesServerConfig):
    REVERIFY_MODE = ReverifyMode.STATELESS


class SeedRequest(BaseSeedSessionRequest):
    initial_count: int = 0


class CounterServer(SimpleResourcesServer):
    """Written the way upstream environments are: state keyed by ``request.session[SESSION_ID_KEY]``."""

    config: CounterConfig
    counts: dict[str, int] = {}

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/increment")(self.increment)
        app.post("/boom")(self.boom)
        return app

    async def seed_session(self, request: Request, body: SeedRequest) -> BaseSeedSessionResponse:
        self.counts[request.session[SESSION_ID_KEY]] = body.initial_count
        return BaseSeedSessionResponse()

    async def increment(self, request: Request) -> dict[str, Any]:
        sid = request.session[SESSION_ID_KEY]
        assert request.state.session_id == sid  # our own way of reading it agrees
        self.counts[sid] = self.counts.get(sid, 0) + 1
        return {"count": self.counts[sid]}

    async def boom(self) -> dict[str, Any]:
        raise ValueError("bad city")

    async def verify(self, request: Request, body: BaseVerifyRequest) -> BaseVerifyResponse:
        return BaseVerifyResponse(
            **body.model_dump(), reward=float(self.counts.get(request.session[SESSION_ID_KEY], 0))
        )

    def compute_metrics(self, tasks: list[list[dict[str, Any]]]) -> dict[str, Any]:
        return {
            "solved_tasks": sum(any(r["reward"] > 0 for r in t) for t in tasks),
            "per_task_metrics": [
                {"_ng_task_index": t[0]["_ng_task_index"], "best": max(r["reward"] for r in t)} for t in tasks
            ],
        }


class _NoJar:
    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=10, trust_env=False)

    def post(self, path: str, cookies: dict[str, str] | None = None, **kwargs: Any) -> httpx.Response:
        headers = {"cookie": "; ".join(f"{k}={v}" for k, v in cookies.items())} if cookies else {}
        return httpx.post(self.url + path, headers=headers, timeout=10, trust_env=False, **kwargs)


def hosted_server() -> CounterServer:
    """What verifiers' NeMo Gym taskset does: build the class directly, with upstream's ServerClient call."""
    config = CounterConfig(name="counter", host="127.0.0.1", port=0, entrypoint="app.py")
    client = ServerClient(
        head_server_config=BaseServerConfig(host="127.0.0.1", port=11000),
        global_config_dict=OmegaConf.create({}),
    )
    return CounterServer(config=config, server_client=client)


def hosted_app(server: SimpleServer) -> FastAPI:
    app = server.setup_webserver()
    server.setup_liveness(app)
    server.setup_exception_middleware(app)
    return app


def test_a_directly_built_server_serves_sessions_the_upstream_way() -> None:
    with serve_app(hosted_app(hosted_server())) as url:
        c = _NoJar(url)  # keeps no cookies: each call sends exactly the cookies it is given
        assert c.get("/").json()["status"] == "ok"
        seeded = c.post("/seed_session", json={**ROW, "initial_count": 5})
        assert seeded.status_code == 200, seeded.text
        cookies = dict(seeded.cookies)
        assert cookies, "the seed answer sets the session cookie"
        # A client that only ever sends back the cookies of the last answer keeps its session: every
        # answer carries the cookie (upstream semantics).
        for expected in (6, 7):
            resp = c.post("/increment", cookies=cookies)
            assert resp.json() == {"count": expected}
            assert dict(resp.cookies) == cookies
        verify = c.post("/verify", json={**ROW, "response": RESPONSE}, cookies=cookies)
        assert verify.json()["reward"] == 7.0
        # No cookie: a new session. A tampered cookie: also a new session.
        assert c.post("/increment").json() == {"count": 1}
        name, value = next(iter(cookies.items()))
        sid, _, sig = value.partition(".")
        forged = c.post("/increment", cookies={name: f"{sid}.{sig[::-1]}"})
        assert forged.json() == {"count": 1} and dict(forged.cookies)[name] != value
        # A raising tool is a JSON 500 naming the path and the error; the next call works.
        boom = c.post("/boom", cookies=cookies)
        assert boom.status_code == 500 and boom.json()["error"]["path"] == "/boom"
        assert "bad city" in boom.json()["error"]["message"]
        assert c.post("/increment", cookies=cookies).json() == {"count": 8}


def test_a_stored_rollout_posted_back_to_verify_is_verified_again() -> None:
    """A rollout line from an output file carries ``reward`` and metrics of its first verification;
    upstream's verifiers build ``XVerifyResponse(**body.model_dump(), reward=...)``, so request
    models must drop undeclared fields (upstream semantics) or that call raises on a duplicate key."""
    stored = {
        **ROW,
        "response": RESPONSE,
        "reward": 0.25,  # stale: from the first verification
        "initial_count": 3,
        "_ng_task_index": 4,
        "agent_ref": {"type": "responses_api_agents", "name": "a"},
    }
    with serve_app(hosted_app(hosted_server())) as url:
        c = _NoJar(url)
        cookies = dict(c.post("/seed_session", json=stored).cookies)
        c.post("/increment", cookies=cookies)
        verify = c.post("/verify", json=stored, cookies=cookies)
    assert verify.status_code == 200, verify.text
    body = verify.json()
    assert body["reward"] == 4.0  # seeded at 3 by the stored row, one increment: verified again
    assert "agent_ref" not in body and "_ng_task_index" not in body  # undeclared: not echoed
    assert set(BaseVerifyRequest.model_validate(stored).model_dump()) == {
        "responses_create_params",
        "response",
    }


def test_set_up_steps_are_idempotent_and_a_self_built_app_still_gets_the_guard(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = hosted_server()
    app = hosted_app(server)
    server.setup_session_middleware(app)
    server.setup_liveness(app)
    assert [r.path for r in app.router.routes].count("/") == 1
    # nothing added twice (MetricsMiddleware: GET /metrics, nemo_gym.server.metrics; outermost, metrics on by default)
    assert [m.cls.__name__ for m in app.user_middleware] == ["ServerLayer"]
    assert server.get_session_middleware_key() == "CounterServer___counter"

    class OwnAppServer(SimpleServer):
        """Upstream's GymnasiumServer pattern: builds FastAPI() itself and installs sessions by hand."""

        def setup_webserver(self) -> FastAPI:
            own = FastAPI()
            self.setup_session_middleware(own)

            @own.post("/sid")
            async def sid(request: Request) -> dict[str, str]:
                return {"sid": request.session[SESSION_ID_KEY]}

            return own

    monkeypatch.setenv(AUTH_TOKEN_ENV_VAR_NAME, "tok")
    own_server = OwnAppServer(config=CounterConfig(name="own"), server_client=MagicMock(spec=ServerClient))
    own_app = own_server.complete_app(own_server.setup_webserver())  # what run_webserver does
    with serve_app(own_app) as url:
        assert httpx.post(url + "/sid", trust_env=False).status_code == 401
        ok = httpx.post(url + "/sid", headers={"Authorization": "Bearer tok"}, trust_env=False)
        assert ok.status_code == 200 and ok.json()["sid"]
        assert (
            httpx.get(url + "/", headers={"Authorization": "Bearer tok"}, trust_env=False).status_code == 200
        )


def test_aggregate_metrics_and_reverify_mode_endpoints() -> None:
    rows = [
        {
            "_ng_task_index": 0,
            "_ng_rollout_index": 0,
            "reward": 1.0,
            "ok": True,
            "response": {"usage": {"output_tokens": 10}},
        },
        {
            "_ng_task_index": 0,
            "_ng_rollout_index": 1,
            "reward": 0.0,
            "ok": False,
            "response": {"usage": {"output_tokens": 30}},
        },
        {
            "_ng_task_index": 1,
            "_ng_rollout_index": 0,
            "reward": 0.5,
            "ok": True,
            "response": {"usage": {"output_tokens": 20}},
        },
    ]
    with serve_app(hosted_app(hosted_server())) as url:
        assert httpx.get(url + "/reverify_mode", trust_env=False).json() == "stateless"
        resp = httpx.post(url + "/aggregate_metrics", json={"verify_responses": rows}, trust_env=False)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    agent = body["agent_metrics"]
    assert agent["mean/reward"] == pytest.approx(0.5)
    assert agent["std/reward"] == pytest.approx(0.5)  # sample std of 1, 0, 0.5
    assert agent["median/output_tokens"] == 20 and agent["max/output_tokens"] == 30
    assert agent["mean/ok"] == pytest.approx(2 / 3)
    assert agent["solved_tasks"] == 2
    assert body["key_metrics"] == {k: v for k, v in agent.items() if k.startswith("mean/")}
    groups = body["group_level_metrics"]
    assert [g["_ng_task_index"] for g in groups] == [0, 1]
    assert groups[0]["mean/reward"] == 0.5 and groups[0]["num_rollouts"] == 2 and groups[0]["best"] == 1.0
    assert groups[1]["std/reward"] == 0.0


async def test_server_client_answers_like_upstreams_aiohttp_response() -> None:
    with serve_app(hosted_app(hosted_server())) as url:
        host, port = url.removeprefix("http://").split(":")
        cfg = OmegaConf.create(
            {"counter": {"resources_servers": {"counter": {"host": host, "port": int(port)}}}}
        )
        client = ServerClient(
            head_server_config=BaseServerConfig(host="127.0.0.1", port=1), global_config_dict=cfg
        )
        assert get_first_server_config_dict(cfg, "counter").port == int(port)

        seeded = await client.post(
            server_name="counter", url_path="/seed_session", json={**ROW, "initial_count": 1}
        )
        await raise_for_status(seeded)  # upstream's one-argument, awaited form
        assert seeded.ok and seeded.status == 200
        # aiohttp cookies (morsels) passed straight back keep the session.
        resp = await client.post(server_name="counter", url_path="/increment", cookies=seeded.cookies)
        assert await resp.json() == {"count": 2}
        assert json.loads(await resp.read()) == {"count": 2}
        assert json.loads(await resp.content.read()) == {"count": 2}
        assert await get_response_json(resp) == {"count": 2}
        # Upstream's argument order and aiohttp's timeout object.
        again = await client.request(
            "counter", "/increment", "POST", cookies=resp.cookies, timeout=SimpleNamespace(total=5)
        )
        assert await again.json() == {"count": 3}
        again = await client.request(
            server_name="counter", url_path="/increment", method="POST", cookies=resp.cookies
        )
        assert await again.json() == {"count": 4}
        # The module-level request(method, url) of upstream.
        direct = await request("POST", url + "/increment", cookies=resp.cookies)
        assert await direct.json() == {"count": 5}

        bad = await client.post(server_name="counter", url_path="/verify", json={"nope": 1})
        assert not bad.ok and bad.status == 422
        with pytest.raises(UpstreamError) as caught:
            await raise_for_status(bad)
        err = caught.value
        assert err.status == 422 and err.server == "counter" and err.path == "/verify"
        assert json.loads(err.response_content)["error"]["kind"] == "validation_error"
        with pytest.raises(UpstreamError):
            bad.raise_for_status()  # aiohttp's method on the response
        with pytest.raises(UpstreamError) as caught:
            raise_for_status(bad, "counter", "/verify")  # our three-argument, synchronous form
        assert caught.value.response_content == err.response_content
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a sync caller that does not await gets no "never awaited"
            raise_for_status(seeded, "counter", "/seed_session")
            raise_for_status(seeded)


async def test_helpers_accept_the_test_doubles_upstream_tests_use() -> None:
    ok = MagicMock()
    ok.read = AsyncMock(return_value=b'{"a": 1}')
    await raise_for_status(ok)  # a MagicMock's ``ok`` is truthy: success, as upstream treats it
    assert await get_response_json(ok) == {"a": 1}
    failed = MagicMock(ok=False, status=503)
    failed.content.read = AsyncMock(return_value=b"overloaded")
    with pytest.raises(UpstreamError) as caught:
        await raise_for_status(failed)
    assert caught.value.status == 503 and caught.value.response_content == b"overloaded"
    server = CounterServer(
        config=CounterConfig(name="x", host="0.0.0.0", port=8080, entrypoint=""),
        server_client=MagicMock(spec=ServerClient),
    )
    verify = await server.verify(
        MagicMock(session={SESSION_ID_KEY: "s"}), BaseVerifyRequest(**ROW, response=RESPONSE)
    )
    assert verify.reward == 0.0


def test_upstream_config_keys_are_accepted_and_typos_still_caught() -> None:
    cfg = CounterConfig(
        name="x",
        entrypoint="app.py",
        domain="agent",
        verified=False,
        description="d",
        value="v",
        num_workers=1,
    )
    assert cfg.domain is Domain.AGENT
    with pytest.raises(ValidationError, match="domain"):
        CounterConfig(domain="agents")
    with pytest.raises(ValidationError) as caught:
        CounterConfig(descripton="d")
    problem = config_problems(CounterConfig, caught.value)[0]
    assert problem["loc"] == "descripton" and problem["suggest"] == ["description"]
    assert CounterConfig(expose_tools_over_mcp=True).expose_tools_over_mcp  # served by nemo_gym/server/mcp

    gitlab = {"dataset_name": "d", "version": "0.0.1", "artifact_fpath": "train.jsonl"}
    ds = DatasetConfig(
        name="t", type="train", jsonl_fpath="x.jsonl", license="Apache 2.0", gitlab_identifier=gitlab
    )
    assert ds.num_repeats == 1 and ds.gitlab_identifier.version == "0.0.1"
    DatasetConfig(name="t", type="example", jsonl_fpath="x", huggingface_identifier={"repo_id": "o/r"})
    DatasetConfig(name="t", type="example", jsonl_fpath="x", source={"type": "huggingface", "repo_id": "o/r"})
    with pytest.raises(ValidationError, match="needs a license"):
        DatasetConfig(name="t", type="train", jsonl_fpath="x")
    with pytest.raises(ValidationError, match="license"):
        DatasetConfig(name="t", type="example", jsonl_fpath="x", license="Apache-2")
    with pytest.raises(ValidationError, match="gitlab_identifer"):
        DatasetConfig(name="t", type="example", jsonl_fpath="x", gitlab_identifer=gitlab)


def test_multi_reward_verify_response_checks_the_sum() -> None:
    base = {**ROW, "response": RESPONSE}
    ok = BaseMultiRewardVerifyResponse(**base, reward=1.5, reward_components={"a": 1.0, "b": 0.5})
    assert ok.reward_components == {"a": 1.0, "b": 0.5}
    with pytest.raises(ValidationError, match="sum of reward_components"):
        BaseMultiRewardVerifyResponse(**base, reward=1.0, reward_components={"a": 1.0, "b": 0.5})
    assert "task_field" not in BaseRunRequest(**ROW, task_field=3).model_dump()  # undeclared: ignored


def test_base_server_keeps_upstream_names() -> None:
    assert issubclass(SimpleResourcesServer, SimpleServer) and issubclass(SimpleServer, BaseServer)
    assert asyncio.iscoroutinefunction(SimpleResourcesServer.seed_session)


APP = "NAME = {name!r}\n"
TEST = """
from app import NAME as BARE
from resources_servers.{name}.app import NAME as FULL


def test_imports():
    assert BARE == FULL == {name!r}
"""


def test_environment_tests_import_app_both_ways_from_inside_their_folder(tmp_path: Path) -> None:
    """``cd resources_servers/<name> && pytest tests`` with ``from app import`` and the full path."""
    (tmp_path / "conftest.py").write_text((REPO / "conftest.py").read_text())
    (tmp_path / "pyproject.toml").write_text(
        '[tool.pytest.ini_options]\naddopts = "-p no:cacheprovider --import-mode=importlib"\n'
    )
    for name in ("env_a", "env_b"):
        folder = tmp_path / "resources_servers" / name
        (folder / "tests").mkdir(parents=True)
        (folder / "app.py").write_text(APP.format(name=name))
        (folder / "tests" / "test_app.py").write_text(TEST.format(name=name))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    pytest_bin = [
        sys.executable,
        "-c",
        "import sys, pytest; sys.path.remove(sys.path[0]) if sys.path[0] in ('', '.') else None; sys.exit(pytest.main())",
    ]
    inside = subprocess.run(
        [*pytest_bin, "-q", "tests"],
        cwd=tmp_path / "resources_servers" / "env_a",
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert inside.returncode == 0, inside.stdout + inside.stderr
    both = subprocess.run(
        [*pytest_bin, "-q", "resources_servers"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert both.returncode == 0 and "2 passed" in both.stdout, both.stdout + both.stderr


def test_rollout_prefixed_paths_answer_as_plain_ones_and_expose_the_id() -> None:
    """Upstream's rollout correlation: ``/ng-rollout/<id>/<path>`` is ``/<path>`` with ``<id>`` current."""
    from nemo_gym.base_responses_api_agent import SimpleResponsesAPIAgent
    from nemo_gym.rollout_correlation import (
        RolloutContextMiddleware,
        current_rollout_id,
        maybe_rollout_id_from_run_body,
    )
    from nemo_gym.server.rollout_prefix import rollout_path_prefix

    server = hosted_server()
    app = hosted_app(server)
    app.add_middleware(RolloutContextMiddleware)  # as upstream's Gymnasium servers do: harmless twice

    @app.post("/whoami")
    async def whoami(request: Request) -> dict[str, Any]:
        return {"rollout_id": current_rollout_id(), "path": request.url.path}

    with serve_app(app) as url:
        c = _NoJar(url)
        assert c.post("/ng-rollout/4-2/whoami").json() == {"rollout_id": "4-2", "path": "/whoami"}
        assert c.post("/whoami").json() == {"rollout_id": None, "path": "/whoami"}
        seeded = c.post("/ng-rollout/7-0/seed_session", json={**ROW, "initial_count": 2})
        cookies = dict(seeded.cookies)
        assert c.post("/ng-rollout/7-0/increment", cookies=cookies).json() == {"count": 3}
        assert c.post("/ng-rollout/bad id/whoami").status_code == 404  # not a prefix: routed as is
    assert maybe_rollout_id_from_run_body({"_ng_task_index": 3, "_ng_rollout_index": 1}) == "3-1"
    assert maybe_rollout_id_from_run_body({"_ng_rollout_id": "x.1", "_ng_attempt_index": 2}) == "x.1-a2"
    assert maybe_rollout_id_from_run_body({"responses_create_params": {}}) is None
    with pytest.raises(ValueError, match="_ng_rollout_id"):
        maybe_rollout_id_from_run_body({"_ng_rollout_id": "../etc"})
    assert rollout_path_prefix("3-1") == "/ng-rollout/3-1" and rollout_path_prefix(None) == ""
    # Agents: upstream's path helpers exist; with no capture configured they leave paths unchanged.
    for name in ("url_path_for_run", "base_url_for_run", "url_path_for_request", "rollout_id_from_run"):
        assert callable(getattr(SimpleResponsesAPIAgent, name))


def test_unhandled_errors_are_scrubbed_json_500s_with_the_session_cookie_in_both_set_ups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The folded layer (our setup_webserver) and an app that installed upstream's set-up steps itself
    (the layer then leaves errors and sessions to those) answer an unhandled error the same way: a JSON
    500 naming the server and path, the secret scrubbed, the session cookie set, the connection kept."""
    from nemo_gym.redaction import add_secret_values

    secret = "sk-folded-layer-secret-0123456789"
    add_secret_values([secret])
    monkeypatch.setenv(AUTH_TOKEN_ENV_VAR_NAME, "tok")
    auth = {"Authorization": "Bearer tok"}

    def boom_route(app: FastAPI) -> None:
        @app.post("/boom")
        async def boom() -> dict[str, str]:
            raise RuntimeError(f"upstream said no with key {secret}")

        @app.post("/refuse")
        async def refuse() -> dict[str, str]:  # an error answer the app builds itself
            raise HTTPException(status_code=400, detail=f"bad key {secret}")

    class OwnAppServer(SimpleServer):
        def setup_webserver(self) -> FastAPI:
            own = FastAPI()
            self.setup_exception_middleware(own)
            self.setup_session_middleware(own)
            boom_route(own)
            return own

    class OursServer(SimpleServer):
        uses_sessions = True

        def setup_webserver(self) -> FastAPI:
            app = super().setup_webserver()
            boom_route(app)
            return app

    own = OwnAppServer(config=CounterConfig(name="own"), server_client=MagicMock(spec=ServerClient))
    ours = OursServer(config=CounterConfig(name="ours"), server_client=MagicMock(spec=ServerClient))
    for server, layers in ((own, 3), (ours, 1)):  # the metrics are counted in ServerLayer
        app = server.complete_app(server.setup_webserver())
        assert len(app.user_middleware) == layers  # nothing installed twice
        with serve_app(app) as url, httpx.Client(base_url=url, trust_env=False, headers=auth) as client:
            for _ in range(2):  # the same keep-alive connection serves the next request too
                r = client.post("/boom")
                assert r.status_code == 500, r.text
                error = r.json()["error"]
                assert error["kind"] == "internal_error" and error["type"] == "RuntimeError"
                assert error["server"] == server.config.name and error["path"] == "/boom"
                assert secret not in r.text and "upstream said no" in error["message"]
                assert f"ng_session_{server.config.name}=" in r.headers["set-cookie"]
            refused = client.post("/refuse")
            assert refused.status_code == 400 and "bad key" in refused.text and secret not in refused.text
            assert int(refused.headers["content-length"]) == len(refused.content)
            assert client.post("/boom", headers={"Authorization": "Bearer wrong"}).status_code == 401
            # The layer counted each answer by the status and kind that went out, in both set-ups.
            m = scrape(url, "tok")
            assert value(m, "nemo_gym_http_requests_total", route="/boom", status="500") == 2
            assert value(m, "nemo_gym_http_errors_total", route="/boom", kind="internal_error") == 2
            assert value(m, "nemo_gym_http_errors_total", route="/refuse") == 1  # its own body: no envelope
            assert value(m, "nemo_gym_http_errors_total", route="/boom", kind="unauthorized") == 1
