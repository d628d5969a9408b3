"""`owai mosaic-train --dry-run` (issue #40): it refuses exactly what a run refuses (exit 2, one
`error:` line, nothing written), and the plan it prints is the run's: the parameter count the real
build gives, with the vocabulary the run uses (the tiny preset's bpe-4096, Table 4.2's 128,256 for
small and large), the strategy and precision of the run, FLOPs readable at every scale. The
resolved params that `owai recipes show` prints carry the size's dimensions.

Everything runs in-process: a dry run builds models on the meta device only (tiny: the cpu
preset's State of the Union corpus and its cached bpe-4096 tokenizer).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from conftest import SHARED_DATA, cli_in_process

SOTU = SHARED_DATA / "text" / "sotu.tar.gz"
needs_sotu = pytest.mark.skipif(not SOTU.is_file(), reason=f"the cpu preset's corpus is not here ({SOTU})")


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No hub: a tokenizer that is not cached is missing here, whatever the network."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


# (case id, mosaic-train arguments after --size tiny --dry-run, a fragment of the one error line).
# Each is refused by the run without --dry-run too (test_a_run_refuses_the_same_cases).
BAD = [
    ("steps-negative", ["--set", "train.steps=-5"], "train.steps must be >= 1"),
    ("n-layer-zero", ["--set", "model.n_layer=0"], "model.n_layer=0"),
    ("depth-zero", ["--depth", "0"], "--depth"),
    ("depth-other-than-the-size", ["--depth", "8"], "model.size=tiny has n_layer=4"),
    ("width-other-than-the-size", ["--set", "model.n_embd=512"], "model.size=tiny has n_embd=256"),
    ("tokenizer-unknown", ["--set", "data.tokenizer=nosuchtok"], "nosuchtok"),
    ("lr-negative", ["--set", "train.lr=-1"], "train.lr must be > 0"),
    ("arch-twice", ["--arch", "mmv2,mmv2"], "distinct architectures"),
    ("batch-negative", ["--set", "train.batch_size=-1"], "train.batch_size must be >= 1"),
    ("context-zero", ["--context", "0"], "--context"),
    ("context-negative", ["--context=-512"], "--context"),
    ("context-huge", ["--context", "1000000"], "model.n_embd=256 need at least"),  # the size's width, not 768
    ("size-with-gpt", ["--arch", "mmv2,gpt"], "model.size applies to"),
    ("bf16-on-cpu", ["--set", "train.precision=bfloat16", "--set", "runtime.device=cpu"], "needs a CUDA device"),
    ("vocab-below-tokenizer", ["--set", "model.vocab_size=64"], "tokenizer has"),
    ("global-batch-indivisible", ["--set", "train.global_batch=12"], "train.global_batch=12 is not a multiple of train.batch_size x ranks = 8 x 1"),
    ("global-batch-and-accumulate", ["--set", "train.global_batch=16", "--set", "train.accumulate=2"], "leave train.accumulate at 1"),
]


def _one_error_line(code: int, out: str, err: str, fragment: str) -> None:
    assert code == 2, (code, out, err)
    assert err.startswith("error: ") and err.strip().count("\n") == 0, err
    assert fragment in err, err
    assert "Traceback" not in err + out and "nan" not in out


@needs_sotu
@pytest.mark.parametrize("extra, fragment", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_a_dry_run_refuses_what_a_run_refuses(extra: list[str], fragment: str, tmp_path: Path, capsys) -> None:
    out_dir = tmp_path / "runs"
    code, out, err = cli_in_process(["mosaic-train", "--size", "tiny", "--dry-run", "-o", str(out_dir), *extra], capsys)
    _one_error_line(code, out, err, fragment)
    assert not out_dir.exists()


@needs_sotu
@pytest.mark.parametrize("case", ["steps-negative", "depth-zero", "tokenizer-unknown", "lr-negative", "context-negative",
                                  "global-batch-indivisible"])
def test_a_run_refuses_the_same_cases(case: str, tmp_path: Path, capsys) -> None:
    extra, fragment = next(c[1:] for c in BAD if c[0] == case)
    out_dir = tmp_path / "runs"
    code, out, err = cli_in_process(["mosaic-train", "--size", "tiny", "-o", str(out_dir), *extra], capsys)
    _one_error_line(code, out, err, fragment)
    assert not out_dir.exists()


def _plans(out: str) -> dict[str, dict]:
    """{model label: {"parameters": int, "vocabulary": int, "lines": [...]}} from a dry run's stdout."""
    plans: dict[str, dict] = {}
    current = None
    for line in out.splitlines():
        head = re.match(r"(\S.*?): \S+ parameters \(([\d,]+)\), (.*?), micro-batch", line)
        if head:
            current = plans.setdefault(head.group(1), {"parameters": int(head.group(2).replace(",", "")),
                                                       "strategy": head.group(3), "lines": []})
        if current is not None:
            current["lines"].append(line)
            vocab = re.search(r"vocabulary ([\d,]+)", line)
            if vocab:
                current["vocabulary"] = int(vocab.group(1).replace(",", ""))
    return plans


