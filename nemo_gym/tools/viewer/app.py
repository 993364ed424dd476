"""The viewer's FastAPI app: a JSON API over opened rollouts files plus the page in ``static/``.

Contract
--------
* ``GET /`` is the page; ``/static/*`` its script and style (shipped in the package, nothing from
  the internet).
* ``GET /api/files`` lists opened files with their indexing state; ``POST /api/files``
  ``{"path": ...}`` opens another one (for comparison); ``POST /api/files/{id}/refresh`` picks up
  rows appended since indexing.
* ``GET /api/files/{id}/rows`` (filters, sort, paging, full-text ``q``), ``.../position`` (where a
  row sits in that list, and its neighbours), ``.../rollouts/{row}`` (one whole rollout, read from
  disk), ``.../summary``, ``.../tasks``, ``.../malformed``; ``GET /api/compare?a=&b=``.
* Errors are JSON ``{"error": message}``: 400 for bad parameters, 404 for an unknown file or row,
  503 (with the progress) while a file is still being indexed.
* Only files on the :class:`~nemo_gym.tools.viewer.access.AccessPolicy` allow-list are opened: the
  files the viewer was started with, their sidecars, and files under ``+allowed_roots``, checked
  after resolving symlinks and ``..``. ``POST /api/files`` for any other path is a 403 saying how
  to allow it (the same answer whether or not the path exists).
* When the viewer has a token (bound to a non-loopback address, or ``+token`` given), every
  request must carry it (see :class:`~nemo_gym.tools.viewer.access.TokenGuard`), else 401. A ``GET``
  with a valid ``?token=`` sets an HttpOnly ``SameSite=Strict`` cookie, so the page's own requests
  carry it; ``GET /?token=`` then redirects to ``/`` so the token leaves the address bar.
* Work that reads the file or walks every row runs on worker threads; the event loop only routes.
* When bound to a loopback address, requests whose ``Host`` is not a loopback name are refused
  (protects the local page from DNS-rebinding sites); ``POST`` bodies must be JSON.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from nemo_gym.tools.viewer.access import (
    LOOPBACK_NAMES,
    TOKEN_HEADER,
    TOKEN_QUERY,
    AccessDenied,
    AccessPolicy,
    TokenGuard,
)
from nemo_gym.tools.viewer.compare import compare
from nemo_gym.tools.viewer.dataset import Dataset
from nemo_gym.tools.viewer.query import Filters, QueryError, parse_task_spec

STATIC_DIR = Path(__file__).parent / "static"
MAX_WAIT_S = 5.0


class JSON(Response):
    """A JSON response serialised with orjson (NaN/inf become null)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        """Serialise ``content``."""
        return orjson.dumps(content)


def _error(status: int, message: str, **extra: Any) -> JSON:
    return JSON({"error": message, **extra}, status_code=status, headers={"cache-control": "no-store"})


class ViewerState:
    """The files opened in one viewer process."""

    def __init__(
        self, cache_dir: str | None = None, pass_threshold: float = 1.0, policy: AccessPolicy | None = None
    ) -> None:
        self.cache_dir = cache_dir
        self.pass_threshold = pass_threshold
        self.policy = policy if policy is not None else AccessPolicy()
        self.datasets: dict[str, Dataset] = {}
        self.main_id: str | None = None
        self.compare_id: str | None = None
        self._lock = threading.Lock()

    def open(self, path: str | os.PathLike[str]) -> Dataset:
        """Open ``path`` (or return the already opened dataset for it); indexing starts in the background.

        The caller decides whether ``path`` may be opened (the command line's files are added to the
        allow-list, ``POST /api/files`` checks it); the dataset checks its sidecars itself.
        """
        resolved = Path(path).expanduser().resolve()
        with self._lock:
            for ds in self.datasets.values():
                if ds.path.resolve() == resolved and ds.state != "error":
                    return ds
            file_id = str(len(self.datasets) + 1)
            ds = Dataset(
                file_id,
                resolved,
                cache_dir=self.cache_dir,
                pass_threshold=self.pass_threshold,
                access=self.policy,
            )
            self.datasets[file_id] = ds
        return ds.start()

    def get(self, file_id: str) -> Dataset | None:
        """The dataset with id ``file_id``."""
        return self.datasets.get(file_id)

    def listing(self) -> dict[str, Any]:
        """Every opened file's status, and which are the main and comparison files."""
        return {
            "files": [ds.status() for ds in self.datasets.values()],
            "main": self.main_id,
            "compare": self.compare_id,
        }


def _float_param(request: Request, name: str) -> float | None:
    raw = request.query_params.get(name, "").strip()
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        raise QueryError(f"{name}={raw!r} is not a number") from None


def _int_param(request: Request, name: str, default: int) -> int:
    raw = request.query_params.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise QueryError(f"{name}={raw!r} is not an integer") from None


