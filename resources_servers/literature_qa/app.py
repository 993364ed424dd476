"""literature_qa: answer a question from a local corpus of papers and cite them (LitQA's idea, written here).

Contract
--------
* The corpus: ``corpus_path`` (default ``data/corpus.jsonl``, relative to this folder), one paper a line
  with ``id``, ``title``, ``authors``, ``year``, ``field``, ``abstract``, ``methods``, ``results``. It is
  read and indexed (BM25) once at start-up; a bad line stops the server with an error naming the file,
  the line and the field.
* Row fields: ``question_id``, ``kind`` (``numeric`` or ``multiple_choice``), ``options`` (multiple
  choice: ``{letter: text}``), ``expected_answer`` (a number, an option letter, or null when the corpus
  cannot answer), ``tolerance`` (numeric: relative), ``citations`` (the paper ids the answer comes from;
  empty exactly when the question is unanswerable) and ``responses_create_params``. A row that
  contradicts itself or cites a paper not in the corpus is refused (422 naming the field) at
  ``/seed_session`` and ``/verify``: a broken row is never a reward.
* Tools (stateless: they read only the corpus):

  - ``POST /search_papers`` ``{"query"}`` -> ``{"results": [{"paper_id", "title", "year", "snippet",
    "score"}]}``: the ``top_k`` papers by BM25 over title, abstract, methods and results, each with the
    sentence that matches the query best. An empty query answers ``{"error"}``.
  - ``POST /read_section`` ``{"paper_id", "section"}`` -> ``{"paper_id", "title", "authors", "year",
    "section", "text"}`` for ``abstract``, ``methods`` or ``results``; an unknown id or section answers
    ``{"error"}`` naming the valid ones (a tool result the model reads, not an HTTP error).
  - ``POST /submit_answer`` ``{"answer", "citations"}`` -> ``{"recorded": true}`` or ``{"error"}`` (an
    unknown paper id is named so the model can fix it); judged only by ``/verify``.

* ``/verify`` judges the last ``submit_answer`` call of the response (stateless: a stored rollout
  re-verifies). The answer is an abstention when it reads ``abstention_answer`` ("insufficient
  information", case and end punctuation ignored). Answerable question: a numeric answer is the ONE
  number it commits to, sign included (``committed_number``: digits glued to a word or an id, and the
  question's own numbers restated, are not candidates; a number written twice is one), right within
  ``tolerance`` of the expected value; two or more different numbers are ``several_numbers`` (0). A
  multiple-choice answer is one option letter. An answer longer than ``max_answer_chars`` is not read
  (``unreadable_answer``; ``submit_answer`` refuses it so the model can submit again). The citation is
  right when the cited ids are exactly the row's ``citations`` (order and repeats ignored). Reward 1.0
  for a right answer with the right citation, ``partial_credit`` (0.5) with a wrong or missing one, 0.0
  for a wrong answer or an abstention. Unanswerable question: ``abstention_reward`` (1.0) for an
  abstention, 0.0 for any answer. ``failure_reason``: ``pass``,
  ``wrong_citation``, ``wrong_answer``, ``unreadable_answer``, ``abstained`` (on an answerable
  question), ``hallucinated`` (an answer to an unanswerable one), ``no_answer``, ``several_numbers``;
  ``reason`` says what was read and why, for a person.
* Each rollout also carries upstream's abstention verdicts (NeMo Gym's ``abstention`` server):
  ``is_correct`` (a right answer, whatever its citation), ``is_incorrect`` (a wrong, unreadable or
  several-number answer,
  or any answer to an unanswerable question), ``is_abstain`` (an abstention) as 0/1, and
  ``omniscience_index`` = ``is_correct - is_incorrect``; a rollout with no submission is none of them.
* Aggregate metrics over a run (``compute_metrics``, ``POST /aggregate_metrics``): ``precision`` (right
  answers / answers given), ``coverage`` (answers given / rollouts), ``abstention_precision``
  (abstentions on unanswerable questions / abstentions), ``abstention_recall`` (abstentions on
  unanswerable questions / their rollouts) and ``citation_accuracy`` (right citations / right answers).
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar, Literal

import orjson
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field, PrivateAttr, ValidationError, model_validator

from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseSeedSessionRequest,
    BaseSeedSessionResponse,
    BaseVerifyRequest,
    BaseVerifyResponse,
    ReverifyMode,
    SimpleResourcesServer,
)
from nemo_gym.openai_utils.responses import text_of_message
from nemo_gym.server.resources import function_calls

HERE = Path(__file__).resolve().parent
SECTIONS = ("abstract", "methods", "results")
CORPUS_FIELDS = ("id", "title", "authors", "year", "field", *SECTIONS)


class LiteratureQAConfig(BaseResourcesServerConfig):
    REVERIFY_MODE: ClassVar[ReverifyMode] = ReverifyMode.STATELESS  # verify reads the row and the response
    corpus_path: str = "data/corpus.jsonl"
    top_k: int = Field(default=5, ge=1, le=50)
    partial_credit: float = Field(default=0.5, ge=0, le=1)
    abstention_reward: float = Field(default=1.0, ge=0, le=1)
    abstention_answer: str = "insufficient information"
    max_query_chars: int = Field(default=500, ge=10)
    # A longer answer is not read (submit_answer refuses it; /verify scores it unreadable_answer).
    max_answer_chars: int = Field(default=1000, ge=10)


class Paper(BaseModel):
    id: str = Field(min_length=1)
    title: str = Field(min_length=1)
    authors: list[str] = Field(min_length=1)
    year: int
    field: str = ""
    abstract: str = Field(min_length=1)
    methods: str = Field(min_length=1)
    results: str = Field(min_length=1)


def load_corpus(path: Path) -> dict[str, Paper]:
    """The papers of a JSONL corpus by id; ``ValueError`` naming the file, line and field of a bad one."""
    papers: dict[str, Paper] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            paper = Paper.model_validate_json(line)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "line"
            raise ValueError(f"{path}:{number}: {where}: {first['msg']}") from None
        if paper.id in papers:
            raise ValueError(f"{path}:{number}: id: {paper.id!r} appears twice")
        papers[paper.id] = paper
    if not papers:
        raise ValueError(f"{path}: the corpus is empty")
    return papers


_TOKEN = re.compile(r"[a-z0-9]+(?:\.[0-9]+)?")
_STOP = frozenset(
    "a an and are as at be by did do does for from had has have in into is it its of on or per than that "
    "the their there these this to was were what which who with how many much".split()
)


def _stem(word: str) -> str:
    """A plural's singular, roughly ("dams" -> "dam", not "glass" -> "glas"): enough for a small corpus."""
    if (
        len(word) > 3
        and word.endswith("s")
        and not word.endswith(("ss", "us", "is"))
        and not word[0].isdigit()
    ):
        return word[:-3] + "y" if word.endswith("ies") else word[:-1]
    return word


