"""Whether a tensor's storage still holds every byte its view reaches: checked before anything reads it.

The manifest refuses such a tensor by name when it is built, and every reader checks again before a raw
read, so no path reads memory the tensor no longer owns.
"""

from __future__ import annotations

import torch

__all__ = ["storage_fits"]


def storage_fits(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage holds every byte its view reaches (``False``: freed or shrunk under it).

    A storage resized under a tensor (``p.untyped_storage().resize_(0)``) leaves the tensor's shape and
    strides pointing at memory it no longer owns; reading it, by pointer or by any torch kernel, is a
    crash or worse. Metadata only: nothing is read. A tensor without a readable storage (a subclass
    that has none) is left to the reader.

    >>> import torch
    >>> t = torch.ones(4)
    >>> storage_fits(t), storage_fits(t[1:])
    (True, True)
    >>> _ = t.untyped_storage().resize_(0)
    >>> storage_fits(t)
    False
    """
    try:
        held = t.untyped_storage().nbytes()
    except Exception:  # noqa: BLE001 - no plain storage to measure
        return True
    offset = t.storage_offset()
    if not offset and t.is_contiguous():  # the common case, thousands of times per manifest
        return held >= t.nbytes
    if t.numel() == 0:
        return True
    reach = offset + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return held >= reach * t.element_size()
