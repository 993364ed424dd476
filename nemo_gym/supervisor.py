"""Start, watch and stop the server processes of one run (what ``ng_run`` and ``RunHelper`` use).

Contract
--------
* ``start()`` reserves every port first (see :mod:`nemo_gym.ports`), starts the head server in this
  process, spawns one child per server instance (each in its own process group, its output
  prefixed with the instance name), and health-polls them all within ``startup_timeout_s``.
  If a child exits or the bound passes, it stops everything and raises :class:`StartupError`
  naming the server with its last log lines.
* Every child loads its code and checks its config block against its config class, reports the
  verdict over a pipe, and waits. Only when every child's config is valid are they all told to go
  on (build the server, run start-up hooks, serve); otherwise everything stops and one
  :class:`ConfigError` lists every server's problems with file:line and "did you mean".
* Secrets never leave through the logs: every line relayed from a child (to the terminal, the
  ``log_dir`` files and error messages) is scrubbed (:mod:`nemo_gym.redaction`) of the secret values
  of the config and of ``env.yaml``; the ``env.yaml`` values are passed to each child
  (``NEMO_GYM_SECRET_VALUES``) so it can scrub its own error bodies.
* ``dead_server()`` reports a child that has exited since start, or an instance placed on Ray whose
  every replica is dead. Ray-placed replicas check their config blocks on their nodes and report
  their verdicts with the local ones: nothing serves until every config is valid.
* ``shutdown()`` sends SIGTERM to every child's process group, then SIGKILL after
  ``shutdown_timeout_s``; it is idempotent and also runs at interpreter exit.
* Children also die on their own when this process dies, even by SIGKILL (parent-death signal
  plus a parent watch in :func:`nemo_gym.server_utils._die_with_parent`). Linux delivers the
  parent-death signal when the *thread* that forked the child exits, so every child is spawned
  from one long-lived thread owned by the supervisor: ``RunHelper().start()`` may be called from
  a short-lived thread (a trainer's worker, ``asyncio.to_thread``) without its servers dying.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import secrets
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
import yaml
from omegaconf import OmegaConf

from nemo_gym.auth import (
    AUTH_DISABLED_ENV_VAR_NAME,
    AUTH_TOKEN_ENV_VAR_NAME,
    SERVER_AUTH_KEY_NAME,
    auth_headers,
    new_run_token,
    register_in_process,
    remove_token_file,
    write_token_file,
)
from nemo_gym.global_config import (
    DEFAULT_HEAD_SERVER_HOST,
    DEFAULT_HEAD_SERVER_PORT,
    ENV_YAML_FNAME,
    HEAD_SERVER_KEY_NAME,
    NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME,
    NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME,
    NEMO_GYM_LISTEN_FD_ENV_VAR_NAME,
    NEMO_GYM_PARENT_PID_ENV_VAR_NAME,
    NEMO_GYM_SESSION_SECRET_ENV_VAR_NAME,
    NEMO_GYM_VALIDATION_FDS_ENV_VAR_NAME,
    ConfigError,
    LoadedConfig,
    ServerInstance,
    configured_port_range,
    find_server_dir,
    is_secret_key,
)
from nemo_gym.ports import reserve_listening_socket, reserve_listening_socket_in_range
from nemo_gym.redaction import (
    NEMO_GYM_SECRET_VALUES_ENV_VAR_NAME,
    Scrubber,
    add_secret_values,
    config_secret_values,
    env_yaml_secret_values,
    process_scrubber,
    redact_config,
)
from nemo_gym.replicas import (
    NUM_REPLICAS_KEY_NAME,
    REPLICA_ENV_VAR_NAME,
    REPLICAS_KEY_NAME,
    new_replica_identity,
)
from nemo_gym.server_venvs import check_shared_requirements, ensure_server_venv

LOG_TAIL_LINES = 30
RAY_DEAD_CHECK_S = 1.0  # how often dead_server() asks the Ray replicas' actors for their status


class StartupError(RuntimeError):
    """A server failed to come up; the message names it and shows its last log lines."""


class _SpawnerThread:
    """One long-lived thread that runs every ``Popen`` of a supervisor (see the module docstring)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the spawner thread and return its result (or raise its exception)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="nemo-gym-spawner", daemon=True)
            self._thread.start()
        fut: Future = Future()
        self._jobs.put((fn, fut))
        return fut.result()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, fut = job
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed to the caller
                fut.set_exception(e)

    def stop(self) -> None:
        """Let the thread end (only once every child it spawned has been reaped)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=5)
            self._thread = None


@dataclass
class ChildServer:
    """One server instance: where it listens, how it is started, and its process once spawned."""

    instance: ServerInstance
    host: str
    port: int
    python: str
    script: Path
    sock: socket.socket | None = None
    process: subprocess.Popen | None = None
    tail: deque = field(default_factory=lambda: deque(maxlen=LOG_TAIL_LINES))
    reader: threading.Thread | None = None
    ready: bool = False
    verdict_fd: int | None = None  # read end: the child's config verdict (one JSON line)
    go_fd: int | None = None  # write end: b"g" lets the child go on once every config is valid
    verdict_buf: bytes = b""
    verdict: dict[str, Any] | None = None
    replica: int | None = None  # index among the instance's replicas (None: not replicated)
    identity: str | None = None  # NEMO_GYM_REPLICA of a replica (nemo_gym.replicas)

    @property
    def url(self) -> str:
        """Base URL of the server."""
        return f"http://{self.host}:{self.port}"

    @property
    def name(self) -> str:
        """Instance name (the top-level config key)."""
        return self.instance.name

    @property
    def label(self) -> str:
        """The instance name, with ``[<replica>]`` for a replica (log prefixes, messages)."""
        return self.name if self.replica is None else f"{self.name}[{self.replica}]"


@dataclass
class DeadRayInstance:
    """An instance placed on Ray whose every replica is dead (what :meth:`ServerSupervisor.dead_server`
    reports for it)."""

    name: str
    statuses: list[dict[str, Any]]

    @property
    def label(self) -> str:
        return self.name

    def describe(self) -> str:
        parts = [
            f"replica {i} on node {st.get('node')} (pid {st.get('pid')}, {st.get('restarts', 0)} restart(s))"
            for i, st in enumerate(self.statuses)
        ]
        return (
            f"Server '{self.name}' (placed on the Ray cluster) is dead: every replica exited and has no "
            f"restarts left (ray_max_restarts), or lost its actor or node: {'; '.join(parts)}."
        )


class ServerSupervisor:
    """Starts the head server and one child process per server instance; see the module docstring."""

    def __init__(
        self,
        loaded: LoadedConfig,
        instances: list[ServerInstance],
        echo: Callable[[str], None] | None = None,
        stop_event: threading.Event | None = None,
    ):
        self.loaded = loaded
        self.cfg = loaded.config
        self.instances = instances
        self.children: list[ChildServer] = []
        self.stop_event = stop_event or threading.Event()
        self._print_lock = threading.Lock()
        self._echo = echo
        self._head_server: Any = None
        self._head_sock: socket.socket | None = None
        self._head_thread: threading.Thread | None = None
        self.ray_connection: Any = None  # nemo_gym.ray.cluster.RayConnection when the config uses Ray
        # Instances placed on the Ray cluster: name -> nemo_gym.ray.replicas.RayReplicaGroup.
        self.ray_groups: dict[str, Any] = {}
        self.head_host = str(
            OmegaConf.select(self.cfg, f"{HEAD_SERVER_KEY_NAME}.host", default=None)
            or self.cfg.get("default_host")
            or DEFAULT_HEAD_SERVER_HOST
        )
        port = OmegaConf.select(self.cfg, f"{HEAD_SERVER_KEY_NAME}.port", default=None)
        self.head_port: int = DEFAULT_HEAD_SERVER_PORT if port is None else int(port)
        self.startup_timeout_s = float(OmegaConf.select(self.cfg, "startup_timeout_s", default=None) or 120)
        self.shutdown_timeout_s = float(OmegaConf.select(self.cfg, "shutdown_timeout_s", default=None) or 3)
        log_dir = OmegaConf.select(self.cfg, "log_dir", default=None)
        self.log_dir = Path(log_dir) if log_dir else None
        self.isolate = bool(OmegaConf.select(self.cfg, "isolate_server_venvs", default=False))
        self.venv_cache_dir = OmegaConf.select(self.cfg, "venv_cache_dir", default=None)
        # The run token every request to every server of this run must carry (see nemo_gym.auth).
        self._shut_down = False
        self._ray_dead: DeadRayInstance | None = None
        self._ray_checked_at = 0.0
        self._spawner = _SpawnerThread()
        # Every secret value this run knows: scrubbed from relayed log lines and error messages.
        self.auth_enabled = OmegaConf.select(self.cfg, SERVER_AUTH_KEY_NAME, default=True) not in (
            False,
            "false",
            0,
        )
        self.auth_token: str | None = new_run_token() if self.auth_enabled else None
        self.token_file: Path | None = None
        # The run token is a secret too: scrubbed from every log line and error body, in every process.
        self.env_secret_values = sorted(
            env_yaml_secret_values(loaded.env_yaml_data) | {self.auth_token or ""} - {""}
        )
        add_secret_values(config_secret_values(self.cfg, loaded.env_yaml_data) | set(self.env_secret_values))
        atexit.register(self.shutdown)

    # -- output --------------------------------------------------------------------------------------
    def echo(self, line: str) -> None:
        """Print one line, secrets scrubbed (thread-safe; through ``echo`` when one was given)."""
        self._emit(process_scrubber().scrub(line))

    def _emit(self, line: str) -> None:
        with self._print_lock:
            if self._echo is not None:
                self._echo(line)
            else:
                sys.stdout.write(line + "\n")
                sys.stdout.flush()

    # -- start ----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start everything and return once every server answers; stop everything and raise otherwise."""
        try:
            self._start()
        except BaseException:
            self.shutdown()
            raise

    def _start(self) -> None:
        server_dirs: dict[str, Path] = {}
        for inst in self.instances:
            folder = find_server_dir(inst, self.loaded.root_dir)
            assert folder is not None  # validated before
            server_dirs[inst.name] = folder
        if not self.isolate:
            check_shared_requirements(server_dirs)

        # 1. Every port, before anything starts (replicas placed on Ray open theirs on their nodes).
        self._check_explicit_ports_distinct()
        self._connect_ray()
        head_sock = reserve_listening_socket(
            self.head_host,
            self.head_port,
            f"the head server ({HEAD_SERVER_KEY_NAME}.port)",
            busy_hint=self._head_port_busy_hint,
        )
        self._head_sock = head_sock  # closed by shutdown() whatever happens next
        self.head_port = head_sock.getsockname()[1]
        OmegaConf.update(
            self.cfg, HEAD_SERVER_KEY_NAME, {"host": self.head_host, "port": self.head_port}, force_add=True
        )
        try:
            for inst in self.instances:
                block = OmegaConf.select(self.cfg, inst.config_key)
                num_replicas = self._num_replicas(inst, block)
                if self._placed_on_ray(inst, block):
                    self._reserve_ray_replicas(inst, block, num_replicas)
                    continue
                host = str(block.get("host") or self.cfg.get("default_host") or "127.0.0.1")
                explicit = block.get("port")
                where = self.loaded.provenance.where(f"{inst.config_key}.port")
                what = f"server '{inst.name}'" + (f" (port set at {where})" if explicit and where else "")
                port_range = configured_port_range(self.cfg)
                replicas = []
                for index in range(num_replicas):
                    asked = int(explicit) if explicit and index == 0 else None
                    if asked or port_range is None:
                        sock = reserve_listening_socket(host, asked, what)
                    else:  # upstream's port_range_low/high: automatically chosen ports come from the range
                        sock = reserve_listening_socket_in_range(
                            host, *port_range, what, avoid={self.head_port}
                        )
                    port = sock.getsockname()[1]
                    entry = str(block.get("entrypoint") or "app.py")
                    replicated = num_replicas > 1
                    self.children.append(
                        ChildServer(
                            instance=inst,
                            host=host,
                            port=port,
                            python=sys.executable,
                            script=server_dirs[inst.name] / entry,
                            sock=sock,
                            replica=index if replicated else None,
                            identity=new_replica_identity(index) if replicated else None,
                        )
                    )
                    replicas.append(
                        {"host": host, "port": port, "url": f"http://{host}:{port}", "node": None}
                    )
                # The first replica's address is the instance's (what clients without routing use).
                block["host"], block["port"] = host, replicas[0]["port"]
                if num_replicas > 1:
                    block[REPLICAS_KEY_NAME] = replicas
        except BaseException:
            head_sock.close()
            raise

        # 2. Per-server environments (only in isolated mode; a no-op when nothing changed).
        if self.isolate:
            for child in self.children:
                child.python = str(
                    ensure_server_venv(
                        child.script.parent,
                        child.name,
                        self.venv_cache_dir,
                        echo=self.echo,
                        should_stop=self.stop_event.is_set,
                    )
                )

        # 3. Head server (in this process) and the children.
        if self.stop_event.is_set():
            raise StartupError("Start-up interrupted.")
        self._publish_token()
        self._start_head_server(head_sock)
        secret = secrets.token_hex(32)
        # Every secret value of the run: what other servers' blocks must not show to a child.
        run_scrubber = Scrubber(config_secret_values(self.cfg, self.loaded.env_yaml_data))
        if self.log_dir:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        for child in self.children:
            self._spawn(child, self._child_config_yaml(child, run_scrubber), secret)

        # 4. Every child checks its config, then all go on together; health-poll with a bound.
        deadline = time.monotonic() + self.startup_timeout_s
        self._start_ray_replicas(run_scrubber, secret)  # they check their configs too, then wait for go
        self._wait_config_verdicts(deadline)
        self._wait_ready(deadline)
        self._wait_ray_replicas(deadline)

    def _connect_ray(self) -> None:
        """Join (or start) the run's Ray cluster when the config asks for it (only then is ray imported),
        and hand its address to every server through the config."""
        from nemo_gym.ray import RAY_START_LOCAL_KEY_NAME, ray_settings

        settings = ray_settings(self.cfg)
        if settings is None:
            return
        from nemo_gym.ray.cluster import RayConnectError, connect

        try:
            self.ray_connection = connect(settings, timeout_s=min(self.startup_timeout_s, 60.0))
        except RayConnectError as e:
            raise StartupError(str(e)) from None
        how = "started a local Ray cluster" if self.ray_connection.started_local else "joined the Ray cluster"
        self.echo(f"nemo_gym: {how} at {self.ray_connection.gcs_address}")
        OmegaConf.update(self.cfg, "ray_head_node_address", self.ray_connection.gcs_address, force_add=True)
        OmegaConf.update(self.cfg, RAY_START_LOCAL_KEY_NAME, False, force_add=True)

    # -- replicas ----------------------------------------------------------------------------------------
    def _num_replicas(self, inst: ServerInstance, block: Any) -> int:
        if block.get(REPLICAS_KEY_NAME) is not None:
            where = self.loaded.provenance.where(f"{inst.config_key}.{REPLICAS_KEY_NAME}")
            raise ConfigError(
                f"'{inst.config_key}.{REPLICAS_KEY_NAME}'{f' ({where})' if where else ''} is filled in by the "
                f"launcher; set '{NUM_REPLICAS_KEY_NAME}' (and ray_resources) instead."
            )
        value = block.get(NUM_REPLICAS_KEY_NAME)
        if value is None:
            return 1
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            where = self.loaded.provenance.where(f"{inst.config_key}.{NUM_REPLICAS_KEY_NAME}")
            raise ConfigError(
                f"'{inst.config_key}.{NUM_REPLICAS_KEY_NAME}'{f' ({where})' if where else ''} must be a "
                f"positive integer, got {value!r}."
            )
        return value

    def _placed_on_ray(self, inst: ServerInstance, block: Any) -> bool:
        """Whether the instance asks to run on Ray nodes (``ray_resources`` / ``ray_node_id``)."""
        keys = [k for k in ("ray_resources", "ray_node_id") if block.get(k) is not None]
        if not keys:
            return False
        if self.ray_connection is None:
            raise ConfigError(
                f"'{inst.config_key}.{keys[0]}' places '{inst.name}' on a Ray cluster, but the run has none: "
                "set ray_head_node_address (join a cluster) or +ray_start_local=true."
            )
        return True

    def _reserve_ray_replicas(self, inst: ServerInstance, block: Any, num_replicas: int) -> None:
        from nemo_gym.ray.replicas import RayPlacementError, RayReplicaGroup

        try:
            group = RayReplicaGroup(inst.name, OmegaConf.to_container(block, resolve=True), num_replicas)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.ray_groups[inst.name] = group
        try:
            infos = group.reserve(timeout_s=min(self.startup_timeout_s, 60.0))
        except RayPlacementError as e:
            raise StartupError(str(e)) from None
        replicas = [
            {
                "host": i["host"],
                "port": i["port"],
                "url": f"http://{i['host']}:{i['port']}",
                "node": i["node"],
            }
            for i in infos
        ]
        block["host"], block["port"] = replicas[0]["host"], replicas[0]["port"]
        block[REPLICAS_KEY_NAME] = replicas

    def _start_ray_replicas(self, run_scrubber: Scrubber, secret: str) -> None:
        if not self.ray_groups:  # ray is imported only when something runs on it
            return
        from nemo_gym.ray.replicas import script_spec

        secrets_env = {
            NEMO_GYM_SESSION_SECRET_ENV_VAR_NAME: secret,
            AUTH_TOKEN_ENV_VAR_NAME: self.auth_token or "",
            AUTH_DISABLED_ENV_VAR_NAME: "" if self.auth_enabled else "1",
            NEMO_GYM_SECRET_VALUES_ENV_VAR_NAME: json.dumps(self.env_secret_values),
        }
        for inst in self.instances:
            group = self.ray_groups.get(inst.name)
            if group is None:
                continue
            folder = find_server_dir(inst, self.loaded.root_dir)
            assert folder is not None
            block = OmegaConf.select(self.cfg, inst.config_key)
            script = folder / str(block.get("entrypoint") or "app.py")
            specs = []
            for index, info in enumerate(group.infos):
                config_yaml = self._config_yaml_for(inst.name, info["host"], info["port"], run_scrubber)
                identity = new_replica_identity(index)
                specs.append(
                    script_spec(
                        inst.name,
                        index,
                        identity,
                        self.loaded.root_dir,
                        script,
                        config_yaml,
                        self.startup_timeout_s,
                    )
                )
            group.start(specs, secrets_env)

    def _wait_ray_replicas(self, deadline: float) -> None:
        if not self.ray_groups:
            return
        from nemo_gym.ray.replicas import RayPlacementError

        for group in self.ray_groups.values():
            try:
                group.wait_started(deadline)
            except RayPlacementError as e:
                raise StartupError(str(e)) from None
            for info in group.infos:
                self.echo(
                    f"nemo_gym: replica {group.instance_name}[{group.infos.index(info)}] at "
                    f"http://{info['host']}:{info['port']} on Ray node {info['node']}"
                )

    def _check_explicit_ports_distinct(self) -> None:
        """Two entries of this config asking for the same explicit port is a config error naming both."""
        owners: dict[int, str] = {}
        if self.head_port:
            default = OmegaConf.select(self.cfg, f"{HEAD_SERVER_KEY_NAME}.port", default=None) is None
            owners[self.head_port] = (
                f"the head server ({HEAD_SERVER_KEY_NAME}.port{', default' if default else ''})"
            )
        for inst in self.instances:
            port = OmegaConf.select(self.cfg, f"{inst.config_key}.port", default=None)
            if not port:
                continue
            what = f"server '{inst.name}' ({inst.config_key}.port)"
            if int(port) in owners:
                raise ConfigError(
                    f"Port {int(port)} is set for both {owners[int(port)]} and {what}; "
                    "give each its own port (a server whose port is left unset gets a free one)."
                )
            owners[int(port)] = what

    def _publish_token(self) -> None:
        """Make the run token findable by this process's clients and, through a 0600 file, by the user's
        other processes on this machine; or warn loudly that authentication is off."""
        if self.auth_token is None:
            self.echo(
                "WARNING: server authentication is OFF for this run (+server_auth=false): any process that can "
                "reach these ports can call every server, verify fabricated trajectories and use the model "
                "server's API key. Never do this on a shared machine or off loopback."
            )
            return
        register_in_process(self._run_ports(), self.auth_token)
        try:
            self.token_file = write_token_file(self.head_port, self.auth_token)
        except OSError as e:
            self.echo(
                f"WARNING: could not write the run token file ({e}); clients in other processes need "
                f"{AUTH_TOKEN_ENV_VAR_NAME} set to reach this run."
            )

    def _run_ports(self) -> list[int]:
        ray_ports = [i["port"] for g in self.ray_groups.values() for i in g.infos]
        return [self.head_port] + [c.port for c in self.children] + ray_ports

    def _child_config_yaml(self, child: ChildServer, run_scrubber: Scrubber) -> str:
        """The config ``child`` receives: its own block whole (interpolations resolved, its own secrets
        included), every other server's block with secrets redacted (a judge's model name is readable,
        its API key is not), and the top-level values that are neither secret-looking nor from env.yaml.
        A replica's own block names its own address; every block lists the instance's ``replicas``."""
        return self._config_yaml_for(child.name, child.host, child.port, run_scrubber)

    def _config_yaml_for(self, name: str, host: str, port: int, run_scrubber: Scrubber) -> str:
        cfg = self.cfg
        out: dict[str, Any] = {}
        instance_keys = {inst.name for inst in self.instances}
        for key in cfg.keys():
            key = str(key)
            if key in instance_keys:
                continue
            where = self.loaded.provenance.where(key) or ""
            if is_secret_key(key) or where.startswith(ENV_YAML_FNAME + ":"):
                continue
            try:
                out[key] = run_scrubber.scrub_obj(_resolved(cfg, key))
            except Exception:  # a value only other servers interpolate may be unresolvable here: leave it out
                continue
        for other in self.instances:
            if other.name == name:
                continue
            impl = OmegaConf.select(cfg, other.config_key)
            address: dict[str, Any] = {"host": impl.get("host"), "port": impl.get("port")}
            if impl.get(REPLICAS_KEY_NAME) is not None:
                address[REPLICAS_KEY_NAME] = OmegaConf.to_container(impl[REPLICAS_KEY_NAME])
            try:
                block = redact_config(_resolved(cfg, other.name), run_scrubber)
                impl_block = block[other.server_type][other.impl]
                impl_block.update(address)
            except Exception:  # unresolvable: the address is all another server needs
                block = {other.server_type: {other.impl: address}}
            out[other.name] = block
        try:
            own = _resolved(cfg, name)
        except Exception as e:
            raise StartupError(f"Cannot resolve the config of server '{name}': {e}") from None
        inst = next(i for i in self.instances if i.name == name)
        own[inst.server_type][inst.impl].update({"host": host, "port": port})
        out[name] = own
        return yaml.safe_dump(out, sort_keys=False)

    def _head_port_busy_hint(self) -> str:
        """What to do when the head server's port is taken (the default one is not a free pick)."""
        explicit = OmegaConf.select(self.cfg, f"{HEAD_SERVER_KEY_NAME}.port", default=None) is not None
        who = ""
        try:  # another run's head server names itself, in its answer or in its 401 (it wants a token)
            r = httpx.get(f"http://{self.head_host}:{self.head_port}/", timeout=1.0, trust_env=False)
            body = r.json()
            name = body.get("name") if r.status_code == 200 else (body.get("error") or {}).get("server")
            if name == HEAD_SERVER_KEY_NAME:
                who = " Another ng_run's head server answers there (see ng_status); stop it, or run this one elsewhere."
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
        what = "the default head server port" if not explicit else "the head server port you set"
        return (
            f"Port {self.head_port} is {what} and another process is using it.{who} Choose a free port with "
            f"+{HEAD_SERVER_KEY_NAME}.port=<port> (+{HEAD_SERVER_KEY_NAME}.port=0 picks one and prints it), and "
            f"give ng_collect_rollouts, ng_status and trainers the same +{HEAD_SERVER_KEY_NAME}.port."
        )

    def _spawn(self, child: ChildServer, config_yaml: str, secret: str) -> None:
        assert child.sock is not None
        fd = child.sock.fileno()
        verdict_r, verdict_w = os.pipe()
        go_r, go_w = os.pipe()
        child.verdict_fd, child.go_fd = verdict_r, go_w
        env = dict(os.environ)
        root = str(self.loaded.root_dir)
        env.update(
            {
                NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME: config_yaml,
                NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME: child.name,
                NEMO_GYM_SESSION_SECRET_ENV_VAR_NAME: secret,
                NEMO_GYM_LISTEN_FD_ENV_VAR_NAME: str(fd),
                NEMO_GYM_PARENT_PID_ENV_VAR_NAME: str(os.getpid()),
                AUTH_TOKEN_ENV_VAR_NAME: self.auth_token or "",
                AUTH_DISABLED_ENV_VAR_NAME: "" if self.auth_enabled else "1",
                NEMO_GYM_VALIDATION_FDS_ENV_VAR_NAME: f"{verdict_w},{go_r}",
                NEMO_GYM_SECRET_VALUES_ENV_VAR_NAME: json.dumps(self.env_secret_values),
                REPLICA_ENV_VAR_NAME: child.identity or "",
                "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p),
            }
        )
        try:
            child.process = self._spawner.call(
                lambda: subprocess.Popen(
                    [child.python, str(child.script)],
                    cwd=root,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    pass_fds=(fd, verdict_w, go_r),
                    start_new_session=True,
                )
            )
        finally:
            # The child holds the socket and its pipe ends now; ours must go (the port dies with the
            # child, and its exit is seen as the end of its verdict pipe).
            os.close(verdict_w)
            os.close(go_r)
        child.sock.close()
        child.sock = None
        log_file: IO[str] | None = None
        if self.log_dir:
            suffix = "" if child.replica is None else f".{child.replica}"
            log_file = open(self.log_dir / f"{child.name}{suffix}.log", "a", buffering=1)
        child.reader = threading.Thread(
            target=self._pump, args=(child, log_file), name=f"log-{child.label}", daemon=True
        )
        child.reader.start()

    def _pump(self, child: ChildServer, log_file: IO[str] | None) -> None:
        assert child.process is not None and child.process.stdout is not None
        prefix = f"[{child.label}] "
        scrubber = process_scrubber()
        for raw in iter(child.process.stdout.readline, b""):
            line = scrubber.scrub(raw.decode(errors="replace").rstrip("\n"))
            child.tail.append(line)
            self._emit(prefix + line)
            if log_file is not None:
                log_file.write(line + "\n")
        if log_file is not None:
            log_file.close()

    def _wait_config_verdicts(self, deadline: float) -> None:
        """Collect every child's config verdict; raise ConfigError listing all problems, else let all go."""
        pending = {c.verdict_fd: c for c in self.children if c.verdict_fd is not None}
        silent: list[ChildServer] = []  # closed its pipe without a verdict: it exited (or never checks)
        # A selector (epoll where there is one), not select.select: a trainer process that starts servers
        # through RunHelper may hold more than 1,024 open files, and select() refuses descriptors >= 1024.
        selector = selectors.DefaultSelector()
        for fd in pending:
            selector.register(fd, selectors.EVENT_READ)
        try:
            self._read_verdicts(pending, silent, selector, deadline)
        finally:
            selector.close()
        problems = list(  # replicas of one instance report the same problems once
            dict.fromkeys(
                p
                for c in self.children
                if c.verdict and not c.verdict.get("ok")
                for p in self._problems_of(c)
            )
        )
        problems += [p for p in self._ray_config_problems(deadline) if p not in problems]
        if problems:
            raise ConfigError(
                f"The configuration of {'a server is' if len(problems) == 1 else 'the servers is'} not valid "
                f"({len(problems)} problem{'s' if len(problems) != 1 else ''}; no server was started):\n"
                + "\n".join(f"  - {p}" for p in problems)
            )
        for child in self.children:
            self._close_go(child, go=True)
        for group in self.ray_groups.values():
            group.go()

    def _ray_config_problems(self, deadline: float) -> list[str]:
        """The config problems Ray-placed replicas reported (their servers check their blocks on their
        nodes, as local ones do); replicas of one instance report the same problems once."""
        if not self.ray_groups:
            return []
        from nemo_gym.ray.replicas import RayPlacementError

        problems: list[str] = []
        for inst in self.instances:
            group = self.ray_groups.get(inst.name)
            if group is None:
                continue
            try:
                verdicts = group.wait_verdicts(deadline)
            except RayPlacementError as e:
                raise StartupError(str(e)) from None
            for verdict in verdicts:
                if verdict and not verdict.get("ok"):
                    problems += [p for p in self._verdict_problems(inst, verdict) if p not in problems]
        return problems

    def _read_verdicts(
        self,
        pending: dict[int, ChildServer],
        silent: list[ChildServer],
        selector: selectors.BaseSelector,
        deadline: float,
    ) -> None:
        while pending:
            if self.stop_event.is_set():
                raise StartupError("Start-up interrupted.")
            readable = [key.fd for key, _ in selector.select(0.05)]
            for fd in readable:
                child = pending[fd]
                data = os.read(fd, 65536)
                child.verdict_buf += data
                if b"\n" in child.verdict_buf or not data:
                    line = child.verdict_buf.partition(b"\n")[0]
                    try:
                        child.verdict = json.loads(line) if line else None
                    except ValueError:
                        child.verdict = None
                    if child.verdict is None:
                        silent.append(child)
                    selector.unregister(fd)
                    os.close(fd)
                    child.verdict_fd = None
                    del pending[fd]
            for child in [*silent, *pending.values()]:
                if child.process is not None and child.process.poll() is not None:
                    raise StartupError(self.describe_exit(child, during_startup=True))
            if pending and time.monotonic() > deadline:
                waiting = list(pending.values())
                details = "\n".join(self._tail_text(c) for c in waiting)
                raise StartupError(
                    f"Timed out after {self.startup_timeout_s:g} s waiting for "
                    f"{', '.join(c.name for c in waiting)} to load and check its config "
                    f"(raise +startup_timeout_s=... if it is just slow).\n{details}"
                )

    def _problems_of(self, child: ChildServer) -> list[str]:
        """One line per problem a child reported, with the file:line of the key and "did you mean"."""
        assert child.verdict is not None
        return self._verdict_problems(child.instance, child.verdict)

    def _verdict_problems(self, instance: ServerInstance, verdict: dict[str, Any]) -> list[str]:
        key = instance.config_key
        out = []
        for p in verdict.get("problems") or [{"loc": "", "msg": "invalid config"}]:
            loc = str(p.get("loc") or "")
            dotted = f"{key}.{loc}" if loc and not loc.startswith("[") else key + loc
            where = self.loaded.provenance.where(dotted)
            at = f" ({where})" if where else ""
            if p.get("type") == "extra_forbidden":
                suggest = p.get("suggest") or []
                known = p.get("known") or []
                hint = (
                    " Did you mean " + " or ".join(f"'{s}'" for s in suggest) + "?"
                    if suggest
                    else (f" Known keys: {', '.join(known)}." if known else "")
                )
                out.append(
                    f"'{dotted}'{at}: {instance.folder} has no setting '{loc.rpartition('.')[2]}'.{hint}"
                )
            else:
                out.append(f"'{dotted}'{at}: {p.get('msg')}")
        return out

    @staticmethod
    def _close_go(child: ChildServer, go: bool) -> None:
        if child.go_fd is None:
            return
        try:
            if go:
                os.write(child.go_fd, b"g")
        except OSError:  # the child is gone (or never listens): it is watched like any other
            pass
        finally:
            os.close(child.go_fd)
            child.go_fd = None

    def _wait_ready(self, deadline: float) -> None:
        with httpx.Client(timeout=2.0, trust_env=False, headers=auth_headers(self.auth_token)) as client:
            while True:
                if self.stop_event.is_set():
                    raise StartupError("Start-up interrupted.")
                dead = self.dead_server()
                if dead is not None:
                    raise StartupError(self.describe_exit(dead, during_startup=True))
                for child in self.children:
                    if child.ready:
                        continue
                    try:
                        if client.get(child.url + "/").status_code == 200:
                            child.ready = True
                    except httpx.HTTPError:
                        pass
                if all(c.ready for c in self.children):
                    return
                if time.monotonic() > deadline:
                    waiting = [c for c in self.children if not c.ready]
                    details = "\n".join(self._tail_text(c) for c in waiting)
                    raise StartupError(
                        f"Timed out after {self.startup_timeout_s:g} s waiting for "
                        f"{', '.join(c.name for c in waiting)} to answer GET / "
                        f"(raise +startup_timeout_s=... if it is just slow).\n{details}"
                    )
                time.sleep(0.05)

    # -- head server -----------------------------------------------------------------------------------
    def _start_head_server(self, sock: socket.socket) -> None:
        import uvicorn

        from nemo_gym.head_server import build_head_app

        app = build_head_app(self, token=self.auth_token, auth_disabled=not self.auth_enabled)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        self._head_server = uvicorn.Server(config)
        self._head_thread = threading.Thread(
            target=self._head_server.run, kwargs={"sockets": [sock]}, name="head-server", daemon=True
        )
        self._head_thread.start()
        deadline = time.monotonic() + 10
        while not self._head_server.started and time.monotonic() < deadline and self._head_thread.is_alive():
            time.sleep(0.01)
        if not self._head_server.started:
            raise StartupError(f"The head server did not start on {self.head_host}:{self.head_port}.")

    def server_instances_info(self) -> list[dict[str, Any]]:
        """One row per server process (name, type, impl, host, port, url, pid, alive; a replica also
        ``replica`` and ``node``): what ``/server_instances`` serves. Replicas on Ray are asked for their
        status (bounded), so call this off an event loop."""
        rows = []
        for c in self.children:
            row = {
                "name": c.name,
                "server_type": c.instance.server_type,
                "impl": c.instance.impl,
                "host": c.host,
                "port": c.port,
                "url": c.url,
                "pid": c.process.pid if c.process else None,
                "alive": c.process is not None and c.process.poll() is None,
            }
            if c.replica is not None:
                row.update({"replica": c.replica, "node": None})
            rows.append(row)
        for inst in self.instances:
            group = self.ray_groups.get(inst.name)
            if group is None or not group.infos:
                continue
            for index, status in enumerate(group.statuses()):
                rows.append(
                    {
                        "name": inst.name,
                        "server_type": inst.server_type,
                        "impl": inst.impl,
                        "host": status.get("host"),
                        "port": status.get("port"),
                        "url": f"http://{status.get('host')}:{status.get('port')}",
                        "pid": status.get("pid"),
                        "alive": bool(status.get("alive")),
                        "replica": index,
                        "node": status.get("node"),
                        "restarts": status.get("restarts", 0),
                    }
                )
        return rows

    def num_servers(self) -> int:
        """Server processes of the run: local children and replicas placed on Ray nodes."""
        return len(self.children) + sum(len(g.infos) for g in self.ray_groups.values())

    # -- watching ---------------------------------------------------------------------------------------
    def dead_server(self) -> ChildServer | DeadRayInstance | None:
        """The first child that has exited since start, if any; a dead replica only once every replica
        of its instance on this machine is dead (clients route around the others). An instance placed
        on Ray is dead once every replica is (restarts used up, actor or node lost); its actors are
        asked at most once per :data:`RAY_DEAD_CHECK_S`."""
        for child in self.children:
            if child.process is not None and child.process.poll() is not None:
                if child.replica is not None and any(
                    c.name == child.name and c.process is not None and c.process.poll() is None
                    for c in self.children
                ):
                    continue
                return child
        if self.ray_groups and not self._shut_down:
            if self._ray_dead is None and time.monotonic() >= self._ray_checked_at + RAY_DEAD_CHECK_S:
                self._ray_checked_at = time.monotonic()
                for name, group in self.ray_groups.items():
                    statuses = group.all_dead()
                    if statuses is not None:
                        self._ray_dead = DeadRayInstance(name, statuses)
                        break
            return self._ray_dead
        return None

    def _tail_text(self, child: ChildServer) -> str:
        if child.reader is not None:
            child.reader.join(timeout=0.5)
        lines = list(child.tail) or ["(no output)"]
        return f"--- last log lines of {child.label} ---\n" + "\n".join(lines)

    def describe_exit(self, child: ChildServer | DeadRayInstance, during_startup: bool = False) -> str:
        """How ``child`` exited, with its last log lines (for error messages)."""
        if isinstance(child, DeadRayInstance):
            return child.describe()
        assert child.process is not None
        code = child.process.returncode
        how = (
            f"was killed by signal {-code} ({signal.Signals(-code).name})"
            if code < 0
            else f"exited with code {code}"
        )
        when = " during start-up" if during_startup else ""
        return f"Server '{child.label}' ({child.instance.folder}, pid {child.process.pid}) {how}{when}.\n{self._tail_text(child)}"

    # -- stop -------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every child (SIGTERM to its group, SIGKILL after the bound) and the head server; idempotent."""
        if self._shut_down:
            return
        self._shut_down = True
        alive = [c for c in self.children if c.process is not None]
        deadline = time.monotonic() + self.shutdown_timeout_s
        # Agents stop first (for at most a second of the bound), so they do not report failed calls
        # to servers that are already stopping; then everything else.
        agents = [c for c in alive if c.instance.server_type == "responses_api_agents"]
        others = [c for c in alive if c.instance.server_type != "responses_api_agents"]
        for stage, stage_deadline in ((agents, min(deadline, time.monotonic() + 1.0)), (others, deadline)):
            for c in stage:
                _signal_group(c.process.pid, signal.SIGTERM)
            for c in stage:
                try:
                    c.process.wait(timeout=max(0.0, stage_deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for c in alive:
            # Kill the whole group even when the leader exited: nothing of ours may outlive the run.
            _signal_group(c.process.pid, signal.SIGKILL)
            try:
                c.process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        for c in self.children:
            if c.sock is not None:
                c.sock.close()
                c.sock = None
            self._close_go(c, go=False)
            if c.verdict_fd is not None:
                os.close(c.verdict_fd)
                c.verdict_fd = None
        if self._head_server is not None:
            self._head_server.should_exit = True
            if self._head_thread is not None:
                self._head_thread.join(timeout=3)
        if self._head_sock is not None:
            self._head_sock.close()
            self._head_sock = None
        for group in self.ray_groups.values():
            group.stop()
        if self.ray_connection is not None:
            self.ray_connection.close()
        if self.auth_token is not None:
            register_in_process(self._run_ports(), None)
            if self.token_file is not None:
                remove_token_file(self.head_port, self.auth_token)
        self._spawner.stop()


def _resolved(cfg: Any, key: str) -> Any:
    """The value of top-level ``key`` with every interpolation resolved (against the whole config)."""
    node = cfg._get_node(key)
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else cfg[key]


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def format_instances_table(rows: list[dict[str, Any]]) -> str:
    """A plain-text table of server rows (name, type/impl, url, pid)."""
    headers = ["name", "type/impl", "url", "pid"]
    data = [
        [
            r["name"] + (f"[{r['replica']}]" if r.get("replica") is not None else ""),
            f"{r['server_type']}/{r['impl']}",
            r["url"],
            str(r["pid"]),
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(d[i]) for d in data)) if data else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.ljust(w) for v, w in zip(d, widths, strict=True)) for d in data]
    return "\n".join(out)


__all__ = ["ConfigError", "ServerSupervisor", "StartupError", "format_instances_table"]
