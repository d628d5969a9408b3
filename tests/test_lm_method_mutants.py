"""Chapter 4's method code (language models, in-context classification, corpus statistics, RegBench,
recall) pinned where a mutation audit found no test that failed: each test below fails on one small,
plausible change of the method (named in its docstring) and passes on the real code. Fast, in
process, no data downloads."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

CPU = torch.device("cpu")


# -- corpus statistics (Table B.1, Fig 4.4) ------------------------------------------------------


def test_over_t_counts_only_documents_longer_than_the_context():
    """`over_T` is the share of documents the context T truncates (Fig 4.4's peak): a document of
    exactly T tokens fits whole and is not counted. (Mutant: `>=` instead of `>`.)"""
    from owai.methods.corpus_stats import split_statistics

    stats = split_statistics(np.array([8, 9, 3, 8]), chars=40, truncate=[8])
    assert stats["over_8"] == pytest.approx(1 / 4)


def test_median_tokens_is_the_median_not_the_mean():
    """`median_tokens` is the median document length; on a skewed corpus it is far from the mean,
    which `tokens_per_document` reports. (Mutant: np.mean for np.median.)"""
    from owai.methods.corpus_stats import split_statistics

    stats = split_statistics(np.array([3, 10, 600]), chars=100, truncate=[512])
    assert stats["median_tokens"] == 10.0 and stats["tokens_per_document"] == pytest.approx(204.33)


# -- in-context classification (owai eval icl, Figs 4.6-4.9) --------------------------------------


def _icl_run(tmp_path: Path, **settings):
    from owai.methods.icl_eval import Config, InContextClassification

    cfg = Config(task="synthetic", model="reference:knn", n_queries=8, strategies=["newline-fixed"], synthetic_classes=4,
                 **settings)
    run = SimpleNamespace(device=CPU, writes=False, path=tmp_path, save_figure=lambda fig, name: None)
    return cfg, InContextClassification().run(cfg, run)


def test_each_label_mode_is_prompted_with_its_own_labels(tmp_path):
    """`labels: [semantic, anonymous]` scores the anonymous mode on `class_j` labels, not on the
    semantic names again (Figs 4.6-4.9 compare the two). (Mutant: PromptOptions(labels="semantic")
    for every mode.)"""
    _, out = _icl_run(tmp_path, shots=[1])
    for mode in ("semantic", "anonymous"):
        assert out.details[mode]["config"]["labels"] == mode
    golds = [e["gold"] for e in out.details["anonymous"]["results"]["1"]["strategies"]["newline-fixed"]["examples"]]
    assert golds and all(g.startswith("class_") for g in golds)
    golds = [e["gold"] for e in out.details["semantic"]["results"]["1"]["strategies"]["newline-fixed"]["examples"]]
    assert golds and not any(g.startswith("class_") for g in golds)


def test_each_shot_count_reports_its_own_best_accuracy(tmp_path):
    """`{labels}.{n}shot.acc` is the best strategy's accuracy at n shots, each shot count its own
    (here 1 and 2 shots score differently). (Mutant: every n reads the most shots' result.)"""
    cfg, out = _icl_run(tmp_path, shots=[1, 2])
    accs = []
    for mode in cfg.labels:
        for n in (1, 2):
            want = out.details[mode]["results"][str(n)]["best"]["accuracy"]
            assert out.measured[f"{mode}.{n}shot.acc"] == want
            accs.append(want)
    assert len(set(accs)) > 1  # the check above can tell the shot counts apart


@pytest.mark.filterwarnings("error::UserWarning")  # the empty figure's legend() warned: "No artists with labels"
def test_the_prompt_budget_leaves_room_for_the_generated_tokens(tmp_path, monkeypatch):
    """A prompt must leave `max_new_tokens` of the model's context for the answer: a prompt of more
    than max_tokens - max_new_tokens tokens is an overflow, never scored. Here every prompt counts
    390 tokens, within max_tokens = 400 but not within 400 - 32. (Mutant: the budget is max_tokens.)"""
    from owai.evals import causal_lm, longicl

    class Counting:  # the k-NN reference, with a token count
        def __init__(self) -> None:
            self.inner = longicl.InContextKNN()

        def generate(self, prompt: str) -> str:
            return self.inner.generate(prompt)

        def count_tokens(self, prompt: str) -> int:
            return 390

    monkeypatch.setattr(causal_lm, "open_model", lambda *a, **k: Counting())
    _, out = _icl_run(tmp_path, shots=[1], max_tokens=400, max_new_tokens=32, labels=["semantic"])
    scored = out.details["semantic"]["results"]["1"]["strategies"]["newline-fixed"]
    assert scored["n_overflow"] == 8 and scored["n_scored"] == 0
    assert "semantic.1shot.acc" not in out.measured  # no prompt scored: no accuracy


# -- RegBench (Fig 3.10, Table B.3) ---------------------------------------------------------------


class _Split:
    """A RegBench split stand-in: `n` one-token sequences; `batch(idx)` gives (x, y, pfas)."""

    def __init__(self, n: int, offset: int = 0) -> None:
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    def batch(self, idx):
        idx = list(idx)
        x = np.array([[self.offset + i] for i in idx], dtype=np.int64)
        return x, x.copy(), [None] * len(idx)


def test_regbench_test_metrics_pool_every_position_not_the_batches_means(monkeypatch):
    """Accuracy and L1 are means over every counted position of the test split (pooled), as seq_icl
    computes them: a batch of 10 positions all right and one of 30 all wrong give 10 / 40, not the
    mean of the two batches' means. (Mutant: each batch weighs 1.)"""
    from owai.evals import regbench as scoring
    from owai.methods.regbench import EvalConfig, test_metrics

    per_batch = iter([{"accuracy": 1.0, "num_accuracy_positions": 10, "tvd": 0.0, "num_tvd_positions": 10},
                      {"accuracy": 0.0, "num_accuracy_positions": 30, "tvd": 1.0, "num_tvd_positions": 30}])
    monkeypatch.setattr(scoring, "regbench_metrics", lambda probs, x, pfas, positions: next(per_batch))
    out = test_metrics(lambda x: None, _Split(4), EvalConfig(batch_size=2))
    assert out["accuracy"] == pytest.approx(10 / 40)
    assert out["tvd"] == pytest.approx(30 / 40) and out["tvd_half"] == pytest.approx(15 / 40)


# -- mosaic-train's training recipe (lm_pretrain: train_model) ------------------------------------

EOT = 0


class _Windows:
    """TokenWindows' reading interface over random tokens, an end-of-text in the middle of every
    window (two documents per window); counts its reads."""

    def __init__(self, name: str, block_size: int, vocab: int = 64) -> None:
        self.name, self.block_size, self.vocab, self.reads = name, block_size, vocab, 0

    def batch(self, n: int, generator: torch.Generator):
        self.reads += 1
        rows = torch.randint(1, self.vocab, (n, self.block_size + 1), generator=generator)
        rows[:, self.block_size // 2] = EOT
        return rows[:, :-1], rows[:, 1:]


def _v2_config(**train):
    from owai.methods.language_model import Config, DataConfig, ModelConfig, TrainConfig

    model = ModelConfig(size="", n_layer=1, n_embd=32, n_head=2, ffn_hidden=64, short_window=4, long_delay_train=[2, 6],
                        long_delay_eval=2, dropout=0.0)
    settings = {"steps": 10, "warmup": 3, "decay_steps": 7, "lr": 1e-3, "min_lr": 1e-4, "batch_size": 2, "accumulate": 2,
                "eval_every": 5, "eval_batches": 1} | train
    return Config(archs=["mmv2"], model=model, data=DataConfig(block_size=16, documents=True), train=TrainConfig(**settings))


def _captured_training(monkeypatch, cfg):
    """Run `train_model` with the training loop replaced by a spy: what it hands the loop (the loss of
    each micro-batch, the lr schedule, the step hook), every forward call's inputs (the forward is a
    stand-in), and the windows each `mean_loss` reads."""
    from owai import train as train_module
    from owai.methods import language_model as lm
    from owai.models.lm import build_lm

    torch.manual_seed(0)
    model = build_lm("mmv2", **lm.model_kwargs(cfg, "mmv2", 64))
    calls: list[dict] = []

    def forward(**inputs):  # the loss of uniform logits: what the model computes does not matter here
        calls.append(inputs)
        return SimpleNamespace(logits=torch.zeros(*inputs["input_ids"].shape, 64), bag_logits=None)

    captured: dict = {"forward": calls, "mean_loss": []}

    def loop(run, stage, model, optimizer, loss_at, config, lr_at=None, after_step=None, **_):
        captured.update(loss_at=loss_at, lr_at=lr_at, after_step=after_step, config=config)
        return {"final_loss": 0.0}

    monkeypatch.setattr(train_module, "train_loop", loop)
    monkeypatch.setattr(lm, "mean_loss", lambda model, batches, device, eot=None, log=None:
                        captured["mean_loss"].append(batches.windows.name) or 1.0)
    data = lm.LMData(SimpleNamespace(eot_id=EOT), _Windows("train", 16), _Windows("val", 16), None)
    captured["data"] = data
    run = SimpleNamespace(log=lambda *a, **k: captured.setdefault("logged", []).append(k))
    parallel = SimpleNamespace(module=model, forward_module=forward)
    lm.train_model(cfg, run, "mmv2", parallel, data, CPU)
    return captured


def test_lm_lr_schedule_warms_up_to_the_peak_and_reaches_min_lr_at_decay_steps(monkeypatch):
    """train.warmup / decay_steps / min_lr are the nanoGPT schedule the thesis trains with: 0 at update
    0, train.lr at update `warmup`, cosine down to train.min_lr at update `decay_steps` (not at
    `steps`), then min_lr. (Mutants: the warmup one update longer; decay_steps ignored.)"""
    cfg = _v2_config(steps=10, warmup=3, decay_steps=7, lr=1e-3, min_lr=1e-4)
    lr_at = _captured_training(monkeypatch, cfg)["lr_at"]
    assert lr_at(0) == 0.0 and lr_at(2) == pytest.approx(2e-3 / 3)
    assert lr_at(3) == pytest.approx(1e-3)
    assert lr_at(5) == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4))  # half-way down the cosine
    assert lr_at(7) == pytest.approx(1e-4) and lr_at(9) == pytest.approx(1e-4)


def test_lm_micro_batches_of_one_update_are_different_windows_of_the_training_split(monkeypatch):
    """With accumulation each micro-batch of an update is its own draw (keyed by step and micro), so
    an update averages batch_size x accumulate distinct windows; the training loss reads the training
    split only. (Mutant: every micro-batch of a step keyed by micro 0, the same windows twice.)"""
    captured = _captured_training(monkeypatch, _v2_config())
    data = captured["data"]
    val_reads = data.val.reads
    captured["loss_at"](0, 0)
    captured["loss_at"](0, 1)
    captured["loss_at"](1, 0)
    x00, x01, x10 = (c["input_ids"] for c in captured["forward"])
    assert not torch.equal(x00, x01) and not torch.equal(x00, x10)
    assert data.val.reads == val_reads


def test_lm_training_with_documents_restarts_positions_after_every_eot(monkeypatch):
    """data.documents: every training forward gets position_ids restarting after each end-of-text
    (document-wise masking: no token reads across a document boundary). (Mutant: no position_ids.)"""
    from owai.data.packing import document_positions

    captured = _captured_training(monkeypatch, _v2_config())
    captured["loss_at"](0, 0)
    inputs = captured["forward"][-1]
    assert "position_ids" in inputs
    assert torch.equal(inputs["position_ids"], document_positions(inputs["input_ids"], EOT))
    assert int(inputs["position_ids"][0, 8 + 1]) == 0  # the token after the eot at 8 starts a document


def test_lm_long_term_delay_is_drawn_from_the_whole_inclusive_range(monkeypatch):
    """mmv2's long-term delay m ~ U[min, max] of model.long_delay_train, both ends included, one draw
    per update (sec 4.2.1). (Mutant: randint(lo, hi), which never draws hi.)"""
    captured = _captured_training(monkeypatch, _v2_config())
    for step in range(60):
        captured["loss_at"](step, 0)
    delays = {c["long_delay"] for c in captured["forward"]}
    assert delays == {2, 3, 4, 5, 6}
    captured["forward"].clear()
    captured["loss_at"](7, 0)
    captured["loss_at"](7, 1)
    first, second = (c["long_delay"] for c in captured["forward"])
    assert first == second  # one delay per update, whatever the micro-batch


def test_lm_bag_of_k_loss_is_added_with_its_weight(monkeypatch):
    """model.bag_of_k: the training loss is L_next + alpha L_bag with alpha = model.bag_weight (sec
    4.2.5.1). With uniform logits over 64 tokens and L_bag stubbed to 10, a micro-batch's loss is
    log 64 + 0.3 x 10. (Mutant: L_bag added unweighted.)"""
    from owai.models import bag_of_k

    monkeypatch.setattr(bag_of_k, "bag_of_k_loss", lambda logits, bags, valid, eta: torch.tensor(10.0))
    cfg = _v2_config()
    cfg.model.bag_of_k, cfg.model.bag_weight = 4, 0.3
    loss = _captured_training(monkeypatch, cfg)["loss_at"](0, 0)
    assert float(loss) == pytest.approx(float(np.log(64)) + 3.0, rel=1e-6)


def test_lm_validation_during_training_reads_the_validation_split(monkeypatch):
    """The val_loss of the training curves is measured on the validation split, and the reference's
    "train" estimate on training windows: never the other way round. (Mutant: val_loss on data.train.)"""
    captured = _captured_training(monkeypatch, _v2_config())
    captured["mean_loss"].clear()
    captured["after_step"](5)
    assert captured["mean_loss"] == ["val", "train"]
    assert captured["logged"][-1].keys() >= {"val_loss", "train_eval_loss"}


def test_regbench_split_loss_averages_over_the_non_separator_targets_only():
    """The validation / test loss is the mean cross-entropy over the targets that are not separators
    or padding (IGNORE_INDEX), as seq_icl's loss ignores them: with a uniform predictor over 4 symbols
    it is log 4 however many targets are masked. (Mutant: the count includes the masked targets.)"""
    from owai.data.regbench import IGNORE_INDEX
    from owai.methods.regbench import split_loss

    class Masked(_Split):
        def batch(self, idx):
            x, y, pfas = super().batch(idx)
            x = np.tile(x, (1, 4)) % 4
            y = x.copy()
            y[:, 1] = IGNORE_INDEX  # a separator target
            y[:, 3] = IGNORE_INDEX  # padding
            return x, y, pfas

    loss = split_loss(lambda x: np.full((*x.shape, 4), 0.25), Masked(5), batch_size=2)
    assert loss == pytest.approx(np.log(4))


def test_regbench_warmup_is_a_tenth_of_the_epochs_rounded_up_counted_in_updates(monkeypatch, tmp_path):
    """seq_icl warms up linearly from warmup_lr over ceil(epochs / 10) epochs, each of
    ceil(train / batch) updates: 15 epochs of 2 updates warm up over 2 epochs = 4 updates. (Mutants:
    epochs // 10; the warmup counted in updates instead of epochs.)"""
    from owai import train as train_module
    from owai.methods.regbench import Config, TrainConfig, build_model, train

    class Stop(Exception):
        pass

    seen = {}

    def loop(run, stage, model, optimizer, loss_at, config, lr_at=None, **_):
        seen["lr_at"], seen["steps"] = lr_at, config.steps
        raise Stop

    monkeypatch.setattr(train_module, "train_loop", loop)
    cfg = Config(arch="mm", train=TrainConfig(epochs=15, batch_size=32, lr=1e-3, warmup_lr=1e-6, min_lr_ratio=0.1))
    data = SimpleNamespace(train=_Split(64), val=_Split(4))
    run = SimpleNamespace(checkpoints=lambda stage: tmp_path / stage, log=lambda *a, **k: None)
    with pytest.raises(Stop):
        train(cfg, run, build_model(cfg, CPU), data, CPU)
    lr_at = seen["lr_at"]
    assert seen["steps"] == 30
    assert lr_at(0) == pytest.approx(1e-6)
    assert lr_at(2) == pytest.approx(1e-6 + (1e-3 - 1e-6) * 2 / 4)  # half-way through the warmup
    assert lr_at(3) < lr_at(4) <= 1e-3  # still rising at update 3


def test_regbench_keeps_the_epoch_of_the_lowest_validation_loss_measured_on_the_validation_automata(monkeypatch, tmp_path):
    """After every epoch the validation loss on the validation automata (never the test ones) is
    measured, and the epoch with the lowest one is kept and tested, not the last: here epochs score
    3, 1, 2, so epoch 2 is kept. (Mutants: every epoch replaces the kept one; the validation batches
    drawn from the test split.)"""
    from owai import train as train_module
    from owai.evals import lm as lm_evals
    from owai.methods.regbench import Config, TrainConfig, build_model, train

    losses, read = iter([3.0, 1.0, 2.0]), []

    def validation_loss(model, batches, device, eot=None):
        read.extend(int(x.min()) for x, _ in batches)
        return next(losses)

    def loop(run, stage, model, optimizer, loss_at, config, lr_at=None, after_step=None, **_):
        for done in range(1, config.steps + 1):
            after_step(done)
        return {}

    monkeypatch.setattr(train_module, "train_loop", loop)
    monkeypatch.setattr(lm_evals, "validation_loss", validation_loss)
    cfg = Config(arch="mm", train=TrainConfig(epochs=3, batch_size=32))
    data = SimpleNamespace(train=_Split(64), val=_Split(4, offset=1000), test=_Split(4, offset=2000))
    run = SimpleNamespace(checkpoints=lambda stage: tmp_path / stage, log=lambda *a, **k: None)
    best = train(cfg, run, build_model(cfg, CPU), data, CPU)
    assert best["epoch"] == 2 and best["val_loss"] == 1.0
    assert read and all(1000 <= v < 2000 for v in read)


@pytest.mark.parametrize("arch, clip", [("mm", 1.0), ("transformer", 0.0), ("lstm", 0.0)])
def test_regbench_clips_gradients_for_the_memory_mosaic_only(arch, clip):
    """Each family trains with its official clipping: 1.0 for the Memory Mosaic (its ICLL config),
    none for seq_icl's transformer and LSTM (gradient_clip_val 0). (Mutant: 1.0 for every model.)"""
    from owai.methods.regbench import Config, TrainConfig, grad_clip_of

    assert grad_clip_of(Config(arch=arch)) == clip
    assert grad_clip_of(Config(arch=arch, train=TrainConfig(grad_clip=0.5))) == 0.5


# -- mosaic-train / mosaic-eval's evaluation (evaluate_model, prepare_data, run) ------------------

TAGS = {"train": 1, "val": 2, "posloss": 3}


class _TaggedWindows:
    """Windows whose every token is its split's tag (TAGS), so a loss spy can tell what it reads."""

    def __init__(self, name: str, block_size: int) -> None:
        self.name, self.block_size, self.n_tokens = name, block_size, 100_000

    def _rows(self, n: int, T: int):
        x = torch.full((n, T), TAGS[self.name])
        return x, x.clone()

    def batch(self, n: int, generator: torch.Generator):
        return self._rows(n, self.block_size)

    def sequential(self, block_size=None, max_windows=None, batch_size=None):
        return [self._rows(min(max_windows, batch_size), block_size or self.block_size)]

    def with_block_size(self, block_size: int):
        return _TaggedWindows(self.name, block_size)


def _spied_evaluation(monkeypatch, tmp_path, eot=None, **ev_settings):
    """`evaluate_model` of a stand-in model on tagged windows (block 64), its loss functions spied:
    returns (outcome, [(what, tags read, window length, eot)]). The per-position loss of a window of
    T tokens is the curve 0, 1, ..., T-1."""
    from owai.evals import lm as lme
    from owai.methods import language_model as lm

    seen = []

    def mean_loss(model, batches, device, eot=None, log=None):
        tags = {int(x[0, 0]) for x, _ in batches}
        seen.append(("mean_loss", tags, None, eot))
        return 1.0

    def per_position_loss(model, windows, device, eot=None, log=None):
        rows = list(windows)
        T = rows[0][0].shape[1]
        seen.append(("posloss", {int(x[0, 0]) for x, _ in rows}, T, eot))
        return [float(i) for i in range(T)], sum(x.shape[0] for x, _ in rows)

    monkeypatch.setattr(lm, "mean_loss", mean_loss)
    monkeypatch.setattr(lme, "per_position_loss", per_position_loss)
    model = torch.nn.Linear(1, 1)
    model.config = SimpleNamespace(model_type="stand-in")
    data = lm.LMData(None, _TaggedWindows("train", 64), _TaggedWindows("val", 64), _TaggedWindows("posloss", 64))
    ev = lm.EvalConfig(posloss_windows=4, val_batches=2, batch_size=2, attention_multiples=[], continuations=False,
                       **ev_settings)
    out = lm.evaluate_model(ev, SimpleNamespace(path=tmp_path), "m", model, data, CPU, eot)
    return out, seen


def test_final_evaluation_reads_validation_windows_for_val_loss_and_training_windows_only_for_train_loss(monkeypatch, tmp_path):
    """Table B.2's validation loss is measured on the validation split, never on training windows;
    the training loss (the reference's estimate_loss "train") on training windows. (Mutant: the final
    val_loss drawn from data.train.)"""
    _, seen = _spied_evaluation(monkeypatch, tmp_path)
    assert [tags for what, tags, _, _ in seen if what == "mean_loss"] == [{TAGS["val"]}, {TAGS["train"]}]
    assert all(tags == {TAGS["posloss"]} for what, tags, _, _ in seen if what == "posloss")


def test_posloss_summaries_split_the_curve_at_position_50_and_at_the_training_context(monkeypatch, tmp_path):
    """posloss_first50 is the mean of positions 0-49 and posloss_after50 of 50 onwards (Fig 3.9's
    "after about 50 tokens"); at an evaluation length L, loss_L is the whole curve and
    loss_L_beyond the positions at and past the training context. (Mutants: position 51, block + 1.)"""
    out, seen = _spied_evaluation(monkeypatch, tmp_path, lengths=[128])
    m = out.measured
    assert m["posloss_first50"] == pytest.approx(24.5) and m["posloss_after50"] == pytest.approx(56.5)  # 0..49, 50..63
    assert m["loss_128"] == pytest.approx(63.5) and m["loss_128_beyond"] == pytest.approx(95.5)  # 0..127, 64..127
    assert [T for what, _, T, _ in seen if what == "posloss"] == [64, 128]


def test_every_evaluation_loss_reads_documents_apart_when_given_eot(monkeypatch, tmp_path):
    """A model trained with document-wise masks is evaluated with them: `eot` reaches every loss of
    the final evaluation (validation, training, per-position at each length)."""
    _, seen = _spied_evaluation(monkeypatch, tmp_path, eot=EOT, lengths=[128])
    assert len(seen) == 4 and all(eot == EOT for *_, eot in seen)


def test_mosaic_train_evaluates_with_documents_apart_exactly_when_it_trained_so(monkeypatch, tmp_path):
    """data.documents=true: the final evaluation of each trained model gets the tokenizer's eot (it
    reads windows as the model was trained to); without documents, none. (Mutant: eot never passed.)"""
    from owai.methods import Outcome
    from owai.methods import language_model as lm

    got = []
    data = lm.LMData(SimpleNamespace(eot_id=7, name="t", vocab_size=64), SimpleNamespace(n_tokens=1), SimpleNamespace(n_tokens=1), None)
    monkeypatch.setattr(lm, "check_memory", lambda cfg: None)
    monkeypatch.setattr(lm, "prepare_data", lambda *a, **k: data)
    monkeypatch.setattr(lm, "parallel_model", lambda *a, **k: SimpleNamespace(module=torch.nn.Linear(1, 1)))
    monkeypatch.setattr(lm, "train_model", lambda *a, **k: {"final_loss": 0.0})
    monkeypatch.setattr(lm, "save_model", lambda *a, **k: None)
    monkeypatch.setattr(lm, "evaluate_model", lambda ev, run, arch, model, data, device, eot=None: got.append(eot) or Outcome({}, {}))
    for name in ("plot_training_curves", "plot_posloss", "plot_extrapolation"):
        monkeypatch.setattr(lm, name, lambda *a, **k: None)
    run = SimpleNamespace(device=CPU, path=tmp_path, metrics=list)
    for documents, want in ((True, 7), (False, None)):
        got.clear()
        cfg = _v2_config()
        cfg.data.documents = documents
        lm.LanguageModelPretraining().run(cfg, run)
        assert got == [want]


def _saved_model(root: Path, model_type: str, documents: object = None) -> Path:
    """A saved model's folder: a run's models/<arch>/ beside its config.yaml recording
    `data.documents` when `documents` is given (True / False / "absent"), else a bare folder."""
    import yaml

    folder = root / "models" / "m" if documents is not None else root
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    if documents is not None:
        data = {} if documents == "absent" else {"documents": documents}
        (root / "config.yaml").write_text(yaml.safe_dump({"recipe": "table4.2-pretrain", "params": {"data": data}}))
    return folder


@pytest.mark.parametrize("asked, trained, want", [
    (True, None, 7), (False, None, None),  # data.documents given: every model so
    (None, True, 7), (None, False, None), (None, "absent", None),  # not given: as its run trained it
    (None, None, None),  # not given, a folder no owai run saved: read whole, as before
    (False, True, None),  # given false: a documents-trained model read across documents on purpose
])
def test_mosaic_eval_reads_documents_apart_as_asked_or_as_the_model_was_trained(monkeypatch, tmp_path, asked, trained, want):
    """mosaic-eval reads each window documents apart (evaluate_model gets the tokenizer's eot) when
    data.documents says so, and when it is not given, exactly when the mosaic-train run that saved the
    model trained with document-wise masks (its config.yaml's data.documents): Table 4.2's models, so
    evaluated, give mosaic-train's own final losses without the user repeating the setting. Before, the
    setting was dropped (the eot never passed), then had to be repeated by hand."""
    from owai.methods import Outcome
    from owai.methods import language_model as lm

    got = []
    data = lm.LMData(SimpleNamespace(eot_id=7, name="t", vocab_size=64), SimpleNamespace(n_tokens=1), SimpleNamespace(n_tokens=1), None)
    monkeypatch.setattr(lm, "prepare_data", lambda *a, **k: data)
    folder = _saved_model(tmp_path / "run", "owai_memory_mosaics_v2", trained)
    monkeypatch.setattr(lm, "model_dirs", lambda root: [("mmv2", folder)])
    monkeypatch.setattr("owai.data.text.tokenizer_for", lambda path, default: default)
    monkeypatch.setattr("owai.models.lm.load_pretrained", lambda path: torch.nn.Linear(1, 1))
    monkeypatch.setattr("owai.models.lm.check_vocab", lambda model, vocab: None)
    monkeypatch.setattr(lm, "evaluate_model", lambda ev, run, arch, model, data, device, eot=None: got.append(eot) or Outcome({}, {}))
    monkeypatch.setattr(lm, "plot_posloss", lambda *a, **k: None)
    cfg = lm.EvalOnlyConfig(models=[str(folder)])
    cfg.data.documents = asked
    outcome = lm.LanguageModelEvaluation().run(cfg, SimpleNamespace(device=CPU, path=tmp_path))
    assert got == [want]
    assert outcome.details["mmv2.documents"] is (want is not None)


def test_mosaic_eval_says_when_a_run_trained_on_another_corpus_than_it_reads(monkeypatch, tmp_path):
    """A run's models validated on another corpus than they trained on (mosaic-eval's preset reads
    data.source, owai-stories on the cpu preset) is said in one line naming both corpora; nothing
    when they agree or no run saved the model."""
    import yaml

    from owai.methods import Outcome
    from owai.methods import language_model as lm

    said = []
    data = lm.LMData(SimpleNamespace(eot_id=7, name="t", vocab_size=64), SimpleNamespace(n_tokens=1), SimpleNamespace(n_tokens=1), None)
    monkeypatch.setattr(lm, "prepare_data", lambda *a, **k: data)
    monkeypatch.setattr("owai.data.text.tokenizer_for", lambda path, default: default)
    monkeypatch.setattr("owai.models.lm.load_pretrained", lambda path: torch.nn.Linear(1, 1))
    monkeypatch.setattr("owai.models.lm.check_vocab", lambda model, vocab: None)
    monkeypatch.setattr(lm, "evaluate_model", lambda *a, **k: Outcome({}, {}))
    monkeypatch.setattr(lm, "plot_posloss", lambda *a, **k: None)
    monkeypatch.setattr(lm.console, "info", said.append)
    run_folder = _saved_model(tmp_path / "run", "owai_memory_mosaics_v2", False)
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    config["params"]["data"]["source"] = "text/sotu.tar.gz"
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(config))
    bare = _saved_model(tmp_path / "bare", "owai_memory_mosaics_v2")
    for folder, source, want in ((run_folder, "owai-stories", 1), (run_folder, "text/sotu.tar.gz", 0), (bare, "owai-stories", 0)):
        said.clear()
        monkeypatch.setattr(lm, "model_dirs", lambda root, folder=folder: [("mmv2", folder)])
        cfg = lm.EvalOnlyConfig(models=[str(folder)])
        cfg.data.source = source
        lm.LanguageModelEvaluation().run(cfg, SimpleNamespace(device=CPU, path=tmp_path))
        assert said == ["mmv2 was trained on text/sotu.tar.gz; its validation and training losses here read owai-stories "
                        "(--set data.source=text/sotu.tar.gz to read its own)"][:want]


