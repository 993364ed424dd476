"""The global configuration: load it, merge it, validate it, hand it to child servers.

Contract
--------
* ``load_global_config(argv)`` builds one config from, lowest precedence first:
  the YAML files named by ``config_paths`` (each file may name more, loaded transitively and
  each only once, the including file winning over what it includes), then ``env.yaml`` in the
  working directory, then the Hydra-syntax command-line overrides.
* ``validate_global_config`` checks everything that can be checked before a process starts and
  raises one :class:`ConfigError` that lists every problem, each with the file and line (or the
  command-line override) it came from.
* Child servers never parse the command line: the launcher passes them the merged config as YAML
  in ``NEMO_GYM_CONFIG_DICT`` and their own instance name in ``NEMO_GYM_CONFIG_PATH``;
  ``get_global_config_dict()`` reads it back (interpolations resolve in the child, at its start).
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import (
    InterpolationKeyError,
    InterpolationResolutionError,
    InterpolationToMissingValueError,
    MissingMandatoryValue,
)
from pydantic import BaseModel, ConfigDict

SERVER_TYPES: tuple[str, ...] = ("resources_servers", "responses_api_agents", "responses_api_models")
HEAD_SERVER_KEY_NAME = "head_server"
CONFIG_PATHS_KEY_NAME = "config_paths"
DEFAULT_HEAD_SERVER_HOST = "127.0.0.1"
DEFAULT_HEAD_SERVER_PORT = 11000

NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME = "NEMO_GYM_CONFIG_DICT"
NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME = "NEMO_GYM_CONFIG_PATH"
NEMO_GYM_SESSION_SECRET_ENV_VAR_NAME = "NEMO_GYM_SESSION_SECRET"
NEMO_GYM_LISTEN_FD_ENV_VAR_NAME = "NEMO_GYM_LISTEN_FD"
NEMO_GYM_PARENT_PID_ENV_VAR_NAME = "NEMO_GYM_PARENT_PID"

ENV_YAML_FNAME = "env.yaml"
REDACTED = "***REDACTED***"

# Top-level keys the launcher itself understands (everything else is either a server instance or a
# free value such as ``policy_base_url`` that other values interpolate).
LAUNCHER_KEYS = {
    CONFIG_PATHS_KEY_NAME,
    HEAD_SERVER_KEY_NAME,
    "isolate_server_venvs",
    "venv_cache_dir",
    "log_dir",
    "startup_timeout_s",
    "shutdown_timeout_s",
}

# The repository root when installed editable (``pip install -e .``): server folders and configs are
# looked up relative to the working directory first, then here.
PACKAGE_PARENT_DIR = Path(__file__).resolve().parent.parent


class ConfigError(Exception):
    """A configuration problem a user must fix; the message is meant to be printed as is."""


# --------------------------------------------------------------------------------------------------
# Provenance: where each dotted key was last set, so errors can say "configs/x.yaml:12".


@dataclass
class Provenance:
    locations: dict[str, str] = field(default_factory=dict)

    def where(self, dotted: str) -> str | None:
        """The location of ``dotted`` or of its closest parent that has one."""
        key = dotted
        while key:
            if key in self.locations:
                return self.locations[key]
            key = key.rpartition(".")[0]
        return None

    def update(self, other: dict[str, str]) -> None:
        self.locations.update(other)


def _node_locations(node: yaml.Node, fname: str, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = f"{prefix}{key_node.value}"
            out[key] = f"{fname}:{key_node.start_mark.line + 1}"
            out.update(_node_locations(value_node, fname, key + "."))
    return out


def load_yaml_file(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """Parse one YAML file into a dict and a map of dotted key -> ``file:line``."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"Cannot read config file {path}: {e.strerror}") from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else {}
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        snippet = ""
        if mark is not None:
            lines = text.splitlines()
            if 0 <= mark.line < len(lines):
                snippet = f"\n    {lines[mark.line]}\n    {' ' * mark.column}^"
        problem = " ".join(p for p in (e.context, e.problem) if p)
        raise ConfigError(f"Malformed YAML at {where}: {problem}{snippet}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"Malformed YAML in {path}: {e}") from None
    finally:
        loader.dispose()
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config file must be a mapping of keys to values, got {type(data).__name__}")
    return data, _node_locations(node, str(path)) if node is not None else {}


# --------------------------------------------------------------------------------------------------
# Command-line overrides (Hydra syntax).


@dataclass
class CliOverride:
    key: str
    value: Any
    delete: bool
    text: str


def parse_cli_overrides(argv: list[str]) -> list[CliOverride]:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    result = []
    for arg in argv:
        try:
            (override,) = parser.parse_overrides([arg])
        except OverrideParseException as e:
            raise ConfigError(
                f"Cannot parse command-line override {arg!r}: {e}\n"
                "Overrides use Hydra syntax, e.g. +config_paths=[a.yaml,b.yaml] ++policy_model_name=gpt-4o"
            ) from None
        if override.is_sweep_override():
            raise ConfigError(f"Command-line override {arg!r} is a sweep; sweeps are not supported here.")
        result.append(
            CliOverride(
                key=override.key_or_group,
                value=None if override.is_delete() else override.value(),
                delete=override.is_delete(),
                text=arg,
            )
        )
    return result


def _apply_overrides(cfg: DictConfig, overrides: list[CliOverride]) -> dict[str, str]:
    locations = {}
    for o in overrides:
        if o.delete:
            parent_key, _, leaf = o.key.rpartition(".")
            parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
            if isinstance(parent, DictConfig) and leaf in parent:
                del parent[leaf]
            continue
        OmegaConf.update(cfg, o.key, o.value, merge=True, force_add=True)
        locations[o.key] = f"command-line override `{o.text}`"
        if isinstance(o.value, dict):
            for sub in _flatten_keys(o.value, o.key + "."):
                locations[sub] = f"command-line override `{o.text}`"
    return locations


def _flatten_keys(d: dict, prefix: str) -> list[str]:
    out = []
    for k, v in d.items():
        out.append(prefix + str(k))
        if isinstance(v, dict):
            out.extend(_flatten_keys(v, f"{prefix}{k}."))
    return out


# --------------------------------------------------------------------------------------------------
# Loading.


def _resolve_config_path(raw: str, relative_to: Path | None, cwd: Path) -> Path | None:
    candidates = [cwd / raw]
    if relative_to is not None:
        candidates.append(relative_to / raw)
    candidates.append(PACKAGE_PARENT_DIR / raw)
    for c in candidates:
        if c.is_file():
            return c.resolve()
    return None


def _as_path_list(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple, ListConfig)):
        return [str(v) for v in value]
    raise ConfigError(f"{where}: `config_paths` must be a list of YAML file paths, got {value!r}")


