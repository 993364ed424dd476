"""Server instances: the ``<name>: {<server_type>: {<impl>: {...}}}`` blocks of a config.

Contract
--------
* :func:`server_instances` lists the instances of a config; a top-level block that is almost an
  instance (a misspelled server type, a missing impl level, no ``entrypoint``) is a
  :class:`ConfigError` saying how to write it, with the file and line (:func:`scan_server_instances`
  returns the instances, the problems and the names of the broken blocks, for the whole-config check).
* :func:`find_server_dir` finds an instance's folder under the working directory, else the repository
  root, else an installed package (:mod:`nemo_gym.config.discovery`); :func:`_iter_server_refs` yields the ``{type: ..., name: ...}`` references inside a block.
* :func:`get_first_server_config_dict` returns an instance's impl block (upstream's name), raising
  ``KeyError`` naming the known instances.
* A block laid out as a server of a kind not in ``SERVER_TYPES`` is a problem naming the kind, never a
  block left out of the run in silence.
* :func:`environment_servers_by_agent` maps each agent to the environment servers that front it (the
  agent references of an environment server: :func:`environment_server_agent_refs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from nemo_gym.config.discovery import find_folder, server_folders
from nemo_gym.config.keys import (
    AGENT_SERVER_REF_KEY_NAME,
    AGENT_SERVER_TYPE_KEY_NAME,
    ENVIRONMENT_SERVER_TYPE_KEY_NAME,
    PACKAGE_PARENT_DIR,
    SERVER_TYPES,
)
from nemo_gym.config.options import LAUNCHER_KEYS
from nemo_gym.config.problems import ConfigError, Provenance, _close, _format_problems, _loc, did_you_mean


@dataclass(frozen=True)
class ServerInstance:
    """One server process to start: ``<name>: {<server_type>: {<impl>: {...}}}``."""

    name: str
    server_type: str
    impl: str
    config_key: str  # dotted path of the impl block, e.g. "policy_model.responses_api_models.openai_model"

    @property
    def folder(self) -> str:
        """``<server_type>/<impl>``, the server's folder relative to the root dir."""
        return f"{self.server_type}/{self.impl}"


def find_server_dir(instance: ServerInstance, root_dir: Path) -> Path | None:
    """The instance's folder under ``root_dir``, else the repo root, else an installed package; else None."""
    return find_folder(instance.server_type, instance.impl, root_dir)


def _is_server_ref(node: Any) -> bool:
    return isinstance(node, DictConfig) and {"type", "name"} <= {str(k) for k in node.keys()}


def _impl_types(impl: str, root_dir: Path | None) -> list[str]:
    """The server types that have a folder named ``impl`` (to suggest where a block belongs)."""
    return [t for t in SERVER_TYPES if find_folder(t, impl, root_dir) is not None]


