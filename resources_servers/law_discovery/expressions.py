"""Law expressions: parsed from text without ``eval``, evaluated with floats, compared by form.

A law is written in Python's arithmetic syntax over the task's variables: numbers, ``+ - * / **``
(``^`` is read as ``**``), parentheses, the functions of :data:`FUNCTIONS` and the constants ``pi`` and
``e``; an optional ``<target> =`` in front is dropped. The text comes from a model, so it is parsed
with :mod:`ast` into a small checked tree (never evaluated as Python, never handed to sympy's
``parse_expr``, which calls ``eval``): anything else is a :class:`LawSyntaxError` saying what.

Two uses, two evaluators:

* :func:`evaluate` computes the tree with floats (microseconds: fine on the event loop for the
  ``fit_check`` tool). Every number is a float, so ``10**10**10`` overflows at once instead of
  building a huge integer.
* :func:`same_form` (sympy, CPU-heavy: run it in the verify pool) says whether two laws have the same
  form up to their constants: both are expanded, exponents made exact (``2.5`` -> ``5/2``), and every
  other number (coefficients, additive constants, ``pi``) replaced by one placeholder, so
  ``6.1e-3*m1*m2/r**3`` and ``G*m1*m2/r**3`` with any ``G`` have the same form and ``r**2`` does not.
  Whether the constants are right is the numeric check's business (:func:`rmsle`).

What may reach sympy is bounded before any simplification, because its exact arithmetic and expansion
are costly on purpose-built input (``m1*10**10**10`` is an exact integer of ten billion digits,
``(m1+m2+r+1)**30*(m1+r)**30`` an expansion of hundreds of thousands of terms). :func:`parse_law` refuses
a law (:class:`TooCostlyError`, "too costly to compare") that nests deeper than :data:`MAX_DEPTH`, holds
a number beyond the float range, raises anything to a numeric power beyond :data:`MAX_EXPONENT` (or to
powers whose product along a nesting passes :data:`MAX_POWER_PRODUCT`), or whose expansion is estimated
past :data:`MAX_TERMS` terms or :data:`MAX_WORK` products. What passes these bounds is still run under a
CPU-time budget (:func:`cpu_budget`, a ``SIGPROF`` timer that aborts the computation in its own process),
so a form check never holds its worker for long.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import math
import operator
import signal
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from nemo_gym.kit import pyast

MAX_EXPRESSION_CHARS = 500
MAX_NODES = 200
# Bounds on what reaches sympy (see the module docstring); physical laws stay far inside them.
MAX_DEPTH = 32  # nesting of the expression tree
MAX_EXPONENT = 100  # |p| of a numeric exponent
MAX_POWER_PRODUCT = 1000  # product of the |p| > 1 of numeric exponents nested in one another
MAX_TERMS = 1000  # estimated terms of the expanded law (or of any part of it)
MAX_WORK = 10_000  # estimated term products the expansion computes
TOO_COSTLY = "too costly to compare"
FUNCTIONS: dict[str, Callable[[float], float]] = {
    "exp": math.exp,
    "log": math.log,
    "sqrt": math.sqrt,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
    "abs": abs,
}
CONSTANTS = {"pi": math.pi, "e": math.e}
_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}
_SYMBOLS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.Pow: "**"}


class LawSyntaxError(ValueError):
    """The text is not a law this environment reads; the message says why (shown to the model)."""


class UnknownSymbolsError(LawSyntaxError):
    """The law names symbols that are not the task's variables."""

    def __init__(self, unknown: Sequence[str], allowed: Iterable[str]) -> None:
        self.unknown = list(unknown)
        super().__init__(
            f"unknown symbol(s) {', '.join(self.unknown)}: a law may use only the variables "
            f"{', '.join(sorted(allowed))}, numbers, pi, e and the functions {', '.join(FUNCTIONS)}"
        )


class TooCostlyError(LawSyntaxError):
    """The law is too costly to compare (the message starts with :data:`TOO_COSTLY` and says why)."""

    def __init__(self, why: str) -> None:
        super().__init__(f"{TOO_COSTLY}: {why}; write the law in a simpler form")


class Law:
    """A checked expression tree (from :func:`parse_law`); never mutated, so parsed laws can be shared."""

    def __init__(self, tree: ast.expr) -> None:
        self.tree = tree

    @functools.cached_property
    def text(self) -> str:
        """The normalised text (``ast.unparse``: the slow part of parsing, so only when asked)."""
        return ast.unparse(self.tree)

    def __repr__(self) -> str:
        return f"Law({self.text!r})"