@dataclass
class LoadedConfig:
    config: DictConfig
    provenance: Provenance
    files: list[Path]
    root_dir: Path


def load_global_config(
    argv: list[str] | None = None,
    initial_global_config_dict: dict | None = None,
    cwd: Path | None = None,
    load_env_yaml: bool = True,
) -> LoadedConfig:
    """Load and merge the config; see the module docstring for the precedence order."""
    cwd = (cwd or Path.cwd()).resolve()
    provenance = Provenance()
    cli_cfg = OmegaConf.create({})
    cli_locations = _apply_overrides(cli_cfg, parse_cli_overrides(argv or []))

    env_data: dict = {}
    env_locations: dict[str, str] = {}
    env_path = cwd / ENV_YAML_FNAME
    if load_env_yaml and env_path.is_file():
        env_data, env_locations = load_yaml_file(env_path)

    initial = dict(initial_global_config_dict or {})
    initial_cfg = OmegaConf.create(initial)

    roots: list[tuple[str, str, Path | None]] = []
    for source, where in (
        (initial.get(CONFIG_PATHS_KEY_NAME), "initial_global_config_dict"),
        (env_data.get(CONFIG_PATHS_KEY_NAME), str(env_path)),
        (OmegaConf.to_container(cli_cfg).get(CONFIG_PATHS_KEY_NAME), "command line"),
    ):
        for p in _as_path_list(source, where):
            roots.append((p, where, None))

    merged = OmegaConf.create({})
    files: list[Path] = []
    seen: set[Path] = set()

    def load_one(raw: str, where: str, relative_to: Path | None, stack: tuple[Path, ...]) -> None:
        nonlocal merged
        path = _resolve_config_path(raw, relative_to, cwd)
        if path is None:
            raise ConfigError(
                f"Config file {raw!r} (listed in {where}) does not exist.\n"
                f"Looked in {cwd}" + (f", {relative_to}" if relative_to else "") + f" and {PACKAGE_PARENT_DIR}."
            )
        if path in seen:
            return
        seen.add(path)
        data, locations = load_yaml_file(path)
        nested = data.pop(CONFIG_PATHS_KEY_NAME, None)
        for child in _as_path_list(nested, str(path)):
            child_where = locations.get(CONFIG_PATHS_KEY_NAME, str(path))
            load_one(child, child_where, path.parent, stack + (path,))
        try:
            merged = OmegaConf.merge(merged, OmegaConf.create(data))
        except Exception as e:  # omegaconf type clashes, e.g. a dict merged over a scalar
            raise ConfigError(f"{path}: cannot merge into the config loaded so far: {e}") from None
        provenance.update(locations)
        files.append(path)

    for raw, where, rel in roots:
        load_one(raw, where, rel, ())

    env_data.pop(CONFIG_PATHS_KEY_NAME, None)
    try:
        merged = OmegaConf.merge(initial_cfg, merged, OmegaConf.create(env_data))
    except Exception as e:
        raise ConfigError(f"{env_path}: cannot merge over the YAML config files: {e}") from None
    provenance.update(env_locations)
    cli_cfg.pop(CONFIG_PATHS_KEY_NAME, None)
    merged = OmegaConf.merge(merged, cli_cfg)
    provenance.update(cli_locations)
    merged.pop(CONFIG_PATHS_KEY_NAME, None)
    root_dir = cwd
    return LoadedConfig(config=merged, provenance=provenance, files=files, root_dir=root_dir)