def scan_server_instances(
    cfg: DictConfig, prov: Provenance, root_dir: Path | None = None
) -> tuple[list[ServerInstance], list[str], set[str]]:
    """Instances, problems, and the names of top-level blocks that were meant as instances but are broken."""
    problems: list[str] = []
    broken: set[str] = set()
    instances: list[ServerInstance] = []
    types = ", ".join(SERVER_TYPES)
    for name in cfg.keys():
        name = str(name)
        value = cfg._get_node(name)
        near_type = _close(name, SERVER_TYPES, 0.75)
        if (
            near_type
            and name not in LAUNCHER_KEYS
            and isinstance(value, DictConfig)
            and not _is_server_ref(value)
            # A well-formed instance whose name resembles a type (``arc_agi_resources_server``) is fine.
            and not any(str(k) in SERVER_TYPES for k in value.keys())
        ):
            what = (
                "is a server type" if name in SERVER_TYPES else f"looks like the server type '{near_type[0]}'"
            )
            problems.append(
                f"Top-level key '{name}'{_loc(prov, name)} {what}, but the top level holds instance names. "
                f"Nest it under an instance name:\n      my_instance:\n        {near_type[0]}:\n          <impl>: {{...}}"
            )
            continue
        if not isinstance(value, DictConfig):
            continue
        keys = [str(k) for k in value.keys()]
        type_keys = [k for k in keys if k in SERVER_TYPES]
        if not type_keys:
            near = [
                (k, m)
                for k in keys
                if (m := _close(k, SERVER_TYPES, 0.75))
                and isinstance(value._get_node(k), DictConfig)
                and not _is_server_ref(value._get_node(k))
            ]
            if near:
                k, m = near[0]
                broken.add(name)
                problems.append(
                    f"Top-level block '{name}'{_loc(prov, f'{name}.{k}')} looks like a server instance but "
                    f"'{k}' is not a server type. Did you mean '{m[0]}'? Server types: {types}."
                )
            elif name not in LAUNCHER_KEYS and (kind := _unknown_kind(value)) is not None:
                # ``name: {<kind>: {<impl>: {entrypoint: ...}}}`` with a kind we do not run: an error, never
                # a block silently left out of the run (0.6 dropped 0.7's environment_servers this way).
                broken.add(name)
                problems.append(
                    f"Top-level block '{name}'{_loc(prov, f'{name}.{kind}')} is a server of unknown kind "
                    f"'{kind}'.{did_you_mean(kind, SERVER_TYPES)} Server kinds: {types}."
                )
            elif name not in LAUNCHER_KEYS and _looks_like_impl_block(value):
                broken.add(name)
                impl = next((k for k in keys if isinstance(value._get_node(k), DictConfig)), None)
                found = _impl_types(impl, root_dir) if impl and "entrypoint" not in value else []
                if found:
                    fix = f"Did you mean '{name}: {{{found[0]}: {{{impl}: {{entrypoint: ..., ...}}}}}}'?"
                else:
                    fix = (
                        f"Write it as '{name}: {{<server_type>: {{<impl>: {{entrypoint: app.py, ...}}}}}}' "
                        f"with <server_type> one of {types} and <impl> the server's folder name."
                    )
                problems.append(
                    f"Top-level block '{name}'{_loc(prov, name)} has an `entrypoint` but no server type. {fix}"
                )
            continue
        broken.add(name)
        if len(keys) != 1:
            extra = [k for k in keys if k not in type_keys]
            problems.append(
                f"Server instance '{name}'{_loc(prov, name)} must contain exactly one server-type key; "
                f"found {keys}. Move {extra or type_keys[1:]} inside the impl block or to a separate instance."
            )
            continue
        server_type = type_keys[0]
        type_block = value._get_node(server_type)
        key = f"{name}.{server_type}"
        if isinstance(type_block, DictConfig) and "entrypoint" in type_block:
            problems.append(
                f"'{key}'{_loc(prov, key)} has `entrypoint` directly under the server type; the impl folder "
                f"level is missing. Write '{name}: {{{server_type}: {{<impl>: {{entrypoint: ..., ...}}}}}}' "
                f"with <impl> the folder name under {server_type}/."
            )
            continue
        if not isinstance(type_block, DictConfig) or len(type_block) != 1:
            got = list(type_block.keys()) if isinstance(type_block, DictConfig) else type_block
            problems.append(
                f"Server instance '{key}'{_loc(prov, key)} must contain exactly one impl block (the folder "
                f"name under {server_type}/), got {got!r}. Use one instance name per server."
            )
            continue
        impl = str(next(iter(type_block.keys())))
        impl_block = type_block._get_node(impl)
        key = f"{name}.{server_type}.{impl}"
        if not isinstance(impl_block, DictConfig):
            problems.append(f"'{key}'{_loc(prov, key)} must be a mapping with at least `entrypoint: app.py`.")
            continue
        if "entrypoint" not in impl_block:
            problems.append(f"'{key}'{_loc(prov, key)} has no `entrypoint`; add `entrypoint: app.py`.")
            continue
        broken.discard(name)
        instances.append(ServerInstance(name=name, server_type=server_type, impl=impl, config_key=key))
    return instances, problems, broken


def server_instances(cfg: DictConfig, prov: Provenance | None = None) -> list[ServerInstance]:
    """All server instances in ``cfg``; raises ConfigError on blocks that are almost instances."""
    instances, problems, _ = scan_server_instances(cfg, prov or Provenance())
    if problems:
        raise ConfigError(_format_problems("Invalid server instance configuration", problems))
    return instances


def _unknown_kind(value: DictConfig) -> str | None:
    """The key of ``value`` laid out as a server kind (``{<kind>: {<impl>: {entrypoint: ...}}}``), else None."""
    for k in value.keys():
        kind_block = value._get_node(k)
        if not isinstance(kind_block, DictConfig) or "entrypoint" in kind_block:
            continue
        for impl in kind_block.keys():
            impl_block = kind_block._get_node(impl)
            if isinstance(impl_block, DictConfig) and "entrypoint" in impl_block:
                return str(k)
    return None


def _looks_like_impl_block(value: DictConfig) -> bool:
    if "entrypoint" in value:
        return True
    for k in value.keys():
        child = value._get_node(k)
        if isinstance(child, DictConfig) and "entrypoint" in child:
            return True
    return False


