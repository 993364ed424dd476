"""The chemistry checks, on rdkit. Everything here runs in a verify-pool worker (rdkit parsing and
fingerprints are CPU work): the entry points take and return plain JSON-able values so they pickle
cheaply, and a broken row comes back as ``{"bad_row": ...}`` (never an exception, never a score).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from typing import Any

from rdkit import Chem, DataStructs, RDLogger
from rdkit.Chem import Crippen, Descriptors, rdFingerprintGenerator, rdMolDescriptors

RDLogger.DisableLog("rdApp.*")  # rdkit's own stderr chatter: every reason is returned instead

MAX_ANSWER_CHARS = 500  # a longer "SMILES" is refused unparsed (huge outputs are capped)

DESCRIPTORS: dict[str, Callable[[Chem.Mol], float]] = {
    "mol_weight": Descriptors.MolWt,
    "heavy_atoms": lambda m: float(m.GetNumHeavyAtoms()),
    "rings": lambda m: float(rdMolDescriptors.CalcNumRings(m)),
    "aromatic_rings": lambda m: float(rdMolDescriptors.CalcNumAromaticRings(m)),
    "hbd": lambda m: float(rdMolDescriptors.CalcNumHBD(m)),
    "hba": lambda m: float(rdMolDescriptors.CalcNumHBA(m)),
    "logp": Crippen.MolLogP,
    "rotatable_bonds": lambda m: float(rdMolDescriptors.CalcNumRotatableBonds(m)),
    "tpsa": rdMolDescriptors.CalcTPSA,
}
DESCRIPTOR_MEANING = {
    "mol_weight": "molecular weight",
    "heavy_atoms": "number of heavy (non-hydrogen) atoms",
    "rings": "number of rings",
    "aromatic_rings": "number of aromatic rings",
    "hbd": "number of hydrogen-bond donors",
    "hba": "number of hydrogen-bond acceptors",
    "logp": "computed logP (Crippen)",
    "rotatable_bonds": "number of rotatable bonds",
    "tpsa": "topological polar surface area",
}

_MORGAN = rdFingerprintGenerator.GetMorganGenerator(radius=2, fpSize=2048)
_FORMULA = re.compile(r"([A-Z][a-z]?)(\d*)")
_CHOICE = re.compile(r"^\(?([A-Za-z])\)?[.)]?$")


class SmilesError(ValueError):
    """A string that is not a molecule; the message says why (syntax, valence, empty)."""


def parse_smiles(text: str) -> Chem.Mol:
    """The sanitized molecule of ``text``, or :class:`SmilesError` with rdkit's reason."""
    if len(text) > MAX_ANSWER_CHARS:
        raise SmilesError(f"longer than {MAX_ANSWER_CHARS} characters")
    if not text or any(c.isspace() for c in text):
        raise SmilesError("a SMILES string has no spaces and is not empty")
    mol = Chem.MolFromSmiles(text, sanitize=False)
    if mol is None:
        raise SmilesError("not SMILES syntax")
    if mol.GetNumAtoms() == 0:
        raise SmilesError("no atoms")
    try:
        Chem.SanitizeMol(mol)
    except (
        Exception
    ) as e:  # rdkit raises its own exception types (AtomValenceException, KekulizeException, ...)
        raise SmilesError(str(e).strip() or type(e).__name__) from None
    return mol


def canonical(mol: Chem.Mol) -> str:
    """Canonical SMILES without stereochemistry (a product's or a name's stereo is not asked for)."""
    return Chem.MolToSmiles(mol, isomericSmiles=False)


def same_molecule(a: Chem.Mol, b: Chem.Mol) -> bool:
    """The same compound: equal stereo-free canonical SMILES, or equal standard InChIKeys (which also
    folds some tautomers)."""
    if canonical(a) == canonical(b):
        return True
    key_a, key_b = Chem.MolToInchiKey(a), Chem.MolToInchiKey(b)
    return bool(key_a) and key_a == key_b


def formula_counts(formula: str) -> Counter[str]:
    """Element counts of a neutral Hill formula such as ``C3H6O2`` (ValueError when it is not one)."""
    if not formula or _FORMULA.sub("", formula):
        raise ValueError(f"{formula!r} is not a neutral molecular formula such as C3H6O2")
    counts: Counter[str] = Counter()
    for element, number in _FORMULA.findall(formula):
        counts[element] += int(number or 1)
    return counts


def similarity(a: Chem.Mol, b: Chem.Mol) -> float:
    """Tanimoto similarity of Morgan fingerprints (radius 2, 2048 bits)."""
    return DataStructs.TanimotoSimilarity(_MORGAN.GetFingerprint(a), _MORGAN.GetFingerprint(b))


def descriptor(name: str, mol: Chem.Mol) -> float:
    return round(float(DESCRIPTORS[name](mol)), 4)


class _BadRow(Exception):
    pass


def _reference(task: dict[str, Any], field: str, text: str) -> Chem.Mol:
    try:
        return parse_smiles(text)
    except SmilesError as e:
        raise _BadRow(f"task.{field} {text!r} is not a molecule: {e}") from None