# --------------------------------------------------------------------------------------------------
# Server instances.


@dataclass(frozen=True)
class ServerInstance:
    """One server process to start: ``<name>: {<server_type>: {<impl>: {...}}}``."""

    name: str
    server_type: str
    impl: str
    config_key: str  # dotted path of the impl block, e.g. "policy_model.responses_api_models.openai_model"

    @property
    def folder(self) -> str:
        return f"{self.server_type}/{self.impl}"


def find_server_dir(instance: ServerInstance, root_dir: Path) -> Path | None:
    for base in (root_dir, PACKAGE_PARENT_DIR):
        candidate = base / instance.server_type / instance.impl
        if candidate.is_dir():
            return candidate
    return None


def _close(word: str, options: list[str] | tuple[str, ...], cutoff: float = 0.6) -> list[str]:
    return difflib.get_close_matches(word, list(options), n=3, cutoff=cutoff)


def _did_you_mean(word: str, options: list[str] | tuple[str, ...]) -> str:
    matches = _close(word, options)
    if matches:
        return " Did you mean " + " or ".join(f"'{m}'" for m in matches) + "?"
    return ""


def _loc(prov: Provenance, dotted: str) -> str:
    where = prov.where(dotted)
    return f" ({where})" if where else ""


def server_instances(cfg: DictConfig, prov: Provenance | None = None) -> list[ServerInstance]:
    """All server instances in ``cfg``; raises ConfigError on blocks that are almost instances."""
    prov = prov or Provenance()
    problems: list[str] = []
    instances: list[ServerInstance] = []
    for name in cfg.keys():
        name = str(name)
        value = cfg._get_node(name)
        if name in SERVER_TYPES:
            problems.append(
                f"Top-level key '{name}'{_loc(prov, name)} is a server type, not an instance name. "
                f"Nest it under an instance name:\n      my_instance:\n        {name}:\n          <impl>: {{...}}"
            )
            continue
        if not isinstance(value, DictConfig):
            continue
        keys = [str(k) for k in value.keys()]
        type_keys = [k for k in keys if k in SERVER_TYPES]
        if not type_keys:
            near = [(k, _close(k, SERVER_TYPES, 0.75)) for k in keys]
            near = [(k, m) for k, m in near if m]
            if near:
                k, m = near[0]
                problems.append(
                    f"Top-level block '{name}'{_loc(prov, f'{name}.{k}')} looks like a server instance but "
                    f"'{k}' is not a server type. Did you mean '{m[0]}'? Server types: {', '.join(SERVER_TYPES)}."
                )
            elif name not in LAUNCHER_KEYS and _looks_like_impl_block(value):
                problems.append(
                    f"Top-level block '{name}'{_loc(prov, name)} has an `entrypoint` but no server type. "
                    f"Write it as '{name}: {{<server_type>: {{<impl>: {{entrypoint: app.py, ...}}}}}}' "
                    f"with <server_type> one of {', '.join(SERVER_TYPES)}."
                )
            continue
        if len(keys) != 1:
            extra = [k for k in keys if k not in type_keys]
            problems.append(
                f"Server instance '{name}'{_loc(prov, name)} must contain exactly one server-type key; "
                f"found {keys}. Move {extra or type_keys[1:]} inside the impl block or to a separate instance."
            )
            continue
        server_type = type_keys[0]
        type_block = value._get_node(server_type)
        if not isinstance(type_block, DictConfig) or len(type_block) != 1:
            got = list(type_block.keys()) if isinstance(type_block, DictConfig) else type_block
            problems.append(
                f"Server instance '{name}.{server_type}'{_loc(prov, f'{name}.{server_type}')} must contain "
                f"exactly one impl block (the folder name under {server_type}/), got {got!r}."
            )
            continue
        impl = str(next(iter(type_block.keys())))
        impl_block = type_block._get_node(impl)
        key = f"{name}.{server_type}.{impl}"
        if not isinstance(impl_block, DictConfig):
            problems.append(f"'{key}'{_loc(prov, key)} must be a mapping with at least `entrypoint`.")
            continue
        if "entrypoint" not in impl_block:
            problems.append(f"'{key}'{_loc(prov, key)} has no `entrypoint` (e.g. `entrypoint: app.py`).")
            continue
        instances.append(ServerInstance(name=name, server_type=server_type, impl=impl, config_key=key))
    if problems:
        raise ConfigError(_format_problems("Invalid server instance configuration", problems))
    return instances


