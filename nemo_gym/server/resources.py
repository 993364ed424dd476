"""Resources servers: the environment side of a rollout (tools, per-rollout state, verifier).

Contract
--------
* ``POST /seed_session`` receives the task row (``BaseSeedSessionRequest``) and may set up
  per-rollout state keyed by ``request.state.session_id``.
* Each tool is ``POST /<tool_name>`` with a pydantic body; a tool that raises answers 500 with the
  error text, which the agent hands to the model as the tool output.
* ``POST /seed_session`` also takes NeMo Gym 0.7's environment-server seed (``ResourcesSeedSessionRequest``:
  a ``resources_session_id`` the caller assigns, the episode, the task and its ``task_data``) and answers
  ``ResourcesSeedSessionResponse`` naming that id; ``POST /close_session`` (``ResourcesCloseSessionRequest``)
  releases it through ``close_resources_session``. A server that keeps state per session must: answer a
  repeated seed of the same id and episode with the same session; refuse a seed of an id already bound to
  another episode or task, or already closed (a close may race ahead of its seed: the late seed must not
  create the session); answer a close of an unknown or closed id as done; and raise when releasing fails
  rather than record the session as closed, so the caller can retry. The default keeps no state and only
  echoes the id. :func:`nemo_gym.tools.session_conformance.check_resources_session_contract` checks these
  rules through a server's routes.
* ``POST /verify`` receives the task row plus the final ``response`` and returns the fields its
  request model declares plus ``reward`` (a float).
* Request and response models **ignore undeclared fields** (pydantic's default, as upstream): a
  verifier reads only what its request model declares, so a stored rollout (carrying an old
  ``reward`` and metrics) can be posted to ``/verify`` again and ``XVerifyResponse(**body.model_dump(),
  reward=...)`` never sees a duplicate key. The row's other fields are not lost: the agent lays the
  verify response over the row it was given, so every task field survives into the rollout output.
* ``POST /aggregate_metrics`` (``AggregateMetricsRequest`` -> ``AggregateMetrics``) computes metrics over a
  run's verify responses through the overridable ``compute_metrics``/``get_key_metrics`` hooks
  (:mod:`nemo_gym.kit.reward_profile`). ``GET /reverify_mode`` answers the config class's
  ``REVERIFY_MODE`` (whether ``/verify`` can be re-run later from a stored rollout alone).
* An oversized answer is the model's own doing: a ``/verify`` whose response holds more model-written
  characters (:func:`model_written_chars`) than ``verify_max_model_chars`` answers reward 0 with a
  ``failure_reason`` and the request's fields, without running the verifier (whose cost could grow with
  the answer); per-rollout state such an answer leaves is freed as for an abandoned rollout.
* ``BaseMultiRewardVerifyResponse`` adds ``reward_components``; ``reward`` must equal their sum.
* Names follow NVIDIA NeMo Gym's ``nemo_gym.server.resources`` (our face at that path imports them
  from here) so its environments import them unchanged. ``expose_tools_over_mcp: true`` also serves the tools over MCP at ``/mcp``
  (:mod:`nemo_gym.server.mcp`, which defines ``MCPServerMetadata`` and the ``NEMO_GYM_MCP_*`` names).
* ``GET /row_schema`` publishes the JSON schema of what a task row must carry for this environment:
  the fields of the ``/seed_session`` and ``/verify`` request bodies, without ``response`` (the
  agent adds it). ``ng_collect_rollouts`` checks every row against it before sending anything.
"""

from __future__ import annotations

import functools
import inspect
import math
from abc import abstractmethod
from collections.abc import Callable
from enum import StrEnum
from typing import Any, ClassVar, Generic, Self, TypeVar

import orjson
from fastapi import FastAPI
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, JsonValue, create_model, field_validator, model_validator

from nemo_gym.config.types import BaseRunServerInstanceConfig
from nemo_gym.kit.reward_profile import AggregateMetricsMixin
from nemo_gym.openai_utils.responses import (
    NeMoGymResponse,
    NeMoGymResponseCreateParamsNonStreaming,
    text_of_message,
)
from nemo_gym.server.base import SimpleServer
from nemo_gym.server.episodes import EpisodeId, TaskId, validate_failure_kind
from nemo_gym.server.mcp import MCPServerMetadata
from nemo_gym.server.metrics.install import observed_verify

VerificationInputT = TypeVar("VerificationInputT")


