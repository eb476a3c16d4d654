"""``WEIGHTSYNC_AUDIT`` with no code: the shipped ``weightsync_audit_hf.pth`` adds the audit to every HF Trainer.

Each test starts fresh Python processes as an installed package would: the repository's own
``weightsync_audit_hf.pth`` is processed by ``site.addsitedir`` at start-up (a ``sitecustomize`` in a temporary
folder on ``PYTHONPATH`` stands for site-packages, which the shared editable install does not let a branch
change), so the training script (tests/scripts/hf_zero_code_run.py) says nothing about the audit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from torchrun import OFFLINE

from weightsync_audit.integrations.hf_activation import PTH_NAME, is_on

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "hf_zero_code_run.py"
WATCHED = ("weightsync_audit", "torch", "transformers")


def _env(tmp_path: Path, value: str | None, *first: Path) -> dict[str, str]:
    """An environment whose Python processes the repository's ``.pth`` at start-up, as site-packages would."""
    site_dir, boot = tmp_path / "site-packages", tmp_path / "boot"
    if not site_dir.exists():
        site_dir.mkdir()
        boot.mkdir()
        shutil.copy(ROOT / PTH_NAME, site_dir / PTH_NAME)
        (boot / "sitecustomize.py").write_text(f"import site\nsite.addsitedir({str(site_dir)!r})\n")
    env = {k: v for k, v in os.environ.items() if k != "WEIGHTSYNC_AUDIT"}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, first), str(boot), str(ROOT), env.get("PYTHONPATH", "")])
    env.update(OFFLINE, OMP_NUM_THREADS="1")
    if value is not None:
        env["WEIGHTSYNC_AUDIT"] = value
    return env


def _run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _loaded(tmp_path: Path, value: str | None) -> list[str]:
    code = f"import sys; print(sorted(m for m in sys.modules if m.split('.')[0] in {WATCHED!r}))"
    return json.loads(_run([sys.executable, "-c", code], _env(tmp_path, value)).stdout.replace("'", '"'))


def test_the_pth_line_is_shipped_in_the_wheel_and_decides_on_and_off_as_the_variable_does() -> None:
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert config["tool"]["hatch"]["build"]["targets"]["wheel"]["force-include"][PTH_NAME] == PTH_NAME
    [line] = (ROOT / PTH_NAME).read_text().splitlines()
    assert line.startswith("import ")  # the only lines of a .pth that Python runs
    for value in ("", " 0 ", "off", "FALSE", "no", "1", "every_n_steps=5"):
        installed: list[str] = []
        fake_os = SimpleNamespace(environ={"WEIGHTSYNC_AUDIT": value})
        hook = SimpleNamespace(install=lambda seen=installed: seen.append("installed"))

        def fake_import(name: str, *args: object, os_: object = fake_os, hook_: object = hook, **kw: object) -> object:
            return os_ if name == "os" else hook_

        exec(line, {"__builtins__": {"__import__": fake_import}})
        assert bool(installed) == is_on(value), value


@pytest.mark.parametrize("value", [None, "0", "off"])
def test_unset_or_off_the_pth_line_imports_nothing(tmp_path: Path, value: str | None) -> None:
    assert _loaded(tmp_path, value) == []


def test_set_the_pth_line_installs_the_hook_and_imports_neither_torch_nor_transformers(tmp_path: Path) -> None:
    loaded = _loaded(tmp_path, "1")
    assert "weightsync_audit.integrations.hf_activation" in loaded
    assert not [m for m in loaded if m.split(".")[0] in ("torch", "transformers")], loaded


def test_a_transformers_without_a_trainer_class_gets_a_warning_and_imports_as_usual(tmp_path: Path) -> None:
    fake = tmp_path / "fake"
    (fake / "transformers").mkdir(parents=True)
    (fake / "transformers" / "__init__.py").write_text("")
    (fake / "transformers" / "trainer.py").write_text("VALUE = 7\n")
    code = "import transformers.trainer as t; print(t.VALUE)"
    done = _run([sys.executable, "-c", code], _env(tmp_path, "1", fake))
    assert done.stdout.strip() == "7"
    assert "WEIGHTSYNC_AUDIT is set but transformers.trainer.Trainer could not be hooked" in done.stderr