def tokens(text: str) -> list[str]:
    return [_stem(t) for t in _TOKEN.findall(text.lower()) if t not in _STOP]


class BM25:
    """Okapi BM25 over the corpus (k1 1.2, b 0.75); small enough to score every paper per query."""

    def __init__(self, docs: dict[str, list[str]], k1: float = 1.2, b: float = 0.75) -> None:
        self.k1, self.b = k1, b
        self.counts = {doc_id: Counter(words) for doc_id, words in docs.items()}
        self.lengths = {doc_id: len(words) for doc_id, words in docs.items()}
        self.average = sum(self.lengths.values()) / max(len(docs), 1)
        frequency = Counter(word for words in docs.values() for word in set(words))
        n = len(docs)
        self.idf = {w: math.log(1 + (n - f + 0.5) / (f + 0.5)) for w, f in frequency.items()}

    def rank(self, query: list[str]) -> list[tuple[str, float]]:
        scores = []
        for doc_id, counts in self.counts.items():
            norm = self.k1 * (1 - self.b + self.b * self.lengths[doc_id] / self.average)
            score = sum(
                self.idf[w] * counts[w] * (self.k1 + 1) / (counts[w] + norm)
                for w in set(query)
                if w in counts
            )
            if score > 0:
                scores.append((doc_id, score))
        return sorted(scores, key=lambda s: (-s[1], s[0]))


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z0-9])", text) if s]


def snippet(paper: Paper, query: list[str], idf: dict[str, float], limit: int = 300) -> str:
    """The sentence of the paper sharing the rarest words with the query (the first on a tie)."""
    wanted = set(query)
    sentences = [s for section in SECTIONS for s in _sentences(getattr(paper, section))]
    best = max(sentences, key=lambda s: sum(idf.get(w, 0.0) for w in wanted & set(tokens(s))))
    return best if len(best) <= limit else best[: limit - 3] + "..."


