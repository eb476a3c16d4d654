"""Each rank's own timeline, recorded locally per optimizer step: :class:`StepWatch`.

Per optimizer step, with no message: right before it (an optimizer pre-step hook) the digests of the
parameters and optimizer state are compared with this rank's own digests taken right after the step
before (a post-step hook): a tensor that changed in between changed at rest. The hyperparameters are read
too (one changed at rest on some rank only is a software difference), and with ``collective`` the
gradients, once there (after the step's closure, where Lightning runs backward), are compared with what
the all-reduce gave (:mod:`.replay`). Right after the step the sampled update is replayed
(:mod:`.replay`). :meth:`StepWatch.mark` closes the step's record under the loop's step number, once per
optimizer step: a step marked again with no optimizer step since (gradient accumulation: Lightning's
``on_train_batch_end`` at every micro-batch, or a loop's ``no_sync`` micro-batches) leaves its record as it
is. Each step leaves one small record in a bounded ring; an in-sync audit empties it; a divergent audit
exchanges it (:mod:`.settle`), and an audit's own digests against the post-step ones say what changed
after the step. For what changed at rest, the record keeps how (:mod:`.records`): a version counter moved (a
write), how many elements and bits changed. With ``offload`` (what ``overlap=True`` sets) the at-rest reads
and the collective check's digests run on worker threads (:mod:`.offload`).

Nothing here breaks the user's step, and nothing fails in silence: a check that fails is written in the
step's record (``failed``, read by the blame) and warned about once; an update the replay cannot
reproduce faithfully (a closure optimizer such as ``LBFGS``) is declined, said in the record and warned
about once, and the other checks run as usual.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import replace
from typing import Any, Callable, Sequence

import numpy as np
import torch
import xxhash

from weightsync_audit.channel.store import Worker
from weightsync_audit.compat import tensor_version
from weightsync_audit.engine.attribution import AttributionConfig
from weightsync_audit.engine.attribution.atrest import AtRest
from weightsync_audit.engine.attribution.blame import Blame
from weightsync_audit.engine.attribution.records import MAX_NAMES, Change, StepRecord
from weightsync_audit.engine.attribution.replay import ReducedDigests, UpdateReplay, attach_collective
from weightsync_audit.engine.hashing.digest import digest_tensors, overall_digest
from weightsync_audit.engine.hashing.digest_plan import PreparedManifest
from weightsync_audit.engine.hashing.reader import readable
from weightsync_audit.engine.inventory.manifest import before_update, stepping_optimizer
from weightsync_audit.engine.inventory.peers import replicated_everywhere
from weightsync_audit.errors import warn_user

__all__ = ["StepWatch", "hyper_text"]

COPIES_WAIT_S = 30.0
"""How long the post-step hook waits for the offloaded check of the replay's copies (a worker that never
runs it leaves that step's check unknown, never wrong: the replay still runs after)."""


def hyper_text(optimizers: Sequence[torch.optim.Optimizer]) -> str:
    """Every group's hyperparameters (not its parameters), as text: what the update reads besides tensors."""
    parts = []
    for i, opt in enumerate(optimizers):
        for j, group in enumerate(opt.param_groups):
            for k in sorted(group):
                v = group[k]
                if k != "params" and isinstance(v, (int, float, bool, str, tuple, type(None))):
                    parts.append(f"{i}.{j}.{k}={v!r}")
    return "\n".join(parts)


def _changed(before: str, after: str) -> str:
    old = dict(p.split("=", 1) for p in before.splitlines() if "=" in p)
    new = dict(p.split("=", 1) for p in after.splitlines() if "=" in p)
    diff = [
        f"{k.split('.', 2)[2]} {old.get(k)} -> {new.get(k)}"
        for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k)
    ]
    return ", ".join(diff[:4])


def _word(text: str) -> int:
    return xxhash.xxh3_64_intdigest(text.encode()) >> 1


