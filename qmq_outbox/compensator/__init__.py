"""The compensator: resends outbox rows no dispatcher confirmed (docs/outbox.md).

``worker`` claims due rows and sends them (``Compensator``), ``config`` holds its settings
with their defaults once, ``metrics`` its Prometheus series, ``cli`` the ``qmq compensator``
command. Names are imported on first use: the outbox reads the settings without loading the
scheduler the worker runs on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qmq_outbox.lazy import lazy_attributes

if TYPE_CHECKING:
    from qmq_outbox.compensator.config import CompensatorConfig, CompensatorSettings
    from qmq_outbox.compensator.metrics import CompensatorMetrics
    from qmq_outbox.compensator.worker import Compensator, PassResult

__all__ = [
    "Compensator",
    "CompensatorConfig",
    "CompensatorMetrics",
    "CompensatorSettings",
    "PassResult",
]

_LAZY = {
    "qmq_outbox.compensator.config": ("CompensatorConfig", "CompensatorSettings"),
    "qmq_outbox.compensator.metrics": ("CompensatorMetrics",),
    "qmq_outbox.compensator.worker": ("Compensator", "PassResult"),
}

__getattr__ = lazy_attributes(__name__, _LAZY, globals())
