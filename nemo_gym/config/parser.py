"""Upstream's parser API: ``GlobalConfigDictParser().parse(GlobalConfigDictParserConfig(...))``.

Contract
--------
* :class:`GlobalConfigDictParserConfig` has upstream NeMo Gym's fields, each honoured (see the class);
  an unknown field is an error naming it, never silently dropped.
* :meth:`GlobalConfigDictParser.parse` loads (:func:`~nemo_gym.config.loading.load_global_config`) and
  validates (:func:`~nemo_gym.config.validation.validate_global_config`) the config; it binds no
  ports and touches no network. Holding the result for the process is ``nemo_gym.config.process``'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from omegaconf import DictConfig, OmegaConf
from pydantic import BaseModel, ConfigDict, Field, model_validator

from nemo_gym.config.keys import POLICY_API_KEY_KEY_NAME, POLICY_BASE_URL_KEY_NAME, POLICY_MODEL_NAME_KEY_NAME
from nemo_gym.config.loading import LoadedConfig, load_global_config
from nemo_gym.config.problems import _did_you_mean
from nemo_gym.config.validation import validate_global_config
from nemo_gym.redaction import redact_config


class GlobalConfigDictParserConfig(BaseModel):
    """How to build the global config; upstream NeMo Gym's fields, each honoured.

    * ``dotenv_path``: the env.yaml-style file to read (default: ``env.yaml`` in the working
      directory). A path that does not exist loads nothing, as upstream, but says so on stderr.
    * ``initial_global_config_dict``: values a program passes; they beat the YAML files and env.yaml,
      the command line beats them. Its ``config_paths`` are loaded.
    * ``skip_load_from_cli``: do not read ``sys.argv`` overrides (``cli_args`` gives them explicitly).
    * ``skip_load_from_dotenv`` (alias ``skip_load_from_env_yaml``, our earlier name): load no env.yaml.
    * ``hide_secrets``: :func:`get_global_config_dict` / :meth:`GlobalConfigDictParser.parse` return
      the config with secret values replaced (:mod:`nemo_gym.redaction`).
    * ``offline``: accepted for upstream code; our parser never touches the network or probes ports
      (ports are bound by the launcher), so parsing is always offline.

    An unknown field is an error naming it (never silently dropped).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid", populate_by_name=True)

    dotenv_path: Path | None = None
    initial_global_config_dict: dict | DictConfig | None = None
    skip_load_from_cli: bool = False
    skip_load_from_dotenv: bool = Field(default=False, alias="skip_load_from_env_yaml")
    hide_secrets: bool = False
    offline: bool = False
    cli_args: list[str] | None = None

    # Upstream's constant for parsing without a model: empty policy values and a placeholder model.
    NO_MODEL_GLOBAL_CONFIG_DICT: ClassVar[dict[str, Any]] = {
        POLICY_BASE_URL_KEY_NAME: "",
        POLICY_API_KEY_KEY_NAME: "",
        POLICY_MODEL_NAME_KEY_NAME: "",
    }

    @model_validator(mode="before")
    @classmethod
    def _name_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = set(cls.model_fields) | {"skip_load_from_env_yaml"}
            unknown = [str(k) for k in data if k not in known]
            if unknown:
                hints = "".join(_did_you_mean(k, sorted(known)) for k in unknown)
                raise ValueError(
                    f"GlobalConfigDictParserConfig got unknown field(s) {unknown}.{hints} "
                    f"Fields: {', '.join(sorted(known))}."
                )
            if "skip_load_from_env_yaml" in data and "skip_load_from_dotenv" in data:
                if bool(data["skip_load_from_env_yaml"]) != bool(data["skip_load_from_dotenv"]):
                    raise ValueError(
                        "GlobalConfigDictParserConfig: skip_load_from_env_yaml and skip_load_from_dotenv are "
                        "the same setting and were given different values; pass only skip_load_from_dotenv."
                    )
                data = {k: v for k, v in data.items() if k != "skip_load_from_env_yaml"}
        return data

    @property
    def skip_load_from_env_yaml(self) -> bool:
        """Our earlier name of :attr:`skip_load_from_dotenv`."""
        return self.skip_load_from_dotenv

    def initial_dict(self) -> dict | None:
        """``initial_global_config_dict`` as a plain dict (interpolations kept as written)."""
        initial = self.initial_global_config_dict
        if isinstance(initial, DictConfig):
            return OmegaConf.to_container(initial, resolve=False)  # type: ignore[return-value]
        return None if initial is None else dict(initial)

    def argv(self) -> list[str]:
        """The command-line overrides to apply: ``cli_args``, else ``sys.argv[1:]`` unless skipped."""
        import sys

        if self.cli_args is not None:
            return list(self.cli_args)
        return [] if self.skip_load_from_cli else sys.argv[1:]

    def load(self, cwd: Path | None = None) -> LoadedConfig:
        """Load and merge the config these settings describe (see :func:`load_global_config`)."""
        return load_global_config(
            self.argv(),
            initial_global_config_dict=self.initial_dict(),
            cwd=cwd,
            load_env_yaml=not self.skip_load_from_dotenv,
            env_yaml_path=self.dotenv_path,
        )


class GlobalConfigDictParser:
    """Upstream's parser class: ``GlobalConfigDictParser().parse(parser_config) -> DictConfig``.

    ``parse`` loads (:func:`load_global_config`) and validates (:func:`validate_global_config`, which
    raises one :class:`ConfigError` listing every problem) the config. Ports are not assigned here:
    our launcher binds them when it starts the servers.
    """

    def parse(self, parse_config: GlobalConfigDictParserConfig | None = None) -> DictConfig:
        parse_config = parse_config or GlobalConfigDictParserConfig()
        loaded = parse_config.load()
        validate_global_config(loaded)
        if parse_config.hide_secrets:
            return OmegaConf.create(redact_config(OmegaConf.to_container(loaded.config, resolve=False)))
        return loaded.config

    def parse_no_environment(self, initial_global_config_dict: dict | DictConfig | None = None) -> DictConfig:
        """Parse ``initial_global_config_dict`` alone: no command line, no env.yaml."""
        return self.parse(
            GlobalConfigDictParserConfig(
                initial_global_config_dict=initial_global_config_dict,
                skip_load_from_cli=True,
                skip_load_from_dotenv=True,
            )
        )
