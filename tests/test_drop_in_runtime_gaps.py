"""Runtime gaps that made upstream NeMo Gym environments' own test suites fail here: module paths upstream
added later, and behaviour their tests rely on. Servers run under real uvicorn on 127.0.0.1."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from pydantic import BaseModel

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseSeedSessionRequest,
    BaseSeedSessionResponse,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)
from nemo_gym.judge import JudgeError, call_judge
from nemo_gym.openai_utils import NeMoGymResponse
from nemo_gym.server_utils import SESSION_ID_KEY, ServerClient
from tests.conftest import serve_app

BOUND_S = 30.0
STUB = {"responses_create_params": {"input": "hi"}, "response": {"output": []}}


# --- nemo_gym.mcp_auto_exposure -------------------------------------------------------------------------


class CityRequest(BaseModel):
    city: str


class WeatherServer(SimpleResourcesServer):
    """Written as upstream's example_mcp_weather: a plain tool route, state keyed by the session id."""

    config: BaseResourcesServerConfig
    calls: dict[str, list[str]] = {}

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/get_weather")(self.get_weather)
        return app

    async def seed_session(self, request: Request, body: BaseSeedSessionRequest) -> BaseSeedSessionResponse:
        self.calls[request.session[SESSION_ID_KEY]] = []
        return BaseSeedSessionResponse()

    async def get_weather(self, request: Request, body: CityRequest) -> dict[str, str]:
        self.calls.setdefault(request.session[SESSION_ID_KEY], []).append(body.city)
        return {"weather": f"sunny in {body.city}"}

    async def verify(self, request: Request, body: BaseVerifyRequest) -> BaseVerifyResponse:
        seen = self.calls.get(request.session[SESSION_ID_KEY], [])
        return BaseVerifyResponse(**body.model_dump(), reward=float(seen == ["Paris"]))


def _weather_server(name: str, expose: bool) -> WeatherServer:
    config = BaseResourcesServerConfig(name=name, host="127.0.0.1", port=0, expose_tools_over_mcp=expose)
    return WeatherServer(config=config, server_client=ServerClient(global_config_dict={}))


async def _call_weather_over_mcp(url: str, headers: dict[str, str]) -> tuple[list[str], str]:
    pytest.importorskip("mcp", reason="the `mcp` extra is not installed")
    import httpx2
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    async with httpx2.AsyncClient(headers=headers, timeout=BOUND_S) as http:
        async with streamable_http_client(url, http_client=http) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                names = sorted(t.name for t in (await session.list_tools()).tools)
                result = await session.call_tool("get_weather", {"city": "Paris"})
                assert not result.is_error, result
                return names, result.content[0].text


def test_maybe_auto_expose_serves_an_upstream_style_server_once_and_binds_the_session() -> None:
    pytest.importorskip("mcp", reason="the `mcp` extra is not installed")
    from nemo_gym.mcp_auto_exposure import MCP_URL_PATH, TOKEN_HEADER, maybe_auto_expose

    server = _weather_server("weather_env", expose=True)
    app = server.setup_webserver()
    # Upstream's tests and launch code call it after setup_webserver; calling it again changes nothing.
    assert maybe_auto_expose(server, app) is True
    assert maybe_auto_expose(server, app) is True
    assert [getattr(r, "path", None) for r in app.router.routes].count(MCP_URL_PATH) == 1

    with serve_app(app, lifespan="on") as base:
        seeded = httpx.post(base + "/seed_session", json=STUB, timeout=BOUND_S, trust_env=False)
        assert seeded.status_code == 200, seeded.text
        meta = seeded.json()["mcp"]
        assert meta["server_name"] == "weather_env" and meta["url_path"] == MCP_URL_PATH
        assert TOKEN_HEADER == "X-NeMo-Gym-Session-Token" and TOKEN_HEADER in meta["headers"]
        names, text = asyncio.run(
            asyncio.wait_for(_call_weather_over_mcp(base + meta["url_path"], meta["headers"]), BOUND_S)
        )
        assert names == ["get_weather"]
        assert text == '{"weather":"sunny in Paris"}'
        verify = httpx.post(
            base + "/verify", json=STUB, cookies=seeded.cookies, timeout=BOUND_S, trust_env=False
        )
        assert verify.status_code == 200 and verify.json()["reward"] == 1.0  # the MCP call hit this session


