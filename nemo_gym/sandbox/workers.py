"""The sandbox's background threads: clean-up (cgroups, dirs) and starting sandboxes ahead.

Contract
--------
* :data:`_CLEANUP` (one thread) removes finished runs' cgroups and dirs nobody uses any more, off the
  event loop and off a run's critical path; :func:`remove_dir_later` queues a dir there (or removes it
  at once while the interpreter shuts down).
* :data:`_STARTER` (one thread, never retired) starts pre-started sandboxes: bwrap's
  ``--die-with-parent`` fires when the THREAD that started it exits, so they live as long as the process.
* A forked child gets fresh executors (it inherits the objects but not their threads). Both names are
  rebound then: use them as ``workers._CLEANUP`` / ``workers._STARTER``, never import them by value.
"""

from __future__ import annotations

import concurrent.futures
import os
from pathlib import Path

from nemo_gym.sandbox.trees import remove_tree

# Work kept off the event loop and off a run's critical path, in threads not tied to any loop: removing a
# finished run's cgroups (an rmdir waits for the kernel: ms) and work dir; starting the next sandbox.
_CLEANUP = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nemo-gym-sandbox-cleanup")
# bwrap's --die-with-parent (PR_SET_PDEATHSIG) fires when the THREAD that started it exits: the starter
# thread lives as long as the process (executor workers are not retired), so idle sandboxes do too.
_STARTER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nemo-gym-sandbox-start")


def _new_executors_after_fork() -> None:  # a forked child has the executors but not their threads
    global _CLEANUP, _STARTER
    _CLEANUP = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nemo-gym-sandbox-cleanup")
    _STARTER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nemo-gym-sandbox-start")


os.register_at_fork(after_in_child=_new_executors_after_fork)


def remove_dir_later(path: Path) -> None:
    """Remove a dir nobody uses any more in the clean-up thread (an rmdir can take milliseconds)."""
    try:
        _CLEANUP.submit(remove_tree, path)
    except RuntimeError:  # interpreter shutting down
        remove_tree(path)
