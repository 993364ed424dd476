"""The run token guards WebSocket routes too: a drop-in environment's ``@app.websocket`` route is not a
way around it. A real server (under ``RunHelper``, uvicorn with the ``websockets`` implementation) and
a real WebSocket client."""

from __future__ import annotations

from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from nemo_gym.tools.testing import running_servers, server_url
from tests.conftest import write_server_folder

WS_APP = """
from fastapi import WebSocket

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)


class WsServer(SimpleResourcesServer):
    config: BaseResourcesServerConfig

    def setup_webserver(self):
        app = super().setup_webserver()

        @app.websocket("/ws")
        async def echo(ws: WebSocket) -> None:
            await ws.accept()
            await ws.send_text("served: " + await ws.receive_text())
            await ws.close()

        return app

    async def verify(self, body: BaseVerifyRequest) -> BaseVerifyResponse:
        return BaseVerifyResponse(**body.model_dump(), reward=1.0)


if __name__ == "__main__":
    WsServer.run_webserver()
"""


@pytest.fixture(scope="module")
def ws_run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("ws")
    write_server_folder(root, "resources_servers", "ws_probe", WS_APP)
    extra = {"ws_probe": {"resources_servers": {"ws_probe": {"entrypoint": "app.py"}}}}
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)  # the server folder is found under the working directory
        with running_servers([], extra, with_scripted_model=False) as helper:
            yield helper


def _ws_url(run: Any) -> str:
    return server_url(run, "ws_probe").replace("http://", "ws://", 1) + "/ws"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}], ids=["no token", "wrong token"])
def test_a_websocket_route_without_the_run_token_is_closed_with_policy_violation(
    ws_run: Any, headers: dict[str, str]
) -> None:
    with pytest.raises(ConnectionClosed) as closed:  # the app's "served: ..." never comes
        with connect(_ws_url(ws_run), additional_headers=headers, open_timeout=10, close_timeout=5) as ws:
            ws.send("hello")
            ws.recv(timeout=10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008, closed.value
    assert "run token" in closed.value.rcvd.reason


def test_a_websocket_route_with_the_run_token_is_served(ws_run: Any) -> None:
    headers = {"Authorization": f"Bearer {ws_run.supervisor.auth_token}"}
    with connect(_ws_url(ws_run), additional_headers=headers, open_timeout=10, close_timeout=5) as ws:
        ws.send("hello")
        assert ws.recv(timeout=10) == "served: hello"
