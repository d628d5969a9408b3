"""Full chapter-3 reproductions on their `cpu` presets (minutes): `python -m pytest -m slow`."""

from __future__ import annotations

import pytest

from owai.experiment import execute

pytestmark = pytest.mark.slow


def test_three_moons_cpu_preset_reproduces_figures_3_5_3_6_b1(tmp_path):
    run, results = execute("three-moons", "cpu", [], out=tmp_path)
    m = {row["metric"]: row["measured"] for row in results["rows"]}
    panels = results["details"]["panels"]
    for panel in ("train", "val"):
        lcm = {"train": 222.2, "val": 266.7}[panel]
        periods = {"train": [22.2, 44.4, 111.1], "val": [44.4, 88.9, 133.3]}[panel]
        assert tuple(panels[panel]) in {(0.5, 1.0, 2.5), (1.0, 2.0, 3.0)}
        # Fig 3.5: one memory drops only once the context passes the lcm
        drops1 = m[f"heads1.{panel}.transitions"]
        assert drops1 and all(t > 0.95 * lcm for t in drops1) and abs(drops1[0] - lcm) < 8
        # Fig 3.6: three memories drop at each moon's period, accurate well before the lcm
        drops3 = m[f"heads3.{panel}.transitions"]
        assert len(drops3) >= 3 and all(abs(t - p) < 8 for t, p in zip(drops3, periods))
        assert m[f"heads3.{panel}.accurate_from_over_lcm"] < 0.75
    # Fig B.1: one moon per head
    assert m["heads3.one_moon_per_head"] and m["heads3.disentanglement"] > 0.95
    assert m["heads1.disentanglement"] < 0.8
    for fig in ("fig3.5-single-head", "fig3.6-three-heads", "figB.1-matrices"):
        assert (run.path / "figures" / f"{fig}.png").is_file()


def test_figure_3_1_cpu_preset_shows_the_sample_complexity_gap(tmp_path):
    _, results = execute("linear-disentanglement", "cpu", [], out=tmp_path)
    m = {row["metric"]: row["measured"] for row in results["rows"]}
    assert m["sample_complexity_ratio"] is not None and m["sample_complexity_ratio"] > 5
