"""Server replicas placed on Ray cluster nodes: one small actor per replica starts and watches its process.

Contract
--------
* Imported only when a config uses Ray and an instance block has ``ray_resources`` or ``ray_node_id``
  (see :mod:`nemo_gym.run.supervision.ray_groups`); it imports ray.
* :class:`RayReplicaGroup` is one instance's replicas. ``reserve()`` creates one :class:`ReplicaActor`
  per replica, placed by the block's ``ray_resources`` (``{CPU: 1, node_b: 1}``, the same for every
  replica, spread over nodes; or a list with one dict per replica) or ``ray_node_id`` (node
  affinity), and each actor reserves a listening socket on its node: on the block's ``host`` unless it
  is a loopback address, else on every interface, advertising the node's IP (a routable address).
  Placement that cannot be satisfied within the bound raises :class:`RayPlacementError` naming the
  replica and what it asked for.
* ``start()`` hands each actor the replica's config and the run's secrets (run token, cookie secret,
  secret values). The secrets travel sealed: each actor makes an X25519 key pair, the launcher
  encrypts for it (X25519 + HKDF-SHA256 + AES-GCM), so they are never in Ray's object store, GCS or
  logs in plain text. The actor spawns the server process (it listens on the actor's socket, dies
  with the actor), which checks its config block and reports the verdict over a pipe, exactly as a
  local server does; ``wait_verdicts()`` hands them to the launcher, which lets every server go
  (``go()``) only when all configs, local and Ray-placed, are valid. Then each actor waits until
  ``GET /`` answers with the token (bounded), and reports url, node id and pid (``wait_started()``);
  a server that does not come up raises with its last log lines.
* ``all_dead()`` says when every replica of the instance is dead (restarts used up, actor or node
  lost): the launcher then reports the instance dead, like a local server that exited.
* A replica that exits is restarted on the same socket (so its address stays valid; connections
  wait in the backlog meanwhile) as a new boot, at most ``ray_max_restarts`` times; then it is
  reported dead. Sessions of the earlier boot are refused by the new one (:mod:`nemo_gym.client.replicas`).
* ``stop()`` stops every server process (SIGTERM to its group, then SIGKILL) and kills the actors.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import ray
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from nemo_gym.auth import AUTH_TOKEN_ENV_VAR_NAME
from nemo_gym.client.replicas import REPLICA_ENV_VAR_NAME
from nemo_gym.config.keys import (
    NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME,
    NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME,
    NEMO_GYM_LISTEN_FD_ENV_VAR_NAME,
    NEMO_GYM_PARENT_PID_ENV_VAR_NAME,
    NEMO_GYM_VALIDATION_FDS_ENV_VAR_NAME,
)
from nemo_gym.redaction import NEMO_GYM_SECRET_VALUES_ENV_VAR_NAME, child_environ
from nemo_gym.run.supervision.children import LOG_TAIL_LINES

RESTART_DELAY_S = 0.5
HEALTH_POLL_S = 0.1
STOP_GRACE_S = 3.0
_LOOPBACK = ("127.0.0.1", "localhost", "::1", "")


class RayPlacementError(RuntimeError):
    """A replica could not be placed or started on the cluster; the message names it."""


# ------------------------------------------------------------------------------------------------
# Sealing the run's secrets for one actor.


def _key(shared: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"nemo-gym replica secrets").derive(
        shared
    )


def seal(recipient_public_key: bytes, plaintext: bytes) -> tuple[bytes, bytes, bytes]:
    """(ephemeral public key, nonce, ciphertext) that only the holder of the recipient's key can open."""
    ephemeral = X25519PrivateKey.generate()
    shared = ephemeral.exchange(X25519PublicKey.from_public_bytes(recipient_public_key))
    nonce = os.urandom(12)
    sealed = AESGCM(_key(shared)).encrypt(nonce, plaintext, None)
    return ephemeral.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw), nonce, sealed


def unseal(private_key: X25519PrivateKey, ephemeral_public: bytes, nonce: bytes, sealed: bytes) -> bytes:
    shared = private_key.exchange(X25519PublicKey.from_public_bytes(ephemeral_public))
    return AESGCM(_key(shared)).decrypt(nonce, sealed, None)


