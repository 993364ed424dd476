"""workplace_assistant: a simulated company (email, calendar, analytics, project tasks, customer records)
held per session; reward 1 iff the session's final data equals what the row's ``ground_truth`` calls make.

Contract
--------
* ``POST /seed_session`` gives the session (the signed cookie the server issues) a private copy of the
  company in ``world_data/company.json`` (re-seeding resets it). Sessions never share data. The body
  must be a task row of this environment (:class:`WorkbenchSeedSessionRequest`: a missing or malformed
  field is a 422 naming it) of at most ``max_seed_session_body_bytes`` (else 413, before it is read).
* ``POST /<tool>`` for each of the 27 tools in :data:`world.TOOLS` (upstream's names, e.g.
  ``email_send_email``): the body is the tool's JSON arguments; the answer is ``{"output": <result>}``.
  A tool that cannot do what it is asked (unknown id, bad field, bad date, unknown argument) answers
  ``{"output": "Error: ..."}`` so the model can correct itself; nothing changes in that case. A tool
  called on a session that was never seeded (or already verified) answers 409: that is a harness
  fault, not the model's.
* ``POST /verify`` (row fields ``ground_truth`` (list of ``{name, arguments}``, or that list as a JSON
  string), ``id``, ``category``, ``environment_name``): applies ``ground_truth`` to a fresh copy of the
  company and compares it with this session's data (:func:`world.state_differences`: by id for
  records that existed, order-free for new ones, case-insensitive except status/list/board). Reward
  1.0 iff they are equivalent, so any call order reaching the same state scores. The response adds
  ``state_differences`` (what differs), ``num_state_differences`` and ``state_source``. The session's
  data is dropped here. Without a live session (a stored rollout posted again) the response's
  function calls are replayed on a fresh copy instead (``state_source: "replay"``); the tools are
  deterministic, so this gives the same state. A ``ground_truth`` call that fails is a broken row:
  /verify answers an error naming the call, never reward 0. ``failure_reason`` gives the number of
  differences and the first of them (``None`` when the reward is 1).
* A rollout whose tools ran on no session (the agent never seeded it, or it was evicted past
  ``max_sessions`` before its calls were done: its tool outputs hold the 409 of an unseeded session)
  is not scored: /verify answers 503. Replaying its calls would score actions that never took effect
  and that the model saw fail; the harness lost the state, not the model.
* Seeded but never verified sessions are bounded by ``max_sessions`` (oldest dropped first).
* With ``expose_tools_over_mcp: true`` the same tools are served over MCP, bound to the session
  (see ``nemo_gym/server/mcp``); :meth:`WorkbenchResourcesServer.call_session_tool` is the one entry point
  both transports use.
"""

import json
from typing import Any, ClassVar

from fastapi import Body, FastAPI, HTTPException, Request
from pydantic import BaseModel, Field, PrivateAttr, field_validator

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseSeedSessionRequest,
    BaseSeedSessionResponse,
    BaseVerifyRequest,
    BaseVerifyResponse,
    NeMoGymResponseCreateParamsNonStreaming,
    ReverifyMode,
    SimpleResourcesServer,
)
from nemo_gym.server.base import get_session_id
from resources_servers.workplace_assistant.world import (
    TOOLS,
    ToolError,
    World,
    apply_calls,
    call_tool,
    new_world,
    parse_arguments,
    state_differences,
    tool_schema,
)

SEED_BODY_LIMIT_SETTING = "max_seed_session_body_bytes"


class WorkbenchResourcesServerConfig(BaseResourcesServerConfig):
    max_sessions: int = Field(default=100_000, ge=1)
    # A task row (27 tool schemas, a prompt, the ground truth) is ~20 KB; /seed_session refuses more.
    max_seed_session_body_bytes: int = Field(default=1024 * 1024, gt=0)
    # Verify replays a stored response's calls when its session is gone, so re-verification works.
    REVERIFY_MODE: ClassVar[ReverifyMode] = ReverifyMode.STATELESS


class WorkbenchResponse(BaseModel):
    output: Any


class WorkbenchSeedSessionRequest(BaseSeedSessionRequest):
    """A task row as ``/seed_session`` accepts it: the fields ``/verify`` will need, checked up front
    (other fields of a row are ignored, as everywhere)."""

    responses_create_params: NeMoGymResponseCreateParamsNonStreaming
    ground_truth: list[dict[str, Any]] | str
    id: int
    category: str
    environment_name: str

    @field_validator("ground_truth")
    @classmethod
    def _calls(cls, value: list[dict[str, Any]] | str) -> list[dict[str, Any]] | str:
        ground_truth_calls(value)  # a ValueError names ground_truth
        return value


class WorkbenchVerifyRequest(BaseVerifyRequest):
    ground_truth: list[dict[str, Any]] | str
    id: int
    category: str
    environment_name: str


class WorkbenchVerifyResponse(WorkbenchVerifyRequest, BaseVerifyResponse):
    state_source: str
    state_differences: list[str]
    num_state_differences: int
    failure_reason: str | None = None


UNSEEDED_DETAIL = "This session has no workplace data"


class UnseededSessionError(HTTPException):
    def __init__(self) -> None:
        super().__init__(
            status_code=409,
            detail=f"{UNSEEDED_DETAIL}: call /seed_session first (and send the cookie it "
            "returns), or the session already ended with /verify.",
        )


def ran_without_session(output: list[Any]) -> bool:
    """Whether a tool call of this trajectory was refused for want of a session: an agent's tool output
    reporting this server's 409 (``Error: tool '<name>' answered HTTP 409: This session has no ...``).
    A tool output is the agent's, never the model's; this server's own outputs are JSON (``{"output":``),
    so a model's text echoed by a tool cannot start like this."""
    for item in output:
        if getattr(item, "type", None) != "function_call_output" or not isinstance(item.output, str):
            continue
        text = item.output
        if text.startswith("Error: tool ") and " answered HTTP 409: " in text and UNSEEDED_DETAIL in text:
            return True
    return False


