"""Resources servers: the environment side of a rollout (tools, per-rollout state, verifier).

Contract
--------
* ``POST /seed_session`` receives the task row (``BaseSeedSessionRequest``, extra fields kept) and
  may set up per-rollout state keyed by ``request.state.session_id``.
* Each tool is ``POST /<tool_name>`` with a pydantic body; a tool that raises answers 500 with the
  error text, which the agent hands to the model as the tool output.
* ``POST /verify`` receives the task row plus the final ``response`` and returns the same fields
  plus ``reward`` (a float). Every task field of the row survives into the verify response.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict

from nemo_gym.openai_utils import NeMoGymResponse, NeMoGymResponseCreateParamsNonStreaming
from nemo_gym.server_utils import BaseRunServerInstanceConfig, BaseServer


class BaseResourcesServerConfig(BaseRunServerInstanceConfig):
    pass


class BaseSeedSessionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")


class BaseSeedSessionResponse(BaseModel):
    model_config = ConfigDict(extra="allow")


class BaseRunRequest(BaseModel):
    """A task row: the model request plus any task fields (ground truth, ids, ...)."""

    model_config = ConfigDict(extra="allow")

    responses_create_params: NeMoGymResponseCreateParamsNonStreaming


class BaseVerifyRequest(BaseRunRequest):
    response: NeMoGymResponse


class BaseVerifyResponse(BaseVerifyRequest):
    reward: float


class SimpleResourcesServer(BaseServer):
    """Subclass, declare ``config: YourConfig``, register tools in ``setup_webserver``, implement ``verify``."""

    config: BaseResourcesServerConfig

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/seed_session")(self.seed_session)
        app.post("/verify")(self.verify)
        return app

    async def seed_session(self, request: Request, body: BaseSeedSessionRequest) -> BaseSeedSessionResponse:
        return BaseSeedSessionResponse()

    @abstractmethod
    async def verify(self, body: BaseVerifyRequest) -> BaseVerifyResponse: ...


def function_calls(response: NeMoGymResponse | dict[str, Any], name: str | None = None) -> list[Any]:
    """The function_call items of a response (optionally only those of one tool), in order."""
    output = response.get("output", []) if isinstance(response, dict) else response.output
    out = []
    for item in output:
        t = item.get("type") if isinstance(item, dict) else getattr(item, "type", None)
        n = item.get("name") if isinstance(item, dict) else getattr(item, "name", None)
        if t == "function_call" and (name is None or n == name):
            out.append(item)
    return out
