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


def test_report_lists_the_rounds_newest_first_and_their_totals(hand_run, tmp_path):
    html = write_report(hand_run.dir, tmp_path / "out").index.read_text()
    rows = "".join(f"<tr><td>{e}</td><td>{n}</td><td>{wall:.2f}</td><td>{compute:.2f}</td><td>{comm:.2f}</td>"
                   f"<td>{pct:.1f}</td></tr>" for e, n, wall, compute, comm, pct in hand_run.round_means)
    # the sum of every epoch's means: 16 s, 12 of them compute and 4 communication
    totals = "<tr><td>all 3 rounds</td><td></td><td>16.00</td><td>12.00</td><td>4.00</td><td>25.0</td></tr>"
    assert "<h2>Rounds</h2>" in html and rows + totals in html
    assert "<td>33.3</td>" in rows  # epoch 19: 2 s of its 6 communicating


def test_report_command_writes_into_the_run_directory(hand_run, capsys):
    assert main(["report", str(hand_run.dir)]) == 0
    assert (hand_run.dir / "report" / "index.html").exists()
    assert all((hand_run.dir / "report" / f"{c}.png").exists() for c in CHARTS)
    assert "report:" in capsys.readouterr().out
