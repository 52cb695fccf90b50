"""What a laptop user meets when ``spotswarm up`` launches the head (moto, and the harness that boots
instances from their user data; no Ray here: these heads never get that far): a failing setup command,
a head that never boots, a second ``up`` of a run whose head is up, an archive bucket that does not
exist.  Each is one message and exit 2, the head's console shown where it has one, and nothing is left
running in EC2 (what was launched is terminated, or named with the command that does it)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

pytest.importorskip("boto3")
pytest.importorskip("s3fs")

from orchestrator.cli.main import main  # noqa: E402
from tests.orchestrator.run_checks import laptop_yaml, spotswarm_command  # noqa: E402

pytestmark = [pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cloud(aws, aws_proxy, ec2_harness):  # noqa: ANN001, ANN201
    """moto with the shipped config's bucket and the head's instance profile; EC2 behind the proxy."""
    import boto3

    boto3.client("s3", endpoint_url=aws).create_bucket(Bucket="spotswarm-runs")
    boto3.client("iam", endpoint_url=aws).create_instance_profile(InstanceProfileName="spotswarm-head")
    return aws, aws_proxy, boto3.client("ec2", endpoint_url=aws)


def config_in(folder: Path, cloud, **top) -> Path:  # noqa: ANN001
    """The shipped example in ``folder``, pointed at the stand-ins, with ``top`` keys set."""
    aws, proxy, _ = cloud
    return laptop_yaml(folder, "aws-spot.yaml", proxy.url, aws, **top)


def running(ec2) -> list[str]:  # noqa: ANN001
    pages = ec2.describe_instances(Filters=[{"Name": "instance-state-name", "Values": ["pending", "running"]}])
    return [i["InstanceId"] for r in pages["Reservations"] for i in r["Instances"]]


def test_a_failing_setup_command_is_shown_with_the_heads_console_and_the_head_terminated(
        tmp_path, cloud, monkeypatch, capsys):
    path = config_in(tmp_path, cloud, setup_commands=["echo preparing the image", "exit 3"])
    monkeypatch.chdir(path.parent)
    assert main(["up", path.name]) == 2
    out = capsys.readouterr().out
    assert "the head did not boot: setup_commands[1] exited with status 3: exit 3" in out
    console = out[out.index("the end of its console output"):]
    assert "spotswarm-boot: setup_commands[0]: echo preparing the image" in console
    assert "\n  preparing the image\n" in console  # the command's own output, from the machine's console
    assert "terminated what the run had launched: i-" in out
    assert running(cloud[2]) == []
    assert not (tmp_path / "runs").exists()


def test_a_head_that_never_boots_is_shown_and_terminated_after_the_boot_timeout(tmp_path, cloud, monkeypatch,
                                                                                  capsys):
    path = config_in(tmp_path, cloud, initialization_commands=["sleep 300"])
    monkeypatch.chdir(path.parent)
    assert main(["up", path.name, "--boot-timeout", "3"]) == 2
    out = capsys.readouterr().out
    assert "the head did not boot: no word from the head in its archive within 3 s of its launch" in out
    assert "spotswarm-boot: initialization_commands[0]: sleep 300" in out
    assert running(cloud[2]) == []


def test_a_second_up_of_a_run_whose_head_is_up_is_refused_and_down_terminates_the_head(
        tmp_path, cloud, ec2_harness, wait_for, capsys):
    path = config_in(tmp_path / "laptop", cloud, initialization_commands=["sleep 300"])  # it boots for long
    out = tmp_path / "up.out"
    first = spotswarm_command(["up", path.name], path.parent, out)
    try:
        wait_for(lambda: "following the run" in out.read_text() and ec2_harness.alive(), 60, "the head launched")
        (head,) = running(cloud[2])

        elsewhere = config_in(tmp_path / "elsewhere", cloud, initialization_commands=["sleep 300"])
        assert main(["up", str(elsewhere)]) == 2
        err = capsys.readouterr().err
        assert f"run aws-demo is already up (head {head} (running))" in err and "nothing started" in err
        assert running(cloud[2]) == [head]

        first.send_signal(signal.SIGINT)  # Ctrl-C: the laptop stops following; the head goes on
        assert first.wait(timeout=30) == 0
        assert "stopped following; the run goes on (`spotswarm down aws-spot.yaml` stops it)" in out.read_text()
        assert running(cloud[2]) == [head]
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(30)
    assert main(["down", str(elsewhere)]) == 0
    said = capsys.readouterr().out
    assert "no head has published" in said and f"terminated 1 instance tagged with the run ({head})" in said
    assert running(cloud[2]) == []


def test_up_with_a_missing_archive_bucket_launches_nothing(tmp_path, cloud, monkeypatch, capsys):
    path = config_in(tmp_path, cloud, checkpoint={"uri": "s3://no-such-bucket/r", "endpoint_url": cloud[0]})
    monkeypatch.chdir(path.parent)
    assert main(["up", path.name]) == 2
    err = capsys.readouterr().err
    assert "checkpoint.uri cannot take the run's archive: s3://no-such-bucket/r" in err and "nothing started" in err
    assert running(cloud[2]) == []
