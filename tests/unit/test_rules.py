"""The broker's request models state exactly the tables of ``qmq_wire.rules``.

The in-memory broker checks requests with those tables, the broker with its pydantic models
(and, on the busy routes, msgspec structs): field names and order, which are required,
defaults, and every bound, pattern and choice must be the same, or the two would refuse
differently. Read from the models' JSON Schemas, so a bound written by hand shows up here.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from pydantic import BaseModel

import qmq_wire as wire
from qmq_broker.http import bodies, schemas
from qmq_wire import rules

MODELS: list[tuple[rules.Request, type[BaseModel]]] = [
    (rules.ENVELOPE, schemas.Envelope),
    (rules.PRODUCE, schemas.ProduceRequest),
    (rules.PULL, schemas.PullRequest),
    (rules.ACK, schemas.AckRequest),
    (rules.NACK, schemas.NackRequest),
    (rules.REDRIVE, schemas.RedriveRequest),
    (rules.RESET, schemas.ResetRequest),
    (rules.DECLARE, schemas.DeclareRequest),
    (rules.SPLIT, schemas.SplitRequest),
    (rules.MERGE, schemas.MergeRequest),
    (rules.MOVE, schemas.MoveRequest),
]
STRUCTS: list[tuple[rules.Request, type[Any]]] = [
    (rules.ENVELOPE, bodies.Envelope),
    (rules.PRODUCE, bodies.ProduceBody),
    (rules.PULL, bodies.PullBody),
    (rules.ACK, bodies.AckBody),
    (rules.NACK, bodies.NackBody),
]


def expected(rule: Any) -> dict[str, Any]:
    """The JSON Schema keywords a rule must appear as."""
    if isinstance(rule, rules.Integer):
        return {"type": "integer", "minimum": rule.low, "maximum": rule.high}
    if isinstance(rule, rules.Name):
        return {"type": "string", "pattern": wire.NAME_PATTERN}
    if isinstance(rule, rules.Text):
        if rule.pattern is not None:
            return {"type": "string", "pattern": rule.pattern}
        bounds = {"minLength": rule.low or None, "maxLength": rule.high}
        return {"type": "string", **{k: v for k, v in bounds.items() if v is not None}}
    if isinstance(rule, rules.Choice):
        if set(rule.values) == {True, False}:
            return {"type": "boolean"}
        if len(rule.values) == 1:
            return {"const": rule.values[0]}
        return {"enum": list(rule.values)}
    if isinstance(rule, rules.Items):
        unique = {"uniqueItems": True} if rule.unique else {}
        return {
            "type": "array",
            "minItems": rule.low,
            "maxItems": rule.high,
            "items": expected(rule.item),
            **unique,
        }
    if isinstance(rule, rules.Object):
        return {}  # a $ref to the object's model, checked against its own request
    if isinstance(rule, rules.Headers):
        return {
            "type": "object",
            "maxProperties": rule.most,
            "additionalProperties": expected(rule.value),
        }
    if isinstance(rule, rules.Timestamp):
        return {"type": "string"}
    if isinstance(rule, rules.PositionRule):
        return {"anyOf": schemas.POSITION_SCHEMA["anyOf"]}
    raise AssertionError(rule)


def resolve(schema: dict[str, Any], defs: dict[str, Any], *, nullable: bool) -> dict[str, Any]:
    """A property's schema without ``$ref`` and, if ``nullable``, without its null branch."""
    if "$ref" in schema:
        return resolve(defs[schema["$ref"].rsplit("/", 1)[-1]], defs, nullable=nullable)
    if "anyOf" in schema and nullable:
        (kept,) = [s for s in schema["anyOf"] if s.get("type") != "null"]
        assert {"type": "null"} in schema["anyOf"]
        return resolve(kept, defs, nullable=False)
    return schema


