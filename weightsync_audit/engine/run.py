"""One audit as its phases: prepare, agree, localize, measure, explain, record.

:class:`AuditRun` is built by :meth:`Auditor.audit <weightsync_audit.engine.auditor.Auditor.audit>` for a
single call (and, as its subclass ``OverlapRun``, by :meth:`Auditor.launch
<weightsync_audit.engine.auditor.Auditor.launch>`) and read top to bottom in :meth:`AuditRun.phases`. The
run holds one :class:`~weightsync_audit.engine.context.AuditContext`, everything it reads, set once; each phase is one method that takes the results of the phases before it and returns its own, a
small frozen value (:mod:`~weightsync_audit.engine.context`), so what each phase needs and leaves is its
signature:

- **prepare**: this rank's manifest (cached while the structure holds), its digests and 104-byte summary;
- **agree**: the summaries meet at the coordinator, which answers every rank the same verdict;
- **localize**: off the healthy path, which tensors differ on which ranks (digest columns, structures,
  DTensor peer sets);
- **measure**: the gap against the reference copy for the first few, and the tolerance;
- **explain**: the pinpointed step, counts, notes and the hints (the first rank's, shared);
- **record**: the :class:`~weightsync_audit.reporting.record.AuditResult`, the same on every rank.

Every rank takes every phase from the same gathered data, so no collective is entered by some ranks only.
"""

from __future__ import annotations

import copy
import gc
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

from weightsync_audit.engine.agreement.consensus import (
    HOLDERS_VALUE,
    PROTOCOL,
    PROTOCOL_FAILED,
    StructureDiff,
    ValueDiff,
    structure_row,
    tie_detail,
)
from weightsync_audit.engine.agreement.rounds import (
    Agreement,
    agree,
    bucket_sketch,
    compare_sharded,
    compare_structures,
    compared_counts,
    localize_values,
    raise_failed,
    raise_out_of_step,
    shard_names,
    sharded_notes,
)
from weightsync_audit.engine.attribution.settle import attribute_audit
from weightsync_audit.engine.context import AuditContext, Explained, Localized, Measured, Prepared, SharedHints, Tally
from weightsync_audit.engine.explain import Evidence, explain
from weightsync_audit.engine.hashing.digest import overall_digest
from weightsync_audit.engine.hashing.manifest_cache import PreparedManifest
from weightsync_audit.engine.inventory.manifest import Entry, Manifest
from weightsync_audit.engine.inventory.replicas import reducing_engine
from weightsync_audit.engine.measure import finite
from weightsync_audit.engine.measure.gaps import apply_tolerance, drift_arguments
from weightsync_audit.engine.measure.remote_gaps import measure_gaps, measure_held_gaps
from weightsync_audit.engine.timeline.answer import transient_note
from weightsync_audit.engine.timeline.pinpoint import mark_pinpoint
from weightsync_audit.engine.timeline.step_records import describe, shared_batches
from weightsync_audit.reporting.record import AuditResult, Mismatch

__all__ = ["AuditRun", "gc_paused"]


class gc_paused:  # named as the function it replaces: ``with gc_paused():``
    """Hold the cyclic garbage collector while the manifest is built.

    A manifest allocates a small object per tensor; on a model of thousands of tensors the collector's
    repeated passes over the training process's heap cost more than the audit itself (measured: 2.3 of
    3.6 us per tensor). Nothing built here forms cycles, so nothing is kept longer than the audit.
    """

    __slots__ = ("was",)

    def __enter__(self) -> None:
        self.was = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self.was:
            gc.enable()


