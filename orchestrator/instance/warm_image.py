"""The local simulator's warm image: one preloaded interpreter that forks its instances' workers.

A worker interpreter spends seconds of CPU on imports before it trains (torch, the
``torch._dynamo`` every ``torch.optim`` optimizer imports on its first call, our modules).  On a
cloud each instance pays that on its own cores, overlapped with its provisioning; the simulator's
instances share this machine's cores, so a replacement's imports would be taken from the peers
still training, and the replacement would be productive only seconds after its launch.  Forked from this
process, which paid for them once, a worker starts in milliseconds, and shares the imported pages.

Each instance is still a Ray actor in its own process (``instance/actor.py``'s ``WorkerActor``).  Its actor
connects here; the image forks a child for it that holds the actor's ``WorkerCore``, writes to the
actor's own stdout and stderr (passed over the socket), and serves the actor's calls over that
connection.  The child ends when its actor's process does (a kill of the actor is a kill of the
worker), and the actor ends when its child does.  The socket lives in a directory only this user
can enter: the calls are pickles.

The same image also runs a command (``ForkedCommand``): ``python -m MODULE ARGV`` in a forked child,
with the files, working directory and environment it is given, whose pid and then exit status the
image reports on the connection, as ``subprocess.Popen`` would have them.  The tests start their
``spotswarm worker`` processes this way: real processes with their own sockets, signals and exit
codes, in milliseconds instead of a fresh interpreter's seconds of imports.

Protocol: a client connects and sends one byte with two file descriptors, the child's stdout and
stderr: ``w`` (a worker for this actor) or ``c`` (a command).  For ``w`` the answer is ``w`` from the
forked child, which then reads the actor's setup and serves its calls (or ``x``: the image cannot
fork workers).  For ``c`` the client sends the command (module, argv, cwd, env, fresh); the image
answers the child's pid, and its exit status once it ended (negative: the signal that ended it).

A child forked after CUDA started could not use it; if preloading started CUDA, the image says so,
actors boot in their own interpreter instead, and commands exec a fresh interpreter in the fork.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

READY = b"listening\n"  # the image's first line: its socket accepts connections (forks wait for the preload)
WORKER = b"w"  # a request for a worker for the connecting actor, and the forked worker's answer
COMMAND = b"c"  # a request for a command run in a forked child
UNUSABLE = b"x"  # the image's answer instead of forking a worker: its preload started CUDA
REQUEST_TIMEOUT_S = 10.0  # for a client to send its request once connected (it sends it at once)
END_WAIT_S = 5.0  # as the image ends, for its SIGKILLed children to be gone


def preload() -> None:
    """Everything a worker imports before it trains, and the first optimizer step's lazy imports."""
    import torch

    import orchestrator.instance.core  # noqa: F401
    import orchestrator.instance.notices  # noqa: F401
    import workers.expert_host  # noqa: F401
    import workers.peer  # noqa: F401

    weight = torch.nn.Parameter(torch.zeros(1))
    weight.grad = torch.zeros(1)
    torch.optim.Adam([weight]).step()  # torch.optim's first step is what imports torch._dynamo
    assert threading.active_count() == 1, "a Python thread before fork would be lost in the children"


def cuda_started() -> bool:
    """Whether this process started CUDA, which a child forked from it could then not use."""
    import torch

    return torch.cuda.is_initialized()


class WarmImage:
    """The image process, owned by the local provider (it ends with the provider, or with the
    process that started it); ``env``: its environment, else this process's."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="spotswarm-image-")  # mode 0700
        self.path = str(Path(self._dir.name) / "image.sock")
        self.process = subprocess.Popen([sys.executable, "-m", __name__, self.path, str(os.getpid())],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=env)
        assert self.process.stdout is not None
        line = self.process.stdout.readline()  # within a fraction of a second: bound before the preload
        self.process.stdout.close()
        if line != READY:
            self.process.wait(timeout=10)
            raise RuntimeError(f"the warm image did not start (exit code {self.process.returncode})")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._dir.cleanup()


def _request(path: str, kind: bytes, stdout: int, stderr: int) -> socket.socket:
    """A connection to the image at ``path`` that asked for a ``kind`` child writing to these files."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)  # refused or absent: the caller runs without the image
        socket.send_fds(sock, [kind], [stdout, stderr])
    except BaseException:
        sock.close()
        raise
    return sock


class ForkedCore:
    """The actor's side: its ``WorkerCore`` in a child of the image; any method call is sent there."""

    def __init__(self, path: str) -> None:
        sock = _request(path, WORKER, 1, 2)  # its stdout and stderr (a Ray worker's: its log files)
        answer = sock.recv(1)  # after the image's preload
        if answer != WORKER:
            sock.close()
            raise RuntimeError("the warm image cannot fork workers here (its preload started CUDA)"
                               if answer == UNUSABLE else "the warm image closed the connection")
        self._conn = Connection(sock.detach())
        self._conn.send({"env": dict(os.environ), "cwd": os.getcwd(), "sys_path": list(sys.path),
                         "actor_pid": os.getpid()})
        self.worker_pid: int = self._call("__pid__")
        self._lock = threading.Lock()

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        try:
            self._conn.send((name, args, kwargs))
            ok, value = self._conn.recv()
        except (EOFError, OSError):
            # the worker process died (killed, crashed): so does its instance's actor, as it would
            # have had the worker run in it; the supervisor sees a dead worker and replaces it
            logger.error("the worker process of this actor is gone; exiting")
            os._exit(70)
        if not ok:
            raise value
        return value

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return self._call(name, *args, **kwargs)
        return call


