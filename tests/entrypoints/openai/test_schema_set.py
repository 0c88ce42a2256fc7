"""A set of real-world JSON schemas, regexes, choices and Lark grammars sent through a real server on
the default model with the official openai client: every reply must end by itself (``stop``), parse,
and satisfy its constraint.

Why a set and not three: a JSON-schema compiler is a pile of special cases (``$ref`` into ``$defs``,
enums of mixed types, numeric ranges, patterns, optional keys, bounded arrays), and a client only
finds out which one is missing when its own schema comes back invalid or never ends. Each schema
here is the shape of something clients really ask for, bounded (short strings, few items, numeric
ranges, no extra keys) so a greedy 135M model can finish well within ``max_tokens``: a reply that
hits the limit is a failure here, because it means the grammar let the model wander.

Requests go 8 at a time (the server's ``--max-num-seqs``), so the set costs a few batched decodes
rather than 46 sequential ones. Measured on a 2-core Xeon shared with other test runs: the
module took 61 s at load average ~5 (server start 14 s, 33 schemas 38 s, 13 regex / choice /
grammar requests 5 s) and 43 s at load average ~2; the longest reply (the invoice) is 132 tokens.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.entrypoints.openai.conftest import API_KEY, start_server

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 256
BATCH = 8


def text(max_length: int = 24, **kw: Any) -> dict:
    """A bounded string: the model cannot wander inside it."""
    return {"type": "string", "maxLength": max_length, **kw}


def obj(properties: dict, required: list[str] | None = None) -> dict:
    """A closed object; every key required unless ``required`` names fewer."""
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, "additionalProperties": False}


def array(items: dict, min_items: int = 1, max_items: int = 3) -> dict:
    return {"type": "array", "items": items, "minItems": min_items, "maxItems": max_items}


def integer(minimum: int, maximum: int) -> dict:
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


def number(minimum: float, maximum: float) -> dict:
    return {"type": "number", "minimum": minimum, "maximum": maximum}


ADDRESS = obj({"street": text(), "city": text(), "postcode": text(pattern=r"^[0-9]{5}$"),
               "country": {"enum": ["DE", "FR", "US", "CN", "JP"]}}, required=["street", "city", "country"])
#: Money in integer cents, as payment APIs send it: a free ``number`` here let the model repeat
#: digits after the point (``1.1111111111111111``, 177 of 256 tokens for the invoice).
MONEY = obj({"cents": integer(0, 10_000_000), "currency": {"enum": ["EUR", "USD", "CNY", "GBP"]}})
DATE = text(10, pattern=r"^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$")
TIME = text(5, pattern=r"^([01][0-9]|2[0-3]):[0-5][0-9]$")

#: (name, prompt, schema): the shapes clients send for extraction, function arguments, configs and API payloads.
SCHEMA_SET: list[tuple[str, str, dict]] = [
    ("product", "Describe a laptop for sale as JSON.",
     obj({"name": text(), "sku": text(12, pattern=r"^[A-Z]{3}-[0-9]{4}$"), "price": number(0, 10000),
          "in_stock": {"type": "boolean"}, "tags": array(text(12), 0, 3)}, required=["name", "sku", "price"])),
    ("address", "Give the address of a museum in Paris as JSON.", ADDRESS),
    ("invoice", "Write an invoice for two books as JSON.",
     {"$defs": {"line": obj({"description": text(), "quantity": integer(1, 99), "unit_cents": integer(0, 100_000)}),
                "money": MONEY},
      **obj({"number": text(10, pattern=r"^INV-[0-9]{6}$"), "issued": DATE, "lines": array({"$ref": "#/$defs/line"}),
             "total": {"$ref": "#/$defs/money"}, "paid": {"type": "boolean"}}, required=["number", "lines", "total"])}),
    ("calendar_event", "Create a calendar event for a team meeting as JSON.",
     obj({"title": text(), "date": DATE, "start": TIME, "end": TIME, "location": text(),
          "attendees": array(text(16), 1, 3), "recurrence": {"enum": ["none", "daily", "weekly", "monthly"]}},
         required=["title", "date", "start", "attendees"])),
    ("user_profile", "Create a user profile for a new member as JSON.",
     obj({"username": text(16, pattern=r"^[a-z][a-z0-9_]{2,15}$"), "display_name": text(),
          "role": {"enum": ["admin", "editor", "viewer"]}, "age": integer(13, 120),
          "theme": {"enum": ["light", "dark", "system"]}, "newsletter": {"type": "boolean"}},
         required=["username", "role", "age"])),
    ("github_issue", "File a GitHub issue about a crash on startup as JSON.",
     obj({"title": text(), "body": text(), "labels": array({"enum": ["bug", "enhancement", "docs", "question"]}, 1, 3),
          "assignee": {"anyOf": [text(16), {"type": "null"}]}, "priority": integer(0, 3)},
         required=["title", "labels", "assignee"])),
    ("log_record", "Write one log record of a failed database connection as JSON.",
     obj({"timestamp": text(24, pattern=r"^20[0-9]{2}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z$"),
          "level": {"enum": ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]}, "logger": text(16),
          "message": text(), "code": integer(0, 999)}, required=["timestamp", "level", "message"])),
    ("recipe", "Give a pancake recipe as JSON.",
     obj({"title": text(), "servings": integer(1, 12), "minutes": integer(1, 240),
          "ingredients": array(obj({"item": text(16), "grams": integer(1, 2000)}), 1, 3),
          "steps": array(text(), 1, 3), "vegetarian": {"type": "boolean"}},
         required=["title", "servings", "ingredients", "steps"])),
    ("flight_booking", "Book a flight from Berlin to Rome as JSON.",
     {"$defs": {"airport": text(3, pattern=r"^[A-Z]{3}$"),
                "passenger": obj({"first_name": text(16), "last_name": text(16),
                                  "seat": text(3, pattern=r"^[0-9]{1,2}[A-F]$")},
                                 required=["first_name", "last_name"])},
      **obj({"from": {"$ref": "#/$defs/airport"}, "to": {"$ref": "#/$defs/airport"}, "date": DATE,
             "cabin": {"enum": ["economy", "premium", "business", "first"]},
             "passengers": array({"$ref": "#/$defs/passenger"}, 1, 2)},
            required=["from", "to", "date", "passengers"])}),
    ("weather_report", "Report the weather in Oslo today as JSON.",
     obj({"city": text(), "temperature_c": number(-60, 60), "humidity": integer(0, 100),
          "condition": {"enum": ["sunny", "cloudy", "rain", "snow", "fog", "storm"]},
          "wind": obj({"speed_kmh": number(0, 300),
                       "direction": {"enum": ["N", "NE", "E", "SE", "S", "SW", "W", "NW"]}})},
         required=["city", "temperature_c", "condition"])),
    ("service_config", "Write the configuration of a web server as JSON.",
     obj({"host": text(16), "port": integer(1, 65535), "debug": {"type": "boolean"},
          "log_level": {"enum": ["debug", "info", "warning", "error"]}, "workers": integer(1, 64),
          "tls": obj({"enabled": {"type": "boolean"}, "cert_path": text()}, required=["enabled"])},
         required=["host", "port", "log_level"])),
    ("k8s_container", "Describe a Kubernetes container for nginx as JSON.",
     obj({"name": text(20, pattern=r"^[a-z0-9-]{1,20}$"), "image": text(),
          "ports": array(obj({"containerPort": integer(1, 65535), "protocol": {"enum": ["TCP", "UDP"]}},
                             required=["containerPort"]), 1, 2),
          "env": array(obj({"name": text(16, pattern=r"^[A-Z_]{1,16}$"), "value": text(16)}), 0, 2)},
         required=["name", "image"])),
    ("sentiment", "Classify the sentiment of 'I love this phone' as JSON.",
     obj({"label": {"enum": ["positive", "negative", "neutral"]}, "score": number(0, 1)})),
    ("contact_card", "Give the contact card of a plumber as JSON.",
     {"$defs": {"address": ADDRESS, "phone": text(16, pattern=r"^\+[0-9]{6,14}$")},
      **obj({"name": text(), "company": text(), "phones": array({"$ref": "#/$defs/phone"}, 1, 2),
             "address": {"$ref": "#/$defs/address"}}, required=["name", "phones"])}),
    ("order_status", "Report the status of order 42 as JSON.",
     obj({"order_id": integer(1, 999999), "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
          "items": integer(1, 50), "tracking": {"anyOf": [text(16, pattern=r"^[A-Z0-9]{8,16}$"), {"type": "null"}]}},
         required=["order_id", "status", "tracking"])),
    ("movie", "Describe a famous science fiction movie as JSON.",
     obj({"title": text(), "year": integer(1900, 2030), "rating": number(0, 10),
          "genres": array({"enum": ["drama", "comedy", "action", "scifi", "horror", "romance"]}, 1, 3),
          "director": text()}, required=["title", "year", "genres"])),
    ("bank_transaction", "Record a coffee purchase paid by card as JSON.",
     {"$defs": {"money": MONEY},
      **obj({"id": text(12, pattern=r"^TX[0-9]{6,10}$"), "date": DATE, "amount": {"$ref": "#/$defs/money"},
             "kind": {"enum": ["debit", "credit"]}, "merchant": text(), "category": text(16)},
            required=["id", "date", "amount", "kind"])}),
    ("survey_answer", "Answer a customer satisfaction survey as JSON.",
     obj({"respondent": integer(1, 100000), "satisfaction": integer(1, 5), "recommend": {"type": "boolean"},
          "channels": array({"enum": ["email", "phone", "chat", "store"]}, 0, 3), "comment": text()},
         required=["respondent", "satisfaction", "recommend"])),
    ("employee", "Describe an employee of a small company as JSON.",
     {"$defs": {"person": obj({"name": text(), "email": text(24, pattern=r"^[a-z]{1,8}@[a-z]{1,8}\.[a-z]{2,3}$")},
                              required=["name"])},
      **obj({"person": {"$ref": "#/$defs/person"}, "department": {"enum": ["engineering", "sales", "support", "hr"]},
             "salary": integer(0, 500000), "manager": {"anyOf": [{"$ref": "#/$defs/person"}, {"type": "null"}]}},
            required=["person", "department", "manager"])}),
    ("geo_point", "Give the coordinates of the Eiffel Tower as JSON.",
     obj({"name": text(), "lat": number(-90, 90), "lon": number(-180, 180)})),
    ("shopping_cart", "Fill a shopping cart with fruit as JSON.",
     {"$defs": {"item": obj({"product": text(16), "quantity": integer(1, 20), "price": number(0, 500)})},
      **obj({"customer": integer(1, 99999), "items": array({"$ref": "#/$defs/item"}, 1, 3),
             "coupon": {"anyOf": [text(10, pattern=r"^[A-Z0-9]{4,10}$"), {"type": "null"}]}},
            required=["customer", "items"])}),
    ("tool_call_search", "Search the web for the height of Mount Everest; give the arguments as JSON.",
     obj({"query": text(), "max_results": integer(1, 10), "safe_search": {"type": "boolean"},
          "language": {"enum": ["en", "de", "fr", "zh"]}}, required=["query"])),
    ("email_message", "Write a short email inviting a friend to lunch as JSON.",
     obj({"to": array(text(24, pattern=r"^[a-z]{1,8}@[a-z]{1,8}\.com$"), 1, 2), "subject": text(), "body": text(),
          "importance": {"enum": ["low", "normal", "high"]}}, required=["to", "subject", "body"])),
    ("sensor_reading", "Report a reading from a greenhouse sensor as JSON.",
     obj({"device": text(12, pattern=r"^dev-[0-9]{3}$"), "temperature": number(-40, 85), "humidity": number(0, 100),
          "battery": integer(0, 100), "status": {"enum": ["ok", "low_battery", "fault"]}})),
    ("book", "Describe a classic novel as JSON.",
     obj({"title": text(), "author": text(), "isbn": text(17, pattern=r"^97[89]-[0-9]{10}$"), "pages": integer(1, 2000),
          "language": {"enum": ["en", "fr", "de", "es", "ru"]}, "available": {"type": "boolean"}},
         required=["title", "author", "pages"])),
    ("hotel_search", "Find a hotel room in Tokyo for two nights as JSON.",
     obj({"city": text(), "check_in": DATE, "nights": integer(1, 30), "guests": integer(1, 6),
          "max_price": MONEY, "amenities": array({"enum": ["wifi", "pool", "gym", "parking", "breakfast"]}, 0, 3)},
         required=["city", "check_in", "nights", "guests"])),
    ("org_chart", "Describe a tiny team with a lead and two members as JSON.",
     {"$defs": {"member": obj({"name": text(16), "title": text(16)}),
                "team": obj({"name": text(16), "lead": {"$ref": "#/$defs/member"},
                             "members": array({"$ref": "#/$defs/member"}, 0, 2)})},
      "$ref": "#/$defs/team"}),
    ("api_error", "Write the body of an HTTP 404 error response as JSON.",
     obj({"error": obj({"code": integer(400, 599), "type": {"enum": ["not_found", "invalid_request", "server_error"]},
                        "message": text(), "param": {"anyOf": [text(16), {"type": "null"}]}})})),
    ("feature_flags", "List feature flags of a mobile app as JSON.",
     obj({"app": text(16),
          "flags": array(obj({"key": text(16, pattern=r"^[a-z_]{1,16}$"), "enabled": {"type": "boolean"},
                              "rollout": integer(0, 100)}, required=["key", "enabled"]), 1, 3)})),
    ("medication", "Describe a dose of a common painkiller as JSON.",
     obj({"drug": text(), "dose_mg": number(0.1, 2000), "route": {"enum": ["oral", "iv", "topical"]},
          "times_per_day": integer(1, 6), "with_food": {"type": "boolean"}}, required=["drug", "dose_mg", "route"])),
    ("version_release", "Describe a software release as JSON.",
     obj({"package": text(16, pattern=r"^[a-z][a-z0-9-]{0,15}$"),
          "version": text(12, pattern=r"^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$"),
          "date": DATE, "breaking": {"type": "boolean"},
          "changes": array(obj({"kind": {"enum": ["added", "fixed", "removed"]}, "summary": text()}), 1, 3)},
         required=["package", "version", "changes"])),
    ("chess_move", "Give a good opening move in chess as JSON.",
     obj({"piece": {"enum": ["pawn", "knight", "bishop", "rook", "queen", "king"]},
          "from": text(2, pattern=r"^[a-h][1-8]$"), "to": text(2, pattern=r"^[a-h][1-8]$"),
          "check": {"type": "boolean"}})),
    ("mixed_enum_const", "Describe a pricing plan as JSON.",
     obj({"schema_version": {"const": 2}, "plan": {"enum": ["free", "pro", 3, None]}, "seats": integer(1, 500),
          "annual": {"type": "boolean"}, "discount": {"anyOf": [number(0, 0.5), {"type": "null"}]}})),
]

#: (prompt, regex): identifiers, dates, codes clients pin down with a regex.
REGEXES = [
    ("Call me at", r"\(\d{3}\) \d{3}-\d{4}"),
    ("The meeting is on", r"20\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"),
    ("My IPv4 address is", r"((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"),
    ("The color in hex is", r"#[0-9a-f]{6}"),
    ("The answer, yes or no, then a reason:", r"(Yes|No), because [a-z ]{1,30}\."),
]
#: (prompt, choices).
CHOICES = [
    ("Is the sky blue?", ["yes", "no"]),
    ("What is the sentiment of 'I hate waiting'?", ["positive", "negative", "neutral"]),
    ("Which is a fruit?", ["apple", "carrot", "potato", "onion"]),
    ("Pick a weekday.", ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]),
    ("Which language is this: 'Bonjour'?", ["English", "French", "German", "Chinese (中文)"]),
]
#: (prompt, Lark grammar, hand parser of its replies). The parsers are written out here rather
#: than taken from a Lark library so the check does not share the server's reading of the grammar.
ARITHMETIC = r"""
start: expr
expr: term (OP term){0,2}
term: NUMBER | "(" NUMBER (OP NUMBER){1,2} ")"
NUMBER: /[1-9][0-9]{0,2}/
OP: " + " | " - " | " * "
"""
KEY_VALUES = r"""
start: pair ("; " pair){0,2}
pair: KEY "=" VALUE
KEY: /[a-z]{1,8}/
VALUE: /[0-9]{1,4}/
"""
SQL = r"""
start: "SELECT " columns " FROM " TABLE where? ";"
columns: COLUMN (", " COLUMN){0,2}
where: " WHERE " COLUMN " = " NUMBER
COLUMN: "id" | "name" | "age" | "city"
TABLE: "users" | "orders"
NUMBER: /[0-9]{1,4}/
"""


def parse_arithmetic(reply: str) -> list:
    """Recursive descent over ``term (op term)*``; a parenthesised term becomes a nested list."""
    tokens = re.findall(r"[0-9]+| [-+*] |[()]|.", reply)
    pos = 0

    def take(pattern: str) -> str:
        nonlocal pos
        assert pos < len(tokens) and re.fullmatch(pattern, tokens[pos]), (reply, pos, pattern)
        pos += 1
        return tokens[pos - 1]

    def term() -> int | list:
        if tokens[pos] != "(":
            return int(take(r"[1-9][0-9]{0,2}"))
        take(r"\(")
        inner = [int(take(r"[1-9][0-9]{0,2}"))]
        while tokens[pos] != ")":
            inner += [take(r" [-+*] ").strip(), int(take(r"[1-9][0-9]{0,2}"))]
        take(r"\)")
        assert 3 <= len(inner) <= 5, reply
        return inner

    expr = [term()]
    while pos < len(tokens):
        expr += [take(r" [-+*] ").strip(), term()]
    assert len(expr) <= 5, reply
    return expr


def parse_key_values(reply: str) -> dict[str, int]:
    pairs = reply.split("; ")
    assert 1 <= len(pairs) <= 3, reply
    parsed = {}
    for pair in pairs:
        key, value = pair.split("=")
        assert re.fullmatch(r"[a-z]{1,8}", key) and re.fullmatch(r"[0-9]{1,4}", value), reply
        parsed[key] = int(value)
    return parsed


def parse_sql(reply: str) -> tuple[list[str], str, tuple[str, int] | None]:
    m = re.fullmatch(r"SELECT (.+?) FROM (\w+)(?: WHERE (\w+) = ([0-9]{1,4}))?;", reply)
    assert m, reply
    columns = m[1].split(", ")
    assert 1 <= len(columns) <= 3 and set(columns) <= {"id", "name", "age", "city"}, reply
    assert m[2] in ("users", "orders"), reply
    assert m[3] is None or m[3] in ("id", "name", "age", "city"), reply
    return columns, m[2], (m[3], int(m[4])) if m[3] else None


GRAMMARS = [
    ("Compute something: ", ARITHMETIC, parse_arithmetic),
    ("Settings as key=value pairs: ", KEY_VALUES, parse_key_values),
    ("A SQL query that lists users: ", SQL, parse_sql),
]


@pytest.fixture(scope="module")
def oc(tmp_path_factory):
    srv = start_server(str(tmp_path_factory.mktemp("schema_set")))
    yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key=API_KEY, max_retries=0, timeout=600)
    srv.stop()


def run_batched(fn, cases: list) -> list:
    with ThreadPoolExecutor(BATCH) as pool:
        return list(pool.map(fn, cases))


def test_schemas_are_distinct_and_the_set_is_large_enough():
    names = [name for name, _, _ in SCHEMA_SET]
    assert len(names) >= 30 and len(set(names)) == len(names)
    for _, _, schema in SCHEMA_SET:
        jsonschema.Draft202012Validator.check_schema(schema)


def test_every_schema_reply_ends_parses_and_validates(oc):
    def ask(case):
        name, prompt, schema = case
        r = oc.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=MAX_TOKENS,
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}})
        return r.choices[0].finish_reason, r.choices[0].message.content

    failures = []
    for (name, _, schema), (finish, content) in zip(SCHEMA_SET, run_batched(ask, SCHEMA_SET), strict=True):
        try:
            assert finish == "stop", f"finish_reason {finish}"
            jsonschema.validate(json.loads(content), schema)
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append(f"{name}: {type(exc).__name__}: {str(exc)[:200]}\n  reply: {content!r}")
    assert not failures, "\n".join(failures)


def test_regex_choice_and_grammar_constraints_hold(oc):
    def complete(prompt: str, **extra):
        r = oc.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=64, extra_body=extra)
        return r.choices[0].finish_reason, r.choices[0].text

    def chat(prompt: str, **extra):
        r = oc.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0,
                                       max_tokens=64, extra_body=extra)
        return r.choices[0].finish_reason, r.choices[0].message.content

    cases = [("regex", complete, p, {"guided_regex": rx}, rx) for p, rx in REGEXES]
    cases += [("choice", chat, p, {"guided_choice": ch}, ch) for p, ch in CHOICES]
    cases += [("grammar", complete, p, {"guided_grammar": g}, (g, parse)) for p, g, parse in GRAMMARS]
    replies = run_batched(lambda c: c[1](c[2], **c[3]), cases)
    for (kind, _, prompt, _, expected), (finish, reply) in zip(cases, replies, strict=True):
        assert finish == "stop", (prompt, finish, reply)
        if kind == "regex":
            assert re.fullmatch(expected, reply), (prompt, expected, reply)
        elif kind == "choice":
            assert reply in expected, (prompt, reply)
        else:
            _, parse = expected
            parse(reply)
