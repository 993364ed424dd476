"""The scientific_code problems: each a short scientific computation split into 2-4 functions.

Every step is written once, as its reference function (``reference``: the ``def`` line, the docstring
the model sees, and the body only the generator sees). The model is shown the header (the ``def`` line
and the docstring) and the return line; the generator runs the reference on each test case's ``call``
(inputs drawn from a seed) to store the target. Later steps call earlier ones by name, as SciCode's do.
The docstrings say exactly what to compute (the random streams, the stencils, the conventions), so
that one numeric answer is right.
"""

from __future__ import annotations

import ast
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nemo_gym.kit import pyast

NUMPY = "import numpy as np"


@dataclass(frozen=True)
class Case:
    """One test: ``setup`` (statements) then ``call`` (an expression) in the step's namespace; the value
    must match the target within ``rtol``/``atol`` (elementwise, as ``numpy.isclose``)."""

    call: str
    setup: str = ""
    rtol: float = 1e-6
    atol: float = 1e-9


@dataclass(frozen=True)
class Step:
    description: str
    reference: str
    cases: Callable[[random.Random], list[Case]]

    @property
    def function(self) -> ast.FunctionDef:
        tree = pyast.parse(self.reference.strip("\n"))
        functions = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
        assert len(functions) == 1, "a step's reference is one function"
        return functions[0]

    @property
    def name(self) -> str:
        return self.function.name

    @property
    def header(self) -> str:
        """The ``def`` line and the docstring: what the model must implement."""
        fn = self.function
        lines = self.reference.strip("\n").splitlines()
        doc = fn.body[0]
        assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant), f"{fn.name}: no docstring"
        assert doc.end_lineno is not None
        return "\n".join(lines[: doc.end_lineno])

    @property
    def return_line(self) -> str:
        last = self.reference.strip("\n").splitlines()[-1]
        assert last.strip().startswith("return "), f"{self.name}: the reference must end with its return line"
        return last


@dataclass(frozen=True)
class Problem:
    problem_id: str
    name: str
    description: str
    steps: tuple[Step, ...]
    dependencies: str = NUMPY
    io: str = ""
    domain: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def _r(rng: random.Random, low: float, high: float, digits: int = 3) -> float:
    return round(rng.uniform(low, high), digits)


def _vec(rng: random.Random, n: int, low: float = -1.0, high: float = 1.0) -> str:
    return "np.array([" + ", ".join(repr(_r(rng, low, high)) for _ in range(n)) + "])"


def _matrix(rng: random.Random, n: int) -> str:
    return "np.array([" + ", ".join(_vec(rng, n)[9:-1] for _ in range(n)) + "])"


def _spd(rng: random.Random, n: int) -> str:
    """Setup code making ``A`` a symmetric positive definite matrix with well separated eigenvalues."""
    eig = sorted((_r(rng, 1, 3) * (i + 1) ** 1.5 for i in range(n)), reverse=True)
    return (
        f"Q, _ = np.linalg.qr({_matrix(rng, n)})\n"
        f"A = Q @ np.diag({[round(e, 3) for e in eig]}) @ Q.T\n"
        "A = (A + A.T) / 2"
    )


# -- 1. Lotka-Volterra with a hand-written RK4 ---------------------------------------------------------

LOTKA_VOLTERRA = Problem(
    problem_id="lotka_volterra_rk4",
    name="Predator-prey dynamics integrated with fourth-order Runge-Kutta",
    domain="dynamical systems",
    description=(
        "Prey x and predators y follow the Lotka-Volterra equations dx/dt = alpha*x - beta*x*y, "
        "dy/dt = delta*x*y - gamma*y. Write the right-hand side, a generic classical RK4 step, and an "
        "integrator that returns the whole trajectory on a uniform time grid."
    ),
    steps=(
        Step(
            "The right-hand side of the Lotka-Volterra system.",
            '''
def lotka_volterra_rhs(t, state, alpha, beta, delta, gamma):
    """Time derivative of the Lotka-Volterra system.

    t: time (unused: the system is autonomous); state: array [x, y] (prey, predators);
    alpha, beta, delta, gamma: the positive rate constants.
    Returns np.array([alpha*x - beta*x*y, delta*x*y - gamma*y]).
    """
    x, y = state
    derivative = np.array([alpha * x - beta * x * y, delta * x * y - gamma * y])
    return derivative
''',
            lambda rng: [
                Case(
                    f"lotka_volterra_rhs(0.0, {_vec(rng, 2, 0.5, 5)}, {_r(rng, 0.5, 1.5)}, "
                    f"{_r(rng, 0.1, 0.5)}, {_r(rng, 0.05, 0.3)}, {_r(rng, 0.5, 1.5)})"
                )
                for _ in range(3)
            ],
        ),
        Step(
            "One step of the classical fourth-order Runge-Kutta method for any system y' = f(t, y).",
            '''
def rk4_step(f, t, y, h):
    """Advance y' = f(t, y) from (t, y) by one classical RK4 step of size h.

    f: callable f(t, y) -> array; t: float; y: np.ndarray; h: step size.
    Uses k1 = f(t, y), k2 = f(t + h/2, y + h/2*k1), k3 = f(t + h/2, y + h/2*k2), k4 = f(t + h, y + h*k3).
    Returns y + h/6*(k1 + 2*k2 + 2*k3 + k4).
    """
    k1 = f(t, y)
    k2 = f(t + h / 2, y + h / 2 * k1)
    k3 = f(t + h / 2, y + h / 2 * k2)
    k4 = f(t + h, y + h * k3)
    y_next = y + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    return y_next
''',
            lambda rng: [
                Case(
                    f"rk4_step(f, {_r(rng, 0, 2)}, {_vec(rng, 2)}, {_r(rng, 0.05, 0.5)})",
                    setup=f"f = lambda t, y: np.array([y[1], -{_r(rng, 1, 4)} * y[0] + np.sin(t)])",
                )
                for _ in range(3)
            ],
        ),
        Step(
            "Integrate the Lotka-Volterra system with RK4 on a uniform grid.",
            '''
def integrate_lotka_volterra(x0, y0, alpha, beta, delta, gamma, t_end, n_steps):
    """Integrate the Lotka-Volterra system from t = 0 to t_end with n_steps equal RK4 steps.

    Uses lotka_volterra_rhs and rk4_step. Returns an array of shape (n_steps + 1, 2): the state [x, y]
    at t = 0, h, 2h, ..., t_end (h = t_end / n_steps), the initial state first.
    """
    h = t_end / n_steps
    f = lambda t, s: lotka_volterra_rhs(t, s, alpha, beta, delta, gamma)
    trajectory = np.empty((n_steps + 1, 2))
    trajectory[0] = [x0, y0]
    for i in range(n_steps):
        trajectory[i + 1] = rk4_step(f, i * h, trajectory[i], h)
    return trajectory
''',
            lambda rng: [
                Case(
                    f"integrate_lotka_volterra({_r(rng, 5, 15)}, {_r(rng, 2, 8)}, {_r(rng, 0.8, 1.2)}, "
                    f"{_r(rng, 0.08, 0.15)}, {_r(rng, 0.05, 0.1)}, {_r(rng, 0.8, 1.5)}, "
                    f"{rng.choice([5.0, 10.0, 15.0])}, {rng.choice([100, 200, 400])})[::25]"
                )
                for _ in range(3)
            ],
        ),
    ),
)

