"""Recall and in-context classification episodes planted in real text (issue #38).

Chapter 4's task claims (Tables 4.4, C.1, 4.6, Figs 4.6-4.9) rest on RULER and LongICLBench, which
a 6M-parameter model cannot follow. These episodes ask the same two questions at a laptop's scale,
inside real text (the State of the Union addresses), so a tiny model can learn them while it learns
the language:

recall (RULER's needles, MQAR-style: several facts, then every one queried)
    "... text ... The special magic number for river is 47. ... text ... The special magic number for
    river is 47. ..."   The fact is planted at a chosen distance before its query; the episode ends
    with the queries (each followed by its answer, scored by teacher forcing). Distances fall in
    buckets: `near` (inside the short-term window, under 256 tokens), `mid` (just past it, up to the
    training length) and `far` (past the training length: thousands of tokens at 4x / 8x).

in-context classification (LongICLBench's shape: demonstrations, then a query)
    K classes of fresh invented items (a new vocabulary per episode, so only the context can tell an
    item's class), `shots` labelled demonstrations per class " dova: river." spread through the
    text, then queries " dova:" -> " river". Labels are English words
    (`semantic`) or `class_j` (`anonymous`).

Episodes are token arrays built from token pieces (each piece encoded on its own, so the answer's
tokens are known exactly) and a filler window of real text; everything is a function of the numpy
generator passed in, so an episode is fixed by its seed. Nothing here knows a model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from owai.errors import OwaiError

KEYS = (
    "river mountain garden window bridge harbor candle forest castle island valley market station village "
    "lantern meadow desert engine mirror orchard pocket rocket saddle ticket tunnel wagon basket blanket "
    "button camera carpet cellar circle cotton doctor dragon farmer feather finger flower hammer helmet "
    "jacket kettle ladder letter marble needle number oyster painter parrot pencil pepper pillow planet "
    "pocket rabbit ribbon salmon shadow silver singer sister soldier spider spring summer sunset table "
    "teacher thunder tiger tomato turtle violin wallet winter wizard yellow anchor arrow barrel beacon"
).split()
SEMANTIC_LABELS = (
    "red blue green north south east west river stone bread music water fire winter summer money law war "
    "peace farm ship horse gold iron school church army navy city road"
).split()
FACT_PREFIX = " The special magic number for"
ICL_INPUT, ICL_LABEL = "", ":"
CONSONANTS, VOWELS = "bdfgklmnprstvz", "aeiou"


def buckets_for(window: int, train_length: int) -> dict[str, tuple[int, int | None]]:
    """The distance buckets: inside the short-term window, past it within the training length, beyond."""
    if not 0 < window < train_length:
        raise OwaiError(f"recall buckets need 0 < window ({window}) < training length ({train_length})")
    return {"near": (0, window), "mid": (window, train_length), "far": (train_length, None)}


def bucket_of(distance: int, window: int, train_length: int) -> str:
    """The bucket a distance falls in (see `buckets_for`)."""
    for name, (lo, hi) in buckets_for(window, train_length).items():
        if distance >= lo and (hi is None or distance < hi):
            return name
    raise OwaiError(f"distance {distance} is negative")


@dataclass(frozen=True)
class Query:
    """One scored answer: its tokens at `start` (teacher-forced), the planted evidence it copies
    (`source`: first token of the fact's value, or of the nearest demonstration's label; -1 when the
    query's item was never shown), `distance = start - source` and its bucket or class label."""

    start: int
    answer: tuple[int, ...]
    source: int
    distance: int
    group: str  # recall: the distance bucket; icl: "seen" or "unseen" (was the item demonstrated?)
    key: str


@dataclass
class Episode:
    tokens: np.ndarray  # int64 (length,)
    queries: list[Query]
    spans: list[tuple[int, int]] = field(default_factory=list)  # planted pieces [start, end), facts or demonstrations
    filler: int = 0  # tokens of real text


class Pieces:
    """Token pieces of the episodes under one tokenizer (`encode`: text -> ids), encoded once."""

    def __init__(self, encode: Callable[[str], list[int]], value_digits: int = 2) -> None:
        if not 1 <= value_digits <= 9:
            raise OwaiError(f"episodes.value_digits must be in 1..9, got {value_digits}")
        self.encode = encode
        self.value_digits = value_digits
        self.prefix = tuple(encode(FACT_PREFIX))
        self.is_ = tuple(encode(" is"))
        self.end = tuple(encode("."))
        self.input, self.label = tuple(encode(ICL_INPUT)) if ICL_INPUT else (), tuple(encode(ICL_LABEL))
        self._cache: dict[str, tuple[int, ...]] = {}

    def word(self, text: str) -> tuple[int, ...]:
        """" text" as tokens (cached)."""
        if text not in self._cache:
            self._cache[text] = tuple(self.encode(" " + text))
        return self._cache[text]

    @property
    def n_values(self) -> int:
        """How many values a fact can hold: chance recall is 1 / n_values."""
        return 9 * 10 ** (self.value_digits - 1)

    def value(self, rng: np.random.Generator) -> str:
        lo = 10 ** (self.value_digits - 1)
        return str(int(rng.integers(lo, 10 * lo)))


def _fill(length: int, pieces: list[tuple[int, tuple[int, ...]]], filler: np.ndarray) -> tuple[np.ndarray, int]:
    """A sequence of `length` tokens: each (start, tokens) piece at its place, the gaps filled with
    consecutive filler tokens (so the pieces sit inside running text). Returns (tokens, filler used)."""
    out = np.empty(length, dtype=np.int64)
    taken = np.zeros(length, dtype=bool)
    for start, toks in pieces:
        end = start + len(toks)
        if start < 0 or end > length or taken[start:end].any():
            raise AssertionError("pieces overlap or fall outside the episode")
        out[start:end] = toks
        taken[start:end] = True
    gaps = np.flatnonzero(~taken)
    if len(gaps) > len(filler):
        raise OwaiError(f"the filler text has {len(filler)} tokens; the episode needs {len(gaps)}")
    out[gaps] = filler[: len(gaps)]
    return out, int(len(gaps))


def _place(rng: np.random.Generator, length: int, sizes: Sequence[int], ranges: Sequence[tuple[int, int]],
           taken: list[tuple[int, int]], tries: int = 200) -> list[int] | None:
    """Start positions for pieces of `sizes`, each start uniform in its inclusive `ranges`, none
    overlapping each other or `taken`; None when rejection sampling fails."""
    for _ in range(tries):
        used = list(taken)
        starts = []
        for size, (lo, hi) in zip(sizes, ranges):
            if hi < lo:
                return None
            s = int(rng.integers(lo, hi + 1))
            if any(s < b and a < s + size for a, b in used) or s < 0 or s + size > length:
                break
            used.append((s, s + size))
            starts.append(s)
        else:
            return starts
    return None


def recall_episode(rng: np.random.Generator, pieces: Pieces, filler: np.ndarray, length: int,
                   buckets: Sequence[str] | None = None, n_facts: int = 4, window: int = 256,
                   train_length: int = 512) -> Episode:
    """`length` tokens of text with facts planted in it and, at its end, one query per fact.

    `buckets`: one distance bucket per fact (evaluation; `buckets_for(window, train_length)`), or
    None for `n_facts` facts anywhere before the queries (training). Keys are distinct; every fact
    is queried once, in random order. Raises OwaiError when the facts cannot fit."""
    spans = buckets_for(window, train_length)
    names = list(buckets) if buckets is not None else [""] * n_facts
    if not names:
        raise OwaiError("a recall episode needs at least one fact")
    if len(names) > len(KEYS):
        raise OwaiError(f"at most {len(KEYS)} facts per episode, got {len(names)}")
    for name in names:
        if name and name not in spans:
            raise OwaiError(f"unknown distance bucket {name!r} (buckets: {', '.join(spans)})")
    keys = [str(k) for k in rng.choice(sorted(set(KEYS)), size=len(names), replace=False)]
    values = [pieces.value(rng) for _ in names]
    lead = [pieces.prefix + pieces.word(k) + pieces.is_ for k in keys]  # the query's prompt = the fact's start
    order = rng.permutation(len(names))
    block: list[int] = []
    answer_at: dict[int, int] = {}
    for i in order:
        block += lead[i]
        answer_at[int(i)] = len(block)
        block += pieces.word(values[i]) + pieces.end
    block_start = length - len(block)
    facts = [lead[i] + pieces.word(values[i]) + pieces.end for i in range(len(names))]
    if buckets is None:
        start_of = _spread(rng, block_start, facts)
    else:
        start_of = _in_buckets(rng, block_start, facts, [len(t) for t in lead], [block_start + answer_at[i] for i in range(len(names))],
                               [spans[n] for n in names])
        if start_of is None:
            raise OwaiError(f"cannot plant {len(names)} facts ({', '.join(names)}) in {length} tokens")
    placed = [(start_of[i], facts[i]) for i in range(len(names))]
    placed.append((block_start, tuple(block)))
    tokens, used = _fill(length, placed, filler)
    queries = []
    for i in range(len(names)):
        source = start_of[i] + len(lead[i])
        start = block_start + answer_at[i]
        queries.append(Query(start, pieces.word(values[i]), source, start - source,
                             bucket_of(start - source, window, train_length), keys[i]))
    queries.sort(key=lambda q: q.start)
    return Episode(tokens, queries, [(s, s + len(t)) for s, t in placed[:-1]], used)


def _spread(rng: np.random.Generator, room_end: int, facts: list[tuple[int, ...]]) -> dict[int, int]:
    """Training: the facts anywhere in [0, room_end), in random order with uniform random text gaps
    between them (so any number of facts that fits is placed, however dense)."""
    room = room_end - sum(len(f) for f in facts)
    if room < 0:
        raise OwaiError(f"cannot plant {len(facts)} facts before their queries: they take {room_end - room} tokens, "
                        f"{max(room_end, 0)} are left")
    start_of, offset = {}, 0
    for cut, i in zip(np.sort(rng.integers(0, room + 1, size=len(facts))), rng.permutation(len(facts))):
        start_of[int(i)] = int(cut) + offset
        offset += len(facts[int(i)])
    return start_of


def _in_buckets(rng: np.random.Generator, room_end: int, facts: list[tuple[int, ...]], leads: list[int], answers: list[int],
                spans: list[tuple[int, int | None]]) -> dict[int, int] | None:
    """Evaluation: fact i's value at a distance from its answer (position `answers[i]`) inside
    `spans[i]` = [lo, hi), no fact overlapping another or the queries; None when sampling fails."""
    ranges = []  # each fact's start range; a function of the shapes alone, so computed once for every try
    for fact, lead, answer, (lo_d, hi_d) in zip(facts, leads, answers, spans):
        lo_v, hi_v = lead, room_end - len(fact) + lead  # value positions that fit before the queries
        lo_v = max(lo_v, answer - (hi_d - 1 if hi_d is not None else answer))
        hi_v = min(hi_v, answer - max(lo_d, 1))
        ranges.append((lo_v - lead, hi_v - lead))
    # the tightest ranges first, so rejection rarely fails
    rank = sorted(range(len(facts)), key=lambda j: ranges[j][1] - ranges[j][0])
    for _ in range(50):
        starts = _place(rng, room_end, [len(facts[j]) for j in rank], [ranges[j] for j in rank], [])
        if starts is not None:
            return {j: s for j, s in zip(rank, starts)}
    return None


def invented_words(rng: np.random.Generator, n: int, taken: set[str] | None = None) -> list[str]:
    """`n` distinct invented words of 2 consonant-vowel syllables ("dova"): items no text holds."""
    seen = set(taken or ())
    out: list[str] = []
    while len(out) < n:
        w = "".join(CONSONANTS[rng.integers(len(CONSONANTS))] + VOWELS[rng.integers(len(VOWELS))] for _ in range(2))
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


def icl_episode(rng: np.random.Generator, pieces: Pieces, filler: np.ndarray, length: int, shots: int,
                labels: str = "semantic", classes: int = 4, items_per_class: int = 8, n_queries: int = 4) -> Episode:
    """`length` tokens of text carrying `shots` demonstrations per class (items of each class taken
    in a random cycle, so `shots` >= items_per_class shows every item), spread at random through
    the text, then `n_queries` queries (each of a class drawn uniformly, its item uniform over the
    class's items: an item shown or not; no item asked twice while the class has unasked items)."""
    if labels not in ("semantic", "anonymous"):
        raise OwaiError(f"labels must be semantic or anonymous, got {labels!r}")
    if classes < 2 or items_per_class < 1 or shots < 1 or n_queries < 1:
        raise OwaiError("an icl episode needs >= 2 classes, >= 1 item per class, >= 1 shot and >= 1 query")
    if labels == "semantic":
        if classes > len(SEMANTIC_LABELS):
            raise OwaiError(f"at most {len(SEMANTIC_LABELS)} semantic labels, got {classes} classes")
        names = [str(w) for w in rng.choice(SEMANTIC_LABELS, size=classes, replace=False)]
    else:
        names = [f"class_{j}" for j in rng.permutation(classes)]
    words = invented_words(rng, classes * items_per_class)
    items = [words[c * items_per_class:(c + 1) * items_per_class] for c in range(classes)]
    demos: list[tuple[int, str]] = []
    for c in range(classes):
        cycle: list[str] = []
        while len(cycle) < shots:
            cycle += [items[c][int(i)] for i in rng.permutation(items_per_class)]
        demos += [(c, w) for w in cycle[:shots]]
    demos = [demos[int(i)] for i in rng.permutation(len(demos))]

    def demo(c: int, w: str) -> tuple[int, ...]:
        return pieces.input + pieces.word(w) + pieces.label + pieces.word(names[c]) + pieces.end

    block: list[int] = []
    asked: list[tuple[int, str, int]] = []
    for _ in range(n_queries):
        # each query's class drawn on its own: with classes in turn, the answers already given in the
        # block would tell the next one (the last class left, or the label from `classes` queries back)
        c = int(rng.integers(classes))
        w = items[c][int(rng.integers(items_per_class))]
        while any(w == a[1] for a in asked) and sum(a[0] == c for a in asked) < items_per_class:
            w = items[c][int(rng.integers(items_per_class))]  # no item asked twice: a second query could copy the first's answer
        block += pieces.input + pieces.word(w) + pieces.label
        asked.append((c, w, len(block)))
        block += pieces.word(names[c]) + pieces.end
    block_start = length - len(block)
    shown = [demo(c, w) for c, w in demos]
    room = block_start - sum(len(d) for d in shown)
    if room < 0:
        raise OwaiError(f"{len(shown)} demonstrations do not fit in {length} tokens; use fewer shots or a longer length")
    cuts = np.sort(rng.integers(0, room + 1, size=len(shown)))  # filler tokens before each demonstration
    placed, offset = [], 0
    for cut, toks in zip(cuts, shown):
        placed.append((int(cut) + offset, toks))
        offset += len(toks)
    placed.append((block_start, tuple(block)))
    tokens, used = _fill(length, placed, filler)
    label_at = {}  # item -> position of the label of its last demonstration
    for (c, w), (s, _) in zip(demos, placed[:-1]):
        label_at[w] = s + len(pieces.input + pieces.word(w) + pieces.label)
    queries = []
    for c, w, off in asked:
        start = block_start + off
        source = label_at.get(w, -1)
        queries.append(Query(start, pieces.word(names[c]), source, start - source if source >= 0 else -1,
                             "seen" if source >= 0 else "unseen", w))
    return Episode(tokens, queries, [(s, s + len(t)) for s, t in placed[:-1]], used)


def training_episode(rng: np.random.Generator, pieces: Pieces, filler: np.ndarray, length: int, icl_share: float,
                     max_facts: int, max_shots: int, classes: int, items_per_class: int, queries_per_class: int = 1) -> Episode:
    """One episode of the training mixture: in-context classification with probability `icl_share`
    (shots uniform in 1..max_shots, labels semantic or anonymous, `queries_per_class` queries per
    class), else recall (1..max_facts facts anywhere before their queries)."""
    if rng.random() < icl_share:
        shots = int(rng.integers(1, max_shots + 1))
        labels = "semantic" if rng.random() < 0.5 else "anonymous"
        return icl_episode(rng, pieces, filler, length, shots, labels, classes, items_per_class, n_queries=classes * queries_per_class)
    return recall_episode(rng, pieces, filler, length, None, int(rng.integers(1, max_facts + 1)))
