"""A collection's numbers while it runs: the progress bar's postfix, ``GET /metrics`` and the ``live`` block.

Contract
--------
* :class:`LiveStats` counts one collection as it goes, O(1) per rollout and no lock: successful
  rollouts, failures by kind, rollouts written nowhere (``_ng_no_persist``), the running reward mean
  and standard deviation (Welford, :class:`~nemo_gym.kit.rollout_stats.RunningStat`) and the tokens of
  the ``usage`` of each rollout's ``response`` (when it has one). A ``parent`` receives every count too
  (``ng_e2e_collect_rollouts``: one per agent, the parent for the whole run).
* A failure's kind label is one of :data:`FAILURE_KINDS` (``other`` for any other; a failure the
  environment reported with ``_ng_failure_class`` is ``environment_reported``), so label values stay
  bounded whatever the servers answer.
* :meth:`LiveStats.postfix` is the tqdm postfix; :meth:`LiveStats.to_dict` the ``live`` block of the
  aggregate metrics file (the same numbers, at the end).
* :class:`LiveMetricsServer` serves those numbers (and the process's CPU and memory) as Prometheus text
  at ``http://127.0.0.1:<port>/metrics`` from a registry of its own, read at scrape time from the
  counts (nothing is done per rollout for it). Port 0 picks a free one. It listens on 127.0.0.1 only
  and has no token (the servers' ``/metrics`` carry the run token; this is the collector's own
  process). :meth:`LiveMetricsServer.close` stops it and joins its thread: no port or thread is left.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from nemo_gym.kit.rollout_stats import RunningStat
from nemo_gym.server.metrics.registry import KNOWN_ERROR_KINDS

# Failure kinds a label may take: the error envelope's kinds (nemo_gym.server.metrics.registry's
# KNOWN_ERROR_KINDS), the client's (nemo_gym.client.server_client, nemo_gym.errors), the breaker's
# and the collector's own; anything else is "other".
FAILURE_KINDS = KNOWN_ERROR_KINDS | frozenset(
    {
        "connection_error",
        "timeout",
        "bad_response",
        "http_error",
        "replica_unknown",
        "server_down",
        "environment_reported",
        "other",
    }
)
USAGE_KEYS = ("input_tokens", "output_tokens", "total_tokens")


def failure_label(kind: Any, reported: bool = False) -> str:
    """The bounded label of a failure kind (see :data:`FAILURE_KINDS`)."""
    if reported:
        return "environment_reported"
    return kind if isinstance(kind, str) and kind in FAILURE_KINDS else "other"


class LiveStats:
    """Running counts of one collection (see the module docstring)."""

    def __init__(self, parent: LiveStats | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.parent = parent
        self._clock = clock
        self.started = clock()
        self.ended: float | None = None
        self.planned = 0
        self.ok = 0
        self.not_persisted = 0
        self.failed: dict[str, int] = {}
        self.reward = RunningStat()
        self.tokens = dict.fromkeys(USAGE_KEYS, 0)

    # -- counting (the collector calls these, one per rollout) -----------------------------------------
    def start(self) -> None:
        """Start the clock again (the run step starts after the checks of the plan step)."""
        self.started = self._clock()

    def plan(self, n: int) -> None:
        self.planned += n
        if self.parent is not None:
            self.parent.plan(n)

    def rollout_ok(self, reward: float, result: dict[str, Any]) -> None:
        response = result.get("response")
        usage = response.get("usage") if isinstance(response, dict) else None
        self._count(reward, usage if isinstance(usage, dict) else None)

    def _count(self, reward: float, usage: dict[str, Any] | None) -> None:
        self.ok += 1
        self.reward.add(reward)
        if usage is not None:
            tokens = self.tokens
            for key in USAGE_KEYS:
                n = usage.get(key)
                if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                    tokens[key] += n
        if self.parent is not None:
            self.parent._count(reward, usage)

    def rollout_failed(self, label: str) -> None:
        self.failed[label] = self.failed.get(label, 0) + 1
        if self.parent is not None:
            self.parent.rollout_failed(label)

    def rollout_not_persisted(self) -> None:
        self.not_persisted += 1
        if self.parent is not None:
            self.parent.rollout_not_persisted()

    def finish(self) -> None:
        """Stop the clock (rates are then over the whole run)."""
        if self.ended is None:
            self.ended = self._clock()

    # -- reading ---------------------------------------------------------------------------------------
    @property
    def elapsed(self) -> float:
        return (self.ended if self.ended is not None else self._clock()) - self.started

    @property
    def n_failed(self) -> int:
        return sum(dict(self.failed).values())

    def rates(self) -> tuple[float, float]:
        """(successful rollouts/s, tokens/s) since the start."""
        wall = self.elapsed
        if wall <= 0:
            return 0.0, 0.0
        return self.ok / wall, self.tokens["total_tokens"] / wall

    def postfix(self) -> dict[str, str]:
        """The progress bar's postfix: rollouts/s, reward mean±std, tokens/s, failures by kind."""
        per_s, tok_s = self.rates()
        out = {"rollouts/s": f"{per_s:.1f}"}
        if self.reward.n:
            out["reward"] = f"{self.reward.mean:.3f}±{self.reward.std:.3f}"
        if self.tokens["total_tokens"]:
            out["tok/s"] = f"{tok_s:.0f}"
        failed = dict(self.failed)
        out["failed"] = str(sum(failed.values()))
        if failed:
            out["failed"] += " (" + ", ".join(f"{k} {n}" for k, n in sorted(failed.items())) + ")"
        return out

    def to_dict(self) -> dict[str, Any]:
        """The ``live`` block of the aggregate metrics file (this run only)."""
        per_s, tok_s = self.rates()
        return {
            "wall_time_s": self.elapsed,
            "rollouts_ok": self.ok,
            "rollouts_failed": self.n_failed,
            "rollouts_not_persisted": self.not_persisted,
            "failures_by_kind": dict(sorted(self.failed.items())),
            "rollouts_per_s": per_s,
            "reward": {"count": self.reward.n, "mean": self.reward.mean, "std": self.reward.std},
            "tokens": dict(self.tokens),
            "tokens_per_s": tok_s,
        }


