"""The simulated company of workplace_assistant: its data, its 27 tools, and the final-state comparison.

Contract
--------
* :func:`new_world` returns a fresh, private copy of the company in ``world_data/company.json``
  (tables ``emails``, ``calendar_events``, ``analytics``, ``plots``, ``project_tasks``, ``customers``;
  every record a ``dict[str, str]``). Nothing is shared between copies, so a session that mutates its
  copy can never be seen by another.
* ``TOOLS`` maps each tool name (NVIDIA NeMo Gym's names, e.g. ``email_send_email``) to a
  :class:`ToolSpec`: its description, its parameters (all strings except ``page``/``page_size``) and
  its implementation ``fn(world, **args)``. :func:`tool_schema` renders a spec as a Responses API
  function tool.
* A tool that cannot do what it is asked (unknown id, invalid field, bad date) raises
  :class:`ToolError`; the server shows the message to the model as the tool's output.
* :func:`apply_calls` runs ``[{"name", "arguments"}]`` on a world (used for a row's ``ground_truth``
  and to replay a stored response's calls).
* :func:`state_differences` compares two worlds: records that existed from the start are compared by
  id, records created during the episode as a multiset of their contents *without* their generated
  id (so two creations in either order compare equal), strings case-insensitively except ``status``,
  ``list_name`` and ``board`` (as upstream). It returns human-readable differences; none means equal.
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from pathlib import Path
from typing import Any

WORLD_FILE = Path(__file__).parent / "world_data" / "company.json"
_BASE: dict[str, Any] = json.loads(WORLD_FILE.read_text())
NOW = datetime.strptime(_BASE["now"], "%Y-%m-%d %H:%M:%S")
DIRECTORY: tuple[str, ...] = tuple(_BASE["directory"])

# table name -> id field (None: the table has no ids; compared as a multiset)
TABLES: dict[str, str | None] = {
    "emails": "email_id",
    "calendar_events": "event_id",
    "analytics": None,
    "plots": None,
    "project_tasks": "task_id",
    "customers": "customer_id",
}
CASE_SENSITIVE_FIELDS = frozenset({"status", "list_name", "board"})
EMAIL_FIELDS = ("email_id", "inbox/outbox", "sender/recipient", "subject", "sent_datetime", "body")
EVENT_FIELDS = ("event_id", "event_name", "participant_email", "event_start", "duration")
TASK_FIELDS = ("task_id", "task_name", "assigned_to_email", "list_name", "due_date", "board")
CUSTOMER_FIELDS = (
    "customer_id",
    "assigned_to_email",
    "customer_name",
    "customer_email",
    "customer_phone",
    "last_contact_date",
    "product_interest",
    "status",
    "notes",
    "follow_up_by",
)
LISTS = ("Backlog", "In Progress", "In Review", "Completed")
BOARDS = ("Back end", "Front end", "Design")
STATUSES = ("Qualified", "Won", "Lost", "Lead", "Proposal")
PRODUCTS = ("Software", "Hardware", "Services", "Consulting", "Training")
TRAFFIC_SOURCES = ("direct", "referral", "search engine", "social media")
PLOT_VALUES = (
    "total_visits",
    "session_duration_seconds",
    "user_engaged",
    "visits_direct",
    "visits_referral",
    "visits_search_engine",
    "visits_social_media",
)
PLOT_TYPES = ("bar", "line", "scatter", "histogram")

World = dict[str, list[dict[str, str]]]


class ToolError(Exception):
    """The tool could not do what it was asked; the message is shown to the model."""


def new_world() -> World:
    """A private copy of the company's starting state."""
    world: World = {name: [dict(r) for r in _BASE.get(name, [])] for name in TABLES}
    return world


# ------------------------------------------------------------------------------------------------
# Helpers


def _find(world: World, table: str, record_id: str) -> dict[str, str]:
    key = TABLES[table]
    for record in world[table]:
        if record[key] == record_id:
            return record
    raise ToolError(f"No record in {table.replace('_', ' ')} has {key} {record_id!r}.")


def _next_id(world: World, table: str) -> str:
    key = TABLES[table]
    return f"{max((int(r[key]) for r in world[table]), default=0) + 1:08d}"


def _date(value: str, what: str) -> date:
    try:
        return date.fromisoformat(value.strip()[:10])
    except ValueError:
        raise ToolError(f"{what} must be a date as YYYY-MM-DD, got {value!r}.") from None


