"""The task pool, written by this team: common molecules, textbook reactions, fragments, formulas,
logP edits and property questions. ``scripts/generate_dataset.py`` turns it into rows (and checks every
item with rdkit: each reference parses and solves its own task).
"""

from __future__ import annotations

from typing import Any

# name_to_smiles: (name, SMILES) of common molecules.
NAMES: tuple[tuple[str, str], ...] = (
    ("ethanol", "CCO"),
    ("acetic acid", "CC(=O)O"),
    ("toluene", "Cc1ccccc1"),
    ("phenol", "Oc1ccccc1"),
    ("acetone", "CC(C)=O"),
    ("aniline", "Nc1ccccc1"),
    ("benzoic acid", "OC(=O)c1ccccc1"),
    ("pyridine", "c1ccncc1"),
    ("glycine", "NCC(=O)O"),
    ("cyclohexane", "C1CCCCC1"),
    ("isopropanol (propan-2-ol)", "CC(C)O"),
    ("ethyl acetate", "CCOC(C)=O"),
    ("acetaldehyde", "CC=O"),
    ("caffeine", "Cn1cnc2c1c(=O)n(C)c(=O)n2C"),
    ("aspirin (acetylsalicylic acid)", "CC(=O)Oc1ccccc1C(=O)O"),
    ("urea", "NC(N)=O"),
    ("diethyl ether", "CCOCC"),
    ("naphthalene", "c1ccc2ccccc2c1"),
    ("styrene", "C=Cc1ccccc1"),
    ("nitrobenzene", "O=[N+]([O-])c1ccccc1"),
    ("chloroform", "ClC(Cl)Cl"),
    ("dimethyl sulfoxide", "CS(C)=O"),
)

# reaction_product: (reaction family, reactants, conditions, main organic product).
REACTIONS: tuple[tuple[str, tuple[str, ...], str, str], ...] = (
    ("esterification", ("CC(=O)O", "CCO"), "catalytic H2SO4, heat (Fischer esterification)", "CCOC(C)=O"),
    (
        "esterification",
        ("OC(=O)c1ccccc1", "CO"),
        "catalytic H2SO4, heat (Fischer esterification)",
        "COC(=O)c1ccccc1",
    ),
    ("amide formation", ("CC(=O)Cl", "CN"), "excess amine, 0 C", "CNC(C)=O"),
    ("amide formation", ("O=C(Cl)c1ccccc1", "Nc1ccccc1"), "pyridine", "O=C(Nc1ccccc1)c1ccccc1"),
    ("hydrogenation", ("CC=C",), "H2, Pd/C", "CCC"),
    ("hydrogenation", ("C1=CCCCC1",), "H2, Pd/C", "C1CCCCC1"),
    (
        "hydrogenation",
        ("C=Cc1ccccc1",),
        "H2 (1 atm), Pd/C, room temperature (the ring is untouched)",
        "CCc1ccccc1",
    ),
    ("halogenation of an alkene", ("C=C", "BrBr"), "CH2Cl2, dark", "BrCCBr"),
    ("halogenation of an alkene", ("C1=CCCCC1", "BrBr"), "CH2Cl2, dark", "BrC1CCCCC1Br"),
    ("hydrohalogenation (Markovnikov)", ("CC=C", "Br"), "no peroxides", "CC(C)Br"),
    ("SN2 substitution", ("CCBr", "[C-]#N.[Na+]"), "DMSO", "CCC#N"),
    ("SN2 substitution", ("CCCCBr", "[OH-].[Na+]"), "water/THF", "CCCCO"),
    ("SN2 substitution (Williamson ether synthesis)", ("CI", "CC[O-].[Na+]"), "ethanol", "CCOC"),
    ("ketone reduction", ("CC(C)=O",), "NaBH4, methanol", "CC(C)O"),
    ("nitration", ("c1ccccc1",), "HNO3, H2SO4", "O=[N+]([O-])c1ccccc1"),
    ("alcohol oxidation", ("CCCO",), "PCC, CH2Cl2", "CCC=O"),
)

# fragment_completion: (fragment SMILES, constraints {descriptor: {min, max}}, a reference molecule).
FRAGMENTS: tuple[tuple[str, dict[str, dict[str, float]], str], ...] = (
    ("O=Cc1ccccc1", {"heavy_atoms": {"min": 10, "max": 14}}, "CC(=O)c1ccc(C)cc1"),
    ("CC(=O)N", {"mol_weight": {"min": 100, "max": 200}}, "CC(=O)NCc1ccccc1"),
    ("c1ccncc1", {"hbd": {"min": 1}}, "Nc1ccncc1"),
    ("C1CCNCC1", {"rings": {"min": 2}}, "c1ccc(CN2CCCCC2)cc1"),
    ("OC(=O)", {"aromatic_rings": {"min": 1}}, "OC(=O)Cc1ccccc1"),
    ("NS(=O)=O", {"heavy_atoms": {"max": 15}}, "NS(=O)(=O)c1ccccc1"),
    ("C#N", {"rings": {"min": 1}, "mol_weight": {"max": 150}}, "N#Cc1ccccc1"),
    ("c1ccc2ccccc2c1", {"hba": {"min": 2}}, "COc1ccc2cc(OC)ccc2c1"),
)

