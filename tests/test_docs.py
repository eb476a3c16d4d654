"""Every code block in README.md and docs/*.md runs.

Per page, in a fresh temporary folder and one Python process of its own (forked from one that has imported
torch and what Lightning and the Trainer import, never the package or a Lightning namespace: the imports
every page would pay again):

- each ```python block is executed in order, each in a namespace of its own, with ``__name__ == "__main__"``;
- a python block preceded by ``<!-- file: NAME -->`` is not executed but written to ``NAME`` (a script
  the page then runs from a shell block);
- a ```bash block preceded by ``<!-- run -->`` (or ``<!-- run: exit=N -->``) is run with bash in the same
  folder, with the venv's ``bin`` first on PATH, and must exit with N (default 0); the ``python``,
  ``torchrun`` and ``weightsync-audit`` it starts (and the ranks they start) are forked off a process that has
  imported torch and what the pages' scripts import, each run as that command would run (tests/zygote.py);
- a ```text block preceded by ``<!-- output -->`` is the real output of the block run just before it:
  each of its lines must appear in what that block printed, in order (a line ending in ``...`` matches
  a printed line it begins);
- each python block runs alone, in a fresh namespace, as a reader would copy it; a block that imports
  one Lightning namespace (``pytorch_lightning`` or ``lightning.pytorch``) runs with the other one
  unimportable, as on a machine that has only the one it names;
- a block preceded by ``<!-- not-run: reason -->`` is skipped (used sparingly, for YAML-like snippets
  of other systems); other bash blocks (install commands, make targets) are checked for existing
  ``weightsync-audit`` sub-commands only.

Pages are independent (each its own folder and process), so two run at a time, the slowest first: most of
a page's time is interpreters importing torch, and the machine has two cores. Each page's test waits
for its own page's run and judges it alone.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
from ranks import free_port
from zygote import Zygote

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
COMMANDS: tuple[str, ...] = __import__("weightsync_audit.cli", fromlist=["COMMANDS"]).COMMANDS
"""Every command of ``weightsync-audit``, as the code lists them."""

_FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)
_MARK = re.compile(r"<!--\s*(run(?::\s*exit=(\d+))?|not-run:[^>]*|output|file:\s*([\w./-]+))\s*-->\s*$")


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
import json, os, subprocess, sys, tempfile, traceback
steps = json.load(open(sys.argv[1]))
# The page's own port for a launcher's rendezvous (Lightning's, torchrun's, a block's own), not one picked in the
# ephemeral range that a concurrent test's gloo pair may hold (tests/conftest.py).
port = open("port").read()
os.environ.update(MASTER_PORT=port, PET_MASTER_PORT=port, STANDALONE_PORT=port)


def fail(step, why):
    print(f"BLOCK FAILED: {step['page']} line {step['line']}: {why}"); sys.exit(1)


def other_namespace(code):
    # A block written for one Lightning namespace must run where only that one is installed.
    if "pytorch_lightning" in code and "lightning.pytorch" not in code and "import lightning\n" not in code:
        return "lightning"
    if "lightning.pytorch" in code and "pytorch_lightning" not in code:
        return "pytorch_lightning"
    return None


def run_python(step):
    blocked = other_namespace(step["code"])
    saved = {m: sys.modules.pop(m) for m in list(sys.modules) if blocked and (m == blocked or m.startswith(blocked + "."))}
    if blocked:
        sys.modules[blocked] = None  # import fails as if the package were not installed
    ns = {"__name__": "__main__"}  # every block alone, as a reader copies it: no name from an earlier block
    try:
        exec(compile(step["code"], f"{step['page']}:{step['line']}", "exec"), ns)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            fail(step, f"SystemExit({exc.code})")
    except BaseException:
        traceback.print_exc()
        fail(step, "raised")
    finally:
        if blocked:
            del sys.modules[blocked]
            sys.modules.update(saved)


def matches(sample, output):
    # Every line of the sample appears in the output, in order ("..." at the end of a line: a prefix).
    lines = [l.rstrip() for l in output.splitlines()]
    at = 0
    for want in (l.rstrip() for l in sample.splitlines()):
        if not want.strip():
            continue
        prefix = want[:-3].rstrip() if want.endswith("...") else None
        while at < len(lines) and not (lines[at].startswith(prefix) if prefix is not None else lines[at] == want):
            at += 1
        if at == len(lines):
            return want
        at += 1
    return None


for step in steps:
    if step["kind"] == "file":
        open(step["name"], "w").write(step["code"])
        continue
    sys.stdout.flush()
    with tempfile.TemporaryFile() as out:  # fd 1 itself, so forked ranks and shells are captured too
        real = os.dup(1)
        os.dup2(out.fileno(), 1)
        try:
            if step["kind"] == "python":
                run_python(step)
            elif step["kind"] == "shared":  # this very command, run once for the session: its output and status
                sys.stdout.write(step["stdout"])
                if step["returncode"] != step["exit"]:
                    fail(step, f"the command exited {step['returncode']}, expected {step['exit']}")
            else:
                proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", step["code"]])
                if proc.returncode != step["exit"]:
                    fail(step, f"bash exited {proc.returncode}, expected {step['exit']}")
        finally:
            sys.stdout.flush()
            os.dup2(real, 1)
            os.close(real)
            out.seek(0)
            text = out.read().decode(errors="replace")
            sys.stdout.write(text)
            sys.stdout.flush()
    for sample in step.get("outputs", []):
        missing = matches(sample["text"], text)
        if missing is not None:
            fail(step, f"the sample output at line {sample['line']} is not what the block printed: {missing!r} is missing")
"""


