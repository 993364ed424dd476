"""harness_agent: any program as the agent of a rollout, trained with the exact tokens it sent and got.

One ``POST /run`` is one rollout:

1. ``POST /seed_session`` on the resources server with the task row.
2. The harness ``command`` starts in a sandbox of its own (:class:`nemo_gym.sandbox.SandboxSession`:
   bubblewrap, no network, uid 65534, the host's ``/usr`` read-only, memory / process / disk limits),
   in ``/workspace``: the row's ``harness_files`` (``workspace: files``), or the task's workspace as the
   resources server exports it (``workspace: resources_server``, ``POST /export_workspace``). Bound
   read-only: the Python environment running this agent (its venv and the installation it is based on,
   so a CLI harness installed beside nemo-gym, such as mini-swe-agent's ``mini``, runs by name), file
   arguments of ``command``, and ``sandbox.ro_binds``. Nothing else of the host: no repository, no home,
   no ``~/.cache``, no run-token files, no other rollout's files, no host network. The task's text is on
   stdin (``task_input: stdin``) or in ``$NG_TASK_FILE`` (``task_input: file``; in ``workspace: files``
   also ``TASK.md`` in the working directory), the whole ``responses_create_params`` in ``$NG_TASK_JSON``.
   Its model is the configured model server, reached through a URL scoped to this rollout
   (``/ng-rollout/<id>/``) at ``127.0.0.1:<port>`` in the sandbox's own network namespace, where a relay
   (``model_relay.py``) carries each connection over a Unix socket bound into the sandbox to this agent,
   which connects it to the model server and nowhere else: ``OPENAI_BASE_URL`` (``.../v1``),
   ``ANTHROPIC_BASE_URL``, the rollout's own credential as ``OPENAI_API_KEY`` / ``ANTHROPIC_API_KEY``
   (:func:`nemo_gym.auth.rollout_credential`: it opens ``/ng-rollout/<id>/v1/*`` and nothing else), and
   the model's name as ``NG_MODEL``. ``unsafe_host: true`` runs the harness on the host instead, as this
   server's user, in a temporary directory (never for training: the model's commands can read and do
   anything this server can).
3. The harness ends, or is killed at ``timeout_s``; its whole process tree dies with it (the sandbox's
   pid namespace and cgroups; on the host, its process group). Its final answer is its stdout
   (``final_answer: stdout``) or the file ``answer_file`` it wrote.
4. The model server recorded every call of the rollout (the run needs ``observability_enabled: true``;
   the agent refuses to start without it); the agent takes them (``POST /ng_model_calls/pop``) and
   builds the training samples (:mod:`nemo_gym.kit.harness_trajectory`).
5. ``POST /verify`` with the row and a Responses object whose output is the harness's final answer as
   an assistant message, plus ``final_files`` (relative path -> text, ``None`` for a named file that is
   gone) when the config's ``final_files`` lists glob patterns of the working directory's files to
   report (environments that judge the files, resources_servers/file_edit_tasks), or, with ``workspace:
   resources_server``, ``workspace_changes`` (base64 of the changeset tar of what the harness changed in
   the task's workspace, :mod:`nemo_gym.sandbox.changes`, which the environment applies to a fresh copy
   of the workspace before it judges it: resources_servers/workspace_tasks); the answer is the verify
   response plus ``harness`` (exit code, the capped tail of its stderr, duration, calls) and ``training``.

A harness that cannot start, runs past ``timeout_s``, never calls the model, or exits non-zero after a
failed model call fails the rollout with a 502 of kind ``harness_failed`` naming the command: it lands in
the failures file, never as a reward. A sandbox that cannot start is a 503 (``sandbox_unavailable``). A
harness that exits non-zero (or is killed: by its own commands, at its output, memory or disk bound)
after every model call of the rollout answered was ended by what the model did: the rollout is scored 0
with ``failure_reason`` saying so, without ``/verify``; so is a workspace whose changes pass
``max_workspace_changes_bytes``.

The model calls are recorded under the row's ``_ng_rollout_id`` when it has one (``ng_reward_audit``
gives each played row its own, and the scripted model picks each rollout's turns by it), else a fresh id.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import contextlib
import fnmatch
import hashlib
import logging
import os
import shutil
import signal
import sys
import sysconfig
import tempfile
import time
from pathlib import Path, PurePosixPath
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import orjson
from fastapi import Request
from fastapi.responses import Response
from pydantic import Field, PrivateAttr, model_validator

from nemo_gym.auth import rollout_credential, server_token_from_env
from nemo_gym.base_resources_server import BaseRunRequest
from nemo_gym.base_responses_api_agent import BaseResponsesAPIAgentConfig, SimpleResponsesAPIAgent
from nemo_gym.config.keys import ROLLOUT_ID_KEY_NAME
from nemo_gym.config_types import ModelServerRef, ResourcesServerRef
from nemo_gym.errors import error_envelope
from nemo_gym.kit.harness_trajectory import merge_samples, policy_versions_of_calls
from nemo_gym.openai_utils import new_id
from nemo_gym.sandbox import (
    SandboxError,
    SandboxProviderConfig,
    SandboxSession,
    SessionClosedError,
    SessionLimits,
    check_sandbox_available,
    prepare_workspace,
)
from nemo_gym.sandbox.changes import WHITEOUT, ChangesTooLargeError, pack_upper, read_changes
from nemo_gym.server.base import validated_body
from nemo_gym.server.model_calls import POP_PATH
from nemo_gym.server.policy_version import POLICY_VERSIONS_KEY
from nemo_gym.server.rollout_prefix import ROLLOUT_ID_PATTERN

LOG = logging.getLogger("nemo_gym")

HARNESS_FAILED = "harness_failed"
SANDBOX_UNAVAILABLE = "sandbox_unavailable"
SANDBOX_MODEL_PORT = 8000  # the model's address inside a harness's sandbox: 127.0.0.1:8000 (its own netns)
_INSIDE_RUN_DIR = "/run/ng-harness"  # bound read-only: the model socket, the task's files
_RELAY_SOURCE = Path(__file__).with_name("model_relay.py").read_bytes()  # copied into each rollout's run dir
_RELAY_INSIDE = f"{_INSIDE_RUN_DIR}/model_relay.py"
_CANNOT_START = "ng-harness: cannot start"
_MAX_RELAY_CONNECTIONS = 64  # open connections per rollout from its harness to the model server


class HarnessFailed(Exception):
    """The harness could not do its part of the rollout (message names the command and why)."""


class HarnessInfraError(Exception):
    """The harness's sandbox could not be set up: infrastructure (a 503), never the model's score."""


class HarnessAgentConfig(BaseResponsesAPIAgentConfig):
    resources_server: ResourcesServerRef
    model_server: ModelServerRef
    # The program and its arguments. ``python`` is the Python running this agent; an argument naming an
    # existing file relative to the directory ng_run runs in is given to the harness as an absolute path
    # (bound read-only into its sandbox at that path: the file alone).
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
    # Where the harness's working directory comes from: the row's ``harness_files`` (files), or the task's
    # workspace exported by the resources server (resources_server: POST /export_workspace; what the
    # harness changed goes to /verify as ``workspace_changes``). resources_server needs the sandbox.
    workspace: Literal["files", "resources_server"] = "files"
    unsafe_host: bool = Field(
        default=False,
        description="UNSAFE, never for training: run the harness ON THE HOST as this server's user (the "
        "model's commands can read the repository and its answer keys, the run's token files, call every "
        "server, and leave processes behind). Default: the harness runs in a sandbox",
    )
    sandbox: SandboxProviderConfig = Field(default_factory=SandboxProviderConfig)  # bubblewrap only
    # SessionLimits fields for the harness's sandbox, over the defaults below (sandbox_limits()).
    sandbox_limits: dict[str, int | float] = Field(default_factory=dict)
    max_output_bytes: int = Field(default=16 << 20, gt=0)  # each of stdout / stderr; past it: killed
    # Bound on what the harness's workspace sends on (the final_files' or the changes' tar).
    max_workspace_changes_bytes: int = Field(default=16 << 20, gt=0)

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

    @model_validator(mode="after")
    def _workspace_fits(self) -> HarnessAgentConfig:
        if self.workspace == "resources_server" and self.unsafe_host:
            raise ValueError(
                "workspace: resources_server runs the harness in a sandbox only (not unsafe_host)"
            )
        if self.workspace == "resources_server" and self.final_files:
            raise ValueError(
                "final_files reports the files of workspace: files; with workspace: resources_server the "
                "whole change goes to /verify as workspace_changes"
            )
        if self.sandbox.backend != "bubblewrap":
            raise ValueError(
                "the harness's sandbox is bubblewrap (sandbox.backend); to run a harness without one, set "
                "unsafe_host: true (never for training)"
            )
        self.sandbox_limits_for()  # unknown keys or bad values fail here, before the server starts
        # sandbox.ro_binds relative to where ng_run runs (e.g. a harness's own folder), bound at that path.
        self.sandbox.ro_binds = [os.path.abspath(path) for path in self.sandbox.ro_binds]
        return self

    def sandbox_limits_for(self) -> SessionLimits:
        """The harness's sandbox limits: one command (the harness) bounded by ``timeout_s``, a whole
        Python agent's memory and processes, then ``sandbox_limits`` over them."""
        lifetime = self.timeout_s + 600
        defaults: dict[str, float] = {
            "memory_mib": 2048,
            "processes": 256,
            "disk_quota_mib": 512,
            "command_wall_time_s": self.timeout_s,
            "command_cpu_time_s": self.timeout_s,
            "output_limit_bytes": self.max_output_bytes,
            "tmp_size_mib": 256,
            "idle_timeout_s": lifetime,
            "lifetime_s": lifetime,
        }
        limits = SessionLimits.from_mapping({**defaults, **self.sandbox_limits})
        if limits.command_wall_time_s < self.timeout_s:
            limits.command_wall_time_s = self.timeout_s
        return limits


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


