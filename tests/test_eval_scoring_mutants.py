"""Scoring and prompt rules of the public benchmarks that a mutation audit found unpinned.

Each test pins one rule whose change would publish a different number beside the published ones:
RULER's post-processing, rounding, nulls, budget and haystack rules (NVIDIA/RULER; spec evals.md
sec 1), LongICLBench's answer cut and overflow rule (TIGER-AI-Lab/LongICLBench; sec 2), RegBench's
tie rule and in-context n-gram (berlino/seq_icl; sec 3), the recall suite's exact match, the answer
log's keys, and the harness adapter's prompt truncation, filters and averages (lm-evaluation-harness;
sec 5). Expected values come from the spec, from the official code's rule as quoted in each
docstring, or from the official code run beside owai's (the harness's HFLM). Fast, offline, no data.
"""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch

from owai.evals import longicl as L
from owai.evals import ruler as R


class WordTokenizer:
    """A tokenizer whose tokens are whitespace-separated words (RULER's builders need only `count`)."""

    name = "words"

    def count(self, text: str) -> int:
        return len(text.split())

    def encode(self, text: str) -> list[int]:
        return list(range(self.count(text)))

    def decode(self, ids) -> str:
        return ""


# ------------------------------------------------------------------------------------------- RULER


def test_ruler_postprocess_strips_again_after_replacing_control_characters() -> None:
    """RULER's `postprocess_pred` (evaluate.py; spec 1.7): strip, every character of [\\x00-\\x1f]
    -> newline, strip again. A control character that str.strip keeps (\\x00) becomes a newline at
    the edge, which the second strip removes; \\x1f is in the range too."""
    assert R.postprocess("Paris\x00") == "Paris"
    assert R.postprocess("\x00\x01Paris") == "Paris"
    assert R.postprocess("a\x1fb") == "a\nb"
    assert R.postprocess("a\x1eb\x00") == "a\nb"


def test_ruler_task_scores_are_rounded_to_two_decimals() -> None:
    """Spec 1.7: a task score is 100 x the mean over samples, rounded to 2 decimals (RULER's
    `round(score, 2)`), for string_match_part and string_match_all alike."""
    predictions = ["paris", "no", "no"]
    references = [["Paris"], ["Rome"], ["Oslo"]]
    assert R.string_match_part(predictions, references) == 33.33
    assert R.string_match_all(predictions, references) == 33.33
    assert R.string_match_all(["a b"], [["a", "c", "d"]]) == 33.33
    # RULER's order, the mean and then x 100: 23 right of 160 is 14.37 there (100 x 23 / 160 rounds to 14.38)
    right, wrong = ["paris"] * 23, ["no"] * 137
    assert R.string_match_part(right + wrong, [["Paris"]] * 160) == R.string_match_all(right + wrong, [["Paris"]] * 160) == 14.37
    assert R.task_score([1.0] * 49 + [0.0] * 111) == 30.63


class _Partial:
    """OracleReader's answer for the questions in `known`, nothing for the others."""

    name = "partial-oracle"

    def __init__(self, known: set[str], *data: R.QAData) -> None:
        self.known, self.oracle = known, R.OracleReader(*data)

    def generate(self, prompt: str, max_new_tokens: int = 32) -> str:
        return self.oracle.generate(prompt) if R.qa_question(prompt) in self.known else ""


def test_ruler_qa_mean_is_the_mean_of_the_two_task_scores() -> None:
    """Spec 1.1: the thesis's RULER number is the unweighted mean of qa_1 and qa_2 at a length; the
    scores it averages are given to 2 decimals, so the mean may differ from it by rounding alone."""
    squad, hotpot = R.synthetic_squad(), R.synthetic_hotpotqa()
    known = {squad.records[0].query}  # qa_1: 1 of 3 answered (33.33), qa_2: none (0.0)
    tasks = [R.qa_task("qa_1", squad), R.qa_task("qa_2", hotpot)]
    out = R.evaluate(_Partial(known, squad, hotpot), tasks, ["2000"], n=3, tokenizer=WordTokenizer())
    q1, q2 = out["results"]["qa_1"]["2000"]["score"], out["results"]["qa_2"]["2000"]["score"]
    assert (q1, q2) == (33.33, 0.0)
    assert abs(out["qa_mean"]["2000"] - (q1 + q2) / 2) <= 0.005 + 1e-9


class _Blank:
    name = "blank"

    def generate(self, prompt: str, max_new_tokens: int = 32) -> str:
        return " \n\t\x00 "


