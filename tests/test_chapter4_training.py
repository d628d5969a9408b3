"""Chapter 4's training side through `owai mosaic-train`: Memory Mosaics v2 and the Llama transformer
trained on the same batches with document masks, evaluated past their training length and without
the long-term memory; 2 gloo processes with FSDP2; --size, --dry-run, the memory plan; bad input."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from owai.models.lm import load_pretrained
from conftest import as_if_killed, as_sets, cli_in_process, run_owai
from test_language_model import lm_cache, losses, only_run, torchrun_mosaic_train  # noqa: F401  (lm_cache: one token cache)

WORDS = ("the cat sat on a mat while seven brown dogs ran past the old mill and every child saw the river "
         "turn gold under a quiet evening sky").split()


def corpus(path: Path, docs: int = 160, seed: int = 0) -> Path:
    """Documents of 40-200 words, each repeating an invented name (so context pays)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(docs):
            name = "".join(rng.choice("bcdfgklmnprstvz") + rng.choice("aeiou") for _ in range(3))
            words = [rng.choice(WORDS) if rng.random() > 0.15 else name for _ in range(rng.randint(40, 200))]
            f.write(json.dumps({"text": " ".join(words)}) + "\n")
    return path


TINY_V2 = [
    "archs=[mmv2, transformer]",
    "model.size=''",  # the explicit widths below, not the cpu preset's tiny size
    "data.tokenizer=bpe-300",
    "data.block_size=32",
    "data.documents=true",
    "data.val_every=10",
    "model.n_layer=1",
    "model.n_embd=32",
    "model.n_head=2",
    "model.ffn_hidden=64",
    "model.short_window=8",
    "model.long_delay_train=[2, 6]",
    "model.long_delay_eval=2",
    "train.steps=8",
    "train.batch_size=4",
    "train.warmup=2",
    "train.eval_every=4",
    "train.eval_batches=2",
    "train.checkpoint_every=4",
    "eval.posloss_windows=4",
    "eval.val_batches=2",
    "eval.lengths=[64, 128]",
    "eval.without_long_term=true",
    "eval.attention_multiples=[]",
    "eval.continuations=false",
]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return corpus(tmp_path_factory.mktemp("corpus") / "docs.jsonl")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, text_file: Path) -> Path:
    out = tmp_path_factory.mktemp("ch4-runs")
    proc = run_owai("mosaic-train", "-r", "table4.2-pretrain", "-q", "-o", str(out), "--dataset", str(text_file), *as_sets(TINY_V2))
    assert proc.returncode == 0, proc.stderr
    return only_run(out)


def test_both_models_train_and_are_evaluated_past_their_length(trained: Path):
    from transformers import AutoModelForCausalLM

    import owai.models.lm  # noqa: F401  (registers owai's model types with the Auto classes)

    results = json.loads((trained / "results.json").read_text())
    rows = {r["metric"]: r["measured"] for r in results["rows"]}
    for arch in ("mmv2", "transformer"):
        assert rows[f"{arch}.val_loss"] > 0
        for length in (64, 128):
            curve = results["details"][f"{arch}.posloss_{length}"]
            assert len(curve) == length
            assert rows[f"{arch}.loss_{length}_beyond"] == pytest.approx(sum(curve[32:]) / (length - 32))
        model = AutoModelForCausalLM.from_pretrained(trained / "models" / arch)
        assert model.config.model_type == {"mmv2": "owai_memory_mosaics_v2", "transformer": "llama"}[arch]
        speed = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
        assert any(r.get("stage") == arch and r.get("tokens_per_s", 0) > 0 for r in speed)
    # v2 was evaluated again with its long-term memory off (Table C.1), and the switch was put back
    assert rows["mmv2.val_loss_no_ltm"] != rows["mmv2.val_loss"]
    assert "transformer.val_loss_no_ltm" not in rows
    assert json.loads((trained / "models" / "mmv2" / "config.json").read_text())["long_term_memory"] is True
    assert (trained / "figures" / "extrapolation.png").is_file()


