"""Per-rollout sessions: a signed cookie per server instance; forged cookies are not accepted."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
from fastapi import FastAPI, Request

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)
from nemo_gym.config.keys import NEMO_GYM_SESSION_SECRET_ENV_VAR_NAME
from nemo_gym.server.asgi.sessions import cookie_name_for
from nemo_gym.server.base import get_session_id
from nemo_gym.server_utils import ServerClient
from tests.conftest import serve_app


class CounterServer(SimpleResourcesServer):
    """Counts calls per session, so tests can see whether two requests share one."""

    config: BaseResourcesServerConfig
    counts: dict[str, int] = {}

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/count")(self.count)
        return app

    async def count(self, request: Request) -> dict[str, object]:
        sid = get_session_id(request)
        self.counts[sid] = self.counts.get(sid, 0) + 1
        return {"session_id": sid, "count": self.counts[sid]}

    async def verify(self, body: BaseVerifyRequest) -> BaseVerifyResponse:
        return BaseVerifyResponse(**body.model_dump(), reward=0.0)


def make_app(instance: str) -> FastAPI:
    server = CounterServer(
        config=BaseResourcesServerConfig(name=instance, port=0),
        server_client=ServerClient(global_config_dict={}),
    )
    return server.setup_webserver()


def post(url: str, cookies: dict[str, str] | None = None) -> httpx.Response:
    headers = {"Cookie": "; ".join(f"{k}={v}" for k, v in (cookies or {}).items())} if cookies else {}
    return httpx.post(url + "/count", headers=headers, timeout=10, trust_env=False)


@pytest.fixture
def no_env_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NEMO_GYM_SESSION_SECRET_ENV_VAR_NAME, raising=False)


def test_cookie_is_named_per_instance_and_keeps_the_session(no_env_secret: None) -> None:
    name = cookie_name_for("my-env.v2")
    assert name == "ng_session_my_env_v2"
    with serve_app(make_app("my-env.v2")) as url:
        first = post(url)
        assert first.status_code == 200
        value = first.cookies[name]
        assert "httponly" in first.headers["set-cookie"].lower()
        sid = first.json()["session_id"]
        assert sid in value and value != sid  # the id travels with a signature

        again = post(url, {name: value})
        assert again.json() == {"session_id": sid, "count": 2}
        # Every answer carries the cookie (upstream semantics); an accepted session keeps its value.
        assert again.cookies[name] == value

        other = post(url)
        assert other.json()["session_id"] != sid and other.json()["count"] == 1


def test_tampered_or_forged_cookies_start_a_new_session(no_env_secret: None) -> None:
    name = cookie_name_for("sessions_a")
    with serve_app(make_app("sessions_a")) as url:
        first = post(url)
        value = first.cookies[name]
        sid, _, sig = value.partition(".")
        victim = "0" * len(sid)
        forged_values = [
            f"{victim}.{sig}",  # someone else's id with my signature
            f"{sid}.{sig[:-1]}{'B' if sig.endswith('A') else 'A'}",  # my id with a changed signature
            sid,  # no signature at all
            f"{sid}.",
            "garbage",
        ]
        for forged in forged_values:
            resp = post(url, {name: forged})
            assert resp.status_code == 200
            got = resp.json()["session_id"]
            assert got not in (sid, victim), forged
            assert resp.json()["count"] == 1
            assert resp.cookies[name] != forged  # a fresh, validly signed cookie is issued instead
        # The genuine cookie still works.
        assert post(url, {name: value}).json() == {"session_id": sid, "count": 2}


def test_cookie_of_another_instance_is_not_this_instances_session(no_env_secret: None) -> None:
    with serve_app(make_app("env_one")) as one, serve_app(make_app("env_two")) as two:
        one_cookie = post(one).cookies[cookie_name_for("env_one")]
        # Same process, same secret: even the right signature under another name is not a session here.
        resp = post(two, {cookie_name_for("env_one"): one_cookie})
        assert resp.json()["count"] == 1
        assert cookie_name_for("env_two") in resp.cookies


def test_signing_secret_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    name = cookie_name_for("shared")
    monkeypatch.setenv(NEMO_GYM_SESSION_SECRET_ENV_VAR_NAME, "run-secret-1")
    app_a, app_b = make_app("shared"), make_app("shared")
    monkeypatch.setenv(NEMO_GYM_SESSION_SECRET_ENV_VAR_NAME, "run-secret-2")
    app_c = make_app("shared")
    with serve_app(app_a) as a, serve_app(app_b) as b, serve_app(app_c) as c:
        first = post(a)
        cookie = first.cookies[name]
        sid = first.json()["session_id"]
        # Another process of the same run (same secret) accepts the cookie ...
        assert post(b, {name: cookie}).json()["session_id"] == sid
        # ... a server of another run (another secret) does not.
        assert post(c, {name: cookie}).json()["session_id"] != sid


def test_without_the_environment_the_secret_is_random_per_process() -> None:
    env = {k: v for k, v in os.environ.items() if k != NEMO_GYM_SESSION_SECRET_ENV_VAR_NAME}
    code = "from nemo_gym.server.asgi.sessions import session_secret as s; a, b = s(), s(); print(a.hex(), b.hex(), len(a))"
    outs = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        first, second, length = done.stdout.split()
        assert first == second  # stable within a process: every server app of it agrees
        assert int(length) >= 32
        outs.append(first)
    assert outs[0] != outs[1]