def test_ruler_nulls_and_predictions_are_counted_after_postprocessing() -> None:
    """RULER's evaluate.py post-processes every prediction before it scores it and counts nulls
    (`len(pred) == 0`) on the post-processed predictions (spec 1.7): whitespace and control
    characters alone are a null, and the record holds the post-processed prediction."""
    squad = R.synthetic_squad()
    out = R.evaluate(_Blank(), [R.qa_task("qa_1", squad)], ["2000"], n=3, tokenizer=WordTokenizer())
    cell = out["results"]["qa_1"]["2000"]
    assert cell["nulls"] == 3 and cell["score"] == 0.0
    assert [r["prediction"] for r in out["records"]["qa_1"]["2000"]] == ["", "", ""]


class DocumentTokenizer:
    """Ten tokens per `Document k:` header and nothing else: a QA prompt's count is 10 x its haystack
    size whatever the draws, so a budget can be hit exactly."""

    name = "documents"

    def count(self, text: str) -> int:
        return 10 * len(re.findall(r"Document \d+:\n", text))


def test_ruler_2024_budget_rule_at_an_exact_hit() -> None:
    """Spec 1.6 (RULER 7061a05's qa.py): a prompt fits when count + tokens_to_generate <=
    max_seq_length. The size search steps 10, 20, ... while total + 32 < budget and steps back when
    total + 32 > budget: at an exact hit (20 documents: 200 + 32 = 232) it leaves the loop one step
    too large (30), and the per-sample retry steps down to 20, which fits exactly (<=, not <)."""
    task = R.qa_task("qa_1", R.synthetic_squad())
    built = task.build(3, 232, DocumentTokenizer())
    assert built.size == 30
    assert [(s.size, s.tokens, s.fits) for s in built.samples] == [(20, 200, True)] * 3
    below = task.build(3, 231, DocumentTokenizer())  # 200 + 32 > 231: the search steps back to 10
    assert below.size == 10 and [s.size for s in below.samples] == [10] * 3


class _Recording(WordTokenizer):
    """WordTokenizer, keeping every text it counts."""

    name = "recording"

    def __init__(self) -> None:
        self.texts: list[str] = []

    def count(self, text: str) -> int:
        self.texts.append(text)
        return super().count(text)


def test_ruler_2024_size_search_counts_the_prompt_a_space_and_the_answer_list() -> None:
    """RULER 7061a05's qa.py sizes the haystack on `input_text + f' {answer}'` (answer: the list of
    gold strings; spec 1.6's "quirk"); the samples themselves are counted without it."""
    squad = R.synthetic_squad()
    tokenizer = _Recording()
    built = R.qa_task("qa_1", squad).build(1, 1000, tokenizer)
    tail = " Answer: " + str(list(squad.records[0].outputs))
    probes = [t for t in tokenizer.texts if not t.endswith(R.QA_ANSWER_PREFIX)]
    assert probes and all(t.endswith(tail) for t in probes)
    assert built.samples[0].prompt in tokenizer.texts


def test_ruler_haystack_samples_same_article_paragraphs_when_exactly_enough() -> None:
    """Spec 1.4.2: with num_docs - len(context) > len(more_context) all same-article paragraphs are
    taken and the rest drawn from the other documents; otherwise (equality included)
    `random.sample(more_context, num_docs - len(context))`; then a fresh Random(seed) shuffles."""
    squad = R.synthetic_squad()  # 5 paragraphs an article: 1 own + 4 same-article
    task = R.qa_task("qa_1", squad)
    record = squad.records[0]
    assert len(record.more_context) == 4
    expected = list(record.context) + random.Random(7).sample(list(record.more_context), 4)
    random.Random(42).shuffle(expected)
    assert task.documents(random.Random(7), 42, 0, 5) == expected


# ----------------------------------------------------------------------------------- LongICLBench


def test_longicl_banking77_answer_is_cut_at_service_query_without_its_colon() -> None:
    """banking77_infer.py (9c5da3d): when the query text is not in the response, the response is
    `response.split("service query")[0].strip()`: the field name alone cuts, colon or not."""
    assert L.parse_prediction("card_arrival service query", "banking77", "How do I locate my card?") == "card_arrival"
    assert L.parse_prediction(" pin_blocked service queryx", "banking77") == "pin_blocked"


class _Counting:
    """Answers " x" to every prompt; a prompt's tokens are its characters."""

    def generate(self, prompt: str) -> str:
        return " x"

    def count_tokens(self, prompt: str) -> int:
        return len(prompt)


def test_longicl_a_prompt_of_exactly_max_tokens_is_not_an_overflow() -> None:
    """Spec 2.8: the suite checks count_tokens(prompt) <= the model's maximum length and reports
    the prompts over it as overflows; a prompt of exactly that many tokens is scored."""
    data = L.synthetic_task(4)
    options = L.PromptOptions()
    shots = L.select_demonstrations(data, 1)
    query = L.select_queries(data)[:1]
    size = len(L.render_context(data, shots, options) + L.render_query(data, query[0], options))
    at = L.score_prompts(_Counting(), data, shots, query, options, max_tokens=size)
    over = L.score_prompts(_Counting(), data, shots, query, options, max_tokens=size - 1)
    assert (at["n_scored"], at["n_overflow"]) == (1, 0)
    assert (over["n_scored"], over["n_overflow"]) == (0, 1)