def test_maybe_auto_expose_without_the_flag_serves_nothing() -> None:
    from nemo_gym.mcp_auto_exposure import MCP_URL_PATH, maybe_auto_expose

    server = _weather_server("plain_env", expose=False)
    app = server.setup_webserver()
    assert maybe_auto_expose(server, app) is False
    with serve_app(app, lifespan="on") as base:
        resp = httpx.post(base + MCP_URL_PATH, json={}, timeout=BOUND_S, trust_env=False)
        assert resp.status_code == 404


def test_maybe_auto_expose_refuses_an_app_that_routes_mcp_itself() -> None:
    from nemo_gym.mcp_auto_exposure import maybe_auto_expose

    server = _weather_server("own_mcp_env", expose=False)
    app = server.setup_webserver()
    app.post("/mcp")(lambda: {"mine": True})
    server.config.expose_tools_over_mcp = True
    with pytest.raises(ValueError, match=r"'own_mcp_env' already routes /mcp"):
        maybe_auto_expose(server, app)


# --- nemo_gym.judge ---------------------------------------------------------------------------------------


class _RaisingClient:
    """A client whose ``post`` raises what upstream's environment tests make their mocks raise."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc
        self.calls = 0

    async def post(self, **kwargs: Any) -> Any:
        self.calls += 1
        raise self.exc


async def test_any_exception_from_the_client_post_is_a_judge_error_chained_to_it() -> None:
    client = _RaisingClient(RuntimeError("judge timeout"))
    with pytest.raises(JudgeError, match="RuntimeError: judge timeout") as failure:
        await asyncio.wait_for(
            call_judge(
                client,
                server_name="judge_model",
                url_path="/v1/responses",
                json={"input": "x"},
                response_model=NeMoGymResponse,
            ),
            BOUND_S,
        )
    assert isinstance(failure.value.__cause__, RuntimeError)
    assert failure.value.server == "judge_model" and failure.value.path == "/v1/responses"
    assert client.calls == 1  # not a transient status: not retried


# --- NeMoGymResponse fields as the SDK's Response has them ---------------------------------------------


class SeenStatusVerifyResponse(BaseVerifyResponse):
    seen_status: str


class TruncationAwareServer(SimpleResourcesServer):
    """Reads the response the way upstream environments do: attributes of the SDK's sub-objects."""

    config: BaseResourcesServerConfig

    async def verify(self, body: BaseVerifyRequest) -> SeenStatusVerifyResponse:
        details = body.response.incomplete_details
        truncated = getattr(details, "reason", None) == "max_output_tokens"
        failed = getattr(body.response.error, "message", None)
        return SeenStatusVerifyResponse(
            **body.model_dump(),
            reward=0.0 if truncated or failed else 1.0,
            seen_status=body.response.status or "unset",
        )


