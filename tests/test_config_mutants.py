"""Mutation audit of the configuration and user-input layer (owai/config.py, recipes.py, sweep.py,
values.py, report.py, commands/_common.py and the commands' option checks).

Each test pins one rule that a small, plausible edit of that layer broke without any other test
failing: a range's bound, a type coercion, a check dropped, an override landing under the wrong
key, a report column. Every test is fast (no training run) and names the rule in its docstring.
"""

from __future__ import annotations

import dataclasses

import pytest

from owai.config import (
    MAX_WORKERS,
    SEED_RANGE,
    BaseConfig,
    apply_overrides,
    build,
    check_count,
)
from owai.errors import OwaiError


def _three_moons_schema() -> type:
    from owai.methods import method_class

    return method_class("three_moons").Config


def _built(schema: type, *sets: str) -> object:
    return build(schema, apply_overrides(schema, {}, list(sets)), path="params")


# --- config.py: types and ranges ----------------------------------------------------------------


def test_a_boolean_is_not_a_float_setting() -> None:
    """`--set train.lr=true` must be refused: YAML reads `true` as a bool, and Python's bool is an
    int, so a float check that forgets to exclude bool would train at a learning rate of 1.0 (the
    int case is pinned in test_recipes_config; the float case was not)."""

    @dataclasses.dataclass
    class C(BaseConfig):
        x: float = 0.5

    with pytest.raises(OwaiError, match=r"^params\.x: expected float, got bool True$"):
        build(C, {"x": True})
    assert build(C, {"x": 1}).x == 1.0 and isinstance(build(C, {"x": 1}).x, float)


def test_a_count_accepts_both_its_bounds_and_nothing_beyond() -> None:
    """check_count's range is closed, [low, high]: `--workers 1024` (MAX_WORKERS) or `--n 100000`
    (MAX_SAMPLES) are documented maxima, so an off-by-one (`< high`) would refuse the maximum the
    error message itself names."""
    check_count("--x", 1, 1, 8)
    check_count("--x", 8, 1, 8)
    for bad in (0, 9, True, 2.0):
        with pytest.raises(OwaiError, match=r"^--x must be between 1 and 8, got "):
            check_count("--x", bad, 1, 8)


def test_a_learning_rate_of_zero_is_refused() -> None:
    """A learning rate must be > 0 (its schedule's end points >= 0): lr=0 trains nothing while
    looking like a run. The existing range test only tries -1, so `v >= 0` passed it."""
    schema = _three_moons_schema()
    with pytest.raises(OwaiError, match=r"^params\.train\.lr must be > 0, got 0\.0$"):
        _built(schema, "train.lr=0")
    assert _built(schema, "train.lr_end=0").train.lr_end == 0.0  # a schedule's end may be 0


def test_a_seed_is_a_64_bit_integer_at_both_ends() -> None:
    """A seed is a 64-bit integer (torch.manual_seed overflows beyond it, inside the run): both
    ends of SEED_RANGE are accepted and one past either end is refused before the run."""
    schema = _three_moons_schema()
    low, high = -(2**63), 2**63 - 1  # literal: the test must not read the bound it checks
    assert SEED_RANGE == (low, high)
    assert _built(schema, f"seed={low}").seed == low
    assert _built(schema, f"seed={high}").seed == high
    for bad in (low - 1, high + 1):
        with pytest.raises(OwaiError, match=r"^params\.seed must be a 64-bit integer"):
            _built(schema, f"seed={bad}")


def test_thread_counts_stop_at_max_workers() -> None:
    """runtime.threads (and every *workers count) is in [0, MAX_WORKERS]: torch.set_num_threads of a
    huge number crashes the process, so the upper bound is the one that matters, and the existing
    test only tried -1."""
    schema = _three_moons_schema()
    assert _built(schema, f"runtime.threads={MAX_WORKERS}").runtime.threads == MAX_WORKERS
    with pytest.raises(OwaiError, match=rf"^params\.runtime\.threads must be between 0 and {MAX_WORKERS:,}, got {MAX_WORKERS + 1}$"):
        _built(schema, f"runtime.threads={MAX_WORKERS + 1}")


def test_a_mappings_keys_are_checked_against_their_type() -> None:
    """A dict setting checks its keys as well as its values: three-moons' `train.restarts` maps a
    number of heads (int) to restarts, so `--set 'train.restarts={one: 1}'` must be refused, not
    kept as a string key that the run then never matches."""
    schema = _three_moons_schema()
    assert _built(schema, "train.restarts={3: 2}").train.restarts == {3: 2}
    with pytest.raises(OwaiError, match=r"^params\.train\.restarts: expected int, got str 'one'$"):
        _built(schema, "train.restarts={one: 1}")


