"""The collector's options and its input error.

Contract
--------
* :class:`CollectionOptions` are the options ``ng_collect_rollouts`` and ``ng_e2e_collect_rollouts``
  share; :class:`RolloutCollectionConfig` adds the input file and ``num_repeats``. Unknown keys are
  refused (``extra="forbid"``) and every bound is checked by pydantic.
* :class:`InputError` is raised for bad input or options before anything is sent or written (the
  CLI's exit status 2); its message names the file, line and field.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Keys a /run answer may carry to say "this rollout is not a result" (upstream's names and meanings):
# a failure class sends it to the failures file (terminal: never retried on resume); no-persist writes
# it nowhere (a resume runs it again).
NG_FAILURE_CLASS_KEY = "_ng_failure_class"
NG_NO_PERSIST_KEY = "_ng_no_persist"
NG_TERMINAL_KEY = "_ng_failure_terminal"
# NeMo Gym 0.7's verify-response fields: ``mask_sample: true`` says the reward is not a measurement of the
# policy (the environment or its infrastructure failed); the rollout goes to the failures file as a failure
# of kind ``failure_kind`` (else "masked_sample") with ``failure_reason``, retried on resume like any other.
MASK_SAMPLE_KEY = "mask_sample"
MASKED_SAMPLE_KIND = "masked_sample"
MAX_ROLLOUT_ATTEMPTS_ENV_VAR = "NEMO_GYM_MAX_ROLLOUT_ATTEMPTS"
DEFAULT_MAX_ROLLOUT_ATTEMPTS = 3


def _get_max_rollout_attempts() -> int:
    """``NEMO_GYM_MAX_ROLLOUT_ATTEMPTS`` (a positive integer), else 3: the default of ``max_attempts``."""
    raw = os.environ.get(MAX_ROLLOUT_ATTEMPTS_ENV_VAR, "").strip()
    if not raw:
        return DEFAULT_MAX_ROLLOUT_ATTEMPTS
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{MAX_ROLLOUT_ATTEMPTS_ENV_VAR}={raw!r}: expected a positive integer")
    return value


class CollectionOptions(BaseModel):
    """The collection options ``ng_collect_rollouts`` and ``ng_e2e_collect_rollouts`` share."""

    model_config = ConfigDict(extra="forbid")

    output_jsonl_fpath: str
    agent_name: str | None = None
    limit: int | None = Field(default=None, ge=0)
    num_samples_in_parallel: int = Field(default=256, ge=1)
    responses_create_params: dict[str, Any] = Field(default_factory=dict)
    num_repeats_add_seed: bool = False
    resume_from_cache: bool = False
    overwrite: bool = False
    max_attempts: int = Field(default_factory=_get_max_rollout_attempts, ge=1)
    # Consecutive "server down" failures of one server (each after its retries) that stop dispatching.
    circuit_breaker_threshold: int = Field(default=3, ge=1)
    pass_threshold: float = 1.0
    request_timeout_s: float = 3600.0
    progress: bool = True
    # Export the metrics to an experiment tracker at the end (nemo_gym.collection.tracking; its keys apart).
    tracker: Literal["mlflow", "wandb"] | None = None
    # Model-call capture (nemo_gym.server.model_calls): None follows the servers' config, false never pulls.
    observability_enabled: bool | None = None
    # Live stats on GET http://127.0.0.1:<port>/metrics while the collection runs (0: a free port;
    # None: off). nemo_gym.collection.live_stats.
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    # Asynchronous RL (nemo_gym.collection.policy_lag): rollouts whose oldest policy version is more than
    # max_policy_lag behind the current version of policy_version_model are dropped or marked.
    max_policy_lag: int | None = Field(default=None, ge=0)
    stale_policy: Literal["drop", "mark"] = "drop"
    policy_version_model: str = "policy_model"
    # Environment servers (NeMo Gym 0.7; nemo_gym.collection.routing): through which server each row runs.
    environment_routing_mode: Literal["agent", "legacy", "taskset"] = "agent"
    environment_server_name: str | None = None
    environment_server_routes: dict[str, str] = Field(default_factory=dict)


class RolloutCollectionConfig(CollectionOptions):
    """The options of ``ng_collect_rollouts`` (each is a ``+key=value`` on the command line)."""

    input_jsonl_fpath: str
    num_repeats: int = Field(default=1, ge=1)


class InputError(Exception):
    """The input file has problems; the message lists them with line numbers."""
