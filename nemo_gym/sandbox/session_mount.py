"""How a session's copy-on-write workspace is mounted: by root, or in a user namespace (not root).

Contract
--------
* :func:`workspace_mount` picks, once per process, how sessions mount their overlay (logged with why):

  ``root``
      the server is root: ``unshare --mount`` makes a private mount namespace and the kernel's overlayfs
      is mounted there (``trusted.overlay.*`` xattrs in the upper dir). The fast path, as before.
  ``userns``
      not root: ``unshare --user --map-root-user --mount`` makes a user namespace in which this user is
      root, and the kernel's overlayfs is mounted there with ``userxattr`` (Linux >= 5.11 allows that
      unprivileged; the upper dir's marks are ``user.overlay.*``). Checked once by mounting a probe.
  ``fuse``
      not root, and the kernel refused that mount (older kernels): Debian's ``fuse-overlayfs`` mounts it
      in the same kind of namespaces. A FUSE daemon (one thread, no network: its own network namespace)
      serves the workspace for the sandbox's life: outside bubblewrap, as this user.

  ``NEMO_GYM_SANDBOX_SESSION_MOUNT=userns|fuse`` forces a non-root mode (tests, diagnosis); root always
  uses ``root``. No mode that works: :class:`~nemo_gym.sandbox.errors.SandboxUnavailableError` saying
  what was tried and what to install.
* :meth:`WorkspaceMount.argv` is the argv that mounts ``lower`` + ``upper`` (+ ``work``) at ``merged`` (the
  entries of one session dir) in the fresh namespaces, then runs the rest (bubblewrap). The mount is made
  from inside that dir with those names, so its options, which the sandbox reads in
  ``/proc/self/mountinfo``, name no host path. ``processes`` (not root, no pids cgroup) sets
  RLIMIT_NPROC INSIDE the user namespace, just before bubblewrap: the kernel then counts the session's
  own tasks (those of its namespace), not every process of this user on the host, which it would if the
  limit were set before the namespace was made. :attr:`WorkspaceMount.outside_tasks` is how many tasks
  that count holds besides the sandbox's pid namespace (the outer bwrap; the shell and the FUSE daemon).
* :attr:`WorkspaceMount.opaque_xattrs` / :attr:`WorkspaceMount.fuse_markers`: how its upper dir marks
  an opaque dir (and fuse-overlayfs' own marker files), for a snapshot (:func:`nemo_gym.sandbox.trees.apply_upper`).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from nemo_gym.sandbox import trees
from nemo_gym.sandbox.errors import SandboxUnavailableError

LOG = logging.getLogger("nemo_gym.sandbox")

_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
_MOUNT_FAILED = 121
_OPTS = "redirect_dir=off,metacopy=off,index=off"
# Every mount is made from inside the session's dir ($1) with the names of its entries (lower: the layer,
# or a symlink to it; upper, work, merged): the kernel keeps the options as given, and the sandbox reads
# them in /proc/self/mountinfo, so they say nothing of the host's paths (before: the layer's, the upper and
# work dirs' full paths, with this process's pid and the session's id in them).
# Root: the layer is the only lower dir; overlayfs never writes it; redirect_dir/metacopy off keep the upper
# dir self-contained (a renamed dir is copied, a changed file's data is in the upper dir), so a snapshot can
# read it alone.
_MOUNT_ROOT = (
    f'cd "$1" || exit {_MOUNT_FAILED}; '
    f'mount -t overlay nemo-gym-workspace -o "lowerdir=lower,upperdir=upper,workdir=work,{_OPTS}" merged '
    f'|| exit {_MOUNT_FAILED}; cd /; shift 2; exec "$@"'
)
# A user namespace: userxattr (its marks as user.* xattrs), which needs redirects off for both creating and
# following (nofollow); then RLIMIT_NPROC (inside the namespace: it counts the session's tasks only).
_MOUNT_USERNS = (
    f'cd "$1" || exit {_MOUNT_FAILED}; '
    'mount -t overlay nemo-gym-workspace -o "lowerdir=lower,upperdir=upper,workdir=work,userxattr,'
    f'redirect_dir=nofollow,metacopy=off,index=off" merged || exit {_MOUNT_FAILED}; cd /; '
    f'[ -z "$2" ] || ulimit -p "$2" || exit {_MOUNT_FAILED}; shift 2; exec "$@"'
)
# fuse-overlayfs stays in the foreground as this shell's child (in its own network namespace), so killing
# the process group ends it with the sandbox, and so does the sandbox's end (the shell kills it then).
_MOUNT_FUSE = f"""
cd "$1" || exit {_MOUNT_FAILED}
unshare --net fuse-overlayfs -f -o "lowerdir=lower,upperdir=upper,workdir=work" merged </dev/null >/dev/null 2>&1 &
fuse=$!
i=0
until mountpoint -q merged; do
  kill -0 $fuse 2>/dev/null || exit {_MOUNT_FAILED}
  i=$((i + 1))
  [ $i -le 2000 ] || {{ kill $fuse; exit {_MOUNT_FAILED}; }}
  sleep 0.005
