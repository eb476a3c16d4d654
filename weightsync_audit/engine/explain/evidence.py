"""What the hints reason from: the mismatches of one audit, the live DDP wrapper and the optimizer state.

:class:`Evidence` is gathered once per :func:`~weightsync_audit.engine.explain.explain` call and read by every
rule in :mod:`~weightsync_audit.engine.explain.rules`; it also keeps the ledger of names a cause already
accounts for (``explained``), so that each mismatch feeds at most one parameter hint. What the wrapper
tells (the reducer's coverage, the ignore list) is read lazily: only a rule that needs it pays for it.

Two findings the rules and the DDP watch share live here too. **Followers**: when a parameter outside DDP's
reducer is stepped from local gradients, the parameters inside it agree unless something couples them to
the local gradients: clipping by the global gradient norm (the Hugging Face Trainer's ``max_grad_norm``,
Lightning's ``gradient_clip_val``) scales every gradient by one factor computed from all of them
(:func:`followers`). **A trainable set changed after the DDP wrap** (Lightning #20340): DDP builds its
reducer once, over the parameters that require grad then; a parameter unfrozen later is stepped from local
gradients on each rank, one frozen later stalls the bucket that holds it. The rules state these as fact
when the wrapper proves them, and the trainable-set watch (:mod:`weightsync_audit.ddp.inspect`) words the
change the same way when it sees it happen (:func:`ddp_unsynced_hint`, :func:`ddp_frozen_hint`).

What a DistributedDataParallel wrapper reduces, as an audit reads it, is read here too: the wrapper an
audit is given or finds in the module's wrapper chain (:func:`find_ddp`), followed from a wrapper a re-wrap
retired to its successor (:func:`live_ddp`), and, off the healthy path, which parameters its reducer
all-reduces (:func:`remembered_flags`, :func:`synced_parameter_names`) and whether it syncs buffers
(:func:`syncs_buffers`). Re-creating a wrapper and watching the trainable set are the DDP adapter's
(:mod:`weightsync_audit.ddp`); they write what is read here (:func:`mark_retired`, :func:`remember_flags`,
:data:`FIX_ATTR`).

>>> from weightsync_audit.reporting.record import Mismatch
>>> ev = Evidence([Mismatch("0.weight", "param", [1], [0])], state_names=["0.weight.exp_avg"])
>>> ev.open("param"), ev.state_agrees("0.weight")
(['0.weight'], True)
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, Callable, Collection, Iterable, Sequence

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from weightsync_audit.compat import ddp_reducer_parameter_ids, module_attr
from weightsync_audit.reporting.record import Mismatch
from weightsync_audit.text import brief_names

__all__ = [
    "FIX_ATTR",
    "GRADIENT_STATE",
    "Evidence",
    "ddp_frozen_hint",
    "ddp_unsynced_hint",
    "find_ddp",
    "fix_for",
    "followers",
    "followers_accounts",
    "followers_hint",
    "live_ddp",
    "mark_retired",
    "remember_flags",
    "remembered_flags",
    "synced_parameter_names",
    "syncs_buffers",
    "uses_fsdp2",
]

#: Attribute on a wrapper: the ``requires_grad`` flags of ``ddp.module.parameters()`` its reducer
#: was built over. Set by a re-wrap (known at construction) or, once, by the first read of the reducer.
_FLAGS_ATTR = "_weightsync_trainable_flags"
#: Attribute on a retired wrapper: True, or the wrapper that replaced it (see :func:`live_ddp`).
_SUCCESSOR_ATTR = "_weightsync_replaced_by"

#: Attribute on a wrapper: the fix its hints offer when its Trainer cannot re-wrap (the Hugging Face Trainer's).
FIX_ATTR = "_weightsync_fix"


def fix_for(ddp: object) -> str | None:
    """The fix a Trainer set on its wrapper (:data:`FIX_ATTR`), or ``None`` for the re-wrap fix."""
    return getattr(ddp, FIX_ATTR, None) if ddp is not None else None


def live_ddp(ddp: DistributedDataParallel | None) -> DistributedDataParallel | None:
    """The wrapper in use now: ``ddp``, or the one a re-wrap put in its place (followed to the end).

    ``None`` when ``ddp`` was retired and what replaced it is not known: nothing it says about gradient
    reduction holds any more.
    """
    seen = 0
    while ddp is not None and seen < 1000:
        nxt = getattr(ddp, _SUCCESSOR_ATTR, None)
        if nxt is None:
            return ddp
        ddp = nxt if isinstance(nxt, DistributedDataParallel) else None
        seen += 1
    return ddp


def mark_retired(ddp: DistributedDataParallel, replaced_by: DistributedDataParallel | None = None) -> None:
    """Mark ``ddp`` retired, linked to the wrapper that replaced it once that is known."""
    setattr(ddp, _SUCCESSOR_ATTR, replaced_by if replaced_by is not None else True)


def find_ddp(module: Any) -> DistributedDataParallel | None:
    """The live DistributedDataParallel wrapper for ``module``'s wrapper chain, if any.

    A wrapper that a re-wrap retired is followed to the one that replaced it (:func:`live_ddp`), so an
    ``Auditor`` bound to the old wrapper reads what reduces gradients now, never a retired reducer.
    """
    seen = 0
    while module is not None and seen < 16:
        seen += 1
        if isinstance(module, DistributedDataParallel):
            return live_ddp(module)
        nxt = None
        for attr in ("_forward_module", "_orig_mod", "module"):
            cand = module_attr(module, attr) if attr != "module" or isinstance(module, nn.DataParallel) else None
            if isinstance(cand, nn.Module):
                nxt = cand
                break
        module = nxt
    return None


def remembered_flags(ddp: DistributedDataParallel) -> tuple[bool, ...] | None:
    """The flags ``ddp``'s reducer was built over when already known (set by a re-wrap or a first read)."""
    return getattr(ddp, _FLAGS_ATTR, None)