# -- 2. Monte Carlo with a seeded generator ---------------------------------------------------------

MONTE_CARLO = Problem(
    problem_id="monte_carlo_estimates",
    name="Seeded Monte Carlo estimates of pi and of an integral",
    domain="statistics",
    description=(
        "Estimate pi by throwing points into the unit square, and estimate a one-dimensional integral "
        "with its standard error. Every random number comes from numpy's default_rng with the given seed, "
        "drawn exactly as the docstrings say, so the estimates are reproducible."
    ),
    steps=(
        Step(
            "Uniform points in the unit square from a seeded generator.",
            '''
def sample_unit_square(n, seed):
    """n points uniform in [0, 1)^2: np.random.default_rng(seed).random((n, 2)) (shape (n, 2))."""
    points = np.random.default_rng(seed).random((n, 2))
    return points
''',
            lambda rng: [Case(f"sample_unit_square({n}, {rng.randrange(10**6)})") for n in (3, 5)],
        ),
        Step(
            "Estimate pi from the fraction of points inside the quarter circle.",
            '''
def estimate_pi(n, seed):
    """4 * (fraction of the points of sample_unit_square(n, seed) with x**2 + y**2 <= 1)."""
    points = sample_unit_square(n, seed)
    inside = np.count_nonzero(np.sum(points**2, axis=1) <= 1.0)
    estimate = 4.0 * inside / n
    return estimate
''',
            lambda rng: [Case(f"estimate_pi({n}, {rng.randrange(10**6)})") for n in (1000, 20000, 50000)],
        ),
        Step(
            "A Monte Carlo integral over [a, b] with its standard error.",
            '''
def mc_integral(f, a, b, n, seed):
    """Monte Carlo estimate of the integral of f over [a, b] from n uniform samples.

    Draws u = np.random.default_rng(seed).random(n), x = a + (b - a) * u, values = (b - a) * f(x).
    Returns np.array([values.mean(), values.std(ddof=1) / sqrt(n)]): the estimate and its standard error.
    """
    u = np.random.default_rng(seed).random(n)
    values = (b - a) * f(a + (b - a) * u)
    result = np.array([values.mean(), values.std(ddof=1) / np.sqrt(n)])
    return result
''',
            lambda rng: [
                Case(f"mc_integral({fn}, {_r(rng, 0, 1)}, {_r(rng, 1.5, 3)}, 5000, {rng.randrange(10**6)})")
                for fn in ("np.exp", "lambda x: np.sin(x) ** 2", "lambda x: 1 / (1 + x**2)")
            ],
        ),
    ),
)

# -- 3. Eigenvalues by power iteration and deflation --------------------------------------------------

