"""instruction_following against real servers (scripted answers that follow / break each row) and the
instruction checkers one by one."""

import copy
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_gym.tools.testing import (
    collect_rollouts,
    example_rows,
    post_json,
    running_servers,
    server_url,
    text_response,
)
from resources_servers.instruction_following.instructions import INSTRUCTION_IDS, BadInstruction, check

CONFIG = "resources_servers/instruction_following/configs/instruction_following.yaml"
AGENT = "instruction_following_simple_agent"
SERVER = "instruction_following"

# Per example row: (an answer following both instructions, one breaking only the second).
ANSWERS = [
    (
        "Hi Sam! I am away from Friday to Monday. Could you water my plants on Saturday? Thank you so much.",
        "Hi Sam! " + "I will be away for a while and would be grateful if you could water the plants. " * 6,
    ),
    (
        "* Stronger legs\n* Better heart health\n* No waiting for the lift\nAny other questions?",
        "* Stronger legs\n* Better heart health\n* No waiting for the lift\nThat is all.",
    ),
    (
        "the beam sweeps slowly over the dark water, and the waves break white on the rocks below.",
        "the light sweeps slowly over the dark water, and the waves break white on the shore below.",
    ),
    (
        "<<The Patient Loaf>>\nA name for bakers who wait for the dough.\nP.S. It suits a corner shop.",
        "<<The Patient Loaf>>\nA name for bakers who wait for the dough.",
    ),
    (
        "Air molecules scatter short blue wavelengths more than red ones.\n***\nSo blue reaches our eyes from every direction.",
        "Air molecules scatter the blue part of the sun's rays more.\n***\nSo the sky glows blue in daylight.",
    ),
]


CONTENT_MISSING = "the reply does not address the request: it never mentions {} (content_keywords)"
# Replies to row 0 (a note asking a neighbour to water the plants; no commas, under 60 words) that follow
# both instructions and not the request, and why each scores 0.
CONTENT_FREE = [
    ("ok", "the reply does not address the request: 1 word, fewer than 5 (content_min_words)"),
    (
        "Water the plants.",
        "the reply does not address the request: 3 words, fewer than 5 (content_min_words)",
    ),
    ("I will be away from Friday to Monday. Thank you so much.", CONTENT_MISSING.format('"water"')),
    # Look-alike letters (Cyrillic) are other words.
    ("Please w\u0430ter my pl\u0430nts while I am away.", CONTENT_MISSING.format('"water"')),
]


def _marked(row: dict, marker: str) -> dict:
    out = copy.deepcopy(row)
    out["responses_create_params"]["input"][-1]["content"] += f" {marker}"
    return out


