"""JSON schemas of the analysis documents (plain dicts, JSON-Schema draft 2020-12
subset) and a small validator for that subset, so no new dependency is needed.

Supported keywords: ``type`` (a name or a list of names), ``required``,
``properties``, ``items``, ``enum``, ``const``, ``minimum``, ``minItems``,
``additionalProperties`` (a schema). Extra fields are allowed unless a schema says
otherwise. The same dicts are valid input for the ``jsonschema`` package.
"""

from __future__ import annotations

import math

__all__ = ["SCHEMAS", "validate", "SchemaError"]

_NUM = {"type": "number"}
_NUM_OR_NULL = {"type": ["number", "null"]}


def _doc(name: str, rows_key: str, row: dict) -> dict:
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"fedlora analysis: {name}",
        "type": "object",
        "required": ["analysis", rows_key],
        "properties": {
            "analysis": {"const": name},
            rows_key: {"type": "array", "minItems": 1, "items": row},
        },
    }


_AMP_ROW = {
    "type": "object",
    "required": ["scheme", "sigma", "noise_power", "closed_form"],
    "properties": {
        "scheme": {"type": "string"},
        "sigma": {"type": "number", "minimum": 0},
        "noise_power": {"type": ["number", "null"], "minimum": 0},
        "closed_form": _NUM_OR_NULL,
    },
}
AMPLIFICATION = _doc("amplification", "rows", _AMP_ROW)
AMPLIFICATION["required"] = ["analysis", "rows", "fits"]
AMPLIFICATION["properties"]["fits"] = {
    "type": "object",
    "additionalProperties": {
        "type": "object",
        "required": ["exponent_low", "exponent_high"],
        "properties": {"exponent_low": _NUM_OR_NULL, "exponent_high": _NUM_OR_NULL},
    },
}

EXACTNESS = _doc(
    "exactness",
    "rows",
    {
        "type": "object",
        "required": ["method", "clients", "rank", "oversketch", "shared_a", "relative_error"],
        "properties": {
            "method": {"type": "string"},
            "clients": {"type": "integer", "minimum": 1},
            "rank": {"type": "integer", "minimum": 1},
            "oversketch": {"type": ["integer", "null"], "minimum": 0},
            "shared_a": {"type": ["boolean", "null"]},
            "relative_error": {"type": ["number", "null"], "minimum": 0},
        },
    },
)

HETERO = _doc(
    "hetero",
    "rows",
    {
        "type": "object",
        "required": ["method", "round", "init_noise", "agg_noise"],
        "properties": {
            "method": {"type": "string"},
            "round": {"type": "integer", "minimum": 0},
            "init_noise": {"type": ["number", "null"], "minimum": 0},
            "agg_noise": {"type": ["number", "null"], "minimum": 0},
        },
    },
)

REFACTORIZATION = _doc(
    "refactorization",
    "rows",
    {
        "type": "object",
        "required": ["scheme", "epsilon", "subspace_error", "reconstruction_error"],
        "properties": {
            "scheme": {"type": "string"},
            "epsilon": {"type": ["number", "null"], "minimum": 0},
            "subspace_error": {"type": ["number", "null"], "minimum": 0},
            "reconstruction_error": {"type": ["number", "null"], "minimum": 0},
        },
    },
)

CLAIMS = _doc(
    "claims",
    "claims",
    {
        "type": "object",
        "required": ["id", "paper", "statement", "holds", "measured", "setting"],
        "properties": {
            "id": {"type": "string"},
            "paper": {"type": "string"},
            "statement": {"type": "string"},
            "holds": {"type": ["boolean", "null"]},
            "measured": {"type": "object"},
            "setting": {"type": "object"},
        },
    },
)

SCHEMAS: dict[str, dict] = {
    "amplification": AMPLIFICATION,
    "exactness": EXACTNESS,
    "hetero": HETERO,
    "refactorization": REFACTORIZATION,
    "claims": CLAIMS,
}


class SchemaError(ValueError):
    """A document does not match its schema; the message names the JSON path."""


def _is_type(v, t: str) -> bool:
    if t == "null":
        return v is None
    if t == "boolean":
        return isinstance(v, bool)
    if t == "integer":
        return isinstance(v, int) and not isinstance(v, bool)
    if t == "number":
        return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    if t == "string":
        return isinstance(v, str)
    if t == "array":
        return isinstance(v, list)
    if t == "object":
        return isinstance(v, dict)
    raise ValueError(f"unknown schema type {t!r}")


def _check(v, schema: dict, path: str) -> None:
    if "const" in schema and v != schema["const"]:
        raise SchemaError(f"{path}: expected {schema['const']!r}, got {v!r}")
    if "enum" in schema and v not in schema["enum"]:
        raise SchemaError(f"{path}: {v!r} not one of {schema['enum']}")
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_is_type(v, t) for t in types):
            raise SchemaError(f"{path}: expected {'/'.join(types)}, got {type(v).__name__} {v!r}")
    if "minimum" in schema and _is_type(v, "number") and v < schema["minimum"]:
        raise SchemaError(f"{path}: {v!r} < minimum {schema['minimum']}")
    if isinstance(v, dict):
        for key in schema.get("required", []):
            if key not in v:
                raise SchemaError(f"{path}: missing required field {key!r}")
        props = schema.get("properties", {})
        for key, sub in props.items():
            if key in v:
                _check(v[key], sub, f"{path}.{key}")
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, val in v.items():
                if key not in props:
                    _check(val, extra, f"{path}.{key}")
    if isinstance(v, list):
        if len(v) < schema.get("minItems", 0):
            raise SchemaError(f"{path}: fewer than {schema['minItems']} items")
        if "items" in schema:
            for i, item in enumerate(v):
                _check(item, schema["items"], f"{path}[{i}]")


def validate(doc, name: str | None = None) -> None:
    """Raise SchemaError unless ``doc`` matches the schema of analysis ``name``
    (default: ``doc["analysis"]``). The document must be JSON data (dicts, lists,
    str, int, finite float, bool, None) — NaN/Inf are rejected."""
    if name is None:
        if not isinstance(doc, dict) or "analysis" not in doc:
            raise SchemaError("$: not an analysis document (no 'analysis' field)")
        name = doc["analysis"]
    if name not in SCHEMAS:
        raise SchemaError(f"no schema for analysis {name!r}")
    _check(doc, SCHEMAS[name], "$")