POWER_ITERATION = Problem(
    problem_id="power_iteration_eigen",
    name="Dominant eigenvalues of a symmetric matrix by power iteration and deflation",
    domain="linear algebra",
    description=(
        "For a symmetric positive definite matrix with distinct eigenvalues, find the largest eigenvalues "
        "one at a time: power iteration gives the dominant eigenpair, Hotelling deflation removes it."
    ),
    steps=(
        Step(
            "Power iteration from a given start vector.",
            '''
def power_iteration(A, v0, n_iter):
    """Dominant eigenpair of the symmetric matrix A by n_iter steps of power iteration from v0.

    Each step: v = A @ v, then v = v / norm(v) (v0 is normalised first). Returns (lam, v) where
    lam = v @ A @ v (the Rayleigh quotient of the final unit vector v).
    """
    v = v0 / np.linalg.norm(v0)
    for _ in range(n_iter):
        v = A @ v
        v = v / np.linalg.norm(v)
    lam = v @ A @ v
    return lam, v
''',
            lambda rng: [
                Case("power_iteration(A, np.ones(len(A)), 500)[0]", setup=_spd(rng, n), rtol=1e-7)
                for n in (3, 4, 5)
            ],
        ),
        Step(
            "Remove a known eigenpair from a symmetric matrix (Hotelling deflation).",
            '''
def deflate(A, lam, v):
    """A - lam * outer(u, u) with u = v / norm(v): the matrix with eigenvalue lam moved to 0."""
    u = v / np.linalg.norm(v)
    deflated = A - lam * np.outer(u, u)
    return deflated
''',
            lambda rng: [
                Case(f"deflate(A, {_r(rng, 1, 5)}, {_vec(rng, n)})", setup=_spd(rng, n)) for n in (3, 4)
            ],
        ),
        Step(
            "The k largest eigenvalues by repeated power iteration and deflation.",
            '''
def top_eigenvalues(A, k, n_iter):
    """The k largest eigenvalues of the symmetric positive definite A, largest first.

    Repeat k times: (lam, v) = power_iteration(B, np.ones(len(A)), n_iter) on the current matrix B
    (B = A at first), record lam, then B = deflate(B, lam, v). Returns np.array of the k values.
    """
    B = np.array(A, dtype=float)
    values = []
    for _ in range(k):
        lam, v = power_iteration(B, np.ones(len(A)), n_iter)
        values.append(lam)
        B = deflate(B, lam, v)
    eigenvalues = np.array(values)
    return eigenvalues
''',
            lambda rng: [
                Case(f"top_eigenvalues(A, {n - 1}, 2000)", setup=_spd(rng, n), rtol=1e-6) for n in (3, 4, 5)
            ],
        ),
    ),
)

# -- 4. QR by modified Gram-Schmidt, least squares by back substitution -------------------------------

QR_LEAST_SQUARES = Problem(
    problem_id="qr_least_squares",
    name="QR decomposition by modified Gram-Schmidt and least squares",
    domain="linear algebra",
    description=(
        "Factor a tall matrix with full column rank as A = QR (Q with orthonormal columns, R upper "
        "triangular with a positive diagonal) by modified Gram-Schmidt, then solve the least-squares "
        "problem min ||A x - b|| with it."
    ),
    steps=(
        Step(
            "QR decomposition by modified Gram-Schmidt.",
            '''
def mgs_qr(A):
    """Reduced QR of A (m x n, m >= n, full column rank) by modified Gram-Schmidt.

    Returns (Q, R): Q of shape (m, n) with orthonormal columns, R of shape (n, n) upper triangular with
    a positive diagonal, Q @ R == A.
    """
    A = np.array(A, dtype=float)
    m, n = A.shape
    Q = A.copy()
    R = np.zeros((n, n))
    for j in range(n):
        R[j, j] = np.linalg.norm(Q[:, j])
        Q[:, j] = Q[:, j] / R[j, j]
        for k in range(j + 1, n):
            R[j, k] = Q[:, j] @ Q[:, k]
            Q[:, k] = Q[:, k] - R[j, k] * Q[:, j]
    return Q, R
''',
            lambda rng: [
                Case(f"mgs_qr(A)[{part}]", setup=f"A = {_matrix(rng, 5)}[:, :{n}]")
                for n in (2, 3)
                for part in (0, 1)
            ],
        ),
        Step(
            "Solve an upper triangular system by back substitution.",
            '''
def back_substitution(R, y):
    """Solve R x = y for an upper triangular R with a non-zero diagonal (no library solver)."""
    n = len(y)
    x = np.zeros(n)
    for i in range(n - 1, -1, -1):
        x[i] = (y[i] - R[i, i + 1 :] @ x[i + 1 :]) / R[i, i]
    return x
''',
            lambda rng: [
                Case(
                    f"back_substitution(R, {_vec(rng, n)})",
                    setup=f"R = np.triu({_matrix(rng, n)}) + {n} * np.eye({n})",
                )
                for n in (3, 4, 5)
            ],
        ),
        Step(
            "Least squares through the QR factorisation.",
            '''
def qr_least_squares(A, b):
    """The x minimising ||A x - b||: with (Q, R) = mgs_qr(A), solve R x = Q.T @ b by back_substitution."""
    Q, R = mgs_qr(A)
    x = back_substitution(R, Q.T @ b)
    return x
''',
            lambda rng: [
                Case(f"qr_least_squares(A, {_vec(rng, 6)})", setup=f"A = {_matrix(rng, 6)}[:, :{n}]")
                for n in (2, 3, 4)
            ],
        ),
    ),
)

# -- 5. FIR low-pass filtering and spectra -----------------------------------------------------------