@dataclass(frozen=True, slots=True, eq=False)
class AuditRun:
    """One audit over its :class:`~weightsync_audit.engine.context.AuditContext` (everything it reads, set
    once); each phase takes the frozen results of the phases before it (:mod:`~weightsync_audit.engine.context`)
    and returns its own."""

    context: AuditContext
    t0: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "t0", time.perf_counter())

    def run(self) -> AuditResult:
        """The phases in order; the same on every rank."""
        return self.phases()[0]

    def phases(self) -> tuple[AuditResult, PreparedManifest]:
        """:meth:`run`'s result, and the manifest this rank compared (what a resync right after it reads)."""
        ctx, prepared = self.context, self.prepare()
        agreement = self.agree(prepared)
        # With check_batches: ranks that trained on identical batches at this step (one round, every rank).
        shared = shared_batches(ctx.comm, ctx.batch) if ctx.config.check_batches else []
        found = self.localize(prepared, agreement)
        measured = self.measure(prepared, found)
        # With check_finite: the audited tensors holding NaN/inf (collective; the same on every rank).
        nonfinite = finite.count_everywhere(ctx.comm, prepared.manifest) if ctx.config.check_finite else None
        explained = self.explain(prepared, agreement, found, measured)
        return self.record(explained, nonfinite, shared), prepared.manifest

    # -- prepare -------------------------------------------------------------------------------

    def prepare(self) -> Prepared:
        """This rank's digests and its fixed-size summary for the coordinator.

        A rank that cannot prepare its audit (a meta tensor, say) still takes part in the exchange,
        flagged, so that every rank raises together instead of the others waiting for it.
        """
        ctx = self.context
        cfg = ctx.config
        failure: BaseException | None = ctx.failure
        try:
            if ctx.prepared is None:
                raise failure or RuntimeError("no manifest was prepared")
            manifest = ctx.prepared
            with gc_paused():
                digests = manifest.digests(slice_index=ctx.slice_index, slices=cfg.slices, method=cfg.method)
                structure, overall = manifest.structure, overall_digest(digests, manifest.structure)
        except Exception as exc:  # noqa: BLE001 - re-raised in agree, after telling the other ranks
            failure = exc
            manifest, digests = PreparedManifest.uncached(Manifest()), np.zeros(0, np.int64)
            structure = overall = 0
        else:
            failure = self.raced(manifest)
        sketch, buckets = bucket_sketch(digests)
        pinpointer = ctx.pinpointer
        position = f"hook={ctx.hook} {cfg.fingerprint()}{pinpointer.position if pinpointer else ''}"
        summary = np.array(
            [
                PROTOCOL if failure is None else PROTOCOL_FAILED,
                -1 if ctx.step is None else int(ctx.step),
                -1 if ctx.epoch is None else int(ctx.epoch),
                manifest.size,
                structure,
                overall,
                xxhash.xxh3_64_intdigest(position.encode()) >> 1,
                ctx.slice_index,
                0 if pinpointer is None else pinpointer.ring_word(),
                *sketch.tolist(),  # where a divergence lies, to the bucket: localized a round sooner
            ],
            dtype=np.int64,
        )
        return Prepared(manifest, digests, buckets, summary, failure)

    def raced(self, manifest: PreparedManifest) -> BaseException | None:
        """A write seen to the tensors while they were digested (an overlapped audit's), else ``None``."""
        return None

    # -- agree ---------------------------------------------------------------------------------

    def agree(self, prepared: Prepared) -> Agreement:
        """The summaries meet; a failed or out-of-step rank makes every rank raise together."""
        ctx = self.context
        agreement = agree(ctx.comm, prepared.summary)
        if agreement.failed:
            self.fail(prepared.failure)
        if agreement.status == "out_of_step":
            position = {"step": ctx.step, "epoch": ctx.epoch, "hook": ctx.hook}
            position.update(config=ctx.config.fingerprint(), slice=ctx.slice_index)
            raise_out_of_step(ctx.comm, agreement.differing_fields, position)
        return agreement

    def fail(self, failure: BaseException | None) -> None:
        """Some rank could not prepare its audit: every rank raises, after one round telling why."""
        raise_failed(self.context.comm, failure)

    # -- localize ------------------------------------------------------------------------------

    def localize(self, prepared: Prepared, agreement: Agreement) -> Localized:
        """Off the healthy path: which tensors differ, on which ranks (and DTensors within peer sets)."""
        status, manifest, comm = agreement.status, prepared.manifest, self.context.comm
        # The entries themselves are needed only off the healthy path (or for DTensors: their peer sets).
        diverged = status in ("values", "structure")
        entries = manifest.manifest.entries if diverged or manifest.sharded else []
        value_diffs: list[ValueDiff] = []
        structure_diffs: list[StructureDiff] = []
        union, peers = None, None
        if status != "structure" and manifest.sharded:
            # Equal structures hold the same DTensors everywhere: every rank takes this step. Shards
            # differ by design, so the overall digests say nothing; compare within each peer set.
            value_diffs, peers = compare_sharded(comm, entries, prepared.digests)
        elif status == "values":
            uids = [e.uid for e in entries]
            value_diffs = localize_values(comm, uids, prepared.digests, agreement.candidates, prepared.buckets)
        elif status == "structure":
            g = comm.global_ranks
            rows = [structure_row(e, d, g) for e, d in zip(entries, prepared.digests.tolist())]
            structure_diffs, value_diffs, union = compare_structures(comm, rows)
        structural = [self._structure_mismatch(d) for d in structure_diffs]
        return Localized(entries, value_diffs, structure_diffs, structural, union, peers)

    def _structure_mismatch(self, d: StructureDiff) -> Mismatch:
        return Mismatch(
            d.name,
            d.kind if d.detail.startswith(HOLDERS_VALUE) else "structure",  # a pipeline stage's own value
            list(d.ranks),
            list(d.reference_ranks),
            list(d.shape) if d.shape else None,
            d.dtype,
            None,
            tie_detail(d.tie, self.context.comm.global_ranks, d.detail),
        )

    # -- measure -------------------------------------------------------------------------------

    def measure(self, prepared: Prepared, found: Localized) -> Measured:
        """Value mismatches with their gaps against the reference copy; ranks made global; tolerance."""
        ctx, structural = self.context, found.structural
        comm, cfg = ctx.comm, ctx.config
        if not found.value_diffs and not structural:  # the healthy path: nothing to measure
            return Measured([], None, None)
        # Only on divergence: the lookup costs per tensor.
        by_uid = {e.uid: e for e in found.entries} if found.value_diffs else {}
        value_mismatches = []
        for d, shard in zip(found.value_diffs, shard_names(comm, found.value_diffs, by_uid)):
            e = by_uid[d.uid]
            tie = tie_detail(d.tie, comm.global_ranks)
            value_mismatches.append(
                Mismatch(
                    e.name, e.kind, list(d.ranks), list(d.reference_ranks), list(e.shape), e.dtype, None, tie, shard
                )
            )
        held = [(m, d.uid) for m, d in zip(structural, found.structure_diffs) if d.detail.startswith(HOLDERS_VALUE)]
        if held:  # a pipeline stage's own value, differing within its group: measured among its holders
            measure_held_gaps(comm, cfg, [m for m, _ in held], [u for _, u in held], found.entries)
        tally = shared = None
        stepped: list[Mismatch] = []
        if value_mismatches:
            # The hyper-parameters that differed at a step this audit covers (an lr set back since): collective.
            hyper = ctx.step_hyper
            step = ctx.step
            stepped = hyper.differed(comm, step, structural + value_mismatches) if hyper is not None else []
            tally = self.tally(prepared, found)  # the hints ride the gaps' last round: what they say is known
            entries = [by_uid[d.uid] for d in found.value_diffs]
            n = len(entries)  # the odd ranks read the diverged tensors again
            again = finite.reread_row(comm.rank, found.value_diffs, found.entries, prepared.digests,
                               slice_index=ctx.slice_index, slices=cfg.slices, method=cfg.method)  # fmt: skip

            def finish(measured: list[Mismatch], extra: np.ndarray) -> bytes:  # on the coordinator
                try:
                    self._apply_extra(measured, extra, n)
                    settled = self._settle(copy.deepcopy(structural) + measured + copy.deepcopy(stepped))
                    return self._hint_payload(settled, tally, found.entries)
                except Exception:  # noqa: BLE001 - every rank then asks for the hints in a round of their own
                    return b""

            # NaN/inf counts and second reads ride the gap layouts' round: one round, not three.
            extra = np.concatenate([finite.nonfinite_row(entries), again])
            gathered, settled = measure_gaps(comm, cfg, value_mismatches, entries, extra, finish)
            self._apply_extra(value_mismatches, gathered, n)
            shared = SharedHints.unpack(settled) if settled is not None else None
        return Measured(self._settle(structural + value_mismatches + stepped), tally, shared)

    def _apply_extra(self, mismatches: list[Mismatch], shared: np.ndarray, n: int) -> None:
        finite.apply_nonfinite(self.context.comm.global_ranks, mismatches, shared[:, :n])  # which side holds NaN/inf
        finite.apply_stability(mismatches, shared[:, n:])  # stable or not

    def _settle(self, mismatches: list[Mismatch]) -> list[Mismatch]:
        """Ranks made global (decided on positions in the group; reported, like every error, in global
        ranks), and the tolerance."""
        ctx = self.context
        g = ctx.comm.global_ranks
        if g != tuple(range(ctx.comm.world_size)):
            for m in mismatches:
                m.ranks = [g[r] for r in m.ranks]
                m.reference_ranks = [g[r] for r in m.reference_ranks]
        apply_tolerance(mismatches, ctx.config.tolerance)
        return mismatches

    # -- explain -------------------------------------------------------------------------------

    def explain(self, prepared: Prepared, agreement: Agreement, found: Localized, measured: Measured) -> Explained:
        """The pinpointed step, what was compared, notes, and (on a divergence) the shared hints."""
        ctx, mismatches = self.context, measured.mismatches
        cfg, comm, pinpointer = ctx.config, ctx.comm, ctx.pinpointer
        transient, pin, lead = None, None, []
        # Pinpoint is collective on a divergence (on shared data), so every rank settles it here.
        if pinpointer is not None:
            if not mismatches and "ring" in agreement.differing_fields:
                names = [e.name for e in prepared.manifest.manifest.entries]
                transient = pinpointer.find_transient(comm, names)  # before settle forgets the ring
                lead.append(transient_note(transient))
                transient.pop("why", None)  # said in the note; the field keeps its three keys
            names = [m.name for m in mismatches]
            tolerated = _tolerated(prepared.manifest, found.value_diffs, mismatches)
            pin = pinpointer.settle(comm, bool(names), ctx.step, cfg.slices == 1, tolerated, names)
        tally = measured.tally if measured.tally is not None else self.tally(prepared, found, lead)
        shared = measured.shared
        if mismatches and shared is None:  # the first rank's, to every rank
            mine = self._hint_payload(mismatches, tally, found.entries) if comm.rank == 0 else None
            shared = SharedHints.unpack(comm.share_bytes(0, mine, "the hints"))
        hints, notes, hosts = (
            (shared.hints, shared.notes, shared.hosts) if shared is not None else ([], tally.notes, None)
        )
        if mismatches:
            hints = hints + finite.unstable_hints(mismatches, hosts)
        # Whom to blame, its hint, where the blamed run (None: in sync); the watch's records consumed.
        blame, hosts, hints = attribute_audit(
            ctx.watch, comm, mismatches, prepared=prepared.manifest, digests=prepared.digests,
            full=cfg.slices == 1, hosts=hosts, hints=hints, request=ctx.request,
        )  # fmt: skip
        return Explained(mismatches, tally.checked, notes, hints, hosts, pin, transient, blame)

    def tally(self, prepared: Prepared, found: Localized, lead: Sequence[str] = ()) -> Tally:
        """What was compared, and the notes (``lead`` first): taken once per audit."""
        cfg = self.context.config
        counts = prepared.manifest.counts()
        checked, unpaired = compared_counts(found.entries, found.peers) if found.peers is not None else (counts, 0)
        if found.union is not None:  # not this rank's own count: the same on every rank
            checked = {k: v for k, v in found.union.items() if not k.startswith("unreplicated:")}
            unpaired = {k.split(":", 1)[1]: v for k, v in found.union.items() if k.startswith("unreplicated:")}
        notes = [
            *lead,
            *prepared.manifest.notes,
            *sharded_notes(checked, unpaired, counts["param"], "params" in cfg.include, cfg.include),
        ]
        return Tally(checked, notes)

    def _hint_payload(self, mismatches: list[Mismatch], tally: Tally, entries: list[Entry]) -> bytes:
        """On the first rank: the hints, notes and where the odd ranks run. Nothing here may raise on that
        rank alone, or the others would wait for it."""
        ctx = self.context
        hints: list[str] = []
        notes = list(tally.notes)
        try:
            evidence = Evidence(
                mismatches,
                ddp=ctx.ddp,
                grads_checked="grads" in ctx.config.include,
                params_compared=tally.checked["param"] > 0,
                params_audited="params" in ctx.config.include,
                module=ctx.module,
                state_names=[e.name for e in entries if e.kind == "optimizer" and e.shard is None],
                engine=reducing_engine(ctx.module, ctx.optimizers),
                **drift_arguments(mismatches),  # a gap the size of float rounding reads as drift
            )
            hints = explain(evidence)
        except Exception as exc:  # noqa: BLE001 - a hint is not worth a hang
            notes.append(f"no hint: {type(exc).__name__}: {exc}")
        odd = sorted({r for m in mismatches for r in m.ranks})
        return SharedHints(hints, notes, ctx.comm.known_hosts(odd)).pack()  # where the odd ranks run

    # -- record --------------------------------------------------------------------------------

    def record(
        self, explained: Explained, nonfinite: finite.NonfiniteCount | None, shared: Sequence[list[int]] = ()
    ) -> AuditResult:
        """The result, the same on every rank, entered in the auditor's history; ``shared``: the groups of
        ranks that trained on identical batches (``check_batches``)."""
        ctx = self.context
        cfg, history, step = ctx.config, ctx.history, ctx.step
        in_sync = not explained.mismatches
        full = cfg.slices == 1
        result = AuditResult(
            in_sync=in_sync,
            step=step,
            epoch=ctx.epoch,
            world_size=ctx.comm.world_size,
            mismatches=explained.mismatches,
            hints=explained.hints,
            checked=explained.checked,
            hook=ctx.hook,
            action="none",
            last_in_sync_step=step if in_sync else history.last_in_sync_step,
            last_full_sync_step=step if in_sync and full else history.last_full_sync_step,
            notes=explained.notes,
            coverage=None if full else f"{ctx.slice_index + 1}/{cfg.slices}",
            tolerance=cfg.tolerance,
            transient=explained.transient,
            hosts=explained.hosts,
            blame=explained.blame,
            nothing_compared=True if in_sync and not any(explained.checked.values()) else None,
        )
        if nonfinite is not None:
            result.nonfinite_count = nonfinite.count
            result.notes.extend(nonfinite.notes(in_sync))
        if shared:
            result.notes.append(describe(list(shared), -1 if step is None else step))
            batches = ctx.batches
            if batches is not None and ctx.comm.rank == 0:  # warned once per grouping, on the first rank
                batches.warn_new(list(shared), -1 if step is None else step)
        mark_pinpoint(result, explained.pin)
        hyper = ctx.step_hyper
        if hyper is not None:  # the steps this audit covered are consumed; agreement forgets what was found
            hyper.consumed(step, in_sync)
        history.record(result)
        result.duration_ms = (time.perf_counter() - self.t0) * 1e3
        return result


def _tolerated(
    manifest: PreparedManifest, value_diffs: list[ValueDiff], mismatches: list[Mismatch]
) -> list[int] | None:
    """Manifest positions of the diverged tensors when every one is within the tolerance, else None."""
    if not mismatches or not all(m.within_tolerance for m in mismatches):
        return None
    position = {e.uid: i for i, e in enumerate(manifest.manifest.entries)}
    return [position[d.uid] for d in value_diffs if d.uid in position]
