"""One audit as its phases: prepare, agree, localize, measure, explain, record.

:class:`AuditRun` is built by :meth:`Auditor.audit <weightsync_audit.engine.auditor.Auditor.audit>` for a
single call and read top to bottom in :meth:`AuditRun.run`; each phase is one method that reads and writes
the run's fields (the state that flows between them), so what each phase needs and leaves is visible in
one place:

- **prepare**: this rank's manifest (cached while the structure holds), its digests and 72-byte summary;
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
import json
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import numpy as np
import torch
import xxhash
from torch import nn

from weightsync_audit.channel.star import Comm
from weightsync_audit.ddp.hints import explain
from weightsync_audit.engine.agreement.consensus import (
    HOLDERS_VALUE,
    PROTOCOL,
    PROTOCOL_FAILED,
    StructureDiff,
    SummaryVerdict,
    ValueDiff,
    structure_row,
    tie_detail,
)
from weightsync_audit.engine.agreement.failures import raise_failed, raise_out_of_step
from weightsync_audit.engine.agreement.rounds import agree, bucket_sketch, compare_structures, localize_values
from weightsync_audit.engine.agreement.sharded import compare_sharded, compared_counts, shard_names, sharded_notes
from weightsync_audit.engine.attribution.settle import attribute_into
from weightsync_audit.engine.config import AuditConfig
from weightsync_audit.engine.hashing.digest import overall_digest
from weightsync_audit.engine.hashing.manifest_cache import PreparedManifest
from weightsync_audit.engine.inventory.manifest import Entry, Manifest
from weightsync_audit.engine.inventory.replicas import reducing_engine
from weightsync_audit.engine.measure.finite import NonfiniteCount, apply_nonfinite, count_everywhere, nonfinite_row
from weightsync_audit.engine.measure.remote_gaps import measure_gaps, measure_held_gaps
from weightsync_audit.engine.measure.stability import apply_stability, reread_row, unstable_hints
from weightsync_audit.engine.measure.tolerance import apply_tolerance, drift_arguments
from weightsync_audit.engine.timeline.history import AuditHistory
from weightsync_audit.engine.timeline.pinpoint import Pinpoint, Pinpointer, mark_pinpoint
from weightsync_audit.engine.timeline.transient import find_transient, ring_word, transient_note
from weightsync_audit.reporting.record import AuditResult, Mismatch


class Engine(Protocol):
    """What a run reads of its :class:`~weightsync_audit.engine.auditor.Auditor` (no import back up)."""

    config: AuditConfig
    history: AuditHistory
    pinpointer: Pinpointer | None

    @property
    def comm(self) -> Comm: ...

    def slice_for(self, step: int | None) -> int: ...

    def prepare(self, module: nn.Module | None, optimizers: list[Any], *, ddp: Any) -> PreparedManifest: ...


__all__ = ["AuditRun", "Engine"]


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Hold the cyclic garbage collector while the manifest is built.

    A manifest allocates a small object per tensor; on a model of thousands of tensors the collector's
    repeated passes over the training process's heap cost more than the audit itself (measured: 2.3 of
    3.6 us per tensor). Nothing built here forms cycles, so nothing is kept longer than the audit.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class AuditRun:
    """One call of :meth:`Auditor.audit`: its inputs, the state its phases hand on, and the phases."""

    __slots__ = (
        "auditor",
        "blame",
        "buckets",
        "by_uid",
        "candidates",
        "checked",
        "comm",
        "ddp",
        "digests",
        "entries",
        "epoch",
        "failure",
        "hints",
        "hints_shared",
        "hook",
        "hosts",
        "mismatches",
        "module",
        "nonfinite",
        "notes",
        "optimizers",
        "peers",
        "pin",
        "prepared",
        "slice_index",
        "step",
        "structure_diffs",
        "t0",
        "transient",
        "union",
        "value_diffs",
        "verdict",
    )

    def __init__(
        self,
        auditor: Engine,
        module: nn.Module | None,
        optimizers: list[torch.optim.Optimizer],
        *,
        step: int | None,
        epoch: int | None,
        hook: str | None,
        ddp: Any,
    ) -> None:
        self.t0 = time.perf_counter()
        self.auditor, self.module, self.optimizers = auditor, module, optimizers
        self.step, self.epoch, self.hook = step, epoch, hook
        self.ddp = ddp  # the DDP wrapper, looked up once per audit and handed to every phase that reads it
        self.comm: Comm = auditor.comm
        self.slice_index = auditor.slice_for(step)
        self.failure: BaseException | None = None
        self.prepared = PreparedManifest.uncached(Manifest())
        self.digests = np.zeros(0, np.int64)
        self.verdict: SummaryVerdict | None = None
        self.candidates: tuple[int, ...] | None = None
        self.buckets = np.zeros(0, np.int64)
        self.entries: list[Entry] = []
        self.by_uid: dict[int, Entry] = {}
        self.value_diffs: list[ValueDiff] = []
        self.structure_diffs: list[StructureDiff] = []
        self.union: dict[str, int] | None = None
        self.peers: Any = None
        self.mismatches: list[Mismatch] = []
        self.checked: dict[str, int] = {}
        self.notes: list[str] = []
        self.hints: list[str] = []
        self.hints_shared = False
        self.pin: Pinpoint | None = None
        self.nonfinite: NonfiniteCount | None = None
        self.transient: dict[str, Any] | None = None
        self.hosts: dict[str, str] | None = None

    def phases(self) -> tuple[AuditResult, PreparedManifest]:
        """:meth:`run`, and the manifest this rank compared."""
        return self.run(), self.prepared

    def run(self) -> AuditResult:
        """The phases in order; the same on every rank."""
        summary = self.prepare()
        self.agree(summary)
        self.localize()
        self.measure()
        if self.auditor.config.check_finite:
            self.count_nonfinite()
        self.explain()
        return self.record()

    # -- prepare -------------------------------------------------------------------------------

    def prepare(self) -> np.ndarray:
        """This rank's digests and its fixed-size summary for the coordinator.

        A rank that cannot prepare its audit (a meta tensor, say) still takes part in the exchange,
        flagged, so that every rank raises together instead of the others waiting for it.
        """
        cfg = self.auditor.config
        structure = overall = 0
        try:
            with _gc_paused():
                prepared = self.auditor.prepare(self.module, self.optimizers, ddp=self.ddp)
                self.digests = prepared.digests(slice_index=self.slice_index, slices=cfg.slices, method=cfg.method)
                self.prepared = prepared
                structure = prepared.structure
                overall = overall_digest(self.digests, structure)
        except Exception as exc:  # noqa: BLE001 - re-raised in agree, after telling the other ranks
            self.failure = exc
            self.prepared, self.digests = PreparedManifest.uncached(Manifest()), np.zeros(0, np.int64)
            structure = overall = 0
        sketch, self.buckets = bucket_sketch(self.digests)
        pinpointer = self.auditor.pinpointer
        position = f"hook={self.hook} {cfg.fingerprint()}{pinpointer.position if pinpointer else ''}"
        return np.array(
            [
                PROTOCOL if self.failure is None else PROTOCOL_FAILED,
                -1 if self.step is None else int(self.step),
                -1 if self.epoch is None else int(self.epoch),
                self.prepared.size,
                structure,
                overall,
                xxhash.xxh3_64_intdigest(position.encode()) >> 1,
                self.slice_index,
                ring_word(pinpointer),
                *sketch.tolist(),  # where a divergence lies, to the bucket: localized a round sooner
            ],
            dtype=np.int64,
        )

    # -- agree ---------------------------------------------------------------------------------

    def agree(self, summary: np.ndarray) -> None:
        """The summaries meet; a failed or out-of-step rank makes every rank raise together."""
        agreed = agree(self.comm, summary)
        if agreed.failed:
            raise_failed(self.comm, self.failure)
        self.verdict, self.candidates = agreed.verdict, agreed.candidates
        if self.verdict.status == "out_of_step":
            position = {"step": self.step, "epoch": self.epoch, "hook": self.hook}
            position.update(config=self.auditor.config.fingerprint(), slice=self.slice_index)
            raise_out_of_step(self.comm, self.verdict.differing_fields, position)

    # -- localize ------------------------------------------------------------------------------

    def localize(self) -> None:
        """Off the healthy path: which tensors differ, on which ranks (and DTensors within peer sets)."""
        status = self.verdict.status if self.verdict is not None else "in_sync"
        prepared, comm = self.prepared, self.comm
        # The entries themselves are needed only off the healthy path (or for DTensors, never cached).
        diverged = status in ("values", "structure")
        self.entries = prepared.manifest.entries if diverged or prepared.sharded else []
        if status != "structure" and prepared.sharded:
            # Equal structures hold the same DTensors everywhere: every rank takes this step. Shards
            # differ by design, so the overall digests say nothing; compare within each peer set.
            self.value_diffs, self.peers = compare_sharded(comm, self.entries, self.digests)
        elif status == "values":
            uids = [e.uid for e in self.entries]
            self.value_diffs = localize_values(comm, uids, self.digests, self.candidates, self.buckets)
        elif status == "structure":
            g = comm.global_ranks
            rows = [structure_row(e, d, g) for e, d in zip(self.entries, self.digests.tolist())]
            self.structure_diffs, self.value_diffs, self.union = compare_structures(comm, rows)
        self.mismatches = [self._structure_mismatch(d) for d in self.structure_diffs]

    def _structure_mismatch(self, d: StructureDiff) -> Mismatch:
        return Mismatch(
            d.name,
            d.kind if d.detail.startswith(HOLDERS_VALUE) else "structure",  # a pipeline stage's own value
            list(d.ranks),
            list(d.reference_ranks),
            list(d.shape) if d.shape else None,
            d.dtype,
            None,
            tie_detail(d.tie, self.comm.global_ranks, d.detail),
        )

    # -- measure -------------------------------------------------------------------------------

    def measure(self) -> None:
        """Value mismatches with their gaps against the reference copy; ranks made global; tolerance."""
        comm = self.comm
        # Only on divergence: the lookup costs per tensor.
        self.by_uid = {e.uid: e for e in self.entries} if self.value_diffs else {}
        value_mismatches = []
        for d, shard in zip(self.value_diffs, shard_names(comm, self.value_diffs, self.by_uid)):
            e = self.by_uid[d.uid]
            tie = tie_detail(d.tie, comm.global_ranks)
            value_mismatches.append(
                Mismatch(
                    e.name, e.kind, list(d.ranks), list(d.reference_ranks), list(e.shape), e.dtype, None, tie, shard
                )
            )
        held = [(m, d.uid) for m, d in zip(self.mismatches, self.structure_diffs) if d.detail.startswith(HOLDERS_VALUE)]
        if held:  # a pipeline stage's own value, differing within its group: measured among its holders
            measure_held_gaps(comm, self.auditor.config, [m for m, _ in held], [u for _, u in held], self.entries)
        settled = None
        if value_mismatches:
            self._tally()  # the hints ride the gaps' last round, so what they say is known before it
            entries = [self.by_uid[d.uid] for d in self.value_diffs]
            cfg, n = self.auditor.config, len(entries)  # the odd ranks read the diverged tensors again
            again = reread_row(comm.rank, self.value_diffs, self.entries, self.digests,
                               slice_index=self.slice_index, slices=cfg.slices, method=cfg.method)  # fmt: skip

            def finish(measured: list[Mismatch], extra: np.ndarray) -> bytes:  # on the coordinator
                try:
                    self._apply_extra(measured, extra, n)
                    return self._hint_payload(self._settle(copy.deepcopy(self.mismatches) + measured))
                except Exception:  # noqa: BLE001 - every rank then asks for the hints in a round of their own
                    return b""

            # NaN/inf counts and second reads ride the gap layouts' round: one round, not three.
            extra = np.concatenate([nonfinite_row(entries), again])
            shared, settled = measure_gaps(comm, cfg, value_mismatches, entries, extra, finish)
            self._apply_extra(value_mismatches, shared, n)
        self.mismatches = self._settle(self.mismatches + value_mismatches)
        if settled is not None:
            self._take_hints(settled)

    def _apply_extra(self, mismatches: list[Mismatch], shared: np.ndarray, n: int) -> None:
        apply_nonfinite(self.comm.global_ranks, mismatches, shared[:, :n])  # which side holds NaN/inf
        apply_stability(mismatches, shared[:, n:])  # stable or not

    def _settle(self, mismatches: list[Mismatch]) -> list[Mismatch]:
        """Ranks made global (decided on positions in the group; reported, like every error, in global
        ranks), and the tolerance."""
        g = self.comm.global_ranks
        if g != tuple(range(self.comm.world_size)):
            for m in mismatches:
                m.ranks = [g[r] for r in m.ranks]
                m.reference_ranks = [g[r] for r in m.reference_ranks]
        apply_tolerance(mismatches, self.auditor.config.tolerance)
        return mismatches

    def count_nonfinite(self) -> None:
        """With ``check_finite``: the audited tensors holding NaN/inf (collective; the same on every rank)."""
        self.nonfinite = count_everywhere(self.comm, self.prepared)

    # -- explain -------------------------------------------------------------------------------

    def explain(self) -> None:
        """The pinpointed step, what was compared, notes, and (on a divergence) the shared hints."""
        cfg, comm, pinpointer = self.auditor.config, self.comm, self.auditor.pinpointer
        # Pinpoint is collective on a divergence (on shared data), so every rank settles it here.
        if pinpointer is not None:
            if not self.mismatches and self.verdict is not None and "ring" in self.verdict.differing_fields:
                names = [e.name for e in self.prepared.manifest.entries]
                self.transient = find_transient(comm, pinpointer, names)  # before settle forgets the ring
                self.notes.append(transient_note(self.transient))
                self.transient.pop("why", None)  # said in the note; the field keeps its three keys
            names = [m.name for m in self.mismatches]
            self.pin = pinpointer.settle(comm, bool(names), self.step, cfg.slices == 1, self._tolerated(), names)
        self._tally()
        if self.mismatches:
            if not self.hints_shared:
                self._share_hints()
            self.hints += unstable_hints(self.mismatches, self.hosts)
        self.blame = attribute_into(self)  # whom to blame, its hint, where the blamed run (None: in sync)

    def _tally(self) -> None:
        """What was compared, and the notes (once per audit)."""
        if self.checked:
            return
        cfg = self.auditor.config
        counts = self.prepared.counts()
        self.checked, unpaired = compared_counts(self.entries, self.peers) if self.peers is not None else (counts, 0)
        if self.union is not None:  # not this rank's own count: the same on every rank
            self.checked = {k: v for k, v in self.union.items() if not k.startswith("unreplicated:")}
            unpaired = {k.split(":", 1)[1]: v for k, v in self.union.items() if k.startswith("unreplicated:")}
        self.notes = (
            self.notes
            + list(self.prepared.notes)
            + sharded_notes(self.checked, unpaired, counts["param"], "params" in cfg.include)
        )

    def _tolerated(self) -> list[int] | None:
        """Manifest positions of the diverged tensors when every one is within the tolerance, else None."""
        if not self.mismatches or not all(m.within_tolerance for m in self.mismatches):
            return None
        position = {e.uid: i for i, e in enumerate(self.prepared.manifest.entries)}
        return [position[d.uid] for d in self.value_diffs if d.uid in position]

    def _share_hints(self) -> None:
        """Hints read a wrapper and notes a manifest: the first rank's are everyone's, so the record is the
        same on every rank (one small message, on divergence only, when the gaps' last round could not
        carry them)."""
        mine = self._hint_payload(self.mismatches) if self.comm.rank == 0 else None
        self._take_hints(self.comm.share_bytes(0, mine, "the hints"))

    def _hint_payload(self, mismatches: list[Mismatch]) -> bytes:
        """On the first rank: the hints, notes and where the odd ranks run. Nothing here may raise on that
        rank alone, or the others would wait for it."""
        hints: list[str] = []
        notes = list(self.notes)
        try:
            hints = explain(
                mismatches,
                ddp=self.ddp,
                grads_checked="grads" in self.auditor.config.include,
                params_compared=self.checked["param"] > 0,
                module=self.module,
                state_names=[e.name for e in self.entries if e.kind == "optimizer" and e.shard is None],
                engine=reducing_engine(self.module, self.optimizers),
                **drift_arguments(mismatches),  # a gap the size of float rounding reads as drift
            )
        except Exception as exc:  # noqa: BLE001 - a hint is not worth a hang
            notes.append(f"no hint: {type(exc).__name__}: {exc}")
        odd = sorted({r for m in mismatches for r in m.ranks})
        raw = json.dumps([hints, notes, self.comm.known_hosts(odd)]).encode()  # where the odd ranks run
        packed = b"z" + zlib.compress(raw, 6)  # the hints' words repeat: on the wire to every rank, it pays
        return packed if len(packed) < len(raw) else raw

    def _take_hints(self, payload: bytes) -> None:
        self.hints_shared = True
        self.hints, self.notes, hosts = json.loads(zlib.decompress(payload[1:]) if payload[:1] == b"z" else payload)
        self.hosts = hosts or None

    # -- record --------------------------------------------------------------------------------

    def record(self) -> AuditResult:
        """The result, the same on every rank, entered in the auditor's history."""
        cfg, history = self.auditor.config, self.auditor.history
        in_sync = not self.mismatches
        full = cfg.slices == 1
        result = AuditResult(
            in_sync=in_sync,
            step=self.step,
            epoch=self.epoch,
            world_size=self.comm.world_size,
            mismatches=self.mismatches,
            hints=self.hints,
            checked=self.checked,
            hook=self.hook,
            action="none",
            last_in_sync_step=self.step if in_sync else history.last_in_sync_step,
            last_full_sync_step=self.step if in_sync and full else history.last_full_sync_step,
            notes=self.notes,
            coverage=None if full else f"{self.slice_index + 1}/{cfg.slices}",
            tolerance=cfg.tolerance,
            transient=self.transient,
            hosts=self.hosts,
            blame=self.blame,
        )
        if self.nonfinite is not None:
            result.nonfinite_count = self.nonfinite.count
            result.notes.extend(self.nonfinite.notes(in_sync))
        mark_pinpoint(result, self.pin)
        history.record(result)
        result.duration_ms = (time.perf_counter() - self.t0) * 1e3
        return result
