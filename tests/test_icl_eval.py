"""`owai eval icl` (thesis sec 4.2.3.3, Figs 4.6-4.9) and the model interface the chapter-4 suites
share (`owai.evals.causal_lm`): a saved causal LM end to end, the reference models on the real
banking77 files, log-likelihoods, the ablation switch, and the one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from owai.errors import OwaiError
from conftest import cli_in_process, save_tiny_gpt2

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory) -> Path:
    """A 2-layer GPT-2 over owai's byte tokenizer, saved as a save_pretrained directory that records
    its tokenizer (owai_tokenizer.json), as mosaic-train's model directories do."""
    return save_tiny_gpt2(tmp_path_factory.mktemp("tiny-lm"))


def _icl(args: list[str], capsys) -> tuple[int, str, str]:
    return cli_in_process(["eval", "icl", *args, "-q"], capsys)


def test_a_saved_causal_lm_is_scored_and_long_prompts_are_overflows(tiny_lm, tmp_path, capsys) -> None:
    args = ["--model", str(tiny_lm), "--task", "synthetic", "--shots", "1,4", "--n", "6", "--set", "synthetic_classes=4",
            "--set", "max_new_tokens=4", "--labels", "semantic"]
    rc, _, err = _icl([*args, "-o", str(tmp_path / "refused")], capsys)  # the 4-shot prompts do not fit
    assert rc != 0 and "--allow-overflow" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "refused").exists()
    rc, _, err = _icl([*args, "--allow-overflow", "-o", str(tmp_path)], capsys)
    assert rc == 0, err
    run_dir = next((tmp_path / "fig4.6-icl").iterdir())
    details = json.loads((run_dir / "results.json").read_text())["details"]
    assert details["max_tokens"] == 1024
    one, four = details["semantic"]["results"]["1"], details["semantic"]["results"]["4"]
    fixed_one = one["strategies"]["newline-fixed"]
    assert fixed_one["n_scored"] == 6 and fixed_one["n_overflow"] == 0  # 4 demonstrations of bytes fit
    assert four["strategies"]["newline-fixed"]["n_overflow"] == 6  # 16 do not: counted, never truncated
    assert four["best"]["accuracy"] is None
    assert all("continuation" in e for e in fixed_one["examples"])
    assert (run_dir / "figures").is_dir()


def test_loglikelihood_is_the_sum_of_the_continuations_log_probabilities(tiny_lm) -> None:
    from owai.evals.causal_lm import open_model

    lm = open_model(str(tiny_lm), device=torch.device("cpu"))
    context, continuation = "service query: hi\nintent category:", " card_arrival"
    logp, greedy = lm.loglikelihood(context, continuation)
    ids = lm.tokenizer.encode(context + continuation)
    n = len(lm.tokenizer.encode(continuation))
    with torch.no_grad():
        logits = lm.model(input_ids=torch.tensor([ids[:-1]])).logits[0].float()
    by_hand = sum(float(torch.log_softmax(logits[i], -1)[ids[i + 1]]) for i in range(len(ids) - 1 - n, len(ids) - 1))
    assert logp == pytest.approx(by_hand, abs=1e-4)
    assert greedy == all(int(logits[i].argmax()) == ids[i + 1] for i in range(len(ids) - 1 - n, len(ids) - 1))


def test_generation_is_greedy_and_cut_at_stop_strings(tiny_lm) -> None:
    from owai.evals.causal_lm import open_model

    lm = open_model(str(tiny_lm), device=torch.device("cpu"))
    full = lm.generate("comment: so good\nemotion category:", max_new_tokens=12)
    assert full == lm.generate("comment: so good\nemotion category:", max_new_tokens=12)  # greedy: no sampling
    assert len(lm.tokenizer.encode(full)) <= 12
    assert len(full) > 2
    stop = full[1:3]
    assert lm.generate("comment: so good\nemotion category:", max_new_tokens=12, stop=(stop,)) == full[: full.index(stop)]
    # the cut itself, on known tokens (the random model's own text repeats one character)
    encode, eot = lm.tokenizer.encode, lm.tokenizer.eot_id
    assert lm.continuation_text(encode("abc\nde|f"), ("|", "\n")) == "abc"  # the earliest, in whatever order listed
    assert lm.continuation_text(encode("abc\nde|f"), ("|",)) == "abc\nde"
    assert lm.continuation_text(encode("abc"), ("|", "")) == "abc"  # absent and empty stop strings cut nothing
    assert lm.continuation_text(encode("ab") + [eot] + encode("c|d"), ("|",)) == "ab"  # end-of-text ends it first


def test_ablating_long_term_memory_needs_a_model_that_has_one(tiny_lm) -> None:
    from owai.evals.causal_lm import open_model

    lm = open_model(str(tiny_lm), device=torch.device("cpu"))
    with pytest.raises(OwaiError, match="has no long_term_memory"):
        with lm.ablate("long_term_memory"):
            pass
    lm.model.config.long_term_memory = True  # a model with the switch (Memory Mosaics v2's config field)
    with lm.ablate("long_term_memory"):
        assert lm.model.config.long_term_memory is False
    assert lm.model.config.long_term_memory is True
    with pytest.raises(OwaiError, match="unknown ablation"):
        with lm.ablate("attention"):
            pass


