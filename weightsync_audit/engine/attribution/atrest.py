"""The at-rest check of one rank: :class:`AtRest`, its digests right after each step and right before the next.

Synchronously both reads run on the training thread, in the optimizer's post- and pre-step hooks. With
``offload`` (the watch of an ``overlap=True`` run) they run on a worker (:mod:`.offload`), and the
training thread keeps only the cached structure check, the small tensors and the version counters.
Either way the step's record gets the same fields: ``post`` and ``pre`` (one word each, compared across
ranks at a divergent audit), and for what changed in between ``rest`` (names), ``rest_count`` and
``rest_evidence`` (how it changed). The positions and names of what is checked are taken from the manifest
once per structure, not per step.

How it changed, a write or a bit flip, is told by :mod:`.records`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Sequence

import numpy as np
import torch

from weightsync_audit.compat import tensor_version
from weightsync_audit.engine.attribution.offload import RestReader
from weightsync_audit.engine.attribution.records import MAX_NAMES, Change, StepRecord, change_evidence
from weightsync_audit.engine.hashing.digest import digest_tensors, overall_digest
from weightsync_audit.engine.hashing.digest_plan import PreparedManifest

__all__ = [
    "at_rest_positions",
    "AtRest",
    "PostWord",
    "rest_evidence",
    "tensors_at",
    "versions",
]
_PARAM = torch.nn.Parameter
PostWord = Callable[[int, "Callable[[StepRecord], StepRecord] | None"], None]
"""Where a step's post-step word goes, with how its record completes (None: as it is)."""


def _with_rest(found: Sequence[Change], word: int) -> Callable[[StepRecord], StepRecord]:
    """How a step's record takes changes at rest found after it was opened: their names and evidence, and the
    ``pre`` word that holds them."""

    def add(rec: StepRecord) -> StepRecord:
        new = [e for e in found if e.name not in rec.rest]
        rest, evidence = (*rec.rest, *(e.name for e in new)), (*rec.rest_evidence, *new)
        return replace(rec, pre=word, rest=rest[:MAX_NAMES], rest_count=rec.rest_count + len(new),
                       rest_evidence=evidence[:MAX_NAMES])  # fmt: skip

    return add


def at_rest_positions(entries: Any) -> list[int]:
    """The manifest positions that must not change between steps: parameters and optimizer state (not the
    buffers, which every forward may write, nor the hyperparameters, watched apart)."""
    return [i for i, e in enumerate(entries) if e.kind in ("param", "optimizer") and "param_groups." not in e.name]