def python_env_binds() -> dict[str, str]:
    """What of the Python environment running this agent a harness needs, as read-only binds (host path
    -> the same path inside): its venv (``sys.prefix``) and the installation the venv is based on
    (``sys.base_prefix``), except what the sandbox has anyway (``/usr``). A venv that leaves the base's
    site-packages out (``include-system-site-packages = false``) gets an empty directory bound over them:
    what else is installed in the base Python stays out of the model's sight."""
    binds: dict[str, str] = {}
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        if prefix in ("/", "/usr") or prefix.startswith("/usr/") or not os.path.isdir(prefix):
            continue
        binds[prefix] = prefix
        real = os.path.realpath(prefix)
        if real != prefix and not real.startswith("/usr/"):
            binds[real] = real
    if sys.prefix != sys.base_prefix and not _venv_uses_system_site_packages():
        base_site = sysconfig.get_path("purelib", vars={"base": sys.base_prefix, "platbase": sys.base_prefix})
        if os.path.isdir(base_site) and any(_under(base_site, b) for b in binds):
            binds[_empty_dir()] = base_site
    return binds


def _venv_uses_system_site_packages() -> bool:
    try:
        text = (Path(sys.prefix) / "pyvenv.cfg").read_text()
    except OSError:
        return True
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "include-system-site-packages":
            return value.strip().lower() == "true"
    return False


