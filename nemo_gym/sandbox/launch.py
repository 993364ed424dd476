"""Launching one sandboxed process: the cgroup-joining, rlimit-setting launcher, and reading its output.

Contract
--------
* :func:`_launcher_args` is the argv prefix that joins the run's cgroups, sets the rlimits (CPU time soft
  and hard, file size, open files, no core files; address space / process count only where no cgroup
  limits them) and execs the rest: one dash (:data:`DASH`) when present, else ``/bin/sh`` plus util-linux
  ``prlimit``. If it cannot join or limit, it exits :data:`_JOIN_FAILED` before the program runs.
* :func:`_dash_ulimits` and :func:`_sh_quote` are the shell pieces (also used by pre-started sandboxes).
* :func:`_read_capped` reads a stream up to a cap (calling ``overflow`` once past it);
  :func:`_parse_status` reads bwrap's ``--json-status-fd`` stream (concatenated JSON objects) into one
  dict of its integer fields, ignoring anything unparsable.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from collections.abc import Callable

from nemo_gym.sandbox.spec import SandboxResources

_JOIN_FAILED = 121  # exit code of the launching shell when it cannot join the cgroups or set a limit
_READ_CHUNK = 1 << 16


DASH = "/bin/dash"


def _launcher_args(
    limits: SandboxResources, procs_files: list[str], *, memory_by_cgroup: bool, pids_by_cgroup: bool
) -> list[str]:
    """argv prefix that joins the run's cgroups, sets the rlimits, then execs the rest.

    With dash (Debian's /bin/sh) one shell does both (``ulimit``: -f counts 512-byte blocks, -v KiB);
    elsewhere the shell joins the cgroups and util-linux ``prlimit`` sets the limits (one exec more)."""
    cpu = max(1, math.ceil(limits.cpu_time_s))
    join = f'for f in {" ".join(_sh_quote(p) for p in procs_files)}; do echo $$ > "$f" || exit {_JOIN_FAILED}; done; '
    if not procs_files:
        join = ""
    if os.path.exists(DASH):
        ulimits = _dash_ulimits(limits, memory_by_cgroup=memory_by_cgroup, pids_by_cgroup=pids_by_cgroup)
        script = join + " && ".join(ulimits) + f' || exit {_JOIN_FAILED}; exec "$@"'
        return [DASH, "-c", script, "sandbox-launch"]
    prlimit = [
        "prlimit",
        f"--cpu={cpu}:{cpu + 1}",
        f"--fsize={limits.file_size_bytes}",
        f"--nofile={limits.open_files}",
        "--core=0",
    ]
    if not memory_by_cgroup and limits.memory_mib is not None:
        prlimit.append(f"--as={limits.memory_mib << 20}")
    if not pids_by_cgroup:
        prlimit.append(f"--nproc={limits.processes}")
    return ["/bin/sh", "-c", join + 'exec "$@"', "sandbox-launch", *prlimit, "--"]


def _dash_ulimits(limits: SandboxResources, *, memory_by_cgroup: bool, pids_by_cgroup: bool) -> list[str]:
    """dash ``ulimit`` commands for the rlimits (-f counts 512-byte blocks, -v KiB)."""
    cpu = max(1, math.ceil(limits.cpu_time_s))
    ulimits = [
        f"ulimit -S -t {cpu}",
        f"ulimit -H -t {cpu + 1}",
        f"ulimit -f {-(-limits.file_size_bytes // 512)}",
        f"ulimit -n {limits.open_files}",
        "ulimit -c 0",
    ]
    if not memory_by_cgroup and limits.memory_mib is not None:
        ulimits.append(f"ulimit -v {limits.memory_mib << 10}")
    if not pids_by_cgroup:
        ulimits.append(f"ulimit -p {limits.processes}")
    return ulimits


def _sh_quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


async def _read_capped(
    stream: asyncio.StreamReader, cap: int, overflow: Callable[[], None]
) -> tuple[bytes, bool]:
    buf = bytearray()
    while True:
        chunk = await stream.read(_READ_CHUNK)
        if not chunk:
            return bytes(buf), False
        room = cap - len(buf)
        if len(chunk) > room:
            buf += chunk[:room]
            overflow()
            return bytes(buf), True
        buf += chunk


def _parse_status(raw: bytes) -> dict[str, int]:
    out: dict[str, int] = {}
    text = raw.decode(errors="replace")
    decoder, pos = json.JSONDecoder(), 0
    while pos < len(text):
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            break
        try:
            doc, pos = decoder.raw_decode(text, pos)
        except ValueError:
            break
        if isinstance(doc, dict):
            out.update({k: v for k, v in doc.items() if isinstance(v, int)})
    return out
