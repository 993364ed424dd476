"""Secrets never leave a process: not in HTTP responses, log lines, nor output files.

A secret is planted in every shape a config holds one (an ``extra_headers`` value, a password in a
URL, ``private_key``, ``wandb_key``, ``aws_access_key_id``, ``credentials``, and an ``env.yaml`` value
under an innocent key, ``policy_base_url``, holding a key in its ``api-key`` query parameter). Real ``ng_run`` with a probe server
that prints its config at start and puts every value into its errors, the real simple agent and
openai_model (pointed at a dead port so it fails), ``ng_collect_rollouts`` and ``ng_dump_config``;
then every HTTP answer, every line of output and every file written is searched for each secret.
"""

from __future__ import annotations

import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from nemo_gym.auth import auth_headers
from nemo_gym.redaction import REDACTED
from nemo_gym.tools.testing import post_json, refusing_port, running_servers, server_url
from tests.conftest import READY_WAIT_S, REPO, LaunchedProcess, Launcher, get_json, write_server_folder

PROBE_APP = """
import logging

from fastapi import Request
from fastapi.responses import JSONResponse

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)

logger = logging.getLogger("secret_probe")


class ProbeConfig(BaseResourcesServerConfig):
    extra_headers: dict[str, str]
    db_url: str
    private_key: str
    wandb_key: str
    aws_access_key_id: str
    credentials: dict[str, str]
    upstream_url: str


class ProbeServer(SimpleResourcesServer):
    config: ProbeConfig

    def _everything(self) -> str:
        c = self.config
        return " | ".join(
            [*c.extra_headers.values(), c.db_url, c.private_key, c.wandb_key, c.aws_access_key_id,
             *c.credentials.values(), c.upstream_url]
        )

    async def on_startup(self) -> None:
        print("secret_probe config:", self.config.model_dump_json(), flush=True)
        logger.warning("secret_probe connecting with %s", self._everything())

    def setup_webserver(self):
        app = super().setup_webserver()
        app.post("/leak_raw")(self.leak_raw)
        return app

    async def seed_session(self, request: Request, body: dict) -> dict:
        raise RuntimeError("cannot seed with " + self._everything())

    async def leak_raw(self) -> JSONResponse:
        # A server author's own error body, built by hand.
        return JSONResponse({"error": "backend down", "tried": self._everything()}, status_code=503)

    async def verify(self, body: BaseVerifyRequest) -> BaseVerifyResponse:
        return BaseVerifyResponse(**body.model_dump(), reward=1.0)


if __name__ == "__main__":
    ProbeServer.run_webserver()
"""

PROBE = "secret_probe"
AGENT = "secret_probe_agent"


class Planted:
    """The secrets of one test run, each unique, and the files that plant them."""

    def __init__(self, root: Path) -> None:
        tag = uuid.uuid4().hex[:12]
        self.root = root
        self.secrets = {
            "extra_headers value": f"org-HEADERVAL-{tag}",
            "openai_model extra_headers value": f"org-MODELHEADER-{tag}",
            "URL password": f"URLPASS-{tag}",
            "private_key": f"PRIVKEY-{tag}",
            "wandb_key": f"WANDBKEY-{tag}",
            "aws_access_key_id": f"AKIA{tag.upper()}",
            "credentials": f"CREDPIN-{tag}",
            "env.yaml policy_base_url api-key parameter": f"ENVTOKEN-{tag}",
            "env.yaml policy_api_key": f"sk-ENVKEY-{tag}",
        }
        s = self.secrets
        (root / "env.yaml").write_text(
            textwrap.dedent(f"""\
                policy_base_url: http://127.0.0.1:{refusing_port()}/v1?api-key={s["env.yaml policy_base_url api-key parameter"]}
                policy_api_key: {s["env.yaml policy_api_key"]}
                policy_model_name: probe-model
            """)
        )
        write_server_folder(root, "resources_servers", PROBE, PROBE_APP)
        self.config = root / "configs" / "secret_probe.yaml"
        self.config.parent.mkdir(parents=True, exist_ok=True)
        self.config.write_text(
            textwrap.dedent(f"""\
                {PROBE}:
                  resources_servers:
                    {PROBE}:
                      entrypoint: app.py
                      extra_headers: {{X-Org-Id: {s["extra_headers value"]}}}
                      db_url: postgresql://probe:{s["URL password"]}@db.internal:5432/tasks
                      private_key: {s["private_key"]}
                      wandb_key: {s["wandb_key"]}
                      aws_access_key_id: {s["aws_access_key_id"]}
                      credentials: {{username: probe, pin: {s["credentials"]}}}
                      upstream_url: ${{policy_base_url}}
                {AGENT}:
                  responses_api_agents:
                    simple_agent:
                      entrypoint: app.py
                      resources_server: {{type: resources_servers, name: {PROBE}}}
                      model_server: {{type: responses_api_models, name: policy_model}}
                policy_model:
                  responses_api_models:
                    openai_model:
                      max_retries: 1
                      backoff_s: 0
                      extra_headers: {{OpenAI-Organization: {s["openai_model extra_headers value"]}}}
            """)
        )
        self.config_paths = f"+config_paths=[{REPO}/responses_api_models/openai_model/configs/openai_model.yaml,{self.config}]"

    def leaks(self, text: str) -> list[str]:
        """The names of the planted secrets that appear in ``text``."""
        return [name for name, value in self.secrets.items() if value in text]


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Planted:
    return Planted(tmp_path_factory.mktemp("secrets"))


