"""Typed pieces of server configs that several server kinds share (references, datasets, metrics).

Contract
--------
* Names and fields follow NVIDIA NeMo Gym's ``nemo_gym.config_types`` (our face at that path imports
  them from here) so environments written for it
  import them unchanged: ``ModelServerRef``/``ResourcesServerRef``/``AgentServerRef``, ``Domain``,
  ``BaseServerConfig``, ``BaseRunServerConfig``, ``BaseRunServerInstanceConfig``, ``DatasetConfig``
  (with ``source``, ``gitlab_identifier``, ``huggingface_identifier`` and the license set),
  ``BenchmarkDatasetConfig``, ``AggregateMetricsRequest``/``AggregateMetrics``.
* Server-instance blocks stay strict: a key no config class declares is an error (the launcher adds
  "did you mean"). The keys upstream configs carry for people rather than code (``description``,
  ``value``, ``verified``, ``domain``, ``license``, ``num_workers``) are declared, so upstream YAML loads.
* A server reference's ``type`` defaults from its class (a superset of upstream, where it is required).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# The kinds of server (nemo_gym.config.keys.SERVER_TYPES, as a type).
ServerType = Literal[
    "resources_servers", "responses_api_agents", "responses_api_models", "environment_servers"
]
AGENT_REF_KEY = "agent_ref"
# Request paths that carry a rollout id: /ng-rollout/<id>/... (see nemo_gym.server.rollout_prefix).
ROLLOUT_PATH_PREFIX = "ng-rollout"
TOKEN_CAPTURE_PATH_SEGMENT = "training-token-capture"
# A model server's policy version (nemo_gym.server.policy_version); setting it takes the trainer credential.
POLICY_VERSION_PATH = "/policy_version"


class BaseServerConfig(BaseModel):
    """Where a server listens (also importable from ``nemo_gym.server.base``)."""

    host: str = "127.0.0.1"
    port: int
    # Accepted for upstream configs; each server here runs one uvicorn worker.
    num_workers: int | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


class Domain(StrEnum):
    """What an environment trains or measures (upstream's values)."""

    MATH = "math"
    CODING = "coding"
    AGENT = "agent"
    KNOWLEDGE = "knowledge"
    INSTRUCTION_FOLLOWING = "instruction_following"
    LONG_CONTEXT = "long_context"
    SAFETY = "safety"
    GAMES = "games"
    TRANSLATION = "translation"
    E2E = "e2e"
    RLHF = "rlhf"
    OTHER = "other"


class BaseRunServerInstanceConfig(BaseModel):
    """The impl block of one server instance in YAML. Unknown keys are an error (typos surface)."""

    model_config = ConfigDict(extra="forbid")

    name: str = ""  # the instance name, filled in by the launcher
    # The instance's server type; upstream code sometimes passes it (``type="resources_servers"``).
    type: ServerType | None = None
    entrypoint: str = "app.py"
    host: str = "127.0.0.1"
    port: int | None = None
    domain: Domain | None = None
    description: str | None = None
    verified: bool | None = None
    license: str | None = None
    # Free text upstream configs carry for people (what the environment is worth); no code reads it.
    value: Any = None
    # Accepted for upstream configs; each server here runs one uvicorn worker.
    num_workers: int | None = Field(default=None, ge=1)
    # Larger request bodies get a 413 naming this setting; unset: the top-level
    # ``max_request_body_bytes``, else 32 MiB.
    max_request_body_bytes: int | None = Field(default=None, gt=0)
    # Slow or silent clients (nemo_gym.server.accept_limit): a connection that has not sent a whole request head
    # within request_head_timeout_s, or whose body stalls for request_body_idle_timeout_s, is closed; idle
    # keep-alive connections after keep_alive_timeout_s; reserved_connection_fraction of the accepted
    # connections are kept for clients that sent the run token. Unset: the top-level key, else the default.
    request_head_timeout_s: float | None = Field(default=None, gt=0)
    request_body_idle_timeout_s: float | None = Field(default=None, gt=0)
    keep_alive_timeout_s: float | None = Field(default=None, gt=0)
    reserved_connection_fraction: float | None = Field(default=None, ge=0, lt=1)
    # Replicas and placement (nemo_gym.client.replicas, nemo_gym.run.ray.replicas): how many processes serve this
    # instance, and where on a Ray cluster they run. ``replicas`` is filled in by the launcher.
    num_replicas: int = Field(default=1, ge=1)
    ray_resources: dict[str, float] | list[dict[str, float]] | None = None
    ray_node_id: str | None = None
    ray_max_restarts: int = Field(default=3, ge=0)
    replicas: list[dict[str, Any]] | None = None
    # Launcher environment variables this server needs although their names look secret (OPENAI_API_KEY,
    # HF_TOKEN, AWS_*): every other secret-looking variable is left out of its environment
    # (nemo_gym.redaction.child_environ; docs/security.md).
    pass_env: list[str] = Field(default_factory=list)


# Upstream's names for the same shape (it splits where-to-listen and what-to-run into layers).
BaseRunServerConfig = BaseRunServerInstanceConfig


class ServerRef(BaseModel):
    """A reference to another server instance by its name, e.g. ``{type: resources_servers, name: x}``."""

    model_config = ConfigDict(extra="forbid")

    type: ServerType
    name: str


class ResourcesServerRef(ServerRef):
    type: Literal["resources_servers"] = "resources_servers"


class ModelServerRef(ServerRef):
    type: Literal["responses_api_models"] = "responses_api_models"


class AgentServerRef(ServerRef):
    type: Literal["responses_api_agents"] = "responses_api_agents"


class EnvironmentServerRef(ServerRef):
    type: Literal["environment_servers"] = "environment_servers"


_REF_CLASSES: dict[str, type[ServerRef]] = {
    "resources_servers": ResourcesServerRef,
    "responses_api_models": ModelServerRef,
    "responses_api_agents": AgentServerRef,
    "environment_servers": EnvironmentServerRef,
}


def is_server_ref(config_dict: Any) -> ServerRef | None:
    """The typed reference when ``config_dict`` is exactly ``{type: <server type>, name: <str>}``, else None."""
    if not hasattr(config_dict, "keys") or set(config_dict.keys()) != {"type", "name"}:
        return None
    cls = _REF_CLASSES.get(str(config_dict["type"]))
    if cls is None:
        return None
    try:
        return cls(type=config_dict["type"], name=config_dict["name"])
    except ValidationError:
        return None


# ------------------------------------------------------------------------------------------------
# Datasets.

License = Literal[
    "Apache 2.0",
    "MIT",
    "Creative Commons Attribution 4.0 International",
    "Creative Commons Attribution-ShareAlike 4.0 International",
    "CC BY-SA 4.0",
    "CC BY-NC 3.0",
    "NVIDIA Internal Use Only, Do Not Distribute",
    "NVIDIA Evaluation Dataset License Agreement",
    "TBD",
    "GNU General Public License v3.0",
]


class JsonlDatasetGitlabIdentifer(BaseModel):  # upstream's spelling
    model_config = ConfigDict(extra="forbid")

    dataset_name: str
    version: str
    artifact_fpath: str


class JsonlDatasetHuggingFaceIdentifer(BaseModel):  # upstream's spelling
    model_config = ConfigDict(extra="forbid")

    repo_id: str
    artifact_fpath: str | None = None


class GitlabDatasetSource(JsonlDatasetGitlabIdentifer):
    type: Literal["gitlab"]


class HuggingFaceDatasetSource(JsonlDatasetHuggingFaceIdentifer):
    type: Literal["huggingface"]


DatasetSource = Annotated[GitlabDatasetSource | HuggingFaceDatasetSource, Field(discriminator="type")]


class DatasetConfig(BaseModel):
    """A JSONL of task rows an agent can run. Where it can be downloaded from is recorded, never fetched
    at run time. ``train`` and ``validation`` datasets must name their license."""

    model_config = ConfigDict(extra="forbid")

    name: str
    type: Literal["train", "validation", "example", "benchmark"]
    jsonl_fpath: str
    num_repeats: int = Field(default=1, ge=1)
    # A benchmark's rows are made by ``prepare_script`` (optionally rendered with ``prompt_config``; on
    # another dataset ``prompt_config`` records how its rows were rendered).
    prepare_script: str | None = None
    prompt_config: str | None = None
    source: DatasetSource | None = None
    gitlab_identifier: JsonlDatasetGitlabIdentifer | None = None
    huggingface_identifier: JsonlDatasetHuggingFaceIdentifer | None = None
    license: License | None = None

    @model_validator(mode="after")
    def _check(self) -> DatasetConfig:
        if self.type in ("train", "validation") and self.license is None:
            raise ValueError(f"dataset '{self.name}' (type {self.type}) needs a license")
        if self.type == "benchmark" and not self.prepare_script:
            raise ValueError(f"dataset '{self.name}' (type benchmark) needs a prepare_script")
        # (A prompt_config on another dataset only records how its rows were rendered: upstream's critpt
        # config carries one on its example dataset, and upstream accepts it.)
        if self.type != "benchmark" and self.prepare_script:
            raise ValueError(f"dataset '{self.name}': prepare_script belongs to benchmark datasets only")
        if self.source is not None and (self.gitlab_identifier or self.huggingface_identifier):
            raise ValueError(
                f"dataset '{self.name}': give its source once, either `source` or "
                "`gitlab_identifier`/`huggingface_identifier`, not both"
            )
        return self


class BenchmarkDatasetConfig(BaseModel):
    """A benchmark dataset: rows made by ``prepare_script``, optionally rendered with ``prompt_config``."""

    model_config = ConfigDict(extra="forbid")

    name: str
    type: Literal["benchmark"]
    jsonl_fpath: str
    prepare_script: str
    prompt_config: str | None = None
    num_repeats: int = Field(default=1, ge=1)


# One model for every kind of dataset (a union of models would put its tag into error locations, and
# hide "did you mean" for a misspelt key); BenchmarkDatasetConfig stays importable by its name.
AnyDatasetConfig = DatasetConfig


# ------------------------------------------------------------------------------------------------
# Aggregate metrics (``POST /aggregate_metrics`` on resources servers and agents).


class AggregateMetricsRequest(BaseModel):
    """The verify responses of a run (each at least ``reward`` and ``_ng_task_index``)."""

    verify_responses: list[dict[str, Any]]


class AggregateMetrics(BaseModel):
    """Metrics over a run: per task (``group_level_metrics``), over all rollouts (``agent_metrics``) and
    the headline subset (``key_metrics``)."""

    group_level_metrics: list[dict[str, Any]] = Field(default_factory=list)
    agent_metrics: dict[str, Any] = Field(default_factory=dict)
    key_metrics: dict[str, Any] = Field(default_factory=dict)
