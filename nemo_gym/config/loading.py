"""Loading: YAML files, env.yaml, a program's values and the command line merged into one config.

Contract
--------
* :func:`load_global_config` builds one config from, lowest precedence first: the YAML files named by
  ``config_paths`` (each file may name more, loaded transitively and each only once, the including
  file winning over what it includes), then ``env.yaml`` in the working directory, then
  ``initial_global_config_dict`` (values a program passes, e.g. a trainer's live vLLM URL), then the
  Hydra-syntax command-line overrides (:mod:`nemo_gym.config.overrides`).
* A config file is looked up next to the file that lists it, then in the working directory, then in
  the repository root (:data:`~nemo_gym.config.keys.PACKAGE_PARENT_DIR`); a missing file, malformed
  YAML (with line, column and a caret) or a merge clash is a :class:`ConfigError` naming the file.
* The result, :class:`LoadedConfig`, keeps where each key was set (:class:`Provenance`) and
  ``env_yaml_data``, env.yaml as read: its values are secrets (:mod:`nemo_gym.redaction`).
* A value one config file sets over another file's is recorded (``file_overrides``);
  :func:`file_override_notes` words them (loudly for keys that route traffic or hold a credential) and
  ``ng_run`` prints them: layering is allowed, a silent redirect of a server is not.
* ``+env=<name>`` (for the commands that start servers, ``expand_env``) puts environment ``<name>``'s
  ``configs/<name>.yaml`` (a folder here, in the repository or in an installed package:
  :mod:`nemo_gym.config.discovery`) first among the config files; an unknown name is a ConfigError
  with a "did you mean".
* Loading checks nothing beyond syntax: :mod:`nemo_gym.config.validation` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from nemo_gym.config.discovery import env_config_path, env_names
from nemo_gym.config.keys import CONFIG_PATHS_KEY_NAME, ENV_KEY_NAME, ENV_YAML_FNAME, PACKAGE_PARENT_DIR
from nemo_gym.config.overrides import _apply_overrides, _flatten_keys, parse_cli_overrides
from nemo_gym.config.problems import ConfigError, Provenance, did_you_mean


def _node_locations(node: yaml.Node, fname: str, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = f"{prefix}{key_node.value}"
            out[key] = f"{fname}:{key_node.start_mark.line + 1}"
            out.update(_node_locations(value_node, fname, key + "."))
    return out


def _display_path(path: Path, cwd: Path | None) -> str:
    """``path`` relative to ``cwd`` when it is inside it (shorter error messages), else absolute."""
    if cwd is not None:
        try:
            return str(path.relative_to(cwd))
        except ValueError:
            pass
    return str(path)


def load_yaml_file(path: Path, display_name: str | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Parse one YAML file into a dict and a map of dotted key -> ``file:line``."""
    name = display_name or str(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"Cannot read config file {name}: {e.strerror}") from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else {}
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{name}:{mark.line + 1}:{mark.column + 1}" if mark else name
        snippet = ""
        if mark is not None:
            lines = text.splitlines()
            if 0 <= mark.line < len(lines):
                snippet = f"\n    {lines[mark.line]}\n    {' ' * mark.column}^"
        problem = e.problem or "invalid YAML"
        started = ""
        if e.context and e.context_mark is not None and e.problem_mark is not None:
            started = f" ({e.context} started at line {e.context_mark.line + 1}, column {e.context_mark.column + 1})"
        elif e.context:
            started = f" ({e.context})"
        raise ConfigError(
            f"Malformed YAML at {where}: {problem}{started}{snippet}\n"
            "Fix the YAML syntax there (indent with spaces, close every [ and {, quote values containing ': ')."
        ) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"Malformed YAML in {name}: {e}") from None
    finally:
        loader.dispose()
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{name}: a config file must be a mapping of keys to values (`key: value` lines), "
            f"but it holds a {type(data).__name__}."
        )
    return data, _node_locations(node, name) if node is not None else {}


def _resolve_config_path(raw: str, relative_to: Path | None, cwd: Path) -> Path | None:
    """Find a config file: next to the file that lists it, then in ``cwd``, then in the repo root."""
    path = Path(raw).expanduser()
    if path.is_absolute():
        return path.resolve() if path.is_file() else None
    candidates = [relative_to / path] if relative_to is not None else []
    candidates += [cwd / path, PACKAGE_PARENT_DIR / path]
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
    raise ConfigError(
        f"{where}: `config_paths` must be a list of YAML file paths, got {value!r}. "
        "Write it as config_paths: [a.yaml, b.yaml] (on the command line: +config_paths=[a.yaml,b.yaml])."
    )