def test_set_with_no_audit_code_a_trainer_writes_the_report_the_variable_names_and_steps_aside_for_an_explicit_one(
    tmp_path: Path,
) -> None:
    # One process, two Trainers: the first with no callbacks, the second with the script's own audit callback.
    report = tmp_path / "audit.jsonl"
    env = _env(tmp_path, f"every_n_steps=2,report_path={report}")
    done = _run([sys.executable, str(SCRIPT), str(tmp_path), "explicit"], env)
    records = [json.loads(line) for line in report.read_text().splitlines()]
    assert [(r["hook"], r["step"]) for r in records] == [("on_train_begin", 0), ("on_step_end", 2), ("on_step_end", 4)]
    assert all(r["in_sync"] and r["world_size"] == 1 for r in records)
    assert json.loads((tmp_path / "callbacks.rank0.json").read_text()).count("WeightSyncAuditCallback") == 1
    # The second Trainer: its own callback audits, the variable's says which of its options are dropped.
    assert len((tmp_path / "own.jsonl").read_text().splitlines()) == 3
    assert "already has a WeightSyncAuditCallback passed in callbacks=" in done.stderr
    assert f"every_n_steps=2, report_path='{report}' are dropped" in done.stderr


@pytest.mark.slow
def test_set_with_no_audit_code_two_gloo_ranks_under_torchrun_write_one_report(tmp_path: Path) -> None:
    from ranks import free_port

    report = tmp_path / "audit.jsonl"
    env = _env(tmp_path, f"every_n_steps=2,report_path={report},verbose=false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2", "--rdzv-backend=static"]
    cmd += [f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--node-rank=0", str(SCRIPT), str(tmp_path)]
    _run(cmd, env)
    records = [json.loads(line) for line in report.read_text().splitlines()]
    assert [(r["hook"], r["step"], r["world_size"]) for r in records] == [
        ("on_train_begin", 0, 2),
        ("on_step_end", 2, 2),
        ("on_step_end", 4, 2),
    ]
    assert all(r["in_sync"] for r in records)
    for rank in (0, 1):
        assert "WeightSyncAuditCallback" in json.loads((tmp_path / f"callbacks.rank{rank}.json").read_text())


def _trainer(tmp_path: Path, callbacks: list[Any]) -> Any:
    """A single-process Trainer over the script's tiny model (``hf_setup.TinyNet``), two steps over four rows."""
    pytest.importorskip("transformers")
    from hf_setup import tiny_trainer

    return tiny_trainer(tmp_path / "out", callbacks, rows=4, max_steps=2)


def test_the_hook_adds_no_second_callback_to_a_trainer_given_from_env_and_fails_on_a_bad_option(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from weightsync_audit.integrations.hf_activation import add_env_callback
    from weightsync_audit.transformers import WeightSyncAuditCallback

    def audits(trainer: Any) -> list[Any]:
        return [c for c in trainer.callback_handler.callbacks if isinstance(c, WeightSyncAuditCallback)]

    monkeypatch.setenv("WEIGHTSYNC_AUDIT", "every_n_steps=3")
    given = _trainer(tmp_path, WeightSyncAuditCallback.from_env())
    add_env_callback(given)
    assert len(audits(given)) == 1
    bare = _trainer(tmp_path, [])
    add_env_callback(bare)
    [added] = audits(bare)
    assert added.every_n_steps == 3 and added.env_options == {"every_n_steps": 3}
    monkeypatch.setenv("WEIGHTSYNC_AUDIT", "every_n_step=3")
    with pytest.raises(ValueError, match="every_n_step"):
        add_env_callback(_trainer(tmp_path, []))


def test_a_callback_added_with_add_callback_audits_train_begin_once(tmp_path: Path) -> None:
    from weightsync_audit.transformers import WeightSyncAuditCallback

    report = tmp_path / "audit.jsonl"
    trainer = _trainer(tmp_path, [])
    trainer.add_callback(WeightSyncAuditCallback(every_n_steps=None, report_path=str(report), verbose=False))
    trainer.train()
    assert [json.loads(line)["hook"] for line in report.read_text().splitlines()] == ["on_train_begin", "on_train_end"]
