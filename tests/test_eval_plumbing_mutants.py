"""Chapter 4's evaluation plumbing around the models, pinned where a mutation audit found no test that
would fail: the answer cut (first stop string, end-of-text), the maximum length read from a config as
lm-evaluation-harness reads it (key order, its 2048 default), the `ablate` switch and the generation
budget reaching the model through `owai eval ruler` / `owai eval harness`, those runs' recorded
details, the length checks of `eval ruler` (a length equal to the model's is no overflow; `max_tokens`
overrides the model's limit), RULER's token counting without special tokens, and `max_gen_toks >= 1`.

Every expected value comes from a docstring, the official code (lm-evaluation-harness's
`resolve_max_length`, RULER's `HFTokenizer.text_to_tokens`, a Hugging Face tokenizer's `tokenize`) or
a saved model's config.json, never from owai's own output. The suite functions that would take
minutes (`ruler.evaluate`, `harness.evaluate`) are replaced by recorders: what is pinned is what the
method hands them."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import cli_in_process, save_char_llama, save_tiny_gpt2

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ltm_gpt2(tmp_path_factory) -> Path:
    """A saved tiny GPT-2 (1024 positions, owai's byte tokenizer) whose config.json also carries
    `long_term_memory: true`, the config field `ablate("long_term_memory")` switches off (Memory
    Mosaics v2's): the field is what the runs must turn off, whatever the architecture."""
    path = save_tiny_gpt2(tmp_path_factory.mktemp("ltm") / "lm", positions=1024, n_embd=16, n_layer=1)
    config = json.loads((path / "config.json").read_text())
    config["long_term_memory"] = True
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def byte_lm():
    from owai.data.text import ByteTokenizer
    from owai.evals.causal_lm import CausalLM
    from owai.models.lm import build_lm

    torch.manual_seed(0)
    model = build_lm("gpt", vocab_size=257, n_layer=1, n_embd=16, n_head=2, block_size=64, position="learned")
    return CausalLM(model, ByteTokenizer(), "gpt", torch.device("cpu"), "float32")


def test_the_answer_is_cut_before_the_first_occurrence_of_a_stop_string(byte_lm) -> None:
    """RULER's and LongICLBench's generation runs its whole budget, then the answer is cut before the
    first stop string (`continuation_text`'s docstring: "the earliest stop string"): a stop string that
    occurs twice cuts at its first occurrence, not its last."""
    tokens = byte_lm.tokenizer.encode("Paris\nLyon\nNice")
    assert byte_lm.continuation_text(tokens, ("\n",)) == "Paris"
    assert byte_lm.continuation_text(byte_lm.tokenizer.encode("a, b, c"), (", ", "\n")) == "a"


def test_the_answer_ends_at_the_end_of_text_token(byte_lm) -> None:
    """`continuation_text` cuts at the end-of-text token (its docstring): what follows it is not part
    of the answer, even where decoding without special tokens would only drop the token itself."""
    tok = byte_lm.tokenizer
    new = tok.encode("ab") + [tok.eot_id] + tok.encode("cd")
    assert byte_lm.continuation_text(new, ()) == "ab"


def test_n_positions_wins_over_max_position_embeddings_as_in_the_harness() -> None:
    """HFLM reads a model's length from n_positions, then max_position_embeddings, then n_ctx (the
    first one set, lm_eval.models.utils.resolve_max_length): a config that sets all three differently
    gives n_positions."""
    from lm_eval.models.utils import resolve_max_length

    from owai.evals.causal_lm import config_max_length

    config = {"model_type": "custom", "n_positions": 1024, "max_position_embeddings": 4096, "n_ctx": 512}
    assert config_max_length(config) == resolve_max_length(SimpleNamespace(**config), None) == 1024


def test_a_foreign_model_without_a_length_gets_the_harnesss_default() -> None:
    """A model whose config names no length: HFLM falls back to lm-eval's default (2048), and so must
    OwaiLM for a foreign architecture (harness module docstring); owai's own models keep no limit."""
    pytest.importorskip("lm_eval")
    from lm_eval.models.utils import resolve_max_length

    from owai.data.text import ByteTokenizer
    from owai.evals import harness

    def stub(model_type: str) -> SimpleNamespace:
        return SimpleNamespace(max_tokens=None, model=SimpleNamespace(config=SimpleNamespace(model_type=model_type)),
                               tokenizer=ByteTokenizer(), label=model_type, device=torch.device("cpu"))

    expected = resolve_max_length(SimpleNamespace(model_type="mamba"), None)
    assert expected == 2048
    assert harness.OwaiLM(stub("mamba")).max_length == expected
    assert harness.OwaiLM(stub("owai_memory_mosaics_v2")).max_length is None


def test_a_foreign_model_without_a_length_reads_its_tokenizers_model_max_length(tmp_path) -> None:
    """HFLM's order for a config that names no length (lm_eval's `resolve_max_length`): the tokenizer's
    `model_max_length` when transformers' tokenizer config sets one (transformers marks an unset one
    with int(1e30)), only then 2048. OwaiLM went straight to 2048 (found by the plumbing audit)."""
    pytest.importorskip("lm_eval")
    from lm_eval.models.utils import resolve_max_length
    from tokenizers import Tokenizer, models
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from owai.data.text import load_tokenizer
    from owai.evals import harness

    backend = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "a": 2}, unk_token="<unk>"))
    for length, folder in ((77, tmp_path / "set"), (None, tmp_path / "unset")):
        PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>",
                                **({"model_max_length": length} if length else {})).save_pretrained(folder)
        expected = resolve_max_length(SimpleNamespace(model_type="mamba"), AutoTokenizer.from_pretrained(folder))
        tok = load_tokenizer(str(folder))
        assert tok.model_max_length == length
        lm = SimpleNamespace(max_tokens=None, model=SimpleNamespace(config=SimpleNamespace(model_type="mamba")),
                             tokenizer=tok, label="mamba", device=torch.device("cpu"))
        assert harness.OwaiLM(lm).max_length == expected == (length or 2048)


