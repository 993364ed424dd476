"""Server plumbing shared by every server process: sessions, errors, start-up.

Contract
--------
* The HTTP client lives in :mod:`nemo_gym.client.server_client`, its error and response checks
  (``UpstreamError``, ``raise_for_status``, ``response_body``) in :mod:`nemo_gym.errors`; upstream's
  path ``nemo_gym.server.base`` offers them with this module's names
  (``from nemo_gym.server.base import ServerClient, raise_for_status`` keeps working).
* :class:`BaseServer` turns a pydantic config into a FastAPI app with ``GET /`` (health), a signed
  per-instance session cookie, and JSON errors that name the server, the path and the inner error.
  Every error answer (status >= 400, whoever built it) is scrubbed of the secret values this process
  knows (its config, the whole config it got, the env.yaml values ``ng_run`` passed): see
  :mod:`nemo_gym.redaction`. Successful answers are never touched. A
  :class:`~nemo_gym.kit.verify_pool.VerifyPoolError` escaping a handler (a check that timed out or whose
  worker died, or a library's own timeout reported as :class:`~nemo_gym.kit.verify_pool.VerifyTimeoutError`)
  is answered 503 with its ``kind`` (``verify_timeout`` / ``verify_failed``): never a score.
* ``run_webserver()`` is what each ``app.py`` calls under ``if __name__ == "__main__"``. It validates
  the instance's config block (unknown keys are errors, with "did you mean"); under ``ng_run`` it
  reports the verdict to the launcher and waits for its go before building and serving, so a typo
  in any server's block stops the run before any server starts (the server's side of that verdict
  protocol is :mod:`nemo_gym.server.startup`, the launcher's :mod:`nemo_gym.run.supervision.verdicts`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any, ClassVar

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute
from omegaconf import DictConfig, OmegaConf
from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError

from nemo_gym.auth import (
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    MAX_REQUEST_BODY_BYTES_KEY_NAME,
    RequestBodyTooLarge,
    RequestGuard,
    server_token_from_env,
)
from nemo_gym.client.replicas import install_replica_cookie
from nemo_gym.client.server_client import (  # re-exported: the client is importable from here too
    ServerClient,
    find_instance_block,
)
from nemo_gym.config.keys import (
    DEFAULT_HEAD_SERVER_HOST,
    DEFAULT_HEAD_SERVER_PORT,
    HEAD_SERVER_KEY_NAME,
    NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME,
    NEMO_GYM_LISTEN_FD_ENV_VAR_NAME,
)
from nemo_gym.config.process import current_global_config_dict, get_global_config_dict, launched_by_ng_run
from nemo_gym.config.types import (
    ROLLOUT_PATH_PREFIX,
    TOKEN_CAPTURE_PATH_SEGMENT,
    BaseRunServerInstanceConfig,
    BaseServerConfig,
)
from nemo_gym.errors import UpstreamError, error_envelope
from nemo_gym.kit.verify_pool.errors import VerifyPoolError
from nemo_gym.launch import load_launch_values
from nemo_gym.redaction import (
    add_secret_values,
    collect_secret_values,
    config_secret_values,
)
from nemo_gym.server.accept_limit import (
    ConnectionLimits,
)
from nemo_gym.server.asgi.errors import InternalErrorMiddleware
from nemo_gym.server.asgi.layer import ServerLayer
from nemo_gym.server.asgi.sessions import SessionMiddleware, cookie_name_for, session_secret
from nemo_gym.server.metrics.install import install_metrics
from nemo_gym.server.startup import (
    InstanceConfigError,
    config_problems,
    die_with_parent,
    report_config_verdict,
    startup_mark,
    tune_gc_for_throughput,
)
from nemo_gym.server.tracing import install_tracing

logger = logging.getLogger("nemo_gym")

# ------------------------------------------------------------------------------------------------
# Request plumbing (one ASGI layer; see :mod:`nemo_gym.server.asgi`).


def _is_foreign_key(problem: dict[str, Any]) -> bool:
    """An unknown key at the top of a server's block that is no typo of a setting's name."""
    loc = str(problem.get("loc") or "")
    return (
        problem.get("type") == "extra_forbidden"
        and bool(loc)
        and "." not in loc
        and "[" not in loc
        and not problem.get("typo_of")
    )


class StrictJSONRequest(Request):
    """A request whose ``json()`` is parsed by orjson: strict UTF-8, so a lone surrogate (``"\\ud800"``,
    or the bytes of one) is a 422 ``json_invalid`` at the door instead of a string no JSON encoder can
    write back (a 500 when a handler echoes it), and faster than the standard library's parser."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = orjson.loads(await self.body())  # orjson.JSONDecodeError is a json.JSONDecodeError
        return self._json


