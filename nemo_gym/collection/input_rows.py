"""The collector's input: streaming validation and materialisation of task rows.

Contract
--------
* :func:`validate_input` reads the input JSONL once, lazily, before any request: every line that is
  not a JSON object, whose ``responses_create_params`` (merged with the options') fails validation,
  whose ``agent_ref`` is malformed, or that names no agent is reported with its line number and
  field, all at once (the first ``MAX_ERRORS_SHOWN`` problems shown), as one :class:`InputError`.
* :func:`materialize` yields the rows actually sent, in order: each input row repeated in place
  (``num_repeats``: abc -> aabbcc) with ``_ng_task_index`` / ``_ng_rollout_index`` and its
  ``agent_ref`` added; memory does not grow with the input.
* :func:`check_agents_running` names every agent the rows use that the running config lacks.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
from pydantic import ValidationError

from nemo_gym.client.server_client import ServerClient
from nemo_gym.collection.options import InputError, RolloutCollectionConfig
from nemo_gym.openai_utils.responses import NeMoGymResponseCreateParamsNonStreaming

MAX_ERRORS_SHOWN = 50


class _BadLines:
    """Problems of an input file's lines, for one error that names every bad line (the first
    ``MAX_ERRORS_SHOWN`` problems shown, the number of bad lines counted)."""

    def __init__(self) -> None:
        self.shown: list[str] = []
        self.count = 0

    def add(self, where: str, problems: list[str]) -> None:
        """Record the problems of the line at ``where`` (nothing when ``problems`` is empty)."""
        if problems:
            self.count += 1
            if len(self.shown) < MAX_ERRORS_SHOWN:
                self.shown.extend(f"{where}: {p}" for p in problems)

    def raise_if_any(self, what: str) -> None:
        """Raise :class:`InputError` "<n> line(s) of <what>; nothing was sent" listing them, if any."""
        if self.count:
            more = (
                f"\n  ... and more ({self.count} bad lines in all)" if self.count > MAX_ERRORS_SHOWN else ""
            )
            raise InputError(
                f"{self.count} line(s) of {what}; nothing was sent:\n  " + "\n  ".join(self.shown) + more
            )


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``over`` merged in (nested dicts merged, anything else replaced)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _agent_of(row: dict[str, Any], default: str | None) -> str | None:
    """The row's ``agent_ref.name``, else ``default`` (+agent_name)."""
    ref = row.get("agent_ref")
    if isinstance(ref, dict) and isinstance(ref.get("name"), str) and ref["name"]:
        return ref["name"]
    return default


def _agent_ref_problem(row: dict[str, Any]) -> str | None:
    """A message when the row has an ``agent_ref`` that is not ``{name: <non-empty string>}``."""
    if "agent_ref" not in row:
        return None
    ref = row["agent_ref"]
    if isinstance(ref, dict) and isinstance(ref.get("name"), str) and ref["name"]:
        return None
    return f"field `agent_ref` must be an object with a non-empty string `name`, got {orjson.dumps(ref).decode()[:200]}"


def _iter_input(cfg: RolloutCollectionConfig) -> Iterator[tuple[int, bytes]]:
    """(line number, raw line) of each non-blank input line, up to +limit rows; read lazily."""
    path = Path(cfg.input_jsonl_fpath)
    taken = 0
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            if cfg.limit is not None and taken >= cfg.limit:
                return
            taken += 1
            yield line_no, line


