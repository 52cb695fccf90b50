"""A preloaded interpreter that forks ``spotswarm worker`` processes for the worker tests.

Each fresh worker interpreter spends about 4.5 CPU-seconds on imports (torch, and ``torch._dynamo``, which
``torch.optim`` imports on first use) before it trains. The tests start 4-8 of them at a time on a 2-core
machine, so they waited mostly on imports. Forked from this process, which has paid for them once, a
worker is up in milliseconds. The children are still real processes: their own sockets, signals, exit
codes and files; only the imports are shared. ``tests/workers/test_devices.py`` and the fleet tests still
run the real ``python -m orchestrator.cli.main`` from a fresh interpreter.

On a machine with a GPU, torch may start CUDA while preloading (a child forked after that cannot use
it: torch refuses), so there each child execs ``python -m orchestrator.cli.main`` instead, set up the same
way: fresh interpreters, as slow as without the zygote, and able to train on the GPU. ``ZYGOTE_EXEC=1``
in the zygote's environment takes that path anywhere (``test_zygote.py``).

Protocol, one JSON object per line: on stdin ``{"argv", "stdout", "stderr", "exit", "cwd", "env"}``;
the answer on stdout is ``{"pid": ...}``. When the child ends, its exit code (negative: the signal
that ended it, as ``subprocess`` says) is written to the ``exit`` file. When stdin closes, every child
still running is killed.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import traceback

from orchestrator.instance import warm_image


def preload() -> None:
    """What the local simulator's warm image preloads, and the worker's command line."""
    import orchestrator.cli.main  # noqa: F401
    import orchestrator.instance.worker  # noqa: F401

    warm_image.preload()


def run_child(command: dict, fresh: bool) -> int:
    """In the forked child: become ``spotswarm worker ARGV`` with its own files, then exit; with
    ``fresh``, by exec'ing a new interpreter for it."""
    for sig in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    # As a fresh interpreter sets it at startup: a write to a peer that has gone raises
    # BrokenPipeError for the code to handle, instead of killing the process.
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, command["stdout"]), (2, command["stderr"])):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.close(null)
    os.chdir(command["cwd"])
    os.environ.clear()
    os.environ.update(command["env"])
    if fresh:
        os.execv(sys.executable, [sys.executable, "-m", "orchestrator.cli.main", *command["argv"]])
    warm_image.reseed_after_fork()
    sys.argv = ["spotswarm", *command["argv"]]
    from orchestrator.cli.main import main

    try:
        code = main(command["argv"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except BaseException:  # what the interpreter would print and exit 1 for
        traceback.print_exc()
        code = 1
    import atexit

    atexit._run_exitfuncs()  # what a normal exit runs (logging's flush among them)
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _reap(exits: dict[int, str]) -> None:
    while exits:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = exits.pop(pid, None)
        if path is not None:
            with open(path + ".tmp", "w") as f:
                f.write(str(os.waitstatus_to_exitcode(status)))
            os.replace(path + ".tmp", path)  # whole or absent: the test polls it


def main() -> None:
    preload()
    # the variable: to test the exec path anywhere
    fresh = warm_image.cuda_started() or os.environ.get("ZYGOTE_EXEC") == "1"
    exits: dict[int, str] = {}  # running child -> its exit file
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.02)
        _reap(exits)
        if not readable:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            break
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            command = json.loads(line)
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:  # the child never returns into this loop, whatever happens
                code = 1
                try:
                    code = run_child(command, fresh)
                finally:
                    os._exit(code)
            exits[pid] = command["exit"]
            sys.stdout.write(json.dumps({"pid": pid}) + "\n")
            sys.stdout.flush()
    for pid in exits:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in exits:
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
