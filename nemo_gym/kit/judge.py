"""LLM-as-judge calls through any configured model server, with upstream NeMo Gym's names.

Contract
--------
* ``await call_judge(server_client, server_name=..., url_path="/v1/responses", json=...,
  response_model=NeMoGymResponse)`` POSTs ``json`` to model server instance ``server_name`` through
  the :class:`~nemo_gym.client.server_client.ServerClient` and returns the reply validated as
  ``response_model``. Retries are bounded: an answer with a status in :data:`JUDGE_RETRY_STATUSES`
  (rate limits, 5xx) or no answer in time is tried again, at most ``max_tries`` times in all, with
  exponential backoff. (Upstream retries rate limits without bound; here every wait has a bound.)
* Anything else that goes wrong with the call (the server cannot be reached, a non-retryable error
  status, a body that is not JSON or not a ``response_model``, any exception the client's ``post``
  raises) raises :class:`JudgeError` chained to the cause, naming the server, the path, the status and
  the error. A judge *reply* that arrives but does not contain a
  verdict is the caller's business (typically a wrong answer), not a JudgeError.
* A judge failure is never a reward. :class:`JudgeError` is an
  :class:`~nemo_gym.errors.UpstreamError` (kind ``judge_failed``), so a ``/verify`` that lets it
  propagate answers 502 naming the judge, and the collector records the rollout in the failures file
  (retried with ``+resume_from_cache=true``). :func:`judge_failsafe` keeps upstream's decorator name but
  lets the error through: upstream returns reward 0.0 there, which would train on an outage.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError

from nemo_gym.errors import UpstreamError

JUDGE_FAILED_KIND = "judge_failed"
# Upstream's retry set: rate limits and transient gateway errors (429, 502, 503, 504, 520) plus 500.
JUDGE_RETRY_STATUSES: frozenset[int] = frozenset({429, 500, 502, 503, 504, 520})
DEFAULT_JUDGE_MAX_TRIES = 3
DEFAULT_JUDGE_BACKOFF_S = 0.5
MAX_JUDGE_BACKOFF_S = 8.0

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


class JudgeError(UpstreamError):
    """A judge call failed (transport, timeout, error status, unusable body) - not a wrong answer.

    ``JudgeError("message")`` works as upstream's; the keyword arguments say which call failed.
    """

    def __init__(
        self,
        message: str,
        *,
        server: str | None = None,
        path: str | None = None,
        status: int | None = None,
        detail: Any = None,
        response_content: bytes | None = None,
    ) -> None:
        super().__init__(server or "judge", path or "", status, detail if detail is not None else message)
        self.response_content = response_content  # the judge's raw answer body, when one came
        self.kind = JUDGE_FAILED_KIND
        self.message = message
        self.args = (message,)

    def __str__(self) -> str:
        return self.message

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "kind": JUDGE_FAILED_KIND, "message": self.message}


async def reraise_judge_errors(coro: Awaitable[T]) -> T:
    """Await ``coro``; any exception becomes a :class:`JudgeError` (chained), a JudgeError stays as is.

    Wrap only the judge call in it, not the scoring code (a bug in scoring is not a judge failure).
    """
    try:
        return await coro
    except JudgeError:
        raise
    except UpstreamError as e:
        raise JudgeError(
            f"{type(e).__name__}: {e}", server=e.server, path=e.path, status=e.status, detail=e.detail
        ) from e
    except Exception as e:
        raise JudgeError(f"{type(e).__name__}: {e}") from e


async def _read_body(resp: Any) -> bytes:
    body = resp.read()
    if inspect.isawaitable(body):
        body = await body
    return body if isinstance(body, bytes) else str(body).encode()


def _status_ok(resp: Any) -> tuple[int | None, bool]:
    status = getattr(resp, "status", None)
    if isinstance(status, int):
        return status, status < 400
    return None, bool(getattr(resp, "ok", True))


def _excerpt(body: bytes, limit: int = 500) -> str:
    text = body.decode(errors="replace")
    return text if len(text) <= limit else text[:limit] + "..."


async def call_judge(
    server_client: Any,
    *,
    server_name: str,
    url_path: str,
    json: Any,
    response_model: type[M],
    max_tries: int = DEFAULT_JUDGE_MAX_TRIES,
    backoff_s: float = DEFAULT_JUDGE_BACKOFF_S,
) -> M:
    """POST ``json`` to ``server_name``'s ``url_path`` and return the reply as ``response_model``.

    See the module docstring for retries; raises :class:`JudgeError` when no usable reply comes.
    """
    if max_tries < 1:
        raise ValueError(f"max_tries must be >= 1, got {max_tries!r}")
    where = f"judge {server_name!r} {url_path}"
    last: JudgeError | None = None
    for attempt in range(max_tries):
        if attempt:
            await asyncio.sleep(min(backoff_s * 2 ** (attempt - 1), MAX_JUDGE_BACKOFF_S))
        try:
            resp = await server_client.post(server_name=server_name, url_path=url_path, json=json)
        except UpstreamError as e:
            last = JudgeError(
                f"{where}: {e.kind} ({e})",
                server=server_name,
                path=url_path,
                status=e.status,
                detail=e.detail,
            )
            if e.kind in ("timeout", "connection_error") and attempt + 1 < max_tries:
                continue
            raise last from e
        except Exception as e:  # no such server instance, a client that raised: not transient
            raise JudgeError(f"{where}: {type(e).__name__}: {e}", server=server_name, path=url_path) from e
        status, ok = _status_ok(resp)
        body = await _read_body(resp)
        if not ok:
            last = JudgeError(
                f"{where} answered HTTP {status}: {_excerpt(body)}",
                server=server_name,
                path=url_path,
                status=status,
                detail=_excerpt(body, 2000),
                response_content=body,
            )
            if status in JUDGE_RETRY_STATUSES and attempt + 1 < max_tries:
                continue
            if status in JUDGE_RETRY_STATUSES:
                raise JudgeError(
                    f"{where} still failing after {max_tries} tries; last answer HTTP {status}: {_excerpt(body)}",
                    server=server_name,
                    path=url_path,
                    status=status,
                    detail=_excerpt(body, 2000),
                    response_content=body,
                )
            raise last
        try:
            return response_model.model_validate(orjson.loads(body))
        except orjson.JSONDecodeError as e:
            raise JudgeError(
                f"{where} answered HTTP {status} with a body that is not JSON ({e}): {_excerpt(body)}",
                server=server_name,
                path=url_path,
                status=status,
            ) from None
        except ValidationError as e:
            raise JudgeError(
                f"{where} answered with a body that is not a {response_model.__name__}: "
                f"{e.error_count()} error(s), first: {e.errors()[0]['loc']}: {e.errors()[0]['msg']}",
                server=server_name,
                path=url_path,
                status=status,
            ) from None
    assert last is not None  # the loop either returned or raised
    raise last


def judge_failsafe(verify_fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Upstream's decorator for a ``verify`` that calls a judge, with the failure kept a failure.

    Upstream turns a :class:`JudgeError` into reward 0.0 (flagged for its collector). Here it
    propagates: the server answers 502 naming the judge, and the rollout goes to the failures file
    instead of being scored. Other exceptions are untouched. The signature is kept (FastAPI injects
    the same parameters).
    """

    @functools.wraps(verify_fn)
    async def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return await verify_fn(*args, **kwargs)
        except JudgeError as e:
            if not e.server or e.server == "judge":
                e.server = f"judge (in {getattr(verify_fn, '__qualname__', 'verify')})"
            raise

    return wrapper