class QARow(BaseModel):
    question_id: str = ""
    kind: Literal["numeric", "multiple_choice"]
    options: dict[str, str] | None = None
    expected_answer: float | str | None
    tolerance: float = Field(default=0.01, ge=0, le=1)
    citations: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _consistent(self) -> QARow:
        answerable = self.expected_answer is not None
        if answerable != bool(self.citations):
            raise ValueError(
                "citations must name the source paper(s) exactly when expected_answer is not null"
            )
        if self.kind == "multiple_choice":
            if not self.options or not all(re.fullmatch(r"[A-Z]", k) for k in self.options):
                raise ValueError("options must map single capital letters to texts for multiple_choice")
            if answerable and self.expected_answer not in self.options:
                raise ValueError(f"expected_answer {self.expected_answer!r} is not one of the options")
        elif answerable and not isinstance(self.expected_answer, float):
            raise ValueError(f"expected_answer must be a number for numeric, got {self.expected_answer!r}")
        return self

    def check_citations(self, corpus: dict[str, Paper]) -> None:
        """``HTTPException(422)`` naming ``citations`` if the row cites a paper the corpus lacks."""
        unknown = [c for c in self.citations if c not in corpus]
        if unknown:
            raise HTTPException(422, f"bad row: citations: paper id(s) {unknown} are not in the corpus")


class QASeedSessionRequest(QARow, BaseSeedSessionRequest):
    pass


class QAVerifyRequest(QARow, BaseVerifyRequest):
    pass


class QAVerifyResponse(QAVerifyRequest, BaseVerifyResponse):
    failure_reason: str
    reason: str  # for a person: what was read and why it scored so
    answerable: bool
    abstained: bool
    answer_correct: bool
    citation_correct: bool
    submitted_answer: str | None
    submitted_citations: list[str] | None
    is_correct: float
    is_incorrect: float
    is_abstain: float
    omniscience_index: float
    searches: int
    sections_read: int


class SearchRequest(BaseModel):
    query: str = Field(description="Keywords to look for in the papers' titles and text.")


class ReadSectionRequest(BaseModel):
    paper_id: str = Field(description="A paper id from search_papers, e.g. LQA-001.")
    section: str = Field(description="abstract, methods or results")


class SubmitAnswerRequest(BaseModel):
    answer: Any = None
    citations: Any = None


# Minus signs and dashes as papers and models type them: read as "-" (a sign only before a number that
# does not follow a digit: "200-500" is a range, "-412" is negative).
_DASHES = str.maketrans(dict.fromkeys("\u2010\u2011\u2012\u2013\u2014\u2212", "-"))
# A number standing on its own: not glued to the word before it ("log10", "pCO2", "CA1") nor to an id
# ("LQA-009", "Kessler-88", "GX-417"). Any script's decimal digits count (a number in Arabic-Indic digits
# is still a number); full-width digits are folded to ASCII first (NFKC).
_NUMBER = re.compile(
    r"(?<![\w.])(?<![^\W\d_]-)"  # not glued to a word, a number or an id
    r"(?P<sign>[-+])?"
    r"(?P<digits>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|\.\d+)"
)
_LETTER = re.compile(r"^\(?([A-Z])\)?(?:[.:)]|\s|$)")


def answer_numbers(text: str) -> list[float]:
    """The distinct numbers of ``text`` in the order written, signs included (``1,490`` is 1490; a number
    written twice is one number)."""
    out: dict[float, None] = {}
    for match in _NUMBER.finditer(unicodedata.normalize("NFKC", text).translate(_DASHES)):
        value = float(match["digits"].replace(",", ""))
        out[-value if match["sign"] == "-" else value] = None
    return list(out)


def committed_number(answer: str, question: str) -> tuple[float | None, list[float]]:
    """(the one number ``answer`` commits to or None, the numbers it was chosen from). The question's own
    numbers restated as context ("10.7 hours at 36 weeks") are not candidates, unless the answer gives no
    other number. Several different candidates commit to none."""
    found = answer_numbers(answer)
    asked = set(answer_numbers(question))
    candidates = [v for v in found if v not in asked] or found
    return (candidates[0] if len(candidates) == 1 else None), candidates


def option_letter(text: str) -> str | None:
    match = _LETTER.match(text.strip())
    return match.group(1) if match else None


def is_abstention(answer: str, phrase: str) -> bool:
    def norm(s: str) -> str:
        return " ".join(s.lower().strip().strip("\"'`.!").split())

    return norm(answer) == norm(phrase)


