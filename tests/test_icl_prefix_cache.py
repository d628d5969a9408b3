"""In-context classification prefills a prompt set's shared demonstrations once (`CausalLM.shared_prefix`):
every model family owai evaluates continues each query from a copy of the prefix's cache and answers,
string for string, what a whole prefill of each prompt answers; one at a time and batched, across
prompt sets, with a token-level prefix shorter than the shared text; a family whose cache cannot be
continued (the LSTM's recurrent state) prefills every prompt whole and says so once."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch
from transformers import (JambaConfig, JambaForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM)

from owai.data.text import ByteTokenizer
from owai.evals import causal_lm
from owai.evals.causal_lm import CausalLM, generate_all
from owai.models.lm import build_lm

pytestmark = pytest.mark.usefixtures("one_thread")

MERGED, BOS = 257, 258  # "ab" as one token (a BPE merge), and a beginning-of-sequence token
VOCAB = 259
TINY = {  # owai's families; "llama" is transformers' own LlamaForCausalLM from a config (no hub)
    "gpt": dict(n_layer=2, n_embd=32, n_head=4, block_size=1024, position="learned", initializer_range=0.2),
    "mm": dict(n_layer=2, n_embd=32, n_head=4, pmem_size=8, leaky_chunk=4, ic_dropout=0.0, hd_dropout=0.0),
    "mmv2": dict(n_layer=2, n_embd=16, n_head=2, ffn_hidden=24, short_window=5, long_delay_eval=3, scan_chunk=4,
                 query_block=3),
    "lstm": dict(n_layer=1, n_embd=16),
}
FAMILIES = ("gpt", "mm", "mmv2", "llama")
CONTEXT = "Task: sort.\ntext: one two\nlabel: xa\ntext: three\nlabel: ya\ntext: sa"  # ends in "a"
# first tokens differ ("ab" merges with the context's last "a"), lengths differ
QUERIES = ["b four\nlabel:", "zz five six\nlabel:", "bb\nlabel:", "q seven eight nine\nlabel:", "c\nlabel:"]
OTHER = "Task: sort.\ntext: ten\nlabel: za\ntext: elf\nlabel: xa\ntext: "  # a second prompt set


class MergingBytes(ByteTokenizer):
    """UTF-8 bytes with one BPE merge ("ab" -> 257) and a BOS (258) in front of what
    `encode_as_transformers` gives, as a Llama tokenizer adds one: a merge across the shared text's
    end makes the token-level common prefix shorter than the text's."""

    name, vocab_size, fingerprint = "bytes+ab", VOCAB, "bytes-ab-v1"

    def encode(self, text: str) -> list[int]:
        raw, out, i = list(text.encode("utf-8")), [], 0
        while i < len(raw):
            if raw[i:i + 2] == [97, 98]:
                out.append(MERGED)
                i += 2
            else:
                out.append(raw[i])
                i += 1
        return out

    def encode_as_transformers(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + super().encode_as_transformers(text, add_special_tokens)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        expanded: list[int] = []
        for i in ids:
            expanded += [97, 98] if int(i) == MERGED else [] if int(i) == BOS else [int(i)]
        return super().decode(expanded, skip_special)


def tiny(family: str) -> torch.nn.Module:
    """A tiny random model with peaked, context-dependent logits (greedy continuations that vary)."""
    torch.manual_seed(0)
    sizes = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**sizes))
    elif family == "mistral":  # Mistral-7B-v0.1's sliding-window attention, a window of 16 under the prompts' ~70 tokens
        model = MistralForCausalLM(MistralConfig(sliding_window=16, **sizes))
    elif family == "jamba":  # a hybrid: a Mamba layer (a recurrent state in the cache) and an attention layer
        model = JambaForCausalLM(JambaConfig(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=100, num_experts=1,
                                             mamba_d_state=4, **sizes))
    else:
        model = build_lm(family, vocab_size=VOCAB, **TINY[family])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if family == "mm" and p.dim() == 1 and "ln" not in name:
                p.add_(0.3 * torch.randn_like(p))
            elif p.dim() >= 2:
                p.mul_(8**0.5)
    return model.eval()


