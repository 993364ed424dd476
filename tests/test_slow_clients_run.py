"""No connection flood can stop the head server of a run or ``ng_viewer`` either.

tests/test_slow_clients.py proves the connection limits on a server of ours; here the two servers that
are not ours-by-class get the same treatment, each started as a user starts it (``ng_run``,
``ng_viewer``) with short limits so the test is quick: connections that send nothing or half a request
head are closed within the head timeout (half a head is told 408), and while a flood holds every
place an untrusted client may hold, a request with the token is still served.
"""

from __future__ import annotations

import resource
import socket
import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from tests.conftest import EXAMPLE_CONFIG_PATHS, Launcher
from tests.test_slow_clients import _closed_by_server, _connect
from tests.test_viewer_app import URL_RE
from tests.test_viewer_support import write_files

TIMEOUT_S = 1.5
# Small enough that the flood below fills every place: with this hard limit ng_viewer accepts ~60-70
# connections at once (nemo_gym.client.fd_limits: half of what is left after the descriptors it keeps).
NOFILE = 200
FLOOD = 120


def _wait_all_closed(held: list[socket.socket], bound_s: float) -> dict[int, bytes]:
    deadline = time.monotonic() + bound_s
    outcome: dict[int, bytes] = {}
    while time.monotonic() < deadline and len(outcome) < len(held):
        for i, s in enumerate(held):
            if i not in outcome:
                got = _closed_by_server(s)
                if got is not None:
                    outcome[i] = got
        time.sleep(0.05)
    return outcome


def _get(port: int, path: str, headers: dict[str, str], timeout_s: float) -> bytes:
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n{head}\r\n".encode())
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
        return answer


def test_head_server_closes_silent_and_half_sent_connections(launch: Launcher) -> None:
    run = launch(EXAMPLE_CONFIG_PATHS, "+head_server.port=0", f"+request_head_timeout_s={TIMEOUT_S}")
    run.wait_ready()
    port = urlsplit(run.head_url).port
    assert port is not None
    silent = [_connect(port) for _ in range(5)]
    half_heads = [_connect(port, b"GET / HTTP/1.1\r\nHost: x\r\nX-Pad: ") for _ in range(5)]
    try:
        # Within the bound a request with the run token is answered as usual...
        answer = _get(port, "/", {"Authorization": f"Bearer {run.token}"}, timeout_s=5)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
        # ...and every connection that did not send a whole head is closed (before: open for good).
        outcome = _wait_all_closed([*silent, *half_heads], 2 * TIMEOUT_S + 5)
        assert len(outcome) == 10, f"{10 - len(outcome)} connection(s) to the head server still open"
        assert all(outcome[i].startswith(b"HTTP/1.1 408") for i in range(5, 10)), outcome
    finally:
        for s in [*silent, *half_heads]:
            s.close()


def _low_nofile() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


def test_viewer_serves_token_bearers_through_a_flood(launch: Launcher, tmp_path: Path) -> None:
    data = write_files(tmp_path / "data")
    proc = launch(
        f"+jsonl_fpath={data.a}",
        "+host=0.0.0.0",  # off loopback: a token is required
        f"+request_head_timeout_s={TIMEOUT_S}",
        "+reserved_connection_fraction=0.25",
        cmd="ng_viewer",
        env={"XDG_CACHE_HOME": str(tmp_path / "cache")},
        preexec_fn=_low_nofile,
    )
    line = proc.wait_for_line(URL_RE, 60)
    assert line is not None, proc.output
    url = urlsplit(URL_RE.search(line).group(1))  # type: ignore[union-attr]
    token = parse_qs(url.query)["token"][0]
    port = url.port
    assert port is not None
    flood: list[socket.socket] = []
    try:
        flood = [_connect(port) for _ in range(FLOOD - 10)]
        flood += [_connect(port, b"GET /api/files HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: ") for _ in range(10)]
        time.sleep(0.3)
        answer = _get(port, "/api/files", {"X-NG-Viewer-Token": token}, timeout_s=5)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
        open_meanwhile = sum(_closed_by_server(s) is None for s in flood)
        assert open_meanwhile >= 30, open_meanwhile  # the flood was there while the token bearer was served
        # A request without the token is no reason to keep a place: it gets its 401 like any other.
        assert _get(port, "/api/files", {}, timeout_s=5).startswith(b"HTTP/1.1 401")
        outcome = _wait_all_closed(flood, 2 * TIMEOUT_S + 8)
        assert len(outcome) == len(flood), (
            f"{len(flood) - len(outcome)} connection(s) to ng_viewer still open"
        )
        assert proc.proc.poll() is None
    finally:
        for s in flood:
            s.close()
