"""This process's Ray session: a local one, or the cluster at an address.  The one way the CLI, a chaos
run, the tests and the benchmarks start Ray as a driver, so each gets the same options and retries."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import tenacity

# What Ray says on a driver's console that is not ours to show (its session's notices, its paragraphs for
# a node or worker that died): here instead, which the run's log takes (``run_log``), not the terminal.
RAY_CONSOLE = logging.getLogger("spotswarm.ray")
RAY_CONSOLE.propagate = False
RAY_CONSOLE.addHandler(logging.NullHandler())
# Ray's loggers whose warnings are notices, not problems: token authentication enabled by default
_NOTICES = ("ray._private.authentication.authentication_token_setup",)


class RayConnectError(RuntimeError):
    """Ray could not be started or joined; the message says what to check."""


class _ToRayConsole(logging.Filter):
    """A record of one of Ray's notice loggers goes to ``RAY_CONSOLE`` instead of the terminal."""

    def filter(self, record: logging.LogRecord) -> bool:
        RAY_CONSOLE.info("%s", record.getMessage())
        return False


def _quiet_notices() -> None:
    for name in _NOTICES:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ToRayConsole) for f in logger.filters):
            logger.addFilter(_ToRayConsole())


@contextlib.contextmanager
def run_log(path: Path) -> Iterator[None]:
    """While it lasts, what Ray says on this driver's console (``RAY_CONSOLE``) goes to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    RAY_CONSOLE.addHandler(handler)
    RAY_CONSOLE.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        RAY_CONSOLE.removeHandler(handler)
        handler.close()


def start_ray(address: str | None = None, num_cpus: int = 2, namespace: str = "spotswarm") -> None:
    """A local Ray session (``address`` None), or the existing cluster at ``address``; the one way
    the CLI and the tests start Ray."""
    import ray

    _quiet_notices()
    options = dict(include_dashboard=False, log_to_driver=False, configure_logging=False, namespace=namespace)
    if address is None:
        options.update(address="local", num_cpus=num_cpus)  # "local": never a cluster left over on this box
    else:
        options.update(address=address)
        options.pop("include_dashboard")
    # a fresh local ray.init occasionally fails on a busy machine; joining retries through a head restart
    retrying = tenacity.Retrying(stop=tenacity.stop_after_attempt(3), wait=tenacity.wait_fixed(1.0), reraise=True)
    main_thread = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if main_thread else None
    try:
        retrying(ray.init, **options)
    except Exception as e:
        if address is None:
            raise
        raise RayConnectError(
            f"cannot join the Ray cluster at {address}: {e}. Check that its head runs (`ray start --head`), "
            "that this machine reaches it, and, with token authentication, that RAY_AUTH_MODE=token and "
            "RAY_AUTH_TOKEN (or ~/.ray/auth_token) hold the head's token") from None
    finally:  # ray.init makes SIGTERM exit at once: a command's own graceful stop must stay in place
        if sigterm is not None:
            signal.signal(signal.SIGTERM, sigterm)
    _quiet_worker_deaths()


# Ray's paragraphs for a worker process or a whole node that died (a raylet's with the last 20 lines of
# its log): on a spot fleet, a preemption
_PREEMPTION_NOISE = ("worker died or was killed", "has been marked dead because the detector", "raylet is terminated")


def _quiet_worker_deaths() -> None:
    """Ray prints a paragraph on the driver's stdout for every worker process or node that dies ("A
    worker died or was killed ... OOM killer ...", "... has been marked dead ...").  On a spot fleet
    that is a preemption, which the supervisor reports in one line of its own, so those paragraphs
    go to the debug log."""
    import ray._private.worker as ray_worker

    original = ray_worker.print_to_stdstream
    if getattr(original, "spotswarm_quiet", False):
        return

    def print_to_stdstream(data: dict, ignore_prefix: bool) -> None:
        if data.get("pid") == "raylet" and any(quiet in line.lower() for line in data.get("lines", ())
                                                for quiet in _PREEMPTION_NOISE):
            RAY_CONSOLE.debug("%s", " ".join(data["lines"]))
            return
        original(data, ignore_prefix)

    print_to_stdstream.spotswarm_quiet = True  # type: ignore[attr-defined]
    ray_worker.print_to_stdstream = print_to_stdstream
