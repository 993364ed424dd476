"""A session's workspace changes as a changeset, applied to another session on the same workspace
(``nemo_gym.sandbox.changes``; how harness_agent's sandbox hands its work to workspace_tasks), and a
session's read-only binds. Real bubblewrap and overlayfs; tests/test_sandbox_session_unprivileged.py runs
them again as an unprivileged user (a user namespace's overlayfs, and fuse-overlayfs)."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from nemo_gym.sandbox import SandboxSession
from nemo_gym.sandbox.changes import OPAQUE, WHITEOUT, ChangesTooLargeError, read_changes
from nemo_gym.sandbox.session_mount import workspace_mount

FAST = {"command_wall_time_s": 20, "command_cpu_time_s": 20, "memory_mib": 256, "processes": 64}

# What a model's commands may do to a workspace: edit, delete, replace a directory by another, add a symlink
# out, a file named like an overlay marker, a FIFO, a read-only directory, a directory and file closed to
# their owner, an executable, a deep tree (one file under a path within PATH_MAX, one past it).
_CHANGE = r"""
set -e
echo changed >> pkg/mod.py
rm gone.txt
rm -rf replaced && mkdir replaced && echo new > replaced/inner.txt
ln -s /etc/passwd outside
[ -n "$FUSE" ] || echo marker > .wh.keep.txt
mkfifo pipe
mkdir locked && echo in > locked/f && chmod 500 locked
mkdir shut && echo hidden > shut/f && chmod 000 shut/f shut
printf '#!/bin/sh\necho run\n' > tool.sh && chmod 755 tool.sh
python3 -c "
import os
os.makedirs('/'.join(['near'] * 150))
open('/'.join(['near'] * 150) + '/leaf', 'w').write('near')
if not os.environ.get('FUSE'):  # fuse-overlayfs takes whole paths: none past PATH_MAX can be made there
    for _ in range(30):
        os.mkdir('F' * 200)
        os.chdir('F' * 200)
    open('leaf', 'w').write('far')
