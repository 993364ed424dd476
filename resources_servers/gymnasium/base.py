"""GymnasiumServer: the base of resources servers that speak Gymnasium's reset/step API to an agent
(``responses_api_agents/gymnasium_agent``), with NVIDIA NeMo Gym's names and routes.

Contract
--------
* ``POST /reset`` (the task row) -> :class:`EnvResetResponse` ``{observation, info}``: starts this
  session's episode (the session is the signed cookie the server issues).
* ``POST /step`` (the task row plus ``response``: the model's latest turn) -> :class:`EnvStepResponse`
  ``{observation, reward, terminated, truncated, info}``. ``info["tool_outputs"]`` may carry
  ``[{call_id, output}]`` answers to the turn's function calls; the agent appends them as
  ``function_call_output`` items and ``observation`` (if any) as a user message. When the episode
  ends (``terminated`` or ``truncated``) the session's state is dropped (:meth:`close_session`).
* ``POST /close``: drops the session's state (the agent calls it when ``/reset``'s ``info`` says
  ``supports_explicit_close: true``, also after a failed rollout). An optional body ``{"reason": ...}``
  (``client_disconnected`` when the agent's caller went away) is counted in ``closed_by_reason``.
* Subclasses implement ``async reset(metadata, session_id) -> (observation, info)`` and
  ``async step(action, metadata, session_id) -> (observation, reward, terminated, truncated, info)``;
  ``metadata`` is the row's fields other than ``responses_create_params`` / ``response``. Keep per
  session state in ``self.session_state[session_id]``.
* ``/verify`` is not part of this protocol (the agent sums the step rewards): it answers 501 naming
  the agent to use, never a reward.
"""

from __future__ import annotations

import json
from abc import abstractmethod
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field

from nemo_gym.base_resources_server import BaseVerifyRequest, BaseVerifyResponse, SimpleResourcesServer
from nemo_gym.openai_utils import (
    NeMoGymResponse,
    NeMoGymResponseCreateParamsNonStreaming,
    NeMoGymResponseFunctionToolCall,
)
from nemo_gym.server.base import get_session_id

__all__ = [
    "EnvResetRequest",
    "EnvResetResponse",
    "EnvStepRequest",
    "EnvStepResponse",
    "GymnasiumServer",
    "extract_text",
]


class EnvResetRequest(BaseModel):
    # The row's other fields are the episode's metadata (upstream semantics), so they are kept.
    model_config = ConfigDict(extra="allow")
    responses_create_params: NeMoGymResponseCreateParamsNonStreaming


class EnvResetResponse(BaseModel):
    observation: str | None = None
    info: dict[str, Any] = {}


class EnvStepRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    responses_create_params: NeMoGymResponseCreateParamsNonStreaming
    response: NeMoGymResponse


class EnvStepResponse(BaseModel):
    observation: str | None = None
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = {}


class EnvCloseRequest(BaseModel):
    """``/close``'s optional body: why the episode is closed (counted per reason)."""

    reason: str | None = None


def extract_text(response: NeMoGymResponse) -> str:
    """All ``output_text`` of the response's assistant messages, joined."""
    parts = []
    for item in response.output:
        if item.type == "message":
            content = item.content
            if isinstance(content, str):
                parts.append(content)
            else:
                parts.extend(c.text for c in content if c.type == "output_text")
    return "".join(parts)


class GymnasiumServer(SimpleResourcesServer):
    """Gymnasium-style resources server; subclass and implement :meth:`reset` and :meth:`step`."""

    session_state: dict[str, Any] = Field(default_factory=dict)
    closed_by_reason: dict[str, int] = Field(default_factory=dict)  # /close calls that said why

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/reset")(self._reset_endpoint)
        app.post("/step")(self._step_endpoint)
        app.post("/close")(self._close_endpoint)
        return app

    @staticmethod
    def _metadata(body: BaseModel) -> dict[str, Any]:
        return dict(body.model_extra or {})

    async def _reset_endpoint(self, request: Request, body: EnvResetRequest) -> EnvResetResponse:
        observation, info = await self.reset(self._metadata(body), get_session_id(request))
        return EnvResetResponse(observation=observation, info=info)

    async def _step_endpoint(self, request: Request, body: EnvStepRequest) -> EnvStepResponse:
        session_id = get_session_id(request)
        observation, reward, terminated, truncated, info = await self.step(
            body.response, self._metadata(body), session_id
        )
        if terminated or truncated:
            await self.close_session(session_id)
        return EnvStepResponse(
            observation=observation, reward=reward, terminated=terminated, truncated=truncated, info=info
        )

    async def _close_endpoint(self, request: Request, body: EnvCloseRequest | None = None) -> dict[str, bool]:
        if body is not None and body.reason:
            self.closed_by_reason[body.reason] = self.closed_by_reason.get(body.reason, 0) + 1
        await self.close_session(get_session_id(request))
        return {"closed": True}

    async def reset(self, metadata: dict[str, Any], session_id: str | None = None) -> tuple[str | None, dict]:
        return None, {}

    @abstractmethod
    async def step(
        self, action: NeMoGymResponse, metadata: dict[str, Any], session_id: str | None = None
    ) -> tuple[str | None, float, bool, bool, dict]: ...

    async def close_session(self, session_id: str | None) -> None:
        self.session_state.pop(session_id, None)

    @staticmethod
    def tool_output(call: NeMoGymResponseFunctionToolCall, result: Any) -> dict[str, str]:
        """One ``info["tool_outputs"]`` entry answering ``call``."""
        return {
            "call_id": call.call_id,
            "output": result if isinstance(result, str) else json.dumps(result, default=str),
        }

    async def verify(self, body: BaseVerifyRequest) -> BaseVerifyResponse:
        raise HTTPException(
            501,
            f"{type(self).__name__} is a Gymnasium-style server: rollouts run through /reset and /step with "
            "responses_api_agents/gymnasium_agent, which sums the step rewards; /verify is not offered.",
        )