class ReverifyMode(StrEnum):
    """Whether ``/verify`` can be re-run later from a stored rollout alone."""

    STATELESS = "stateless"  # yes: verify reads only the row and the response
    UNSUPPORTED = "unsupported"  # no: verify needs state from the rollout (tools, session)
    UNKNOWN = "unknown"


class BaseResourcesServerConfig(BaseRunServerInstanceConfig):
    # Also serve the tools over MCP at /mcp, bound to the session /seed_session announces (nemo_gym/server/mcp).
    expose_tools_over_mcp: bool = False
    # An MCP client's ``GET /mcp`` event stream that carries no event for this long is ended (stateless
    # MCP never sends one there; the client may open it again).
    mcp_stream_idle_timeout_s: float = Field(default=60.0, gt=0)
    # What /verify reads of a model's own writing (message and reasoning text, tool-call arguments, over the
    # whole response): past it the rollout scores 0 with a failure_reason, and the verifier is not run.
    verify_max_model_chars: int = Field(default=4_000_000, ge=1)
    # Servers override it on their config class: ``REVERIFY_MODE: ClassVar[ReverifyMode] = ReverifyMode.STATELESS``.
    REVERIFY_MODE: ClassVar[ReverifyMode] = ReverifyMode.UNKNOWN


class BaseSeedSessionRequest(BaseModel):
    """What ``/seed_session`` reads of a task row; subclasses declare the fields they need."""


class BaseSeedSessionResponse(BaseModel):
    model_config = ConfigDict(extra="allow")


class ResourcesSeedSessionRequest(BaseModel):
    """An environment server's seed: set up state under ``resources_session_id`` (the caller's id) for one
    episode of one task (the rules a stateful server follows are in the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    resources_session_id: str = Field(min_length=1)
    episode_id: EpisodeId
    task_id: TaskId
    task_data: dict[str, JsonValue]


class ResourcesSeedSessionResponse(BaseModel):
    """The seeded session's id, and how the agent reaches the session's tools over MCP if it does.
    ``sandbox_access`` describes a sandbox the resources server lends the agent; it is passed on as
    given (our sandboxes are never lent across servers, so no server here sets it)."""

    model_config = ConfigDict(extra="forbid")

    resources_session_id: str
    resources_tools: MCPServerMetadata | None = None
    sandbox_access: dict[str, JsonValue] | None = None


class ResourcesVerifyRequest(BaseModel, Generic[VerificationInputT]):
    """An environment server's typed output for a resources server to verify."""

    model_config = ConfigDict(extra="forbid")

    episode_id: EpisodeId
    task_id: TaskId
    verification_input: VerificationInputT


class ResourcesCloseSessionRequest(BaseModel):
    """Release the state seeded under ``resources_session_id`` for ``episode_id``."""

    model_config = ConfigDict(extra="forbid")

    resources_session_id: str
    episode_id: EpisodeId


class ResourcesCloseSessionResponse(BaseModel):
    """The session that is closed."""

    model_config = ConfigDict(extra="forbid")

    resources_session_id: str


class BaseRunRequest(BaseModel):
    """A task row as a verifier sees it: the model request plus the task fields a subclass declares
    (ground truth, ids, ...). Undeclared fields are ignored (see the module docstring)."""

    responses_create_params: NeMoGymResponseCreateParamsNonStreaming


class BaseVerifyRequest(BaseRunRequest):
    response: NeMoGymResponse