def _looks_like_impl_block(value: DictConfig) -> bool:
    if "entrypoint" in value:
        return True
    for k in value.keys():
        child = value._get_node(k)
        if isinstance(child, DictConfig) and "entrypoint" in child:
            return True
    return False


def _format_problems(title: str, problems: list[str]) -> str:
    lines = [f"{title} ({len(problems)} problem{'s' if len(problems) != 1 else ''}):"]
    for p in problems:
        lines.append(f"  - {p}")
    return "\n".join(lines)


def _iter_leaves(node: Any, prefix: str):
    if isinstance(node, DictConfig):
        for k in node.keys():
            yield from _iter_leaves(node._get_node(k), f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(node, ListConfig):
        for i in range(len(node)):
            yield from _iter_leaves(node._get_node(i), f"{prefix}[{i}]")
    else:
        yield prefix, node


def _iter_server_refs(node: Any, prefix: str):
    """Yield (dotted_path, type, name) for every ``{type: <server_type>, name: ...}`` mapping."""
    if isinstance(node, DictConfig):
        keys = set(node.keys())
        if {"type", "name"} <= keys and node._get_node("type")._value() in SERVER_TYPES:
            yield prefix, str(node._get_node("type")._value()), str(node._get_node("name")._value())
            return
        for k in node.keys():
            yield from _iter_server_refs(node._get_node(k), f"{prefix}.{k}")
    elif isinstance(node, ListConfig):
        for i in range(len(node)):
            yield from _iter_server_refs(node._get_node(i), f"{prefix}[{i}]")


_INTERP_RE = re.compile(r"\$\{([^}]+)\}")


def find_missing_values(cfg: DictConfig, prov: Provenance) -> list[str]:
    """Every value that is ``???`` or interpolates a key that does not exist, grouped by missing key."""
    missing: dict[str, list[str]] = {}
    for path, node in _iter_leaves(cfg, ""):
        try:
            OmegaConf.select(cfg, path, throw_on_missing=True, throw_on_resolution_failure=True)
        except (MissingMandatoryValue, InterpolationToMissingValueError, InterpolationKeyError) as e:
            raw = node._value() if hasattr(node, "_value") else None
            refs = _INTERP_RE.findall(raw) if isinstance(raw, str) else []
            if not refs:
                target = path
            else:
                target = next((r for r in refs if OmegaConf.select(cfg, r, default=None) is None), refs[0])
            missing.setdefault(target, []).append(f"{path}{_loc(prov, path)}" + ("" if refs else f" [{type(e).__name__}]"))
        except InterpolationResolutionError as e:
            missing.setdefault(path, []).append(f"{path}{_loc(prov, path)}: {e}")
    out = []
    for key, users in missing.items():
        used = "" if users == [key] or (len(users) == 1 and users[0].startswith(key)) else (
            "\n        needed by: " + "\n                   ".join(users)
        )
        out.append(
            f"`{key}` is not set. Set it in {ENV_YAML_FNAME} (`{key}: <value>`) "
            f"or on the command line (`++{key}=<value>`).{used}"
        )
    return out


def validate_global_config(loaded: LoadedConfig) -> list[ServerInstance]:
    """Check the whole config before anything starts; raise one ConfigError listing every problem."""
    cfg, prov = loaded.config, loaded.provenance
    instances = server_instances(cfg, prov)
    problems: list[str] = []

    by_type: dict[str, list[str]] = {t: [] for t in SERVER_TYPES}
    for inst in instances:
        by_type[inst.server_type].append(inst.name)
        folder = find_server_dir(inst, loaded.root_dir)
        if folder is None:
            available = _available_impls(inst.server_type, loaded.root_dir)
            problems.append(
                f"'{inst.config_key}'{_loc(prov, inst.config_key)}: there is no folder "
                f"{inst.server_type}/{inst.impl}/.{_did_you_mean(inst.impl, available)}"
                + (f" Available: {', '.join(available)}." if available else "")
            )
        else:
            entry = str(OmegaConf.select(cfg, f"{inst.config_key}.entrypoint", default="app.py"))
            if not (folder / entry).is_file():
                problems.append(
                    f"'{inst.config_key}.entrypoint'{_loc(prov, inst.config_key + '.entrypoint')}: "
                    f"{folder / entry} does not exist."
                )

    all_names = [i.name for i in instances]
    for inst in instances:
        block = OmegaConf.select(cfg, inst.config_key)
        for path, ref_type, ref_name in _iter_server_refs(block, inst.config_key):
            if ref_name in by_type[ref_type]:
                continue
            if ref_name in all_names:
                actual = next(i.server_type for i in instances if i.name == ref_name)
                problems.append(
                    f"'{path}'{_loc(prov, path + '.name')} refers to '{ref_name}' as {ref_type}, "
                    f"but '{ref_name}' is a {actual} instance."
                )
                continue
            hint = _did_you_mean(ref_name, by_type[ref_type])
            known = ", ".join(by_type[ref_type]) or "none are configured"
            problems.append(
                f"'{path}'{_loc(prov, path + '.name')} refers to {ref_type} instance '{ref_name}', "
                f"which does not exist.{hint} Known {ref_type} instances: {known}."
                + (" (Did you forget to add its YAML to config_paths?)" if not hint else "")
            )

    missing = find_missing_values(cfg, prov)
    if missing:
        problems.append(
            f"Missing values ({len(missing)}):\n    " + "\n    ".join(missing)
        )
    if problems:
        raise ConfigError(_format_problems("The configuration is not valid", problems))
    return instances


def _available_impls(server_type: str, root_dir: Path) -> list[str]:
    names: set[str] = set()
    for base in (root_dir, PACKAGE_PARENT_DIR):
        d = base / server_type
        if d.is_dir():
            names.update(p.name for p in d.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))
    return sorted(names)


