"""The claims `benchmarks/bonsai_cpu.py` checks on a study's rows (Tables 2.4 and 2.5)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from owai.methods.coloredmnist import table_metric

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bonsai_claims  # noqa: E402
import bonsai_cpu  # noqa: E402


def rows_of(cells: dict[tuple[str, str, str], float]) -> list[dict]:
    """Study rows as `owai bonsai --study` writes them: each names its table metric."""
    return [{"dataset": d, "method": m, "init": i, "metric": table_metric(d, m, i), "mean": v} for (d, m, i), v in cells.items()]


def table25(pi_cmnist: float, pi_inverse: float) -> list[dict]:
    cells = {("coloredmnist", "pi", "rand"): pi_cmnist, ("inverse-coloredmnist", "pi", "rand"): pi_inverse,
             ("coloredmnist", "erm", "bonsai-cf"): 0.30, ("inverse-coloredmnist", "erm", "bonsai-cf"): 0.70}
    for k, m in enumerate(bonsai_cpu.INVARIANT):
        cells[("coloredmnist", m, "bonsai-cf")] = 0.68 + 0.005 * k
        cells[("inverse-coloredmnist", m, "bonsai-cf")] = 0.72 + 0.02 * k
    return rows_of(cells)


@pytest.mark.parametrize("pi_cmnist, pi_inverse, holds", [
    (0.709, 0.510, [True, True]),    # the thesis's pattern
    (0.600, 0.510, [False, True]),   # PI does not work on ColoredMNIST
    (0.709, 0.710, [True, False]),   # PI on Inverse above ERM-cf (0.70): not a failure
    (0.709, 0.650, [True, True]),
])
def test_table25_claims(pi_cmnist, pi_inverse, holds):
    claims = bonsai_cpu.pattern_pi(table25(pi_cmnist, pi_inverse))
    assert [h for _, h, _ in claims] == holds
    assert "PI fails on inverse-coloredmnist" in claims[1][0]


def test_table24_claims_and_a_missing_cell():
    cells = {("coloredmnist-gray", "erm", "rand"): 0.72, ("coloredmnist", "erm", "rand"): 0.27}
    for m in bonsai_cpu.INVARIANT:
        cells[("coloredmnist", m, "rand")] = 0.50
        cells[("coloredmnist", m, "bonsai-cf")] = 0.70
    assert [h for _, h, _ in bonsai_cpu.pattern(rows_of(cells))] == [True, True, True]
    cells[("coloredmnist", "clove", "bonsai-cf")] = 0.62  # 10 points under the oracle
    assert [h for _, h, _ in bonsai_cpu.pattern(rows_of(cells))] == [True, True, False]
    del cells[("coloredmnist-gray", "erm", "rand")]
    assert bonsai_cpu.pattern(rows_of(cells)) == [] and bonsai_cpu.pattern_pi(rows_of(cells)) == []


def test_claims_on_pooled_study_reports(tmp_path, capsys):
    """bonsai_claims pools the rows of several `--study --json` reports (one per column) and checks
    the claims on the whole table; a cell in two reports and an unreadable report are errors."""
    cells = {("coloredmnist-gray", "erm", "rand"): 0.72, ("coloredmnist", "erm", "rand"): 0.27}
    for m in bonsai_cpu.INVARIANT:
        cells[("coloredmnist", m, "rand")] = 0.50
        cells[("coloredmnist", m, "bonsai-cf")] = 0.70
    rows = [dict(r, std=0.0, n=1, thesis=None) for r in rows_of(cells)]
    rand = tmp_path / "rand.json"
    rand.write_text(json.dumps({"rows": [r for r in rows if r["init"] == "rand"]}))
    cf = tmp_path / "cf.json"
    cf.write_text(json.dumps({"rows": [r for r in rows if r["init"] == "bonsai-cf"]}))
    assert bonsai_claims.main([str(rand)]) == 0  # no Bonsai-cf rows: that claim is left out, the others hold
    out = capsys.readouterr().out
    assert out.count("holds ") == 2 and "Bonsai-cf" not in out
    assert bonsai_claims.main([str(cf)]) == 1  # no oracle: nothing decided
    assert "no claim can be decided" in capsys.readouterr().out
    assert bonsai_claims.main([str(rand), str(cf)]) == 0
    assert capsys.readouterr().out.count("holds ") == 3
    low = tmp_path / "low.json"
    low.write_text(json.dumps({"rows": [dict(r, mean=0.60) if r["method"] == "clove" else r
                                        for r in rows if r["init"] == "bonsai-cf"]}))
    assert bonsai_claims.main([str(rand), str(low)]) == 1
    assert "FAILS  Bonsai-cf" in capsys.readouterr().out
    assert bonsai_claims.main([str(rand), str(cf), str(cf)]) == 2
    assert "in two reports" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{not json")
    assert bonsai_claims.main([str(tmp_path / "bad.json")]) == 2


def test_claims_window_option_errors(tmp_path, capsys):
    """`--window` takes all or a12; a12 needs the report's sweep directory, and a missing one is a
    one-line error (exit 2), not a traceback."""
    assert bonsai_claims.main(["--window", "first", "r.json"]) == 2
    assert bonsai_claims.main(["--window", "a12"]) == 2
    assert "--window takes all or a12" in capsys.readouterr().err
    report = tmp_path / "r.json"
    report.write_text(json.dumps({"rows": [], "sweep_dir": str(tmp_path / "gone")}))
    assert bonsai_claims.main(["--window", "a12", str(report)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "gone" in err and err.count("\n") == 1
