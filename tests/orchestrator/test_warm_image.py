"""The local simulator's warm image: workers forked from one preloaded interpreter, each bound to its
actor's process as the in-process worker was (a kill of either is a kill of both), answering its
actor's calls as the in-process ``WorkerCore`` would, errors included.  This test's process stands in
for the Ray actor (the fleet tests run the real ones).

Also its commands (``python -m MODULE ARGV`` in a forked child, what the worker tests start their
peers with): their own pid, files, signals and exit status, forked or, as on a machine where the
preload started CUDA, exec'd afresh in the fork."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from orchestrator.host.processes import kill_tree
from orchestrator.host.wait import wait_for
from orchestrator.instance.warm_image import ForkedCommand, ForkedCore, WarmImage

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


def _command(image: WarmImage, argv: list[str], tmp_path: Path, name: str, fresh: bool = False) -> ForkedCommand:
    """``spotswarm ARGV`` forked from the image, its output in ``tmp_path/NAME.out`` and ``.err``."""
    return ForkedCommand(image.path, "orchestrator.cli.main", argv, stdout=tmp_path / f"{name}.out",
                         stderr=tmp_path / f"{name}.err", cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, fresh=fresh)


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
        kill_tree(first.worker_pid)
        kill_tree(second.worker_pid)


def test_an_error_in_the_worker_is_raised_in_its_actor_and_the_worker_answers_on(image):
    core = ForkedCore(image.path)
    try:
        with pytest.raises(Exception, match="no_such_setting"):
            core.start({"no_such_setting": 1})  # the worker's config refuses it, as in-process
        with pytest.raises(AttributeError, match="_secret"):
            core._call("_secret")  # only the core's public calls
        assert core.status()["worker_pid"] == core.worker_pid
    finally:
        kill_tree(core.worker_pid)


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


def test_a_forked_command_is_a_child_of_the_image_with_its_files_and_exit_code(image, tmp_path):
    helped = _command(image, ["--help"], tmp_path, "help")
    refused = _command(image, ["no-such-command"], tmp_path, "bad")
    assert helped.wait(timeout=60) == 0
    assert (tmp_path / "help.out").read_text().startswith("usage: ")
    assert refused.wait(timeout=60) == 2  # argparse's exit code, from the forked interpreter
    assert "invalid choice: 'no-such-command'" in (tmp_path / "bad.err").read_text()


def test_a_forked_command_is_signalled_and_reports_the_signal_that_ended_it(image, tmp_path):
    server = ForkedCommand(image.path, "http.server", ["0", "--bind", "127.0.0.1"], stdout=tmp_path / "s.out",
                           stderr=tmp_path / "s.err", cwd=tmp_path)
    try:
        assert psutil.Process(server.pid).ppid() == image.process.pid
        wait_for(lambda: psutil.Process(server.pid).net_connections("tcp"), 30, "the server to listen")
        assert server.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            server.wait(timeout=0.1)
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == -signal.SIGTERM  # as subprocess says it
        server.send_signal(signal.SIGKILL)  # once it ended, nothing (its pid may be another's)
    finally:
        server.send_signal(signal.SIGKILL)


def test_an_execd_command_writes_to_its_files_and_exits_with_its_own_code(image, tmp_path):
    """The image's other way to run a command, the one a GPU machine takes (where its preload started
    CUDA): a fresh interpreter exec'd in the fork, with the same files and exit code as a forked child."""
    helped = _command(image, ["--help"], tmp_path, "help", fresh=True)
    refused = _command(image, ["no-such-command"], tmp_path, "bad", fresh=True)
    assert helped.wait(timeout=60) == 0
    assert (tmp_path / "help.out").read_text().startswith("usage: ")
    assert refused.wait(timeout=60) == 2  # argparse's exit code, from the exec'd interpreter
    assert "invalid choice: 'no-such-command'" in (tmp_path / "bad.err").read_text()
