"""``ng_viewer`` reads only what it was asked to, writes nothing beside the data, and needs a token off loopback.

Every test runs the real ``ng_viewer`` command and talks HTTP to it on 127.0.0.1 (even when it
listens on 0.0.0.0). The index cache goes to ``$XDG_CACHE_HOME`` pointed at the test's own temp
directory, so the user's real cache is never touched.
"""

from __future__ import annotations

import re
import stat
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import orjson
import pytest

from tests.conftest import Launcher
from tests.test_viewer_app import HTTP_TIMEOUT_S, READY_WAIT_S, URL_RE, get, start_viewer, wait_ready
from tests.test_viewer_support import AGENT, ViewerFiles, rollout, write_files

SECRET = "s3cret-line-that-must-never-leave-this-file"


def post_open(base: str, path: str | Path, **headers: str) -> httpx.Response:
    return httpx.post(
        f"{base}/api/files",
        json={"path": str(path)},
        headers=headers,
        timeout=HTTP_TIMEOUT_S,
        trust_env=False,
    )


def listing_paths(base: str) -> list[str]:
    return [f["path"] for f in get(f"{base}/api/files").json()["files"]]


def tree(directory: Path) -> set[str]:
    """Every file and folder under ``directory`` (hidden ones too), relative."""
    return {str(p.relative_to(directory)) for p in directory.rglob("*")}


@pytest.fixture
def layout(tmp_path: Path) -> dict[str, Any]:
    """data/ (the rollouts given on the command line), root/ (an allowed root), outside/ (neither)."""
    data = write_files(tmp_path / "data")
    outside = tmp_path / "outside"
    outside.mkdir()
    # A "secret" that parses as rollouts and as failures rows, so reading it would show its text.
    secret = outside / "secret.jsonl"
    secret.write_bytes(orjson.dumps({**rollout(0, 0, 1.0), "kind": "timeout", "error": SECRET}) + b"\n")
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    inside = root / "sub" / "inside.jsonl"
    inside.write_bytes(data.b.read_bytes())
    link = root / "link.jsonl"
    link.symlink_to(secret)
    # A data file in the root whose failures sidecar is a symlink to the secret.
    tricky = root / "tricky.jsonl"
    tricky.write_bytes(data.b.read_bytes())
    (root / "tricky_failures.jsonl").symlink_to(secret)
    linked_dir = root / "linked_dir"
    linked_dir.symlink_to(outside, target_is_directory=True)
    return {
        "data": data,
        "outside": outside,
        "secret": secret,
        "root": root,
        "inside": inside,
        "link": link,
        "tricky": tricky,
        "linked_dir": linked_dir,
        "cache": tmp_path / "xdg_cache",
    }


def _start(launch: Launcher, layout: dict[str, Any], *extra: str) -> str:
    data: ViewerFiles = layout["data"]
    _, base = start_viewer(
        launch, f"+jsonl_fpath={data.a}", *extra, env={"XDG_CACHE_HOME": str(layout["cache"])}
    )
    assert wait_ready(base, "1")["state"] == "ready"
    return base


def test_only_the_given_files_are_served(launch: Launcher, layout: dict[str, Any]) -> None:
    base = _start(launch, layout)
    secret: Path = layout["secret"]
    data: ViewerFiles = layout["data"]
    for path in (
        secret,  # an ordinary file outside
        "/etc/shadow",  # the example (exists or not: the same answer)
        layout["outside"] / "no-such-file.jsonl",  # no existence oracle either
        data.a.parent / ".." / "outside" / "secret.jsonl",  # `..` out of the data folder
        data.b,  # next to the given file, but not given
    ):
        resp = post_open(base, path)
        assert resp.status_code == 403, (path, resp.status_code, resp.text)
        err = resp.json()["error"]
        assert "may not read" in err and "+allowed_roots=" in err, err
    assert listing_paths(base) == [str(data.a.resolve())]
    assert get(f"{base}/api/files/2/malformed").status_code == 404  # nothing was opened
    assert not list(layout["outside"].glob(".*")), "the viewer wrote beside a refused file"
    # The given file's failures sidecar is still read.
    assert get(f"{base}/api/files/1/summary").json()["failures"]["total"] == 2


