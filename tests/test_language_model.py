"""`owai mosaic-train` / `owai mosaic-eval` end to end on tiny models: training, evaluations,
saved models, resume, torchrun (2 gloo processes, DDP and FSDP) and the one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import as_if_killed, as_sets, cli_in_process, run_owai, torchrun

TINY_LM = [
    "data.source=owai-stories:1500",
    "data.tokenizer=bpe-512",
    "data.block_size=32",
    "model.n_layer=1",
    "model.n_embd=32",
    "model.n_head=2",
    "model.dropout=0.0",
    "train.steps=30",
    "train.batch_size=8",
    "train.warmup=5",
    "train.eval_every=10",
    "train.eval_batches=2",
    "train.checkpoint_every=10",
    "eval.posloss_windows=8",
    "eval.val_batches=2",
    "eval.attention_sequences=4",
    "eval.max_new_tokens=4",
]


@pytest.fixture(scope="module", autouse=True)
def lm_cache(tmp_path_factory: pytest.TempPathFactory):
    """One token/tokenizer cache for the module (the bpe-512 tokenizer is trained once)."""
    old = os.environ.get("OWAI_CACHE")
    os.environ["OWAI_CACHE"] = str(tmp_path_factory.mktemp("owai-cache"))
    yield
    if old is None:
        os.environ.pop("OWAI_CACHE", None)
    else:
        os.environ["OWAI_CACHE"] = old


def only_run(root: Path) -> Path:
    runs = [p for p in root.glob("*/*") if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


def losses(run: Path, stage: str) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["stage"] == stage and "loss" in r}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lm-runs")
    proc = run_owai("mosaic-train", "-q", "-o", str(out), *as_sets(TINY_LM))
    assert proc.returncode == 0, proc.stderr
    return only_run(out)


def test_mosaic_train_trains_both_and_writes_everything(trained: Path):
    results = json.loads((trained / "results.json").read_text())
    rows = {r["metric"]: r for r in results["rows"]}
    for arch in ("mm", "gpt"):
        assert rows[f"{arch}.val_loss"]["measured"] > 0
        # Table B.2's training loss is an evaluation (eval mode, fixed training windows); the
        # training steps' own mean is kept apart
        assert rows[f"{arch}.train_loss"]["measured"] > 0 and results["details"][f"{arch}.final_step_loss"] > 0
        assert (trained / "models" / arch / "config.json").is_file()
        assert (trained / "models" / arch / "model.safetensors").is_file()
        assert (trained / "models" / arch / "tokenizer.json").is_file()
        assert (trained / f"continuations_{arch}.md").read_text().count("\n|") >= 24
        metrics = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
        val = [r["val_loss"] for r in metrics if r["stage"] == arch and "val_loss" in r]
        assert len(val) == 3 and val[-1] < val[0], val  # validation loss decreases
        speed = [r for r in metrics if r["stage"] == arch and "tokens_per_s" in r]
        assert speed and all(r["tokens_per_s"] > 0 and r["peak_mem_gb"] > 0 for r in speed)
        assert len(results["details"][f"{arch}.posloss"]) == 32
    # Figs B.5 / B.6 in numbers, read off the same profiles the figures draw (block 32: 1x and 3x)
    details = results["details"]
    for arch in ("mm", "gpt"):
        assert rows[f"{arch}.attention_first_1x"]["measured"] == pytest.approx(details[f"{arch}.attention_32"]["mean_over_heads"][0][0] * 32)
    assert rows["mm.attention_beyond_3x"]["measured"] == pytest.approx(sum(details["mm.attention_96"]["mean_over_heads"][0][:64]))
    assert "gpt.attention_beyond_3x" not in rows  # learned positions stop at block_size
    lambdas = results["details"]["mm.leaky_lambda"]  # Fig B.7: one coefficient per layer and head
    assert len(lambdas) == 1 and len(lambdas[0]) == 2 and all(0 < v < 1 for v in lambdas[0])
    assert rows["val_loss_gpt_minus_mm"]["measured"] == pytest.approx(rows["gpt.val_loss"]["measured"] - rows["mm.val_loss"]["measured"])
    figures = {p.name for p in (trained / "figures").iterdir()}
    assert {"training_curves.png", "posloss.png", "attention_mm_32.png", "attention_mm_96.png", "attention_gpt_32.png"} <= figures
    assert "attention_gpt_96.png" not in figures  # learned positions stop at block_size
    assert not list(trained.rglob("*.tmp"))


def test_mosaic_eval_reads_the_saved_models_back(trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    code, out, err = cli_in_process(["mosaic-eval", str(trained), "-q", "--json", "-o", str(tmp_path),
                                     *as_sets([s for s in TINY_LM if s.startswith(("data.", "eval."))])], capsys)
    assert code == 0, err
    evaluated = {r["metric"]: r["measured"] for r in json.loads(out)["rows"]}
    original = {r["metric"]: r["measured"] for r in json.loads((trained / "results.json").read_text())["rows"]}
    for arch in ("mm", "gpt"):  # same weights, same tokenizer, same evaluation windows
        assert evaluated[f"{arch}.val_loss"] == pytest.approx(original[f"{arch}.val_loss"], rel=1e-5)
        # the training loss too: an evaluation of the saved weights, not the last steps' losses
        assert evaluated[f"{arch}.train_loss"] == pytest.approx(original[f"{arch}.train_loss"], rel=1e-5)


def test_resume_replays_the_killed_steps_exactly(trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """Drop the last checkpoint and everything after it (as a kill would), resume, compare."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    before = losses(trained, "gpt")
    as_if_killed(run, run / "checkpoints" / "gpt" / "step-000030", run / "models")
    code, _, err = cli_in_process(["mosaic-train", "-q", "--resume", str(run)], capsys)
    assert code == 0, err
    assert losses(run, "gpt") == before


