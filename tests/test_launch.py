"""``weightsync-audit launch`` under signals and with a hand-off that cannot be written, with real processes:
torchrun on 2 CPU ranks (tests/scripts/launch_worker.py), a plain command with a grandchild in a session of its
own (as torchrun starts its workers). The truth is the processes themselves (psutil) and torchrun's own report
of its workers' exit codes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from weightsync_audit.cli import main

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "scripts" / "launch_worker.py"
LAUNCH = [sys.executable, "-c", "import sys; from weightsync_audit.cli import main; sys.exit(main())", "launch"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_for(paths: list[Path], timeout: float = 90) -> None:
    end = time.monotonic() + timeout
    while not all(p.exists() and p.read_text().strip() for p in paths):
        assert time.monotonic() < end, f"never written: {[str(p) for p in paths if not p.exists()]}"
        time.sleep(0.1)


def _clean_up(proc: subprocess.Popen[Any], pids: set[int]) -> None:
    """Whatever the test started and is still running (a failing run leaves it), killed by its id."""
    for pid in pids | {proc.pid}:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=10)


def _as_in_the_foreground(ignored: tuple[int, ...] = ()) -> None:
    """In the launched process before it runs: the terminating signals at their defaults, as a shell starts a
    command in the foreground (``make test`` started in the background of a script has SIGINT and SIGQUIT
    ignored, which every process under it inherits), but ``ignored`` (as ``nohup`` ignores SIGHUP)."""
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(s, signal.SIG_IGN if s in ignored else signal.SIG_DFL)


def test_sigint_to_launch_takes_torchrun_and_every_worker_down_then_exits_130(tmp_path: Path) -> None:
    cmd = [*LAUNCH, "--evict-file", str(tmp_path / "evict.json"), "--", *TORCHRUN, str(WORKER), "hang", str(tmp_path)]
    log = (tmp_path / "launch.log").open("w")  # not a pipe: an orphaned worker would hold it open
    proc = subprocess.Popen(
        cmd, env=_env(), start_new_session=True, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_as_in_the_foreground
    )
    started: set[int] = set()
    try:
        _wait_for([tmp_path / f"pid.rank{r}" for r in (0, 1)])
        workers = {int((tmp_path / f"pid.rank{r}").read_text()) for r in (0, 1)}
        started = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)} | workers
        assert workers <= started and len(started) >= 3  # torchrun and its 2 workers under launch
        os.kill(proc.pid, signal.SIGINT)  # to launch alone, as a scheduler or a terminal's Ctrl-C through it
        code = proc.wait(timeout=60)
        left = sorted(p for p in started if _alive(p))
        assert (code, left) == (130, []), (tmp_path / "launch.log").read_text()[-3000:]
    finally:
        _clean_up(proc, started)
        log.close()


CHILD = r"""
import os, pathlib, subprocess, sys, time
stubborn = "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); signal.signal(signal.SIGTERM, signal.SIG_IGN)"
body = (stubborn if sys.argv[2] == "stubborn" else "") + "\nimport time\nwhile True: time.sleep(1)"
grandchild = subprocess.Popen([sys.executable, "-c", body], start_new_session=True)  # as torchrun starts a worker
time.sleep(0.5)  # its handlers in place
pathlib.Path(sys.argv[1]).write_text(f"{os.getpid()} {grandchild.pid}")
while True:
    time.sleep(1)