class ForkedCommand:
    """``python -m MODULE ARGV`` in a child of the image, and what callers use of ``subprocess.Popen``
    for it (``pid``, ``poll``, ``wait``, ``send_signal``, ``returncode``).  Its stdout and stderr are
    the files at those paths (truncated).  ``fresh``: exec a new interpreter in the fork, as the image
    does anyway where its preload started CUDA (for a test of that path on any machine)."""

    def __init__(self, path: str, module: str, argv: list[str], stdout: Path, stderr: Path, cwd: Path,
                 env: dict[str, str] | None = None, fresh: bool = False) -> None:
        self.args = [module, *argv]
        self.returncode: int | None = None
        files = [os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for f in (stdout, stderr)]
        try:
            sock = _request(path, COMMAND, *files)
        finally:
            for fd in files:
                os.close(fd)
        self._conn = Connection(sock.detach())
        self._conn.send({"module": module, "argv": list(argv), "cwd": str(cwd),
                         "env": dict(os.environ if env is None else env), "fresh": fresh})
        try:
            self.pid: int = self._conn.recv()
        except (EOFError, OSError):
            self._conn.close()
            raise RuntimeError("the warm image closed the connection") from None
        try:  # the child, not a later process with its pid, whatever happens before a signal is sent
            self._pidfd: int | None = os.pidfd_open(self.pid)
        except ProcessLookupError:  # ended (and reaped) already: its exit status is on its way
            self._pidfd = None

    def poll(self) -> int | None:
        if self.returncode is None and self._conn.poll(0):
            self._take_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not self._conn.poll(timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._take_status()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """As ``Popen.send_signal``: nothing once it ended."""
        if self.poll() is None and self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def _take_status(self) -> None:
        try:
            self.returncode = self._conn.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"the warm image ended without the exit status of {self.pid}") from None
        self._conn.close()
        self._close_pidfd()

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def __del__(self) -> None:  # a command dropped before its end: its descriptor is not kept open
        with contextlib.suppress(AttributeError, OSError):
            self._close_pidfd()


# ---- the image process ---------------------------------------------------------------------------

def _die_with(pid: int) -> None:
    """End this process, at once and without cleanup, when process ``pid`` ends."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(0)

    def watch() -> None:
        select.select([fd], [], [])
        os._exit(0)
    threading.Thread(target=watch, name="die-with-actor", daemon=True).start()


def reseed_after_fork() -> None:
    """A fresh interpreter seeds its generators from the OS; a fork copies the parent's (Python's
    ``random`` reseeds itself on fork, numpy's and torch's do not)."""
    import numpy as np
    import torch

    np.random.seed()
    torch.seed()


def _redirect(fds: list[int]) -> None:
    """In a forked child: the stdout and stderr it was given (the descriptors received, closed)."""
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in fds:
        os.close(fd)


def _become(setup: dict, fds: list[int]) -> None:
    """In a forked child: the stdout, stderr, working directory and environment it was given, and
    what a fresh interpreter would have drawn or read at its start."""
    _redirect(fds)
    os.chdir(setup["cwd"])
    os.environ.clear()
    os.environ.update(setup["env"])
    reseed_after_fork()
    import torch

    if os.environ.get("OMP_NUM_THREADS", "").isdigit():  # what a fresh interpreter would have read
        torch.set_num_threads(max(int(os.environ["OMP_NUM_THREADS"]), 1))


def _serve_actor(sock: socket.socket, fds: list[int]) -> None:
    """In the forked child: become the actor's worker process and answer its calls until it ends."""
    sock.sendall(WORKER)
    conn = Connection(sock.detach())
    setup = conn.recv()
    _become(setup, fds)  # the actor's environment: Ray's settings for it, the run's variables
    sys.path[:] = setup["sys_path"]  # the actor's too: Ray gives it the driver's (a task module beside a script)
    _die_with(setup["actor_pid"])
    from orchestrator.instance.core import WorkerCore

    core: WorkerCore | None = None
    while True:
        try:
            name, args, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if name == "__pid__":
                core = WorkerCore()
                value: Any = os.getpid()
            elif name.startswith("_") or core is None:
                raise AttributeError(f"WorkerCore has no call {name!r}")
            else:
                value = getattr(core, name)(*args, **kwargs)
            answer = (True, value)
        except Exception as e:  # noqa: BLE001 - the actor re-raises it, as the call would have raised there
            answer = (False, e)
        try:
            conn.send(answer)
        except Exception as e:  # noqa: BLE001 - an answer that does not pickle: say what it was
            value = answer[1]
            said = f"{type(value).__name__}: {value}" if not answer[0] else f"an answer that does not pickle ({e})"
            conn.send((False, RuntimeError(f"{name}: {said}")))


