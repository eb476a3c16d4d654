"""A process that imports what every docs page would import again, then forks each page's run off itself
(tests/test_docs.py): a page runs as ``python runner.py steps.json`` would in its folder, its output in
``stdout.txt`` and ``stderr.txt`` there, without paying for torch's import once more.

The interpreters a page's shell blocks start (``python x.py``, ``torchrun`` and the ranks it starts, Lightning's
launcher's ranks) are forked too, off a second process that has imported what they import (:data:`SERVER`):
the pages' ``PATH`` starts with a ``python`` that hands its command line, environment, folder and open files to
that process and exits with the status of the fork that ran it (:data:`SHIM`), and a ``torchrun`` and a
``weightsync-audit`` that run the real console scripts through it. Each such process still runs the command as ``python`` would: its
``sys.argv``, ``sys.path``, environment, folder and files, ``__main__``, exit status, signals forwarded, and
it dies when its ``python`` dies; what the shim cannot reproduce (another option, a file open past number 200,
no server) it leaves to the real interpreter."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Sequence

SOURCE = r"""
import os, runpy, select, signal, sys

import torch, torch.distributed, torch._dynamo  # what nearly every page imports: once, here
try:  # what Lightning and the Trainer import, in neither Lightning namespace
    import torchmetrics, transformers
except ImportError:
    pass
import gc
gc.freeze()  # what was imported is never garbage: no fork's collector walks it (a fifth of a run's CPU)


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


SERVER = r"""
import fcntl, io, json, os, runpy, select, signal, socket, struct, sys, threading, traceback, types

ADDRESS = sys.argv[1]
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(ADDRESS)
listener.listen(128)  # bound before the imports: a command that comes early waits for them, queued
own_path = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
BASE = [p for p in sys.path[1:] if os.path.abspath(p) not in own_path]

import torch, torch.distributed, torch._dynamo, torch.distributed.run
for name in sys.argv[2:]:
    try:  # what the commands import; never the package under test, which each run imports itself
        __import__(name)
    except Exception:
        pass
import gc
gc.freeze()  # what was imported is never garbage: no fork's collector walks it


def streams(unbuffered):
    try:
        sys.stdin = open(0, closefd=False)
    except OSError:
        sys.stdin = None
    for fd, name, errors in ((1, "stdout", "strict"), (2, "stderr", "backslashreplace")):
        try:
            raw = open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)
        except OSError:
            setattr(sys, name, None)
            continue
        line = fd == 2 or raw.isatty()
        setattr(sys, name, io.TextIOWrapper(raw, "utf-8", errors, line_buffering=line, write_through=unbuffered))


def become(request, received, conn):
    # The open files of the `python` that asked, at the same numbers; nothing of this server's.
    spare = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 256) for fd in (conn, *received)]
    for fd in map(int, os.listdir("/proc/self/fd")):
        if fd not in spare:
            try:
                os.close(fd)
            except OSError:
                pass
    watch = spare.pop(0)
    for fd, number in zip(spare, request["fds"]):
        os.dup2(fd, number)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():  # read once at torch's load: set as a fresh one would
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    streams(request["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED")))
    sys.executable = request["python"]
    extra = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]

    def orphaned():  # the `python` that asked is gone (killed): so is this process
        while os.read(watch, 1):
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=orphaned, daemon=True).start()
    mode, target, args = request["mode"], request["target"], request["args"]
    code = 0
    try:
        if mode == "s":
            sys.argv = [target, *args]
            sys.path[:] = [os.path.dirname(os.path.realpath(target)), *extra, *BASE]
            runpy.run_path(target, run_name="__main__")
        elif mode == "m":
            sys.argv = [target, *args]
            sys.path[:] = [os.getcwd(), *extra, *BASE]
            sys.modules.pop(target, None)  # run as __main__ before any import of it, as in a fresh interpreter
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *args]
            sys.path[:] = ["", *extra, *BASE]
            sys.modules["__main__"] = main = types.ModuleType("__main__")
            exec(compile(target, "<string>", "exec"), main.__dict__)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    import atexit
    threading._shutdown()  # as at an interpreter's end: its threads joined, then its exit functions
    atexit._run_exitfuncs()
    for f in (sys.stdout, sys.stderr):
        try:
            f and f.flush()
        except Exception:
            pass
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


waiting, running = [], {}
while True:
    ready = select.select([0, listener, *waiting], [], [], 0.05)[0]
    if 0 in ready and not os.read(0, 1):
        break
    if listener in ready:
        waiting.append(listener.accept()[0])
    for conn in [c for c in waiting if c in ready]:
        waiting.remove(conn)
        head, fds, _, _ = socket.recv_fds(conn, 8, 250)
        size, body = struct.unpack("!Q", head)[0] if len(head) == 8 else -1, b""
        while 0 <= len(body) < size and (part := conn.recv(size - len(body))):
            body += part
        if len(body) != size:
            conn.close()
        else:
            pid = os.fork()
            if pid == 0:
                become(json.loads(body), fds, conn.fileno())
            running[pid] = conn
            conn.sendall(b"%d\n" % pid)
        for fd in fds:
            os.close(fd)
    while running:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if not pid:
            break
        conn = running.pop(pid)
        try:
            conn.sendall(b"%d\n" % status)
        except OSError:
            pass
        conn.close()
for pid in running:
    os.kill(pid, signal.SIGKILL)
"""
"""The process that forks the interpreters :data:`SHIM` asks for (``python server.py ADDRESS MODULE...``); ends when
its stdin closes. It imports torch and the MODULEs (what the commands' scripts import), never the package under
test."""

