"""Walking, copying and removing directory trees that sandboxed code wrote, at any depth and path length.

Code in a sandbox can build a tree no recursive walk survives and no full path names: ``mkdir d; cd d``
in a loop makes it deeper than Python's recursion limit (``os.walk`` and ``shutil.rmtree`` recurse in
Python 3.11: RecursionError) and its paths longer than PATH_MAX (4096 bytes: every call that takes a full
path fails with ENAMETOOLONG). A snapshot, the disk quota's count and the clean-up must still work there,
or the model's own tree would pass for a failure of the infrastructure (a 5xx), slip past the quota, or
leave its files on the host.

Contract
--------
* Every operation is relative to an open directory (``dir_fd``); a walk is iterative (a list of names
  left per level, never recursion) and holds one open directory per tree it walks. It goes down with
  ``openat(name, O_NOFOLLOW)`` (a symlink is never entered) and back up through ``..``, checking that it
  lands on the directory it came down from (device and inode): if the tree was moved under it,
  :class:`TreeChangedError`. It never leaves the tree it started in.
* :func:`walk_paths` walks a tree in name order giving each entry's path from its top (a changeset's
  packing, :mod:`nemo_gym.sandbox.changes`); :func:`tree_bytes` sums what a directory holds for a quota (a file's size where it is sparse,
  optionally a floor per entry);
  :func:`link_tree`
  makes a tree of hard links to an immutable tree; :func:`apply_upper` applies an overlayfs upper dir
  (whiteouts, opaque dirs, changed files copied); :func:`remove_tree` removes a tree (best effort, never
  raises: it is the clean-up of dirs nobody uses); :func:`remove_entry` removes a file or a tree
  relative to a directory fd.
* Modes and times are kept (a set-id bit is dropped: the sandbox's files are root's on the host, or the
  host user's when the server is not root); a directory's mode and times are set once its entries are
  in. Extended attributes are not copied (overlayfs' own ``trusted.overlay.*`` / ``user.overlay.*`` ones
  are read, never copied into a flattened layer). FIFOs, sockets and devices are not copied.
* Not root: the sandbox's files are the host user's own, and its code may have taken the owner's access
  away (``chmod 000 dir``), which root's DAC override ignores but this user's walk would not get past
  (data hidden from the quota, a snapshot that fails, a clean-up that leaves files). A walk that needs
  read/search (or, to remove, write) access to a dir or file of its own that lacks it adds those owner
  bits (``chmod u+rx``); a count or a copy puts the mode back once done, so the sandbox sees its mode
  unchanged (only for that moment).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_SETID = stat.S_ISUID | stat.S_ISGID
_READ_DIR = stat.S_IRUSR | stat.S_IXUSR  # the owner bits a walk needs on a dir to list and enter it
_WRITE_DIR = _READ_DIR | stat.S_IWUSR  # ... and to remove its entries


def _grant(name: str, dir_fd: int | None, st: os.stat_result, bits: int) -> int | None:
    """Not root: give the owner ``bits`` on ``name`` (a file or dir of this user that lacks them: the
    sandbox took them away). Returns the mode to put back, or None when nothing was changed (root, which
    needs none of them; not ours; already there)."""
    mode = stat.S_IMODE(st.st_mode)
    if mode & bits == bits or st.st_uid != os.geteuid() or os.geteuid() == 0:
        return None
    try:
        os.chmod(name, mode | bits, dir_fd=dir_fd, follow_symlinks=False)
    except (OSError, NotImplementedError):  # NotImplementedError: a platform without fchmodat's no-follow
        return None
    return mode


def _put_back(name: str, dir_fd: int | None, mode: int | None) -> None:
    if mode is not None:
        with contextlib.suppress(OSError, NotImplementedError):
            os.chmod(name, mode, dir_fd=dir_fd, follow_symlinks=False)


class TreeChangedError(OSError):
    """The tree was moved under a walk (``..`` led somewhere else than where the walk came from)."""


class _Cursor:
    """One open directory of a tree that moves down into a child and back up through ``..``."""

    def __init__(self, path: str | Path, dir_fd: int | None = None) -> None:
        self.fd = os.open(path, _DIR_FLAGS, dir_fd=dir_fd)
        st = os.fstat(self.fd)
        self._ids = [(st.st_dev, st.st_ino)]

    def enter(self, name: str) -> None:
        fd = os.open(name, _DIR_FLAGS, dir_fd=self.fd)
        st = os.fstat(fd)
        os.close(self.fd)
        self.fd = fd
        self._ids.append((st.st_dev, st.st_ino))

    def leave(self) -> None:
        if len(self._ids) < 2:
            raise ValueError("the walk is at the top of its tree")
        fd = os.open("..", _DIR_FLAGS, dir_fd=self.fd)
        st = os.fstat(fd)
        self._ids.pop()
        if (st.st_dev, st.st_ino) != self._ids[-1]:
            os.close(fd)
            raise TreeChangedError("the tree was moved while it was walked")
        os.close(self.fd)
        self.fd = fd

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _lstat(name: str, dir_fd: int) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _walk(
    root: str | Path,
    visit: Callable[[int, str, os.stat_result], bool],
    leave: Callable[[int, str], None] | None = None,
    *,
    root_dir_fd: int | None = None,
    access: int = _READ_DIR,
    put_back: bool = True,
) -> None:
    """Depth first under ``root``: ``visit(dir_fd, name, lstat)`` for every entry; a directory is walked
    into when visit returns True, and ``leave(dir_fd, name)`` is called from its parent once it is done.
    ``access``: the owner bits a dir walked into must have (added when it lacks them and is ours, not
    root; :func:`_grant`), put back when it is left (``put_back``; a removal does not)."""
    top = _top_grant(root, root_dir_fd, access)
    cursor = _Cursor(root, root_dir_fd)
    try:
        pending = [os.listdir(cursor.fd)]
        below: list[tuple[str, int | None]] = []
        while pending:
            if not pending[-1]:
                pending.pop()
                if below:
                    name, mode = below.pop()
                    cursor.leave()
                    if leave is not None:
                        leave(cursor.fd, name)
                    if put_back:
                        _put_back(name, cursor.fd, mode)
                continue
            name = pending[-1].pop()
            st = _lstat(name, cursor.fd)
            if st is None or not visit(cursor.fd, name, st) or not stat.S_ISDIR(st.st_mode):
                continue
            mode = _grant(name, cursor.fd, st, access)
            try:
                cursor.enter(name)
            except (FileNotFoundError, NotADirectoryError):
                continue  # gone (or no longer a directory) since it was listed
            except OSError as exc:
                if exc.errno != errno.ELOOP:  # replaced by a symlink since it was listed
                    raise
                continue
            below.append((name, mode))
            pending.append(os.listdir(cursor.fd))
    finally:
        cursor.close()
        if put_back:
            _put_back(str(root), root_dir_fd, top)


def _top_grant(root: str | Path, dir_fd: int | None, access: int) -> int | None:
    """:func:`_grant` for the dir a walk starts in (the sandbox may chmod its /workspace too)."""
    if os.geteuid() == 0:
        return None
    try:
        st = os.stat(root, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None
    return _grant(str(root), dir_fd, st, access) if stat.S_ISDIR(st.st_mode) else None


def walk_paths(root: str | Path, visit: Callable[[int, str, os.stat_result], bool]) -> None:
    """Depth first under ``root``, parents before their entries, in name order: ``visit(dir_fd, rel,
    lstat)`` for every entry (``rel``: its path from ``root``, ``/``-separated; ``dir_fd``: its directory,
    open only during the call, for ``*at`` calls on ``rel``'s last part). A directory is walked into when
    visit returns True. Iterative at any depth and path length, never through a symlink; entries that
    vanish are skipped, a tree moved under the walk raises :class:`TreeChangedError`. Not root: a dir of
    this user's that lacks the owner's read/search bits gets them while it is walked (:func:`_grant`)."""
    top = _top_grant(root, None, _READ_DIR)
    cursor = _Cursor(root)
    try:
        pending = [sorted(os.listdir(cursor.fd), reverse=True)]
        below: list[tuple[str, int | None]] = []
        while pending:
            if not pending[-1]:
                pending.pop()
                if below:
                    name, mode = below.pop()
                    cursor.leave()
                    _put_back(name, cursor.fd, mode)
                continue
            name = pending[-1].pop()
            st = _lstat(name, cursor.fd)
            rel = "/".join([*(n for n, _ in below), name])
            if st is None or not visit(cursor.fd, rel, st) or not stat.S_ISDIR(st.st_mode):
                continue
            mode = _grant(name, cursor.fd, st, _READ_DIR)
            try:
                cursor.enter(name)
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as exc:
                if exc.errno != errno.ELOOP:
                    raise
                continue
            below.append((name, mode))
            pending.append(sorted(os.listdir(cursor.fd), reverse=True))
    finally:
        cursor.close()
        _put_back(str(root), None, top)


def read_at(name: str, dir_fd: int, st: os.stat_result) -> tuple[int, int | None]:
    """An fd to read the regular file ``name`` (never through a symlink) and the mode to put back with
    :func:`put_back_at` once read (not root: a file of this user's the sandbox made unreadable gets the
    owner's read bit meanwhile)."""
    mode = _grant(name, dir_fd, st, stat.S_IRUSR)
    try:
        return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd), mode
    except BaseException:
        _put_back(name, dir_fd, mode)
        raise


def put_back_at(name: str, dir_fd: int, mode: int | None) -> None:
    """Put back the mode :func:`read_at` changed (None: it changed nothing)."""
    _put_back(name, dir_fd, mode)


def _walk_pair(
    src: str | Path,
    dest: str | Path,
    visit: Callable[[int, int, str, os.stat_result], bool],
    leave: Callable[[int, int, str, os.stat_result], None] | None = None,
) -> None:
    """:func:`_walk` over ``src`` with a second cursor kept at the same place under ``dest``:
    ``visit(src_fd, dest_fd, name, lstat)``; when it returns True for a directory, ``dest/name`` must be
    a directory (visit made it) and both walks go into it; ``leave(src_fd, dest_fd, name, lstat)`` once
    both are done with it (set its mode and times there: its entries are in). A dir of ``src`` that
    lacks read/search access for its owner (not root) gets it while it is walked (:func:`_grant`)."""
    top = _top_grant(src, None, _READ_DIR)
    source, target = _Cursor(src), _Cursor(dest)
    try:
        pending = [os.listdir(source.fd)]
        below: list[tuple[str, os.stat_result, int | None]] = []
        while pending:
            if not pending[-1]:
                pending.pop()
                if below:
                    name, st, mode = below.pop()
                    source.leave()
                    target.leave()
                    _put_back(name, source.fd, mode)
                    if leave is not None:
                        leave(source.fd, target.fd, name, st)
                continue
            name = pending[-1].pop()
            st = _lstat(name, source.fd)
            if st is None or not visit(source.fd, target.fd, name, st) or not stat.S_ISDIR(st.st_mode):
                continue
            mode = _grant(name, source.fd, st, _READ_DIR)
            try:
                source.enter(name)
            except BaseException:
                _put_back(name, source.fd, mode)
                raise
            target.enter(name)
            below.append((name, st, mode))
            pending.append(os.listdir(source.fd))
    finally:
        source.close()
        target.close()
        _put_back(str(src), None, top)


def tree_bytes(path: str | Path, max_entries: int | None = None, min_entry_bytes: int = 0) -> int | None:
    """What ``path`` holds for a quota: a regular file counts what it can become (its size, even where it
    is sparse, or its blocks if more), a dir or link its blocks; every entry at least ``min_entry_bytes``
    (an inode each: so a flood of empty files is bounded too). None when there are more than
    ``max_entries`` entries (the caller then walks it in a thread). Entries that vanish during the walk
    are skipped; a tree moved under the walk (:class:`TreeChangedError`) raises."""
    total = seen = 0

    class _Enough(Exception):
        pass

    def visit(_fd: int, _name: str, st: os.stat_result) -> bool:
        nonlocal total, seen
        seen += 1
        if max_entries is not None and seen > max_entries:
            raise _Enough
        blocks = st.st_blocks * 512
        total += (
            max(blocks, st.st_size, min_entry_bytes)
            if stat.S_ISREG(st.st_mode)
            else max(blocks, min_entry_bytes)
        )
        return True

    try:
        _walk(path, visit)
    except _Enough:
        return None
    except TreeChangedError:
        raise
    except OSError:
        pass  # the tree (or a dir in it) went away while it was counted: what was seen
    return total


def _copy_meta(name: str, dir_fd: int, st: os.stat_result) -> None:
    os.chmod(name, stat.S_IMODE(st.st_mode) & ~_SETID, dir_fd=dir_fd)
    os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=dir_fd, follow_symlinks=False)


