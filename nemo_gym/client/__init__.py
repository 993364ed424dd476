"""The client: how one process of a run talks to the servers of the run.

:class:`~nemo_gym.client.server_client.ServerClient` finds a server by instance name in the run's config
and calls it over HTTP (:mod:`~nemo_gym.client.http_transport`: one pooled aiohttp session per
process, bounded retries, every wait bounded), routes a rollout's calls to one replica of a replicated
server and fails over when a replica dies (:mod:`~nemo_gym.client.replicas`), raises the process's
open-file limit to what its connection budget needs (:mod:`~nemo_gym.client.fd_limits`), and with
``+tracing=otlp`` makes each call a span carrying the W3C ``traceparent`` (:mod:`~nemo_gym.client.tracing`).

May import: the base modules (``errors``, ``redaction``, ``jsonl``, ``auth``), ``config`` (with
``config_types`` and ``global_config``), ``openai_utils`` and ``kit``. Nothing here knows a server's
routes or the launcher. The layering of every wing is checked by ``tests/test_architecture.py``.
"""