FIR_FILTER = Problem(
    problem_id="fir_lowpass_spectrum",
    name="A windowed-sinc low-pass filter and the spectrum of the filtered signal",
    domain="signal processing",
    description=(
        "Design a linear-phase FIR low-pass filter by the windowed-sinc method, apply it causally to a "
        "sampled signal, and find the strongest frequency of a signal with the FFT."
    ),
    steps=(
        Step(
            "Windowed-sinc low-pass taps.",
            '''
def lowpass_taps(num_taps, cutoff):
    """Taps of a windowed-sinc low-pass FIR filter.

    cutoff: the cut-off as a fraction of the sampling rate (0 < cutoff < 0.5). With
    n = np.arange(num_taps) and M = num_taps - 1: h = 2*cutoff*np.sinc(2*cutoff*(n - M/2)) times the
    Hamming window 0.54 - 0.46*cos(2*pi*n/M), then scaled so that sum(h) == 1.
    """
    n = np.arange(num_taps)
    M = num_taps - 1
    h = 2 * cutoff * np.sinc(2 * cutoff * (n - M / 2))
    h = h * (0.54 - 0.46 * np.cos(2 * np.pi * n / M))
    taps = h / h.sum()
    return taps
''',
            lambda rng: [Case(f"lowpass_taps({n}, {_r(rng, 0.05, 0.4)})") for n in (11, 21, 31)],
        ),
        Step(
            "Causal FIR filtering.",
            '''
def fir_filter(taps, x):
    """y[i] = sum_k taps[k] * x[i - k] over k with i - k >= 0 (x is zero before the start); len(y) == len(x)."""
    y = np.convolve(x, taps)[: len(x)]
    return y
''',
            lambda rng: [Case(f"fir_filter({_vec(rng, 4)}, {_vec(rng, 12)})") for _ in range(3)],
        ),
        Step(
            "The strongest frequency of a real signal.",
            '''
def dominant_frequency(x, fs):
    """The frequency (Hz) of the largest |rfft(x)| bin other than 0 Hz, for a signal sampled at fs Hz.

    Bin k of np.fft.rfft(x) is at k * fs / len(x).
    """
    spectrum = np.abs(np.fft.rfft(x))
    k = 1 + int(np.argmax(spectrum[1:]))
    frequency = k * fs / len(x)
    return frequency
''',
            lambda rng: (
                [
                    Case(
                        f"dominant_frequency(np.sin(2*np.pi*{f1}*t) + {_r(rng, 0.3, 0.6)}*np.sin(2*np.pi*{f2}*t), 1000.0)",
                        setup="t = np.arange(2000) / 1000.0",
                    )
                    for f1, f2 in ((rng.randrange(5, 60), rng.randrange(150, 400)) for _ in range(2))
                ]
                + [
                    Case(  # after low-pass filtering the strong high tone, the low tone dominates
                        f"dominant_frequency(fir_filter(lowpass_taps(101, 0.05), "
                        f"0.6*np.sin(2*np.pi*{rng.randrange(5, 30)}*t) + np.sin(2*np.pi*{rng.randrange(200, 400)}*t)), 1000.0)",
                        setup="t = np.arange(2000) / 1000.0",
                    )
                ]
            ),
        ),
    ),
)

# -- 6. Newton's method and Kepler's equation ---------------------------------------------------------

KEPLER = Problem(
    problem_id="kepler_newton",
    name="Kepler's equation solved by Newton's method, and the orbit it gives",
    domain="celestial mechanics",
    description=(
        "A body on an elliptical orbit: its eccentric anomaly E solves Kepler's equation "
        "E - e*sin(E) = M for the mean anomaly M. Solve it with Newton's method and place the body."
    ),
    steps=(
        Step(
            "Newton's method for a scalar root.",
            '''
def newton(f, df, x0, tol=1e-12, max_iter=100):
    """A root of f by Newton's method x <- x - f(x)/df(x) from x0.

    Stops when |step| < tol or after max_iter steps, and returns the last x.
    """
    x = x0
    for _ in range(max_iter):
        step = f(x) / df(x)
        x = x - step
        if abs(step) < tol:
            break
    return x
''',
            lambda rng: (
                [
                    Case(f"newton(lambda x: x**3 - {c}, lambda x: 3 * x**2, {x0})", rtol=1e-9)
                    for c, x0 in ((_r(rng, 2, 30), _r(rng, 1, 4)) for _ in range(2))
                ]
                + [Case(f"newton(np.cos, lambda x: -np.sin(x), {_r(rng, 1, 2)})", rtol=1e-9)]
            ),
        ),
        Step(
            "The eccentric anomaly.",
            '''
def eccentric_anomaly(M, e):
    """E solving E - e*sin(E) = M (0 <= e < 1), by newton from x0 = M if e < 0.8 else x0 = pi."""
    x0 = M if e < 0.8 else np.pi
    E = newton(lambda E: E - e * np.sin(E) - M, lambda E: 1 - e * np.cos(E), x0)
    return E
''',
            lambda rng: [
                Case(f"eccentric_anomaly({_r(rng, 0.1, 6)}, {e})", rtol=1e-9) for e in (0.1, 0.5, 0.9)
            ],
        ),
        Step(
            "The position on the orbit.",
            '''
def orbit_position(a, e, M):
    """The body's position (x, y) in the orbital plane, the focus at the origin, periapsis on +x.

    With E = eccentric_anomaly(M, e): x = a*(cos(E) - e), y = a*sqrt(1 - e**2)*sin(E).
    Returns np.array([x, y]).
    """
    E = eccentric_anomaly(M, e)
    position = np.array([a * (np.cos(E) - e), a * np.sqrt(1 - e**2) * np.sin(E)])
    return position
''',
            lambda rng: [
                Case(f"orbit_position({_r(rng, 1, 5)}, {_r(rng, 0.05, 0.95)}, {_r(rng, 0.1, 6)})", rtol=1e-9)
                for _ in range(3)
            ],
        ),
    ),
)

