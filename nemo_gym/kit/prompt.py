"""Prompt configs: a YAML file with a ``user`` template (and optionally a ``system`` one) that turns a
task row's fields into the ``responses_create_params.input`` messages. Upstream NeMo Gym's names.

Contract
--------
* :class:`PromptConfig` is ``{user: str, system: str | None}``; :func:`load_prompt_config` reads one
  from YAML (a relative path is looked up in the working directory, then the repository root) and
  caches it. A missing file, malformed YAML or a wrong field raises :class:`PromptConfigError`
  naming the file.
* :func:`fill_prompt` formats each template with the row's top-level fields (``str.format_map``:
  ``{question}``; literal braces are doubled). A field the template needs and the row lacks raises
  ``KeyError`` naming the field and the row's fields.
* :func:`apply_prompt_to_row` returns a new row whose ``responses_create_params.input`` is the filled
  messages (other params kept; the input row is not modified). :func:`validate_prompt_compatibility`
  refuses rows that already carry an input. :func:`materialize_prompts` does both for a JSONL file
  (errors name the file and line) and records the prompt file used on each row.
"""

from __future__ import annotations

import functools
import string
from pathlib import Path
from typing import Any

import orjson
import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from nemo_gym.config.keys import PACKAGE_PARENT_DIR
from nemo_gym.jsonl import iter_jsonl_objects

PROMPT_CONFIG_USED_KEY_NAME = "prompt_config_used"


class PromptConfigError(ValueError):
    """A prompt config file that cannot be used; the message names the file."""


class PromptConfig(BaseModel):
    """A ``user`` message template and an optional ``system`` one (``str.format`` syntax)."""

    model_config = ConfigDict(extra="forbid")

    user: str
    system: str | None = None


class MaterializePromptsConfig(BaseModel):
    """Options of :func:`materialize_prompts` as a command takes them."""

    input_jsonl_fpath: str
    prompt_config: str
    output_jsonl_fpath: str


def resolve_prompt_config_path(path: str | Path) -> Path:
    """``path`` if absolute, else the first of ``<cwd>/path`` and ``<repo root>/path`` that exists."""
    p = Path(path).expanduser()
    if p.is_absolute():
        return p
    for base in (Path.cwd(), PACKAGE_PARENT_DIR):
        if (base / p).is_file():
            return (base / p).resolve()
    return (Path.cwd() / p).resolve()


@functools.lru_cache(maxsize=64)
def _load(path: Path) -> PromptConfig:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise PromptConfigError(f"Cannot read prompt config {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise PromptConfigError(f"Prompt config {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise PromptConfigError(
            f"Prompt config {path} must be a mapping with a `user` template (and optionally `system`)."
        )
    try:
        return PromptConfig.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or '<root>'}: {err['msg']}" for err in e.errors()
        )
        raise PromptConfigError(f"Prompt config {path}: {problems}") from None


def load_prompt_config(path: str | Path) -> PromptConfig:
    """The :class:`PromptConfig` in YAML file ``path`` (cached per resolved path)."""
    return _load(resolve_prompt_config_path(path))


def _template_fields(template: str) -> list[str]:
    out = []
    for _, name, _, _ in string.Formatter().parse(template):
        if name:
            out.append(name.split(".")[0].split("[")[0])
    return out


def _fill(template: str, row: dict[str, Any], which: str) -> str:
    try:
        return template.format_map(row)
    except KeyError as e:
        missing = e.args[0]
        raise KeyError(
            f"The {which} prompt template needs field {missing!r}, which the row does not have. "
            f"Row fields: {sorted(row)}. (Write a literal brace as {{{{ or }}}}.)"
        ) from None
    except (IndexError, ValueError) as e:
        raise ValueError(f"The {which} prompt template cannot be filled: {e}") from None


def fill_prompt(prompt_config: PromptConfig, row: dict[str, Any]) -> list[dict[str, str]]:
    """The messages of ``prompt_config`` filled from ``row``: the system message (if any), then the user one."""
    messages = []
    if prompt_config.system is not None:
        messages.append({"role": "system", "content": _fill(prompt_config.system, row, "system")})
    messages.append({"role": "user", "content": _fill(prompt_config.user, row, "user")})
    return messages


def _has_input(row: dict[str, Any]) -> bool:
    params = row.get("responses_create_params")
    return isinstance(params, dict) and bool(params.get("input"))


def validate_prompt_compatibility(rows: list[dict[str, Any]], prompt_config: PromptConfig) -> None:
    """Raise ``ValueError`` listing the rows (0-based) that already have a ``responses_create_params.input``:
    a prompt config builds the input, so it must not silently replace one."""
    clashing = [i for i, row in enumerate(rows) if _has_input(row)]
    if clashing:
        shown = ", ".join(map(str, clashing[:20])) + (
            f" and {len(clashing) - 20} more" if len(clashing) > 20 else ""
        )
        raise ValueError(
            f"{len(clashing)} row(s) already have responses_create_params.input (rows {shown}); a prompt config "
            "builds the input from the row's fields. Remove the input from those rows or do not use a prompt config."
        )


def apply_prompt_to_row(row: dict[str, Any], prompt_config: PromptConfig) -> dict[str, Any]:
    """A copy of ``row`` whose ``responses_create_params.input`` is :func:`fill_prompt` of it."""
    params = row.get("responses_create_params")
    params = dict(params) if isinstance(params, dict) else {}
    params["input"] = fill_prompt(prompt_config, row)
    return {**row, "responses_create_params": params}


def materialize_prompts(
    input_jsonl_fpath: str | Path, prompt_config: str | Path, output_jsonl_fpath: str | Path
) -> int:
    """Apply the prompt config to every row of a JSONL file and write the result; returns the row count.

    Each output row also carries ``prompt_config_used`` (the resolved prompt file). A line that is not
    a JSON object, or that lacks a template field, raises ``ValueError`` naming the file and line;
    nothing is written then.
    """
    path = Path(input_jsonl_fpath)
    config_path = resolve_prompt_config_path(prompt_config)
    config = _load(config_path)
    rows = list(iter_jsonl_objects(path))
    try:
        validate_prompt_compatibility([r for _, r in rows], config)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    out_rows = []
    for lineno, row in rows:
        try:
            filled = apply_prompt_to_row(row, config)
        except (KeyError, ValueError) as e:
            raise ValueError(f"{path}:{lineno}: {e.args[0] if e.args else e}") from None
        filled[PROMPT_CONFIG_USED_KEY_NAME] = str(config_path)
        out_rows.append(filled)
    out = Path(output_jsonl_fpath)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as f:
        for row in out_rows:
            f.write(orjson.dumps(row) + b"\n")
    return len(out_rows)


def template_fields(prompt_config: PromptConfig) -> list[str]:
    """The row fields the templates of ``prompt_config`` use (for checking a dataset up front)."""
    fields = _template_fields(prompt_config.user)
    if prompt_config.system:
        fields += _template_fields(prompt_config.system)
    return sorted(set(fields))
