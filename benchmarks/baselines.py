"""What the audit is measured against: two checks in use today and the memory-copy limit.

``seed_check``: the check from the bug report that started this project (Lightning #20340): sha256 over
every parameter's bytes (``param.data.cpu().numpy().tobytes()``, a copy of each) and
``all_gather_object`` of the hex digest.

``megatron_check``: Megatron-LM's ``check_param_hashes_across_dp_replicas``: per parameter, ``sha1`` of
``param.data.to("cpu").float().numpy(force=True)``; the 20-byte hashes are stacked and all-gathered.

``MemoryCopy``: a plain copy of the same bytes into destinations allocated (and touched) beforehand, on
the same number of threads as the digest uses, in ``CHUNK``-sized pieces: the bandwidth limit for any
method that must read every byte once.
"""

from __future__ import annotations

import array
import hashlib
import itertools
from concurrent.futures import ThreadPoolExecutor

import harness  # noqa: F401 - first: it puts this checkout ahead of an installed copy on sys.path
import numpy as np
import torch
import torch.distributed as dist
import xxhash
from torch import nn

from weightsync_audit.engine.hashing.reader import CHUNK, host_view


def seed_check(model: nn.Module) -> bool:
    hasher = hashlib.sha256()
    for param in model.parameters():
        hasher.update(param.data.cpu().numpy().tobytes())
    param_hash = hasher.hexdigest()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return True
    all_param_hashes: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(all_param_hashes, param_hash)
    return len(set(all_param_hashes)) == 1


def megatron_check(model: nn.Module) -> bool:
    local = []
    for _, param in model.named_parameters():
        digest = hashlib.sha1(param.data.to("cpu").float().numpy(force=True)).digest()
        local.append(torch.frombuffer(array.array("B", digest), dtype=torch.uint8))
    hashes = torch.stack(local)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return True
    gathered = [torch.zeros_like(hashes) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, hashes)
    return all(torch.equal(hashes, other) for other in gathered)


def plain_xxh3_check(model: nn.Module) -> bool:
    """What xxh3 alone gives: xxh3-64 over each parameter's bytes in one thread, then
    ``all_gather_object`` of the list, as the seed does with sha256. The library's own work is what the
    audit adds beyond this (names, buffers, optimizer state, a fixed-size healthy message, threads)."""
    local = [xxhash.xxh3_64_intdigest(host_view(p.data)) for p in model.parameters()]
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return True
    gathered: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return all(g == local for g in gathered)


class MemoryCopy:
    """Copies every parameter's bytes into a preallocated twin, on ``threads`` threads."""

    def __init__(self, model: nn.Module, threads: int) -> None:
        self.jobs: list[tuple[np.ndarray, np.ndarray]] = []
        for p in model.parameters():
            src = np.frombuffer(host_view(p.data), dtype=np.uint8)
            dst = np.ones_like(src)  # touched now, so the timed copies pay no page faults
            for a in range(0, src.size, CHUNK):
                self.jobs.append((src[a : a + CHUNK], dst[a : a + CHUNK]))
        self.jobs.sort(key=lambda j: -j[0].size)
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads - 1) if threads > 1 else None

    def __call__(self) -> None:
        counter = itertools.count()
        jobs = self.jobs

        def drain() -> None:
            while (k := next(counter)) < len(jobs):
                np.copyto(jobs[k][1], jobs[k][0])

        futures = [self.pool.submit(drain) for _ in range(self.threads - 1)] if self.pool else []
        drain()
        for f in futures:
            f.result()
