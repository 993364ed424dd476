"""The ``unsafe_local_subprocess`` backend: limits, NO isolation (explicit opt-in only).

Contract
--------
* :class:`UnsafeLocalBackend` runs ``argv`` as this user in the work dir with an empty environment (plus
  the base variables and the caller's), the same rlimits/cgroups and process-group + cgroup kill as the
  bubblewrap backend, but NO isolation: the program has this machine's network, files and processes.
  ``python``/``python3`` become the configured sandbox Python. Only for machines without bubblewrap;
  the API logs a warning at every sandbox start with it.
"""

from __future__ import annotations

from nemo_gym.sandbox.backend_base import _BackendBase


class UnsafeLocalBackend(_BackendBase):
    """NO ISOLATION. Only for machines without bubblewrap, by explicit opt-in."""

    def _command(self, argv, *, host_dir, workdir, cwd, env, status_fd):
        program = list(argv)
        if program[0] in ("python", "python3"):
            program[0] = self.config.python
        run_cwd = str(host_dir / cwd.removeprefix(workdir).lstrip("/")) if cwd else str(host_dir)
        return program, {**self._base_env(str(host_dir)), "TMPDIR": str(host_dir), **env}, run_cwd

    def _program_rc(self, status, outer_rc, stderr, kill_reason):
        if kill_reason is not None and outer_rc < 0:
            return 128 - outer_rc
        return 128 - outer_rc if outer_rc < 0 else outer_rc
