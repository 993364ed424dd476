"""bash_test_shell: a test-only resources server for bash_agent's tests (not an environment).

Its ``bash`` tool has the contract of resources_servers/workspace_tasks' (``{"command": str}`` ->
``{"output": str, "exit_code": int | null, "timed_out": bool}``) but runs nothing: it interprets a few
commands over a per-session dict of files, so the tests can say exactly what each command prints.

  echo WORDS [> FILE]   prints WORDS (or writes them, with a newline, to FILE)
  cat FILE              prints FILE (exit 1 when there is none)
  seq N                 prints 1..N, one a line (long output)
  exit N                prints nothing, exits N
  sleep N               N > 5: killed at the limit (``exit_code: null, timed_out: true``)
  A && B                B only when A exited 0; the outputs joined
  refuse                HTTP 400 (the tool refusing the command on purpose)
  crash                 HTTP 503 (the sandbox failing: the rollout must fail, not score)
  garble                HTTP 200 without ``output`` (a broken tool answer)
  anything else         ``bash: X: command not found``, exit 127
``/verify`` gives reward 1.0 iff ``answer.txt`` holds the row's ``expected_answer``, and reports the
session's commands (``commands_run``) and the seeded ``task_id``.
"""

from __future__ import annotations

import shlex
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseSeedSessionRequest,
    BaseSeedSessionResponse,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)
from nemo_gym.server.base import get_session_id


class BashTestShellConfig(BaseResourcesServerConfig):
    pass


class BashRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    command: str


class ShellSeedRequest(BaseSeedSessionRequest):
    task_id: int | None = None


class ShellVerifyRequest(BaseVerifyRequest):
    task_id: int
    expected_answer: str


class ShellVerifyResponse(ShellVerifyRequest, BaseVerifyResponse):
    seen_task_id: int | None
    commands_run: list[str]


def _run_one(command: str, files: dict[str, str]) -> tuple[str, int | None, bool]:
    words = shlex.split(command)
    if not words:
        return "", 0, False
    name, args = words[0], words[1:]
    if name == "echo":
        if ">" in args:
            at = args.index(">")
            files[args[at + 1]] = " ".join(args[:at]) + "\n"
            return "", 0, False
        return " ".join(args) + "\n", 0, False
    if name == "cat":
        if args and args[0] in files:
            return files[args[0]], 0, False
        return f"cat: {args[0] if args else ''}: No such file or directory\n", 1, False
    if name == "seq":
        return "".join(f"{i}\n" for i in range(1, int(args[0]) + 1)), 0, False
    if name == "exit":
        return "", int(args[0]), False
    if name == "sleep":
        return ("", None, True) if float(args[0]) > 5 else ("", 0, False)
    return f"bash: {name}: command not found\n", 127, False


class BashTestShellServer(SimpleResourcesServer):
    config: BashTestShellConfig
    sessions: dict[str, dict[str, Any]] = {}

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/bash")(self.bash)
        return app

    def _state(self, request: Request) -> dict[str, Any]:
        return self.sessions.setdefault(
            get_session_id(request), {"task_id": None, "files": {}, "commands": []}
        )

    async def seed_session(self, request: Request, body: ShellSeedRequest) -> BaseSeedSessionResponse:
        self._state(request)["task_id"] = body.task_id
        return BaseSeedSessionResponse()

    async def bash(self, request: Request, body: BashRequest) -> Any:
        state = self._state(request)
        state["commands"].append(body.command)
        if body.command == "refuse":
            raise HTTPException(status_code=400, detail="this shell refuses that command")
        if body.command == "crash":
            return JSONResponse({"error": {"message": "sandbox unavailable"}}, status_code=503)
        if body.command == "garble":
            return {"stdout": "no output field here"}
        output, exit_code, timed_out = "", 0, False
        for part in body.command.split(" && "):
            text, exit_code, timed_out = _run_one(part, state["files"])
            output += text
            if exit_code != 0:
                break
        return {"output": output, "exit_code": exit_code, "timed_out": timed_out}

    async def verify(self, request: Request, body: ShellVerifyRequest) -> ShellVerifyResponse:
        state = self._state(request)
        answer = state["files"].get("answer.txt", "").strip()
        return ShellVerifyResponse(
            **body.model_dump(),
            reward=1.0 if answer == body.expected_answer else 0.0,
            seen_task_id=state["task_id"],
            commands_run=state["commands"],
        )


if __name__ == "__main__":
    BashTestShellServer.run_webserver()