class AtRest:
    """The post-step digests of the last step, its version counters, and the comparison before the next."""

    def __init__(self, prepare: Callable[[], PreparedManifest], method: str = "auto", offload: bool = False) -> None:
        self.prepare = prepare
        self.method = method
        self.reader = RestReader(method) if offload else None
        self.post: np.ndarray | None = None
        """This rank's digests right after the last step (at-rest positions, in order)."""
        self.structure = 0
        self.keep: list[int] = []
        self.names: list[str] = []
        self.versions: np.ndarray | None = None
        """Every manifest tensor's version counter right after the last step (:func:`.rest.versions`)."""
        self.pre_now: np.ndarray | None = None
        """Offloaded: what the pre-step hook took the bytes before this step to be (the late read, or the
        post-step read with the tensors whose counter moved read again); :meth:`copy_check` completes it."""
        self.stamps_before: np.ndarray | None = None  # offloaded: the counters in the pre-step hook
        self._layout: tuple[int, list[int], list[str], list[tuple[int, int]]] | None = None
        self._where: tuple[Any, Any, np.ndarray] | None = None  # plan, layout: :meth:`_source_of`
        # _left_alone's: the source map it was built from, the parameters' places and their sources
        self._params: tuple[np.ndarray, np.ndarray, list[int]] | None = None
        self._skipped: np.ndarray | None = None  # offloaded: the at-rest parameters the step left without a gradient
        self._index: tuple[int, dict[str, int]] | None = None  # :meth:`_name_index`
        self._window: PreparedManifest | None = None  # offloaded: what the worker reads
        self._awaiting: PostWord | None = None  # offloaded: where the worker's ``post`` word goes
        self.read: np.ndarray | None = None
        """Offloaded: the worker's post-step read as it read it (the bytes before the next step, but for what a
        write moved since), where :attr:`post` holds what the step wrote."""
        self.written: dict[str, tuple[int, int]] = {}
        """Name -> the digest of what the last step wrote, read right after it by the update replay (the tensors
        whose replay reproduced), and the id of the tensor it read; offloaded, the step's post-step bytes where
        the worker's read came later."""

    def layout(self, prepared: PreparedManifest) -> tuple[list[int], list[str]]:
        """The at-rest positions and names of ``prepared``'s manifest (built once per structure)."""
        if self._layout is None or self._layout[0] != prepared.structure:
            entries = prepared.manifest.entries
            keep = at_rest_positions(entries)
            params = [(i, pos) for i, pos in enumerate(keep) if entries[pos].kind == "param"]
            self._layout = (prepared.structure, keep, [entries[i].name for i in keep], params)
        return self._layout[1], self._layout[2]

    def _left_alone(self, prepared: PreparedManifest) -> np.ndarray | None:
        """Right after a step: which at-rest tensors are parameters without a gradient, which no optimizer writes
        (a frozen one); None when the sources are not at hand."""
        sources = prepared.sources
        src = self._source_of(prepared)
        if src is None or self._layout is None:
            return None
        if self._params is None or self._params[0] is not src:
            # The parameters themselves only (a shard's or a partition's view holds no gradient, which says
            # nothing of whether the step wrote it).
            pairs = [
                (i, int(src[i])) for i, _ in self._layout[3] if src[i] >= 0 and isinstance(sources[src[i]], _PARAM)
            ]
            self._params = (src, np.array([i for i, _ in pairs], dtype=np.intp), [j for _, j in pairs])
        at, where = self._params[1], self._params[2]
        out = np.zeros(len(self.keep), dtype=bool)
        out[at] = np.fromiter((sources[j].grad is None for j in where), bool, len(where))
        return out

    def _source_of(self, prepared: PreparedManifest) -> np.ndarray | None:
        """Where each at-rest tensor is among ``prepared``'s plan's sources (-1: not one), built once per plan and
        layout; None when the sources are not at hand."""
        sources, plan = prepared.sources, prepared.plan
        if self._layout is None or not len(sources) or len(sources) != len(plan.all_index):
            return None
        if self._where is None or self._where[0] is not plan or self._where[1] is not self._layout:
            source = {int(pos): j for j, pos in enumerate(plan.all_index)}
            self._where = (plan, self._layout, np.array([source.get(p, -1) for p in self._layout[1]], dtype=np.intp))
        return self._where[2]

    def _name_index(self) -> dict[str, int]:
        """Name -> position among the at-rest tensors (:attr:`names`), built once per structure."""
        if self._index is None or self._index[0] != self.structure:
            self._index = (self.structure, {n: i for i, n in enumerate(self.names)})
        return self._index[1]

    def after_step(self, post: PostWord) -> None:
        """The optimizer's post-step hook: this rank's bytes at rest from here, their word handed to ``post``
        (now, or offloaded once the worker's read is settled: :meth:`settle_post`, with how the step's record
        completes)."""
        self.post = self.versions = None
        prepared = self.prepare()
        self.keep, self.names = self.layout(prepared)
        self.structure = prepared.structure
        self.versions = versions(prepared)
        if self.reader is not None:
            self._window, self._awaiting, self._skipped = prepared, post, self._left_alone(prepared)
            self.reader.launch(prepared, self.keep, stamp=lambda: versions(prepared), stamped=self.versions)
            return
        self.post = prepared.digests(method=self.method)[self.keep]
        post(overall_digest(self.post, prepared.structure), None)

    def settle_post(self) -> None:
        """Offloaded: the worker's post-step read, waited for, its word handed on to its step's record."""
        if self.reader is not None and self._awaiting is not None:
            into, self._awaiting = self._awaiting, None
            self.read, raced = self.reader.post()
            self.post = self.read.copy() if self.read is not None else None
            if self.post is not None:
                unknown = raced & ~self._as_written() if raced is not None else None
                if unknown is not None and unknown.any():  # written before it was read: the bytes after the
                    self.post = np.where(unknown, ~self.post, self.post)  # step unknown, so changed
                else:
                    into(overall_digest(self.post, self.structure), self._unwritten_changed())
        self.written = {}

    def _as_written(self) -> np.ndarray:
        """Offloaded: a tensor the replay read right after the update holds, for the step, the bytes it read
        there. A later read by the worker that differs came after a change at rest (a flip or a write right
        after the update): the step's post-step word keeps the written bytes, and the next pre-step read finds
        the change, in the next step's record, as the synchronous check does. Where they were so set."""
        known = np.zeros(len(self.post) if self.post is not None else 0, dtype=bool)
        src = self._source_of(self._window) if self.written and self._window is not None else None
        if src is None or self.post is None:
            return known
        sources, index = self._window.sources, self._name_index()
        for name, (word, tensor) in self.written.items():
            i = index.get(name)  # the very tensor the at-rest check reads (never a shard's or a partition's view)
            if i is not None and src[i] >= 0 and id(sources[src[i]]) == tensor:
                self.post[i], known[i] = word, True
        return known

    def _unwritten_changed(self) -> Callable[[StepRecord], StepRecord] | None:
        """Offloaded: the parameters the step did not write (no gradient after it, no counter moved across it: a
        frozen one) whose late post-step read differs from their bytes before the step changed at rest in the
        window, where the replay's copies (of what it updates) do not look: how the step's record completes."""
        pre, before, after, post, skipped = self.pre_now, self.stamps_before, self.versions, self.post, self._skipped
        if pre is None or before is None or after is None or post is None or skipped is None:
            return None
        if len(before) != len(after) or not len(pre) == len(post) == len(skipped):
            return None
        keep = np.asarray(self.keep, dtype=np.intp)
        changed = np.nonzero(skipped & (before[keep] == after[keep]) & (post != pre))[0]
        if not len(changed):
            return None
        pre = pre.copy()
        pre[changed] = post[changed]
        return _with_rest([Change(self.names[i], moved=False) for i in changed], overall_digest(pre, self.structure))

    def before_step(self, reference: dict[str, Any]) -> StepRecord:
        """The optimizer's pre-step hook: the step's record opened, ``pre`` and what changed since the post-step read."""
        rec, moved, read = StepRecord(), [], False
        if self.reader is None:
            prepared = self.prepare()
            keep, names = self.layout(prepared)
            pre = prepared.digests(method=self.method)[keep]
        else:
            self.settle_post()
            _, late = self.reader.collect()
            prepared, keep, names = self._window, self.keep, self.names
            self._window = None
            if prepared is None or self.post is None or self.versions is None:
                return rec
            seen = late if late is not None else self.read  # the bytes read last, after the step
            pre = (seen if seen is not None else self.post).copy()
            # a late read, or a post-step read that saw other bytes than the step wrote (a change right after it)
            read = late is not None or (seen is not None and bool((seen != self.post).any()))
            rec = StepRecord(rest_read="late" if late is not None else "counters")
            now = versions(prepared)  # a write through torch anywhere in the window: its counter moved
            self.stamps_before = now
            moved = [i for i, pos in enumerate(keep) if now[pos] != self.versions[pos]]
            if moved:
                pre[moved] = digest_tensors(tensors_at(prepared, [keep[i] for i in moved]), method=self.method)
        self.pre_now = pre if self.reader is not None else None
        if self.reader is None or read or moved:
            # without a read after the step nothing says what the bytes were before the next, but for the counters
            rec = replace(rec, pre=overall_digest(pre, prepared.structure))
        post = self.post
        if post is None or prepared.structure != self.structure or len(pre) != len(post):
            return rec
        changed = np.nonzero(pre != post)[0].tolist()
        if not changed:
            return rec
        rest = tuple(names[i] for i in changed[:MAX_NAMES])
        evidence = rest_evidence(prepared, [keep[i] for i in changed[:MAX_NAMES]], rest, self.versions, reference)
        return replace(rec, rest=rest, rest_count=len(changed), rest_evidence=tuple(evidence))

    def copy_check(
        self, copies: Sequence[tuple[str, torch.Tensor, int]], reference: dict[str, torch.Tensor]
    ) -> Callable[[], Callable[[StepRecord], StepRecord] | None] | None:
        """Offloaded: a job comparing the update replay's pre-step copies (name, copy, the tensor's version
        counter when copied) with the post-step read. A change that lands after the late read began (or with
        no late read) is then seen for every parameter the replay copies, as the synchronous check sees it:
        the job returns how the step's record completes (``rest``, ``rest_evidence``, ``pre``; None: as it is).
        What it reads is captured now, on the training thread; the copies must not change until the job has
        run. ``None``: nothing to compare."""
        post, stamps, keep, structure = self.post, self.versions, self.keep, self.structure
        if self.reader is None or post is None or stamps is None or not copies or len(keep) != len(post):
            return None
        index = self._name_index()
        pre0 = self.pre_now if self.pre_now is not None and len(self.pre_now) == len(post) else post
        wanted = [(index[n], n, c, v) for n, c, v in copies if n in index]
        if not wanted:
            return None

        def job() -> Callable[[StepRecord], StepRecord] | None:
            pre = pre0.copy()
            got = digest_tensors([c for _, _, c, _ in wanted], method=self.method)
            found = []
            for (i, name, copy, version), d in zip(wanted, got):
                if d != post[i] and d != pre0[i]:  # changed since the post-step read, unseen by the late one
                    pre[i] = d
                    found.append(change_evidence(name, copy, version, int(stamps[keep[i]]), reference.get(name)))
            if not found:
                return None
            return _with_rest(found, overall_digest(pre, structure))

        return job

    def rebase(self) -> None:
        """A confirmed repair: what every rank holds now is the baseline the next step is checked against
        (the repair is no change at rest), read as right after a step; an offloaded window's reads, taken of
        the bytes before the repair, are dropped and a new window opens."""
        if self.reader is not None:
            self.settle_post()
            self.reader.collect()
            self._window = None
        self.after_step(lambda *_: None)

    def since_step(
        self, prepared: PreparedManifest, digests: np.ndarray, reference: dict[str, Any]
    ) -> tuple[list[str], list[Change]]:
        """An audit's own full digests against the post-step read: what changed since, and how."""
        self.settle_post()
        entries = prepared.manifest.entries
        keep = at_rest_positions(entries)
        post = self.post
        if (
            post is None
            or prepared.structure != self.structure
            or len(keep) != len(post)
            or len(digests) != len(entries)
        ):
            return [], []
        changed = np.nonzero(digests[keep] != post)[0].tolist()[:MAX_NAMES]
        names = [self.names[i] for i in changed]
        if not changed:
            return [], []
        try:
            return names, rest_evidence(prepared, [keep[i] for i in changed], names, self.versions, reference)
        except Exception:  # noqa: BLE001 - evidence, never a failure of the audit
            return names, [Change(n) for n in names]

    def close(self) -> None:
        """End the worker thread, if any."""
        if self.reader is not None:
            self.reader.close()


