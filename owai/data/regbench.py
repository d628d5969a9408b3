"""RegBench (in-context language learning; Akyurek et al. 2024; thesis sec 3.5, Fig 3.10, Table B.3).

owai's implementation of the `berlino/seq_icl` `ICLDFADataModule` generator (spec:
shared/specs/evals.md sec 3.1), draw for draw. One "environment" is a random DFA turned into a PFA by
choosing uniformly among the outgoing edges of the current state; each environment yields one
sequence of 10..19 strings (lengths 1..49) joined by the separator `|`.

Vocabulary (ids from sorting the symbols): `.` (pad / no-op) = 0, letters `a..r` = 1..18,
`|` = 19 (for the default `vocab_size=20`; in general `vocab_size - 2` letters).

Labels: `labels = ids[1:]` with separator targets and padding set to `IGNORE_INDEX = -100`
(the reference's / PyTorch's ignore value), inputs padded with `.` (id 0).

Splits: the master RNG's shuffle of the first `num_examples + num_test_examples` candidate DFAs
(minimised) gives train = first `num_examples`, test = next `num_test_examples // 2`, val = the
rest. Like seq_icl, candidates are not deduplicated: its `set` of DFAs never merges two, since its
DFA class has a hash but no `__eq__`. So a held-out automaton can, rarely, have a training
automaton's language (0.1 % of candidates at 2,000, 1.2 % at 41,000); `dedup=True` (an owai
option) skips such repeats. With the same seed the candidates, the splits and the token sequences
are seq_icl's, up to two orders that depend on PYTHONHASHSEED there (tests/test_official_code.py).
With `iid=True` (thesis Table B.3) val and test instead hold one *new* sequence from each training
automaton.
"""

from __future__ import annotations

import dataclasses
import string
from collections import deque
from dataclasses import dataclass

import numpy as np

from owai.errors import OwaiError

IGNORE_INDEX = -100
PAD_SYMBOL = "."
SEPARATOR_SYMBOL = "|"


@dataclass(frozen=True)
class RegBenchConfig:
    """Parameters under the seq_icl names (`configs/dataset/icl_dfa.yaml`)."""

    num_examples: int = 100  # training automata = training sequences
    num_test_examples: int = 500  # split in half: test, val (seq_icl sweeps use 1000)
    vocab_size: int = 20  # letters + separator + pad
    max_num_nodes: int = 12
    max_num_in_context_examples: int = 20  # exclusive upper bound: 10..19 strings
    min_num_in_context_examples: int = 10
    max_outgoing_edges: int = 4  # exclusive upper bound: 1..3 edges; also min #states/#letters
    max_len_per_example: int = 50  # exclusive upper bound: string lengths 1..49
    seed: int = 0
    iid: bool = False  # Table B.3: val/test sequences drawn from the training automata
    dedup: bool = False  # owai option: skip candidates whose minimised automaton repeats an earlier one

    def __post_init__(self) -> None:
        n_letters = self.vocab_size - 2
        checks = [
            (self.num_examples >= 1, "num_examples must be >= 1"),
            (self.num_test_examples >= 0, "num_test_examples must be >= 0"),
            (2 <= self.max_outgoing_edges, "max_outgoing_edges must be >= 2"),
            (
                self.max_outgoing_edges <= n_letters <= 26,
                f"vocab_size must be in [{self.max_outgoing_edges + 2}, 28] "
                "(letters = vocab_size - 2 >= max_outgoing_edges)",
            ),
            (
                self.max_num_nodes >= self.max_outgoing_edges,
                "max_num_nodes must be >= max_outgoing_edges",
            ),
            (
                1 <= self.min_num_in_context_examples < self.max_num_in_context_examples,
                "need 1 <= min_num_in_context_examples < max_num_in_context_examples",
            ),
            (self.max_len_per_example >= 2, "max_len_per_example must be >= 2"),
        ]
        for ok, msg in checks:
            if not ok:
                raise OwaiError(f"regbench config: {msg}")

    # --- vocabulary -------------------------------------------------------------------------
    @property
    def symbols(self) -> tuple[str, ...]:
        letters = string.ascii_lowercase[: self.vocab_size - 2]
        return tuple(sorted([PAD_SYMBOL, SEPARATOR_SYMBOL, *letters]))

    @property
    def pad_id(self) -> int:
        return self.symbols.index(PAD_SYMBOL)

    @property
    def sep_id(self) -> int:
        return self.symbols.index(SEPARATOR_SYMBOL)

    @property
    def letter_ids(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.symbols) if s not in (PAD_SYMBOL, SEPARATOR_SYMBOL))


