"""``nemo_gym.tools.metrics_plots`` against a fake Prometheus on 127.0.0.1 answering canned ``query_range``s.

The plots in docs/observability.md come from a real run (docs/observability-run.sh); this checks the
tool's own parts: the queries it sends, the parsing of Prometheus's matrix answer, and that the figure
holds those series with their legends and units, so a broken plot fails here rather than in the docs.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest

from nemo_gym.tools.metrics_plots import (
    Query,
    draw,
    fetch,
    key_panels,
    legend_for,
    main,
    parse_matrix,
    query_range,
)

pytest.importorskip("matplotlib")

START = 1_700_000_000.0
AGENTS = {"agent_a": ["1.5", "2.5", "3.5"], "agent_b": ["0.5", "NaN", "1"]}


def matrix(results: list[dict]) -> dict:
    return {"status": "success", "data": {"resultType": "matrix", "result": results}}


def canned(query: str) -> tuple[int, dict]:
    """What the fake Prometheus answers to ``query``: data for throughput and RSS, nothing else."""
    if query == "bad(":
        return 400, {"status": "error", "errorType": "bad_data", "error": "parse error at char 5"}
    if "nemo_gym_rollouts_finished_total" in query:
        return 200, matrix(
            [
                {
                    "metric": {"instance_name": name},
                    "values": [[START + 2 * i, v] for i, v in enumerate(vals)],
                }
                for name, vals in AGENTS.items()
            ]
        )
    if "nemo_gym_collection_rollouts_ok_total" in query:
        return 200, matrix([{"metric": {}, "values": [[START, "4"], [START + 2, "5"]]}])
    if "process_resident_memory_bytes" in query:
        return 200, matrix(
            [{"metric": {"instance_name": "head_server"}, "values": [[START, str(64 * 2**20)]]}]
        )
    return 200, matrix([])


@pytest.fixture
def fake_prometheus() -> Iterator[tuple[str, list[dict[str, list[str]]]]]:
    """A fake Prometheus's URL and the query strings it received."""
    seen: list[dict[str, list[str]]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urlparse(self.path)
            params = parse_qs(url.query)
            seen.append(params)
            status, body = (404, {}) if url.path != "/api/v1/query_range" else canned(params["query"][0])
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def test_legend_and_parse() -> None:
    assert legend_for("{instance_name} p99", {"instance_name": "srv"}) == "srv p99"
    assert legend_for("collector {type}", {}) == "collector "
    series = parse_matrix(canned("nemo_gym_rollouts_finished_total")[1], "{instance_name}", scale=2.0)
    assert [s.legend for s in series] == ["agent_a", "agent_b"]
    assert series[0].times == [START, START + 2, START + 4] and series[0].values == [3.0, 5.0, 7.0]
    assert math.isnan(series[1].values[1])
    with pytest.raises(ValueError, match="vector"):
        parse_matrix({"status": "success", "data": {"resultType": "vector", "result": []}}, "")


def test_figure_holds_the_series(fake_prometheus: tuple[str, list[dict[str, list[str]]]]) -> None:
    url, seen = fake_prometheus
    panels = key_panels("15s")
    data = fetch(url, panels, START, START + 60, 2.0)
    # Every panel's every query was asked once, over the range and step given.
    assert len(seen) == sum(len(p.queries) for p in panels)
    assert all(
        q["start"] == [str(START)] and q["end"] == [str(START + 60)] and q["step"] == ["2.0"] for q in seen
    )
    assert all("[15s]" in q["query"][0] for q in seen if "rate(" in q["query"][0])

    fig = draw(panels, data, START, "a run")
    axes = fig.axes
    assert len(axes) >= len(panels)
    by_title = {ax.get_title(): ax for ax in axes if ax.get_visible()}
    assert set(by_title) == {p.title for p in panels}

    throughput = by_title["Throughput"]
    assert throughput.get_ylabel() == "rollouts/s" and throughput.get_xlabel() == "time since start (s)"
    lines = {line.get_label(): line for line in throughput.get_lines()}
    assert set(lines) == {"agent_a", "agent_b", "collector (written)"}
    assert list(lines["agent_a"].get_xdata()) == [0.0, 2.0, 4.0]
    assert list(lines["agent_a"].get_ydata()) == [1.5, 2.5, 3.5]
    assert [t.get_text() for t in throughput.get_legend().get_texts()] == [
        "agent_a",
        "agent_b",
        "collector (written)",
    ]
    rss = by_title["Memory (RSS) per process"]
    assert rss.get_ylabel() == "MiB" and list(rss.get_lines()[0].get_ydata()) == [64.0]
    # A panel with no series says so instead of drawing an empty box silently.
    lag = by_title["Event-loop lag p99 per server"]
    assert lag.get_lines() == [] and "no data" in [t.get_text() for t in lag.texts]


def test_bad_query_raises_prometheus_error(fake_prometheus: tuple[str, list[dict[str, list[str]]]]) -> None:
    url, _ = fake_prometheus
    with pytest.raises(ValueError, match="parse error at char 5"):
        query_range(url, Query("bad(", ""), START, START + 10, 1.0)


def test_main_writes_a_png(fake_prometheus: tuple[str, list[dict[str, list[str]]]], tmp_path: Path) -> None:
    url, _ = fake_prometheus
    out = tmp_path / "run.png"
    assert (
        main(["--prometheus", url, "--start", str(START), "--end", str(START + 60), "--out", str(out)]) == 0
    )
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