_EMPTY: list[str] = []


def _empty_dir() -> str:
    """One empty, read-only directory per process (bound over what a sandbox must not see)."""
    if not _EMPTY:
        path = tempfile.mkdtemp(prefix="ng-harness-empty-")
        os.chmod(path, 0o555)
        atexit.register(os.rmdir, path)
        _EMPTY.append(path)
    return _EMPTY[0]


def _under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _checked_files(files: Any) -> dict[str, str]:
    """The row's ``harness_files`` (relative path -> text), checked."""
    if files is None:
        return {}
    if not isinstance(files, dict):
        raise ValueError("harness_files must be an object of relative path -> text")
    out: dict[str, str] = {}
    for name, text in files.items():
        path = PurePosixPath(name)
        if path.is_absolute() or ".." in path.parts or not path.parts or not isinstance(text, str):
            raise ValueError(
                f"harness_files: {name!r} must be a relative path inside the working directory with text"
            )
        out[path.as_posix()] = text
    return out


def glob_matches(pattern: str, rel: str) -> bool:
    """Whether the relative path ``rel`` matches the glob ``pattern`` as ``Path.glob`` reads it: ``*``,
    ``?`` and ``[...]`` within one path part, ``**`` any number of parts (none too)."""
    pat, parts = pattern.split("/"), rel.split("/")
    if pat[-1] == "**":  # Path.glob: a trailing ** names directories only, never a file
        return False
    # reach[j]: the first i pattern parts can match the first j path parts (iterative, any depth).
    reach = [True] + [False] * len(parts)
    for p in pat:
        if p == "**":
            seen = False
            for j in range(len(parts) + 1):
                seen = seen or reach[j]
                reach[j] = seen
            continue
        reach = [False] + [reach[j] and fnmatch.fnmatchcase(parts[j], p) for j in range(len(parts))]
    return reach[-1]