def judge_answer(row: QARow, answer: str, question: str = "") -> tuple[str, str]:
    """(``pass``, ``wrong_answer``, ``unreadable_answer`` or ``several_numbers``; the reason for a person)
    of ``answer`` on an answerable row; ``question`` is the text the model was asked."""
    if row.kind == "multiple_choice":
        letter = option_letter(answer)
        if letter is None:
            return "unreadable_answer", f"no option letter at the start of {answer[:60]!r}"
        if letter != row.expected_answer:
            return "wrong_answer", f"{letter}, not {row.expected_answer}"
        return "pass", f"{letter} is the right option"
    value, candidates = committed_number(answer, question)
    if not candidates:
        return "unreadable_answer", f"no number in {answer[:60]!r}"
    if value is None:
        shown = ", ".join(f"{v:g}" for v in candidates[:6]) + (", ..." if len(candidates) > 6 else "")
        return "several_numbers", f"several different numbers ({shown}): a numeric answer is one number"
    expected = float(row.expected_answer)  # type: ignore[arg-type]
    if abs(value - expected) <= row.tolerance * abs(expected) + 1e-12:
        return "pass", f"{value:g} is {expected:g} within {row.tolerance:.0%}"
    return "wrong_answer", f"{value:g} is not {expected:g} (within {row.tolerance:.0%}, sign included)"


def question_text(body: BaseVerifyRequest) -> str:
    """The user's messages of the row (what the model was asked)."""
    items = body.responses_create_params.input
    if isinstance(items, str):
        return items
    return "\n".join(
        text_of_message(m)
        for m in items
        if (m.get("role") if isinstance(m, dict) else getattr(m, "role", None)) == "user"
    )


def _arguments(call: Any) -> tuple[str | None, list[str] | None]:
    """(answer, citations) of a submit_answer call; None for what is missing or of the wrong type."""
    try:
        arguments = orjson.loads(call.arguments)
    except orjson.JSONDecodeError:
        return None, None
    if not isinstance(arguments, dict):
        return None, None
    answer = arguments.get("answer")
    citations = arguments.get("citations")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    ok = isinstance(citations, list) and all(isinstance(c, str) for c in citations)
    return (answer if isinstance(answer, str) else None), (citations if ok else None)


