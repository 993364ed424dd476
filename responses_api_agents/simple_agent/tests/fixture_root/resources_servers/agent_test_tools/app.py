"""agent_test_tools: a test-only resources server for simple_agent's tests (not an environment).

Tools:
  record {value: str}   appends ``value`` to this session's list and returns the list so far
  explode {}            raises (the agent must hand the error text to the model)
  refuse {reason: str}  answers HTTP 400 on purpose (a tool-level refusal the model should read)
  broken_infra {}       answers HTTP 503 (the infrastructure failing: the rollout must fail, not score)
  hang {seconds: float} answers only after ``seconds`` (a tool that hangs, for the agent's timeouts)
``/seed_session`` stores the row's ``task_id``; ``/verify`` reports what this session saw, and gives
reward 1.0 iff the session was seeded with the row's ``task_id`` and at least one value was recorded.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseSeedSessionRequest,
    BaseSeedSessionResponse,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)
from nemo_gym.server.base import get_session_id


class AgentTestToolsConfig(BaseResourcesServerConfig):
    pass


class RecordRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    value: str


class RefuseRequest(BaseModel):
    reason: str


class EmptyRequest(BaseModel):
    pass


class HangRequest(BaseModel):
    seconds: float


class AgentTestSeedRequest(BaseSeedSessionRequest):
    task_id: int | None = None


class AgentTestVerifyRequest(BaseVerifyRequest):
    task_id: int


class AgentTestVerifyResponse(AgentTestVerifyRequest, BaseVerifyResponse):
    seen_task_id: int | None
    session_calls: list[str]


class AgentTestToolsServer(SimpleResourcesServer):
    config: AgentTestToolsConfig
    sessions: dict[str, dict[str, Any]] = {}

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/record")(self.record)
        app.post("/explode")(self.explode)
        app.post("/refuse")(self.refuse)
        app.post("/broken_infra")(self.broken_infra)
        app.post("/hang")(self.hang)
        return app

    def _state(self, request: Request) -> dict[str, Any]:
        return self.sessions.setdefault(get_session_id(request), {"task_id": None, "calls": []})

    async def seed_session(self, request: Request, body: AgentTestSeedRequest) -> BaseSeedSessionResponse:
        self._state(request)["task_id"] = body.task_id
        return BaseSeedSessionResponse()

    async def record(self, request: Request, body: RecordRequest) -> dict[str, list[str]]:
        calls = self._state(request)["calls"]
        calls.append(body.value)
        return {"calls": list(calls)}

    async def explode(self, body: EmptyRequest) -> dict[str, str]:
        raise RuntimeError("kaboom: the tool broke")

    async def refuse(self, body: RefuseRequest) -> dict[str, str]:
        raise HTTPException(status_code=400, detail=f"refused: {body.reason}")

    async def broken_infra(self, body: EmptyRequest) -> JSONResponse:
        return JSONResponse({"error": {"message": "database unavailable"}}, status_code=503)

    async def hang(self, body: HangRequest) -> dict[str, str]:
        await asyncio.sleep(body.seconds)
        return {"status": "finally"}

    async def verify(self, request: Request, body: AgentTestVerifyRequest) -> AgentTestVerifyResponse:
        state = self._state(request)
        ok = state["task_id"] == body.task_id and bool(state["calls"])
        return AgentTestVerifyResponse(
            **body.model_dump(),
            reward=1.0 if ok else 0.0,
            seen_task_id=state["task_id"],
            session_calls=state["calls"],
        )


if __name__ == "__main__":
    AgentTestToolsServer.run_webserver()
