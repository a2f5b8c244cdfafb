"""Where every prompt and every sample attempt ends, so a run can show that nothing is lost.

A sample *attempt* is one request for one response. Each ends as exactly one :class:`Outcome`;
an attempt aborted (weight update, engine death) and sent again ends as ``aborted_resubmitted``
and its resubmission is a new attempt. A prompt ends once, with the outcome of its group (or
``error`` when no sample of it could be scored). At any moment::

    started == sum(ended) + in_flight + buffered          (for samples and for prompts alike)

:meth:`Ledger.check` asserts it; :meth:`Ledger.metrics` gives the counts for ``metrics.jsonl``.
"""
from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field


class Outcome(str, enum.Enum):
    TRAINED = "trained"
    DROPPED_STALE = "dropped_stale"  # older than buffer.max_staleness when the trainer took it
    DROPPED_FILTER = "dropped_filter"  # dynamic sampling: all rewards of the group equal
    ABORTED_RESUBMITTED = "aborted_resubmitted"  # cut off and sent again (sample attempts only)
    ERROR = "error"  # generation or reward failed


class AccountingError(AssertionError):
    """The ledger does not add up: a sample was lost or counted twice."""


@dataclass
class Tally:
    """Counts for one kind of item (prompts or sample attempts)."""

    started: int = 0
    in_flight: int = 0
    buffered: int = 0
    ended: Counter = field(default_factory=Counter)  # Outcome -> count

    def check(self, kind: str) -> None:
        total = sum(self.ended.values()) + self.in_flight + self.buffered
        if min(self.in_flight, self.buffered, *self.ended.values(), 0) < 0 or total != self.started:
            raise AccountingError(f"{kind}: started {self.started} != ended {dict(self.ended)} + in flight "
                                  f"{self.in_flight} + buffered {self.buffered}")


@dataclass
class Ledger:
    """Prompt and sample-attempt counts of one run (restored on resume through :meth:`state_dict`)."""

    prompts: Tally = field(default_factory=Tally)
    samples: Tally = field(default_factory=Tally)

    def started(self, prompts: int, samples: int) -> None:
        """Prompts and attempts sent to the engines."""
        for tally, n in ((self.prompts, prompts), (self.samples, samples)):
            tally.started += n
            tally.in_flight += n

    def resubmitted(self, n: int) -> None:
        """``n`` in-flight attempts were aborted and sent again: they end, their resubmissions start."""
        self.samples.ended[Outcome.ABORTED_RESUBMITTED] += n
        self.samples.started += n

    def returned(self, prompts: int, samples: int, errors: int) -> None:
        """A group came back: ``samples`` scored attempts enter the buffer, ``errors`` end as error.
        ``prompts`` is 1 when the group has a scored sample, else the prompt ends as error."""
        self.samples.in_flight -= samples + errors
        self.samples.buffered += samples
        self.samples.ended[Outcome.ERROR] += errors
        self.prompts.in_flight -= 1
        if prompts:
            self.prompts.buffered += 1
        else:
            self.prompts.ended[Outcome.ERROR] += 1

    def dropped_in_flight(self, samples: int, outcome: Outcome) -> None:
        """A group that never reached the buffer (filtered on arrival, or abandoned at shutdown)."""
        self.samples.in_flight -= samples
        self.samples.ended[outcome] += samples
        self.prompts.in_flight -= 1
        self.prompts.ended[outcome] += 1

    def left_buffer(self, samples: int, outcome: Outcome) -> None:
        """One group of ``samples`` scored attempts left the buffer as ``outcome``."""
        self.samples.buffered -= samples
        self.samples.ended[outcome] += samples
        self.prompts.buffered -= 1
        self.prompts.ended[outcome] += 1

    def check(self) -> None:
        self.prompts.check("prompts")
        self.samples.check("samples")

    def metrics(self) -> dict[str, int]:
        """``buffer/<outcome>`` (samples) and ``buffer/prompts_<outcome>`` totals, plus the live counts."""
        out = {f"buffer/{o.value}": self.samples.ended[o] for o in Outcome}
        out |= {f"buffer/prompts_{o.value}": self.prompts.ended[o] for o in Outcome if o != Outcome.ABORTED_RESUBMITTED}
        out |= {"buffer/samples_started": self.samples.started, "buffer/samples_buffered": self.samples.buffered,
                "buffer/samples_in_flight": self.samples.in_flight, "buffer/prompts_started": self.prompts.started}
        return out

    def state_dict(self, carried: dict[str, tuple[int, int]] | None = None) -> dict:
        """Plain-typed counts for a checkpoint. ``carried``: the (in flight, buffered) prompts and samples
        the checkpoint carries (:class:`megarl.pipeline.carried.CarriedRollouts`), which count as in
        flight and buffered on resume; the other in-flight and buffered items are not in the checkpoint:
        their prompts are re-queued on resume, so they count as not started."""
        carried = carried or {}

        def plain(t: Tally, kept: tuple[int, int]) -> dict:
            ended = {o.value: t.ended[o] for o in Outcome}
            return {"started": t.started - (t.in_flight - kept[0]) - (t.buffered - kept[1]), "ended": ended,
                    "in_flight": kept[0], "buffered": kept[1]}
        return {kind: plain(getattr(self, kind), carried.get(kind, (0, 0))) for kind in ("prompts", "samples")}

    @classmethod
    def from_state_dict(cls, state: dict) -> Ledger:
        def tally(d: dict) -> Tally:
            return Tally(started=d["started"], in_flight=d.get("in_flight", 0), buffered=d.get("buffered", 0),
                         ended=Counter({Outcome(k): v for k, v in d["ended"].items()}))
        ledger = cls(prompts=tally(state["prompts"]), samples=tally(state["samples"]))
        ledger.check()
        return ledger
