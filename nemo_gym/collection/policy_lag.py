"""Policy versions on rollout lines, and the ``max_policy_lag`` filter of asynchronous RL.

Contract
--------
* :class:`PolicyLagFilter` gives each finished rollout result ``policy_versions``: the distinct
  ``policy_version`` values its model calls were answered with (read from its output items, which the
  model servers stamp once a trainer has set a version: :mod:`nemo_gym.server.policy_version`), in the
  order they appear. A rollout whose model never had a version set gets no such key.
* With ``max_policy_lag`` set, the current version is asked of the model server
  ``policy_version_model`` (``GET /policy_version``, bounded wait) when the rollout is judged, and a
  rollout whose oldest version is more than ``max_policy_lag`` behind it is stale
  (:func:`nemo_gym.server.policy_version.policy_lag`). ``stale_policy: "mark"`` keeps it with
  ``stale_policy: true`` and ``policy_lag: <n>``; ``"drop"`` discards it (``ng_collect_rollouts``
  writes it nowhere, so a resume runs it again; :class:`RolloutCollectionHelper` raises
  :class:`StalePolicyError` from its awaitable). A rollout without versions, or a server without a
  current version, is never stale.
* A model server that cannot be asked is warned about once and its rollouts are kept (not judged).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal

import orjson

from nemo_gym.config.types import POLICY_VERSION_PATH
from nemo_gym.server.policy_version import (
    POLICY_VERSION_KEY,
    POLICY_VERSIONS_KEY,
    PolicyVersionValue,
    policy_lag,
    policy_versions_of,
)

logger = logging.getLogger("nemo_gym")

StalePolicy = Literal["drop", "mark"]
DEFAULT_POLICY_VERSION_MODEL = "policy_model"
STALE_KEY = "stale_policy"
LAG_KEY = "policy_lag"
_NO_PERSIST_KEY = "_ng_no_persist"  # nemo_gym.collection.options.NG_NO_PERSIST_KEY (no import cycle)


class StalePolicyError(Exception):
    """A rollout dropped by ``max_policy_lag`` (``stale_policy="drop"``): its oldest policy version is
    ``lag`` versions behind ``current``. ``row`` and ``result`` are the rollout's."""

    def __init__(
        self, row: dict[str, Any], result: dict[str, Any], lag: int, current: PolicyVersionValue
    ) -> None:
        self.row, self.result, self.lag, self.current = row, result, lag, current
        versions = result.get(POLICY_VERSIONS_KEY)
        super().__init__(
            f"stale rollout dropped: policy versions {versions} are {lag} behind the current version "
            f"{current!r} (max_policy_lag exceeded)"
        )


class PolicyLagFilter:
    """Adds ``policy_versions`` to rollout results and judges them against ``max_policy_lag``."""

    def __init__(
        self,
        client: Any,  # nemo_gym.client.server_client.ServerClient
        max_policy_lag: int | None = None,
        stale_policy: StalePolicy = "drop",
        policy_version_model: str = DEFAULT_POLICY_VERSION_MODEL,
    ) -> None:
        if max_policy_lag is not None and max_policy_lag < 0:
            raise ValueError(f"max_policy_lag must be >= 0, got {max_policy_lag}")
        if stale_policy not in ("drop", "mark"):
            raise ValueError(f"stale_policy must be 'drop' or 'mark', got {stale_policy!r}")
        self.client = client
        self.max_policy_lag = max_policy_lag
        self.stale_policy = stale_policy
        self.policy_version_model = policy_version_model
        self.stale = 0
        self.dropped = 0
        self._warned = False
        if max_policy_lag is not None:
            check_model_server(client.global_config_dict, policy_version_model)

    async def current(self) -> PolicyVersionValue | None:
        """The current version of ``policy_version_model`` (None: unset, or the server could not be asked)."""
        from nemo_gym.errors import UpstreamError, response_body

        try:
            resp = await self.client.get(self.policy_version_model, POLICY_VERSION_PATH, timeout_s=30)
            if resp.status != 200:
                raise UpstreamError(
                    self.policy_version_model, POLICY_VERSION_PATH, resp.status, response_body(resp)[:300]
                )
            return orjson.loads(response_body(resp)).get(POLICY_VERSION_KEY)
        except (UpstreamError, orjson.JSONDecodeError, AttributeError) as e:
            if not self._warned:
                self._warned = True
                logger.warning(
                    "max_policy_lag: cannot read the current policy version from %s (%s); "
                    "its rollouts are kept unjudged",
                    self.policy_version_model,
                    e,
                )
            return None

    async def judge(self, result: Any) -> tuple[int, PolicyVersionValue] | None:
        """Add ``policy_versions`` to ``result``; return (lag, current) when it is stale, else None.
        With ``stale_policy="mark"`` a stale result is marked here."""
        if not isinstance(result, dict):
            return None
        versions = policy_versions_of(result)
        if not versions:
            return None
        result[POLICY_VERSIONS_KEY] = versions
        if self.max_policy_lag is None:
            return None
        current = await self.current()
        lag = policy_lag(versions, current)
        if lag is None or current is None or lag <= self.max_policy_lag:
            return None
        self.stale += 1
        if self.stale_policy == "mark":
            result[STALE_KEY] = True
            result[LAG_KEY] = lag
        else:
            self.dropped += 1
        return lag, current

    def wrap(
        self, worker: Callable[[dict[str, Any]], Awaitable[Any]]
    ) -> Callable[[dict[str, Any]], Awaitable[Any]]:
        """``worker`` whose rewarded results are judged; a dropped one comes back marked ``_ng_no_persist``
        (the collector then writes it nowhere and a resume runs it again)."""

        async def run(row: dict[str, Any]) -> Any:
            result = await worker(row)
            if isinstance(result, dict) and "reward" in result:
                stale = await self.judge(result)
                if stale is not None and self.stale_policy == "drop":
                    result[_NO_PERSIST_KEY] = True
            return result

        return run

    def summary(self) -> dict[str, Any]:
        return {
            "max_policy_lag": self.max_policy_lag,
            "stale_policy": self.stale_policy,
            "policy_version_model": self.policy_version_model,
            "stale": self.stale,
            "dropped": self.dropped,
        }


def check_model_server(global_config: Mapping[str, Any], name: str) -> None:
    """Raise ``ValueError`` unless ``name`` is a model server of the run (``max_policy_lag`` asks it)."""
    from nemo_gym.server.model_calls import model_server_names

    names = model_server_names(global_config)
    if name not in names:
        raise ValueError(
            f"policy_version_model={name!r} is not a model server of this run (model servers: {names}); "
            "max_policy_lag reads the current policy version from it"
        )