class LiteratureQAServer(SimpleResourcesServer):
    config: LiteratureQAConfig
    _corpus: dict[str, Paper] = PrivateAttr(default_factory=dict)
    _index: BM25 | None = PrivateAttr(default=None)

    def model_post_init(self, context: Any) -> None:
        super().model_post_init(context)
        path = Path(self.config.corpus_path)
        self._corpus = load_corpus(path if path.is_absolute() else HERE / path)
        self._index = BM25(
            {
                pid: tokens(" ".join([p.title, p.title, p.abstract, p.methods, p.results]))
                for pid, p in self._corpus.items()
            }
        )

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/search_papers")(self.search_papers)
        app.post("/read_section")(self.read_section)
        app.post("/submit_answer")(self.submit_answer)
        return app

    async def seed_session(self, body: QASeedSessionRequest) -> BaseSeedSessionResponse:  # type: ignore[override]
        body.check_citations(self._corpus)  # a broken row is refused before the rollout
        return BaseSeedSessionResponse()

    async def search_papers(self, body: SearchRequest) -> dict[str, Any]:
        query = tokens(body.query[: self.config.max_query_chars])
        if not query:
            return {"error": "the query has no searchable words: give a few keywords"}
        assert self._index is not None
        ranked = self._index.rank(query)[: self.config.top_k]
        return {
            "results": [
                {
                    "paper_id": pid,
                    "title": self._corpus[pid].title,
                    "year": self._corpus[pid].year,
                    "snippet": snippet(self._corpus[pid], query, self._index.idf),
                    "score": round(score, 3),
                }
                for pid, score in ranked
            ]
        }

    async def read_section(self, body: ReadSectionRequest) -> dict[str, Any]:
        paper = self._corpus.get(body.paper_id.strip())
        if paper is None:
            return {
                "error": f"unknown paper_id {_shown(body.paper_id)}: use an id that search_papers returned"
            }
        section = body.section.strip().lower()
        if section not in SECTIONS:
            return {"error": f"unknown section {_shown(body.section)}: use one of {', '.join(SECTIONS)}"}
        return {
            "paper_id": paper.id,
            "title": paper.title,
            "authors": paper.authors,
            "year": paper.year,
            "section": section,
            "text": getattr(paper, section),
        }

    async def submit_answer(self, body: SubmitAnswerRequest) -> dict[str, Any]:
        answer = str(body.answer) if isinstance(body.answer, (int, float)) else body.answer
        if not isinstance(answer, str) or not answer.strip():
            return {"error": "answer must be a non-empty string; submit again"}
        if len(answer) > self.config.max_answer_chars:
            return {
                "error": f"answer is longer than {self.config.max_answer_chars} characters: submit the "
                "number, letter or 'insufficient information' alone"
            }
        if not isinstance(body.citations, list) or not all(isinstance(c, str) for c in body.citations):
            return {"error": "citations must be a list of paper ids (empty for insufficient information)"}
        unknown = [c for c in body.citations if c not in self._corpus]
        if unknown:
            return {
                "error": f"unknown paper id(s) {[_shown(u) for u in unknown[:10]]}: cite ids that search_papers "
                "returned; submit again"
            }
        return {"recorded": True}

    async def verify(self, body: QAVerifyRequest) -> QAVerifyResponse:  # type: ignore[override]
        body.check_citations(self._corpus)  # a broken row is a 422, never a reward
        answerable = body.expected_answer is not None
        submissions = function_calls(body.response, "submit_answer")
        answer, cited = _arguments(submissions[-1]) if submissions else (None, None)
        readable = answer is not None and len(answer) <= self.config.max_answer_chars
        abstained = readable and is_abstention(str(answer), self.config.abstention_answer)
        right_answer = False
        citation_right = False
        if answer is None or not answer.strip():
            reason, why = "no_answer", "no submit_answer call with a string answer"
        elif len(answer) > self.config.max_answer_chars:
            reason, why = "unreadable_answer", f"longer than {self.config.max_answer_chars} characters"
        elif not answerable:
            reason = "pass" if abstained else "hallucinated"
            why = "abstained: the papers do not say" if abstained else "answered what the papers do not say"
        elif abstained:
            reason, why = "abstained", "abstained, but the papers answer it"
        else:
            reason, why = judge_answer(body, answer, question_text(body))
            right_answer = reason == "pass"
            citation_right = cited is not None and set(cited) == set(body.citations)
            if right_answer and not citation_right:
                reason = "wrong_citation"
                why += f"; cited {sorted(set(cited or []))}, the sources are {sorted(set(body.citations))}"
        reward = {
            "pass": self.config.abstention_reward if not answerable else 1.0,
            "wrong_citation": self.config.partial_credit,
        }.get(reason, 0.0)
        correct = float(bool(right_answer) and answerable)
        incorrect = float(reason in ("wrong_answer", "unreadable_answer", "several_numbers", "hallucinated"))
        return QAVerifyResponse.from_request(
            body,
            reward=reward,
            failure_reason=reason,
            reason=why,
            answerable=answerable,
            abstained=abstained,
            answer_correct=bool(right_answer) and answerable,
            citation_correct=citation_right and bool(right_answer),
            submitted_answer=answer,
            submitted_citations=cited,
            is_correct=correct,
            is_incorrect=incorrect,
            is_abstain=float(abstained),
            omniscience_index=correct - incorrect,
            searches=len(function_calls(body.response, "search_papers")),
            sections_read=len(function_calls(body.response, "read_section")),
        )

    def compute_metrics(self, tasks: list[list[dict[str, Any]]]) -> dict[str, Any]:
        return abstention_metrics([r for rollouts in tasks for r in rollouts])

    def get_key_metrics(self, agent_metrics: dict[str, Any]) -> dict[str, Any]:
        names = ("mean/reward", *ABSTENTION_METRICS)
        return {k: agent_metrics[k] for k in names if k in agent_metrics}


ABSTENTION_METRICS = (
    "precision",
    "coverage",
    "abstention_precision",
    "abstention_recall",
    "citation_accuracy",
)


def abstention_metrics(rollouts: list[dict[str, Any]]) -> dict[str, float]:
    """Precision and coverage of a run's answers (upstream's verdicts: an answer is correct or
    incorrect, an abstention neither), and how well it abstained; a metric whose denominator is empty
    is left out (no answers given: no precision)."""
    answered = [r for r in rollouts if r.get("is_correct") or r.get("is_incorrect")]
    right = [r for r in rollouts if r.get("is_correct")]
    abstentions = [r for r in rollouts if r.get("is_abstain")]
    unanswerable = [r for r in rollouts if not r.get("answerable")]
    ratios = {
        "precision": (len(right), len(answered)),
        "coverage": (len(answered), len(rollouts)),
        "abstention_precision": (sum(1 for r in abstentions if not r.get("answerable")), len(abstentions)),
        "abstention_recall": (sum(1 for r in unanswerable if r.get("is_abstain")), len(unanswerable)),
        "citation_accuracy": (sum(1 for r in right if r.get("citation_correct")), len(right)),
    }
    return {name: num / den for name, (num, den) in ratios.items() if den}


def _shown(value: str, limit: int = 80) -> str:
    """A model-written value quoted back to it, cut to ``limit`` characters (a 100 KB id is not echoed)."""
    return repr(value) if len(value) <= limit else f"{value[:limit]!r}... ({len(value):,} characters)"


if __name__ == "__main__":
    LiteratureQAServer.run_webserver()
