"""Aviary datasets that load from local files instead of a hub, and HotPotQA with an offline search.

Contract
--------
* :class:`GSM8kFileDataset`: a JSONL file of ``{"question": str, "answer": str}`` in GSM8K's own
  format (the final number after ``####``; commas allowed), so a copy of the real GSM8K
  ``train.jsonl``/``test.jsonl`` works as is. Optional ``id`` per line becomes the problem id. Each
  task is :class:`OfflineCalculatorEnv`: Aviary's own ``CalculatorEnv`` (tools ``calculator`` and
  ``submit_answer``; its rewards: correct 1, wrong 0, unparsable answer or unknown tool -1) whose
  ``reset()`` reuses its tools' descriptions and schemas (:func:`tool_of`) instead of building them
  again for every episode, whose calculator bounds its integers (:func:`bounded_calculation`) and
  whose ``submit_answer`` wants an integer answer exactly.
* :class:`HotPotQAFileDataset`: HotPotQA items in the distractor-setting format (``_id``/``id``,
  ``question``, ``answer``, ``context: [[title, [sentence, ...]], ...]``) as a JSON array (the
  official ``hotpot_*_distractor_v1.json``) or JSONL. Every item's paragraphs together form the
  search corpus. Each task is :class:`OfflineHotPotQAEnv`: Aviary's ``HotPotQAEnv`` (same tools,
  same tool schemas) whose ``search`` reads that corpus instead of fetching Wikipedia; its answer check
  is the normalised exact match unless ``evaluation_mode`` says otherwise (Aviary's default, "contains",
  pays an answer that merely contains the gold).
* Bad input fails at load with the file and line (or item number) and what is wrong.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import json
import operator
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, Self

from aviary.core import Message, TaskDataset, Tool
from aviary.envs.gsm8k import CalculatorEnv, CalculatorEnvConfig
from aviary.envs.hotpotqa import HotPotQAEnv, HotPotQAEnvConfig
from aviary.envs.hotpotqa.env import normalize_answer
from aviary.utils import EvalAnswerMode, eval_answer
from nemo_gym.jsonl import iter_jsonl_objects
from nemo_gym.kit import pyast
from resources_servers.aviary.app import resolve_data_path
from resources_servers.aviary.schemas import AviaryResourcesServerConfig

_GSM8K_FINAL = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)


class DatasetFileError(ValueError):
    """A dataset file (or one line of it) is not in the expected format."""


def _jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    return iter_jsonl_objects(path, error=DatasetFileError)


def parse_gsm8k_answer(answer: str) -> float:
    """The final number of a GSM8K answer (``... #### 1,234`` -> 1234.0); ValueError when absent."""
    m = _GSM8K_FINAL.search(answer)
    if not m:
        raise ValueError("no '#### <number>' final answer")
    text = m.group(1).replace(",", "").replace("$", "").strip()
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"the final answer {m.group(1)!r} is not a number") from None


# (env class, method name) -> the Tool Aviary builds from that method; see tool_of.
_TOOL_TEMPLATES: dict[tuple[type, str], Tool] = {}


def tool_of(method: Callable[..., Any]) -> Tool:
    """``Tool.from_function(method)`` for a bound method of an env, its description and JSON schema made
    once per env class and method.

    ``Tool.from_function`` parses the docstring, builds a pydantic model of the signature and its JSON
    schema: ~3-5 ms per tool, ~7 ms of the ~7.9 ms a whole GSM8K episode cost in-process. What it builds
    depends only on the method's class (signature, docstring), so the first build is kept and every env
    gets a copy bound to its own method.
    """
    key = (type(method.__self__), method.__name__)
    template = _TOOL_TEMPLATES.get(key)
    if template is None:
        template = _TOOL_TEMPLATES[key] = Tool.from_function(method)
    return Tool(
        tool_fn=method,
        info=template.info.model_copy(deep=True),
        concurrency_safe=template.concurrency_safe,
    )


MAX_CALCULATOR_BITS = 10_000  # of any integer the calculator makes (about 3,000 digits)
_CALC_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_CALC_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_CALC_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "abs": abs,
    "round": round,
    "min": min,
    "max": max,
    "sum": sum,
}


