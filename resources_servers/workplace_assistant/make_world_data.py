"""Writes ``world_data/company.json``: the simulated company every workplace_assistant session starts from.

The company ("Atlas Works") is invented for this project: people, mail, meetings, web-analytics
visits, project tasks and customer records are drawn from the small vocabularies below with a fixed
seed, so running this script again reproduces the committed file byte for byte. Run it only when the
world itself should change (the example rows' ground truths refer to its ids)::

    python resources_servers/workplace_assistant/make_world_data.py
"""

from __future__ import annotations

import json
import random
from datetime import datetime, timedelta
from pathlib import Path

OUT = Path(__file__).parent / "world_data" / "company.json"
DOMAIN = "atlas-works.com"
PEOPLE = [
    ("Nadia", "Okafor"),
    ("Tomas", "Lindqvist"),
    ("Priya", "Raman"),
    ("Jonah", "Whitfield"),
    ("Mei", "Tanaka"),
    ("Oscar", "Delgado"),
    ("Fatima", "Haddad"),
    ("Lukas", "Brenner"),
    ("Ingrid", "Solberg"),
    ("Kwame", "Mensah"),
    ("Rosa", "Quintero"),
    ("Dmitri", "Volkov"),
    ("Aisha", "Bello"),
    ("Felix", "Hartmann"),
    ("Chloe", "Marchand"),
    ("Samir", "Nasser"),
]
TOPICS = [
    "quarterly budget review",
    "onboarding checklist",
    "API rate limits",
    "design system refresh",
    "customer churn report",
    "security audit findings",
    "release 4.2 planning",
    "office move logistics",
    "vendor contract renewal",
    "hiring plan for Q1",
    "data retention policy",
    "mobile app crash fix",
]
EMAIL_OPENERS = [
    "Quick update on the {t}.",
    "Can we talk about the {t} this week?",
    "Attached are my notes on the {t}.",
    "Following up on the {t}: any blockers?",
    "The {t} needs a decision before Friday.",
]
MEETINGS = [
    "Sprint planning",
    "Design critique",
    "Budget sync",
    "Customer call",
    "Architecture review",
    "One-on-one",
    "Hiring debrief",
    "Incident retro",
    "Roadmap workshop",
    "Vendor demo",
]
TASKS = [
    "Migrate billing service to new queue",
    "Redesign settings page",
    "Write load tests for search",
    "Audit access logs",
    "Create onboarding illustrations",
    "Fix flaky checkout test",
    "Document webhook retries",
    "Prototype dark mode",
    "Upgrade database driver",
    "Refresh icon set",
    "Add CSV export to reports",
    "Reduce image sizes on landing page",
    "Set up staging alerts",
    "Review accessibility of forms",
    "Split monolith auth module",
    "Localize error messages",
    "Draft Q1 design principles",
    "Cache pricing lookups",
    "Clean up feature flags",
    "Build usage dashboard",
]
LISTS = ["Backlog", "In Progress", "In Review", "Completed"]
BOARDS = ["Back end", "Front end", "Design"]
CUSTOMERS = [
    "Harbor Lane Foods",
    "Copperleaf Clinics",
    "Northwind Rail",
    "Bluebird Logistics",
    "Kestrel Bank",
    "Orchid Hotels",
    "Summit Schools",
    "Riverbend Energy",
    "Granite Insurance",
    "Lumen Studios",
    "Pinecrest Retail",
    "Quarry Labs",
    "Tidewater Ports",
    "Verdant Farms",
    "Zephyr Airlines",
    "Maple Street Dental",
    "Ironclad Security",
    "Saffron Kitchens",
    "Beacon Media",
    "Cobalt Mining",
    "Falcon Freight",
    "Juniper Health",
    "Meridian Law",
    "Nimbus Cloud Co",
    "Osprey Outdoor",
]
STATUSES = ["Qualified", "Won", "Lost", "Lead", "Proposal"]
PRODUCTS = ["Software", "Hardware", "Services", "Consulting", "Training"]
SOURCES = ["direct", "referral", "search engine", "social media"]
NOW = datetime(2023, 11, 30, 23, 59, 0)