class StrictJSONRoute(APIRoute):
    """The route class of every server of ours: its handlers get a :class:`StrictJSONRequest`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Response:
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict_handler


async def validated_body(request: Request, model: type[BaseModel]) -> dict[str, Any]:
    """The JSON body as parsed, after checking it against ``model``; errors become the usual 422.

    For hot paths that forward a body: the dict is passed on exactly as received (nothing added,
    nothing dropped, no re-serialisation), and the model only checks it.
    """
    raw = await request.body()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise RequestValidationError(
            [
                {
                    "type": "json_invalid",
                    "loc": ("body", e.pos),
                    "msg": f"JSON decode error: {e.msg}",
                    "input": {},
                }
            ]
        ) from None
    try:
        model.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError(
            [{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)]
        ) from None
    return body


def get_session_id(request: Request) -> str:
    return request.state.session_id


# ------------------------------------------------------------------------------------------------
# The server base.


def _validation_message(errors: list[dict[str, Any]]) -> str:
    parts = []
    for err in errors[:20]:
        loc = ".".join(str(x) for x in err.get("loc", ()))
        parts.append(f"{loc}: {err.get('msg')}")
    return "; ".join(parts)


class BaseServer(BaseModel):
    """A server: its validated config plus a client for calling the others."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    config: BaseRunServerInstanceConfig
    server_client: ServerClient

    # Subclasses that keep per-rollout state set this so the session cookie is issued.
    uses_sessions: ClassVar[bool] = True
    # The server type its metrics are those of (nemo_gym.server.metrics); each base class sets its own.
    metrics_kind: ClassVar[str] = "server"
    # Whether this server uses the run's Ray cluster when the run has one (verification as Ray tasks,
    # nemo_gym.kit.verify_pool): None (NeMo Gym 0.7's "not declared") and True do; False never does, its
    # verification stays in the local pool. Without a cluster it changes nothing: Ray is never imported.
    ray_enabled: ClassVar[bool | None] = None
    _metrics: Any = PrivateAttr(default=None)  # its ServerMetrics (None: +metrics_enabled=false)

    async def on_startup(self) -> None:
        """Runs once in the server's event loop before the first request (override to open resources)."""

    async def on_shutdown(self) -> None:
        """Runs once when the server stops (override to close sessions, files, models)."""

    @contextlib.asynccontextmanager
    async def _lifespan(self, _app: FastAPI) -> AsyncIterator[None]:
        await self.on_startup()
        startup_mark("serving")
        try:
            yield
        finally:
            await self.on_shutdown()

    def setup_webserver(self) -> FastAPI:
        """The app: ``GET /``, JSON errors, the session cookie (when ``uses_sessions``), the request guard.
        Subclasses call ``super().setup_webserver()`` and add their routes."""
        app = FastAPI(
            title=f"{self.config.name} ({type(self).__name__})",
            docs_url="/docs",
            redoc_url=None,
            lifespan=self._lifespan,
        )
        self._install_base(app)
        return app

    def _install_base(self, app: FastAPI) -> None:
        """Give ``app`` what every server of ours has (also used for an app a subclass built itself)."""
        app.state.nemo_gym_base_installed = True
        app.router.route_class = StrictJSONRoute  # the routes added from now on
        # What this server knows of secrets: its own config and the whole config it got.
        add_secret_values(collect_secret_values(self.config))
        global_cfg = current_global_config_dict()
        if global_cfg is not None:
            add_secret_values(config_secret_values(global_cfg))
        name = self.config.name
        self.setup_liveness(app)

        @app.exception_handler(UpstreamError)
        async def upstream_error(request: Request, exc: UpstreamError) -> Response:
            body = error_envelope("upstream_error", server=name, path=request.url.path, inner=exc.to_dict())
            # A server that did not answer in time is a gateway timeout; anything else a bad gateway.
            status = 504 if exc.kind == "timeout" else 502
            return Response(orjson.dumps(body), status_code=status, media_type="application/json")

        @app.exception_handler(VerifyPoolError)
        async def verify_error(request: Request, exc: VerifyPoolError) -> Response:
            # A check that could not be carried out (timed out, worker died): not a score, and this
            # server is up (it answered), so 503 with the kind the failures sidecar files it under.
            # (the message is scrubbed with every error answer: nemo_gym.server.asgi)
            body = error_envelope(
                exc.kind, server=name, path=request.url.path, type=type(exc).__name__, message=str(exc)
            )
            return Response(orjson.dumps(body), status_code=503, media_type="application/json")

        @app.exception_handler(RequestValidationError)
        async def validation_error(request: Request, exc: RequestValidationError) -> Response:
            errors = _jsonable_errors(exc.errors())
            body = {
                "detail": errors,
                **error_envelope(
                    "validation_error",
                    server=name,
                    path=request.url.path,
                    message=_validation_message(errors),
                ),
            }
            return Response(orjson.dumps(body), status_code=422, media_type="application/json")

        # Unhandled exceptions: answered by a middleware rather than ``exception_handler(Exception)``.
        # Starlette re-raises after such a handler, and uvicorn then closes the keep-alive connection,
        # so the caller's next request on that pooled connection would fail with a reset.
        @app.exception_handler(RequestBodyTooLarge)
        async def body_too_large(request: Request, exc: RequestBodyTooLarge) -> Response:
            body = error_envelope("request_too_large", server=name, path=request.url.path, message=str(exc))
            return Response(orjson.dumps(body), status_code=413, media_type="application/json")

        # Guard, rollout prefix, sessions and error answers: one layer (nemo_gym.server.asgi). Sessions and
        # errors are left out of it when the app installed its own (upstream's set-up steps, called by
        # a subclass that built its app itself), and the set-up steps become no-ops afterwards.
        sessions = None
        if self.uses_sessions and not getattr(app.state, "nemo_gym_session_middleware_installed", False):
            app.state.nemo_gym_session_middleware_installed = True
            sessions = SessionMiddleware(None, cookie_name_for(name), session_secret())
        if self.uses_sessions:
            install_replica_cookie(app, name)  # replicas only (nemo_gym.client.replicas); else nothing
        errors = not getattr(app.state, "nemo_gym_exception_middleware_installed", False)
        app.state.nemo_gym_exception_middleware_installed = True
        token, disabled = server_token_from_env()
        guard = RequestGuard(
            None,
            server_name=name,
            token=token,
            disabled=disabled,
            max_body_bytes=self._max_request_body_bytes(),
            rollout_paths=(f"/{ROLLOUT_PATH_PREFIX}/", TOKEN_CAPTURE_PATH_SEGMENT),
        )
        app.state.nemo_gym_request_guard = guard  # its ``trusts`` gives token bearers reserved connections
        # GET /metrics; the request counts are taken by the layer (refused requests too).
        self._metrics = install_metrics(app, name, self.metrics_kind, global_cfg, middleware=False)
        meter = None if self._metrics is None else self._metrics.meter
        # Added last, so outermost: nothing runs for a request without the run token or too large a body.
        app.add_middleware(
            ServerLayer, guard=guard, server_name=name, sessions=sessions, errors=errors, meter=meter
        )
        # +tracing=otlp: a span per request, outermost (nemo_gym.server.tracing); off: nothing at all.
        install_tracing(app, name, self.metrics_kind, global_cfg)

    # -- upstream NeMo Gym's set-up steps (each idempotent: our setup_webserver already did them) -------
    def setup_liveness(self, app: FastAPI) -> None:
        """``GET /`` answers ``{"status": "ok", "name": <instance>}`` (added once)."""
        if any(getattr(r, "path", None) == "/" for r in app.router.routes):
            return
        name = self.config.name

        @app.get("/", include_in_schema=False)
        async def health() -> dict[str, str]:
            return {"status": "ok", "name": name}

    def setup_exception_middleware(self, app: FastAPI) -> None:
        """An unhandled exception becomes a JSON 500 naming the server, the path and the error; error
        bodies are scrubbed of secrets (added once)."""
        if getattr(app.state, "nemo_gym_exception_middleware_installed", False):
            return
        app.state.nemo_gym_exception_middleware_installed = True
        app.add_middleware(InternalErrorMiddleware, server_name=self.config.name)

    def setup_session_middleware(self, app: FastAPI) -> None:
        """The signed per-instance session cookie; handlers read ``request.session[SESSION_ID_KEY]``
        (added once)."""
        if getattr(app.state, "nemo_gym_session_middleware_installed", False):
            return
        app.state.nemo_gym_session_middleware_installed = True
        app.add_middleware(
            SessionMiddleware, cookie_name=cookie_name_for(self.config.name), secret=session_secret()
        )

    def get_session_middleware_key(self) -> str:
        """Upstream's per-server key ``<ClassName>___<instance>`` (used here to name the server in logs)."""
        return f"{type(self).__name__}___{self.config.name}"

    def complete_app(self, app: FastAPI) -> FastAPI:
        """Make sure an app about to be served has the request guard, JSON errors and ``GET /``, even when
        a subclass built its own ``FastAPI()`` instead of calling ``super().setup_webserver()``."""
        if not getattr(app.state, "nemo_gym_base_installed", False):
            self._install_base(app)
        return app

    def _max_request_body_bytes(self) -> int:
        """This server's body limit: its own setting, else the run's top-level one, else the default."""
        return int(self._setting(MAX_REQUEST_BODY_BYTES_KEY_NAME, DEFAULT_MAX_REQUEST_BODY_BYTES))

    def _setting(self, key: str, default: Any) -> Any:
        """A per-server setting: this server's block, else the run's top-level key (under ng_run), else
        ``default``."""
        own = getattr(self.config, key, None)
        if own is not None:
            return own
        if launched_by_ng_run():
            top = get_global_config_dict().get(key)
            if top is not None:
                return top
        return default

    def connection_limits(self) -> tuple[ConnectionLimits, float]:
        """(head/body timeouts and reserved places, keep-alive timeout) of this server, from its block,
        else the run's top-level keys, else the defaults (see :mod:`nemo_gym.server.accept_limit`)."""
        return ConnectionLimits.from_settings(self._setting)

    def serve_app(self, app: FastAPI, sock: socket.socket, max_accepted: int) -> None:
        """Serve ``app`` on the listening ``sock`` until told to stop, accepting at most ``max_accepted``
        connections at once, with this server's connection limits."""
        from nemo_gym.server.accept_limit import bounded_server

        limits, keep_alive_s = self.connection_limits()
        guard = getattr(app.state, "nemo_gym_request_guard", None)
        trusts = guard.trusts if guard is not None else None
        bounded_server(app, max_accepted, limits, keep_alive_s, trusts).run(sockets=[sock])

    # -- start-up ------------------------------------------------------------------------------------
    @classmethod
    def config_class(cls) -> type[BaseRunServerInstanceConfig]:
        return cls.model_fields["config"].annotation  # type: ignore[return-value]

    @classmethod
    def load_instance_config(cls, instance_name: str | None = None) -> BaseRunServerInstanceConfig:
        """Validate this instance's impl block from the global config into the server's config class.

        Raises :class:`InstanceConfigError` (a ``SystemExit`` with the message) listing every problem,
        an unknown key with "did you mean".
        """
        cfg = get_global_config_dict()
        name = (
            instance_name
            or os.environ.get(NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME)
            or _guess_instance_name(cls, cfg)
        )
        found = find_instance_block(cfg, name)
        if found is None:
            message = f"No server instance named {name!r} in the config."
            raise InstanceConfigError(f"[nemo_gym] {message}", [{"loc": "", "msg": message}])
        server_type, impl, block = found
        try:
            data = OmegaConf.to_container(block, resolve=True)
        except Exception as e:  # found by the launcher's checks first; here for direct starts
            message = f"cannot resolve the config: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
            raise InstanceConfigError(
                f"[nemo_gym] {name}: {message}", [{"loc": "", "msg": message}]
            ) from None
        data["name"] = name
        model = cls.config_class()
        try:
            return model.model_validate(data)
        except ValidationError as e:
            problems = config_problems(model, e)
            # Keys of the block that are no setting and no typo of one (upstream's configs carry a few that
            # their own config class never declared, e.g. code_gen's verified_url): ignored, as upstream
            # does, and said. A key that reads as a mistyped setting's name stays an error.
            foreign = [p for p in problems if _is_foreign_key(p)]
            if foreign:
                for p in foreign:
                    data.pop(p["loc"], None)
                near = [f"{p['loc']!r} is not {p['suggest'][0]!r}" for p in foreign if p.get("suggest")]
                sys.stderr.write(
                    f"[nemo_gym] {name}: ignoring {', '.join(repr(p['loc']) for p in foreign)}: not a setting "
                    f"of {server_type}/{impl} and no typo of one (upstream NeMo Gym ignores such keys too)"
                    + (f"; note {', '.join(near)}" if near else "")
                    + "\n"
                )
                try:
                    return model.model_validate(data)
                except ValidationError as again:
                    problems = config_problems(model, again)
            lines = [f"[nemo_gym] Invalid config for server instance '{name}' ({server_type}/{impl}):"]
            for p in problems:
                hint = (
                    f". Did you mean {' or '.join(repr(s) for s in p['suggest'])}?"
                    if p.get("suggest")
                    else ""
                )
                lines.append(f"  {name}.{server_type}.{impl}.{p['loc']}: {p['msg']}{hint}")
            raise InstanceConfigError("\n".join(lines), problems) from None

    @classmethod
    def load_config_from_global_config(cls) -> BaseRunServerInstanceConfig:
        """Upstream's name for :meth:`load_instance_config` (this process's instance)."""
        return cls.load_instance_config()

    @classmethod
    def run_webserver(cls) -> FastAPI | None:
        """Start this server: validate its config, build the app, serve until told to stop.

        The open-file limit is raised first; the descriptors left are split between accepted
        connections (at most half open at once, the rest wait in the listen backlog) and this
        process's outbound connection pools (see :mod:`nemo_gym.client.fd_limits`).
        """
        from nemo_gym.client.fd_limits import raise_open_file_limit, split_server_budget
        from nemo_gym.config.ports import reserve_listening_socket
        from nemo_gym.config.problems import ConfigError

        startup_mark("imports")  # the app module and what it imports are loaded
        load_launch_values()  # the private launch file, read and removed before anything else runs
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        raise_open_file_limit()
        die_with_parent()
        try:
            config = cls.load_instance_config()
        except InstanceConfigError as e:
            if report_config_verdict(e.problems):
                raise SystemExit(2) from None  # the launcher reports every server's problems at once
            raise
        startup_mark("config")
        report_config_verdict([])  # under ng_run: returns once every server's config is valid
        startup_mark("go")
        if cls.ray_enabled is False:
            from nemo_gym.kit.verify_pool import set_verify_ray_address

            set_verify_ray_address("")  # the local pool, whatever the run's cluster
        server = cls(config=config, server_client=ServerClient())
        app = server.complete_app(server.setup_webserver())
        tune_gc_for_throughput()
        startup_mark("app")
        fd = os.environ.get(NEMO_GYM_LISTEN_FD_ENV_VAR_NAME)
        if fd is not None:
            sock = socket.socket(fileno=int(fd))
        else:
            try:
                sock = reserve_listening_socket(config.host, config.port, f"server '{config.name}'")
            except ConfigError as e:
                raise SystemExit(f"[nemo_gym] {e}") from None
        server.serve_app(app, sock, split_server_budget())
        return app


