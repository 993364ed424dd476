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
  not grow with the input.
* Each finished rollout is one whole line in the output, written and flushed as it completes. An
  infrastructure failure (connection refused, timeout, 5xx, a 4xx from the agent) goes to
  ``<stem>_failures.jsonl`` with its kind, server, error and attempt number — never to the output.
* A ``/run`` answer may mark itself as not a result (upstream's keys): ``_ng_failure_class`` sends it
  to the failures file with that class as its kind (``_ng_failure_terminal: true``: never retried on
  resume), ``_ng_no_persist`` writes it nowhere (a resume runs it again). ``max_attempts`` defaults to
  ``NEMO_GYM_MAX_ROLLOUT_ATTEMPTS`` (else 3).
* With model-call capture on (the servers' ``observability_enabled``; the collector's own option can
  turn it off, or require it), each rollout's model calls are taken from the model servers as it ends
  and appended to ``<stem>_model_calls.jsonl`` (:mod:`nemo_gym.observability`).
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
The code lives in :mod:`nemo_gym.collection`, one module per concept; this module is the public,
upstream-compatible path (``from nemo_gym.rollout_collection import RolloutCollectionHelper``, the
``ng_collect_rollouts`` entry point) and re-exports every name that was defined here.
"""

from __future__ import annotations

from nemo_gym.client_errors import UpstreamError as UpstreamError  # imported (so exposed) before the split
from nemo_gym.collection.circuit_breaker import DOWN_STATUSES as DOWN_STATUSES
from nemo_gym.collection.circuit_breaker import CircuitBreaker as CircuitBreaker
from nemo_gym.collection.circuit_breaker import ServerDownError as ServerDownError
from nemo_gym.collection.circuit_breaker import _error_text as _error_text
from nemo_gym.collection.circuit_breaker import classify_failure as classify_failure
from nemo_gym.collection.circuit_breaker import describe_down as describe_down
from nemo_gym.collection.circuit_breaker import down_server as down_server
from nemo_gym.collection.cli import EXIT_SERVER_DOWN as EXIT_SERVER_DOWN
from nemo_gym.collection.cli import _collect_with_signals as _collect_with_signals
from nemo_gym.collection.cli import collect_main as collect_main
from nemo_gym.collection.collector import _KIND_FIELDS as _KIND_FIELDS
from nemo_gym.collection.collector import _Progress as _Progress
from nemo_gym.collection.collector import collect_rollouts as collect_rollouts
from nemo_gym.collection.collector import format_summary as format_summary
from nemo_gym.collection.dispatch import bounded_map as bounded_map
from nemo_gym.collection.dispatch import post_run as post_run
from nemo_gym.collection.dispatch import run_one as run_one
from nemo_gym.collection.helper import RolloutCollectionHelper as RolloutCollectionHelper
from nemo_gym.collection.input_rows import MAX_ERRORS_SHOWN as MAX_ERRORS_SHOWN
from nemo_gym.collection.input_rows import _agent_of as _agent_of
from nemo_gym.collection.input_rows import _agent_ref_problem as _agent_ref_problem
from nemo_gym.collection.input_rows import _BadLines as _BadLines
from nemo_gym.collection.input_rows import _deep_merge as _deep_merge
from nemo_gym.collection.input_rows import _iter_input as _iter_input
from nemo_gym.collection.input_rows import check_agents_running as check_agents_running
from nemo_gym.collection.input_rows import materialize as materialize
from nemo_gym.collection.input_rows import validate_input as validate_input
from nemo_gym.collection.options import NG_FAILURE_CLASS_KEY as NG_FAILURE_CLASS_KEY
from nemo_gym.collection.options import NG_NO_PERSIST_KEY as NG_NO_PERSIST_KEY
from nemo_gym.collection.options import NG_TERMINAL_KEY as NG_TERMINAL_KEY
from nemo_gym.collection.options import CollectionOptions as CollectionOptions
from nemo_gym.collection.options import InputError as InputError
from nemo_gym.collection.options import RolloutCollectionConfig as RolloutCollectionConfig
from nemo_gym.collection.options import _get_max_rollout_attempts as _get_max_rollout_attempts
from nemo_gym.collection.output_files import LineWriter as LineWriter
from nemo_gym.collection.output_files import _check_materialized_matches as _check_materialized_matches
from nemo_gym.collection.output_files import _check_output_paths as _check_output_paths
from nemo_gym.collection.output_files import _rollout_key as _rollout_key
from nemo_gym.collection.output_files import _scan_existing_output as _scan_existing_output
from nemo_gym.collection.output_files import _scan_failures as _scan_failures
from nemo_gym.collection.output_files import sidecar_paths as sidecar_paths
from nemo_gym.collection.row_schema import _JSON_TYPE_NAMES as _JSON_TYPE_NAMES
from nemo_gym.collection.row_schema import ROW_SCHEMA_PATH as ROW_SCHEMA_PATH
from nemo_gym.collection.row_schema import ROW_SCHEMA_TIMEOUT_S as ROW_SCHEMA_TIMEOUT_S
from nemo_gym.collection.row_schema import RowSchema as RowSchema
from nemo_gym.collection.row_schema import _allowed_types as _allowed_types
from nemo_gym.collection.row_schema import _fetch_row_schema as _fetch_row_schema
from nemo_gym.collection.row_schema import _json_type as _json_type
from nemo_gym.collection.row_schema import _not_null as _not_null
from nemo_gym.collection.row_schema import _resolve as _resolve
from nemo_gym.collection.row_schema import check_rows_against_schemas as check_rows_against_schemas
from nemo_gym.collection.row_schema import fetch_row_schemas as fetch_row_schemas
from nemo_gym.collection.row_schema import logger as logger

# Names this module imported and so exposed before the split (kept reachable from here).
from nemo_gym.server_client import BaseServerConfig as BaseServerConfig
from nemo_gym.server_client import ServerClient as ServerClient
from nemo_gym.server_client import close_shared_session as close_shared_session
