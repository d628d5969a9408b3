"""One model interface for chapter 4's evaluation suites (spec evals.md sec 0.3), over any causal LM.

The suites (`owai.evals.ruler`, `owai.evals.longicl`) call a model as

    count_tokens(text) -> int              tokens of `text` (no special tokens): prompt fitting, overflow
    generate(prompt, max_new_tokens) -> str  greedy continuation, cut at `stop` strings; the prompt is
                                           encoded as `tokenizer(prompt)` (a Llama tokenizer's BOS
                                           first) and the answer decoded without special tokens, as
                                           RULER's and LongICLBench's official code do
    max_tokens                             the longest sequence the model takes (None: any length)

and the log-likelihood suites also `loglikelihood(context, continuation) -> (float, bool)`.
`open_model(spec)` gives one from

    a directory          an owai run directory (models/<arch>/, mosaic-train) or a save_pretrained
                         directory: the model through the Auto classes, the tokenizer it was trained
                         with (owai_tokenizer.json) unless one is given
    a Hugging Face id    AutoModelForCausalLM + its own tokenizer (no remote code)
    reference:NAME       a reference model of the suite that validates the pipeline without training
                         (`owai.evals.ruler` / `owai.evals.longicl`: oracle, null, slot:K, knn, last)

`generate_many(prompts)` runs `batch_size` prompts at once, left-padded, for models that read
padding as something apart (Hugging Face models, owai's GPT and Memory Mosaics v2: the padding
is a document no real token reads; the LSTM runs each row over its own tokens); Memory Mosaics v1
batches only rows of one length, which need no padding.
`generate_all(model, prompts)` is how the suites call any model (reference models included); with
`batch_size` above 1 it makes the batches in order of length, longest first.
`with model.shared_prefix(prompts):` (a prompt set whose prompts share their demonstrations, the
in-context suites') prefills the prompts' common token prefix once and generates each prompt from a
copy of that prefix's cache, batched as above (rows of one length together for Memory Mosaics and
for models with windowed attention, `windowed_attention`, which cannot read padding after the prefix):
the same continuations as a whole prefill each (`SharedPrefix`).
Prompts over `max_tokens` (minus the generation budget) are the suites' overflow, never truncated
here. On CUDA the model runs in bfloat16 (`precision="auto"`). `ablate("long_term_memory")` switches
a Memory Mosaics v2 model's long-term memory off for the rows of Tables 4.2, 4.3 and C.1; models
without one refuse it in one line.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from owai.errors import DataMissing, OwaiError
from owai.evals.answers import AnswerLog, occurrence_keys

REFERENCE = "reference:"
ABLATIONS = ("long_term_memory",)
NO_PADDING = ("owai_memory_mosaics",)  # model types that cannot read left-padded batches
# model types whose padding cannot sit between a shared prefix and a prompt's own tokens: v1 reads no
# padding, v2 reads padding as a document of its own (a row's document cannot resume after it); with
# a shared prefix they batch only rows of one length (`CausalLM._same_length_groups`)
NO_PADDING_AFTER_PREFIX = ("owai_memory_mosaics", "owai_memory_mosaics_v2")


def windowed_attention(config: Any) -> bool:
    """Whether a transformers config has layers that do not attend to the whole past: sliding-window
    (Mistral-7B-v0.1, Phi-3, Gemma 2/3, Qwen2 with use_sliding_window), chunked (Llama 4) or linear
    layers (`layer_types` other than full_attention). Their windows count cache indices, not
    positions, so padding between a shared prefix and a row's own tokens would move a row's window
    by its padding (measured: a batched Mistral or Qwen2 with sliding windows then answers otherwise
    than whole prefills); such models continue a prefix in batches of rows of one length (exact)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None)
    if layer_types:
        return any(kind != "full_attention" for kind in layer_types)
    if getattr(text, "attention_chunk_size", None):
        return True
    return bool(getattr(text, "sliding_window", None)) and getattr(text, "use_sliding_window", True) is not False


