"""Authentication between servers, cookies bound to their instance, per-child config, body limits.

Every test talks real HTTP to servers started through ``RunHelper`` (or ``ng_run`` as a subprocess).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil
import pytest
import yaml

from nemo_gym.auth import (
    AUTH_TOKEN_ENV_VAR_NAME,
    TOKEN_HEADER_NAME,
    RequestGuard,
    rollout_credential,
    token_file_for,
)
from nemo_gym.redaction import REDACTED
from nemo_gym.tools.testing import example_rows, post_json, running_servers, server_url
from resources_servers.example_single_tool_call.app import weather_for, weather_report
from tests.conftest import EXAMPLE_CONFIG, EXAMPLE_CONFIG_PATHS, get_json

AGENT = "example_single_tool_call_simple_agent"
RESOURCES = "example_single_tool_call"
SESSION_CONFIG = "resources_servers/example_session_state_mgmt/configs/example_session_state_mgmt.yaml"
MODEL_SECRET_MARKER = "only-the-model-may-see-this-7d1f"
TOP_LEVEL_SECRET = "sk-top-level-secret-5e2a"
JUDGE_KEY = "sk-judge-key-only-the-judge-sees-91c3"
LAUNCHER_SECRET_VAR = "SOME_SERVICE_API_KEY"
LAUNCHER_SECRET = "launcher-exported-secret-2b7e"


def _raw_post(url: str, body: Any, headers: dict[str, str] | None = None, **kwargs: Any) -> httpx.Response:
    """POST JSON with exactly ``headers`` (no run token unless given)."""
    return httpx.post(
        url,
        content=orjson.dumps(body),
        headers={"content-type": "application/json", **(headers or {})},
        timeout=30,
        trust_env=False,
        **kwargs,
    )


@pytest.fixture(scope="module")
def run() -> Iterator[Any]:
    extra = {
        "policy_model": {
            "responses_api_models": {
                "scripted_model": {
                    "scripts_by_input": [{"contains": MODEL_SECRET_MARKER, "turns": [{"text": "ok"}]}]
                }
            }
        },
        "policy_api_key": TOP_LEVEL_SECRET,
        # A second model server holding an API key of its own (it is never called here).
        "judge_model": {
            "responses_api_models": {
                "openai_model": {
                    "entrypoint": "app.py",
                    "openai_base_url": "http://127.0.0.1:9/v1",
                    "openai_api_key": JUDGE_KEY,
                    "openai_model": "judge-model-name",
                }
            }
        },
        "experiment_label": "visible-to-every-server",
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(LAUNCHER_SECRET_VAR, LAUNCHER_SECRET)  # exported in the launcher: reaches no server
        with running_servers([EXAMPLE_CONFIG], extra) as helper:
            yield helper


def _fabricated_verify_body() -> dict[str, Any]:
    row = example_rows(RESOURCES)[0]
    city = row["expected_city"]
    response = {
        "id": "resp_fake",
        "object": "response",
        "created_at": 0,
        "model": "x",
        "status": "completed",
        "output": [
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "c1",
                "name": "get_weather",
                "arguments": orjson.dumps({"city": city}).decode(),
                "status": "completed",
            },
            {
                "type": "function_call_output",
                "call_id": "c1",
                "output": orjson.dumps({"city": city, "weather": weather_for(city)}).decode(),
            },
            {
                "type": "message",
                "id": "m1",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": weather_report(city), "annotations": []}],
            },
        ],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    }
    return {**row, "response": response}


def test_every_server_and_the_head_server_refuse_requests_without_the_run_token(run: Any) -> None:
    urls = [run.head_server_config.base_url] + [row["url"] for row in run.server_instances()]
    assert len(urls) == 5
    for url in urls:
        for path in ("/", "/openapi.json"):
            resp = httpx.get(url + path, timeout=10, trust_env=False)
            assert resp.status_code == 401, (url, path, resp.text)
            assert resp.json()["error"]["kind"] == "unauthorized"
            wrong = httpx.get(
                url + path, timeout=10, trust_env=False, headers={"Authorization": "Bearer nope"}
            )
            assert wrong.status_code == 401
    head = run.head_server_config.base_url
    assert httpx.get(head + "/global_config_dict_yaml", timeout=10, trust_env=False).status_code == 401
    assert httpx.get(head + "/server_instances", timeout=10, trust_env=False).status_code == 401


def test_the_run_token_is_accepted_in_any_of_its_headers(run: Any) -> None:
    token = run.supervisor.auth_token
    assert token
    url = server_url(run, RESOURCES)
    assert (
        httpx.get(url + "/", headers={"Authorization": f"Bearer {token}"}, trust_env=False).status_code == 200
    )
    assert httpx.get(url + "/", headers={TOKEN_HEADER_NAME: token}, trust_env=False).status_code == 200
    # Anthropic's clients send their key as x-api-key (a harness with the run token as ANTHROPIC_API_KEY).
    assert httpx.get(url + "/", headers={"x-api-key": token}, trust_env=False).status_code == 200
    assert httpx.get(url + "/", headers={"x-api-key": token + "x"}, trust_env=False).status_code == 401


def test_a_fabricated_trajectory_cannot_be_verified_without_the_token(run: Any) -> None:
    url = server_url(run, RESOURCES) + "/verify"
    body = _fabricated_verify_body()
    refused = _raw_post(url, body)
    assert refused.status_code == 401
    assert "reward" not in refused.text
    # The same body with the token is verified (so the 401 above is the token's doing, nothing else).
    allowed = _raw_post(url, body, {"Authorization": f"Bearer {run.supervisor.auth_token}"})
    assert allowed.status_code == 200, allowed.text
    assert allowed.json()["reward"] == 1.0


def test_the_model_server_is_no_open_proxy(run: Any) -> None:
    url = server_url(run, "policy_model")
    params = {"input": "hello"}
    assert _raw_post(url + "/v1/responses", params).status_code == 401
    assert (
        _raw_post(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}).status_code
        == 401
    )


def test_the_openai_sdk_reaches_a_model_server_with_the_run_token_as_api_key(run: Any) -> None:
    from openai import AuthenticationError, OpenAI

    base = server_url(run, "policy_model") + "/v1"
    good = OpenAI(base_url=base, api_key=run.supervisor.auth_token, max_retries=0)
    answer = good.responses.create(model="scripted", input=f"say {MODEL_SECRET_MARKER}")
    assert answer.output_text == "ok"
    bad = OpenAI(base_url=base, api_key="sk-wrong", max_retries=0)
    with pytest.raises(AuthenticationError):
        bad.responses.create(model="scripted", input="hello")


def test_a_rollout_through_the_python_api_needs_nothing_from_the_user(run: Any) -> None:
    # post_json finds the token of the run this process started: what RunHelper users get.
    resp = post_json(server_url(run, AGENT) + "/run", example_rows(RESOURCES)[0])
    assert resp.status_code == 200, resp.text
    assert resp.json()["reward"] in (0.0, 1.0)


def _child_environ(run: Any, name: str) -> dict[str, str]:
    """The environment the server process ``name`` was started with, as the kernel holds it."""
    pid = next(r["pid"] for r in run.server_instances() if r["name"] == name)
    return psutil.Process(pid).environ()


def _child_config(run: Any, name: str) -> dict[str, Any]:
    """The config server ``name`` was handed (in its private launch file, nemo_gym.launch)."""
    return yaml.safe_load(run.supervisor.launch_values[name]["NEMO_GYM_CONFIG_DICT"])


def test_each_child_sees_its_own_secrets_and_no_other_servers_secrets(run: Any) -> None:
    agent_cfg = _child_config(run, AGENT)
    judge_cfg = _child_config(run, "judge_model")
    # The judge's API key reaches the judge and nobody else; its other settings stay readable (an
    # environment may read its judge's model name), and every server has every address.
    own_judge = judge_cfg["judge_model"]["responses_api_models"]["openai_model"]
    assert own_judge["openai_api_key"] == JUDGE_KEY
    seen_judge = agent_cfg["judge_model"]["responses_api_models"]["openai_model"]
    assert seen_judge["openai_model"] == "judge-model-name"
    assert seen_judge["openai_api_key"] == REDACTED
    judge_port = next(r["port"] for r in run.server_instances() if r["name"] == "judge_model")
    assert seen_judge["port"] == judge_port and seen_judge["host"] == "127.0.0.1"
    # The agent's own block is whole and resolved.
    own = agent_cfg[AGENT]["responses_api_agents"]["simple_agent"]
    assert own["resources_server"]["name"] == RESOURCES and own["model_server"]["name"] == "policy_model"
    # The whole process environment (the config, the secret values it scrubs, inherited variables):
    # a secret-looking top-level value and the launcher's exported secret reach no child, another
    # server's key reaches no child, an ordinary value reaches all.
    for name in (AGENT, RESOURCES, "policy_model", "judge_model"):
        handed = run.supervisor.launch_values[name]
        text = "\n".join(f"{k}={v}" for k, v in handed.items())
        assert TOP_LEVEL_SECRET not in text, name
        assert LAUNCHER_SECRET not in text, name
        assert "visible-to-every-server" in handed["NEMO_GYM_CONFIG_DICT"], name
        assert (JUDGE_KEY in text) == (name == "judge_model"), name
        assert run.supervisor.auth_token in handed["NEMO_GYM_SECRET_VALUES"], name
        # Its environment holds none of it: nothing the server starts inherits a secret or the config.
        environ = _child_environ(run, name)
        whole = "\n".join(f"{k}={v}" for k, v in environ.items())
        assert LAUNCHER_SECRET_VAR not in environ and LAUNCHER_SECRET not in whole, name
        assert JUDGE_KEY not in whole and TOP_LEVEL_SECRET not in whole, name
        assert run.supervisor.auth_token not in whole and "visible-to-every-server" not in whole, name
        for var in (
            "NEMO_GYM_CONFIG_DICT",
            "NEMO_GYM_AUTH_TOKEN",
            "NEMO_GYM_SESSION_SECRET",
            "NEMO_GYM_SECRET_VALUES",
        ):
            assert var not in environ, (name, var)
        # The launch file it was started with was read once and removed.
        assert not Path(environ["NEMO_GYM_LAUNCH_FILE"]).exists(), name


def test_a_session_cookie_is_accepted_only_by_the_instance_that_signed_it() -> None:
    extra = {
        "second_counter": {"resources_servers": {"example_session_state_mgmt": {"entrypoint": "app.py"}}},
    }
    with running_servers([SESSION_CONFIG], extra) as run:
        first, second = server_url(run, "example_session_state_mgmt"), server_url(run, "second_counter")
        token = run.supervisor.auth_token
        headers = {"Authorization": f"Bearer {token}", "content-type": "application/json"}
        with httpx.Client(trust_env=False, timeout=10, headers=headers) as client:
            seeded = client.post(first + "/seed_session", content=b'{"initial_count": 0}')
            assert seeded.status_code == 200, seeded.text
            first_cookie = seeded.cookies["ng_session_example_session_state_mgmt"]
            # The same instance recognises its own cookie: no new session is minted.
            again = client.post(
                first + "/seed_session",
                content=b'{"initial_count": 0}',
                headers={"cookie": f"ng_session_example_session_state_mgmt={first_cookie}"},
            )
            assert again.cookies["ng_session_example_session_state_mgmt"] == first_cookie
            # Replayed to the other instance under that instance's cookie name, it is not accepted:
            # the other instance mints a session of its own.
            replay = client.post(
                second + "/seed_session",
                content=b'{"initial_count": 0}',
                headers={"cookie": f"ng_session_second_counter={first_cookie}"},
            )
            assert replay.status_code == 200, replay.text
            minted = replay.cookies.get("ng_session_second_counter")
            assert minted is not None and minted.split(".")[0] != first_cookie.split(".")[0]


def test_server_auth_can_be_switched_off_loudly(capfd: pytest.CaptureFixture[str]) -> None:
    with running_servers([EXAMPLE_CONFIG], {"server_auth": False}) as run:
        out = capfd.readouterr().out
        assert "server authentication is OFF" in out
        url = server_url(run, RESOURCES)
        assert httpx.get(url + "/", timeout=10, trust_env=False).status_code == 200
        assert run.supervisor.token_file is None


def test_ng_run_writes_a_private_token_file_that_a_collector_in_another_process_uses(
    launch: Any, tmp_path: Any
) -> None:
    run_dir = tmp_path / "runs"
    env = {"NEMO_GYM_RUN_DIR": str(run_dir)}
    env_without_token = {k: "" for k in (AUTH_TOKEN_ENV_VAR_NAME,)}
    server = launch(EXAMPLE_CONFIG_PATHS, "++head_server.port=0", env={**env, **env_without_token})
    server.wait_ready()
    head_port = int(server.head_url.rsplit(":", 1)[1])
    os.environ["NEMO_GYM_RUN_DIR"] = str(run_dir)
    try:
        token_path = token_file_for(head_port)
    finally:
        del os.environ["NEMO_GYM_RUN_DIR"]
    assert token_path.parent == run_dir
    assert stat.S_IMODE(token_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    token = token_path.read_text().strip()  # the whole file is the token: TOKEN=$(cat FILE) works
    assert int(token_path.with_suffix(".pid").read_text()) == server.proc.pid
    line = server.wait_for_line(r"^Run token: ", 10)
    assert line is not None and str(token_path) in line, server.output
    assert token not in server.output  # the token itself is never printed
    get_json(server.head_url + "/server_instances", token=token)

    out = tmp_path / "rollouts.jsonl"
    collector = launch(
        f"+agent_name={AGENT}",
        f"+input_jsonl_fpath=resources_servers/{RESOURCES}/data/example.jsonl",
        f"+output_jsonl_fpath={out}",
        f"+head_server.port={head_port}",
        cmd="ng_collect_rollouts",
        env={**env, **env_without_token},
    )
    assert collector.wait_exit(120) == 0, collector.output
    assert len(out.read_text().splitlines()) == 5

    # A collector holding a wrong token is refused with a message that says what to do.
    wrong = launch(
        f"+agent_name={AGENT}",
        f"+input_jsonl_fpath=resources_servers/{RESOURCES}/data/example.jsonl",
        f"+output_jsonl_fpath={tmp_path / 'wrong.jsonl'}",
        f"+head_server.port={head_port}",
        cmd="ng_collect_rollouts",
        env={**env, AUTH_TOKEN_ENV_VAR_NAME: "not-the-token"},
    )
    assert wrong.wait_exit(60) not in (0, None)
    assert "run token" in wrong.output and AUTH_TOKEN_ENV_VAR_NAME in wrong.output
    assert not (tmp_path / "wrong.jsonl").exists()

    server.send_signal(2)
    assert server.wait_exit(20) == 0, server.output
    assert not token_path.exists() and not token_path.with_suffix(".pid").exists()


async def test_a_server_hosted_outside_ng_run_serves_loopback_clients_only_without_a_token() -> None:
    """What verifiers' taskset does: build a server object in its own process, no token configured."""
    from nemo_gym.server_utils import BaseRunServerInstanceConfig, BaseServer, ServerClient

    assert not os.environ.get(AUTH_TOKEN_ENV_VAR_NAME)
    server = BaseServer(
        config=BaseRunServerInstanceConfig(name="hosted"), server_client=ServerClient(global_config_dict={})
    )
    app = server.setup_webserver()
    cases = (("127.0.0.1", 200), ("::1", 200), ("testclient", 200), ("192.0.2.7", 401), ("10.1.2.3", 401))
    for client_host, expected in cases:
        transport = httpx.ASGITransport(app=app, client=(client_host, 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://hosted") as client:
            resp = await client.get("/")
        assert resp.status_code == expected, (client_host, resp.text)
        if expected == 401:
            assert "loopback clients only" in resp.json()["error"]["message"]
    # starlette's TestClient (what upstream environments' own tests use) is an in-process client.
    from fastapi.testclient import TestClient

    assert TestClient(app).get("/").status_code == 200


async def test_the_guard_checks_the_token_in_constant_form_and_ignores_other_headers() -> None:
    async def ok_app(scope: dict, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    guard = RequestGuard(ok_app, server_name="s", token="t0k3n")
    transport = httpx.ASGITransport(app=guard, client=("127.0.0.1", 1))
    async with httpx.AsyncClient(transport=transport, base_url="http://s") as client:
        assert (await client.get("/", headers={"Authorization": "Bearer t0k3n"})).status_code == 200
        assert (await client.get("/", headers={"Authorization": "t0k3n"})).status_code == 401
        assert (await client.get("/", headers={"X-Other": "Bearer t0k3n"})).status_code == 401
        # A loopback client gets no pass when a token is configured.
        assert (await client.get("/")).status_code == 401


# ------------------------------------------------------------------------------------------------
# Request body limit.


@pytest.fixture(scope="module")
def limited() -> Iterator[Any]:
    extra = {
        "max_request_body_bytes": 3_000_000,  # top level: every server
        RESOURCES: {"resources_servers": {RESOURCES: {"max_request_body_bytes": 1_000_000}}},  # per server
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(LAUNCHER_SECRET_VAR, LAUNCHER_SECRET)  # exported in the launcher: reaches no server
        with running_servers([EXAMPLE_CONFIG], extra) as helper:
            yield helper


def _padded_row(size: int) -> dict[str, Any]:
    return {**example_rows(RESOURCES)[0], "padding": "x" * size}


def test_a_body_over_the_limit_is_a_413_naming_the_setting(limited: Any) -> None:
    resp = post_json(server_url(limited, AGENT) + "/run", _padded_row(4_000_000))
    assert resp.status_code == 413, resp.text[:500]
    error = resp.json()["error"]
    assert error["kind"] == "request_too_large" and error["server"] == AGENT
    assert "max_request_body_bytes" in error["message"] and "3000000" in error["message"]
    # Under the limit the same row runs.
    assert post_json(server_url(limited, AGENT) + "/run", _padded_row(1000)).status_code == 200


def test_a_per_server_limit_beats_the_top_level_one(limited: Any) -> None:
    body = _padded_row(2_000_000)  # under the agent's 3 MB, over the resources server's 1 MB
    direct = post_json(server_url(limited, RESOURCES) + "/seed_session", body)
    assert direct.status_code == 413 and "1000000" in direct.json()["error"]["message"]
    # Through the agent: the agent accepts it, the resources server refuses it, and the rollout fails
    # naming the inner server (never a reward).
    through = post_json(server_url(limited, AGENT) + "/run", body)
    assert through.status_code == 502, through.text[:500]
    inner = through.json()["error"]["inner"]
    assert inner["server"] == RESOURCES and inner["status"] == 413


def test_a_chunked_body_is_cut_off_at_the_limit(limited: Any) -> None:
    sent = 0

    def chunks() -> Iterator[bytes]:
        nonlocal sent
        yield b'{"padding": "'
        for _ in range(400):  # up to 20 MB, far past the 3 MB limit
            sent += 50_000
            yield b"y" * 50_000
        yield b'"}'

    headers = {"content-type": "application/json", "Authorization": f"Bearer {limited.supervisor.auth_token}"}
    resp = httpx.post(
        server_url(limited, AGENT) + "/run", content=chunks(), headers=headers, timeout=60, trust_env=False
    )
    assert "content-length" not in resp.request.headers  # really streamed in chunks
    assert resp.status_code == 413, resp.text[:500]
    assert "max_request_body_bytes" in resp.json()["error"]["message"]
    # The server stays healthy and serves the next request.
    assert post_json(server_url(limited, AGENT) + "/run", _padded_row(10)).status_code == 200


def test_the_default_limit_refuses_a_50_mb_body() -> None:
    with running_servers([EXAMPLE_CONFIG]) as run:
        resp = post_json(server_url(run, AGENT) + "/run", _padded_row(50 * 1024 * 1024))
        assert resp.status_code == 413, resp.text[:500]
        assert str(32 * 1024 * 1024) in resp.json()["error"]["message"]


def test_a_new_run_removes_token_files_of_runs_that_are_gone(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nemo_gym.auth import read_token_file, write_token_file

    monkeypatch.setenv("NEMO_GYM_RUN_DIR", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for port, token, pid in ((1111, "stale-token", dead.pid), (2222, "live-token", os.getpid())):
        (tmp_path / f"head-{port}.token").write_text(token + "\n")
        (tmp_path / f"head-{port}.pid").write_text(f"{pid}\n")  # 1111's run was SIGKILLed
    (tmp_path / "head-3333.token").write_text("no-pid-file\n")  # not ours to judge: kept
    path = write_token_file(4444, "new-token")
    assert read_token_file(path) == "new-token" and path.read_text() == "new-token\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert int(path.with_suffix(".pid").read_text()) == os.getpid()
    assert sorted(p.name for p in tmp_path.glob("head-*")) == [
        "head-2222.pid",
        "head-2222.token",
        "head-3333.token",
        "head-4444.pid",
        "head-4444.token",
    ]


def test_a_rollout_credential_opens_its_own_rollouts_model_calls_and_nothing_else(run: Any) -> None:
    """What a harness holds instead of the run token (nemo_gym.auth.rollout_credential)."""
    token = run.supervisor.auth_token
    model, resources = server_url(run, "policy_model"), server_url(run, RESOURCES)
    head = f"http://127.0.0.1:{run.head_server_config.port}"
    body = orjson.dumps({"input": "hello"})

    def post(url: str, credential: str, header: str = "authorization") -> int:
        value = f"Bearer {credential}" if header == "authorization" else credential
        headers = {header: value, "content-type": "application/json"}
        return httpx.post(url, content=body, headers=headers, timeout=30, trust_env=False).status_code

    mine = rollout_credential(token, "r-1.a")
    assert post(f"{model}/ng-rollout/r-1.a/v1/responses", mine) == 200
    assert post(f"{model}/ng-rollout/r-1.a/v1/responses", mine, header="x-api-key") == 200  # Anthropic's way
    # Through the token-capture segment too: past the door (this run does not serve the capture path: 404).
    assert post(f"{model}/ng-rollout/r-1.a/training-token-capture/v1/responses", mine) == 404
    for url in (
        f"{model}/ng-rollout/r-2/v1/responses",  # another rollout's calls
        f"{model}/v1/responses",  # calls of no rollout
        f"{model}/ng-rollout/r-1.a/policy_version",  # not a model call
        f"{model}/ng-rollout/r-1.a/ng_model_calls/pop",  # the recorded calls of the rollout
        f"{resources}/ng-rollout/r-1.a/seed_session",  # the environment
        f"{resources}/ng-rollout/r-1.a/verify",
        f"{head}/ng-rollout/r-1.a/v1/responses",  # the head server takes no rollout credential at all
        f"{head}/server_instances",
    ):
        assert post(url, mine) == 401, url
    forged = mine[:-4] + ("AAAA" if not mine.endswith("AAAA") else "BBBB")
    assert post(f"{model}/ng-rollout/r-1.a/v1/responses", forged) == 401
    other_run = rollout_credential("another run's token", "r-1.a")
    assert post(f"{model}/ng-rollout/r-1.a/v1/responses", other_run) == 401
    refused = httpx.post(
        f"{model}/v1/responses",
        content=body,
        headers={"authorization": f"Bearer {mine}"},
        timeout=30,
        trust_env=False,
    )
    assert (
        "opens only its own rollout's model calls (/ng-rollout/r-1.a/v1/...)"
        in refused.json()["error"]["message"]
    )
