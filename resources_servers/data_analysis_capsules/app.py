"""data_analysis_capsules: analyse a small dataset in a notebook and answer (BixBench's idea, written here).

Contract
--------
* Built on the Aviary notebook environment (``resources_servers/aviary/notebook_app.py``): the same
  sandboxed, resource-limited local ipykernel, throw-away work dir, tools ``edit_cell``,
  ``list_workdir`` and ``submit_answer``, the same live-env bounds. What a capsule adds: its own data
  folder (``data_folder``, under ``capsules_dir``, copied into the kernel's work dir), a per-task
  tolerance, multiple-choice answers, and metrics. The kernel sees that copy and the read-only system,
  never the rows (``data/capsules.jsonl`` holds the answers) nor any process outside its sandbox
  (``notebook_app.bwrap_argv``).
* A row carries its task (BixBench's field names where it has one): ``task_idx`` (the group id),
  ``capsule_id``, ``data_folder``, ``question``, ``eval_mode`` (``range_verifier``: ``ideal`` is a
  number and ``tolerance`` is ``{"abs": x}`` or ``{"rel": x}``; ``mcq``: ``ideal`` is one of
  ``options``, shown to the model lettered A, B, ...), ``ideal``; optional ``question_id``,
  ``category``, ``hypothesis``; ``reference`` (the generator's evidence) is not read. aviary_agent
  sends the whole row to ``/seed_session`` (``send_row_to_seed_session: true``). A row missing a field,
  or inconsistent (no tolerance for a number, an ``ideal`` not among the options, a ``data_folder`` that
  is not a capsule folder) is refused with a 422 naming the field before any kernel starts.
* Reward (at ``submit_answer``, which ends the episode): 1.0 when the answer is within tolerance (a
  number: exactly one number in the answer text) or is the right option (its letter, or its text);
  else 0.0. ``/verify`` answers the reward and ``failure_reason`` (``pass``, ``wrong_answer``,
  ``unparseable``, ``kernel_died``, ``no_answer``) with ``reason`` (why, in words),
  ``answer_parse_status`` (``parsed``, ``unparseable``, ``no_answer``), ``submitted_answer`` and
  ``cells_run`` (``edit_cell`` calls). One answer per episode: once a call has ended the episode, the
  later calls of the same model turn are not run (Aviary runs them all, in order).
* What the model's code did is its score: a kernel that dies while the model's cell runs, or is found
  dead at a later cell (an earlier cell's code may still run in it), ends the episode with reward 0,
  ``kernel_died`` (the kernel's work dir's disk quota killing it is such a death: the reason says so;
  a cell that the quota only interrupted is a tool error, and the episode goes on). Only what the model cannot have caused is infrastructure, never a 0: a kernel that
  cannot start is a 503 at ``/seed_session``; one found dead at the model's first cell (none of its
  code has run there) makes ``/verify`` answer 503 naming it. A cell that merely runs past
  ``cell_timeout_s`` is the model's: a tool error it reads.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from pathlib import Path
from typing import Any, Literal, Self

from aviary.core import TaskDataset
from fastapi import HTTPException, Request
from pydantic import BaseModel, Field, ValidationError, model_validator

from resources_servers.aviary.app import AviaryResourcesServer, resolve_data_path
from resources_servers.aviary.notebook_app import EPISODE_ENDED, CSVAnalysisEnv, NotebookServerConfig
from resources_servers.aviary.offline import DatasetFileError
from resources_servers.aviary.schemas import (
    AviaryAgentVerifyRequest,
    AviaryAgentVerifyResponse,
    AviarySeedSessionRequest,
    AviarySeedSessionResponse,
)

HERE = Path(__file__).resolve().parent
LETTERS = "ABCDEFGHIJ"
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


# ------------------------------------------------------------------------------------------------
# Rows and grading (pure: no kernel).


class Tolerance(BaseModel):
    abs: float | None = Field(default=None, ge=0)
    rel: float | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _one(self) -> Self:
        if (self.abs is None) == (self.rel is None):
            raise ValueError('tolerance must be exactly one of {"abs": x} or {"rel": x}')
        return self


class CapsuleRow(BaseModel):
    capsule_id: str = Field(min_length=1)
    data_folder: str = Field(
        min_length=1, description="The capsule's folder under the server's capsules_dir."
    )
    question: str = Field(min_length=1)
    eval_mode: Literal["range_verifier", "mcq"]
    ideal: float | str
    tolerance: Tolerance | None = None
    options: list[str] | None = Field(default=None, max_length=len(LETTERS))
    question_id: str = ""
    category: str = ""
    hypothesis: str = ""

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.eval_mode == "range_verifier":
            if isinstance(self.ideal, str) or not math.isfinite(self.ideal):
                raise ValueError("eval_mode range_verifier needs a finite number as ideal")
            if self.tolerance is None:
                raise ValueError("eval_mode range_verifier needs a tolerance")
        else:
            if not self.options or len(self.options) < 2:
                raise ValueError("eval_mode mcq needs at least two options")
            if str(self.ideal) not in self.options:
                raise ValueError(f"ideal {self.ideal!r} is not one of the options {self.options}")
        return self

    def prompt(self) -> str:
        """The question as the model sees it (with the lettered options of a multiple-choice task)."""
        if self.eval_mode != "mcq":
            return self.question
        lines = [f"{LETTERS[i]}. {o}" for i, o in enumerate(self.options or [])]
        return f"{self.question}\nOptions:\n" + "\n".join(lines) + "\nSubmit the letter of the right option."


class Verdict(BaseModel):
    correct: bool
    parse_status: Literal["parsed", "unparseable"]
    failure_reason: Literal["pass", "wrong_answer", "unparseable"]
    reason: str


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def grade(row: CapsuleRow, answer: str) -> Verdict:
    """Judge a submitted answer against the row (see the module docstring)."""
    text = str(answer).strip().replace("\u2212", "-")
    if row.eval_mode == "range_verifier":
        numbers = _NUMBER.findall(text.replace(",", ""))
        if len(numbers) != 1:
            why = "no number" if not numbers else f"{len(numbers)} numbers"
            return Verdict(
                correct=False,
                parse_status="unparseable",
                failure_reason="unparseable",
                reason=f"the answer {text[:200]!r} holds {why}; submit exactly one number",
            )
        value, ideal, tol = float(numbers[0]), float(row.ideal), row.tolerance
        assert tol is not None
        allowed = tol.abs if tol.abs is not None else (tol.rel or 0.0) * abs(ideal)
        bound = f"±{tol.abs:g}" if tol.abs is not None else f"±{tol.rel:g} relative"
        if math.isfinite(value) and abs(value - ideal) <= allowed:
            return Verdict(
                correct=True,
                parse_status="parsed",
                failure_reason="pass",
                reason=f"{value:g} is within {bound}",
            )
        return Verdict(
            correct=False,
            parse_status="parsed",
            failure_reason="wrong_answer",
            reason=f"{value:g} is not within the tolerance ({bound}) of the reference answer",
        )
    options = row.options or []
    chosen: str | None = None
    by_text = {_norm(o): o for o in options}
    if _norm(text.rstrip(".")) in by_text:
        chosen = by_text[_norm(text.rstrip("."))]
    else:
        match = re.fullmatch(r"\(?([A-Za-z])\)?[.):]?\s*(.*)", text)
        if match and match.group(1).upper() in LETTERS[: len(options)]:
            option = options[LETTERS.index(match.group(1).upper())]
            rest = _norm(match.group(2).rstrip("."))
            if not rest or rest == _norm(option):
                chosen = option
    if chosen is None:
        allowed = ", ".join(LETTERS[: len(options)])
        return Verdict(
            correct=False,
            parse_status="unparseable",
            failure_reason="unparseable",
            reason=f"the answer {text[:200]!r} is not one of the options (a letter {allowed} or an option's text)",
        )
    if chosen == str(row.ideal):
        return Verdict(
            correct=True, parse_status="parsed", failure_reason="pass", reason=f"{chosen!r} is right"
        )
    return Verdict(
        correct=False,
        parse_status="parsed",
        failure_reason="wrong_answer",
        reason=f"{chosen!r} is not the right option",
    )


# ------------------------------------------------------------------------------------------------
# The environment.


class KernelDiedError(RuntimeError):
    """The notebook kernel died before any of the model's code ran: infrastructure, never a score."""


