"""``ng_viewer``: browse a rollouts file in a local web page.

Usage::

    ng_viewer +jsonl_fpath=<rollouts.jsonl> [+host=127.0.0.1] [+port=0]
              [+compare_jsonl_fpath=<other.jsonl>] [+pass_threshold=1.0] [+index_dir=<dir>]
              [+allowed_roots=<dir>|[<dir>,...]] [+token=<secret>]
              [+request_head_timeout_s=10] [+request_body_idle_timeout_s=30] [+keep_alive_timeout_s=60]
              [+reserved_connection_fraction=0.1]

The server binds first (port 0 picks a free port), prints ``ng_viewer: open http://...``, and
indexes the file(s) in the background; the page shows the progress. Ctrl-C stops it.

It serves only the files it was started with (and their sidecars) and files under
``+allowed_roots``. Off loopback (or with ``+token`` / ``NG_VIEWER_TOKEN``) every request needs the
access token; the printed URL carries it (``?token=...``), printed once. Connections that send no
complete request within ``+request_head_timeout_s`` are closed, and places are kept for requests with
the token, as on every server of a run (:mod:`nemo_gym.server.accept_limit`).
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any
from urllib.parse import quote

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from nemo_gym.client.fd_limits import raise_open_file_limit
from nemo_gym.config.command import command
from nemo_gym.config.loading import load_global_config
from nemo_gym.config.problems import ConfigError, did_you_mean
from nemo_gym.tools.viewer.access import MIN_TOKEN_CHARS, TOKEN_ENV

USAGE = (
    "usage: ng_viewer +jsonl_fpath=<rollouts.jsonl> [+host=127.0.0.1] [+port=0]\n"
    "                 [+compare_jsonl_fpath=<other rollouts.jsonl>] [+pass_threshold=1.0] [+index_dir=<dir>]\n"
    "                 [+allowed_roots=<dir>|[<dir>,...]] [+token=<secret>]\n"
    "                 [+request_head_timeout_s=10] [+request_body_idle_timeout_s=30] [+keep_alive_timeout_s=60]\n"
    "                 [+reserved_connection_fraction=0.1]\n"
    "Opens a local web page for reading the rollouts (port 0 = a free port, printed at start).\n"
    "Serves only the given files, their sidecars and files under +allowed_roots (symlinks resolved first).\n"
    "Off 127.0.0.1 every request needs a token (random, or +token / $NG_VIEWER_TOKEN): the printed URL has it.\n"
    "The line-offset index is cached in $XDG_CACHE_HOME/nemo_gym/viewer (~/.cache/...), or in +index_dir."
)


class ViewerConfig(BaseModel):
    """Command-line options of ``ng_viewer``."""

    model_config = ConfigDict(extra="forbid")

    jsonl_fpath: str
    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535)
    compare_jsonl_fpath: str | None = None
    pass_threshold: float = 1.0
    index_dir: str | None = None
    allowed_roots: list[str] = Field(default_factory=list)
    token: str | None = Field(default=None, min_length=MIN_TOKEN_CHARS)
    # Connection limits, as for every server of a run (nemo_gym.server.accept_limit; defaults there).
    request_head_timeout_s: float | None = Field(default=None, gt=0)
    request_body_idle_timeout_s: float | None = Field(default=None, gt=0)
    keep_alive_timeout_s: float | None = Field(default=None, gt=0)
    reserved_connection_fraction: float | None = Field(default=None, ge=0, lt=1)

    @field_validator("allowed_roots", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


def _fail(message: str) -> None:
    sys.stderr.write(f"ng_viewer: {message}\n")
    sys.exit(2)


def parse_config(argv: list[str]) -> ViewerConfig:
    """Options from Hydra-style ``+key=value`` arguments; exits with a message on bad input."""
    from omegaconf import OmegaConf

    try:
        loaded = load_global_config(argv, load_env_yaml=False)
        raw: Any = OmegaConf.to_container(loaded.config, resolve=True)
    except ConfigError as e:
        _fail(str(e))
    raw = {k: v for k, v in raw.items() if k != "config_paths"}
    try:
        return ViewerConfig.model_validate(raw)
    except ValidationError as e:
        msgs = []
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"])
            if err["type"] == "extra_forbidden":
                msgs.append(
                    f"+{loc}: unknown option.{did_you_mean(loc, list(ViewerConfig.model_fields), '+')}"
                )
            else:
                msgs.append(f"+{loc}: {err['msg']}")
        _fail("invalid options:\n  " + "\n  ".join(msgs) + "\n" + USAGE)
    raise AssertionError("unreachable")


def url_for(host: str, port: int, token: str | None = None) -> str:
    """The address to print for a server bound to ``host:port`` (with ``?token=`` when it has one)."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)
    if ":" in shown and not shown.startswith("["):
        shown = f"[{shown}]"
    return f"http://{shown}:{port}/" + (f"?token={quote(token, safe='')}" if token else "")