def _data_extents(fd: int, size: int) -> list[tuple[int, int]]:
    """The (offset, length) runs of a file that hold data: its holes are not copied, so a sparse file
    (``truncate -s 1T``, a few blocks on disk and under the quota) stays sparse in a copy."""
    extents, pos = [], 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # no data past pos
                break
            return [(0, size)]  # SEEK_DATA not supported: the whole file
        end = os.lseek(fd, start, os.SEEK_HOLE)
        extents.append((start, min(end, size) - start))
        pos = end
    return extents


def _copy_file(name: str, src_fd: int, dest_fd: int, st: os.stat_result) -> None:
    mode = _grant(name, src_fd, st, stat.S_IRUSR)
    try:
        fin = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=src_fd)
    finally:
        _put_back(name, src_fd, mode)
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fout = os.open(name, flags, 0o600, dir_fd=dest_fd)
        try:
            for offset, length in _data_extents(fin, st.st_size):
                os.lseek(fout, offset, os.SEEK_SET)
                while length > 0:
                    sent = os.sendfile(fout, fin, offset, min(length, 1 << 30))
                    if sent == 0:
                        break
                    offset, length = offset + sent, length - sent
            os.ftruncate(fout, st.st_size)
        finally:
            os.close(fout)
    finally:
        os.close(fin)
    _copy_meta(name, dest_fd, st)