def torchrun_mosaic_train(nproc: int, out: Path, extra: list[str]) -> subprocess.CompletedProcess:
    """`owai mosaic-train -q -o OUT EXTRA` as a torchrun job of `nproc` gloo ranks."""
    return torchrun(nproc, ["-m", "owai", "mosaic-train", "-q", "-o", str(out), *extra],
                    before_retry=lambda: shutil.rmtree(out, ignore_errors=True))


# fsdp: tests/test_chapter4_training.py (mosaic-train, Memory Mosaics v2) and tests/test_sharded_checkpoint.py
@pytest.mark.parametrize("strategy", ["ddp"])
def test_torchrun_two_gloo_processes_match_one(strategy: str, tmp_path: Path):
    """2 processes x 4 sequences see the same global batches as 1 process x 8; only rank 0 writes."""
    common = TINY_LM + ["archs=[gpt]", "train.steps=12", "train.log_every=2", "train.eval_every=12", "train.checkpoint_every=6",
                        "eval.continuations=false", "eval.attention_multiples=[]", f"train.parallel={strategy}"]
    single = run_owai("mosaic-train", "-q", "-o", str(tmp_path / "one"), *as_sets(common))
    assert single.returncode == 0, single.stderr
    double = torchrun_mosaic_train(2, tmp_path / "two", as_sets([c for c in common if not c.startswith("train.batch_size")] + ["train.batch_size=4"]))
    assert double.returncode == 0, double.stderr[-2000:]
    one, two = only_run(tmp_path / "one"), only_run(tmp_path / "two")
    l1, l2 = losses(one, "gpt"), losses(two, "gpt")
    assert l1.keys() == l2.keys() and len(l1) == 6
    for step in l1:
        assert l2[step] == pytest.approx(l1[step], abs=2e-4), (step, l1, l2)
    # the final evaluations' batches (eval.batch_size 8 in both) are split across the ranks and their
    # losses added up exactly: the numbers one process gives
    r1, r2 = ({r["metric"]: r["measured"] for r in json.loads((run / "results.json").read_text())["rows"]} for run in (one, two))
    for metric in ("gpt.val_loss", "gpt.train_loss"):
        assert r2[metric] == pytest.approx(r1[metric], abs=2e-4), metric
    # rank 0 wrote one copy of everything: one metrics line per logged step, one results file
    rows = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if "loss" in r]) == 6
    assert json.loads((two / "status.json").read_text())["status"] == "complete"
    # env.json names the ranks, without which a batch per rank does not say the update's size
    assert [json.loads((run / "env.json").read_text())["world_size"] for run in (one, two)] == [1, 2]
    assert sorted(p.name for p in (two / "checkpoints" / "gpt").iterdir()) == ["step-000006", "step-000012"]


