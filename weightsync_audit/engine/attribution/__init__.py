"""Attribution: which rank is wrong, and whether it is the machine, told even between two replicas.

A vote needs a majority; two replicas never have one. Each rank's own timeline does: between two
optimizer steps its parameters and optimizer state must not change (:mod:`.watch`, at rest); from the
same reduced gradients and the same pre-step state every rank's update must give the same bytes, and
each rank can replay its own (:mod:`.replay`); the reduced gradient buckets must be equal everywhere
(:mod:`.replay`). Each rank records these locally, without a message, and only an audit that found
a divergence exchanges the records (:mod:`.settle`) and decides, from the same gathered data on every
rank, whom to blame and why (:mod:`.blame`). What to record is one :class:`AttributionConfig`, here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["AttributionConfig", "check_attribution", "RECHECK_BYTES"]


RECHECK_BYTES = 16 << 20
"""The replay's default budget per optimizer step: 16 MiB copied (parameters, gradients, optimizer state)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class AttributionConfig:
    """What each rank records, locally, to name the corrupted rank and tell the machine from the software.

    >>> AttributionConfig(recheck=8).fingerprint()
    ' attribution=rest,recheck/8/16777216'
    """

    at_rest: bool = True
    """Digest the parameters and optimizer state right before each optimizer step and compare them with
    this rank's own digests after the step before: a change while at rest (a bit flip, a stray write)."""
    collective: bool = False
    """A DDP communication hook digests every reduced gradient bucket (compared across ranks at a
    divergent audit: the all-reduce itself), and each rank digests its gradients right before the
    optimizer step (a gradient changed after the all-reduce, on this rank)."""
    recheck: int = 0
    """Replay the optimizer update of 1 in ``recheck`` parameters (rotating, per step) from a pre-step
    copy, and compare with the rank's own result: a non-reproducible update is the machine. 0: off;
    1: every parameter at every step, within ``recheck_bytes``."""
    recheck_bytes: int = RECHECK_BYTES
    """The replay's budget per optimizer step, in bytes copied (each covered parameter, its gradient and its
    optimizer state): parameters are taken in turn until it is spent, so over the steps every parameter
    smaller than it is replayed, at a bounded cost per step. A parameter larger than it is never replayed
    (the records say so). 0: no budget (``recheck`` alone decides)."""

    def __post_init__(self) -> None:
        for name, unit in (("recheck", "1 in n parameters"), ("recheck_bytes", "bytes per step")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"attribution {name}={value!r}: must be an integer >= 0 ({unit})")
        if not (self.at_rest or self.collective or self.recheck):
            raise ValueError("attribution: at_rest, collective and recheck are all off; pass attribution=False")

    def fingerprint(self) -> str:
        """Part of the audit position: every rank must watch alike (the records are exchanged)."""
        parts = (["rest"] if self.at_rest else []) + (["collective"] if self.collective else [])
        parts += [f"recheck/{self.recheck}/{self.recheck_bytes}"] if self.recheck else []
        return " attribution=" + ",".join(parts)


def check_attribution(value: Any, argument: str = "attribution") -> AttributionConfig | None:
    """``False``/``None`` (off), ``True`` (at rest, collective, and every update replayed in turn within
    :data:`RECHECK_BYTES` per step), a dict of
    :class:`AttributionConfig`'s fields, or one itself.

    >>> check_attribution({"recheck": 4}).recheck
    4
    """
    if value is None or value is False:
        return None
    if value is True:
        return AttributionConfig(at_rest=True, collective=True, recheck=1)
    if isinstance(value, AttributionConfig):
        return value
    if isinstance(value, dict):
        known = set(AttributionConfig.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise TypeError(f"{argument}: unknown field(s) {unknown}; the fields are {sorted(known)}")
        return AttributionConfig(**value)
    raise TypeError(f"{argument}={value!r}: pass True, False, a dict of fields or an AttributionConfig")