def _report_when_indexed(state: Any) -> None:
    for ds in list(state.datasets.values()):
        ds.wait_ready(timeout=24 * 3600)
        st = ds.status()
        if st["state"] == "error":
            print(f"ng_viewer: cannot index {st['path']}: {st['error']}", flush=True)
            continue
        how = "loaded cached index" if st["loaded_from_cache"] else "indexed"
        bad = f", {st['malformed']} malformed line(s)" if st["malformed"] else ""
        print(
            f"ng_viewer: {how} {st['path']}: {st['rows']} rollouts{bad} in {st['index_seconds']:.2f} s",
            flush=True,
        )


@command("ng_viewer")
def main(argv: list[str] | None = None) -> None:
    """Entry point of ``ng_viewer``."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return
    raise_open_file_limit()
    cfg = parse_config(argv)
    for label, value in (
        ("+jsonl_fpath", cfg.jsonl_fpath),
        ("+compare_jsonl_fpath", cfg.compare_jsonl_fpath),
    ):
        if value is not None and not Path(value).expanduser().is_file():
            _fail(f"{label}={value}: no such file")
    env_token = os.environ.get(TOKEN_ENV)
    if cfg.token is None and env_token is not None and len(env_token) < MIN_TOKEN_CHARS:
        _fail(f"${TOKEN_ENV} must have at least {MIN_TOKEN_CHARS} characters (or unset it)")
    for root in cfg.allowed_roots:
        if not Path(root).expanduser().is_dir():
            _fail(f"+allowed_roots: {root} is not a directory")

    from nemo_gym.client.fd_limits import split_server_budget
    from nemo_gym.config.ports import reserve_listening_socket
    from nemo_gym.server.accept_limit import ConnectionLimits, bounded_server
    from nemo_gym.tools.viewer.access import AccessPolicy, TokenGuard, is_loopback_host
    from nemo_gym.tools.viewer.app import ViewerState, create_app

    given = [f for f in (cfg.jsonl_fpath, cfg.compare_jsonl_fpath) if f is not None]
    policy = AccessPolicy(files=given, roots=cfg.allowed_roots)
    state = ViewerState(cache_dir=cfg.index_dir, pass_threshold=cfg.pass_threshold, policy=policy)
    state.main_id = state.open(Path(cfg.jsonl_fpath).expanduser()).id
    if cfg.compare_jsonl_fpath:
        state.compare_id = state.open(Path(cfg.compare_jsonl_fpath).expanduser()).id
    token = TokenGuard.for_host(cfg.host, cfg.token)
    app = create_app(state, token)
    app.state.loopback_only = is_loopback_host(cfg.host)
    try:
        sock = reserve_listening_socket(cfg.host, cfg.port, "ng_viewer")
    except ConfigError as e:
        _fail(str(e))
    port = sock.getsockname()[1]
    print(f"ng_viewer: serving {Path(cfg.jsonl_fpath).expanduser().resolve()}", flush=True)
    if cfg.allowed_roots:
        print(f"ng_viewer: may also open files under {', '.join(str(r) for r in policy.roots)}", flush=True)
    print(f"ng_viewer: open {url_for(cfg.host, port, token.token)}  (Ctrl-C to stop)", flush=True)
    if token.required:
        print(
            "ng_viewer: every request needs the token in that URL (it is kept in a cookie after the first visit)",
            flush=True,
        )
    threading.Thread(target=_report_when_indexed, args=(state,), daemon=True).start()
    # Silent or slow connections are closed and requests with the token keep places: no connection flood
    # can stop the viewer (nemo_gym.server.accept_limit).
    limits, keep_alive_s = ConnectionLimits.from_settings(
        lambda key, default: default if getattr(cfg, key) is None else getattr(cfg, key)
    )
    trusts = app.state.viewer_trusts
    bounded_server(app, split_server_budget(), limits, keep_alive_s, trusts, lifespan="off").run(
        sockets=[sock]
    )


if __name__ == "__main__":
    main()