@dataclass
class LoadedConfig:
    """The merged config, where each key came from, the files read (in merge order) and the root dir."""

    config: DictConfig
    provenance: Provenance
    files: list[Path]
    root_dir: Path
    env_yaml_data: dict = field(default_factory=dict)  # env.yaml as read (its values are secrets)
    # (dotted key, where it was set first, the later config file that replaced it): a config file that
    # changes a value another file set, e.g. a server's base_url (see :func:`file_override_notes`).
    file_overrides: list[tuple[str, str, str]] = field(default_factory=list)


def _env_config(value: Any, cwd: Path) -> Path:
    """The default config of environment ``value`` (``+env=<name>``); a ConfigError with a suggestion
    when no folder or installed package provides it."""
    name = str(value).strip()
    path = env_config_path(name, cwd)
    if path is None:
        hint = did_you_mean(name, sorted(env_names(cwd)))
        raise ConfigError(
            f"+{ENV_KEY_NAME}={name}: no environment named {name!r} (a resources_servers/<name>/ folder with "
            f"configs/<name>.yaml, here, in the repository or in an installed package).{hint} "
            "`ng_list +kind=resources_servers` lists them."
        )
    return path


def load_global_config(
    argv: list[str] | None = None,
    initial_global_config_dict: dict | None = None,
    cwd: Path | None = None,
    load_env_yaml: bool = True,
    env_yaml_path: Path | str | None = None,
    expand_env: bool = False,
) -> LoadedConfig:
    """Load and merge the config; see the module docstring for the precedence order.

    With ``expand_env`` (the commands that start servers: ng_run, ng_dump_config,
    ng_e2e_collect_rollouts), a command-line ``+env=<name>`` loads that environment's default config
    before ``config_paths`` and is not itself a config value; other commands (ng_bench has its own
    ``+env``) see it as an ordinary override.

    ``env_yaml_path`` names the env.yaml-style file to read instead of ``<cwd>/env.yaml`` (a trainer's
    ``dotenv_path``); when it does not exist nothing is loaded and one line on stderr says so.
    """
    cwd = (cwd or Path.cwd()).resolve()
    provenance = Provenance()
    file_overrides: list[tuple[str, str, str]] = []
    overrides = parse_cli_overrides(argv or [])

    env_data: dict = {}
    env_locations: dict[str, str] = {}
    env_path = cwd / ENV_YAML_FNAME if env_yaml_path is None else (cwd / Path(env_yaml_path).expanduser())
    if load_env_yaml and env_yaml_path is not None and not env_path.is_file():
        import sys

        sys.stderr.write(f"nemo_gym: dotenv_path {env_path} does not exist; no env.yaml values loaded.\n")
    if load_env_yaml and env_path.is_file():
        env_data, env_locations = load_yaml_file(env_path, _display_path(env_path, cwd))
    env_yaml_data = dict(env_data)

    initial = dict(initial_global_config_dict or {})

    cli_paths: Any = None
    cli_paths_where = "the command line"
    env_roots: list[tuple[str, str]] = []
    for o in overrides:
        if o.key == CONFIG_PATHS_KEY_NAME:
            cli_paths = None if o.delete else o.value
            cli_paths_where = f"command-line override `{o.text}`"
        elif expand_env and o.key == ENV_KEY_NAME and not o.delete:
            env_roots = [(str(_env_config(o.value, cwd)), f"command-line override `{o.text}`")]
    roots: list[tuple[str, str]] = list(env_roots)
    for source, where in (
        (initial.pop(CONFIG_PATHS_KEY_NAME, None), "initial_global_config_dict"),
        (env_data.pop(CONFIG_PATHS_KEY_NAME, None), env_locations.get(CONFIG_PATHS_KEY_NAME, ENV_YAML_FNAME)),
        (cli_paths, cli_paths_where),
    ):
        for p in _as_path_list(source, where):
            roots.append((p, where))

    merged = OmegaConf.create({})
    files: list[Path] = []
    seen: set[Path] = set()

    def load_one(raw: str, where: str, relative_to: Path | None) -> None:
        nonlocal merged
        path = _resolve_config_path(raw, relative_to, cwd)
        if path is None:
            looked = [str(d) for d in (relative_to, cwd, PACKAGE_PARENT_DIR) if d is not None]
            raise ConfigError(
                f"Config file {raw!r} (listed in {where}) does not exist.\n"
                f"Looked in: {', '.join(dict.fromkeys(looked))}. Fix the path or remove it from config_paths."
            )
        if path in seen:  # diamond or cyclic includes: each file is loaded once
            return
        seen.add(path)
        data, locations = load_yaml_file(path, _display_path(path, cwd))
        nested = data.pop(CONFIG_PATHS_KEY_NAME, None)
        child_where = locations.pop(CONFIG_PATHS_KEY_NAME, _display_path(path, cwd))
        for child in _as_path_list(nested, child_where):
            load_one(child, child_where, path.parent)
        try:
            merged = OmegaConf.merge(merged, OmegaConf.create(data))
        except Exception as e:  # omegaconf type clashes, e.g. a list merged over a dict
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(
                f"{_display_path(path, cwd)}: cannot merge into the config loaded so far: {first}"
            ) from None
        _record_file_overrides(data, locations, provenance, file_overrides)
        provenance.update(locations)
        files.append(path)

    for raw, where in roots:
        load_one(raw, where, None)

    env_locations.pop(CONFIG_PATHS_KEY_NAME, None)
    try:
        merged = OmegaConf.merge(merged, OmegaConf.create(env_data))
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{ENV_YAML_FNAME}: cannot merge over the YAML config files: {first}") from None
    provenance.update(env_locations)
    # Values a program passes (a trainer's live vLLM URL, a test's script) beat YAML defaults and env.yaml.
    try:
        merged = OmegaConf.merge(merged, OmegaConf.create(initial))
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(
            f"initial_global_config_dict: cannot merge over the YAML config files: {first}"
        ) from None
    provenance.update(
        {k: "initial_global_config_dict" for k in _flatten_keys(initial, "")} if initial else {}
    )
    skipped = (CONFIG_PATHS_KEY_NAME, ENV_KEY_NAME) if expand_env else (CONFIG_PATHS_KEY_NAME,)
    provenance.update(_apply_overrides(merged, [o for o in overrides if o.key not in skipped]))
    merged.pop(CONFIG_PATHS_KEY_NAME, None)
    return LoadedConfig(
        config=merged,
        provenance=provenance,
        files=files,
        root_dir=cwd,
        env_yaml_data=env_yaml_data,
        file_overrides=file_overrides,
    )