@pytest.mark.slow
def test_scripted_answers_follow_or_break_the_instructions(tmp_path: Path) -> None:
    rows = example_rows("instruction_following")
    broken = [_marked(r, f"[break-{i}]") for i, r in enumerate(rows)]
    fraction = [{**_marked(r, f"[break-{i}]"), "grading_mode": "fraction"} for i, r in enumerate(rows)]
    rules = [{"contains": f"[break-{i}]", "turns": [{"text": bad}]} for i, (_, bad) in enumerate(ANSWERS)]
    rules += [
        {"contains": r["prompt"], "turns": [{"text": good}]}
        for r, (good, _) in zip(rows, ANSWERS, strict=True)
    ]
    extra = {"policy_model": {"responses_api_models": {"scripted_model": {"scripts_by_input": rules}}}}
    with running_servers([CONFIG], extra) as helper:
        code, out, err = collect_rollouts(helper, rows + broken + fraction, tmp_path, AGENT)
        assert code == 0, err[-3000:]
        assert [r["follow_instruction_list"] for r in out] == [[True, True]] * 5 + [[True, False]] * 10
        assert [r["reward"] for r in out] == [1.0] * 5 + [0.0] * 5 + [0.5] * 5
        assert out[0]["verifier_metadata"]["instruction_id_list"] == rows[0]["instruction_id_list"]

        # Upstream's nested layout verifies the same; bad kwargs there are a 422, not a failed instruction.
        nested = {k: v for k, v in out[1].items() if k not in ("instruction_id_list", "kwargs", "prompt")}
        nested["verifier_metadata"] = {k: rows[1][k] for k in ("instruction_id_list", "kwargs", "prompt")}
        resp = post_json(server_url(helper, SERVER) + "/verify", nested)
        assert resp.status_code == 200 and resp.json()["reward"] == 1.0
        nested["verifier_metadata"]["kwargs"] = [{"num_bullets": 3}, {"phrase": "x"}]
        resp = post_json(server_url(helper, SERVER) + "/verify", nested)
        assert resp.status_code == 422 and "startend:end_checker" in resp.text and "end_phrase" in resp.text

        # Every 0 says why; a reply that repeats the prompt is no reply (the prompt of row 3 holds
        # "<<title>>" and "P.S.", which follow its own instructions).
        assert out[5]["failure_reason"] == "not followed: length_constraints:number_words"
        assert out[0]["failure_reason"] is None
        echo = {**out[3], "response": text_response("Sure! " + rows[3]["prompt"])}
        resp = post_json(server_url(helper, SERVER) + "/verify", echo)
        assert resp.status_code == 200 and resp.json()["reward"] == 0.0
        assert resp.json()["failure_reason"].startswith("the answer repeats the prompt")
        # A long answer is checked in the verify pool, to the same verdicts.
        good, _ = ANSWERS[1]
        long = {**out[1], "response": text_response(good.replace("\nAny", "\n" + " " * 30_000 + "\nAny"))}
        resp = post_json(server_url(helper, SERVER) + "/verify", long, timeout=300)
        assert resp.status_code == 200 and resp.json()["reward"] == 1.0, resp.text[:500]
        long["response"] = text_response("\n" * 30_000 + "* One\nAny other questions?")
        resp = post_json(server_url(helper, SERVER) + "/verify", long, timeout=300)
        assert resp.status_code == 200 and resp.json()["reward"] == 0.0
        assert resp.json()["failure_reason"] == (
            "not followed: detectable_format:number_bullet_lists; "
            "the reply does not address the request: 4 words, fewer than 5 (content_min_words)"
        )

        # A reply that meets the form without doing the task (the audit's content_free_note: "ok" has no
        # comma and fewer than 60 words) scored 1.0; the row's content_keywords and content_min_words
        # make it 0, in either grading mode, with the reason. IFEval's own verdicts are kept.
        url = server_url(helper, SERVER) + "/verify"
        for body in (out[0], out[10]):  # binary, fraction
            for reply, reason in CONTENT_FREE:
                resp = post_json(url, {**body, "response": text_response(reply)})
                assert resp.status_code == 200, resp.text[:500]
                assert (resp.json()["reward"], resp.json()["failure_reason"]) == (0.0, reason), reply
                assert resp.json()["follow_instruction_list"] == [True, True]
                assert resp.json()["addresses_request"] is False
        assert out[0]["addresses_request"] is True
        # The nested layout carries them too; a row without them is scored on form only (upstream's rule).
        nested = {k: v for k, v in out[0].items() if k not in ("content_keywords", "content_min_words")}
        nested["verifier_metadata"] = {**out[0]["verifier_metadata"], "content_keywords": ["sunflower"]}
        resp = post_json(url, {**nested, "response": text_response(ANSWERS[0][0])})
        assert resp.json()["failure_reason"] == CONTENT_MISSING.format('"sunflower"')
        bare = {k: v for k, v in nested.items() if k != "verifier_metadata"}
        resp = post_json(url, {**bare, "response": text_response("ok")})
        assert (resp.json()["reward"], resp.json()["addresses_request"]) == (1.0, None)
        # A keyword that is blank is bad data.
        meta = {**out[0]["verifier_metadata"], "content_keywords": ["water", " "]}
        resp = post_json(url, {**out[0], "verifier_metadata": meta})
        assert resp.status_code == 422 and "content_keywords" in resp.text

        # Unknown ids and bad grading modes are refused before any rollout.
        bad = [rows[0], {**rows[1], "instruction_id_list": ["punctuation:no_comma", "vibes:good"]}]
        bad.append({**rows[2], "grading_mode": "most"})
        code, out, err = collect_rollouts(helper, bad, tmp_path / "bad", AGENT)
        assert code == 2 and out == []
        assert 'input.jsonl:2: field `instruction_id_list` has unknown value(s) ["vibes:good"]' in err
        assert "input.jsonl:3: field `grading_mode` has unknown value(s)" in err


