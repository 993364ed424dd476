"""harness_agent: any program as the agent of a rollout, trained with the exact tokens it sent and got.

One ``POST /run`` is one rollout:

1. ``POST /seed_session`` on the resources server with the task row.
2. The harness ``command`` starts in a fresh working directory (the row's ``harness_files`` written
   into it), in a process group of its own, with the task's text on stdin (``task_input: stdin``) or in
   the file ``TASK.md`` (``task_input: file``), and the whole ``responses_create_params`` in
   ``$NG_TASK_JSON``. Its model is the configured model server, reached through a URL scoped to this
   rollout (``/ng-rollout/<id>/``): ``OPENAI_BASE_URL`` (``.../v1``), ``ANTHROPIC_BASE_URL``, the
   rollout's own credential as ``OPENAI_API_KEY`` / ``ANTHROPIC_API_KEY`` (:func:`nemo_gym.auth.rollout_credential`:
   it opens ``/ng-rollout/<id>/v1/*`` and nothing else; the harness never holds the run token), and the
   model's name as ``NG_MODEL``. The
   agent's Python environment's ``bin`` comes first on ``PATH`` (a CLI harness installed beside
   nemo-gym, such as mini-swe-agent's ``mini``, is found by name).
3. The harness ends (or is killed with its whole process group at ``timeout_s``); its final answer is
   its stdout (``final_answer: stdout``) or the file ``answer_file`` it wrote.
4. The model server recorded every call of the rollout (the run needs ``observability_enabled: true``;
   the agent refuses to start without it); the agent takes them (``POST /ng_model_calls/pop``) and
   builds the training samples (:mod:`nemo_gym.kit.harness_trajectory`).
5. ``POST /verify`` with the row and a Responses object whose output is the harness's final answer as
   an assistant message, plus ``final_files`` (relative path -> text, ``None`` for a named file that is
   gone) when the config's ``final_files`` lists glob patterns of the working directory's files to
   report (environments that judge the files, resources_servers/file_edit_tasks); the answer is the verify response plus ``harness`` (exit code, the capped tail
   of its stderr, duration, calls) and ``training`` (the samples).

A harness that cannot start, runs past ``timeout_s``, never calls the model, or exits non-zero after a
failed model call fails the rollout with a 502 of kind ``harness_failed`` naming the command: it lands in
the failures file, never as a reward. A harness that exits non-zero (or is killed) after every model call
of the rollout answered was ended by what the model did (its commands, its answers): the rollout is
scored 0 with ``failure_reason`` saying so, without ``/verify``.

The model calls are recorded under the row's ``_ng_rollout_id`` when it has one (``ng_reward_audit``
gives each played row its own, and the scripted model picks each rollout's turns by it), else a fresh id.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import orjson
from fastapi import Request
from fastapi.responses import Response
from pydantic import Field, model_validator

from nemo_gym.auth import rollout_credential, server_token_from_env
from nemo_gym.base_resources_server import BaseRunRequest
from nemo_gym.base_responses_api_agent import BaseResponsesAPIAgentConfig, SimpleResponsesAPIAgent
from nemo_gym.config.keys import ROLLOUT_ID_KEY_NAME
from nemo_gym.config_types import ModelServerRef, ResourcesServerRef
from nemo_gym.errors import error_envelope
from nemo_gym.kit.harness_trajectory import merge_samples, policy_versions_of_calls
from nemo_gym.openai_utils import new_id
from nemo_gym.server.base import validated_body
from nemo_gym.server.model_calls import POP_PATH
from nemo_gym.server.policy_version import POLICY_VERSIONS_KEY
from nemo_gym.server.rollout_prefix import ROLLOUT_ID_PATTERN

HARNESS_FAILED = "harness_failed"


class HarnessFailed(Exception):
    """The harness could not do its part of the rollout (message names the command and why)."""


class HarnessAgentConfig(BaseResponsesAPIAgentConfig):
    resources_server: ResourcesServerRef
    model_server: ModelServerRef
    # The program and its arguments. ``python`` is the Python running this agent; an argument naming an
    # existing file relative to the directory ng_run runs in is given to the harness as an absolute path
    # (the harness runs in a working directory of its own).
    command: list[str] = Field(min_length=1)
    task_input: Literal["stdin", "file"] = "stdin"
    final_answer: Literal["stdout", "file"] = "stdout"
    answer_file: str = "ANSWER.txt"
    timeout_s: float = Field(default=600.0, gt=0)
    max_stderr_bytes: int = Field(default=64 * 1024, ge=0)
    env: dict[str, str] = Field(default_factory=dict)  # more environment variables for the harness
    model_name: str | None = None  # NG_MODEL; default: responses_create_params.model, else the server's name
    # Files of the working directory (glob patterns relative to it) whose text at the end is sent to
    # /verify as ``final_files`` (relative path -> text), for environments that judge what the harness
    # changed (resources_servers/file_edit_tasks). Empty: nothing is sent.
    final_files: list[str] = Field(default_factory=list)
    max_final_file_bytes: int = Field(default=256 * 1024, gt=0)  # a longer file is sent cut to this

    @model_validator(mode="after")
    def _final_files_stay_inside(self) -> HarnessAgentConfig:
        for pattern in self.final_files:
            path = PurePosixPath(pattern)
            if path.is_absolute() or ".." in path.parts or not path.parts:
                raise ValueError(
                    f"final_files: {pattern!r} must be a relative glob pattern inside the working directory"
                )
        return self

    @model_validator(mode="after")
    def _answer_file_stays_inside(self) -> HarnessAgentConfig:
        path = PurePosixPath(self.answer_file)
        if path.is_absolute() or ".." in path.parts or not path.parts:
            raise ValueError(
                f"answer_file must be a relative path inside the working directory, got {self.answer_file!r}"
            )
        return self


def task_text(params: dict[str, Any]) -> str:
    """The task as text for the harness: a string input as is, else the text of the last user message."""
    raw = params.get("input")
    if isinstance(raw, str):
        return raw
    for item in reversed(raw or []):
        if isinstance(item, dict) and item.get("role") == "user":
            content = item.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def harness_argv(command: list[str]) -> list[str]:
    """The argv to start: ``python`` is this process's Python; arguments naming an existing file relative
    to this process's directory (where ng_run runs) become absolute paths."""
    here = Path.cwd()
    argv = [sys.executable if command[0] == "python" else command[0]]
    for arg in command[1:]:
        argv.append(str(here / arg) if not os.path.isabs(arg) and (here / arg).is_file() else arg)
    if argv[0] != sys.executable and not os.path.isabs(argv[0]) and (here / argv[0]).is_file():
        argv[0] = str(here / argv[0])
    return argv