def parse_law(text: str, variables: Iterable[str], target: str | None = None) -> Law:
    """The law in ``text`` over ``variables``; :class:`LawSyntaxError` (or :class:`UnknownSymbolsError`,
    or :class:`TooCostlyError` past a cost bound) naming what is wrong."""
    if not isinstance(text, str) or not text.strip():
        raise LawSyntaxError("the law is empty: write an expression such as 2.5*x**2/y")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise LawSyntaxError(f"the law is {len(text)} characters long; at most {MAX_EXPRESSION_CHARS}")
    allowed = set(variables)
    source = text.strip().replace("^", "**").replace("\u2212", "-").replace("\u00d7", "*")
    if "=" in source:
        left, _, right = source.partition("=")
        if "=" in right or (target is not None and left.strip() not in (target, "")):
            raise LawSyntaxError(f"write only the right-hand side of the law for {target or 'the target'}")
        source = right.strip()
    try:
        tree = pyast.parse(source, mode="eval").body
    except SyntaxError as e:
        raise LawSyntaxError(f"not an arithmetic expression ({e.msg} at column {e.offset})") from None
    nodes = sum(1 for _ in ast.walk(tree))
    if nodes > MAX_NODES:
        raise LawSyntaxError(f"the law has {nodes} parts; at most {MAX_NODES}")
    unknown: list[str] = []
    _check(tree, allowed, unknown)
    if unknown:
        raise UnknownSymbolsError(sorted(set(unknown)), allowed)
    check_cost(tree)
    return Law(tree)


@functools.lru_cache(maxsize=4096)
def parse_row_law(text: str, variables: tuple[str, ...], target: str | None) -> Law:
    """:func:`parse_law` for a row's law, remembered: the rows of a GRPO group (and of repeated runs)
    carry the same law, and ``/seed_session`` and ``/verify`` both need it."""
    return parse_law(text, variables, target)


def _check(node: ast.expr, allowed: set[str], unknown: list[str]) -> None:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise LawSyntaxError(f"{node.value!r} is not a number")
        return
    if isinstance(node, ast.Name):
        if node.id not in allowed and node.id not in CONSTANTS:
            unknown.append(node.id)
        return
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        _check(node.left, allowed, unknown)
        _check(node.right, allowed, unknown)
        return
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        _check(node.operand, allowed, unknown)
        return
    if isinstance(node, ast.Call):
        name = node.func.id if isinstance(node.func, ast.Name) else None
        if name not in FUNCTIONS:
            raise LawSyntaxError(
                f"unknown function {ast.unparse(node.func)!r}; the functions are {', '.join(FUNCTIONS)}"
            )
        if len(node.args) != 1 or node.keywords:
            raise LawSyntaxError(f"{name}() takes exactly one argument")
        _check(node.args[0], allowed, unknown)
        return
    raise LawSyntaxError(
        f"{ast.unparse(node)!r} is not allowed in a law (numbers, variables, + - * / **, functions)"
    )


def check_cost(tree: ast.expr) -> None:
    """:class:`TooCostlyError` when ``tree`` (checked by :func:`_check`) passes a bound of the module
    docstring: what sympy's exact arithmetic and expansion could not do in bounded time."""
    _cost(tree, 1.0, 1)


def _numeric(node: ast.expr) -> float | None:
    """The value of a subtree made of numbers only (floats), None when it holds a variable;
    :class:`TooCostlyError` when it has no finite float value (sympy would compute it exactly)."""
    if any(isinstance(n, ast.Name) and n.id not in CONSTANTS for n in ast.walk(node)):
        return None
    try:
        value = _eval(node, {})
    except (ZeroDivisionError, OverflowError, ValueError):
        value = math.nan
    if isinstance(value, complex) or not math.isfinite(value):
        raise TooCostlyError(f"{ast.unparse(node)[:60]} is not a finite number")
    return value


def _bounded(terms: int, work: int) -> tuple[int, int]:
    if terms > MAX_TERMS or work > MAX_WORK:
        raise TooCostlyError(
            f"expanded, the law would have about {terms} terms from {work} products "
            f"(at most {MAX_TERMS} and {MAX_WORK})"
        )
    return terms, work


