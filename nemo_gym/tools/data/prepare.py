"""``ng_prepare_data``: validate the datasets a config declares, write prepared files and metrics.

Contract (upstream NeMo Gym's option names, output names and fields; stricter where upstream is silent)
--------
``ng_prepare_data "+config_paths=[...]" +output_dirpath=DIR +mode=train_preparation|example_validation``
* Datasets are the ``datasets: [{name, type, jsonl_fpath, num_repeats?, license?, ...}]`` lists of
  agent instances (``responses_api_agents``). ``train_preparation`` takes types ``train``,
  ``validation`` and ``benchmark``; ``example_validation`` takes ``example``.
* ``jsonl_fpath`` is found relative to the working directory, then the repository root. A missing
  file is an error naming the config key that declared it (and its file:line). Everything is
  offline: ``+should_download=true`` (any ``+data_source``) is refused with the file to place.
* Every line must be a JSON object that validates as the agent's request (``BaseRunRequest``, what
  ``/run`` accepts); all problems are reported as ``file:line: field: message`` (up to 20 per file)
  and nothing is written. Blank lines are ignored.
* Per dataset: ``<dir>/<stem>_metrics.json`` (the dataset entry's ``name, type, jsonl_fpath,
  num_repeats, gitlab_identifier, huggingface_identifier, license`` plus
  :class:`nemo_gym.tools.data.metrics.DatasetMetrics`) and ``<dir>/<stem>_prepare.jsonl`` (each row
  ``num_repeats`` times, with ``agent_ref: {type: responses_api_agents, name: <agent instance>}``).
  Per type: ``<output_dirpath>/<type>.jsonl`` (the prepared files concatenated) and
  ``<output_dirpath>/<type>_metrics.json`` (metrics over every dataset of that type).
* A metrics file that exists and differs (:func:`nemo_gym.tools.data.metrics.same_metrics`) is not
  overwritten: ``<stem>_metrics_conflict.json`` is written beside it and the command exits 1 at the
  end, unless ``+overwrite_metrics_conflicts=true``. Unchanged metrics files are not rewritten. Every
  file is written to a temporary name and renamed, so an interrupted run leaves no half file.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import orjson
from omegaconf import DictConfig, ListConfig, OmegaConf
from pydantic import ValidationError

from nemo_gym.config.command import command
from nemo_gym.config.keys import PACKAGE_PARENT_DIR
from nemo_gym.config.loading import LoadedConfig, load_global_config
from nemo_gym.config.options import check_options
from nemo_gym.config.problems import ConfigError
from nemo_gym.redaction import scrub
from nemo_gym.server.resources import BaseRunRequest
from nemo_gym.tools.data.metrics import DatasetMetrics, same_metrics

AGENT_SERVER_TYPE = "responses_api_agents"
MODES = {"train_preparation": ("train", "validation", "benchmark"), "example_validation": ("example",)}
DATA_SOURCES = ("huggingface", "gitlab")
DATASET_TYPES = ("train", "validation", "example", "benchmark")
CONFIG_FIELDS = ("gitlab_identifier", "huggingface_identifier", "license")
MAX_ERRORS_PER_FILE = 20
USAGE = """\
usage: ng_prepare_data "+config_paths=[...]" +output_dirpath=DIR +mode=train_preparation|example_validation
                       [+overwrite_metrics_conflicts=true]