# -- 7. The heat equation by finite differences ------------------------------------------------------

HEAT = Problem(
    problem_id="heat_equation_ftcs",
    name="The 1-D heat equation by the explicit finite-difference scheme",
    domain="partial differential equations",
    description=(
        "u_t = alpha * u_xx on a rod whose two ends are held at 0 (Dirichlet), on a uniform grid of "
        "spacing dx that includes both ends. March in time with forward Euler (FTCS)."
    ),
    steps=(
        Step(
            "The discrete second derivative.",
            '''
def laplacian_1d(u, dx):
    """(u[i-1] - 2*u[i] + u[i+1]) / dx**2 at the interior points; 0 at the two end points."""
    lap = np.zeros_like(u, dtype=float)
    lap[1:-1] = (u[:-2] - 2 * u[1:-1] + u[2:]) / dx**2
    return lap
''',
            lambda rng: [Case(f"laplacian_1d({_vec(rng, n)}, {_r(rng, 0.05, 0.5)})") for n in (5, 8)],
        ),
        Step(
            "One explicit time step.",
            '''
def ftcs_step(u, alpha, dt, dx):
    """u + dt * alpha * laplacian_1d(u, dx), with the two end values then set to 0."""
    u_next = u + dt * alpha * laplacian_1d(u, dx)
    u_next[0] = 0.0
    u_next[-1] = 0.0
    return u_next
''',
            lambda rng: [Case(f"ftcs_step({_vec(rng, 7)}, {_r(rng, 0.5, 2)}, 0.001, 0.1)") for _ in range(2)],
        ),
        Step(
            "March the heat equation in time.",
            '''
def solve_heat(u0, alpha, dx, dt, n_steps):
    """u after n_steps ftcs_step steps from u0. Raises ValueError when alpha*dt/dx**2 > 0.5 (unstable)."""
    if alpha * dt / dx**2 > 0.5:
        raise ValueError("unstable: alpha*dt/dx**2 > 0.5")
    u = np.array(u0, dtype=float)
    for _ in range(n_steps):
        u = ftcs_step(u, alpha, dt, dx)
    return u
''',
            lambda rng: (
                [
                    Case(
                        f"solve_heat(np.sin({k}*np.pi*x) + {_r(rng, 0, 0.5)}*np.sin(3*np.pi*x), {alpha}, 0.02, "
                        f"{round(0.4 * 0.02**2 / alpha, 7)}, {n})",
                        setup="x = np.linspace(0, 1, 51)",
                    )
                    for k, alpha, n in ((1, 1.0, 300), (2, 0.5, 500))
                ]
                + [
                    Case(
                        "int(np.isclose(np.max(solve_heat(np.sin(np.pi*x), 1.0, 0.02, 0.0001, 1000)), "
                        "np.exp(-np.pi**2*0.1), rtol=2e-3))",
                        setup="x = np.linspace(0, 1, 51)",
                    ),
                    Case(
                        "unstable()",
                        setup=(
                            "def unstable():\n"
                            "    try:\n"
                            "        solve_heat(np.ones(11), 1.0, 0.1, 0.01, 3)\n"
                            "    except ValueError:\n"
                            "        return 1\n"
                            "    return 0"
                        ),
                    ),
                ]
            ),
        ),
    ),
)

# -- 8. Numerical quadrature ------------------------------------------------------------------------

QUADRATURE = Problem(
    problem_id="numerical_quadrature",
    name="Composite trapezoid and Simpson rules, Gauss-Legendre quadrature",
    domain="numerical analysis",
    description="Three ways to integrate a smooth function f over [a, b], from crude to exact for polynomials.",
    steps=(
        Step(
            "The composite trapezoid rule.",
            '''
def trapezoid(f, a, b, n):
    """Composite trapezoid rule with n equal sub-intervals: h*(f(x0)/2 + f(x1) + ... + f(x_{n-1}) + f(xn)/2)."""
    x = np.linspace(a, b, n + 1)
    y = f(x)
    h = (b - a) / n
    integral = h * (y[0] / 2 + y[1:-1].sum() + y[-1] / 2)
    return integral
''',
            lambda rng: [
                Case(f"trapezoid({fn}, {_r(rng, 0, 1)}, {_r(rng, 2, 3)}, {n})")
                for fn, n in (("np.exp", 10), ("np.sin", 7), ("lambda x: x**3 - x", 4))
            ],
        ),
        Step(
            "The composite Simpson rule.",
            '''
def simpson(f, a, b, n):
    """Composite Simpson rule with n (even) sub-intervals: h/3*(f0 + 4 f1 + 2 f2 + 4 f3 + ... + 4 f_{n-1} + fn).

    Raises ValueError when n is odd.
    """
    if n % 2:
        raise ValueError("n must be even")
    x = np.linspace(a, b, n + 1)
    y = f(x)
    h = (b - a) / n
    integral = h / 3 * (y[0] + 4 * y[1:-1:2].sum() + 2 * y[2:-1:2].sum() + y[-1])
    return integral
''',
            lambda rng: [
                Case(f"simpson({fn}, {_r(rng, 0, 1)}, {_r(rng, 2, 3)}, {n})")
                for fn, n in (("np.exp", 10), ("np.sin", 6), ("lambda x: 1 / (1 + x**2)", 4))
            ],
        ),
        Step(
            "Gauss-Legendre quadrature on [a, b].",
            '''
def gauss_legendre(f, a, b, n):
    """n-point Gauss-Legendre quadrature: the nodes and weights of np.polynomial.legendre.leggauss(n)
    on [-1, 1], mapped to [a, b] (x = (b - a)/2 * t + (a + b)/2, weights times (b - a)/2)."""
    t, w = np.polynomial.legendre.leggauss(n)
    x = (b - a) / 2 * t + (a + b) / 2
    integral = (b - a) / 2 * np.sum(w * f(x))
    return integral
''',
            lambda rng: (
                [
                    Case(f"gauss_legendre({fn}, {_r(rng, 0, 1)}, {_r(rng, 2, 3)}, {n})")
                    for fn, n in (("np.exp", 3), ("lambda x: x**5 - 2*x", 3), ("np.cos", 5))
                ]
                + [
                    Case(  # Gauss with 4 points beats Simpson with 4 sub-intervals on a smooth integrand
                        "int(abs(gauss_legendre(np.exp, 0, 2, 4) - (np.exp(2) - 1)) "
                        "< abs(simpson(np.exp, 0, 2, 4) - (np.exp(2) - 1)) "
                        "< abs(trapezoid(np.exp, 0, 2, 4) - (np.exp(2) - 1)))"
                    )
                ]
            ),
        ),
    ),
)