def _exit_code(exit_value: Any) -> int:
    """The exit status ``sys.exit(value)`` gives, as the interpreter prints and computes it."""
    if exit_value is None:
        return 0
    if isinstance(exit_value, int):
        return exit_value
    print(exit_value, file=sys.stderr)
    return 1


def _run_command(sock: socket.socket, fds: list[int], usable: bool) -> int:
    """In the forked child: ``python -m MODULE ARGV`` as the client asked, in this interpreter or (not
    ``usable``, or asked ``fresh``) in a new one exec'd here; the exit status."""
    conn = Connection(sock.detach())
    setup = conn.recv()
    conn.close()  # the image reports the exit status on its own end of the connection
    # as a fresh interpreter sets them at its start: a write to a peer that has gone raises
    # BrokenPipeError for the code to handle, and Ctrl-C is a KeyboardInterrupt
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if setup["fresh"] or not usable:
        _redirect(fds)
        os.chdir(setup["cwd"])
        os.execve(sys.executable, [sys.executable, "-m", setup["module"], *setup["argv"]], setup["env"])
    _become(setup, fds)
    import atexit
    import runpy

    sys.argv = [setup["module"], *setup["argv"]]  # argv[0] becomes the module's file, as with -m
    try:
        runpy.run_module(setup["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:  # what the interpreter would print and exit 1 for
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # what a normal exit runs (logging's flush among them)
    return code


def _fork(sock: socket.socket, kind: bytes, fds: list[int], usable: bool,
          close_in_child: list[int]) -> tuple[int, int]:
    """A child for the request on ``sock``: its pid and pidfd, in the image."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid != 0:
        return pid, os.pidfd_open(pid)  # a child not yet waited for: its pid cannot have been reused
    code = 0
    try:  # the child never returns into the image's loop, whatever happens
        for fd in close_in_child:  # the image's listener, pidfds and connections
            os.close(fd)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        if kind == WORKER:
            _serve_actor(sock, fds)
        else:
            code = _run_command(sock, fds, usable)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _accept(listener: socket.socket, usable: bool, children: dict[int, Connection | None],
            close_in_child: list[int]) -> None:
    """Read one client's request and fork its child (``children``: pidfd -> where its exit status
    goes, None for a worker's); a request that cannot be served is answered ``x`` or closed."""
    sock, _ = listener.accept()
    with contextlib.closing(sock):
        sock.settimeout(REQUEST_TIMEOUT_S)
        try:
            kind, fds, _, _ = socket.recv_fds(sock, 1, 2)
        except OSError:
            return
        sock.setblocking(True)
        try:
            if kind == WORKER and not usable:
                sock.sendall(UNUSABLE)
            elif kind in (WORKER, COMMAND) and len(fds) == 2:
                pid, pidfd = _fork(sock, kind, fds, usable, close_in_child)
                children[pidfd] = None
                if kind == COMMAND:
                    children[pidfd] = conn = Connection(sock.detach())
                    conn.send(pid)
        except OSError as e:  # the client left meanwhile: its child, if forked, ends on its own
            logger.info("a request to the warm image failed: %s", e)
        finally:
            for fd in fds:
                os.close(fd)


def _reap(pidfd: int, status_to: Connection | None) -> None:
    """Collect an ended child (never left a zombie) and send its exit status where it goes."""
    try:
        result = os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)
    except ChildProcessError:
        result = None
    os.close(pidfd)
    if status_to is None:
        return
    if result is not None:
        code = result.si_status if result.si_code == os.CLD_EXITED else -result.si_status
        with contextlib.suppress(OSError):  # its client left
            status_to.send(code)
    status_to.close()


def main(path: str, owner_pid: int) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # children are reaped here, for their exit status
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    os.write(1, READY)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    owner = os.pidfd_open(owner_pid)
    preload()
    usable = not cuda_started()
    if not usable:
        logger.warning("preloading started CUDA: the warm image cannot fork workers, which boot on their own, "
                       "and its commands exec a fresh interpreter")
    children: dict[int, Connection | None] = {}  # pidfd of each child still running -> where its status goes
    try:
        while True:
            readable, _, _ = select.select([listener, owner, *children], [], [])
            if owner in readable:
                return
            for ended in [fd for fd in readable if fd in children]:
                _reap(ended, children.pop(ended))
            if listener in readable:
                status_to = [conn.fileno() for conn in children.values() if conn is not None]
                _accept(listener, usable, children, [listener.fileno(), owner, *children, *status_to])
    finally:  # a child outliving its image is a leak: a worker ends with its actor, which should be gone by now
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(child, signal.SIGKILL)
        deadline = time.monotonic() + END_WAIT_S
        while children and (left := deadline - time.monotonic()) > 0:  # each command's status still reported
            ended, _, _ = select.select(list(children), [], [], left)
            for child in ended:
                _reap(child, children.pop(child))


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    main(sys.argv[1], int(sys.argv[2]))
