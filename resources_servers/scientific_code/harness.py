"""The program that runs inside the sandbox: it executes a rollout's step code and reports each test's value.

It is shipped into the sandbox as a file (``HARNESS``) and never imported by a server. It reads a nonce
from stdin and ``steps.json`` from its work dir: the dependencies and, per step, the model's code (or
null) and the test cases' ``setup`` and ``call`` (never their targets: the values are compared outside,
by the resources server, so code running here cannot see or forge what it is compared with). Then, in
one namespace: the dependencies; for each step, the step's code, then each test case in a shallow copy
of the namespace. Every result is one line ``<nonce> <json>`` on stdout, flushed as it is made, so the
steps that finished are known even when a later one never ends. The model's own prints go to
/dev/null. Each exec and each test is bounded by SIGALRM (``step_timeout_s``); the sandbox bounds the
whole run.

Lines: ``{"ready": true}`` once the dependencies are imported (before it, a failure is the sandbox's,
not the model's), ``{"step": k, "code": "ok" | "missing" | "syntax_error" | "runtime_error" |
"timeout" | "missing_function", "detail"}`` per step, and ``{"step": k, "test": i, "value": ..., }`` or
``{"step": k, "test": i, "error": "runtime_error" | "timeout" | "not_numeric" | "too_large", "detail"}``
per test.
"""

HARNESS = r"""
import json, math, os, signal, sys, traceback

NONCE = sys.stdin.readline().strip()
OUT = sys.stdout
MAX_ELEMENTS = 200000


def emit(record):
    OUT.write(NONCE + " " + json.dumps(record, allow_nan=True) + "\n")
    OUT.flush()


class StepTimeout(BaseException):
    pass


def on_alarm(signum, frame):
    raise StepTimeout()


def bounded(seconds, fn):
    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def last_error(exc):
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return text[-500:]


def encode(value):
    import numpy as np

    if value is None or isinstance(value, (str, bytes)):
        return None, "not_numeric: " + type(value).__name__
    try:
        array = np.asarray(value, dtype=float)
    except Exception as exc:
        return None, "not_numeric: " + type(value).__name__ + " (" + last_error(exc)[:200] + ")"
    if array.size > MAX_ELEMENTS:
        return None, "too_large: " + str(array.size) + " elements"
    return array.tolist(), None


config = json.load(open("steps.json"))
timeout = float(config["step_timeout_s"])
namespace = {"__name__": "solution"}  # a model's `if __name__ == "__main__":` demo does not run
exec(compile(config["dependencies"], "<dependencies>", "exec"), namespace)
emit({"ready": True})
sys.stdout = open(os.devnull, "w")
for k, step in enumerate(config["steps"]):
    code = step["code"]
    status, detail = "ok", ""
    if code is None:
        status = "missing"
    else:
        try:
            compiled = compile(code, "<step " + str(k + 1) + ">", "exec")
        except (SyntaxError, ValueError) as exc:
            status, detail = "syntax_error", last_error(exc)
        else:
            try:
                bounded(timeout, lambda: exec(compiled, namespace))
            except StepTimeout:
                status, detail = "timeout", "defining the step did not finish in " + str(timeout) + " s"
            except BaseException as exc:
                status, detail = "runtime_error", last_error(exc)
    if status == "ok" and not callable(namespace.get(step["function"])):
        status, detail = "missing_function", "the code does not define " + step["function"] + "()"
    emit({"step": k, "code": status, "detail": detail})
    if status != "ok":
        continue
    timed_out = False
    for i, case in enumerate(step["tests"]):
        if timed_out:  # one test past the bound: the step has failed; its other tests are not run
            emit({"step": k, "test": i, "error": "timeout", "detail": "not run: an earlier test of this step timed out"})
            continue
        scope = dict(namespace)

        def run(case=case, scope=scope):
            if case["setup"]:
                exec(compile(case["setup"], "<setup>", "exec"), scope)
            return eval(compile(case["call"], "<test>", "eval"), scope)

        try:
            value = bounded(timeout, run)
        except StepTimeout:
            emit({"step": k, "test": i, "error": "timeout", "detail": "the call did not finish in " + str(timeout) + " s"})
            timed_out = True
            continue
        except BaseException as exc:
            emit({"step": k, "test": i, "error": "runtime_error", "detail": last_error(exc)})
            continue
        encoded, problem = encode(value)
        if problem is not None:
            kind, _, why = problem.partition(": ")
            emit({"step": k, "test": i, "error": kind, "detail": why})
        else:
            emit({"step": k, "test": i, "value": encoded})
emit({"done": True})
"""