SHIM = r"""import json, os, signal, socket, struct, sys

args = sys.argv[1:]


def real():
    os.execv({python!r}, [{python!r}, *args])


def parse():
    unbuffered = False
    for i, a in enumerate(args):
        if a == "-u":
            unbuffered = True
        elif a in ("-c", "-m") and i + 1 < len(args):
            return a[1], args[i + 1], args[i + 2 :], unbuffered
        elif a.startswith("-"):
            return None
        else:
            return "s", a, args[i + 1 :], unbuffered
    return None


what = parse()
fds = []
for fd in sorted(map(int, os.listdir("/proc/self/fd"))):
    try:
        os.fstat(fd)
        fds.append(fd)
    except OSError:
        pass
if what is None or max(fds, default=0) >= 200:
    real()
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    sock.connect({address!r})
except OSError:
    real()
mode, target, rest, unbuffered = what
body = json.dumps(dict(mode=mode, target=target, args=rest, unbuffered=unbuffered, cwd=os.getcwd(),
                       env=dict(os.environ), fds=fds, python={shim!r})).encode()
socket.send_fds(sock, [struct.pack("!Q", len(body))], fds)
sock.sendall(body)
replies = sock.makefile("rb")
pid = replies.readline()
if not pid:  # the server is gone
    real()
pid = int(pid)
for fd in fds:
    os.close(fd)  # the fork holds them now: a reader of this process's output sees its end when the fork ends


def forward(sig, frame):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(sig, forward)
line = replies.readline()
code = os.waitstatus_to_exitcode(int(line)) if line else 1
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
os._exit(code & 0xFF)
"""
"""``python`` on a page's ``PATH``: hands the command to :data:`SERVER`'s socket with its open files and waits for
its status; anything else (another option, no server) is the real interpreter's."""


PAGES_IMPORT = (
    "torchmetrics",
    "transformers",
    "pytorch_lightning",
    "lightning.pytorch",
    "megatron.core.parallel_state",
    "torchtitan.distributed.parallel_dims",
)
"""What the docs pages' scripts import, imported once by their :class:`WarmPython`."""


def stop(proc: subprocess.Popen[Any]) -> None:
    """End a server that reads commands on its stdin: its stdin closed, then 30 s, then killed."""
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class WarmPython:
    """:data:`SERVER` running, and ``folder/bin`` holding the ``python`` (:data:`SHIM`), ``torchrun`` and
    ``weightsync-audit`` that go through it: ``python`` is the interpreter to start, ``bin`` the folder to put
    first on ``PATH``. Its commands run as the real interpreter would run them, without importing torch and
    ``imports`` again."""

    def __init__(self, folder: Path, env: dict[str, str], imports: Sequence[str]) -> None:
        address = str(folder / "commands.sock")
        if len(address) > 100:  # a Unix socket's path is short
            address = os.path.join(tempfile.mkdtemp(prefix="zygote-"), "commands.sock")
        (folder / "server.py").write_text(SERVER)
        self.bin = folder / "bin"
        self.bin.mkdir()
        shim = self.bin / "python"
        (folder / "shim.py").write_text(SHIM.replace("{python!r}", repr(sys.executable))
                                        .replace("{address!r}", repr(address)).replace("{shim!r}", repr(str(shim))))  # fmt: skip
        # A shell script, as pip writes one where a path is too long for a "#!" line: the shim keeps its process.
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -IS "{folder / "shim.py"}" "$@"\n')
        for name in ("torchrun", "weightsync-audit"):  # console scripts: the real one's script, through the shim
            script = self.bin / name
            script.write_text(f'#!/bin/sh\nexec "{shim}" "{Path(sys.executable).parent / name}" "$@"\n')
            script.chmod(0o755)
        shim.chmod(0o755)
        self.python = str(shim)
        with (folder / "server.log").open("w") as log:
            self.server = subprocess.Popen(
                [sys.executable, "server.py", address, *imports], cwd=folder, stdin=subprocess.PIPE, stdout=log,
                stderr=log, env=env,
            )  # fmt: skip

    def close(self) -> None:
        """The server ends, and with it any command still running."""
        stop(self.server)


class Zygote:
    """One Python process that imports what the pages share once, then forks a page's run off itself."""

    def __init__(self, folder: Path) -> None:
        (folder / "zygote.py").write_text(SOURCE)
        env = {
            **os.environ,
            "PATH": os.pathsep.join(
                [str(folder / "bin"), str(Path(sys.executable).parent), os.environ.get("PATH", "")]
            ),
            "COLUMNS": "120",
        }
        env.pop("WEIGHTSYNC_AUDIT", None)
        self.warm = WarmPython(folder, env, PAGES_IMPORT)
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
        self.warm.close()
        stop(self.proc)
