"""The RegBench method (one run = one model at one grid point): training with best-val selection,
the test metrics, resume, the LSTM and n-gram entries, and bad input."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from owai.errors import OwaiError
from owai.experiment import execute, resolve
from owai.recipes import load
from owai.runs import Run
from conftest import as_if_killed

# short sequences, few automata, few epochs: a run takes seconds
TINY = [
    "data.num_examples=24", "data.num_test_examples=16", "data.max_len_per_example=8",
    "data.min_num_in_context_examples=4", "data.max_num_in_context_examples=7",
    "train.epochs=6", "train.batch_size=8", "train.checkpoint_every=2", "train.log_every=1",
    "eval.batch_size=8",
]
SMALL = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32"]  # mm / transformer sizes
RECIPE = "fig3.10-regbench"


def run_tiny(out: Path, *extra: str) -> tuple[Run, dict]:
    """A tiny run; the n-gram (nothing to train) without TINY's train.* settings, which it refuses."""
    tiny = [s for s in TINY if not s.startswith("train.")] if "arch=ngram" in extra else TINY
    return execute(RECIPE, "cpu", [*tiny, *extra], out)


@pytest.fixture(scope="module")
def mm_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, dict]:
    return run_tiny(tmp_path_factory.mktemp("rb"), "arch=mm", "train.lr=1e-2", *SMALL)


def measured(results: dict) -> dict:
    return {r["metric"]: r["measured"] for r in results["rows"]}


def test_mm_run_selects_the_best_validation_epoch_and_tests_it(mm_run):
    run, results = mm_run
    m = measured(results)
    vals = [r for r in run.metrics() if "val_loss" in r]
    assert [r["epoch"] for r in vals] == [1, 2, 3, 4, 5, 6]  # validated after every epoch
    best = min(vals, key=lambda r: r["val_loss"])
    assert m["selected_epoch"] == best["epoch"] and m["val_loss"] == pytest.approx(best["val_loss"])
    assert 0 <= m["accuracy"] <= 1 and 0 <= m["tvd"] <= 2 and m["tvd_half"] == pytest.approx(m["tvd"] / 2)
    assert math.isfinite(m["test_loss"]) and m["parameters"] > 0
    # trained for a few epochs, the model is already closer to the PFAs than the uniform model
    assert m["tvd"] < uniform_l1(run)


def uniform_l1(run: Run) -> float:
    from owai.data.regbench import RegBenchConfig, make_regbench
    from owai.evals.regbench import regbench_metrics, uniform_probs

    data = make_regbench(RegBenchConfig(**run.read_config()["params"]["data"]))
    x, _, pfas = data.test.batch()
    return regbench_metrics(uniform_probs(x, 20), x, pfas)["tvd"]


def test_the_thesis_number_follows_the_architecture_and_size(mm_run, tmp_path: Path):
    _, results = mm_run
    rows = {r["metric"]: r for r in results["rows"]}
    assert rows["accuracy"]["thesis"] is None  # 24 training automata: no published number
    _, res = run_tiny(tmp_path, "arch=ngram", "data.num_examples=100", "data.num_test_examples=10")
    rows = {r["metric"]: r for r in res["rows"]}
    assert rows["accuracy"]["thesis"] is None  # the figure has no n-gram
    cfg, _ = resolve(load(RECIPE), "cpu", ["arch=transformer", "data.num_examples=100"])
    from owai.recipes import thesis_for

    assert thesis_for(load(RECIPE), "accuracy", {"arch": "transformer", "data": {"num_examples": 100}}).value == 0.523


def test_resume_after_a_kill_gives_the_same_numbers(mm_run, tmp_path: Path):
    run, results = mm_run
    copy = tmp_path / "copy"
    shutil.copytree(run.path, copy)
    ckpts = sorted((copy / "checkpoints" / "train").iterdir())
    as_if_killed(copy, ckpts[-1])  # killed after epoch 4's checkpoint (epochs 5-6 lost)
    _, again = execute(resume=copy)
    a, b = measured(results), measured(again)
    for key in ("val_loss", "selected_epoch", "accuracy", "tvd", "test_loss"):
        assert a[key] == pytest.approx(b[key], rel=1e-6), key


@pytest.mark.parametrize("arch", ["transformer", "lstm"])
def test_other_zoo_models_train(arch: str, tmp_path: Path):
    size = SMALL if arch == "transformer" else ["model.n_layer=1", "model.n_embd=32"]
    _, results = run_tiny(tmp_path, f"arch={arch}", "train.epochs=2", *size)
    m = measured(results)
    assert 0 <= m["accuracy"] <= 1 and 0 < m["tvd"] < 2 and m["selected_epoch"] in (1, 2)


