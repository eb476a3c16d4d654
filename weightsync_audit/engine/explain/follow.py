"""Parameters DDP does reduce that differ alongside ones it does not: a consequence, likely through clipping.

When a parameter outside DDP's reducer is stepped from local gradients, the parameters inside it agree
unless something couples them to the local gradients: clipping by the global gradient norm (the Hugging
Face Trainer's ``max_grad_norm``, on by default; Lightning's ``gradient_clip_val``) scales every gradient
by one factor computed from all of them, the unreduced ones included, so it differs per rank. Without
this rule those followers fell to the optimizer rules ("optimizer state loaded on some ranks only").
"""

from __future__ import annotations

from typing import Iterable

from weightsync_audit.engine.explain.evidence import Evidence
from weightsync_audit.text import brief_names

__all__ = ["followers", "followers_accounts", "followers_hint"]


def followers(ev: Evidence, unsynced: list[str]) -> list[str]:
    """Differing parameters the reducer covers, when ``unsynced`` (trainable ones it does not) differ too."""
    covered = ev.covered
    if not unsynced or covered is None:
        return []
    return [n for n in ev.open("param") if n in covered and n not in unsynced]


def followers_hint(names: list[str]) -> str:
    """The likely cause, worded."""
    return (
        f"{brief_names(names)} differ although DistributedDataParallel all-reduces their gradients, alongside "
        "parameters it does not: likely a consequence of those: clipping by the global gradient norm "
        "(the Hugging Face Trainer's max_grad_norm, Lightning's gradient_clip_val) scales every gradient by "
        "a factor computed from the unreduced ones too. The fix for those removes this as well."
    )


def followers_accounts(ev: Evidence, names: list[str]) -> Iterable[str]:
    """The followers and the optimizer state stepped from their gradients."""
    keep = set(names)
    return [*names, *(n for n in ev.names("optimizer") if n.rsplit(".", 1)[0] in keep)]
