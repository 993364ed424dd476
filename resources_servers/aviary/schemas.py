"""Request and response bodies shared by the Aviary resources servers and ``aviary_agent``.

Contract
--------
* Names and fields follow NVIDIA NeMo Gym's ``resources_servers/aviary/schemas.py`` so rows, clients
  and trainer code carry over: ``/seed_session {task_idx} -> {env_id, obs, tools}``,
  ``/step {env_id, action: [function_call items]} -> {obs, reward, done}``,
  ``/close {env_id} -> {message, success}``, and the agent's response carries ``env_id``,
  ``group_id`` and ``contains_transitions``.
* Additions (all optional for a reader): ``/step`` also answers ``truncated`` and ``step`` (the
  1-based step number); ``/verify`` answers ``step_rewards`` (one per env step, as Aviary returned
  them), ``num_steps`` and ``env_done``; the agent's response carries ``steps`` (one
  :class:`AviaryStepRecord` per model turn) and ``context_policy`` (how the model's context was built,
  so :mod:`nemo_gym.tools.export_transitions` can rebuild each step's prompt).
* Observation messages that carry environment *state* (Aviary's ``info["is_env_state"]``, e.g. the
  notebook view) are ``AviaryEnvStateEasyInputMessage`` with ``is_env_state: true``; agents strip
  the marker before sending input to a model.
* This module imports nothing from ``aviary`` so agents and clients need no Aviary install.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseSeedSessionRequest,
    BaseSeedSessionResponse,
    BaseVerifyRequest,
    BaseVerifyResponse,
    ReverifyMode,
)
from nemo_gym.openai_utils import (
    NeMoGymEasyInputMessage,
    NeMoGymFunctionCallOutput,
    NeMoGymResponse,
    NeMoGymResponseFunctionToolCall,
)

ENV_STATE_KEY = "is_env_state"


class AviaryResourcesServerConfig(BaseResourcesServerConfig):
    """Config of every Aviary resources server (the dataset file and the live-env bounds)."""

    REVERIFY_MODE = ReverifyMode.UNSUPPORTED  # verify reads the rewards the env gave during the rollout

    dataset_jsonl_fpath: str | None = Field(
        default=None,
        description="The task file the dataset loads (relative to the working directory or the repository). "
        "None: the server's default file under resources_servers/aviary/data/.",
    )
    env_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments for the environment's config (e.g. GSM8K's correct_reward).",
    )
    max_live_envs: int = Field(default=64, ge=1, description="Environments alive at once.")
    seed_wait_timeout_s: float = Field(
        default=1.0,
        ge=0,
        description="How long /seed_session waits (first come, first served) for a free slot before a 503 "
        "with Retry-After; aviary_agent retries a 503 until its seed_session_timeout_s. Keep it short: "
        "a waiting seed holds its caller's connection open.",
    )
    idle_timeout_s: float = Field(
        default=900.0, gt=0, description="An env untouched this long is closed (abandoned rollouts)."
    )
    step_timeout_s: float = Field(default=900.0, gt=0, description="Bound on one env.step().")
    reset_timeout_s: float = Field(default=300.0, gt=0, description="Bound on env.reset().")
    close_timeout_s: float = Field(default=60.0, gt=0, description="Bound on env.close().")
    max_finished_records: int = Field(
        default=100_000,
        ge=1,
        description="Closed envs whose rewards /verify can still read (oldest dropped).",
    )
    answer_tools: list[str] = Field(
        default_factory=lambda: ["submit_answer"],
        description="Tools that answer the task and end the episode: the calls after the first of them "
        "in a turn are not run (Aviary would run and reward every answer of the turn).",
    )


class AviarySeedSessionRequest(BaseSeedSessionRequest):
    task_idx: int = Field(description="Index of the task in the server's dataset.")


class AviaryEnvStateEasyInputMessage(NeMoGymEasyInputMessage):
    """An observation message that shows the environment's current state (collapsible by agents)."""

    # Required (upstream defaults it to True): with a default, every plain message validating against
    # the observation union would come out marked as environment state.
    is_env_state: Literal[True]


ObsItem = AviaryEnvStateEasyInputMessage | NeMoGymEasyInputMessage | NeMoGymFunctionCallOutput


class AviarySeedSessionResponse(BaseSeedSessionResponse):
    env_id: str
    obs: list[ObsItem]
    tools: list[dict[str, Any]]


class AviaryStepRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    env_id: str
    action: list[NeMoGymResponseFunctionToolCall] = Field(
        description="Every function_call item of one model turn, in order."
    )


class AviaryStepResponse(BaseModel):
    obs: list[ObsItem]
    reward: float
    done: bool
    truncated: bool = False
    step: int = 0
    reason: str | None = Field(
        default=None,
        description="Why a call of this step got no answer from the env (e.g. an unknown tool, which "
        "Aviary punishes by ending the episode); the same text is the call's function_call_output.",
    )


class AviaryStepRecord(BaseModel):
    """One model turn of a rollout, as the agent saw it."""

    model_config = ConfigDict(extra="allow")

    step: int = Field(description="1-based model turn.")
    output_start: int = Field(description="Index in response.output of this turn's first model item.")
    action_end: int = Field(description="Index just past this turn's model items (its obs follow).")
    output_end: int = Field(description="Index just past this turn's observation items.")
    obs: list[dict[str, Any]] = Field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    truncated: bool = False
    stepped_env: bool = Field(default=True, description="False when the turn had no tool call.")
    reason: str | None = Field(default=None, description="The env step's reason (see AviaryStepResponse).")
    prompt_token_ids: list[int] | None = None
    generation_token_ids: list[int] | None = None
    generation_log_probs: list[float] | None = None


class AviaryNeMoGymResponse(NeMoGymResponse):
    env_id: str
    group_id: str
    contains_transitions: bool = False
    steps: list[AviaryStepRecord] = Field(default_factory=list)
    stop_reason: str | None = None
    context_policy: dict[str, Any] = Field(default_factory=dict)


class AviaryAgentVerifyRequest(BaseVerifyRequest):
    task_idx: int
    response: AviaryNeMoGymResponse


class AviaryAgentVerifyResponse(AviaryAgentVerifyRequest, BaseVerifyResponse):
    step_rewards: list[float] = Field(default_factory=list)
    num_steps: int = 0
    env_done: bool = False
    failure_reason: str | None = Field(
        default=None, description="Why the rollout earned no reward, in words (None when it earned one)."
    )


class AviaryCloseRequest(BaseModel):
    env_id: str
    reason: str | None = Field(
        default=None, description="Why the client closes it (e.g. client_disconnected); kept in the record."
    )


class AviaryCloseResponse(BaseModel):
    message: str
    success: bool