# The tests below run owai in this process (`cli_in_process`: an `owai` subprocess costs seconds of
# imports); the `trained` fixture runs the console script itself.
def test_the_long_term_delay_is_drawn_per_step_and_replayed_on_resume(trained: Path, tmp_path: Path, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    before = losses(trained, "mmv2")
    as_if_killed(run, run / "checkpoints" / "mmv2" / "step-000008", run / "checkpoints" / "transformer", run / "models")
    code, _, err = cli_in_process(["mosaic-train", "-q", "--resume", str(run)], capsys)
    assert code == 0, err
    assert losses(run, "mmv2") == before


def test_a_corrupt_checkpoint_is_refused_in_one_line(trained: Path, tmp_path: Path, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    as_if_killed(run)
    tensors = run / "checkpoints" / "mmv2" / "step-000008" / "tensors.safetensors"
    data = bytearray(tensors.read_bytes())
    data[len(data) // 2] ^= 0xFF
    tensors.write_bytes(bytes(data))
    code, _, err = cli_in_process(["mosaic-train", "-q", "--resume", str(run)], capsys)
    assert code == 2 and "Traceback" not in err
    assert err.strip().count("\n") == 0 and "step-000008" in err, err


@pytest.mark.slow  # a full end-to-end path (tens of seconds); `pytest -m slow`
def test_two_fsdp_processes_train_like_one(tmp_path: Path, text_file: Path):
    """FSDP2 over 2 gloo processes (meta-device build, per-block shards, sharded checkpoints) gives
    the losses of 1 process with the same global batch; the sharded model is then evaluated in
    lockstep (losses and greedy/beam generation) and gathered parameter by parameter into the same
    save_pretrained directory a single process writes."""
    common = [s for s in TINY_V2 if not s.startswith(("archs", "train.batch_size", "eval."))] + [
        "archs=[mmv2]", "train.parallel=fsdp", "train.steps=6", "train.log_every=2", "train.eval_every=6",
        "train.checkpoint_every=3", "eval.attention_multiples=[]", "eval.continuations=true", "eval.max_new_tokens=3",
        "eval.val_batches=2", "eval.posloss_windows=2"]
    recipe = ["-r", "table4.2-pretrain", "--dataset", str(text_file)]
    single = run_owai("mosaic-train", "-q", "-o", str(tmp_path / "one"), *recipe, *as_sets([*common, "train.batch_size=4"]))
    assert single.returncode == 0, single.stderr
    double = torchrun_mosaic_train(2, tmp_path / "two", recipe + as_sets([*common, "train.batch_size=2"]))
    assert double.returncode == 0, double.stderr[-2000:]
    l1, l2 = losses(only_run(tmp_path / "one"), "mmv2"), losses(only_run(tmp_path / "two"), "mmv2")
    assert l1.keys() == l2.keys() and len(l1) == 3
    for step in l1:
        assert l2[step] == pytest.approx(l1[step], abs=2e-4), (step, l1, l2)
    step = only_run(tmp_path / "two") / "checkpoints" / "mmv2" / "step-000006"
    assert (step / "dcp").is_dir()  # each rank wrote its own shards
    measured = [{r["metric"]: r["measured"] for r in json.loads((only_run(tmp_path / d) / "results.json").read_text())["rows"]}
                for d in ("one", "two")]
    assert measured[1]["mmv2.val_loss"] == pytest.approx(measured[0]["mmv2.val_loss"], abs=2e-4)
    assert measured[1]["mmv2.loss_2048_beyond"] == pytest.approx(measured[0]["mmv2.loss_2048_beyond"], abs=2e-4)
    one, two = (load_pretrained(only_run(tmp_path / d) / "models" / "mmv2").state_dict() for d in ("one", "two"))
    assert one.keys() == two.keys()
    assert all(torch.allclose(one[k], two[k], atol=1e-4) for k in one)


@pytest.mark.slow  # a full end-to-end path (tens of seconds); `pytest -m slow`
def test_size_large_dry_run_prints_the_plan_and_a_real_run_refuses(tmp_path: Path):
    dry = run_owai("mosaic-train", "--size", "large", "--dry-run", "-o", str(tmp_path))
    assert dry.returncode == 0, dry.stderr
    assert "Memory Mosaics v2 large: 9.93B parameters" in dry.stdout
    assert "18.9B at context 256" in dry.stdout  # Table 4.2's FLOPs per token
    transformer = run_owai("mosaic-train", "--size", "large", "--arch", "transformer", "--dry-run")
    assert "8.84B parameters" in transformer.stdout and "16.7B at context 256" in transformer.stdout
    real = run_owai("mosaic-train", "--size", "large", "-o", str(tmp_path))
    assert real.returncode == 2 and "Traceback" not in real.stderr
    *plan_lines, error = real.stderr.strip().splitlines()
    assert error.startswith("error: ") and "needs" in error and "GiB per rank" in error, real.stderr
    assert any("parameters 37.0 GiB" in line for line in plan_lines)  # the plan that says why, on stderr
    assert real.stdout == "" and not any(line.startswith("error") for line in plan_lines)
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("extra, message", [
    (["--set", "data.block_size=1000000", "--set", "train.batch_size=64"], "GiB"),  # a context the machine cannot hold
    (["--set", "data.block_size=4000000"], "at most 1,048,576 tokens"),  # past the largest context owai plans
    (["--set", "model.vocab_size=64"], "tokenizer has"),  # a tokenizer larger than the embedding
    (["--set", "model.size=huge"], "model.size must be one of"),
    (["--set", "model.long_delay_train=[9, 3]"], "long_delay_train"),
    (["--set", "eval.lengths=[1]"], "eval.lengths"),
])
def test_bad_input_is_one_line(extra: list[str], message: str, tmp_path: Path, text_file: Path, capsys):
    # in process (each `owai` subprocess costs ~10 s of imports; the console script's own one-line path
    # is tests/test_invocations_issue40.py's)
    code, _, err = cli_in_process(["mosaic-train", "-r", "table4.2-pretrain", "-o", str(tmp_path / "out"), "--dataset",
                                   str(text_file), *as_sets(TINY_V2), *extra], capsys)
    assert code == 2, err
    assert message in err and err.strip().count("\n") == 0, err
    assert not (tmp_path / "out").exists()


def test_an_empty_corpus_is_one_line(tmp_path: Path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    code, _, err = cli_in_process(["mosaic-train", "-r", "table4.2-pretrain", "-o", str(tmp_path / "out"), "--dataset",
                                   str(empty), *as_sets(TINY_V2)], capsys)
    assert code == 2 and "no text" in err and err.strip().count("\n") == 0, err


def test_table_4_2_flops_per_token():
    """2 x (parameters that multiply) + 4 L d x (pairs read per query) at context 256 gives Table 4.2's
    16.7B / 18.9B / 15.6B."""
    from owai.models.lm import build_sized_lm
    from owai.plan import forward_flops_per_token

    for arch, extra, thesis in (("transformer", {}, 16.7), ("mmv2", {}, 18.9), ("mmv2", {"long_term_memory": False}, 15.6)):
        model = build_sized_lm(arch, "large", meta=True, **extra)
        assert round(forward_flops_per_token(model, 256) / 1e9, 1) == thesis
    assert torch.get_default_device().type == "cpu"


@pytest.mark.slow  # ~40 s; tests/test_packing.py checks the stream's resume state and next batches
def test_a_streamed_corpus_trains_and_resumes_where_it_stopped(tmp_path: Path, text_file: Path):
    """data.stream: batches from the packed stream (owai.data.packing), its position saved with each
    checkpoint, so a killed run resumes on the same next rows; validation tokens kept in the run. The
    same through the prefetch thread (data.prefetch=2; `auto` is none on a CPU): the same losses to the
    last bit, and a resume from the checkpoint its thread had read past gives them again. Each log line
    has the loop's wait for data beside it (data_wait_s)."""
    common = [s for s in TINY_V2 if not s.startswith(("archs", "eval.lengths", "eval.without"))] + [
        "archs=[mmv2]", "data.stream=true", "data.stream_val_tokens=600", "eval.lengths=[]", "train.steps=6", "train.checkpoint_every=3",
        "train.log_every=1", "train.eval_every=6"]
    before = None
    for prefetch in ("auto", "2"):
        out = tmp_path / f"runs-{prefetch}"
        proc = run_owai("mosaic-train", "-r", "table4.2-pretrain", "-q", "-o", str(out), "--dataset", str(text_file),
                        *as_sets(common + [f"data.prefetch={prefetch}"]))
        assert proc.returncode == 0, proc.stderr
        run = only_run(out)
        assert (run / "val_tokens.bin").stat().st_size > 0
        before = before or losses(run, "mmv2")
        assert len(before) == 6 and losses(run, "mmv2") == before
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert sorted(r["step"] for r in rows if r.get("data_wait_s", -1) >= 0) == list(range(1, 7))  # the loop's data stall
        as_if_killed(run, run / "checkpoints" / "mmv2" / "step-000006", run / "models")
        again = run_owai("mosaic-train", "-q", "--resume", str(run))
        assert again.returncode == 0, again.stderr
        assert losses(run, "mmv2") == before


STREAMED = ["archs=[transformer]", "model.size=''", "data.tokenizer=bytes", "data.block_size=32", "data.documents=true",
            "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.ffn_hidden=64", "train.steps=4", "train.batch_size=4",
            "train.warmup=1", "train.eval_every=4", "train.eval_batches=1", "train.checkpoint_every=2", "eval.posloss_windows=2",
            "eval.val_batches=1", "eval.lengths=[]", "eval.attention_multiples=[]", "eval.continuations=false",
            "data.stream=true", "data.stream_val_tokens=100"]


def _streamed_corpus(folder: Path, broken_at: int | None = None) -> Path:
    """train.jsonl (a line that is not JSON at record `broken_at`) and val.jsonl, in `folder`."""
    folder.mkdir()
    rng = random.Random(1)
    lines = [json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60)))}) for _ in range(100)]
    (folder / "val.jsonl").write_text("\n".join(lines[:10]) + "\n")
    if broken_at is not None:
        lines.insert(broken_at, '{"text": "cut off')
    (folder / "train.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_a_corrupt_file_met_by_the_prefetch_thread_is_the_same_error_line(tmp_path: Path, capsys):
    """A corrupt training file read by the prefetch thread stops the run with the one `error:` line and
    exit code the stream read in the loop gives (not a hang, not a traceback of the thread)."""
    corpus = _streamed_corpus(tmp_path / "corpus", broken_at=30)
    said = []
    for prefetch in ("0", "2"):
        code, _, err = cli_in_process(["mosaic-train", "-r", "table4.2-pretrain", "-q", "-o", str(tmp_path / prefetch),
                                       "--dataset", str(corpus), *as_sets(STREAMED + [f"data.prefetch={prefetch}"])], capsys)
        said.append((code, err.strip().splitlines()))
    assert said[0] == said[1], said
    code, lines = said[1]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "train.jsonl:31: not a JSON line" in lines[0], said


def test_sigterm_while_the_loop_waits_for_the_prefetch_thread_stops_the_run_as_interrupted(tmp_path: Path, capsys, monkeypatch):
    """SIGTERM (torchrun, SLURM) arriving while the training loop waits for a batch of the prefetch
    thread stops the run at once, marked interrupted with exit 143, as anywhere else in a run; the
    thread, inside its batch, is left to end (a daemon: nothing waits on it past PREFETCH_CLOSE_S)."""
    import os
    import signal
    import threading

    from owai.data import packing
    from owai.data.text import ByteTokenizer

    corpus = _streamed_corpus(tmp_path / "corpus")
    release = threading.Event()
    encode_batch = ByteTokenizer.encode_batch

    def slow_in_the_thread(self, texts):
        if threading.current_thread() is not threading.main_thread():
            os.kill(os.getpid(), signal.SIGTERM)
            release.wait(30)
        return encode_batch(self, texts)

    monkeypatch.setattr(ByteTokenizer, "encode_batch", slow_in_the_thread)
    monkeypatch.setattr(packing, "PREFETCH_CLOSE_S", 0.2)
    try:
        code, _, err = cli_in_process(["mosaic-train", "-r", "table4.2-pretrain", "-q", "-o", str(tmp_path / "out"),
                                       "--dataset", str(corpus), *as_sets(STREAMED + ["data.prefetch=2"])], capsys)
    finally:
        release.set()
    assert code == 143 and err.strip().splitlines()[-1] == "error: stopped by SIGTERM", err
    (status,) = (tmp_path / "out").glob("*/*/status.json")
    assert json.loads(status.read_text())["status"] == "interrupted"


@pytest.mark.parametrize("arch", ["mmv2", "transformer", "lstm"])
def test_the_evaluation_interface_batches_left_padded_prompts(arch: str):
    """owai.evals.causal_lm: batch_size prompts per generate call, left-padded, give what each prompt
    gives alone (v2 reads the padding as a document of its own; Llama masks it; the LSTM skips it)."""
    from owai.data.text import ByteTokenizer
    from owai.evals.causal_lm import CausalLM, generate_all
    from owai.models.lm import build_lm

    torch.manual_seed(0)
    kw = dict(n_layer=2, n_embd=32, vocab_size=260) | ({} if arch == "lstm" else dict(n_head=2, ffn_hidden=64))
    model = build_lm(arch, **kw, **({"short_window": 6, "long_delay_eval": 3} if arch == "mmv2" else {}))
    lm = CausalLM(model, ByteTokenizer(), arch, torch.device("cpu"))
    prompts = ["the cat sat", "a much longer prompt about the river", "x", "seven brown dogs ran past"]
    alone = [lm.generate(p, max_new_tokens=6) for p in prompts]
    lm.batch_size = 3
    assert lm.pads and generate_all(lm, prompts, max_new_tokens=6) == alone


def test_context_extension_starts_from_the_saved_model(trained: Path, tmp_path: Path, text_file: Path, capsys):
    """model.init_from: the extend-32k stage's mechanism, here 32 -> 64 tokens with a zero learning rate:
    the saved model equals the one it started from."""
    from safetensors.torch import load_file

    extend = [s for s in TINY_V2 if not s.startswith(("archs", "data.block_size", "train.steps", "eval.lengths"))] + [
        "archs=[mmv2]", "data.block_size=64", "train.steps=1", "train.lr=1e-30", "train.min_lr=1e-30", "train.warmup=0",
        "eval.lengths=[]", f"model.init_from={trained / 'models' / 'mmv2'}"]
    code, _, err = cli_in_process(["mosaic-train", "-r", "table4.2-pretrain", "-q", "-o", str(tmp_path), "--dataset",
                                   str(text_file), *as_sets(extend)], capsys)
    assert code == 0, err
    before = load_file(trained / "models" / "mmv2" / "model.safetensors")
    after = load_file(only_run(tmp_path) / "models" / "mmv2" / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.allclose(before[k], after[k]) for k in before)
    # another shape is refused in validation (in process: the one-line form of init_from's refusals is
    # tests/test_invocations_issue40.py's)
    from owai.errors import OwaiError
    from owai.methods.language_model import _check_init_from
    from owai.models.lm import lm_config

    saved = json.loads((trained / "models" / "mmv2" / "config.json").read_text())
    wider = lm_config("mmv2", **{k: saved[k] for k in ("vocab_size", "n_layer", "n_head", "ffn_hidden")}, n_embd=48)
    with pytest.raises(OwaiError, match="does not fit this model: n_embd is 32 there, 48 here"):
        _check_init_from(trained / "models" / "mmv2", "mmv2", wider)


def test_mosaic_eval_reads_documents_apart_as_the_run_trained(trained: Path, tmp_path: Path, text_file: Path, capsys):
    """`owai mosaic-eval RUN` of models trained with document-wise masks (data.documents=true) gives
    the run's own final validation losses without the setting repeated (it is read from the run's
    config.yaml); `--set data.documents=false` reads the same windows across documents, another loss."""
    sets = as_sets([s for s in TINY_V2 if s.startswith(("data.", "eval.")) and not s.startswith("data.documents")])
    original = {r["metric"]: r["measured"] for r in json.loads((trained / "results.json").read_text())["rows"]}
    for extra, same in (([], True), (["--set", "data.documents=false"], False)):
        out = tmp_path / str(same)
        code, stdout, err = cli_in_process(["mosaic-eval", str(trained), "--posloss-only", "-q", "--json", "-o", str(out),
                                            "--set", f"data.source={text_file}", *sets, *extra], capsys)
        assert code == 0, err
        got = json.loads(stdout)
        evaluated = {r["metric"]: r["measured"] for r in got["rows"]}
        for arch in ("mmv2", "transformer"):
            assert got["details"][f"{arch}.documents"] is same
            if same:
                assert evaluated[f"{arch}.val_loss"] == pytest.approx(original[f"{arch}.val_loss"], rel=1e-5)
            else:
                assert evaluated[f"{arch}.val_loss"] != pytest.approx(original[f"{arch}.val_loss"], rel=1e-5)