# ------------------------------------------------------------------------------------------------
# The actor (runs on the replica's node).


class ReplicaActor:
    """Starts, health-checks and restarts one replica's server process on this node."""

    def __init__(self, label: str, bind_host: str, max_restarts: int) -> None:
        # One long-lived thread forks (the parent-death signal follows the forking thread).
        from nemo_gym.run.supervision.children import SpawnerThread

        self.label = label
        self.bind_host = bind_host
        self.max_restarts = max_restarts
        self._private_key = X25519PrivateKey.generate()
        self._spawner = SpawnerThread()
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen | None = None
        self._tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
        self._lock = threading.Lock()
        self._stopping = False
        self.restarts = 0
        self.dead = False
        self.info: dict[str, Any] = {}
        self._spec: dict[str, Any] = {}
        self._env: dict[str, str] = {}
        self._scrub: Any = None
        self._go_fd: int | None = None

    def public_key(self) -> bytes:
        return self._private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def reserve(self) -> dict[str, Any]:
        """Open the replica's listening socket on this node; its address, node id and this actor's pid."""
        from nemo_gym.config.ports import reserve_listening_socket

        loopback = self.bind_host in _LOOPBACK
        bind = "0.0.0.0" if loopback else self.bind_host
        self._sock = reserve_listening_socket(bind, None, f"replica {self.label}")
        host = ray.util.get_node_ip_address() if loopback else self.bind_host
        self.info = {
            "host": host,
            "port": self._sock.getsockname()[1],
            "node": ray.get_runtime_context().get_node_id(),
            "actor_pid": os.getpid(),
        }
        return dict(self.info)

    def start(
        self, spec: dict[str, Any], ephemeral_public: bytes, nonce: bytes, sealed: bytes
    ) -> dict[str, Any] | None:
        """Spawn the server (``spec``: script, root, config, identity, timeouts) with the sealed secrets
        and return its config verdict (``{"ok", "problems"}``, as local servers report theirs to the
        launcher) once it has checked its config; it then waits for :meth:`go`. Raises with its last
        log lines if it exits or stays silent past the start-up bound."""
        from nemo_gym.redaction import Scrubber

        opened = json.loads(unseal(self._private_key, ephemeral_public, nonce, sealed))
        secrets_env = opened["env"]
        self._spec = {**spec, "config_yaml": opened["config_yaml"]}
        self._env = secrets_env
        values = json.loads(secrets_env.get(NEMO_GYM_SECRET_VALUES_ENV_VAR_NAME, "[]"))
        token = secrets_env.get(AUTH_TOKEN_ENV_VAR_NAME) or ""
        self._scrub = Scrubber(set(values) | ({token} if token else set())).scrub
        verdict_r, go_w = self._spawn(spec["identity"], validate=True)
        self._go_fd = go_w
        return self._read_verdict(verdict_r, float(spec["startup_timeout_s"]))

    def go(self, proceed: bool = True) -> dict[str, Any]:
        """After every server's config was found valid: let this one serve, and return once it answers
        (then watch and restart it). ``proceed=False`` stops it instead (the run is not starting)."""
        fd, self._go_fd = self._go_fd, None
        if fd is not None:
            try:
                if proceed:
                    os.write(fd, b"g")
            except OSError:  # it exited: seen below
                pass
            finally:
                os.close(fd)
        if not proceed:
            return self.status()
        self._wait_healthy(float(self._spec["startup_timeout_s"]))
        threading.Thread(target=self._watch, name=f"watch-{self.label}", daemon=True).start()
        return self.status()

    def _read_verdict(self, fd: int, bound_s: float) -> dict[str, Any] | None:
        import select

        buf = b""
        deadline = time.monotonic() + bound_s
        try:
            while b"\n" not in buf:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RayPlacementError(
                        f"Replica {self.label} did not check its config within {bound_s:g} s.\n"
                        + self._tail_text()
                    )
                if select.select([fd], [], [], min(left, 0.5))[0]:
                    data = os.read(fd, 65536)
                    if not data:
                        break
                    buf += data
        finally:
            os.close(fd)
        line = buf.partition(b"\n")[0]
        try:
            verdict = json.loads(line) if line else None
        except ValueError:
            verdict = None
        if verdict is None:
            proc = self._proc
            if proc is not None:
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            code = None if proc is None else proc.poll()
            raise RayPlacementError(
                f"Replica {self.label} exited with code {code} during start-up.\n" + self._tail_text()
            )
        return verdict

    def _spawn(self, identity: str, validate: bool = False) -> tuple[int, int] | None:
        """Start the server; with ``validate``, with the launcher's config-verdict pipes, whose ends
        (verdict read end, go write end) are returned."""
        assert self._sock is not None
        spec = self._spec
        fd = self._sock.fileno()
        pipes: tuple[int, int] | None = None
        pass_fds: tuple[int, ...] = (fd,)
        if validate:
            verdict_r, verdict_w = os.pipe()
            go_r, go_w = os.pipe()
            pipes = (verdict_r, go_w)
            pass_fds = (fd, verdict_w, go_r)
        # The node's environment without its secret-looking variables (as a local child's).
        env = child_environ(os.environ, spec.get("pass_env") or ())
        root = spec["root"]
        env.update(self._env)
        env.update(
            {
                NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME: spec["config_yaml"],
                NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME: spec["instance"],
                NEMO_GYM_LISTEN_FD_ENV_VAR_NAME: str(fd),
                NEMO_GYM_PARENT_PID_ENV_VAR_NAME: str(os.getpid()),
                REPLICA_ENV_VAR_NAME: identity,
                "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p),
            }
        )
        if validate:  # the first boot reports its config verdict and waits for go (see start/go)
            env[NEMO_GYM_VALIDATION_FDS_ENV_VAR_NAME] = f"{pass_fds[1]},{pass_fds[2]}"
        else:  # a restart: its config was checked at the first boot
            env.pop(NEMO_GYM_VALIDATION_FDS_ENV_VAR_NAME, None)
        self.info["identity"] = identity
        try:
            self._proc = self._spawner.call(
                lambda: subprocess.Popen(
                    [sys.executable, spec["script"]],
                    cwd=root,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    pass_fds=pass_fds,
                    start_new_session=True,
                )
            )
        finally:
            for child_end in pass_fds[1:]:  # the child holds them now
                os.close(child_end)
        self.info["pid"] = self._proc.pid
        threading.Thread(target=self._pump, args=(self._proc,), daemon=True).start()
        return pipes

    def _pump(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for raw in iter(proc.stdout.readline, b""):
            line = self._scrub(raw.decode(errors="replace").rstrip("\n"))
            self._tail.append(line)
            print(f"[{self.label}] {line}", flush=True)  # the node's Ray worker log

    def _wait_healthy(self, bound_s: float) -> None:
        import httpx

        token = self._env.get(AUTH_TOKEN_ENV_VAR_NAME)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        url = f"http://{self.info['host']}:{self.info['port']}/"
        deadline = time.monotonic() + bound_s
        with httpx.Client(timeout=2.0, trust_env=False, headers=headers) as client:
            while True:
                proc = self._proc
                if proc is None or proc.poll() is not None:
                    code = None if proc is None else proc.returncode
                    raise RayPlacementError(
                        f"Replica {self.label} exited with code {code} during start-up.\n" + self._tail_text()
                    )
                try:
                    if client.get(url).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RayPlacementError(
                        f"Replica {self.label} did not answer GET {url} within {bound_s:g} s.\n"
                        + self._tail_text()
                    )
                time.sleep(HEALTH_POLL_S)

    def _tail_text(self) -> str:
        time.sleep(0.2)  # let the pump read the last lines
        return f"--- last log lines of {self.label} ---\n" + ("\n".join(self._tail) or "(no output)")

    def _watch(self) -> None:
        """Restart the server when it exits, at most ``max_restarts`` times; then report it dead."""
        from nemo_gym.client.replicas import new_replica_identity

        while True:
            proc = self._proc
            if proc is None:
                return
            code = proc.wait()
            with self._lock:
                if self._stopping:
                    return
                if self.restarts >= self.max_restarts:
                    self.dead = True
                    print(f"[{self.label}] exited with code {code}; no restarts left: dead", flush=True)
                    return
                self.restarts += 1
            print(
                f"[{self.label}] exited with code {code}; restart {self.restarts}/{self.max_restarts}",
                flush=True,
            )
            time.sleep(RESTART_DELAY_S)
            index = int(str(self.info.get("identity", "0")).partition(".")[0])
            try:
                self._spawn(new_replica_identity(index))
                self._wait_healthy(float(self._spec["startup_timeout_s"]))
            except Exception as e:  # the next loop sees the exit (or counts it as one)
                print(f"[{self.label}] restart failed: {e}", flush=True)
                if self._proc is not None and self._proc.poll() is None:
                    _kill_group(self._proc, signal.SIGKILL)

    def status(self) -> dict[str, Any]:
        proc = self._proc
        return {
            **self.info,
            "alive": proc is not None and proc.poll() is None and not self.dead,
            "restarts": self.restarts,
            "dead": self.dead,
        }

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            _kill_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        if proc is not None:
            _kill_group(proc, signal.SIGKILL)
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ------------------------------------------------------------------------------------------------
# The launcher's side.


def _actor_options(resources: dict[str, float] | None, node_id: str | None, spread: bool) -> dict[str, Any]:
    opts: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 4, "max_restarts": 0}
    custom: dict[str, float] = {}
    for key, amount in (resources or {}).items():
        if key == "CPU":
            opts["num_cpus"] = amount
        elif key == "GPU":
            opts["num_gpus"] = amount
        elif key == "memory":
            opts["memory"] = amount
        else:
            custom[key] = amount
    if custom:
        opts["resources"] = custom
    if node_id:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    elif spread:
        opts["scheduling_strategy"] = "SPREAD"
    return opts