def test_documents_apart_are_refused_for_a_model_without_document_masks(tmp_path):
    """Only the document-masked architectures (v2, the Llama transformer) read restarting positions as
    document boundaries: a GPT or a v1 Mosaic given data.documents=true would restart its positions
    but still attend across documents, so it is refused in one line; false, or a run's own setting,
    is taken. The saved types are those of the zoo's DOCUMENT_MASKED architectures."""
    from owai.methods import language_model as lm
    from owai.models.lm import lm_config
    from owai.models.zoo import DOCUMENT_MASKED, DOCUMENT_MASKED_TYPES

    widths = {"n_layer": 1, "n_embd": 8, "n_head": 2, "ffn_hidden": 16, "vocab_size": 16}
    types = {lm_config(a, **(widths if a == "transformer" else {})).model_type for a in DOCUMENT_MASKED}
    assert types == set(DOCUMENT_MASKED_TYPES)
    gpt = _saved_model(tmp_path / "gpt", "owai_gpt")
    with pytest.raises(lm.OwaiError, match=r"data.documents=true: .* \(owai_gpt\) has no document-wise masks"):
        lm.reads_documents(gpt, True)
    assert lm.reads_documents(gpt, False) is False and lm.reads_documents(gpt, None) is False
    assert lm.reads_documents(_saved_model(tmp_path / "llama", "llama"), True) is True