def _steps(page: Path) -> list[dict[str, object]]:
    steps: list[dict[str, Any]] = []
    for b in blocks(page):
        where = {"page": page.name, "line": b.line}
        if b.mark == "output":  # the real output of the block run just before (checked by the runner)
            ran = [s for s in steps if s["kind"] != "file"]
            assert ran, f"{page.name}:{b.line}: an output block follows no block that runs"
            ran[-1].setdefault("outputs", []).append({"text": b.code, "line": b.line})
            continue
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


def _is_shared_demo(step: dict[str, Any]) -> bool:
    """A shell block that is exactly ``weightsync-audit demo --epochs 4`` (a comment aside): the command that
    tests/conftest.py ``demo_run`` runs once for the session."""
    from conftest import DEMO_ARGS

    if step["kind"] != "bash":
        return False
    lines = [ln.split("#", 1)[0].strip() for ln in str(step["code"]).splitlines()]
    return [ln for ln in lines if ln] == [" ".join(("weightsync-audit", *DEMO_ARGS))]


def _with_shared_demo(steps: list[dict[str, Any]], run: dict[str, Any]) -> list[dict[str, Any]]:
    """``steps`` with the shared demo command's block replaced by that command's one run for the session: the
    page's output blocks and exit code are checked against its real output (``--report`` aside, which only
    says where the reports go and which the block's samples do not show)."""
    shared = {"kind": "shared", "stdout": run["stdout"], "returncode": run["returncode"]}
    return [{**s, **shared} if _is_shared_demo(s) else s for s in steps]


def _cost(steps: list[dict[str, Any]]) -> int:
    # What a page's run costs, roughly: a shell block starting ranks or Python is many times a plain block.
    heavy = ("torchrun", "python ", "devices=2", "demo")
    return sum(10 if s["kind"] != "file" and any(h in s["code"] for h in heavy) else 1 for s in steps)


def _run_page(steps: list[dict[str, Any]], folder: Path, zygote: Zygote) -> tuple[int, str, str]:
    (folder / "steps.json").write_text(json.dumps(steps))
    (folder / "runner.py").write_text(_RUNNER)
    (folder / "port").write_text(str(free_port()))
    code = zygote.run(folder, timeout=600)
    out, err = ((folder / name).read_text(errors="replace") for name in ("stdout.txt", "stderr.txt"))
    if code is None:
        err += "\n(the page ran past 600 s)"
    return -9 if code is None else code, out, err


@pytest.fixture(scope="module")
def page_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[Path, Future]]:
    """Starts every selected page's run, two at a time, the slowest first; ``{page: future (rc, out, err)}``."""
    chosen = [
        item.callspec.params["page"]
        for item in request.session.items
        if getattr(item, "module", None) is request.module
        and getattr(item, "originalname", None) == "test_code_blocks_run"
        and hasattr(item, "callspec")
    ]
    runnable = {page: steps for page in chosen if (steps := _steps(page))}
    zygote = Zygote(tmp_path_factory.mktemp("docs-zygote"))
    pool = ThreadPoolExecutor(max_workers=2)
    futures: dict[Path, Future] = {}
    # Pages that run the session's shared demo command start once it has run (tests/conftest.py demo_run),
    # which it does here while the other pages run.
    later = {page for page, steps in runnable.items() if any(_is_shared_demo(s) for s in steps)}
    for page, steps in sorted(runnable.items(), key=lambda kv: (kv[0] in later, -_cost(kv[1]))):
        if page in later:
            steps = _with_shared_demo(steps, request.getfixturevalue("demo_run"))
        futures[page] = pool.submit(_run_page, steps, tmp_path_factory.mktemp(f"docs-{page.stem}"), zygote)
    yield futures
    for f in futures.values():
        f.cancel()
    zygote.kill()  # an interrupted session leaves no page running
    pool.shutdown(wait=True)
    zygote.close()