def _leaf_keys(data: Any, prefix: str = "") -> list[str]:
    if isinstance(data, dict) and data:
        return [k for key, value in data.items() for k in _leaf_keys(value, f"{prefix}{key}.")]
    return [prefix[:-1]] if prefix else []


def _record_file_overrides(
    data: dict, locations: dict[str, str], provenance: Provenance, out: list[tuple[str, str, str]]
) -> None:
    """Note each value of ``data`` (one config file) that replaces a value another file set."""
    for key in _leaf_keys(data):
        earlier, later = provenance.locations.get(key), locations.get(key)
        if (
            earlier is not None
            and later is not None
            and earlier.rpartition(":")[0] != later.rpartition(":")[0]
        ):
            out.append((key, earlier, later))


# Key words that route requests or carry credentials: a config file changing one of these in a block
# another file wrote could send that server's traffic (and its API key) somewhere else.
_SENSITIVE_KEY_WORDS = ("url", "host", "port", "key", "token", "secret", "password", "endpoint", "entrypoint")


def file_override_notes(loaded: LoadedConfig, limit: int = 10) -> list[str]:
    """One line per config-file value that replaced another file's (at most ``limit``, then a count):
    layering files is allowed, but it is said, and loudly when the key routes traffic or holds a
    credential (a downloaded environment's config that redirects the model server's ``base_url``)."""
    lines = []
    for key, earlier, later in loaded.file_overrides[:limit]:
        leaf = key.rpartition(".")[2].lower()
        level = "WARNING" if any(w in leaf for w in _SENSITIVE_KEY_WORDS) else "note"
        lines.append(f"{level}: {later} replaces {key}, set at {earlier}")
    if len(loaded.file_overrides) > limit:
        lines.append(
            f"note: and {len(loaded.file_overrides) - limit} more value(s) replaced by later config files"
        )
    return lines


def config_to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=False)