# In this process (`cli_in_process`: owai's `main`, its one error path): an `owai` subprocess pays
# seconds of imports each; tests/test_cli_errors.py checks the same error path through the entry point.
@pytest.mark.parametrize(
    "extra, message",
    [
        (["--dataset", "/nonexistent/stories.jsonl"], "dataset path not found"),
        (["--set", "model.vocab_size=64"], "tokenizer has"),
        (["--arch", "mm,lstm9"], "unknown architecture"),
        (["--preset", "nope"], "has no preset"),
        (["--set", "model.n_embd=30", "--set", "model.n_head=4"], "multiple of n_head"),
    ],
)
def test_bad_input_is_one_line(extra: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    tiny = [s for s in TINY_LM if not (extra[0] == "--dataset" and s.startswith("data.source="))]
    code, _, err = cli_in_process(["mosaic-train", "-o", str(tmp_path), *as_sets(tiny), *extra], capsys)
    assert code == 2, err
    assert message in err and err.strip().count("\n") == 0, err
    assert "Traceback" not in err
    assert not any(tmp_path.iterdir())  # rejected before any run directory exists


def test_eval_context_longer_than_learned_positions_is_one_line(trained: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]):
    code, _, err = cli_in_process(["mosaic-eval", str(trained), "--context", "64", "-o", str(tmp_path)], capsys)
    assert code == 2 and "learned position table" in err, err
    assert err.strip().count("\n") == 0
    assert not any(tmp_path.iterdir())  # rejected before any run directory exists


def test_eval_missing_model_is_one_line(tmp_path: Path):
    proc = run_owai("mosaic-eval", str(tmp_path / "nothing"), "-o", str(tmp_path))
    assert proc.returncode == 2 and "model path not found" in proc.stderr
    assert proc.stderr.strip().count("\n") == 0