def _version(t: Any) -> int:
    try:
        return tensor_version(t)
    except Exception:  # noqa: BLE001 - a tensor without a counter (an inference tensor) stamps nothing
        return -1


def versions(prepared: PreparedManifest) -> np.ndarray:
    """The version counter of every entry's tensor, in manifest order (-1 where there is none)."""
    out = np.full(prepared.size, -1, dtype=np.int64)
    plan = prepared.plan
    if len(plan.all_index) and len(prepared.sources) == len(plan.all_index):
        out[plan.all_index] = np.fromiter(map(_version, prepared.sources), np.int64, len(prepared.sources))
    if len(plan.dyn_index) and len(prepared.dynamic) == len(plan.dyn_index):
        out[plan.dyn_index] = np.fromiter(map(_version, prepared.dynamic), np.int64, len(prepared.dynamic))
    return out


def tensors_at(prepared: PreparedManifest, positions: Sequence[int]) -> list[torch.Tensor | None]:
    """The tensors the audit reads at manifest ``positions`` (the parameters themselves where cached)."""
    plan = prepared.plan
    where: dict[int, torch.Tensor] = {}
    if len(prepared.sources) == len(plan.all_index):
        where.update(zip(plan.all_index.tolist(), prepared.sources))
    if len(prepared.dynamic) == len(plan.dyn_index):
        where.update(zip(plan.dyn_index.tolist(), prepared.dynamic))
    return [where.get(int(i)) for i in positions]


def rest_evidence(
    prepared: PreparedManifest,
    positions: Sequence[int],
    names: Sequence[str],
    stamped: np.ndarray | None,
    reference: dict[str, torch.Tensor],
) -> list[Change]:
    """For each changed tensor (manifest ``positions``, their ``names``): whether its version counter moved
    since ``stamped`` (the post-step stamps) and, against ``reference``, how many elements and bits changed."""
    now = versions(prepared) if stamped is not None else None
    out = []
    for pos, name, t in zip(positions, names, tensors_at(prepared, positions)):
        known = now is not None and stamped is not None and pos < len(stamped)
        out.append(change_evidence(name, t, int(now[pos]) if known else -1, int(stamped[pos]) if known else -1,
                                   reference.get(name)))  # fmt: skip
    return out