# Transition table: per state, a sorted tuple of (symbol_id, next_state). Missing symbol = reject.
Table = tuple[tuple[tuple[int, int], ...], ...]


@dataclass(frozen=True)
class PFA:
    """A (minimised) DFA read as a PFA: from each state, uniform over its outgoing symbols.

    Start state 0, all states accepting. `num_states_raw` is the state count before minimisation.
    """

    transitions: Table
    vocab_size: int
    sep_id: int
    num_states_raw: int = 0

    @property
    def num_states(self) -> int:
        return len(self.transitions)

    def step(self, state: int, symbol: int) -> int | None:
        for s, nxt in self.transitions[state]:
            if s == symbol:
                return nxt
        return None

    def accepts(self, word) -> bool:
        state: int | None = 0
        for sym in word:
            state = self.step(state, int(sym))
            if state is None:
                return False
        return True

    def next_distribution(self, state: int) -> np.ndarray:
        p = np.zeros(self.vocab_size)
        out = self.transitions[state]
        for s, _ in out:
            p[s] = 1.0 / len(out)
        return p

    def string_prob(self, word) -> float:
        """Probability that a walk from the start state emits `word` as its first len(word) symbols."""
        state, prob = 0, 1.0
        for sym in word:
            out = self.transitions[state]
            nxt = self.step(state, int(sym))
            if nxt is None:
                return 0.0
            prob /= len(out)
            state = nxt
        return prob

    def states_along(self, input_ids) -> np.ndarray:
        """State after reading the current partial string, at every position of `input_ids`.

        The partial string restarts after each separator; padding positions get -1, positions
        after an illegal symbol get -2 (never happens on generated data).
        """
        ids = np.asarray(input_ids)
        out = np.full(len(ids), -1, dtype=np.int64)
        state: int | None = 0
        for t, tok in enumerate(ids.tolist()):
            if tok == self.sep_id:
                state = 0
            elif state is not None and state >= 0:
                state = self.step(state, tok)
            if tok == 0:  # pad `.` (always id 0: '.' sorts before letters and '|')
                out[t] = -1
            else:
                out[t] = -2 if state is None else state
        return out

    def next_distributions(self, input_ids) -> np.ndarray:
        """(T, V) exact next-symbol distribution at every input position (zeros at pad/illegal)."""
        states = self.states_along(input_ids)
        table = np.stack([self.next_distribution(s) for s in range(self.num_states)])
        out = np.zeros((len(states), self.vocab_size))
        ok = states >= 0
        out[ok] = table[states[ok]]
        return out

    def sample_string(self, length: int, rng: np.random.Generator) -> list[int]:
        state, word = 0, []
        for _ in range(length):
            syms = [s for s, _ in self.transitions[state]]
            sym = int(rng.choice(syms))
            word.append(sym)
            state = self.step(state, sym)
        return word


# --- random automata -----------------------------------------------------------------------