# Functional groups as SMARTS, for formula_design.
GROUPS = {
    "carboxylic acid": "[CX3](=O)[OX2H1]",
    "ester": "[#6][CX3](=O)[OX2H0][#6]",
    "ether": "[OD2]([#6;!$(C=O)])[#6;!$(C=O)]",
    "alcohol": "[CX4][OX2H]",
    "benzene ring": "c1ccccc1",
    "primary amide": "[NX3H2][CX3](=[OX1])",
    "ketone": "[#6][CX3](=O)[#6]",
    "aldehyde": "[CX3H1](=O)[#6]",
    "primary aromatic amine": "[NX3H2]c",
    "nitrile": "[CX2]#[NX1]",
    "alkene": "[CX3]=[CX3]",
}

# formula_design: (formula, group names, a reference molecule).
FORMULAS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("C3H6O2", ("carboxylic acid",), "CCC(=O)O"),
    ("C3H6O2", ("ester",), "COC(C)=O"),
    ("C4H10O", ("ether",), "CCOCC"),
    ("C4H10O", ("alcohol",), "CCCCO"),
    ("C7H6O2", ("carboxylic acid", "benzene ring"), "OC(=O)c1ccccc1"),
    ("C2H5NO", ("primary amide",), "CC(N)=O"),
    ("C3H6O", ("ketone",), "CC(C)=O"),
    ("C3H6O", ("aldehyde",), "CCC=O"),
    ("C7H9N", ("primary aromatic amine",), "Cc1ccccc1N"),
    ("C4H5N", ("nitrile", "alkene"), "C=CCC#N"),
)

# logp_edit: (starting molecule, direction, minimum change, minimum Tanimoto similarity, a reference edit).
LOGP_EDITS: tuple[tuple[str, str, float, float, str], ...] = (
    ("OC(=O)c1ccccc1", "up", 0.5, 0.3, "OC(=O)c1ccc(Cl)cc1"),
    ("CCCCCCO", "down", 0.5, 0.3, "CCCCC(O)CO"),
    ("Oc1ccccc1", "up", 0.5, 0.2, "Cc1ccc(O)cc1C"),
    ("CCOC(=O)c1ccccc1", "down", 0.5, 0.3, "CCOC(=O)c1ccc(O)cc1O"),
    ("CC(=O)Nc1ccccc1", "up", 1.0, 0.3, "CC(=O)Nc1ccc(Cl)cc1Cl"),
    ("c1ccc2ccccc2c1", "down", 0.5, 0.2, "Nc1ccc2ccccc2c1O"),
    ("CC(C)Cc1ccc(C(C)C(=O)O)cc1", "down", 0.25, 0.4, "CC(C)Cc1ccc(C(C)C(=O)O)cc1O"),
    ("OCC1OC(O)C(O)C(O)C1O", "up", 1.0, 0.2, "CCCCOCC1OC(O)C(O)C(O)C1O"),
)

# property_mcq: (descriptor, "max"/"min", four molecules); the answer letter is computed by rdkit.
CHOICES: tuple[tuple[str, str, tuple[str, str, str, str]], ...] = (
    ("mol_weight", "max", ("CCO", "CC(=O)O", "c1ccccc1", "CCCCCl")),
    ("hbd", "max", ("CCO", "NCC(=O)O", "OCC(O)CO", "CC(C)=O")),
    ("hba", "max", ("CCCC", "CCOCC", "CCOC(C)=O", "Cn1cnc2c1c(=O)n(C)c(=O)n2C")),
    ("logp", "max", ("CCO", "Cc1ccccc1", "CCCCCCCC", "OC(=O)c1ccccc1")),
    ("logp", "min", ("CCCC", "OCC(O)CO", "c1ccccc1", "CCOCC")),
    ("rotatable_bonds", "max", ("c1ccccc1", "CCCCCCO", "CC(C)=O", "C1CCCCC1")),
    ("tpsa", "max", ("CCOCC", "CC(N)=O", "Cc1ccccc1", "CCCl")),
    ("rings", "max", ("c1ccc2ccccc2c1", "C1CCCCC1", "CCCCCC", "c1ccc2cc3ccccc3cc2c1")),
    ("heavy_atoms", "min", ("CCO", "CC(C)O", "C", "CCCC")),
    ("mol_weight", "min", ("ClC(Cl)Cl", "CCBr", "CCCCCCC", "CS(C)=O")),
)


def pool_size() -> int:
    return len(NAMES) + len(REACTIONS) + len(FRAGMENTS) + len(FORMULAS) + len(LOGP_EDITS) + len(CHOICES)


def items() -> list[tuple[str, Any]]:
    """Every item with its task type (the generator's input)."""
    return [
        *(("fragment_completion", x) for x in FRAGMENTS),
        *(("formula_design", x) for x in FORMULAS),
        *(("reaction_product", x) for x in REACTIONS),
        *(("name_to_smiles", x) for x in NAMES),
        *(("logp_edit", x) for x in LOGP_EDITS),
        *(("property_mcq", x) for x in CHOICES),
    ]
