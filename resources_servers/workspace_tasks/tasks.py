"""The workspace tasks: each a tiny prepared workspace, hidden tests the agent never sees, and a reference
solution (which proves the task solvable: tests/test_app.py runs the hidden tests on the untouched
workspace, where they must fail, and after the solution, where they must pass).

A task's workspace is built from :attr:`Task.files` (and, for the merge-conflict tasks, by the ``git`` CLI
in :func:`build_workspace`: a ``.git`` cannot be kept in this repository, so every workspace is built,
deterministically, into a cache directory when the server starts). The hidden tests are Python source
(functions ``test_*`` using ``assert``, with the helpers of :data:`PRELUDE`) that the server's runner
executes inside a fresh sandbox forked from the final workspace; they live only here, on the server.

The solution is a list of steps in the shape of the two tools: ``("write", path, content)`` (the editor's
``create``) and ``("bash", command)``.
"""

from __future__ import annotations

import ast
import os
import subprocess
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from nemo_gym.kit import pyast

KINDS = ("python_fix", "cli_flag", "shell_pipeline", "csv_clean", "git_merge", "makefile")

# Defined before every task's hidden tests, in the process that runs one test (cwd /workspace). That process
# never runs the workspace's code itself: `sh` runs a command, and `load(module).function(*args)` imports the
# module and calls the function in a process of its own, which hands back the result (or the exception) as
# a Python literal that is parsed here (ast.literal_eval: data, never code). So the workspace's code can
# change only what its functions return and its commands print, never how a test is judged.
# The inputs a test makes up (a second log, a note added to the directory a target archives, a unit test
# planted in tests/) come from RANDOM, new at every run: the workspace's code never learns them before it
# runs, so a script that recognises the hidden test's probe and answers just that probe cannot pass.
PRELUDE = '''
import ast, builtins, csv, io, os, random, shlex, shutil, subprocess, sys

RANDOM = random.SystemRandom()

def tag():
    """16 random hex digits, new at every call (names and contents of what a test adds)."""
    return "%016x" % RANDOM.getrandbits(64)

def sh(cmd, stdin=None, timeout=20):
    """Run a shell command in /workspace: (exit code, stdout, stderr)."""
    p = subprocess.run(cmd, shell=True, cwd="/workspace", input=stdin, capture_output=True, text=True,
                       timeout=timeout)
    return p.returncode, p.stdout, p.stderr

# Runs in the call's own process: imports the module (/workspace last on sys.path), calls the function,
# and writes repr(("return", value)) or repr(("raise", [builtin classes of the exception], message)) on
# its stdout, which it first takes away from the workspace's code (whose prints go nowhere). Numbers of
# other types (Fraction, Decimal, numpy's, subclasses) become int or float, containers plain ones; any
# other object's repr is no literal, and the call fails.
_CALL = r"""
import ast, decimal, importlib, numbers, os, sys
out = os.fdopen(os.dup(1), "w", errors="backslashreplace")
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
module, name, args, kwargs = ast.literal_eval(sys.stdin.read())
sys.path.append("/workspace")

def plain(v, depth=0):
    if v is None or type(v) in (bool, int, float, complex, str, bytes) or depth > 50:
        return v
    if isinstance(v, (list, tuple, set, frozenset)):
        items = [plain(x, depth + 1) for x in v]
        return items if isinstance(v, list) else tuple(items) if isinstance(v, tuple) else set(items)
    if isinstance(v, dict):
        return {plain(k, depth + 1): plain(x, depth + 1) for k, x in v.items()}
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, (numbers.Real, decimal.Decimal)):
        return float(v)
    if isinstance(v, str):
        return str.__str__(v)
    return v

try:
    value = ("return", plain(getattr(importlib.import_module(module), name)(*args, **kwargs)))
except BaseException as exc:
    try:
        message = str(exc)[:1000]
    except BaseException:
        message = "(its message could not be shown)"
    value = ("raise", [c.__name__ for c in type(exc).__mro__ if c.__module__ == "builtins"], message)
try:
    text = repr(value)
except BaseException:
    text = repr(("raise", ["Exception"], "its result could not be shown"))
out.write(text)
out.flush()
"""
_CALL_MAX_BYTES = 1 << 20

def _call(module, name, args, kwargs):
    shown = "%s.%s(%s)" % (module, name, ", ".join([repr(a) for a in args] + ["%s=%r" % kv for kv in kwargs.items()]))
    p = subprocess.Popen([sys.executable, "-I", "-c", _CALL], cwd="/workspace", stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        p.stdin.write(repr((module, name, tuple(args), dict(kwargs))).encode())
        p.stdin.close()
    except OSError:
        pass
    data = p.stdout.read(_CALL_MAX_BYTES + 1)
    p.stdout.close()
    p.kill()
    code = p.wait()
    if not data:
        raise RuntimeError("the call %s exited with code %s before it returned" % (shown, code))
    if len(data) > _CALL_MAX_BYTES:
        raise RuntimeError("the call %s returned more than %d bytes" % (shown, _CALL_MAX_BYTES))
    try:
        answer = ast.literal_eval(data.decode("utf-8", "replace"))
    except Exception:
        answer = None
    if isinstance(answer, tuple) and len(answer) == 2 and answer[0] == "return":
        return answer[1]
    if not (isinstance(answer, tuple) and len(answer) == 3 and answer[0] == "raise"):
        raise RuntimeError("the call %s returned a value that is not a Python literal: %.200s"
                           % (shown, data.decode("utf-8", "replace")))
    names = [n for n in answer[1] if isinstance(n, str)] if isinstance(answer[1], list) else []
    for class_name in names:
        cls = getattr(builtins, class_name, None)
        if isinstance(cls, type) and issubclass(cls, Exception):
            try:
                error = cls(str(answer[2]))
            except Exception:
                continue
            raise error
    raise RuntimeError("the call %s raised %s: %s" % (shown, "/".join(names) or "an exception", answer[2]))

class _Module:
    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return lambda *args, **kwargs: _call(self._name, attr, args, kwargs)

def load(name):
    """A workspace module whose functions run in a process of their own, freshly imported at each call:
    load(name).f(*args) returns f's result or raises its exception (the first builtin class of its type);
    arguments and results are Python literals."""
    return _Module(name)

def read(path):
    with open(os.path.join("/workspace", path)) as f:
        return f.read()

def rows(path):
    with open(os.path.join("/workspace", path), newline="") as f:
        return list(csv.reader(f))

def write(path, text):
    """Write a file (a path relative to /workspace, or absolute)."""
    with open(os.path.join("/workspace", path), "w") as f:
        f.write(text)
'''

