"""``ng_viewer`` as a real process: command line, JSON API over HTTP, shutdown; and a real rollouts file.

The data of the first tests is written by ``tests/test_viewer_support.py`` (every number known);
the last test collects a real rollouts file with ``ng_run`` + ``ng_collect_rollouts`` and reads it
back through the viewer.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from nemo_gym.tools.testing import running_servers
from tests.conftest import EXAMPLE_CONFIG, HANG_BOUND_S, LaunchedProcess, Launcher
from tests.test_viewer_support import MALFORMED_A, NEEDLE, ViewerFiles, write_files

URL_RE = re.compile(r"ng_viewer: open (http://\S+)")
START_WAIT_S = 60.0
READY_WAIT_S = 60.0
HTTP_TIMEOUT_S = 30.0


def start_viewer(
    launch: Launcher, *args: str, env: dict[str, str] | None = None
) -> tuple[LaunchedProcess, str]:
    proc = launch(*args, cmd="ng_viewer", env=env)
    line = proc.wait_for_line(URL_RE, START_WAIT_S)
    assert line is not None, f"ng_viewer printed no URL (exit {proc.proc.poll()}):\n{proc.output}"
    m = URL_RE.search(line)
    assert m is not None
    return proc, m.group(1).rstrip("/")


def get(url: str, **params: Any) -> httpx.Response:
    return httpx.get(url, params=params, timeout=HTTP_TIMEOUT_S, trust_env=False)


def wait_ready(base: str, file_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + READY_WAIT_S
    while True:
        st = get(f"{base}/api/files/{file_id}").json()
        if st["state"] != "indexing" or time.monotonic() > deadline:
            return st
        time.sleep(0.1)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> ViewerFiles:
    return write_files(tmp_path_factory.mktemp("viewer_app"))


@pytest.fixture(scope="module")
def extra_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory the module's viewer may open further files from (``+allowed_roots``)."""
    return tmp_path_factory.mktemp("viewer_app_root")


