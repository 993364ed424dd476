"""Which files ``ng_viewer`` may read, and who may talk to it.

Contract
--------
* :class:`AccessPolicy` is the viewer's allow-list. A path is readable when, after resolving
  ``~``, ``..`` and every symlink, it is

  - one of the files the viewer was started with (``+jsonl_fpath``, ``+compare_jsonl_fpath``),
  - a sidecar that ``ng_collect_rollouts`` writes next to such a file
    (``<stem>_failures.jsonl``, ``<stem>_aggregate_metrics.json``,
    ``<stem>_materialized_inputs.jsonl``), or
  - a file under one of the directories named with ``+allowed_roots``.

  Because the check is made on the resolved path, a symlink (or ``..``) inside an allowed
  directory that leads outside it is refused. :meth:`AccessPolicy.check` raises
  :class:`AccessDenied`, whose message says why and how to allow the file. The check is the same
  whether or not the path exists, so a refusal tells nothing about files outside the allow-list.
* :class:`TokenGuard` holds the access token of a viewer that listens on a non-loopback address
  (or was given one). A request carries it as ``Authorization: Bearer <token>``, an
  ``X-NG-Viewer-Token`` header, a ``token`` query parameter or the HttpOnly cookie the viewer sets
  when the page is first opened with ``?token=``. Comparisons are constant-time.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Iterable
from pathlib import Path

TOKEN_ENV = "NG_VIEWER_TOKEN"
TOKEN_HEADER = "x-ng-viewer-token"
TOKEN_QUERY = "token"
MIN_TOKEN_CHARS = 16
LOOPBACK_NAMES = {"127.0.0.1", "localhost", "::1", "[::1]"}


class AccessDenied(Exception):
    """A path outside the viewer's allow-list; the message says how to allow it."""


def resolve(path: str | os.PathLike[str]) -> Path:
    """``path`` made absolute with ``~``, ``..`` and symlinks resolved (it need not exist)."""
    return Path(path).expanduser().resolve(strict=False)


def is_loopback_host(host: str) -> bool:
    """Whether binding ``host`` only listens on the loopback interface."""
    return host in LOOPBACK_NAMES or host.startswith("127.")


class AccessPolicy:
    """The files one viewer process may read (see the module docstring)."""

    def __init__(
        self, files: Iterable[str | os.PathLike[str]] = (), roots: Iterable[str | os.PathLike[str]] = ()
    ) -> None:
        self.files: set[Path] = set()
        self.sidecars: set[Path] = set()
        self.roots: list[Path] = [resolve(r) for r in roots]
        for f in files:
            self.allow_file(f)

    def allow_file(self, path: str | os.PathLike[str]) -> Path:
        """Add ``path`` (resolved) and its sidecars to the allow-list; returns the resolved path."""
        from nemo_gym.collection.output_files import sidecar_paths

        p = resolve(path)
        self.files.add(p)
        # The sidecars are named from the resolved file; matched against the resolved candidate,
        # so a sidecar that is itself a symlink to somewhere else does not match.
        self.sidecars.update(sidecar_paths(p).values())
        from nemo_gym.server.model_calls import model_calls_path

        self.sidecars.add(model_calls_path(p))  # written only with model-call capture on
        return p

    def allows(self, path: str | os.PathLike[str]) -> bool:
        """Whether ``path`` may be read."""
        p = resolve(path)
        return p in self.files or p in self.sidecars or any(p.is_relative_to(r) for r in self.roots)

    def check(self, path: str | os.PathLike[str]) -> Path:
        """The resolved ``path`` when it may be read; else :class:`AccessDenied` saying how to allow it."""
        p = resolve(path)
        if p in self.files or p in self.sidecars or any(p.is_relative_to(r) for r in self.roots):
            return p
        shown = str(path) if str(path) == str(p) else f"{path} (resolved: {p})"
        where = (
            "the files it was started with (and their sidecars) and files under +allowed_roots="
            + ",".join(str(r) for r in self.roots)
            if self.roots
            else "the files it was started with (and their sidecars)"
        )
        raise AccessDenied(
            f"ng_viewer may not read {shown}: it only serves {where}. To open it, restart ng_viewer "
            "with +allowed_roots=<dir> naming a directory that holds it, or with +compare_jsonl_fpath=<file> "
            "(symlinks are resolved before the check, so a link leading out of an allowed directory is refused)."
        )


class TokenGuard:
    """The access token of one viewer process (``None`` token: no token needed)."""

    def __init__(self, token: str | None) -> None:
        self.token = token

    @classmethod
    def for_host(cls, host: str, configured: str | None) -> TokenGuard:
        """The token for a viewer bound to ``host``.

        ``configured`` (``+token``) or the ``NG_VIEWER_TOKEN`` environment variable when set (then
        it is required on any address); otherwise a fresh random token when ``host`` is not a
        loopback address, and none on loopback.
        """
        given = configured or os.environ.get(TOKEN_ENV) or None
        if given:
            return cls(given)
        return cls(None if is_loopback_host(host) else secrets.token_urlsafe(24))

    @property
    def required(self) -> bool:
        """Whether requests must carry the token."""
        return self.token is not None

    def matches(self, candidate: str | None) -> bool:
        """Whether ``candidate`` is the token (constant-time)."""
        if self.token is None or not candidate:
            return False
        return hmac.compare_digest(candidate.encode(), self.token.encode())

    @staticmethod
    def cookie_name(port: int | None) -> str:
        """The cookie name for the viewer on ``port`` (cookies are not per port, names are)."""
        return f"ng_viewer_token_{port or 0}"