def test_eval_ruler_runs_the_suite_with_the_long_term_memory_off_and_names_its_cells(ltm_gpt2, tmp_path, capsys,
                                                                                       monkeypatch) -> None:
    """Table C.1 is `owai eval ruler --ablate long_term_memory`: the model's switch is off while the
    suite runs (CausalLM.ablate) and the suite gets the model's length (its 1024 positions, config.json);
    each cell is `{task}.{ctx}.score` and the details record the ablation (ruler_eval's docstring)."""
    from owai.evals import ruler

    seen = {}

    def recorder(model, tasks, ctx, n, seed, tokenizer, max_tokens, answers=None):
        seen.update(ltm=model.model.config.long_term_memory, max_tokens=max_tokens, ctx=list(ctx))
        return {"results": {"niah_single_1": {"1024": {"score": 50.0, "n": 1, "overflow": 0}}}, "qa_mean": {}}

    monkeypatch.setattr(ruler, "evaluate", recorder)
    rc, _, err = cli_in_process(["eval", "ruler", "-q", "--model", str(ltm_gpt2), "--tasks", "niah_single_1", "--ctx", "1024",
                                 "--n", "1", "--set", "tokenizer=", "--ablate", "long_term_memory",
                                 "-o", str(tmp_path)], capsys)
    assert rc == 0, err
    assert seen == {"ltm": False, "max_tokens": 1024, "ctx": ["1024"]}
    results = json.loads(next((tmp_path / "table4.4-ruler").iterdir()).joinpath("results.json").read_text())
    assert {r["metric"]: r["measured"] for r in results["rows"]}["niah_single_1.1024.score"] == 50.0
    assert results["details"]["ablate"] == ["long_term_memory"] and results["details"]["max_tokens"] == 1024


def test_eval_harness_hands_the_adapter_its_budget_with_the_long_term_memory_off(ltm_gpt2, tmp_path, capsys,
                                                                                   monkeypatch) -> None:
    """Tables 4.2 / 4.3's "without long-term memory" rows: `owai eval harness --ablate long_term_memory`
    runs the harness with the switch off; `max_gen_toks` is owai's adapter's budget (harness_eval's
    Config); the details record the model, the ablation and its length (1024 positions, config.json)."""
    from owai.evals import harness

    seen = {}

    def recorder(model, tasks, num_fewshot=None, limit=0, **kwargs):
        seen.update(ltm=model.lm.model.config.long_term_memory, budget=model.max_gen_toks)
        return {"results": {"owai_mc_smoke": {"acc,none": 0.5}}}

    monkeypatch.setattr(harness, "evaluate", recorder)
    monkeypatch.setattr(harness, "task_manager", lambda include_path=None: None)  # evaluate reads no task
    rc, _, err = cli_in_process(["eval", "harness", "-q", "--model", str(ltm_gpt2), "--tasks", "owai_mc_smoke",
                                 "--ablate", "long_term_memory", "--set", "max_gen_toks=7", "-o", str(tmp_path)], capsys)
    assert rc == 0, err
    assert seen == {"ltm": False, "budget": 7}
    results = json.loads(next((tmp_path / "table4.1-harness").iterdir()).joinpath("results.json").read_text())
    assert {r["metric"]: r["measured"] for r in results["rows"]}["owai_mc_smoke.acc"] == 0.5
    details = results["details"]
    assert (details["model"], details["ablate"], details["max_length"]) == (str(ltm_gpt2), ["long_term_memory"], 1024)


def test_a_length_equal_to_the_models_is_no_overflow_and_max_tokens_overrides_the_models(ltm_gpt2) -> None:
    """ruler_eval's Config: "a length longer than the model takes is an error before the run unless
    allow_overflow"; `max_tokens` is "the model's maximum length for overflow (0 = the model's own
    limit)". A 1024-position model takes a 1024-token prompt; with max_tokens 768 it does not."""
    from owai.errors import OwaiError
    from owai.methods.ruler_eval import Config, Ruler

    base = dict(model=str(ltm_gpt2), tokenizer="", tasks=["niah_single_1"], n=1)
    Ruler.validate(Config(**base, ctx=["1024"]))  # equal to the model's length: no refusal
    with pytest.raises(OwaiError, match="longer than the 768 tokens"):
        Ruler.validate(Config(**base, ctx=["1024"], max_tokens=768))