# -- 9. Polynomial least squares ---------------------------------------------------------------------

POLYFIT = Problem(
    problem_id="polynomial_least_squares",
    name="Polynomial fit by the normal equations and its goodness of fit",
    domain="statistics",
    description=(
        "Fit a polynomial of a given degree to noisy data (x_i, y_i) by least squares and report how "
        "well it fits."
    ),
    steps=(
        Step(
            "The Vandermonde design matrix.",
            '''
def design_matrix(x, degree):
    """The matrix with columns x**0, x**1, ..., x**degree (shape (len(x), degree + 1))."""
    X = np.vander(np.asarray(x, dtype=float), degree + 1, increasing=True)
    return X
''',
            lambda rng: [Case(f"design_matrix({_vec(rng, 5, -2, 2)}, {d})") for d in (1, 3)],
        ),
        Step(
            "Coefficients from the normal equations.",
            '''
def polyfit_normal(x, y, degree):
    """Least-squares coefficients c (c[k] multiplies x**k) solving (X.T X) c = X.T y, X = design_matrix(x, degree)."""
    X = design_matrix(x, degree)
    coefficients = np.linalg.solve(X.T @ X, X.T @ y)
    return coefficients
''',
            lambda rng: [
                Case(
                    f"polyfit_normal(x, {c0} + {c1}*x + {c2}*x**2 + noise, {d})",
                    setup=(
                        "x = np.linspace(-1, 2, 30)\n"
                        f"noise = 0.1 * np.random.default_rng({rng.randrange(10**6)}).standard_normal(30)"
                    ),
                )
                for c0, c1, c2, d in ((_r(rng, -2, 2), _r(rng, -2, 2), _r(rng, -1, 1), d) for d in (1, 2, 3))
            ],
        ),
        Step(
            "The coefficient of determination.",
            '''
def r_squared(x, y, coefficients):
    """1 - SS_res/SS_tot of the polynomial with these coefficients (c[k] multiplies x**k) on (x, y)."""
    fitted = design_matrix(x, len(coefficients) - 1) @ coefficients
    ss_res = np.sum((y - fitted) ** 2)
    ss_tot = np.sum((y - np.mean(y)) ** 2)
    r2 = 1 - ss_res / ss_tot
    return r2
''',
            lambda rng: (
                [
                    Case(
                        f"r_squared(x, y, polyfit_normal(x, y, {d}))",
                        setup=(
                            "x = np.linspace(0, 3, 40)\n"
                            f"y = {_r(rng, 0.5, 2)} * np.exp(0.5 * x) + 0.2 * "
                            f"np.random.default_rng({rng.randrange(10**6)}).standard_normal(40)"
                        ),
                    )
                    for d in (1, 2)
                ]
                + [
                    Case(
                        f"r_squared({_vec(rng, 6)}, {_vec(rng, 6)}, np.array([{_r(rng, -1, 1)}, {_r(rng, -1, 1)}]))"
                    )
                ]
            ),
        ),
    ),
)

# -- 10. Random walks and diffusion ------------------------------------------------------------------