KERNEL_DIED = "kernel_died"


class CapsuleEnv(CSVAnalysisEnv):
    """The notebook environment on one capsule's data folder, graded by :func:`grade`."""

    KERNEL_POLL_S = 0.5

    def __init__(self, *, row: CapsuleRow, files_dir: Path, **kwargs: Any):
        super().__init__(question=row.prompt(), answer=str(row.ideal), files_dir=files_dir, **kwargs)
        self.row = row
        self.cells_run = 0
        self.verdict: Verdict | None = None
        self.submitted: str | None = None
        self.infra_error: str | None = None
        self.kernel_killed: str | None = None  # why the kernel died of the model's code (its 0)

    async def edit_cell(self, contents: str, idx: int | None = None) -> str:
        """Edit the notebook by modifying a specific code cell; the notebook then runs.

        Only code cells are supported: write Python (comments are welcome). Keep cells short.

        Args:
            contents: Cell contents to insert. We assume the cell is a code block.
            idx: Index of the cell to edit. If not provided (None default), then appends a new cell.
        """
        if self.state.done:  # an earlier call of this turn ended the episode
            return EPISODE_ENDED
        kernel = self.state._kernel_manager
        model_code_ran = self.cells_run > 0  # code it started may still run (a thread, a child process)
        self.cells_run += 1
        if not await kernel.is_alive():
            if model_code_ran:
                return self._killed_by_model("the notebook kernel died after the model's earlier cells ran")
            self.infra_error = "the notebook kernel died before any of the model's code ran"
            self.state.done = True
            raise KernelDiedError(
                self.infra_error + "; the episode ends (an infrastructure error, not a score)"
            )
        run = asyncio.ensure_future(CSVAnalysisEnv.edit_cell(self, contents, idx))
        while True:
            done, _ = await asyncio.wait({run}, timeout=self.KERNEL_POLL_S)
            if done and (run.cancelled() or run.exception() is None or await kernel.is_alive()):
                return run.result()
            if done or not await kernel.is_alive():
                run.cancel()
                await asyncio.gather(run, return_exceptions=True)
                return self._killed_by_model("the notebook kernel died while the model's cell ran")

    def _killed_by_model(self, why: str) -> str:
        """The kernel died of the model's code: the episode ends, scored 0 (``kernel_died``)."""
        self.kernel_killed = why + " (the model's code killed or crashed it)"
        if self.state.disk_killed:  # the work dir's disk quota killed it (notebook_app)
            self.kernel_killed = f"{why}: killed at its work dir's disk quota: {self.state.disk_killed}"
        self.state.done = True
        return f"Error: {self.kernel_killed}. The episode ends without an answer."

    async def submit_answer(self, answer: str) -> str:
        """Submit the final answer to the question. This ends the episode.

        Args:
            answer: The answer only: one number, or the letter of the right option.
        """
        if self.state.done:  # one answer per episode: a second call of the same turn changes nothing
            return EPISODE_ENDED
        self.state.done = True
        self.state.answer = answer
        self.submitted = str(answer)
        self.verdict = grade(self.row, str(answer))
        self.state.total_reward += 1.0 if self.verdict.correct else 0.0
        return "Correct." if self.verdict.correct else "Incorrect."

    def info(self) -> dict[str, Any]:
        verdict = self.verdict
        if verdict is not None:
            failure_reason, reason = verdict.failure_reason, verdict.reason
        elif self.kernel_killed is not None:
            failure_reason, reason = KERNEL_DIED, self.kernel_killed
        else:
            failure_reason, reason = "no_answer", "the episode ended without submit_answer"
        return {
            "cells_run": self.cells_run,
            "submitted_answer": self.submitted,
            "answer_parse_status": verdict.parse_status if verdict else "no_answer",
            "failure_reason": failure_reason,
            "reason": reason,
            "infra_error": self.infra_error,
        }