def _bits(value: Any) -> int:
    return abs(value).bit_length() if isinstance(value, int) else 0


def bounded_calculation(expr: str) -> float | int:
    """The value of an arithmetic expression: the operators, constants and functions Aviary's GSM8K
    calculator allows, but no integer may grow past ``MAX_CALCULATOR_BITS`` bits. Aviary's evaluator
    computes ``9**9**9`` (370 million digits) in one C call that holds the GIL: the whole server stops.
    Raises ``ValueError`` (or ``ArithmeticError``, ``RecursionError``, ``MemoryError``) for anything else."""
    return _calc(pyast.parse(expr, mode="eval").body)


def _calc(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _CALC_BINARY:
        left, right = _calc(node.left), _calc(node.right)
        if isinstance(node.op, ast.Pow) and isinstance(left, int) and isinstance(right, int) and right > 0:
            if abs(left) > 1 and max(_bits(left) - 1, 1) * right > MAX_CALCULATOR_BITS:
                raise ValueError(f"the result is too large (more than {MAX_CALCULATOR_BITS} bits)")
        if isinstance(node.op, ast.Mult) and _bits(left) + _bits(right) > MAX_CALCULATOR_BITS + 1:
            raise ValueError(f"the result is too large (more than {MAX_CALCULATOR_BITS} bits)")
        value = _CALC_BINARY[type(node.op)](left, right)
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _CALC_UNARY:
        value = _CALC_UNARY[type(node.op)](_calc(node.operand))
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _CALC_FUNCTIONS:
        if node.keywords:
            raise ValueError("keyword arguments are not supported")
        value = _CALC_FUNCTIONS[node.func.id](*(_calc(arg) for arg in node.args))
    else:
        raise ValueError(f"unsupported expression: {type(node).__name__}")
    if _bits(value) > MAX_CALCULATOR_BITS:
        raise ValueError(f"the result is too large (more than {MAX_CALCULATOR_BITS} bits)")
    return value


class OfflineCalculatorEnv(CalculatorEnv):
    """Aviary's ``CalculatorEnv`` whose ``reset()`` makes its tools with :func:`tool_of` (the same tools,
    ~0.1 ms instead of ~7 ms; tests compare both resets), with two of its tools made safe to reward:

    * ``calculator`` evaluates with :func:`bounded_calculation` (the same expressions, but integers
      bounded: a power tower no longer stops the server);
    * ``submit_answer`` wants an integer answer exactly (``29`` or ``29.0``; Aviary's relative tolerance
      of ``rel_tol`` accepted ``29.0028``, and ``20001`` for ``20000``); a non-integer answer keeps the
      tolerance.

    Same docstrings, so the model sees the same tool schemas."""

    async def reset(self) -> tuple[list[Message], list[Tool]]:
        # CalculatorEnv.reset, with tool_of for Tool.from_function.
        self.state = None
        self.tools = [tool_of(self.calculator), tool_of(self.submit_answer)]
        return [Message(content=self.problem)], self.tools

    def calculator(self, expr: str) -> tuple[float | str, float, bool]:
        try:
            result = bounded_calculation(expr.strip())
            with contextlib.suppress(ValueError):  # as Aviary: an integral float is shown as an integer
                if int(result) == result:
                    result = int(result)
        except Exception as exc:  # noqa: BLE001 - every failure is the model's tool error, as in Aviary
            return (
                f"Error using calculator: {exc!r}.",
                self.config.tool_failure_reward,
                self.config.done_on_failure,
            )
        return result, self.config.tool_success_reward, False

    calculator.__doc__ = CalculatorEnv.calculator.__doc__

    def submit_answer(self, answer: str) -> tuple[bool, float, Literal[True]]:
        try:
            value = float(answer)
        except (TypeError, ValueError):
            return False, self.config.tool_failure_reward, True
        tol = self.config.rel_tol
        if self.answer.is_integer():
            correct = value == self.answer
        else:
            correct = abs(value - self.answer) / (abs(self.answer) + tol) < tol
        return correct, (self.config.correct_reward if correct else self.config.incorrect_reward), True

    submit_answer.__doc__ = CalculatorEnv.submit_answer.__doc__


class GSM8kFileDataset(TaskDataset[CalculatorEnv]):
    """GSM8K-format problems from a local JSONL file (see the module docstring)."""

    DEFAULT_FILE = "gsm8k_problems.jsonl"

    def __init__(self, jsonl_fpath: str | Path, config: CalculatorEnvConfig | dict | None = None):
        self.path = Path(jsonl_fpath)
        self.config = (
            CalculatorEnvConfig(**config) if isinstance(config, dict) else config or CalculatorEnvConfig()
        )
        self.problems: list[tuple[str, str, float]] = []
        for line_no, obj in _jsonl(self.path):
            q, a = obj.get("question"), obj.get("answer")
            if not isinstance(q, str) or not q.strip():
                raise DatasetFileError(f"{self.path}:{line_no}: field 'question' must be a non-empty string")
            if not isinstance(a, str | int | float) or isinstance(a, bool):
                raise DatasetFileError(
                    f"{self.path}:{line_no}: field 'answer' must be a string like '... #### 42'"
                )
            try:
                num = float(a) if not isinstance(a, str) else parse_gsm8k_answer(a)
            except ValueError as e:
                raise DatasetFileError(f"{self.path}:{line_no}: field 'answer': {e}") from None
            pid = str(obj.get("id") or f"{self.path.stem}_{len(self.problems)}")
            self.problems.append((pid, q, num))
        if not self.problems:
            raise DatasetFileError(f"{self.path}: no problems in the file")

    @classmethod
    def from_config(cls, config: AviaryResourcesServerConfig) -> Self:
        return cls(resolve_data_path(config.dataset_jsonl_fpath, cls.DEFAULT_FILE), config.env_kwargs or None)

    def __len__(self) -> int:
        return len(self.problems)

    def get_new_env_by_idx(self, idx: int) -> OfflineCalculatorEnv:
        pid, question, answer = self.problems[idx]
        return OfflineCalculatorEnv(problem_id=pid, problem=question, answer=answer, config=self.config)


# ------------------------------------------------------------------------------------------------
# HotPotQA.


def _key(title: str) -> str:
    return " ".join(title.replace("_", " ").replace("+", " ").lower().split())


class HotPotQACorpus:
    """Paragraphs by title (first occurrence of a title wins), searchable by title."""

    def __init__(self) -> None:
        self.paragraphs: dict[str, tuple[str, list[str]]] = {}

    def add(self, title: str, sentences: list[str]) -> None:
        self.paragraphs.setdefault(_key(title), (title, sentences))

    def get(self, entity: str) -> tuple[str, list[str]] | None:
        return self.paragraphs.get(_key(entity.strip("[]")))

    def similar(self, entity: str, n: int = 5) -> list[str]:
        keys = difflib.get_close_matches(_key(entity), list(self.paragraphs), n=n, cutoff=0.3)
        words = set(_key(entity).split())
        keys += [k for k in self.paragraphs if k not in keys and words & set(k.split())]
        return [self.paragraphs[k][0] for k in keys[:n]]


class OfflineHotPotQAEnv(HotPotQAEnv):
    """Aviary's HotPotQA env whose ``search`` reads a local corpus (scoring and other tools unchanged)."""

    def __init__(self, *args: Any, corpus: HotPotQACorpus, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.corpus = corpus

    async def search(self, entity: str) -> str:
        if not entity:
            self.state.done = True
            return "Search failed. No entity provided."
        found = self.corpus.get(str(entity))
        if found is None:
            self.state.page = None
            return f"Search for {entity!r} returned no results. Similar: {self.corpus.similar(str(entity))}."
        _title, sentences = found
        # One sentence per line: ``lookup`` returns the lines that contain its keyword.
        self.state.page = "".join(s.strip() + "\n" for s in sentences if s.strip())
        self.state.last_action_is_lookup = False
        return " ".join(s.strip() for s in sentences[:5] if s.strip())

    # The tool schema is built from the docstring: keep Aviary's, so the model sees the same tool.
    search.__doc__ = HotPotQAEnv.search.__doc__

    async def calculate_answer_reward(self, answer: str | None) -> float:
        """Aviary's check with the configured ``evaluation_mode`` really applied: Aviary passes the mode
        where ``eval_answer`` takes the question, so every HotPotQA env checked "contains" (an answer
        naming every place of the corpus, or the whole searched paragraph, was right)."""
        if answer is None:
            return self.incorrect_reward
        correct = await eval_answer(
            normalize_answer(answer),
            self.normalized_correct_answer,
            question=self.question,
            eval_mode=self.evaluation_mode,
        )
        return self.correct_reward if correct else self.incorrect_reward


class HotPotQAFileDataset(TaskDataset[OfflineHotPotQAEnv]):
    """HotPotQA distractor-format items from a local file (see the module docstring)."""

    DEFAULT_FILE = "hotpotqa_distractor.jsonl"

    def __init__(self, fpath: str | Path, config: HotPotQAEnvConfig | dict | None = None):
        self.path = Path(fpath)
        # The answer check is the normalised exact match (HotPotQA's EM) unless the config names another:
        # Aviary's default, "contains", pays any answer that contains the gold (every place of the corpus
        # in one answer, the whole searched paragraph).
        if config is None or isinstance(config, dict):
            config = HotPotQAEnvConfig(**{"evaluation_mode": EvalAnswerMode.EXACT, **(config or {})})
        self.config = config
        self.corpus = HotPotQACorpus()
        self.items: list[tuple[str, str, str]] = []
        for where, obj in self._read():
            qid, q, a, ctx = (
                obj.get("_id", obj.get("id")),
                obj.get("question"),
                obj.get("answer"),
                obj.get("context"),
            )
            if not isinstance(q, str) or not q.strip():
                raise DatasetFileError(f"{where}: field 'question' must be a non-empty string")
            if not isinstance(a, str) or not a.strip():
                raise DatasetFileError(f"{where}: field 'answer' must be a non-empty string")
            if not isinstance(ctx, list) or not all(
                isinstance(p, list)
                and len(p) == 2
                and isinstance(p[0], str)
                and isinstance(p[1], list)
                and all(isinstance(s, str) for s in p[1])
                for p in ctx
            ):
                raise DatasetFileError(f"{where}: field 'context' must be [[title, [sentence, ...]], ...]")
            for title, sentences in ctx:
                self.corpus.add(title, sentences)
            self.items.append((str(qid or f"{self.path.stem}_{len(self.items)}"), q, a))
        if not self.items:
            raise DatasetFileError(f"{self.path}: no items in the file")

    def _read(self) -> Iterator[tuple[str, dict[str, Any]]]:
        text_start = self.path.read_text(encoding="utf-8").lstrip()[:1]
        if text_start == "[":
            try:
                data = json.loads(self.path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise DatasetFileError(f"{self.path}: not valid JSON ({e})") from None
            for i, obj in enumerate(data):
                if not isinstance(obj, dict):
                    raise DatasetFileError(f"{self.path}: item {i}: expected an object")
                yield f"{self.path}: item {i}", obj
        else:
            for line_no, obj in _jsonl(self.path):
                yield f"{self.path}:{line_no}", obj

    @classmethod
    def from_config(cls, config: AviaryResourcesServerConfig) -> Self:
        return cls(resolve_data_path(config.dataset_jsonl_fpath, cls.DEFAULT_FILE), config.env_kwargs or None)

    def __len__(self) -> int:
        return len(self.items)

    def get_new_env_by_idx(self, idx: int) -> OfflineHotPotQAEnv:
        qid, question, answer = self.items[idx]
        c = self.config
        return OfflineHotPotQAEnv(
            question_id=None,
            question=question,
            correct_answer=answer,
            correct_reward=c.correct_reward,
            incorrect_reward=c.incorrect_reward,
            tool_failure_reward=c.tool_failure_reward,
            evaluation_mode=c.evaluation_mode,
            corpus=self.corpus,
        )


__all__ = [
    "CalculatorEnv",
    "DatasetFileError",
    "GSM8kFileDataset",
    "HotPotQACorpus",
    "HotPotQAFileDataset",
    "OfflineCalculatorEnv",
    "OfflineHotPotQAEnv",
    "normalize_answer",
    "parse_gsm8k_answer",
    "tool_of",
]