RANDOM_WALK = Problem(
    problem_id="random_walk_diffusion",
    name="Random walks on a line and the diffusion coefficient",
    domain="statistical physics",
    description=(
        "Many independent walkers start at 0 and step +1 or -1 with equal probability each time unit. "
        "Their mean squared displacement grows linearly, MSD(t) = 2 D t; estimate D."
    ),
    steps=(
        Step(
            "Seeded walks.",
            '''
def random_walks(n_walkers, n_steps, seed):
    """Positions of n_walkers walkers over n_steps steps, shape (n_walkers, n_steps + 1), column 0 all 0.

    Steps: 2 * np.random.default_rng(seed).integers(0, 2, size=(n_walkers, n_steps)) - 1; the positions
    are their cumulative sums along each walk.
    """
    steps = 2 * np.random.default_rng(seed).integers(0, 2, size=(n_walkers, n_steps)) - 1
    positions = np.zeros((n_walkers, n_steps + 1), dtype=int)
    positions[:, 1:] = np.cumsum(steps, axis=1)
    return positions
''',
            lambda rng: [
                Case(f"random_walks({w}, {s}, {rng.randrange(10**6)})") for w, s in ((3, 6), (2, 10))
            ],
        ),
        Step(
            "Mean squared displacement.",
            '''
def mean_squared_displacement(positions):
    """The mean over walkers of (position - starting position)**2 at each time (length n_steps + 1)."""
    displacement = positions - positions[:, :1]
    msd = np.mean(displacement.astype(float) ** 2, axis=0)
    return msd
''',
            lambda rng: [
                Case(
                    f"mean_squared_displacement(np.array([{_vec(rng, 5, -3, 3)[9:-1]}, {_vec(rng, 5, -3, 3)[9:-1]}]))"
                ),
                Case(f"mean_squared_displacement(random_walks(500, 50, {rng.randrange(10**6)}))"),
            ],
        ),
        Step(
            "The diffusion coefficient from a fit through the origin.",
            '''
def diffusion_coefficient(n_walkers, n_steps, seed):
    """D from MSD(t) = 2 D t: with msd = mean_squared_displacement(random_walks(n_walkers, n_steps, seed))
    and t = 0, 1, ..., n_steps, the least-squares slope through the origin s = sum(t*msd)/sum(t*t); D = s/2."""
    msd = mean_squared_displacement(random_walks(n_walkers, n_steps, seed))
    t = np.arange(n_steps + 1)
    D = np.sum(t * msd) / np.sum(t * t) / 2
    return D
''',
            lambda rng: [
                Case(f"diffusion_coefficient({w}, 100, {rng.randrange(10**6)})") for w in (200, 2000)
            ],
        ),
    ),
)

# -- 11. An epidemic with scipy's ODE solver ---------------------------------------------------------

SIR = Problem(
    problem_id="sir_epidemic",
    name="The SIR epidemic model solved with scipy",
    domain="epidemiology",
    dependencies="import numpy as np\nfrom scipy.integrate import solve_ivp",
    description=(
        "Susceptible, infected and recovered fractions (S, I, R) of a population: dS/dt = -beta*S*I, "
        "dI/dt = beta*S*I - gamma*I, dR/dt = gamma*I. Solve the system with scipy and find the epidemic's peak."
    ),
    steps=(
        Step(
            "The right-hand side.",
            '''
def sir_rhs(t, y, beta, gamma):
    """np.array([-beta*S*I, beta*S*I - gamma*I, gamma*I]) for y = [S, I, R]."""
    S, I, R = y
    derivative = np.array([-beta * S * I, beta * S * I - gamma * I, gamma * I])
    return derivative
''',
            lambda rng: [
                Case(f"sir_rhs(0.0, {_vec(rng, 3, 0, 1)}, {_r(rng, 0.2, 1)}, {_r(rng, 0.05, 0.3)})")
                for _ in range(2)
            ],
        ),
        Step(
            "Solve the system on a time grid.",
            '''
def simulate_sir(y0, beta, gamma, t_eval):
    """[S, I, R] at the times t_eval (shape (3, len(t_eval))) from y0 at t_eval[0], by
    solve_ivp(..., method="RK45", rtol=1e-10, atol=1e-12) on sir_rhs."""
    solution = solve_ivp(
        sir_rhs, (t_eval[0], t_eval[-1]), y0, method="RK45", t_eval=t_eval,
        args=(beta, gamma), rtol=1e-10, atol=1e-12,
    )
    states = solution.y
    return states
''',
            lambda rng: [
                Case(
                    f"simulate_sir(np.array([{1 - i0}, {i0}, 0.0]), {_r(rng, 0.3, 0.8)}, {_r(rng, 0.05, 0.2)}, "
                    "np.linspace(0, 100, 11))",
                    rtol=1e-5,
                    atol=1e-8,
                )
                for i0 in (0.01, 0.001)
            ],
        ),
        Step(
            "When and how high the epidemic peaks.",
            '''
def epidemic_peak(i0, beta, gamma, t_max):
    """(t_peak, I_peak) over the grid np.linspace(0, t_max, 2001) from simulate_sir with
    y0 = [1 - i0, i0, 0]: the grid time where I is largest, and that I. Returns np.array([t_peak, I_peak])."""
    t = np.linspace(0, t_max, 2001)
    infected = simulate_sir(np.array([1 - i0, i0, 0.0]), beta, gamma, t)[1]
    k = int(np.argmax(infected))
    peak = np.array([t[k], infected[k]])
    return peak
''',
            lambda rng: [
                Case(f"epidemic_peak({i0}, {_r(rng, 0.4, 0.8)}, {_r(rng, 0.05, 0.15)}, 200.0)", rtol=1e-5)
                for i0 in (0.01, 0.001)
            ],
        ),
    ),
)

# -- 12. Molecular dynamics with the Lennard-Jones potential -----------------------------------------