@pytest.mark.parametrize(
    ("instruction", "kwargs", "good", "bad"),
    [
        (
            "keywords:frequency",
            {"keyword": "tea", "frequency": 2, "relation": "at least"},
            "Tea, then tea.",
            "Tea.",
        ),
        (
            "keywords:letter_frequency",
            {"letter": "z", "let_frequency": 2, "let_relation": "less than"},
            "zoo",
            "zzz",
        ),
        (
            "language:response_language",
            {"language": "de"},
            "Das Wetter ist heute sehr schön und warm.",
            "The weather is nice today and warm.",
        ),
        (
            "length_constraints:number_sentences",
            {"num_sentences": 2, "relation": "less than"},
            "One. ",
            "One. Two. Three.",
        ),
        (
            "length_constraints:nth_paragraph_first_word",
            {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "then"},
            "First.\n\nThen more.",
            "First.\n\nAfter that.",
        ),
        (
            "detectable_content:number_placeholders",
            {"num_placeholders": 2},
            "Dear [name] at [address]",
            "Dear [name]",
        ),
        ("detectable_format:constrained_response", {}, "My answer is yes.", "Yes."),
        ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "*a* and **b**", "*a* only"),
        (
            "detectable_format:multiple_sections",
            {"section_spliter": "Section", "num_sections": 2},
            "Section 1 a\nSection 2 b",
            "Section 1 a",
        ),
        ("detectable_format:json_format", {}, '```json\n{"a": 1}\n```', "{a: 1}"),
        ("combination:two_responses", {}, "First answer.\n******\nSecond answer.", "Same.\n******\nSame."),
        ("combination:repeat_prompt", {"prompt_to_repeat": "Say hi."}, "Say hi. Hi!", "Hi! Say hi."),
        ("startend:quotation", {}, '"All quoted."', "Not quoted."),
        (
            "change_case:capital_word_frequency",
            {"capital_frequency": 2, "capital_relation": "at least"},
            "VERY GOOD",
            "Very GOOD",
        ),
        ("change_case:english_capital", {}, "THIS IS ALL IN CAPITAL LETTERS, AS ASKED.", "This is not."),
        ("count:lowercase_counting", {"N": 3}, "The Cat sat on it", "the cat sat on it"),  # a total
        ("letters:letter_counting", {"N": 5, "relation": "less than"}, "Yes 1234!", "Certainly"),
        ("paragraphs:paragraphs", {}, "One.\n***\nTwo.", "One.\n***\n***\nTwo."),
        (
            "last_word:last_word_answer",
            {"last_word": "contest"},
            "We won the contest.",
            "The contest was won.",
        ),
        (
            "first_word:first_word_sent",
            {"first_word": "so"},
            "So it goes. So be it.",
            "So it goes. Then it ends.",
        ),
    ],
)
def test_checkers(instruction: str, kwargs: dict, good: str, bad: str) -> None:
    assert check(instruction, kwargs, good) is True
    assert check(instruction, kwargs, bad) is False


# IFEval's rules where a plausible checker goes wrong (the oracle test checks many more against IFEval).
@pytest.mark.parametrize(
    ("instruction", "kwargs", "good", "bad"),
    [
        # Surrounding double quotes are stripped before the end phrase is looked for.
        ("startend:end_checker", {"end_phrase": "Bye now."}, 'Done. "Bye now."', "Bye now. Done."),
        # The first word stops at the first . , ? ! ' " (not at every one of them).
        (
            "length_constraints:nth_paragraph_first_word",
            {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "then"},
            "First.\n\nThen's more.",
            "First.\n\nThen—more.",
        ),
        # A blank piece between \n\n pairs is not counted but keeps its place in the lookup.
        (
            "length_constraints:nth_paragraph_first_word",
            {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "then"},
            "First.\n\n\nThen more.",
            "First.\n\n\n\nThen more.",
        ),
        # Words are runs of word characters: "Don't" is two.
        (
            "length_constraints:number_words",
            {"num_words": 4, "relation": "at least"},
            "Don't stop now",
            "Stop now",
        ),
        # Punkt sentences: "p.m." before a capital ends no sentence, "U.S." before one does not either.
        (
            "length_constraints:number_sentences",
            {"num_sentences": 2, "relation": "less than"},
            "Smith arrived at 5 p.m. Then he left.",
            "The U.S. Army won. Yes.",
        ),
        # Treebank tokens: "U.S." is one capital word.
        (
            "change_case:capital_word_frequency",
            {"capital_frequency": 2, "capital_relation": "less than"},
            "The U.S. team",
            "The US and UK team",
        ),
        ("detectable_format:json_format", {}, "```json```{}```", '```js\n{"a": 1}\n```'),
        ("detectable_format:title", {}, "<<A title>> text", "<<<>> text"),
        (
            "keywords:frequency",
            {"keyword": " tea ", "frequency": 2, "relation": "at least"},
            "Tea? TEA.",
            "Tea.",
        ),
        # A blank response follows nothing, even "no commas".
        ("punctuation:no_comma", {}, "No commas here.", " \n"),
    ],
)
def test_checkers_follow_ifeval_rules(instruction: str, kwargs: dict, good: str, bad: str) -> None:
    assert check(instruction, kwargs, good) is True
    assert check(instruction, kwargs, bad) is False