def remember_flags(ddp: DistributedDataParallel, flags: tuple[bool, ...]) -> None:
    """Record on the wrapper the flags its reducer was built over (known at construction by a re-wrap)."""
    setattr(ddp, _FLAGS_ATTR, flags)


def synced_parameter_names(ddp: DistributedDataParallel) -> frozenset[str]:
    """Names of the parameters whose gradients ``ddp``'s reducer all-reduces.

    Reads the reducer's buckets; this allocates gradient-sized buffers, so it belongs on rare paths
    (after a divergence was found, once per wrapper), never on every step.
    """
    ids = ddp_reducer_parameter_ids(ddp)
    if ids is None:
        raise RuntimeError("this torch's DistributedDataParallel does not expose its reducer's buckets")
    return frozenset(n for n, p in ddp.module.named_parameters() if id(p) in ids)


def syncs_buffers(ddp: DistributedDataParallel) -> bool:
    """Whether DDP overwrites buffers from its first rank at each forward.

    torch 2.13 names the setting ``forward_sync_buffers`` (``broadcast_buffers`` is its deprecated alias).
    """
    value = getattr(ddp, "forward_sync_buffers", None)
    if value is None:
        value = getattr(ddp, "broadcast_buffers", True)
    return bool(value)


#: Per-parameter optimizer state that each step builds from the gradient (torch's optimizers and
#: Adafactor): equal on every rank only if the gradients that fed it were. ``step`` counts, it is not fed.
GRADIENT_STATE = frozenset(
    {
        "exp_avg",
        "exp_avg_sq",
        "max_exp_avg_sq",
        "exp_inf",
        "momentum_buffer",
        "square_avg",
        "grad_avg",
        "acc_delta",
        "sum",
        "prev",
        "row_var",
        "col_var",
        "variance",
    }
)


def uses_fsdp2(module: Any) -> bool:
    """Whether ``module`` (or a module inside it) is sharded by FSDP2's ``fully_shard``."""
    from torch.distributed.fsdp import FSDPModule  # lazy: the fsdp package costs ~0.3 s at import

    return isinstance(module, nn.Module) and any(isinstance(m, FSDPModule) for m in module.modules())