Step = tuple[str, ...]


@dataclass(frozen=True)
class Task:
    task_id: str
    kind: str
    prompt: str
    files: dict[str, str]
    hidden_tests: str
    solution: list[Step]
    git: list[str] = field(default_factory=list)  # git steps after the files are written (merge tasks)

    @property
    def test_names(self) -> list[str]:
        """The hidden test functions, in order (what the runner reports on)."""
        tree = pyast.parse(self.hidden_tests)
        return [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]


def _d(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


TASKS: list[Task] = []


def _add(task: Task) -> None:
    TASKS.append(task)


# -- python_fix: a failing function in a small package -------------------------------------------------

_add(
    Task(
        "pyfix_median",
        "python_fix",
        "The package `stats` in /workspace has a bug: `stats.median.median` gives the wrong answer for "
        "lists of even length (it must return the mean of the two middle values of the sorted list, and "
        "raise ValueError on an empty list). Fix it.",
        {
            "stats/__init__.py": "",
            "stats/median.py": _d('''
                def median(values):
                    """The median of a list of numbers."""
                    ordered = sorted(values)
                    return ordered[len(ordered) // 2]
            '''),
            "README.md": "A tiny statistics package.\n",
        },
        _d("""
            def test_odd():
                assert load("stats.median").median([3, 1, 2]) == 2

            def test_even():
                assert load("stats.median").median([4, 1, 3, 2]) == 2.5

            def test_even_unsorted():
                assert load("stats.median").median([10, 0]) == 5

            def test_empty():
                try:
                    load("stats.median").median([])
                except ValueError:
                    return
                raise AssertionError("no ValueError")
        """),
        [
            (
                "write",
                "stats/median.py",
                _d('''
                    def median(values):
                        """The median of a list of numbers."""
                        if not values:
                            raise ValueError("median of an empty list")
                        ordered = sorted(values)
                        mid = len(ordered) // 2
                        if len(ordered) % 2:
                            return ordered[mid]
                        return (ordered[mid - 1] + ordered[mid]) / 2
                '''),
            )
        ],
    )
)

_add(
    Task(
        "pyfix_slugify",
        "python_fix",
        "`textutil.slug.slugify` in /workspace should turn a title into a URL slug: lower case, every run "
        "of characters that are not ASCII letters or digits becomes one '-', and no '-' at either end "
        '("  Hello, World!! " -> "hello-world"). It is broken; fix it.',
        {
            "textutil/__init__.py": "",
            "textutil/slug.py": _d('''
                def slugify(title):
                    """A URL slug of the title."""
                    return title.replace(" ", "-")
            '''),
        },
        _d("""
            def test_simple():
                assert load("textutil.slug").slugify("Hello World") == "hello-world"

            def test_punctuation_runs():
                assert load("textutil.slug").slugify("  Hello, World!! ") == "hello-world"

            def test_digits():
                assert load("textutil.slug").slugify("Top 10 -- Tips") == "top-10-tips"
        """),
        [
            (
                "write",
                "textutil/slug.py",
                _d('''
                    import re


                    def slugify(title):
                        """A URL slug of the title."""
                        return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")
                '''),
            )
        ],
    )
)

_add(
    Task(
        "pyfix_roman",
        "python_fix",
        "`numerals.roman.to_roman(n)` in /workspace must return the Roman numeral of 1 <= n <= 3999 with "
        "subtractive forms (4 -> IV, 9 -> IX, 40 -> XL, 90 -> XC, 400 -> CD, 900 -> CM). It gets those "
        "wrong; fix it without changing its name or signature.",
        {
            "numerals/__init__.py": "",
            "numerals/roman.py": _d('''
                VALUES = [(1000, "M"), (500, "D"), (100, "C"), (50, "L"), (10, "X"), (5, "V"), (1, "I")]


                def to_roman(n):
                    """The Roman numeral of n."""
                    out = ""
                    for value, letters in VALUES:
                        while n >= value:
                            out += letters
                            n -= value
                    return out
            '''),
        },
        _d("""
            def test_plain():
                assert load("numerals.roman").to_roman(3) == "III"
                assert load("numerals.roman").to_roman(2023) == "MMXXIII"

            def test_subtractive():
                r = load("numerals.roman").to_roman
                assert [r(4), r(9), r(40), r(90), r(400), r(900)] == ["IV", "IX", "XL", "XC", "CD", "CM"]

            def test_mixed():
                assert load("numerals.roman").to_roman(1994) == "MCMXCIV"
        """),
        [
            (
                "bash",
                'sed -i \'s/^VALUES = .*/VALUES = [(1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), '
                '(100, "C"), (90, "XC"), (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), '
                '(1, "I")]/\' numerals/roman.py',
            )
        ],
    )
)

_add(
    Task(
        "pyfix_intervals",
        "python_fix",
        "`intervals.merge.merge(pairs)` in /workspace must merge overlapping or touching closed intervals "
        "given as (start, end) tuples in any order, and return them sorted by start: "
        "[(5, 6), (1, 3), (2, 4), (4, 4)] -> [(1, 4), (5, 6)]. Fix it.",
        {
            "intervals/__init__.py": "",
            "intervals/merge.py": _d('''
                def merge(pairs):
                    """Merge overlapping intervals."""
                    out = []
                    for start, end in pairs:
                        if out and start < out[-1][1]:
                            out[-1] = (out[-1][0], end)
                        else:
                            out.append((start, end))
                    return out
            '''),
        },
        _d("""
            def test_sorted_input():
                assert load("intervals.merge").merge([(1, 3), (2, 5)]) == [(1, 5)]

            def test_unsorted_and_touching():
                assert load("intervals.merge").merge([(5, 6), (1, 3), (2, 4), (4, 4)]) == [(1, 4), (5, 6)]

            def test_contained():
                assert load("intervals.merge").merge([(1, 10), (2, 3)]) == [(1, 10)]

            def test_empty():
                assert load("intervals.merge").merge([]) == []
        """),
        [
            (
                "write",
                "intervals/merge.py",
                _d('''
                    def merge(pairs):
                        """Merge overlapping intervals."""
                        out = []
                        for start, end in sorted(pairs):
                            if out and start <= out[-1][1]:
                                out[-1] = (out[-1][0], max(end, out[-1][1]))
                            else:
                                out.append((start, end))
                        return out
                '''),
            )
        ],
    )
)

# -- cli_flag: add an argparse option -----------------------------------------------------------------

_add(
    Task(
        "cli_shout",
        "cli_flag",
        "`python3 greet.py NAME` in /workspace prints `Hello, NAME!`. Add a `--shout` flag (argparse) that "
        "prints the same line in upper case; without it the output must not change.",
        {
            "greet.py": _d("""
                import argparse


                def main():
                    parser = argparse.ArgumentParser(description="Greet someone.")
                    parser.add_argument("name")
                    args = parser.parse_args()
                    print(f"Hello, {args.name}!")


                if __name__ == "__main__":
                    main()
            """),
        },
        _d("""
            def test_plain():
                assert sh("python3 greet.py Ada") == (0, "Hello, Ada!\\n", "")

            def test_shout():
                code, out, _ = sh("python3 greet.py Ada --shout")
                assert (code, out) == (0, "HELLO, ADA!\\n")

            def test_help_mentions_flag():
                assert "--shout" in sh("python3 greet.py --help")[1]
        """),
        [
            (
                "write",
                "greet.py",
                _d("""
                    import argparse


                    def main():
                        parser = argparse.ArgumentParser(description="Greet someone.")
                        parser.add_argument("name")
                        parser.add_argument("--shout", action="store_true", help="upper case")
                        args = parser.parse_args()
                        line = f"Hello, {args.name}!"
                        print(line.upper() if args.shout else line)


                    if __name__ == "__main__":
                        main()
                """),
            )
        ],
    )
)

_add(
    Task(
        "cli_limit",
        "cli_flag",
        "`python3 head.py FILE` in /workspace prints every line of FILE. Add an integer option `--limit N` "
        "(argparse) that prints only the first N lines; without it every line is printed as before.",
        {
            "head.py": _d("""
                import argparse


                def main():
                    parser = argparse.ArgumentParser(description="Print a file.")
                    parser.add_argument("path")
                    args = parser.parse_args()
                    with open(args.path) as f:
                        for line in f:
                            print(line, end="")


                if __name__ == "__main__":
                    main()
            """),
            "lines.txt": "one\ntwo\nthree\nfour\n",
        },
        _d("""
            def test_all():
                assert sh("python3 head.py lines.txt")[1] == "one\\ntwo\\nthree\\nfour\\n"

            def test_limit():
                assert sh("python3 head.py lines.txt --limit 2")[1] == "one\\ntwo\\n"

            def test_limit_other_file():
                for _ in range(2):  # made-up lines and N, new at every run
                    lines = ["%s %d\\n" % (tag(), i) for i in range(RANDOM.randint(5, 30))]
                    n = RANDOM.randint(1, len(lines) - 1)
                    write("/tmp/l.txt", "".join(lines))
                    assert sh("python3 head.py /tmp/l.txt --limit %d" % n)[1] == "".join(lines[:n])

            def test_limit_is_int():
                code, _, err = sh("python3 head.py lines.txt --limit two")
                assert code == 2 and "invalid int" in err
        """),
        [
            (
                "bash",
                "python3 - <<'EOF'\n"
                "p = 'head.py'\n"
                "s = open(p).read()\n"
                "s = s.replace('parser.add_argument(\"path\")\\n', "
                '\'parser.add_argument("path")\\n    parser.add_argument("--limit", type=int)\\n\')\n'
                "s = s.replace('        for line in f:\\n', "
                "'        for i, line in enumerate(f):\\n            if args.limit is not None and i >= args.limit:\\n"
                "                break\\n')\n"
                "open(p, 'w').write(s)\n"
                "EOF",
            )
        ],
    )
)

_add(
    Task(
        "cli_sep",
        "cli_flag",
        "`python3 joinwords.py WORD...` in /workspace prints its words joined by single spaces. Add an "
        "option `--sep SEP` (argparse, default a single space) that joins them with SEP instead.",
        {
            "joinwords.py": _d("""
                import argparse


                def main():
                    parser = argparse.ArgumentParser(description="Join words.")
                    parser.add_argument("words", nargs="+")
                    args = parser.parse_args()
                    print(" ".join(args.words))


                if __name__ == "__main__":
                    main()
            """),
        },
        _d("""
            def test_default():
                assert sh("python3 joinwords.py a b c")[1] == "a b c\\n"

            def test_sep():
                assert sh("python3 joinwords.py --sep , a b c")[1] == "a,b,c\\n"

            def test_sep_after_words():
                assert sh("python3 joinwords.py x y --sep ' :: '")[1] == "x :: y\\n"
        """),
        [
            (
                "bash",
                'sed -i \'s/nargs="+")/nargs="+")\\n    parser.add_argument("--sep", default=" ")/\' joinwords.py',
            ),
            (
                "bash",
                "sed -i 's/print(\" \".join(args.words))/print(args.sep.join(args.words))/' joinwords.py",
            ),
        ],
    )
)

# -- shell_pipeline: repair a broken script -------------------------------------------------------------

_add(
    Task(
        "sh_top_words",
        "shell_pipeline",
        "`sh top_words.sh FILE` in /workspace should print the 3 most frequent words of FILE (words are "
        "separated by spaces or newlines), one per line as `COUNT WORD` (no leading spaces), most frequent "
        "first, ties broken alphabetically. It prints the wrong thing; repair the pipeline.",
        {
            "top_words.sh": _d("""
                #!/bin/sh
                # The 3 most frequent words of $1.
                tr ' ' '\\n' < "$1" | grep -v '^$' | uniq -c | sort -rn | head -3
            """),
            "words.txt": "b a c a\nb a\nd c a b\n",
        },
        _d("""
            def test_example():
                assert sh("sh top_words.sh words.txt")[1] == "4 a\\n3 b\\n2 c\\n"

            def test_other_input():
                trees = ["alder", "ash", "beech", "birch", "cedar", "elm", "fir", "oak", "pine", "yew"]
                for _ in range(2):  # made-up words and counts (ties too), new at every run
                    words = RANDOM.sample(trees, 5)
                    tokens = [w for w in words for _ in range(RANDOM.randint(1, 6))]
                    RANDOM.shuffle(tokens)
                    write("/tmp/w.txt", "".join(t + RANDOM.choice(" \\n") for t in tokens[:-1]) + tokens[-1] + "\\n")
                    top = sorted(words, key=lambda w: (-tokens.count(w), w))[:3]
                    assert sh("sh top_words.sh /tmp/w.txt")[1] == "".join("%d %s\\n" % (tokens.count(w), w) for w in top)
        """),
        [
            (
                "write",
                "top_words.sh",
                "#!/bin/sh\n# The 3 most frequent words of $1.\n"
                "tr ' ' '\\n' < \"$1\" | grep -v '^$' | sort | uniq -c | sort -k1,1nr -k2,2 | head -3 "
                "| awk '{print $1, $2}'\n",
            )
        ],
    )
)

_add(
    Task(
        "sh_sum_column",
        "shell_pipeline",
        "`sh total.sh FILE` in /workspace should print the sum of the second column of the tab-separated "
        "FILE, skipping its header line (for sales.tsv: 60). It does not; repair it.",
        {
            "total.sh": _d("""
                #!/bin/sh
                # Sum of column 2 of a TSV file with a header.
                cut -d ',' -f 2 "$1" | awk '{s += $1} END {print s}'
            """),
            "sales.tsv": "item\tamount\napple\t10\npear\t20\nplum\t30\n",
        },
        _d("""
            def test_sales():
                assert sh("sh total.sh sales.tsv")[1].strip() == "60"

            def test_header_with_number():
                for _ in range(2):  # a made-up file, new at every run: a number in the header, names with spaces
                    amounts = [RANDOM.randint(0, 999) for _ in range(RANDOM.randint(2, 9))]
                    body = "".join("item %s\\t%d\\n" % (tag()[:RANDOM.randint(1, 6)], a) for a in amounts)
                    write("/tmp/t.tsv", "name\\t%d\\n" % RANDOM.randint(1000, 99999) + body)
                    assert sh("sh total.sh /tmp/t.tsv")[1].strip() == str(sum(amounts))
        """),
        [("write", "total.sh", "#!/bin/sh\ntail -n +2 \"$1\" | cut -f 2 | awk '{s += $1} END {print s}'\n")],
    )
)

_add(
    Task(
        "sh_count_errors",
        "shell_pipeline",
        "`sh errors.sh FILE` in /workspace should print how many lines of the log FILE have the level "
        "ERROR (the second field, exactly `ERROR`; a message that merely mentions 'error' does not count). "
        "For app.log the answer is 2. Repair the script.",
        {
            "errors.sh": '#!/bin/sh\n# Count the ERROR lines of a log.\ngrep -ic error "$1"\n',
            "app.log": (
                "2024-01-01 INFO start\n2024-01-01 ERROR disk full\n2024-01-02 WARN error rate high\n"
                "2024-01-02 ERROR timeout\n2024-01-03 INFO no error\n"
            ),
        },
        _d("""
            def test_app_log():
                assert sh("sh errors.sh app.log")[1].strip() == "2"

            def test_other_log():
                messages = ["ok", "error seen", "no error", "Error rate high", "disk full", "retry after error"]
                for _ in range(3):  # made-up logs, new at every run: 0-30 ERROR lines among 0-30 others
                    levels = ["ERROR"] * RANDOM.randint(0, 30) + [
                        RANDOM.choice(["INFO", "WARN", "DEBUG"]) for _ in range(RANDOM.randint(0, 30))
                    ]
                    RANDOM.shuffle(levels)
                    write("/tmp/l.log", "".join(
                        "2024-02-%02d %s %s\\n" % (RANDOM.randint(1, 28), level, RANDOM.choice(messages))
                        for level in levels
                    ))
                    assert sh("sh errors.sh /tmp/l.log")[1].strip() == str(levels.count("ERROR"))
        """),
        [("write", "errors.sh", '#!/bin/sh\nawk \'$2 == "ERROR" {n++} END {print n + 0}\' "$1"\n')],
    )
)

_add(
    Task(
        "sh_unique_ips",
        "shell_pipeline",
        "`sh unique_ips.sh FILE` in /workspace should print the number of distinct client IPs (the first "
        "field) in the access log FILE (4 for access.log). It counts wrong; repair it.",
        {
            "unique_ips.sh": "#!/bin/sh\n# Distinct client IPs of an access log.\ncut -d ' ' -f 1 \"$1\" | uniq | wc -l\n",
            "access.log": (
                "10.0.0.1 GET /\n10.0.0.2 GET /a\n10.0.0.1 GET /b\n10.0.0.3 GET /\n10.0.0.2 GET /c\n"
                "10.0.0.4 GET /\n10.0.0.1 GET /\n"
            ),
        },
        _d("""
            def test_access_log():
                assert sh("sh unique_ips.sh access.log")[1].strip() == "4"

            def test_interleaved():
                for _ in range(3):  # made-up logs, new at every run: 2-40 distinct IPs, repeated, interleaved
                    ips = set()
                    wanted = RANDOM.randint(2, 40)
                    while len(ips) < wanted:
                        ips.add("10.%d.%d.%d" % (RANDOM.randint(0, 255), RANDOM.randint(0, 255), RANDOM.randint(1, 254)))
                    clients = sorted(ips) + [RANDOM.choice(sorted(ips)) for _ in range(RANDOM.randint(1, 40))]
                    RANDOM.shuffle(clients)
                    write("/tmp/a.log", "".join("%s GET /%s\\n" % (ip, tag()[:4]) for ip in clients))
                    assert sh("sh unique_ips.sh /tmp/a.log")[1].strip() == str(len(ips))
        """),
        [("bash", "sed -i 's/| uniq |/| sort -u |/' unique_ips.sh")],
    )
)

# -- csv_clean: a CSV into a given schema ----------------------------------------------------------------

_add(
    Task(
        "csv_people",
        "csv_clean",
        "Clean /workspace/raw_people.csv into /workspace/people.csv with the header `id,name,age`: id and "
        "age as plain integers, name stripped of surrounding spaces and in Title Case, rows without an age "
        "dropped, duplicate ids kept once (the first), rows sorted by id. Leave raw_people.csv as it is.",
        {
            "raw_people.csv": (
                "id,name,age\n3, carol smith ,41\n1,ALICE jones,30\n2,bob,\n1,Alice Jones,30\n"
                "4,  dave  , 27 \n"
            ),
        },
        _d("""
            def test_header():
                assert rows("people.csv")[0] == ["id", "name", "age"]

            def test_rows():
                assert rows("people.csv")[1:] == [["1", "Alice Jones", "30"], ["3", "Carol Smith", "41"],
                                                  ["4", "Dave", "27"]]

            def test_raw_untouched():
                assert read("raw_people.csv").startswith("id,name,age\\n3, carol smith ,41\\n")
        """),
        [("write", "people.csv", "id,name,age\n1,Alice Jones,30\n3,Carol Smith,41\n4,Dave,27\n")],
    )
)

_add(
    Task(
        "csv_prices",
        "csv_clean",
        "Convert /workspace/orders.csv into /workspace/orders_clean.csv with the header "
        "`order_id,date,price_cents`: date as ISO `YYYY-MM-DD` (the input is US style M/D/YYYY), price as an "
        "integer number of cents (the input looks like `$1,234.50`), same row order.",
        {
            "orders.csv": (
                'order_id,date,price\nA1,3/4/2024,"$1,234.50"\nA2,12/25/2023,$5\nA3,1/31/2024,$0.99\n'
            ),
        },
        _d("""
            def test_header():
                assert rows("orders_clean.csv")[0] == ["order_id", "date", "price_cents"]

            def test_values():
                assert rows("orders_clean.csv")[1:] == [["A1", "2024-03-04", "123450"],
                                                        ["A2", "2023-12-25", "500"],
                                                        ["A3", "2024-01-31", "99"]]
        """),
        [
            (
                "write",
                "orders_clean.csv",
                "order_id,date,price_cents\nA1,2024-03-04,123450\nA2,2023-12-25,500\nA3,2024-01-31,99\n",
            )
        ],
    )
)

_add(
    Task(
        "csv_emails",
        "csv_clean",
        "From /workspace/contacts.csv write /workspace/emails.csv with the header `email,domain`: each "
        "valid address once (lower case, surrounding spaces removed; valid means exactly one '@' with "
        "text before it and a '.' in the part after it), domain = the part after '@', sorted by email.",
        {
            "contacts.csv": (
                "name,email\nAnn, Ann@Example.com\nBo,bo@mail.org\nCy,not-an-email\nAnn2,ann@example.com\n"
                "Di,di@@x.com\nEd,ed@localhost\n"
            ),
        },
        _d("""
            def test_header():
                assert rows("emails.csv")[0] == ["email", "domain"]

            def test_rows():
                assert rows("emails.csv")[1:] == [["ann@example.com", "example.com"], ["bo@mail.org", "mail.org"]]
        """),
        [("write", "emails.csv", "email,domain\nann@example.com,example.com\nbo@mail.org,mail.org\n")],
    )
)

# -- git_merge: a conflicted merge in a local repository ------------------------------------------------

_GIT_BASE = ["init -q -b main", "config user.name Workspace", "config user.email workspace@example.com"]

# The merge tasks' test_merge_committed: the merge is in the repository, not only in the working tree. git
# runs without replace refs (a `git replace --graft` would show parents a commit does not have) and without
# the fsmonitor hook; HEAD's stored commit has two parents, the second `feature`; every file HEAD tracks is
# in the working tree byte for byte as committed (whatever the index's assume-unchanged / skip-worktree
# flags hide from `git status`); and nothing is staged or changed.
_GIT_COMMITTED = _d("""

    def git(args):
        return sh("GIT_NO_REPLACE_OBJECTS=1 git -c core.fsmonitor=false " + args)

    def test_merge_committed():
        assert git("status --porcelain --untracked-files=no")[1] == ""
        code, commit, err = git("cat-file commit HEAD")
        assert code == 0, err
        header = commit.split("\\n\\n", 1)[0].splitlines()
        parents = [line.split()[1] for line in header if line.startswith("parent ")]
        assert len(parents) == 2, "HEAD has %d parents" % len(parents)
        assert parents[1] == git("rev-parse --verify -q feature^{commit}")[1].strip(), "not a merge of feature"
        tracked = [n for n in git("ls-tree -r -z --name-only HEAD")[1].split("\\0") if n]
        assert tracked
        for name in tracked:
            code, blob, err = git("cat-file blob " + shlex.quote("HEAD:" + name))
            assert code == 0 and blob == read(name), "%s is not as committed" % name
""")

_add(
    Task(
        "git_settings",
        "git_merge",
        "/workspace is a git repository in the middle of a merge of branch `feature` into `main` with a "
        "conflict in settings.ini. Resolve it keeping BOTH sides' new settings (main raised timeout to 30, "
        "feature added retries = 5; keep timeout = 30), then conclude the merge with a commit.",
        {"settings.ini": "[server]\nport = 8080\ntimeout = 10\n"},
        _d("""
            def test_no_markers():
                text = read("settings.ini")
                assert "<<<<<<<" not in text and ">>>>>>>" not in text and "=======" not in text

            def test_both_settings():
                lines = [l.replace(" ", "") for l in read("settings.ini").splitlines()]
                assert "timeout=30" in lines and "retries=5" in lines and "port=8080" in lines

        """)
        + _GIT_COMMITTED,
        [
            ("write", "settings.ini", "[server]\nport = 8080\ntimeout = 30\nretries = 5\n"),
            ("bash", "git add settings.ini && git commit -q --no-edit"),
        ],
        git=[
            *_GIT_BASE,
            "add -A",
            "commit -q -m base",
            "checkout -q -b feature",
            "!sed -i 's/^timeout = 10$/timeout = 10\\nretries = 5/' settings.ini",
            "commit -q -am 'add retries'",
            "checkout -q main",
            "!sed -i 's/^timeout = 10$/timeout = 30/' settings.ini",
            "commit -q -am 'raise timeout'",
            "?merge feature",
        ],
    )
)

_add(
    Task(
        "git_discount",
        "git_merge",
        "/workspace is a git repository with an unfinished merge of branch `feature` into `main`: "
        "shop.py conflicts. main made `price` round to 2 decimals; feature added a `discount` parameter "
        "(a fraction, default 0). Resolve it so `price(amount, qty, discount=0)` returns "
        "round(amount * qty * (1 - discount), 2), and commit the merge.",
        {"shop.py": "def price(amount, qty):\n    return amount * qty\n"},
        _d("""
            def test_no_markers():
                assert "<<<<<<<" not in read("shop.py") and ">>>>>>>" not in read("shop.py")

            def test_behaviour():
                price = load("shop").price
                assert price(1.005, 3) == round(1.005 * 3, 2)
                assert price(10, 2, discount=0.25) == 15.0
                assert price(3.333, 1, 0.1) == round(3.333 * 0.9, 2)

        """)
        + _GIT_COMMITTED,
        [
            (
                "write",
                "shop.py",
                "def price(amount, qty, discount=0):\n    return round(amount * qty * (1 - discount), 2)\n",
            ),
            ("bash", "git add shop.py && git commit -q --no-edit"),
        ],
        git=[
            *_GIT_BASE,
            "add -A",
            "commit -q -m base",
            "checkout -q -b feature",
            "!printf 'def price(amount, qty, discount=0):\\n    return amount * qty * (1 - discount)\\n' > shop.py",
            "commit -q -am discount",
            "checkout -q main",
            "!printf 'def price(amount, qty):\\n    return round(amount * qty, 2)\\n' > shop.py",
            "commit -q -am round",
            "?merge feature",
        ],
    )
)

_add(
    Task(
        "git_authors",
        "git_merge",
        "/workspace is a git repository with a conflicted merge of branch `feature` into `main` in "
        "AUTHORS. Resolve it so AUTHORS lists every name added on either branch, one per line, sorted "
        "alphabetically, and commit the merge.",
        {"AUTHORS": "Ada\nGrace\n"},
        _d("""
            def test_names():
                assert read("AUTHORS").split() == ["Ada", "Barbara", "Grace", "Katherine", "Linus"]

        """)
        + _GIT_COMMITTED,
        [
            ("write", "AUTHORS", "Ada\nBarbara\nGrace\nKatherine\nLinus\n"),
            ("bash", "git add AUTHORS && git commit -q -m 'merge feature'"),
        ],
        git=[
            *_GIT_BASE,
            "add -A",
            "commit -q -m base",
            "checkout -q -b feature",
            "!printf 'Ada\\nGrace\\nLinus\\n' > AUTHORS",
            "commit -q -am linus",
            "checkout -q main",
            "!printf 'Ada\\nGrace\\nBarbara\\nKatherine\\n' > AUTHORS",
            "commit -q -am more",
            "?merge feature",
        ],
    )
)

# -- makefile: write a Makefile target -------------------------------------------------------------------

_add(
    Task(
        "make_clean",
        "makefile",
        "The Makefile in /workspace has a `build` target that writes build/app.txt. Add a `clean` target "
        "that removes the build directory (and does not fail when it does not exist). Keep `build` working.",
        {
            "Makefile": "build:\n\tmkdir -p build\n\tcat src/*.txt > build/app.txt\n",
            "src/a.txt": "alpha\n",
            "src/b.txt": "beta\n",
        },
        _d("""
            def test_build_then_clean():
                assert sh("make build")[0] == 0 and read("build/app.txt") == "alpha\\nbeta\\n"
                assert sh("make clean")[0] == 0 and not os.path.exists("/workspace/build")
                # only the build directory goes: the sources stay, and build works again
                assert read("src/a.txt") == "alpha\\n" and read("src/b.txt") == "beta\\n"
                assert sh("make build")[0] == 0 and read("build/app.txt") == "alpha\\nbeta\\n"

            def test_clean_twice():
                sh("make clean")
                assert sh("make clean")[0] == 0
        """),
        [("bash", "printf '\\nclean:\\n\\trm -rf build\\n' >> Makefile")],
    )
)

_add(
    Task(
        "make_dist",
        "makefile",
        "Add a `dist` target to /workspace/Makefile that creates dist/notes.tar.gz, a gzipped tar of the "
        "directory notes/ (members named notes/...), creating dist/ when needed.",
        {
            "Makefile": ".PHONY: all\nall:\n\t@echo nothing to build\n",
            "notes/one.md": "# One\n",
            "notes/two.md": "# Two\n",
        },
        _d("""
            def test_dist():
                code, _, err = sh("rm -rf dist && make dist")
                assert code == 0, err
                import tarfile
                with tarfile.open("/workspace/dist/notes.tar.gz", "r:gz") as t:
                    names = set(t.getnames())
                    assert t.extractfile("notes/one.md").read() == b"# One\\n"
                assert {"notes/one.md", "notes/two.md"} <= names

            def test_dist_follows_the_directory():
                # a note the target has never seen (name and text new at every run) is in the archive
                note = tag()
                write("notes/%s.md" % note, "# %s\\n" % note)
                try:
                    code, _, err = sh("rm -rf dist && make dist")
                finally:
                    os.remove("/workspace/notes/%s.md" % note)
                assert code == 0, err
                import tarfile
                with tarfile.open("/workspace/dist/notes.tar.gz", "r:gz") as t:
                    assert t.extractfile("notes/%s.md" % note).read() == ("# %s\\n" % note).encode()
        """),
        [
            (
                "bash",
                "printf '\\ndist:\\n\\tmkdir -p dist\\n\\ttar czf dist/notes.tar.gz notes\\n' >> Makefile",
            )
        ],
    )
)

_add(
    Task(
        "make_stats",
        "makefile",
        "Add a `stats` target to /workspace/Makefile that prints exactly one line `total: N`, where N is "
        "the number of lines in all data/*.txt files together (make must not echo the commands).",
        {
            "Makefile": ".PHONY: all\nall:\n\t@echo ok\n",
            "data/x.txt": "1\n2\n3\n",
            "data/y.txt": "4\n5\n",
        },
        _d("""
            def test_stats():
                code, out, _ = sh("make -s stats")
                assert code == 0 and out == "total: 5\\n"

            def test_stats_not_echoed_and_follows_data():
                for _ in range(2):  # a data file the target has never seen: its name and length new at every run
                    path, n = "data/%s.txt" % tag(), RANDOM.randint(1, 60)
                    write(path, "".join("%d\\n" % RANDOM.randint(0, 999) for _ in range(n)))
                    try:
                        code, out, _ = sh("make stats")
                    finally:
                        os.remove(os.path.join("/workspace", path))
                    assert code == 0 and out == "total: %d\\n" % (5 + n), out
        """),
        [("bash", "printf '\\nstats:\\n\\t@echo \"total: $$(cat data/*.txt | wc -l)\"\\n' >> Makefile")],
    )
)

_add(
    Task(
        "make_test",
        "makefile",
        "Add a `test` target to /workspace/Makefile that runs the unit tests in tests/ with "
        "`python3 -m unittest discover -s tests` and fails when they fail. Do not change the tests.",
        {
            "Makefile": "run:\n\tpython3 calc.py\n",
            "calc.py": "def add(a, b):\n    return a + b\n",
            "tests/test_calc.py": _d("""
                import sys
                import unittest

                sys.path.insert(0, ".")
                from calc import add


                class T(unittest.TestCase):
                    def test_add(self):
                        self.assertEqual(add(2, 3), 5)
            """),
        },
        _d("""
            # Each run plants a unit test the Makefile has never seen (tests/test_probe_<tag>.py, the tag new at
            # every run) that records it ran (/tmp/ran-<tag>) and passes or fails as asked (it checks add(x, y),
            # or x + y alone when calc.py is broken, so that only tests/test_calc.py can fail the suite then);
            # calc.py may be swapped for a made-up equivalent or broken add. `make test` must exit 0 exactly
            # when the suite passes, and the planted test must have run: its verdict is not told by its name,
            # nor by calc.py's text.
            CALC_SAME = ["return b + a", "return sum((a, b))", "return a - (-b)", "return (a + b) * 1"]
            CALC_BROKEN = ["return a - b", "return a * b", "return b - a", "return a + b + %d", "return a + b - %d"]

            def make_test(passing, calc=None, uses_add=True):
                probe, x, y = tag(), RANDOM.randint(1, 10**6), RANDOM.randint(1, 10**6)
                planted = "/workspace/tests/test_probe_%s.py" % probe
                write(planted, (
                    "import sys\\nimport unittest\\n\\nsys.path.insert(0, '.')\\nfrom calc import add\\n\\n\\n"
                    "def sum_of(a, b):\\n    return a + b\\n\\n\\n"
                    "class Probe(unittest.TestCase):\\n    def test_%s(self):\\n"
                    "        with open('/tmp/ran-%s', 'w') as f:\\n            f.write('%s')\\n"
                    "        self.assertEqual(%s(%d, %d), %d)\\n"
                ) % (probe, probe, probe, "add" if uses_add else "sum_of", x, y,
                     x + y if passing else x + y + RANDOM.randint(1, 99)))
                original = read("calc.py")
                if calc is not None:
                    write("calc.py", "def add(a, b):\\n    # %s\\n    %s\\n" % (tag(), calc.replace("%d", str(RANDOM.randint(1, 99)))))
                try:
                    for cache in ("__pycache__", "tests/__pycache__"):
                        shutil.rmtree(os.path.join("/workspace", cache), ignore_errors=True)
                    code, _, err = sh("make test")
                finally:
                    os.remove(planted)
                    write("calc.py", original)
                    for cache in ("__pycache__", "tests/__pycache__"):
                        shutil.rmtree(os.path.join("/workspace", cache), ignore_errors=True)
                ran = os.path.exists("/tmp/ran-" + probe) and open("/tmp/ran-" + probe).read() == probe
                return code, ran, err[-300:]

            def test_passes():
                for calc in (None, RANDOM.choice(CALC_SAME)):
                    code, ran, err = make_test(True, calc)
                    assert ran, "the planted passing test did not run"
                    assert code == 0, "make test failed on a passing suite: " + err

            def test_fails_when_a_test_fails():
                code, ran, err = make_test(False)
                assert ran, "the planted failing test did not run"
                assert code != 0, "make test passed a failing test"

            def test_fails_when_calc_breaks():
                code, ran, err = make_test(True, RANDOM.choice(CALC_BROKEN), uses_add=False)
                assert ran, "the planted test did not run"
                assert code != 0, "make test passed with add() broken"
        """),
        [("bash", "printf '\\ntest:\\n\\tpython3 -m unittest discover -s tests\\n' >> Makefile")],
    )
)

TASKS_BY_ID: dict[str, Task] = {t.task_id: t for t in TASKS}
assert len(TASKS_BY_ID) == len(TASKS), "task ids must be unique"

_GIT_ENV = {
    "GIT_AUTHOR_DATE": "2024-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2024-01-01T00:00:00Z",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
}


def build_workspace(task: Task, dest: Path) -> None:
    """Write the task's workspace into the (new) directory ``dest``. Merge tasks run their ``git`` steps
    there: ``!cmd`` a shell command, ``?args`` a git command expected to fail (the conflicted merge), else
    git arguments; the dates are fixed, so the same task always gives the same repository."""
    dest.mkdir(parents=True)
    for rel, content in task.files.items():
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    env = {**os.environ, **_GIT_ENV}
    for step in task.git:
        if step.startswith("!"):
            subprocess.run(step[1:], shell=True, cwd=dest, check=True, env=env, timeout=30)
            continue
        expect_failure = step.startswith("?")
        proc = subprocess.run(
            f"git {step.lstrip('?')}",
            shell=True,
            cwd=dest,
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        if (proc.returncode != 0) != expect_failure:
            raise RuntimeError(
                f"{task.task_id}: git {step!r} exited {proc.returncode}: {proc.stderr.strip()}"
            )