def test_unknown_or_unusable_instructions_are_bad_data() -> None:
    assert len(INSTRUCTION_IDS) == 30
    with pytest.raises(BadInstruction, match="unknown instruction id"):
        check("vibes:good", {}, "x")
    with pytest.raises(BadInstruction, match="needs kwargs"):
        check("keywords:frequency", {"keyword": "a", "frequency": None, "relation": "at least"}, "x")
    with pytest.raises(BadInstruction, match="relation"):
        check("length_constraints:number_words", {"num_words": 3, "relation": "about"}, "x")
    # IFEval draws a random letter / paragraph for these; here they are bad rows, even on a blank answer.
    with pytest.raises(BadInstruction, match="letter must be a single letter"):
        check(
            "keywords:letter_frequency",
            {"letter": " t ", "let_frequency": 1, "let_relation": "at least"},
            "t",
        )
    with pytest.raises(BadInstruction, match="nth_paragraph"):
        kwargs = {"num_paragraphs": 2, "nth_paragraph": 3, "first_word": "a"}
        check("length_constraints:nth_paragraph_first_word", kwargs, "")


def test_checks_from_many_threads_at_once_agree() -> None:
    """/verify checks in threads: langdetect's first load, racing in a fresh process, must not turn
    into "followed" (it did: its factory was loaded twice and raised)."""
    script = (
        "from concurrent.futures import ThreadPoolExecutor\n"
        "from resources_servers.instruction_following.instructions import check\n"
        "text = 'The weather is lovely today and we are going for a long walk along the river after lunch.'\n"
        "with ThreadPoolExecutor(8) as pool:\n"
        "    got = list(pool.map(lambda _: check('language:response_language', {'language': 'de'}, text), range(8)))\n"
        "print(got)\n"
    )
    repo = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=repo, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str([False] * 8)


# The warm-up thread starts importing NLTK; checks start on other threads every 20 ms while it does.
# Before the import lock: one of them took the module lock of nltk.tokenize.punkt while the warm-up,
# inside nltk/__init__, wanted it too: _DeadlockError, then "partially initialized module 'nltk'".
RACE = """
import threading
import time

from resources_servers.instruction_following import instructions

errors = []


def run(fn, delay):
    time.sleep(delay)
    try:
        fn()
    except Exception as e:
        errors.append(f"{type(e).__name__}: {e}")


threads = [threading.Thread(target=run, args=(instructions.warm_up, 0))]
threads += [
    threading.Thread(target=run, args=(lambda: instructions.sentences("One. Two."), 0.02 * i))
    for i in range(1, 40)
]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(errors)
"""