def test_a_context_beyond_max_context_is_named_as_such() -> None:
    """A block size above MAX_CONTEXT (1024k tokens) is refused by its own line naming the maximum
    (issue #40: a typo such as 10000000k), not only by the memory estimate, which says "lower
    data.block_size" without saying how far."""
    from owai.config import MAX_CONTEXT, check_sizes

    @dataclasses.dataclass
    class Data:
        block_size: int = 8

    @dataclasses.dataclass
    class C(BaseConfig):
        data: Data = dataclasses.field(default_factory=Data)

    check_sizes(C(data=Data(MAX_CONTEXT)), limit=1 << 60)
    with pytest.raises(OwaiError, match=r"^params: data\.block_size must be at most 1,048,576 tokens \(1024k\), got 1,048,577$"):
        check_sizes(C(data=Data(MAX_CONTEXT + 1)), limit=1 << 60)


# --- recipes.py: layers -------------------------------------------------------------------------


def _nested_leaves(data: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(_nested_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_a_preset_merges_into_the_params_key_by_key() -> None:
    """defaults <- params <- preset: a preset that names one key of a section leaves the params'
    other keys of that section (tableA.4-simsiam's `pretrain.objective: simsiam` under a cpu preset
    that sets `pretrain.epochs`). A merge that replaced whole sections trained supervised networks
    in the SimSiam recipe, and every recipe still validated."""
    from owai import recipes

    checked = 0
    for name in recipes.available():
        r = recipes.load(name)
        base = _nested_leaves(r.params)
        for preset, layer in r.presets.items():
            merged = _nested_leaves(r.params_for(preset))
            own = _nested_leaves(layer or {})
            for key, value in base.items():
                if not any(key == k or key.startswith(k + ".") or k.startswith(key + ".") for k in own):
                    assert merged.get(key, "<missing>") == value, (name, preset, key)
                    checked += 1
            for key, value in own.items():
                assert merged[key] == value, (name, preset, key)
    assert checked > 100
    assert recipes.load("tableA.4-simsiam").params_for("cpu")["pretrain"]["objective"] == "simsiam"


def _variant(tmp_path, edit) -> str:
    import yaml

    from owai import recipes

    data = yaml.safe_load((recipes.recipe_dir() / "three-moons.yaml").read_text())
    edit(data)
    path = tmp_path / "three-moons.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(default_preset="gpu"), "recipe three-moons: default_preset 'gpu' is not a preset"),
    (lambda d: d.update(sweep={"grid": {"train.lr": [0.1]}, "seeds": []}), "recipe three-moons: sweep has no seeds"),
    (lambda d: d.update(sweep={"grid": {"train.lr": [0.1]}, "select": {"metric": "loss", "per": ["train.lr", "train.lr"]}}),
     "recipe three-moons: sweep select.per repeats a key"),
])
def test_a_recipe_is_refused_on_load_for_what_its_runs_would_trip_on(tmp_path, edit, message) -> None:
    """A recipe is checked whole when it loads (`owai recipes list` validates them all): a default
    preset that does not exist, a sweep with no seeds (no points at all) or a selection grouping by
    one key twice. Each is one line naming the problem, not a later failure of the first run."""
    from owai import recipes

    with pytest.raises(OwaiError) as err:
        recipes.load(_variant(tmp_path, edit))
    assert str(err.value) == message


def test_a_packaged_recipe_must_be_named_by_its_id(tmp_path, monkeypatch) -> None:
    """Packaged recipes are found by file name (`owai recipes run ID`), so a packaged file whose id
    differs from its name is refused on load; a user's recipe file given by path may be named
    anything (test_hardening_cli)."""
    from owai import recipes

    text = (recipes.recipe_dir() / "three-moons.yaml").read_text()
    (tmp_path / "other-name.yaml").write_text(text)
    monkeypatch.setattr(recipes, "recipe_dir", lambda: tmp_path)
    with pytest.raises(OwaiError, match=r"id 'three-moons' does not match the file name; rename it to three-moons\.yaml$"):
        recipes.load("other-name")


# --- config.py: a mapping given for a section ----------------------------------------------------


def test_a_mapping_set_keeps_the_presets_other_keys_of_that_section() -> None:
    """`--set 'eval={tau_stride: 2}'` sets the keys it names, as `--set eval.tau_stride=2` does (the
    unused-settings check, `override_leaves`, reads it key by key): three-moons' cpu preset keeps its
    `eval.n_sequences: 32`. Before, the mapping replaced the preset's whole `eval` section and
    n_sequences silently became the dataclass default (512, the paper's). A mapping-valued setting
    (`penalty.options`, a dict) is still replaced whole."""
    from owai import recipes
    from owai.experiment import resolve

    r = recipes.load("three-moons")
    by_key, _ = resolve(r, "cpu", ["eval.tau_stride=2"], missing_ok=True)
    by_mapping, _ = resolve(r, "cpu", ["eval={tau_stride: 2}"], missing_ok=True)
    assert by_key.eval.n_sequences == 32
    assert by_mapping.eval == by_key.eval
    # a mapping-valued setting inside it is replaced, not merged: {3: 2} alone, not {1: 1, 3: 2}
    within, _ = resolve(r, "cpu", ["train={restarts: {3: 2}}"], missing_ok=True)
    assert within.train.restarts == {3: 2}
    assert dataclasses.replace(within.train, restarts=by_key.train.restarts) == by_key.train


