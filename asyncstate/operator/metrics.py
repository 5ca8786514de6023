"""The counters of an operator (`KeyedOperator.metrics`), gathered from its parts."""

from __future__ import annotations

from typing import Any

from asyncstate.operator.admission import AdmissionGate
from asyncstate.runtime.controller import AsyncExecutionController

__all__ = ["operator_metrics"]


def operator_metrics(controller: AsyncExecutionController | None,
                     gate: AdmissionGate | None) -> dict[str, Any]:
    """`records_in`, `records_done`, `in_flight`, `in_flight_peak`, `batches`, `requests`,
    `max_batch_size` and `blocked_seconds` (all zero before the operator started)."""
    if controller is None or gate is None:
        return {"records_in": 0, "records_done": 0, "in_flight": 0, "in_flight_peak": 0,
                "batches": 0, "requests": 0, "max_batch_size": 0, "blocked_seconds": 0.0}
    return {
        "records_in": gate.records_in,
        "records_done": controller.records_done,
        "in_flight": gate.in_flight,
        "in_flight_peak": max(gate.peak, controller.in_flight_peak),
        "batches": controller.batches,
        "requests": controller.requests,
        "max_batch_size": controller.max_batch_size,
        "blocked_seconds": gate.blocked_seconds,
    }
