"""The hidden laws of law_discovery: 24 systems over 8 domains, each a law changed from its textbook
form (another exponent, another dependence) so that a remembered formula does not score.

Each :class:`LawTemplate` has constants named in braces (``{C}``); :func:`instantiate` draws them from a
seeded generator (log-uniform within a factor of 2 of the base value, 3 significant figures), so
each seed gives a dataset whose constants nobody has seen. The dataset generator
(``scripts/generate_dataset.py``) writes the rows; the server reads only what a row says.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Variable:
    name: str
    low: float
    high: float
    unit: str
    meaning: str


@dataclass(frozen=True)
class LawTemplate:
    task_id: str
    domain: str
    system: str  # what the agent is told it studies
    target: str
    target_unit: str
    target_meaning: str
    template: str  # the law, constants in braces
    constants: dict[str, float]  # base values of the constants
    variables: tuple[Variable, ...]
    noise: float  # relative standard deviation of a measurement
    textbook: str = ""  # the familiar form a model might remember (a wrong answer for the tests)


def _v(name: str, low: float, high: float, unit: str, meaning: str) -> Variable:
    return Variable(name, low, high, unit, meaning)


TEMPLATES: tuple[LawTemplate, ...] = (
    # -- gravitation ------------------------------------------------------------------------------
    LawTemplate(
        "gravitation_force",
        "gravitation",
        "two point masses attracting each other in a modified universe",
        "F",
        "N",
        "the attractive force",
        "{C}*m1*m2/r**3",
        {"C": 6.7e-3},
        (
            _v("m1", 1, 100, "kg", "first mass"),
            _v("m2", 1, 100, "kg", "second mass"),
            _v("r", 0.5, 10, "m", "distance between the centres"),
        ),
        0.0,
        textbook="6.7e-3*m1*m2/r**2",
    ),
    LawTemplate(
        "gravitation_orbit",
        "gravitation",
        "a small moon on a circular orbit around a planet",
        "T",
        "s",
        "the orbital period",
        "{C}*r**1.25/M**0.5",
        {"C": 2.4},
        (_v("r", 1, 50, "Mm", "orbit radius"), _v("M", 1, 80, "Eg", "planet mass")),
        0.01,
        textbook="2.4*r**1.5/M**0.5",
    ),
    LawTemplate(
        "gravitation_escape",
        "gravitation",
        "a probe launched from the surface of a body",
        "v",
        "km/s",
        "the escape speed",
        "{C}*(M/R)**0.4",
        {"C": 3.1},
        (_v("M", 1, 100, "Eg", "body mass"), _v("R", 0.5, 20, "Mm", "body radius")),
        0.01,
        textbook="3.1*(M/R)**0.5",
    ),
    # -- electrostatics ---------------------------------------------------------------------------
    LawTemplate(
        "electrostatics_force",
        "electrostatics",
        "two small charged spheres",
        "F",
        "N",
        "the force between them",
        "{C}*q1*q2/r**2.5",
        {"C": 8.9},
        (
            _v("q1", 0.1, 10, "uC", "first charge"),
            _v("q2", 0.1, 10, "uC", "second charge"),
            _v("r", 0.1, 5, "m", "distance"),
        ),
        0.0,
        textbook="8.9*q1*q2/r**2",
    ),
    LawTemplate(
        "electrostatics_potential",
        "electrostatics",
        "the potential near a charged wire segment",
        "V",
        "V",
        "the potential",
        "{C}*q/r**0.5",
        {"C": 45},
        (_v("q", 0.1, 10, "nC", "charge"), _v("r", 0.05, 4, "m", "distance from the wire")),
        0.01,
        textbook="45*q/r",
    ),
    LawTemplate(
        "electrostatics_ring",
        "electrostatics",
        "the field on the axis of a charged ring",
        "E",
        "V/m",
        "the field strength",
        "{C}*q*z/(z**2 + a**2)**1.25",
        {"C": 9.0},
        (
            _v("q", 0.1, 10, "nC", "ring charge"),
            _v("z", 0.1, 3, "m", "distance along the axis"),
            _v("a", 0.1, 2, "m", "ring radius"),
        ),
        0.0,
        textbook="9.0*q*z/(z**2 + a**2)**1.5",
    ),
    # -- optics -----------------------------------------------------------------------------------
    LawTemplate(
        "optics_dispersion",
        "optics",
        "a glass whose refractive index depends on the wavelength",
        "n",
        "1",
        "the refractive index",
        "{A} + {B}/w**3",
        {"A": 1.45, "B": 2.0e6},
        (_v("w", 350, 900, "nm", "wavelength"),),
        0.0,
        textbook="1.45 + 2.0e6/w**2",
    ),
    LawTemplate(
        "optics_intensity",
        "optics",
        "light from a lamp through a tinted medium",
        "I",
        "W/m^2",
        "the intensity",
        "{C}*P*exp(-{k}*d)/d**2",
        {"C": 0.08, "k": 0.3},
        (_v("P", 1, 100, "W", "lamp power"), _v("d", 0.5, 8, "m", "distance")),
        0.01,
        textbook="0.08*P/d**2",
    ),
    LawTemplate(
        "optics_magnification",
        "optics",
        "an image formed by a strange lens",
        "M",
        "1",
        "the magnification",
        "{C}*f/(u - f)**0.8",
        {"C": 1.2},
        (_v("u", 3, 20, "cm", "object distance"), _v("f", 0.5, 2.5, "cm", "focal length")),
        0.0,
        textbook="f/(u - f)",
    ),
    # -- oscillation ------------------------------------------------------------------------------
    LawTemplate(
        "oscillation_pendulum",
        "oscillation",
        "a pendulum swinging with a small amplitude",
        "T",
        "s",
        "the period",
        "{C}*L**0.7/g**0.5",
        {"C": 6.3},
        (_v("L", 0.1, 5, "m", "length"), _v("g", 1, 25, "m/s^2", "gravitational acceleration")),
        0.01,
        textbook="6.3*L**0.5/g**0.5",
    ),
    LawTemplate(
        "oscillation_spring",
        "oscillation",
        "a mass on a spring",
        "T",
        "s",
        "the period",
        "{C}*(m/k)**0.6",
        {"C": 6.3},
        (_v("m", 0.1, 10, "kg", "mass"), _v("k", 1, 100, "N/m", "spring constant")),
        0.0,
        textbook="6.3*(m/k)**0.5",
    ),
    LawTemplate(
        "oscillation_damped",
        "oscillation",
        "the amplitude of a damped oscillator over time",
        "A",
        "cm",
        "the amplitude",
        "A0*exp(-{C}*t**1.5)",
        {"C": 0.05},
        (_v("A0", 1, 10, "cm", "initial amplitude"), _v("t", 0, 12, "s", "time")),
        0.01,
        textbook="A0*exp(-0.05*t)",
    ),
    # -- thermal ----------------------------------------------------------------------------------
    LawTemplate(
        "thermal_conduction",
        "thermal conduction",
        "heat flowing through a slab",
        "Q",
        "W",
        "the heat flow",
        "{C}*A*dT/L**1.5",
        {"C": 0.9},
        (
            _v("A", 0.1, 4, "m^2", "area"),
            _v("dT", 1, 80, "K", "temperature difference"),
            _v("L", 0.01, 0.5, "m", "thickness"),
        ),
        0.0,
        textbook="0.9*A*dT/L",
    ),
    LawTemplate(
        "thermal_cooling",
        "thermal conduction",
        "a cup cooling in a room",
        "T",
        "degC",
        "the cup's temperature",
        "Ta + {D}*exp(-{k}*t**1.2)",
        {"D": 60, "k": 0.02},
        (_v("Ta", 5, 30, "degC", "room temperature"), _v("t", 0, 100, "min", "time")),
        0.01,
        textbook="Ta + 60*exp(-0.04*t)",
    ),
    LawTemplate(
        "thermal_radiation",
        "thermal conduction",
        "a hot plate radiating into cold space",
        "P",
        "W",
        "the radiated power",
        "{C}*A*T**3.5",
        {"C": 2.0e-8},
        (_v("A", 0.01, 2, "m^2", "area"), _v("T", 200, 1500, "K", "plate temperature")),
        0.01,
        textbook="5.67e-8*A*T**4",
    ),
    # -- fluids -----------------------------------------------------------------------------------
    LawTemplate(
        "fluids_drag",
        "fluids",
        "a body moving through air",
        "F",
        "N",
        "the drag force",
        "{C}*rho*A*v**1.7",
        {"C": 0.45},
        (
            _v("rho", 0.5, 2, "kg/m^3", "air density"),
            _v("A", 0.01, 2, "m^2", "frontal area"),
            _v("v", 1, 60, "m/s", "speed"),
        ),
        0.01,
        textbook="0.45*rho*A*v**2",
    ),
    LawTemplate(
        "fluids_pipe",
        "fluids",
        "a liquid flowing through a thin pipe",
        "Q",
        "mL/s",
        "the flow rate",
        "{C}*r**3.5*dP/(mu*L)",
        {"C": 0.4},
        (
            _v("r", 0.1, 2, "mm", "pipe radius"),
            _v("dP", 1, 100, "kPa", "pressure drop"),
            _v("mu", 0.5, 5, "mPa s", "viscosity"),
            _v("L", 0.1, 3, "m", "pipe length"),
        ),
        0.0,
        textbook="0.4*r**4*dP/(mu*L)",
    ),
    LawTemplate(
        "fluids_terminal",
        "fluids",
        "a bead falling through oil",
        "v",
        "cm/s",
        "the terminal speed",
        "{C}*(m/(rho*A))**0.4",
        {"C": 4.0},
        (
            _v("m", 0.1, 10, "g", "bead mass"),
            _v("rho", 0.7, 1.5, "g/cm^3", "oil density"),
            _v("A", 0.05, 2, "cm^2", "cross-section"),
        ),
        0.01,
        textbook="4.0*(m/(rho*A))**0.5",
    ),
    # -- kinetics ---------------------------------------------------------------------------------
    LawTemplate(
        "kinetics_decay",
        "kinetics",
        "a radioactive sample",
        "N",
        "counts/s",
        "the activity",
        "N0*exp(-{C}*t**0.8)",
        {"C": 0.2},
        (_v("N0", 100, 5000, "counts/s", "initial activity"), _v("t", 0, 30, "h", "time")),
        0.01,
        textbook="N0*exp(-0.2*t)",
    ),
    LawTemplate(
        "kinetics_rate",
        "kinetics",
        "a reaction between two reagents",
        "R",
        "mol/(L s)",
        "the reaction rate",
        "{C}*a**1.5*b**0.5",
        {"C": 0.03},
        (
            _v("a", 0.01, 2, "mol/L", "concentration of the first reagent"),
            _v("b", 0.01, 2, "mol/L", "concentration of the second reagent"),
        ),
        0.0,
        textbook="0.03*a*b",
    ),
    LawTemplate(
        "kinetics_arrhenius",
        "kinetics",
        "a reaction at different temperatures",
        "k",
        "1/s",
        "the rate constant",
        "{A}*exp(-{E}/T**1.2)",
        {"A": 5.0e3, "E": 900},
        (_v("T", 280, 700, "K", "temperature"),),
        0.01,
        textbook="5.0e3*exp(-900/T)",
    ),
    # -- waves and elasticity ---------------------------------------------------------------------
    LawTemplate(
        "waves_string",
        "waves and elasticity",
        "waves on a stretched string",
        "v",
        "m/s",
        "the wave speed",
        "{C}*(Tn/mu)**0.6",
        {"C": 1.0},
        (_v("Tn", 1, 200, "N", "tension"), _v("mu", 0.001, 0.1, "kg/m", "mass per length")),
        0.0,
        textbook="(Tn/mu)**0.5",
    ),
    LawTemplate(
        "elasticity_spring",
        "waves and elasticity",
        "a stiffening rubber band",
        "F",
        "N",
        "the restoring force",
        "{C}*x**1.3",
        {"C": 40},
        (_v("x", 0.01, 0.5, "m", "extension"),),
        0.01,
        textbook="40*x",
    ),
    LawTemplate(
        "elasticity_beam",
        "waves and elasticity",
        "a cantilever beam loaded at its tip",
        "d",
        "mm",
        "the tip deflection",
        "{C}*F*L**2.5/(E*I)",
        {"C": 330},
        (
            _v("F", 1, 100, "N", "load"),
            _v("L", 0.2, 3, "m", "length"),
            _v("E", 50, 300, "GPa", "Young's modulus"),
            _v("I", 0.5, 10, "cm^4", "second moment of area"),
        ),
        0.01,
        textbook="330*F*L**3/(E*I)",
    ),
)


def _draw(base: float, rng: random.Random) -> float:
    value = base * math.exp(rng.uniform(-math.log(2), math.log(2)))
    return float(f"{value:.3g}")


def instantiate(template: LawTemplate, rng: random.Random) -> tuple[str, dict[str, float]]:
    """(the law with drawn constants, the constants) for one task."""
    values = {name: _draw(base, rng) for name, base in template.constants.items()}
    return template.template.format(**{k: repr(v) for k, v in values.items()}), values