def test_a_run_whose_data_documents_is_not_a_bool_is_one_line(tmp_path):
    """A config.yaml edited to say `documents: maybe` is named, not taken as true."""
    from owai.methods import language_model as lm

    folder = _saved_model(tmp_path / "run", "owai_memory_mosaics_v2", "maybe")
    with pytest.raises(lm.OwaiError, match=r"config.yaml: data.documents is 'maybe', not true or false"):
        lm.reads_documents(folder, None)


def test_an_evaluation_corpus_is_read_from_its_validation_split(monkeypatch):
    """eval.source (Fig 3.9's Simple Wikipedia): the per-position loss reads that corpus's validation
    split, as the validation loss reads the training corpus's. (Mutant: its training split.)"""
    from owai.data import tokens
    from owai.methods import language_model as lm

    class Prepared:
        def __init__(self, source):
            self.source = source

        def windows(self, split, block_size):
            return (self.source, split, block_size)

    monkeypatch.setattr(lm, "run_tokenizer", lambda data: "tok")
    monkeypatch.setattr(tokens, "prepare_tokens", lambda source, tokenizer, **k: Prepared(source))
    got = lm.prepare_data(lm.DataConfig(source="corpus", block_size=16), lm.EvalConfig(source="wiki"))
    assert got.train == ("corpus", "train", 16) and got.val == ("corpus", "val", 16)
    assert got.posloss == ("wiki", "val", 16)