@pytest.fixture(scope="module")
def secret_run(planted: Planted, launch_module: Launcher) -> Iterator[LaunchedProcess]:
    run = launch_module(
        planted.config_paths, "+head_server.port=0", f"+log_dir={planted.root / 'logs'}", cwd=planted.root
    )
    run.wait_ready()
    assert run.wait_for_line(r"^\[secret_probe\] secret_probe config:", 10) is not None, run.output
    yield run


def _url(run: LaunchedProcess, name: str) -> str:
    rows = get_json(run.head_url + "/server_instances", token=run.token)
    return next(r["url"] for r in rows if r["name"] == name)


def test_head_server_config_hides_every_shape(secret_run: LaunchedProcess, planted: Planted) -> None:
    resp = httpx.get(
        secret_run.head_url + "/global_config_dict_yaml",
        timeout=10,
        trust_env=False,
        headers=auth_headers(secret_run.token),
    )
    assert resp.status_code == 200, resp.text
    text = resp.text
    assert planted.leaks(text) == [], text
    assert REDACTED in text
    # What clients need is still there.
    assert "port:" in text and PROBE in text and "postgresql://probe:" in text


def test_error_bodies_hide_every_shape(secret_run: LaunchedProcess, planted: Planted) -> None:
    probe = _url(secret_run, PROBE)
    answers = {
        "probe /seed_session (unhandled error, 500)": post_json(
            probe + "/seed_session", {}, token=secret_run.token
        ),
        "probe /leak_raw (hand-built 503)": post_json(probe + "/leak_raw", {}, token=secret_run.token),
        "agent /run (inner 500 -> 502)": post_json(
            _url(secret_run, AGENT) + "/run",
            {"responses_create_params": {"input": [{"role": "user", "content": "hi"}]}},
            token=secret_run.token,
        ),
        "openai_model /v1/responses (endpoint unreachable, 502)": post_json(
            _url(secret_run, "policy_model") + "/v1/responses", {"input": "hi"}, token=secret_run.token
        ),
    }
    for what, resp in answers.items():
        assert resp.status_code >= 500, (what, resp.status_code, resp.text)
        assert planted.leaks(resp.text) == [], f"{what}: {resp.text}"
        assert REDACTED in resp.text, (
            f"{what}: nothing was scrubbed, so the probe did not put secrets in: {resp.text}"
        )
        assert int(resp.headers["content-length"]) == len(resp.content)


def test_collector_files_and_output_hide_every_shape(
    secret_run: LaunchedProcess, planted: Planted, launch: Launcher
) -> None:
    rows = planted.root / "rows.jsonl"
    rows.write_bytes(
        b"\n".join(
            orjson.dumps({"responses_create_params": {"input": [{"role": "user", "content": f"task {i}"}]}})
            for i in range(3)
        )
        + b"\n"
    )
    out = planted.root / "out" / "rollouts.jsonl"
    port = secret_run.head_url.rsplit(":", 1)[1]
    collect = launch(
        f"+agent_name={AGENT}", f"+input_jsonl_fpath={rows}", f"+output_jsonl_fpath={out}",
        f"+head_server.port={port}", "+progress=false", cmd="ng_collect_rollouts", cwd=planted.root,
    )  # fmt: skip
    assert collect.wait_exit(READY_WAIT_S) == 1, collect.output  # every rollout failed
    failures = (out.parent / "rollouts_failures.jsonl").read_text()
    assert len(failures.splitlines()) == 3 and REDACTED in failures, failures
    for path in sorted(out.parent.iterdir()):
        assert planted.leaks(path.read_text()) == [], f"{path}:\n{path.read_text()}"
    assert planted.leaks(collect.output) == [], collect.output


