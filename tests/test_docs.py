"""Every code block in README.md and docs/*.md runs.

Per page, in a fresh temporary folder and one fresh Python process:

- each ```python block is executed in order, in one shared namespace (like a notebook), with
  ``__name__ == "__main__"``;
- a python block preceded by ``<!-- file: NAME -->`` is not executed but written to ``NAME`` (a script
  the page then runs from a shell block);
- a ```bash block preceded by ``<!-- run -->`` (or ``<!-- run: exit=N -->``) is run with bash in the same
  folder, with the venv's ``bin`` first on PATH, and must exit with N (default 0);
- a block preceded by ``<!-- not-run: reason -->`` is skipped (used sparingly, for YAML-like snippets
  of other systems); other bash blocks (install commands, make targets) are checked for existing
  ``weightsync-audit`` sub-commands only.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
COMMANDS = ("demo", "check", "show", "diff", "verify")

_FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)
_MARK = re.compile(r"<!--\s*(run(?::\s*exit=(\d+))?|not-run:[^>]*|file:\s*([\w./-]+))\s*-->\s*$")


@dataclass
class Block:
    lang: str
    code: str
    line: int
    mark: str | None
    exit: int
    file: str | None


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    out = []
    for m in _FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = _MARK.search(before)
        out.append(
            Block(
                lang=m.group(1).lower(),
                code=m.group(2),
                line=text.count("\n", 0, m.start()) + 1,
                mark=mark.group(1) if mark else None,
                exit=int(mark.group(2)) if mark and mark.group(2) else 0,
                file=mark.group(3) if mark else None,
            )
        )
    return out


_RUNNER = r"""
import json, subprocess, sys, traceback
steps = json.load(open(sys.argv[1]))
ns = {"__name__": "__main__"}
for step in steps:
    if step["kind"] == "python":
        try:
            exec(compile(step["code"], f"{step['page']}:{step['line']}", "exec"), ns)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                print(f"BLOCK FAILED: {step['page']} line {step['line']}: SystemExit({exc.code})"); sys.exit(1)
        except BaseException:
            traceback.print_exc()
            print(f"BLOCK FAILED: {step['page']} line {step['line']}"); sys.exit(1)
    elif step["kind"] == "file":
        open(step["name"], "w").write(step["code"])
    else:
        sys.stdout.flush()
        proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", step["code"]])
        if proc.returncode != step["exit"]:
            print(f"BLOCK FAILED: {step['page']} line {step['line']}: bash exited {proc.returncode}, expected {step['exit']}")
            sys.exit(1)
"""


def _steps(page: Path) -> list[dict[str, object]]:
    steps: list[dict[str, object]] = []
    for b in blocks(page):
        where = {"page": page.name, "line": b.line}
        if b.mark and b.mark.startswith("not-run"):
            continue
        if b.lang == "python":
            if b.file:
                steps.append({"kind": "file", "name": b.file, "code": b.code, **where})
            else:
                steps.append({"kind": "python", "code": b.code, **where})
        elif b.lang in ("bash", "sh", "console") and b.mark and b.mark.startswith("run"):
            steps.append({"kind": "bash", "code": b.code, "exit": b.exit, **where})
    return steps


def test_pages_exist() -> None:
    names = {p.name for p in PAGES}
    for page in (
        "README.md",
        "index.md",
        "quickstart.md",
        "callback.md",
        "integrations.md",
        "cli.md",
        "ci.md",
        "how-it-works.md",
        "report-schema.md",
        "troubleshooting.md",
        "lightning-20340.md",
        "performance.md",
        "reliability.md",
    ):
        assert page in names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_code_blocks_run(page: Path, tmp_path: Path) -> None:
    steps = _steps(page)
    if not steps:
        pytest.skip("no runnable blocks")
    (tmp_path / "steps.json").write_text(json.dumps(steps))
    (tmp_path / "runner.py").write_text(_RUNNER)
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "COLUMNS": "120",
    }
    env.pop("WEIGHTSYNC_AUDIT", None)
    proc = subprocess.run(
        [sys.executable, "runner.py", "steps.json"], cwd=tmp_path, capture_output=True, text=True, timeout=180, env=env
    )
    assert proc.returncode == 0, f"{page.name}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_shell_blocks_name_real_commands(page: Path) -> None:
    for b in blocks(page):
        if b.lang not in ("bash", "sh", "console"):
            continue
        for m in re.finditer(r"weightsync-audit\s+([a-z-]+)", b.code):
            assert m.group(1) in COMMANDS or m.group(1).startswith("-"), f"{page.name}:{b.line}: {m.group(0)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (page.parent / target).exists(), f"{page.name}: broken link {target}"