# --- values.py and report.py: what a report prints -----------------------------------------------


def test_only_finite_numbers_count_as_measured() -> None:
    """`numeric` is what a sweep's mean, a selection's score and a claim read: a NaN or infinite
    value is not a number there (it would make a cell's mean NaN and a claim compare against it);
    a bool counts as 0/1 so that a mean of booleans is a fraction."""
    from owai.values import numeric

    assert [numeric(v) for v in (float("nan"), float("inf"), -float("inf"), "1", [1], None)] == [None] * 6
    assert (numeric(2), numeric(0.5), numeric(True)) == (2.0, 0.5, 1.0)


def test_a_table_value_has_four_significant_digits() -> None:
    """A measured or thesis number prints with 4 significant digits (`fmt`), the precision the
    thesis's tables give (0.5402, 1.494): three would print a thesis's 1.494 as 1.49."""
    from owai.values import fmt

    assert [fmt(0.54021), fmt(1.494), fmt(123456.0), fmt(True), fmt(None), fmt([0.123456, 2])] == \
        ["0.5402", "1.494", "1.235e+05", "yes", "-", "[0.1235, 2]"]


def test_json_nulls_non_finite_numbers_inside_tuples_too() -> None:
    """Strict JSON: every NaN / infinity becomes null, in tuples as in lists (a method's details
    may hold tuples, e.g. a transition point's (tau, error))."""
    from owai.values import finite_json

    assert finite_json({"a": (1.0, float("nan")), "b": [float("inf"), {"c": (float("-inf"),)}]}) == \
        {"a": [1.0, None], "b": [None, {"c": [None]}]}


RESULTS = {"recipe": "r", "reproduces": "Table 9.9", "preset": "cpu", "command": "owai x", "run_dir": "runs/x",
           "rows": [{"metric": "acc", "measured": 0.12345, "thesis": 0.9, "thesis_claim": "weak", "ref": "Table 9.9"},
                    {"metric": "loss", "measured": None, "thesis": None, "thesis_claim": "lower", "ref": ""}]}


def test_the_markdown_report_puts_each_number_in_its_column() -> None:
    """The report prints the measured number beside the thesis's, each under its own header:
    | metric | measured | thesis | ref |; swapping two cells of a row still renders a table."""
    from owai.report import markdown

    lines = markdown(RESULTS).splitlines()
    assert "| metric | measured | thesis | ref |" in lines
    assert "| acc | 0.1235 | 0.9 (weak) | Table 9.9 |" in lines
    assert "| loss | - | lower | |" in lines


def test_the_rich_report_puts_each_number_in_its_column() -> None:
    """The terminal table has the same columns in the same order as the Markdown one (metric,
    measured, thesis, ref), each row's cells under them."""
    from rich.console import Console

    from owai.report import table

    t = table(RESULTS)
    assert [c.header for c in t.columns] == ["metric", "measured", "thesis", "ref"]
    assert [list(c.cells) for c in t.columns][1:3] == [["0.1235", "-"], ["0.9 (weak)", "lower"]]
    console = Console(width=200, record=True)
    console.print(t)
    row = next(line for line in console.export_text().splitlines() if "acc" in line)
    assert row.index("0.1235") < row.index("0.9 (weak)") < row.index("Table 9.9")


def test_recipes_list_runs_shows_the_newest_run_of_each_recipe(tmp_path) -> None:
    """`owai recipes list --runs DIR` gives each recipe the verdicts of its newest finished run (by
    when its results.json was written), so an old run does not speak for today's code."""
    import json
    import os

    from owai.report import latest_verdicts

    for name, when in (("old", 1_000_000_000), ("new", 1_100_000_000)):
        path = tmp_path / name / "results.json"
        path.parent.mkdir()
        path.write_text(json.dumps({"recipe": "three-moons", "preset": "cpu", "rows": []}))
        os.utime(path, (when, when))
    assert latest_verdicts(tmp_path)["three-moons"]["dir"] == str(tmp_path / "new")
    os.utime(tmp_path / "old" / "results.json", (1_200_000_000, 1_200_000_000))
    assert latest_verdicts(tmp_path)["three-moons"]["dir"] == str(tmp_path / "old")


def test_seeds_name_a_repeated_seed_as_the_flag_was_given() -> None:
    """`--seeds 1,2,1` is refused by its parser, naming the flag and its text (the sweep planner's
    later "sweep seeds must be distinct" names no flag, and rich-features' chain hands the parsed
    seeds to evaluation runs that never plan a sweep)."""
    from owai.sweep import parse_seeds

    assert parse_seeds("3,1,2,") == [3, 1, 2]
    with pytest.raises(OwaiError, match=r"^--seeds '1,2,1': a seed is repeated$"):
        parse_seeds("1,2,1")
