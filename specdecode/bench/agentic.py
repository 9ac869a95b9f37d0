"""The `agentic` category: an agent's next tool call, with its earlier calls and their results in context. Each
scenario is a user's request, the tools the agent is given (OpenAI function definitions, rendered by the model's own
chat template) and a scripted run of calls with the tools' answers; a task stands after the first d calls of a run
(d = 1 .. its length - 1), so the model must produce call d + 1 (or its answer) with d calls and results before it.
The scenarios are HAND-WRITTEN here, kept small in the repository (no package ships agent transcripts); what is
measured is how fast each method writes the next call, where copying from the context (file contents, earlier
arguments, JSON shapes) is what speculation finds.
"""

from __future__ import annotations

import json
from typing import Any

CATEGORY = "agentic"


def _function(name: str, description: str, **properties: dict) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": list(properties)}}}


STRING, INTEGER = {"type": "string"}, {"type": "integer"}
READ = _function("read_file", "Read a file of the repository.", path=STRING)
WRITE = _function("write_file", "Replace a file's content.", path=STRING, content=STRING)
TESTS = _function("run_tests", "Run the test suite, or one test file.", path=STRING)
GREP = _function("grep", "Search the repository for a regular expression.", pattern=STRING, path=STRING)
SQL = _function("run_sql", "Run a read-only SQL query on the analytics database.", query=STRING)
TABLE = _function("describe_table", "The columns of a table.", table=STRING)
WEATHER = _function("get_weather", "The forecast for a city.", city=STRING, days=INTEGER,
                    unit={"type": "string", "enum": ["celsius", "fahrenheit"]})
FLIGHTS = _function("search_flights", "Flights between two cities on a date (YYYY-MM-DD).", origin=STRING,
                    destination=STRING, date=STRING)
EVENTS = _function("list_events", "The calendar's events on a date (YYYY-MM-DD).", date=STRING)
CREATE = _function("create_event", "Add an event to the calendar.", title=STRING, date=STRING, start=STRING,
                   minutes=INTEGER)
EMAIL = _function("send_email", "Send an email.", to=STRING, subject=STRING, body=STRING)

STATS_PY = '''def mean(values):
    return sum(values) / len(values)


def median(values):
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle]
'''
STATS_FIXED = STATS_PY.replace('''    return ordered[middle]
''', '''    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2
''')
TEST_OUTPUT = '''FAILED tests/test_stats.py::test_median_of_even_count - assert 3 == 2.5
 +  where 3 = median([4, 1, 3, 2])
1 failed, 6 passed in 0.04s'''
CONFIG_PY = '''import os

TIMEOUT = int(os.environ.get("APP_TIMEOUT", "30"))
RETRIES = int(os.environ.get("APP_RETRIES", "3"))
'''
CLIENT_PY = '''import requests

from app.config import RETRIES


def fetch(url):
    for attempt in range(RETRIES):
        try:
            return requests.get(url).json()
        except requests.RequestException:
            if attempt == RETRIES - 1:
                raise
'''

