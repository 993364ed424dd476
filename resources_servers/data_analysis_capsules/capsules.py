"""The capsules: small seeded datasets with a planted effect, each with a question and its proven answer.

A capsule (BixBench's word: the data of one analysis) is one or more CSV files drawn from a seeded
numpy generator with an effect planted in them (a group difference, a slope, a survival gap, a
confounder, ...). Its reference analysis (pandas/scipy) runs on the CSV text exactly as written (the
rounded numbers the agent will read), gives the answer and the evidence that the planted effect is
really there (``proof``). A draw whose proof fails is replaced by the next draw of the same seed
(bounded), so every stored answer is backed by its data.

Each :class:`CapsuleSpec` also carries ``solution``: notebook code that prints the answer, run by the
tests' scripted "right" trajectories in the real kernel (never shown to a model).
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from scipy import optimize, stats

Frames = dict[str, pd.DataFrame]


@dataclass(frozen=True)
class Analysis:
    """The reference analysis of a drawn capsule: the answer, the evidence, and whether it proves the
    planted effect."""

    ideal: float | str
    reference: dict[str, Any]
    proven: bool


@dataclass(frozen=True)
class CapsuleSpec:
    capsule_id: str
    category: str
    hypothesis: str
    question: str
    eval_mode: str  # "range_verifier" (a number within tolerance) or "mcq" (one of the options)
    draw: Callable[[np.random.Generator], Frames]
    analyse: Callable[[Frames], Analysis]
    solution: str
    tolerance: dict[str, float] = field(default_factory=dict)  # {"abs": x} or {"rel": x}
    options: tuple[str, ...] = ()


def csv_text(frame: pd.DataFrame) -> str:
    """The CSV file as written to the capsule's folder (the agent reads exactly these numbers)."""
    return frame.to_csv(index=False, lineterminator="\n")


def reread(frames: Frames) -> Frames:
    """The frames as the agent will load them: written to CSV text and parsed back."""
    return {name: pd.read_csv(io.StringIO(csv_text(f))) for name, f in frames.items()}


# ------------------------------------------------------------------------------------------------
# Shared analyses (numpy/scipy only; the kernel has the same packages).


def kaplan_meier_median(time: np.ndarray, event: np.ndarray) -> float:
    """The Kaplan–Meier median survival: the first event time at which the estimate falls to 0.5 or
    below (``nan`` if it never does)."""
    order = np.argsort(time, kind="stable")
    t, e = time[order], event[order]
    surv = 1.0
    at_risk = len(t)
    for value in np.unique(t):
        here = t == value
        deaths = int(e[here].sum())
        if deaths:
            surv *= 1.0 - deaths / at_risk
            if surv <= 0.5:
                return float(value)
        at_risk -= int(here.sum())
    return math.nan


def logrank(time: np.ndarray, event: np.ndarray, group: np.ndarray) -> tuple[float, float]:
    """The two-group log-rank chi-square statistic (1 degree of freedom) and its p-value."""
    groups = np.unique(group)
    assert len(groups) == 2
    observed_minus_expected = 0.0
    variance = 0.0
    for value in np.unique(time[event == 1]):
        at_risk = time >= value
        n = at_risk.sum()
        n1 = (at_risk & (group == groups[0])).sum()
        dead = (time == value) & (event == 1)
        d = dead.sum()
        d1 = (dead & (group == groups[0])).sum()
        observed_minus_expected += d1 - d * n1 / n
        if n > 1:
            variance += d * (n1 / n) * (1 - n1 / n) * (n - d) / (n - 1)
    chi2 = observed_minus_expected**2 / variance
    return float(chi2), float(stats.chi2.sf(chi2, 1))