# -- the losses themselves (owai.evals.lm) ---------------------------------------------------------


class _ScoredLM(torch.nn.Module):
    """A causal-LM stand-in: logits 2.0 for token 0 and 0 elsewhere at every position (so the loss of
    a target depends only on whether it is 0); records the position_ids it is given."""

    def __init__(self, vocab: int = 8) -> None:
        super().__init__()
        self.vocab, self.positions = vocab, []

    def forward(self, input_ids, position_ids=None):
        self.positions.append(position_ids)
        logits = torch.zeros(*input_ids.shape, self.vocab)
        logits[..., 0] = 2.0
        return SimpleNamespace(logits=logits)


def test_validation_loss_averages_over_the_targets_that_are_not_ignored():
    """Targets equal to -100 (separators, padding: RegBench's validation batches) count neither in
    the sum nor in the number of targets the mean divides by. (Mutant: divided by every target.)"""
    from owai.evals.lm import IGNORE_INDEX, loss_totals, validation_loss

    model = _ScoredLM()
    x = torch.ones(2, 6, dtype=torch.long)
    y = torch.ones(2, 6, dtype=torch.long)
    y[:, 3:] = IGNORE_INDEX
    one = float(torch.log(torch.exp(torch.tensor(2.0)) + 7))  # loss of a non-zero target
    total, count = loss_totals(model, [(x, y)], CPU)
    assert count == 6 and total == pytest.approx(6 * one, rel=1e-6)
    assert validation_loss(model, [(x, y)], CPU) == pytest.approx(one, rel=1e-6)


