"""The `twospeed` object a response carries (a body's, and a stream's last chunk's): the request's split clock, bill,
SLO verdict and speculation trace. The server writes it with `twospeed_object`; the lab reads it back with
`read_twospeed` into typed fields, so the keys are spelled here only. Milliseconds, rounded to the microsecond.

A request with several sequences (n > 1, or a batch of prompts) carries one merged clock (schema/clock.py's
`merged_clock_json`), the bills summed, one verdict (met only if every sequence met), and each sequence's own
object under `choices`. No torch, no HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from twospeed.schema.clock import Bill, Clock, SpecTrace, clock_json, merged_clock_json
from twospeed.schema.slo import Verdict


@dataclass(frozen=True, slots=True)
class SequenceFacts:
    """What one finished sequence contributes: the writer's input."""

    index: int
    clock: Clock
    bill: Bill
    num_preemptions: int = 0
    verdict: Verdict | None = None
    spec: SpecTrace | None = None


def spec_json(traces: list[SpecTrace | None]) -> dict | None:
    """Speculation's trace of one sequence, or of several summed (events then per choice only); None when the
    engine does not speculate."""
    traces = [t for t in traces if t is not None]
    if not traces:
        return None
    if len(traces) == 1:
        return traces[0].as_dict()
    steps, proposed, accepted = (sum(getattr(t, k) for t in traces) for k in ("verify_steps", "proposed", "accepted"))
    width = max(len(t.proposed_per_position) for t in traces)
    per = lambda k: [sum(getattr(t, k)[i] for t in traces if i < len(getattr(t, k))) for i in range(width)]  # noqa: E731
    return {"method": traces[0].method, "verify_steps": steps, "proposed": proposed, "accepted": accepted,
            "rejected": proposed - accepted, "accepted_per_position": per("accepted_per_position"),
            "proposed_per_position": per("proposed_per_position"),
            "mean_acceptance_length": round(1 + accepted / steps, 4) if steps else None,
            "events": [], "events_dropped": sum(len(t.events) + t.events_dropped for t in traces)}


def sequence_object(seq: SequenceFacts) -> dict:
    return {"clock": clock_json(seq.clock), "bill": seq.bill.as_dict(), "num_preemptions": seq.num_preemptions,
            "slo": seq.verdict.as_dict() if seq.verdict else None, "spec": spec_json([seq.spec])}


def twospeed_object(lane: str, sequences: list[SequenceFacts]) -> dict:
    """The object of a whole response: merged clock, summed bill, one verdict, and per choice when n > 1."""
    bills = [s.bill.as_dict() for s in sequences]
    bill = {k: sum(b[k] for b in bills) for k in bills[0]}
    verdicts = [s.verdict for s in sequences if s.verdict is not None]
    slo = None
    if verdicts:
        missed = [v for v in verdicts if not v.met]
        slo = {"lane": lane, "met": not missed, "cause": missed[0].cause if missed else None,
               "missed": sorted({m for v in missed for m in v.missed})}
    body = {"lane": lane, "clock": merged_clock_json([s.clock for s in sequences]), "bill": bill,
            "num_preemptions": sum(s.num_preemptions for s in sequences), "slo": slo,
            "spec": spec_json([s.spec for s in sequences])}
    if len(sequences) > 1:
        body["choices"] = [{"index": s.index, **sequence_object(s)} for s in sequences]
    return body


# -- reading it back ------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ClockReport:
    """The split clock as a response states it, in milliseconds (None where the request has no such time)."""

    queue_ms: float | None = None
    route_ms: float | None = None
    prefill_ms: float | None = None
    ttft_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    itl_max_ms: float | None = None
    tpot_ms: float | None = None
    ttlt_ms: float | None = None
    decode_steps: int | None = None
    interfered_steps: int | None = None
    longest_interfered_step_ms: float | None = None


@dataclass(frozen=True, slots=True)
class SLOReport:
    lane: str | None
    met: bool | None
    cause: str | None = None
    missed: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SpecReport:
    method: str | None
    verify_steps: int = 0
    proposed: int = 0
    accepted: int = 0
    mean_acceptance_length: float | None = None


@dataclass(frozen=True, slots=True)
class TwospeedReport:
    """A response's `twospeed` object, read."""

    lane: str | None
    clock: ClockReport | None
    bill: Bill | None
    num_preemptions: int = 0
    slo: SLOReport | None = None
    spec: SpecReport | None = None


_BILL_FIELDS = tuple(f.name for f in fields(Bill))


def read_clock(obj: dict) -> ClockReport:
    itl = obj.get("itl_ms") or {}
    return ClockReport(obj.get("queue_ms"), obj.get("route_ms"), obj.get("prefill_ms"), obj.get("ttft_ms"),
                       itl.get("p50"), itl.get("p99"), itl.get("max"), obj.get("tpot_ms"), obj.get("ttlt_ms"),
                       obj.get("decode_steps"), obj.get("interfered_steps"), obj.get("longest_interfered_step_ms"))


def read_twospeed(obj: dict | None) -> TwospeedReport | None:
    """A response's `twospeed` object (as written above) as typed fields; None for none. Keys a server of another
    version leaves out read as None (or 0 in the bill)."""
    if not isinstance(obj, dict) or not obj:
        return None
    clock, bill, slo, spec = obj.get("clock"), obj.get("bill"), obj.get("slo"), obj.get("spec")
    return TwospeedReport(
        lane=obj.get("lane"),
        clock=read_clock(clock) if isinstance(clock, dict) and clock else None,
        bill=Bill(**{k: int(bill.get(k) or 0) for k in _BILL_FIELDS}) if isinstance(bill, dict) and bill else None,
        num_preemptions=int(obj.get("num_preemptions") or 0),
        slo=SLOReport(slo.get("lane"), slo.get("met"), slo.get("cause"), tuple(slo.get("missed") or ()))
        if isinstance(slo, dict) else None,
        spec=SpecReport(spec.get("method"), int(spec.get("verify_steps") or 0), int(spec.get("proposed") or 0),
                        int(spec.get("accepted") or 0), spec.get("mean_acceptance_length"))
        if isinstance(spec, dict) else None)