def test_ngram_needs_no_training_and_beats_uniform(tmp_path: Path):
    run, results = run_tiny(tmp_path, "arch=ngram")
    m = measured(results)
    assert not any((run.path / "checkpoints").iterdir())
    assert 0.5 < m["accuracy"] <= 1 and m["tvd"] < uniform_l1(run) and math.isfinite(m["val_loss"])


def test_transformer_is_seq_icls_lm_simple():
    """seq_icl's RegBench transformer (lm_simple + MHA): biases, learned positions, tanh GELU, dropout
    0.1 on the embeddings and attention weights, none on the residual branches; `model.dropout`
    sets the first two."""
    from owai.methods.regbench import Config, ModelConfig, build_model

    for dropout in (None, 0.3):
        model = build_model(Config(arch="transformer", model=ModelConfig(dropout=dropout)), torch.device("cpu"))
        block, want = model.transformer.h[0], 0.1 if dropout is None else dropout
        assert model.config.bias and model.config.position == "learned" and model.config.activation == "gelu_tanh"
        assert (model.transformer.drop.p, block.attn.dropout) == (want, want)
        assert block.attn.resid_dropout.p == block.mlp.dropout.p == 0.0


def test_transformer_and_mm_have_equal_parameter_counts_at_the_thesis_sizes():
    """P = 3.5 C persistent slots make a Mosaic block the size of a transformer block (biases,
    the transformer's position table and the Mosaic's per-head scalars aside)."""
    from owai.methods.regbench import Config, ModelConfig, build_model

    for n_layer, n_embd in [(2, 64), (4, 128), (8, 256)]:
        counts = {}
        for arch in ("mm", "transformer"):
            cfg = Config(arch=arch, model=ModelConfig(n_layer=n_layer, n_head=4, n_embd=n_embd))
            model = build_model(cfg, torch.device("cpu"))
            pos = model.transformer.wpe.weight.numel() if arch == "transformer" else 0
            biases = sum(p.numel() for n, p in model.named_parameters() if n.endswith(".bias"))
            counts[arch] = model.num_parameters() - pos - biases
        assert abs(counts["mm"] - counts["transformer"]) / counts["transformer"] < 0.01, counts


@pytest.mark.parametrize(
    "extra, message",
    [
        (["data.num_examples=0"], "num_examples must be >= 1"),
        (["arch=lstm", "model.n_head=4"], "the lstm model has no setting 'n_head'"),
        (["arch=ngram", "model.n_layer=2"], "the ngram model has no setting 'n_layer'"),
        (["eval.positions=first"], "eval.positions: expected one of"),
        (["arch=rnn"], "unknown RegBench model 'rnn'"),
        (["arch=ngram", "train.epochs=3"], "train.epochs is unused here: settings of the trained models"),
        (["arch=lstm", "eval.ngram_order=2"], "eval.ngram_order is unused here: the order of --model ngram"),
        (["model.n_embd=30", "model.n_head=4"], "not divisible"),
        (["model.n_layer=two"], "model.n_layer: expected"),
    ],
)
def test_bad_settings_are_one_line_errors_before_any_run_dir(extra: list[str], message: str, tmp_path: Path):
    with pytest.raises(OwaiError, match=message.replace("(", r"\(")):
        run_tiny(tmp_path, *extra)
    assert not (tmp_path / RECIPE).exists()


def test_max_input_length_covers_the_longest_sequence():
    from owai.data.regbench import RegBenchConfig, make_regbench
    from owai.methods.regbench import max_input_length

    cfg = RegBenchConfig(num_examples=200, num_test_examples=10, max_len_per_example=6)
    data = make_regbench(cfg)
    longest = max(len(s) - 1 for split in (data.train, data.val, data.test) for s in split.sequences)
    assert longest <= max_input_length(cfg)
    assert max_input_length(RegBenchConfig()) == 19 * 49 + 18 - 1


def test_batches_reshuffle_every_epoch_and_cover_the_training_set():
    from owai.data.regbench import RegBenchConfig, make_regbench
    from owai.methods.regbench import Config, TrainConfig, epoch_batch

    cfg = Config(data=RegBenchConfig(num_examples=20, num_test_examples=4), train=TrainConfig(batch_size=8))
    data = make_regbench(cfg.data)
    seen = []
    for step in range(3):  # ceil(20/8) = 3 batches per epoch: 8, 8, 4 sequences
        x, y = epoch_batch(data.train, cfg, step)
        seen += [tuple(row[row != 0].tolist()) for row in x]
        assert (y != 19).all()  # separator targets are masked
    assert len(seen) == 20
    assert sorted(seen) == sorted(tuple(s[:-1].tolist()) for s in data.train.sequences)
    a, _ = epoch_batch(data.train, cfg, 0)
    b, _ = epoch_batch(data.train, cfg, 3)
    assert not torch.equal(a, b)