def test_per_position_loss_is_the_mean_over_windows_not_over_batches():
    """Fig 3.9's curve: at each position, the loss averaged over every window, whatever the batches'
    sizes: 3 windows of loss a and 1 of loss b give (3a + b) / 4 over 4 windows. (Mutants: windows
    counted per batch; batch means summed.)"""
    from owai.evals.lm import per_position_loss

    model = _ScoredLM()
    x = torch.ones(4, 5, dtype=torch.long)
    y = torch.ones(4, 5, dtype=torch.long)
    y[:3] = 0  # the first batch's three windows are right (low loss), the last one's is wrong
    curve, n = per_position_loss(model, [(x[:3], y[:3]), (x[3:], y[3:])], CPU)
    a = float(torch.log(1 + 7 * torch.exp(torch.tensor(-2.0))))
    b = float(torch.log(torch.exp(torch.tensor(2.0)) + 7))
    assert n == 4 and curve == pytest.approx([(3 * a + b) / 4] * 5, rel=1e-6)


def test_losses_read_documents_apart_with_eot():
    """With `eot`, the model gets position_ids restarting after every end-of-text, so a window that
    crosses documents is read as the model was trained to. (Mutant: eot ignored.)"""
    from owai.data.packing import document_positions
    from owai.evals.lm import token_losses

    model = _ScoredLM()
    x = torch.tensor([[3, 4, EOT, 5, 6, EOT, 7]])
    token_losses(model, x, x, eot=EOT)
    assert torch.equal(model.positions[-1], document_positions(x, EOT))
    assert model.positions[-1].tolist() == [[0, 1, 2, 0, 1, 2, 0]]
    token_losses(model, x, x)
    assert model.positions[-1] is None


