"""A session's workspace changes as one tar (a changeset), and applying a changeset to another session.

What moves a workspace from one sandbox to another machine or server: harness_agent runs a harness in a
session of its own, started on a task's workspace, and sends what it changed to the environment, which
applies it to a fresh session on the same workspace before its hidden tests run
(``resources_servers/workspace_tasks``).

Contract
--------
* :func:`pack_upper` packs a session's overlayfs upper dir (everything the session wrote on top of the
  layer it started from) into a POSIX (pax) tar, in name order, parents before their entries: directories,
  regular files (mode and mtime kept; set-id bits dropped), symlinks (their target as written). A deletion
  (an overlay whiteout) is a member whose pax header ``NEMO_GYM.whiteout`` is ``1``; a directory that
  replaced one of the layer (an opaque dir) carries ``NEMO_GYM.opaque`` ``1``: the upper dir's marks
  read as the session's mount makes them (root: ``trusted.overlay.*``; a user namespace: ``user.overlay.*``;
  fuse-overlayfs: its ``.wh.`` marker files). In the tar, names are never special, so a file the session
  named like a marker is just a file (except under fuse-overlayfs, whose upper dir cannot tell them apart).
  Not root, a dir or file the sandbox made unreadable to its owner is read as the snapshot reads it. FIFOs, sockets and devices are left out. The
  walk is iterative at any depth and path length (:func:`nemo_gym.sandbox.trees.walk_paths`); ``include``
  may leave regular files out by path; past ``max_bytes`` (the tar's size) it raises
  :class:`ChangesTooLargeError`.
* :data:`APPLY_SOURCE` is the program that applies such a tar, run INSIDE the receiving session's
  sandbox (``python3 -I -S -c APPLY_SOURCE`` in ``/workspace``, the tar on stdin, as the sandbox's uid),
  so nothing a changeset holds touches the host: a whiteout removes the path, an opaque directory is
  emptied first, a directory is made (a file in its place removed), a file or symlink replaces what is
  there. A member whose path is absolute, has ``..``, or whose parent resolves outside ``/workspace`` (a
  symlink of the changeset or the workspace) is skipped; so is one the file system refuses (a path past
  PATH_MAX). It prints one JSON line: ``{"applied": n, "skipped": n, "first_skipped": "path: why"}``,
  and exits 0 unless the stream is not a tar (2).
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
from collections.abc import Callable
from pathlib import Path

from nemo_gym.sandbox import trees

WHITEOUT = "NEMO_GYM.whiteout"
OPAQUE = "NEMO_GYM.opaque"
_FUSE_OPAQUE = ".wh..wh..opq"  # fuse-overlayfs (sessions without root): this file makes its dir opaque
_FUSE_WHITEOUT = ".wh."  # ... and ``.wh.<name>`` deletes <name> where it cannot make a whiteout device
_SETID = stat.S_ISUID | stat.S_ISGID


class ChangesTooLargeError(ValueError):
    """The changeset would pass its byte bound (what the session wrote is too big to send)."""


class _Budget(io.RawIOBase):
    """A write-only byte sink that raises past a bound (the tar is built in it)."""

    def __init__(self, max_bytes: int) -> None:
        self.buffer = bytearray()
        self.max_bytes = max_bytes

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        if len(self.buffer) + len(data) > self.max_bytes:
            raise ChangesTooLargeError(
                f"the workspace's changes take more than {self.max_bytes} bytes as a tar"
            )
        self.buffer += data
        return len(data)


def _opaque(dir_fd: int, name: str, opaque_xattrs: tuple[str, ...], fuse_markers: bool) -> bool:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        for key in opaque_xattrs:
            try:
                if os.getxattr(fd, key) == b"y":
                    return True
            except OSError:
                pass
        if fuse_markers:
            try:
                os.stat(_FUSE_OPAQUE, dir_fd=fd, follow_symlinks=False)
                return True
            except OSError:
                pass
        return False
    finally:
        os.close(fd)


def pack_upper(
    upper: str | Path,
    *,
    max_bytes: int,
    include: Callable[[str], bool] | None = None,
    opaque_xattrs: tuple[str, ...] = trees.OPAQUE_XATTRS,
    fuse_markers: bool = False,
) -> bytes:
    """The changeset of an overlayfs upper dir (or of any plain directory: then every entry is new), as
    tar bytes; see the module docstring. ``opaque_xattrs`` / ``fuse_markers``: how the session's mount
    marks an opaque dir and a deletion (:class:`nemo_gym.sandbox.session_mount.WorkspaceMount`)."""
    sink = _Budget(max_bytes)
    with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as tar:

        def whiteout(rel: str) -> None:
            info = tarfile.TarInfo(rel)
            info.type, info.mode = tarfile.REGTYPE, 0o600
            info.pax_headers = {WHITEOUT: "1"}
            tar.addfile(info)

        def visit(dir_fd: int, rel: str, st: os.stat_result) -> bool:
            parent, _, name = rel.rpartition("/")
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:  # an overlay whiteout: deleted
                whiteout(rel)
                return False
            if fuse_markers and name.startswith(_FUSE_WHITEOUT):  # fuse-overlayfs' own marker files
                gone = name[len(_FUSE_WHITEOUT) :]
                if gone and not gone.startswith(_FUSE_WHITEOUT) and stat.S_ISREG(st.st_mode):
                    whiteout(f"{parent}/{gone}" if parent else gone)
                return False
            info = tarfile.TarInfo(rel)
            info.mtime = int(st.st_mtime)
            info.mode = stat.S_IMODE(st.st_mode) & ~_SETID
            if stat.S_ISDIR(st.st_mode):
                info.type = tarfile.DIRTYPE
                if _opaque(dir_fd, name, opaque_xattrs, fuse_markers):
                    info.pax_headers = {OPAQUE: "1"}
                tar.addfile(info)
                return True
            if stat.S_ISLNK(st.st_mode):
                info.type = tarfile.SYMTYPE
                info.linkname = os.readlink(name, dir_fd=dir_fd)
                tar.addfile(info)
                return False
            if not stat.S_ISREG(st.st_mode) or (include is not None and not include(rel)):
                return False
            try:
                fd, mode = trees.read_at(name, dir_fd, st)
            except FileNotFoundError:
                return False
            try:
                with os.fdopen(fd, "rb") as f:
                    info.size = os.fstat(fd).st_size
                    if info.size > max_bytes:
                        raise ChangesTooLargeError(
                            f"the workspace's file {rel[:200]!r} alone has {info.size} bytes (bound {max_bytes})"
                        )
                    tar.addfile(info, f)
            finally:
                trees.put_back_at(name, dir_fd, mode)
            return False

        trees.walk_paths(upper, visit)
    return bytes(sink.buffer)


def read_changes(data: bytes) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    """The members of a changeset :func:`pack_upper` made, with each regular file's bytes (None for the
    rest). For the host's own reading of its own packing (never extracted to the host)."""
    out = []
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        for member in tar:
            content = None
            if member.isreg() and WHITEOUT not in member.pax_headers:
                f = tar.extractfile(member)
                content = f.read() if f is not None else b""
            out.append((member, content))
    return out


