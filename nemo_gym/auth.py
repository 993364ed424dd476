"""Authentication between the servers of one run, and the request guard every server puts in front.

Contract
--------
* Every ``ng_run`` (or ``RunHelper``) run has one random **run token**. Every request to every server
  of the run, the head server included, must carry it as ``Authorization: Bearer <token>`` (the
  OpenAI SDK sends exactly that when given the token as ``api_key``) or as ``X-NeMo-Gym-Token``.
  Without it the answer is 401, whatever the path; a WebSocket is closed with code 1008 (policy
  violation) before the application sees it. Lifespan events pass.
* Who gets the token without doing anything: the launched servers (``NEMO_GYM_AUTH_TOKEN`` in their
  environment), ``RunHelper``'s own process (an in-process registry keyed by head-server port) and
  any process of the same user on the machine (``ng_collect_rollouts`` in another terminal): the
  launcher writes it to a ``0600`` file in a ``0700`` directory keyed by the head server's port
  and removes it at shutdown. A process elsewhere sets ``NEMO_GYM_AUTH_TOKEN`` itself.
* ``+server_auth=false`` switches the check off for a run; the launcher says so loudly.
* Two narrower credentials sit beside the run token (docs/security.md has the table of who holds what):

  - a **rollout credential** (:func:`rollout_credential`: ``ngr.<rollout id>.<HMAC of the id under the
    run token>``) opens exactly one rollout's model calls, ``/ng-rollout/<id>/v1/*`` (with or without the
    token-capture segment), on any server of the run, and nothing else: a harness holds it instead of the
    run token. Every server checks it from the run token alone (no shared state).
  - the **trainer credential** (:func:`trainer_token`): a second random token, held by the process that
    started the run (in process, and in a 0600 file beside the run token's) and by no server. Servers get
    only its SHA-256 (:data:`TRAINER_TOKEN_SHA256_ENV_VAR_NAME`, in their launch file); a request carries
    it in ``X-NeMo-Gym-Trainer-Token`` next to the run token. ``POST /policy_version`` needs it
    (:mod:`nemo_gym.server.policy_version`); :class:`nemo_gym.client.server_client.ServerClient` adds it
    to that call by itself when its process has it.
* A server hosted outside ``ng_run`` with no token configured (a resources server class a trainer
  builds in its own process) answers **loopback clients only**, with no token, as before.
* The same guard refuses bodies larger than the server's ``max_request_body_bytes`` with a 413 naming
  the setting, before the application reads them.

The guard is a pure ASGI middleware: per request it scans the header list once and compares the
token in constant time, so it costs a few microseconds on the hot path.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson

from nemo_gym.errors import error_envelope
from nemo_gym.launch import launch_value

logger = logging.getLogger("nemo_gym")

AUTH_TOKEN_ENV_VAR_NAME = "NEMO_GYM_AUTH_TOKEN"
AUTH_DISABLED_ENV_VAR_NAME = "NEMO_GYM_AUTH_DISABLED"
RUN_DIR_ENV_VAR_NAME = "NEMO_GYM_RUN_DIR"
SERVER_AUTH_KEY_NAME = "server_auth"
TOKEN_HEADER_NAME = "X-NeMo-Gym-Token"
MAX_REQUEST_BODY_BYTES_KEY_NAME = "max_request_body_bytes"
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024

TRAINER_TOKEN_ENV_VAR_NAME = "NEMO_GYM_TRAINER_TOKEN"
TRAINER_TOKEN_SHA256_ENV_VAR_NAME = "NEMO_GYM_TRAINER_TOKEN_SHA256"
TRAINER_TOKEN_HEADER_NAME = "X-NeMo-Gym-Trainer-Token"
ROLLOUT_CREDENTIAL_PREFIX = "ngr."

# Tokens of runs started in this process (RunHelper), by head-server port.
_IN_PROCESS_TOKENS: dict[int, str] = {}
_IN_PROCESS_TRAINER_TOKENS: dict[int, str] = {}


def new_run_token() -> str:
    """A fresh random run token (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


# ------------------------------------------------------------------------------------------------
# Where a run's token is kept for other processes of the same user.


def run_dir() -> Path:
    """The private directory for run tokens: ``$NEMO_GYM_RUN_DIR``, else ``$XDG_RUNTIME_DIR/nemo_gym``,
    else ``~/.cache/nemo_gym/runs``."""
    explicit = os.environ.get(RUN_DIR_ENV_VAR_NAME)
    if explicit:
        return Path(explicit)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "nemo_gym"
    return Path.home() / ".cache" / "nemo_gym" / "runs"


def token_file_for(head_port: int) -> Path:
    """The token file of the run whose head server listens on ``head_port``."""
    return run_dir() / f"head-{int(head_port)}.token"


def trainer_token_file_for(head_port: int) -> Path:
    """The trainer credential's file of the run whose head server listens on ``head_port``."""
    return run_dir() / f"head-{int(head_port)}.trainer-token"


def read_token_file(path: Path) -> str | None:
    """The token in a token file (the whole file: ``TOKEN=$(cat FILE)`` works)."""
    with _suppress_os_error():
        return path.read_text().strip() or None
    return None


def _pid_file_for(token_path: Path) -> Path:
    """Beside each token file, the pid of the run that wrote it (so a later run can prune it)."""
    return token_path.with_suffix(".pid")


def _prune_stale_token_files(directory: Path) -> None:
    """Remove token files whose writer is gone (a run killed with SIGKILL cannot remove its own)."""
    for pid_path in directory.glob("head-*.pid"):
        try:
            pid = int(pid_path.read_text().strip())
        except (OSError, ValueError):  # unreadable, or not ours: leave it
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            with _suppress_os_error():
                pid_path.with_suffix(".token").unlink()
            with _suppress_os_error():
                pid_path.with_suffix(".trainer-token").unlink()
            with _suppress_os_error():
                pid_path.unlink()
        except PermissionError:  # alive: another user's process
            pass


def _write_private(directory: Path, path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".token-")  # mkstemp creates it 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with _suppress_os_error():
            os.unlink(tmp)
        raise


def write_token_file(head_port: int, token: str, trainer_token: str | None = None) -> Path:
    """Write ``token`` (and the run's ``trainer_token``) for ``head_port`` atomically, readable by this
    user only; returns the run token's path.

    A ``.pid`` file beside it names this process, so a later run can remove the files of runs that
    are gone."""
    directory = run_dir()
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(directory, 0o700)
    _prune_stale_token_files(directory)
    path = token_file_for(head_port)
    _write_private(directory, _pid_file_for(path), f"{os.getpid()}\n")
    if trainer_token is not None:
        _write_private(directory, trainer_token_file_for(head_port), trainer_token + "\n")
    _write_private(directory, path, token + "\n")
    return path


def remove_token_file(head_port: int, token: str) -> None:
    """Remove the token files of ``head_port`` if they still hold ``token`` (a newer run's stay)."""
    path = token_file_for(head_port)
    if read_token_file(path) == token:
        with _suppress_os_error():
            trainer_token_file_for(head_port).unlink()
        with _suppress_os_error():
            path.unlink()
        with _suppress_os_error():
            _pid_file_for(path).unlink()


def register_in_process(ports: list[int], token: str | None, trainer_token: str | None = None) -> None:
    """Remember the token (and the trainer credential) of a run this process started, for the run's
    head-server and server ports (``token=None`` forgets them)."""
    for port in ports:
        if token is None:
            _IN_PROCESS_TOKENS.pop(int(port), None)
            _IN_PROCESS_TRAINER_TOKENS.pop(int(port), None)
        else:
            _IN_PROCESS_TOKENS[int(port)] = token
            if trainer_token is not None:
                _IN_PROCESS_TRAINER_TOKENS[int(port)] = trainer_token


def trainer_token(port: int | None = None) -> str | None:
    """The trainer credential of the run whose head server (or one of whose servers) listens on
    ``port``: a run this process started; ``NEMO_GYM_TRAINER_TOKEN``; the run's trainer-token file."""
    if port is not None and int(port) in _IN_PROCESS_TRAINER_TOKENS:
        return _IN_PROCESS_TRAINER_TOKENS[int(port)]
    env = os.environ.get(TRAINER_TOKEN_ENV_VAR_NAME)
    if env:
        return env
    if port is not None:
        return read_token_file(trainer_token_file_for(port))
    return None


def token_sha256(token: str) -> str:
    """What a server keeps of the trainer credential: enough to check it, not to use it."""
    return hashlib.sha256(token.encode()).hexdigest()


def rollout_credential(run_token: str, rollout_id: str) -> str:
    """The credential that opens only rollout ``rollout_id``'s model calls (see the module docstring)."""
    return (
        ROLLOUT_CREDENTIAL_PREFIX + rollout_id + "." + _rollout_mac(run_token.encode(), rollout_id.encode())
    )


def _rollout_mac(run_token: bytes, rollout_id: bytes) -> str:
    digest = hmac.new(run_token, b"nemo-gym-rollout\0" + rollout_id, hashlib.sha256).digest()[:24]
    return base64.urlsafe_b64encode(digest).decode()


def rollout_of_credential(run_token: bytes, presented: bytes) -> str | None:
    """The rollout id a presented rollout credential opens, or ``None`` when it is not a valid one."""
    if not presented.startswith(ROLLOUT_CREDENTIAL_PREFIX.encode()):
        return None
    rollout_id, dot, mac = presented[len(ROLLOUT_CREDENTIAL_PREFIX) :].rpartition(b".")
    if not dot or not rollout_id:
        return None
    if not hmac.compare_digest(mac, _rollout_mac(run_token, rollout_id).encode()):
        return None
    return rollout_id.decode(errors="replace")


def client_token(port: int | None = None) -> str | None:
    """The token a client should send to the run whose head server (or one of whose servers) listens
    on ``port``.

    In order: a run this process started; ``NEMO_GYM_AUTH_TOKEN``; the token file of the run whose
    head server is on ``port``. ``None`` when there is none (servers then accept only loopback
    clients, or auth is off).
    """
    if port is not None and int(port) in _IN_PROCESS_TOKENS:
        return _IN_PROCESS_TOKENS[int(port)]
    env = launch_value(AUTH_TOKEN_ENV_VAR_NAME)
    if env:
        return env
    if port is not None:
        return read_token_file(token_file_for(port))
    return None


def client_token_for_url(url: str) -> str | None:
    """:func:`client_token` for the port of ``url`` (``http://host:port/...``)."""
    port = urlsplit(url).port
    return client_token(port)


def auth_headers(token: str | None) -> dict[str, str]:
    """The headers that carry ``token`` (empty when there is none)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


class _suppress_os_error:
    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        return exc_type is not None and issubclass(exc_type, OSError)


# ------------------------------------------------------------------------------------------------
# The server side.


def server_token_from_env() -> tuple[str | None, bool]:
    """(token, disabled) for a server process: what ``ng_run`` handed it (:mod:`nemo_gym.launch`)."""
    disabled = os.environ.get(AUTH_DISABLED_ENV_VAR_NAME, "") not in ("", "0", "false")
    return (None if disabled else launch_value(AUTH_TOKEN_ENV_VAR_NAME) or None), disabled


@functools.lru_cache(maxsize=4096)  # called per request on servers without a token: parse each peer once
def is_local_client(host: str | None) -> bool:
    """Whether a client (the host ASGI reports) is on this machine: a loopback address, or no network
    peer at all (an in-process test transport such as starlette's ``TestClient`` reports
    ``"testclient"``; a Unix socket reports none). A TCP peer is always reported as an IP address."""
    if not host:
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return True


# The error envelope's ``kind`` of each refusal :meth:`RequestGuard.admit` answers, by its status.
REFUSAL_KINDS = {401: "unauthorized", 413: "request_too_large"}


def _json_error(status: int, server: str, path: str, message: str) -> tuple[dict, bytes]:
    body = orjson.dumps(error_envelope(REFUSAL_KINDS[status], server=server, path=path, message=message))
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if status in (401, 413):  # a refused client does not keep a place (see nemo_gym.server.accept_limit)
        headers.append((b"connection", b"close"))
    return {"type": "http.response.start", "status": status, "headers": headers}, body


class RequestGuard:
    """Pure ASGI middleware: the run token (or loopback-only when none is configured) and a body limit.

    ``token``: required on every request when set. ``disabled``: no token check at all (``+server_auth=
    false``). Neither: only loopback clients are served. ``max_body_bytes``: larger bodies get a 413
    naming ``setting`` (checked on ``Content-Length`` first, and while a chunked body streams in).
    """

    def __init__(
        self,
        app: Any,
        server_name: str,
        token: str | None,
        disabled: bool = False,
        max_body_bytes: int | None = DEFAULT_MAX_REQUEST_BODY_BYTES,
        setting: str = MAX_REQUEST_BODY_BYTES_KEY_NAME,
        rollout_paths: tuple[str, str] | None = None,
    ):
        """``rollout_paths``: (``"/ng-rollout/"``, the token-capture segment) when rollout credentials are
        accepted here (servers: yes; the head server: no)."""
        self.app = app
        self.rollout_paths = rollout_paths
        self.server_name = server_name
        self.disabled = disabled
        self.bearer = b"Bearer " + token.encode() if token else None
        self.raw_token = token.encode() if token else None
        self.max_body = max_body_bytes
        self.setting = setting

    def _authorized(self, scope: dict, headers: list[tuple[bytes, bytes]]) -> str | None:
        """``None`` when the request may pass, else why not."""
        if self.disabled:
            return None
        if self.bearer is None:
            client = scope.get("client")
            if is_local_client(client[0] if client else None):
                return None
            return (
                f"server '{self.server_name}' has no run token configured, so it serves loopback clients only. "
                f"Start it under ng_run (which gives every server a token), or set {AUTH_TOKEN_ENV_VAR_NAME} "
                "for the server and its clients."
            )
        for k, v in headers:
            if k == b"authorization":
                if hmac.compare_digest(v, self.bearer):
                    return None
            elif (k == b"x-nemo-gym-token" or k == b"x-api-key") and hmac.compare_digest(
                v, self.raw_token or b""
            ):
                # x-api-key: how Anthropic's clients send their key (ANTHROPIC_API_KEY), e.g. a harness
                # trained through /v1/messages with the run token as its key.
                return None
        scoped = self._rollout_credential(scope, headers)
        if scoped is not None:
            return scoped or None
        return (
            f"missing or wrong run token for server '{self.server_name}'. Send 'Authorization: Bearer <token>' "
            f"(or '{TOKEN_HEADER_NAME}: <token>', or 'x-api-key: <token>'); ng_collect_rollouts, RunHelper and RolloutCollectionHelper find "
            f"it themselves on this machine; elsewhere set {AUTH_TOKEN_ENV_VAR_NAME} to the token in the file "
            f"ng_run printed."
        )

    def _rollout_credential(self, scope: dict, headers: list[tuple[bytes, bytes]]) -> str | None:
        """``None``: no rollout credential presented; ``""``: one that opens this request's path; else why
        the presented one does not."""
        if self.rollout_paths is None or self.raw_token is None:
            return None
        marker = ROLLOUT_CREDENTIAL_PREFIX.encode()
        for k, v in headers:
            if k == b"authorization" and v.startswith(b"Bearer " + marker):
                value = v[7:]
            elif k == b"x-api-key" and v.startswith(marker):
                value = v
            else:
                continue
            rollout_id = rollout_of_credential(self.raw_token, value)
            if rollout_id is None:
                return f"a rollout credential that is not valid for this run (server '{self.server_name}')"
            prefix, capture = self.rollout_paths
            path = scope.get("path", "")
            start = f"{prefix}{rollout_id}/"
            rest = path[len(start) :] if path.startswith(start) else None
            if rest is not None and rest.startswith(capture + "/"):
                rest = rest[len(capture) + 1 :]
            if rest is not None and rest.startswith("v1/"):
                return ""
            return (
                f"a rollout credential opens only its own rollout's model calls ({start}v1/...) on server "
                f"'{self.server_name}', not {path!r}"
            )
        return None

    def trusts(self, scope: dict) -> bool:
        """Whether a request head (its ASGI scope) passes the check; its connection is then trusted with a
        reserved place (:class:`nemo_gym.server.accept_limit.ConnectionLimits`)."""
        return self._authorized(scope, scope["headers"]) is None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.not_http(scope, receive, send)
            return
        receive = await self.admit(scope, receive, send)
        if not isinstance(receive, int):
            await self.app(scope, receive, send)

    async def not_http(self, scope: dict, receive: Any, send: Any, app: Any = None) -> None:
        """Serve a non-HTTP scope with ``app`` (default: the wrapped one): a WebSocket needs the run token
        like any request (refused: accepted, then closed at once with 1008, policy violation, and the
        reason; nothing of the app runs); lifespan and other scopes pass."""
        app = self.app if app is None else app
        if scope["type"] == "websocket":
            refusal = self._authorized(scope, scope["headers"])
            if refusal is not None:
                await _refuse_websocket(receive, send, refusal)
                return
        await app(scope, receive, send)

    async def admit(self, scope: dict, receive: Any, send: Any) -> Any:
        """The ``receive`` to serve an HTTP request with (counting a body of unknown length as it
        streams in), or, when the request was refused here, the status of the refusal already sent (an
        ``int``: 401 or 413)."""
        headers = scope["headers"]
        refusal = self._authorized(scope, headers)
        if refusal is not None:
            start, body = _json_error(401, self.server_name, scope.get("path", ""), refusal)
            await send(start)
            await send({"type": "http.response.body", "body": body})
            return 401
        limit = self.max_body
        if limit is None:
            return receive
        for k, v in headers:
            if k == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    break  # not a length the server will frame the body by: count what arrives
                if declared > limit:
                    await self._too_large(scope, send, declared)
                    return 413
                # The server reads exactly the declared length: nothing more can arrive to count.
                return receive
        return self._limited_receive(scope, receive, send, limit)

    def _limited_receive(self, scope: dict, receive: Any, send: Any, limit: int) -> Any:
        seen = 0

        async def guarded() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise RequestBodyTooLarge(self._too_large_message(seen, at_least=True))
            return message

        return guarded

    def _too_large_message(self, size: int, at_least: bool = False) -> str:
        return (
            f"request body of {'more than ' if at_least else ''}{size - 1 if at_least else size} bytes exceeds "
            f"server '{self.server_name}''s limit of {self.max_body} bytes; raise its {self.setting} setting "
            f"(per server in its config block, or top-level for every server)"
        )

    async def _too_large(self, scope: dict, send: Any, size: int) -> None:
        start, body = _json_error(413, self.server_name, scope.get("path", ""), self._too_large_message(size))
        await send(start)
        await send({"type": "http.response.body", "body": body})


async def _refuse_websocket(receive: Any, send: Any, refusal: str) -> None:
    message = await receive()
    if message["type"] != "websocket.connect":  # the client went away already
        return
    # Accepted first, so the client sees the close code and the reason (a close before the accept is a
    # bare HTTP 403 handshake failure). A close reason may be at most 123 bytes.
    reason = refusal.encode()[:123].decode(errors="ignore")
    await send({"type": "websocket.accept"})
    await send({"type": "websocket.close", "code": 1008, "reason": reason})


class RequestBodyTooLarge(Exception):
    """A streamed (chunked) body grew past the limit; the server answers 413 (see ``InternalErrorMiddleware``)."""