class SimpleServer(BaseServer):
    """Upstream's name for a server with a ``server_client`` (every server here has one): subclass it, or
    one of the resources/agent/model bases, and override ``setup_webserver``."""


def _jsonable_errors(errors: Any) -> list[dict[str, Any]]:
    out = []
    for e in errors:
        d = {k: v for k, v in e.items() if k in ("loc", "msg", "type")}
        reason = (e.get("ctx") or {}).get("error")
        if e.get("type") == "json_invalid" and isinstance(reason, str) and reason not in str(d.get("msg")):
            d["msg"] = f"{d.get('msg')}: {reason}"  # say what is wrong with the JSON
        if "input" in e:
            try:
                orjson.dumps(e["input"])
                d["input"] = e["input"]
            except TypeError:
                d["input"] = repr(e["input"])[:200]
        d["loc"] = list(d.get("loc", ()))
        out.append(d)
    return out


def _guess_instance_name(cls: type, cfg: DictConfig) -> str:
    """Outside ng_run: the one instance whose impl folder is the folder of the running app.py."""
    folder = Path(sys.modules[cls.__module__].__file__ or sys.argv[0]).resolve().parent
    candidates = []
    for key in cfg.keys():
        found = find_instance_block(cfg, str(key))
        if found and found[1] == folder.name and found[0] == folder.parent.name:
            candidates.append(str(key))
    if len(candidates) == 1:
        return candidates[0]
    raise SystemExit(
        f"[nemo_gym] Cannot tell which server instance to run for {folder} (candidates: {candidates}). "
        f"Start it through ng_run, or set {NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME}=<instance name>."
    )