class RayReplicaGroup:
    """The replicas of one server instance on the cluster (see the module docstring)."""

    def __init__(self, instance_name: str, block: Any, num_replicas: int) -> None:
        self.instance_name = instance_name
        self.num_replicas = num_replicas
        resources = block.get("ray_resources")
        if resources is not None and not isinstance(resources, dict):
            resources = [dict(r) for r in resources]
            if len(resources) != num_replicas:
                raise ValueError(
                    f"'ray_resources' of '{instance_name}' lists {len(resources)} entries for "
                    f"num_replicas={num_replicas}: give one dict for all replicas or one per replica."
                )
        self.per_replica: list[dict[str, float] | None] = (
            resources
            if isinstance(resources, list)
            else [dict(resources) if resources else None] * num_replicas
        )
        self.node_id = block.get("ray_node_id")
        self.bind_host = str(block.get("host") or "127.0.0.1")
        self.max_restarts = int(block.get("ray_max_restarts", 3))
        self.actors: list[Any] = []
        self.infos: list[dict[str, Any]] = []
        self._starts: list[Any] = []
        self._verdicts: list[Any] = []

    def label(self, index: int) -> str:
        return f"{self.instance_name}[{index}]"

    def reserve(self, timeout_s: float) -> list[dict[str, Any]]:
        """Place one actor per replica and open its socket; [{host, port, node, actor_pid}] per replica."""
        remote_cls = ray.remote(ReplicaActor)
        for i in range(self.num_replicas):
            opts = _actor_options(
                self.per_replica[i], self.node_id, spread=not isinstance(self.per_replica, list)
            )
            self.actors.append(
                remote_cls.options(**opts).remote(self.label(i), self.bind_host, self.max_restarts)
            )
        refs = [a.reserve.remote() for a in self.actors]
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if pending:
            i = refs.index(pending[0])
            asked = self.per_replica[i] or ({"node": self.node_id} if self.node_id else {})
            raise RayPlacementError(
                f"Could not place replica {self.label(i)} (ray_resources/ray_node_id: {asked}) on the Ray cluster "
                f"within {timeout_s:g} s: no node has those resources free. Cluster resources: "
                f"{ray.available_resources()}"
            )
        self.infos = ray.get(refs)
        return self.infos

    def start(self, specs: list[dict[str, Any]], secrets_env: dict[str, str]) -> None:
        """Start every replica's server (non-blocking): each checks its config and waits for go
        (:meth:`wait_verdicts`, :meth:`go`, :meth:`wait_started`). Each spec's ``config_yaml`` (it may
        hold the server's own secrets) travels sealed with ``secrets_env``."""
        keys = ray.get([a.public_key.remote() for a in self.actors], timeout=60)
        self._verdicts = []
        for actor, key, spec in zip(self.actors, keys, specs, strict=True):
            spec = dict(spec)
            plaintext = json.dumps({"env": secrets_env, "config_yaml": spec.pop("config_yaml")}).encode()
            self._verdicts.append(actor.start.remote(spec, *seal(key, plaintext)))

    def _get(self, refs: list[Any], deadline: float, what: str) -> list[Any]:
        try:
            return ray.get(refs, timeout=max(1.0, deadline - time.monotonic()))
        except ray.exceptions.GetTimeoutError:
            raise RayPlacementError(f"Replicas of '{self.instance_name}' did not {what} in time.") from None
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if getattr(e, "cause", None) is not None else e
            raise RayPlacementError(str(cause)) from None
        except ray.exceptions.RayError as e:  # an actor or its node died
            raise RayPlacementError(
                f"Replicas of '{self.instance_name}' could not {what}: {type(e).__name__}: {e}"
            ) from None

    def wait_verdicts(self, deadline: float) -> list[dict[str, Any] | None]:
        """Each replica's config verdict (``{"ok", "problems"}``) once its server checked its config."""
        return self._get(self._verdicts, deadline, "check their config")

    def go(self, proceed: bool = True) -> None:
        """Let every replica serve (non-blocking; :meth:`wait_started` waits), or stop them."""
        self._starts = [a.go.remote(proceed) for a in self.actors]

    def wait_started(self, deadline: float) -> None:
        statuses = self._get(self._starts, deadline, "start")
        for info, status in zip(self.infos, statuses, strict=True):
            info.update(status)

    def all_dead(self, timeout_s: float = 2.0) -> list[dict[str, Any]] | None:
        """The replicas' statuses when every one is dead (restarts used up, or its actor or node
        lost), else None."""
        if not self.infos:
            return None
        statuses = self.statuses(timeout_s)
        return statuses if all(s.get("dead") for s in statuses) else None

    def statuses(self, timeout_s: float = 2.0) -> list[dict[str, Any]]:
        """Each replica's live status (url, node, pid, alive, restarts); a lost actor reads as dead."""
        out = []
        for info, actor in zip(self.infos, self.actors, strict=True):
            try:
                out.append(ray.get(actor.status.remote(), timeout=timeout_s))
            except Exception:  # the actor (or its node) is gone
                out.append({**info, "alive": False, "dead": True})
        return out

    def stop(self) -> None:
        refs = []
        for actor in self.actors:
            try:
                refs.append(actor.stop.remote())
            except Exception:
                pass
        if refs:
            try:
                ray.wait(refs, num_returns=len(refs), timeout=STOP_GRACE_S + 5)
            except Exception:
                pass
        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:
                pass
        self.actors = []


def script_spec(
    instance_name: str,
    index: int,
    identity: str,
    root: Path,
    script: Path,
    config_yaml: str,
    startup_timeout_s: float,
    pass_env: list[str] | None = None,
) -> dict[str, Any]:
    """What :meth:`ReplicaActor.start` needs besides the secrets. ``pass_env``: the node's environment
    variables the server may inherit although their names look secret (its block's ``pass_env``)."""
    return {
        "instance": instance_name,
        "identity": identity,
        "root": str(root),
        "script": str(script),
        "config_yaml": config_yaml,
        "startup_timeout_s": startup_timeout_s,
        "pass_env": list(pass_env or []),
    }


__all__ = ["RayPlacementError", "RayReplicaGroup", "ReplicaActor", "script_spec", "seal", "unseal"]
