"""The wire contract: the broker's answer models mirror ``qmq_wire``'s JSON shapes, and the
OpenAPI document is built from the models."""

from __future__ import annotations

from typing import Any, get_type_hints

import pytest
from pydantic import BaseModel

import qmq_wire as wire
from qmq_broker.http import answers
from qmq_broker.http.openapi import openapi_document

MIRRORS: list[tuple[type[Any], type[BaseModel]]] = [
    (wire.ProduceAnswerJson, answers.ProduceResponse),
    (wire.ProduceResultJson, answers.ProducedItem),
    (wire.PullAnswerJson, answers.PullResponse),
    (wire.PulledMessageJson, answers.DeliveredMessage),
    (wire.AckAnswerJson, answers.AckResponse),
    (wire.NackAnswerJson, answers.NackResponse),
    (wire.SubjectsAnswerJson, answers.SubjectsResponse),
    (wire.SubjectStatsJson, answers.SubjectSummary),
    (wire.SubjectAnswerJson, answers.SubjectResponse),
    (wire.ScheduledStatsJson, answers.ScheduledSummary),
    (wire.GroupStatsJson, answers.GroupSummary),
    (wire.DeadLettersAnswerJson, answers.DeadLettersResponse),
    (wire.DeadLetterJson, answers.DeadLetterItem),
    (wire.RedriveAnswerJson, answers.RedriveResponse),
    (wire.ResetAnswerJson, answers.ResetResponse),
    (wire.ResetPositionJson, answers.ResetPosition),
    (wire.HealthAnswerJson, answers.HealthResponse),
    (wire.ErrorAnswerJson, answers.ErrorResponse),
    (wire.ErrorDetailJson, answers.ErrorDetail),
]


@pytest.mark.parametrize(("shape", "model"), MIRRORS)
def test_answer_models_mirror_the_wire_shapes(shape: type[Any], model: type[BaseModel]) -> None:
    assert list(get_type_hints(shape)) == list(model.model_fields)
    assert {name for name, f in model.model_fields.items() if f.is_required()} == set(
        shape.__required_keys__
    )


@pytest.mark.parametrize("auth", [False, True])
def test_every_schema_reference_of_the_openapi_document_resolves(auth: bool) -> None:
    document = openapi_document(auth=auth)
    schemas = document["components"]["schemas"]
    refs: list[str] = []

    def collect(node: Any) -> None:
        if isinstance(node, dict):
            refs.extend(v for k, v in node.items() if k == "$ref")
            for value in node.values():
                collect(value)
        elif isinstance(node, list):
            for value in node:
                collect(value)

    collect(document)
    names = {ref.rsplit("/", 1)[1] for ref in refs}
    assert names <= set(schemas)
    assert {"Error400", "ErrorResponse", "Envelope", "ProduceResponse", "DeadLettersResponse"} <= (
        names
    )
    assert schemas["Error"] == {"$ref": "#/components/schemas/ErrorResponse"}
    assert schemas["Message"] == {"$ref": "#/components/schemas/DeliveredMessage"}
    for path in ("/v1/messages", "/v1/pull", "/v1/ack", "/v1/nack", "/v1/subjects"):
        operation = next(iter(document["paths"][path].values()))
        assert "default" not in operation["responses"]  # every status is listed
        assert {"200", "403", "503"} <= set(operation["responses"])


def test_error_status_follows_the_code() -> None:
    assert wire.error_status("group_not_found") == 404
    assert wire.error_status("invalid_subject") == 400
    assert wire.error_status("mailbox_full") == 429
    assert wire.error_status("something_new") == 500
    assert [s for s in (200, 400, 404, 429, 500, 503) if wire.transient(s)] == [429, 500, 503]


@pytest.mark.parametrize(
    ("name", "valid"),
    [
        ("orders", True),
        ("a.b-c_d", True),
        ("a" * 200, True),
        ("a" * 201, False),
        ("_qmq", False),
        ("a/b", False),
        ("a\n", False),
        ("", False),
    ],
)
def test_name_rule(name: str, valid: bool) -> None:
    assert wire.valid_name(name) is valid
