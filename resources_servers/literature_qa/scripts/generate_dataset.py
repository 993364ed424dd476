"""Write literature_qa question rows from ``questions.POOL`` against ``data/corpus.jsonl``.

    python resources_servers/literature_qa/scripts/generate_dataset.py --seed 7 --out questions.jsonl
    python resources_servers/literature_qa/scripts/generate_dataset.py --example   # data/example.jsonl

A seed shuffles the questions and the order of every multiple-choice question's options (so the right
letter moves). Rows are checked as they are written: each cited paper is in the corpus and holds the
question's evidence text, and an unanswerable question cites nothing.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))  # the repository root: run as a plain script

from nemo_gym.kit.dataset_cli import generator_main  # noqa: E402
from resources_servers.literature_qa.app import Paper, answer_numbers, load_corpus  # noqa: E402
from resources_servers.literature_qa.questions import POOL, Question  # noqa: E402

CORPUS = HERE.parent / "data" / "corpus.jsonl"
EXAMPLE_QUESTIONS = ("q02", "q14", "q29", "q34", "q36")
EXAMPLE_SEED = 2026

SYSTEM = (
    "You answer questions about scientific papers from a local library. Use search_papers to find "
    "papers (it returns ids, titles and a snippet) and read_section to read a paper's abstract, methods "
    "or results. Answer only from what the papers say. When you know the answer, call submit_answer "
    "once with the answer and the ids of the paper(s) it comes from. For a number, answer with that one "
    "number, its sign included (units may follow; no other numbers); for a multiple-choice question, "
    "answer with the option's letter. If the "
    'papers do not report the answer, submit the answer "insufficient information" with no citations.'
)

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "name": "search_papers",
        "description": "Search the library; returns the best-matching papers' ids, titles and a snippet.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "a few keywords"}},
            "required": ["query"],
            "additionalProperties": False,
        },
        "strict": True,
    },
    {
        "type": "function",
        "name": "read_section",
        "description": "Read one section of a paper.",
        "parameters": {
            "type": "object",
            "properties": {
                "paper_id": {"type": "string", "description": "an id from search_papers, e.g. LQA-001"},
                "section": {"type": "string", "enum": ["abstract", "methods", "results"]},
            },
            "required": ["paper_id", "section"],
            "additionalProperties": False,
        },
        "strict": True,
    },
    {
        "type": "function",
        "name": "submit_answer",
        "description": "Submit the final answer and the ids of the paper(s) it comes from.",
        "parameters": {
            "type": "object",
            "properties": {
                "answer": {
                    "type": "string",
                    "description": "a number, an option letter, or 'insufficient information'",
                },
                "citations": {"type": "array", "items": {"type": "string"}, "description": "paper ids"},
            },
            "required": ["answer", "citations"],
            "additionalProperties": False,
        },
        "strict": True,
    },
]


def _check(question: Question, corpus: dict[str, Paper]) -> None:
    if (question.answer is None) != (not question.citations):
        raise ValueError(f"{question.question_id}: citations must be given exactly when there is an answer")
    if isinstance(question.answer, (int, float)) and float(question.answer) in answer_numbers(
        question.question
    ):
        # the question's own numbers are read as context, not as an answer (app.committed_number)
        raise ValueError(f"{question.question_id}: the answer {question.answer} is a number of the question")
    if len(question.evidence) != len(question.citations):
        raise ValueError(f"{question.question_id}: one evidence text per cited paper")
    for paper_id, evidence in zip(question.citations, question.evidence, strict=True):
        paper = corpus.get(paper_id)
        if paper is None:
            raise ValueError(f"{question.question_id}: cites {paper_id}, which is not in the corpus")
        text = " ".join([paper.abstract, paper.methods, paper.results])
        if evidence not in text:
            raise ValueError(f"{question.question_id}: {paper_id} does not say {evidence!r}")


def row(question: Question, rng: random.Random, corpus: dict[str, Paper]) -> dict[str, Any]:
    _check(question, corpus)
    prompt = question.question
    options: dict[str, str] | None = None
    expected: float | str | None = None
    if question.kind == "multiple_choice":
        texts = list(question.distractors) + ([question.answer] if isinstance(question.answer, str) else [])
        rng.shuffle(texts)
        options = {chr(ord("A") + i): t for i, t in enumerate(texts)}
        if question.answer is not None:
            expected = next(letter for letter, t in options.items() if t == question.answer)
        prompt += "\n" + "\n".join(f"{letter}) {t}" for letter, t in options.items())
    elif question.answer is not None:
        expected = float(question.answer)
    return {
        "question_id": question.question_id,
        "kind": question.kind,
        "options": options,
        "expected_answer": expected,
        "tolerance": question.tolerance,
        "citations": list(question.citations),
        "responses_create_params": {
            "input": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}],
            "tools": TOOLS,
        },
    }


def rows(seed: int, question_ids: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    corpus = load_corpus(CORPUS)
    rng = random.Random(seed)
    chosen = [q for q in POOL if question_ids is None or q.question_id in question_ids]
    if question_ids is None:
        rng.shuffle(chosen)
    return [row(q, rng, corpus) for q in chosen]


def main() -> None:
    generator_main(
        __doc__.split("\n\n")[0],
        rows,
        lambda: rows(EXAMPLE_SEED, EXAMPLE_QUESTIONS),
        HERE.parent / "data" / "example.jsonl",
    )


if __name__ == "__main__":
    main()