def _cost(node: ast.expr, power: float, depth: int) -> tuple[int, int]:
    """(terms, products) of ``node`` expanded, estimated from above; ``power`` is the product of the
    numeric exponents it is nested in. Raises :class:`TooCostlyError` at the first bound passed."""
    if depth > MAX_DEPTH:
        raise TooCostlyError(f"the law nests deeper than {MAX_DEPTH} levels")
    if isinstance(node, ast.Constant):
        try:
            finite = math.isfinite(float(node.value))
        except OverflowError:
            finite = False
        if not finite:
            raise TooCostlyError(f"the number {ast.unparse(node)[:40]} is beyond the float range")
        return 1, 1
    if isinstance(node, ast.Name):
        return 1, 1
    if isinstance(node, ast.UnaryOp):
        return _cost(node.operand, power, depth + 1)
    if isinstance(node, ast.Call):
        terms, work = _cost(node.args[0], power, depth + 1)
        assert isinstance(node.func, ast.Name)
        out = 1
        if node.func.id == "log":  # log(a*b) expands to log(a) + log(b)
            out = sum(1 for n in ast.walk(node.args[0]) if isinstance(n, ast.Name | ast.Constant))
        return _bounded(out, work + terms)
    assert isinstance(node, ast.BinOp)
    if isinstance(node.op, ast.Pow):
        exponent = _numeric(node.right)
        if exponent is None:  # x**(a + b) expands to x**a * x**b: one term
            base_terms, base_work = _cost(node.left, power, depth + 1)
            exp_terms, exp_work = _cost(node.right, power, depth + 1)
            return _bounded(1, base_work + exp_work + base_terms * exp_terms)
        if abs(exponent) > MAX_EXPONENT:
            raise TooCostlyError(f"the exponent {exponent:.6g} is beyond +-{MAX_EXPONENT}")
        power *= max(1.0, abs(exponent))
        if power > MAX_POWER_PRODUCT:
            raise TooCostlyError(
                f"the powers nested in one another multiply to {power:.6g} (at most {MAX_POWER_PRODUCT})"
            )
        base_terms, base_work = _cost(node.left, power, depth + 1)
        whole = int(abs(exponent))  # (a + b)**2.5 expands to (a**2 + 2*a*b + b**2)*sqrt(a + b)
        expanded = math.comb(whole + base_terms - 1, base_terms - 1) if whole and base_terms > 1 else 1
        terms = expanded if exponent > 0 else 1  # a negative power's expansion is in a denominator
        return _bounded(terms, base_work + expanded * base_terms)
    left_terms, left_work = _cost(node.left, power, depth + 1)
    right_terms, right_work = _cost(node.right, power, depth + 1)
    if isinstance(node.op, ast.Add | ast.Sub):
        terms = left_terms + right_terms
    elif isinstance(node.op, ast.Mult):
        terms = left_terms * right_terms
    else:  # a/(b + c): the numerator's terms, each over the expanded denominator
        terms = left_terms
    return _bounded(terms, left_work + right_work + terms)


def evaluate(law: Law, values: Mapping[str, float]) -> float:
    """The law's value at ``values`` (floats throughout); ``ValueError`` when it is undefined there
    (division by zero, log of a negative, overflow)."""
    try:
        result = _eval(law.tree, values)
    except (ZeroDivisionError, OverflowError, ValueError) as e:
        raise ValueError(f"the law is undefined at {dict(values)}: {e}") from None
    if isinstance(result, complex) or not math.isfinite(result):
        raise ValueError(f"the law is not a finite real number at {dict(values)}")
    return result


def _eval(node: ast.expr, values: Mapping[str, float]) -> float:
    if isinstance(node, ast.Constant):
        return float(node.value)
    if isinstance(node, ast.Name):
        return float(values[node.id]) if node.id in values else CONSTANTS[node.id]
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left, values), _eval(node.right, values)
        result = _BINARY[type(node.op)](left, right)
        if isinstance(result, complex):  # a negative number to a fractional power
            raise ValueError(f"{left} ** {right} is not real")
        return result
    if isinstance(node, ast.UnaryOp):
        value = _eval(node.operand, values)
        return -value if isinstance(node.op, ast.USub) else value
    assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    return FUNCTIONS[node.func.id](_eval(node.args[0], values))


def rmsle(law: Law, truth: Law, points: Sequence[Mapping[str, float]]) -> float:
    """Root mean squared log error of ``law`` against ``truth`` over ``points`` (``inf`` when the law is
    undefined at a point or has the other sign: no partial credit for a curve that is not there)."""
    total = 0.0
    for point in points:
        want = evaluate(truth, point)
        try:
            got = evaluate(law, point)
        except ValueError:
            return math.inf
        if got == 0 or want == 0 or (got > 0) != (want > 0):
            if got == want:
                continue
            return math.inf
        total += (math.log(abs(got)) - math.log(abs(want))) ** 2
    return math.sqrt(total / max(1, len(points)))


def rmsle_of_measurements(law: Law, measurements: Sequence[tuple[Mapping[str, float], float]]) -> float:
    """:func:`rmsle` of ``law`` against measured values (for the ``fit_check`` tool)."""
    total = 0.0
    for point, measured in measurements:
        try:
            got = evaluate(law, point)
        except ValueError:
            return math.inf
        if got == 0 or measured == 0 or (got > 0) != (measured > 0):
            return math.inf
        total += (math.log(abs(got)) - math.log(abs(measured))) ** 2
    return math.sqrt(total / max(1, len(measurements)))


# -- form, by sympy (run in the verify pool) -------------------------------------------------------


