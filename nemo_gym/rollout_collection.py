"""Rollout collection: task rows in, verified reward-annotated trajectories out.

Contract
--------
* The input JSONL is validated in a first streaming pass before any request: every line that is
  not a JSON object, whose ``responses_create_params`` fails validation, or that names no agent is
  reported with its line number and field, all at once, and nothing is sent or written. Then each
  row is checked against the row schema its agent's resources server publishes (``GET
  /row_schema``): a missing required field, a top-level field of the wrong JSON type, a value outside
  a field's enum (or its items' enum) and a ``contentMediaType: application/json`` string that is not
  JSON are reported the same way. An agent without a resources server, or a schema that cannot be
  fetched, gets one warning and no check.
* Rows are expanded in place (``num_repeats``: abc -> aabbcc) with ``_ng_task_index`` and
  ``_ng_rollout_index``; the expanded rows are written to ``<stem>_materialized_inputs.jsonl``.
* At most ``num_samples_in_parallel`` rollouts are in flight; rows are read lazily, so memory does
  not grow with the input: it is O(in flight) + O(distinct agents, metric keys and failure kinds).
  What would grow with the rows (a resume's pairs done and attempts, the rewards grouped by task
  for pass@k) goes through temporary files (:mod:`nemo_gym.kit.spill`); docs/concepts.md, "Memory
  at scale", has the measured numbers.
* Each finished rollout is one whole line in the output, written and flushed as it completes. An
  infrastructure failure (connection refused, timeout, 5xx, a 4xx from the agent) goes to
  ``<stem>_failures.jsonl`` with its kind, server, error and attempt number — never to the output.
* A ``/run`` answer may mark itself as not a result (upstream's keys): ``_ng_failure_class`` sends it
  to the failures file with that class as its kind (``_ng_failure_terminal: true``: never retried on
  resume), ``_ng_no_persist`` writes it nowhere (a resume runs it again). ``max_attempts`` defaults to
  ``NEMO_GYM_MAX_ROLLOUT_ATTEMPTS`` (else 3).
* With model-call capture on (the servers' ``observability_enabled``; the collector's own option can
  turn it off, or require it), each rollout's model calls are taken from the model servers as it ends
  and appended to ``<stem>_model_calls.jsonl`` (:mod:`nemo_gym.server.model_calls`).
* A per-server circuit breaker: after ``circuit_breaker_threshold`` consecutive rollouts fail
  because one server is down (unreachable past the client's retries, or 502/503/504 — the agent's
  own, or an inner server's named in the agent's 502), rows for the agents it affects are no longer
  sent. Rollouts in flight finish or fail; rows not sent are "not attempted" (not failures, not
  counted towards ``max_attempts``): a resume runs them. One line per failure kind is printed at
  the end, and the exit status is 3, naming the server. A server with several replicas is down only
  when none of them answers: the in-flight failures of one dead replica's sessions are written to the
  failures file (a resume runs them) and the run goes on through the others.
* The failures file never carries a secret: each record is scrubbed (:mod:`nemo_gym.redaction`) of
  the secret values this process knows (its config and ``env.yaml``) before it is written.
* ``resume_from_cache`` runs exactly the (task, rollout) pairs missing from the output, retrying
  failed ones up to ``max_attempts`` (then skipping and reporting them); it refuses, touching
  nothing, if the materialized inputs no longer match. A line cut short by a hard kill is dropped.
* SIGINT/SIGTERM stop cleanly: nothing new starts, in-flight rollouts are cancelled (they are not
  failures), and the output keeps only whole lines. Exit status: 0 all done, 1 rollouts missing
  after failures, 2 bad input or options (nothing sent or written), 3 stopped early because a
  server is down, 130 interrupted.

Layout
------
The code lives in :mod:`nemo_gym.collection`, one module per concept. This module is upstream NeMo
Gym's path for it, kept as a thin face: exactly upstream's public names that we implement
(``from nemo_gym.rollout_collection import RolloutCollectionHelper``), and ``collect_main``, the
``ng_collect_rollouts`` entry point. Our own code imports from the defining modules.
"""

from __future__ import annotations

from nemo_gym.collection.cli import collect_main
from nemo_gym.collection.helper import RolloutCollectionHelper
from nemo_gym.collection.options import (
    NG_FAILURE_CLASS_KEY,
    NG_NO_PERSIST_KEY,
    NG_TERMINAL_KEY,
    RolloutCollectionConfig,
)
from nemo_gym.collection.policy_lag import StalePolicyError

__all__ = [
    "NG_FAILURE_CLASS_KEY",
    "NG_NO_PERSIST_KEY",
    "NG_TERMINAL_KEY",
    "RolloutCollectionConfig",
    "RolloutCollectionHelper",
    "StalePolicyError",
    "collect_main",
]