class BaseVerifyResponse(BaseVerifyRequest):
    reward: float
    # NeMo Gym 0.7's failure fields, written out only when set. ``mask_sample``: this reward is no
    # measurement of the policy (the environment or its infrastructure failed: a lost session, a judge
    # down); ng_collect_rollouts writes such a rollout to the failures file, never as a score.
    # ``failure_kind``: one of nemo_gym.server.episodes.FAILURE_KINDS or '<server>:<kind>' (another is
    # kept, with a warning); ``failure_reason``: the occurrence, in words.
    mask_sample: bool = Field(default=False, exclude_if=lambda value: value is False)
    failure_kind: str | None = Field(default=None, exclude_if=lambda value: value is None)
    failure_reason: str | None = Field(default=None, exclude_if=lambda value: value is None)

    @field_validator("failure_kind")
    @classmethod
    def _kind_is_known(cls, kind: str | None) -> str | None:
        return validate_failure_kind(kind)

    @classmethod
    def from_request(cls, body: BaseModel, **fields: Any) -> Self:
        """This response to the verify request ``body``: the request's fields echoed (as upstream's
        ``XVerifyResponse(**body.model_dump(), reward=...)`` does) and ``fields`` set. What this response
        adds to the request (``reward``, ``extracted_answer``, ...) is never taken from ``body``: a stored
        rollout posted again carries them, and the new verdict must not meet the old one ("multiple values
        for keyword argument 'reward'") nor inherit a stale field it leaves at its default."""
        own = type(body).model_fields
        skip = (set(cls.model_fields) - set(own)) | set(fields)
        # A field both classes declare with the same type is handed over as the validated value it is
        # (pydantic accepts an instance of the field's own model without validating it again); any other
        # is dumped and validated by ``cls``, as ``**body.model_dump()`` would. Dumping and re-validating
        # the whole rollout was most of the cost of a verify on a small environment.
        same: dict[str, Any] = {}
        dumped: set[str] = set()
        theirs = cls.model_fields
        for name, field in own.items():
            if name in skip:
                continue
            other = theirs.get(name)
            if other is not None and other.annotation == field.annotation and not other.metadata:
                same[name] = getattr(body, name)
            else:
                dumped.add(name)
        data = body.model_dump(include=dumped) if dumped else {}
        if body.__pydantic_extra__:
            data.update(
                {
                    k: v
                    for k, v in body.model_dump(include=set(body.__pydantic_extra__)).items()
                    if k not in skip
                }
            )
        return cls(**same, **data, **fields)


class BaseMultiRewardVerifyResponse(BaseVerifyResponse):
    """A verify response whose ``reward`` is the sum of named ``reward_components`` (e.g. correctness,
    format). Components that should appear in aggregate metrics must also be top-level number fields."""

    reward_components: dict[str, float]

    @model_validator(mode="after")
    def _reward_is_the_sum(self) -> BaseMultiRewardVerifyResponse:
        total = math.fsum(self.reward_components.values())
        if not math.isclose(self.reward, total, rel_tol=1e-5, abs_tol=1e-6):
            raise ValueError(
                f"reward ({self.reward}) must equal the sum of reward_components ({total}): "
                f"{self.reward_components}"
            )
        return self


class _ZeroReward(Response):
    """A verify answer built here rather than by the verifier (so not checked against its response model);
    ``reward`` is what the metrics observe."""

    reward = 0.0


ROW_SCHEMA_PATH = "/row_schema"


def _body_model(endpoint: Callable[..., Any]) -> type[BaseModel] | None:
    """The pydantic model of an endpoint's request body (its first parameter annotated with one)."""
    try:
        signature = inspect.signature(endpoint, eval_str=True)
    except (NameError, TypeError, ValueError):
        return None
    for param in signature.parameters.values():
        if isinstance(param.annotation, type) and issubclass(param.annotation, BaseModel):
            return param.annotation
    return None


@functools.cache
def task_row_schema(server_class: type[SimpleResourcesServer]) -> dict[str, Any]:
    """The JSON schema of the fields a task row must carry for ``server_class`` (computed once per class).

    Properties and required fields of the ``/seed_session`` and ``/verify`` request bodies, except
    ``response``; ``responses_create_params`` is only described as an object (the collector and the
    agent check it in full). Each property lists the endpoints that read it in ``x-used-by``.
    """
    properties: dict[str, Any] = {
        "responses_create_params": {"type": "object", "description": "The Responses API request."}
    }
    required = ["responses_create_params"]
    defs: dict[str, Any] = {}
    used_by: dict[str, list[str]] = {}
    for path, endpoint in (("/seed_session", server_class.seed_session), ("/verify", server_class.verify)):
        model = _body_model(endpoint)
        if model is None:
            continue
        fields = {
            name: (info.annotation, info)
            for name, info in model.model_fields.items()
            if name not in ("response", "responses_create_params")
        }
        part = create_model(f"{model.__name__}TaskRow", **fields).model_json_schema()
        defs.update(part.get("$defs", {}))
        for name, prop in part.get("properties", {}).items():
            properties.setdefault(name, prop)
            used_by.setdefault(name, []).append(path)
        required += [name for name in part.get("required", []) if name not in required]
    for name, paths in used_by.items():
        properties[name] = {**properties[name], "x-used-by": paths}
    schema: dict[str, Any] = {
        "title": f"Task row of {server_class.__name__}",
        "type": "object",
        "properties": properties,
        "required": required,
    }
    if defs:
        schema["$defs"] = defs
    return schema