def test_checks_during_the_start_up_warm_up_see_nltk_whole() -> None:
    """The server imports NLTK on a thread at start-up while the first checks may run on others: no
    check may see it half imported (it did: "partially initialized module 'nltk' has no attribute
    'data'", answered as a bad row). A fresh interpreter, so NLTK is imported for the first time."""
    repo = Path(__file__).resolve().parents[3]
    proc = subprocess.run([sys.executable, "-c", RACE], cwd=repo, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", proc.stdout


def test_checkers_rewritten_in_one_pass_give_ifevals_verdicts() -> None:
    """The title, placeholder, postscript and bullet checks read the text in one pass (IFEval's patterns
    are quadratic on a long line of ``<<`` or ``[``, a long run of spaces or of line breaks, and held
    the server's GIL for minutes); on random texts of the characters that matter they count exactly as
    IFEval's patterns do, and a million characters of each worst case are read at once."""
    import random
    import re

    from resources_servers.instruction_following import instructions as ins

    def title(r: str) -> bool:
        return any(t.lstrip("<").rstrip(">").strip() for t in re.findall(r"<<[^\n]+>>", r))

    def bullets(r: str) -> int:
        star = re.findall(r"^\s*\*[^\*].*$", r, flags=re.MULTILINE)
        return len(star) + len(re.findall(r"^\s*-.*$", r, flags=re.MULTILINE))

    def postscript(r: str) -> bool:
        return re.search(r"\s*p\.\s?s\..*$", r.lower(), flags=re.MULTILINE) is not None

    pieces = [
        "<",
        ">",
        "<<",
        ">>",
        "[",
        "]",
        "*",
        "-",
        " ",
        "\n",
        "\t",
        "\u2028",
        "\x85",
        "a",
        "p.",
        "s.",
        "P.S.",
    ]
    rng = random.Random(7)
    for _ in range(20_000):
        r = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        assert ins._title(r) == title(r), r
        assert ins._placeholders(r) == len(re.findall(r"\[.*?\]", r)), r
        assert ins._bullets(r) == bullets(r), r
        assert ins._postscript(r, "P.S.") == postscript(r), r
    big = 1_000_000
    assert not check("detectable_format:title", {}, "<<" * big)
    assert not check("detectable_content:number_placeholders", {"num_placeholders": 1}, "[" * big)
    assert not check("detectable_format:number_bullet_lists", {"num_bullets": 1}, "\n" * big)
    assert not check("detectable_content:postscript", {"postscript_marker": "P.S."}, "x" + " " * big)


def test_json_too_deep_is_not_json() -> None:
    """json.loads raises RecursionError on 1,000 nested arrays: not followed (it was a 500)."""
    assert not check("detectable_format:json_format", {}, "[" * 1000 + "]" * 1000)
    assert check("detectable_format:json_format", {}, "[" * 100 + "]" * 100)


def test_an_echo_of_the_prompt_is_no_answer() -> None:
    from resources_servers.instruction_following.app import echoes_the_prompt

    prompt = "Suggest a name for a bakery. Wrap a title in double angular brackets, like <<title>>."
    assert echoes_the_prompt("Sure:  " + prompt.upper().replace(" ", "\n"), [prompt])
    assert not echoes_the_prompt("<<The Patient Loaf>>, a name for a bakery.", [prompt])
    assert not echoes_the_prompt("Say hi. Hi!", ["Say hi."])  # too short to tell an echo from a reply


@pytest.mark.parametrize(
    ("reply", "keywords", "min_words", "problem"),
    [
        # A keyword is found as a word or the start of one, in any case or compatibility form.
        ("Could you WATER my Plants?", [["water"], ["plant"]], 5, None),
        ("Watering the plantation.", [["water"], ["plant"]], 3, None),
        ("\uff37\uff41\uff54\uff45\uff52 the plants please.", [["water"]], 3, None),
        # A keyword of several words matches across any whitespace; one alternative of an entry will do.
        ("Please turn the  red\nonion slices.", [["red onion"], ["slice", "dice"]], 3, None),
        ("Dear neighbor please help.", [["neighbour", "neighbor"]], 3, None),
        # Inside a word it is no mention ("hotwater"), nor in look-alike letters.
        ("The hotwater tap is on.", [["water"]], 3, 'never mentions "water"'),
        ("Please w\u0430ter the plants.", [["water"]], 3, 'never mentions "water"'),
        ("Nothing here at all.", [["neighbour", "neighbor"]], 3, 'never mentions "neighbour" or "neighbor"'),
        # Words are runs of word characters (IFEval's count): "don't" is two.
        ("Don't", [], 2, None),
        ("ok", [["ok"]], 5, "1 word, fewer than 5"),
        ("", [], 1, "0 words, fewer than 1"),
        ("  ...  ", [], 1, "0 words, fewer than 1"),
    ],
)
def test_content_rules(reply: str, keywords: list[list[str]], min_words: int, problem: str | None) -> None:
    from resources_servers.instruction_following.app import content_problem

    got = content_problem(reply, keywords, min_words)
    assert (got is None) if problem is None else (got is not None and problem in got), got


def test_content_spec_reads_the_row_and_refuses_bad_values() -> None:
    from resources_servers.instruction_following.app import DEFAULT_CONTENT_MIN_WORDS, content_spec

    assert content_spec({}) is None  # scored on form only
    assert content_spec({"content_keywords": ["a", ["b", "c"]]}) == (
        [["a"], ["b", "c"]],
        DEFAULT_CONTENT_MIN_WORDS,
    )
    assert content_spec({"content_min_words": 2}) == ([], 2)
    for bad in (
        {"content_keywords": "water"},
        {"content_keywords": [""]},
        {"content_keywords": [[]]},
        {"content_keywords": [["a", 3]]},
        {"content_keywords": ["a"], "content_min_words": 0},
        {"content_min_words": True},
    ):
        with pytest.raises(ValueError, match="content_"):
            content_spec(bad)


def test_content_rules_read_a_long_reply_once() -> None:
    """A megabyte reply: words are counted only up to the floor, each keyword searched once (linear)."""
    from resources_servers.instruction_following.app import content_problem

    long = "word " * 200_000 + "water"
    assert content_problem(long, [["water"], ["plant"]], 5) is not None
    assert content_problem(long + " plants", [["water"], ["plant"]], 5) is None
    assert content_problem("(" * 1_000_000, [["water"]], 1).endswith(
        "0 words, fewer than 1 (content_min_words)"
    )