def lm(family: str, batch_size: int = 1, precision: str = "float32") -> CausalLM:
    model = CausalLM(tiny(family), MergingBytes(), family, torch.device("cpu"), precision)
    if precision == "float32":
        model.model.double()  # float64: a prefix and a suffix prefill round as one prefill does
    model.batch_size = batch_size
    return model


def prompts(context: str = CONTEXT) -> list[str]:
    return [context + q for q in QUERIES]


@pytest.fixture
def copies(monkeypatch) -> list[int]:
    """The rows of each copy of a prefix cache handed to `generate` (the cached path was taken)."""
    made: list[int] = []
    real = causal_lm.copy_cache

    def counted(cache, rows):
        made.append(rows)
        return real(cache, rows)

    monkeypatch.setattr(causal_lm, "copy_cache", counted)
    return made


def shared_answers(model: CausalLM, asked: list[str]) -> list[str]:
    with model.shared_prefix(asked):
        return generate_all(model, asked, max_new_tokens=6)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_prefix_cache_answers_what_a_whole_prefill_answers(family, copies) -> None:
    model = lm(family)
    asked = prompts()
    plain = generate_all(model, asked, max_new_tokens=6)
    assert len(set(plain)) > 1  # the queries are told apart (a test that could fail)
    assert not copies
    assert shared_answers(model, asked) == plain
    assert copies == [1] * len(asked)
    # a second prompt set after the first: its own prefix, nothing left from the first
    other = prompts(OTHER)
    assert shared_answers(model, other) == generate_all(model, other, max_new_tokens=6)
    assert model.shared is None  # the block freed its prefix


