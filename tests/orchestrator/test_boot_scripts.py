"""The boot scripts run by bash as a machine runs them: Ray's boot commands in Ray's order (the head's
and the workers' own last), each line on the console, the first failure named and the rest not run; a
head's script then hands over to ``spotswarm head-boot``, which says on the console why it cannot boot."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from orchestrator.config.schema import ClusterConfig
from orchestrator.providers.bootstrap import BOOT_FAILED, render_boot_script, render_head_script


def config(tmp_path: Path, **commands: list[str]) -> ClusterConfig:
    return ClusterConfig.model_validate({
        "cluster_name": "boot", "provider": {"type": "local", "zones": ["a"]}, "head_node_type": "head",
        "available_node_types": {"head": {"max_workers": 0}, "w": {"min_workers": 1, "max_workers": 1}},
        **commands})


def run(script: str, tmp_path: Path) -> subprocess.CompletedProcess:
    path = tmp_path / "boot.sh"
    path.write_text(script)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "SPOTSWARM_HOME": str(tmp_path / "home"), "RAY_AUTH_TOKEN": "t"}
    return subprocess.run(["bash", str(path)], capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)


def order_commands(log: Path) -> dict[str, list[str]]:
    step = f"echo $0 >> {log}"
    return {key: [step.replace("$0", f"{key}-{i}") for i in range(2)]
            for key in ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands")}


def test_the_heads_script_runs_rays_commands_in_order_then_head_boot_says_why_it_cannot_boot(tmp_path):
    log = tmp_path / "order.log"
    script = render_head_script(config(tmp_path, **order_commands(log)), str(tmp_path / "no-archive"))
    done = run(script, tmp_path)
    assert done.returncode == 1
    assert log.read_text().split() == ["initialization_commands-0", "initialization_commands-1", "setup_commands-0",
                                       "setup_commands-1", "head_setup_commands-0", "head_setup_commands-1"]
    lines = done.stdout.splitlines()
    assert lines[0] == "spotswarm-boot: the head of run boot boots"
    assert lines[1].startswith("spotswarm-boot: initialization_commands[0]: echo initialization_commands-0 >> ")
    assert lines[-1] == f"{BOOT_FAILED}: ArchiveMissing: {tmp_path / 'no-archive'}: no launch there " \
                        f"(no {tmp_path / 'no-archive' / 'launch' / 'launch.json'})"


def test_a_failing_command_ends_the_boot_named_and_the_rest_never_runs(tmp_path):
    log = tmp_path / "order.log"
    commands = order_commands(log)
    commands["setup_commands"].insert(1, "echo broken image >&2; exit 7")
    for script in (render_head_script(config(tmp_path, **commands), str(tmp_path / "archive")),
                   render_boot_script(config(tmp_path, **commands), "w", "127.0.0.1:1", "w-0")):
        log.unlink(missing_ok=True)
        done = run(script, tmp_path)
        assert done.returncode == 7
        assert log.read_text().split() == ["initialization_commands-0", "initialization_commands-1", "setup_commands-0"]
        assert done.stdout.splitlines()[-1] == \
            f"{BOOT_FAILED}: setup_commands[1] exited with status 7: echo broken image >&2; exit 7"
        assert "broken image" in done.stderr


def test_a_workers_script_runs_its_own_commands_and_not_the_heads(tmp_path):
    log = tmp_path / "order.log"
    commands = order_commands(log)
    commands["worker_setup_commands"].append("exit 4")  # ray start is never reached
    done = run(render_boot_script(config(tmp_path, **commands), "w", "127.0.0.1:1", "w-0"), tmp_path)
    assert done.returncode == 4
    assert log.read_text().split() == ["initialization_commands-0", "initialization_commands-1", "setup_commands-0",
                                       "setup_commands-1", "worker_setup_commands-0", "worker_setup_commands-1"]


def test_without_commands_the_scripts_are_as_before(tmp_path):
    script = render_boot_script(config(tmp_path), "w", "127.0.0.1:1", "w-0")
    assert "spotswarm_step" not in script and "set +e" not in script
