"""The package surface: the contract's names, and a core that never imports Lightning."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    # ("make[1]: Entering directory ..."), and pass its own overrides (`make test TEST_WORKERS=3` exports that
    # one to the tests too): a fresh make, as a user runs it.
    dropped = ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES", "TEST_WORKERS")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    proc = subprocess.run(
        ["make", "--no-print-directory", "-n", target, f"VENV={tmp_path / 'venv'}"],
        cwd=root, capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return [line for line in proc.stdout.splitlines() if not line.lstrip().startswith("#")]


def test_make_demo_installs_what_the_demo_needs_and_make_test_the_test_extra_on_top(tmp_path: Path) -> None:
    # The demo needs torch, the package and its lightning extra (the demo is a Lightning run); never the
    # test extra (DeepSpeed, Ray, Megatron-core...), which make test adds on top.
    demo = _make_dry_run("demo", tmp_path)
    installs = [line for line in demo if " pip install " in line]
    assert [line.split(" pip install -q ", 1)[1] for line in installs] == [
        "--upgrade pip",
        "torch==2.13.0",
        '-e ".[lightning]"',
    ]
    assert demo[-1].endswith("weightsync-audit demo")
    test = _make_dry_run("test", tmp_path)
    assert test[: len(demo) - 1] == demo[:-1]  # the demo's install first
    extra = [line for line in test[len(demo) - 1 :] if " pip install " in line]
    assert any('-e ".[test]"' in line for line in extra) and test[-1].endswith(
        "pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder"
    )


def test_lightning_is_an_extra_that_the_test_extra_and_make_demo_include() -> None:
    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    named = [d.split(">")[0].split("[")[0] for d in project["dependencies"]]
    assert not any("lightning" in n for n in named), named  # an HF or plain-loop install pulls no Lightning
    extras = project["optional-dependencies"]
    assert [d.split(">")[0] for d in extras["lightning"]] == ["pytorch-lightning"]
    assert "pytorch-lightning" in [d.split(">")[0] for d in extras["test"]]


@pytest.mark.parametrize(
    ("blocked", "path", "install"),
    [
        (
            "pytorch_lightning",
            "weightsync_audit.lightning.pytorch_lightning",
            "pip install 'weightsync-audit[lightning]'",
        ),
        ("lightning", "weightsync_audit.lightning.lightning_pytorch", "pip install lightning"),
    ],
)
def test_the_lightning_callback_without_lightning_says_what_to_install(blocked: str, path: str, install: str) -> None:
    code = (
        f"import sys; sys.modules[{blocked!r}] = None\n"
        "import weightsync_audit; weightsync_audit.LoopAudit  # the rest of the package imports\n"
        f"try:\n    from {path} import WeightSyncAudit\n"
        "except ModuleNotFoundError as exc:\n    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert "Lightning callbacks" in out and install in out, out


def test_every_warning_points_at_the_users_line() -> None:
    import ast

    root = Path(weightsync_audit.__file__).parent
    fixed = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            func = getattr(node, "func", None)
            if isinstance(func, ast.Attribute) and func.attr == "warn" and getattr(func.value, "id", "") == "warnings":
                levels = [ast.unparse(k.value) for k in node.keywords if k.arg == "stacklevel"]  # type: ignore[attr-defined]
                if levels != ["user_stacklevel()"]:
                    fixed.append(f"{path.relative_to(root)}:{node.lineno}")  # type: ignore[attr-defined]
    assert not fixed, f"warnings whose stacklevel is not user_stacklevel(): {fixed}"
