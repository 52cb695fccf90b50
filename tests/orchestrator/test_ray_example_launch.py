"""Ray's own AWS example (``ray/autoscaler/aws/defaults.yaml``, as the installed Ray ships it) runs with
``spotswarm up`` from a laptop, only provider and node_config values changed: the endpoints pointed at moto,
an AMI and the head's instance profile.  It names no archive, so the run's goes to the account's default
bucket (created); its boot commands run on the head; ``down`` leaves nothing running."""

from __future__ import annotations

import importlib.util
from contextlib import closing
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray")
pytest.importorskip("boto3")
pytest.importorskip("s3fs")

from orchestrator.cli.main import main  # noqa: E402
from orchestrator.runs.durable import ArchiveError, RunArchive  # noqa: E402
from tests.fakes.machines import Ec2Harness  # noqa: E402
from tests.orchestrator.run_checks import spotswarm_command, while_running  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.heavy]

AMI = "ami-0123456789abcdef0"


def rays_example() -> dict:
    spec = importlib.util.find_spec("ray")
    assert spec is not None and spec.submodule_search_locations
    path = Path(spec.submodule_search_locations[0]) / "autoscaler" / "aws" / "defaults.yaml"
    return yaml.safe_load(path.read_text())


def test_rays_own_aws_example_runs_with_up_from_a_laptop(tmp_path, aws, loop_servers, wait_for, capsys):
    import boto3

    data = rays_example()
    region = data["provider"]["region"]
    data["provider"]["endpoint_url"] = aws
    data["checkpoint"] = {"endpoint_url": aws}  # where S3 is; no uri: the default bucket
    for node_type in data["available_node_types"].values():
        node_type["node_config"]["ImageId"] = AMI
    head = data["available_node_types"][data["head_node_type"]]
    head["node_config"]["IamInstanceProfile"] = {"Name": "ray-head"}
    boto3.client("iam", endpoint_url=aws).create_instance_profile(InstanceProfileName="ray-head")
    laptop = tmp_path / "laptop"
    laptop.mkdir()
    path = laptop / "ray-aws.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    ec2 = boto3.client("ec2", region_name=region, endpoint_url=aws)
    archive = RunArchive(f"s3://spotswarm-123456789012-{region}/default", endpoint_url=aws)  # moto's account

    with closing(Ec2Harness(aws, loop_servers, tmp_path / "machines", region=region)) as harness:
        out = tmp_path / "up.out"
        up = spotswarm_command(["up", path.name], laptop, out)
        try:
            wait = while_running(up, out, wait_for)
            def trains() -> bool:
                try:
                    return (archive.status() or {}).get("epoch", 0) >= 1
                except ArchiveError:  # its bucket is not made yet
                    return False
            wait(trains, 240, "the run of Ray's example to train")
            said = out.read_text()
            assert f"the run's archive: {archive.uri} (checkpoint.uri left out: the default, its bucket created)" \
                in said
            (head_machine,) = [m for m in harness.machines.values() if m.instance_id.startswith("head-")]
            console = harness.console(head_machine.key)
            assert "spotswarm-boot: head_setup_commands[0]: pip install 'boto3>=1.4.8'" in console

            assert main(["down", str(path)]) == 0
            assert "stopped by its head" in capsys.readouterr().out
            assert up.wait(timeout=60) == 0, out.read_text()[-3000:]
        finally:
            if up.poll() is None:
                up.kill()
                up.wait(30)
        pages = ec2.describe_instances(Filters=[{"Name": "instance-state-name", "Values": ["pending", "running"]}])
        assert [i["InstanceId"] for r in pages["Reservations"] for i in r["Instances"]] == []
        assert harness.errors == []