def _kill_group(process: asyncio.subprocess.Process) -> None:
    """Kill the harness's whole process group (it runs in a session of its own)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


class _ModelRelay:
    """The host end of a sandboxed harness's way to its model: a Unix socket (bound into the sandbox) whose
    every connection is carried, byte for byte, to the model server's address and nowhere else."""

    def __init__(self, path: Path, host: str, port: int) -> None:
        self.path, self.host, self.port = path, host, port
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._connection, path=str(self.path))

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._writers) >= 2 * _MAX_RELAY_CONNECTIONS:
            writer.close()
            return
        self._writers.add(writer)
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        except OSError:
            self._writers.discard(writer)
            writer.close()
            return
        self._writers.add(up_writer)
        try:
            await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        self._writers.clear()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(1 << 16):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, RuntimeError):
        writer.close()


class HarnessAgent(SimpleResponsesAPIAgent):
    config: HarnessAgentConfig

    _layers: dict[str, str] = PrivateAttr(default_factory=dict)  # sha256 of an exported workspace -> layer
    _layers_dir: Path | None = PrivateAttr(default=None)
    _layers_lock: asyncio.Lock = PrivateAttr(default_factory=asyncio.Lock)

    def model_post_init(self, context: Any) -> None:
        super().model_post_init(context)
        if self.config.unsafe_host:
            LOG.warning(
                "UNSAFE: harness_agent '%s' runs its harness ON THE HOST (unsafe_host: true), as this server's "
                "user: the model's commands can read the repository and its answer keys, the run's token "
                "files, call every server and outlive the rollout. Never use this for training.",
                self.config.name,
            )
            return
        check_sandbox_available(self.config.sandbox)  # no bubblewrap: refuse to start

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
        except HarnessInfraError as e:
            body = error_envelope(SANDBOX_UNAVAILABLE, server=self.config.name, path="/run", message=str(e))
            return Response(orjson.dumps(body), status_code=503, media_type="application/json")
        return Response(orjson.dumps(result), media_type="application/json")

    async def _rollout(self, row: dict[str, Any], cookies: dict[str, str]) -> dict[str, Any]:
        resources = self.config.resources_server.name
        _, new_cookies = await self.server_client.post_json(
            resources, "/seed_session", json=row, cookies=cookies, **self.timeout("seed_session_timeout_s")
        )
        cookies.update(new_cookies)
        rollout_id = self._rollout_id(row)
        place: _Place = _HostPlace(self) if self.config.unsafe_host else _SandboxPlace(self)
        extra: dict[str, Any] = {}
        try:
            try:
                await place.open(row, rollout_id, cookies)
                run = await place.run(row, rollout_id)
            finally:  # taken even when the harness failed: the server keeps nothing of this rollout
                calls = await self._pop_calls(rollout_id)
            if not calls and run["exit_code"] != 0:
                if run.get("could_not_start"):
                    raise HarnessFailed(
                        f"harness {self.config.command!r} could not start: {run['could_not_start']}"
                    )
                raise HarnessFailed(
                    f"harness {self.config.command!r} exited with status {run['exit_code']}"
                    f"{run.get('note', '')}; its stderr ends: {run['stderr'][-2000:]}"
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
                code = run["exit_code"]
                how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
                reason = (
                    f"the harness {how}{run.get('note', '')} after {len(calls)} model calls that all answered: "
                    "the model's commands or answers ended it before it finished"
                )
                return self._scored_zero(row, run, calls, rollout_id, reason)
            answer = await place.final_answer(run)
            try:
                if self.config.final_files:
                    extra["final_files"] = await place.final_files()
                if self.config.workspace == "resources_server":
                    extra["workspace_changes"] = await place.workspace_changes()
            except ChangesTooLargeError as e:
                reason = (
                    f"the harness's working directory cannot be sent to /verify: {e} "
                    f"(max_workspace_changes_bytes of agent '{self.config.name}')"
                )
                return self._scored_zero(row, run, calls, rollout_id, reason)
        finally:
            await place.close()
        response = self._response(row, answer)
        verify_body = {**row, "response": response, **extra}
        verify, _ = await self.server_client.post_json(
            resources,
            "/verify",
            json=verify_body,
            cookies=cookies,
            **self.timeout("verify_timeout_s"),
        )
        verify.pop("workspace_changes", None)  # a whole changeset is no part of the rollout's line
        self.observe_loop(len(calls), 0)
        out = {
            **row,
            **verify,
            "harness": self._harness_info(run, calls, rollout_id),
            "training": merge_samples(calls),
        }
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

    @staticmethod
    def _harness_info(run: dict[str, Any], calls: list[dict[str, Any]], rollout_id: str) -> dict[str, Any]:
        return {
            "exit_code": run["exit_code"],
            "duration_s": run["duration_s"],
            "stderr": run["stderr"],
            "model_calls": len(calls),
            "rollout_id": rollout_id,
        }

    def _scored_zero(
        self,
        row: dict[str, Any],
        run: dict[str, Any],
        calls: list[dict[str, Any]],
        rollout_id: str,
        reason: str,
    ) -> dict[str, Any]:
        """The result of a rollout the model ended or spoiled after every model call had answered: reward 0
        with the reason (the files and answer it left are not judged)."""
        out = {
            **row,
            "response": self._response(row, run["stdout"].strip()),
            "reward": 0.0,
            "failure_reason": reason,
            "harness": self._harness_info(run, calls, rollout_id),
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

    def _model_vars(self, row: dict[str, Any], rollout_id: str, base: str) -> dict[str, str]:
        """The variables that point a harness at its model (``base``: its ``.../ng-rollout/<id>/v1``)."""
        # The harness's key opens this rollout's model calls and nothing else (nemo_gym.auth): never the run token.
        run_token = server_token_from_env()[0]
        token = rollout_credential(run_token, rollout_id) if run_token else "no-token"
        return {
            "OPENAI_BASE_URL": base,
            "OPENAI_API_KEY": token,
            "ANTHROPIC_BASE_URL": base.removesuffix("/v1"),
            "ANTHROPIC_API_KEY": token,
            "NG_MODEL": self._model_name(row),
            "NG_ROLLOUT_ID": rollout_id,
        }

    async def _pop_calls(self, rollout_id: str) -> list[dict[str, Any]]:
        answer, _ = await self.server_client.post_json(
            self.config.model_server.name,
            POP_PATH,
            json={"rollout_ids": [rollout_id]},
            **self.timeout("model_timeout_s"),
        )
        return list((answer.get("calls") or {}).get(rollout_id) or [])

    def _final_files_of(self, changes: bytes) -> dict[str, str | None]:
        """``final_files`` from a changeset of the working directory (every file in it: it started empty):
        each regular file a pattern matches, cut at ``max_final_file_bytes``; a pattern without wildcards
        that matches none is ``None`` (the harness deleted the file, or left something else there)."""
        cap = self.config.max_final_file_bytes
        out: dict[str, str | None] = {}
        files = {
            m.name: content
            for m, content in read_changes(changes)
            if content is not None and m.isreg() and WHITEOUT not in m.pax_headers
        }
        for pattern in self.config.final_files:
            matched = sorted(name for name in files if glob_matches(pattern, name))
            if not matched and not any(c in pattern for c in "*?["):
                out[pattern] = None
            for name in matched:
                out[name] = files[name][:cap].decode(errors="replace")
        return out

    def _included(self, rel: str) -> bool:
        return any(glob_matches(p, rel) for p in self.config.final_files)

    async def workspace_layer(self, cookies: dict[str, str]) -> str:
        """The task's workspace the resources server exports (``POST /export_workspace``), prepared once
        per distinct content as a sandbox layer."""
        answer, _ = await self.server_client.post_json(
            self.config.resources_server.name,
            "/export_workspace",
            json={},
            cookies=cookies,
            **self.timeout("seed_session_timeout_s"),
        )
        try:
            data = base64.b64decode(answer["tar_base64"], validate=True)
        except (KeyError, TypeError, ValueError) as e:
            raise HarnessInfraError(
                f"resources server '{self.config.resources_server.name}' answered /export_workspace without a "
                f"tar_base64 workspace ({type(e).__name__})"
            ) from None
        digest = hashlib.sha256(data).hexdigest()
        async with self._layers_lock:  # a GRPO group's rollouts arrive together: one prepares, all share it
            if digest not in self._layers:
                if self._layers_dir is None:
                    self._layers_dir = Path(tempfile.mkdtemp(prefix="ng-harness-workspaces-"))
                    atexit.register(shutil.rmtree, self._layers_dir, True)
                path = self._layers_dir / f"{digest}.tar"
                path.write_bytes(data)
                self._layers[digest] = await prepare_workspace(
                    path, workdir_root=self.config.sandbox.workdir_root
                )
        return self._layers[digest]


class _Place:
    """Where one rollout's harness runs (:class:`_SandboxPlace`, or :class:`_HostPlace` when unsafe)."""

    def __init__(self, agent: HarnessAgent) -> None:
        self.agent = agent
        self.config = agent.config

    async def open(self, row: dict[str, Any], rollout_id: str, cookies: dict[str, str]) -> None: ...

    async def run(self, row: dict[str, Any], rollout_id: str) -> dict[str, Any]: ...

    async def final_answer(self, run: dict[str, Any]) -> str: ...

    async def final_files(self) -> dict[str, str | None]: ...

    async def workspace_changes(self) -> str: ...

    async def close(self) -> None: ...

    def _stdin(self, row: dict[str, Any]) -> bytes:
        text = task_text(row.get("responses_create_params") or {})
        return text.encode() if self.config.task_input == "stdin" else b""


class _SandboxPlace(_Place):
    """The harness in a sandbox session of its own (see the module docstring)."""

    session: SandboxSession | None = None
    relay: _ModelRelay | None = None
    run_dir: Path | None = None

    async def open(self, row: dict[str, Any], rollout_id: str, cookies: dict[str, str]) -> None:
        config = self.config
        params = row.get("responses_create_params") or {}
        text = task_text(params)
        try:
            files = _checked_files(row.get("harness_files"))
        except ValueError as e:
            raise HarnessFailed(str(e)) from None
        if config.task_input == "file" and config.workspace == "files":
            files["TASK.md"] = text
        try:
            layer = (
                await self.agent.workspace_layer(cookies) if config.workspace == "resources_server" else None
            )
            # This rollout's private dir, bound read-only at /run/ng-harness: the model socket and the task.
            self.run_dir = Path(tempfile.mkdtemp(prefix="ng-harness-run-"))
            (self.run_dir / "task.json").write_bytes(orjson.dumps(params))
            (self.run_dir / "TASK.md").write_text(text)
            (self.run_dir / "model_relay.py").write_bytes(_RELAY_SOURCE)
            base = urlsplit(self.agent.resolve_model_base_url(config.model_server.name, rollout_id))
            self.relay = _ModelRelay(
                self.run_dir / "model.sock", base.hostname or "127.0.0.1", base.port or 80
            )
            await self.relay.start()
        except (OSError, ValueError, SandboxError) as e:
            raise HarnessInfraError(
                f"the harness's sandbox could not be set up: {type(e).__name__}: {e}"
            ) from e
        self.inside_base = urlunsplit(("http", f"127.0.0.1:{SANDBOX_MODEL_PORT}", base.path, "", ""))
        self.argv = harness_argv(config.command)
        binds = python_env_binds()
        dirs = ["/usr", *binds.values(), *config.sandbox.ro_binds]
        for arg in self.argv:  # the harness's own files named in its command, read-only
            if os.path.isabs(arg) and os.path.isfile(arg) and not any(_under(arg, d) for d in dirs):
                binds[arg] = arg
        binds[str(self.run_dir)] = _INSIDE_RUN_DIR
        try:
            self.session = await SandboxSession.start(
                workspace=layer,
                files=files,
                limits=config.sandbox_limits_for(),
                provider=config.sandbox,
                binds=binds,
            )
        except (SandboxError, ValueError) as e:
            raise HarnessInfraError(f"the harness's sandbox could not start: {e}") from e

    async def run(self, row: dict[str, Any], rollout_id: str) -> dict[str, Any]:
        config, session = self.config, self.session
        assert session is not None
        venv_bin = str(Path(sys.executable).parent)
        env = {
            "PATH": os.pathsep.join([venv_bin, "/usr/local/bin", "/usr/bin", "/bin"]),
            **config.env,
            **self.agent._model_vars(row, rollout_id, self.inside_base),
            "NG_TASK_JSON": f"{_INSIDE_RUN_DIR}/task.json",
            "NG_TASK_FILE": f"{_INSIDE_RUN_DIR}/TASK.md",
        }
        argv = [
            config.sandbox.python,
            "-I",
            "-S",
            _RELAY_INSIDE,
            f"{_INSIDE_RUN_DIR}/model.sock",
            str(SANDBOX_MODEL_PORT),
            *self.argv,
        ]
        started = time.monotonic()
        note = ""
        try:
            result = await session.exec(
                argv, stdin=self._stdin(row), timeout=config.timeout_s, env=env, pool_slot=False
            )
        except SessionClosedError as e:
            # The sandbox's own processes died (its memory bound, or the harness's commands killed it).
            return {
                "exit_code": -signal.SIGKILL,
                "stdout": "",
                "stderr": "",
                "duration_s": round(time.monotonic() - started, 3),
                "note": f" (its sandbox closed: {str(e).split(' is closed: ', 1)[-1]})",
            }
        except SandboxError as e:
            raise HarnessInfraError(f"the harness's sandbox failed: {e}") from e
        if result.timed_out:
            raise HarnessFailed(
                f"harness {config.command!r} ran past timeout_s={config.timeout_s} of agent '{config.name}' "
                "and was killed with its whole sandbox"
            )
        code = result.return_code
        if (
            code > 128 and code - 128 < signal.NSIG
        ):  # the sandbox reports a signal as 128 + N, as a shell does
            code = -(code - 128)
        if result.error_type == "output_limit":
            note = f" (its output passed max_output_bytes={config.max_output_bytes} and it was stopped)"
        elif result.oom_killed:
            note = f" (its sandbox ran out of memory: {session.limits.memory_mib} MiB)"
        elif result.error_type == "disk_quota":
            note = f" (its workspace passed the disk quota of {session.limits.disk_quota_mib} MiB)"
        cap = config.max_stderr_bytes
        stderr = result.stderr
        start_failed = None
        if code == 127 and _CANNOT_START in stderr:
            start_failed = stderr.split(_CANNOT_START, 1)[1].strip()[:500]
        return {
            "exit_code": code,
            "stdout": result.stdout,
            "stderr": stderr[-cap:] if cap else "",
            "duration_s": round(time.monotonic() - started, 3),
            "note": note,
            "could_not_start": start_failed,
        }

    async def final_answer(self, run: dict[str, Any]) -> str:
        if self.config.final_answer == "stdout":
            return run["stdout"].strip()
        assert self.session is not None
        try:
            data = await self.session.read_file(
                self.config.answer_file, max_bytes=self.config.max_output_bytes
            )
        except ValueError:
            raise HarnessFailed(
                f"harness {self.config.command!r} wrote no {self.config.answer_file} (final_answer: file)"
            ) from None
        return data.decode(errors="replace").strip()

    async def final_files(self) -> dict[str, str | None]:
        assert self.session is not None
        changes = await self.session.export_changes(
            max_bytes=self.config.max_workspace_changes_bytes, include=self.agent._included
        )
        return self.agent._final_files_of(changes)

    async def workspace_changes(self) -> str:
        assert self.session is not None
        changes = await self.session.export_changes(max_bytes=self.config.max_workspace_changes_bytes)
        return base64.b64encode(changes).decode()

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close("its rollout ended")
        if self.relay is not None:
            await self.relay.close()
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)


class _HostPlace(_Place):
    """``unsafe_host: true``: the harness on the host, in a temporary directory, as this server's user."""

    workdir: Path | None = None

    async def open(self, row: dict[str, Any], rollout_id: str, cookies: dict[str, str]) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="ng_harness_"))
        try:
            files = _checked_files(row.get("harness_files"))
        except ValueError as e:
            raise HarnessFailed(str(e)) from None
        for name, text in files.items():
            target = self.workdir.joinpath(*PurePosixPath(name).parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)

    async def run(self, row: dict[str, Any], rollout_id: str) -> dict[str, Any]:
        config, workdir = self.config, self.workdir
        assert workdir is not None
        params = row.get("responses_create_params") or {}
        task_json = workdir / ".ng_task.json"
        task_json.write_bytes(orjson.dumps(params))
        if config.task_input == "file":
            (workdir / "TASK.md").write_text(task_text(params))
        base = self.agent.resolve_model_base_url(
            config.model_server.name, rollout_id
        )  # .../ng-rollout/<id>/v1
        env = {
            **os.environ,
            # The agent's Python environment first, as an activated venv would: its console scripts
            # (a CLI harness installed beside nemo-gym, e.g. mini-swe-agent's ``mini``) are found by name.
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", os.defpath)]),
            **config.env,
            **self.agent._model_vars(row, rollout_id, base),
            "NG_TASK_JSON": str(task_json),
            "NG_TASK_FILE": str(workdir / "TASK.md"),
        }
        started = time.monotonic()
        try:
            process = await asyncio.create_subprocess_exec(
                *harness_argv(config.command),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=workdir,
                env=env,
                start_new_session=True,
            )
        except OSError as e:
            raise HarnessFailed(
                f"harness {config.command!r} could not start: {type(e).__name__}: {e}"
            ) from None
        try:
            stdout, stderr = await asyncio.wait_for(process.communicate(self._stdin(row)), config.timeout_s)
        except TimeoutError:
            _kill_group(process)
            await process.wait()
            raise HarnessFailed(
                f"harness {config.command!r} ran past timeout_s={config.timeout_s} of agent "
                f"'{config.name}' and was killed with its process group"
            ) from None
        finally:
            _kill_group(process)  # whatever it left running in its group goes too
        cap = config.max_stderr_bytes
        return {
            "exit_code": process.returncode,
            "stdout": stdout.decode(errors="replace"),
            "stderr": stderr[-cap:].decode(errors="replace") if cap else "",
            "duration_s": round(time.monotonic() - started, 3),
        }

    async def final_answer(self, run: dict[str, Any]) -> str:
        if self.config.final_answer == "stdout":
            return run["stdout"].strip()
        assert self.workdir is not None
        path = self.workdir.joinpath(*PurePosixPath(self.config.answer_file).parts)
        if not path.is_file():
            raise HarnessFailed(
                f"harness {self.config.command!r} wrote no {self.config.answer_file} (final_answer: file)"
            )
        return path.read_text(errors="replace").strip()

    async def final_files(self) -> dict[str, str | None]:
        assert self.workdir is not None
        changes = await asyncio.to_thread(
            pack_upper,
            self.workdir,
            max_bytes=self.config.max_workspace_changes_bytes,
            include=self.agent._included,
        )
        return self.agent._final_files_of(changes)

    async def close(self) -> None:
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


if __name__ == "__main__":
    HarnessAgent.run_webserver()