def head_server_config_from(cfg: DictConfig | dict) -> BaseServerConfig:
    head = cfg.get(HEAD_SERVER_KEY_NAME) or {}
    return BaseServerConfig(
        host=head.get("host", DEFAULT_HEAD_SERVER_HOST), port=head.get("port", DEFAULT_HEAD_SERVER_PORT)
    )


# ------------------------------------------------------------------------------------------------
# Upstream NeMo Gym's module-level helpers.

# Upstream's retry budget for a request that fails to reach its server (ours is ``ServerClient.max_retries``).
MAX_NUM_TRIES = 3


def get_first_server_config_dict(global_config_dict: DictConfig | dict, top_level_path: str) -> Any:
    """The impl block of server instance ``top_level_path`` (``cfg[name][<server type>][<impl>]``)."""
    found = find_instance_block(global_config_dict, top_level_path)
    if found is None:
        known = [str(k) for k in global_config_dict.keys() if find_instance_block(global_config_dict, str(k))]
        raise KeyError(f"No server instance named {top_level_path!r} in the config. Known instances: {known}")
    return found[2]


def get_server_url(server_name: str) -> str:
    """``http://host:port`` of server instance ``server_name`` in this process's global config."""
    block = get_first_server_config_dict(get_global_config_dict(), server_name)
    return f"http://{block.get('host') or '127.0.0.1'}:{block['port']}"


