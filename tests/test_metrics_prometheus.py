"""A real Prometheus (Debian's ``/usr/bin/prometheus``) scrapes a real ``ng_run``.

The run: example_single_tool_call + simple_agent + the scripted model, started as the ``ng_run``
command. Prometheus finds the targets through the head server's ``/prometheus_targets`` (HTTP service
discovery) and authenticates with the run's token file, for discovery and for every scrape, as
docs/observability.md tells users to. After a few rollouts, its query API must show the request counter,
a latency histogram and the event-loop lag histogram of every server of the run and of the head server.
Prometheus is killed at the end whatever happens.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from nemo_gym.auth import auth_headers, token_file_for
from tests.conftest import EXAMPLE_CONFIG_PATHS, EXAMPLE_INSTANCES, REPO, LaunchedProcess, Launcher, get_json

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


@pytest.mark.slow
def test_prometheus_scrapes_every_server_of_a_run(launch: Launcher, tmp_path: Path) -> None:
    # ng_run's entry point by its import path (the venv's console script may belong to another checkout).
    run = LaunchedProcess([sys.executable, "-c", NG_RUN, EXAMPLE_CONFIG_PATHS, "+head_server.port=0"], REPO)
    launch.started.append(run)  # killed with everything it started at the end
    assert run.wait_ready() == 3
    head_url = run.head_url
    token = run.token
    token_file = token_file_for(int(head_url.rsplit(":", 1)[1]))
    config = tmp_path / "prometheus.yml"
    config.write_text(prometheus_yml(head_url, token_file))
    port = _free_port()
    prom_url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "prometheus.log").open("wb")
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
        rows = {r["name"]: r for r in get_json(head_url + "/server_instances", token=token)}
        agent = rows[AGENT]["url"]
        for city in ("Paris", "Tokyo", "Oslo"):
            row = {
                "responses_create_params": {"input": [{"role": "user", "content": f"Weather in {city}?"}]},
                "expected_city": city,
            }
            resp = httpx.post(
                agent + "/run", json=row, headers=auth_headers(token), timeout=60, trust_env=False
            )
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
            f"not scraped within {WAIT_S:.0f} s: {missing}\n"
            + (tmp_path / "prometheus.log").read_text()[-3000:]
        )
        # Every target is up, and the rollouts are visible: 3 /run answers counted by the agent.
        targets = query(prom_url, 'up{job="nemo_gym"}')
        assert {r["metric"]["instance_name"]: r["value"][1] for r in targets} == dict.fromkeys(
            EVERY_INSTANCE, "1"
        )
        runs = query(prom_url, f'nemo_gym_http_requests_total{{instance_name="{AGENT}",route="/run"}}')
        assert sum(float(r["value"][1]) for r in runs) == 3
    finally:
        if prom.poll() is None:
            os.killpg(prom.pid, signal.SIGKILL)
        prom.wait(timeout=30)
        log.close()