def test_losses_taken_a_slice_of_positions_at_a_time_are_every_positions_loss(monkeypatch):
    """A long window's log-softmax is taken LOSS_CHUNK logits at a time; every position's loss is
    the one the whole window gives, the last slice (shorter than the others) included. (Mutant: the
    last slice left unwritten.)"""
    from owai.evals import lm as lme

    torch.manual_seed(0)
    logits = torch.randn(2, 11, 8)

    def model(input_ids, position_ids=None):
        return SimpleNamespace(logits=logits)

    y = torch.randint(0, 8, (2, 11))
    whole = lme.token_losses(model, y, y)
    monkeypatch.setattr(lme, "LOSS_CHUNK", 2 * 8 * 3)  # 3 positions of 2 rows at a time: 4 slices, the last of 2
    assert torch.equal(lme.token_losses(model, y, y), whole)


# -- the recall / in-context classification mixture (owai.methods.recall, Table 4.4) -------------


def _recall_config(**recall):
    from owai.methods.language_model import DataConfig, TrainConfig
    from owai.methods.recall import Config, EpisodeConfig, RecallEvalConfig

    settings = {"lengths": [16, 32], "episodes": 2, "shots": [1, 2], "icl_episodes": 1, "probe_episodes": 1} | recall
    return Config(archs=["mmv2"], data=DataConfig(block_size=16), train=TrainConfig(batch_size=8),
                  episodes=EpisodeConfig(fraction=0.25, icl_share=0.5, window=8), recall=RecallEvalConfig(**settings))