def _write_files(workdir: Path, files: Any) -> None:
    """Write the row's ``harness_files`` (relative path -> text) into the working directory."""
    if files is None:
        return
    if not isinstance(files, dict):
        raise ValueError("harness_files must be an object of relative path -> text")
    for name, text in files.items():
        path = PurePosixPath(name)
        if path.is_absolute() or ".." in path.parts or not isinstance(text, str):
            raise ValueError(
                f"harness_files: {name!r} must be a relative path inside the working directory with text"
            )
        target = workdir.joinpath(*path.parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)


def _kill_group(process: asyncio.subprocess.Process) -> None:
    """Kill the harness's whole process group (it runs in a session of its own)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


class HarnessAgent(SimpleResponsesAPIAgent):
    config: HarnessAgentConfig

    def setup_webserver(self) -> Any:
        if not self._model_call_capture_enabled():
            raise ValueError(
                f"agent '{self.config.name}' (harness_agent) needs the model server to record the harness's "
                "calls: set observability_enabled: true at the top level of the run's config"
            )
        return super().setup_webserver()

    async def responses(self, request: Request) -> Response:
        body = error_envelope(
            "not_supported",
            server=self.config.name,
            path="/v1/responses",
            message="harness_agent runs whole rollouts only: POST /run with a task row",
        )
        return Response(orjson.dumps(body), status_code=404, media_type="application/json")

    async def run(self, request: Request) -> Response:
        row = await validated_body(request, BaseRunRequest)
        try:
            result = await self._rollout(row, dict(request.cookies))
        except HarnessFailed as e:
            body = error_envelope(HARNESS_FAILED, server=self.config.name, path="/run", message=str(e))
            return Response(orjson.dumps(body), status_code=502, media_type="application/json")
        return Response(orjson.dumps(result), media_type="application/json")

    async def _rollout(self, row: dict[str, Any], cookies: dict[str, str]) -> dict[str, Any]:
        resources = self.config.resources_server.name
        _, new_cookies = await self.server_client.post_json(
            resources, "/seed_session", json=row, cookies=cookies, **self.timeout("seed_session_timeout_s")
        )
        cookies.update(new_cookies)
        rollout_id = self._rollout_id(row)
        workdir = Path(tempfile.mkdtemp(prefix="ng_harness_"))
        try:
            try:
                _write_files(workdir, row.get("harness_files"))
            except ValueError as e:
                raise HarnessFailed(str(e)) from None
            try:
                run = await self._run_harness(row, rollout_id, workdir)
            finally:  # taken even when the harness failed: the server keeps nothing of this rollout
                calls = await self._pop_calls(rollout_id)
            if not calls and run["exit_code"] != 0:
                raise HarnessFailed(
                    f"harness {self.config.command!r} exited with status {run['exit_code']}; "
                    f"its stderr ends: {run['stderr'][-2000:]}"
                )
            if not calls:
                raise HarnessFailed(
                    f"harness {self.config.command!r} never called the model (its base URL is in "
                    f"OPENAI_BASE_URL / ANTHROPIC_BASE_URL); its stderr ends: {run['stderr'][-2000:]}"
                )
            if run["exit_code"] != 0:
                last = calls[-1]
                if (last.get("status_code") or 0) >= 400 or last.get("error_category"):
                    raise HarnessFailed(
                        f"harness {self.config.command!r} exited with status {run['exit_code']} after its "
                        f"last model call failed (HTTP {last.get('status_code')}: {last.get('error')}); its "
                        f"stderr ends: {run['stderr'][-2000:]}"
                    )
                # Every model call answered, and then the harness died or failed: what ended it came from
                # the model (its commands, e.g. killing the harness, or an answer the harness could not
                # take). That is the model's score, never a rollout dropped from training as unscored.
                return self._model_ended_harness(row, run, calls, rollout_id)
            answer = self._final_answer(run["stdout"], workdir)
            final_files = self._final_files(workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        response = self._response(row, answer)
        verify_body = {**row, "response": response}
        if self.config.final_files:
            verify_body["final_files"] = final_files
        verify, _ = await self.server_client.post_json(
            resources,
            "/verify",
            json=verify_body,
            cookies=cookies,
            **self.timeout("verify_timeout_s"),
        )
        self.observe_loop(len(calls), 0)
        harness = {
            "exit_code": run["exit_code"],
            "duration_s": run["duration_s"],
            "stderr": run["stderr"],
            "model_calls": len(calls),
            "rollout_id": rollout_id,
        }
        out = {**row, **verify, "harness": harness, "training": merge_samples(calls)}
        versions = policy_versions_of_calls(calls)
        if versions:  # the collector's max_policy_lag judges the rollout by them
            out[POLICY_VERSIONS_KEY] = versions
        return out

    def _rollout_id(self, row: dict[str, Any]) -> str:
        """The id the harness's model calls are recorded under: the row's own ``_ng_rollout_id`` when it
        names one (so a scripted model can play each rollout its own turns, as ``ng_reward_audit`` does),
        else a fresh one."""
        explicit = row.get(ROLLOUT_ID_KEY_NAME)
        if isinstance(explicit, str) and ROLLOUT_ID_PATTERN.match(explicit) and len(explicit) <= 256:
            return explicit
        return new_id("harness")

    def _model_ended_harness(
        self, row: dict[str, Any], run: dict[str, Any], calls: list[dict[str, Any]], rollout_id: str
    ) -> dict[str, Any]:
        """The result of a rollout whose harness failed after every model call had answered: reward 0
        with the reason (the files and answer it left are not judged)."""
        code = run["exit_code"]
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        reason = (
            f"the harness {how} after {len(calls)} model calls that all answered: the model's commands or "
            "answers ended it before it finished"
        )
        harness = {
            "exit_code": code,
            "duration_s": run["duration_s"],
            "stderr": run["stderr"],
            "model_calls": len(calls),
            "rollout_id": rollout_id,
        }
        out = {
            **row,
            "response": self._response(row, run["stdout"].strip()),
            "reward": 0.0,
            "failure_reason": reason,
            "harness": harness,
            "training": merge_samples(calls),
        }
        versions = policy_versions_of_calls(calls)
        if versions:
            out[POLICY_VERSIONS_KEY] = versions
        self.observe_loop(len(calls), 0)
        return out

    def _response(self, row: dict[str, Any], answer: str) -> dict[str, Any]:
        """A Responses object whose output is the harness's final answer as an assistant message."""
        return {
            "id": new_id("resp"),
            "object": "response",
            "created_at": int(time.time()),
            "model": self._model_name(row),
            "status": "completed",
            "output": [
                {
                    "type": "message",
                    "id": new_id("msg"),
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": answer, "annotations": []}],
                }
            ],
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
        }

    def _model_name(self, row: dict[str, Any]) -> str:
        return (
            self.config.model_name
            or (row.get("responses_create_params") or {}).get("model")
            or self.config.model_server.name
        )

    async def _run_harness(self, row: dict[str, Any], rollout_id: str, workdir: Path) -> dict[str, Any]:
        params = row.get("responses_create_params") or {}
        text = task_text(params)
        task_json = workdir / ".ng_task.json"
        task_json.write_bytes(orjson.dumps(params))
        if self.config.task_input == "file":
            (workdir / "TASK.md").write_text(text)
        model = self.config.model_server.name
        base = self.resolve_model_base_url(model, rollout_id)  # .../ng-rollout/<id>/v1
        # The harness's key opens this rollout's model calls and nothing else (nemo_gym.auth): never the run token.
        run_token = server_token_from_env()[0]
        token = rollout_credential(run_token, rollout_id) if run_token else "no-token"
        env = {
            **os.environ,
            # The agent's Python environment first, as an activated venv would: its console scripts
            # (a CLI harness installed beside nemo-gym, e.g. mini-swe-agent's ``mini``) are found by name.
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", os.defpath)]),
            **self.config.env,
            "OPENAI_BASE_URL": base,
            "OPENAI_API_KEY": token,
            "ANTHROPIC_BASE_URL": base.removesuffix("/v1"),
            "ANTHROPIC_API_KEY": token,
            "NG_MODEL": self._model_name(row),
            "NG_TASK_JSON": str(task_json),
            "NG_ROLLOUT_ID": rollout_id,
        }
        started = time.monotonic()
        try:
            process = await asyncio.create_subprocess_exec(
                *harness_argv(self.config.command),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=workdir,
                env=env,
                start_new_session=True,
            )
        except OSError as e:
            raise HarnessFailed(
                f"harness {self.config.command!r} could not start: {type(e).__name__}: {e}"
            ) from None
        stdin = text.encode() if self.config.task_input == "stdin" else b""
        try:
            stdout, stderr = await asyncio.wait_for(process.communicate(stdin), self.config.timeout_s)
        except TimeoutError:
            _kill_group(process)
            await process.wait()
            raise HarnessFailed(
                f"harness {self.config.command!r} ran past timeout_s={self.config.timeout_s} of agent "
                f"'{self.config.name}' and was killed with its process group"
            ) from None
        finally:
            _kill_group(process)  # whatever it left running in its group goes too
        cap = self.config.max_stderr_bytes
        return {
            "exit_code": process.returncode,
            "stdout": stdout.decode(errors="replace"),
            "stderr": stderr[-cap:].decode(errors="replace") if cap else "",
            "duration_s": round(time.monotonic() - started, 3),
        }

    async def _pop_calls(self, rollout_id: str) -> list[dict[str, Any]]:
        answer, _ = await self.server_client.post_json(
            self.config.model_server.name,
            POP_PATH,
            json={"rollout_ids": [rollout_id]},
            **self.timeout("model_timeout_s"),
        )
        return list((answer.get("calls") or {}).get(rollout_id) or [])

    def _final_answer(self, stdout: str, workdir: Path) -> str:
        if self.config.final_answer == "stdout":
            return stdout.strip()
        path = workdir.joinpath(*PurePosixPath(self.config.answer_file).parts)
        if not path.is_file():
            raise HarnessFailed(
                f"harness {self.config.command!r} wrote no {self.config.answer_file} (final_answer: file)"
            )
        return path.read_text(errors="replace").strip()

    def _final_files(self, workdir: Path) -> dict[str, str | None]:
        """The text of the working directory's files that ``final_files`` names (a pattern without any
        wildcard that matches nothing is reported as ``None``: the harness deleted or never made it)."""
        out: dict[str, str | None] = {}
        cap = self.config.max_final_file_bytes
        root = workdir.resolve()
        for pattern in self.config.final_files:
            matches = sorted(p for p in workdir.glob(pattern) if p.is_file())
            if not matches and not any(c in pattern for c in "*?["):
                out[pattern] = None
            for path in matches:
                if not path.resolve().is_relative_to(root):  # a symlink the harness left pointing out
                    continue
                with path.open("rb") as f:
                    out[path.relative_to(workdir).as_posix()] = f.read(cap).decode(errors="replace")
        return out


if __name__ == "__main__":
    HarnessAgent.run_webserver()
