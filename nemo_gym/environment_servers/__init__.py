"""Environment servers that ship with the package (NeMo Gym 0.7's generic ones, written here).

Each folder is a server folder like those of a working directory (``app.py``, ``configs/``,
``README.md``); the package declares them in its ``nemo_gym.servers`` entry points, so a config names
them as ``environment_servers: {<folder>: {entrypoint: app.py, ...}}`` from any directory, and a folder
of the same name in the working directory takes precedence (nemo_gym.config.discovery). They import
from ``server/`` and ``client/`` and nothing imports them.
"""
