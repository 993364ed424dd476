"""Typed pieces of server configs that several server kinds share (references, datasets)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class BaseServerConfig(BaseModel):
    """Where a server listens (also importable from ``nemo_gym.server_utils``)."""

    host: str = "127.0.0.1"
    port: int

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


class ServerRef(BaseModel):
    """A reference to another server instance by its name, e.g. ``{type: resources_servers, name: x}``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["resources_servers", "responses_api_agents", "responses_api_models"]
    name: str


class ResourcesServerRef(ServerRef):
    type: Literal["resources_servers"] = "resources_servers"


class ModelServerRef(ServerRef):
    type: Literal["responses_api_models"] = "responses_api_models"


class AgentServerRef(ServerRef):
    type: Literal["responses_api_agents"] = "responses_api_agents"


class DatasetConfig(BaseModel):
    """A JSONL of task rows an agent can run."""

    model_config = ConfigDict(extra="forbid")

    name: str
    type: Literal["train", "validation", "example"]
    jsonl_fpath: str
    license: str | None = None
    num_repeats: int | None = None