@pytest.fixture(scope="module")
def viewer(
    launch_module: Launcher, data: ViewerFiles, extra_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    index_dir = tmp_path_factory.mktemp("index")
    _, base = start_viewer(
        launch_module,
        f"+jsonl_fpath={data.a}",
        f"+compare_jsonl_fpath={data.b}",
        f"+index_dir={index_dir}",
        f"+allowed_roots={extra_root}",
    )
    assert wait_ready(base, "1")["state"] == "ready"
    assert wait_ready(base, "2")["state"] == "ready"
    yield base


def test_files_listing_and_indexing_report(viewer: str, data: ViewerFiles, launch_module: Launcher) -> None:
    listing = get(f"{viewer}/api/files").json()
    assert (listing["main"], listing["compare"]) == ("1", "2")
    a, b = listing["files"]
    assert (a["path"], a["rows"], a["malformed"], a["state"]) == (str(data.a.resolve()), 18, 2, "ready")
    assert (b["path"], b["rows"], b["malformed"]) == (str(data.b.resolve()), 21, 0)
    assert not (data.a.parent / f".{data.a.name}.ngv-index").exists()  # +index_dir was given
    proc = launch_module.started[0]
    assert (
        proc.wait_for_line(r"ng_viewer: indexed .*rollouts_a\.jsonl: 18 rollouts, 2 malformed line\(s\)", 10)
        is not None
    )


def test_rows_filters_sort_and_search(viewer: str, data: ViewerFiles) -> None:
    r = get(
        f"{viewer}/api/files/1/rows", sort="reward", desc="1", reward_max="0.5", tasks="2-5", limit="3"
    ).json()
    assert r["total"] == 8 and r["all"] == 18
    assert [(x["task"], x["rollout"], x["reward"]) for x in r["rows"]] == [
        (2, 2, 0.5),
        (5, 0, 0.25),
        (5, 1, 0.25),
    ]
    r = get(f"{viewer}/api/files/1/rows", q=NEEDLE, wait="5").json()
    assert r["search"]["done"] and [(x["task"], x["rollout"]) for x in r["rows"]] == [(4, 0)]
    r = get(f"{viewer}/api/files/1/rows", errors="1").json()
    assert [(x["task"], x["rollout"], x["tool_errors"]) for x in r["rows"]] == [(1, 2, 1)]
    r = get(f"{viewer}/api/files/1/rows", agent="weather_react_agent", offset="2", limit="5").json()
    assert r["total"] == 3 and [x["rollout"] for x in r["rows"]] == [2]
    pos = get(f"{viewer}/api/files/1/position", row="7", sort="reward", desc="1").json()
    order = sorted(range(18), key=lambda i: -float(data.rows_a[i]["reward"]))
    p = order.index(7)
    assert (pos["position"], pos["total"], pos["prev"], pos["next"]) == (p, 18, order[p - 1], order[p + 1])


def test_bad_parameters_are_400_with_a_message(viewer: str) -> None:
    for params, needle in [
        ({"sort": "bogus"}, "cannot sort by 'bogus'"),
        ({"tasks": "1-x"}, "task filter"),
        ({"reward_min": "abc"}, "reward_min='abc' is not a number"),
        ({"limit": "0"}, "limit must be between"),
    ]:
        resp = get(f"{viewer}/api/files/1/rows", **params)
        assert resp.status_code == 400 and needle in resp.json()["error"], (params, resp.text)
    assert get(f"{viewer}/api/files/9/rows").status_code == 404
    assert get(f"{viewer}/api/files/1/rollouts/18").status_code == 404


def test_one_rollout_is_the_exact_line(viewer: str, data: ViewerFiles) -> None:
    for i in (0, 9, 17):
        body = get(f"{viewer}/api/files/1/rollouts/{i}").json()
        assert body["data"] == data.rows_a[i]
        assert body["meta"]["line_no"] == data.lines_a[i] and body["meta"]["row"] == i


def test_malformed_lines_have_line_numbers(viewer: str) -> None:
    m = get(f"{viewer}/api/files/1/malformed").json()
    assert m["total"] == 2
    assert [(x["line_no"], x["snippet"]) for x in m["rows"]] == [
        (n, t.decode()) for n, t in sorted(MALFORMED_A.items())
    ]


def test_summary_tasks_and_compare(viewer: str) -> None:
    s = get(f"{viewer}/api/files/1/summary").json()
    assert (s["rows"], s["num_tasks"], s["malformed_total"], s["failures"]["total"]) == (18, 6, 2, 2)
    t = get(f"{viewer}/api/files/1/tasks", sort="mean_reward", desc="1", limit="2").json()
    assert [x["task"] for x in t["rows"]] == [0, 3]
    c = get(f"{viewer}/api/compare", a="1", b="2", sort="delta", limit="1").json()
    assert (c["rows"][0]["task"], c["rows"][0]["delta"]) == (0, -1.0)
    assert (c["tasks_both"], c["tasks_only_b"]) == (6, 1)


def test_open_another_file_over_the_api(viewer: str, data: ViewerFiles, extra_root: Path) -> None:
    third = extra_root / "third.jsonl"
    third.write_bytes(data.b.read_bytes()[: data.b.stat().st_size // 2].rsplit(b"\n", 1)[0] + b"\n")
    resp = httpx.post(
        f"{viewer}/api/files",
        json={"path": str(third), "role": "compare"},
        timeout=HTTP_TIMEOUT_S,
        trust_env=False,
    )
    assert resp.status_code == 200, resp.text
    fid = resp.json()["id"]
    assert wait_ready(viewer, fid)["rows"] == len(third.read_bytes().splitlines())
    assert get(f"{viewer}/api/files").json()["compare"] == fid
    again = httpx.post(
        f"{viewer}/api/files", json={"path": str(third)}, timeout=HTTP_TIMEOUT_S, trust_env=False
    )
    assert again.json()["id"] == fid  # the same file is not opened twice
    missing = httpx.post(
        f"{viewer}/api/files",
        json={"path": str(extra_root / "nope.jsonl")},
        timeout=HTTP_TIMEOUT_S,
        trust_env=False,
    )
    assert missing.status_code == 400 and "is not a file" in missing.json()["error"]
    not_json = httpx.post(
        f"{viewer}/api/files",
        content=b"path=/etc/passwd",
        timeout=HTTP_TIMEOUT_S,
        trust_env=False,
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert not_json.status_code == 415


def test_requests_for_other_host_names_are_refused(viewer: str) -> None:
    resp = httpx.get(
        f"{viewer}/api/files",
        headers={"host": "attacker.example:80"},
        timeout=HTTP_TIMEOUT_S,
        trust_env=False,
    )
    assert resp.status_code == 403
    port = viewer.rsplit(":", 1)[1]
    ok = httpx.get(
        f"{viewer}/api/files", headers={"host": f"localhost:{port}"}, timeout=HTTP_TIMEOUT_S, trust_env=False
    )
    assert ok.status_code == 200


def test_page_and_assets_are_served_locally(viewer: str) -> None:
    page = get(viewer + "/")
    assert page.status_code == 200 and "<title>ng_viewer</title>" in page.text
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert "/static/viewer.js" in assets and "/static/viewer.css" in assets
    assert not [a for a in assets if "//" in a], assets  # nothing from another host
    for asset in ("/static/viewer.js", "/static/viewer.css"):
        resp = get(viewer + asset)
        assert resp.status_code == 200 and len(resp.content) > 1000
        assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", resp.text), (
            f"{asset} refers to the internet"
        )


def test_command_line_errors(launch: Launcher, tmp_path: Path) -> None:
    proc = launch(f"+jsonl_fpath={tmp_path / 'missing.jsonl'}", cmd="ng_viewer")
    assert proc.wait_exit(30) == 2
    assert "no such file" in proc.stderr
    proc = launch(f"+jsonl_fpath={tmp_path}", "+colour=blue", cmd="ng_viewer")
    assert proc.wait_exit(30) == 2
    assert "+colour: unknown option" in proc.stderr
    proc = launch(cmd="ng_viewer")
    assert proc.wait_exit(30) == 2
    assert "+jsonl_fpath" in proc.stderr


def test_sigterm_stops_the_viewer(launch: Launcher, data: ViewerFiles, tmp_path: Path) -> None:
    proc, base = start_viewer(launch, f"+jsonl_fpath={data.b}", f"+index_dir={tmp_path}", "+port=0")
    assert get(f"{base}/api/files").status_code == 200
    proc.send_signal(signal.SIGTERM)
    assert proc.wait_exit(HANG_BOUND_S) is not None
    assert proc.wait_no_processes() == []


def test_a_real_collected_rollouts_file(launch: Launcher, tmp_path: Path) -> None:
    out = tmp_path / "rollouts.jsonl"
    with running_servers([EXAMPLE_CONFIG]) as helper:
        port = helper.head_server_config.port
        cmd = [
            str(Path(sys.executable).parent / "ng_collect_rollouts"),
            "+agent_name=example_single_tool_call_simple_agent",
            "+input_jsonl_fpath=resources_servers/example_single_tool_call/data/example.jsonl",
            f"+output_jsonl_fpath={out}",
            "+num_repeats=2",
            f"+head_server.port={port}",
            "+progress=false",
        ]
        done = subprocess.run(
            cmd,
            cwd=Path(__file__).resolve().parents[1],
            capture_output=True,
            timeout=180,
            stdin=subprocess.DEVNULL,
        )
    rows = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert len(rows) == 10, done.stderr.decode()[-3000:]
    _, base = start_viewer(launch, f"+jsonl_fpath={out}", f"+index_dir={tmp_path}")
    st = wait_ready(base, "1")
    assert (st["rows"], st["malformed"]) == (10, 0)
    listing = get(f"{base}/api/files/1/rows", sort="task").json()
    assert [(r["task"], r["rollout"]) for r in listing["rows"]] == [
        (t, k) for t in range(5) for k in range(2)
    ]
    for r in listing["rows"]:
        row = next(
            x for x in rows if (x["_ng_task_index"], x["_ng_rollout_index"]) == (r["task"], r["rollout"])
        )
        calls = [o for o in row["response"]["output"] if o["type"] == "function_call"]
        assert r["tool_calls"] == len(calls) >= 1
        assert r["reward"] == row["reward"]
        assert r["total_tokens"] == row["response"]["usage"]["total_tokens"] > 0
        assert r["agent"] == "example_single_tool_call_simple_agent"
    one = get(f"{base}/api/files/1/rollouts/{listing['rows'][0]['row']}").json()["data"]
    assert one["_ng_task_index"] == 0 and "expected_city" in one


def test_every_answer_tells_the_browser_to_run_only_the_viewers_own_script(viewer: str) -> None:
    """Defence in depth for untrusted rollout text: a Content-Security-Policy on the page, the API and errors."""
    for path in ("/", "/api/files", "/api/files/nope"):
        resp = get(viewer + path)
        csp = resp.headers.get("content-security-policy", "")
        assert "script-src 'self'" in csp and "object-src 'none'" in csp, (path, resp.headers)
        assert resp.headers.get("x-content-type-options") == "nosniff"