done
cd /
[ -z "$2" ] || ulimit -p "$2" || {{ kill $fuse; exit {_MOUNT_FAILED}; }}
shift 2
"$@"
rc=$?
kill $fuse 2>/dev/null
wait $fuse
exit $rc
"""
_USERNS = ["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"]


@dataclass(frozen=True)
class WorkspaceMount:
    """One way to mount a session's workspace (see the module docstring)."""

    kind: str  # "root" | "userns" | "fuse"
    reason: str
    opaque_xattrs: tuple[str, ...]
    fuse_markers: bool = False  # fuse-overlayfs' .wh..wh..opq files (and .wh.<name> whiteouts)
    outside_tasks: int = 1  # tasks the RLIMIT_NPROC count holds outside the sandbox's pid namespace

    @property
    def privileged(self) -> bool:
        return self.kind == "root"

    def argv(self, dirs: Path, processes: int | None) -> list[str]:
        """Mount ``dirs/merged`` (from ``dirs/lower``: the layer, or a symlink to it; ``dirs/upper``,
        ``dirs/work``), then run what follows (appended by the caller). ``processes``: RLIMIT_NPROC set
        inside the user namespace (not root, and no pids cgroup; None: not set here)."""
        args = [str(dirs), "" if processes is None else str(processes)]
        if self.kind == "root":
            return [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "/bin/sh",
                "-c",
                _MOUNT_ROOT,
                "mount",
                *args,
            ]
        script = _MOUNT_USERNS if self.kind == "userns" else _MOUNT_FUSE
        return [*_USERNS, "/bin/sh", "-c", script, "mount", *args]


_ROOT_MOUNT = WorkspaceMount(
    "root",
    "root: the kernel's overlayfs in a private mount namespace",
    opaque_xattrs=("trusted.overlay.opaque",),
)
_PICKED: list[WorkspaceMount] = []


def workspace_mount(probe_dir: str | Path | None = None) -> WorkspaceMount:
    """How this process's sessions mount their workspace (picked once; logged). ``probe_dir``: where a
    non-root process tries a mount first (a dir of its own). Raises SandboxUnavailableError if none works."""
    if _PICKED:
        return _PICKED[0]
    for tool in ("unshare", "mount"):
        if shutil.which(tool, path=_PATH) is None:
            raise SandboxUnavailableError(
                f"sandbox sessions need `{tool}` (Debian package util-linux / mount)"
            )
    if os.geteuid() == 0:
        mode = _ROOT_MOUNT
    else:
        mode = _pick_unprivileged(Path(probe_dir or tempfile.gettempdir()))
    LOG.info("sandbox sessions: workspace mount %s: %s", mode.kind, mode.reason)
    _PICKED.append(mode)
    return mode