def test_longicl_each_shot_is_shuffled_by_its_own_generator() -> None:
    """PromptOptions' rule (spec 2.3's within-shot shuffle, owai's seeding): shot r is permuted by an
    RNG seeded with (shuffle_seed, r), so shots holding the same classes get different orders while
    the n-shot shuffled prompt stays a prefix of the (n+1)-shot one."""
    data = L.synthetic_task(8)
    shots = L.select_demonstrations(data, 3)
    shuffled = L.shuffle_shots(shots, 0)
    orders = [[ex.label for ex in shot] for shot in shuffled]
    assert all(sorted(o) == sorted(orders[0]) for o in orders)
    assert len({tuple(o) for o in orders}) == 3
    for r, shot in enumerate(shots):
        expected = list(shot)
        random.Random(f"longicl-shuffle:0:{r}").shuffle(expected)
        assert shuffled[r] == expected
    options = L.PromptOptions(shuffle=True)
    assert L.render_context(data, shots, options).startswith(L.render_context(data, shots[:2], options))


# --------------------------------------------------------------------------------------- RegBench


def test_regbench_accuracy_breaks_ties_at_the_first_index() -> None:
    """Spec 3.2 / 3.7: the predicted symbol is the argmax with the first index on ties (torch's and
    numpy's argmax, as seq_icl's `dfa_accuracy`). Half the mass on the smallest legal symbol and half
    on the separator (the last id, never legal) is then always right."""
    from owai.data.regbench import make_regbench
    from owai.evals.regbench import exact_distributions, regbench_metrics

    data = make_regbench(num_examples=30, num_test_examples=20, seed=1)
    x, _, pfas = data.test.batch()
    true = exact_distributions(x, pfas)
    probs = np.zeros_like(true)
    legal = true > 0
    first = legal.argmax(-1)
    rows, cols = np.nonzero(x != 0)
    probs[rows, cols, first[rows, cols]] = 0.5
    probs[rows, cols, data.config.sep_id] = 0.5
    assert not legal[..., data.config.sep_id].any()
    assert regbench_metrics(probs, x, pfas)["accuracy"] == 1.0


def test_regbench_ngram_backoff_matches_seq_icl_by_hand() -> None:
    """seq_icl's `predict_with_n_gram_back_off` (ngram.py, N=3, backoff, addone=False) worked by
    hand. Input "aab" (a=1, b=2): at the last position the prefix "ab" and the suffix "b" were never
    followed, so both symbols back off to the unigram counts of "__aab" (_:2, a:2, b:1): p(a) =
    2/3, p(b) = 1/3. Input "ab|a": p(b | "_a") = count("_ab") / count("_a") = 1/2 and the leftover
    1/2 goes to a."""
    from owai.evals.regbench import ngram_backoff_probs

    probs = ngram_backoff_probs(np.array([[1, 1, 2]]), 20, 19)
    np.testing.assert_allclose(probs[0, 2, :3], [0.0, 2 / 3, 1 / 3], atol=1e-12)
    np.testing.assert_allclose(probs[0, :2, 1], [1.0, 1.0], atol=1e-12)
    probs = ngram_backoff_probs(np.array([[1, 2, 19, 1]]), 20, 19)
    np.testing.assert_allclose(probs[0, 3, :3], [0.0, 0.5, 0.5], atol=1e-12)


# ----------------------------------------------------------------------------------------- recall


class _Fixed(torch.nn.Module):
    """Logits whose argmax at position t is `predict[t]`."""

    def __init__(self, predict: list[int], vocab: int = 16) -> None:
        super().__init__()
        self.predict, self.vocab = predict, vocab

    def forward(self, input_ids: torch.Tensor):
        B, T = input_ids.shape
        logits = torch.zeros(B, T, self.vocab)
        for t, token in enumerate(self.predict[:T]):
            logits[:, t, token] = 1.0
        return type("Out", (), {"logits": logits})()


def test_recall_answer_counts_only_when_every_token_is_predicted() -> None:
    """owai.evals.recall (issue #38): an answer counts when the greedy prediction of *every* answer
    token is right (exact match); one wrong token of two fails it. Accuracy per group = correct / n."""
    from owai.data.recall import Episode, Query
    from owai.evals.recall import accuracy_by_group, score

    tokens = np.array([3, 4, 5, 7, 8, 9, 7, 8], dtype=np.int64)
    queries = [Query(3, (7, 8), 0, 3, "near", "k1"), Query(6, (7, 8), 3, 3, "far", "k2")]
    # position t predicts token t + 1: 7 at 2, 8 at 3 (right); 7 at 5, 9 at 6 (second token wrong)
    model = _Fixed([0, 0, 7, 8, 0, 7, 9, 0])
    right = score(model, [Episode(tokens, queries)], torch.device("cpu"))
    assert right == [[True, False]]
    groups = accuracy_by_group([Episode(tokens, queries)], right)
    assert groups == {"all": (0.5, 2), "far": (0.0, 1), "near": (1.0, 1)}