def test_evaluation_episodes_are_planted_in_validation_text_only(monkeypatch):
    """Every evaluation episode (recall and classification, every length) is planted in text of the
    validation split: evaluation never reads the training data the models learnt. (Mutant: the
    filler drawn from data.train.)"""
    from owai.data import recall as episodes
    from owai.methods.language_model import LMData
    from owai.methods.recall import evaluation_episodes

    fillers = []
    monkeypatch.setattr(episodes, "recall_episode", lambda rng, pieces, filler, *a, **k: fillers.append(set(filler.tolist())))
    monkeypatch.setattr(episodes, "icl_episode", lambda rng, pieces, filler, *a, **k: fillers.append(set(filler.tolist())))
    data = LMData(None, _TaggedWindows("train", 16), _TaggedWindows("val", 16), None)
    suite = evaluation_episodes(_recall_config(), data, pieces=None)
    assert len(suite) == 2 * (1 + 2 * 2) and len(fillers) == 2 * (2 + 2 * 2 * 1)
    assert all(f == {TAGS["val"]} for f in fillers)


def test_training_mixture_has_its_share_of_episodes_and_next_token_targets(monkeypatch):
    """A training batch holds round(rows x episodes.fraction) episodes (icl_share only splits them
    between recall and classification), the rest text windows of the training split; targets are the
    inputs shifted by one. (Mutants: icl_share as the episodes' share; targets = inputs.)"""
    from owai.data import recall as episodes
    from owai.methods.language_model import LMData
    from owai.methods.recall import mixture

    monkeypatch.setattr(episodes, "training_episode", lambda rng, pieces, filler, length, *a: SimpleNamespace(
        tokens=np.full(length, 99, dtype=np.int64)))
    train = _Windows("train", 16)
    batch = mixture(_recall_config(), LMData(None, train, _Windows("val", 16), None), pieces=None)
    x, y = batch(0, 0)
    assert x.shape == y.shape == (8, 16)
    assert int((x == 99).all(1).sum()) == 2  # round(8 x 0.25)
    assert torch.equal(y[:, :-1], x[:, 1:]) and not torch.equal(y, x)