def _query(field: str, text: str, smarts: bool) -> Chem.Mol:
    query = Chem.MolFromSmarts(text) if smarts else Chem.MolFromSmiles(text)
    if query is None:
        kind = "SMARTS" if smarts else "SMILES"
        raise _BadRow(f"task.{field} {text!r} is not valid {kind}")
    return query


def _result(reason: str, why: str, valid: bool | None, **measured: float) -> dict[str, Any]:
    return {"failure_reason": reason, "reason": why, "valid_smiles": valid, "measured": measured}


def _in_range(task: dict[str, Any], mol: Chem.Mol) -> tuple[str | None, dict[str, float]]:
    """The first constraint ``mol`` breaks (or None) and the values measured."""
    measured, broken = {}, None
    for name, bounds in task["constraints"].items():
        value = descriptor(name, mol)
        measured[name] = value
        low, high = bounds.get("min"), bounds.get("max")
        if broken is None and ((low is not None and value < low) or (high is not None and value > high)):
            broken = f"{name} is {value}, outside [{low}, {high}]"
    return broken, measured


def _fragment(task: dict[str, Any], mol: Chem.Mol) -> dict[str, Any]:
    query = _query("fragment", task["fragment"], smarts=False)
    broken, measured = _in_range(task, mol)
    if not mol.HasSubstructMatch(query):
        return _result("missing_fragment", f"does not contain {task['fragment']}", True, **measured)
    if mol.GetNumHeavyAtoms() <= query.GetNumHeavyAtoms():  # it contains the fragment and nothing more
        why = f"the answer is the fragment {task['fragment']} itself: complete it by adding atoms"
        return _result("unchanged", why, True, **measured)
    if broken:
        return _result("constraint_failed", broken, True, **measured)
    return _result("pass", "contains the fragment and meets the constraints", True, **measured)


def _formula(task: dict[str, Any], mol: Chem.Mol) -> dict[str, Any]:
    want = formula_counts(task["formula"])
    queries = {name: _query(f"groups.{name}", s, smarts=True) for name, s in task["groups"].items()}
    got_text = rdMolDescriptors.CalcMolFormula(mol)
    try:
        got = formula_counts(got_text)
    except ValueError:  # charged: C2H3O2- is not C2H4O2
        got = Counter()
    if got != want:
        return _result("wrong_formula", f"formula {got_text}, not {task['formula']}", True)
    missing = [name for name, q in queries.items() if not mol.HasSubstructMatch(q)]
    if missing:
        return _result("missing_group", f"no {', '.join(missing)}", True)
    return _result("pass", f"{got_text} with {', '.join(queries)}", True)


def _same_as(task: dict[str, Any], field: str, mol: Chem.Mol, wrong: str) -> dict[str, Any]:
    reference = _reference(task, field, task[field])
    if same_molecule(mol, reference):
        return _result("pass", "the same molecule", True)
    return _result(wrong, f"{canonical(mol)} is not the expected molecule", True)


def _logp(task: dict[str, Any], mol: Chem.Mol) -> dict[str, Any]:
    start = _reference(task, "smiles", task["smiles"])
    change = round(Crippen.MolLogP(mol) - Crippen.MolLogP(start), 4)
    sim = round(similarity(mol, start), 4)
    signed = change if task["direction"] == "up" else -change
    if same_molecule(mol, start):
        return _result(
            "unchanged", "the answer is the starting molecule", True, logp_change=change, similarity=sim
        )
    if signed < task["min_change"]:
        why = f"logP changed by {change:+.2f}; needed {task['direction']} by at least {task['min_change']}"
        return _result("too_little_change", why, True, logp_change=change, similarity=sim)
    if sim < task["min_similarity"]:
        why = f"Tanimoto similarity {sim:.2f} is below {task['min_similarity']}"
        return _result("too_dissimilar", why, True, logp_change=change, similarity=sim)
    return _result(
        "pass", f"logP {change:+.2f}, similarity {sim:.2f}", True, logp_change=change, similarity=sim
    )


def extreme_option(task: dict[str, Any]) -> tuple[str, dict[str, float]]:
    """The option letter with the extreme property value, and every option's value (a tie or an option
    that is not a molecule is a broken row)."""
    values = {
        letter: descriptor(task["property"], _reference(task, f"options.{letter}", smiles))
        for letter, smiles in task["options"].items()
    }
    best = (max if task["extreme"] == "max" else min)(values.values())
    winners = [letter for letter, v in values.items() if v == best]
    if len(winners) != 1:
        raise _BadRow(f"task.options: {', '.join(winners)} tie on {task['property']} ({best})")
    return winners[0], values


def choice_answer(task: dict[str, Any]) -> tuple[str, dict[str, float]]:
    """:func:`extreme_option`, checked against the row's stored ``answer``."""
    right, values = extreme_option(task)
    if task["answer"] != right:
        raise _BadRow(
            f"task.answer is {task['answer']!r} but {right} has the {task['extreme']} {task['property']}"
        )
    return right, values