class BaseResourcesServer(SimpleServer):
    config: BaseResourcesServerConfig
    metrics_kind: ClassVar[str] = "resources_servers"


class SimpleResourcesServer(BaseResourcesServer, AggregateMetricsMixin):
    """Subclass, declare ``config: YourConfig``, register tools in ``setup_webserver``, implement ``verify``."""

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/seed_session")(self.seed_session)
        app.post("/close_session")(self.close_resources_session)
        # The reward observed for nemo_gym.server.metrics; an oversized answer scored 0 before the verifier.
        app.post("/verify")(observed_verify(self._metrics, self._bounded_verify()))
        app.post("/aggregate_metrics")(self.aggregate_metrics)
        app.get("/reverify_mode")(self.get_reverify_mode)
        app.get(ROW_SCHEMA_PATH)(self.row_schema)
        if self.config.expose_tools_over_mcp:
            from nemo_gym.server.mcp import install_mcp  # the optional mcp package is needed only then

            install_mcp(self, app)
        return app

    async def get_reverify_mode(self) -> ReverifyMode:
        """``GET /reverify_mode``: the config class's ``REVERIFY_MODE``."""
        return self.config.REVERIFY_MODE

    async def row_schema(self) -> dict[str, Any]:
        """``GET /row_schema``: the JSON schema of what a task row must carry (see :func:`task_row_schema`)."""
        return task_row_schema(type(self))

    async def seed_session(
        self, body: ResourcesSeedSessionRequest | BaseSeedSessionRequest
    ) -> ResourcesSeedSessionResponse | BaseSeedSessionResponse:
        """Set up per-rollout state (override; take ``request: Request`` too for the session id). An agent's
        ``/run`` seeds with the task row; an environment server with a ``ResourcesSeedSessionRequest``,
        answered with its id. The default keeps no state."""
        if isinstance(body, ResourcesSeedSessionRequest):
            return ResourcesSeedSessionResponse(resources_session_id=body.resources_session_id)
        return BaseSeedSessionResponse()

    async def close_resources_session(
        self, body: ResourcesCloseSessionRequest
    ) -> ResourcesCloseSessionResponse:
        """``POST /close_session``: release what a ``ResourcesSeedSessionRequest`` set up (override, following
        the rules in the module docstring). The default keeps no state: the session is closed."""
        return ResourcesCloseSessionResponse(resources_session_id=body.resources_session_id)

    @abstractmethod
    async def verify(self, body: BaseVerifyRequest) -> BaseVerifyResponse: ...

    def _bounded_verify(self) -> Callable[..., Any]:
        """``verify`` behind the ``verify_max_model_chars`` check (its signature kept for FastAPI)."""
        verify = self.verify
        limit = self.config.verify_max_model_chars

        @functools.wraps(verify)
        async def bounded(*args: Any, **kwargs: Any) -> Any:
            body = next((a for a in (*args, *kwargs.values()) if isinstance(a, BaseVerifyRequest)), None)
            written = model_written_chars(body.response) if body is not None else 0
            if written > limit:
                reason = (
                    f"the answer is too long: the model wrote {written:,} characters (at most {limit:,} "
                    "are read; verify_max_model_chars)"
                )
                answer = {
                    **body.model_dump(mode="json", exclude_unset=True),
                    "reward": 0.0,
                    "failure_reason": reason,
                }
                return _ZeroReward(orjson.dumps(answer), media_type="application/json")
            return await verify(*args, **kwargs)

        return bounded


def model_written_chars(response: NeMoGymResponse | dict[str, Any]) -> int:
    """How many characters the model wrote in ``response``: its messages' and reasoning items' text and
    its tool calls' arguments (tool outputs and inputs are not the model's)."""
    output = response.get("output", []) if isinstance(response, dict) else response.output
    total = 0
    for item in output:
        get = item.get if isinstance(item, dict) else functools.partial(getattr, item)
        kind = get("type", None)
        if kind == "function_call":
            arguments = get("arguments", None)
            total += len(arguments) if isinstance(arguments, str) else 0
        elif kind == "message" and get("role", None) == "assistant":
            total += len(text_of_message(item))
        elif kind == "reasoning":
            for part in (get("summary", None) or []) + (get("content", None) or []):
                text = part.get("text") if isinstance(part, dict) else getattr(part, "text", None)
                total += len(text) if isinstance(text, str) else 0
    return total


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