def same(actual: dict[str, Any], wanted: dict[str, Any], where: str) -> None:
    for keyword, value in wanted.items():
        if isinstance(value, dict):
            same(actual[keyword], value, f"{where}.{keyword}")
            continue
        found = actual.get(keyword)
        if keyword == "pattern" and isinstance(found, str):
            found = found.removesuffix(r"\Z") + "$" if found.endswith(r"\Z") else found
        if keyword == "enum" and isinstance(found, list):
            found, value = sorted(found), sorted(value)
        assert found == value, f"{where}: {keyword} is {found!r}, the rule says {value!r}"


def check_schema(request: rules.Request, schema: dict[str, Any]) -> None:
    defs = schema.get("$defs", {})
    properties = schema["properties"]
    assert list(properties) == [f.name for f in request.fields]
    assert set(schema.get("required", [])) == {f.name for f in request.fields if f.required}
    for field in request.fields:
        prop = resolve(properties[field.name], defs, nullable=field.nullable)
        same(prop, expected(field.rule), field.name)


@pytest.mark.parametrize(
    ("request_rules", "model"), MODELS, ids=lambda m: getattr(m, "__name__", "")
)
def test_models_state_the_rules(request_rules: rules.Request, model: type[BaseModel]) -> None:
    check_schema(request_rules, model.model_json_schema())
    for field in request_rules.fields:
        info = model.model_fields[field.name]
        assert info.is_required() == field.required, field.name
        if not field.required:
            assert info.get_default(call_default_factory=True) == field.default, field.name


@pytest.mark.parametrize(
    ("request_rules", "struct"), STRUCTS, ids=lambda s: getattr(s, "__name__", "")
)
def test_structs_state_the_rules(request_rules: rules.Request, struct: type[Any]) -> None:
    (schema,), components = msgspec.json.schema_components([struct], schema_hook=_timestamp_schema)
    name = schema["$ref"].rsplit("/", 1)[-1]
    properties = components[name]["properties"]
    required = set(components[name].get("required", []))
    # the order may differ (required fields first): a refusal is the reference model's anyway
    assert set(properties) == {f.name for f in request_rules.fields}
    assert required == {f.name for f in request_rules.fields if f.required}
    optional = struct.__struct_fields__[
        len(struct.__struct_fields__) - len(struct.__struct_defaults__) :
    ]
    defaults = dict(zip(optional, struct.__struct_defaults__, strict=True))
    for field in request_rules.fields:
        if field.name in ("id", "subject"):  # checked in Envelope.__post_init__, for speed
            continue
        prop = resolve(properties[field.name], components, nullable=field.nullable)
        if isinstance(field.rule, rules.Timestamp):
            continue  # decoded by a hook as microseconds: the reference's parser
        if isinstance(field.rule, rules.PositionRule):
            continue  # checked in PullBody.__post_init__ by the rule itself
        same(prop, expected(field.rule), field.name)
        if not field.required:
            found = defaults[field.name]
            found = found.factory() if isinstance(found, msgspec._core.Factory) else found
            assert found == field.default, field.name


def test_the_hand_written_envelope_checks_are_the_rules() -> None:
    """``Envelope.__post_init__`` checks the id and subject by hand: the same verdicts."""
    ids = ["a", "x" * 128, "x" * 129, "", "tab\there", "é", "ok id ~", "new\n"]
    names = ["a", "a" * 200, "a" * 201, "_x", "x_", "a.b-c", "a\n", "", "a b"]
    for message_id in ids:
        for subject in names[:2]:
            ok = rules.MESSAGE_ID.accepts(message_id, "id", "id")
            assert _decodes(message_id, subject) == ok, message_id
    for subject in names:
        ok = rules.Name().accepts(subject, "subject", "subject")
        assert _decodes("id-1", subject) == ok, subject


def _timestamp_schema(kind: type[Any]) -> dict[str, Any]:
    if kind is bodies.TimestampUs:
        return {"type": "string"}
    raise NotImplementedError(kind)


def _decodes(message_id: str, subject: str) -> bool:
    raw = msgspec.json.encode({"messages": [{"id": message_id, "subject": subject, "body": ""}]})
    try:
        bodies.DECODERS[bodies.ProduceBody].decode(raw)
    except (msgspec.DecodeError, ValueError):
        return False
    return True
