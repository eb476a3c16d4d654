"""The package surface: the contract's names, and a core that never imports Lightning."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
    code = "import weightsync_audit.engine.repair.resync, weightsync_audit; assert callable(weightsync_audit.resync); from weightsync_audit import resync; assert callable(resync)"
    subprocess.run([sys.executable, "-c", code], check=True)


def _the_core_imports_none_of(*packages: str) -> None:
    """In a fresh interpreter, ``import weightsync_audit`` and one ``audit(None)`` load none of ``packages``."""
    code = (
        "import sys, weightsync_audit; weightsync_audit.audit(None);"
        f"bad = [m for m in sys.modules if m.split('.')[0] in {packages!r}];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_core_imports_no_lightning() -> None:
    _the_core_imports_none_of("pytorch_lightning", "lightning", "lightning_fabric")


def test_the_core_imports_no_transformers_and_only_the_hf_adapter_names_it() -> None:
    _the_core_imports_none_of("transformers", "accelerate")
    # pytorch_lightning itself imports transformers when it is installed, so the Lightning adapter is
    # checked by what it imports, as is every other module of the package.
    import ast
    from pathlib import Path

    root = Path(weightsync_audit.__file__).parent
    importers = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            if any(n.split(".")[0] in ("transformers", "accelerate") for n in names):
                importers.add(path.relative_to(root).as_posix())
    assert importers == {"integrations/hf/callback.py", "integrations/hf/engines.py"}  # the HF adapter only


def _make_dry_run(target: str, tmp_path: Path) -> list[str]:
    """The commands ``make TARGET`` would run on a fresh machine (no venv yet), without running them."""
    root = Path(__file__).resolve().parents[1]
    # Run under `make test` (CI), the outer make's variables would make this one print its directory
    # ("make[1]: Entering directory ..."), and pass its own overrides: a fresh make, as a user runs it.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")}
    proc = subprocess.run(
        ["make", "--no-print-directory", "-n", target, f"VENV={tmp_path / 'venv'}"],
        cwd=root, capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return [line for line in proc.stdout.splitlines() if not line.lstrip().startswith("#")]


def test_make_demo_installs_what_the_demo_needs_and_make_test_the_test_extra_on_top(tmp_path: Path) -> None:
    # The demo needs torch and the package (its core dependencies: Lightning, xxhash, rich); never the
    # test extra (DeepSpeed, Ray, Megatron-core...), which make test adds on top.
    demo = _make_dry_run("demo", tmp_path)
    installs = [line for line in demo if " pip install " in line]
    assert [line.split(" pip install -q ", 1)[1] for line in installs] == ["--upgrade pip", "torch==2.13.0", "-e ."]
    assert demo[-1].endswith("weightsync-audit demo")
    test = _make_dry_run("test", tmp_path)
    assert test[: len(demo) - 1] == demo[:-1]  # the demo's install first
    extra = [line for line in test[len(demo) - 1 :] if " pip install " in line]
    assert any('-e ".[test]"' in line for line in extra) and test[-1].endswith(
        "pytest -q -p no:cacheprovider -n 2 --dist loadfile"
    )