class Evidence:
    """The facts one set of hints is drawn from, and the names the causes found so far account for.

    ``mismatches``: what differs. ``ddp``: the wrapper of the audited module, if any (a retired one is
    followed to its successor, or not read). ``synced``: the parameter names DDP all-reduces when the
    caller already knows them (for example a snapshot taken right after the wrap); otherwise they are read
    from ``ddp``. ``grads_checked``: gradients were part of this audit, so "no grad mismatch" means they
    agree. ``params_compared``: at least one parameter was compared (not so when every shard has no
    replica), so "no param mismatch" means they agree. ``params_audited``: the audit was asked to compare
    parameters at all (the gradient audit before the step is not). ``module``: the audited module, to
    recognise FSDP2.
    ``drifting``: names whose measured gap is the size of float rounding; unless a proven cause accounts
    for them, ``drift_hint(names)`` explains them instead of the bug-class guesses.
    ``state_names``: the per-parameter optimizer state entries this audit compared on every rank
    (``0.weight.exp_avg``): what the hints may say of the optimizer, and state stepped from a parameter's
    gradients that agrees rules out unreduced gradients as the cause of that parameter's difference.
    ``engine``: the sharding engine holding the tensors (``"DeepSpeed ZeRO-2"``): its own reduction, not
    DDP's, is then what a differing parameter or gradient is read against.
    """

    def __init__(
        self,
        mismatches: Sequence[Mismatch],
        *,
        ddp: DistributedDataParallel | None = None,
        synced: frozenset[str] | None = None,
        grads_checked: bool = False,
        params_compared: bool = True,
        params_audited: bool = True,
        module: Any = None,
        drifting: Collection[str] = (),
        drift_hint: Callable[[list[str]], str] | None = None,
        state_names: Collection[str] = (),
        engine: str | None = None,
    ) -> None:
        self.mismatches = list(mismatches)
        self.engine = engine
        """The sharding engine holding the tensors (``"DeepSpeed ZeRO-2"``), ``None`` for plain replicas."""
        self.ddp = live_ddp(ddp)  # a retired wrapper proves nothing about the reduction that runs now
        self.synced = synced
        self.grads_checked = grads_checked
        self.params_compared = params_compared
        self.params_audited = params_audited
        self.module = module
        self.drifting = list(dict.fromkeys(drifting))
        self.drift_hint = drift_hint
        self.state_names = state_names
        self.by_kind: dict[str, list[Mismatch]] = {}
        for m in self.mismatches:
            self.by_kind.setdefault(m.kind, []).append(m)
        self.params = self.names("param")
        self.grads = self.names("grad")
        self.explained: set[str] = set()
        """Parameter (or gradient, or optimizer) names a cause already accounts for."""

    def names(self, kind: str) -> list[str]:
        """Every mismatch of ``kind``, explained or not."""
        return [m.name for m in self.by_kind.get(kind, [])]

    def open(self, kind: str) -> list[str]:
        """The mismatches of ``kind`` no cause accounts for yet."""
        return [m.name for m in self.by_kind.get(kind, []) if m.name not in self.explained]

    @property
    def diverged(self) -> list[str]:
        """Differing parameters and gradients, a parameter and its gradient named alike (once)."""
        return list(dict.fromkeys(self.params + self.grads))

    # -- the wrapper -------------------------------------------------------------------------------

    @cached_property
    def named(self) -> dict[str, nn.Parameter]:
        """The wrapped module's parameters by name (none without a live wrapper)."""
        return dict(self.ddp.module.named_parameters()) if self.ddp is not None else {}

    @cached_property
    def ignored(self) -> frozenset[str]:
        """What DDP was told to leave alone (``_ddp_params_and_buffers_to_ignore``)."""
        return frozenset(getattr(self.ddp, "parameters_to_ignore", ()) or ())

    @cached_property
    def covered(self) -> frozenset[str] | None:
        """Names DDP all-reduces: given, remembered by a re-wrap, or read from the reducer (rare path);
        ``None`` without a live wrapper or when the reducer cannot be read."""
        if self.ddp is None:
            return None
        if self.synced is not None:
            return self.synced
        try:
            flags = remembered_flags(self.ddp)
            if flags is not None:
                return frozenset(n for (n, _), f in zip(self.ddp.module.named_parameters(), flags) if f)
            return synced_parameter_names(self.ddp)
        except Exception:  # noqa: BLE001 - private reducer API; no hint rather than a crash
            return None

    def requires_grad(self, name: str) -> bool | None:
        """Whether the wrapped module's parameter ``name`` is trainable now (``None``: not one of its)."""
        p = self.named.get(name)
        return None if p is None else p.requires_grad

    def reduced(self, names: Sequence[str]) -> bool:
        """Whether the live wrapper's reducer is known to cover every one of ``names``."""
        covered = self.covered
        return covered is not None and all(n in covered for n in names)

    # -- the optimizer state -----------------------------------------------------------------------

    @cached_property
    def _state(self) -> dict[str, list[str]]:
        """Per parameter, the gradient-fed state keys known to exist: compared by this audit, or differing."""
        out: dict[str, list[str]] = {}
        for n in [*self.state_names, *self.names("optimizer")]:
            param, _, key = n.rpartition(".")
            if key in GRADIENT_STATE and key not in out.setdefault(param, []):
                out[param].append(key)
        return out

    @cached_property
    def _compared(self) -> frozenset[str]:
        return frozenset(self.state_names)

    @cached_property
    def _differing(self) -> frozenset[str]:
        return frozenset(m.name for m in self.mismatches)

    def state_keys(self, params: Sequence[str]) -> list[str]:
        """The gradient-fed optimizer state keys that ``params`` have (``exp_avg``...), in first-seen order."""
        return list(dict.fromkeys(k for p in params for k in self._state.get(p, ())))

    def state_agrees(self, param: str) -> bool:
        """Whether ``param`` has gradient-fed optimizer state that this audit compared and found equal
        on every rank: then the gradients that stepped it were equal too."""
        keys = [k for k in self._state.get(param, ()) if f"{param}.{k}" in self._compared]
        return bool(keys) and not any(f"{param}.{k}" in self._differing for k in keys)


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


