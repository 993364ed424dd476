"""file_edit_tasks: edit files in a working directory; rewarded on what the files say afterwards.

Meant for agents that work on files themselves (a CLI coding agent run by ``harness_agent``): the row's
``harness_files`` (relative path -> text) are the working directory harness_agent lays out for the
harness, its task text says what to change, and ``expected_files`` says what the changed files must read.

Contract
--------
* ``POST /verify`` takes the row plus ``final_files`` (relative path -> the file's text when the harness
  ended, ``null`` for a file that was not there), which ``harness_agent`` adds when its ``final_files``
  config names the files to report. No tools: the agent edits the files itself.
* reward = 1.0 iff every path of ``expected_files`` is in ``final_files`` and its text equals the expected
  text, compared line by line with line endings and trailing whitespace ignored, and trailing blank lines
  too (an editor's or ``sed``'s last newline is no edit). Otherwise 0.0, with ``failure_reason``
  ``missing_file`` (a file the task needs is gone) or ``wrong_content``; ``files_matched`` says per path.
* The check only reads text: no code written by the agent runs in this server.
* A verify request without ``final_files`` is not the agent's fault but a setup error (the agent does not
  report the files): 422 naming ``final_files`` and the config key that sends them, never a reward of 0.
* Stateless: a stored rollout carries ``final_files``, so ``/verify`` can run again from it alone.
"""

from __future__ import annotations

from typing import ClassVar

from fastapi import HTTPException
from pydantic import Field

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseVerifyRequest,
    BaseVerifyResponse,
    ReverifyMode,
    SimpleResourcesServer,
)


class FileEditTasksConfig(BaseResourcesServerConfig):
    REVERIFY_MODE: ClassVar[ReverifyMode] = ReverifyMode.STATELESS


class FileEditVerifyRequest(BaseVerifyRequest):
    expected_files: dict[str, str] = Field(
        min_length=1, description="Relative path -> the text the file must have after the edit."
    )
    harness_files: dict[str, str] | None = Field(
        default=None, description="Relative path -> text: the working directory before the edit."
    )
    final_files: dict[str, str | None] | None = Field(
        default=None,
        description="Relative path -> text when the agent ended (null: no such file); set by harness_agent.",
    )
    uuid: str | None = None


class FileEditVerifyResponse(FileEditVerifyRequest, BaseVerifyResponse):
    """The request echoed (``final_files`` too, so a stored rollout can be verified again) plus the verdict."""

    files_matched: dict[str, bool]
    failure_reason: str | None = None


def normalized(text: str) -> list[str]:
    """The lines that count: line endings and trailing whitespace dropped, trailing blank lines too."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


class FileEditTasksServer(SimpleResourcesServer):
    config: FileEditTasksConfig

    async def verify(self, body: FileEditVerifyRequest) -> FileEditVerifyResponse:
        if body.final_files is None:
            raise HTTPException(
                status_code=422,
                detail="final_files is missing: the agent must report the edited files (harness_agent's "
                "final_files config, e.g. final_files: ['*.py'])",
            )
        matched: dict[str, bool] = {}
        reason = None
        for path, expected in body.expected_files.items():
            final = body.final_files.get(path)
            if final is None:
                matched[path] = False
                reason = reason or "missing_file"
                continue
            matched[path] = normalized(final) == normalized(expected)
            if not matched[path]:
                reason = reason or "wrong_content"
        reward = 1.0 if all(matched.values()) else 0.0
        return FileEditVerifyResponse.from_request(
            body, reward=reward, files_matched=matched, failure_reason=reason
        )


if __name__ == "__main__":
    FileEditTasksServer.run_webserver()
