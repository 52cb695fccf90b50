"""``spotswarm report``: an HTML page and one non-empty PNG plot per chart."""

from __future__ import annotations

import pytest
from PIL import Image

from orchestrator.cli.main import main
from orchestrator.ui.report import write_report

pytestmark = pytest.mark.timeout(120)

FIRST_LINE = (31, 119, 180)  # matplotlib's first line colour, C0
CHARTS = ["throughput", "loss", "instances", "preemptions", "dollars", "dollars_per_million", "savings"]


def test_report_has_every_plot_drawn_and_every_instance_listed(hand_run, tmp_path):
    report = write_report(hand_run.dir, tmp_path / "out")
    assert list(report.plots) == CHARTS
    html = report.index.read_text()
    for chart_id, png in report.plots.items():
        assert png.parent == report.index.parent and png.stat().st_size > 5_000
        assert f'src="{png.name}"' in html
        assert report.points[chart_id] > 0
        with Image.open(png) as image:
            image = image.convert("RGB")
            assert image.size == (700, 340)
            first_line = sum(n for n, rgb in image.getcolors(maxcolors=1 << 20) if rgb == FIRST_LINE)
            assert first_line > 100, f"{png.name}: its first data line is missing"  # not just axes and text
    for instance_id in ("i0", "i1", "i2", "i3", "i4", "i5", "i6"):
        assert f"<td>{instance_id}</td>" in html
    assert f"${hand_run.dollars:.4f}" in html and "lost" in html and "preempted" in html


def test_report_command_writes_into_the_run_directory(hand_run, capsys):
    assert main(["report", str(hand_run.dir)]) == 0
    assert (hand_run.dir / "report" / "index.html").exists()
    assert all((hand_run.dir / "report" / f"{c}.png").exists() for c in CHARTS)
    assert "report:" in capsys.readouterr().out
