"""The at-rest check of one rank: :class:`AtRest`, its digests right after each step and right before the next.

Synchronously both reads run on the training thread, in the optimizer's post- and pre-step hooks. With
``offload`` (the watch of an ``overlap=True`` run) they run on a worker (:mod:`.offload`), and the
training thread keeps only the cached structure check, the small tensors and the version counters.
Either way the step's record gets the same fields: ``post`` and ``pre`` (one word each, compared across
ranks at a divergent audit), and for what changed in between ``rest`` (names), ``rest_count`` and
``rest_evidence`` (how it changed: :mod:`.rest`). The positions and names of what is checked are taken
from the manifest once per structure, not per step.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

from weightsync_audit.engine.attribution.offload import RestReader
from weightsync_audit.engine.attribution.rest import change_evidence, rest_evidence, tensors_at, versions
from weightsync_audit.engine.hashing.digest import digest_tensors, overall_digest
from weightsync_audit.engine.hashing.digest_plan import PreparedManifest

__all__ = ["MAX_NAMES", "AtRest", "at_rest_positions"]

MAX_NAMES = 8
"""Tensor names a record keeps per finding (the count is kept too)."""


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
        self._layout: tuple[int, list[int], list[str]] | None = None
        self._index: tuple[int, dict[str, int]] | None = None  # :meth:`_name_index`
        self._window: PreparedManifest | None = None  # offloaded: what the worker reads
        self._awaiting: dict[str, Any] | None = None  # offloaded: the record whose ``post`` the worker reads

    def layout(self, prepared: PreparedManifest) -> tuple[list[int], list[str]]:
        """The at-rest positions and names of ``prepared``'s manifest (built once per structure)."""
        if self._layout is None or self._layout[0] != prepared.structure:
            entries = prepared.manifest.entries
            keep = at_rest_positions(entries)
            self._layout = (prepared.structure, keep, [entries[i].name for i in keep])
        return self._layout[1], self._layout[2]

    def _name_index(self) -> dict[str, int]:
        """Name -> position among the at-rest tensors (:attr:`names`), built once per structure."""
        if self._index is None or self._index[0] != self.structure:
            self._index = (self.structure, {n: i for i, n in enumerate(self.names)})
        return self._index[1]

    def after_step(self, rec: dict[str, Any]) -> None:
        """The optimizer's post-step hook: this rank's bytes at rest from here (``rec["post"]``)."""
        self.post = self.versions = None
        prepared = self.prepare()
        self.keep, self.names = self.layout(prepared)
        self.structure = prepared.structure
        self.versions = versions(prepared)
        if self.reader is not None:
            self._window, self._awaiting = prepared, rec
            self.reader.launch(prepared, self.keep, stamp=lambda: versions(prepared), stamped=self.versions)
            return
        self.post = prepared.digests(method=self.method)[self.keep]
        rec["post"] = overall_digest(self.post, prepared.structure)

    def settle_post(self) -> None:
        """Offloaded: the worker's post-step read, waited for, written into its step's record."""
        if self.reader is not None and self._awaiting is not None:
            rec, self._awaiting = self._awaiting, None
            self.post = self.reader.post()
            if self.post is not None and not self.reader.raced():  # a read that raced a write says nothing
                rec["post"] = overall_digest(self.post, self.structure)

    def before_step(self, rec: dict[str, Any], reference: dict[str, Any]) -> None:
        """The optimizer's pre-step hook: ``rec["pre"]``, and what changed since the post-step read."""
        moved: list[int] = []
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
                return
            pre = (late if late is not None else self.post).copy()
            rec["rest_read"] = "late" if late is not None else "counters"
            now = versions(prepared)  # a write through torch anywhere in the window: its counter moved
            moved = [i for i, pos in enumerate(keep) if now[pos] != self.versions[pos]]
            if moved:
                pre[moved] = digest_tensors(tensors_at(prepared, [keep[i] for i in moved]), method=self.method)
        self.pre_now = pre if self.reader is not None else None
        if self.reader is None or rec["rest_read"] == "late" or moved:
            # without a late read nothing says what the bytes were before the step, but for the counters
            rec["pre"] = overall_digest(pre, prepared.structure)
        post = self.post
        if post is None or prepared.structure != self.structure or len(pre) != len(post):
            return
        changed = np.nonzero(pre != post)[0].tolist()
        if changed:
            rec["rest"] = [names[i] for i in changed[:MAX_NAMES]]
            rec["rest_count"] = len(changed)
            where = [keep[i] for i in changed[:MAX_NAMES]]
            rec["rest_evidence"] = rest_evidence(prepared, where, rec["rest"], self.versions, reference)

    def copy_check(
        self, rec: dict[str, Any], copies: Sequence[tuple[str, torch.Tensor, int]], reference: dict[str, torch.Tensor]
    ) -> Callable[[], None] | None:
        """Offloaded: a job comparing the update replay's pre-step copies (name, copy, the tensor's version
        counter when copied) with the post-step read. A change that lands after the late read began (or with
        no late read) is then seen for every parameter the replay copies, as the synchronous check sees it:
        ``rest``, ``rest_evidence`` and ``pre`` completed in ``rec``. What it reads is captured now, on the
        training thread; the copies must not change until the job has run. ``None``: nothing to compare."""
        post, stamps, keep, structure = self.post, self.versions, self.keep, self.structure
        if self.reader is None or post is None or stamps is None or not copies or len(keep) != len(post):
            return None
        index = self._name_index()
        pre0 = self.pre_now if self.pre_now is not None and len(self.pre_now) == len(post) else post
        wanted = [(index[n], n, c, v) for n, c, v in copies if n in index]
        if not wanted:
            return None

        def job() -> None:
            pre = pre0.copy()
            got = digest_tensors([c for _, _, c, _ in wanted], method=self.method)
            found = []
            for (i, name, copy, version), d in zip(wanted, got):
                if d != post[i] and d != pre0[i]:  # changed since the post-step read, unseen by the late one
                    pre[i] = d
                    found.append((i, name, copy, version))
            if not found:
                return
            rec["pre"] = overall_digest(pre, structure)
            names, evidence = list(rec.get("rest", [])), list(rec.get("rest_evidence", []))
            for i, name, copy, version in found:
                if name in names:
                    continue
                names.append(name)
                evidence.append(change_evidence(name, copy, version, int(stamps[keep[i]]), reference.get(name)))
                rec["rest_count"] = rec.get("rest_count", 0) + 1
            rec["rest"], rec["rest_evidence"] = names[:MAX_NAMES], evidence[:MAX_NAMES]

        return job

    def rebase(self) -> None:
        """A confirmed repair: what every rank holds now is the baseline the next step is checked against
        (the repair is no change at rest), read as right after a step; an offloaded window's reads, taken of
        the bytes before the repair, are dropped and a new window opens."""
        if self.reader is not None:
            self.settle_post()
            self.reader.collect()
            self._window = None
        self.after_step({})

    def since_step(
        self, prepared: PreparedManifest, digests: np.ndarray, reference: dict[str, Any]
    ) -> tuple[list[str], list[dict[str, Any]]]:
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
            return names, [{"name": n} for n in names]

    def close(self) -> None:
        """End the worker thread, if any."""
        if self.reader is not None:
            self.reader.close()