def test_lstm_is_a_zoo_causal_lm_that_saves_and_loads(tmp_path: Path):
    from owai.models.lm import build_lm, load_pretrained

    model = build_lm("lstm", n_layer=2, n_embd=16, vocab_size=20).eval()
    x = torch.randint(0, 20, (2, 9))
    out = model(input_ids=x, labels=x)
    assert out.logits.shape == (2, 9, 20) and torch.isfinite(out.loss)
    # causal: a prefix gives the same logits, to float rounding (the CPU kernels can differ with
    # the sequence length)
    torch.testing.assert_close(model(input_ids=x[:, :5]).logits, out.logits[:, :5], rtol=0, atol=1e-6)
    model.save_pretrained(tmp_path)
    assert torch.equal(load_pretrained(tmp_path).eval()(input_ids=x).logits, out.logits)


@pytest.mark.parametrize("scope", ["all", "matrices"])
def test_weight_decay_reaches_every_parameter_as_in_seq_icl(scope, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """seq_icl trains RegBench with one AdamW group (its dfa configs set no optimizer_param_grouping),
    so biases, LayerNorms, embeddings and a Mosaic's per-head scalars decay too; `train.decay_scope
    =matrices` keeps decay to the >= 2-dim tensors."""
    groups = []

    class Recorded(torch.optim.AdamW):
        def __init__(self, params, *args, **kwargs):
            super().__init__(params, *args, **kwargs)
            groups.append([(g["weight_decay"], [p.dim() for p in g["params"]]) for g in self.param_groups])

    monkeypatch.setattr(torch.optim, "AdamW", Recorded)
    chosen = [] if scope == "all" else [f"train.decay_scope={scope}"]  # "all" is the default
    run_tiny(tmp_path, "arch=mm", "train.epochs=1", "train.weight_decay=0.1", *chosen)
    (seen,) = groups
    decayed = [d for wd, dims in seen if wd > 0 for d in dims]
    if scope == "all":
        assert len(seen) == 1 and seen[0][0] == 0.1 and min(decayed) == 1  # 1-dim tensors decay too
    else:
        assert min(decayed) == 2 and any(wd == 0 and min(dims) == 1 for wd, dims in seen)


def test_regbench_lstm_is_seq_icls_as_it_computes(tmp_path: Path):
    """RegBench's LSTM: seq_icl's LSTMLayer initialisation (Xavier input weights, orthogonal
    recurrent weights, zero biases but the forget gate's input bias at 1), the embedding matrix as
    the head without a bias; it saves and loads tied."""
    from owai.methods.regbench import Config, ModelConfig, build_model
    from owai.models.lm import load_pretrained

    model = build_model(Config(arch="lstm", model=ModelConfig(n_embd=32)), torch.device("cpu")).eval()
    C, lstm = 32, model.lstm
    assert model.lm_head.weight is model.wte.weight and model.lm_head.bias is None
    assert 0.9 < float(model.wte.weight.detach().std()) < 1.1  # N(0, 1): seq_icl's nn.Embedding default, kept tied
    hh = lstm.weight_hh_l0.detach()
    torch.testing.assert_close(hh.T @ hh, torch.eye(C), rtol=0, atol=1e-5)  # orthonormal columns
    bound = math.sqrt(6 / (C + 4 * C))  # Xavier-uniform of a (4C, C) matrix
    assert bound * 0.9 < float(lstm.weight_ih_l0.detach().abs().max()) <= bound
    assert not lstm.bias_hh_l0.any() and torch.equal(lstm.bias_ih_l0, torch.cat([torch.zeros(C), torch.ones(C),
                                                                                 torch.zeros(2 * C)]))
    model.save_pretrained(tmp_path)
    loaded = load_pretrained(tmp_path).eval()
    x = torch.randint(0, model.config.vocab_size, (2, 9))
    assert loaded.lm_head.weight is loaded.wte.weight
    assert torch.equal(loaded(input_ids=x).logits, model(input_ids=x).logits)


def test_torchrun_is_refused_with_a_pointer_to_sweeps(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(OwaiError, match="not torchrun"):
        resolve(load(RECIPE), "cpu", [])