def _bool_param(request: Request, name: str) -> bool:
    return request.query_params.get(name, "").lower() in ("1", "true", "yes", "on")


def filters_from_request(request: Request) -> Filters:
    """Read the run-list filters from the query string."""
    q = request.query_params
    tasks_spec = q.get("tasks", "").strip()
    agent = q.get("agent")
    return Filters(
        reward_min=_float_param(request, "reward_min"),
        reward_max=_float_param(request, "reward_max"),
        tasks=parse_task_spec(tasks_spec) if tasks_spec else None,
        agent=agent if agent is not None and "agent" in q else None,
        errors_only=_bool_param(request, "errors"),
        text=q.get("q", "").strip(),
    )


CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; object-src 'none'; "
    "base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
)


def _supplied_token(request: Request, cookie_name: str) -> tuple[str | None, bool]:
    """The token a request carries (header, bearer, cookie or query), and whether it came in the query."""
    auth = request.headers.get("authorization", "")
    supplied = request.headers.get(TOKEN_HEADER) or (
        auth[7:].strip() if auth[:7].lower() == "bearer " else None
    )
    supplied = supplied or request.cookies.get(cookie_name)
    if supplied:
        return supplied, False
    return request.query_params.get(TOKEN_QUERY) or None, True


def _set_token_cookie(response: Response, name: str, token: TokenGuard) -> None:
    assert token.token is not None
    response.set_cookie(name, token.token, httponly=True, samesite="strict", path="/")