Validates every row of the datasets the config's agents declare, adds agent_ref, writes
<output_dirpath>/<type>.jsonl and <type>_metrics.json, and per dataset <stem>_prepare.jsonl and
<stem>_metrics.json. Offline: +should_download=true is refused."""


@dataclass
class Dataset:
    """One dataset entry of one agent instance."""

    agent: str
    key: str  # dotted config key of the entry, e.g. my_agent.responses_api_agents.simple_agent.datasets[0]
    where: str | None  # file:line that declared it
    entry: dict[str, Any]
    path: Path | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)  # filled by read_rows(keep_rows=True)
    metrics: DatasetMetrics = field(default_factory=DatasetMetrics)
    n_rows: int = 0  # valid rows, counted by read_rows

    @property
    def type(self) -> str:
        return str(self.entry["type"])

    @property
    def num_repeats(self) -> int:
        return int(self.entry.get("num_repeats") or 1)

    def label(self) -> str:
        return f"{self.key}" + (f" ({self.where})" if self.where else "")


def _option(cfg: DictConfig, key: str, default: Any = None) -> Any:
    return OmegaConf.select(cfg, key, default=default)


def _bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ConfigError(f"+{key} must be true or false, got {value!r}")


def declared_datasets(loaded: LoadedConfig) -> Iterator[Dataset]:
    """Every dataset entry of every agent instance, in config order."""
    cfg = loaded.config
    for name in map(str, cfg.keys()):
        node = cfg._get_node(name)
        if not isinstance(node, DictConfig) or AGENT_SERVER_TYPE not in node:
            continue
        impls = node[AGENT_SERVER_TYPE]
        if not isinstance(impls, DictConfig):
            continue
        for impl in map(str, impls.keys()):
            datasets = OmegaConf.select(impls[impl], "datasets", default=None)
            if datasets is None:
                continue
            base = f"{name}.{AGENT_SERVER_TYPE}.{impl}.datasets"
            if not isinstance(datasets, ListConfig):
                raise ConfigError(f"{base}{_at(loaded, base)}: must be a list of {{name, type, jsonl_fpath}}")
            for i, raw in enumerate(datasets):
                key = f"{base}[{i}]"
                where = loaded.provenance.where(key)
                if not isinstance(raw, DictConfig):
                    raise ConfigError(
                        f"{key}{_at(loaded, key)}: must be a mapping {{name, type, jsonl_fpath}}"
                    )
                entry = OmegaConf.to_container(raw, resolve=True)
                assert isinstance(entry, dict)
                missing = [k for k in ("name", "type", "jsonl_fpath") if not entry.get(k)]
                if missing:
                    raise ConfigError(f"{key}{_at(loaded, key)}: missing {', '.join(missing)}")
                if entry["type"] not in DATASET_TYPES:
                    raise ConfigError(
                        f"{key}.type{_at(loaded, key)}: {entry['type']!r} is not one of {', '.join(DATASET_TYPES)}"
                    )
                yield Dataset(agent=name, key=key, where=where, entry=entry)


def _at(loaded: LoadedConfig, key: str) -> str:
    where = loaded.provenance.where(key)
    return f" ({where})" if where else ""


def locate(dataset: Dataset, cwd: Path) -> Path | None:
    raw = Path(str(dataset.entry["jsonl_fpath"]))
    candidates = [raw] if raw.is_absolute() else [cwd / raw, PACKAGE_PARENT_DIR / raw]
    return next((p for p in candidates if p.is_file()), None)


def _error_text(e: ValidationError) -> list[str]:
    out = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err.get("loc", ())) or "(row)"
        out.append(f"{loc}: {err.get('msg', 'invalid')}")
    return out


def read_rows(dataset: Dataset, keep_rows: bool = True) -> list[str]:
    """Validate (and with ``keep_rows`` load) the dataset's rows; returns the problems (``file:line: ...``).

    Without ``keep_rows`` only ``n_rows`` and the metrics are kept (memory does not grow with the
    file); :func:`iter_valid_rows` reads the rows again when they are needed."""
    assert dataset.path is not None
    problems: list[str] = []
    hidden = 0
    with dataset.path.open("rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            errors: list[str] = []
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError as e:
                row, errors = None, [f"not valid JSON ({e})"]
            if row is not None and not isinstance(row, dict):
                errors = [f"expected a JSON object, got {type(row).__name__}"]
            elif row is not None:
                try:
                    BaseRunRequest.model_validate(row)
                except ValidationError as e:
                    errors = _error_text(e)
            if errors:
                for text in errors:
                    if len(problems) < MAX_ERRORS_PER_FILE:
                        problems.append(f"{dataset.path}:{lineno}: {text}")
                    else:
                        hidden += 1
                continue
            assert isinstance(row, dict)
            dataset.n_rows += 1
            if keep_rows:
                dataset.rows.append(row)
            for _ in range(dataset.num_repeats):
                dataset.metrics.observe(row)
    if hidden:
        problems.append(f"{dataset.path}: ... and {hidden} more problems")
    return problems


def iter_valid_rows(dataset: Dataset) -> Iterator[dict[str, Any]]:
    """The rows of a dataset :func:`read_rows` found valid (it raised nothing), read again lazily."""
    assert dataset.path is not None
    with dataset.path.open("rb") as f:
        for line in f:
            if line.strip():
                yield orjson.loads(line)


@contextlib.contextmanager
def atomic_writer(path: Path) -> Iterator[BinaryIO]:
    """:func:`write_atomic` for data written piece by piece: a temporary file beside ``path``, renamed
    to it when the block ends without an error (removed otherwise)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb", buffering=1 << 20) as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file beside it: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def json_file_bytes(data: Any) -> bytes:
    """``data`` as an indented JSON document ending in a newline (how metrics files are written)."""
    return orjson.dumps(data, option=orjson.OPT_INDENT_2) + b"\n"


def write_metrics(path: Path, metrics: dict[str, Any], overwrite: bool) -> str | None:
    """Write ``metrics`` to ``path`` unless an existing file differs; returns the conflict file written."""
    if path.is_file():
        try:
            old = orjson.loads(path.read_bytes())
        except orjson.JSONDecodeError:
            old = None
        if isinstance(old, dict) and same_metrics(old, metrics):
            return None
        if old is not None and not overwrite:
            conflict = path.with_name(path.stem + "_conflict.json")
            write_atomic(conflict, json_file_bytes(metrics))
            return str(conflict)
    write_atomic(path, json_file_bytes(metrics))
    return None