def _leave_dir(_src_fd: int, dest_fd: int, name: str, st: os.stat_result) -> None:
    """A copied dir's entries are in: now its mode (which may forbid adding any) and times."""
    _copy_meta(name, dest_fd, st)


def link_tree(src: str | Path, dest: str | Path) -> None:
    """``dest`` (new) = ``src`` with every regular file hard-linked (``src`` is an immutable layer)."""
    os.mkdir(dest, 0o700)
    src_st = os.stat(src)

    def visit(src_fd: int, dest_fd: int, name: str, st: os.stat_result) -> bool:
        if stat.S_ISDIR(st.st_mode):
            os.mkdir(name, 0o700, dir_fd=dest_fd)
            return True  # its mode and times: at leave, once its entries are in
        if stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(name, dir_fd=src_fd), name, dir_fd=dest_fd)
        elif stat.S_ISREG(st.st_mode):
            os.link(name, name, src_dir_fd=src_fd, dst_dir_fd=dest_fd, follow_symlinks=False)
        return False

    _walk_pair(src, dest, visit, _leave_dir)
    os.chmod(dest, stat.S_IMODE(src_st.st_mode))
    os.utime(dest, ns=(src_st.st_atime_ns, src_st.st_mtime_ns))


def remove_entry(name: str, dir_fd: int) -> None:
    """Remove ``name`` under ``dir_fd`` whatever it is (a whole tree for a directory); nothing if absent."""
    st = _lstat(name, dir_fd)
    if st is None:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return

    def visit(fd: int, child: str, child_st: os.stat_result) -> bool:
        if stat.S_ISDIR(child_st.st_mode):
            return True
        with contextlib.suppress(FileNotFoundError):
            os.unlink(child, dir_fd=fd)
        return False

    def leave(fd: int, child: str) -> None:
        os.rmdir(child, dir_fd=fd)

    _walk(name, visit, leave, root_dir_fd=dir_fd, access=_WRITE_DIR, put_back=False)
    os.rmdir(name, dir_fd=dir_fd)


