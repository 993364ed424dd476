"""A real Prometheus (Debian's ``/usr/bin/prometheus``) scrapes a real ``ng_run``.

The run: example_single_tool_call + simple_agent + the scripted model, started as the ``ng_run``
command. Prometheus finds the targets through the head server's ``/prometheus_targets`` (HTTP service
discovery) and authenticates with the run's token file, for discovery and for every scrape, as
docs/observability.md tells users to. After a few rollouts, its query API must show the request counter,
a latency histogram and the event-loop lag histogram of every server of the run and of the head server.
Prometheus is killed at the end whatever happens.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from nemo_gym.auth import auth_headers, token_file_for
from tests.conftest import (
    EXAMPLE_CONFIG,
    EXAMPLE_CONFIG_PATHS,
    EXAMPLE_INSTANCES,
    REPO,
    SCRIPTED_MODEL_CONFIG,
    LaunchedProcess,
    Launcher,
    get_json,
)

PROMETHEUS = Path("/usr/bin/prometheus")
WAIT_S = 90.0  # bound on Prometheus discovering and scraping every target on a busy 2-core machine
AGENT = "example_single_tool_call_simple_agent"
EVERY_INSTANCE = {"head_server", *EXAMPLE_INSTANCES}
NG_RUN = "import sys; from nemo_gym.run.cli import run_main; sys.exit(run_main())"

pytestmark = pytest.mark.skipif(
    not PROMETHEUS.is_file(), reason="Debian's prometheus package is needed (apt-get install prometheus)"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prometheus_yml(head_url: str, token_file: Path) -> str:
    """The set-up docs/observability.md gives: discovery and scrapes both carry the run token."""
    return f"""\
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: nemo_gym
    authorization:
      type: Bearer
      credentials_file: {token_file}
    http_sd_configs:
      - url: {head_url}/prometheus_targets
        refresh_interval: 1s
        authorization:
          type: Bearer  # explicit: Prometheus 2.42 sends http_sd's credentials without the scheme otherwise
          credentials_file: {token_file}
"""


def query(prom_url: str, promql: str) -> list[dict[str, Any]]:
    resp = httpx.get(f"{prom_url}/api/v1/query", params={"query": promql}, timeout=10, trust_env=False)
    resp.raise_for_status()
    body = resp.json()
    assert body["status"] == "success", body
    return body["data"]["result"]


def instances_with(prom_url: str, promql: str) -> set[str]:
    """The ``instance_name`` labels of the series ``promql`` returns."""
    return {r["metric"].get("instance_name", "") for r in query(prom_url, promql)}


@contextlib.contextmanager
def running_prometheus(config_text: str, tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen, Path]]:
    """A real Prometheus on a free port with ``config_text``: (its URL, its process, its log); always killed."""
    config = tmp_path / "prometheus.yml"
    config.write_text(config_text)
    port = _free_port()
    log_path = tmp_path / "prometheus.log"
    log = log_path.open("wb")
    prom = subprocess.Popen(
        [
            str(PROMETHEUS),
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield f"http://127.0.0.1:{port}", prom, log_path
    finally:
        if prom.poll() is None:
            os.killpg(prom.pid, signal.SIGKILL)
        prom.wait(timeout=30)
        log.close()


@pytest.mark.slow
def test_prometheus_scrapes_every_server_of_a_run(launch: Launcher, tmp_path: Path) -> None:
    # ng_run's entry point by its import path (the venv's console script may belong to another checkout).
    run = LaunchedProcess([sys.executable, "-c", NG_RUN, EXAMPLE_CONFIG_PATHS, "+head_server.port=0"], REPO)
    launch.started.append(run)  # killed with everything it started at the end
    assert run.wait_ready() == 3
    head_url = run.head_url
    token = run.token
    token_file = token_file_for(int(head_url.rsplit(":", 1)[1]))
    with running_prometheus(prometheus_yml(head_url, token_file), tmp_path) as (prom_url, prom, _):
        _scrape_every_server(prom_url, prom, head_url, token, tmp_path)


def _scrape_every_server(
    prom_url: str, prom: subprocess.Popen, head_url: str, token: str, tmp_path: Path
) -> None:
    """A few rollouts, then every server of the run and the head server must be scraped."""
    rows = {r["name"]: r for r in get_json(head_url + "/server_instances", token=token)}
    agent = rows[AGENT]["url"]
    for city in ("Paris", "Tokyo", "Oslo"):
        row = {
            "responses_create_params": {"input": [{"role": "user", "content": f"Weather in {city}?"}]},
            "expected_city": city,
        }
        resp = httpx.post(agent + "/run", json=row, headers=auth_headers(token), timeout=60, trust_env=False)
        assert resp.status_code == 200, resp.text[:1000]

    wanted = {
        "requests": "nemo_gym_http_requests_total",
        "latency": "nemo_gym_http_request_duration_seconds_bucket",
        "loop lag": "nemo_gym_event_loop_lag_seconds_count > 0",
    }
    seen: dict[str, set[str]] = {}
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            seen = {what: instances_with(prom_url, promql) for what, promql in wanted.items()}
        except httpx.HTTPError:  # Prometheus still starting
            seen = {}
        if seen and all(found >= EVERY_INSTANCE for found in seen.values()):
            break
        assert prom.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
        time.sleep(1)
    missing = {what: EVERY_INSTANCE - seen.get(what, set()) for what in wanted}
    assert not any(missing.values()), (
        f"not scraped within {WAIT_S:.0f} s: {missing}\n" + (tmp_path / "prometheus.log").read_text()[-3000:]
    )
    # Every target is up, and the rollouts are visible: 3 /run answers counted by the agent.
    targets = query(prom_url, 'up{job="nemo_gym"}')
    assert {r["metric"]["instance_name"]: r["value"][1] for r in targets} == dict.fromkeys(
        EVERY_INSTANCE, "1"
    )
    runs = query(prom_url, f'nemo_gym_http_requests_total{{instance_name="{AGENT}",route="/run"}}')
    assert sum(float(r["value"][1]) for r in runs) == 3


# ------------------------------------------------------------------------------------------------
# The Grafana dashboard (docs/grafana/nemo_gym.json): every panel's query returns data from a real
# Prometheus scraping a real run and a real ng_collect_rollouts with +metrics_port.

DASHBOARD = REPO / "docs" / "grafana" / "nemo_gym.json"
SLOW, FAIL_503 = "[slow]", "[fail503]"
NG_COLLECT = "import sys; from nemo_gym.collection.cli import collect_main; sys.exit(collect_main())"


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, expr) of every target of every panel (rows' nested panels included)."""
    dash = json.loads(DASHBOARD.read_text())
    assert dash["schemaVersion"] >= 36
    assert any(v["type"] == "datasource" and v["query"] == "prometheus" for v in dash["templating"]["list"])
    out = []
    panels = list(dash["panels"])
    while panels:
        panel = panels.pop(0)
        panels.extend(panel.get("panels", []))
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            out.append((panel["title"], target["expr"]))
    return out