_FIX = (
    "Fix: re-create the DDP wrapper whenever the trainable set changes: add "
    "weightsync_audit.DDPRewrapOnTrainableChange() to the Trainer's callbacks, or, in a plain loop, "
    "ddp = weightsync_audit.maybe_rewrap(ddp) (or rewrap_ddp(ddp)) on every rank after unfreezing or freezing."
)


def _resync_too(state: Sequence[str]) -> str:
    """The second half of the fix once replicas drifted, naming only optimizer state that exists."""
    stepped = (
        f"their {', '.join(state)} were stepped from local gradients too and bring"
        if state
        else "any state the optimizer keeps per parameter was stepped from local gradients too and brings"
    )
    return (
        " Re-wrapping stops new drift but does not undo what already differs: resync it once, optimizer state "
        f"included ({stepped} the drift back a few steps later): WeightSyncAudit(on_mismatch='resync'), or "
        "weightsync_audit.resync(model, optimizer, src='majority') on every rank right after the re-wrap."
    )


def ddp_unsynced_hint(
    unsynced: Sequence[str], *, drifted: bool = False, state: Sequence[str] = (), fix: str | None = None
) -> str:
    """The proven cause of Lightning #20340: trainable parameters outside DDP's reducer.

    ``drifted``: the replicas already differ, so the fix must also resync them, optimizer state included;
    ``state``: the optimizer state keys those parameters have (``exp_avg``...), named in that advice.
    ``fix``: the fix to offer instead of the re-wrap (a Trainer whose loop keeps its own wrapper), whole.

    >>> "Adam" in ddp_unsynced_hint(["fc.weight"], drifted=True)  # no optimizer named that is not known
    False
    """
    return (
        f"{brief_names(unsynced)} require grad, but DistributedDataParallel does not all-reduce their "
        "gradients: they became trainable after DDP wrapped the model (DDP builds its gradient reducer "
        "once, over the parameters that required grad then; BackboneFinetuning's unfreeze is one way), so "
        "each rank steps them with its own local gradient. "
        + (fix if fix is not None else _FIX + (_resync_too(state) if drifted else ""))
    )


def ddp_frozen_hint(left: Sequence[str], *, fix: str | None = None) -> str:
    """Parameters frozen after the wrap: DDP's reducer still waits for their gradients."""
    return (
        f"{brief_names(left)} were frozen after DistributedDataParallel wrapped the model; its reducer still "
        "expects their gradients, so the bucket holding them is never all-reduced (without "
        "find_unused_parameters=True the next forward fails with 'Expected to have finished reduction "
        f"in the prior iteration'). {_FIX if fix is None else fix}"
    )