class CausalLM:
    """A causal language model and its tokenizer, as the evaluation suites call them."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, label: str, device: torch.device | None = None,
                 precision: str = "auto") -> None:
        from owai.runtime import DTYPES, auto_precision

        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = DTYPES[auto_precision(precision, self.device)]
        self.model = model.to(self.device, dtype=dtype).eval()
        self.tokenizer, self.label = tokenizer, label
        self.max_tokens = config_max_length(self.model.config.to_dict())
        self.ablated: set[str] = set()
        self.batch_size = 1  # prompts per generate call (generate_many)
        self.pads = getattr(self.model.config, "model_type", "") not in NO_PADDING
        # whether the forward computes the last positions' logits alone when asked (as generate asks it)
        parameters = inspect.signature(self.model.forward).parameters
        self.keeps_logits = "logits_to_keep" in parameters
        # padding between a shared prefix and a prompt's own tokens: positions come from the mask
        # (generate passes position_ids), the model type reads such padding as nothing, and every
        # layer attends to the whole past (a window would move by the padding: `windowed_attention`)
        self.pads_after_prefix = (self.pads and "position_ids" in parameters
                                  and getattr(self.model.config, "model_type", "") not in NO_PADDING_AFTER_PREFIX
                                  and not windowed_attention(self.model.config))
        self.shared: SharedPrefix | None = None  # the prompt set of the `shared_prefix` block running
        self.no_prefix_reuse: str | None = None  # why this model's prefix caches cannot be reused (said once)

    def count_tokens(self, text: str) -> int:
        return self.tokenizer.count(text)

    def count_tokens_many(self, texts: list[str]) -> list[int]:
        """`count_tokens` of each text; a batch at once (in parallel) where the tokenizer can."""
        from owai.data.text import count_each

        return count_each(self.tokenizer, texts)

    def prompt_ids(self, prompt: str) -> list[int]:
        """The ids a prompt is generated from, as RULER's and LongICLBench's official code makes them
        (`tokenizer(prompt)`): the tokenizer's own additions (a Llama tokenizer's BOS, none for
        GPT-2 or bpe-N) in front, special-token strings read as those tokens."""
        return list(self.tokenizer.encode_as_transformers(prompt, add_special_tokens=True))

    @torch.no_grad()
    def generate(self, prompt: str, max_new_tokens: int = 32, stop: tuple[str, ...] = ()) -> str:
        """The greedy continuation of `prompt` (at most max_new_tokens tokens), cut before the first
        stop string; the end-of-text token ends it."""
        ids = self._ids(prompt)
        if not ids:
            raise OwaiError(f"{self.label}: the prompt encodes to no tokens")
        return self.continuation_text(self._continue([ids], max_new_tokens)[0], stop)

    def _ids(self, prompt: str) -> list[int]:
        """The prompt's ids; inside a `shared_prefix` block, as the block encoded them (once)."""
        return self.shared.ids(prompt) if self.shared is not None else self.prompt_ids(prompt)

    @torch.no_grad()
    def generate_many(self, prompts: list[str], max_new_tokens: int = 32, stop: tuple[str, ...] = ()) -> list[str]:
        """`generate` of each prompt, `batch_size` at a time, in order: the same continuations as one at
        a time (greedy). A batch's rows are left-padded, or, inside a `shared_prefix` block, prefix,
        padding, own tokens; where the model cannot read that padding (`_same_length_groups`), only
        rows of one length share a `generate` call, which needs no padding."""
        out: list[str] = []
        step = max(1, int(self.batch_size))
        for start in range(0, len(prompts), step):
            encoded = [self._ids(p) for p in prompts[start:start + step]]
            if not all(encoded):
                raise OwaiError(f"{self.label}: a prompt encodes to no tokens")
            texts: list[str] = [""] * len(encoded)
            for rows in self._same_length_groups(encoded):
                for i, new in zip(rows, self._continue([encoded[i] for i in rows], max_new_tokens)):
                    texts[i] = self.continuation_text(new, stop)
            out += texts
        return out

    def _same_length_groups(self, encoded: list[list[int]]) -> list[list[int]]:
        """The batch's rows (indices) in the groups that share one `generate` call: all of them where the
        model reads the padding their lengths need (left padding: `pads`; padding after a shared
        prefix: `pads_after_prefix`), else the rows of each length (first-seen order), which need none:
        Memory Mosaics v1 reads no padding, v2 reads padding after a prefix as a document of its own,
        and a sliding window would move by it (measured exact: equal-length rows from the prefix cache
        answer what one prompt at a time answers, v1 and v2 alike)."""
        prefix = self._prefix() if self.shared is not None else None
        cached = prefix is not None and prefix.reusable(encoded)
        if cached and not repeats_along_batch(prefix.cache):  # one copy per prompt (a hybrid model's linear layers)
            return [[i] for i in range(len(encoded))]
        if len({len(ids) for ids in encoded}) == 1 or (self.pads_after_prefix if cached else self.pads):
            return [list(range(len(encoded)))]
        groups: dict[int, list[int]] = {}
        for i, ids in enumerate(encoded):
            groups.setdefault(len(ids), []).append(i)
        return list(groups.values())

    def _continue(self, encoded: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """The greedy new tokens of each row of `encoded` (token ids), from one `model.generate` call:
        the rows left-padded with the end-of-text id under an attention mask; or, when every row
        starts with the shared prefix (`SharedPrefix.reusable`), each row the prefix, its padding,
        its own tokens, generated from a copy of the prefix's cache (repeated along the batch), so
        the prefix is not computed again and the prompts' positions are those of a whole prefill."""
        eot = getattr(self.tokenizer, "eot_id", None)
        pad = eot if eot is not None else 0
        width = max(len(ids) for ids in encoded)
        prefix = self._prefix()
        cached: dict[str, Any] = {}
        if prefix is not None and prefix.reusable(encoded):
            n = prefix.length
            rows = [ids[:n] + [pad] * (width - len(ids)) + ids[n:] for ids in encoded]
            mask = [[1] * n + [0] * (width - len(ids)) + [1] * (len(ids) - n) for ids in encoded]
            from owai.models.hf_cache import cache_kwargs

            # decoding from the cache whatever the model's generation config says: with use_cache
            # false (a config's) generate would read the whole rows again on top of the prefix's
            # cache (wrong answers), and a cache_implementation ("static", a hub model's
            # generation_config.json) cannot be combined with a passed cache (a ValueError)
            cached = {**cache_kwargs(copy_cache(prefix.cache, len(encoded))), "use_cache": True,
                      "cache_implementation": None}
        else:
            rows = [[pad] * (width - len(ids)) + ids for ids in encoded]
            mask = [[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded]
        x = torch.tensor(rows, device=self.device)
        y = self.model.generate(input_ids=x, attention_mask=torch.tensor(mask, device=self.device),
                                max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eot, pad_token_id=pad,
                                **cached)
        return [[int(t) for t in row[width:].tolist()] for row in y]

    @contextlib.contextmanager
    def shared_prefix(self, prompts: list[str]) -> Iterator[None]:
        """While the block runs, `generate` / `generate_many` continue prompts from a copy of the cache
        of `prompts`' common token prefix (`SharedPrefix`), prefilled once, at the block's first
        generation (a resumed prompt set with every answer logged prefills nothing); left, the cache
        is freed. A model whose cache cannot be continued exactly (a recurrent state: the LSTM)
        prefills every prompt whole, said once in the log."""
        if self.shared is not None:
            raise OwaiError(f"{self.label}: a shared_prefix block is already running")
        self.shared = SharedPrefix(self.prompt_ids, prompts)
        try:
            yield
        finally:
            self.shared = None

    def _prefix(self) -> SharedPrefix | None:
        """The running block's prefix, prefilled at its first call; None outside a block or where the
        prefix is not reused (under two prompts, no common token, a cache that cannot be copied)."""
        shared = self.shared
        if shared is None or shared.off or self.no_prefix_reuse is not None:
            return None
        if shared.cache is None:
            shared.locate()
            if shared.length < 1 or len(shared.known) < 2:
                shared.off = True
                return None
            with torch.no_grad():
                x = torch.tensor([shared.reference[:shared.length]], device=self.device)
                keep = {"logits_to_keep": 1} if self.keeps_logits else {}  # a 20k-token prefix's logits: 5 GB at 128k vocabulary
                from owai.models.hf_cache import output_cache

                cache = output_cache(self.model(input_ids=x, use_cache=True, **keep))
            reason = cache_not_reusable(cache)
            if reason is not None:
                from owai import console

                self.no_prefix_reuse = reason
                console.info(f"prefix cache: {self.label} ({getattr(self.model.config, 'model_type', '?')}) {reason}: "
                             "every prompt is prefilled whole")
                shared.off = True
                return None
            shared.cache = cache
        return shared

    def continuation_text(self, new: list[int], stop: tuple[str, ...]) -> str:
        """Generated tokens -> text, cut at the end-of-text token and before the earliest stop string
        (every suite's generation, and the harness's `generate_until`, read their answers this way)."""
        eot = getattr(self.tokenizer, "eot_id", None)
        if eot is not None and eot in new:
            new = new[: new.index(eot)]
        text = self.tokenizer.decode(new, skip_special=True)  # as the suites' official code reads answers
        cuts = [text.index(s) for s in stop if s and s in text]
        return text[: min(cuts)] if cuts else text

    @torch.no_grad()
    def loglikelihood(self, context: str, continuation: str) -> tuple[float, bool]:
        """(sum of log p(continuation tokens | context and the tokens before), whether every one of them
        is the argmax): lm-evaluation-harness's loglikelihood request, from full-sequence logits."""
        ctx, cont = self.tokenizer.encode(context), self.tokenizer.encode(continuation)
        if not cont:
            raise OwaiError(f"{self.label}: the continuation {continuation!r} encodes to no tokens")
        return self.score_tokens(ctx, cont)

    def score_tokens(self, context: list[int], continuation: list[int], max_length: int | None = None) -> tuple[float, bool]:
        """`loglikelihood` on token ids, the one scorer (owai's harness adapter calls it too): the
        sequence is cut to its last `max_length` (default: the model's) + 1 tokens, as the harness
        keeps the tail, and only the continuation tokens left in it are scored; an empty
        continuation is (0.0, True)."""
        if not continuation:
            return 0.0, True
        ids = context + continuation
        limit = max_length or self.max_tokens
        if limit:
            ids = ids[-(limit + 1):]
        n = min(len(continuation), len(ids) - 1)
        with torch.no_grad():
            x = torch.tensor([ids[:-1]], device=self.device)
            # the continuation's logits alone where the model can: the whole (T, V) logits of a long
            # context are T / n times larger (a 32k-token context, 128k vocabulary: 8.6 GB in bfloat16)
            keep = {"logits_to_keep": n} if self.keeps_logits else {}
            logits = self.model(input_ids=x, **keep).logits[0, -n:].float()  # (n, V)
        target = torch.tensor(continuation[-n:], device=logits.device)
        logp = torch.log_softmax(logits, dim=-1).gather(1, target[:, None])
        return float(logp.sum()), bool((logits.argmax(-1) == target).all())

    @contextlib.contextmanager
    def ablate(self, name: str) -> Iterator[None]:
        """Switch a part of the model off while the block runs (weights untouched)."""
        if name not in ABLATIONS:
            raise OwaiError(f"unknown ablation {name!r}; known: {', '.join(ABLATIONS)}")
        config = self.model.config
        if not hasattr(config, name):
            raise OwaiError(f"{self.label} ({getattr(config, 'model_type', type(self.model).__name__)}) has no {name} "
                            "to switch off")
        before = getattr(config, name)
        setattr(config, name, False)
        self.ablated.add(name)
        try:
            yield
        finally:
            setattr(config, name, before)
            self.ablated.discard(name)


class SharedPrefix:
    """The prompts of one `CausalLM.shared_prefix` block, their common token prefix and its cache.

    The prefix is token-level: the longest common prefix of the prompts' ids (`prompt_ids`, a BOS
    included), cut so that every prompt keeps at least one token of its own (its first logits come
    from its own prefill). BPE can merge the demonstrations' last characters with a query's first, so
    the prefix may end before the shared text does. Each prompt is encoded once (`locate`), kept as
    the reference's first `n` ids and its own tail, and `ids(prompt)` rebuilds it; `generate` never
    reads `cache` itself but a copy (`copy_cache`), since generation writes into the cache it is
    given: the prefix stays the one the prefill made, for every query and prompt set."""

    def __init__(self, encode: Callable[[str], list[int]], prompts: list[str]) -> None:
        self.encode, self.prompts = encode, list(prompts)
        self.reference: list[int] = []  # the first prompt's ids
        self.known: dict[str, tuple[int, list[int]]] = {}  # prompt -> (n, tail): reference[:n] + tail
        self.length = 0  # tokens of the shared prefix (0: none)
        self.cache: Any = None  # the prefix's cache once prefilled
        self.off = False  # no reuse in this block (too few prompts, no common token, a cache not reusable)

    def locate(self) -> None:
        """Encode the block's prompts once and find their common prefix (numpy compares the ids)."""
        import numpy as np

        common = None
        ref = np.zeros(0, dtype=np.int64)
        for prompt in self.prompts:
            if prompt in self.known:
                continue
            ids = self.encode(prompt)
            if common is None:
                self.reference, ref, common = list(ids), np.asarray(ids, dtype=np.int64), len(ids)
                self.known[prompt] = (len(ids), [])
                continue
            m = min(len(ids), len(ref))
            differ = np.flatnonzero(np.asarray(ids[:m], dtype=np.int64) != ref[:m])
            n = int(differ[0]) if differ.size else m
            self.known[prompt] = (n, list(ids[n:]))
            common = min(common, n)
        if common is None:
            return
        shortest = min(n + len(tail) for n, tail in self.known.values())
        self.length = max(0, min(common, shortest - 1))

    def ids(self, prompt: str) -> list[int]:
        """The prompt's ids: rebuilt from `locate`'s record, else encoded."""
        found = self.known.get(prompt)
        if found is None:
            return self.encode(prompt)
        n, tail = found
        return self.reference[:n] + tail

    def reusable(self, encoded: list[list[int]]) -> bool:
        """Whether every row starts with the prefix and has a token after it."""
        n = self.length
        head = self.reference[:n]
        return self.cache is not None and all(len(ids) > n and ids[:n] == head for ids in encoded)


def cache_not_reusable(cache: Any) -> str | None:
    """Why a prefix's cache cannot continue other prompts exactly, or None where it can: a model that
    returns no cache, or a cache of recurrent states alone (transformers' `generate` continues those
    from the new tokens only, not a prompt's whole ids, so the prefix would be read twice)."""
    if cache is None:
        return "returns no cache from its forward"
    linear = getattr(cache, "is_linear", None)
    if linear is not None and len(linear) and all(linear):
        return "keeps a recurrent state as its cache"
    return None


def repeats_along_batch(cache: Any) -> bool:
    """Whether `copy_cache` can repeat the cache for several prompts: a transformers cache where every
    layer has `batch_repeat_interleave` (5.24's linear-attention layers, in a hybrid model's cache
    beside its attention layers, have none), or a cache of owai's own that has it."""
    from transformers.cache_utils import Cache

    if isinstance(cache, Cache):  # it repeats layer by layer
        return all(hasattr(layer, "batch_repeat_interleave") for layer in cache.layers)
    return hasattr(cache, "batch_repeat_interleave")  # owai's Memory Mosaics caches


def copy_cache(cache: Any, rows: int) -> Any:
    """A copy of a prefix's cache for one `generate` call of `rows` prompts, repeated along the batch
    (the cache's own `batch_repeat_interleave`): `generate` writes each new token into the cache it is
    given, so a cache handed over twice would let one prompt read another's tokens."""
    out = copy.deepcopy(cache)
    if rows > 1:
        out.batch_repeat_interleave(rows)
    return out


def generate_all(model: Any, prompts: list[str], progress: Callable[[int], Any] | None = None,
                 answers: AnswerLog | None = None, **kwargs: Any) -> list[str]:
    """The continuations of `prompts` from any suite model: batched through `generate_many` where the
    model has it, else one `generate(prompt, **kwargs)` each. With `progress` (a progress bar's
    update), `progress(k)` after every k prompts answered: the prompts go to the model `batch_size`
    at a time, the batches `generate_many` makes itself, so the answers are the same. Batches of more
    than one prompt are made in order of length, longest first (`batch_order`); the answers come back
    in the prompts' order. With `answers` (the run's `AnswerLog`), a prompt answered before a kill is
    not asked again, and each batch's answers are logged once it is answered; the prompts left make
    the batches they made before.

    Under torchrun (more than one rank, `owai.distributed`) every rank holds the whole model and the
    same prompts, and the batches (the ones one process makes) go to the ranks in turn: in each round
    rank r answers the round's batch r, then every rank has every answer of the round, so each rank
    returns them all. `answers` is rank 0's log (None on the other ranks): rank 0 says which prompts
    were answered before a kill and logs each round's batches, so the log is one process's, and a run
    killed on W ranks resumes on any number."""
    from owai import distributed

    prompts = list(prompts)
    many = getattr(model, "generate_many", None)
    ranks = distributed.world()

    def answer(batch: list[str]) -> list[str]:
        texts = list(many(batch, **kwargs) if many is not None else [model.generate(p, **kwargs) for p in batch])
        if len(texts) != len(batch):
            raise OwaiError(f"{type(model).__name__} answered {len(texts)} of {len(batch)} prompts")
        return texts

    step = max(1, int(getattr(model, "batch_size", 1) or 1))

    def batch_order(todo: list[int]) -> list[int]:
        """Batches of similar lengths (less padding, and equal-length rows for the models that read
        none), longest first as lm-evaluation-harness orders them (a batch too large fails at once);
        by the prompts alone, so the prompts left after a kill make the batches they made before."""
        return sorted(todo, key=lambda i: -len(prompts[i])) if step > 1 else todo

    if progress is None and answers is None and ranks.world_size == 1:
        order = batch_order(list(range(len(prompts))))
        in_order = [""] * len(prompts)
        for i, text in zip(order, answer([prompts[i] for i in order])):
            in_order[i] = text
        return in_order
    out: list[Any] = [None] * len(prompts)
    keys = occurrence_keys(("generate", p, kwargs) for p in prompts) if answers is not None else []
    logged = {i: text for i, text in enumerate(answers.get(key, str) for key in keys) if text is not None}
    if ranks.world_size > 1:
        logged = distributed.broadcast_object(logged)  # rank 0's log, on every rank
    for i, text in logged.items():
        out[i] = text
    todo = [i for i in range(len(prompts)) if out[i] is None]
    if progress is not None and len(todo) < len(prompts):
        progress(len(prompts) - len(todo))  # answered before a kill
    todo = batch_order(todo)
    batches = [todo[start:start + step] for start in range(0, len(todo), step)]
    for first in range(0, len(batches), ranks.world_size):
        round_ = batches[first:first + ranks.world_size]
        mine = round_[ranks.rank] if ranks.rank < len(round_) else []
        texts = answer([prompts[i] for i in mine]) if mine else []
        answered = distributed.gather_objects(texts) if ranks.world_size > 1 else [texts]
        for batch, texts in zip(round_, answered):
            for i, text in zip(batch, texts):
                out[i] = text
            if answers is not None:
                answers.add_batch({keys[i]: out[i] for i in batch})
            if progress is not None:
                progress(len(batch))
    return out


def open_model(spec: str, tokenizer: str = "", device: torch.device | None = None, precision: str = "auto",
               reference_data: Any = None) -> Any:
    """The model `spec` names (module docstring): a CausalLM, or a reference model of the suite."""
    if spec.startswith(REFERENCE):
        if reference_data is None:
            raise OwaiError(f"{spec}: reference models belong to a suite (owai eval ruler / icl)")
        return reference_data(spec[len(REFERENCE):])
    path = Path(spec).expanduser()
    if path.exists():
        return _from_directory(path, tokenizer, device, precision)
    return _from_hub(spec, tokenizer, device, precision)


def check_model_choice(spec: str, references: str, ablate: Sequence[str] = ()) -> bool:
    """The checks every suite makes on its `model` and `ablate` settings before a run: a model is
    given (`references` names the suite's reference models for the message), the ablations are known,
    and a reference model is not asked to ablate anything. Returns whether `spec` is a reference."""
    if not spec:
        raise DataMissing(f"no model given: pass --model (a run or model directory, a Hugging Face id, or {references})")
    bad = [a for a in ablate if a not in ABLATIONS]
    if bad:
        raise OwaiError(f"ablate {bad}: known ablations are {', '.join(ABLATIONS)}")
    reference = spec.startswith(REFERENCE)
    if reference and ablate:
        raise OwaiError("reference models have nothing to ablate")
    return reference


def looks_like_path(spec: str) -> bool:
    """Whether a --model value is clearly a filesystem path rather than a hub id (NAME or OWNER/NAME):
    absolute, ./ ../ or ~ first, or more than one '/'. OWNER/NAME stays a hub id even where a folder
    OWNER exists here."""
    return spec in (".", "..") or spec.startswith(("/", "./", "../", "~")) or spec.count("/") > 1


def check_model(spec: str, tokenizer: str = "") -> tuple[int | None, Any]:
    """Before a run, without loading weights: a directory holds exactly one saved model whose
    embedding has a row for every token of its tokenizer (the recorded one, or `tokenizer`); a hub id
    is cached or reachable. Returns (the model's maximum length or None, its tokenizer or None), what
    the suites need to find prompts that would overflow; a reference name is left to its suite."""
    import json

    if spec.startswith(REFERENCE) and tokenizer:
        raise OwaiError(f"--tokenizer {tokenizer}: the reference model {spec} has no tokenizer to override; "
                        "drop --tokenizer, or pass a saved or hub --model")
    if spec.startswith(REFERENCE) or not spec:
        return None, None
    path = Path(spec).expanduser()
    if not path.exists() and looks_like_path(spec):  # not a hub id (owner/name) that failed: a path that is absent
        raise DataMissing(f"model path not found: {spec}")
    if not path.exists():  # a hub id: in the local cache, or the hub answers (one line, no minute of retries)
        from owai.data.text import check_tokenizer

        check_tokenizer(spec)
        return None, None
    from owai.data.text import load_tokenizer, tokenizer_for
    from owai.runs import model_dirs

    found = model_dirs(path)
    if len(found) != 1:
        raise OwaiError(f"{path} holds {len(found)} models ({', '.join(label for label, _ in found)}); "
                        f"name one: {path}/models/<arch>")
    label, directory = found[0]
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        raise OwaiError(f"{directory / 'config.json'} is not a model config (unreadable or not JSON)") from None
    from owai.models.lm import check_saved_weights

    check_saved_weights(directory)  # no weights, or a truncated or corrupt file: one line naming it
    name = tokenizer or tokenizer_for(directory, "")
    if not name:
        raise OwaiError(f"{directory} records no tokenizer (owai_tokenizer.json): pass one (e.g. gpt2 or a tokenizer.json)")
    tok = load_tokenizer(name)
    rows = config.get("vocab_size")
    if isinstance(rows, int) and tok.vocab_size > rows:
        raise OwaiError(f"tokenizer {name} has {tok.vocab_size} tokens but {label}'s embedding has {rows} rows: "
                        "not the model's tokenizer")
    return config_max_length(config), tok


# config keys that carry a model's context length: lm-evaluation-harness HFLM's, in its order, then seq_length
SEQLEN_KEYS = ("n_positions", "max_position_embeddings", "n_ctx", "seq_length")


def config_max_length(config: dict[str, Any]) -> int | None:
    """The longest sequence a model config (config.json's dict) allows. owai's models: a learned
    position table's length, else None (any length: RoPE / no-position models extrapolate; the suites
    report what they measure). Any other architecture as lm-evaluation-harness's HFLM reads it: the
    first of SEQLEN_KEYS set, in `text_config` for a composite model; None when none is."""
    kind = str(config.get("model_type") or "")
    if kind == "owai_gpt":
        return int(config["block_size"]) if config.get("position") == "learned" and config.get("block_size") else None
    if kind.startswith("owai_"):
        return None
    text = config.get("text_config") or config
    for key in SEQLEN_KEYS:
        value = text.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def check_ablation(spec: str, names: list[str]) -> None:
    """Before a run: a saved model directory must have the parts `names` switch off (its config field);
    a hub model is checked when it loads."""
    import json

    path = Path(spec).expanduser()
    if not names or spec.startswith(REFERENCE) or not path.exists():
        return
    from owai.runs import model_dirs

    for label, directory in model_dirs(path):
        config = json.loads((directory / "config.json").read_text())
        for name in names:
            if name not in config:
                raise OwaiError(f"{label} ({config.get('model_type', '?')}) has no {name} to switch off")


def _from_directory(path: Path, tokenizer: str, device: torch.device | None, precision: str) -> CausalLM:
    from owai.data.text import load_tokenizer, tokenizer_for
    from owai.runs import model_dirs
    from owai.models.lm import check_vocab, load_pretrained

    found = model_dirs(path)
    if len(found) != 1:
        raise OwaiError(f"{path} holds {len(found)} models ({', '.join(label for label, _ in found)}); name one: "
                        f"{path}/models/<arch>")
    label, directory = found[0]
    name = tokenizer or tokenizer_for(directory, "")
    if not name:
        raise OwaiError(f"{directory} records no tokenizer (owai_tokenizer.json): pass one (e.g. gpt2 or a tokenizer.json)")
    tok = load_tokenizer(name)
    model = load_pretrained(directory)
    check_vocab(model, tok.vocab_size)
    return CausalLM(model, tok, label, device, precision)


def _from_hub(name: str, tokenizer: str, device: torch.device | None, precision: str) -> CausalLM:
    from owai.data.text import load_tokenizer
    from owai.errors import one_line

    tok = load_tokenizer(tokenizer or name)  # a hub id the cache or the hub has; one line otherwise
    try:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, use_kernels=False)  # owai.models.lm.load_pretrained says why
    except Exception as exc:  # noqa: BLE001 - hub, cache and format errors: one line
        raise OwaiError(f"cannot load the model {name!r} ({one_line(exc)})") from None
    return CausalLM(model, tok, name, device, precision)