class _LiveCollector:
    """A prometheus_client collector that reads a :class:`LiveStats` at scrape time."""

    def __init__(self, stats: LiveStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.stats
        failed = dict(s.failed)  # one copy: the event loop may add a kind meanwhile
        tokens = dict(s.tokens)
        per_s, tok_s = s.rates()
        yield CounterMetricFamily(
            "nemo_gym_collection_rollouts_ok", "Rollouts written to the output this run.", value=s.ok
        )
        fam = CounterMetricFamily(
            "nemo_gym_collection_rollouts_failed",
            "Rollouts failed this run, by failure kind.",
            labels=["kind"],
        )
        for kind, n in sorted(failed.items()):
            fam.add_metric([kind], n)
        yield fam
        yield CounterMetricFamily(
            "nemo_gym_collection_rollouts_not_persisted",
            "Rollouts whose answer asked to be written nowhere (_ng_no_persist).",
            value=s.not_persisted,
        )
        yield GaugeMetricFamily(
            "nemo_gym_collection_rollouts_planned", "Rollouts this run set out to run.", value=s.planned
        )
        yield GaugeMetricFamily(
            "nemo_gym_collection_rollouts_per_second",
            "Successful rollouts per second since the start of the run.",
            value=per_s,
        )
        yield GaugeMetricFamily(
            "nemo_gym_collection_reward_mean",
            "Mean reward of this run's rollouts so far.",
            value=s.reward.mean,
        )
        yield GaugeMetricFamily(
            "nemo_gym_collection_reward_std",
            "Standard deviation of this run's rewards so far (population).",
            value=s.reward.std,
        )
        fam = CounterMetricFamily(
            "nemo_gym_collection_tokens",
            "Tokens of the rollouts' response usage, by type (input, output, total).",
            labels=["type"],
        )
        for key in USAGE_KEYS:
            fam.add_metric([key.removesuffix("_tokens")], tokens[key])
        yield fam
        yield GaugeMetricFamily(
            "nemo_gym_collection_tokens_per_second", "Tokens (total) per second since the start.", value=tok_s
        )
        yield GaugeMetricFamily(
            "nemo_gym_collection_elapsed_seconds", "Seconds since the run started.", value=s.elapsed
        )


class LiveMetricsServer:
    """``GET /metrics`` of the collector's process on 127.0.0.1 (see the module docstring)."""

    def __init__(self, stats: LiveStats, port: int, host: str = "127.0.0.1") -> None:
        from prometheus_client import CollectorRegistry, start_http_server
        from prometheus_client.process_collector import ProcessCollector

        registry = CollectorRegistry()
        ProcessCollector(registry=registry)
        registry.register(_LiveCollector(stats))
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.host = host
        self.port: int = self._server.server_port
        self._closed = threading.Event()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