def sample_raw_dfa(
    num_nodes: int, alphabet: list[int], max_outgoing_edges: int, rng: np.random.Generator
) -> list[dict[int, int]]:
    """Random DFA: per state 1..max_outgoing_edges-1 distinct symbols, distinct non-self targets."""
    transitions: list[dict[int, int]] = []
    for s in range(num_nodes):
        k = int(rng.integers(1, max_outgoing_edges))
        syms = rng.choice(np.asarray(alphabet), size=k, replace=False)
        others = np.asarray([x for x in range(num_nodes) if x != s])
        targets = rng.choice(others, size=k, replace=False)
        transitions.append({int(a): int(b) for a, b in zip(syms, targets)})
    return transitions


def minimize(transitions: list[dict[int, int]]) -> Table:
    """Trim (keep states reachable from 0) and Moore-minimise a partial, all-accepting DFA.

    The result is canonically relabelled (BFS from state 0, symbols in increasing order), so two
    DFAs with the same language get the identical table (the key for `dedup` and for comparing languages).
    """
    reach, queue = {0}, deque([0])
    while queue:
        s = queue.popleft()
        for t in transitions[s].values():
            if t not in reach:
                reach.add(t)
                queue.append(t)
    states = sorted(reach)
    block = {s: 0 for s in states}  # all accepting; the implicit reject sink is its own class
    while True:
        sigs = {
            s: (block[s], tuple(sorted((a, block[t]) for a, t in transitions[s].items())))
            for s in states
        }
        ids: dict[tuple, int] = {}
        new = {s: ids.setdefault(sigs[s], len(ids)) for s in states}
        if len(ids) == len(set(block.values())):
            block = new
            break
        block = new
    # quotient automaton + canonical BFS relabelling
    quot: dict[int, dict[int, int]] = {}
    for s in states:
        quot.setdefault(block[s], {a: block[t] for a, t in transitions[s].items()})
    label, order, queue = {block[0]: 0}, [block[0]], deque([block[0]])
    while queue:
        b = queue.popleft()
        for a in sorted(quot[b]):
            c = quot[b][a]
            if c not in label:
                label[c] = len(label)
                order.append(c)
                queue.append(c)
    return tuple(tuple(sorted((a, label[c]) for a, c in quot[b].items())) for b in order)


# --- dataset -------------------------------------------------------------------------------


@dataclass
class RegBenchSplit:
    """One split: full token sequences (string1|string2|...), their PFAs, padding helpers."""

    sequences: list[np.ndarray]
    pfas: list[PFA]
    pad_id: int
    sep_id: int

    def __len__(self) -> int:
        return len(self.sequences)

    def batch(self, indices=None) -> tuple[np.ndarray, np.ndarray, list[PFA]]:
        """(inputs (N,T) padded with pad_id, labels (N,T) with -100 at separators/pad, pfas)."""
        idx = range(len(self)) if indices is None else indices
        seqs = [self.sequences[i] for i in idx]
        T = max(len(s) - 1 for s in seqs)
        inputs = np.full((len(seqs), T), self.pad_id, dtype=np.int64)
        labels = np.full((len(seqs), T), IGNORE_INDEX, dtype=np.int64)
        for n, s in enumerate(seqs):
            inputs[n, : len(s) - 1] = s[:-1]
            lab = s[1:].copy()
            lab[lab == self.sep_id] = IGNORE_INDEX
            labels[n, : len(s) - 1] = lab
        return inputs, labels, [self.pfas[i] for i in idx]

    def torch_batch(self, indices=None):
        import torch

        x, y, pfas = self.batch(indices)
        return torch.from_numpy(x), torch.from_numpy(y), pfas


@dataclass
class RegBenchData:
    config: RegBenchConfig
    train: RegBenchSplit
    val: RegBenchSplit
    test: RegBenchSplit
    num_candidates: int  # candidate DFAs drawn
    num_unique: int  # distinct minimised DFAs among them
    num_examples: int  # after the reference's proportional scale-down (if too few candidates)
    num_test_examples: int

    @property
    def symbols(self) -> tuple[str, ...]:
        return self.config.symbols

    def decode(self, ids) -> str:
        return "".join(self.config.symbols[int(i)] for i in ids)