def test_ruler_counts_a_models_tokens_without_its_special_tokens(tmp_path) -> None:
    """RULER fits prompts with `HFTokenizer.text_to_tokens`, a Hugging Face tokenizer's `tokenize`:
    no BOS counted. A Llama-style tokenizer that adds `<s>` (conftest's char Llama) counts "ab" as 2."""
    from transformers import AutoTokenizer

    from owai.data.text import load_tokenizer
    from owai.methods.ruler_eval import _OwaiTokenizer

    path = save_char_llama(tmp_path / "llama")
    theirs = AutoTokenizer.from_pretrained(path)
    counter = _OwaiTokenizer(load_tokenizer(str(path)))
    for text in ("ab", "The cat sat."):
        assert counter.count(text) == len(theirs.tokenize(text))
    assert theirs("ab")["input_ids"][0] == 1  # the tokenizer does add a BOS when encoding (a test that could fail)


def test_a_generation_budget_of_zero_is_refused() -> None:
    """harness_eval.validate: max_gen_toks must be >= 1 (a budget of 0 generates nothing to score)."""
    pytest.importorskip("lm_eval")
    from owai.errors import OwaiError
    from owai.methods.harness_eval import Config, Harness

    with pytest.raises(OwaiError, match="max_gen_toks must be >= 1, got 0"):
        Harness.validate(Config(model="reference:oracle", max_gen_toks=0))


def test_one_context_length_given_twice_is_refused() -> None:
    """ruler_eval.validate: each context length once; "32k and 32K, or 4k and 4096, are one length"
    (RULER's 4k is 4096 tokens): a run would otherwise score one length twice under two names."""
    from owai.errors import OwaiError
    from owai.methods.ruler_eval import Config, Ruler

    for ctx in (["4k", "4096"], ["32k", "32K"]):
        with pytest.raises(OwaiError, match="give each context length once"):
            Ruler.validate(Config(model="reference:oracle", tasks=["vt"], ctx=ctx))


def test_an_eft_checkpoint_with_its_own_u_rate_is_refused() -> None:
    """The Library's eft leaky average has two rates, leaky_beta_w_under and leaky_beta_u_under, equal
    unless trained with sep_w_on_t=True, which owai does not implement: `convert_official_state_dict`
    ("a Library setting owai does not implement -> OwaiError") must refuse a checkpoint whose u rate
    differs, not convert it with the w rate alone."""
    from naive_memory_mosaics import random_official_state_dict

    from owai.errors import OwaiError
    from owai.models.memory_mosaics_convert import convert_official_state_dict

    sd = random_official_state_dict("library", variant="eft")
    convert_official_state_dict(sd)  # equal rates: converted
    name = "blocks.1.pmem.leaky_average.leaky_beta_u_under"
    sd = {**sd, name: sd[name] + 0.1}
    with pytest.raises(OwaiError, match="sep_w_on_t=True is not supported"):
        convert_official_state_dict(sd)


def test_the_harnesss_own_hflm_runs_in_the_precision_owais_path_runs_in(ltm_gpt2, tmp_path, capsys, monkeypatch) -> None:
    """`--model hflm:DIR` builds the harness's HFLM "in the precision owai's own path runs in", so the two
    paths compare like with like (harness_eval.run): `--set precision=bfloat16` reaches HFLM's dtype,
    with batch size 1 (the harness itself is replaced by recorders)."""
    pytest.importorskip("accelerate")
    import lm_eval.models.huggingface

    from owai.evals import harness

    seen = {}

    class Recorder:
        max_length = 1024

        def __init__(self, **kwargs) -> None:
            seen.update(kwargs)

    monkeypatch.setattr(lm_eval.models.huggingface, "HFLM", Recorder)
    monkeypatch.setattr(harness, "log_answers", lambda lm, answers: lm)
    monkeypatch.setattr(harness, "task_manager", lambda include_path=None: None)
    monkeypatch.setattr(harness, "evaluate", lambda *a, **k: {"results": {"owai_mc_smoke": {"acc,none": 1.0}}})
    rc, _, err = cli_in_process(["eval", "harness", "-q", "--model", f"hflm:{ltm_gpt2}", "--tasks", "owai_mc_smoke",
                                 "--set", "precision=bfloat16", "-o", str(tmp_path)], capsys)
    assert rc == 0, err
    assert (seen["pretrained"], seen["batch_size"], seen["dtype"]) == (str(ltm_gpt2), 1, "bfloat16")


def test_the_slot_reference_counts_its_slots_from_one() -> None:
    """RULER's reference readers are reference:oracle, reference:null and reference:slot:K with K >= 1
    (ruler_eval.validate's message): slot 0 names no slot and is refused before the run."""
    from owai.errors import OwaiError
    from owai.methods.ruler_eval import Config, Ruler

    with pytest.raises(OwaiError, match="reference:slot:K"):
        Ruler.validate(Config(model="reference:slot:0", tasks=["vt"], ctx=["1024"]))
