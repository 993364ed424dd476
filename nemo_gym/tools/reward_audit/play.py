"""Playing an audit: start the environment with the scripted model, play every trajectory through the
agent's ``/run``, and judge each outcome.

The scripted model plays each trajectory for exactly one rollout: every played row carries its own
``_ng_rollout_id``, the run has ``observability_enabled`` (so agents put ``/ng-rollout/<id>/`` on their
model calls, harnesses included) and the scripted model's rules, written to a file, pick turns by that
id. Judge calls carry no rollout id: they fall through to the judge rules.
"""

from __future__ import annotations

import asyncio
import copy
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

from nemo_gym.auth import auth_headers, client_token_for_url
from nemo_gym.config.keys import ROLLOUT_ID_KEY_NAME
from nemo_gym.config.parser import GlobalConfigDictParserConfig
from nemo_gym.kit.script import ScriptRule
from nemo_gym.run.cli import RunHelper
from nemo_gym.tools.reward_audit.battery import Play, all_plays
from nemo_gym.tools.reward_audit.spec import Audit

SCRIPTED_MODEL_CONFIG = "responses_api_models/scripted_model/configs/scripted_model.yaml"
REASON_FIELDS = ("failure_reason", "reason", "failure", "error")
# A play with a time bound of its own may take that long beyond this many times the control's time.
CONTROL_TIME_FACTOR = 3


@dataclass
class Outcome:
    """What one played trajectory got, and whether that is what the audit wants."""

    audit: str
    play: Play
    status: int | None  # HTTP status of /run (None: no answer)
    reward: float | None
    reason: str
    ok: bool
    too_slow: bool = False  # past a time bound of its own (see _judge_times)

    @property
    def verdict(self) -> str:
        if self.ok:
            return "pass"
        if self.too_slow:
            return "FAIL (too slow)"
        if self.play.earn:
            return "FAIL (the control earned nothing: the audit proves nothing)"
        if self.reward is not None:
            return "FAIL (earned a reward)"
        return "FAIL (not scored)"


@dataclass
class AuditResult:
    audit: Audit
    outcomes: list[Outcome]
    left_out: dict[str, str]
    servers_down: list[str]

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]

    @property
    def passed(self) -> bool:
        return not self.failures and not self.servers_down


def load_rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                rows.append(orjson.loads(line))
            except orjson.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not JSON: {exc}") from None
    return rows


def _rollout_id(audit: Audit, index: int, play: Play) -> str:
    return f"audit-{audit.name}-{index}-{play.name}"


