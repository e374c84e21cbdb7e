"""Field types the answer models share (``qmq_broker.http.answers``,
``qmq_broker.console.answers``): names, counts, seqs and timestamps as the wire has them."""

from __future__ import annotations

from typing import Annotated

from pydantic import AwareDatetime, Field, StringConstraints

import qmq_wire as wire

Timestamp = AwareDatetime  # RFC 3339 in UTC on the wire
Count = Annotated[int, Field(ge=0)]
Seq = Annotated[int, Field(ge=0, le=wire.MAX_SEQ)]
Name = Annotated[str, StringConstraints(pattern=wire.NAME_PATTERN)]
"""A subject or group: only names that follow the naming rules are ever stored."""
MessageId = Annotated[str, StringConstraints(pattern=wire.MESSAGE_ID_PATTERN)]
