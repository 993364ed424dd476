"""Rollout ids in request paths: ``/ng-rollout/<id>/<path>`` (NVIDIA NeMo Gym's names and semantics).

Contract
--------
* A rollout's id is ``_ng_rollout_id`` when a row carries one (letters, digits, ``.``, ``_``, ``-``,
  not starting with a dot or dash; anything else is a ``ValueError``), else ``"<task>-<rollout>"``
  from ``_ng_task_index`` / ``_ng_rollout_index``; a re-dispatch attempt ``n > 0`` appends ``-a<n>``
  (:func:`maybe_rollout_id_from_run_body`). No identity: ``None``.
* :class:`RolloutContextMiddleware` (installed on every server of ours, and harmless when an
  environment adds it again) answers ``/ng-rollout/<id>/<path>`` exactly as ``/<path>`` and exposes
  ``<id>`` to the handler and to anything it awaits through :func:`current_rollout_id`. A request
  without the prefix costs one ``str.startswith``.
* The prefix correlates model calls with rollouts: with ``observability_enabled`` set, agents'
  ``url_path_for_run`` / ``base_url_for_run`` prefix their model calls, and model servers record
  each call under its rollout (:mod:`nemo_gym.server.model_calls`). Without it paths are left unchanged.
* Servers of ours strip the prefix in :class:`nemo_gym.server.asgi.ServerLayer`; this module's middleware
  is for apps that install it themselves.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar, Token
from typing import Any

from pydantic import BaseModel

from nemo_gym.config.keys import (
    ATTEMPT_INDEX_KEY_NAME,
    ROLLOUT_ID_KEY_NAME,
    ROLLOUT_INDEX_KEY_NAME,
    TASK_INDEX_KEY_NAME,
)
from nemo_gym.config.types import ROLLOUT_PATH_PREFIX, TOKEN_CAPTURE_PATH_SEGMENT

ROLLOUT_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_CURRENT: ContextVar[str | None] = ContextVar("nemo_gym_rollout_id", default=None)
_PATH_START = f"/{ROLLOUT_PATH_PREFIX}/"


def maybe_rollout_id_from_run_body(body: BaseModel | Mapping[str, Any] | None) -> str | None:
    """The rollout id of a run row (see the module docstring), or ``None`` without an identity."""
    if isinstance(body, Mapping):
        get = body.get
    elif isinstance(body, BaseModel):

        def get(key: str) -> Any:
            value = getattr(body, key, None)
            return value if value is not None else (body.model_extra or {}).get(key)
    else:
        return None
    explicit = get(ROLLOUT_ID_KEY_NAME)
    if explicit is not None:
        if not isinstance(explicit, str) or not ROLLOUT_ID_PATTERN.match(explicit) or len(explicit) > 256:
            raise InvalidRolloutId(
                ROLLOUT_ID_KEY_NAME,
                f"{ROLLOUT_ID_KEY_NAME} must be a string of at most 256 letters, digits, '.', '_' or '-' "
                f"starting with a letter or digit, got {_shown(explicit)}",
            )
        rollout_id = explicit
    else:
        task, rollout = get(TASK_INDEX_KEY_NAME), get(ROLLOUT_INDEX_KEY_NAME)
        if task is None or rollout is None:
            return None
        for key, value in ((TASK_INDEX_KEY_NAME, task), (ROLLOUT_INDEX_KEY_NAME, rollout)):
            if not _is_index(value):
                raise InvalidRolloutId(key, f"{key} must be a non-negative integer, got {_shown(value)}")
        rollout_id = f"{task}-{rollout}"
    attempt = get(ATTEMPT_INDEX_KEY_NAME)
    if attempt is not None and not _is_index(attempt):
        raise InvalidRolloutId(
            ATTEMPT_INDEX_KEY_NAME,
            f"{ATTEMPT_INDEX_KEY_NAME} must be a non-negative integer, got {_shown(attempt)}",
        )
    if attempt:
        rollout_id = f"{rollout_id}-a{attempt}"
    return rollout_id


class InvalidRolloutId(ValueError):
    """A run row's identity fields cannot make a rollout id; ``field`` names the one at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 63


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def rollout_path_prefix(rollout_id: str | None, *, token_capture: bool = False) -> str:
    """``/ng-rollout/<id>`` (plus ``/training-token-capture`` when asked), or ``""`` without an id."""
    if not rollout_id:
        return ""
    return f"/{ROLLOUT_PATH_PREFIX}/{rollout_id}" + (
        f"/{TOKEN_CAPTURE_PATH_SEGMENT}" if token_capture else ""
    )


def apply_rollout_prefix(base_url: str, rollout_id: str | None, *, token_capture: bool = False) -> str:
    """``base_url`` with the rollout's path prefix appended (unchanged without an id)."""
    if not rollout_id:
        return base_url
    return base_url.rstrip("/") + rollout_path_prefix(rollout_id, token_capture=token_capture)


def current_rollout_id() -> str | None:
    """The rollout id of the request being handled (from its path prefix), else ``None``."""
    return _CURRENT.get()


@contextmanager
def rollout_context(rollout_id: str | None) -> Iterator[None]:
    """Make ``rollout_id`` the :func:`current_rollout_id` inside the block."""
    token = _CURRENT.set(rollout_id)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def split_rollout_prefix(path: str) -> tuple[str, str] | None:
    """``(rollout id, rest of the path)`` of a well-formed ``/ng-rollout/<id>/<rest>`` path, else None."""
    if not path.startswith(_PATH_START):
        return None
    rollout_id, slash, rest = path[len(_PATH_START) :].partition("/")
    if not slash or not ROLLOUT_ID_PATTERN.match(rollout_id):
        return None  # not a well-formed prefix: routed (and 404'd) as is
    return rollout_id, "/" + rest


def enter_rollout(rollout_id: str | None) -> Token:
    """Make ``rollout_id`` current; undo with :func:`leave_rollout` (for code that cannot use a ``with``)."""
    return _CURRENT.set(rollout_id)


def leave_rollout(token: Token) -> None:
    _CURRENT.reset(token)


class RolloutContextMiddleware:
    """Pure ASGI middleware: strips ``/ng-rollout/<id>`` from the path and sets the current rollout id."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        split = split_rollout_prefix(scope.get("path", "")) if scope["type"] == "http" else None
        if split is None:
            await self.app(scope, receive, send)
            return
        rollout_id, rest = split
        with rollout_context(rollout_id):
            await self.app({**scope, "path": rest, "raw_path": rest.encode()}, receive, send)