def script_rules(audit: Audit, plays: list[Play]) -> list[ScriptRule]:
    """The scripted model's rules: each play's turns for its own rollout, then the judge's."""
    rules = [ScriptRule(rollout_id=_rollout_id(audit, i, p), turns=p.turns) for i, p in enumerate(plays)]
    if audit.judge is not None:
        rules.append(ScriptRule(contains=audit.judge.control_contains, turns=audit.judge.passes))
        rules.append(ScriptRule(contains=audit.judge.prompt_contains, turns=audit.judge.fails))
    return rules


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for key, value in b.items():
        out[key] = (
            _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


def _agent_name(helper: RunHelper, wanted: str | None) -> str:
    agents = [i["name"] for i in helper.server_instances() if i.get("server_type") == "responses_api_agents"]
    if wanted is not None:
        if wanted not in agents:
            raise ValueError(f"agent {wanted!r} is not in the run; its agents: {', '.join(agents)}")
        return wanted
    if len(agents) != 1:
        raise ValueError(f"the run has {len(agents)} agents ({', '.join(agents)}): name one with `agent:`")
    return agents[0]


def _reason(body: dict[str, Any]) -> str:
    for key in REASON_FIELDS:
        value = body.get(key)
        if value:
            return value if isinstance(value, str) else json.dumps(value)[:300]
    return ""


def _judge(audit: Audit, play: Play, resp: httpx.Response | None, error: str) -> Outcome:
    if resp is None:
        return Outcome(audit.name, play, None, None, error, False)
    if resp.status_code != 200:
        try:
            detail = resp.json().get("error") or resp.json()
            text = detail.get("message") if isinstance(detail, dict) else None
            inner = detail.get("inner") if isinstance(detail, dict) else None
            text = f"{text} {json.dumps(inner)[:300] if inner else ''}".strip() if text else resp.text[:400]
        except (ValueError, AttributeError):
            text = resp.text[:400]
        return Outcome(audit.name, play, resp.status_code, None, text, False)
    body = resp.json()
    reward = body.get("reward")
    if not isinstance(reward, (int, float)):
        return Outcome(audit.name, play, 200, None, f"no numeric reward in the answer: {reward!r}", False)
    ok = reward > 0 if play.earn else reward <= 0
    return Outcome(audit.name, play, 200, float(reward), _reason(body), ok)


async def _play_all(
    audit: Audit, plays: list[Play], rows: list[dict[str, Any]], run_url: str, token: str
) -> list[Outcome]:
    limit = asyncio.Semaphore(audit.concurrency)
    elapsed: dict[int, float] = {}

    async def one(index: int, play: Play, client: httpx.AsyncClient) -> Outcome:
        row = copy.deepcopy(rows[play.row])
        row[ROLLOUT_ID_KEY_NAME] = _rollout_id(audit, index, play)
        async with limit:
            start = time.monotonic()
            try:
                resp = await client.post(run_url, content=orjson.dumps(row), timeout=audit.timeout_s)
            except httpx.TimeoutException:
                return _judge(audit, play, None, f"no answer within {audit.timeout_s:g} s (a hang)")
            except httpx.HTTPError as exc:
                return _judge(audit, play, None, f"the agent could not be reached: {exc!r}")
            finally:
                elapsed[index] = time.monotonic() - start
        return _judge(audit, play, resp, "")

    headers = {"content-type": "application/json", **auth_headers(token)}
    async with httpx.AsyncClient(timeout=audit.timeout_s, headers=headers, trust_env=False) as client:
        outcomes = list(await asyncio.gather(*(one(i, p, client) for i, p in enumerate(plays))))
    return _judge_times(audit, outcomes, elapsed)


def _judge_times(audit: Audit, outcomes: list[Outcome], elapsed: dict[int, float]) -> list[Outcome]:
    """Fail a play with a time bound of its own that took longer than it allows beyond what the control
    took (the same environment, harness and machine: on a busy machine both are slow; a parse that is
    quadratic in a megabyte is slower by hours)."""
    control = max((elapsed.get(i, 0.0) for i, o in enumerate(outcomes) if o.play.earn), default=0.0)
    for i, outcome in enumerate(outcomes):
        play = outcome.play
        if play.timeout_s is None or i not in elapsed or not outcome.ok:
            continue
        allowed = play.timeout_s + CONTROL_TIME_FACTOR * control
        if elapsed[i] > allowed:
            outcomes[i] = Outcome(
                audit.name,
                play,
                outcome.status,
                outcome.reward,
                f"took {elapsed[i]:.0f} s, past its bound of {allowed:.0f} s ({play.timeout_s:g} s + "
                f"{CONTROL_TIME_FACTOR} x the control's {control:.1f} s): slower than a linear read",
                False,
                too_slow=True,
            )
    return outcomes


def run_audit(audit: Audit, folder: Path, root: Path) -> AuditResult:
    """Start ``audit``'s environment (the scripted model as policy and judge), play everything, stop."""
    rows_path = root / audit.rows_fpath if audit.rows_fpath else folder / "data" / "example.jsonl"
    rows = load_rows(rows_path)
    plays, left_out = all_plays(audit, rows)
    for play in plays:
        if play.row >= len(rows):
            raise ValueError(
                f"{audit.name}/{play.name}: row {play.row} is past the {len(rows)} rows of {rows_path}"
            )
    with tempfile.TemporaryDirectory(prefix="nemo-gym-audit-") as tmp:
        rules_path = Path(tmp) / "rules.json"
        rules_path.write_bytes(
            orjson.dumps([r.model_dump(exclude_none=True) for r in script_rules(audit, plays)])
        )
        initial = {
            "config_paths": [*audit.config_paths, SCRIPTED_MODEL_CONFIG],
            "head_server": {"host": "127.0.0.1", "port": 0},
            "observability_enabled": True,
            "policy_model": {
                "responses_api_models": {"scripted_model": {"scripts_by_input_fpath": str(rules_path)}}
            },
        }
        helper = RunHelper()
        try:
            helper.start(
                GlobalConfigDictParserConfig(
                    initial_global_config_dict=_merge(initial, audit.config),
                    skip_load_from_cli=True,
                    skip_load_from_env_yaml=True,
                )
            )
            agent = _agent_name(helper, audit.agent)
            urls = {i["name"]: i["url"].rstrip("/") for i in helper.server_instances()}
            token = client_token_for_url(urls[agent])
            outcomes = asyncio.run(_play_all(audit, plays, rows, urls[agent] + "/run", token))
            down = []
            for name, url in urls.items():
                try:
                    alive = httpx.get(url + "/", headers=auth_headers(token), timeout=10, trust_env=False)
                    if alive.status_code != 200:
                        down.append(f"{name} (GET / answered {alive.status_code})")
                except httpx.HTTPError as exc:
                    down.append(f"{name} ({exc!r})")
        finally:
            helper.shutdown()
    return AuditResult(audit, outcomes, left_out, down)
