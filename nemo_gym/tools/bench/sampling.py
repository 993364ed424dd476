"""Sampling other processes while a benchmark runs (``ng_bench``'s suites share it).

Contract
--------
* :class:`PeakRss` samples the RSS of some processes in a thread (every ``interval_s``, and once at
  entry and exit) and keeps each one's peak; a process that is gone is skipped.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import psutil


class PeakRss:
    """Samples the RSS of some processes in a thread; keeps each one's peak."""

    def __init__(self, pids: dict[str, int], interval_s: float = 0.2):
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.peak = dict.fromkeys(pids, 0)
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        for name, proc in self.procs.items():
            try:
                self.peak[name] = max(self.peak[name], proc.memory_info().rss)
            except psutil.Error:
                pass

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> PeakRss:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sample()


def spawn_module_on_socket(
    module_args: list[str], sock: socket.socket, env: dict[str, str]
) -> subprocess.Popen:
    """``python -m <module_args>`` in a session of its own, handed the listening ``sock`` (closed here
    afterwards), with ``os.environ`` plus ``env``; its stderr kept for the error when it dies early."""
    proc = subprocess.Popen(
        [sys.executable, "-m", *module_args],
        env={**os.environ, **env},
        pass_fds=(sock.fileno(),),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    sock.close()
    return proc