LENNARD_JONES = Problem(
    problem_id="lennard_jones_md",
    name="A few Lennard-Jones atoms moved by velocity Verlet",
    domain="molecular dynamics",
    description=(
        "Atoms of equal mass interact pairwise through the Lennard-Jones potential "
        "V(r) = 4*eps*((sigma/r)**12 - (sigma/r)**6) (no cut-off, no periodic box). Compute forces and "
        "energies and integrate the motion with velocity Verlet; the total energy should stay nearly constant."
    ),
    steps=(
        Step(
            "The pair potential.",
            '''
def lj_potential(r, eps, sigma):
    """4*eps*((sigma/r)**12 - (sigma/r)**6), elementwise for an array of distances r."""
    sr6 = (sigma / r) ** 6
    energy = 4 * eps * (sr6**2 - sr6)
    return energy
''',
            lambda rng: [
                Case(f"lj_potential({_vec(rng, 4, 0.9, 2.5)}, {_r(rng, 0.5, 2)}, {_r(rng, 0.8, 1.2)})")
            ],
        ),
        Step(
            "Forces on every atom.",
            '''
def lj_forces(positions, eps, sigma):
    """The force on each atom (shape (N, 3)) from all the others, F_i = -grad_i of the sum of
    lj_potential over pairs. For a pair at distance r along r_ij = x_i - x_j, atom i feels
    24*eps*(2*(sigma/r)**12 - (sigma/r)**6) / r**2 * r_ij and atom j the opposite."""
    n = len(positions)
    forces = np.zeros_like(positions, dtype=float)
    for i in range(n):
        for j in range(i + 1, n):
            rij = positions[i] - positions[j]
            r2 = rij @ rij
            sr6 = (sigma**2 / r2) ** 3
            f = 24 * eps * (2 * sr6**2 - sr6) / r2 * rij
            forces[i] += f
            forces[j] -= f
    return forces
''',
            lambda rng: [
                Case(
                    f"lj_forces(cube + 0.1 * {_matrix(rng, 3)}[[0, 1, 2, 0]], {_r(rng, 0.5, 2)}, 1.0)",
                    setup="cube = 1.2 * np.array([[0., 0., 0.], [1., 0., 0.], [0., 1., 0.], [0., 0., 1.]])",
                )
                for _ in range(2)
            ],
        ),
        Step(
            "Velocity Verlet integration.",
            '''
def velocity_verlet(positions, velocities, mass, eps, sigma, dt, n_steps):
    """Positions and velocities after n_steps velocity-Verlet steps under lj_forces.

    Each step: v += F/(2m)*dt; x += v*dt; F = lj_forces(x); v += F/(2m)*dt.
    Returns np.concatenate([x, v]) (shape (2N, 3)).
    """
    x = np.array(positions, dtype=float)
    v = np.array(velocities, dtype=float)
    F = lj_forces(x, eps, sigma)
    for _ in range(n_steps):
        v = v + F / (2 * mass) * dt
        x = x + v * dt
        F = lj_forces(x, eps, sigma)
        v = v + F / (2 * mass) * dt
    state = np.concatenate([x, v])
    return state
''',
            lambda rng: [
                Case(
                    f"velocity_verlet(cube, 0.2 * {_matrix(rng, 3)}[[0, 1, 2, 0]], 1.0, 1.0, 1.0, 0.002, 200)",
                    setup="cube = 1.2 * np.array([[0., 0., 0.], [1., 0., 0.], [0., 1., 0.], [0., 0., 1.]])",
                    rtol=1e-5,
                    atol=1e-8,
                )
            ],
        ),
        Step(
            "The total energy.",
            '''
def total_energy(positions, velocities, mass, eps, sigma):
    """Kinetic plus potential energy: sum(m*|v|**2/2) + sum over pairs i < j of lj_potential(|x_i - x_j|)."""
    kinetic = 0.5 * mass * np.sum(velocities**2)
    diff = positions[:, None, :] - positions[None, :, :]
    r = np.sqrt(np.sum(diff**2, axis=-1))
    i, j = np.triu_indices(len(positions), k=1)
    energy = kinetic + np.sum(lj_potential(r[i, j], eps, sigma))
    return energy
''',
            lambda rng: [
                Case(
                    f"total_energy(cube, 0.2 * {_matrix(rng, 3)}[[0, 1, 2, 0]], 1.0, 1.0, 1.0)",
                    setup="cube = 1.2 * np.array([[0., 0., 0.], [1., 0., 0.], [0., 1., 0.], [0., 0., 1.]])",
                ),
                Case(  # velocity Verlet conserves the energy to 1e-3 relative over 200 steps
                    "int(abs(total_energy(s[:4], s[4:], 1.0, 1.0, 1.0) - total_energy(cube, v0, 1.0, 1.0, 1.0))"
                    " < 1e-3 * abs(total_energy(cube, v0, 1.0, 1.0, 1.0)))",
                    setup=(
                        "cube = 1.2 * np.array([[0., 0., 0.], [1., 0., 0.], [0., 1., 0.], [0., 0., 1.]])\n"
                        f"v0 = 0.2 * {_matrix(rng, 3)}[[0, 1, 2, 0]]\n"
                        "s = velocity_verlet(cube, v0, 1.0, 1.0, 1.0, 0.002, 200)"
                    ),
                ),
            ],
        ),
    ),
)

PROBLEMS: tuple[Problem, ...] = (
    LOTKA_VOLTERRA,
    MONTE_CARLO,
    POWER_ITERATION,
    QR_LEAST_SQUARES,
    FIR_FILTER,
    KEPLER,
    HEAT,
    QUADRATURE,
    POLYFIT,
    RANDOM_WALK,
    SIR,
    LENNARD_JONES,
)
BY_ID = {p.problem_id: p for p in PROBLEMS}
