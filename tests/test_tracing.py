"""OpenTelemetry traces (``+tracing=otlp``; nemo_gym.server.tracing, nemo_gym.client.tracing) on real servers.

A small OTLP/HTTP receiver runs in this process (``POST /v1/traces``, protobuf bodies decoded with
OpenTelemetry's own ``ExportTraceServiceRequest``). The stack is example_single_tool_call + simple_agent
+ the scripted model, started by ``RunHelper`` (real processes, real HTTP on 127.0.0.1), plus a probe
server (written into a scratch folder) that reports the W3C headers it received, whether OpenTelemetry
is loaded in its process, and what the server it calls through its ``ServerClient`` received.

The batch processor's schedule delay is set to a minute for the servers, so every span checked here
reached the receiver through the flush at server shutdown.
"""

from __future__ import annotations

import gzip
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from nemo_gym.auth import auth_headers, client_token_for_url
from nemo_gym.config.keys import PACKAGE_PARENT_DIR
from nemo_gym.config.problems import ConfigError
from nemo_gym.config.tracing import tracing_problems
from nemo_gym.tools.testing import (
    SCRIPTED_MODEL_CONFIG,
    example_rows,
    post_json,
    run_rollout,
    running_servers,
    server_url,
)
from tests.conftest import write_server_folder

pytest.importorskip(
    "opentelemetry.sdk", reason="the `tracing` extra is not installed (pip install -e '.[tracing]')"
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

EXAMPLE_CONFIG = str(
    PACKAGE_PARENT_DIR / "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml"
)
MODEL_CONFIG = str(PACKAGE_PARENT_DIR / SCRIPTED_MODEL_CONFIG)
AGENT = "example_single_tool_call_simple_agent"
RESOURCES = "example_single_tool_call"
MODEL = "policy_model"
PROBE = "trace_probe"
SERVER, CLIENT = 2, 3  # Span.SpanKind values of the OTLP protobuf

PROBE_APP = """
import os
import sys

from fastapi import Request

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)


OTEL_SDK = ("opentelemetry.sdk", "opentelemetry.exporter", "opentelemetry.proto")


class ProbeServer(SimpleResourcesServer):
    config: BaseResourcesServerConfig

    def setup_webserver(self):
        app = super().setup_webserver()
        app.post("/echo")(self.echo)
        app.post("/call")(self.call)
        return app

    async def echo(self, request: Request) -> dict:
        return {
            "traceparent": request.headers.get("traceparent"),
            # (not opentelemetry's API: recent FastAPI versions import it themselves)
            "otel_modules": sorted(m for m in sys.modules if m.startswith(OTEL_SDK)),
            "bsp_delay": os.environ.get("OTEL_BSP_SCHEDULE_DELAY"),
        }

    async def call(self, request: Request) -> dict:
        resp = await self.server_client.post(self.config.name, "/echo", json={})
        return {"self": await self.echo(request), "callee": await resp.json()}

    async def verify(self, body: BaseVerifyRequest) -> BaseVerifyResponse:
        return BaseVerifyResponse(**body.model_dump(), reward=1.0)


if __name__ == "__main__":
    ProbeServer.run_webserver()
"""
PROBE_INSTANCE = {PROBE: {"resources_servers": {"trace_probe": {"entrypoint": "app.py", "domain": "other"}}}}


# ------------------------------------------------------------------------------------------------
# A tiny OTLP/HTTP receiver.


class Receiver:
    """Every span exported to ``url``, flattened to a dict (ids as hex)."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.requests = 0
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_error(404)
                    return
                receiver.add(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def add(self, request: ExportTraceServiceRequest) -> None:
        with self.lock:
            self.requests += 1
            for rs in request.resource_spans:
                resource = {a.key: _value(a.value) for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append(
                            {
                                "trace_id": s.trace_id.hex(),
                                "span_id": s.span_id.hex(),
                                "parent_id": s.parent_span_id.hex(),
                                "name": s.name,
                                "kind": s.kind,
                                "attributes": {a.key: _value(a.value) for a in s.attributes},
                                "service": resource.get("service.name"),
                                "server_type": resource.get("nemo_gym.server_type"),
                                "error": s.status.code == 2,
                            }
                        )


def _value(v: Any) -> Any:
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    r.thread.start()
    try:
        yield r
    finally:
        r.server.shutdown()
        r.server.server_close()


# ------------------------------------------------------------------------------------------------
# Tracing on: one trace per rollout across agent, model and resources servers.

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


@pytest.fixture
def traced_run(receiver: Receiver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Two rollouts and a probe call (with a caller's traceparent) on a traced stack, then shutdown."""
    write_server_folder(tmp_path, "resources_servers", "trace_probe", PROBE_APP)
    monkeypatch.chdir(tmp_path)  # the probe's folder is found under the working directory
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "60000")  # only the shutdown flush sends spans
    extra = {**PROBE_INSTANCE, "tracing": "otlp", "tracing_endpoint": receiver.url}
    rows = example_rows("example_single_tool_call")[:2]
    with running_servers([EXAMPLE_CONFIG, MODEL_CONFIG], extra, with_scripted_model=False) as helper:
        results = [run_rollout(helper, AGENT, row) for row in rows]
        url = server_url(helper, PROBE) + "/call"
        probe = httpx.post(
            url,
            json={},
            headers={
                **auth_headers(client_token_for_url(url)),
                "traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01",
            },
            timeout=60,
            trust_env=False,
        )
        assert probe.status_code == 200, probe.text
        assert receiver.spans == []  # nothing exported before the shutdown flush (a minute's delay)
    return {"results": results, "probe": probe.json(), "spans": list(receiver.spans)}