def partial_correlation(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> float:
    """Pearson correlation of the residuals of ``x`` and ``y`` after a linear fit on ``z``."""
    design = np.column_stack([np.ones_like(z), z])
    rx = x - design @ np.linalg.lstsq(design, x, rcond=None)[0]
    ry = y - design @ np.linalg.lstsq(design, y, rcond=None)[0]
    return float(np.corrcoef(rx, ry)[0, 1])


def four_pl(conc: np.ndarray, bottom: float, top: float, ec50: float, hill: float) -> np.ndarray:
    return bottom + (top - bottom) / (1.0 + (ec50 / conc) ** hill)


# ------------------------------------------------------------------------------------------------
# The capsules. Each draw plants an effect; each analysis measures it on the CSV as written.


def _two_groups(rng: np.random.Generator, shift: float, n: int = 40) -> Frames:
    control = rng.normal(12.0, 6.0, n)
    treated = rng.normal(12.0 + shift, 6.0, n)
    frame = pd.DataFrame(
        {
            "patient_id": [f"P{i:03d}" for i in range(2 * n)],
            "arm": ["placebo"] * n + ["drug"] * n,
            "bp_reduction_mmHg": np.round(np.concatenate([control, treated]), 2),
        }
    )
    return {"trial.csv": frame.sample(frac=1.0, random_state=int(rng.integers(2**31))).reset_index(drop=True)}


def _welch(frames: Frames) -> tuple[Any, np.ndarray, np.ndarray]:
    df = frames["trial.csv"]
    drug = df.loc[df.arm == "drug", "bp_reduction_mmHg"].to_numpy()
    placebo = df.loc[df.arm == "placebo", "bp_reduction_mmHg"].to_numpy()
    return stats.ttest_ind(drug, placebo, equal_var=False), drug, placebo


def _analyse_ttest_pvalue(frames: Frames) -> Analysis:
    test, drug, placebo = _welch(frames)
    p = float(test.pvalue)
    ref = {
        "method": "scipy.stats.ttest_ind(drug, placebo, equal_var=False)",
        "t": float(test.statistic),
        "p": p,
    }
    return Analysis(p, ref, proven=p < 0.01)


def _analyse_mean_difference(frames: Frames) -> Analysis:
    df = frames["expression.csv"]
    treated = df.loc[df.condition == "treated", "expression"].to_numpy()
    control = df.loc[df.condition == "control", "expression"].to_numpy()
    diff = float(treated.mean() - control.mean())
    test = stats.ttest_ind(treated, control, equal_var=False)
    ref = {
        "method": "mean(treated) - mean(control); Welch t-test",
        "difference": diff,
        "p": float(test.pvalue),
    }
    return Analysis(diff, ref, proven=float(test.pvalue) < 0.01)


def _draw_mean_difference(rng: np.random.Generator) -> Frames:
    n = 30
    control = rng.normal(7.2, 0.9, n)
    treated = rng.normal(7.2 + 1.1, 0.9, n)
    frame = pd.DataFrame(
        {
            "sample": [f"S{i:02d}" for i in range(2 * n)],
            "condition": ["control"] * n + ["treated"] * n,
            "gene": "MYC",
            "expression": np.round(np.concatenate([control, treated]), 3),
        }
    )
    return {"expression.csv": frame}


SLOPE = 2.5


def _draw_regression(rng: np.random.Generator) -> Frames:
    n = 120
    sodium = rng.uniform(1.5, 6.0, n)
    age = rng.integers(25, 75, n)
    sbp = 105.0 + SLOPE * sodium + rng.normal(0.0, 6.0, n)
    frame = pd.DataFrame(
        {"sodium_g_per_day": np.round(sodium, 2), "age": age, "systolic_bp": np.round(sbp, 1)}
    )
    return {"sodium.csv": frame}


def _analyse_regression(frames: Frames) -> Analysis:
    df = frames["sodium.csv"]
    fit = stats.linregress(df.sodium_g_per_day, df.systolic_bp)
    ref = {
        "method": "scipy.stats.linregress(sodium_g_per_day, systolic_bp)",
        "slope": float(fit.slope),
        "stderr": float(fit.stderr),
        "p": float(fit.pvalue),
        "planted_slope": SLOPE,
    }
    proven = fit.pvalue < 1e-3 and abs(fit.slope - SLOPE) < 3 * fit.stderr
    return Analysis(float(fit.slope), ref, proven=bool(proven))


def _draw_survival(rng: np.random.Generator) -> Frames:
    n = 60
    control = rng.exponential(10.0 / math.log(2), n)
    treated = rng.exponential(22.0 / math.log(2), n)
    follow_up = rng.uniform(12.0, 48.0, 2 * n)
    times = np.concatenate([control, treated])
    event = (times <= follow_up).astype(int)
    observed = np.round(np.minimum(times, follow_up), 1)
    observed = np.maximum(observed, 0.1)
    frame = pd.DataFrame(
        {
            "patient_id": [f"C{i:03d}" for i in range(2 * n)],
            "arm": ["standard"] * n + ["new_regimen"] * n,
            "months": observed,
            "death": event,
        }
    )
    return {"survival.csv": frame}


def _survival_arms(frames: Frames) -> tuple[pd.DataFrame, float, float]:
    df = frames["survival.csv"]
    t, e, g = df.months.to_numpy(), df.death.to_numpy(), df.arm.to_numpy()
    new = kaplan_meier_median(t[g == "new_regimen"], e[g == "new_regimen"])
    std = kaplan_meier_median(t[g == "standard"], e[g == "standard"])
    return df, new, std


def _analyse_survival_median(frames: Frames) -> Analysis:
    df, new, std = _survival_arms(frames)
    chi2, p = logrank(df.months.to_numpy(), df.death.to_numpy(), df.arm.to_numpy())
    ref = {"method": "Kaplan-Meier medians (new_regimen - standard); log-rank test", "median_new": new,
           "median_standard": std, "logrank_chi2": chi2, "p": p}  # fmt: skip
    proven = p < 0.01 and math.isfinite(new) and math.isfinite(std) and new > std
    return Analysis(new - std, ref, proven=bool(proven))


def _analyse_logrank(frames: Frames) -> Analysis:
    df, new, std = _survival_arms(frames)
    chi2, p = logrank(df.months.to_numpy(), df.death.to_numpy(), df.arm.to_numpy())
    ref = {"method": "log-rank chi-square (1 df)", "logrank_chi2": chi2, "p": p, "median_new": new,
           "median_standard": std}  # fmt: skip
    return Analysis(chi2, ref, proven=p < 0.01)


def _draw_confounded(rng: np.random.Generator) -> Frames:
    n = 200
    age = rng.uniform(20, 80, n)
    coffee = 0.5 + 0.05 * age + rng.normal(0, 0.6, n)
    sbp = 95 + 0.6 * age + rng.normal(0, 6, n)  # no direct effect of coffee
    frame = pd.DataFrame(
        {"age": np.round(age, 1), "coffee_cups_per_day": np.round(coffee, 2), "systolic_bp": np.round(sbp, 1)}
    )
    return {"cohort.csv": frame}


def _analyse_partial(frames: Frames) -> Analysis:
    df = frames["cohort.csv"]
    x, y, z = df.coffee_cups_per_day.to_numpy(), df.systolic_bp.to_numpy(), df.age.to_numpy()
    raw = float(np.corrcoef(x, y)[0, 1])
    partial = partial_correlation(x, y, z)
    ref = {"method": "Pearson r of residuals after linear fits on age", "raw_r": raw, "partial_r": partial}
    return Analysis(partial, ref, proven=raw > 0.3 and abs(partial) < 0.15)


CONFOUNDER_OPTIONS = ("age", "height_cm", "shoe_size", "clinic")


def _draw_confounder_choice(rng: np.random.Generator) -> Frames:
    n = 240
    age = rng.uniform(20, 80, n)
    height = rng.normal(170, 9, n)
    shoe = np.round(0.18 * height + rng.normal(0, 1.2, n) - 1.0) / 1.0
    clinic = rng.choice(["north", "south", "east"], n)
    exercise = 9.0 - 0.09 * age + rng.normal(0, 0.9, n)
    cholesterol = 150 + 1.2 * age + rng.normal(0, 10, n)
    frame = pd.DataFrame(
        {
            "exercise_h_per_week": np.round(exercise, 2),
            "cholesterol_mg_dl": np.round(cholesterol, 1),
            "age": np.round(age, 1),
            "height_cm": np.round(height, 1),
            "shoe_size": shoe,
            "clinic": clinic,
        }
    )
    return {"lifestyle.csv": frame}


def _analyse_confounder_choice(frames: Frames) -> Analysis:
    df = frames["lifestyle.csv"]
    x, y = df.exercise_h_per_week.to_numpy(), df.cholesterol_mg_dl.to_numpy()
    raw = float(np.corrcoef(x, y)[0, 1])
    adjusted = {}
    for name in CONFOUNDER_OPTIONS:
        column = df[name]
        numeric = pd.api.types.is_numeric_dtype(column)
        z = column.to_numpy(float) if numeric else pd.factorize(column)[0].astype(float)
        adjusted[name] = partial_correlation(x, y, z)
    ref = {"method": "partial correlation of exercise and cholesterol given each candidate", "raw_r": raw,
           "partial_r": adjusted}  # fmt: skip
    others = [abs(v) for k, v in adjusted.items() if k != "age"]
    proven = abs(raw) > 0.3 and abs(adjusted["age"]) < 0.1 and min(others) > 0.3
    return Analysis("age", ref, proven=bool(proven))


def _draw_anova(rng: np.random.Generator) -> Frames:
    n = 30
    means = {"low_fat": 2.1, "mediterranean": 3.4, "control": 1.5}
    rows = [(d, float(v)) for d, m in means.items() for v in rng.normal(m, 1.4, n)]
    frame = pd.DataFrame(rows, columns=["diet", "weight_loss_kg"])
    frame["weight_loss_kg"] = frame.weight_loss_kg.round(2)
    return {"diets.csv": frame.sample(frac=1.0, random_state=int(rng.integers(2**31))).reset_index(drop=True)}


def _analyse_anova(frames: Frames) -> Analysis:
    df = frames["diets.csv"]
    groups = [g.weight_loss_kg.to_numpy() for _, g in df.groupby("diet", sort=True)]
    test = stats.f_oneway(*groups)
    ref = {
        "method": "scipy.stats.f_oneway over the three diets",
        "F": float(test.statistic),
        "p": float(test.pvalue),
    }
    return Analysis(float(test.statistic), ref, proven=float(test.pvalue) < 0.01)


def _draw_chi_square(rng: np.random.Generator) -> Frames:
    n = 300
    genotype = rng.choice(["AA", "Aa", "aa"], n, p=[0.45, 0.4, 0.15])
    risk = {"AA": 0.2, "Aa": 0.32, "aa": 0.5}
    disease = np.array([rng.random() < risk[g] for g in genotype])
    frame = pd.DataFrame(
        {
            "subject": [f"G{i:03d}" for i in range(n)],
            "genotype": genotype,
            "status": np.where(disease, "case", "control"),
        }
    )
    return {"genotypes.csv": frame}


def _analyse_chi_square(frames: Frames) -> Analysis:
    df = frames["genotypes.csv"]
    table = pd.crosstab(df.genotype, df.status)
    chi2, p, dof, _ = stats.chi2_contingency(table.to_numpy())
    ref = {"method": "scipy.stats.chi2_contingency(pd.crosstab(genotype, status))", "chi2": float(chi2),
           "p": float(p), "dof": int(dof), "table": table.to_dict()}  # fmt: skip
    return Analysis(float(chi2), ref, proven=float(p) < 0.01)


EC50 = 1.8


def _draw_dose_response(rng: np.random.Generator) -> Frames:
    conc = np.repeat(np.logspace(-2, 2, 9), 4)
    response = four_pl(conc, 5.0, 98.0, EC50, 1.3) + rng.normal(0, 3.0, conc.size)
    frame = pd.DataFrame({"concentration_uM": np.round(conc, 4), "inhibition_pct": np.round(response, 2)})
    return {"dose_response.csv": frame}


def fit_ec50(frame: pd.DataFrame) -> np.ndarray:
    """The least-squares four-parameter logistic fit (bottom, top, EC50, Hill)."""
    c, r = frame.concentration_uM.to_numpy(), frame.inhibition_pct.to_numpy()
    p0 = [r.min(), r.max(), float(np.median(c)), 1.0]
    params, _ = optimize.curve_fit(
        four_pl, c, r, p0=p0, bounds=([-50, 0, 1e-4, 0.1], [50, 200, 1e4, 10]), maxfev=20000
    )
    return params


def _analyse_dose_response(frames: Frames) -> Analysis:
    params = fit_ec50(frames["dose_response.csv"])
    ec50 = float(params[2])
    ref = {"method": "scipy.optimize.curve_fit of a four-parameter logistic", "bottom": float(params[0]),
           "top": float(params[1]), "ec50": ec50, "hill": float(params[3]), "planted_ec50": EC50}  # fmt: skip
    return Analysis(ec50, ref, proven=abs(ec50 - EC50) / EC50 < 0.15)


def _draw_paired(rng: np.random.Generator) -> Frames:
    n = 25
    baseline = rng.normal(220, 30, n)
    after = baseline - 6.0 + rng.normal(0, 5.0, n)
    frame = pd.DataFrame(
        {
            "patient_id": [f"Q{i:02d}" for i in range(n)],
            "ldl_before": np.round(baseline, 1),
            "ldl_after": np.round(after, 1),
        }
    )
    return {"statin.csv": frame}


def _analyse_paired(frames: Frames) -> Analysis:
    df = frames["statin.csv"]
    paired = stats.ttest_rel(df.ldl_after, df.ldl_before)
    unpaired = stats.ttest_ind(df.ldl_after, df.ldl_before)
    ref = {"method": "scipy.stats.ttest_rel(ldl_after, ldl_before)", "t": float(paired.statistic),
           "p": float(paired.pvalue), "unpaired_p": float(unpaired.pvalue)}  # fmt: skip
    proven = paired.pvalue < 0.01 and unpaired.pvalue > 0.1  # the pairing is what shows the effect
    return Analysis(float(paired.statistic), ref, proven=bool(proven))


def _draw_robust(rng: np.random.Generator) -> Frames:
    n = 40
    lab_a = rng.normal(50.0, 4.0, n)
    lab_b = rng.normal(46.0, 4.0, n)
    lab_b[:4] = rng.uniform(180, 260, 4)  # gross outliers: a unit mix-up in four samples
    frame = pd.DataFrame(
        {"lab": ["A"] * n + ["B"] * n, "troponin_ng_l": np.round(np.concatenate([lab_a, lab_b]), 2)}
    )
    return {
        "assays.csv": frame.sample(frac=1.0, random_state=int(rng.integers(2**31))).reset_index(drop=True)
    }


def _analyse_robust(frames: Frames) -> Analysis:
    df = frames["assays.csv"]
    a = df.loc[df.lab == "A", "troponin_ng_l"]
    b = df.loc[df.lab == "B", "troponin_ng_l"]
    median_diff = float(b.median() - a.median())
    mean_diff = float(b.mean() - a.mean())
    mw = stats.mannwhitneyu(b, a)
    ref = {"method": "median(B) - median(A); Mann-Whitney U", "median_difference": median_diff,
           "mean_difference": mean_diff, "mannwhitney_p": float(mw.pvalue)}  # fmt: skip
    proven = median_diff < 0 < mean_diff and mw.pvalue < 0.01  # the outliers flip the mean's sign
    return Analysis(median_diff, ref, proven=bool(proven))


GENES = ("TP53", "EGFR", "KRAS", "BRCA1", "PTEN")


def _draw_de_gene(rng: np.random.Generator) -> Frames:
    n = 20
    hit = GENES[int(rng.integers(len(GENES)))]
    rows = []
    for i in range(2 * n):
        tissue = "tumour" if i < n else "normal"
        values = {g: rng.normal(8.0, 1.0) + (1.6 if g == hit and tissue == "tumour" else 0.0) for g in GENES}
        rows.append({"sample": f"T{i:02d}", "tissue": tissue, **{g: round(v, 3) for g, v in values.items()}})
    return {"tumour_expression.csv": pd.DataFrame(rows)}


def _analyse_de_gene(frames: Frames) -> Analysis:
    df = frames["tumour_expression.csv"]
    pvalues = {}
    for gene in GENES:
        test = stats.ttest_ind(
            df.loc[df.tissue == "tumour", gene], df.loc[df.tissue == "normal", gene], equal_var=False
        )
        pvalues[gene] = float(test.pvalue)
    adjusted = {g: min(1.0, p * len(GENES)) for g, p in pvalues.items()}
    hits = [g for g, p in adjusted.items() if p < 0.05]
    ref = {"method": "Welch t-test per gene, Bonferroni over 5 genes", "p": pvalues, "bonferroni_p": adjusted}
    proven = len(hits) == 1 and adjusted[hits[0]] < 0.001
    return Analysis(hits[0] if hits else "none", ref, proven=bool(proven))


# ------------------------------------------------------------------------------------------------

SPECS: tuple[CapsuleSpec, ...] = (
    CapsuleSpec(
        capsule_id="ttest_pvalue",
        category="two-group t-test",
        hypothesis="The drug lowers blood pressure more than placebo.",
        question="trial.csv holds a randomised trial: the blood-pressure reduction (mmHg) of each patient on "
        "drug or placebo. What is the two-sided p-value of Welch's t-test (unequal variances) comparing "
        "the drug and placebo arms? Give at least 3 significant figures.",
        eval_mode="range_verifier",
        tolerance={"rel": 0.01},
        draw=lambda rng: _two_groups(rng, shift=5.5),
        analyse=_analyse_ttest_pvalue,
        solution="import pandas as pd\nfrom scipy import stats\ndf = pd.read_csv('trial.csv')\n"
        "r = stats.ttest_ind(df[df.arm == 'drug'].bp_reduction_mmHg, df[df.arm == 'placebo'].bp_reduction_mmHg, "
        "equal_var=False)\nprint(repr(float(r.pvalue)))",
    ),
    CapsuleSpec(
        capsule_id="mean_difference",
        category="two-group t-test",
        hypothesis="Treatment raises MYC expression.",
        question="expression.csv holds MYC expression (log2 units) in control and treated samples. What is "
        "the mean expression of the treated samples minus the mean of the control samples? Give 3 decimals.",
        eval_mode="range_verifier",
        tolerance={"abs": 0.005},
        draw=_draw_mean_difference,
        analyse=_analyse_mean_difference,
        solution="import pandas as pd\ndf = pd.read_csv('expression.csv')\nm = df.groupby('condition').expression.mean()\n"
        "print(repr(float(m['treated'] - m['control'])))",
    ),
    CapsuleSpec(
        capsule_id="regression_slope",
        category="linear regression",
        hypothesis="Systolic blood pressure rises with sodium intake.",
        question="sodium.csv holds daily sodium intake (g/day), age and systolic blood pressure (mmHg). What "
        "is the slope (mmHg per g/day) of the ordinary least-squares regression of systolic_bp on "
        "sodium_g_per_day alone? Give 3 significant figures.",
        eval_mode="range_verifier",
        tolerance={"rel": 0.01},
        draw=_draw_regression,
        analyse=_analyse_regression,
        solution="import pandas as pd\nfrom scipy import stats\ndf = pd.read_csv('sodium.csv')\n"
        "print(repr(float(stats.linregress(df.sodium_g_per_day, df.systolic_bp).slope)))",
    ),
    CapsuleSpec(
        capsule_id="survival_median",
        category="survival analysis",
        hypothesis="The new regimen prolongs survival.",
        question="survival.csv holds months of follow-up and whether the patient died (death=1) or was "
        "censored (death=0), per arm. What is the Kaplan-Meier median survival of the new_regimen arm minus "
        "that of the standard arm, in months? (The Kaplan-Meier median is the first event time at which the "
        "estimated survival falls to 0.5 or below.)",
        eval_mode="range_verifier",
        tolerance={"abs": 0.05},
        draw=_draw_survival,
        analyse=_analyse_survival_median,
        solution="import numpy as np, pandas as pd\ndf = pd.read_csv('survival.csv')\n"
        "def km_median(t, e):\n    s, n = 1.0, len(t)\n    for v in np.unique(t):\n"
        "        d = e[t == v].sum()\n        if d:\n            s *= 1 - d / n\n            if s <= 0.5:\n"
        "                return v\n        n -= (t == v).sum()\n"
        "m = {a: km_median(g.months.to_numpy(), g.death.to_numpy()) for a, g in df.groupby('arm')}\n"
        "print(repr(float(m['new_regimen'] - m['standard'])))",
    ),
    CapsuleSpec(
        capsule_id="survival_logrank",
        category="survival analysis",
        hypothesis="Survival differs between the two arms.",
        question="survival.csv holds months of follow-up and whether the patient died (death=1) or was "
        "censored (death=0), per arm. What is the log-rank test's chi-square statistic (1 degree of freedom) "
        "comparing the two arms? Give 3 significant figures.",
        eval_mode="range_verifier",
        tolerance={"rel": 0.01},
        draw=_draw_survival,
        analyse=_analyse_logrank,
        solution="import numpy as np, pandas as pd\ndf = pd.read_csv('survival.csv')\n"
        "t, e, g = df.months.to_numpy(), df.death.to_numpy(), (df.arm == 'new_regimen').to_numpy()\n"
        "o = v = 0.0\nfor x in np.unique(t[e == 1]):\n    r = t >= x\n    n, n1 = r.sum(), (r & g).sum()\n"
        "    d = ((t == x) & (e == 1)).sum()\n    d1 = ((t == x) & (e == 1) & g).sum()\n"
        "    o += d1 - d * n1 / n\n    v += d * (n1 / n) * (1 - n1 / n) * (n - d) / (n - 1) if n > 1 else 0\n"
        "print(repr(float(o**2 / v)))",
    ),
    CapsuleSpec(
        capsule_id="partial_correlation",
        category="confounding",
        hypothesis="Coffee drinking raises blood pressure.",
        question="cohort.csv holds age, coffee cups per day and systolic blood pressure. What is the partial "
        "correlation between coffee_cups_per_day and systolic_bp adjusting for age (the Pearson correlation "
        "of their residuals after a linear regression of each on age)? Give 3 decimals.",
        eval_mode="range_verifier",
        tolerance={"abs": 0.01},
        draw=_draw_confounded,
        analyse=_analyse_partial,
        solution="import numpy as np, pandas as pd\ndf = pd.read_csv('cohort.csv')\n"
        "res = lambda y: y - np.polyval(np.polyfit(df.age, y, 1), df.age)\n"
        "print(repr(float(np.corrcoef(res(df.coffee_cups_per_day), res(df.systolic_bp))[0, 1])))",
    ),
    CapsuleSpec(
        capsule_id="confounder_choice",
        category="confounding",
        hypothesis="Exercise lowers cholesterol.",
        question="lifestyle.csv holds weekly exercise hours, cholesterol and four other variables. Exercise "
        "and cholesterol are correlated. Which one variable confounds this association, i.e. adjusting for "
        "it removes the correlation?",
        eval_mode="mcq",
        options=CONFOUNDER_OPTIONS,
        draw=_draw_confounder_choice,
        analyse=_analyse_confounder_choice,
        solution="import numpy as np, pandas as pd\ndf = pd.read_csv('lifestyle.csv')\n"
        "def partial(z):\n    res = lambda y: y - np.polyval(np.polyfit(z, y, 1), z)\n"
        "    return np.corrcoef(res(df.exercise_h_per_week), res(df.cholesterol_mg_dl))[0, 1]\n"
        "num = pd.api.types.is_numeric_dtype\n"
        "print({c: round(float(partial(df[c] if num(df[c]) else pd.factorize(df[c])[0])), 3) "
        "for c in ['age', 'height_cm', 'shoe_size', 'clinic']})",
    ),
    CapsuleSpec(
        capsule_id="anova_diets",
        category="ANOVA",
        hypothesis="Weight loss differs between diets.",
        question="diets.csv holds the weight loss (kg) of participants on three diets. What is the F "
        "statistic of a one-way ANOVA of weight_loss_kg across the diets? Give 3 significant figures.",
        eval_mode="range_verifier",
        tolerance={"rel": 0.01},
        draw=_draw_anova,
        analyse=_analyse_anova,
        solution="import pandas as pd\nfrom scipy import stats\ndf = pd.read_csv('diets.csv')\n"
        "print(repr(float(stats.f_oneway(*[g.weight_loss_kg for _, g in df.groupby('diet')]).statistic)))",
    ),
    CapsuleSpec(
        capsule_id="chi_square_genotype",
        category="contingency table",
        hypothesis="Disease status depends on genotype.",
        question="genotypes.csv holds each subject's genotype (AA, Aa, aa) and status (case or control). What "
        "is the Pearson chi-square statistic of the genotype-by-status contingency table? Give 3 significant "
        "figures.",
        eval_mode="range_verifier",
        tolerance={"rel": 0.01},
        draw=_draw_chi_square,
        analyse=_analyse_chi_square,
        solution="import pandas as pd\nfrom scipy import stats\ndf = pd.read_csv('genotypes.csv')\n"
        "print(repr(float(stats.chi2_contingency(pd.crosstab(df.genotype, df.status))[0])))",
    ),
    CapsuleSpec(
        capsule_id="dose_response_ec50",
        category="dose-response",
        hypothesis="The compound inhibits the enzyme with a sigmoidal dose-response.",
        question="dose_response.csv holds percent inhibition at nine concentrations (uM), four replicates "
        "each. Fit a four-parameter logistic curve, inhibition = bottom + (top - bottom) / (1 + (EC50 / "
        "concentration)^hill), by least squares to all points. What is the EC50 in uM? Give 3 significant "
        "figures.",
        eval_mode="range_verifier",
        tolerance={"rel": 0.02},
        draw=_draw_dose_response,
        analyse=_analyse_dose_response,
        solution="import numpy as np, pandas as pd\nfrom scipy.optimize import curve_fit\n"
        "df = pd.read_csv('dose_response.csv')\nf = lambda c, b, t, e, h: b + (t - b) / (1 + (e / c) ** h)\n"
        "p, _ = curve_fit(f, df.concentration_uM, df.inhibition_pct, p0=[0, 100, 1, 1], maxfev=20000)\n"
        "print(repr(float(p[2])))",
    ),
    CapsuleSpec(
        capsule_id="paired_ldl",
        category="paired test",
        hypothesis="The statin lowers LDL cholesterol.",
        question="statin.csv holds each patient's LDL cholesterol before and after a statin course. What is "
        "the t statistic of the paired t-test of ldl_after against ldl_before (differences taken as after "
        "minus before)? Give 3 significant figures.",
        eval_mode="range_verifier",
        tolerance={"rel": 0.01},
        draw=_draw_paired,
        analyse=_analyse_paired,
        solution="import pandas as pd\nfrom scipy import stats\ndf = pd.read_csv('statin.csv')\n"
        "print(repr(float(stats.ttest_rel(df.ldl_after, df.ldl_before).statistic)))",
    ),
    CapsuleSpec(
        capsule_id="robust_median_difference",
        category="robust statistics",
        hypothesis="Lab B reads troponin lower than lab A.",
        question="assays.csv holds troponin measurements (ng/L) from labs A and B; a few of lab B's values are "
        "gross errors. What is the median of lab B minus the median of lab A, in ng/L? Give 2 decimals.",
        eval_mode="range_verifier",
        tolerance={"abs": 0.01},
        draw=_draw_robust,
        analyse=_analyse_robust,
        solution="import pandas as pd\ndf = pd.read_csv('assays.csv')\nm = df.groupby('lab').troponin_ng_l.median()\n"
        "print(repr(float(m['B'] - m['A'])))",
    ),
    CapsuleSpec(
        capsule_id="de_gene_choice",
        category="differential expression",
        hypothesis="One of five genes is differentially expressed in tumour versus normal tissue.",
        question="tumour_expression.csv holds the expression of five genes in tumour and normal samples. "
        "Which gene is differentially expressed between tumour and normal tissue (Welch t-test, Bonferroni-"
        "adjusted p < 0.05 over the five genes)?",
        eval_mode="mcq",
        options=(*GENES, "none"),
        draw=_draw_de_gene,
        analyse=_analyse_de_gene,
        solution="import pandas as pd\nfrom scipy import stats\ndf = pd.read_csv('tumour_expression.csv')\n"
        "t, n = df[df.tissue == 'tumour'], df[df.tissue == 'normal']\n"
        "print({g: float(min(1, 5 * stats.ttest_ind(t[g], n[g], equal_var=False).pvalue)) "
        "for g in ['TP53', 'EGFR', 'KRAS', 'BRCA1', 'PTEN']})",
    ),
)

BY_ID = {spec.capsule_id: spec for spec in SPECS}
MAX_DRAWS = 50


def draw_capsule(spec: CapsuleSpec, seed: int) -> tuple[Frames, Analysis, int]:
    """The first draw of ``spec`` for ``seed`` whose reference analysis proves the planted effect: its
    frames (as the agent will read them), the analysis, and which draw it was. Raises if none of
    ``MAX_DRAWS`` draws does (a capsule whose effect is too weak to plant reliably)."""
    index = SPECS.index(spec)
    for attempt in range(MAX_DRAWS):
        rng = np.random.default_rng([seed, index, attempt])
        frames = reread(spec.draw(rng))
        analysis = spec.analyse(frames)
        if analysis.proven:
            return frames, analysis, attempt
    raise RuntimeError(f"capsule {spec.capsule_id}: no draw of seed {seed} proves the planted effect")
