"""The OpenAPI document states the broker's rules: statuses, auth, and request rules that
the broker checks outside pydantic (checked here against the document's own JSON Schema)."""

from __future__ import annotations

import base64
import binascii
from typing import Any

import jsonschema_rs
import pytest

import qmq_wire as wire
from qmq_broker.http import app
from qmq_broker.http.openapi import MAX_SCHEDULE_HOURS, openapi_document
from qmq_broker.http.schemas import AckRequest


def _validator(model: str) -> Any:
    """A validator for one component of the document, with its references resolvable."""
    document = openapi_document()
    schemas = document["components"]["schemas"]
    return jsonschema_rs.validator_for(
        {"$ref": f"#/components/schemas/{model}", "components": {"schemas": schemas}}
    )


def test_each_operation_lists_its_statuses_and_auth_adds_401_and_the_bearer_scheme() -> None:
    off, on = openapi_document(auth=False), openapi_document(auth=True)
    produce_off = off["paths"]["/v1/messages"]["post"]
    # 409: a produce an ordered subject refuses (no key, a delay)
    assert set(produce_off["responses"]) == {"200", "400", "403", "409", "413", "415", "503"}
    assert "security" not in produce_off
    assert "securitySchemes" not in off["components"]
    pull_on = on["paths"]["/v1/pull"]["post"]
    assert set(pull_on["responses"]) == {"200", "400", "401", "403", "404", "409", "413"} | {
        "415",
        "429",
        "503",
    }
    assert pull_on["security"] == [{"bearer": []}]
    assert pull_on["responses"]["429"]["headers"]["Retry-After"]["required"] is True
    assert pull_on["responses"]["401"]["headers"]["WWW-Authenticate"]["required"] is True
    assert on["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    for path in ("/healthz", "/metrics", "/openapi.json"):
        assert on["paths"][path]["get"]["security"] == []  # open with auth on
        assert "401" not in on["paths"][path]["get"]["responses"]


def test_error_codes_of_a_status_are_the_wire_codes_of_that_status() -> None:
    schemas = openapi_document()["components"]["schemas"]
    code_404 = schemas["Error404"]["allOf"][1]["properties"]["error"]["properties"]["code"]
    assert set(code_404["enum"]) == {
        code for code, status in wire.ERROR_STATUS.items() if status == 404
    }
    errors_400 = _validator("Error400")
    assert errors_400.is_valid({"error": {"code": "invalid_subject", "message": "m", "field": "s"}})
    assert not errors_400.is_valid({"error": {"code": "not_found", "message": "m", "field": None}})


def test_the_schedule_limit_is_the_one_the_route_enforces() -> None:
    assert MAX_SCHEDULE_HOURS == app.MAX_SCHEDULE_HOURS


@pytest.mark.parametrize(
    "body", ["", "QQ==", "QUI=", "QUJD", "QUJDQQ==", "QQ", "QQ=", "Q", "=", "QQ==QQ==", "QUJD\n"]
)
def test_a_base64_body_is_valid_in_the_document_exactly_when_the_broker_decodes_it(
    body: str,
) -> None:
    try:
        base64.b64decode(body, validate=True)
        decodes = True
    except (binascii.Error, ValueError):
        decodes = False
    envelope = {"id": "1", "subject": "a", "body": body, "body_encoding": "base64"}
    assert _validator("Envelope").is_valid(envelope) is decodes
    assert _validator("Envelope").is_valid({**envelope, "body_encoding": "utf-8"})


@pytest.mark.parametrize(
    "request_body",
    [
        {},
        {"seqs": [1]},
        {"seqs": [1], "all": False},
        {"seqs": [1], "all": None},
        {"seqs": [1], "all": True},
        {"all": True},
        {"all": True, "seqs": None},
        {"all": False},
        {"all": None},
        {"seqs": None},
    ],
)
def test_a_redrive_is_valid_in_the_document_exactly_when_it_names_seqs_or_all(
    request_body: dict[str, Any],
) -> None:
    seqs, everything = request_body.get("seqs"), request_body.get("all")
    served = (seqs is None) != (everything is not True)  # the route's rule
    assert _validator("RedriveRequest").is_valid(request_body) is served


@pytest.mark.parametrize(
    ("created_at", "valid"),
    [
        ("2030-01-01T00:00:00Z", True),
        ("0001-01-01T00:00:00Z", True),
        ("0001-01-01T10:00:00-05:00", True),
        ("0001-01-01T00:00:00+00:01", False),  # before 0001-01-01T00:00:00Z in UTC
        ("9999-12-31T23:59:59.999999Z", True),
        ("9999-12-31T23:59:59+01:00", True),
        ("9999-12-31T23:59:59-23:59", False),  # in the year 10000 in UTC
    ],
)
def test_timestamps_outside_the_range_in_utc_are_refused_by_the_document(
    created_at: str, valid: bool
) -> None:
    envelope = {"id": "1", "subject": "a", "body": "x", "created_at": created_at}
    assert _validator("Envelope").is_valid(envelope) is valid


def test_an_integral_json_number_is_an_integer_as_json_schema_says() -> None:
    doc = '{"subject": "a", "group": "g", "consumer": "c", "seqs": [104.0, 3]}'
    assert AckRequest.model_validate_json(doc).seqs == [104, 3]
    for bad in ("[104.5]", "[true]", '["104"]', "[1e300]"):
        with pytest.raises(ValueError, match="seqs"):
            AckRequest.model_validate_json(doc.replace("[104.0, 3]", bad))