# Runs inside the receiving sandbox: python3 -I -S -c APPLY_SOURCE, in /workspace, the tar on stdin.
APPLY_SOURCE = r"""
import json, os, shutil, stat, sys, tarfile

W = "/workspace"
applied = skipped = 0
first = None
dir_modes = []  # set last, deepest first: a directory the changeset left read-only still takes its entries


def target(name):
    parts = name.split("/")
    if name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError("not a relative path inside the workspace")
    parent = os.path.realpath(os.path.join(W, *parts[:-1]))
    if parent != W and not parent.startswith(W + "/"):
        raise ValueError("its directory resolves outside the workspace")
    return os.path.join(parent, parts[-1])


def remove(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


try:
    tar = tarfile.open(fileobj=sys.stdin.buffer, mode="r|")
except tarfile.TarError as exc:
    print(json.dumps({"error": "not a tar: %s" % exc}))
    sys.exit(2)
for m in tar:
    try:
        path = target(m.name)
        if m.pax_headers.get("NEMO_GYM.whiteout") == "1":
            remove(path)
        elif m.isdir():
            if os.path.lexists(path) and (os.path.islink(path) or not os.path.isdir(path)):
                remove(path)
            if m.pax_headers.get("NEMO_GYM.opaque") == "1" and os.path.isdir(path):
                for entry in os.listdir(path):
                    remove(os.path.join(path, entry))
            os.makedirs(path, exist_ok=True)
            os.chmod(path, 0o700)
            dir_modes.append((path, m.mode & 0o777))
        elif m.issym():
            remove(path)
            os.symlink(m.linkname, path)
        elif m.isreg():
            remove(path)
            src = tar.extractfile(m)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as out:
                shutil.copyfileobj(src, out)
            os.chmod(path, m.mode & 0o777)
            os.utime(path, (m.mtime, m.mtime))
        else:
            raise ValueError("not a file, directory or symlink")
        applied += 1
    except (OSError, ValueError) as exc:
        skipped += 1
        if first is None:
            first = "%s: %s" % (m.name[:200], (getattr(exc, "strerror", None) or str(exc))[:200])
for path, mode in reversed(dir_modes):
    try:
        os.chmod(path, mode)
    except OSError:
        pass
print(json.dumps({"applied": applied, "skipped": skipped, "first_skipped": first}))
"""