def _episode(*groups):
    return SimpleNamespace(queries=[SimpleNamespace(group=g, distance=1) for g in groups])


def test_recall_evaluation_reports_the_all_query_accuracy_and_ablates_the_long_term_memory(monkeypatch):
    """`icl.{labels}.{scale}.{n}shot` is the accuracy over all of a point's queries (not one group's),
    and with recall.without_long_term the recall is measured again with the long-term memory off,
    then switched back on. (Mutants: the worst group's accuracy; the ablation not applied.)"""
    from owai.evals import recall as scoring
    from owai.methods import recall as method
    from owai.methods.language_model import LMData

    states = []

    def score(model, eps, device, batch_size=4):
        states.append(model.config.long_term_memory)
        return [[True, False] for _ in eps]

    monkeypatch.setattr(scoring, "score", score)
    monkeypatch.setattr(method, "mean_loss", lambda *a, **k: 1.0)
    model = torch.nn.Linear(1, 1)
    model.config = SimpleNamespace(long_term_memory=True)
    cfg = _recall_config(lengths=[16], shots=[1])
    suite = {"recall/16": [_episode("near", "mid")], "icl/semantic/16/1": [_episode("a", "b")]}
    out = method.evaluate(cfg, model, LMData(None, None, _TaggedWindows("val", 16), None), suite, CPU)
    assert out.measured["icl.semantic.1x.1shot"] == pytest.approx(0.5)
    assert out.measured["recall.1x"] == pytest.approx(0.5) and out.measured["recall.1x.near"] == 1.0
    assert "recall_no_ltm.1x" in out.measured
    assert states == [True, False, True]  # recall, recall without long-term memory, classification
    assert model.config.long_term_memory is True


def test_learning_probe_scores_classification_with_the_most_shots(monkeypatch):
    """The learning curve's icl_anonymous_1x is measured on the anonymous episodes with the most
    demonstrations per class, at the training length. (Mutant: the fewest shots.)"""
    from owai.evals import recall as scoring
    from owai.methods.recall import learning_probe

    suite = {"recall/16": [_episode("near")], "icl/anonymous/16/1": [_episode("a")], "icl/anonymous/16/2": [_episode("a")]}
    right = {id(suite["recall/16"][0]), id(suite["icl/anonymous/16/2"][0])}
    monkeypatch.setattr(scoring, "score", lambda model, eps, device, batch_size=4: [[id(e) in right] for e in eps])
    out = learning_probe(_recall_config(lengths=[16], shots=[1, 2]), None, suite, CPU)
    assert out == {"recall_1x": 1.0, "icl_anonymous_1x": 1.0}


def test_a_recall_episode_of_twice_the_training_length_has_a_far_bucket():
    """The `far` bucket (past the training length) is asked in every episode of at least twice the
    training context, 2x included (Table C.1's 2x-8x columns). (Mutant: only strictly longer.)"""
    from owai.methods.recall import eval_buckets

    cfg = _recall_config(queries_per_bucket=1)
    assert eval_buckets(cfg, 16) == ["near", "mid"]
    assert eval_buckets(cfg, 32) == ["near", "mid", "far"]


def test_a_learned_position_gpt_continues_the_prompts_last_tokens_leaving_room_for_the_answer():
    """Tables B.4/B.5's continuations by a GPT with a learned position table of `block_size` rows: as
    the reference crops its context to block_size, the model sees the prompt's last
    `block_size - max_new_tokens` tokens, so prompt and answer fit the table; `max_new_tokens` is cut
    to half the table. (Mutants: the crop to the whole table, which runs past it once the answer grows,
    or no cap on max_new_tokens; before, only a crash of a real tiny GPT showed the first.)"""
    from owai.evals.lm import continuations

    seen = []

    class LearnedGPT(torch.nn.Module):
        config = SimpleNamespace(model_type="owai_gpt", position="learned", block_size=16)

        def generate(self, ids, max_new_tokens, **kwargs):
            seen.append((ids[0].tolist(), max_new_tokens))
            return torch.cat([ids, torch.zeros(1, max_new_tokens, dtype=ids.dtype)], 1)

    tokenizer = SimpleNamespace(encode=lambda text: [int(w) for w in text.split()], decode=lambda ids: " ".join(map(str, ids)), eot_id=99)
    prompt = " ".join(str(i) for i in range(30))
    rows = continuations(LearnedGPT(), tokenizer, [prompt], CPU, max_new_tokens=4, beams=(1,))
    assert seen == [(list(range(18, 30)), 4)]  # 16 - 4 = 12 tokens: 18..29
    assert rows == [{"prompt": prompt, "greedy": "0 0 0 0"}]
    seen.clear()
    continuations(LearnedGPT(), tokenizer, [prompt], CPU, max_new_tokens=12, beams=(1,))
    assert seen == [(list(range(22, 30)), 8)]  # at most half the table for the answer: 8 new, 8 seen