def test_the_cpu_preset_runs_the_reference_model_on_the_real_banking77(shared_data, tmp_path, capsys) -> None:
    rc, _, err = _icl(["--shots", "1,2", "--n", "40", "-o", str(tmp_path)], capsys)
    assert rc == 0, err
    rows = json.loads(next((tmp_path / "fig4.6-icl").iterdir()).joinpath("results.json").read_text())["rows"]
    m = {r["metric"]: r["measured"] for r in rows if r["measured"] is not None}
    assert m["semantic.1shot.acc"] == m["anonymous.1shot.acc"] > 1 / 77  # the reference never reads the labels
    assert m["semantic.2shot.acc"] == m["anonymous.2shot.acc"]


@pytest.mark.parametrize(("args", "message"), [
    (["-p", "paper", "--task", "synthetic"], "no model given"),
    (["--task", "synthetic", "--model", "reference:oracle"], "the ICL reference models are"),
    (["--task", "synthetic", "--model", "reference:knn", "--labels", "emoji"], "labels ['emoji']"),
    (["--task", "synthetic", "--model", "reference:knn", "--shots", "0"], "shots must be between 1 and 1,024, got 0"),
    (["--task", "banking77", "--model", "reference:knn", "--data", "/nonexistent/icl"], "banking77: no data at"),
    (["--task", "nowhere", "--model", "reference:knn"], "task 'nowhere'"),
])
def test_bad_input_is_one_line_and_writes_nothing(args, message, tmp_path, capsys) -> None:
    rc, _, err = _icl([*args, "-o", str(tmp_path)], capsys)
    assert rc != 0 and message in err and len(err.strip().splitlines()) == 1, err
    assert not any(tmp_path.iterdir())


def test_a_directory_without_a_recorded_tokenizer_asks_for_one(tiny_lm, tmp_path, capsys) -> None:
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(tiny_lm, bare)
    (bare / "owai_tokenizer.json").unlink()
    rc, _, err = _icl(["--model", str(bare), "--task", "synthetic", "--shots", "1", "--n", "2",
                       "-o", str(tmp_path / "runs")], capsys)
    assert rc != 0 and "records no tokenizer" in err


def test_a_data_file_with_missing_fields_is_one_line(tmp_path, capsys) -> None:
    folder = tmp_path / "banking77"
    folder.mkdir()
    (folder / "train.csv").write_text("text,label\nhello,card_arrival\n")  # no `category` column
    (folder / "test.csv").write_text("text,label\nhi,card_arrival\n")
    (folder / "categories.json").write_text('["card_arrival"]')
    rc, _, err = _icl(["--task", "banking77", "--model", "reference:knn", "--data", str(folder), "--shots", "1",
                       "-o", str(tmp_path / "runs")], capsys)
    assert rc != 0 and "train.csv" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "runs").exists()


def test_the_check_before_the_run_finds_the_prompt_with_the_most_tokens() -> None:
    """The longest prompt is the one with the most tokens, not the one whose query has the most
    characters (on goemotion and tacred they differ by 1 to 4 GPT-2 tokens)."""
    from owai.evals.longicl import Example, ICLData, PromptOptions, render_prompt, select_demonstrations, select_queries
    from owai.methods.icl_eval import Config, longest_prompt

    class Words:
        def encode(self, text: str) -> list[str]:
            return text.split()

    long_word, many_words = "x" * 40, "a b c d e f"
    data = ICLData("banking77", [Example("hi", "l1"), Example("yo", "l2")],
                   [Example(long_word, "l1"), Example(many_words, "l2")], ["l1", "l2"])
    cfg = Config(task="banking77", shots=[1], n_queries=2, labels=["semantic", "anonymous"])
    shots = select_demonstrations(data, 1)
    exact = max(len(Words().encode(render_prompt(data, shots, q, PromptOptions(labels=mode))[0]))
                for q in select_queries(data, 2) for mode in cfg.labels)
    assert longest_prompt(cfg, data, Words()) == exact == len(Words().encode(render_prompt(data, shots, data.test[1])[0]))


def test_a_model_with_no_room_beyond_the_generation_is_refused_before_the_run(tiny_lm, tmp_path, capsys) -> None:
    """With --allow-overflow too: the prompt budget (context less max_new_tokens) was 0, an error
    after the run directory existed."""
    rc, _, err = _icl(["--model", str(tiny_lm), "--task", "synthetic", "--shots", "1", "--n", "2", "--allow-overflow",
                       "--set", "max_tokens=16", "--set", "max_new_tokens=16", "-o", str(tmp_path / "runs")], capsys)
    assert rc == 2 and "takes 16 tokens, no more than the max_new_tokens=16" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "runs").exists()


def test_the_shuffled_prompts_and_the_synthetic_task_follow_the_runs_seed() -> None:
    """shuffle_seed was 0 whatever the run's seed: the points of a study over seeds were one run."""
    from owai.methods.icl_eval import Config, load_task, shuffle_seed

    assert (shuffle_seed(Config()), shuffle_seed(Config(seed=7)), shuffle_seed(Config(seed=7, shuffle_seed=3))) == (0, 7, 3)

    def pools(cfg: Config) -> list:
        data = load_task(cfg)
        return [data.train, data.test]

    assert pools(Config(task="synthetic", seed=1)) == pools(Config(task="synthetic", shuffle_seed=1))
    assert pools(Config(task="synthetic", seed=1)) != pools(Config(task="synthetic"))
