"""`owai eval harness` (thesis Tables 4.1-4.3; spec evals.md sec 5.6): OwaiLM's scoring against a direct
computation, the harness path offline on owai's two smoke tasks (a tiny random model near chance, the
answer-aware oracle at 1.0), the race_middle YAML, the recipe's thesis rows and the one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.usefixtures("one_thread")

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "table4.1-harness.yaml"


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from conftest import save_tiny_gpt2

    return save_tiny_gpt2(tmp_path_factory.mktemp("lm"), positions=256)


@pytest.fixture(scope="module")
def manager():
    from owai.evals import harness

    return harness.task_manager()


def test_runs_without_task_folders_share_one_index_of_the_tasks(manager, tmp_path, monkeypatch) -> None:
    """Indexing lm-eval's ~15k tasks takes seconds: every run without task folders reuses the index that
    validation built, and each `load` from it still builds new task objects; a run with folders, whose
    files may change, indexes them anew each time."""
    import lm_eval.tasks

    from owai.evals import harness

    assert harness.task_manager() is manager and harness.task_manager([]) is manager and harness.builtin_tasks() is manager
    first, second = (manager.load(["owai_mc_smoke"])["tasks"]["owai_mc_smoke"] for _ in range(2))
    assert first is not second
    made = []

    class Manager:  # what task_manager builds with folders, recorded instead of indexed
        def __init__(self, include_path: list[str]) -> None:
            made.append(include_path)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", Manager)
    folder = str(tmp_path)
    assert harness.task_manager([folder]) is not harness.task_manager([folder])
    assert made == [[str(harness.TASKS_DIR), folder]] * 2


@pytest.fixture(scope="module")
def owai_lm(tiny_dir):
    from owai.evals import harness
    from owai.evals.causal_lm import open_model

    return harness.OwaiLM(open_model(str(tiny_dir), device=torch.device("cpu"), precision="float32"))


def test_loglikelihood_tokens_is_the_direct_sum_and_greedy_iff_every_token_is_the_argmax(owai_lm) -> None:
    model = owai_lm.lm.model
    ctx, cont = owai_lm.tok_encode("Question: 2 + 2?\nAnswer:"), owai_lm.tok_encode(" 4 and more")
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ctx + cont])).logits[0].float(), -1)
    expected = sum(float(logp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont))
    (ll, greedy), = owai_lm._loglikelihood_tokens([(("a", "b"), ctx, cont)])
    assert ll == pytest.approx(expected, abs=1e-4) and not greedy  # a random model does not predict this text
    argmax = []  # the model's own greedy continuation is greedy; one changed token is not
    for _ in range(4):
        with torch.no_grad():
            argmax.append(int(model(input_ids=torch.tensor([ctx + argmax])).logits[0, -1].argmax()))
    assert owai_lm._loglikelihood_tokens([(None, ctx, argmax)])[0][1] is True
    assert owai_lm._loglikelihood_tokens([(None, ctx, argmax[:-1] + [(argmax[-1] + 1) % 257])])[0][1] is False
    # past the model's 256 positions the context is cut from the left: the score only sees the tail
    long_ctx = owai_lm.tok_encode("x" * 400)
    assert owai_lm._loglikelihood_tokens([(None, long_ctx, cont)])[0][0] == pytest.approx(
        owai_lm._loglikelihood_tokens([(None, long_ctx[-(256 + 1 - len(cont)):], cont)])[0][0], abs=1e-4)


def test_generation_stops_at_until_and_rolling_loglikelihood_covers_every_token(owai_lm) -> None:
    from lm_eval.api.instance import Instance

    forwards = []
    hook = owai_lm.lm.model.register_forward_hook(lambda module, args, out: forwards.append(1))
    try:
        free = owai_lm.greedy("Question: what?\nAnswer:", 12, [])
        assert len(owai_lm.tok_encode(free)) == len(forwards) == 12
        stop = free[1:3]
        forwards.clear()
        cut = owai_lm.greedy("Question: what?\nAnswer:", 12, ["never", stop])
        assert cut == free[: free.index(stop)]
        assert len(forwards) == free.index(stop) + len(owai_lm.tok_encode(stop))  # stopped once the string appeared
    finally:
        hook.remove()
    assert owai_lm.lm.continuation_text(owai_lm.tok_encode("ab:c\nd"), ("\n", ":")) == "ab"  # the earliest stop
    text = "abc " * 150  # 600 bytes: three windows of 256
    rolled = owai_lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])[0]
    tokens = owai_lm.tok_encode(text)
    pieces = [tokens[i:i + 256] for i in range(0, len(tokens), 256)]
    direct = 0.0
    for i, piece in enumerate(pieces):  # disjoint windows: EOT prefix, then the preceding tokens as context
        context = [owai_lm.eot_token_id] + tokens[:i * 256]
        direct += owai_lm._loglikelihood_tokens([(None, context[-(257 - len(piece)):] if i else context, piece)])[0][0]
    assert rolled == pytest.approx(direct, rel=1e-4)


def test_the_tiny_model_runs_the_smoke_tasks_near_chance_and_the_oracle_scores_one(owai_lm, manager) -> None:
    from owai.evals import harness

    tasks = list(harness.SMOKE_TASKS)
    result = harness.evaluate(owai_lm, tasks, manager=manager)
    measured = harness.main_metrics(result, tasks)
    assert set(measured) == {"owai_mc_smoke.acc", "owai_gen_smoke.exact_match"}
    assert result["results"]["owai_mc_smoke"]["sample_len"] == 20
    assert 0.0 <= measured["owai_mc_smoke.acc"] <= 0.6  # 4 choices: chance 0.25
    assert measured["owai_gen_smoke.exact_match"] <= 0.1
    json.dumps(result)
    oracle = harness.evaluate(harness.OracleLM(manager, tasks), tasks, manager=manager, limit=10)
    assert harness.main_metrics(oracle, tasks) == {"owai_mc_smoke.acc": 1.0, "owai_gen_smoke.exact_match": 1.0}
    assert oracle["results"]["owai_gen_smoke"]["sample_len"] == 10


def test_the_thesis_task_list_and_race_middle_task(manager) -> None:
    from owai.evals import harness
    from owai.methods.harness_eval import Config

    assert len(harness.THESIS_TASKS) == 19 and harness.THESIS_TASKS == Config().tasks
    assert harness.PERSISTENT[-1] == "humaneval_plus" and harness.NEW == [
        "squad_completion", "bbh_fewshot", "minerva_math", "mbpp", "race_middle", "race"]
    assert all(t in manager.all_tasks for t in harness.THESIS_TASKS)  # race_middle from owai's folder
    from lm_eval.config.task import TaskConfig
    from lm_eval.tasks._yaml_loader import load_yaml

    entry = manager.task_index["race_middle"]  # owai's YAML, parsed and its functions resolved: no download
    assert entry.yaml_path == harness.TASKS_DIR / "race_middle.yaml"
    config = TaskConfig(**load_yaml(entry.yaml_path))
    assert (config.dataset_path, config.dataset_name, config.test_split) == ("ehovy/race", "middle", "test")
    assert config.output_type == "multiple_choice"
    from datasets import Dataset
    from lm_eval.tasks.race import preprocess_race as harness_race

    rows = [  # ehovy/race's shape: one row per question, an article's rows together
        {"example_id": "middle1.txt", "article": "Tom has a red kite.", "question": "What colour is Tom's kite?",
         "options": ["red", "blue", "green", "white"], "answer": "A"},
        {"example_id": "middle1.txt", "article": "Tom has a red kite.", "question": "Tom's kite is  _  .",
         "options": ["old", "red", "lost", "big"], "answer": "B"},
        {"example_id": "middle2.txt", "article": "Ann can swim.", "question": "Who can swim?",
         "options": ["Tom", "Ann", "Bob", "Sue"], "answer": "B"},
        {"example_id": "middle1.txt", "article": "Tom has a red kite.", "question": "_ is the best title.",
         "options": ["Kites", "Tom's kite", "Red", "Wind"], "answer": "B"}]
    docs = list(config.process_docs(Dataset.from_list(rows)))
    # one document per article text (the harness's collation), its questions in their stored order
    assert [len(d["problems"]) for d in docs] == [3, 1] and docs[0]["problems"][2]["question"] == "_ is the best title."
    for doc in docs:  # the harness's own race functions on the same article in EleutherAI/race's shape
        theirs = {"article": doc["article"], "problems": repr(doc["problems"])}
        assert config.doc_to_text(doc) == harness_race.doc_to_text(theirs)
        assert config.doc_to_choice(doc) == harness_race.doc_to_choice(theirs)
        assert config.doc_to_target(doc) == harness_race.doc_to_target(theirs)
    assert config.doc_to_text(docs[0]) == ("Article: Tom has a red kite.\n\nQuestion: What colour is Tom's kite?\n"
                                           "Answer: red\nTom's kite is red\n_ is the best title.")
    assert config.doc_to_target(docs[0]) == 1 and config.doc_to_text(docs[1]).endswith("\n\nWho can swim?")


def test_recipe_carries_the_thesis_rows_with_the_corrected_mmv2_small_32k_reading() -> None:
    from owai import recipes

    r = recipes.load(str(RECIPE))
    assert r.method == "harness" and {"cpu", "paper"} <= set(r.presets)
    assert recipes.thesis_for(r, "arc_easy.acc", {"row": "mmv2-large"}).value == pytest.approx(0.781)
    assert recipes.thesis_for(r, "minerva_math.exact_match", {"row": "mmv2-small-32k"}).value == pytest.approx(0.011)
    assert recipes.thesis_for(r, "race_middle.acc", {"row": "mmv2-small-32k"}).value == pytest.approx(0.492)
    assert recipes.thesis_for(r, "squad_completion.contains", {"row": "mmv2-large-32k-no-ltm"}).value == pytest.approx(0.694)
    assert recipes.thesis_for(r, "new.avg", {"row": "mmv2-large-32k-no-ltm"}).value == pytest.approx(0.349)


@pytest.mark.parametrize(("changes", "message"), [
    ({"model": ""}, "no model given: pass --model"),
    ({"ablate": ["short_term_memory"]}, "ablate ['short_term_memory']: known ablations are long_term_memory"),
    ({"model": "reference:null"}, "the harness's reference model is reference:oracle"),
    ({"model": "reference:oracle", "ablate": ["long_term_memory"]}, "reference models have nothing to ablate"),
    ({"limit": -1}, "limit must be between 0 and 1,000,000, got -1"),
    ({"num_fewshot": 1025}, "num_fewshot must be between 0 and 1,024, got 1025"),
    ({"tasks": ["arc_easy", "no_such_task"]}, "unknown harness task(s) no_such_task"),
])
def test_validation_errors_are_one_line(changes, message) -> None:
    from owai.errors import OwaiError
    from owai.methods.harness_eval import Config, Harness

    cfg = Config(**{"model": "reference:oracle", **changes})
    with pytest.raises(OwaiError) as err:
        Harness.validate(cfg)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_missing_harness_is_one_line(monkeypatch) -> None:
    import sys

    from owai.errors import OwaiError
    from owai.evals import harness

    monkeypatch.setitem(sys.modules, "lm_eval", None)
    with pytest.raises(OwaiError, match=r"^lm-evaluation-harness is not installed: pip install 'owai\[eval\]'$"):
        harness.require_harness()


@pytest.mark.slow  # a full end-to-end path (tens of seconds); `pytest -m slow`
def test_the_cpu_preset_oracle_and_a_saved_model_through_the_command(tiny_dir, tmp_path, capsys) -> None:
    from conftest import cli_in_process

    rc, _, err = cli_in_process(["eval", "harness", "-q", "-o", str(tmp_path / "a")], capsys)
    assert rc == 0, err
    results = json.loads(next((tmp_path / "a" / "table4.1-harness").iterdir()).joinpath("results.json").read_text())
    rows = {r["metric"]: r for r in results["rows"]}
    assert rows["owai_mc_smoke.acc"]["measured"] == rows["owai_gen_smoke.exact_match"]["measured"] == 1.0
    rc, _, err = cli_in_process(["eval", "harness", "-q", "-o", str(tmp_path / "b"), "--model", str(tiny_dir),
                                 "--limit", "8", "--set", "row=mmv2-large"], capsys)
    assert rc == 0, err
    results = json.loads(next((tmp_path / "b" / "table4.1-harness").iterdir()).joinpath("results.json").read_text())
    assert results["details"]["results"]["owai_mc_smoke"]["sample_len"] == 8
    assert results["details"]["max_length"] == 256 and results["details"]["model"] == str(tiny_dir)


def test_errors_through_the_command_are_one_line_and_write_nothing(tiny_dir, tmp_path, capsys) -> None:
    from conftest import cli_in_process

    for args, message in ((["-p", "paper"], "no model given"),
                          (["--model", str(tiny_dir), "--ablate", "long_term_memory"], "has no long_term_memory to switch off"),
                          (["--ablate", "nope"], "known ablations are long_term_memory")):
        rc, _, err = cli_in_process(["eval", "harness", *args, "-q", "-o", str(tmp_path)], capsys)
        assert rc != 0 and message in err and len(err.strip().splitlines()) == 1, err
        assert not tmp_path.joinpath("table4.1-harness").exists()


@pytest.mark.slow  # a full end-to-end path (tens of seconds); `pytest -m slow`
def test_the_harnesss_own_hflm_runs_through_the_same_command(tiny_dir, tmp_path, capsys) -> None:
    """`--model hflm:DIR`: lm-eval's HFLM on a transformers directory (with its own tokenizer files)."""
    import shutil

    from conftest import cli_in_process
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    hf_dir = tmp_path / "hf"
    shutil.copytree(tiny_dir, hf_dir)
    backend = Tokenizer(models.WordLevel({chr(i): i for i in range(256)} | {"<unk>": 256}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<unk>", unk_token="<unk>").save_pretrained(hf_dir)
    capsys.readouterr()
    rc, _, err = cli_in_process(["eval", "harness", "-q", "-o", str(tmp_path / "runs"), "--model", f"hflm:{hf_dir}",
                                 "--tasks", "owai_mc_smoke", "--limit", "4"], capsys)
    assert rc == 0, err
    run_dir = next((tmp_path / "runs" / "table4.1-harness").iterdir())
    results = json.loads(run_dir.joinpath("results.json").read_text())
    assert results["details"]["results"]["owai_mc_smoke"]["sample_len"] == 4
    assert 0.0 <= {r["metric"]: r["measured"] for r in results["rows"]}["owai_mc_smoke.acc"] <= 1.0
    # its answers are logged too: a resumed run (here of a run killed after its last answer) asks HFLM nothing
    from owai.evals.answers import AnswerLog

    assert len(AnswerLog(run_dir / "answers.jsonl")) >= 8
    from conftest import as_if_killed
    from lm_eval.models.huggingface import HFLM

    as_if_killed(run_dir)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(HFLM, "_loglikelihood_tokens", lambda *a, **k: pytest.fail("a logged request was asked again"))
        rc, _, err = cli_in_process(["eval", "harness", "-q", "--resume", str(run_dir)], capsys)
    assert rc == 0, err
    resumed = json.loads(run_dir.joinpath("results.json").read_text())
    assert resumed["rows"] == results["rows"]


# ------------------------------------------------------------------ agreement with the harness's own HFLM (issue #35)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    from conftest import save_char_llama

    return save_char_llama(tmp_path_factory.mktemp("llama"))


def test_owai_adapter_scores_a_llama_as_the_harnesss_hflm_does(llama_dir) -> None:
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from owai.evals import harness
    from owai.evals.causal_lm import open_model

    theirs = HFLM(pretrained=str(llama_dir), device="cpu", batch_size=1, dtype="float32")
    ours = harness.OwaiLM(open_model(str(llama_dir), str(llama_dir), torch.device("cpu"), "float32"))
    assert ours.max_length == theirs.max_length == 64  # max_position_embeddings
    assert (ours.prefix_token_id, ours.eot_token_id) == (theirs.prefix_token_id, theirs.eot_token_id) == (1, 2)
    for text in ("The cat sat.", "a</s>b <s> c", "<s>starts with BOS"):
        assert ours.tok_encode(text) == theirs.tok_encode(text)
    assert theirs.tok_encode("ab")[0] == 1 and 2 in theirs.tok_encode("a</s>b")  # BOS added, </s> a special token
    pairs = [("The cat", " sat on the mat."), ("", "hello"), ("Question: 2+2?</s>Answer:", " 4"),
             ("x <s> y", " z</s>")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    for (a, greedy_a), (b, greedy_b) in zip(ours.loglikelihood(requests), theirs.loglikelihood(requests)):
        assert a == pytest.approx(b, abs=1e-4) and greedy_a == greedy_b
    rolling = [Instance("loglikelihood_rolling", {}, (text,), 0) for text in ("one two</s>three " * 6,)]
    assert ours.loglikelihood_rolling(rolling)[0] == pytest.approx(theirs.loglikelihood_rolling(rolling)[0], abs=1e-3)


@pytest.fixture(scope="module")
def bigram_dir(tmp_path_factory) -> Path:
    """A GPT-2 (32 positions) that continues each character the same way whatever came before:
    a -> b -> <|im_end|> -> c -> d -> ... -> z -> space -> a (one-hot embeddings, blocks that add
    nothing, one output row per successor). `<|im_end|>` is a special token that is not end-of-text
    (as in Qwen's tokenizers); `<|endoftext|>` ends text. Its greedy text is known in advance."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("bigram")
    chars = [chr(i) for i in range(32, 127)]
    vocab = {c: i for i, c in enumerate(chars)} | {"<|endoftext|>": len(chars), "<|im_end|>": len(chars) + 1}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                            unk_token="<|endoftext|>", additional_special_tokens=["<|im_end|>"]).save_pretrained(path)
    order = ["a", "b", "<|im_end|>", *(chr(c) for c in range(ord("c"), ord("z") + 1)), " "]
    size = len(vocab)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=size, n_positions=32, n_embd=size, n_layer=1, n_head=1,
                                       tie_word_embeddings=False, bos_token_id=vocab["<|endoftext|>"],
                                       eos_token_id=vocab["<|endoftext|>"]))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        model.transformer.wte.weight.copy_(torch.eye(size))
        for norm in (model.transformer.ln_f, model.transformer.h[0].ln_1, model.transformer.h[0].ln_2):
            norm.weight.fill_(1.0)
        for i, token in enumerate(order):
            model.lm_head.weight[vocab[order[(i + 1) % len(order)]], vocab[token]] = 10.0
    model.save_pretrained(path)
    return path


def test_owai_generation_reads_the_task_settings_and_stops_as_the_harnesss_hflm_does(bigram_dir) -> None:
    """generate_until on a model whose greedy text is known: the budget under any of HFLM's names
    (max_new_tokens too), a stop string that is a special token's text, and a budget the model's length
    cannot hold (HFLM refuses it; owai in one line); log-likelihoods and greedy flags as HFLM's at batch 1 and 4."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from owai.errors import OwaiError
    from owai.evals import harness
    from owai.evals.causal_lm import open_model

    ours = harness.OwaiLM(open_model(str(bigram_dir), str(bigram_dir), torch.device("cpu"), "float32"))
    theirs = HFLM(pretrained=str(bigram_dir), device="cpu", batch_size=1, dtype="float32")
    gens = [("a", {"until": ["<|im_end|>"], "max_gen_toks": 10}),  # stops at the special token, which is not shown
            ("c", {"until": [], "max_new_tokens": 5}),  # HFLM's alias of max_gen_toks
            ("c", {"until": "f", "max_gen_toks": 10}),  # a single stop string
            ("x", {"until": ["zz"], "max_tokens": 6})]
    requests = [Instance("generate_until", {}, g, i) for i, g in enumerate(gens)]
    assert ours.generate_until(requests) == theirs.generate_until(requests) == ["b", "defgh", "de", "yz ab"]
    too_long = [Instance("generate_until", {}, ("a", {"until": [], "max_gen_toks": 32}), 0)]
    with pytest.raises(AssertionError):
        theirs.generate_until(too_long)
    with pytest.raises(OwaiError, match="32 generated tokens but the model takes 32 tokens"):
        ours.generate_until(too_long)
    pairs = [("a", "b<|im_end|>c"), ("a", "bc"), ("", "a"), ("x", "yz ab"), ("q" * 40, " ab")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    batched = HFLM(pretrained=str(bigram_dir), device="cpu", batch_size=4, dtype="float32")
    ours_ll, theirs_ll, batched_ll = (lm.loglikelihood(requests) for lm in (ours, theirs, batched))
    assert [greedy for _, greedy in ours_ll] == [True, False, False, True, False]
    for (a, greedy_a), (b, greedy_b), (c, greedy_c) in zip(ours_ll, theirs_ll, batched_ll):
        assert a == pytest.approx(b, abs=1e-4) and c == pytest.approx(b, abs=1e-4) and greedy_a == greedy_b == greedy_c


def test_suite_generation_encodes_and_decodes_as_the_official_code(llama_dir) -> None:
    """RULER and LongICLBench generate from `tokenizer(prompt)` (a Llama tokenizer's BOS first) and read
    the answer with `decode(..., skip_special_tokens=True)`; the harness's HFLM decodes the same way."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from owai.evals import harness
    from owai.evals.causal_lm import open_model

    lm = open_model(str(llama_dir), str(llama_dir), torch.device("cpu"), "float32")
    theirs = AutoTokenizer.from_pretrained(llama_dir)
    for prompt in ("The cat sat.", "a</s>b", "<s>x"):
        assert lm.prompt_ids(prompt) == theirs(prompt)["input_ids"]
    assert lm.prompt_ids("ab")[0] == 1 and lm.count_tokens("ab") == 2  # the BOS is sent, not counted
    model = AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    for prompt in ("The cat", "Once upon"):
        ids = theirs(prompt, return_tensors="pt")
        out = model.generate(**ids, max_new_tokens=12, do_sample=False, eos_token_id=2, pad_token_id=2)
        assert lm.generate(prompt, max_new_tokens=12) == theirs.decode(out[0, ids.input_ids.shape[1]:], skip_special_tokens=True)
    special = [ord("a") - 29, 1, ord("b") - 29, 0]  # a <s> b <unk>
    skipped = theirs.decode(special, skip_special_tokens=True)
    assert lm.continuation_text(special, ()) == skipped == harness.OwaiLM(lm).tok_decode(special) and "<" not in skipped
    assert lm.tokenizer.decode(special) == theirs.decode(special)  # plain decode keeps them, as before


def test_a_saved_models_tokenizer_without_endoftext_reloads_with_its_eot_and_bos(llama_dir, tmp_path) -> None:
    """A Llama-3-style tokenizer (end of text `</s>`, not `<|endoftext|>`) saved beside a model reloads
    from the run directory with the same end-of-text and BOS ids."""
    from owai.data.text import load_tokenizer, save_tokenizer, tokenizer_for

    tok = load_tokenizer(str(llama_dir))
    assert (tok.eot_id, tok.bos_id) == (2, 1)
    save_tokenizer(tok, tmp_path)
    again = load_tokenizer(tokenizer_for(tmp_path, ""))
    assert (again.eot_id, again.bos_id) == (2, 1) and again.encode("The cat") == tok.encode("The cat")


def test_a_folder_saved_by_transformers_is_read_with_its_own_tokenizer(llama_dir, tmp_path) -> None:
    """No owai_tokenizer.json, but transformers' tokenizer files: the folder's tokenizer, not the default."""
    from owai.data.text import tokenizer_for

    assert tokenizer_for(llama_dir, "bpe-4096") == str(llama_dir)
    (tmp_path / "tokenizer.json").write_text((llama_dir / "tokenizer.json").read_text())
    assert tokenizer_for(tmp_path, "bpe-4096") == "bpe-4096"  # owai's own file without its spec: unknown


@pytest.mark.slow  # a full end-to-end path (tens of seconds); `pytest -m slow`
def test_importing_owais_adapter_leaves_the_harnesss_own_models_usable(llama_dir) -> None:
    """In one fresh process: import owai's adapter, then run lm-eval's own `hf` model by name."""
    import os
    import subprocess
    import sys

    code = (
        "import owai.evals.harness as h\n"
        "from lm_eval import simple_evaluate\n"
        f"r = simple_evaluate(model='hf', model_args='pretrained={llama_dir},dtype=float32', tasks=['owai_mc_smoke'],"
        " limit=2, task_manager=h.task_manager(), device='cpu', batch_size=1, bootstrap_iters=0)\n"
        "print('sample_len', r['results']['owai_mc_smoke']['sample_len'])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1",
           "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "sample_len 2" in done.stdout


def test_hflm_models_and_tokenizers_are_checked_before_a_run(llama_dir, tmp_path, capsys) -> None:
    from conftest import cli_in_process

    for args, message in ((["--model", f"hflm:{tmp_path / 'nowhere'}"], "no such model directory"),
                          (["--model", "hflm:no-one/no-model"], "not in the local Hugging Face cache"),
                          (["--model", f"hflm:{tmp_path}"], "no config.json there"),
                          (["--model", f"hflm:{llama_dir}", "--tokenizer", str(tmp_path / "no.json")],
                           "no such file or directory"),
                          (["--model", str(llama_dir), "--tokenizer", str(tmp_path / "no.json")],
                           "no such file or directory")):
        rc, _, err = cli_in_process(["eval", "harness", *args, "--tasks", "owai_mc_smoke", "-q", "-o",
                                     str(tmp_path / "runs")], capsys)
        assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("config", [
    {"model_type": "gpt2", "n_positions": 1024, "n_ctx": 512},
    {"model_type": "llama", "max_position_embeddings": 4096},
    {"model_type": "gptj", "n_ctx": 2048},
    {"model_type": "gemma3", "max_position_embeddings": 1200, "text_config": {"max_position_embeddings": 32768}},
])
def test_foreign_max_length_is_read_from_the_config_as_the_harness_reads_it(config) -> None:
    from types import SimpleNamespace

    from lm_eval.models.utils import resolve_max_length

    from owai.evals.causal_lm import config_max_length

    text = config.get("text_config")
    theirs = SimpleNamespace(**{**config, "text_config": SimpleNamespace(**text) if text else None})
    assert config_max_length(config) == resolve_max_length(theirs, None)


def test_owai_models_keep_their_own_length_limits() -> None:
    from owai.evals.causal_lm import config_max_length

    assert config_max_length({"model_type": "owai_gpt", "position": "learned", "block_size": 16}) == 16
    assert config_max_length({"model_type": "owai_gpt", "position": "rope", "block_size": 16}) is None
    assert config_max_length({"model_type": "owai_memory_mosaics_v2", "max_position_embeddings": 8}) is None
    assert config_max_length({"model_type": "mamba"}) is None  # none named: OwaiLM then uses HFLM's 2048
