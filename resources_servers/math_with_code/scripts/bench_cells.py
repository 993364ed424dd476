"""Per-call cost of a 10-cell math_with_code rollout: wall ms of each execute_python call (cell k of 10),
median over rollouts, for plain cells and for cells whose first imports sympy (what a replay pays again at
every call). Starts the servers of the tree it is run from (cwd and PYTHONPATH = that tree) and prints
one ``RESULT {json}`` line. ``python resources_servers/math_with_code/scripts/bench_cells.py [rollouts]``"""

import json
import statistics
import sys
import time

from nemo_gym.server.asgi.sessions import cookie_name_for
from nemo_gym.tools.testing import post_json, running_servers, server_url

ENV = "math_with_code"
PLAIN = [
    "n = 250\nmultiples = [i for i in range(1, n + 1) if i % 7 == 0]",
    "total = sum(multiples)\ntotal",
    "from math import comb\nc = comb(15, 4)\nc",
    "def f(k):\n    return pow(3, k, 17)\nf(100)",
    "values = [f(k) for k in range(50)]\nlen(set(values))",
    "sq = [k * k for k in range(1000)]\nsum(sq)",
    "primes = [p for p in range(2, 2000) if all(p % d for d in range(2, int(p ** 0.5) + 1))]\nlen(primes)",
    "print(total + c)",
    "ratio = total / c\nround(ratio, 4)",
    "print(f'answer: {total}')",
]
SYMPY = [
    "import sympy\nx = sympy.symbols('x')\nroots = sympy.solve(x**2 - 13*x + 40, x)\n" + PLAIN[0],
    *PLAIN[1:],
]
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
out = {}
with running_servers([f"resources_servers/{ENV}/configs/{ENV}.yaml"], {}) as h:
    url = server_url(h, ENV)
    cookie = cookie_name_for(ENV)
    post_json(url + "/execute_python", {"code": "1"})  # warm-up
    for name, cells in (("plain", PLAIN), ("sympy", SYMPY)):
        per_cell = [[] for _ in cells]
        close = []
        for _ in range(rounds):
            jar = None
            for k, code in enumerate(cells):
                t = time.perf_counter()
                r = post_json(url + "/execute_python", {"code": code}, cookies=jar, timeout=120)
                per_cell[k].append((time.perf_counter() - t) * 1000)
                assert r.status_code == 200 and r.json()["success"], r.text
                jar = jar or {cookie: r.cookies[cookie]}
            t = time.perf_counter()
            post_json(url + "/end_session", {}, cookies=jar)
            close.append((time.perf_counter() - t) * 1000)
        out[name] = {
            "cells_ms": [statistics.median(v) for v in per_cell],
            "close_ms": statistics.median(close),
        }
print("RESULT " + json.dumps(out))