def create_app(state: ViewerState, token: TokenGuard | None = None) -> FastAPI:
    """The FastAPI app serving ``state``'s files (requests must carry ``token`` when it has one)."""
    app = FastAPI(title="ng_viewer", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.viewer = state
    app.state.loopback_only = True
    guard_token = token if token is not None else TokenGuard(None)

    def trusts(scope: dict) -> bool:
        """Whether a request head carries the token (or none is needed): its connection then keeps a
        place kept for trusted clients (nemo_gym.server.accept_limit)."""
        if not guard_token.required:
            return True
        server = scope.get("server")
        supplied, _ = _supplied_token(Request(scope), TokenGuard.cookie_name(server[1] if server else None))
        return guard_token.matches(supplied)

    app.state.viewer_trusts = trusts

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Response:
        if app.state.loopback_only:
            host = request.headers.get("host", "")
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if name not in LOOPBACK_NAMES:
                return _error(403, f"ng_viewer only answers requests for 127.0.0.1/localhost, not {host!r}")
        set_cookie: str | None = None
        if guard_token.required:
            server = request.scope.get("server")
            cookie = TokenGuard.cookie_name(server[1] if server else None)
            supplied, from_query = _supplied_token(request, cookie)
            if not guard_token.matches(supplied):
                return _error(
                    401,
                    "this ng_viewer needs its access token: open the URL it printed at start (…/?token=…), "
                    f"or send the header '{TOKEN_HEADER}: <token>' (or 'Authorization: Bearer <token>')",
                )
            if from_query:
                set_cookie = cookie
                if request.method == "GET" and request.url.path == "/":
                    # Keep the token out of the address bar and history: the cookie carries it from now on.
                    response: Response = RedirectResponse("/", status_code=303)
                    _set_token_cookie(response, cookie, guard_token)
                    return response
        if request.method == "POST" and not request.headers.get("content-type", "").startswith(
            "application/json"
        ):
            return _error(415, "POST bodies must be application/json")
        response = await call_next(request)
        response.headers.setdefault("cache-control", "no-store")
        # Rollouts are untrusted text: the page builds its DOM from text nodes only, and the browser is
        # told to run nothing but the viewer's own script even if that ever slipped.
        response.headers.setdefault("content-security-policy", CONTENT_SECURITY_POLICY)
        response.headers.setdefault("x-content-type-options", "nosniff")
        if set_cookie is not None:
            _set_token_cookie(response, set_cookie, guard_token)
        return response

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html")

    def dataset_or_error(file_id: str, need_ready: bool = True) -> Dataset | JSON:
        ds = state.get(file_id)
        if ds is None:
            return _error(404, f"no opened file with id {file_id!r}")
        if need_ready and ds.state != "ready":
            if ds.state == "error":
                return _error(400, ds.error or "the file could not be indexed", state="error")
            return _error(
                503, f"{ds.path} is still being indexed", state=ds.state, progress=ds.status()["progress"]
            )
        return ds

    @app.get("/api/files")
    async def files() -> JSON:
        return JSON(state.listing())

    @app.post("/api/files")
    async def open_file(request: Request) -> JSON:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            return _error(400, 'the body must be a JSON object like {"path": "/path/to/rollouts.jsonl"}')
        path = body.get("path") if isinstance(body, dict) else None
        if not isinstance(path, str) or not path.strip():
            return _error(400, 'the body needs a non-empty "path"')
        p = Path(path.strip()).expanduser()
        try:
            p = state.policy.check(p)  # before looking at the file: a refusal says nothing about it
        except AccessDenied as e:
            return _error(403, str(e))
        if not p.is_file():
            return _error(400, f"{p} is not a file")
        ds = state.open(p)
        if body.get("role") == "compare":
            state.compare_id = ds.id
        return JSON(ds.status())

    @app.get("/api/files/{file_id}")
    async def file_status(file_id: str) -> JSON:
        ds = dataset_or_error(file_id, need_ready=False)
        return ds if isinstance(ds, JSON) else JSON(ds.status())

    @app.post("/api/files/{file_id}/refresh")
    def refresh(file_id: str) -> JSON:
        ds = dataset_or_error(file_id)
        if isinstance(ds, JSON):
            return ds
        try:
            changed = ds.refresh()
        except Exception as e:  # noqa: BLE001 - reported to the page
            return _error(400, f"refresh failed: {e}")
        return JSON({"changed": changed, **ds.status()})

    def run(fn: Any) -> JSON:
        try:
            return JSON(fn())
        except QueryError as e:
            return _error(400, str(e))

    @app.get("/api/files/{file_id}/rows")
    def rows(file_id: str, request: Request) -> JSON:
        ds = dataset_or_error(file_id)
        if isinstance(ds, JSON):
            return ds
        return run(
            lambda: ds.rows_page(
                filters_from_request(request),
                request.query_params.get("sort", "row"),
                _bool_param(request, "desc"),
                _int_param(request, "offset", 0),
                _int_param(request, "limit", 50),
                wait_s=min(MAX_WAIT_S, max(0.0, _float_param(request, "wait") or 1.0)),
            )
        )

    @app.get("/api/files/{file_id}/position")
    def position(file_id: str, request: Request) -> JSON:
        ds = dataset_or_error(file_id)
        if isinstance(ds, JSON):
            return ds
        return run(
            lambda: ds.position(
                filters_from_request(request),
                request.query_params.get("sort", "row"),
                _bool_param(request, "desc"),
                _int_param(request, "row", -1),
                wait_s=min(MAX_WAIT_S, max(0.0, _float_param(request, "wait") or 1.0)),
            )
        )

    @app.get("/api/files/{file_id}/rollouts/{row}")
    def rollout(file_id: str, row: int) -> Response:
        ds = dataset_or_error(file_id)
        if isinstance(ds, JSON):
            return ds
        try:
            raw = ds.read_rollout(row)
        except QueryError as e:
            return _error(404 if "does not exist" in str(e) else 409, str(e))
        meta = orjson.dumps(ds.row_summary(row))
        body = b'{"meta":' + meta + b',"data":' + raw + b"}"
        return Response(body, media_type="application/json")

    @app.get("/api/files/{file_id}/rollouts/{row}/model_calls")
    def model_calls(file_id: str, row: int) -> JSON:
        """The rollout's captured model calls (``<stem>_model_calls.jsonl``; nemo_gym.server.model_calls)."""
        ds = dataset_or_error(file_id)
        if isinstance(ds, JSON):
            return ds
        if not 0 <= row < len(ds.require()):
            return _error(404, f"row {row} does not exist")
        return run(lambda: ds.model_calls(row))

    @app.get("/api/files/{file_id}/summary")
    def summary(file_id: str) -> JSON:
        ds = dataset_or_error(file_id)
        return ds if isinstance(ds, JSON) else run(ds.summary)

    @app.get("/api/files/{file_id}/tasks")
    def tasks(file_id: str, request: Request) -> JSON:
        ds = dataset_or_error(file_id)
        if isinstance(ds, JSON):
            return ds
        return run(
            lambda: ds.tasks_page(
                request.query_params.get("sort", "task"),
                _bool_param(request, "desc"),
                _int_param(request, "offset", 0),
                _int_param(request, "limit", 50),
            )
        )

    @app.get("/api/files/{file_id}/malformed")
    def malformed(file_id: str, request: Request) -> JSON:
        ds = dataset_or_error(file_id)
        if isinstance(ds, JSON):
            return ds
        return run(lambda: ds.malformed(_int_param(request, "offset", 0), _int_param(request, "limit", 100)))

    @app.get("/api/compare")
    def compare_files(request: Request) -> JSON:
        a = dataset_or_error(request.query_params.get("a", ""))
        if isinstance(a, JSON):
            return a
        b = dataset_or_error(request.query_params.get("b", ""))
        if isinstance(b, JSON):
            return b
        return run(
            lambda: compare(
                a,
                b,
                request.query_params.get("sort", "task"),
                _bool_param(request, "desc"),
                _int_param(request, "offset", 0),
                _int_param(request, "limit", 50),
                request.query_params.get("only", "all"),
            )
        )

    return app