def is_nemo_gym_fastapi_entrypoint(file: str) -> bool:
    """Whether this process is a uvicorn worker importing ``file`` as its app. Never here: each server
    runs one worker in its own process (so upstream's ``elif is_nemo_gym_fastapi_entrypoint(__file__)``
    branch does not run)."""
    return False


async def request(method: str, url: str, _internal: bool = False, **kwargs: Any) -> Any:
    """Upstream's module-level ``request(method, url, **aiohttp_kwargs)`` on our transport.

    Sends to a plain ``http://`` URL (``json=``, ``data=``, ``headers=``, ``params=``, ``cookies=``,
    ``timeout=``) and returns the response (status not checked; use :func:`raise_for_status`). Failures
    to reach the server are retried a bounded number of times, also when ``_internal`` is set (upstream
    retries those forever), then raise :class:`UpstreamError`. The run token is sent to servers of a
    run this process knows.
    """
    from urllib.parse import urlsplit

    from nemo_gym.auth import client_token_for_url

    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"nemo_gym.server.base.request sends to plain http:// URLs only, got {url!r}")
    host = parts.hostname
    port = parts.port or 80
    name = f"{host}:{port}"
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    token = client_token_for_url(url)
    client = ServerClient(global_config_dict={}, auth_token=token)
    client._auth_headers = client._auth_headers or {}
    client._host_ports[name] = (host, port)  # an address, not an instance of a config
    return await client.request(method.upper(), name, path, **kwargs)
