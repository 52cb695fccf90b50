"""The local simulator's warm image: one preloaded interpreter that forks its instances' workers.

A worker interpreter spends about 5 CPU-seconds on imports before it trains (torch, the
``torch._dynamo`` every ``torch.optim`` optimizer imports on its first call, our modules).  On a
cloud each instance pays that on its own cores, overlapped with its provisioning; the simulator's
instances share this machine's cores, so every replacement's imports were taken from the peers
still training, and a replacement was productive only seconds after its launch.  Forked from this
process, which paid for them once, a worker starts in milliseconds, and shares the imported pages.

Each instance is still a Ray actor in its own process (``ray_workers.WorkerActor``).  Its actor
connects here; the image forks a child for it that holds the actor's ``WorkerCore``, writes to the
actor's own stdout and stderr (passed over the socket), and serves the actor's calls over that
connection.  The child ends when its actor's process does (a kill of the actor is a kill of the
worker), and the actor ends when its child does.  The socket lives in a directory only this user
can enter: the calls are pickles.

A child forked after CUDA started could not use it; if preloading started CUDA, the image says so
and actors boot in their own interpreter instead.
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
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

READY = b"listening\n"  # the image's first line: its socket accepts connections (forks wait for the preload)
UNUSABLE = b"x"  # the image's answer instead of forking: its preload started CUDA


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
    process that started it)."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="spotswarm-image-")  # mode 0700
        self.path = str(Path(self._dir.name) / "image.sock")
        self.process = subprocess.Popen([sys.executable, "-m", __name__, self.path, str(os.getpid())],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
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


class ForkedCore:
    """The actor's side: its ``WorkerCore`` in a child of the image; any method call is sent there."""

    def __init__(self, path: str) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)  # refused or absent: the caller boots in its own interpreter
        socket.send_fds(sock, [b"w"], [1, 2])  # its stdout and stderr (a Ray worker's: its log files)
        answer = sock.recv(1)  # after the image's preload
        if answer != b"w":
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


def _serve_actor(sock: socket.socket) -> None:
    """In the forked child: become the actor's worker process and answer its calls until it ends."""
    _, fds, _, _ = socket.recv_fds(sock, 1, 2)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in fds:
        os.close(fd)
    sock.sendall(b"w")
    conn = Connection(sock.detach())
    setup = conn.recv()
    os.chdir(setup["cwd"])
    os.environ.clear()
    os.environ.update(setup["env"])  # the actor's: Ray's settings for it, the run's variables
    sys.path[:] = setup["sys_path"]  # the actor's too: Ray gives it the driver's (a task module beside a script)
    _die_with(setup["actor_pid"])
    reseed_after_fork()
    import torch

    if os.environ.get("OMP_NUM_THREADS", "").isdigit():  # what a fresh interpreter would have read
        torch.set_num_threads(max(int(os.environ["OMP_NUM_THREADS"]), 1))
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


def _fork_worker(sock: socket.socket, usable: bool, close_in_child: list[int]) -> int | None:
    """A worker process for the actor on ``sock``: its pidfd, in the image (None: none forked)."""
    if not usable:
        sock.sendall(UNUSABLE)
        sock.close()
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid != 0:
        sock.close()
        return os.pidfd_open(pid)  # a child not yet waited for: its pid cannot have been reused
    code = 0
    try:  # the child never returns into the image's loop, whatever happens
        for fd in close_in_child:  # the image's listener and pidfds
            os.close(fd)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        _serve_actor(sock)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(path: str, owner_pid: int) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the workers
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
        logger.warning("preloading started CUDA: the warm image cannot fork workers, which boot on their own")
    workers: set[int] = set()  # pidfds of the workers still running
    try:
        while True:
            readable, _, _ = select.select([listener, owner, *workers], [], [])
            if owner in readable:
                return
            for ended in workers.intersection(readable):
                workers.discard(ended)
                os.close(ended)
            if listener in readable:
                sock, _ = listener.accept()
                worker = _fork_worker(sock, usable, [listener.fileno(), owner, *workers])
                if worker is not None:
                    workers.add(worker)
    finally:  # a worker outliving its image is a leak: each ends with its actor, which should be gone by now
        for worker in workers:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(worker, signal.SIGKILL)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    main(sys.argv[1], int(sys.argv[2]))
