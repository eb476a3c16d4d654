"""Ray Train: the audit's report in the run's own folder, found from inside the training function.

The callbacks need nothing Ray-specific: ``ray.train.torch.TorchTrainer`` starts a torch process group on
its workers, and Lightning (``RayDDPStrategy``) or the Hugging Face Trainer sees a DDP run, so every worker
takes the same verdict and ``on_mismatch="raise"`` ends the run as a Ray worker failure
(``ray.train.TrainingFailedError``). What Ray adds is where a run keeps its files: ``RunConfig(storage_path,
name)``, ``Result.path`` afterwards. :func:`ray_report_path` names the report's path there, so the record
sits beside the run's checkpoints (docs/ray.md).

It imports Ray only when called (extra ``weightsync-audit[ray]``).
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["REPORT_NAME", "ray_report_path", "report_path_in"]

REPORT_NAME = "weightsync-audit.jsonl"
"""The report's default file name in the run's folder."""


def ray_report_path(filename: str = REPORT_NAME) -> str:
    """The path of the audit report in this Ray Train run's folder (``Result.path``); call it in the training
    function, on every worker (the callback writes on global rank 0 only).

    The run's folder is ``RunConfig(storage_path=..., name=...)``: a local path, or on a cluster of several
    machines a shared file system mounted at the same path on each (an NFS mount). A storage path on a
    cloud bucket (``s3://``, ``gs://``) is not a folder the report can be appended to line by line: give
    ``report_path=`` a local file instead. Raises ``RuntimeError`` outside a Ray Train worker.

    Example (in the function ``TorchTrainer`` runs)::

        WeightSyncAudit(every_n_train_steps=50, report_path=ray_report_path())
    """
    if not isinstance(filename, str) or not filename or os.sep in filename or filename in (".", ".."):
        raise ValueError(f"filename={filename!r}: give a file name (no folder), such as {REPORT_NAME!r}")
    import ray.train

    try:
        storage = ray.train.get_context().get_storage()
    except Exception as exc:
        raise RuntimeError(
            "ray_report_path() is called in the training function that ray.train.torch.TorchTrainer runs "
            f"(no Ray Train context here: {type(exc).__name__}: {exc})"
        ) from exc
    return report_path_in(storage, filename)


def report_path_in(storage: Any, filename: str = REPORT_NAME) -> str:
    """:func:`ray_report_path` for a Ray Train ``StorageContext`` (``ray.train.get_context().get_storage()``).

    The folder is made when missing; storage that is not a local (or mounted) file system is refused.
    """
    # Ray Train 2 (the default from Ray 2.50): the run's folder; Ray Train 1 under Tune: the trial's folder.
    folder = getattr(storage, "trial_fs_path", None) or storage.experiment_fs_path
    fs = getattr(storage, "storage_filesystem", None)
    if fs is not None and getattr(fs, "type_name", "local") != "local":
        raise ValueError(
            f"ray_report_path(): the run's storage is a {fs.type_name!r} file system ({folder}), which a report "
            "cannot be appended to line by line; give report_path= a local file (or a shared file system as "
            "storage_path)"
        )
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, filename)