def _built_count(arch: str, size: str, vocab: int | None) -> int:
    """Parameters of the model built the way the run builds it: owai.models.lm at the size, its
    vocabulary given; small and large on the meta device."""
    from owai.models.lm import build_sized_lm

    model = build_sized_lm(arch, size, vocab_size=vocab, meta=size != "tiny")
    return sum(p.numel() for p in model.parameters())


@needs_sotu
@pytest.mark.parametrize("size", ["tiny", "small", "large"])
def test_the_plan_counts_what_the_run_builds(size: str, tmp_path: Path, capsys) -> None:
    from owai.data.text import load_tokenizer
    from owai.experiment import resolve
    from owai.methods.language_model import build_model
    from owai.plan import readable
    from owai.recipes import load

    code, out, err = cli_in_process(["mosaic-train", "--size", size, "--arch", "mmv2,transformer", "--dry-run",
                                     "-o", str(tmp_path / "runs")], capsys)
    assert code == 0, err
    plans = _plans(out)
    assert set(plans) == {f"Memory Mosaics v2 {size}", f"Transformer (Llama) {size}"}, out
    if size == "tiny":  # the preset's tokenizer, loaded as the run loads it
        tokenizer = load_tokenizer("bpe-4096", source="text/sotu.tar.gz")
        vocab = tokenizer.vocab_size
        assert vocab < 50257  # so a plan sized with GPT-2's vocabulary cannot pass below
        cfg, _ = resolve(load("table4.2-pretrain"), "cpu", ["model.size=tiny", "archs=[mmv2, transformer]"])
    else:
        vocab = None  # Table 4.2's 128,256
    for arch, label in (("mmv2", "Memory Mosaics v2"), ("transformer", "Transformer (Llama)")):
        plan = plans[f"{label} {size}"]
        built = _built_count(arch, size, vocab)
        assert plan["parameters"] == built, (arch, plan, built)
        assert plan["vocabulary"] == (vocab or 128256)
        if size == "tiny":  # and the trainer's own build, from the resolved config, agrees
            model = build_model(cfg, arch, vocab, torch.device("cpu"))
            assert sum(p.numel() for p in model.parameters()) == plan["parameters"]
            assert plan["parameters"] != _built_count(arch, size, 50304)
        assert plan["strategy"] == "1 process"  # what a run of this process does: no "fsdp" over 1 rank
        flops = next(line for line in plan["lines"] if "FLOPs per token" in line)
        assert not re.search(r"(?<![\d.])0\.0[MBT]", flops) and "nan" not in flops
        assert re.search(r"\d+\.\dM at context 256" if size == "tiny" else r"\d+\.\dB at context 256", flops), flops
        assert "precision float32 on cpu" in "\n".join(plan["lines"]) or torch.cuda.is_available()
    assert readable(6_048_128, 2) == "6.05M" and readable(18.9e9) == "18.9B" and readable(2.1e12) == "2.1T"


@needs_sotu
def test_a_ddp_preset_is_planned_as_the_run_holds_it(tmp_path: Path, capsys) -> None:
    """The plan prints the strategy of the run: one process here, DDP / FSDP over a torchrun job's ranks."""
    from owai.experiment import resolve
    from owai.methods.language_model import training_plans
    from owai.recipes import load

    cfg, _ = resolve(load("table4.2-pretrain"), "cpu", [])
    assert cfg.train.parallel == "ddp"
    assert [p.strategy_text for p in training_plans(cfg, world_size=1)] == ["1 process"] * 2
    assert [p.strategy_text for p in training_plans(cfg, world_size=4)] == ["ddp over 4 ranks"] * 2
    one, four = training_plans(cfg, world_size=1)[0], training_plans(cfg, world_size=4)[0]
    assert four.params_bytes == one.params_bytes  # ddp keeps the whole model on every rank


def test_the_resolved_params_are_the_sizes_dimensions(capsys) -> None:
    """`owai recipes show table4.2-pretrain -p cpu` prints the widths the run builds, not GPT2-small's;
    so does every other size's resolved config (what config.yaml records)."""
    from owai.config import to_dict
    from owai.experiment import resolve
    from owai.models.sizes import SIZES
    from owai.recipes import load

    code, out, err = cli_in_process(["recipes", "show", "table4.2-pretrain", "-p", "cpu"], capsys)
    assert code == 0, err
    shown = yaml.safe_load(out.split("# resolved params", 1)[1].split("\n", 1)[1].split("\n# ", 1)[0])["model"]
    configs = [("tiny", shown)] + [(size, to_dict(resolve(load("table4.2-pretrain"), preset, [], validate=False)[0])["model"])
                                   for preset, size in (("paper", "large"), ("paper-small", "small"))]
    for size, model in configs:
        assert model["size"] == size
        for key in ("n_layer", "n_embd", "n_head", "ffn_hidden"):
            assert model[key] == SIZES[size][key], (size, key, model)


