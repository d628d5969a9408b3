"""Recipe loading and validation, typed configs and --set overrides."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from owai import recipes
from owai.config import BaseConfig, apply_overrides, build, load_yaml, parse_override
from owai.errors import OwaiError
from owai.experiment import resolve

RECIPE = Path(recipes.recipe_dir()) / "three-moons.yaml"


def write_variant(tmp_path: Path, edit) -> Path:
    data = yaml.safe_load(RECIPE.read_text())
    edit(data)
    path = tmp_path / "three-moons.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_every_packaged_recipe_validates_with_cpu_and_paper_presets(monkeypatch, tmp_path):
    monkeypatch.setenv("OWAI_BABISTORIES", str(tmp_path))  # paper presets name the BabiStories release
    (tmp_path / "traindataset.txt").write_text('"Once upon a time."\n')
    found = recipes.available()
    assert {"three-moons", "linear-disentanglement"} <= set(found)
    for name in found:
        r = recipes.load(name)
        assert r.id == name and r.implemented and {"cpu", "paper"} <= set(r.presets)
        assert r.thesis, f"{name} carries no thesis numbers or claims"
        for preset in r.presets:
            if r.method == "lm_eval":  # evaluates the user's models: validation asks for them
                with pytest.raises(OwaiError, match="no model given"):
                    resolve(r, preset, [])
                continue
            cfg, resolved = resolve(r, preset, [])
            assert resolved["preset"] == preset


def test_presets_layer_over_params_and_defaults():
    r = recipes.load("three-moons")
    cpu, _ = resolve(r, "cpu", [])
    paper, _ = resolve(r, "paper", [])
    assert cpu.seed == paper.seed == 100  # from params
    assert paper.eval.n_sequences == 512 and paper.eval.tau_stride == 1  # the thesis's evaluation
    assert cpu.eval.n_sequences < 512
    assert paper.train.steps == 500 and paper.train.batch_size == 64 and paper.model.beta == 50.0


def test_set_overrides_parse_yaml_values():
    r = recipes.load("three-moons")
    cfg, resolved = resolve(r, None, ["train.lr=1e-3", "model.heads=[3]", "eval.metrics=[exact]"])
    assert cfg.train.lr == 1e-3 and isinstance(cfg.train.lr, float)
    assert cfg.model.heads == [3] and cfg.eval.metrics == ["exact"]
    assert resolved["overrides"] == ["train.lr=1e-3", "model.heads=[3]", "eval.metrics=[exact]"]
    assert parse_override("a.b=2") == (["a", "b"], 2)
    assert load_yaml("x: 5e-6")["x"] == 5e-6


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lrr=1", "unknown key 'lrr' in train"),
        ("nope=1", "unknown key 'nope' in params"),
        ("train.lr.x=1", "train.lr is not a section"),
        ("train.lr=fast", "params.train.lr: expected float, got str"),
        ("train.steps=1.5", "params.train.steps: expected int, got float"),
        ("model.heads=3", "params.model.heads: expected list[int]"),
        ("eval.metrics=[bogus]", "expected one of 'exact' | 'reference'"),
        ("train.lr", "expected KEY.PATH=VALUE"),
        ("=3", "empty key"),
    ],
)
def test_bad_set_is_one_line_error(override, message):
    with pytest.raises(OwaiError) as err:
        resolve(recipes.load("three-moons"), None, [override])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_unknown_recipe_id():
    with pytest.raises(OwaiError, match="unknown recipe 'nope'"):
        recipes.load("nope")


def test_malformed_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("id: bad\nreproduces: [\n  - x: : y\n")
    with pytest.raises(OwaiError, match=r"not valid YAML: .* at line \d+"):
        recipes.load(str(path))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(colour="red"), "unknown key 'colour'"),
        (lambda d: d["params"].update(learning_rate=1), "params: unknown key 'learning_rate'"),
        (lambda d: d["presets"]["cpu"].update(train={"stepz": 3}), "preset cpu.train: unknown key 'stepz'"),
        (lambda d: d["presets"]["paper"].update(eval={"n_sequences": "many"}), "expected int, got str"),
        (lambda d: d.pop("method"), "missing required key 'method'"),
        (lambda d: d["presets"].pop("paper"), "missing required preset 'paper'"),
        (lambda d: d.update(reproduces="Figure 3.5"), "reproduces: expected list"),
        (lambda d: d["thesis"]["heads3.disentanglement"].update(value="one"), "value: expected float | NoneType"),
        (lambda d: d.update(sweep={"grid": {"train.nope": [1]}}), "unknown key 'nope' in train"),
    ],
)
def test_recipe_validation_errors(tmp_path, edit, message):
    path = write_variant(tmp_path, edit)
    with pytest.raises(OwaiError) as err:
        recipes.load(str(path))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_recipe_file_must_be_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(OwaiError, match="expected a mapping at top level"):
        recipes.load(str(path))


def test_yaml_is_read_safely(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("id: !!python/object/apply:os.system ['echo hacked']\n")
    with pytest.raises(OwaiError, match="not valid YAML"):
        recipes.load(str(path))


def test_build_rejects_bool_for_int_and_accepts_int_for_float():
    @dataclasses.dataclass
    class C(BaseConfig):
        n: int = 1
        x: float = 0.5

    assert build(C, {"x": 2}).x == 2.0
    with pytest.raises(OwaiError, match="expected int, got bool"):
        build(C, {"n": True})
    with pytest.raises(OwaiError, match="runtime.device"):
        build(C, {"runtime": {"device": "tpu"}})
    assert apply_overrides(C, {}, ["runtime.threads=2"]) == {"runtime": {"threads": 2}}