def to_sympy(law: Law) -> Any:
    """The law as a sympy expression, built from the checked tree (exponents exact rationals)."""
    import sympy

    def build(node: ast.expr) -> Any:
        if isinstance(node, ast.Constant):
            return sympy.Float(node.value) if isinstance(node.value, float) else sympy.Integer(node.value)
        if isinstance(node, ast.Name):
            if node.id == "pi":
                return sympy.pi
            if node.id == "e":
                return sympy.E
            return sympy.Symbol(node.id, positive=True)
        if isinstance(node, ast.BinOp):
            left, right = build(node.left), build(node.right)
            op = type(node.op)
            if op is ast.Pow:
                return sympy.Pow(left, _exact(right))
            if op is ast.Add:
                return left + right
            if op is ast.Sub:
                return left - right
            if op is ast.Mult:
                return left * right
            return left / right
        if isinstance(node, ast.UnaryOp):
            value = build(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        name = node.func.id
        function = {"abs": sympy.Abs}.get(name) or getattr(sympy, name)
        return function(build(node.args[0]))

    return build(law.tree)


def _exact(exponent: Any) -> Any:
    """A numeric exponent as an exact rational (2.5 -> 5/2, 0.3333 stays 3333/10000): the form of a law
    includes its exponents, so 2.49 is not 2.5."""
    import sympy

    if exponent.is_Number:
        return sympy.nsimplify(exponent, rational=True)
    return exponent


def form(law: Law) -> Any:
    """The law's form: expanded, every number outside an exponent replaced by one placeholder symbol."""
    import sympy

    placeholder = sympy.Symbol("CONST", positive=True)

    def scaled(term: Any) -> Any:
        """``term`` with a constant factor: ``m1`` and ``1.02*m1`` have the same form (the 1 is a constant)."""
        if term == placeholder or (term.is_Mul and placeholder in term.args):
            return term
        return placeholder * term

    def blank(expr: Any) -> Any:
        if expr.is_Number or expr.is_NumberSymbol:
            return placeholder
        if not expr.args:
            return expr
        if expr.is_Pow:
            base, exponent = expr.args
            base = blank(base)
            if exponent.is_Number:
                return placeholder if base == placeholder else sympy.Pow(base, exponent)
            return sympy.Pow(base, scaled(blank(exponent)))
        parts = [blank(a) for a in expr.args]
        if expr.is_Mul:
            rest = [p for p in parts if p != placeholder]
            return sympy.Mul(*([placeholder] if len(rest) < len(parts) else []), *rest)
        if expr.is_Add:
            return sympy.Add(*dict.fromkeys(scaled(p) for p in parts))  # CONST + CONST is one CONST
        if all(p == placeholder for p in parts):
            return placeholder  # exp(CONST): a constant
        return expr.func(*(scaled(p) for p in parts))

    return scaled(blank(sympy.expand(sympy.powsimp(sympy.expand(to_sympy(law)), force=True))))


class OutOfBudget(BaseException):
    """Raised in the thread running under :func:`cpu_budget` when its budget is used up (a
    ``BaseException``, so library code's ``except Exception`` cannot swallow it)."""


_budget_armed = False


def _on_budget_signal(signum: int, frame: Any) -> None:
    if _budget_armed:
        raise OutOfBudget()


@contextlib.contextmanager
def cpu_budget(seconds: float) -> Iterator[bool]:
    """Abort the body with :class:`OutOfBudget` once this process has spent ``seconds`` of CPU time in
    it (``ITIMER_PROF``: CPU time, so a loaded machine does not shorten it; the signal repeats every 50 ms
    until the body ends, in case code swallows one). Yields whether the budget is enforced: only on the
    main thread of a process (a verify-pool worker's); elsewhere the body runs unbounded (the pool's
    own timeout is then the bound). The handler stays installed and does nothing when no budget runs, so
    a late signal is harmless."""
    global _budget_armed
    try:
        if signal.getsignal(signal.SIGPROF) is not _on_budget_signal:
            signal.signal(signal.SIGPROF, _on_budget_signal)
    except ValueError:  # not the main thread
        yield False
        return
    _budget_armed = True
    signal.setitimer(signal.ITIMER_PROF, seconds, 0.05)
    try:
        yield True
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        _budget_armed = False


def forget_cached_forms() -> None:
    """Drop sympy's caches (after an aborted computation: its half-built entries and memory)."""
    from sympy.core.cache import clear_cache

    clear_cache()


def same_form(text: str, truth_text: str, variables: Sequence[str]) -> bool:
    """Whether the law in ``text`` has the form of ``truth_text`` (both over ``variables``). Picklable
    arguments: this runs in a verify-pool worker."""
    return bool(form(parse_law(text, variables)) == form(parse_law(truth_text, variables)))
