"""The server runtime: what runs inside every model, resources and agent server process.

The base classes: :mod:`~nemo_gym.server.base` (``BaseServer``, ``SimpleServer``, ``run_webserver``),
:mod:`~nemo_gym.server.resources` (resources servers: tools, sessions, ``/verify``),
:mod:`~nemo_gym.server.agent` (agents) and :mod:`~nemo_gym.server.model` (model servers); upstream's
paths for them (``nemo_gym.server_utils``, ``nemo_gym.base_resources_server``, ...) are thin faces at
the package's top. Around them: the ASGI layer every request goes through
(:mod:`~nemo_gym.server.asgi`: run token, body limit, session cookie, error answers), the rollout-id
path prefix (:mod:`~nemo_gym.server.rollout_prefix`), the guard against slow or silent clients
(:mod:`~nemo_gym.server.accept_limit`), cancelling work whose client went away
(:mod:`~nemo_gym.server.disconnect`), a server process's side of the launcher's promises
(:mod:`~nemo_gym.server.startup`: die with the launcher, report the config verdict), tools over MCP
(:mod:`~nemo_gym.server.mcp`, :mod:`~nemo_gym.server.mcp_exposure`), model-call capture
(:mod:`~nemo_gym.server.model_calls`), Prometheus metrics (:mod:`~nemo_gym.server.metrics`) and
OpenTelemetry traces (:mod:`~nemo_gym.server.tracing`, with ``+tracing=otlp``).

May import: everything below it (base modules, ``config``, ``openai_utils``, ``kit``, ``client``);
never ``run``, ``collection`` or ``tools``, so a server process never loads the launcher.
"""
