"""A process that imports what every docs page would import again, then forks each page's run off itself
(tests/test_docs.py): a page runs as ``python runner.py steps.json`` would in its folder, its output in
``stdout.txt`` and ``stderr.txt`` there, without paying for torch's import once more."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

SOURCE = r"""
import os, runpy, select, signal, sys

import torch, torch.distributed, torch._dynamo  # what nearly every page imports: once, here
try:  # what Lightning and the Trainer import, in neither Lightning namespace
    import torchmetrics, transformers
except ImportError:
    pass


def page(folder):
    os.chdir(folder)
    sys.path[0] = folder  # as for `python runner.py`: the page's own files import
    sys.argv = ["runner.py", "steps.json"]
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, name in ((1, "stdout.txt"), (2, "stderr.txt")):
        os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.stdin, sys.stdout, sys.stderr = open(0), open(1, "w", buffering=1), open(2, "w", buffering=1)
    code = 0
    try:
        runpy.run_path("runner.py", run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    import atexit
    atexit._run_exitfuncs()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)


report = os.fdopen(os.dup(1), "w", buffering=1)
running = {}
open_, pending = True, b""
while open_ or running:
    if open_ and select.select([0], [], [], 0.1)[0]:
        data = os.read(0, 65536)  # unbuffered: two requests that arrive together are both seen here
        open_ = bool(data)
        pending += data
    elif not open_:
        select.select([], [], [], 0.1)
    while b"\n" in pending:
        line, pending = pending.split(b"\n", 1)
        folder = line.decode().strip()
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            page(folder)
        running[pid] = folder
        print("started", pid, folder, file=report)
    while running:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if not pid:
            break
        print("ended", os.waitstatus_to_exitcode(status), running.pop(pid), file=report)
"""


class Zygote:
    """One Python process that imports what the pages share once, then forks a page's run off itself."""

    def __init__(self, folder: Path) -> None:
        (folder / "zygote.py").write_text(SOURCE)
        env = {
            **os.environ,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "COLUMNS": "120",
        }
        env.pop("WEIGHTSYNC_AUDIT", None)
        self.proc = subprocess.Popen(
            [sys.executable, "zygote.py"], cwd=folder, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        self.lock = threading.Lock()
        self.pids: dict[str, int] = {}
        self.ended: dict[str, tuple[threading.Event, list[int]]] = {}
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            what, number, folder = line.rstrip("\n").split(" ", 2)
            with self.lock:
                if what == "started":
                    self.pids[folder] = int(number)
                else:
                    event, codes = self.ended[folder]
                    codes.append(int(number))
                    event.set()
        with self.lock:  # the zygote is gone: no page still waiting waits for ever
            for event, codes in self.ended.values():
                codes.append(-1)
                event.set()

    def run(self, folder: Path, timeout: float) -> int | None:
        """Runs ``runner.py steps.json`` in ``folder``; its exit status, or ``None`` past ``timeout`` (killed)."""
        event: threading.Event = threading.Event()
        with self.lock:
            self.ended[str(folder)] = (event, codes := [])
            assert self.proc.stdin is not None
            self.proc.stdin.write(f"{folder}\n")
            self.proc.stdin.flush()
        if event.wait(timeout):
            return codes[0]
        self.kill(str(folder))
        event.wait(10)
        return None

    def kill(self, folder: str | None = None) -> None:
        with self.lock:
            pids = [pid for f, pid in self.pids.items() if folder in (None, f) and not self.ended[f][0].is_set()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        self.kill()
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