# ------------------------------------------------------------------------------------------------
# The server.


class CapsuleServerConfig(NotebookServerConfig):
    capsules_dir: str | None = Field(
        default=None,
        description="Where the rows' data_folder paths live (default: this folder's data/capsules).",
    )


class CapsuleSeedSessionRequest(CapsuleRow, AviarySeedSessionRequest):
    pass


class CapsuleVerifyRequest(CapsuleRow, AviaryAgentVerifyRequest):
    pass


class CapsuleVerifyResponse(CapsuleVerifyRequest, AviaryAgentVerifyResponse):
    failure_reason: str
    reason: str
    answer_parse_status: str
    submitted_answer: str | None
    cells_run: int


def _path(configured: str | None, default: Path) -> Path:
    return default if configured is None else resolve_data_path(configured, default.name)


class CapsuleTaskDataset(TaskDataset[CapsuleEnv]):
    """The capsule rows of a JSONL file (Aviary's view: envs by index); the server builds envs from the
    row each request carries, and uses this file only when a request names no row."""

    def __init__(self, config: CapsuleServerConfig):
        self.config = config
        self.capsules_dir = _path(config.capsules_dir, HERE / "data" / "capsules")
        if not self.capsules_dir.is_dir():
            raise DatasetFileError(f"capsules_dir {self.capsules_dir} is not a directory")
        path = _path(config.dataset_jsonl_fpath, HERE / "data" / "capsules.jsonl")
        self.rows: list[CapsuleRow] = []
        for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                self.rows.append(CapsuleRow.model_validate(json.loads(line)))
            except (json.JSONDecodeError, ValidationError) as e:
                raise DatasetFileError(f"{path}:{line_no}: {e}") from None
        self.sandbox = _sandbox(config)

    def __len__(self) -> int:
        return len(self.rows)

    def folder(self, row: CapsuleRow) -> Path:
        """The capsule's data folder; ``HTTPException(422)`` naming ``data_folder`` if it is not one."""
        base = self.capsules_dir.resolve()
        folder = (base / row.data_folder).resolve()
        if not folder.is_relative_to(base) or not folder.is_dir() or not any(folder.iterdir()):
            raise HTTPException(
                422,
                f"bad row: data_folder {row.data_folder!r} is not a capsule folder under {self.capsules_dir}",
            )
        return folder

    def env_for(self, row: CapsuleRow) -> CapsuleEnv:
        c = self.config
        return CapsuleEnv(
            row=row,
            files_dir=self.folder(row),
            limits=c.kernel_limits,
            cell_timeout_s=c.cell_timeout_s,
            sandbox=self.sandbox,
        )

    def get_new_env_by_idx(self, idx: int) -> CapsuleEnv:
        return self.env_for(self.rows[idx])


