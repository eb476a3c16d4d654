"""Start-up: reading a report needs no torch, and the package loads its public names on first use."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from records import CONTRACT_EXAMPLE


def _run(code: str) -> None:
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_check_show_and_version_never_import_torch(tmp_path: Path) -> None:
    report = tmp_path / "audit.jsonl"
    report.write_text(json.dumps(CONTRACT_EXAMPLE) + "\n" + json.dumps({**CONTRACT_EXAMPLE, "step": 50}) + "\n")
    code = (
        "import sys, io, contextlib\n"
        "import weightsync_audit.cli as cli\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    assert cli.main(['check', {str(report)!r}]) == 1\n"
        f"    assert cli.main(['show', {str(report)!r}]) == 0\n"
        "    assert cli.main(['--version']) == 0\n"
        "    assert cli.main(['check', '--help']) == 0\n"
        "bad = [m for m in sys.modules if m.split('.')[0] == 'torch']\n"
        "assert not bad, bad[:5]\n"
    )
    _run(code)


def test_import_weightsync_audit_imports_neither_torch_nor_fsdp_until_asked() -> None:
    _run(
        "import sys, weightsync_audit as w\n"
        "assert 'torch' not in sys.modules\n"
        "w.AuditResult, w.ReportWriter, w.read_report, w.render, w.print_report, w.WeightSyncWarning\n"
        "assert 'torch' not in sys.modules, 'the report names need no torch'\n"
        "w.audit, w.Auditor, w.resync, w.maybe_rewrap\n"
        "assert 'torch' in sys.modules\n"
        "assert 'torch.distributed.fsdp' not in sys.modules, 'FSDP is imported only when a module is checked for it'\n"
    )


def test_every_public_name_is_lazy_and_listed() -> None:
    _run(
        "import weightsync_audit as w\n"
        "assert set(w._LAZY) == set(w.__all__), set(w._LAZY) ^ set(w.__all__)\n"
        "for n in w.__all__: assert getattr(w, n) is not None, n\n"
        "assert set(w.__all__) <= set(dir(w))\n"
    )