def _choice(task: dict[str, Any], answer: str) -> dict[str, Any]:
    right, values = choice_answer(task)
    match = _CHOICE.match(answer.strip())
    letter = match.group(1).upper() if match else None
    if letter is None or letter not in task["options"]:
        return _result(
            "not_a_choice", f"{answer[:40]!r} is not one of {', '.join(task['options'])}", None, **values
        )
    if letter != right:
        return _result("wrong_choice", f"{letter}, not {right}", None, **values)
    return _result("pass", f"{letter} has the {task['extreme']} {task['property']}", None, **values)


def _not_one_molecule(mol: Chem.Mol) -> dict[str, Any] | None:
    """The outcome refusing ``mol`` when it is not one connected, neutral, closed-shell molecule (a
    mixture, a salt, a solvent added, an ion, a radical), else None. Every task asks for one molecule: a
    second part would add its atoms to the formula, its bits to the fingerprint and its logP to the sum."""
    parts = Chem.GetMolFrags(mol, asMols=True, sanitizeFrags=False)
    if len(parts) > 1:
        shown = ", ".join(canonical(p) for p in parts[:4]) + (", ..." if len(parts) > 4 else "")
        why = (
            f"{len(parts)} disconnected parts ({shown}): the answer is one connected molecule, "
            "without salts, solvents or counter-ions"
        )
        return _result("mixture", why, True)
    charge = Chem.GetFormalCharge(mol)
    if charge:
        why = f"net charge {charge:+d}: the answer is a neutral molecule, not an ion or a protonation state"
        return _result("charged", why, True)
    unpaired = sum(atom.GetNumRadicalElectrons() for atom in mol.GetAtoms())
    if unpaired:
        why = f"{unpaired} unpaired electron(s): the answer is a closed-shell molecule, not a radical"
        return _result("radical", why, True)
    return None


def _judge_molecule(task: dict[str, Any], mol: Chem.Mol) -> dict[str, Any]:
    """The outcome of a parsed molecule on a SMILES task: first its form, then the task's own check."""
    return _not_one_molecule(mol) or _SMILES_CHECKS[task["task_type"]](task, mol)


_SMILES_CHECKS: dict[str, Callable[[dict[str, Any], Chem.Mol], dict[str, Any]]] = {
    "fragment_completion": _fragment,
    "formula_design": _formula,
    "reaction_product": lambda t, m: _same_as(t, "product", m, "wrong_product"),
    "name_to_smiles": lambda t, m: _same_as(t, "smiles", m, "wrong_molecule"),
    "logp_edit": _logp,
}


def _check_row(task: dict[str, Any]) -> None:
    """Raise :class:`_BadRow` naming the field when a reference does not parse or the row's own
    reference answer does not solve it."""
    kind = task["task_type"]
    if kind == "property_mcq":
        choice_answer(task)
        return
    if kind == "formula_design":
        try:
            formula_counts(task["formula"])
        except ValueError as e:
            raise _BadRow(f"task.formula: {e}") from None
    for i, reactant in enumerate(task.get("reactants", [])):
        _reference(task, f"reactants[{i}]", reactant)
    field = {"reaction_product": "product", "name_to_smiles": "smiles"}.get(kind, "reference_answer")
    reference = _reference(task, field, task[field])
    outcome = _judge_molecule(task, reference)
    if outcome["failure_reason"] != "pass":
        raise _BadRow(f"task.{field} does not solve its own task: {outcome['reason']}")


def check_task(task: dict[str, Any]) -> str | None:
    """None for a sound row, else what is broken (the field named). Runs in a verify-pool worker."""
    try:
        _check_row(task)
    except _BadRow as e:
        return str(e)
    return None


def no_answer() -> dict[str, Any]:
    """The outcome of a response without an answer (no rdkit needed)."""
    return _result("no_answer", "no <answer>...</answer> in the response", None)


def several_answers(answers: list[str]) -> dict[str, Any]:
    """The outcome of a reply with two or more different answers in its tags (no rdkit needed): a hedge is
    no answer, whichever of them is right."""
    shown = ", ".join(repr(a[:40]) for a in answers[:3]) + (", ..." if len(answers) > 2 else "")
    return _result("several_answers", f"different answers in <answer> tags ({shown}): give one", None)


def judge(task: dict[str, Any], answer: str | None, row_checked: bool = False) -> dict[str, Any]:
    """The outcome of ``answer`` (the extracted text, None when there was none) on ``task``:
    ``{"failure_reason", "reason", "valid_smiles", "measured"}``, or ``{"bad_row": ...}``.
    ``row_checked``: :func:`check_task` already passed this row (the server remembers), so it is not
    redone. Runs in a verify-pool worker."""
    try:
        if not row_checked:
            _check_row(task)
        if answer is None:
            return no_answer()
        if task["task_type"] == "property_mcq":
            return _choice(task, answer)
        try:
            mol = parse_smiles(answer)
        except SmilesError as e:
            return _result("invalid_smiles", f"{answer[:80]!r}: {e}", False)
        return _judge_molecule(task, mol)
    except _BadRow as e:
        return {"bad_row": str(e)}


def warm_up_worker() -> None:
    """Load rdkit's tables in a pool worker before the first answer."""
    similarity(parse_smiles("CCO"), parse_smiles("CCN"))