def ground_truth_calls(ground_truth: list[dict[str, Any]] | str) -> list[dict[str, Any]]:
    """The row's ``ground_truth`` as a list of ``{name, arguments}``; a malformed one raises ValueError."""
    calls = ground_truth
    if isinstance(calls, str):
        try:
            calls = json.loads(calls)
        except json.JSONDecodeError as e:
            raise ValueError(f"ground_truth: not a JSON list of calls: {e}") from None
    if not isinstance(calls, list) or not all(
        isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls
    ):
        raise ValueError("ground_truth: must be a list of {name, arguments} objects")
    return calls


class SeedBodyLimit:
    """ASGI wrapper: a ``/seed_session`` body larger than ``limit`` bytes is refused with a 413 naming
    the setting, by its ``Content-Length`` before anything is read, else as it streams in. It only
    wraps ``receive``, so the request guard (run token, server-wide limit) still answers first."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    def _too_large(self, size: str) -> HTTPException:
        return HTTPException(
            413,
            f"/seed_session body of {size} bytes is larger than a task row may be "
            f"({SEED_BODY_LIMIT_SETTING}={self.limit}); raise {SEED_BODY_LIMIT_SETTING} if your rows are that big",
        )

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not str(scope.get("path", "")).endswith("/seed_session"):
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        seen = 0

        async def bounded() -> dict:
            nonlocal seen
            if declared is not None and declared.isdigit() and int(declared) > self.limit:
                raise self._too_large(declared.decode())
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise self._too_large(f"more than {self.limit}")
            return message

        await self.app(scope, bounded, send)


class WorkbenchResourcesServer(SimpleResourcesServer):
    config: WorkbenchResourcesServerConfig

    # session id -> that session's company. Handlers never await while touching it, so every tool call
    # is atomic on the event loop. Insertion order is seeding order (for the max_sessions bound).
    _worlds: dict[str, World] = PrivateAttr(default_factory=dict)

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.add_middleware(SeedBodyLimit, limit=self.config.max_seed_session_body_bytes)
        for name in TOOLS:
            app.post(f"/{name}", name=name, description=TOOLS[name].description)(self._route(name))
        return app

    def _route(self, name: str):
        async def tool(
            request: Request, body: dict[str, Any] = Body(default_factory=dict)
        ) -> WorkbenchResponse:
            return WorkbenchResponse(output=self.call_session_tool(get_session_id(request), name, body))

        return tool

    @staticmethod
    def tool_schemas() -> list[dict[str, Any]]:
        """Every tool as a Responses API function tool (what rows offer the model, and what MCP lists)."""
        return [tool_schema(name) for name in TOOLS]

    def mcp_tool_schemas(self) -> list[dict[str, Any]]:
        """The tools listed over MCP (``expose_tools_over_mcp: true``): the same 27 function tools."""
        return self.tool_schemas()

    def call_session_tool(self, session_id: str, name: str, arguments: dict[str, Any]) -> Any:
        """Run tool ``name`` on the session's data; a tool error becomes ``"Error: ..."`` output."""
        world = self._worlds.get(session_id)
        if world is None:
            raise UnseededSessionError()
        try:
            return call_tool(world, name, arguments)
        except ToolError as e:
            return f"Error: {e}"

    async def seed_session(
        self, request: Request, body: WorkbenchSeedSessionRequest
    ) -> BaseSeedSessionResponse:
        session_id = get_session_id(request)
        self._worlds.pop(session_id, None)
        self._worlds[session_id] = new_world()
        while len(self._worlds) > self.config.max_sessions:
            del self._worlds[next(iter(self._worlds))]
        return BaseSeedSessionResponse()

    async def verify(self, request: Request, body: WorkbenchVerifyRequest) -> WorkbenchVerifyResponse:
        expected = new_world()
        try:
            apply_calls(expected, ground_truth_calls(body.ground_truth), strict=True)
        except (ToolError, ValueError) as e:
            raise HTTPException(422, f"row id {body.id}: ground_truth cannot be applied: {e}") from None
        actual = self._worlds.pop(get_session_id(request), None)
        source = "session"
        if actual is None and ran_without_session(body.response.output):
            raise HTTPException(
                503,
                f"row id {body.id}: this rollout's tool calls ran on no session (answered 409: never seeded, "
                "or evicted past max_sessions): its actions never took effect, so it is not scored",
            )
        if actual is None:
            source = "replay"
            actual = new_world()
            calls = [
                {"name": item.name, "arguments": item.arguments}
                for item in body.response.output
                if item.type == "function_call"
            ]
            apply_calls(actual, calls, strict=False)
        diffs = state_differences(actual, expected)
        reason = (
            f"{len(diffs)} difference(s) from the expected final data, first: {diffs[0]}" if diffs else None
        )
        return WorkbenchVerifyResponse.from_request(
            body,
            reward=0.0 if diffs else 1.0,
            failure_reason=reason,
            state_source=source,
            state_differences=diffs,
            num_state_differences=len(diffs),
        )


__all__ = [
    "WorkbenchResourcesServer",
    "WorkbenchResourcesServerConfig",
    "WorkbenchSeedSessionRequest",
    "WorkbenchVerifyRequest",
    "WorkbenchVerifyResponse",
    "ground_truth_calls",
    "parse_arguments",
]

if __name__ == "__main__":
    WorkbenchResourcesServer.run_webserver()
