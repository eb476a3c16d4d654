"""The package surface: the contract's names, and a core that never imports Lightning."""

from __future__ import annotations

import subprocess
import sys

import weightsync_audit


def test_every_public_name_resolves() -> None:
    for name in weightsync_audit.__all__:
        assert getattr(weightsync_audit, name) is not None, name


def test_the_contract_names_exist_with_their_arguments() -> None:
    import inspect

    assert list(inspect.signature(weightsync_audit.audit).parameters)[:9] == [
        "module", "optimizer", "group", "include", "exclude", "step", "epoch", "timeout_s", "coverage",
    ]  # fmt: skip
    assert list(inspect.signature(weightsync_audit.resync).parameters)[:5] == [
        "module",
        "optimizer",
        "src",
        "group",
        "names",
    ]
    params = inspect.signature(weightsync_audit.WeightSyncAudit.__init__).parameters
    for arg in (
        "every_n_train_steps",
        "hooks",
        "include",
        "exclude",
        "on_mismatch",
        "resync_src",
        "report_path",
        "timeout_s",
    ):
        assert arg in params, arg
    assert issubclass(weightsync_audit.WeightDivergenceError, RuntimeError)
    assert issubclass(weightsync_audit.AuditTimeoutError, RuntimeError)


def test_resync_stays_the_function_after_its_submodule_is_imported() -> None:
    code = "import weightsync_audit.engine.resync, weightsync_audit; assert callable(weightsync_audit.resync); from weightsync_audit import resync; assert callable(resync)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_core_imports_no_lightning() -> None:
    code = (
        "import sys, weightsync_audit; weightsync_audit.audit(None);"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('pytorch_lightning', 'lightning', 'lightning_fabric')];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_core_and_the_lightning_adapter_import_no_transformers() -> None:
    code = (
        "import sys, weightsync_audit; weightsync_audit.audit(None);"
        "import weightsync_audit.integrations.lightning.pytorch_lightning, weightsync_audit.integrations.activation;"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('transformers', 'accelerate')];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