def remove_tree(path: str | Path) -> None:
    """Remove ``path`` and everything under it, best effort (it never raises: a clean-up)."""
    path = Path(path)
    for _ in range(3):  # a tree moved under the walk: again
        try:
            fd = os.open(path.parent, _DIR_FLAGS)
        except OSError:
            return
        try:
            remove_entry(path.name, fd)
            return
        except OSError:
            continue
        finally:
            os.close(fd)


# overlayfs marks a dir of the upper dir that replaces the lower's (not merged with it) by an xattr: the
# trusted.* one when mounted by root, the user.* one when mounted in a user namespace (``userxattr``).
OPAQUE_XATTRS = ("trusted.overlay.opaque",)


_FUSE_OPAQUE = ".wh..wh..opq"  # fuse-overlayfs: this file in a dir of the upper dir makes it opaque
_FUSE_WHITEOUT = ".wh."  # fuse-overlayfs without mknod: ``.wh.<name>`` deletes <name>


def apply_upper(
    upper: str | Path,
    dest: str | Path,
    opaque_xattrs: tuple[str, ...] = OPAQUE_XATTRS,
    *,
    fuse_markers: bool = False,
) -> None:
    """Apply an overlayfs upper dir onto ``dest`` (a link tree of its lower): whiteouts delete, opaque
    dirs replace, changed files are COPIED (the upper dir stays the live session's). ``opaque_xattrs``:
    the xattr(s) with which this mount marks an opaque dir (value ``y``); ``fuse_markers``: the upper dir
    is fuse-overlayfs', whose ``.wh..wh..opq`` file marks an opaque dir and ``.wh.<name>`` a whiteout."""

    def visit(src_fd: int, dest_fd: int, name: str, st: os.stat_result) -> bool:
        mode = st.st_mode
        if stat.S_ISCHR(mode) and st.st_rdev == 0:  # a whiteout: deleted in the session
            remove_entry(name, dest_fd)
            return False
        if fuse_markers and name.startswith(_FUSE_WHITEOUT):
            gone = name[len(_FUSE_WHITEOUT) :]
            if gone and not gone.startswith(".wh.") and stat.S_ISREG(mode):
                remove_entry(gone, dest_fd)
            return False  # a marker, never a file of the workspace
        if stat.S_ISDIR(mode):
            opaque = False
            readable = _grant(name, src_fd, st, _READ_DIR)  # a user.* xattr needs read access
            try:
                with contextlib.suppress(OSError):
                    fd = os.open(name, _DIR_FLAGS, dir_fd=src_fd)
                    try:
                        opaque = any(_xattr(fd, key) == b"y" for key in opaque_xattrs)
                        opaque = opaque or (fuse_markers and _lstat(_FUSE_OPAQUE, fd) is not None)
                    finally:
                        os.close(fd)
            finally:
                _put_back(name, src_fd, readable)
            there = _lstat(name, dest_fd)
            if there is not None and (opaque or not stat.S_ISDIR(there.st_mode)):
                remove_entry(name, dest_fd)
                there = None
            if there is None:
                os.mkdir(name, 0o700, dir_fd=dest_fd)
            else:
                _grant(name, dest_fd, there, _WRITE_DIR)  # the lower's mode: set again at leave
            return True  # its mode and times: at leave, once its entries are in
        if stat.S_ISLNK(mode):
            remove_entry(name, dest_fd)
            os.symlink(os.readlink(name, dir_fd=src_fd), name, dir_fd=dest_fd)
        elif stat.S_ISREG(mode):
            remove_entry(name, dest_fd)
            _copy_file(name, src_fd, dest_fd, st)
        return False

    top = _top_grant(dest, None, _WRITE_DIR)
    try:
        _walk_pair(upper, dest, visit, _leave_dir)
    finally:
        _put_back(str(dest), None, top)


def _xattr(fd: int, key: str) -> bytes | None:
    try:
        return os.getxattr(fd, key)
    except OSError:
        return None