def prepare(loaded: LoadedConfig, output_dirpath: Path, mode: str, overwrite: bool) -> list[str]:
    """Run the preparation; returns the conflict files written. Raises ConfigError for bad input."""
    types = MODES[mode]
    cwd = loaded.root_dir
    datasets = [d for d in declared_datasets(loaded) if d.type in types]
    if not datasets:
        raise ConfigError(
            f"ng_prepare_data: no agent in the config declares a dataset of type {' / '.join(types)} "
            f"(mode {mode}). Config files read: {', '.join(map(str, loaded.files)) or 'none'}"
        )
    missing = []
    for d in datasets:
        d.path = locate(d, cwd)
        if d.path is None:
            missing.append(
                f"  - {d.label()}: jsonl_fpath {d.entry['jsonl_fpath']!r} does not exist "
                f"(looked in {cwd} and {PACKAGE_PARENT_DIR})"
            )
    if missing:
        raise ConfigError("ng_prepare_data: dataset files are missing:\n" + "\n".join(missing))
    problems: list[str] = []
    for d in datasets:
        print(f"Validating {d.type} dataset {d.entry['name']!r} of {d.agent}: {d.path}", flush=True)
        problems += read_rows(d)
    if problems:
        raise ConfigError(
            "ng_prepare_data: rows that are not valid agent requests (nothing was written):\n"
            + "\n".join(f"  - {p}" for p in problems)
        )

    conflicts: list[str] = []
    for d in datasets:
        assert d.path is not None
        header = {
            "name": d.entry["name"],
            "type": d.type,
            "jsonl_fpath": d.entry["jsonl_fpath"],
            "num_repeats": d.num_repeats,
            **{k: d.entry.get(k) for k in CONFIG_FIELDS},
        }
        conflict = write_metrics(
            d.path.with_name(d.path.stem + "_metrics.json"), {**header, **d.metrics.to_json()}, overwrite
        )
        conflicts += [conflict] if conflict else []
        ref = {"type": AGENT_SERVER_TYPE, "name": d.agent}
        lines = [orjson.dumps({**row, "agent_ref": ref}) for row in d.rows for _ in range(d.num_repeats)]
        write_atomic(d.path.with_name(d.path.stem + "_prepare.jsonl"), b"".join(x + b"\n" for x in lines))

    for kind in types:
        of_type = [d for d in datasets if d.type == kind]
        if not of_type:
            continue
        total = DatasetMetrics()
        chunks = []
        for d in of_type:
            total.merge(d.metrics)
            assert d.path is not None
            chunks.append(d.path.with_name(d.path.stem + "_prepare.jsonl").read_bytes())
        out = output_dirpath / f"{kind}.jsonl"
        write_atomic(out, b"".join(chunks))
        conflict = write_metrics(output_dirpath / f"{kind}_metrics.json", total.to_json(), overwrite)
        conflicts += [conflict] if conflict else []
        print(f"Wrote {out} ({total.examples} rows from {len(of_type)} dataset(s)) and {kind}_metrics.json")
    return conflicts


@command("ng_prepare_data")
def main(argv: list[str] | None = None) -> None:
    """``ng_prepare_data`` entry point; see the module docstring."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help", "help") for a in argv):
        print(USAGE)
        return
    try:
        loaded = load_global_config(argv)
        check_options(loaded, "ng_prepare_data", strict_cli=True)
        cfg = loaded.config
        output = _option(cfg, "output_dirpath")
        mode = _option(cfg, "mode")
        if not output:
            raise ConfigError("ng_prepare_data: +output_dirpath=DIR is required.\n" + USAGE)
        if mode not in MODES:
            raise ConfigError(f"ng_prepare_data: +mode must be one of {', '.join(MODES)}, got {mode!r}.")
        source = _option(cfg, "data_source", "huggingface")
        if source not in DATA_SOURCES:
            raise ConfigError(
                f"ng_prepare_data: +data_source must be one of {', '.join(DATA_SOURCES)}, got {source!r}."
            )
        if _bool(_option(cfg, "should_download", False), "should_download"):
            raise ConfigError(
                f"ng_prepare_data: +should_download=true (from {source}) is not available: this runtime works "
                "offline and never downloads datasets. Put each dataset file at its jsonl_fpath and run again "
                "without +should_download."
            )
        overwrite = _bool(_option(cfg, "overwrite_metrics_conflicts", False), "overwrite_metrics_conflicts")
        output_dir = Path(str(output))
        if not output_dir.is_absolute():
            output_dir = loaded.root_dir / output_dir
        conflicts = prepare(loaded, output_dir, str(mode), overwrite)
    except ConfigError as e:
        sys.stderr.write(scrub(str(e).rstrip()) + "\n")
        sys.exit(2)
    if conflicts:
        sys.stderr.write(
            "ng_prepare_data: metrics changed; the old files were kept and the new metrics written beside them:\n"
            + "".join(f"  - {c}\n" for c in conflicts)
            + "Inspect them; rerun with +overwrite_metrics_conflicts=true to accept the new metrics.\n"
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