def test_v2_decoding_on_its_static_buffers_continues_the_prefix_cache(copies) -> None:
    """v2's StaticDecoder (CUDA graphs on a GPU; its buffers without a graph here) is built from the
    copied cache at the first one-token step after the query's prefill: the same answers."""
    model = lm("mmv2")
    model.model.config.static_decoding = "on"
    plain = generate_all(lm("mmv2"), prompts(), max_new_tokens=6)
    assert shared_answers(model, prompts()) == plain and copies == [1] * len(QUERIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_generation_from_the_prefix_cache_answers_the_same(family, copies) -> None:
    plain = generate_all(lm(family), prompts(), max_new_tokens=6)
    model = lm(family, batch_size=3)  # 5 queries: a batch of 3 and one of 2, rows of different lengths
    assert shared_answers(model, prompts()) == plain
    # padding between the prefix and a prompt's tokens where the family reads it as nothing; Memory
    # Mosaics (v1: no padding, v2: padding is a document) batch rows of one length: longest first, the
    # batches are (q..., zz..., b four) of three lengths, then (bb, c) of one (bb's "ab" merges into one token)
    assert copies == ([1, 1, 1, 2] if family in ("mm", "mmv2") else [3, 2])
    assert shared_answers(model, prompts(OTHER)) == generate_all(lm(family), prompts(OTHER), max_new_tokens=6)


@pytest.mark.parametrize("family", ["mm", "mmv2"])
def test_memory_mosaics_batch_rows_of_one_length_with_and_without_the_prefix_cache(family, copies, monkeypatch) -> None:
    """Rows of one length need no padding, which Memory Mosaics cannot read (v1 none at all, v2 none
    after a prefix): they share a `generate` call, from a copy of the prefix's cache or whole, and
    answer what one prompt at a time answers; a row of another length goes alone."""
    same = ["d four\nlabel:", "zz fiv\nlabel:", "q sevn\nlabel:"]  # one length in tokens after the context
    asked = [CONTEXT + q for q in same] + [CONTEXT + "c\nlabel:"]
    plain = generate_all(lm(family), asked, max_new_tokens=6)
    assert len(set(plain)) > 1
    model = lm(family, batch_size=4)
    calls: list[int] = []
    real = model.model.generate

    def counted(**kwargs):
        calls.append(len(kwargs["input_ids"]))
        return real(**kwargs)

    monkeypatch.setattr(model.model, "generate", counted)
    assert generate_all(model, asked, max_new_tokens=6) == plain
    whole = [3, 1] if family == "mm" else [4]  # whole prefills: v1 reads no padding, v2 reads left padding
    assert calls == whole and not copies
    assert shared_answers(model, asked) == plain
    assert calls == whole + [3, 1] and copies == [3, 1]


def test_a_sliding_window_model_continues_the_prefix_in_rows_of_one_length(copies) -> None:
    """A window counts cache indices, not positions: padding between the prefix and a row's own tokens
    would move the row's window by its padding (a batched Mistral then answered otherwise than whole
    prefills). From the prefix's cache such a model batches only rows of one length, which need no
    padding: the same answers."""
    plain = generate_all(lm("mistral"), prompts(), max_new_tokens=6)
    assert len(set(plain)) > 1
    model = lm("mistral", batch_size=3)
    assert generate_all(model, prompts(), max_new_tokens=6) == plain  # left padding moves a row's window with it
    assert shared_answers(model, prompts()) == plain
    assert copies == [1, 1, 1, 2]  # as Memory Mosaics in the batched test above


def test_windowed_attention_is_read_from_the_config() -> None:
    from transformers import Gemma2Config, Gemma3Config, PretrainedConfig, Qwen2Config

    assert causal_lm.windowed_attention(MistralConfig(sliding_window=4096))  # Mistral-7B-v0.1
    assert not causal_lm.windowed_attention(MistralConfig(sliding_window=None))  # v0.2 on
    assert not causal_lm.windowed_attention(Qwen2Config())  # use_sliding_window false
    assert causal_lm.windowed_attention(Qwen2Config(use_sliding_window=True, sliding_window=16, max_window_layers=0))
    assert causal_lm.windowed_attention(Gemma2Config())  # every other layer
    assert not causal_lm.windowed_attention(LlamaConfig())
    assert causal_lm.windowed_attention(Gemma3Config())  # composite: the layer types are its text_config's
    # a config that lists no layer_types (a saved config of an older release): its chunk or window fields
    assert causal_lm.windowed_attention(PretrainedConfig(attention_chunk_size=8192))
    assert causal_lm.windowed_attention(PretrainedConfig(sliding_window=16))
    assert not causal_lm.windowed_attention(PretrainedConfig(sliding_window=16, use_sliding_window=False))
    assert not lm("mistral").pads_after_prefix and lm("llama").pads_after_prefix


@pytest.mark.parametrize("setting", ["use_cache", "cache_implementation"])
def test_the_prefix_cache_is_decoded_from_whatever_the_generation_config_says(setting, copies) -> None:
    """A generation config with use_cache false (a checkpoint's config that says so): generate read the
    rows whole on top of the prefix's cache (other answers); one asking a static cache (a hub model's
    generation_config.json): generate refused the passed cache (ValueError). Decoded from the copy."""
    plain = generate_all(lm("llama"), prompts(), max_new_tokens=6)
    model = lm("llama", batch_size=3)
    if setting == "use_cache":
        model.model.generation_config.use_cache = False
    else:
        model.model.generation_config.cache_implementation = "static"
    assert generate_all(model, prompts(), max_new_tokens=6) == plain  # the uncached path as the config says
    assert shared_answers(model, prompts()) == plain
    assert copies == [3, 2]


def test_every_call_gets_a_copy_of_the_prefix(monkeypatch) -> None:
    """Without the copy, generation writes each query's tokens into the one prefix cache and the next
    query reads them: the answers change (what the equality tests above would catch)."""
    model = lm("gpt")
    # each prompt longer than the last one's prompt and answer: the shared cache still leaves it tokens to read
    asked = [CONTEXT + q for q in ("b\nlabel:", "zz five six seven\nlabel:", "q seven eight nine ten eleven\nlabel:")]
    plain = generate_all(model, asked, max_new_tokens=6)
    calls = []

    def no_copy(cache, rows):
        calls.append(rows)
        return cache

    monkeypatch.setattr(causal_lm, "copy_cache", no_copy)
    assert shared_answers(model, asked) != plain
    assert calls == [1] * len(asked)  # the cached path was taken for every query


def test_the_token_prefix_stops_where_a_merge_crosses_the_shared_text() -> None:
    model = lm("gpt")
    asked = prompts()
    shared = causal_lm.SharedPrefix(model.prompt_ids, asked)
    shared.locate()
    context_tokens = len(model.prompt_ids(CONTEXT))
    assert shared.length == context_tokens - 1  # "ab" merges the context's last "a" with "b..." queries
    assert all(shared.ids(p) == model.prompt_ids(p) for p in asked)
    # every prompt keeps a token of its own: a set whose one prompt is the prefix of the others
    nested = [CONTEXT, CONTEXT + "zz", CONTEXT + "zzz"]
    shared = causal_lm.SharedPrefix(model.prompt_ids, nested)
    shared.locate()
    assert shared.length == context_tokens - 1
    assert shared_answers(model, nested) == generate_all(model, nested, max_new_tokens=6)


def test_bfloat16_generation_from_the_prefix_cache_runs() -> None:
    for family in ("gpt", "mmv2"):
        model = lm(family, batch_size=2, precision="bfloat16")
        assert next(model.model.parameters()).dtype == torch.bfloat16
        answers = shared_answers(model, prompts())
        assert len(answers) == len(QUERIES) and all(isinstance(a, str) for a in answers)


def test_a_recurrent_cache_is_prefilled_whole_and_said_once(capsys) -> None:
    model = lm("lstm")
    asked = prompts()
    plain = generate_all(model, asked, max_new_tokens=6)
    assert shared_answers(model, asked) == plain
    assert shared_answers(model, prompts(OTHER)) == generate_all(model, prompts(OTHER), max_new_tokens=6)
    said = [line for line in capsys.readouterr().err.splitlines() if "prefix cache" in line]
    assert len(said) == 1 and "recurrent" in said[0] and "prefilled whole" in said[0]


def test_score_prompts_answers_the_same_with_and_without_the_prefix_cache() -> None:
    from owai.evals import longicl
    from owai.methods.icl_eval import _Generator

    data = longicl.synthetic_task(4, 0, n_train=2, n_test=2, n_filler=40, length=(3, 5))
    queries = longicl.select_queries(data, 5)
    shots = longicl.select_demonstrations(data, 1)
    model = lm("gpt")
    results = {}
    for on in (True, False):
        generator = _Generator(model, 4, prefix_cache=on)
        assert hasattr(generator, "shared_prefix") == on
        results[on] = longicl.score_prompts(generator, data, shots, queries, longicl.PromptOptions(), n_examples=5)
    assert results[True] == results[False]
    assert len({e["continuation"] for e in results[True]["examples"]}) > 1


def test_a_set_whose_prompts_share_no_token_is_prefilled_whole() -> None:
    model = lm("gpt")
    model.tokenizer = ByteTokenizer()  # no BOS: the prompts differ from their first token
    asked = ["xq one", "yq two"]
    with model.shared_prefix(asked):
        answers = generate_all(model, asked, max_new_tokens=4)
        assert model.shared.length == 0 and model.shared.cache is None
    assert answers == generate_all(model, asked, max_new_tokens=4)
    with model.shared_prefix(asked[:1]):  # one prompt: no other to share a prefix with, nothing prefilled apart
        assert generate_all(model, asked[:1], max_new_tokens=4) == answers[:1]
        assert model.shared.cache is None


def test_eval_icl_answers_the_same_with_no_prefix_cache(tmp_path, capsys, copies) -> None:
    import json

    from conftest import cli_in_process, save_tiny_gpt2

    model = save_tiny_gpt2(tmp_path / "model")
    args = ["eval", "icl", "-q", "--model", str(model), "--task", "synthetic", "--shots", "1", "--n", "4",
            "--labels", "semantic", "--set", "synthetic_classes=4", "--set", "max_new_tokens=4",
            "--set", 'strategies=["newline-fixed"]', "--set", "batch_size=2"]
    details = {}
    for flag in ("--prefix-cache", "--no-prefix-cache"):
        out = tmp_path / flag.strip("-")
        rc, _, err = cli_in_process([*args, flag, "-o", str(out)], capsys)
        assert rc == 0, err
        run = next((out / "fig4.6-icl").iterdir())
        assert f"prefix_cache: {str(flag == '--prefix-cache').lower()}" in (run / "config.yaml").read_text()
        details[flag] = json.loads((run / "results.json").read_text())["details"]["semantic"]["results"]
        if flag == "--prefix-cache":  # 4 queries in batches of 2 from the prefix's cache; none without it
            assert copies == [2, 2]
    assert copies == [2, 2]
    assert details["--prefix-cache"] == details["--no-prefix-cache"]
    assert all("continuation" in e for e in details["--prefix-cache"]["1"]["strategies"]["newline-fixed"]["examples"])


def test_a_prompt_set_killed_midway_resumes_from_the_prefix_cache(tmp_path, copies, monkeypatch) -> None:
    """`generate_all(answers=...)` inside the block: the answers logged before a kill are read back, the
    rest come from the prefix's cache (prefilled for the whole set), the same as a whole prefill each."""
    from owai.evals.answers import AnswerLog

    model = lm("gpt", batch_size=2)
    asked = prompts()
    plain = generate_all(lm("gpt", batch_size=2), asked, max_new_tokens=6)
    real = CausalLM._continue

    def killed(self, encoded, max_new_tokens):
        if len(copies) == 2:  # the third batch
            raise KeyboardInterrupt
        return real(self, encoded, max_new_tokens)

    monkeypatch.setattr(CausalLM, "_continue", killed)
    log = AnswerLog(tmp_path / "answers.jsonl")
    with pytest.raises(KeyboardInterrupt):
        with model.shared_prefix(asked):
            generate_all(model, asked, answers=log, max_new_tokens=6)
    log.flush()
    monkeypatch.setattr(CausalLM, "_continue", real)
    with model.shared_prefix(asked):
        resumed = generate_all(model, asked, answers=AnswerLog(tmp_path / "answers.jsonl"), max_new_tokens=6)
    assert resumed == plain
    assert copies == [2, 2, 1]  # 2 batches before the kill; the last prompt after it


def test_prompts_outside_the_set_are_prefilled_whole_inside_the_block(copies) -> None:
    """`generate` inside a block with a prompt that is not one of its set: one whose ids are the prefix
    alone (no token of its own) or that does not start with it is prefilled whole, as is a batch holding
    one; one that starts with the prefix and goes on continues from its cache."""
    model = lm("gpt", batch_size=2)
    asked = prompts()
    shared = causal_lm.SharedPrefix(model.prompt_ids, asked)
    shared.locate()
    outside = [CONTEXT[:-1], OTHER + "b four five six seven\nlabel:", CONTEXT + "q ten\nlabel:"]
    assert model.prompt_ids(outside[0]) == shared.reference[:shared.length]  # the prefix, and nothing after it
    assert len(model.prompt_ids(outside[1])) > shared.length  # longer than the prefix, not starting with it
    plain = generate_all(lm("gpt"), outside + asked[:1], max_new_tokens=6)
    with model.shared_prefix(asked):
        assert [model.generate(p, max_new_tokens=6) for p in outside] == plain[:3]
        assert model.generate_many([asked[0], outside[1]], max_new_tokens=6) == [plain[3], plain[1]]
    assert copies == [1]  # the third prompt alone


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_the_prefix_prefill_computes_its_last_logits_alone(family) -> None:
    """A 20k-token prefix's logits at a 128k-token vocabulary are 5 GB: the prefill asks the model for
    the last position's only (`logits_to_keep`), where its forward takes that argument."""
    model = lm(family)
    shared = causal_lm.SharedPrefix(model.prompt_ids, prompts())
    shared.locate()
    seen: list[tuple[int, int]] = []
    model.model.register_forward_hook(
        lambda module, args, kwargs, out: seen.append((kwargs["input_ids"].shape[1], out.logits.shape[1])), with_kwargs=True)
    shared_answers(model, prompts())
    assert seen[0] == (shared.length, 1)  # the first forward is the prefix's prefill


def test_a_model_whose_prefix_is_not_reused_batches_its_prompts_in_the_block(monkeypatch) -> None:
    """The LSTM (a recurrent cache: prefilled whole) keeps its batches inside a block: one prompt at a
    time is for models that continue a shared prefix and cannot pad after it."""
    plain = generate_all(lm("lstm"), prompts(), max_new_tokens=6)
    rows: list[int] = []
    real = CausalLM._continue

    def counted(self, encoded, max_new_tokens):
        rows.append(len(encoded))
        return real(self, encoded, max_new_tokens)

    monkeypatch.setattr(CausalLM, "_continue", counted)
    assert shared_answers(lm("lstm", batch_size=3), prompts()) == plain
    assert rows == [3, 2]


def test_a_hybrid_cache_continues_the_prefix(copies) -> None:
    """Jamba's cache holds a Mamba layer's recurrent state beside an attention layer's keys and values:
    it is reused (a cache of recurrent states alone is not), one prompt at a time (its linear layer
    cannot be repeated along a batch, `repeats_along_batch`), to the answers of whole prefills."""
    plain = generate_all(lm("jamba"), prompts(), max_new_tokens=6)
    assert len(set(plain)) > 1
    model = lm("jamba", batch_size=3)
    assert shared_answers(model, prompts()) == plain
    assert copies == [1] * len(QUERIES) and model.no_prefix_reuse is None


def test_a_model_that_returns_no_cache_is_prefilled_whole_and_said_once(monkeypatch, capsys, copies) -> None:
    from owai.models import hf_cache

    model = lm("gpt")
    plain = {c: generate_all(model, prompts(c), max_new_tokens=6) for c in (CONTEXT, OTHER)}
    monkeypatch.setattr(hf_cache, "output_cache", lambda out: None)  # what the prefill's output holds
    assert {c: shared_answers(model, prompts(c)) for c in (CONTEXT, OTHER)} == plain
    said = [line for line in capsys.readouterr().err.splitlines() if "prefix cache" in line]
    assert copies == [] and len(said) == 1 and "returns no cache" in said[0]


@pytest.mark.slow  # a torchrun job of two ranks (about a minute); `pytest -m slow`
def test_two_ranks_each_prefill_their_prefix_to_one_process_answers(tmp_path, capsys) -> None:
    import json

    from conftest import cli_in_process, save_tiny_gpt2, torchrun

    model = save_tiny_gpt2(tmp_path / "model")
    args = ["eval", "icl", "-q", "--model", str(model), "--task", "synthetic", "--shots", "1", "--queries", "5",
            "--labels", "semantic", "--set", "synthetic_classes=4", "--set", "max_new_tokens=4",
            "--set", 'strategies=["newline-fixed"]', "--set", "batch_size=2"]
    rc, _, err = cli_in_process([*args, "--no-prefix-cache", "-o", str(tmp_path / "one")], capsys)
    assert rc == 0, err
    proc = torchrun(2, ["-m", "owai", *args, "-o", str(tmp_path / "two")], cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = (next((tmp_path / d / "fig4.6-icl").iterdir()) for d in ("one", "two"))
    a, b = (json.loads((d / "results.json").read_text())["details"]["semantic"] for d in (one, two))
    assert a["results"] == b["results"]