def test_dashboard_is_valid_json_with_targets() -> None:
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    assert all("$" not in e for _, e in exprs)  # no Grafana variables a plain Prometheus would not expand


@pytest.mark.slow
def test_every_dashboard_query_returns_data(launch: Launcher, tmp_path: Path) -> None:
    # The scripted model: slow turns (so the collection runs long enough to be scraped) and some 503s.
    call = {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}], "delay_s": 0.1}
    rules = [
        {"contains": FAIL_503, "turns": [{"http_error": 503}]},
        {"contains": SLOW, "turns": [call, {"text": "It is snowy in Paris"}]},
    ]
    scripts = tmp_path / "scripts.yaml"
    scripts.write_text(
        json.dumps(
            {"policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": rules}}}}
        )
    )
    paths = f"+config_paths=[{EXAMPLE_CONFIG},{SCRIPTED_MODEL_CONFIG},{scripts}]"
    run = LaunchedProcess([sys.executable, "-c", NG_RUN, paths, "+head_server.port=0"], REPO)
    launch.started.append(run)
    assert run.wait_ready() == 3
    head_url = run.head_url
    token_file = token_file_for(int(head_url.rsplit(":", 1)[1]))
    collector_port = _free_port()
    config = (
        prometheus_yml(head_url, token_file)
        + f"""\
  - job_name: nemo_gym_collector
    static_configs:
      - targets: ["127.0.0.1:{collector_port}"]
        labels:
          instance_name: collector
"""
    )
    # 600 rows, every 25th answered 503 by the model (never 3 in a row: the breaker stays closed).
    base = [
        json.loads(line)
        for line in (REPO / "resources_servers/example_single_tool_call/data/example.jsonl")
        .read_text()
        .splitlines()
    ]
    rows = []
    for i in range(600):
        row = json.loads(json.dumps(base[i % len(base)]))
        row["responses_create_params"]["input"][-1]["content"] += f" {FAIL_503 if i % 25 == 7 else SLOW} {i}"
        rows.append(row)
    input_path = tmp_path / "tasks.jsonl"
    input_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    exprs = dashboard_exprs()
    with running_prometheus(config, tmp_path) as (prom_url, prom, log_path):
        collector = LaunchedProcess(
            [
                sys.executable,
                "-c",
                NG_COLLECT,
                f"+input_jsonl_fpath={input_path}",
                f"+output_jsonl_fpath={tmp_path / 'out.jsonl'}",
                f"+agent_name={AGENT}",
                f"+head_server.port={head_url.rsplit(':', 1)[1]}",
                f"+metrics_port={collector_port}",
                "+num_samples_in_parallel=4",
                "+progress=false",
            ],
            REPO,
        )
        launch.started.append(collector)
        empty: list[tuple[str, str]] = exprs
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            try:
                empty = [(title, e) for title, e in exprs if not query(prom_url, e)]
            except httpx.HTTPError:  # Prometheus still starting
                pass
            if not empty:
                break
            assert prom.poll() is None, log_path.read_text()[-3000:]
            assert collector.proc.poll() is None, "the collection ended first:\n" + collector.output[-3000:]
            time.sleep(2)
        assert not empty, (
            f"queries without data after {WAIT_S:.0f} s: {empty}\n" + log_path.read_text()[-2000:]
        )
        # The collector's series are the collector's: its counter is what it wrote so far.
        written = query(prom_url, 'nemo_gym_collection_rollouts_ok_total{instance_name="collector"}')
        assert len(written) == 1 and 0 < float(written[0]["value"][1]) <= 600
        collector.send_signal(signal.SIGINT)
        assert collector.wait_exit(60) == 130, collector.output[-3000:]