def _sequence(
    pfa: PFA, cfg: RegBenchConfig, master: np.random.Generator, dfa_rng: np.random.Generator
) -> np.ndarray:
    n_strings = int(master.integers(cfg.min_num_in_context_examples, cfg.max_num_in_context_examples))
    out: list[int] = []
    for i in range(n_strings):
        length = int(master.integers(1, cfg.max_len_per_example))
        if i:
            out.append(cfg.sep_id)
        out.extend(pfa.sample_string(length, dfa_rng))
    return np.asarray(out, dtype=np.int64)


def make_regbench(config: RegBenchConfig | None = None, **overrides) -> RegBenchData:
    """Generate the train/val/test splits; deterministic in `config.seed`."""
    cfg = config or RegBenchConfig()
    if overrides:
        unknown = set(overrides) - {f.name for f in dataclasses.fields(RegBenchConfig)}
        if unknown:
            raise OwaiError(f"regbench config: unknown parameter(s) {sorted(unknown)}")
        cfg = dataclasses.replace(cfg, **overrides)
    master = np.random.default_rng(cfg.seed)
    letters = list(cfg.letter_ids)
    wanted = cfg.num_examples + (0 if cfg.iid else cfg.num_test_examples)
    candidates: list[tuple[Table, int, np.random.Generator]] = []  # (minimised table, raw states, string rng)
    seen: set[Table] = set()
    n_cand = 0
    for _ in range(10 * cfg.num_examples):  # the reference's candidate budget
        n_cand += 1
        num_nodes = int(master.integers(cfg.max_outgoing_edges, cfg.max_num_nodes + 1))
        num_alpha = int(master.integers(cfg.max_outgoing_edges, len(letters) + 1))
        alphabet = [int(a) for a in master.choice(np.asarray(letters), size=num_alpha, replace=False)]
        sampler = np.random.default_rng(int(master.integers(0, 2**32)))
        raw = sample_raw_dfa(num_nodes, alphabet, cfg.max_outgoing_edges, sampler)
        table = minimize(raw)
        dfa_rng = np.random.default_rng(int(sampler.integers(0, 2**32)))
        if not (cfg.dedup and table in seen):
            candidates.append((table, num_nodes, dfa_rng))
        seen.add(table)
        if len(candidates) >= wanted:
            break
    candidates = [candidates[i] for i in master.permutation(len(candidates))]  # seq_icl: rng.shuffle
    n_ex, n_test = cfg.num_examples, (0 if cfg.iid else cfg.num_test_examples)
    if len(candidates) < n_ex + n_test:  # reference: scale the split sizes down proportionally
        n_ex = (len(candidates) * cfg.num_examples) // (cfg.num_examples + n_test)
        n_test = len(candidates) - n_ex
        if n_ex < 1:
            raise OwaiError("regbench: too few automata for the requested split sizes")
    pfas = [PFA(t, cfg.vocab_size, cfg.sep_id, num_states_raw=n) for t, n, _ in candidates]
    rngs = [r for _, _, r in candidates]
    train_ids = range(n_ex)  # positions in the shuffled candidates
    if cfg.iid:
        test_ids = val_ids = train_ids
        n_test_out = 2 * n_ex
    else:  # seq_icl: test the next n_test // 2, val the rest (one more when n_test is odd)
        test_ids, val_ids = range(n_ex, n_ex + n_test // 2), range(n_ex + n_test // 2, n_ex + n_test)
        n_test_out = n_test

    def split(ids: range) -> RegBenchSplit:
        seqs = [_sequence(pfas[i], cfg, master, rngs[i]) for i in ids]
        return RegBenchSplit(seqs, [pfas[i] for i in ids], cfg.pad_id, cfg.sep_id)

    train = split(train_ids)  # order as in the reference: train, test, val
    test = split(test_ids)
    val = split(val_ids)
    return RegBenchData(cfg, train, val, test, n_cand, len(seen), n_ex, n_test_out)