def test_model_dimensions_without_a_size_are_gpt2_small_or_as_given() -> None:
    from owai.errors import OwaiError
    from owai.methods.language_model import ModelConfig

    assert (ModelConfig().n_layer, ModelConfig().n_embd, ModelConfig().n_head) == (12, 768, 12)
    assert ModelConfig(n_layer=2, n_embd=64, n_head=4).n_embd == 64
    assert ModelConfig(size="tiny", n_layer=4).n_embd == 256  # the size's own value may be repeated
    legacy = ModelConfig(size="tiny", n_layer=12, n_embd=768, n_head=12)  # a config.yaml written before #40
    assert (legacy.n_layer, legacy.n_embd, legacy.ffn_hidden) == (4, 256, 768)
    with pytest.raises(OwaiError, match="model.size=tiny has n_layer=4, not model.n_layer=8"):
        ModelConfig(size="tiny", n_layer=8)


def test_a_global_batch_is_the_same_on_any_number_of_ranks(monkeypatch) -> None:
    """train.global_batch (chapter 3's 512, chapter 4's 1024) divides into micro-batches per rank;
    the README's `torchrun --nproc_per_node 8` runs once made chapter 3's batch 8 x 512."""
    from owai.errors import OwaiError
    from owai.methods.language_model import TrainConfig, accumulation, sequences_per_update

    chapter3 = TrainConfig(batch_size=8, global_batch=512)
    assert [accumulation(chapter3, ranks) for ranks in (1, 8, 64)] == [64, 8, 1]
    assert {sequences_per_update(chapter3, ranks) for ranks in (1, 8, 64)} == {512}
    assert accumulation(TrainConfig(batch_size=8, accumulate=3), 4) == 3  # without global_batch: as given
    with pytest.raises(OwaiError, match="not a multiple of train.batch_size x ranks = 8 x 3"):
        accumulation(chapter3, 3)


def test_every_preset_counted_in_tokens_trains_the_same_updates_on_any_number_of_gpus() -> None:
    """A language-model preset that counts its training in tokens (chapter 4's 1T and 200B) trains as
    many updates of as many sequences on 8 GPUs as on 256: its train.global_batch fixes the batch.
    Without it, the bag-of-k preset (Table 4.8, "the pretraining setups of sec 4.2.2") trained
    7,629,395 updates of 32 sequences on eight GPUs, where the thesis trains 238,419 of 1024."""
    from owai import recipes
    from owai.experiment import resolve
    from owai.methods.language_model import sequences_per_update, total_steps

    counted = []
    for name in recipes.available():
        recipe = recipes.load(name)
        if recipe.method not in ("lm_pretrain", "lm_recall"):
            continue
        for preset in recipe.presets:
            cfg, _ = resolve(recipe, preset, [], validate=False)
            if cfg.train.tokens > 0:
                counted.append(f"{name}:{preset}")
                plans = {(total_steps(cfg, ranks), sequences_per_update(cfg.train, ranks)) for ranks in (8, 64, 256)}
                assert len(plans) == 1, (name, preset, plans)
    assert {"table4.2-pretrain:paper", "table4.2-pretrain:paper-small", "table4.2-pretrain:bag-of-k"} <= set(counted)


@needs_sotu
def test_a_dry_run_plans_the_global_batch_for_its_ranks(capsys) -> None:
    code, out, err = cli_in_process(["mosaic-train", "--size", "large", "--dry-run"], capsys)
    assert code == 0, err
    assert "238,419 updates of 1024 sequences (256 micro-batches of 4 per rank)" in out  # 1T tokens / 4M per update


def test_a_dry_run_prints_json_with_json_and_nothing_with_quiet(capsys) -> None:
    """--json: the plan as one JSON object on stdout (each model's numbers and the printed lines);
    --quiet: nothing on stdout."""
    code, out, err = cli_in_process(["mosaic-train", "--size", "tiny", "--dry-run", "--json"], capsys)
    assert code == 0, err
    plan = json.loads(out)
    (model,) = plan["models"]
    assert plan["recipe"] == "table4.2-pretrain" and plan["preset"] == "cpu" and plan["missing"] is None
    assert model["parameters"] == _plans("\n".join(plan["lines"]))[model["arch"]]["parameters"]
    assert model["bytes_per_rank"]["total"] == pytest.approx(sum(v for k, v in model["bytes_per_rank"].items() if k != "total"))
    assert model["sequences_per_update"] == model["micro_batches_per_rank"] * model["micro_batch"] * model["world_size"]
    code, out, err = cli_in_process(["mosaic-train", "--size", "tiny", "--dry-run", "--quiet"], capsys)
    assert code == 0 and out == "", err