def test_eval_posloss_subcommand(trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    code, out, err = cli_in_process(["eval", "posloss", str(trained), "-q", "--json", "-o", str(tmp_path),
                                     *as_sets([s for s in TINY_LM if s.startswith(("data.", "eval."))])], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert len(result["details"]["gpt.posloss"]) == 32 and "gpt.continuations" not in result["details"]
    assert not list(Path(result["run_dir"]).glob("continuations_*.md"))


@pytest.mark.parametrize("recipe", ["tableB.2-gpt-search", "fig3.9-posloss", pytest.param("figB.5-attention", marks=pytest.mark.slow),
                                    pytest.param("tableB.4-continuations", marks=pytest.mark.slow)])
def test_every_lm_recipe_runs_its_cpu_preset_shrunk(recipe: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """Each recipe's own cpu preset, shrunk by TINY_LM: RoPE/ALiBi GPTs included (Fig B.6)."""
    tiny = [s for s in TINY_LM if not s.startswith(("eval.attention", "eval.max_new"))] + ["train.steps=6", "train.eval_every=3", "train.checkpoint_every=3"]
    code, out, err = cli_in_process(["mosaic-train", "--recipe", recipe, "-q", "--json", "-o", str(tmp_path), *as_sets(tiny)], capsys)
    assert code == 0, err
    result = json.loads(out)
    run = Path(result["run_dir"])
    losses = [row for row in result["rows"] if row["metric"].endswith("val_loss")]
    assert losses, [row["metric"] for row in result["rows"]]
    assert all(row["measured"] is not None and row["measured"] > 0 for row in losses), losses
    if recipe == "figB.5-attention":
        figures = {p.name for p in (run / "figures").iterdir()}
        assert {"attention_gpt-rope_96.png", "attention_gpt-alibi_96.png", "attention_mm_96.png"} <= figures


def test_attention_summary_tells_a_sink_from_a_flat_pattern_and_a_fading_one():
    """The two numbers Figs B.5 / B.6's claims read: position 0's weight against uniform, and the mass
    beyond the training context (here 4 of a 12-token window, so 8 positions lie beyond it)."""
    from owai.evals.lm import attention_summary

    flat = torch.full((1, 2, 12), 1 / 12)
    assert attention_summary(flat, 4) == pytest.approx({"first": 1.0, "beyond": 8 / 12})
    sink = torch.zeros(1, 2, 12)
    sink[..., 0], sink[..., -1] = 0.5, 0.5
    assert attention_summary(sink, 12) == pytest.approx({"first": 6.0})  # no window past the context: no `beyond`
    fading = torch.tensor([2.0 ** -(11 - j) for j in range(12)]).expand(1, 2, 12) / sum(2.0 ** -i for i in range(12))
    summary = attention_summary(fading, 4)
    assert summary["beyond"] < 0.1 < 8 / 12 and summary["first"] < 0.01  # ALiBi's way: the far tokens fade
    two_layers = torch.stack([flat[0], sink[0]])  # layers and heads are averaged, as the dotted line
    assert attention_summary(two_layers, 12)["first"] == pytest.approx(3.5)


def test_unique_labels_name_models_of_several_runs():
    from owai.methods.language_model import unique_labels

    found = [("mm", Path("/r/a/models/mm")), ("gpt", Path("/r/a/models/gpt")), ("mm", Path("/r/b/models/mm")), ("mm", Path("/r/b/models/mm"))]
    labels = [label for label, _ in unique_labels(found)]
    assert labels == ["a-mm", "gpt", "b-mm", "b-mm-3"]


def test_evaluation_batches_are_split_across_ranks(monkeypatch):
    """Rank r of W takes batches r, r + W, ... of the same keyed list, rounded up to a multiple of W
    (every rank runs as many forward passes); one process takes batches 0 .. n-1."""
    from owai import distributed
    from owai.methods import language_model as lm

    class Windows:
        def batch(self, size, gen):
            return (torch.randint(0, 1000, (size, 4), generator=gen), None)

    def batches(rank: int, size: int, n: int) -> list[list[int]]:
        monkeypatch.setattr(distributed, "world", lambda: distributed.World(rank, size))
        return [b[0][:, 0].tolist() for b in lm.eval_batches(Windows(), n, 2, 7, "val")]

    one = batches(0, 1, 5)
    assert len(one) == 5
    three = [batches(r, 3, 5) for r in range(3)]
    assert [len(b) for b in three] == [2, 2, 2]  # 5 rounded up to 6
    assert three[0][:2] == [one[0], one[3]] and three[1] == [one[1], one[4]] and three[2][0] == one[2]


def test_beam_continuations_rank_by_summed_log_probability():
    """Tables B.4 / B.5: the reference's beam_generate ranks beams by the raw product of their
    probabilities; Hugging Face's default divides finished beams' scores by their length."""
    from types import SimpleNamespace

    from owai.evals.lm import continuations

    calls: list[dict] = []

    class Model(torch.nn.Module):
        config = SimpleNamespace()

        def generate(self, ids, **kwargs):
            calls.append(kwargs)
            return torch.cat([ids, torch.tensor([[5, 6, 0]])], dim=1)

    tokenizer = SimpleNamespace(encode=lambda text: [1, 2, 3], decode=lambda ids: " ".join(map(str, ids)), eot_id=0)
    rows = continuations(Model(), tokenizer, ["Once"], torch.device("cpu"), max_new_tokens=3)
    assert rows == [{"prompt": "Once", "greedy": "5 6", "beam2": "5 6"}]
    greedy, beam = calls
    assert greedy["num_beams"] == 1 and "length_penalty" not in greedy
    assert beam["num_beams"] == 2 and beam["length_penalty"] == 0.0


def test_posloss_only_skips_the_training_loss():
    from owai.commands._common import eval_overrides

    assert "eval.train_loss=false" in eval_overrides([Path("m")], None, None, None, True)
    assert not any(o.startswith("eval.train_loss") for o in eval_overrides([Path("m")], None, None, None, False))


@pytest.mark.parametrize("arch", ["mm", "gpt", "lstm"])
def test_every_unsized_architecture_builds_from_mosaic_trains_settings(arch):
    """`mosaic-train -a lstm` passed n_head and bias, which the LSTM has not: refused with
    "unknown lstm model setting 'n_head'" after its run directory existed."""
    from owai.experiment import resolve
    from owai.methods.language_model import model_kwargs
    from owai.models.lm import build_lm
    from owai.recipes import load

    cfg, _ = resolve(load("fig3.8-depth"), None, [f"archs=[{arch}]", "model.dropout=0.1"])
    model = build_lm(arch, **model_kwargs(cfg, arch, 500))
    assert model.config.vocab_size == 512 and model.config.n_embd == cfg.model.n_embd