def test_allowed_roots_resolve_symlinks_and_dots(launch: Launcher, layout: dict[str, Any]) -> None:
    root: Path = layout["root"]
    base = _start(launch, layout, f"+allowed_roots={root}")
    ok = post_open(base, layout["inside"])
    assert ok.status_code == 200, ok.text
    assert wait_ready(base, ok.json()["id"])["rows"] == len(layout["data"].rows_b)
    for path in (
        layout["link"],  # a symlink inside the root to a file outside
        layout["linked_dir"] / "secret.jsonl",  # through a symlinked folder inside the root
        root / "sub" / ".." / ".." / "outside" / "secret.jsonl",  # `..` out of the root
    ):
        resp = post_open(base, path)
        assert resp.status_code == 403, (path, resp.text)
        assert "+allowed_roots=" + str(root.resolve()) in resp.json()["error"]
    # A data file in the root opens, but its failures sidecar (a symlink leading out) is not read.
    tricky = post_open(base, layout["tricky"])
    assert tricky.status_code == 200, tricky.text
    tid = tricky.json()["id"]
    assert wait_ready(base, tid)["state"] == "ready"
    summary = get(f"{base}/api/files/{tid}/summary")
    assert summary.status_code == 200
    failures = summary.json()["failures"]
    assert (failures["present"], failures["total"]) == (False, 0) and "may not read" in failures["error"]
    assert SECRET not in summary.text
    for fid in [f["id"] for f in get(f"{base}/api/files").json()["files"]]:
        assert SECRET not in get(f"{base}/api/files/{fid}/malformed").text


def test_roots_given_as_a_list(launch: Launcher, layout: dict[str, Any], tmp_path: Path) -> None:
    other = tmp_path / "other_root"
    other.mkdir()
    extra = other / "x.jsonl"
    extra.write_bytes(layout["data"].b.read_bytes())
    base = _start(launch, layout, f"+allowed_roots=[{layout['root']},{other}]")
    assert post_open(base, extra).status_code == 200
    assert post_open(base, layout["inside"]).status_code == 200
    assert post_open(base, layout["secret"]).status_code == 403


def test_bad_allowed_root_is_a_clear_error(launch: Launcher, layout: dict[str, Any]) -> None:
    proc = launch(
        f"+jsonl_fpath={layout['data'].a}", f"+allowed_roots={layout['outside'] / 'nope'}", cmd="ng_viewer"
    )
    assert proc.wait_exit(30) == 2
    assert "+allowed_roots:" in proc.stderr and "is not a directory" in proc.stderr