def test_ng_dump_config_hides_every_shape(planted: Planted, launch: Launcher) -> None:
    dump = launch(planted.config_paths, cmd="ng_dump_config", cwd=planted.root)
    assert dump.wait_exit(READY_WAIT_S) == 0, dump.output
    assert REDACTED in dump.stdout
    assert planted.leaks(dump.output) == [], dump.output


def test_ng_run_output_and_log_files_hide_every_shape(secret_run: LaunchedProcess, planted: Planted) -> None:
    # After the other tests, the output holds the probe's start-up print and warning, the traceback
    # of its failing /seed_session and openai_model's retry warning.
    assert secret_run.wait_for_line(r"RuntimeError: cannot seed with", 10) is not None, secret_run.output
    assert secret_run.wait_for_line(r"secret_probe connecting with", 10) is not None, secret_run.output
    assert planted.leaks(secret_run.output) == [], secret_run.output
    assert REDACTED in secret_run.output
    logs = sorted((planted.root / "logs").glob("*.log"))
    assert {p.stem for p in logs} == {PROBE, AGENT, "policy_model"}
    for path in logs:
        assert planted.leaks(path.read_text()) == [], f"{path}:\n{path.read_text()}"


# ------------------------------------------------------------------------------------------------
# The collector scrubs with what it knows itself (its env.yaml), even when the agent did not.

ECHO_AGENT_APP = """
from fastapi import Request
from fastapi.responses import Response

from nemo_gym.base_responses_api_agent import BaseResponsesAPIAgentConfig, SimpleResponsesAPIAgent


class EchoFailAgent(SimpleResponsesAPIAgent):
    config: BaseResponsesAPIAgentConfig

    async def responses(self, request: Request) -> Response:
        return Response(b"{}", media_type="application/json")

    async def run(self, request: Request) -> Response:
        row = await request.json()
        return Response(("backend refused note " + row["note"]).encode(), status_code=500)


if __name__ == "__main__":
    EchoFailAgent.run_webserver()
"""


def test_collector_scrubs_failures_with_its_own_env_yaml(
    tmp_path: Path, launch: Launcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = f"ROWTOKEN-{uuid.uuid4().hex}"
    write_server_folder(tmp_path, "responses_api_agents", "echo_fail_agent", ECHO_AGENT_APP)
    (tmp_path / "env.yaml").write_text(f"dataset_access_token: {token}\n")
    rows = tmp_path / "rows.jsonl"
    row = {"responses_create_params": {"input": "hi"}, "note": token}
    rows.write_bytes(orjson.dumps(row) + b"\n")
    out = tmp_path / "out.jsonl"
    agent = {"echo_agent": {"responses_api_agents": {"echo_fail_agent": {"entrypoint": "app.py"}}}}
    monkeypatch.chdir(tmp_path)  # the server folder is found under the working directory
    with running_servers([], extra_config=agent, with_scripted_model=False) as helper:
        # The agent itself knows nothing of the token: its error body carries it.
        direct = post_json(server_url(helper, "echo_agent") + "/run", row)
        assert direct.status_code == 500 and token in direct.text
        collect = launch(
            "+agent_name=echo_agent", f"+input_jsonl_fpath={rows}", f"+output_jsonl_fpath={out}",
            f"+head_server.port={helper.head_server_config.port}", "+progress=false",
            cmd="ng_collect_rollouts", cwd=tmp_path,
        )  # fmt: skip
        assert collect.wait_exit(READY_WAIT_S) == 1, collect.output
    failures = (tmp_path / "out_failures.jsonl").read_text()
    assert "backend refused note" in failures and REDACTED in failures, failures
    assert token not in failures
