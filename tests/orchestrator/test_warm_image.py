"""The local simulator's warm image: workers forked from one preloaded interpreter, each bound to its
actor's process as the in-process worker was (a kill of either is a kill of both), answering its
actor's calls as the in-process ``WorkerCore`` would, errors included.  This test's process stands in
for the Ray actor (the fleet tests run the real ones)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from orchestrator.instance.warm_image import ForkedCore, WarmImage

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parent.parent.parent


@pytest.fixture(scope="module")
def image():
    image = WarmImage()
    yield image
    image.close()


def _actor(image: WarmImage) -> subprocess.Popen:
    """A stand-in actor process: connects, prints its worker's pid, then makes one status call per
    line on its stdin."""
    script = textwrap.dedent(f"""
        import sys
        from orchestrator.instance.warm_image import ForkedCore
        core = ForkedCore({image.path!r})
        print(core.worker_pid, flush=True)
        for line in sys.stdin:
            print(core.status()["worker_pid"], flush=True)
    """)
    return subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def _kill(pid: int) -> None:
    try:
        psutil.Process(pid).kill()
    except psutil.NoSuchProcess:
        pass


def test_each_actor_gets_its_own_worker_process_with_its_own_identity(image):
    first, second = ForkedCore(image.path), ForkedCore(image.path)
    try:
        assert len({first.worker_pid, second.worker_pid, psutil.Process().pid}) == 3
        assert psutil.Process(first.worker_pid).ppid() == image.process.pid
        assert first.peer_id() != second.peer_id()
        status = first.status()
        assert (status["worker_pid"], status["epoch"], status["left"], status["phase"]) == \
            (first.worker_pid, 0, False, "idle")
        assert first.history() == [] and first.expert_stats() == {"role": "trainer"}
    finally:
        _kill(first.worker_pid)
        _kill(second.worker_pid)


def test_an_error_in_the_worker_is_raised_in_its_actor_and_the_worker_answers_on(image):
    core = ForkedCore(image.path)
    try:
        with pytest.raises(Exception, match="no_such_setting"):
            core.start({"no_such_setting": 1})  # the worker's config refuses it, as in-process
        with pytest.raises(AttributeError, match="_secret"):
            core._call("_secret")  # only the core's public calls
        assert core.status()["worker_pid"] == core.worker_pid
    finally:
        _kill(core.worker_pid)


def test_a_killed_actor_takes_its_worker_with_it(image):
    actor = _actor(image)
    worker = psutil.Process(int(actor.stdout.readline()))
    actor.kill()  # as the simulator preempts an instance still booting: its actor's process
    actor.wait(timeout=10)
    worker.wait(timeout=10)  # raises TimeoutExpired if the worker outlived its actor
    assert not worker.is_running()


def test_an_actor_whose_worker_died_ends_too(image):
    actor = _actor(image)
    try:
        worker_pid = int(actor.stdout.readline())
        actor.stdin.write("status\n")
        actor.stdin.flush()
        assert int(actor.stdout.readline()) == worker_pid
        psutil.Process(worker_pid).kill()  # crashed, or killed by the simulator
        actor.stdin.write("status\n")
        actor.stdin.flush()
        assert actor.wait(timeout=10) == 70  # the supervisor then sees a dead worker and replaces it
    finally:
        actor.kill()


def test_the_image_ends_with_its_owner_and_when_closed(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys
        from orchestrator.instance.warm_image import WarmImage
        print(WarmImage().process.pid, flush=True)
        sys.stdin.read()
    """)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        orphan = psutil.Process(int(owner.stdout.readline()))
        owner.kill()  # no close: a supervisor killed outright
        orphan.wait(timeout=30)
    finally:
        owner.kill()
    image = WarmImage()
    worker = psutil.Process(ForkedCore(image.path).worker_pid)  # its actor, this process, lives on
    image.close()
    worker.wait(timeout=10)  # a worker outliving its image would be a leak nobody looks for
    assert image.process.returncode is not None and not Path(image.path).parent.exists()


def test_no_image_at_that_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        ForkedCore(str(tmp_path / "absent.sock"))  # the actor then boots in its own process
