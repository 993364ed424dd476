"""Agents: the loop that drives one rollout (model <-> tools) and asks for a verdict.

Contract
--------
* ``POST /v1/responses`` runs the loop for ``responses_create_params`` and returns the whole
  trajectory as one ``NeMoGymResponse`` (every turn's output items in order, usage summed).
* ``POST /run`` takes a task row (``BaseRunRequest``), seeds the resources server session, runs
  the loop, calls ``/verify`` and returns the verify response unchanged (reward and task fields).
* ``POST /aggregate_metrics`` computes metrics over a run's verify responses
  (:mod:`nemo_gym.kit.reward_profile`; override ``compute_metrics``/``get_key_metrics``).
* A failure to reach the model or the resources server is a non-2xx naming the server and path,
  never a reward.
* ``Body`` is FastAPI's, re-exported as upstream NeMo Gym does.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Coroutine, Mapping
from typing import Any, ClassVar

import orjson
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import Field, PrivateAttr

from nemo_gym.config.types import AnyDatasetConfig, BaseRunServerInstanceConfig
from nemo_gym.kit.reward_profile import AggregateMetricsMixin
from nemo_gym.server.base import SimpleServer
from nemo_gym.server.disconnect import ClientDisconnected, disconnected_response, run_until_disconnected
from nemo_gym.server.metrics.install import observe_agent_loop
from nemo_gym.server.rollout_prefix import (
    InvalidRolloutId,
    apply_rollout_prefix,
    current_rollout_id,
    maybe_rollout_id_from_run_body,
    rollout_path_prefix,
)

USAGE_KEYS = ("input_tokens", "output_tokens", "total_tokens")
USAGE_DETAIL_KEYS = {
    "input_tokens_details": ("cached_tokens", "cache_write_tokens"),
    "output_tokens_details": ("reasoning_tokens",),
}


def empty_usage() -> dict[str, Any]:
    """A Responses API usage object with every count (and detail count) at zero: an agent's total over
    the model turns of one rollout starts here."""
    usage: dict[str, Any] = dict.fromkeys(USAGE_KEYS, 0)
    for details, keys in USAGE_DETAIL_KEYS.items():
        usage[details] = dict.fromkeys(keys, 0)
    return usage


def add_usage(total: dict[str, Any], usage: dict[str, Any] | None) -> None:
    """Add one model turn's ``usage`` (a missing count is 0) into ``total``: the top-level counts, and the
    detail counts of each details section ``total`` has."""
    usage = usage or {}
    for key in USAGE_KEYS:
        total[key] += int(usage.get(key) or 0)
    for details, keys in USAGE_DETAIL_KEYS.items():
        if details not in total:
            continue
        part = usage.get(details) or {}
        for key in keys:
            total[details][key] += int(part.get(key) or 0)


class BaseResponsesAPIAgentConfig(BaseRunServerInstanceConfig):
    datasets: list[AnyDatasetConfig] | None = None
    # Bounds on the agent's calls, per target. A call past its bound fails the rollout with a 504
    # naming the server, the path and the setting; it is never scored. The model bound stays above
    # the model servers' own ``timeout_s`` (600 s) so their clearer 504 arrives first.
    model_timeout_s: float = Field(default=630.0, gt=0)
    tool_timeout_s: float = Field(default=180.0, gt=0)
    seed_session_timeout_s: float = Field(default=180.0, gt=0)
    verify_timeout_s: float = Field(default=630.0, gt=0)


class SimpleResponsesAPIAgent(SimpleServer, AggregateMetricsMixin):
    config: BaseResponsesAPIAgentConfig
    _capture_enabled_cache: bool | None = PrivateAttr(default=None)
    uses_sessions = False  # an agent keeps no state of its own; it forwards the others' cookies
    metrics_kind: ClassVar[str] = "responses_api_agents"

    def observe_loop(self, turns: int, tool_calls: int) -> None:
        """Record one agent loop's model turns and tool calls in this server's metrics (nemo_gym.server.metrics)."""
        observe_agent_loop(self._metrics, turns, tool_calls)

    async def answer_until_disconnected(self, request: Request, work: Coroutine[Any, Any, Any]) -> Response:
        """``work``'s result as the JSON answer; when the caller goes away first, ``work`` is cancelled at
        once (no more model turns, tools or verify) and the answer is the 499 nobody reads."""
        try:
            result = await run_until_disconnected(request, work)
        except ClientDisconnected as e:
            return disconnected_response(self.config.name, e)
        return Response(orjson.dumps(result), media_type="application/json")

    def timeout(self, setting: str) -> dict[str, Any]:
        """Keyword arguments for a ``ServerClient`` call bounded by this agent's ``setting`` (e.g.
        ``"tool_timeout_s"``): the limit, and the name a timeout error should point at."""
        return {
            "timeout_s": getattr(self.config, setting),
            "timeout_setting": f"{setting} of agent '{self.config.name}'",
        }

    # -- rollout ids in downstream paths (upstream's API; see nemo_gym.server.rollout_prefix) ------
    # As upstream: downstream calls carry /ng-rollout/<id> when the run sets ``observability_enabled``
    # (training-token capture is not offered, so never for that). Every server of ours answers a
    # prefixed path exactly like the plain one, so the prefix changes no answer.
    def _token_id_capture_enabled(self) -> bool:
        return False

    def _model_call_capture_enabled(self) -> bool:
        # Read once (a config lookup costs ~13 us, and this runs for every rollout); the run's config
        # does not change while a server runs.
        if self._capture_enabled_cache is None:
            global_config = getattr(self.server_client, "global_config_dict", None)
            enabled = isinstance(global_config, Mapping) and bool(
                global_config.get("observability_enabled", False)
            )
            self._capture_enabled_cache = enabled
        return self._capture_enabled_cache

    def _capture_correlation_enabled(self) -> bool:
        return self._model_call_capture_enabled() or self._token_id_capture_enabled()

    def rollout_id_from_run(self, body: Any) -> str | None:
        """The rollout id to put into downstream paths for this run (``None``: no prefix)."""
        if not self._capture_correlation_enabled():
            return None
        try:
            return maybe_rollout_id_from_run_body(body)
        except InvalidRolloutId as e:  # the row's fault: a 422 naming the field, never a 500
            raise RequestValidationError(
                [{"type": "value_error", "loc": ("body", e.field), "msg": str(e), "input": None}]
            ) from None

    def url_path_for_run(self, url_path: str, body: Any) -> str:
        """``url_path`` with this run's rollout prefix (unchanged when there is none)."""
        prefix = rollout_path_prefix(
            self.rollout_id_from_run(body), token_capture=self._token_id_capture_enabled()
        )
        return prefix + url_path

    def base_url_for_run(self, base_url: str, body: Any) -> str:
        """A model server's root URL with this run's rollout prefix (add ``/v1`` after)."""
        return apply_rollout_prefix(
            base_url, self.rollout_id_from_run(body), token_capture=self._token_id_capture_enabled()
        )

    def url_path_for_request(self, url_path: str, request: Request | None) -> str:
        """``url_path`` carrying the rollout prefix the inbound ``request`` came with, if any."""
        params = getattr(request, "path_params", None)
        rollout_id = params.get("rollout_id") if isinstance(params, Mapping) else None
        rollout_id = rollout_id or (current_rollout_id() if request is not None else None)
        return rollout_path_prefix(rollout_id) + url_path

    def resolve_model_base_url(self, model_server_name: str, rollout_id: str | None = None) -> str:
        """``http://host:port[/ng-rollout/<id>]/v1`` of a configured model server."""
        base_url = self.server_client.base_url(model_server_name)
        return (
            apply_rollout_prefix(base_url, rollout_id, token_capture=self._token_id_capture_enabled()) + "/v1"
        )

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/v1/responses")(self.responses)
        app.post("/run")(self.run)
        app.post("/aggregate_metrics")(self.aggregate_metrics)
        return app

    # Subclasses take the body either as a typed parameter (``body: BaseRunRequest``, FastAPI validates
    # it) or, on hot paths, read it with ``nemo_gym.server.base.validated_body`` and forward it as is.
    @abstractmethod
    async def responses(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        """The model/tool loop for one ``NeMoGymResponseCreateParamsNonStreaming`` body."""

    @abstractmethod
    async def run(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        """One whole rollout for one ``BaseRunRequest`` task row: seed, loop, verify."""
