"""Prometheus metrics (nemo_gym.server.metrics): ``GET /metrics`` of real servers, the head server's scrape
targets, ``+metrics_enabled=false``, bounded labels, and the event-loop lag catching a blocking verifier.

Servers: example_single_tool_call + simple_agent + the scripted model, started by ``RunHelper`` (real
processes, real HTTP on 127.0.0.1); the blocking verifier is a small resources server served by uvicorn
in this process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import Body, FastAPI, Request
from fastapi.responses import Response

from nemo_gym.auth import auth_headers, client_token_for_url
from nemo_gym.kit.verify_pool import VerifyTimeoutError, run_in_verify_pool
from nemo_gym.openai_utils import NeMoGymResponseCreateParamsNonStreaming
from nemo_gym.run.cli import RunHelper
from nemo_gym.sandbox import run_in_sandbox
from nemo_gym.server.base import ServerClient
from nemo_gym.server.metrics.discovery import prometheus_targets
from nemo_gym.server.metrics.middleware import error_kind, usage_of, usage_tokens
from nemo_gym.server.model import BaseResponsesAPIModelConfig, ModelAnswer, SimpleResponsesAPIModel
from nemo_gym.server.resources import (
    BaseResourcesServerConfig,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)
from nemo_gym.tools.testing import (
    example_rows,
    post_json,
    run_rollout,
    running_servers,
    scrape,
    server_url,
)
from nemo_gym.tools.testing import metric_value as value
from tests.conftest import serve_app

EXAMPLE_CONFIG = "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml"
AGENT = "example_single_tool_call_simple_agent"
RESOURCES = "example_single_tool_call"
MODEL = "policy_model"


@pytest.fixture(scope="module")
def stack() -> Iterator[RunHelper]:
    with running_servers([EXAMPLE_CONFIG]) as helper:
        yield helper


@pytest.fixture(scope="module")
def after_rollouts(stack: RunHelper) -> dict[str, Any]:
    """Three rollouts through the agent; the number of get_weather calls they made."""
    rows = example_rows("example_single_tool_call")[:3]
    results = [run_rollout(stack, AGENT, row) for row in rows]
    tool_calls = sum(
        1 for r in results for item in r["response"]["output"] if item.get("type") == "function_call"
    )
    return {"rows": rows, "results": results, "tool_calls": tool_calls}


def test_every_server_counts_requests_latency_and_loop_lag(stack: RunHelper, after_rollouts: dict) -> None:
    time.sleep(0.3)  # a few event-loop ticks
    for name in (AGENT, RESOURCES, MODEL):
        m = scrape(server_url(stack, name))
        assert value(m, "nemo_gym_http_requests_total") > 0, name
        assert value(m, "nemo_gym_http_request_duration_seconds_count") > 0, name
        assert value(m, "nemo_gym_event_loop_lag_seconds_count") > 0, name
        assert value(m, "process_resident_memory_bytes") > 0, name
        assert value(m, "process_cpu_seconds_total") > 0, name
        assert value(m, "process_open_fds") > 0, name
        assert value(m, "nemo_gym_http_requests_in_flight") >= 1  # this scrape
    head = scrape(_head_url(stack))
    assert value(head, "nemo_gym_event_loop_lag_seconds_count") > 0


def _head_url(helper: RunHelper) -> str:
    cfg = helper.head_server_config
    return f"http://{cfg.host}:{cfg.port}"


def test_per_kind_metrics_after_rollouts(stack: RunHelper, after_rollouts: dict) -> None:
    n = len(after_rollouts["rows"])
    agent = scrape(server_url(stack, AGENT))
    assert value(agent, "nemo_gym_rollouts_started_total") == n
    assert value(agent, "nemo_gym_rollouts_finished_total") == n
    assert value(agent, "nemo_gym_http_requests_total", method="POST", route="/run", status="200") == n
    assert value(agent, "nemo_gym_agent_turns_count") == n
    assert value(agent, "nemo_gym_agent_turns_sum") >= n
    assert value(agent, "nemo_gym_agent_tool_calls_sum") == after_rollouts["tool_calls"]

    resources = scrape(server_url(stack, RESOURCES))
    assert value(resources, "nemo_gym_verify_duration_seconds_count") == n
    assert value(resources, "nemo_gym_verify_reward_count") == n
    rewards = sum(r["reward"] for r in after_rollouts["results"])
    assert value(resources, "nemo_gym_verify_reward_sum") == pytest.approx(rewards)
    assert (
        value(resources, "nemo_gym_tool_calls_total", tool="get_weather", outcome="ok")
        == (after_rollouts["tool_calls"])
    )
    assert value(resources, "nemo_gym_open_sessions") == 0  # every seeded session was verified

    model = scrape(server_url(stack, MODEL))
    calls = value(model, "nemo_gym_model_calls_total", endpoint="/v1/responses", outcome="ok")
    assert calls == value(agent, "nemo_gym_agent_turns_sum")
    assert value(model, "nemo_gym_model_generation_duration_seconds_count") == calls
    prompt = value(model, "nemo_gym_model_prompt_tokens_total", endpoint="/v1/responses")
    completion = value(model, "nemo_gym_model_completion_tokens_total", endpoint="/v1/responses")
    usage = [r["response"]["usage"] for r in after_rollouts["results"]]
    assert prompt == sum(u["input_tokens"] for u in usage) > 0
    assert completion == sum(u["output_tokens"] for u in usage) > 0


def test_open_sessions_count_seeded_but_not_verified(stack: RunHelper) -> None:
    url = server_url(stack, RESOURCES)
    before = value(scrape(url), "nemo_gym_open_sessions")
    row = example_rows("example_single_tool_call")[0]
    assert post_json(url + "/seed_session", row).status_code == 200
    assert value(scrape(url), "nemo_gym_open_sessions") == before + 1


def test_route_labels_are_bounded_and_errors_counted_by_kind(stack: RunHelper) -> None:
    url = server_url(stack, RESOURCES)
    for i in range(20):
        assert (
            httpx.get(f"{url}/no/such/path/{i}", headers=auth_headers(client_token_for_url(url))).status_code
            == 404
        )
    assert post_json(url + "/get_weather", {"city": 5}).status_code == 422
    assert httpx.get(url + "/metrics", headers=auth_headers("wrong"), trust_env=False).status_code == 401
    m = scrape(url)
    routes = {ls["route"] for ls, _ in m["nemo_gym_http_requests_total"]}
    assert not any("/no/such" in r for r in routes)
    assert value(m, "nemo_gym_http_requests_total", route="unmatched", status="404") >= 20
    assert value(m, "nemo_gym_http_errors_total", route="unmatched", kind="no_envelope") >= 20
    assert value(m, "nemo_gym_http_errors_total", route="/get_weather", kind="validation_error") >= 1
    assert value(m, "nemo_gym_tool_calls_total", tool="get_weather", outcome="error") >= 1
    assert value(m, "nemo_gym_http_errors_total", route="/metrics", kind="unauthorized") >= 1
    # No label value carries a session id or a path with an id in it.
    for samples in m.values():
        for labels, _ in samples:
            for v in labels.values():
                assert "ng_session" not in v and len(v) < 64, labels


def test_metrics_need_the_run_token(stack: RunHelper) -> None:
    for url in (server_url(stack, RESOURCES), _head_url(stack)):
        assert httpx.get(url + "/metrics", trust_env=False, timeout=10).status_code == 401


def test_a_server_layer_answers_metrics_without_a_route_in_the_router() -> None:
    """/metrics is answered by the server's ASGI layer, so the app's router (matched route by route for
    every request) has no route for it; the answer is counted like any other."""
    app = _blocking_app("layer_metrics")
    assert "/metrics" not in [getattr(r, "path", None) for r in app.router.routes]
    with serve_app(app) as url:
        headers = auth_headers(client_token_for_url(url))
        got = httpx.get(url + "/metrics", headers=headers, trust_env=False)
        assert got.status_code == 200 and got.headers["content-type"].startswith("text/plain")
        head = httpx.head(url + "/metrics", headers=headers, trust_env=False)
        assert head.status_code == 200 and head.content == b""
        post = httpx.post(url + "/metrics", headers=headers, trust_env=False)
        assert post.status_code == 405 and post.headers["allow"] == "GET"
        m = scrape(url)
    assert value(m, "nemo_gym_http_requests_total", route="/metrics", status="200") == 2
    assert value(m, "nemo_gym_http_requests_total", route="/metrics", status="405") == 1


def test_head_serves_prometheus_http_sd_targets(stack: RunHelper) -> None:
    url = _head_url(stack)
    resp = httpx.get(
        url + "/prometheus_targets", headers=auth_headers(client_token_for_url(url)), trust_env=False
    )
    assert resp.status_code == 200
    entries = resp.json()
    by_name = {e["labels"]["instance_name"]: e for e in entries}
    assert set(by_name) == {"head_server", AGENT, RESOURCES, MODEL}
    port = stack.head_server_config.port
    assert by_name["head_server"]["targets"] == [f"127.0.0.1:{port}"]
    for row in stack.server_instances():
        entry = by_name[row["name"]]
        assert entry["targets"] == [f"{row['host']}:{row['port']}"]
        assert entry["labels"]["server_type"] == row["server_type"]
        assert all(isinstance(v, str) for v in entry["labels"].values())
        scrape(row["url"])  # every target answers /metrics


def test_targets_list_each_replica() -> None:
    rows = [
        {"name": "m", "server_type": "responses_api_models", "impl": "x", "host": "0.0.0.0", "port": 1},
        {"name": "r", "server_type": "resources_servers", "impl": "y", "host": "10.0.0.2", "port": 2, "replica": 0, "node": "n1"},
        {"name": "r", "server_type": "resources_servers", "impl": "y", "host": "10.0.0.3", "port": 3, "replica": 1, "node": None},
        {"name": "r", "server_type": "resources_servers", "impl": "y", "host": None, "port": None, "replica": 2},
    ]  # fmt: skip
    out = prometheus_targets(rows, "127.0.0.1", 11000)
    assert [e["targets"] for e in out] == [
        ["127.0.0.1:11000"],
        ["127.0.0.1:1"],
        ["10.0.0.2:2"],
        ["10.0.0.3:3"],
    ]
    assert out[2]["labels"] == {
        "instance_name": "r", "server_type": "resources_servers", "impl": "y", "replica": "0", "node": "n1",
    }  # fmt: skip
    assert out[3]["labels"]["replica"] == "1" and "node" not in out[3]["labels"]


def test_metrics_enabled_false_installs_nothing() -> None:
    with running_servers([EXAMPLE_CONFIG], {"metrics_enabled": False}) as helper:
        for url in [server_url(helper, n) for n in (AGENT, RESOURCES, MODEL)] + [_head_url(helper)]:
            headers = auth_headers(client_token_for_url(url))
            assert httpx.get(url + "/metrics", headers=headers, trust_env=False).status_code == 404, url
        head = _head_url(helper)
        headers = auth_headers(client_token_for_url(head))
        assert httpx.get(head + "/prometheus_targets", headers=headers, trust_env=False).status_code == 404
        run_rollout(helper, AGENT, example_rows("example_single_tool_call")[0])  # still works


# ------------------------------------------------------------------------------------------------
# Parsing helpers.


def test_usage_tokens_reads_the_last_usage_object() -> None:
    assert usage_tokens(b'{"output":[{"usage":"text"}],"usage":{"input_tokens":7,"output_tokens":3}}') == (
        7,
        3,
    )
    assert usage_tokens(b'{"usage":{"prompt_tokens":5,"completion_tokens":2,"x":{"y":1}}}') == (5, 2)
    stream = b'data: {"type":"x"}\n\ndata: {"response":{"usage":{"input_tokens":4,"output_tokens":9}}}\n\n'
    assert usage_tokens(stream) == (4, 9)
    assert usage_tokens(b'{"usage":null}') is None
    assert usage_tokens(b"") is None and usage_tokens(None) is None


def test_error_kind_is_bounded() -> None:
    assert error_kind(b'{"error":{"kind":"upstream_error","server":"a"}}') == "upstream_error"
    assert error_kind(b'{"error":{"kind":"made-up-by-a-handler"}}') == "other"
    assert error_kind(b'{"detail":"Not Found"}') == "no_envelope"
    assert error_kind(b"not json") == "no_envelope"


# ------------------------------------------------------------------------------------------------
# The event-loop lag catches a verifier that blocks the loop.


class BlockingVerifier(SimpleResourcesServer):
    """A verifier that blocks the event loop for 0.2 s (a synchronous sleep inside an async handler)."""

    config: BaseResourcesServerConfig

    async def verify(self, body: BaseVerifyRequest) -> BaseVerifyResponse:
        time.sleep(0.2)  # the mistake the lag histogram is there to show
        return BaseVerifyResponse(**body.model_dump(), reward=1.0)


def _verify_body() -> dict[str, Any]:
    response = {
        "id": "resp_1", "created_at": 0, "model": "m", "object": "response", "output": [],
        "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
    }  # fmt: skip
    return {"responses_create_params": {"input": "hi"}, "response": response}


def _lag_above(m: dict[str, list[tuple[dict[str, str], float]]], bound: str) -> float:
    """Ticks that were later than ``bound`` seconds: the +Inf count minus the ``le=bound`` bucket."""
    return value(m, "nemo_gym_event_loop_lag_seconds_count") - value(
        m, "nemo_gym_event_loop_lag_seconds_bucket", le=bound
    )


def _blocking_app(name: str) -> FastAPI:
    server = BlockingVerifier(
        config=BaseResourcesServerConfig(name=name, port=0), server_client=ServerClient(global_config_dict={})
    )
    return server.complete_app(server.setup_webserver())


def test_loop_lag_histogram_catches_a_blocking_verifier() -> None:
    with (
        serve_app(_blocking_app("blocking_verifier"), lifespan="on") as url,
        serve_app(_blocking_app("idle_neighbour"), lifespan="on") as other,
    ):
        time.sleep(0.35)  # the tick runs from start-up, before any request
        before = scrape(url)
        assert value(before, "nemo_gym_event_loop_lag_seconds_count") >= 2
        for _ in range(3):
            assert post_json(url + "/verify", _verify_body()).status_code == 200
        time.sleep(0.25)
        after = scrape(url)
        assert _lag_above(after, "0.1") >= _lag_above(before, "0.1") + 3
        assert value(after, "nemo_gym_verify_reward_sum") == 3.0
        # A second app in the same process has a registry of its own: none of those requests or rewards.
        neighbour = scrape(other)
        assert value(neighbour, "nemo_gym_verify_reward_count") == 0
        assert value(neighbour, "nemo_gym_http_requests_total", route="/verify") == 0


# ------------------------------------------------------------------------------------------------
# Model servers count tokens from the handler's answer object, and by reading the body only for a route
# a subclass added itself.


class TokenModel(SimpleResponsesAPIModel):
    """Answers whose ``usage`` object and body disagree, so the test can tell which one was counted."""

    config: BaseResponsesAPIModelConfig

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/v1/messages")(self.messages)  # not wrapped by the base: its body is read
        return app

    async def responses(self, request: Request, body: NeMoGymResponseCreateParamsNonStreaming) -> Response:
        answer = ModelAnswer({"id": "r", "usage": {"input_tokens": 1, "output_tokens": 1}})
        answer.usage = {"input_tokens": 11, "output_tokens": 5}  # what the metrics must count
        return answer

    async def chat_completions(self, request: Request, body: dict[str, Any] = Body(...)) -> dict[str, Any]:
        if body.get("slow"):
            await asyncio.sleep(1.0)  # long enough to be seen in flight
        return {"id": "c", "usage": {"prompt_tokens": 20, "completion_tokens": 2}}  # a plain dict

    def model_queue_depth(self) -> int | None:
        return 3  # as a server with a queue of its own would say

    async def messages(self, request: Request) -> Response:
        return Response(b'{"usage":{"input_tokens":7,"output_tokens":3}}', media_type="application/json")


def test_model_tokens_come_from_the_answer_object_or_else_the_body() -> None:
    server = TokenModel(
        config=BaseResponsesAPIModelConfig(name="token_model", port=0),
        server_client=ServerClient(global_config_dict={}),
    )
    with serve_app(server.complete_app(server.setup_webserver())) as url:
        assert post_json(url + "/v1/responses", {"input": "hi"}).json()["usage"]["input_tokens"] == 1
        assert post_json(url + "/v1/messages", {}).status_code == 200
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            slow = pool.submit(post_json, url + "/v1/chat/completions", {"messages": [], "slow": True})
            deadline = time.monotonic() + 10
            while value(scrape(url), "nemo_gym_model_calls_in_flight") != 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert value(scrape(url), "nemo_gym_model_calls_in_flight") == 1
            assert slow.result(timeout=30).status_code == 200
        m = scrape(url)
    assert value(m, "nemo_gym_model_calls_in_flight") == 0
    assert value(m, "nemo_gym_model_queue_depth") == 3
    assert value(m, "nemo_gym_model_prompt_tokens_total", endpoint="/v1/responses") == 11
    assert value(m, "nemo_gym_model_completion_tokens_total", endpoint="/v1/responses") == 5
    assert value(m, "nemo_gym_model_prompt_tokens_total", endpoint="/v1/chat/completions") == 20
    assert value(m, "nemo_gym_model_completion_tokens_total", endpoint="/v1/chat/completions") == 2
    assert value(m, "nemo_gym_model_prompt_tokens_total", endpoint="/v1/messages") == 7
    assert value(m, "nemo_gym_model_completion_tokens_total", endpoint="/v1/messages") == 3
    for endpoint in ("/v1/responses", "/v1/chat/completions", "/v1/messages"):
        assert value(m, "nemo_gym_model_calls_total", endpoint=endpoint, outcome="ok") == 1


def test_usage_of_reads_objects_dicts_and_ready_bodies() -> None:
    class Usage:
        input_tokens, output_tokens = 4, 2

    class Answer:
        usage = Usage()

    assert usage_of(Answer()) == (4, 2)
    assert usage_of({"usage": {"prompt_tokens": 3, "completion_tokens": 1}}) == (3, 1)
    assert usage_of(Response(b'{"usage":{"input_tokens":9,"output_tokens":8}}')) == (9, 8)
    assert usage_of(Response(b'{"usage":{"input_tokens":9,"output_tokens":8}}', status_code=500)) is None
    assert usage_of({"id": "x"}) is None and usage_of(None) is None


# ------------------------------------------------------------------------------------------------
# The verify pool and the sandbox's slots of a resources server's process.


class PoolUser(SimpleResourcesServer):
    """Verifies through the verify pool (a call past its timeout once) and runs a sandboxed program
    (one past its wall-time limit once)."""

    config: BaseResourcesServerConfig

    async def verify(self, body: BaseVerifyRequest) -> BaseVerifyResponse:
        slow = body.responses_create_params.input == "slow"
        try:
            # A cold worker takes a while to start: the bound that runs out is the slow call's only.
            await run_in_verify_pool(time.sleep, 5 if slow else 0.01, timeout=0.5 if slow else 60)
        except VerifyTimeoutError:
            pass
        program = f"import time; time.sleep({30 if slow else 0})"
        await run_in_sandbox(["python3", "-c", program], resources={"wall_time_s": 0.5})
        return BaseVerifyResponse.from_request(body, reward=1.0)


def test_pool_metrics_count_calls_timeouts_and_the_sizes() -> None:
    server = PoolUser(
        config=BaseResourcesServerConfig(name="pool_user", port=0),
        server_client=ServerClient(global_config_dict={}),
    )
    with serve_app(server.complete_app(server.setup_webserver())) as url:
        # Every pool is listed before this server's first use (the counters are of the process, which
        # other tests in it may have used: what this test caused is what grew).
        before = scrape(url)
        for name, pool in (("nemo_gym_pool_calls_total", "verify"), ("nemo_gym_pool_busy", "sandbox")):
            assert any(labels.get("pool") == pool for labels, _ in before.get(name, [])), (name, pool)
        assert value(before, "nemo_gym_pool_busy", pool="sandbox") == 0
        fast, slow = _verify_body(), _verify_body()
        slow["responses_create_params"]["input"] = "slow"
        assert post_json(url + "/verify", fast).status_code == 200
        assert post_json(url + "/verify", slow).status_code == 200
        after = scrape(url)
    for pool in ("verify", "sandbox"):
        grew = {
            key: value(after, f"nemo_gym_pool_{key}", pool=pool)
            - value(before, f"nemo_gym_pool_{key}", pool=pool)
            for key in ("calls_total", "timeouts_total", "failures_total")
        }
        assert grew == {"calls_total": 2, "timeouts_total": 1, "failures_total": 0}, (pool, grew)
        assert value(after, "nemo_gym_pool_size", pool=pool) >= 1
        assert value(after, "nemo_gym_pool_busy", pool=pool) == 0
        assert value(after, "nemo_gym_pool_queued", pool=pool) == 0


def test_servers_collect_the_young_generation_rarely_under_load(stack: RunHelper) -> None:
    """Each server tunes its garbage collector once its app is built (nemo_gym.server.startup.
    tune_gc_for_throughput): with CPython's default threshold the agent, holding parsed model answers across
    awaits, runs a young collection every few rollouts; tuned, 64 rollouts in flight x 4 rounds run at most
    a couple. Counted by prometheus_client's own python_gc_collections_total."""

    def young(name: str) -> float:
        return value(scrape(server_url(stack, name)), "python_gc_collections_total", generation="0")

    rows = example_rows("example_single_tool_call")
    before = {name: young(name) for name in (AGENT, RESOURCES, MODEL)}
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        results = list(pool.map(lambda i: run_rollout(stack, AGENT, rows[i % len(rows)]), range(256)))
    assert all(r["reward"] is not None for r in results)
    for name in (AGENT, RESOURCES, MODEL):
        assert young(name) - before[name] <= 2, name
