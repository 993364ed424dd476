"""The whole-config check: everything that can be checked before a process starts.

Contract
--------
* :func:`validate_global_config` raises ONE :class:`ConfigError` listing every problem, each with the
  file and line (or the command-line override) it came from: malformed or almost-instances, missing
  server folders and entrypoints, references to instances that do not exist (naming the config file
  that defines one), mistyped ng_run options (:mod:`nemo_gym.config.options`), a bad port range or
  connection limit, ``+tracing`` set wrongly or without its packages (:mod:`nemo_gym.config.tracing`), and missing or unresolvable values (:mod:`nemo_gym.config.missing`). It returns
  the server instances when there is none.
* Typos inside server blocks are found by each server's config class, before any server starts
  (:mod:`nemo_gym.run.supervision.verdicts`).
"""

from __future__ import annotations

from omegaconf import OmegaConf

from nemo_gym.config.discovery import ENTRY_POINT_GROUP
from nemo_gym.config.instances import (
    ServerInstance,
    _available_impls,
    _configs_defining,
    _iter_server_refs,
    find_server_dir,
    scan_server_instances,
)
from nemo_gym.config.keys import (
    ENV_YAML_FNAME,
    GLOBAL_AIOHTTP_CONNECTOR_LIMIT_KEY_NAME,
    GLOBAL_AIOHTTP_CONNECTOR_LIMIT_PER_HOST_KEY_NAME,
    PACKAGE_PARENT_DIR,
    PORT_RANGE_LOW_KEY_NAME,
    SERVER_TYPES,
)
from nemo_gym.config.loading import LoadedConfig
from nemo_gym.config.missing import _find_missing
from nemo_gym.config.network import configured_port_range, connection_limits_from
from nemo_gym.config.options import option_problems
from nemo_gym.config.problems import ConfigError, _did_you_mean, _format_problems, _loc
from nemo_gym.config.tracing import tracing_problems


def validate_global_config(loaded: LoadedConfig) -> list[ServerInstance]:
    """Check the whole config before anything starts; raise one ConfigError listing every problem."""
    cfg, prov = loaded.config, loaded.provenance
    instances, problems, broken = scan_server_instances(cfg, prov, loaded.root_dir)

    by_type: dict[str, list[str]] = {t: [] for t in SERVER_TYPES}
    for inst in instances:
        by_type[inst.server_type].append(inst.name)
        folder = find_server_dir(inst, loaded.root_dir)
        if folder is None:
            available = _available_impls(inst.server_type, loaded.root_dir)
            looked = " or ".join(dict.fromkeys(str(b) for b in (loaded.root_dir, PACKAGE_PARENT_DIR)))
            problems.append(
                f"'{inst.config_key}'{_loc(prov, inst.config_key)}: there is no folder "
                f"{inst.server_type}/{inst.impl}/ (looked under {looked} and in installed packages' "
                f"{ENTRY_POINT_GROUP} entry points).{_did_you_mean(inst.impl, available)}"
                + (f" Available: {', '.join(available)}." if available else "")
            )
        else:
            entry = str(OmegaConf.select(cfg, f"{inst.config_key}.entrypoint", default="app.py"))
            if not (folder / entry).is_file():
                files = sorted(p.name for p in folder.glob("*.py"))
                problems.append(
                    f"'{inst.config_key}.entrypoint'{_loc(prov, inst.config_key + '.entrypoint')}: "
                    f"{folder / entry} does not exist."
                    + (f" Python files there: {', '.join(files)}." if files else "")
                )

    all_names = [i.name for i in instances]
    for inst in instances:
        block = OmegaConf.select(cfg, inst.config_key)
        for path, ref_type, ref_name in _iter_server_refs(block, inst.config_key):
            if ref_type not in SERVER_TYPES:
                problems.append(
                    f"'{path}.type'{_loc(prov, path + '.type')}: '{ref_type}' is not a server type."
                    f"{_did_you_mean(ref_type, SERVER_TYPES)} Server types: {', '.join(SERVER_TYPES)}."
                )
                continue
            if ref_name in by_type[ref_type] or ref_name in broken:  # broken ones are reported already
                continue
            if ref_name in all_names:
                actual = next(i.server_type for i in instances if i.name == ref_name)
                problems.append(
                    f"'{path}'{_loc(prov, path + '.name')} refers to '{ref_name}' as {ref_type}, "
                    f"but '{ref_name}' is a {actual} instance. Set `type: {actual}` or name a {ref_type} instance."
                )
                continue
            hint = _did_you_mean(ref_name, by_type[ref_type])
            known = ", ".join(by_type[ref_type]) or "none are configured"
            if not hint:
                defining = _configs_defining(ref_name, ref_type, loaded.root_dir)
                hint = (
                    f" It is defined in {', or '.join(defining)}: add that file to config_paths."
                    if defining
                    else " Did you forget to add its YAML to config_paths?"
                )
            problems.append(
                f"'{path}'{_loc(prov, path + '.name')} refers to {ref_type} instance '{ref_name}', "
                f"which does not exist.{hint} Known {ref_type} instances: {known}."
            )

    problems += option_problems(loaded, "ng_run")
    try:
        configured_port_range(cfg)
    except ValueError as e:
        problems.append(f"'{PORT_RANGE_LOW_KEY_NAME}'{_loc(prov, PORT_RANGE_LOW_KEY_NAME)}: {e}")
    for key in (GLOBAL_AIOHTTP_CONNECTOR_LIMIT_KEY_NAME, GLOBAL_AIOHTTP_CONNECTOR_LIMIT_PER_HOST_KEY_NAME):
        try:
            connection_limits_from(
                {key: OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False)}
            )
        except ValueError as e:
            problems.append(f"'{key}'{_loc(prov, key)}: {e}")
    problems += [f"'{key}'{_loc(prov, key)}: {message}" for key, message in tracing_problems(cfg)]
    count, missing = _find_missing(cfg, prov)
    if missing:
        problems.append(
            f"Missing or unresolvable values ({count}). Set each on the command line as shown, "
            f"or under the same (nested) key in {ENV_YAML_FNAME}:\n      " + "\n      ".join(missing)
        )
    if problems:
        raise ConfigError(_format_problems("The configuration is not valid", problems))
    return instances