"""


def _start_child_under_launch(tmp_path: Path, grandchild: str, *opts: str, ignored: tuple[int, ...] = ()) -> Any:
    """``launch -- python CHILD`` started, CHILD and its grandchild running: ``(launch, their pids)``."""
    pids_file = tmp_path / "pids"
    cmd = [*LAUNCH, "--evict-file", str(tmp_path / "evict.json"), *opts, "--"]
    cmd += [sys.executable, "-c", CHILD, str(pids_file), grandchild]
    proc = subprocess.Popen(
        cmd, env=_env(), start_new_session=True, stderr=subprocess.DEVNULL,
        preexec_fn=lambda: _as_in_the_foreground(ignored),
    )  # fmt: skip
    try:
        _wait_for([pids_file], timeout=60)
    except BaseException:
        _clean_up(proc, set())
        raise
    return proc, set(map(int, pids_file.read_text().split()))


def _child_under_launch(tmp_path: Path, sig: int, grandchild: str, *opts: str) -> tuple[int, list[int], float]:
    """``launch -- python CHILD``, sent ``sig``: launch's status, what still runs of the two, the seconds it took."""
    proc, started = _start_child_under_launch(tmp_path, grandchild, *opts)
    try:
        t0 = time.monotonic()
        os.kill(proc.pid, sig)
        code = proc.wait(timeout=40)
        return code, sorted(p for p in started if _alive(p)), time.monotonic() - t0
    finally:
        _clean_up(proc, started)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT], ids=lambda s: s.name)
def test_every_terminating_signal_is_forwarded_and_nothing_under_the_command_survives(
    tmp_path: Path, sig: signal.Signals
) -> None:
    code, left, _ = _child_under_launch(tmp_path, sig, "plain")
    assert (code, left) == (128 + sig, [])


def test_a_signal_ignored_when_launch_starts_stays_ignored_by_launch_and_by_the_command(tmp_path: Path) -> None:
    # Under nohup (SIGHUP ignored): a hangup ends neither launch nor its command; a SIGTERM still ends both.
    proc, started = _start_child_under_launch(tmp_path, "plain", ignored=(signal.SIGHUP,))
    try:
        os.kill(proc.pid, signal.SIGHUP)
        time.sleep(1.0)  # launch polls its command every 0.2 s: a forwarded signal would have ended it by now
        assert proc.poll() is None and sorted(p for p in started if _alive(p)) == sorted(started)
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=40) == 128 + signal.SIGTERM
        assert [p for p in started if _alive(p)] == []
    finally:
        _clean_up(proc, started)


def test_a_process_that_ignores_the_signal_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    code, left, took = _child_under_launch(tmp_path, signal.SIGINT, "stubborn", "--grace-period", "2")
    assert (code, left) == (130, []) and 2 <= took < 15


def test_a_hand_off_path_that_cannot_be_written_is_refused_before_the_command_runs(tmp_path: Path, capsys: Any) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder\n")
    ran = tmp_path / "ran"
    command = ["--", sys.executable, "-c", f"open({str(ran)!r}, 'w')"]
    assert main(["launch", "--evict-file", str(a_file / "evict.json"), *command]) == 2
    assert "--evict-file" in capsys.readouterr().err and not ran.exists()
    evict = str(tmp_path / "evict.json")
    assert main(["launch", "--evict-file", evict, "--segment-health-dir", str(a_file / "health"), *command]) == 2
    assert "--segment-health-dir" in capsys.readouterr().err and not ran.exists()
    assert main(["launch", "--evict-file", evict, *command]) == 0 and ran.exists()  # a writable one runs


def test_the_runs_exit_code_is_carried_when_the_evict_file_cannot_be_written(tmp_path: Path) -> None:
    evict = tmp_path / "handoff" / "evict.json"
    evict.parent.mkdir()
    cmd = [*LAUNCH, "--evict-file", str(evict), "--", *TORCHRUN, str(WORKER), "unwritable", str(tmp_path)]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=240)
    said = done.stdout[-3000:] + done.stderr[-3000:]
    # the truth: torchrun saw its workers exit 17, none went on, and no evict file could be written
    assert "exitcode  : 17" in done.stderr or "exitcode: 17" in done.stderr.replace("  ", " "), said
    assert not list(tmp_path.glob("survived.rank*")) and evict.parent.is_file()
    assert done.returncode == 17, said
    assert "could not be written" in done.stderr
