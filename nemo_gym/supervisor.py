"""Start, watch and stop the server processes of one run (what ``ng_run`` and ``RunHelper`` use).

The public face of :mod:`nemo_gym.supervision` (the code lives there, one module per concept; the
contract is in :mod:`nemo_gym.supervision.core`). Every name importable from here before the split
still is: :class:`ServerSupervisor`, :class:`StartupError`, :class:`ChildServer`,
:class:`DeadRayInstance`, :func:`format_instances_table`, ``ConfigError`` and the private helpers.
"""

from nemo_gym.global_config import ConfigError as ConfigError
from nemo_gym.supervision.children import LOG_TAIL_LINES as LOG_TAIL_LINES
from nemo_gym.supervision.children import ChildServer as ChildServer
from nemo_gym.supervision.children import DeadRayInstance as DeadRayInstance
from nemo_gym.supervision.children import StartupError as StartupError
from nemo_gym.supervision.children import _signal_group as _signal_group
from nemo_gym.supervision.children import _SpawnerThread as _SpawnerThread
from nemo_gym.supervision.core import ServerSupervisor as ServerSupervisor
from nemo_gym.supervision.instances import format_instances_table as format_instances_table
from nemo_gym.supervision.readiness import RAY_DEAD_CHECK_S as RAY_DEAD_CHECK_S
from nemo_gym.supervision.spawning import _resolved as _resolved

__all__ = ["ConfigError", "ServerSupervisor", "StartupError", "format_instances_table"]