def _iter_server_refs(node: Any, prefix: str):
    """Yield (dotted_path, type, name) for every ``{type: ..., name: ...}`` mapping that names a server.

    ``type`` is yielded as written, so a misspelled server type can be reported; mappings whose
    ``type`` is nowhere near a server type (dataset entries: ``type: train``) are not references.
    """
    if isinstance(node, DictConfig):
        if _is_server_ref(node):
            ref_type, ref_name = _ref_value(node, "type"), _ref_value(node, "name")
            if ref_type in SERVER_TYPES or _close(ref_type, SERVER_TYPES, 0.75):
                yield prefix, ref_type, ref_name
                return
        for k in node.keys():
            yield from _iter_server_refs(node._get_node(k), f"{prefix}.{k}")
    elif isinstance(node, ListConfig):
        for i in range(len(node)):
            yield from _iter_server_refs(node._get_node(i), f"{prefix}[{i}]")


def _ref_value(node: DictConfig, key: str) -> str:
    """``node[key]`` resolved when possible (a reference may interpolate), else as written."""
    try:
        return str(node[key])
    except Exception:  # unresolvable: reported as a missing value
        return str(node._get_node(key)._value())


def _configs_defining(name: str, server_type: str, root_dir: Path, limit: int = 3) -> list[str]:
    """Server config files (``<server_type>/*/configs/*.yaml``) that define instance ``name``."""
    found: list[str] = []
    for base in dict.fromkeys((root_dir, PACKAGE_PARENT_DIR)):
        for path in sorted(base.glob(f"{server_type}/*/configs/*.yaml")):
            try:
                data = yaml.safe_load(path.read_text())
            except (OSError, yaml.YAMLError):
                continue
            if isinstance(data, dict) and isinstance(data.get(name), dict) and server_type in data[name]:
                rel = str(path.relative_to(base))
                if rel not in found:
                    found.append(rel)
            if len(found) >= limit:
                return found
    return found


def _available_impls(server_type: str, root_dir: Path) -> list[str]:
    return sorted({f.name for f in server_folders(root_dir, (server_type,))})


def get_first_server_config_dict(global_config_dict: DictConfig | dict, top_level_path: str) -> DictConfig:
    """The impl block of server instance ``top_level_path`` (``cfg[name][<server_type>][<impl>]``).

    Raises ``KeyError`` naming the known instances when there is no such instance.
    """
    block = global_config_dict.get(top_level_path) if hasattr(global_config_dict, "get") else None
    if not hasattr(block, "keys") or not block:
        known = [
            str(k)
            for k, v in global_config_dict.items()
            if hasattr(v, "keys") and any(str(t) in SERVER_TYPES for t in v.keys())
        ]
        raise KeyError(f"No server instance named {top_level_path!r}. Known instances: {known}")
    type_block = next(iter(block.values()))
    impl_block = next(iter(type_block.values())) if hasattr(type_block, "values") else None
    if impl_block is None:
        raise KeyError(
            f"Server instance {top_level_path!r} has no impl block (<server_type>: {{<impl>: ...}})."
        )
    return impl_block if isinstance(impl_block, DictConfig) else OmegaConf.create(impl_block)


def environment_server_agent_refs(server: Any) -> list[Any]:
    """The agent references in one environment server's impl block: every field whose value is a mapping
    with ``type: responses_api_agents``, and ``agent_server`` whatever its type says (upstream's rule; an
    environment server may front several agents, e.g. a user and an assistant)."""
    if not isinstance(server, dict | DictConfig):
        return []
    return [
        ref
        for field, ref in server.items()
        if isinstance(ref, dict | DictConfig)
        and (
            ref.get("type") == AGENT_SERVER_TYPE_KEY_NAME
            or (field == AGENT_SERVER_REF_KEY_NAME and ref.get("type") is None)
        )
    ]


def environment_server_agent_names(server: Any) -> list[str]:
    """The names of the agents one environment server's impl block references."""
    return [str(ref["name"]) for ref in environment_server_agent_refs(server) if ref.get("name") is not None]


def environment_servers_by_agent(cfg: Any) -> dict[str, list[str]]:
    """Agent instance name -> the environment server instances that front it, in config order."""
    out: dict[str, list[str]] = {}
    for name, block in cfg.items():
        kind_block = (
            block.get(ENVIRONMENT_SERVER_TYPE_KEY_NAME) if isinstance(block, dict | DictConfig) else None
        )
        if not isinstance(kind_block, dict | DictConfig):
            continue
        for impl_block in kind_block.values():
            for agent in environment_server_agent_names(impl_block):
                out.setdefault(agent, []).append(str(name))
    return out
