"""The bare stack ``ng_bench`` compares against: the least a rollout could cost on our HTTP stack.

Run as ``python -m nemo_gym.bench_bare`` with ``NG_BARE_ROLE`` = ``echo_a`` | ``echo_b`` | ``agent``
and ``NG_BARE_FD`` (a listening socket). An echo answers every POST with the body it got. The agent
answers ``POST /run`` after making the inner calls in ``NG_BARE_PLAN`` (``a``/``b`` per call: which
echo) one after another, each carrying the request body, as a real agent would; no validation, no
logic. Same stack as the real servers: FastAPI + uvicorn, aiohttp client, orjson.
"""

from __future__ import annotations

import os
import socket

import aiohttp
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response


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

    urls = {
        "a": f"http://127.0.0.1:{os.environ['NG_BARE_ECHO_A']}/call",
        "b": f"http://127.0.0.1:{os.environ['NG_BARE_ECHO_B']}/call",
    }
    plan = [urls[c] for c in os.environ["NG_BARE_PLAN"].split(",") if c]
    state: dict[str, aiohttp.ClientSession] = {}

    @app.post("/run")
    async def run(request: Request) -> Response:
        session = state.get("s")
        if session is None:
            session = state["s"] = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=1024, keepalive_timeout=30), cookie_jar=aiohttp.DummyCookieJar()
            )
        body = await request.body()
        out = body
        for url in plan:
            async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
                out = await resp.read()
        return Response(out, media_type="application/json")

    return app


if __name__ == "__main__":
    sock = socket.socket(fileno=int(os.environ["NG_BARE_FD"]))
    config = uvicorn.Config(build_app(), log_level="warning", access_log=False, timeout_keep_alive=60, backlog=4096)
    uvicorn.Server(config).run(sockets=[sock])