# ------------------------------------------------------------------------------------- answer log


def test_answer_keys_are_canonical_json_and_a_damaged_value_is_asked_again(tmp_path) -> None:
    """owai.evals.answers: a key is the hash of its parts as canonical JSON (dict order does not
    matter: a resumed run finds what it asked), and `get(key, kind)` is None for a value of
    another kind (a line damaged into another JSON value: that question is asked again)."""
    from owai.evals.answers import AnswerLog, answer_key

    assert answer_key("cell", {"a": 1, "b": [2, 3]}) == answer_key("cell", {"b": [2, 3], "a": 1})
    log = AnswerLog(tmp_path / "answers.jsonl")
    log.add_batch({"k": "a continuation"})
    again = AnswerLog(tmp_path / "answers.jsonl")
    assert again.get("k", str) == "a continuation"
    assert again.get("k", (list, float)) is None


# ---------------------------------------------------------------------------------------- harness


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """conftest's random Llama with a character tokenizer (BOS <s> = 1, EOS </s> = 2)."""
    pytest.importorskip("lm_eval")
    from conftest import save_char_llama

    return save_char_llama(tmp_path_factory.mktemp("llama"))


@pytest.mark.usefixtures("one_thread")
def test_harness_prompt_keeps_room_for_the_generated_tokens_as_hflm(llama_dir, monkeypatch) -> None:
    """lm-evaluation-harness's HFLM.generate_until left-truncates the context to max_length -
    max_gen_toks tokens; owai's adapter feeds the model the same prompt (the first forward's length,
    compared with HFLM's own on the same model) and returns the same text."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from owai.evals import harness
    from owai.evals.causal_lm import open_model

    ours = harness.OwaiLM(open_model(str(llama_dir), str(llama_dir), torch.device("cpu"), "float32"))
    theirs = HFLM(pretrained=str(llama_dir), device="cpu", batch_size=1, dtype="float32")
    requests = [Instance("generate_until", {}, ("The cat sat on the mat. " * 5, {"until": [], "max_gen_toks": 5}), 0)]
    lengths: dict[str, list[int]] = {"ours": [], "theirs": []}
    hooks = [lm_.register_forward_hook(lambda m, args, kwargs, out, who=who: lengths[who].append(
        (kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0]).shape[1]), with_kwargs=True)
        for who, lm_ in (("ours", ours.lm.model), ("theirs", theirs.model))]
    try:
        texts = ours.generate_until(requests), theirs.generate_until(requests)
    finally:
        for hook in hooks:
            hook.remove()
    assert texts[0] == texts[1]
    assert lengths["ours"][0] == lengths["theirs"][0] == 64 - 5


def test_harness_gsm8k_reads_the_strict_match_filter_first() -> None:
    """Spec 5.2 / Table 4.1: gsm8k's exact_match is read from its strict-match filter (the harness
    also reports flexible-extract), whatever order the harness's results list them in."""
    pytest.importorskip("lm_eval")
    from owai.evals import harness

    result = {"results": {"gsm8k": {"alias": "gsm8k", "exact_match,flexible-extract": 0.5,
                                    "exact_match_stderr,flexible-extract": 0.1, "exact_match,strict-match": 0.25}}}
    assert harness.main_metrics(result, ["gsm8k"]) == {"gsm8k.exact_match": 0.25}


def test_harness_averages_reproduce_the_thesis_rows() -> None:
    """Tables 4.2 / 4.3 (spec 5.3): persistent.avg is the plain mean of the 13 persistent-knowledge
    tasks and new.avg of the 6 new-knowledge ones. MMv2 large without long-term memory: 56.6 and 34.9."""
    pytest.importorskip("lm_eval")
    from owai.evals import harness

    persistent = [45.4, 77.9, 71.2, 51.8, 80.4, 73.1, 78.6, 30.8, 48.6, 62.1, 26.7, 46.8, 42.2]
    new = [69.4, 24.6, 5.4, 6.8, 59.5, 43.6]
    measured = {f"{t}.{harness.MAIN_METRIC[t]}": v for t, v in zip(harness.PERSISTENT + harness.NEW, persistent + new)}
    averages = harness.averages(measured)
    assert round(averages["persistent.avg"], 1) == 56.6 and round(averages["new.avg"], 1) == 34.9
    assert harness.averages({k: v for k, v in measured.items() if not k.startswith("race.")}) == {
        "persistent.avg": averages["persistent.avg"]}
