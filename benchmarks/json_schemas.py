"""30 JSON schemas for the structured-output tests and benchmark: nested objects, arrays,
enums, bounded numbers, required and optional fields, $ref. Each with what to ask for."""

from __future__ import annotations

from typing import Any

_str = {"type": "string", "maxLength": 40}
_int = {"type": "integer"}
_addr = {
    "type": "object",
    "properties": {
        "street": _str,
        "city": _str,
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
    },
    "required": ["street", "city", "zip"],
    "additionalProperties": False,
}

SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    (
        "a person",
        {
            "type": "object",
            "properties": {"name": _str, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"],
        },
    ),
    (
        "a book",
        {
            "type": "object",
            "properties": {
                "title": _str,
                "author": _str,
                "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
            },
            "required": ["title", "author", "year"],
            "additionalProperties": False,
        },
    ),
    (
        "a color",
        {
            "type": "object",
            "properties": {"color": {"enum": ["red", "green", "blue"]}},
            "required": ["color"],
        },
    ),
    (
        "a temperature reading",
        {
            "type": "object",
            "properties": {
                "celsius": {"type": "number", "minimum": -50, "maximum": 60},
                "city": _str,
            },
            "required": ["celsius", "city"],
        },
    ),
    (
        "a boolean answer",
        {
            "type": "object",
            "properties": {"answer": {"type": "boolean"}, "reason": _str},
            "required": ["answer"],
        },
    ),
    (
        "a list of fruits",
        {
            "type": "object",
            "properties": {
                "fruits": {"type": "array", "items": _str, "minItems": 1, "maxItems": 4}
            },
            "required": ["fruits"],
        },
    ),
    (
        "three numbers",
        {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 100},
            "minItems": 3,
            "maxItems": 3,
        },
    ),
    (
        "a company with an address",
        {
            "type": "object",
            "properties": {"name": _str, "address": _addr},
            "required": ["name", "address"],
        },
    ),
    (
        "a user with a $ref address",
        {
            "$defs": {"addr": _addr},
            "type": "object",
            "properties": {"user": _str, "home": {"$ref": "#/$defs/addr"}},
            "required": ["user", "home"],
        },
    ),
    (
        "a product",
        {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 10000},
                "in_stock": {"type": "boolean"},
            },
            "required": ["sku", "price", "in_stock"],
        },
    ),
    (
        "an event",
        {
            "type": "object",
            "properties": {
                "event": _str,
                "day": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]},
                "attendees": {"type": "integer", "minimum": 1, "maximum": 1000},
            },
            "required": ["event", "day"],
        },
    ),
    (
        "a point",
        {
            "type": "object",
            "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
            "required": ["x", "y"],
            "additionalProperties": False,
        },
    ),
    (
        "a recipe",
        {
            "type": "object",
            "properties": {
                "dish": _str,
                "steps": {"type": "array", "items": _str, "minItems": 1, "maxItems": 3},
                "minutes": {"type": "integer", "minimum": 1, "maximum": 300},
            },
            "required": ["dish", "steps"],
        },
    ),
    (
        "a movie rating",
        {
            "type": "object",
            "properties": {"movie": _str, "stars": {"type": "integer", "minimum": 1, "maximum": 5}},
            "required": ["movie", "stars"],
        },
    ),
    ("a status", {"enum": ["ok", "warning", "error"]}),
    (
        "a country",
        {
            "type": "object",
            "properties": {
                "country": _str,
                "capital": _str,
                "population_millions": {"type": "number", "minimum": 0, "maximum": 2000},
            },
            "required": ["country", "capital"],
        },
    ),
    (
        "a to-do item",
        {
            "type": "object",
            "properties": {
                "task": _str,
                "done": {"type": "boolean"},
                "priority": {"enum": [1, 2, 3]},
            },
            "required": ["task", "done", "priority"],
        },
    ),
    (
        "an employee",
        {
            "type": "object",
            "properties": {
                "name": _str,
                "role": {"enum": ["engineer", "manager", "designer"]},
                "salary": {"type": "integer", "minimum": 1000, "maximum": 500000},
                "manager": {"type": ["string", "null"], "maxLength": 40},
            },
            "required": ["name", "role"],
        },
    ),
    (
        "a tree node",
        {
            "$defs": {
                "leaf": {
                    "type": "object",
                    "properties": {"value": _int},
                    "required": ["value"],
                    "additionalProperties": False,
                }
            },
            "type": "object",
            "properties": {
                "value": _int,
                "left": {"$ref": "#/$defs/leaf"},
                "right": {"$ref": "#/$defs/leaf"},
            },
            "required": ["value", "left", "right"],
            "additionalProperties": False,
        },
    ),
    (
        "a date",
        {
            "type": "object",
            "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
            "required": ["date"],
        },
    ),
    (
        "an email contact",
        {
            "type": "object",
            "properties": {
                "name": _str,
                "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"},
            },
            "required": ["name", "email"],
        },
    ),
    (
        "a matrix",
        {
            "type": "array",
            "items": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 2,
                "maxItems": 2,
            },
            "minItems": 2,
            "maxItems": 2,
        },
    ),
    (
        "a sentiment",
        {
            "type": "object",
            "properties": {
                "text": _str,
                "sentiment": {"enum": ["positive", "negative", "neutral"]},
                "score": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["sentiment", "score"],
        },
    ),
    (
        "a car",
        {
            "type": "object",
            "properties": {
                "make": _str,
                "model": _str,
                "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                "electric": {"type": "boolean"},
            },
            "required": ["make", "model", "year", "electric"],
            "additionalProperties": False,
        },
    ),
    (
        "a team",
        {
            "type": "object",
            "properties": {
                "team": _str,
                "members": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": _str,
                            "age": {"type": "integer", "minimum": 18, "maximum": 70},
                        },
                        "required": ["name"],
                    },
                    "minItems": 1,
                    "maxItems": 2,
                },
            },
            "required": ["team", "members"],
        },
    ),
    ("an answer of one word", {"type": "string", "pattern": "^[A-Za-z]{1,12}$"}),
    (
        "a weather forecast",
        {
            "type": "object",
            "properties": {
                "city": _str,
                "days": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "day": {"enum": ["mon", "tue", "wed"]},
                            "high": {"type": "integer", "minimum": -30, "maximum": 50},
                        },
                        "required": ["day", "high"],
                        "additionalProperties": False,
                    },
                    "minItems": 1,
                    "maxItems": 3,
                },
            },
            "required": ["city", "days"],
        },
    ),
    (
        "a shape",
        {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "circle_radius": {"type": "number", "minimum": 0, "maximum": 100}
                    },
                    "required": ["circle_radius"],
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "properties": {"square_side": {"type": "number", "minimum": 0, "maximum": 100}},
                    "required": ["square_side"],
                    "additionalProperties": False,
                },
            ]
        },
    ),
    (
        "an order",
        {
            "type": "object",
            "properties": {
                "order_id": {"type": "integer", "minimum": 1},
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "item": _str,
                            "qty": {"type": "integer", "minimum": 1, "maximum": 10},
                        },
                        "required": ["item", "qty"],
                    },
                    "maxItems": 3,
                },
                "express": {"type": "boolean"},
            },
            "required": ["order_id", "items"],
        },
    ),
    (
        "a server config",
        {
            "type": "object",
            "properties": {
                "host": _str,
                "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                "tls": {
                    "type": "object",
                    "properties": {
                        "enabled": {"type": "boolean"},
                        "version": {"enum": ["1.2", "1.3"]},
                    },
                    "required": ["enabled"],
                },
            },
            "required": ["host", "port", "tls"],
        },
    ),
]

TOPICS = ["the city of Paris", "a small coffee shop", "a science fiction story"]


def prompt(what: str, schema: dict[str, Any], topic: str) -> str:
    import json

    return f"Write {what} related to {topic}, as JSON matching this schema:\n{json.dumps(schema)}"