def test_index_cache_is_private_and_nothing_is_written_beside_the_data(
    launch: Launcher, layout: dict[str, Any]
) -> None:
    data: ViewerFiles = layout["data"]
    cache: Path = layout["cache"]
    before = tree(data.a.parent)
    base = _start(launch, layout)
    st = wait_ready(base, "1")
    assert not st["loaded_from_cache"]
    cache_file = Path(st["index_cache"])
    viewer_dir = cache / "nemo_gym" / "viewer"
    assert cache_file.parent == viewer_dir and cache_file.is_file()
    assert stat.S_IMODE(viewer_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(cache_file.stat().st_mode) == 0o600
    assert [p.name for p in viewer_dir.iterdir()] == [cache_file.name]  # no temporary file left behind
    assert tree(data.a.parent) == before, "the viewer wrote beside the rollouts file"
    # Appended rows: a refresh extends the index and rewrites the cache (still private).
    with open(data.a, "ab") as f:
        f.write(orjson.dumps(rollout(6, 0, 0.5)) + b"\n")
    resp = httpx.post(f"{base}/api/files/1/refresh", json={}, timeout=HTTP_TIMEOUT_S, trust_env=False)
    assert resp.status_code == 200 and resp.json()["changed"] and resp.json()["rows"] == len(data.rows_a) + 1
    assert stat.S_IMODE(cache_file.stat().st_mode) == 0o600
    assert tree(data.a.parent) == before


def test_second_start_loads_the_private_cache(launch: Launcher, layout: dict[str, Any]) -> None:
    data: ViewerFiles = layout["data"]
    base = _start(launch, layout)
    first = wait_ready(base, "1")
    launch.cleanup()
    base2 = _start(launch, layout)
    second = wait_ready(base2, "1")
    assert second["loaded_from_cache"] and second["index_cache"] == first["index_cache"]
    assert second["rows"] == len(data.rows_a)
    assert not (data.a.parent / f".{data.a.name}.ngv-index").exists()


def _token_viewer(
    launch: Launcher, layout: dict[str, Any], *extra: str, env: dict[str, str] | None = None
) -> tuple[Any, str, str]:
    """A viewer bound to 0.0.0.0; returns (process, http://127.0.0.1:<port>, the printed token)."""
    data: ViewerFiles = layout["data"]
    proc = launch(
        f"+jsonl_fpath={data.a}",
        "+host=0.0.0.0",
        *extra,
        cmd="ng_viewer",
        env={"XDG_CACHE_HOME": str(layout["cache"]), **(env or {})},
    )
    line = proc.wait_for_line(URL_RE, 60)
    assert line is not None, proc.output
    m = URL_RE.search(line)
    assert m is not None
    url = urlsplit(m.group(1))
    assert url.hostname == "127.0.0.1"
    token = parse_qs(url.query)["token"][0]
    return proc, f"http://127.0.0.1:{url.port}", token


def test_token_required_off_loopback(launch: Launcher, layout: dict[str, Any]) -> None:
    proc, base, token = _token_viewer(launch, layout)
    assert len(token) >= 20
    assert proc.stdout.count(token) == 1  # printed once, in the URL
    for path in ("/", "/api/files", "/static/viewer.js", "/api/files/1/rollouts/0"):
        resp = get(base + path)
        assert resp.status_code == 401, (path, resp.status_code)
        assert "token" in resp.json()["error"] and token not in resp.text
    wrong = httpx.get(
        f"{base}/api/files",
        # The last character changed (a token ending in "x" made "x" no change: a 1-in-64 flake).
        headers={"x-ng-viewer-token": token[:-1] + ("y" if token.endswith("x") else "x")},
        timeout=HTTP_TIMEOUT_S,
        trust_env=False,
    )
    assert wrong.status_code == 401
    assert post_open(base, layout["data"].a).status_code == 401
    # Accepted by header, bearer and query parameter.
    assert (
        httpx.get(
            f"{base}/api/files", headers={"x-ng-viewer-token": token}, timeout=HTTP_TIMEOUT_S, trust_env=False
        ).status_code
        == 200
    )
    assert (
        httpx.get(
            f"{base}/api/files",
            headers={"authorization": f"Bearer {token}"},
            timeout=HTTP_TIMEOUT_S,
            trust_env=False,
        ).status_code
        == 200
    )
    assert wait_ready_with(base, token)["state"] == "ready"
    one = get(f"{base}/api/files/1/rollouts/0", token=token)
    assert one.status_code == 200 and one.json()["data"]["agent_ref"]["name"] == AGENT
    # Off loopback any Host name is fine (the token is the protection).
    assert (
        httpx.get(
            f"{base}/api/files",
            headers={"host": "viewer.lan:80", "x-ng-viewer-token": token},
            timeout=HTTP_TIMEOUT_S,
            trust_env=False,
        ).status_code
        == 200
    )
    # The browser's way: /?token= sets an HttpOnly cookie and redirects to the bare page.
    with httpx.Client(timeout=HTTP_TIMEOUT_S, trust_env=False) as browser:
        first = browser.get(f"{base}/", params={"token": token})
        assert first.status_code == 303 and first.headers["location"] == "/"
        cookie = first.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie
        page = browser.get(f"{base}/")
        assert page.status_code == 200 and "<title>ng_viewer</title>" in page.text
        assert browser.get(f"{base}/api/files").status_code == 200  # the page's own fetch calls
        assert (
            browser.post(f"{base}/api/files", json={"path": "/etc/shadow"}).status_code == 403
        )  # allow-list still applies


def wait_ready_with(base: str, token: str) -> dict[str, Any]:
    deadline = time.monotonic() + READY_WAIT_S
    while True:
        st = get(f"{base}/api/files/1", token=token).json()
        if st["state"] != "indexing" or time.monotonic() > deadline:
            return st
        time.sleep(0.1)


def test_token_from_config_or_environment(launch: Launcher, layout: dict[str, Any]) -> None:
    given = "a-token-chosen-by-the-user-0123"
    _, base, token = _token_viewer(launch, layout, f"+token={given}")
    assert token == given
    assert get(f"{base}/api/files").status_code == 401
    assert get(f"{base}/api/files", token=given).status_code == 200
    launch.cleanup()
    env_token = "another-token-from-the-environment"
    _, base, token = _token_viewer(launch, layout, env={"NG_VIEWER_TOKEN": env_token})
    assert token == env_token
    assert get(f"{base}/api/files").status_code == 401
    assert get(f"{base}/api/files", token=env_token).status_code == 200
    proc = launch(f"+jsonl_fpath={layout['data'].a}", "+token=short", cmd="ng_viewer")
    assert proc.wait_exit(30) == 2 and "+token:" in proc.stderr and "at least 16 characters" in proc.stderr
    proc = launch(f"+jsonl_fpath={layout['data'].a}", cmd="ng_viewer", env={"NG_VIEWER_TOKEN": "short"})
    assert proc.wait_exit(30) == 2 and "$NG_VIEWER_TOKEN must have at least 16 characters" in proc.stderr


def test_loopback_needs_no_token_and_keeps_the_host_check(launch: Launcher, layout: dict[str, Any]) -> None:
    proc, base = start_viewer(
        launch, f"+jsonl_fpath={layout['data'].a}", env={"XDG_CACHE_HOME": str(layout["cache"])}
    )
    assert "token" not in base and not re.search(r"token=", proc.stdout)
    assert get(f"{base}/api/files").status_code == 200
    resp = httpx.get(
        f"{base}/api/files", headers={"host": "attacker.example:80"}, timeout=HTTP_TIMEOUT_S, trust_env=False
    )
    assert resp.status_code == 403
