"""Each server of a run holds only its own secrets, the rollouts file holds none, and what is not a
secret (an endpoint's URL, a model name) stays readable in error messages.

A real ``ng_run`` (example_single_tool_call + simple_agent + openai_model) with ``env.yaml`` holding
the model's API key and the launcher's environment exporting ``OPENAI_API_KEY``. openai_model talks to
a small local endpoint that echoes the ``Authorization`` header it got into its answer (as a careless
or hostile upstream might) and refuses inputs that say "reject" with the key in its error message.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from nemo_gym.auth import auth_headers
from nemo_gym.redaction import REDACTED
from tests.conftest import EXAMPLE_CONFIG, READY_WAIT_S, REPO, LaunchedProcess, Launcher, get_json

TAG = uuid.uuid4().hex[:12]
MODEL_KEY = f"sk-envyaml-model-key-{TAG}"  # env.yaml policy_api_key: the model server's alone
EXPORTED_KEY = f"sk-exported-{TAG}"  # OPENAI_API_KEY in the launcher's environment
MODEL_NAME = f"echo-model-{TAG}"
AGENT = "example_single_tool_call_simple_agent"
RESOURCES = "example_single_tool_call"


class _EchoUpstream(BaseHTTPRequestHandler):
    """POST /v1/responses: a Responses answer quoting the Authorization header; 401 for "reject"."""

    seen_authorization: list[str] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        auth = self.headers.get("authorization") or ""
        type(self).seen_authorization.append(auth)
        if b"reject" in body:
            status, answer = (
                401,
                {"error": {"message": f"Incorrect API key provided: {auth}", "type": "auth"}},
            )
        else:
            status, answer = 200, _response(f"I was called with '{auth}'.")
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def _response(text: str) -> dict[str, Any]:
    return {
        "id": "resp_echo",
        "object": "response",
        "created_at": 0,
        "model": MODEL_NAME,
        "status": "completed",
        "output": [
            {
                "type": "message",
                "id": "msg_echo",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        ],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": {
            "input_tokens": 3,
            "output_tokens": 5,
            "total_tokens": 8,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        },
    }


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _EchoUpstream)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory, upstream: str) -> Path:
    root = tmp_path_factory.mktemp("isolation")
    (root / "env.yaml").write_text(
        f"policy_base_url: {upstream}\npolicy_api_key: {MODEL_KEY}\npolicy_model_name: {MODEL_NAME}\n"
    )
    return root


@pytest.fixture(scope="module")
def run(root: Path, launch_module: Launcher) -> LaunchedProcess:
    launched = launch_module(
        f"+config_paths=[{REPO / EXAMPLE_CONFIG},{REPO}/responses_api_models/openai_model/configs/openai_model.yaml]",
        "+head_server.port=0",
        "++policy_model.responses_api_models.openai_model.max_retries=0",
        # The model server asks for the exported variable by name; no other server gets it.
        "++policy_model.responses_api_models.openai_model.pass_env=[OPENAI_API_KEY]",
        cwd=root,
        env={"OPENAI_API_KEY": EXPORTED_KEY},
    )
    launched.wait_ready()
    return launched


def _rows(run: LaunchedProcess) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in get_json(run.head_url + "/server_instances", token=run.token)}


def _environ(pid: int) -> dict[str, str]:
    """The environment the process was started with, as the kernel holds it."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw.split(b"\0") if item)


def test_a_server_sees_neither_another_servers_key_nor_the_launchers_secret_variables(
    run: LaunchedProcess,
) -> None:
    rows = _rows(run)
    for name in (RESOURCES, AGENT):
        env = _environ(rows[name]["pid"])
        whole = "\0".join(f"{k}={v}" for k, v in env.items())
        assert MODEL_KEY not in whole, f"{name} holds the model server's API key"
        assert EXPORTED_KEY not in whole and "OPENAI_API_KEY" not in env, f"{name} got OPENAI_API_KEY"
        # Its config and the run's secrets came in its private launch file (nemo_gym.launch), read once
        # and removed: none of it is in its environment, so nothing it starts inherits them.
        assert run.token not in whole and env["PATH"], name
        for var in ("NEMO_GYM_CONFIG_DICT", "NEMO_GYM_AUTH_TOKEN", "NEMO_GYM_SESSION_SECRET"):
            assert var not in env, (name, var)
        assert not Path(env["NEMO_GYM_LAUNCH_FILE"]).exists(), name
    model_env = _environ(rows["policy_model"]["pid"])
    assert MODEL_KEY not in "\0".join(
        model_env.values()
    )  # its own key too: in its config, not its environment
    assert model_env["OPENAI_API_KEY"] == EXPORTED_KEY  # named in its pass_env


def test_an_error_names_the_endpoint_and_hides_the_key(run: LaunchedProcess, upstream: str) -> None:
    url = _rows(run)["policy_model"]["url"] + "/v1/responses"
    resp = httpx.post(
        url, json={"input": "reject me"}, headers=auth_headers(run.token), timeout=30, trust_env=False
    )
    assert resp.status_code == 401, resp.text
    message = resp.json()["error"]["message"]
    assert f"{upstream}/responses rejected the API key" in message, message
    assert "Incorrect API key provided" in message and MODEL_KEY not in resp.text


def test_a_model_answer_echoing_the_key_is_scrubbed_from_the_rollouts_file(
    run: LaunchedProcess, root: Path, launch: Launcher
) -> None:
    rows = root / "rows.jsonl"
    row = (REPO / "resources_servers/example_single_tool_call/data/example.jsonl").read_text().splitlines()[0]
    rows.write_text(row + "\n")
    out = root / "out" / "rollouts.jsonl"
    port = run.head_url.rsplit(":", 1)[1]
    collect = launch(
        f"+agent_name={AGENT}", f"+input_jsonl_fpath={rows}", f"+output_jsonl_fpath={out}",
        f"+head_server.port={port}", "+progress=false", cmd="ng_collect_rollouts", cwd=root,
    )  # fmt: skip
    assert collect.wait_exit(READY_WAIT_S) == 0, collect.output
    assert f"Bearer {MODEL_KEY}" in _EchoUpstream.seen_authorization  # so the answer did carry the key
    text = out.read_text()
    assert MODEL_KEY not in text, text
    line = orjson.loads(text.splitlines()[0])
    assert line["response"]["output"][-1]["content"][0]["text"] == f"I was called with 'Bearer {REDACTED}'."
    for path in sorted(out.parent.iterdir()):
        assert MODEL_KEY not in path.read_text(), path