def email_of(first: str, last: str) -> str:
    return f"{first.lower()}.{last.lower()}@{DOMAIN}"


def main() -> None:
    rng = random.Random(20261123)
    staff = [email_of(f, last) for f, last in PEOPLE]
    me = staff[0]  # the assistant works for Nadia Okafor
    others = staff[1:]

    emails = []
    for i in range(40):
        topic = rng.choice(TOPICS)
        sent = NOW - timedelta(days=rng.randint(0, 45), hours=rng.randint(0, 10), minutes=rng.randint(0, 59))
        emails.append(
            {
                "email_id": f"{i + 1:08d}",
                "inbox/outbox": "inbox" if rng.random() < 0.7 else "outbox",
                "sender/recipient": rng.choice(others),
                "subject": topic.capitalize(),
                "sent_datetime": sent.strftime("%Y-%m-%d %H:%M:%S"),
                "body": rng.choice(EMAIL_OPENERS).format(t=topic),
            }
        )

    events = []
    for i in range(30):
        day = datetime(2023, 11, 20) + timedelta(days=rng.randint(0, 20))
        start = day.replace(hour=rng.randint(9, 16), minute=rng.choice([0, 30]))
        events.append(
            {
                "event_id": f"{i + 1:08d}",
                "event_name": rng.choice(MEETINGS),
                "participant_email": rng.choice(others),
                "event_start": start.strftime("%Y-%m-%d %H:%M:%S"),
                "duration": str(rng.choice([15, 30, 45, 60, 90])),
            }
        )

    visits = []
    for _ in range(160):
        day = NOW - timedelta(days=rng.randint(0, 29))
        visits.append(
            {
                "date_of_visit": day.strftime("%Y-%m-%d"),
                "visitor_id": f"{rng.randint(0, 9999):04d}",
                "page_views": str(rng.randint(1, 12)),
                "session_duration_seconds": str(rng.randint(5, 900)),
                "traffic_source": rng.choice(SOURCES),
                "user_engaged": "True" if rng.random() < 0.45 else "False",
            }
        )
    visits.sort(key=lambda v: (v["date_of_visit"], v["visitor_id"]))

    tasks = []
    for i, name in enumerate(TASKS):
        due = datetime(2023, 11, 15) + timedelta(days=rng.randint(0, 40))
        tasks.append(
            {
                "task_id": f"{i + 1:08d}",
                "task_name": name,
                "assigned_to_email": rng.choice(staff),
                "list_name": rng.choice(LISTS),
                "due_date": due.strftime("%Y-%m-%d"),
                "board": rng.choice(BOARDS),
            }
        )

    customers = []
    for i, name in enumerate(CUSTOMERS):
        contact = NOW - timedelta(days=rng.randint(1, 60))
        slug = "".join(ch for ch in name.lower() if ch.isalnum())[:12]
        customers.append(
            {
                "customer_id": f"{i + 1:08d}",
                "assigned_to_email": rng.choice(others[:8]),
                "customer_name": name,
                "customer_email": f"contact@{slug}.example",
                "customer_phone": f"555-{rng.randint(100, 999)}-{rng.randint(1000, 9999)}",
                "last_contact_date": contact.strftime("%Y-%m-%d"),
                "product_interest": rng.choice(PRODUCTS),
                "status": rng.choice(STATUSES),
                "notes": "",
                "follow_up_by": (contact + timedelta(days=rng.randint(7, 30))).strftime("%Y-%m-%d"),
            }
        )

    world = {
        "company": "Atlas Works",
        "assistant_of": me,
        "now": NOW.strftime("%Y-%m-%d %H:%M:%S"),
        "directory": staff,
        "emails": emails,
        "calendar_events": events,
        "analytics": visits,
        "project_tasks": tasks,
        "customers": customers,
    }
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(world, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