# --------------------------------------------------------------------------------------------------
# Redaction.

_SECRET_WORDS = {"token", "secret", "password", "passwd", "apikey"}


def is_secret_key(key: str) -> bool:
    """True for keys like ``policy_api_key``, ``hf_token``, ``clientSecret``; not ``max_tokens``."""
    lowered = key.lower()
    if "api_key" in lowered or "apikey" in lowered:
        return True
    parts = re.split(r"[^a-zA-Z0-9]+|(?<=[a-z0-9])(?=[A-Z])", key)
    return any(p.lower() in _SECRET_WORDS for p in parts if p)


def redact(value: Any) -> Any:
    """A copy of a plain (container) config with secret values replaced."""
    if isinstance(value, dict):
        return {
            k: (REDACTED if is_secret_key(str(k)) and v not in (None, "") and not isinstance(v, (dict, list)) else redact(v))
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value


# --------------------------------------------------------------------------------------------------
# The child-server side and the Python API.


class GlobalConfigDictParserConfig(BaseModel):
    """How to build the global config (kept name-compatible with upstream trainer integrations)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    initial_global_config_dict: dict | DictConfig | None = None
    skip_load_from_cli: bool = False
    skip_load_from_env_yaml: bool = False
    cli_args: list[str] | None = None


_GLOBAL_CONFIG: DictConfig | None = None


def get_global_config_dict() -> DictConfig:
    """The merged config this process runs under (from the launcher, or parsed from argv)."""
    global _GLOBAL_CONFIG
    if _GLOBAL_CONFIG is None:
        raw = os.environ.get(NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME)
        if raw is not None:
            _GLOBAL_CONFIG = OmegaConf.create(yaml.safe_load(raw))
        else:
            import sys

            _GLOBAL_CONFIG = load_global_config(sys.argv[1:]).config
    return _GLOBAL_CONFIG


def set_global_config_dict(cfg: DictConfig | dict | None) -> None:
    global _GLOBAL_CONFIG
    _GLOBAL_CONFIG = None if cfg is None else OmegaConf.create(cfg)


def config_to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=False)
