"""Every precision / dtype setting a user can give either works or is refused in one line before a
run directory exists: runtime.dtype (read by no method), the evaluations' `precision` (the weights'
dtype), and the training stages' autocast precision (train.precision, pretrain.precision), which
trains under bf16 / fp16 autocast on CUDA only. Plus the dtypes a GPU's `precision=auto` produces
for an evaluated model (bf16 weights), forced on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import TINY_MOONS, as_sets, cli_in_process


def _refused(args: list[str], out: Path, capsys) -> str:
    """Run `owai ARGS -o OUT -q`: it must exit 2 with one `error:` line and leave no run directory."""
    code, _, err = cli_in_process([*args, "-o", str(out), "-q"], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    assert not list(out.rglob("status.json")), "a run directory was created before the refusal"
    return lines[0]


@pytest.mark.parametrize(("args", "named"), [
    (["moons", *as_sets(TINY_MOONS)], "this method computes in float32 only"),
    (["mosaic-train", "--size", "tiny"], "set train.precision instead"),
    (["rich-features", "-r", "table2.2-cat-probe", "-p", "tiny"], "set pretrain.precision instead"),
    (["eval", "icl", "--task", "synthetic", "--model", "reference:knn"], "set precision instead"),
])
def test_runtime_dtype_that_no_method_reads_is_refused(args, named, tmp_path, capsys) -> None:
    """runtime.dtype=bfloat16 used to run in float32 while env.json recorded bfloat16."""
    line = _refused([*args, "--set", "runtime.dtype=bfloat16"], tmp_path / "out", capsys)
    assert "runtime.dtype=bfloat16 changes nothing" in line and named in line


@pytest.mark.parametrize("value", ["float16", "fp8", "bf16", "half"])
@pytest.mark.parametrize("args", [
    ["eval", "icl", "--task", "synthetic", "--model", "reference:knn"],
    ["eval", "ruler", "--tasks", "niah_single_1", "--ctx", "1k", "--model", "reference:oracle"],
    ["eval", "harness", "--tasks", "owai_mc_smoke", "--model", "reference:oracle"],
])
def test_evaluation_precision_is_one_of_its_choices(args, value, tmp_path, capsys) -> None:
    """A free string before: an unknown value was an internal KeyError inside the run."""
    line = _refused([*args, "--set", f"precision={value}"], tmp_path / "out", capsys)
    assert f"params.precision: expected one of 'auto' | 'float32' | 'bfloat16', got {value!r}" in line


@pytest.mark.parametrize(("args", "setting"), [
    (["recipes", "run", "table2.8-dropout"], "train.precision"),
    (["rich-features", "-r", "table2.2-cat-probe", "-p", "tiny"], "pretrain.precision"),
    (["mosaic-train", "--size", "tiny"], "train.precision"),
])
def test_autocast_training_off_cuda_is_refused_before_the_run(args, setting, tmp_path, capsys) -> None:
    """dropout-ft and rich-features trained under CPU bf16 autocast, whose convolutions can return
    garbage weight gradients (a ResNet at 16 px): a NonFiniteError mid-run that blamed the lr."""
    line = _refused([*args, "--set", f"{setting}=bfloat16", "--set", "runtime.device=cpu"], tmp_path / "out", capsys)
    assert line == f"error: {setting}=bfloat16 needs a CUDA device (this run is on cpu)"


def test_training_precision_resolves_auto_and_refuses_autocast_off_cuda() -> None:
    from owai.errors import OwaiError
    from owai.runtime import training_precision

    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # device objects only: no CUDA needed
    assert training_precision("auto", cpu, "train.precision") == "float32"
    assert training_precision("float32", cpu, "train.precision") == "float32"
    assert training_precision("auto", cuda, "train.precision") == "bfloat16"
    assert training_precision("float16", cuda, "train.precision") == "float16"
    for name in ("bfloat16", "float16"):
        with pytest.raises(OwaiError, match=f"^pretrain.precision={name} needs a CUDA device"):
            training_precision(name, cpu, "pretrain.precision")


def test_dropout_ft_pretrain_cache_is_keyed_by_its_precision() -> None:
    """The pretrain stage trains in train.precision: a float32 run never takes a bf16-trained
    backbone from the cache; float32 keys are the ones written before the precision was keyed."""
    import owai.methods.dropout_ft as dft
    from owai.config import build

    cfg = build(dft.Config, {})
    assert dft.pretrain_key(cfg) == dft.pretrain_key(cfg, "float32") != dft.pretrain_key(cfg, "bfloat16")



def test_rich_features_pretrain_cache_keys_auto_as_what_it_resolves_to(monkeypatch: pytest.MonkeyPatch) -> None:
    """pretrain.precision=auto trains under bf16 autocast on CUDA and in float32 elsewhere; one key
    for both let a CPU run take a network trained on a GPU from a shared cache. On CUDA the key is
    explicit bfloat16's; on the CPU it stays the one written before (cached networks stay valid)."""
    import owai.methods.rich_features as rf
    from owai.config import build

    auto = build(rf.Config, {})
    bf16 = build(rf.Config, {"pretrain": {"precision": "bfloat16"}})
    on_cpu = rf.pretrain_key(auto, 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # runtime.device=auto picks CUDA
    assert rf.pretrain_key(auto, 0) == rf.pretrain_key(bf16, 0) != on_cpu
    cpu = build(rf.Config, {"runtime": {"device": "cpu"}})
    assert rf.pretrain_key(cpu, 0) == on_cpu


TINY_LMS = {
    "gpt": dict(n_layer=1, n_embd=32, n_head=2, block_size=64),
    "mm": dict(n_layer=1, n_embd=32, n_head=2, pmem_size=8, leaky_chunk=16, ic_dropout=0.0, hd_dropout=0.0),
    "lstm": dict(n_layer=1, n_embd=32),
    "mmv2": dict(n_layer=1, n_embd=16, n_head=2, ffn_hidden=24, short_window=5, long_delay_eval=3, scan_chunk=4,
                 query_block=3),
    "transformer": dict(n_layer=1, n_embd=32, n_head=2, ffn_hidden=64),
}


@pytest.mark.parametrize("arch", list(TINY_LMS))
def test_evaluated_model_in_the_bf16_weights_a_gpu_gives_it(arch, one_thread) -> None:
    """On CUDA an evaluation's precision=auto loads the weights in bfloat16 (CausalLM): every zoo
    model scores and generates in them, forced here on the CPU (with long-term memory ablated too)."""
    from owai.data.text import ByteTokenizer
    from owai.evals.causal_lm import CausalLM
    from owai.models.lm import build_lm

    torch.manual_seed(0)
    lm = CausalLM(build_lm(arch, vocab_size=257, **TINY_LMS[arch]), ByteTokenizer(), arch, torch.device("cpu"),
                  "bfloat16")
    assert {p.dtype for p in lm.model.parameters()} == {torch.bfloat16}
    logp, _ = lm.loglikelihood("Mia found a red", " ball.")
    assert torch.isfinite(torch.tensor(logp))
    assert isinstance(lm.generate("Tom said", max_new_tokens=3), str)
    if arch == "mmv2":
        with lm.ablate("long_term_memory"):
            assert torch.isfinite(torch.tensor(lm.loglikelihood("Mia found a red", " ball.")[0]))


@pytest.mark.parametrize(("args", "setting", "recipe", "preset"), [
    (["recipes", "run", "table2.8-dropout"], "train.precision", "table2.8-dropout", None),
    (["rich-features", "-r", "table2.2-cat-probe", "-p", "tiny"], "pretrain.precision", "table2.2-cat-probe", "tiny"),
    (["mosaic-train", "--size", "tiny"], "train.precision", "table4.2-pretrain", "cpu"),
])
def test_a_gpu_run_is_planned_without_a_gpu_and_refused_only_where_it_would_run(args, setting, recipe, preset, tmp_path,
                                                                               capsys, monkeypatch) -> None:
    """runtime.device=cuda with bf16 autocast: the method's settings check (`validate`, which a SLURM
    sweep planned on a login node runs for every point) takes the GPU at its word; the machine that
    would run it, here without one, refuses the device itself, before any directory."""
    from owai import runtime
    from owai.experiment import resolve
    from owai.recipes import load

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert runtime.planned_device("cuda") == torch.device("cuda") and runtime.planned_device("auto").type == "cpu"
    resolve(load(recipe), preset, [f"{setting}=bfloat16", "runtime.device=cuda"], missing_ok=True)  # not refused
    line = _refused([*args, "--set", f"{setting}=bfloat16", "--set", "runtime.device=cuda"], tmp_path / "out", capsys)
    assert line == "error: runtime.device is 'cuda' but no CUDA device is available"
