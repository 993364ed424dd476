"""The run: ``ng_run`` and its Python API, starting the servers of a config and keeping them alive.

:mod:`~nemo_gym.run.cli` (``ng_run``, ``ng_status``, ``ng_dump_config``, ``ng_help``, ``ng_version`` and
``RunHelper``), the supervisor that spawns, health-polls, restarts and stops the servers
(:mod:`~nemo_gym.run.supervision`), the fork server they are forked from (:mod:`~nemo_gym.run.zygote`),
the head server that hands each server the run's config
(:mod:`~nemo_gym.run.head_server`), one virtual environment per server when asked
(:mod:`~nemo_gym.run.server_venvs`), Ray clusters and replicas placed on them (:mod:`~nemo_gym.run.ray`)
and the commands' help text (:mod:`~nemo_gym.run.cli_help`).

May import: everything below it (base modules, ``config``, ``openai_utils``, ``kit``, ``client``,
``server``); never ``collection`` or ``tools``.
"""