def test_verify_reads_incomplete_details_and_error_as_attributes_and_status_stays_unset() -> None:

    server = TruncationAwareServer(
        config=BaseResourcesServerConfig(name="truncation_env", host="127.0.0.1", port=0),
        server_client=ServerClient(global_config_dict={}),
    )
    base_response = {"id": "r", "created_at": 0, "model": "m", "object": "response", "output": []}
    with serve_app(server.setup_webserver()) as base:

        def verify(**response: Any) -> dict[str, Any]:
            body = {"responses_create_params": {"input": "hi"}, "response": {**base_response, **response}}
            resp = httpx.post(base + "/verify", json=body, timeout=BOUND_S, trust_env=False)
            assert resp.status_code == 200, resp.text
            return resp.json()

        truncated = verify(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
        assert truncated["reward"] == 0.0 and truncated["seen_status"] == "incomplete"
        assert truncated["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
        failed = verify(status="failed", error={"code": "server_error", "message": "boom"})
        assert failed["reward"] == 0.0 and failed["response"]["error"] == {
            "code": "server_error",
            "message": "boom",
        }
        # A response without a status (some model servers leave it out) keeps it unset, as the SDK does:
        # re-verifying a recorded rollout must not invent "completed".
        plain = verify()
        assert (
            plain["reward"] == 1.0 and plain["seen_status"] == "unset" and plain["response"]["status"] is None
        )


def test_response_sub_objects_also_answer_dict_style_reads() -> None:
    response = NeMoGymResponse.model_validate(
        {"output": [], "incomplete_details": {"reason": "max_output_tokens", "message": "n_ctx 4096"}}
    )
    details = response.incomplete_details
    assert details is not None and details.reason == details["reason"] == "max_output_tokens"
    assert details.get("message") == "n_ctx 4096" and "message" in details and details.get("x") is None
    with pytest.raises(KeyError):
        details["x"]


# --- nemo_gym.sandbox: upstream's provider names, config resolution and spec fields ---------------------


def test_sandbox_provider_blocks_resolve_by_name_or_inline_and_errors_name_the_problem() -> None:
    from omegaconf import OmegaConf

    from nemo_gym.sandbox import resolve_provider_config, resolve_provider_metadata

    merged = OmegaConf.create(
        {
            "sandbox": {"docker": {"host": "${host}"}, "default_metadata": {"team": "rl"}},
            "host": "unix:///d.sock",
            "two": {"a": {}, "b": {}},
        }
    )
    assert resolve_provider_config("sandbox", merged) == {"docker": {"host": "unix:///d.sock"}}
    assert resolve_provider_metadata("sandbox", merged) == {"team": "rl"}
    assert resolve_provider_config({"local": {"x": 1}}) == {"local": {"x": 1}}
    assert resolve_provider_metadata({"local": {"x": 1}}) == {}
    with pytest.raises(ValueError, match=r"'sandbx' is not a top-level block.*found: 'sandbox'"):
        resolve_provider_config("sandbx", merged)
    with pytest.raises(ValueError, match=r"exactly one provider key.*\['a', 'b'\]"):
        resolve_provider_config("two", merged)
    with pytest.raises(TypeError, match="got int"):
        resolve_provider_config(3, merged)  # type: ignore[arg-type]


def test_an_upstream_style_spec_is_accepted_and_refused_only_by_the_workdir_backends_at_start() -> None:
    from nemo_gym.sandbox import AsyncSandbox, SandboxSpec, SandboxUnavailableError

    spec = SandboxSpec(
        image="python:3.12",
        ttl_s=600,
        ready_timeout_s=60,
        workdir="/app",
        provider_options={"x": 1},
        ports=[8080],
    )
    assert spec.resources.memory_mib == 512 and spec.workdir == "/app"
    with pytest.raises(SandboxUnavailableError, match=r"image='python:3.12', ports=\[8080\]"):
        asyncio.run(AsyncSandbox(provider={"backend": UNSAFE}, spec=spec).start())
    with pytest.raises(ValueError, match="must be relative"):
        asyncio.run(
            AsyncSandbox(provider={"backend": UNSAFE}, spec=SandboxSpec(files={"/etc/x": "y"})).start()
        )
    with pytest.raises(ValueError, match="ports"):
        SandboxSpec(ports=[0])
    with pytest.raises(ValueError, match=r"'docker' is not registered here.*built-in backends"):
        AsyncSandbox(provider={"docker": {}})


UNSAFE = "unsafe_local_subprocess"


class _InMemoryProvider:
    """An outside provider as upstream environments write one: files in memory, programs run locally."""

    name = "in_memory_test_provider"
    made: list[_InMemoryProvider] = []

    def __init__(self, greeting: str = "hi") -> None:
        from nemo_gym.sandbox import SandboxHandle

        self.handle_cls = SandboxHandle
        self.greeting = greeting
        self.files: dict[str, str] = {}
        self.calls: list[tuple[str, Any]] = []
        _InMemoryProvider.made.append(self)

    async def create(self, spec: Any) -> Any:
        self.calls.append(("create", spec.image))
        return self.handle_cls(sandbox_id="sb-1", provider_name=self.name, raw=None)

    async def upload_file(self, handle: Any, source_path: Any, target_path: str) -> None:
        self.files[target_path] = source_path.read_text()

    async def download_file(self, handle: Any, source_path: str, target_path: Any) -> None:
        target_path.write_text(self.files[source_path])

    async def exec(self, handle: Any, command: str, *, cwd=None, env=None, timeout_s=None, user=None) -> Any:
        from nemo_gym.sandbox import SandboxExecResult

        self.calls.append(("exec", (command, cwd, env, timeout_s, user)))
        return SandboxExecResult(
            stdout=f"{self.greeting} {self.files.get(command.split()[-1], '')}", stderr="", return_code=0
        )

    async def status(self, handle: Any) -> Any:
        from nemo_gym.sandbox import SandboxStatus

        return SandboxStatus.RUNNING

    async def close(self, handle: Any) -> None:
        self.calls.append(("close", handle.sandbox_id))

    async def aclose(self) -> None:
        self.calls.append(("aclose", None))


def test_a_registered_outside_provider_runs_the_sandbox_the_upstream_way() -> None:
    from nemo_gym.sandbox import AsyncSandbox, SandboxSpec, SandboxStatus, list_providers, register_provider

    if _InMemoryProvider.name not in list_providers():
        register_provider(_InMemoryProvider.name, _InMemoryProvider)
    register_provider(_InMemoryProvider.name, _InMemoryProvider)  # the same class again: fine
    with pytest.raises(ValueError, match="already registered"):
        register_provider(_InMemoryProvider.name, dict)
    with pytest.raises(ValueError, match="reserved"):
        register_provider("bubblewrap", _InMemoryProvider)

    async def session() -> tuple[Any, Any, bytes]:
        spec = SandboxSpec(image="img:1", files={"/opt/run.py": "print(1)"})
        sandbox = await AsyncSandbox({_InMemoryProvider.name: {"greeting": "hello"}}, spec).start()
        try:
            result = await sandbox.exec("python3 /opt/run.py", env={"A": "1"}, timeout_s=5, user="agent")
            status = await sandbox.status()
            await sandbox.write_file("/opt/out.txt", "done")
            back = await sandbox.read_file("/opt/out.txt")
        finally:
            await sandbox.stop()
            await sandbox.stop()  # twice: closes once
        return result, status, back

    result, status, back = asyncio.run(asyncio.wait_for(session(), BOUND_S))
    provider = _InMemoryProvider.made[-1]
    assert result.stdout == "hello print(1)" and status == SandboxStatus.RUNNING and back == b"done"
    assert provider.calls == [
        ("create", "img:1"),
        ("exec", ("python3 /opt/run.py", None, {"A": "1"}, 5, "agent")),  # no workdir set: cwd None
        ("close", "sb-1"),
        ("aclose", None),
    ]


def test_an_upstream_config_may_name_the_instance_server_type() -> None:
    from pydantic import ValidationError

    config = BaseResourcesServerConfig(type="resources_servers", name="x", host="127.0.0.1", port=1)
    assert config.type == "resources_servers"
    with pytest.raises(ValidationError, match="type"):
        BaseResourcesServerConfig(type="resource_servers", name="x")
    with pytest.raises(ValidationError, match="typo_key"):
        BaseResourcesServerConfig(typo_key=1, name="x")


# --- nemo_gym.responses_converter ----------------------------------------------------------------------


def test_responses_converter_maps_tool_turns_both_ways_with_upstreams_method_names() -> None:
    from nemo_gym.openai_utils import NeMoGymResponseCreateParamsNonStreaming
    from nemo_gym.responses_converter import ResponsesConverter

    converter = ResponsesConverter(return_token_id_information=False)
    params = NeMoGymResponseCreateParamsNonStreaming(
        model="m",
        instructions="be brief",
        max_output_tokens=64,
        input=[
            {"role": "user", "content": "weather?"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
        tools=[{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
    )
    chat = converter.responses_to_chat_completion_create_params(params)
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "tool"]
    assert chat.messages[2]["tool_calls"][0]["id"] == chat.messages[3]["tool_call_id"] == "c1"
    assert chat.max_completion_tokens == 64 and chat.model == "m"
    assert chat.tools[0]["function"]["name"] == "get_weather"

    items = converter.chat_completions_messages_to_responses_items(chat.messages[1:])
    assert [type(i).__name__ for i in items] == [
        "NeMoGymEasyInputMessage",
        "NeMoGymResponseFunctionToolCall",
        "NeMoGymFunctionCallOutput",
    ]
    completion = {
        "id": "x",
        "model": "m",
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": "<think>hmm</think>It is sunny."},
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
    }
    response = converter.chat_completion_to_response(params, completion)
    assert response.output_text == "It is sunny." and response.output[0].type == "reasoning"
    assert response.usage.input_tokens == 5 and response.status == "completed"
    assert converter._wrap_reasoning_in_think_tags(["a", "", "b"]) == "<think>a</think><think>b</think>"
    with pytest.raises(ValueError, match="'robot'"):
        converter.chat_completions_messages_to_responses_items([{"role": "robot", "content": "x"}])


class _AnsweringClient:
    """A client whose ``post`` answers HTTP 200 with ``body`` (what upstream's judge tests mock)."""

    def __init__(self, body: bytes) -> None:
        self.body = body

    async def post(self, **kwargs: Any) -> Any:
        body = self.body

        class _Answer:
            status = 200
            ok = True

            async def read(self) -> bytes:
                return body

        return _Answer()


async def test_a_judge_answer_without_output_is_not_a_response() -> None:
    with pytest.raises(JudgeError, match=r"not a NeMoGymResponse.*output.*Field required"):
        await call_judge(
            _AnsweringClient(b"{}"),
            server_name="judge_model",
            url_path="/v1/responses",
            json={"input": "x"},
            response_model=NeMoGymResponse,
        )
    empty = await call_judge(
        _AnsweringClient(b'{"output": []}'),
        server_name="judge_model",
        url_path="/v1/responses",
        json={"input": "x"},
        response_model=NeMoGymResponse,
    )
    assert empty.output == [] and empty.status is None


# --- upstream's top-level benchmarks package ---------------------------------------------------------


def test_a_benchmark_folder_next_to_the_environments_imports_as_benchmarks_dot_name(tmp_path: Any) -> None:
    """Upstream environments import ``benchmarks.<name>`` from their project's root. A user who copies
    such a folder to the root of their project gets that import without any package of ours: the root is
    on the path of every server ``ng_run`` starts, and ``benchmarks/`` is a namespace package (upstream's
    folders have no ``__init__.py``). This repository's own top level stays as it is."""
    import subprocess
    import sys

    (tmp_path / "benchmarks" / "demo_bench").mkdir(parents=True)
    (tmp_path / "benchmarks" / "demo_bench" / "prepare.py").write_text("UPSTREAM_SHA = 'abc'\n")
    code = "from benchmarks.demo_bench import prepare; print(prepare.UPSTREAM_SHA)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)},
    )
    assert out.returncode == 0 and out.stdout.strip() == "abc", out.stderr


# --- /run answers that mark themselves as not a result (upstream's _ng_failure_class & co) -------------


def _marking_agent() -> FastAPI:
    """An agent whose /run answers as upstream agents and judge_failsafe verifiers do, per the row's mode."""
    app = FastAPI()
    runs: list[str] = []

    @app.post("/run")
    async def run(request: Request) -> dict[str, Any]:
        row = await request.json()
        runs.append(row["mode"])
        answer = {**row, "response": {"output": []}, "reward": 0.0}
        if row["mode"] == "ok":
            answer["reward"] = 1.0
        elif row["mode"] in ("judge_down", "terminal"):
            answer["_ng_failure_class"] = "judge_failed"
            answer["_ng_failure_judge_error"] = "judge timeout"
            answer["_ng_failure_terminal"] = row["mode"] == "terminal"
        elif row["mode"] == "killed":
            answer["_ng_no_persist"] = True
        elif row["mode"].startswith("masked"):
            # NeMo Gym 0.7's way: the verify response says its reward is no measurement.
            from nemo_gym.base_resources_server import BaseVerifyResponse

            labels = {"failure_kind": "provider_unavailable", "failure_reason": "sandbox pool down"}
            verdict = BaseVerifyResponse(
                responses_create_params=row["responses_create_params"],
                response={"id": "r", "created_at": 0, "model": "m", "object": "response", "output": []},
                reward=0.0,
                mask_sample=True,
                **(labels if row["mode"] == "masked" else {}),
            )
            answer = {**row, **verdict.model_dump(mode="json")}
        return answer

    app.state.runs = runs
    return app


def test_run_answers_with_a_failure_class_go_to_the_failures_file_and_no_persist_nowhere(
    tmp_path: Any,
) -> None:
    import orjson

    from nemo_gym.client.server_client import close_shared_session
    from nemo_gym.collection.collector import collect_rollouts
    from nemo_gym.collection.output_files import sidecar_paths
    from nemo_gym.rollout_collection import RolloutCollectionConfig

    modes = ["ok", "judge_down", "terminal", "killed", "masked", "masked_plain"]
    rows = [{"responses_create_params": {"input": "hi"}, "mode": m} for m in modes]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    out = tmp_path / "rollouts.jsonl"
    side = sidecar_paths(out)
    app = _marking_agent()

    def collect(resume: bool) -> dict[str, Any]:
        cfg = RolloutCollectionConfig(
            input_jsonl_fpath=str(tasks),
            output_jsonl_fpath=str(out),
            agent_name="marking_agent",
            resume_from_cache=resume,
            progress=False,
        )

        async def go() -> dict[str, Any]:
            try:
                return await collect_rollouts(cfg, client)
            finally:
                await close_shared_session()

        return asyncio.run(asyncio.wait_for(go(), BOUND_S))

    with serve_app(app) as base:
        port = int(base.rsplit(":", 1)[1])
        client = ServerClient(
            global_config_dict={
                "marking_agent": {"responses_api_agents": {"marking": {"host": "127.0.0.1", "port": port}}}
            }
        )
        summary = collect(resume=False)
        written = [orjson.loads(line) for line in out.read_bytes().splitlines()]
        failures = [orjson.loads(line) for line in side["failures"].read_bytes().splitlines()]
        assert [r["mode"] for r in written] == ["ok"]  # the judge outage is not a reward of 0
        assert sorted((f["_ng_task_index"], f["kind"], f["attempt"]) for f in failures) == [
            (1, "judge_failed", 1),
            (2, "judge_failed", 1),
            (4, "provider_unavailable", 1),
            (5, "masked_sample", 1),
        ]
        assert "judge timeout" in failures[0]["error"]
        masked = next(f for f in failures if f["_ng_task_index"] == 4)
        assert "sandbox pool down" in masked["error"]
        assert [
            f.get("_ng_failure_terminal", False) for f in sorted(failures, key=lambda f: f["_ng_task_index"])
        ] == [False, True, False, False]
        assert summary["not_persisted"] == 1 and summary["this_run"]["failed"] == 4
        assert summary["rollouts_missing"] == 5

        # Resume: the retryable failure and the unpersisted rollout run again; the terminal one never does.
        app.state.runs.clear()
        summary = collect(resume=True)
        assert sorted(app.state.runs) == ["judge_down", "killed", "masked", "masked_plain"]
        assert summary["skipped_after_max_attempts"] == 1


def test_an_explicit_start_inside_async_with_is_upstreams_pattern_and_starts_once() -> None:
    from nemo_gym.sandbox import AsyncSandbox, SandboxSpec, list_providers, register_provider

    if _InMemoryProvider.name not in list_providers():
        register_provider(_InMemoryProvider.name, _InMemoryProvider)

    async def upstream_pattern(provider: Any, command: str) -> str:
        async with AsyncSandbox(provider, SandboxSpec(files={"run.py": "x"})) as sandbox:
            await sandbox.start()  # upstream's __aenter__ does not start; ours did already: a no-op
            result = await sandbox.exec(command)
            with pytest.raises(RuntimeError, match="already started"):
                await sandbox.start()
            return result.stdout

    assert asyncio.run(asyncio.wait_for(upstream_pattern({"backend": UNSAFE}, "cat run.py"), BOUND_S)) == "x"
    out = asyncio.run(
        asyncio.wait_for(upstream_pattern({_InMemoryProvider.name: {}}, "python3 run.py"), BOUND_S)
    )
    assert out == "hi x"
    assert [c[0] for c in _InMemoryProvider.made[-1].calls] == ["create", "exec", "close", "aclose"]
