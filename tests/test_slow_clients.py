"""Slow and silent clients cannot stop a server (nemo_gym.server.accept_limit's ConnectionLimits).

Proven here against a real server process (our request guard, the run token, BoundedServer with a
small cap and short limits so the flood is small and quick): connections that send nothing or half a
head are closed within the head timeout (half a head is told 408), a stalled body within the body
timeout, idle keep-alive connections within the keep-alive timeout; while the flood holds every place
it may, a request with the run token is served; our keep-alive pool reconnects by itself after the
server closed its idle connections.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from nemo_gym.client.http_transport import HttpTransport

REPO = Path(__file__).resolve().parents[1]
TOKEN = "flood-test-token"
CAP = 40
RESERVED = 0.25  # 10 of the 40 places are kept for clients that sent the token
TIMEOUT_S = 1.5  # head, body-idle and keep-alive timeouts of the server under test

SERVER = textwrap.dedent(f"""
    import socket
    from nemo_gym.server_utils import BaseRunServerInstanceConfig, BaseServer, ServerClient

    config = BaseRunServerInstanceConfig(
        name="flooded", request_head_timeout_s={TIMEOUT_S}, request_body_idle_timeout_s={TIMEOUT_S},
        keep_alive_timeout_s={TIMEOUT_S}, reserved_connection_fraction={RESERVED},
    )
    server = BaseServer(config=config, server_client=ServerClient(global_config_dict={{}}))
    app = server.complete_app(server.setup_webserver())

    @app.post("/echo")
    async def echo(body: dict) -> dict:
        return body

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)
    print(sock.getsockname()[1], flush=True)
    server.serve_app(app, sock, max_accepted={CAP})
""")


def _start_server() -> tuple[subprocess.Popen, int]:
    env = {**os.environ, "NEMO_GYM_AUTH_TOKEN": TOKEN, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def _connect(port: int, data: bytes = b"") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    if data:
        s.sendall(data)
    s.setblocking(False)
    return s


def _closed_by_server(s: socket.socket) -> bytes | None:
    """What the server sent before closing ``s``, or None while it is still open."""
    got = b""
    while True:
        try:
            chunk = s.recv(65536)
        except BlockingIOError:
            return None
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk


def _get_with_token(port: int, timeout_s: float) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(f"GET / HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode())
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
        return answer


def test_silent_and_slow_connections_are_closed_and_token_bearers_are_served() -> None:
    proc, port = _start_server()
    held: list[socket.socket] = []
    try:
        # A client with the token that stalls in the middle of its body (trusted, so never evicted).
        body_head = (
            f"POST /echo HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"a": '
        ).encode()
        stalled_bodies = [_connect(port, body_head) for _ in range(2)]
        time.sleep(0.3)
        # The flood: more connections than the cap, silent or with half a head, no token.
        silent = [_connect(port) for _ in range(CAP)]
        half_heads = [_connect(port, b"GET / HTTP/1.1\r\nHost: x\r\nX-Pad: ") for _ in range(10)]
        held = [*stalled_bodies, *silent, *half_heads]
        time.sleep(0.3)

        # (b) While the flood holds every place it may, a request with the token is served.
        answer = _get_with_token(port, timeout_s=5)
        assert answer.startswith(b"HTTP/1.1 200"), answer
        still_open = sum(_closed_by_server(s) is None for s in [*silent, *half_heads])
        assert still_open >= CAP * (1 - RESERVED) - 3, still_open  # the flood was there meanwhile

        # (a) Every flood connection and the stalled bodies are closed within the bounds.
        deadline = time.monotonic() + 2 * TIMEOUT_S + 5
        outcome: dict[int, bytes | None] = {}
        while time.monotonic() < deadline and len(outcome) < len(held):
            for i, s in enumerate(held):
                if i not in outcome:
                    got = _closed_by_server(s)
                    if got is not None:
                        outcome[i] = got
            time.sleep(0.05)
        assert len(outcome) == len(held), f"{len(held) - len(outcome)} connection(s) still open"
        last_half_heads = [outcome[held.index(s)] for s in half_heads[-5:]]
        assert all(a.startswith(b"HTTP/1.1 408") for a in last_half_heads), last_half_heads
        assert proc.poll() is None
    finally:
        for s in held:
            s.close()
        proc.kill()
        proc.communicate(timeout=10)


def test_refused_clients_are_closed_and_the_keep_alive_pool_reconnects_by_itself() -> None:
    proc, port = _start_server()
    try:
        # A request without the token gets its 401 and the connection is closed: it keeps no place.
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
        s.close()
        assert answer.startswith(b"HTTP/1.1 401") and b"connection: close" in answer.lower(), answer

        async def twice() -> list[int]:
            transport = HttpTransport(max_connections=4)
            headers = {"Authorization": f"Bearer {TOKEN}"}
            statuses = []
            try:
                for _ in range(2):
                    resp = await transport.request("GET", "127.0.0.1", port, "/", None, headers, 10.0)
                    statuses.append(resp.status)
                    await asyncio.sleep(TIMEOUT_S + 0.7)  # the server closes the idle connection
            finally:
                await transport.close()
            return statuses

        assert asyncio.run(twice()) == [200, 200]
    finally:
        proc.kill()
        proc.communicate(timeout=10)


def test_a_client_that_stops_reading_the_answer_is_closed() -> None:
    """Before: a client that sent a request and never read the (large) answer held its connection and
    the handler, blocked on writing, for good."""
    proc, port = _start_server()
    payload = "x" * 20_000_000  # far more than the socket buffers hold: the server's writes must pause
    body = ('{"a": "' + payload + '"}').encode()
    try:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(5)
        s.connect(("127.0.0.1", port))
        head = (
            f"POST /echo HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        s.sendall(head.encode() + body)
        time.sleep(2 * TIMEOUT_S + 2)  # read nothing: the server's writes stall past its bound
        received = 0
        s.settimeout(10)
        try:
            while chunk := s.recv(1 << 20):
                received += len(chunk)
        except (ConnectionResetError, TimeoutError):
            pass
        s.close()
        assert received < len(body), "the whole answer arrived: the stalled connection was kept"
        assert _get_with_token(port, timeout_s=5).startswith(b"HTTP/1.1 200")  # the server is fine
    finally:
        proc.kill()
        proc.communicate(timeout=10)