# (id, the user's request, the tools, [(call name, arguments, the tool's answer)])
SCENARIOS: list[tuple[str, str, list[dict], list[tuple[str, dict, str]]]] = [
    ("fix-median", "The test suite fails. Find the bug in app/stats.py and fix it, then check that the tests pass.",
     [TESTS, READ, WRITE], [
         ("run_tests", {"path": "tests/"}, TEST_OUTPUT),
         ("read_file", {"path": "app/stats.py"}, STATS_PY),
         ("write_file", {"path": "app/stats.py", "content": STATS_FIXED}, "Wrote 9 lines to app/stats.py."),
         ("run_tests", {"path": "tests/test_stats.py"}, "7 passed in 0.03s"),
     ]),
    ("timeout", "Requests in app/client.py hang forever when the server is down. Use the configured timeout.",
     [GREP, READ, WRITE], [
         ("grep", {"pattern": "TIMEOUT", "path": "app/"}, "app/config.py:3:" + CONFIG_PY.splitlines()[2]),
         ("read_file", {"path": "app/config.py"}, CONFIG_PY),
         ("read_file", {"path": "app/client.py"}, CLIENT_PY),
         ("write_file", {"path": "app/client.py", "content": CLIENT_PY.replace(
             "import RETRIES", "import RETRIES, TIMEOUT").replace("get(url)", "get(url, timeout=TIMEOUT)")},
          "Wrote 12 lines to app/client.py."),
     ]),
    ("revenue", "Which three countries brought the most revenue last month? Give the figures.",
     [TABLE, SQL], [
         ("describe_table", {"table": "orders"},
          "orders(id INTEGER, customer_id INTEGER, total_cents INTEGER, created_at DATE, status TEXT)"),
         ("describe_table", {"table": "customers"}, "customers(id INTEGER, name TEXT, country TEXT, created_at DATE)"),
         ("run_sql", {"query": "SELECT c.country, SUM(o.total_cents) / 100.0 AS revenue FROM orders o JOIN customers c "
                               "ON c.id = o.customer_id WHERE o.created_at >= '2026-10-01' AND o.created_at < "
                               "'2026-11-01' AND o.status = 'paid' GROUP BY c.country ORDER BY revenue DESC LIMIT 3"},
          "country | revenue\nGermany | 48210.50\nFrance | 39877.25\nItaly | 21050.00"),
     ]),
    ("trip", "I am flying from Berlin to Lisbon on 2026-12-18 if the weather there is good. Check and find flights.",
     [WEATHER, FLIGHTS], [
         ("get_weather", {"city": "Lisbon", "days": 5, "unit": "celsius"},
          json.dumps({"city": "Lisbon", "forecast": [{"day": "2026-12-18", "high": 17, "low": 10, "rain": 0.1},
                                                     {"day": "2026-12-19", "high": 16, "low": 9, "rain": 0.3}]})),
         ("search_flights", {"origin": "Berlin", "destination": "Lisbon", "date": "2026-12-18"},
          json.dumps([{"flight": "TP 541", "departs": "06:35", "arrives": "09:20", "price_eur": 189},
                      {"flight": "FR 1123", "departs": "13:10", "arrives": "15:55", "price_eur": 74}])),
         ("get_weather", {"city": "Berlin", "days": 1, "unit": "celsius"},
          json.dumps({"city": "Berlin", "forecast": [{"day": "2026-12-18", "high": 2, "low": -3, "rain": 0.6}]})),
     ]),
    ("meeting", "Find a free hour on 2026-12-03 for a design review with Ana and email her the invitation.",
     [EVENTS, CREATE, EMAIL], [
         ("list_events", {"date": "2026-12-03"},
          json.dumps([{"title": "Stand-up", "start": "09:30", "minutes": 15},
                      {"title": "Lunch", "start": "12:00", "minutes": 60},
                      {"title": "Planning", "start": "14:00", "minutes": 90}])),
         ("create_event", {"title": "Design review with Ana", "date": "2026-12-03", "start": "10:00", "minutes": 60},
          json.dumps({"id": "evt_2041", "title": "Design review with Ana", "date": "2026-12-03", "start": "10:00"})),
         ("send_email", {"to": "ana@example.com", "subject": "Design review on 2026-12-03 at 10:00",
                         "body": "Hi Ana, I booked a design review on 2026-12-03 from 10:00 to 11:00. See you there!"},
          "Sent."),
     ]),
]


def _call(index: int, name: str, arguments: dict) -> dict:
    return {"id": f"call_{index}", "type": "function", "function": {"name": name, "arguments": arguments}}


def tasks() -> list[tuple[str, str, tuple[dict, ...], tuple[dict[str, Any], ...]]]:
    """(task id, the user's request, the agent's calls and the tools' answers so far, the tools): one task after
    each call of a run but the last."""
    out = []
    for ident, request, tools, run in SCENARIOS:
        history: list[dict] = []
        for depth, (name, arguments, answer) in enumerate(run[:-1], start=1):
            history += [{"role": "assistant", "content": "", "tool_calls": [_call(depth, name, arguments)]},
                        {"role": "tool", "tool_call_id": f"call_{depth}", "content": answer}]
            out.append((f"{ident}/{depth}", request, tuple(history), tuple(tools)))
    return out