def _by_id(spans: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {s["span_id"]: s for s in spans}


def test_one_trace_per_rollout_through_agent_model_and_resources(traced_run: dict[str, Any]) -> None:
    spans = traced_run["spans"]
    roots = [s for s in spans if s["service"] == AGENT and s["name"] == "POST /run"]
    assert len(roots) == 2, [(s["service"], s["name"]) for s in spans]
    assert len({r["trace_id"] for r in roots}) == 2  # one trace per rollout
    assert not [s for s in spans if s["name"].startswith("GET /")]  # liveness checks are no spans
    tool_calls_seen = 0
    for root in roots:
        assert root["parent_id"] == "" and root["kind"] == SERVER  # the collector sent no traceparent
        assert root["attributes"]["http.response.status_code"] == 200
        assert root["server_type"] == "responses_api_agents"
        trace = [s for s in spans if s["trace_id"] == root["trace_id"]]
        by_id = _by_id(trace)
        # Every span but the root hangs below another span of the same trace, up to the root.
        for s in trace:
            hop = s
            while hop["parent_id"]:
                assert hop["parent_id"] in by_id, f"{s['service']} {s['name']}: parent not in the trace"
                hop = by_id[hop["parent_id"]]
            assert hop is root
        assert [s for s in trace if not s["parent_id"]] == [root]
        # The agent's calls are client spans below /run; each callee's server span is their child.
        client_spans = [s for s in trace if s["kind"] == CLIENT]
        assert client_spans and all(s["service"] == AGENT for s in client_spans)
        assert all(s["parent_id"] == root["span_id"] for s in client_spans)
        downstream = [s for s in trace if s["service"] in (MODEL, RESOURCES)]
        for s in downstream:
            assert s["kind"] == SERVER
            caller = by_id[s["parent_id"]]
            assert caller["kind"] == CLIENT and caller["service"] == AGENT
            assert caller["attributes"]["nemo_gym.server_name"] == s["service"]
            assert caller["attributes"]["url.path"] == s["attributes"]["url.path"]
            assert caller["name"] == s["name"]
            assert (
                caller["attributes"]["http.response.status_code"]
                == 200
                == s["attributes"]["http.response.status_code"]
            )
        assert len(downstream) == len(client_spans)
        names = {(s["service"], s["name"]) for s in downstream}
        assert {
            (MODEL, "POST /v1/responses"),
            (RESOURCES, "POST /seed_session"),
            (RESOURCES, "POST /verify"),
        } <= names
        tool_calls_seen += sum(1 for s in downstream if s["name"] == "POST /get_weather")
        assert {s["server_type"] for s in downstream} == {"responses_api_models", "resources_servers"}
    expected_tool_calls = sum(
        1
        for r in traced_run["results"]
        for item in r["response"]["output"]
        if item.get("type") == "function_call"
    )
    assert tool_calls_seen == expected_tool_calls > 0


def test_a_callers_traceparent_is_continued_and_passed_on(traced_run: dict[str, Any]) -> None:
    probe = traced_run["probe"]
    assert probe["self"]["traceparent"] == f"00-{TRACE_ID}-{CALLER_SPAN}-01"
    assert probe["self"]["otel_modules"] and probe["self"]["bsp_delay"] == "60000"
    sent = probe["callee"]["traceparent"]
    assert re.fullmatch(rf"00-{TRACE_ID}-[0-9a-f]{{16}}-01", sent), sent
    spans = [s for s in traced_run["spans"] if s["service"] == PROBE]
    by_id = _by_id(spans)
    assert all(s["trace_id"] == TRACE_ID for s in spans), [(s["name"], s["trace_id"]) for s in spans]
    assert (
        len(spans) == 3
    )  # /call, its client span, /echo (the launcher's GET / liveness checks are no spans)
    call = next(s for s in spans if s["name"] == "POST /call")
    assert call["parent_id"] == CALLER_SPAN and call["kind"] == SERVER
    client = by_id[sent.split("-")[2]]  # the span whose id the callee received
    assert (
        client["kind"] == CLIENT and client["parent_id"] == call["span_id"] and client["name"] == "POST /echo"
    )
    echo = next(s for s in spans if s["name"] == "POST /echo")
    assert echo["kind"] == SERVER and echo["parent_id"] == client["span_id"]


# ------------------------------------------------------------------------------------------------
# Tracing off: nothing imported, no header sent.


def test_tracing_off_adds_no_header_and_imports_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_server_folder(tmp_path, "resources_servers", "trace_probe", PROBE_APP)
    monkeypatch.chdir(tmp_path)
    with running_servers([], PROBE_INSTANCE, with_scripted_model=False) as helper:
        resp = post_json(server_url(helper, PROBE) + "/call", {})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["callee"]["traceparent"] is None  # the ServerClient call carried no traceparent
    assert body["self"]["otel_modules"] == [] and body["callee"]["otel_modules"] == []


# ------------------------------------------------------------------------------------------------
# The launcher's checks.


def test_a_bad_tracing_value_stops_the_run_before_anything_starts() -> None:
    with pytest.raises(ConfigError, match=r"'tracing'.*must be one of otlp"):
        with running_servers([EXAMPLE_CONFIG], {"tracing": "jaeger"}):
            pass
    with pytest.raises(ConfigError, match=r"'tracing_endpoint'.*http://"):
        with running_servers([EXAMPLE_CONFIG], {"tracing": "otlp", "tracing_endpoint": "127.0.0.1:4318"}):
            pass


def test_missing_packages_name_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import nemo_gym.config.tracing as config_tracing

    assert tracing_problems({"tracing": "otlp"}) == []
    assert tracing_problems({"tracing": False}) == tracing_problems({}) == []
    monkeypatch.setattr(config_tracing, "REQUIRED_MODULES", ("opentelemetry.sdk", "no_such_pkg.exporter"))
    [(key, message)] = tracing_problems({"tracing": "otlp"})
    assert (
        key == "tracing"
        and "pip install 'nemo-gym[tracing]'" in message
        and "no_such_pkg.exporter" in message
    )