class InputScan:
    """One streaming pass over the input that checks each row's format (see :func:`validate_input`).

    :meth:`rows` yields the rows that passed, so a caller can check more per row in the same pass
    (:func:`nemo_gym.collection.row_schema.check_input`); :meth:`finish` then raises every format
    problem at once, or returns (number of rows, agent names used)."""

    def __init__(self, cfg: RolloutCollectionConfig) -> None:
        self.cfg = cfg
        self.path = Path(cfg.input_jsonl_fpath)
        if not self.path.is_file():
            what = "is a directory, not a file" if self.path.is_dir() else "does not exist"
            raise InputError(f"Input file {self.path} {what} (+input_jsonl_fpath).")
        self.bad = _BadLines()
        self.agents: set[str] = set()
        self.n = 0

    def rows(self) -> Iterator[tuple[str, dict[str, Any], str]]:
        """(``file:line``, row, agent) of each row without a format problem; the others are recorded."""
        cfg, path, bad = self.cfg, self.path, self.bad
        for line_no, line in _iter_input(cfg):
            self.n += 1
            where = f"{path}:{line_no}"
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError as e:
                bad.add(where, [f"not valid JSON ({e})"])
                continue
            if not isinstance(row, dict):
                bad.add(where, [f"a row must be a JSON object, got {type(row).__name__}"])
                continue
            line_problems = []
            params = row.get("responses_create_params")
            if not isinstance(params, dict):
                line_problems.append("field `responses_create_params` is missing or not an object")
            else:
                try:
                    NeMoGymResponseCreateParamsNonStreaming.model_validate(
                        _deep_merge(params, cfg.responses_create_params)
                    )
                except ValidationError as e:
                    for err in e.errors()[:5]:
                        loc = ".".join(str(x) for x in err["loc"])
                        line_problems.append(f"field `responses_create_params.{loc}`: {err['msg']}")
            ref_problem = _agent_ref_problem(row)
            agent = _agent_of(row, cfg.agent_name)
            if ref_problem is not None:
                line_problems.append(ref_problem)
            elif agent is None:
                line_problems.append(
                    "no agent: the row has no `agent_ref.name` and +agent_name was not given"
                )
            else:
                self.agents.add(agent)
            bad.add(where, line_problems)
            if not line_problems and agent is not None:
                yield where, row, agent

    def finish(self) -> tuple[int, set[str]]:
        """After :meth:`rows` ran out: raise InputError listing all format problems, else (rows, agents)."""
        self.bad.raise_if_any(f"{self.path} are not valid task rows")
        if self.n == 0:
            raise InputError(
                f"{self.path} has no rows"
                + (f" (limit={self.cfg.limit})" if self.cfg.limit is not None else "")
                + "."
            )
        return self.n, self.agents


def validate_input(cfg: RolloutCollectionConfig) -> tuple[int, set[str]]:
    """One pass over the input: (number of rows, agent names used); raises InputError listing all problems."""
    scan = InputScan(cfg)
    for _ in scan.rows():
        pass
    return scan.finish()


def materialize(cfg: RolloutCollectionConfig) -> Iterator[dict[str, Any]]:
    """The rows actually sent, in order: each input row repeated in place, with indices added."""
    for task_index, (_, line) in enumerate(_iter_input(cfg)):
        row = orjson.loads(line)
        row["responses_create_params"] = _deep_merge(
            row["responses_create_params"], cfg.responses_create_params
        )
        agent = _agent_of(row, cfg.agent_name)
        row["agent_ref"] = {"type": "responses_api_agents", "name": agent}
        for rollout_index in range(cfg.num_repeats):
            out = dict(row)
            if cfg.num_repeats_add_seed:
                out["responses_create_params"] = {**row["responses_create_params"], "seed": rollout_index}
            out["_ng_task_index"] = task_index
            out["_ng_rollout_index"] = rollout_index
            yield out


def running_agents(client: ServerClient) -> list[str]:
    """The agent instances in the running config, sorted."""
    cfg = client.global_config_dict
    return sorted(
        str(name)
        for name in cfg.keys()
        if hasattr(cfg.get(name), "keys") and "responses_api_agents" in cfg.get(name)
    )


def check_agents_running(agents: set[str], client: ServerClient) -> None:
    """Raise InputError naming every agent that is not running, and the agents that are."""
    running = running_agents(client)
    missing = sorted(a for a in agents if a not in running)
    if missing:
        raise InputError(
            f"Agent(s) {', '.join(repr(m) for m in missing)} are not running. "
            f"Running agents: {', '.join(running) or 'none'}."
        )