def _pick_unprivileged(probe_dir: Path) -> WorkspaceMount:
    forced = os.environ.get("NEMO_GYM_SANDBOX_SESSION_MOUNT", "").strip() or "auto"
    if forced not in ("auto", "userns", "fuse"):
        raise SandboxUnavailableError(
            f"NEMO_GYM_SANDBOX_SESSION_MOUNT={forced!r}: expected auto, userns or fuse (or unset)"
        )
    userns = WorkspaceMount(
        "userns",
        "not root: the kernel's overlayfs mounted in a user namespace of the session's own",
        opaque_xattrs=("user.overlay.opaque",),
    )
    fuse = WorkspaceMount(
        "fuse",
        "not root: fuse-overlayfs in a user namespace of the session's own",
        opaque_xattrs=("user.fuseoverlayfs.opaque", "trusted.overlay.opaque", "user.overlay.opaque"),
        fuse_markers=True,
        outside_tasks=3,  # the mounting shell, the FUSE daemon, the outer bwrap
    )
    kernel_error = fuse_error = "not tried"
    if forced in ("auto", "userns"):
        kernel_error = _probe(userns, probe_dir)
        if kernel_error is None:
            return userns if forced == "userns" else _with_reason(userns, "Linux >= 5.11 allows it")
    if forced in ("auto", "fuse"):
        if (
            shutil.which("fuse-overlayfs", path=_PATH) is None
            or shutil.which("mountpoint", path=_PATH) is None
        ):
            fuse_error = "fuse-overlayfs is not installed (apt-get install fuse-overlayfs)"
        else:
            fuse_error = _probe(fuse, probe_dir)
        if fuse_error is None:
            why = (
                "forced" if forced == "fuse" else f"the kernel refused its own overlay here ({kernel_error})"
            )
            return _with_reason(fuse, why)
    raise SandboxUnavailableError(
        "sandbox sessions cannot mount their copy-on-write workspace as this user (uid "
        f"{os.geteuid()}): the kernel's overlayfs in a user namespace: {kernel_error}; fuse-overlayfs: "
        f"{fuse_error}. Use Linux >= 5.11 with unprivileged user namespaces, install fuse-overlayfs "
        "(apt-get install fuse-overlayfs), or run the servers as root"
    )


def _with_reason(mode: WorkspaceMount, why: str) -> WorkspaceMount:
    return WorkspaceMount(
        mode.kind, f"{mode.reason} ({why})", mode.opaque_xattrs, mode.fuse_markers, mode.outside_tasks
    )


def _probe(mode: WorkspaceMount, probe_dir: Path) -> str | None:
    """Mount a tiny overlay this way and write through it: None if the write landed in the upper dir,
    else why not (the tool's own words)."""
    try:
        base = Path(tempfile.mkdtemp(prefix=".nemo-gym-mount-probe-", dir=probe_dir))
    except OSError as exc:
        return f"cannot make a probe dir under {probe_dir}: {exc}"
    try:
        for name in ("lower", "upper", "work", "merged"):
            (base / name).mkdir()
        (base / "lower" / "seen").write_text("x")
        check = ["/bin/sh", "-c", 'test -f "$1/seen" && : > "$1/written"', "check", str(base / "merged")]
        argv = mode.argv(base, None) + check
        try:
            done = subprocess.run(
                argv, capture_output=True, timeout=20, env={"PATH": _PATH}, cwd="/", stdin=subprocess.DEVNULL
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{type(exc).__name__}: {exc}"
        if done.returncode == 0 and (base / "upper" / "written").exists():
            return None
        said = (done.stderr or done.stdout).decode(errors="replace").strip().splitlines()
        return f"exit {done.returncode}: {' / '.join(said[-3:]) or 'no message'}"
    finally:
        trees.remove_tree(base)
