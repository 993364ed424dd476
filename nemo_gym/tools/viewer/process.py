"""Run ``ng_viewer`` as a child process (for the benchmark and the screenshot script).

:class:`ViewerProcess` starts ``python -m nemo_gym.tools.viewer`` in its own session, reads its output on
a thread, waits (bounded) for the ``open http://...`` line, and on exit stops it by pid: SIGTERM,
then SIGKILL after a bound.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from types import TracebackType

URL_RE = re.compile(r"ng_viewer: open (http://\S+)")
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0


class ViewerProcess:
    """``with ViewerProcess([...args]) as v: v.url`` — a running viewer, stopped on exit."""

    def __init__(self, args: list[str], start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.args = args
        self.start_timeout_s = start_timeout_s
        self.lines: list[str] = []
        self.url = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self._cond = threading.Condition()
        self._reader: threading.Thread | None = None

    def __enter__(self) -> ViewerProcess:
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nemo_gym.tools.viewer", *self.args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        line = self.wait_for(URL_RE, self.start_timeout_s)
        if line is None:
            out = "\n".join(self.lines)
            self.stop()
            raise RuntimeError(f"ng_viewer did not start within {self.start_timeout_s:.0f} s:\n{out}")
        m = URL_RE.search(line)
        assert m is not None
        self.url = m.group(1)
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            with self._cond:
                self.lines.append(raw.decode(errors="replace").rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, pattern: re.Pattern[str], timeout: float) -> str | None:
        """The first output line matching ``pattern``, or None after ``timeout`` s or when output ends."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines:
                    if pattern.search(line):
                        return line
                left = deadline - time.monotonic()
                if left <= 0 or (self._reader is not None and not self._reader.is_alive()):
                    return None
                self._cond.wait(min(left, 0.2))

    @property
    def pid(self) -> int:
        """The viewer's process id."""
        assert self.proc is not None
        return self.proc.pid

    def stop(self) -> None:
        """SIGTERM the viewer, SIGKILL it if it is still there after ``STOP_TIMEOUT_S``."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except ProcessLookupError:
                pass
        if self._reader is not None:
            self._reader.join(timeout=2)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
