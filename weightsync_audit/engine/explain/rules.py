"""The causes a hint can name, one rule each: the evidence it needs, the evidence that rules it out, its words.

:data:`RULES` lists them most specific first; :func:`~weightsync_audit.engine.explain.explain` is the loop
over them. A rule speaks when it finds mismatches it would explain (``needs``) and nothing gathered
rules it out (``ruled_out``); the names it accounts for are then closed to the rules after it, so each
mismatch feeds at most one parameter hint. Causes the wrapper proves come first and are stated as fact;
causes inferred from the pattern say "likely", and list only the explanations the evidence leaves open
(a wrapper whose reducer covers the parameters rules out "trainable set changed after the wrap";
optimizer state stepped from the gradients that agrees on every rank rules out unreduced gradients).

>>> [rule.cause for rule in RULES][:3]
['trainable on some ranks only', 'trainable after the DDP wrap', 'frozen after the DDP wrap']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from weightsync_audit.engine.explain.evidence import (
    Evidence,
    ddp_frozen_hint,
    ddp_unsynced_hint,
    fix_for,
    followers,
    followers_accounts,
    followers_hint,
    syncs_buffers,
    uses_fsdp2,
)
from weightsync_audit.text import BEFORE_STEP, brief_names

__all__ = ["RULES", "Names", "Rule", "worded"]

Names = list[str]

#: Name parts that mark an averaged copy of the weights (EMA, Polyak, target networks).
_EMA_MARKS = ("ema", "ewm", "shadow", "average", "averaged", "swa", "polyak", "target", "momentum_encoder")


def worded(template: str) -> Callable[[Evidence, Names], str]:
    """A rule's words when all they name of the evidence is the mismatches (``{names}``, briefly) and the
    sharding engine (``{engine}``)."""

    def says(ev: Evidence, names: Names) -> str:
        return template.format(names=brief_names(names), engine=ev.engine)

    return says


def _never(ev: Evidence, names: Names) -> bool:
    return False


def _themselves(ev: Evidence, names: Names) -> Iterable[str]:
    return names


def _nothing(ev: Evidence, names: Names) -> Iterable[str]:
    return ()


@dataclass(frozen=True)
class Rule:
    """One cause of replicas differing."""

    cause: str
    needs: Callable[[Evidence], Names]
    """The names this cause would explain, found from the evidence it needs (empty: it has nothing to say)."""
    says: Callable[[Evidence, Names], str]
    """The hint, for those names."""
    ruled_out: Callable[[Evidence, Names], bool] = _never
    """Whether the evidence gathered excludes this cause for those names: then it stays silent."""
    accounts: Callable[[Evidence, Names], Iterable[str]] = _themselves
    """The names it accounts for once it spoke, closed to the rules after it."""
    proven: bool = False
    """Stated as fact (read from the wrapper), not "likely"."""

    def find(self, ev: Evidence) -> tuple[str, Iterable[str]] | None:
        """The hint and the names it accounts for, or ``None`` when the cause has nothing to say."""
        names = self.needs(ev)
        if not names or self.ruled_out(ev, names):
            return None
        return self.says(ev, names), self.accounts(ev, names)


def _open(ev: Evidence, names: Names, candidates: Sequence[tuple[str, Callable[[Evidence, Names], bool]]]) -> Names:
    """The candidate explanations of a likely cause that the evidence leaves open for ``names``."""
    return [text for text, ruled_out in candidates if not ruled_out(ev, names)]


def _either(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + ", or " + items[-1]


def _wrapped(ev: Evidence, names: Names) -> bool:
    return ev.ddp is not None


# -- proven from the wrapper ------------------------------------------------------------------------


def _unsynced(ev: Evidence) -> Names:
    covered = ev.covered
    if covered is None:
        return []
    return [n for n in ev.diverged if ev.requires_grad(n) and n not in covered and n not in ev.ignored]


def _unsynced_accounts(ev: Evidence, names: Names) -> Iterable[str]:
    # Their optimizer state was stepped from local gradients too: the same cause.
    return [*names, *(n for n in ev.names("optimizer") if n.rsplit(".", 1)[0] in set(names))]


def _frozen_left(ev: Evidence) -> Names:
    covered = ev.covered
    if covered is None or not ev.diverged:
        return []
    return [n for n, p in ev.named.items() if n in covered and n not in ev.ignored and not p.requires_grad]


def _stalled(ev: Evidence, names: Names) -> Iterable[str]:
    # Their buckets were never all-reduced: the gradients that share them stayed local.
    covered = ev.covered or frozenset()
    return [n for n in ev.diverged if n in covered]


def _ignored(ev: Evidence) -> Names:
    if ev.ddp is None:
        return []
    return [n for n in ev.diverged if n in ev.ignored and n not in ev.explained]


def _frozen_on_some_ranks(ev: Evidence) -> Names:
    return [m.name for m in ev.by_kind.get("structure", []) if "requires_grad" in (m.detail or "")]


_PROVEN = (
    Rule(
        "trainable on some ranks only",
        needs=_frozen_on_some_ranks,
        says=worded(
            "{names} trainable on some ranks and frozen on others (requires_grad differs): "
            "freeze and unfreeze on every rank alike (the same code path, the same step); under DDP, "
            "re-wrap after a change of the trainable set (weightsync_audit.rewrap_ddp)"
        ),
        accounts=_nothing,  # the structure rule below still names the difference of structure
        proven=True,
    ),
    Rule(
        "trainable after the DDP wrap",
        needs=_unsynced,
        says=lambda ev, names: ddp_unsynced_hint(names, drifted=True, state=ev.state_keys(names), fix=fix_for(ev.ddp)),
        accounts=_unsynced_accounts,
        proven=True,
    ),
    Rule(
        "frozen after the DDP wrap",
        needs=_frozen_left,
        says=lambda ev, names: ddp_frozen_hint(names, fix=fix_for(ev.ddp)),
        # With find_unused_parameters=True the reducer marks a frozen parameter unused at each forward
        # and its bucket completes; only without it does freezing after the wrap hurt.
        ruled_out=lambda ev, names: bool(getattr(ev.ddp, "find_unused_parameters", False)),
        accounts=_stalled,
        proven=True,
    ),
    Rule(
        "reduced, but following unreduced ones",
        needs=lambda ev: followers(ev, _unsynced(ev)),
        says=lambda ev, names: followers_hint(names),
        accounts=followers_accounts,
    ),
    Rule(
        "ignored by DDP",
        needs=_ignored,
        says=worded(
            "{names} are in DistributedDataParallel's parameters_to_ignore "
            "(module._ddp_params_and_buffers_to_ignore): DDP neither broadcasts them nor all-reduces "
            "their gradients, so each rank trains its own copy. Remove them from the list, or reduce "
            "them yourself, if they should agree."
        ),
        proven=True,
    ),
)


# -- the pattern: drift, shards, structure, buffers -------------------------------------------------


def _buffers_under_fsdp2(ev: Evidence) -> Names:
    buffers = ev.open("buffer")
    return buffers if buffers and uses_fsdp2(ev.module) else []


def _buffers_unsynced_by(ev: Evidence) -> Names:
    buffers = ev.open("buffer")
    return buffers if buffers and ev.ddp is not None and not syncs_buffers(ev.ddp) else []


_PATTERN = (
    Rule(
        "numerical drift",
        needs=lambda ev: [n for n in ev.drifting if n not in ev.explained] if ev.drift_hint is not None else [],
        says=lambda ev, names: ev.drift_hint(names) if ev.drift_hint is not None else "",
    ),
    Rule(
        "replicated shards differ",
        needs=lambda ev: list(
            dict.fromkeys(m.name for m in ev.by_kind.get("param", []) if m.shard and m.name not in ev.explained)
        ),
        says=worded(
            "Shards of {names} differ between ranks that hold the same shard "
            "(replicas across the data-parallel / replicate dimension, or the tensor-parallel peers of a "
            "DP-only weight, which nothing keeps equal): likely non-deterministic kernels on some ranks "
            "(pytorch#160169), per-rank initialisation, or a checkpoint loaded on some ranks only."
        ),
    ),
    Rule(
        "different structures",
        needs=lambda ev: ev.names("structure"),
        says=worded(
            "The model or optimizer differs in structure between ranks ({names}: "
            "a tensor missing, or another shape or dtype): likely the ranks built different models "
            "(per-rank configuration), or a checkpoint or optimizer state was loaded on some ranks only."
        ),
        accounts=_nothing,  # a parameter's name: its value mismatch, if any, keeps its own hint
    ),
    Rule(
        "buffers under FSDP2",
        needs=_buffers_under_fsdp2,
        says=worded(
            "Buffers {names} differ under FSDP2 (fully_shard), which never synchronises "
            "buffers: each rank keeps the ones its own batches updated (BatchNorm running statistics, "
            "most likely). Reduce them yourself (e.g. all_reduce the running stats before evaluation or "
            "a checkpoint) if they should agree; exclude them if per-rank statistics are intended."
        ),
        proven=True,
    ),
    Rule(
        "buffers DDP does not sync",
        needs=lambda ev: _buffers_unsynced_by(ev),
        says=worded(
            "Buffers {names} differ and DistributedDataParallel runs with "
            "forward_sync_buffers=False (broadcast_buffers=False before torch 2.13), so each rank's own "
            "batches update them (BatchNorm running statistics, most likely). Use forward_sync_buffers=True "
            "or SyncBatchNorm if they should agree; exclude them if per-rank statistics are intended."
        ),
        proven=True,
    ),
    Rule(
        "buffers updated locally",
        needs=lambda ev: ev.open("buffer"),
        says=worded(
            "Buffers {names} differ: likely statistics updated from each rank's local data "
            "(BatchNorm running stats without buffer sync, i.e. forward_sync_buffers / broadcast_buffers, "
            "or SyncBatchNorm; an EMA or target network updated locally), or a buffer set differently per rank."
        ),
    ),
)


# -- the optimizer: named while its mismatches remain, the parameters that followed it included ------


def _is_lr(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ("lr", "initial_lr")


def _followers(ev: Evidence) -> tuple[Names, str, str]:
    """The parameters that followed an optimizer difference, and how the hint says where they stand."""
    followers = ev.open("param")
    if followers:
        state = f" and the parameters have followed ({brief_names(followers)})"
        return followers, state, " The differing parameters most likely follow from it."
    if ev.params_compared:
        return (
            followers,
            " while the parameters still agree",
            " The parameters will diverge at the next optimizer step.",
        )
    if not ev.params_audited:
        state = " (this audit, of the gradients before the optimizer step, does not compare the parameters)"
    else:
        state = " (no parameter could be compared: every parameter shard is held by one rank only)"
    return followers, state, " The parameters will diverge at the next optimizer step."


def _steps_read(ev: Evidence, names: Names) -> list[str]:
    """The steps at which ``names`` differed as the optimizer read them, when all of them agree again now."""
    details = [m.detail or "" for m in ev.by_kind.get("optimizer", []) if m.name in names]
    if not details or not all(d.startswith(BEFORE_STEP) for d in details):
        return []
    return list(dict.fromkeys(d[len(BEFORE_STEP) :].split()[0] for d in details))


def _say_lr(ev: Evidence, names: Names) -> str:
    _, state, then = _followers(ev)
    steps = _steps_read(ev, names)
    if steps:  # read by a step, set back since: the audit saw the lr equal again
        return (
            f"The learning rate differed as optimizer step {', '.join(steps)} read it ({brief_names(names)}; equal "
            f"again when audited, as a scheduler sets it at every step){state}: likely it was changed on some ranks "
            f"only before that step (a rank-dependent callback or branch), or a scheduler was built per rank.{then}"
        )
    return (
        f"The learning rate differs ({brief_names(names)}){state}: likely a scheduler stepped a different "
        f"number of times on some ranks, or was built per rank.{then}"
    )


def _say_optimizer_state(ev: Evidence, names: Names) -> str:
    _, state, then = _followers(ev)
    return (
        f"Optimizer state differs ({brief_names(names)}){state}: likely the optimizer state was loaded or "
        "reset on some ranks only (a checkpoint loaded on one rank), or a step was skipped on some "
        f"ranks (e.g. a GradScaler that saw inf on one rank only).{then}"
    )


_OPTIMIZER = (
    Rule(
        "learning rate differs",
        needs=lambda ev: [n for n in ev.open("optimizer") if _is_lr(n)],
        says=_say_lr,
        # The parameters follow from it; when optimizer state differs too, its hint names them instead.
        accounts=lambda ev, names: [
            *names,
            *(_followers(ev)[0] if all(_is_lr(n) for n in ev.open("optimizer")) else ()),
        ],
    ),
    Rule(
        "optimizer state differs",
        needs=lambda ev: [n for n in ev.open("optimizer") if not _is_lr(n)],
        says=_say_optimizer_state,
        accounts=lambda ev, names: [*names, *_followers(ev)[0]],
    ),
)


# -- what is left: gradients and parameters ----------------------------------------------------------


def _looks_averaged(name: str) -> bool:
    parts = name.lower().replace("-", "_").split(".")
    return any(p in _EMA_MARKS or p.startswith(("ema_", "ewm_")) or p.endswith("_ema") for p in parts)


#: Why gradients that differ at the step were likely not all-reduced, each with what rules it out.
_GRADS_NOT_REDUCED = (
    ("no DistributedDataParallel wrapper", _wrapped),
    ("no_sync() without a final synced backward", _never),
    ("a manual reduction that skips them", _never),
)
#: Why a differing parameter's gradients were likely not all-reduced, each with what rules it out.
_PARAMS_NOT_REDUCED = (
    ("trainable set changed after the DDP wrap", Evidence.reduced),
    ("no_sync() misuse", _never),
    ("a custom loop without DDP", _wrapped),
)


def _say_grads(ev: Evidence, names: Names) -> str:
    causes = _either(_open(ev, names, _GRADS_NOT_REDUCED))
    return f"Gradients differ ({brief_names(names)}) at the optimizer step: likely they are not all-reduced ({causes})."


def _say_state_agrees(ev: Evidence, names: Names) -> str:
    after = " after DDP's broadcast at wrap time" if ev.ddp is not None else ""
    return (
        f"Parameters {brief_names(names)} differ while the optimizer state stepped from their gradients "
        f"({', '.join(ev.state_keys(names))}) agrees on every rank: their gradients were all-reduced and no "
        f"optimizer step parted them, so likely they were edited, loaded or initialised on some ranks only{after}, "
        "or updated outside the optimizer from local values."
    )


def _say_params(ev: Evidence, names: Names) -> str:
    unreduced = ", ".join(_open(ev, names, _PARAMS_NOT_REDUCED))
    return (
        f"Parameters {brief_names(names)} differ: likely their gradients are not all-reduced ({unreduced}), "
        "they were loaded or initialised on some ranks only, or non-deterministic updates (EMA from local data)."
    )


_REST = (
    Rule("gradients differ", needs=lambda ev: ev.open("grad"), says=_say_grads, accounts=_nothing),
    Rule(
        "an averaged copy updated locally",
        needs=lambda ev: [n for n in ev.open("param") if _looks_averaged(n)],
        says=worded(
            "{names} differ and look like an averaged copy of the weights (EMA, SWA or a "
            "target network): likely each rank updates it from its own values (local batches, or before "
            "the gradients are all-reduced), and DDP never syncs it. Update it after optimizer.step() from "
            "the synced parameters, keep it on one rank only, or exclude it if per-rank copies are intended."
        ),
    ),
    Rule(
        "frozen parameters edited",
        needs=lambda ev: [n for n in ev.open("param") if ev.requires_grad(n) is False],
        says=worded(
            "{names} differ but do not require grad, so no optimizer step moved them: likely "
            "they were loaded, initialised or edited on some ranks only after DDP's broadcast at wrap time."
        ),
    ),
    Rule(
        "parameters parted while gradients agree",
        needs=lambda ev: ev.open("param") if ev.grads_checked else [],
        says=worded(
            "Gradients agree but parameters differ ({names}): likely the parameters were already "
            "different before this step (loaded or initialised on some ranks only) or the optimizer "
            "step differs (its state or learning rate)."
        ),
        ruled_out=lambda ev, names: bool(ev.grads),  # some gradients differ
    ),
    Rule(
        "parameters parted while their optimizer state agrees",
        needs=lambda ev: [n for n in ev.open("param") if ev.state_agrees(n)],
        says=_say_state_agrees,
        ruled_out=lambda ev, names: bool(ev.open("grad")),
    ),
    Rule(
        "parameters differ",
        needs=lambda ev: ev.open("param"),
        says=_say_params,
        ruled_out=lambda ev, names: bool(ev.open("grad")),  # the gradients' hint says it
    ),
)

RULES: tuple[Rule, ...] = (*_PROVEN, *_PATTERN, *_OPTIMIZER, *_REST)
"""Every cause, most specific first: the order in which :func:`~weightsync_audit.engine.explain.explain` asks."""
