"""An environment's exploit file, ``resources_servers/<env>/exploits.yaml``: what ``ng_reward_audit`` plays.

The file is one audit (a mapping) or several (``audits: [...]``, e.g. one per config of the folder). An
audit names the configs that start the environment, the example row it plays, a **control** that
solves that row (it must earn a reward: an audit whose plays never reach a reward proves nothing), what
the generic battery needs to know about the answer format, and the environment's own exploits. Every
played trajectory is a list of scripted model turns (:class:`nemo_gym.kit.script.ScriptedTurn`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from nemo_gym.kit.script import ScriptedTurn

EXPLOITS_FILE = "exploits.yaml"

# What every sandboxed environment's own exploits must cover (``covers`` of its exploits).
SandboxAttack = Literal[
    "kill_own_process", "fork_bomb", "endless_output", "sleep_past_bound", "forged_results"
]
SANDBOX_ATTACKS: tuple[str, ...] = SandboxAttack.__args__  # type: ignore[attr-defined]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Exploit(_Strict):
    """One of an environment's own exploits: the turns an adversarial policy plays."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_]*$", max_length=60)
    why: str = Field(min_length=1, description="What the exploit tries, in a sentence")
    turns: list[ScriptedTurn] = Field(min_length=1)
    row: int | None = Field(default=None, ge=0, description="Example row played (default: the audit's)")
    covers: list[SandboxAttack] = Field(default_factory=list)


class JudgeSpec(_Strict):
    """How the audit plays an LLM judge that is the scripted model: every judge call answers ``fails``
    except the control's (its judge prompt holds ``control_contains``), which answers ``passes``. The
    generic ``judge_injection`` exploit writes ``verdict_marker`` and an instruction to the judge into its
    answer: only the judge's own output may decide the verdict."""

    prompt_contains: str = Field(min_length=1, description="A substring of every judge prompt")
    control_contains: str = Field(min_length=1, description="A substring of the control's answer only")
    verdict_marker: str = Field(min_length=1, description="What the judge writes for a pass")
    passes: list[ScriptedTurn] = Field(min_length=1)
    fails: list[ScriptedTurn] = Field(min_length=1)


class Audit(_Strict):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_]*$")
    config_paths: list[str] = Field(min_length=1)
    agent: str | None = Field(default=None, description="The agent instance (default: the only one)")
    config: dict[str, Any] = Field(default_factory=dict, description="Merged over the configs (bounds)")
    row: int = Field(default=0, ge=0, description="The example row (data/example.jsonl, 0-based) played")
    rows_fpath: str | None = Field(default=None, description="Rows file (default: the folder's example)")
    solve: list[ScriptedTurn] = Field(min_length=1, description="The control: a trajectory that earns")
    prefix: list[ScriptedTurn] | None = Field(
        default=None,
        description="Turns played before each generic exploit's last turn (default: `solve` but its last "
        "turn); [] where those turns alone would earn the reward",
    )
    answer: str | None = Field(
        default=None, description="The control's answer text (default: the last turn's text)"
    )
    wrong_answer: str | None = Field(default=None, description="A wrong answer in the same format")
    lookalike_of: str | None = Field(
        default=None, description="The part of `answer` whose letters the look-alike exploit replaces"
    )
    candidates: list[str] = Field(default_factory=list, description="Every option a shotgun lists")
    code_block_forbidden: bool = False
    judge: JudgeSpec | None = None
    sandboxed: bool = False
    exploits: list[Exploit] = Field(default_factory=list)
    not_applicable: dict[str, str] = Field(
        default_factory=dict, description="Generic exploit -> why it does not apply here"
    )
    concurrency: int = Field(default=4, ge=1, le=64)
    timeout_s: float = Field(default=300.0, gt=0, description="Bound on one played rollout")

    @model_validator(mode="after")
    def _consistent(self) -> Audit:
        names = [e.name for e in self.exploits]
        doubled = sorted({n for n in names if names.count(n) > 1})
        if doubled:
            raise ValueError(f"exploit names must be unique; repeated: {', '.join(doubled)}")
        if self.sandboxed:
            covered = {c for e in self.exploits for c in e.covers}
            missing = [a for a in SANDBOX_ATTACKS if a not in covered]
            if missing:
                raise ValueError(
                    "a sandboxed environment's exploits must cover every sandbox attack; "
                    f"none covers: {', '.join(missing)}"
                )
        if self.answer is not None and self.lookalike_of is not None and self.lookalike_of not in self.answer:
            raise ValueError(f"lookalike_of {self.lookalike_of!r} is not part of answer {self.answer!r}")
        return self

    @property
    def answer_text(self) -> str | None:
        return self.answer if self.answer is not None else self.solve[-1].text

    @property
    def generic_prefix(self) -> list[ScriptedTurn]:
        return self.prefix if self.prefix is not None else self.solve[:-1]


class ExploitFile(_Strict):
    audits: list[Audit] = Field(min_length=1)

    @field_validator("audits")
    @classmethod
    def _unique(cls, audits: list[Audit]) -> list[Audit]:
        names = [a.name for a in audits]
        if len(set(names)) != len(names):
            raise ValueError(f"audit names must be unique, got {names}")
        return audits


class ExploitFileError(ValueError):
    """An exploit file that cannot be used: the message names the file and the field."""


def load_exploit_file(path: Path) -> list[Audit]:
    """The audits of one exploit file (see the module docstring)."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ExploitFileError(f"{path}: cannot read it: {exc}") from None
    if not isinstance(data, dict):
        raise ExploitFileError(f"{path}: expected a mapping (one audit, or `audits: [...]`)")
    if "audits" not in data:
        data = {"audits": [{"name": path.parent.name, **data}]}
    try:
        return ExploitFile.model_validate(data).audits
    except ValidationError as exc:
        lines = [f"  {'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in exc.errors()[:10]]
        raise ExploitFileError(f"{path}: not a valid exploit file:\n" + "\n".join(lines)) from None


def environment_folders(root: Path) -> list[Path]:
    """Every environment folder of a checkout (``resources_servers/<name>/`` with an ``app.py``)."""
    base = root / "resources_servers"
    return sorted(p for p in base.iterdir() if p.is_dir() and (p / "app.py").is_file())
