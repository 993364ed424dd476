"""Starting, watching and stopping the server processes of one run, one module per concept.

Import each name from the module that defines it:

* :mod:`~nemo_gym.run.supervision.core`: :class:`ServerSupervisor` and the order of start-up (its contract).
* :mod:`~nemo_gym.run.supervision.children`: one server process (:class:`ChildServer`), the spawner
  thread and the child's parent watch (children die with the launcher), :class:`StartupError`.
* :mod:`~nemo_gym.run.supervision.placement`: replica counts, explicit ports, the busy head port.
* :mod:`~nemo_gym.run.supervision.spawning`: the config YAML each child receives, spawning, log relay.
* :mod:`~nemo_gym.run.supervision.verdicts`: the config-verdict protocol, both sides (server and launcher).
* :mod:`~nemo_gym.run.supervision.readiness`: health-polling, dead servers, how a server exited.
* :mod:`~nemo_gym.run.supervision.ray_groups`: instances placed on a Ray cluster.
* :mod:`~nemo_gym.run.supervision.head`: the head server in this process and the run token.
* :mod:`~nemo_gym.run.supervision.instances`: the rows of ``/server_instances`` and their table.
* :mod:`~nemo_gym.run.supervision.shutdown`: stopping everything, bounded and idempotent.
"""
