"""The server runtime: what runs inside every model, resources and agent server process.

The base classes' upstream paths (``nemo_gym.server_utils``, ``nemo_gym.base_resources_server``,
``nemo_gym.base_responses_api_agent``, ``nemo_gym.base_responses_api_model``) sit at the package's top,
on this layer. Here: the ASGI layer every request goes through (:mod:`~nemo_gym.server.asgi`: run
token, body limit, session cookie, error answers), the guard against slow or silent clients
(:mod:`~nemo_gym.server.accept_limit`), cancelling work whose client went away
(:mod:`~nemo_gym.server.disconnect`), a server process's side of the launcher's promises
(:mod:`~nemo_gym.server.startup`: die with the launcher, report the config verdict), tools over MCP
(:mod:`~nemo_gym.server.mcp`) and model-call capture (:mod:`~nemo_gym.server.model_calls`).

May import: everything below it (base modules, ``config``, ``openai_utils``, ``kit``, ``client``);
never ``run``, ``collection`` or ``tools``, so a server process never loads the launcher.
"""