# In the order the pages are started (the slowest first): a page's test then waits for its own run, never for
# the runs queued before it (a cheap page tested first would wait for the whole queue, past the timeout).
@pytest.mark.parametrize("page", sorted(PAGES, key=lambda p: -_cost(_steps(p))), ids=lambda p: p.name)
def test_code_blocks_run(page: Path, page_runs: dict[Path, Future]) -> None:
    if not _steps(page):
        pytest.skip("no runnable blocks")
    returncode, out, err = page_runs[page].result()
    assert returncode == 0, f"{page.name}:\n{out[-4000:]}\n{err[-4000:]}"


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


def test_the_20340_plain_pytorch_example_runs_with_and_without_the_fix_and_shows_both() -> None:
    page = ROOT / "docs" / "lightning-20340.md"
    runs = [b for b in blocks(page) if b.mark == "run" and "plain_ddp.py" in b.code]
    assert [("--without-fix" in b.code) for b in runs] == [False, True]
    outputs = [b.code for b in blocks(page) if b.mark == "output" and "epoch 4: in sync" in b.code]
    assert "epoch 3: in sync: True" in outputs[0] and "epoch 3: in sync: False" in outputs[1]
    [script] = [b.code for b in blocks(page) if b.file == "plain_ddp.py"]
    assert "torch.manual_seed(1 + dist.get_rank())" in script  # each rank its own data, or nothing diverges


def test_no_page_tells_to_pip_install_from_an_index() -> None:
    # weightsync-audit is installed from a checkout or a built wheel (README); there is no index release.
    for page in PAGES:
        for b in blocks(page):
            for line in b.code.splitlines():
                assert not re.search(r"pip install [\"']?weightsync-audit", line), f"{page.name}:{b.line}: {line}"


# -- docs that cannot drift from the code -------------------------------------------------------------


def _table(page: Path, heading: str) -> dict[str, str]:
    """The table under ``heading``: its first column's backticked name -> its second column."""
    text = page.read_text().split(heading, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    return {re.match(r"\| `(\w+)`", r).group(1): r.split(" | ")[1] for r in rows}  # type: ignore[union-attr]


def _adapter_options() -> dict[str, dict[str, Any]]:
    """Every adapter's named options with their defaults, from the signatures: adapter -> {option: default}."""
    import inspect

    from weightsync_audit import LoopAudit
    from weightsync_audit.integrations.lightning.audit_callback import WeightSyncAuditMixin

    inits = {"WeightSyncAudit": WeightSyncAuditMixin.__init__, "LoopAudit": LoopAudit.__init__}
    try:
        from weightsync_audit.transformers import WeightSyncAuditCallback

        inits["WeightSyncAuditCallback"] = WeightSyncAuditCallback.__init__
    except ImportError:  # pragma: no cover - transformers is in the test extra
        pass
    skip = {"self", "module", "optimizer", "options"}
    return {
        name: {
            p.name: p.default
            for p in inspect.signature(init).parameters.values()
            if p.name not in skip and p.kind is not p.VAR_KEYWORD
        }
        for name, init in inits.items()
    }


def test_the_callback_pages_options_table_is_every_option_of_every_adapter_with_its_default() -> None:
    rows = _table(ROOT / "docs" / "callback.md", "## Options")
    adapters = _adapter_options()
    in_code = {name for options in adapters.values() for name in options}
    assert sorted(in_code - set(rows)) == [], "options in the code that the table does not name"
    assert sorted(set(rows) - in_code) == [], "options in the table that no adapter takes"
    for adapter, options in adapters.items():
        for name, default in options.items():
            shown = repr(default).replace("'", '"')
            assert f"`{shown}`" in rows[name], (
                f"{adapter}({name}=...): default {shown} is not in the table: {rows[name]}"
            )


def test_the_callback_pages_call_with_the_defaults_is_the_signature() -> None:
    import ast

    [first] = [b for b in blocks(ROOT / "docs" / "callback.md") if b.lang == "python"][:1]
    call = next(n for n in ast.walk(ast.parse(first.code)) if isinstance(n, ast.Call))
    given = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    assert given == _adapter_options()["WeightSyncAudit"]


def test_the_readmes_docs_list_names_every_command_of_the_cli() -> None:
    [line] = [ln for ln in (ROOT / "README.md").read_text().splitlines() if "(docs/cli.md)" in ln]
    assert re.findall(r"`(\w+)`", line) == list(COMMANDS), line


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_report_shown_in_the_docs_is_the_output_of_a_run(page: Path) -> None:
    # A printed audit report in a page is checked against a real run (an output block), or it drifts.
    for b in blocks(page):
        if b.lang == "text" and ": DIVERGED, " in b.code:
            assert b.mark == "output", f"{page.name}:{b.line}: a report not checked against a run"
