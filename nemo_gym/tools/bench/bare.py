"""The bare stack ``ng_bench`` compares against: the least a rollout could cost on our HTTP stack.

Run as ``python -m nemo_gym.tools.bench.bare`` with ``NG_BARE_ROLE`` = ``echo_a`` | ``echo_b`` | ``agent``
and ``NG_BARE_FD`` (a listening socket). An echo answers every POST with the body it got. The agent
answers ``POST /run`` after making the inner calls in ``NG_BARE_PLAN`` (``a``/``b`` per call: which
echo) one after another, each carrying the request body, as a real agent would; no validation, no
logic. Same stack as the real servers: FastAPI + uvicorn, our keep-alive HTTP transport, orjson.
"""

from __future__ import annotations

import os
import socket

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response

from nemo_gym.client.fd_limits import client_socket_budget, raise_open_file_limit
from nemo_gym.client.http_transport import HttpTransport


def build_app() -> FastAPI:
    role = os.environ["NG_BARE_ROLE"]
    app = FastAPI()

    @app.get("/")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    if role != "agent":

        @app.post("/{path:path}")
        async def echo(request: Request) -> Response:
            return Response(await request.body(), media_type="application/json")

        return app

    ports = {"a": int(os.environ["NG_BARE_ECHO_A"]), "b": int(os.environ["NG_BARE_ECHO_B"])}
    plan = [ports[c] for c in os.environ["NG_BARE_PLAN"].split(",") if c]
    state: dict[str, HttpTransport] = {}
    headers = {"Content-Type": "application/json"}

    @app.post("/run")
    async def run(request: Request) -> Response:
        transport = state.get("t")
        if transport is None:
            # Sized as ServerClient's pool is: 1,024 requests in flight, sockets up to the fd budget.
            transport = state["t"] = HttpTransport(max_connections=1024, max_sockets=client_socket_budget())
        body = await request.body()
        out = body
        for port in plan:
            out = (await transport.request("POST", "127.0.0.1", port, "/call", body, headers, 600))._body
        return Response(out, media_type="application/json")

    return app


if __name__ == "__main__":
    raise_open_file_limit()
    sock = socket.socket(fileno=int(os.environ["NG_BARE_FD"]))
    config = uvicorn.Config(
        build_app(), log_level="warning", access_log=False, timeout_keep_alive=60, backlog=4096
    )
    uvicorn.Server(config).run(sockets=[sock])
