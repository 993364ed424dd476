"""Agents: the loop that drives one rollout (model <-> tools) and asks for a verdict.

Contract
--------
* ``POST /v1/responses`` runs the loop for ``responses_create_params`` and returns the whole
  trajectory as one ``NeMoGymResponse`` (every turn's output items in order, usage summed).
* ``POST /run`` takes a task row (``BaseRunRequest``), seeds the resources server session, runs
  the loop, calls ``/verify`` and returns the verify response unchanged (reward and task fields).
* A failure to reach the model or the resources server is a non-2xx naming the server and path,
  never a reward.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

from fastapi import FastAPI, Request

from nemo_gym.config_types import DatasetConfig
from nemo_gym.server_utils import BaseRunServerInstanceConfig, BaseServer


class BaseResponsesAPIAgentConfig(BaseRunServerInstanceConfig):
    datasets: list[DatasetConfig] | None = None


class SimpleResponsesAPIAgent(BaseServer):
    config: BaseResponsesAPIAgentConfig
    uses_sessions = False  # an agent keeps no state of its own; it forwards the others' cookies

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/v1/responses")(self.responses)
        app.post("/run")(self.run)
        return app

    # Subclasses take the body either as a typed parameter (``body: BaseRunRequest``, FastAPI validates
    # it) or, on hot paths, read it with ``nemo_gym.server_utils.validated_body`` and forward it as is.
    @abstractmethod
    async def responses(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        """The model/tool loop for one ``NeMoGymResponseCreateParamsNonStreaming`` body."""

    @abstractmethod
    async def run(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        """One whole rollout for one ``BaseRunRequest`` task row: seed, loop, verify."""
