"""The claims `benchmarks/bonsai_cpu.py` checks on a study's rows (Tables 2.4 and 2.5)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bonsai_cpu  # noqa: E402


def rows_of(cells: dict[tuple[str, str, str], float]) -> list[dict]:
    return [{"dataset": d, "method": m, "init": i, "mean": v} for (d, m, i), v in cells.items()]


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