class StepWatch:
    """This rank's per-step records (a ring of ``capacity`` steps) and the hooks that take them.

    ``prepare()`` gives the audit's own manifest (cached while the structure holds): the at-rest digests
    are the audit's digests, of the parameters and optimizer state (buffers change in every forward).
    """

    def __init__(
        self,
        config: AttributionConfig,
        *,
        prepare: Callable[[], PreparedManifest],
        optimizers: Sequence[torch.optim.Optimizer],
        names: dict[int, str],
        capacity: int = 1024,
        method: str = "auto",
        offload: bool = False,
    ) -> None:
        self.config = config
        self.prepare = prepare
        self.optimizers = [stepping_optimizer(o) for o in optimizers]  # hooks where the step runs
        self.names = names
        self.method = method
        self.records: deque[StepRecord] = deque(maxlen=capacity)
        self.current: StepRecord | None = None
        """The step under way: opened by the first pre-step hook after a mark, closed by :meth:`mark`. A record is
        frozen: a later stage (a hook, a worker) replaces it, under :attr:`lock` (:meth:`_amend`)."""
        self.lock = threading.Lock()
        """Guards :attr:`current`, :attr:`records` and :attr:`steps_taken` together."""
        self.rest = AtRest(prepare, method, offload) if config.at_rest else None
        """The at-rest check (``offload``: its reads on a worker thread, :mod:`.offload`)."""
        self.last_hyper = ""
        self.last_step: int | None = None
        self.steps_taken = 0
        self.reduced = ReducedDigests()
        self.deferred = Worker("weightsync-audit-collective") if offload and config.collective else None
        """With ``offload``, the collective check's digests run on this worker (:class:`~weightsync_audit.channel.store.Worker`)."""
        self.reduced.deferred = self.deferred
        self.replay = (
            UpdateReplay(config.recheck, config.recheck_bytes, method, keep_words=offload and config.at_rest)
            if config.recheck
            else None
        )
        if self.replay is not None:
            self.replay.names = names
        self._handles: list[Any] = []
        self._copies_read: dict[int, threading.Event] = {}  # offloaded: the copies' check of a step under way
        self._reference_before: dict[str, torch.Tensor] = {}
        self._depth: dict[int, int] = {}
        self._copied: set[int] = set()  # optimizers whose replay copy this step has (a closure runs many times)
        self._grads_read = False  # the step under way's gradients checked (once: a closure runs many times)
        self._said: set[str] = set()
        self.hook_s = 0.0
        """Seconds this watch's optimizer hooks took on the training thread, in all (its cost on the critical
        path; the collective check's own is :attr:`ReducedDigests.hook_s`)."""
        self.audit_evidence: list[Change] = []
        """How the tensors :meth:`changed_since_mark` found last changed (exchanged with the records)."""
        self.found: tuple[Blame, dict[str, str], frozenset[tuple[str, int]]] | None = None
        """The blame of the divergence under way (every rank alike), where the blamed run, and the (tensor, rank)
        pairs it explains: later audits keep it while it explains theirs and their records name no one."""

    # -- hooks ---------------------------------------------------------------------------------

    def attach(self, ddp: Any = None, hook: Callable[..., Any] | None = None, state: Any = None) -> None:
        """Register the optimizer hooks (and, with ``collective`` and a DDP wrapper, the comm hook)."""
        for opt in self.optimizers:
            self._handles.append(opt.register_step_pre_hook(self._pre))
            self._handles.append(opt.register_step_post_hook(self._post))
        if self.config.collective and ddp is not None:
            try:
                attach_collective(ddp, self.reduced, hook, state)
            except (RuntimeError, ValueError) as exc:  # DDP runs another comm hook already: pass it as ``hook``
                warn_user(
                    f"weightsync audit: attribution's collective check is off ({exc}); pass your comm hook to "
                    "attach_watch(hook=...) so that it runs inside the check"
                )

    def baseline(self) -> None:
        """The bytes at rest now, read as after a step but into no record (the watch was just set: an adapter's
        first call comes right after a step), so that a change at rest before the next step is seen against them."""
        try:
            if self.rest is not None:
                self.rest.after_step(lambda *_: None)
        except Exception as exc:  # noqa: BLE001 - the watch never breaks the user's step
            self._failed(exc, "at-rest check after the step")

    def detach(self) -> None:
        """Remove the optimizer hooks (DDP keeps its comm hook: it cannot be removed), end an offloaded reader."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.rest is not None:
            self.rest.close()
        if self.deferred is not None:
            self.deferred.close()

    @property
    def _offloaded(self) -> bool:
        """The at-rest reads run on a worker (``offload``): the replay's copies are checked too."""
        return self.rest is not None and self.rest.reader is not None

    @property
    def last_post(self) -> np.ndarray | None:
        """This rank's at-rest digests right after the last step (None: none kept). Set to None to forget them
        (after a repair, what was kept is no longer what is held)."""
        if self.rest is None:
            return None
        self.rest.settle_post()
        return self.rest.post

    @last_post.setter
    def last_post(self, value: np.ndarray | None) -> None:
        if self.rest is not None:
            self.rest.settle_post()
            self.rest.post = value

    def _pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        # A subclass whose step calls super().step() runs the hooks again inside: only the outer call counts.
        self._depth[id(opt)] = self._depth.get(id(opt), 0) + 1
        if self._depth[id(opt)] > 1:
            return None
        t0 = time.perf_counter()
        try:
            if self.current is None:
                self.current = self._open_step()
        except Exception as exc:  # noqa: BLE001 - the watch never breaks the user's step
            self._failed(exc, "at-rest check before the step")
        self.hook_s += time.perf_counter() - t0
        return before_update(args, kwargs, lambda _: self._gradients(opt))  # a closure's gradients: after it

    def _gradients(self, opt: torch.optim.Optimizer) -> None:
        """Once the gradients are there: what the all-reduce gave against them, and the replay's copy (once per
        step: a closure optimizer such as LBFGS evaluates its closure several times in one step)."""
        t0 = time.perf_counter()
        try:
            if self.config.collective and self.current is not None and not self._grads_read:
                self._check_gradients()
        except Exception as exc:  # noqa: BLE001
            self._failed(exc, "collective check")
        try:
            if self.replay is not None and id(opt) not in self._copied:
                self._copied.add(id(opt))
                self.replay.before(opt)
                self._check_copies(opt)
        except Exception as exc:  # noqa: BLE001
            self._failed(exc, "update replay")
        self.hook_s += time.perf_counter() - t0

    def _check_copies(self, opt: torch.optim.Optimizer) -> None:
        """Offloaded at-rest check: the replay's pre-step copies against the post-step read, on the worker
        (inline without one); the replay waits for it before it updates the copies (:meth:`_after_step`)."""
        if not self._offloaded or self.replay is None or self.current is None:
            return
        pairs = [(self.names.get(id(real)), copy, tensor_version(real)) for real, copy in self.replay.copies(opt)]
        named = [(n, c, v) for n, c, v in pairs if n is not None]
        job, n = self.rest.copy_check(named, self._reference_before), self.steps_taken
        self._reference_before = {}
        if job is None:
            return
        if self.deferred is None:
            self._amend(n, job())
            return
        self._copies_read[id(opt)] = self.deferred.submit(lambda: self._amend(n, job())).done

    def _post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._depth[id(opt)] = self._depth.get(id(opt), 1) - 1
        if self._depth[id(opt)] > 0:
            return
        t0 = time.perf_counter()
        try:
            self._after_step(opt)
        finally:
            self.hook_s += time.perf_counter() - t0

    def _after_step(self, opt: torch.optim.Optimizer) -> None:
        n = self.steps_taken
        self._amend(n, stepped=True)
        done = self._copies_read.pop(id(opt), None)
        if done is not None:  # the copies are read before the replay updates them
            done.wait(timeout=COPIES_WAIT_S)
        if self.replay is not None and id(opt) in self._copied:
            self._copied.discard(id(opt))
            try:
                bad, r = self.replay.after(opt), self.replay
                self._amend(n, lambda rec: replace(
                    rec, covered=rec.covered + r.covered, replayable=rec.replayable + r.replayable,
                    too_large=rec.too_large + r.too_large, declined=r.declined or rec.declined,
                    update=rec.update + tuple(bad[:MAX_NAMES])))  # fmt: skip
                if r.declined:
                    self._say(f"attribution's update replay is off for it: {r.declined}")
            except Exception as exc:  # noqa: BLE001
                self._failed(exc, "update replay")
        if self.rest is not None:  # at rest from here: whatever runs before the next step must not write
            if self.replay is not None:  # offloaded: what the update wrote, read right after it
                self.rest.written.update(self.replay.words)
            try:
                self.rest.after_step(lambda word, how: self._amend(n, how, post=word))
            except Exception as exc:  # noqa: BLE001
                self._failed(exc, "at-rest check after the step")

    def _failed(self, exc: Exception, where: str) -> None:
        """A check that failed: written in the step's record (the blame reads it) and warned about once."""
        text = f"{type(exc).__name__}: {exc}"[:200]
        self._amend(self.steps_taken, failed=f"{where}: {text}")
        self._say(
            f"attribution's {where} failed ({text}); the records of this rank say so, and its blame may be undecided"
        )

    def _say(self, what: str) -> None:
        if what not in self._said:
            self._said.add(what)
            warn_user(f"weightsync audit: {what}")

    def _amend(self, n: int, how: Callable[[StepRecord], StepRecord] | None = None, **fields: Any) -> None:
        """A later stage's fields (``how``, then ``fields``) into the record of the step that was under way when
        :attr:`steps_taken` was ``n``: :attr:`current` while open (opened if need be), else marked in the ring."""
        with self.lock:
            back = self.steps_taken - n  # 0: the step under way; else its place from the ring's end
            if back > len(self.records):
                return  # let go of (the ring emptied, or full)
            rec = self.records[-back] if back else self.current or StepRecord()
            rec = replace(how(rec) if how else rec, **fields)
            if back:
                self.records[-back] = rec
            else:
                self.current = rec

    def _open_step(self) -> StepRecord:
        """The first pre-step hook of a step: what changed at rest, the hyperparameters, the gradients."""
        rec = StepRecord()
        reference = self.replay.reference if self.replay is not None else {}
        try:
            if self.rest is not None:
                rec = self.rest.before_step(reference)
        finally:
            if self._offloaded:
                self._reference_before = dict(reference)  # for the copies' check, then dropped
            reference.clear()  # the last step's post-step bytes: read, and now to be replaced
        hyper = hyper_text(self.optimizers)
        changed = _changed(self.last_hyper, hyper) if self.last_step is not None and hyper != self.last_hyper else None
        return replace(rec, hyper=_word(hyper), hyper_changed=changed, hyper_text=hyper[:2000])

    def _gradients_now(self) -> tuple[list[int], list[torch.Tensor], list[str]]:
        """The gradients every rank holds whole, as they are now: their parameters' ids, the tensors (a
        DTensor's: its local shard) and names."""
        params = [p for o in self.optimizers for g in o.param_groups for p in g["params"] if p.grad is not None]
        params = [p for p in params if replicated_everywhere(p.grad)]  # a shard's gradient is its rank's own
        names = [self.names.get(id(p), "?") for p in params]
        return [id(p) for p in params], [readable(p.grad, f"{n}.grad") for p, n in zip(params, names)], names

    def _check_gradients(self) -> None:
        """The gradients right before the step against what the all-reduce gave (on the worker with ``offload``,
        guarded by their version counters: gradients written before it read them leave the check unknown)."""
        (ids, grads, names), n = self._gradients_now(), self.steps_taken
        if self.deferred is None:
            self._amend(n, **self._gradient_fields(ids, grads, names, None))
        else:
            stamps = [tensor_version(g) for g in grads]
            self.deferred.submit(lambda: self._amend(n, **self._gradient_fields(ids, grads, names, stamps)))
        self._grads_read = True

    def _gradient_fields(
        self, ids: list[int], grads: list[torch.Tensor], names: list[str], stamps: list[int] | None, keep: bool = False
    ) -> dict[str, Any]:
        """The record's ``buckets``, ``grads`` and ``grads_changed`` (``keep``: the all-reduce's digests kept)."""
        buckets, reduced = self.reduced.take(wait=stamps is None, keep=keep)
        out: dict[str, Any] = {"buckets": tuple(sorted(buckets.items()))}
        mine = digest_tensors(grads) if grads else np.zeros(0, np.int64)
        if stamps is not None and [tensor_version(g) for g in grads] != stamps:
            return out  # written before the worker read them: unknown this step (``grads`` stays null)
        moved = [x for i, x, d in zip(ids, names, mine.tolist()) if reduced.get(i, d) != d]
        return {**out, "grads": int(overall_digest(mine, len(mine))), "grads_changed": tuple(moved[:MAX_NAMES])}

    # -- the step's end --------------------------------------------------------------------------

    def mark(self, step: int) -> None:
        """After every optimizer step (where pinpoint records): the record of the step closed under ``step``
        (its digests at rest were taken by the post-step hook). A mark with no optimizer step since the
        last is recorded too (a skipped step), unless it marks the step of the last record again (gradient
        accumulation): that step's record stands. A second optimizer step under the same step number
        (several optimizers, or a manual second step) is a record of its own (``seq``)."""
        self.last_hyper = hyper_text(self.optimizers)  # what the next step must find, unless changed at rest
        with self.lock:
            last = self.records[-1] if self.records else None
            if self.current is None and last is not None and last.step == int(step):
                return  # the same step marked again with no optimizer step since: idempotent
            again = last is not None and last.step == int(step)
            self.records.append(replace(self.current or StepRecord(), step=int(step), seq=last.seq + 1 if again else 0))
            self.current, self._grads_read = None, False
            self.last_step = int(step)
            self.steps_taken += 1

    def in_sync(self) -> None:
        """A full audit found every rank in sync: what came before is known good."""
        with self.lock:
            self.records.clear()

    def repaired(self) -> None:
        """A repair was confirmed (every rank holds the same values now): the records and the blame were about
        the divergence it ended, so they go; what is held now is the baseline the next step is checked
        against (the repair itself is no change at rest), and a step under way keeps no pre-repair digest."""
        with self.lock:
            self.records.clear()
        self.found = None
        if self.current is not None:
            self._amend(self.steps_taken, pre=None, rest=(), rest_count=0, rest_evidence=(), hyper_changed=None)
        self.last_hyper = hyper_text(self.optimizers)
        if self.replay is not None:
            self._rebase_reference(self.replay.reference)
        if self.rest is not None and self.last_post is not None:
            try:
                self.rest.rebase()
            except Exception as exc:  # noqa: BLE001 - the watch never breaks the user's step
                self.last_post = None
                self._failed(exc, "at-rest check after a repair")

    def _rebase_reference(self, reference: dict[str, torch.Tensor]) -> None:
        """After a repair, the replay's reference (what a change at rest is counted against, bits and
        elements) holds the repaired bytes, not the ones the repair replaced."""
        if not reference:
            return
        names = self.replay.names if self.replay is not None else {}
        for opt in self.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    name = names.get(id(p))
                    if name is None or name not in reference:
                        continue
                    reference[name] = p.detach().clone()
                    for k, v in opt.state.get(p, {}).items():
                        if f"{name}.{k}" in reference and isinstance(v, torch.Tensor):
                            reference[f"{name}.{k}"] = v.detach().clone()

    def changed_since_mark(self, prepared: PreparedManifest, digests: np.ndarray) -> list[str]:
        """The audit's own full digests against this rank's at rest after the last step: what changed since
        (how: :attr:`audit_evidence`)."""
        self.audit_evidence = []
        if self.rest is None:
            return []
        reference = self.replay.reference if self.replay is not None else {}
        names, self.audit_evidence = self.rest.since_step(prepared, digests, reference)
        return names

    def payload(self, under_way: bool = False) -> dict[str, Any]:
        """This rank's records since the last in-sync audit, to exchange (``under_way``: and the step under way's,
        for an audit right before that step: :meth:`under_way`)."""
        if self.rest is not None:
            self.rest.settle_post()  # offloaded: the last step's post-step word, read by now
        if self.deferred is not None:
            self.deferred.drain()  # offloaded: the collective check's words, read by now
        ahead = [self.under_way().as_dict()] if under_way else []
        with self.lock:
            records = [r.as_dict() for r in self.records]
        return {"records": records + ahead, "hyper": self.last_hyper}

    def under_way(self) -> StepRecord:
        """The step under way (numbered one more than the last) as an audit right before it reads it, the watch
        left as it is: its record so far (none before its hooks open it) and, unless its hooks read them
        already, its gradients against what the all-reduce gave, read now (its hooks read them again)."""
        rec = replace(self.current or StepRecord(), step=(self.last_step or 0) + 1)
        if not self.config.collective or self._grads_read:
            return rec
        try:
            return replace(rec, **self._gradient_fields(*self._gradients_now(), None, keep=True))
        except Exception as exc:  # noqa: BLE001 - evidence, never a failure of the audit
            return replace(rec, failed=f"collective check: {type(exc).__name__}: {exc}"[:200])