"
"""
# The view of a workspace the two sessions must agree on (the tree past PATH_MAX and the FIFO left out:
# they do not cross).
_VIEW = (
    "find . \\( -path './FFFF*' -o -name pipe \\) -prune -o -printf '%p %y %m\\n' | LC_ALL=C sort; "
    'for f in pkg/mod.py replaced/inner.txt locked/f tool.sh; do echo "$f: $(cat $f)"; done; '
    "readlink outside; ls replaced; cat $(find . -name leaf -path './near/*')"
)


def _base(tmp_path: Path) -> Path:
    base = tmp_path / "base"
    (base / "pkg").mkdir(parents=True)
    (base / "pkg" / "mod.py").write_text("original\n")
    (base / "gone.txt").write_text("to delete\n")
    (base / "replaced").mkdir()
    (base / "replaced" / "old.txt").write_text("old\n")
    (base / "keep.txt").write_text("kept\n")
    return base


async def test_a_sessions_changes_make_another_session_on_the_same_workspace_the_same(tmp_path: Path) -> None:
    base = _base(tmp_path)
    first = await SandboxSession.start(workspace=base, limits=FAST)
    second = await SandboxSession.start(workspace=base, limits=FAST)
    try:
        # fuse-overlayfs (sessions without root, on older kernels) refuses a file named .wh.*: its marker.
        fuse = workspace_mount().fuse_markers
        made = await first.exec(_CHANGE, env={"FUSE": "1" if fuse else ""})
        assert made.return_code == 0, made
        changes = await first.export_changes(max_bytes=1 << 20)
        members = {m.name: (m, content) for m, content in read_changes(changes)}
        assert members["gone.txt"][0].pax_headers == {WHITEOUT: "1"}  # a deletion
        assert members["replaced"][0].pax_headers == {OPAQUE: "1"}  # a directory replaced
        if not fuse:
            assert members[".wh.keep.txt"][1] == b"marker\n"  # a file's name is never a marker
        assert "keep.txt" not in members and "pipe" not in members  # unchanged; a FIFO is left out

        applied = await second.apply_changes(changes)
        assert applied.return_code == 0, applied
        report = json.loads(applied.stdout)
        # The tree past PATH_MAX (its deepest dirs and its file) is skipped, said so; the rest applied.
        if not fuse:
            assert report["skipped"] >= 1 and report["first_skipped"].endswith("File name too long"), report
        else:
            assert report["skipped"] == 0, report
        a, b = await first.exec(_VIEW), await second.exec(_VIEW)
        assert a.stdout == b.stdout and "replaced/old.txt" not in b.stdout, (a.stdout, b.stdout)
        assert "./gone.txt" not in b.stdout.split()
        assert (await second.exec("ls pipe")).return_code != 0
        assert "pkg/mod.py: original\nchanged" in b.stdout and "/etc/passwd" in b.stdout
        assert "./locked d 500" in b.stdout and "./tool.sh f 755" in b.stdout
        assert (await second.exec("./tool.sh")).stdout == "run\n"
        # A dir and file the sandbox closed to their owner crossed (a host walk that is not root opens them).
        opened = "chmod 700 shut && chmod 600 shut/f && cat shut/f"
        assert (await second.exec(opened)).stdout == "hidden\n"
    finally:
        await first.close()
        await second.close()


async def test_a_changeset_writes_inside_the_workspace_only() -> None:
    """Members that lead out (through a symlink of the changeset, ``..``, an absolute path) are skipped;
    what is not a tar is return code 2; past the bound, export raises."""
    session = await SandboxSession.start(limits=FAST)
    try:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
            link = tarfile.TarInfo("tmp_link")
            link.type, link.linkname = tarfile.SYMTYPE, "/tmp"
            tar.addfile(link)
            for name in ("tmp_link/escaped", "../up", "/abs", "ok/../../x", "fine.txt"):
                info = tarfile.TarInfo(name)
                info.size = 3
                tar.addfile(info, io.BytesIO(b"bad"))
        applied = await session.apply_changes(buffer.getvalue())
        assert json.loads(applied.stdout) | {"first_skipped": None} == {
            "applied": 2,
            "skipped": 4,
            "first_skipped": None,
        }, applied
        listing = await session.exec("ls -A /tmp; ls -A; cat fine.txt")
        assert listing.stdout == "fine.txt\ntmp_link\nbad", listing

        broken = await session.apply_changes(b"this is not a tar")
        assert broken.return_code == 2 and "not a tar" in broken.stdout, broken

        await session.exec("head -c 200000 /dev/zero > big")
        with pytest.raises(ChangesTooLargeError, match="bound 100000"):
            await session.export_changes(max_bytes=100_000)
    finally:
        await session.close()


async def test_binds_are_read_only_and_stay_out_of_the_sandboxs_own_places(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "tool.txt").write_text("from the host\n")
    # At another path, and at its own path under /tmp (on top of the sandbox's own /tmp).
    assert str(shared).startswith("/tmp/")
    session = await SandboxSession.start(
        limits=FAST, binds={str(shared): "/opt/tools", str(tmp_path): str(tmp_path)}
    )
    try:
        run = await session.exec(
            f"cat /opt/tools/tool.txt {shared}/tool.txt; echo x > /opt/tools/new 2>&1 || echo refused; "
            f"echo x > {shared}/new2 2>&1 || echo refused; echo ok > /tmp/mine && cat /tmp/mine"
        )
        assert run.stdout.startswith("from the host\nfrom the host\n"), run
        assert (run.stdout + run.stderr).count("refused") == 2 and run.stdout.endswith("ok\n"), run
        assert not (shared / "new").exists() and not (shared / "new2").exists()
    finally:
        await session.close()
    for inside in ("/workspace/x", "/tmp", "relative", "/"):
        with pytest.raises(ValueError, match="binds"):
            await SandboxSession.start(limits=FAST, binds={str(shared): inside})