def _sandbox(config: CapsuleServerConfig) -> bool:
    import shutil

    have_bwrap = shutil.which("bwrap") is not None
    if config.kernel_sandbox == "bwrap" and not have_bwrap:
        raise DatasetFileError(
            "kernel_sandbox: bwrap, but bubblewrap is not installed (apt-get install bubblewrap)"
        )
    return config.kernel_sandbox == "bwrap" or (config.kernel_sandbox == "auto" and have_bwrap)


class CapsuleResourcesServer(AviaryResourcesServer[CapsuleEnv, CapsuleTaskDataset]):
    config: CapsuleServerConfig
    dataset: CapsuleTaskDataset = Field(default_factory=lambda data: CapsuleTaskDataset(data["config"]))

    async def seed_session(
        self, request: Request, body: CapsuleSeedSessionRequest
    ) -> AviarySeedSessionResponse:
        """Start a kernel on the row's capsule (a kernel that cannot start is a 503, never a score)."""
        try:
            return await super().seed_session(request, body)
        except HTTPException:
            raise
        except Exception as e:  # noqa: BLE001 - the kernel or its sandbox failed to start
            raise HTTPException(
                503, f"the notebook kernel could not start ({type(e).__name__}: {e}); retry later"
            ) from e

    def check_seed_request(self, body: AviarySeedSessionRequest) -> None:
        if isinstance(body, CapsuleRow):
            self.dataset.folder(body)
        else:
            super().check_seed_request(body)

    def new_env(self, task_idx: int, body: AviarySeedSessionRequest | None = None) -> CapsuleEnv:
        if isinstance(body, CapsuleRow):
            return self.dataset.env_for(
                CapsuleRow.model_validate(body.model_dump(include=set(CapsuleRow.model_fields)))
            )
        return super().new_env(task_idx, body)

    def env_info(self, env: Any) -> dict[str, Any]:
        return env.info() if isinstance(env, CapsuleEnv) else {}

    async def verify(self, request: Request, body: CapsuleVerifyRequest) -> CapsuleVerifyResponse:
        base = await super().verify(request, body)
        info = self.record_info(body.response.env_id)
        if info.get("infra_error"):
            raise HTTPException(503, f"infrastructure error, not scored: {info['infra_error']}")
        return CapsuleVerifyResponse.from_request(
            body,
            reward=base.reward,
            step_rewards=base.step_rewards,
            num_steps=base.num_steps,
            env_done=base.env_done,
            failure_reason=info.get("failure_reason", "no_answer"),
            reason=info.get("reason", "the environment kept no record of an answer"),
            answer_parse_status=info.get("answer_parse_status", "no_answer"),
            submitted_answer=info.get("submitted_answer"),
            cells_run=int(info.get("cells_run", 0)),
        )


if __name__ == "__main__":
    CapsuleResourcesServer.run_webserver()