def _datetime(value: str, what: str) -> datetime:
    try:
        return datetime.strptime(value.strip(), "%Y-%m-%d %H:%M:%S")
    except ValueError:
        raise ToolError(f"{what} must be a time as YYYY-MM-DD HH:MM:SS, got {value!r}.") from None


def _email_address(value: str) -> str:
    value = value.strip().lower()
    if "@" not in value or "." not in value.rpartition("@")[2]:
        raise ToolError(f"{value!r} is not a valid email address.")
    return value


def _page(items: list[dict[str, str]], page: int, page_size: int, key: str) -> dict[str, Any]:
    if page_size < 1:
        raise ToolError("page_size must be at least 1.")
    total = len(items)
    pages = max(1, -(-total // page_size))
    page = min(max(page, 1), pages)
    start = (page - 1) * page_size
    return {
        key: items[start : start + page_size],
        "pagination": {"total": total, "page": page, "page_size": page_size, "total_pages": pages},
    }


def _field_of(record: dict[str, str], field: str, allowed: tuple[str, ...]) -> dict[str, str]:
    if field not in allowed:
        raise ToolError(f"Field {field!r} not found. Available fields: {', '.join(allowed)}.")
    return {field: record[field]}


# ------------------------------------------------------------------------------------------------
# Company directory and email


def find_email_address(world: World, name: str = "") -> list[str]:
    needle = name.strip().lower().replace(" ", ".")
    return [address for address in DIRECTORY if needle in address.partition("@")[0]]


def get_email_information_by_id(world: World, email_id: str, field: str) -> dict[str, str]:
    return _field_of(_find(world, "emails", email_id), field, EMAIL_FIELDS)


def search_emails(
    world: World, query: str = "", date_min: str = "", date_max: str = "", page: int = 1, page_size: int = 5
) -> dict[str, Any]:
    words = query.lower().split()
    lo = _date(date_min, "date_min") if date_min else None
    hi = _date(date_max, "date_max") if date_max else None
    hits = []
    for e in world["emails"]:
        text = f"{e['subject']} {e['body']} {e['sender/recipient']}".lower()
        day = date.fromisoformat(e["sent_datetime"][:10])
        if all(w in text for w in words) and (lo is None or day >= lo) and (hi is None or day <= hi):
            hits.append(e)
    hits.sort(key=lambda e: e["sent_datetime"], reverse=True)
    return _page(hits, page, page_size, "emails")


def _send(world: World, recipient: str, subject: str, body: str) -> str:
    email_id = _next_id(world, "emails")
    world["emails"].append(
        {
            "email_id": email_id,
            "inbox/outbox": "outbox",
            "sender/recipient": _email_address(recipient),
            "subject": subject,
            "sent_datetime": NOW.strftime("%Y-%m-%d %H:%M:%S"),
            "body": body,
        }
    )
    return email_id


def send_email(world: World, recipient: str, subject: str, body: str) -> str:
    if not subject.strip() or not body.strip():
        raise ToolError("An email needs a subject and a body.")
    return f"Email sent (email_id {_send(world, recipient, subject, body)})."


def delete_email(world: World, email_id: str) -> str:
    world["emails"].remove(_find(world, "emails", email_id))
    return "Email deleted."


def forward_email(world: World, email_id: str, recipient: str) -> str:
    original = _find(world, "emails", email_id)
    new_id = _send(world, recipient, f"FW: {original['subject']}", original["body"])
    return f"Email forwarded (email_id {new_id})."


def reply_email(world: World, email_id: str, body: str) -> str:
    if not body.strip():
        raise ToolError("A reply needs a body.")
    original = _find(world, "emails", email_id)
    new_id = _send(world, original["sender/recipient"], f"RE: {original['subject']}", body)
    return f"Reply sent (email_id {new_id})."


# ------------------------------------------------------------------------------------------------
# Calendar


def get_event_information_by_id(world: World, event_id: str, field: str) -> dict[str, str]:
    return _field_of(_find(world, "calendar_events", event_id), field, EVENT_FIELDS)


def search_events(
    world: World, query: str = "", time_min: str = "", time_max: str = "", page: int = 1, page_size: int = 5
) -> dict[str, Any]:
    words = query.lower().split()
    lo = _datetime(time_min, "time_min") if time_min else None
    hi = _datetime(time_max, "time_max") if time_max else None
    hits = []
    for e in world["calendar_events"]:
        start = datetime.strptime(e["event_start"], "%Y-%m-%d %H:%M:%S")
        end = start + timedelta(minutes=int(e["duration"]))
        text = f"{e['event_name']} {e['participant_email']}".lower()
        if all(w in text for w in words) and (lo is None or end >= lo) and (hi is None or start <= hi):
            hits.append(e)
    hits.sort(key=lambda e: e["event_start"])
    return _page(hits, page, page_size, "events")


def _duration(value: str) -> str:
    try:
        minutes = int(str(value).strip())
    except ValueError:
        raise ToolError(f"duration must be a whole number of minutes, got {value!r}.") from None
    if minutes < 1:
        raise ToolError("duration must be at least 1 minute.")
    return str(minutes)


def create_event(
    world: World, event_name: str, participant_email: str, event_start: str, duration: str
) -> str:
    start = _datetime(event_start, "event_start")
    event_id = _next_id(world, "calendar_events")
    world["calendar_events"].append(
        {
            "event_id": event_id,
            "event_name": event_name,
            "participant_email": _email_address(participant_email),
            "event_start": start.strftime("%Y-%m-%d %H:%M:%S"),
            "duration": _duration(duration),
        }
    )
    return f"Event created (event_id {event_id})."


def delete_event(world: World, event_id: str) -> str:
    world["calendar_events"].remove(_find(world, "calendar_events", event_id))
    return "Event deleted."


def update_event(world: World, event_id: str, field: str, new_value: str) -> str:
    event = _find(world, "calendar_events", event_id)
    if field not in EVENT_FIELDS[1:]:
        raise ToolError(
            f"Field {field!r} cannot be updated. Available fields: {', '.join(EVENT_FIELDS[1:])}."
        )
    if field == "event_start":
        new_value = _datetime(new_value, "event_start").strftime("%Y-%m-%d %H:%M:%S")
    elif field == "duration":
        new_value = _duration(new_value)
    elif field == "participant_email":
        new_value = _email_address(new_value)
    event[field] = new_value
    return "Event updated."


# ------------------------------------------------------------------------------------------------
# Analytics


def _visits(world: World, time_min: str, time_max: str) -> list[dict[str, str]]:
    lo = _date(time_min, "time_min") if time_min else None
    hi = _date(time_max, "time_max") if time_max else None
    return [
        v
        for v in world["analytics"]
        if (lo is None or date.fromisoformat(v["date_of_visit"]) >= lo)
        and (hi is None or date.fromisoformat(v["date_of_visit"]) <= hi)
    ]


def get_visitor_information_by_id(world: World, visitor_id: str) -> list[dict[str, str]]:
    hits = [v for v in world["analytics"] if v["visitor_id"] == visitor_id.strip()]
    if not hits:
        raise ToolError(f"No visits by visitor {visitor_id!r}.")
    return hits


def create_plot(world: World, time_min: str, time_max: str, value_to_plot: str, plot_type: str) -> str:
    _date(time_min, "time_min"), _date(time_max, "time_max")
    if value_to_plot not in PLOT_VALUES:
        raise ToolError(f"value_to_plot must be one of {', '.join(PLOT_VALUES)}.")
    if plot_type not in PLOT_TYPES:
        raise ToolError(f"plot_type must be one of {', '.join(PLOT_TYPES)}.")
    path = f"plots/{time_min.strip()}_{time_max.strip()}_{value_to_plot}_{plot_type}.png"
    world["plots"].append({"file_path": path})
    return path


def total_visits_count(world: World, time_min: str = "", time_max: str = "") -> dict[str, int]:
    counts = Counter(v["date_of_visit"] for v in _visits(world, time_min, time_max))
    return dict(sorted(counts.items()))


def engaged_users_count(world: World, time_min: str = "", time_max: str = "") -> dict[str, int]:
    counts = Counter(
        v["date_of_visit"] for v in _visits(world, time_min, time_max) if v["user_engaged"] == "True"
    )
    return dict(sorted(counts.items()))


def traffic_source_count(
    world: World, time_min: str = "", time_max: str = "", traffic_source: str = ""
) -> dict[str, int]:
    if traffic_source and traffic_source not in TRAFFIC_SOURCES:
        raise ToolError(f"traffic_source must be one of {', '.join(TRAFFIC_SOURCES)}.")
    counts = Counter(
        v["date_of_visit"]
        for v in _visits(world, time_min, time_max)
        if not traffic_source or v["traffic_source"] == traffic_source
    )
    return dict(sorted(counts.items()))


def get_average_session_duration(world: World, time_min: str = "", time_max: str = "") -> dict[str, float]:
    by_day: dict[str, list[int]] = {}
    for v in _visits(world, time_min, time_max):
        by_day.setdefault(v["date_of_visit"], []).append(int(v["session_duration_seconds"]))
    return {day: round(sum(s) / len(s), 1) for day, s in sorted(by_day.items())}


# ------------------------------------------------------------------------------------------------
# Project management


def get_task_information_by_id(world: World, task_id: str, field: str) -> dict[str, str]:
    return _field_of(_find(world, "project_tasks", task_id), field, TASK_FIELDS)


def search_tasks(
    world: World,
    task_name: str = "",
    assigned_to_email: str = "",
    list_name: str = "",
    due_date: str = "",
    board: str = "",
) -> list[dict[str, str]]:
    wanted = {
        "task_name": task_name,
        "assigned_to_email": assigned_to_email,
        "list_name": list_name,
        "due_date": due_date,
        "board": board,
    }
    wanted = {k: v.strip().lower() for k, v in wanted.items() if v.strip()}
    if not wanted:
        raise ToolError("Give at least one of task_name, assigned_to_email, list_name, due_date, board.")
    return [t for t in world["project_tasks"] if all(v in t[k].lower() for k, v in wanted.items())]


def _choice(value: str, allowed: tuple[str, ...], what: str) -> str:
    for option in allowed:
        if value.strip().lower() == option.lower():
            return option
    raise ToolError(f"{what} must be one of {', '.join(allowed)}, got {value!r}.")


def _task_value(field: str, value: str) -> str:
    if field == "list_name":
        return _choice(value, LISTS, "list_name")
    if field == "board":
        return _choice(value, BOARDS, "board")
    if field == "due_date":
        return _date(value, "due_date").isoformat()
    if field == "assigned_to_email":
        return _email_address(value)
    return value


def create_task(
    world: World, task_name: str, assigned_to_email: str, list_name: str, due_date: str, board: str
) -> str:
    record = {"task_id": _next_id(world, "project_tasks"), "task_name": task_name}
    for field, value in (
        ("assigned_to_email", assigned_to_email),
        ("list_name", list_name),
        ("due_date", due_date),
        ("board", board),
    ):
        record[field] = _task_value(field, value)
    world["project_tasks"].append(record)
    return f"Task created (task_id {record['task_id']})."


def delete_task(world: World, task_id: str) -> str:
    world["project_tasks"].remove(_find(world, "project_tasks", task_id))
    return "Task deleted."


def update_task(world: World, task_id: str, field: str, new_value: str) -> str:
    task = _find(world, "project_tasks", task_id)
    if field not in TASK_FIELDS[1:]:
        raise ToolError(f"Field {field!r} cannot be updated. Available fields: {', '.join(TASK_FIELDS[1:])}.")
    task[field] = _task_value(field, new_value)
    return "Task updated."


# ------------------------------------------------------------------------------------------------
# Customer relationship manager


def _customer_value(field: str, value: str) -> str:
    if field == "status":
        return _choice(value, STATUSES, "status")
    if field == "product_interest":
        return _choice(value, PRODUCTS, "product_interest")
    if field in ("last_contact_date", "follow_up_by"):
        return _date(value, field).isoformat() if value.strip() else ""
    if field in ("assigned_to_email", "customer_email"):
        return _email_address(value) if value.strip() else ""
    return value


def search_customers(
    world: World,
    customer_name: str = "",
    customer_email: str = "",
    product_interest: str = "",
    status: str = "",
    assigned_to_email: str = "",
    last_contact_date_min: str = "",
    last_contact_date_max: str = "",
    follow_up_by_min: str = "",
    follow_up_by_max: str = "",
    page: int = 1,
    page_size: int = 5,
) -> dict[str, Any]:
    wanted = {
        "customer_name": customer_name,
        "customer_email": customer_email,
        "product_interest": product_interest,
        "status": status,
        "assigned_to_email": assigned_to_email,
    }
    wanted = {k: v.strip().lower() for k, v in wanted.items() if v.strip()}
    bounds = [
        ("last_contact_date", last_contact_date_min, last_contact_date_max),
        ("follow_up_by", follow_up_by_min, follow_up_by_max),
    ]
    checks = [
        (f, _date(lo, f"{f}_min") if lo else None, _date(hi, f"{f}_max") if hi else None)
        for f, lo, hi in bounds
    ]
    hits = []
    for c in world["customers"]:
        if not all(v in c[k].lower() for k, v in wanted.items()):
            continue
        ok = True
        for f, lo, hi in checks:
            if lo is None and hi is None:
                continue
            if not c[f]:
                ok = False
                break
            d = date.fromisoformat(c[f])
            ok = ok and (lo is None or d >= lo) and (hi is None or d <= hi)
        if ok:
            hits.append(c)
    return _page(hits, page, page_size, "customers")


def update_customer(world: World, customer_id: str, field: str, new_value: str) -> str:
    customer = _find(world, "customers", customer_id)
    if field not in CUSTOMER_FIELDS[1:]:
        raise ToolError(
            f"Field {field!r} cannot be updated. Available fields: {', '.join(CUSTOMER_FIELDS[1:])}."
        )
    customer[field] = _customer_value(field, new_value)
    return "Customer updated."


def add_customer(
    world: World,
    customer_name: str,
    assigned_to_email: str,
    status: str,
    customer_email: str = "",
    customer_phone: str = "",
    last_contact_date: str = "",
    product_interest: str = "",
    notes: str = "",
    follow_up_by: str = "",
) -> str:
    given = {
        "assigned_to_email": assigned_to_email,
        "customer_name": customer_name,
        "customer_email": customer_email,
        "customer_phone": customer_phone,
        "last_contact_date": last_contact_date,
        "product_interest": product_interest,
        "status": status,
        "notes": notes,
        "follow_up_by": follow_up_by,
    }
    record = {"customer_id": _next_id(world, "customers")}
    for field in CUSTOMER_FIELDS[1:]:
        value = given[field]
        record[field] = _customer_value(field, value) if value.strip() or field == "status" else ""
    world["customers"].append(record)
    return f"Customer added (customer_id {record['customer_id']})."


def delete_customer(world: World, customer_id: str) -> str:
    world["customers"].remove(_find(world, "customers", customer_id))
    return "Customer deleted."


# ------------------------------------------------------------------------------------------------
# The tool table


@dataclass(frozen=True)
class Param:
    description: str
    required: bool = False
    kind: str = "string"  # "string" | "integer"


@dataclass(frozen=True)
class ToolSpec:
    description: str
    params: dict[str, Param]
    fn: Callable[..., Any]
    mutates: bool = False


def _p(description: str, required: bool = False) -> Param:
    return Param(description, required)


_PAGE = Param("Page number of results to return (default 1)", kind="integer")
_PAGE_SIZE = Param("Number of results per page (default 5)", kind="integer")
_ID8 = "8-digit ID of the {}"

TOOLS: dict[str, ToolSpec] = {
    "company_directory_find_email_address": ToolSpec(
        "Finds every employee email address containing the given name (case-insensitive).",
        {"name": _p("Name or part of a name, e.g. 'priya' or 'raman'")},
        find_email_address,
    ),
    "email_get_email_information_by_id": ToolSpec(
        "Returns one field of an email.",
        {
            "email_id": _p(_ID8.format("email"), True),
            "field": _p(f"Field to return, one of: {', '.join(EMAIL_FIELDS)}", True),
        },
        get_email_information_by_id,
    ),
    "email_search_emails": ToolSpec(
        "Searches emails whose subject, body or sender/recipient contain every word of the query; newest first.",
        {
            "query": _p("Words to match in subject, body or sender/recipient"),
            "date_min": _p("Earliest sent date, inclusive, YYYY-MM-DD"),
            "date_max": _p("Latest sent date, inclusive, YYYY-MM-DD"),
            "page": _PAGE,
            "page_size": _PAGE_SIZE,
        },
        search_emails,
    ),
    "email_send_email": ToolSpec(
        "Sends an email.",
        {
            "recipient": _p("Email address of the recipient", True),
            "subject": _p("Subject line", True),
            "body": _p("Body text", True),
        },
        send_email,
        mutates=True,
    ),
    "email_delete_email": ToolSpec(
        "Deletes an email.", {"email_id": _p(_ID8.format("email"), True)}, delete_email, mutates=True
    ),
    "email_forward_email": ToolSpec(
        "Forwards an email to a recipient (subject 'FW: <subject>', same body).",
        {"email_id": _p(_ID8.format("email"), True), "recipient": _p("Email address of the recipient", True)},
        forward_email,
        mutates=True,
    ),
    "email_reply_email": ToolSpec(
        "Replies to the other party of an email (subject 'RE: <subject>').",
        {"email_id": _p(_ID8.format("email"), True), "body": _p("Body text of the reply", True)},
        reply_email,
        mutates=True,
    ),
    "calendar_get_event_information_by_id": ToolSpec(
        "Returns one field of a calendar event.",
        {
            "event_id": _p(_ID8.format("event"), True),
            "field": _p(f"Field to return, one of: {', '.join(EVENT_FIELDS)}", True),
        },
        get_event_information_by_id,
    ),
    "calendar_search_events": ToolSpec(
        "Searches events whose name or participant contain every word of the query; earliest first.",
        {
            "query": _p("Words to match in event_name or participant_email"),
            "time_min": _p("Only events ending at or after this time, YYYY-MM-DD HH:MM:SS"),
            "time_max": _p("Only events starting at or before this time, YYYY-MM-DD HH:MM:SS"),
            "page": _PAGE,
            "page_size": _PAGE_SIZE,
        },
        search_events,
    ),
    "calendar_create_event": ToolSpec(
        "Creates a calendar event.",
        {
            "event_name": _p("Name of the event", True),
            "participant_email": _p("Email address of the participant", True),
            "event_start": _p("Start time, YYYY-MM-DD HH:MM:SS", True),
            "duration": _p("Duration in minutes", True),
        },
        create_event,
        mutates=True,
    ),
    "calendar_delete_event": ToolSpec(
        "Deletes a calendar event.", {"event_id": _p(_ID8.format("event"), True)}, delete_event, mutates=True
    ),
    "calendar_update_event": ToolSpec(
        "Changes one field of a calendar event.",
        {
            "event_id": _p(_ID8.format("event"), True),
            "field": _p(f"Field to change, one of: {', '.join(EVENT_FIELDS[1:])}", True),
            "new_value": _p("The new value", True),
        },
        update_event,
        mutates=True,
    ),
    "analytics_get_visitor_information_by_id": ToolSpec(
        "Returns every website visit of a visitor.",
        {"visitor_id": _p("4-digit visitor ID", True)},
        get_visitor_information_by_id,
    ),
    "analytics_create_plot": ToolSpec(
        "Plots a website metric over a date range and returns the plot's file path.",
        {
            "time_min": _p("First day, YYYY-MM-DD", True),
            "time_max": _p("Last day, YYYY-MM-DD", True),
            "value_to_plot": _p(f"One of: {', '.join(PLOT_VALUES)}", True),
            "plot_type": _p(f"One of: {', '.join(PLOT_TYPES)}", True),
        },
        create_plot,
        mutates=True,
    ),
    "analytics_total_visits_count": ToolSpec(
        "Number of website visits per day in a date range.",
        {"time_min": _p("First day, YYYY-MM-DD"), "time_max": _p("Last day, YYYY-MM-DD")},
        total_visits_count,
    ),
    "analytics_engaged_users_count": ToolSpec(
        "Number of engaged visits per day in a date range.",
        {"time_min": _p("First day, YYYY-MM-DD"), "time_max": _p("Last day, YYYY-MM-DD")},
        engaged_users_count,
    ),
    "analytics_traffic_source_count": ToolSpec(
        "Number of visits per day in a date range, optionally from one traffic source.",
        {
            "time_min": _p("First day, YYYY-MM-DD"),
            "time_max": _p("Last day, YYYY-MM-DD"),
            "traffic_source": _p(f"One of: {', '.join(TRAFFIC_SOURCES)}"),
        },
        traffic_source_count,
    ),
    "analytics_get_average_session_duration": ToolSpec(
        "Average session duration in seconds per day in a date range.",
        {"time_min": _p("First day, YYYY-MM-DD"), "time_max": _p("Last day, YYYY-MM-DD")},
        get_average_session_duration,
    ),
    "project_management_get_task_information_by_id": ToolSpec(
        "Returns one field of a project task.",
        {
            "task_id": _p(_ID8.format("task"), True),
            "field": _p(f"Field to return, one of: {', '.join(TASK_FIELDS)}", True),
        },
        get_task_information_by_id,
    ),
    "project_management_search_tasks": ToolSpec(
        "Searches tasks matching every given field (substring, case-insensitive).",
        {
            "task_name": _p("Part of the task name"),
            "assigned_to_email": _p("Email address of the assignee"),
            "list_name": _p(f"One of: {', '.join(LISTS)}"),
            "due_date": _p("Due date, YYYY-MM-DD"),
            "board": _p(f"One of: {', '.join(BOARDS)}"),
        },
        search_tasks,
    ),
    "project_management_create_task": ToolSpec(
        "Creates a project task.",
        {
            "task_name": _p("Name of the task", True),
            "assigned_to_email": _p("Email address of the assignee", True),
            "list_name": _p(f"One of: {', '.join(LISTS)}", True),
            "due_date": _p("Due date, YYYY-MM-DD", True),
            "board": _p(f"One of: {', '.join(BOARDS)}", True),
        },
        create_task,
        mutates=True,
    ),
    "project_management_delete_task": ToolSpec(
        "Deletes a project task.", {"task_id": _p(_ID8.format("task"), True)}, delete_task, mutates=True
    ),
    "project_management_update_task": ToolSpec(
        "Changes one field of a project task.",
        {
            "task_id": _p(_ID8.format("task"), True),
            "field": _p(f"Field to change, one of: {', '.join(TASK_FIELDS[1:])}", True),
            "new_value": _p("The new value", True),
        },
        update_task,
        mutates=True,
    ),
    "customer_relationship_manager_search_customers": ToolSpec(
        "Searches customer records matching every given field (substring, case-insensitive) and date range.",
        {
            "customer_name": _p("Part of the customer's name"),
            "customer_email": _p("Customer email address"),
            "product_interest": _p(f"One of: {', '.join(PRODUCTS)}"),
            "status": _p(f"One of: {', '.join(STATUSES)}"),
            "assigned_to_email": _p("Email address of the account owner"),
            "last_contact_date_min": _p("Earliest last contact date, YYYY-MM-DD"),
            "last_contact_date_max": _p("Latest last contact date, YYYY-MM-DD"),
            "follow_up_by_min": _p("Earliest follow-up date, YYYY-MM-DD"),
            "follow_up_by_max": _p("Latest follow-up date, YYYY-MM-DD"),
            "page": _PAGE,
            "page_size": _PAGE_SIZE,
        },
        search_customers,
    ),
    "customer_relationship_manager_update_customer": ToolSpec(
        "Changes one field of a customer record.",
        {
            "customer_id": _p(_ID8.format("customer"), True),
            "field": _p(f"Field to change, one of: {', '.join(CUSTOMER_FIELDS[1:])}", True),
            "new_value": _p("The new value", True),
        },
        update_customer,
        mutates=True,
    ),
    "customer_relationship_manager_add_customer": ToolSpec(
        "Adds a customer record.",
        {
            "customer_name": _p("Name of the customer", True),
            "assigned_to_email": _p("Email address of the account owner", True),
            "status": _p(f"One of: {', '.join(STATUSES)}", True),
            "customer_email": _p("Customer email address"),
            "customer_phone": _p("Customer phone number"),
            "last_contact_date": _p("Last contact date, YYYY-MM-DD"),
            "product_interest": _p(f"One of: {', '.join(PRODUCTS)}"),
            "notes": _p("Free-text notes"),
            "follow_up_by": _p("Next follow-up date, YYYY-MM-DD"),
        },
        add_customer,
        mutates=True,
    ),
    "customer_relationship_manager_delete_customer": ToolSpec(
        "Deletes a customer record.",
        {"customer_id": _p(_ID8.format("customer"), True)},
        delete_customer,
        mutates=True,
    ),
}


def tool_schema(name: str) -> dict[str, Any]:
    """The Responses API function tool for ``name`` (as rows carry it in ``responses_create_params.tools``)."""
    spec = TOOLS[name]
    return {
        "type": "function",
        "name": name,
        "description": spec.description,
        "parameters": {
            "type": "object",
            "properties": {k: {"type": p.kind, "description": p.description} for k, p in spec.params.items()},
            "required": [k for k, p in spec.params.items() if p.required],
            "additionalProperties": False,
        },
        "strict": False,
    }


def call_tool(world: World, name: str, arguments: dict[str, Any]) -> Any:
    """Run one tool on ``world``. Unknown tools, unknown or missing arguments raise :class:`ToolError`."""
    spec = TOOLS.get(name)
    if spec is None:
        raise ToolError(f"Unknown tool {name!r}.")
    unknown = sorted(set(arguments) - set(spec.params))
    if unknown:
        raise ToolError(
            f"{name}: unknown argument(s) {', '.join(unknown)}; expected {', '.join(spec.params)}."
        )
    missing = [k for k, p in spec.params.items() if p.required and arguments.get(k) in (None, "")]
    if missing:
        raise ToolError(f"{name}: missing required argument(s) {', '.join(missing)}.")
    args: dict[str, Any] = {}
    for key, value in arguments.items():
        if value is None:
            continue
        kind = spec.params[key].kind
        if kind == "integer":
            try:
                args[key] = int(value)
            except (TypeError, ValueError):
                raise ToolError(f"{name}: {key} must be an integer, got {value!r}.") from None
        elif isinstance(value, (str, int, float)) and not isinstance(value, bool):
            args[key] = str(value)
        else:
            raise ToolError(f"{name}: {key} must be a string, got {type(value).__name__}.")
    return spec.fn(world, **args)


def parse_arguments(arguments: str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError as e:
        raise ToolError(f"arguments are not valid JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise ToolError("arguments must be a JSON object.")
    return parsed


def apply_calls(world: World, calls: list[dict[str, Any]], strict: bool) -> list[str]:
    """Run ``calls`` (``{"name", "arguments"}``) in order. ``strict``: the first failing call raises
    :class:`ToolError` naming its position; otherwise failures are collected and skipped (as they were
    for the model, which saw the error text)."""
    errors = []
    for i, call in enumerate(calls):
        try:
            call_tool(world, call["name"], parse_arguments(call.get("arguments", "{}")))
        except ToolError as e:
            if strict:
                raise ToolError(f"call {i} ({call.get('name')}): {e}") from None
            errors.append(f"call {i} ({call.get('name')}): {e}")
    return errors


def _norm(record: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(
        sorted((k, v.strip() if k in CASE_SENSITIVE_FIELDS else v.strip().lower()) for k, v in record.items())
    )


@functools.cache
def _base_ids() -> dict[str, set[str]]:
    """Per keyed table, the ids of the records the company starts with."""
    return {t: {r[k] for r in _BASE.get(t, [])} for t, k in TABLES.items() if k}


def state_differences(actual: World, expected: World) -> list[str]:
    """Human-readable differences between two worlds (empty: equivalent). See the module docstring."""
    base_ids = _base_ids()
    diffs: list[str] = []
    for table, key in TABLES.items():
        if actual[table] == expected[table]:
            # The same records in the same order differ in no normalised way either. Most tables of a
            # task are untouched: this equality (in C) skips normalising every record of them, which
            # cost ~6 ms per /verify on the event loop.
            continue
        if key is None:
            a, e = Counter(map(_norm, actual[table])), Counter(map(_norm, expected[table]))
            if a != e:
                diffs.append(
                    f"{table}: {sum((a - e).values())} unexpected, {sum((e - a).values())} missing records"
                )
            continue
        a_old = {r[key]: _norm(r) for r in actual[table] if r[key] in base_ids[table]}
        e_old = {r[key]: _norm(r) for r in expected[table] if r[key] in base_ids[table]}
        for rid in sorted(set(a_old) | set(e_old)):
            if rid not in a_old:
                diffs.append(f"{table}: {key} {rid} was deleted but should remain")
            elif rid not in e_old:
                diffs.append(f"{table}: {key} {rid} should have been deleted")
            elif a_old[rid] != e_old[rid]:
                changed = sorted(k for (k, v), (_, w) in zip(a_old[rid], e_old[rid], strict=True) if v != w)
                diffs.append(f"{table}: {key} {rid} differs in {', '.join(changed)}")

        def new(records: list[dict[str, str]], key: str = key, table: str = table) -> Counter:
            return Counter(
                _norm({k: v for k, v in r.items() if k != key})
                for r in records
                if r[key] not in base_ids[table]
            )

        a_new, e_new = new(actual[table]), new(expected[table])
        if a_new != e_new:
            diffs.append(
                f"{table}: {sum((a_new - e_new).values())} unexpected new, {sum((e_new - a_new).values())} missing new records"
            )
    return diffs
