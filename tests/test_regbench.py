"""RegBench generator, metrics and the in-context 3-gram baseline (fast, CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from owai.data.regbench import (
    IGNORE_INDEX,
    PFA,
    RegBenchConfig,
    make_regbench,
    minimize,
    sample_raw_dfa,
)
from owai.errors import OwaiError
from owai.evals.regbench import (
    exact_distributions,
    ngram_backoff_probs,
    regbench_metrics,
    uniform_probs,
)

SMALL = dict(num_examples=30, num_test_examples=20, seed=1)


@pytest.fixture(scope="module")
def data():
    return make_regbench(**SMALL)


def _tables(split):
    return [p.transitions for p in split.pfas]


def test_vocab_and_config():
    cfg = RegBenchConfig()
    assert cfg.symbols[0] == "." and cfg.symbols[-1] == "|" and len(cfg.symbols) == 20
    assert (cfg.pad_id, cfg.sep_id) == (0, 19)
    with pytest.raises(OwaiError):
        RegBenchConfig(vocab_size=4)
    with pytest.raises(OwaiError):
        make_regbench(num_exampels=3)


def test_same_seed_identical(data):
    again = make_regbench(**SMALL)
    for a, b in [(data.train, again.train), (data.val, again.val), (data.test, again.test)]:
        assert _tables(a) == _tables(b)
        assert all(np.array_equal(x, y) for x, y in zip(a.sequences, b.sequences))
    other = make_regbench(**{**SMALL, "seed": 2})
    assert _tables(other.train) != _tables(data.train)


def test_splits_disjoint_and_sizes(data):
    tr, va, te = (set(_tables(s)) for s in (data.train, data.val, data.test))
    assert len(data.train) == 30 and len(data.val) == 10 and len(data.test) == 10
    assert len(tr) == 30 and len(va) == 10 and len(te) == 10  # no two automata repeat a language here
    assert not (tr & va) and not (tr & te) and not (va & te)
    assert data.num_candidates == data.num_unique == 50


# one edge per state over 2 letters and 2-3 states: few languages, so candidates repeat them
REPEATING = dict(vocab_size=4, max_num_nodes=3, max_outgoing_edges=2, num_examples=6, num_test_examples=4, seed=0)


def test_candidates_repeat_as_in_seq_icl_unless_dedup():
    """seq_icl keeps every candidate (its DFAs never compare equal): the first 10 fill the splits even
    though they hold 4 languages. `dedup=True` draws on (up to 10 x 6) until 10 languages."""
    kept = make_regbench(**REPEATING)
    assert (kept.num_candidates, kept.num_unique) == (10, 4)
    assert (len(kept.train), len(kept.test), len(kept.val)) == (6, 2, 2)
    assert len(set(_tables(kept.train))) < 6
    deduped = make_regbench(**REPEATING, dedup=True)
    assert deduped.num_candidates > 10 and deduped.num_unique == 10
    tables = _tables(deduped.train) + _tables(deduped.test) + _tables(deduped.val)
    assert len(tables) == len(set(tables)) == 10


def test_odd_held_out_count_goes_to_val():
    d = make_regbench(num_examples=4, num_test_examples=5, seed=0)
    assert (len(d.train), len(d.test), len(d.val)) == (4, 2, 3)


def test_iid_variant_uses_training_automata():
    d = make_regbench(num_examples=10, num_test_examples=20, seed=0, iid=True)
    assert _tables(d.test) == _tables(d.train) == _tables(d.val)
    assert not any(np.array_equal(a, b) for a, b in zip(d.train.sequences, d.test.sequences))


def test_sequence_shape_and_legality(data):
    cfg = data.config
    for seq, pfa in zip(data.train.sequences, data.train.pfas):
        strings = np.split(seq, np.where(seq == cfg.sep_id)[0])
        strings = [s[s != cfg.sep_id] for s in strings]
        assert 10 <= len(strings) <= 19
        assert all(1 <= len(s) <= 49 for s in strings)
        assert all(pfa.accepts(s) for s in strings)
        assert 1 <= pfa.num_states <= pfa.num_states_raw <= 12
        for state in pfa.transitions:
            assert 1 <= len(state) <= 3
        assert seq.min() >= 1  # no pad inside a sequence


def test_no_training_target_is_separator(data):
    x, y, _ = data.train.batch()
    sep = data.config.sep_id
    assert not (y == sep).any()
    assert ((x == sep)[:, 1:] == (y == IGNORE_INDEX)[:, :-1] & (x != 0)[:, 1:]).all()
    assert (y[x == 0] == IGNORE_INDEX).all()


def test_minimisation_keeps_string_distribution():
    rng = np.random.default_rng(0)
    cfg = RegBenchConfig()
    n_shrunk = 0
    for _ in range(60):
        n = int(rng.integers(4, 13))
        alphabet = [int(a) for a in rng.choice(np.arange(1, 19), size=int(rng.integers(4, 19)), replace=False)]
        raw_t = sample_raw_dfa(n, alphabet, 4, rng)
        raw = PFA(tuple(tuple(sorted(d.items())) for d in raw_t), 20, cfg.sep_id)
        mini = PFA(minimize(raw_t), 20, cfg.sep_id)
        n_shrunk += mini.num_states < n
        assert minimize([dict(s) for s in mini.transitions]) == mini.transitions  # idempotent
        for _ in range(5):
            word = raw.sample_string(30, rng)
            assert raw.string_prob(word) == pytest.approx(mini.string_prob(word))
            seq = np.asarray(word, dtype=np.int64)
            np.testing.assert_allclose(raw.next_distributions(seq), mini.next_distributions(seq))
        # random (mostly rejected) strings: same probability, incl. 0
        for _ in range(5):
            word = rng.choice(alphabet, size=3).tolist()
            assert raw.string_prob(word) == pytest.approx(mini.string_prob(word))
    assert n_shrunk > 0  # minimisation actually did something


def test_oracle_and_uniform(data):
    x, _, pfas = data.test.batch()
    true = exact_distributions(x, pfas)
    for positions in ("all", "last-string"):
        m = regbench_metrics(true, x, pfas, positions=positions)
        assert m["accuracy"] == 1.0 and m["tvd"] == pytest.approx(0.0, abs=1e-12)
    # logits path + torch inputs
    logits = torch.log(torch.from_numpy(true) + 1e-30)
    m = regbench_metrics(logits, torch.from_numpy(x), pfas, from_logits=True)
    assert m["accuracy"] == 1.0 and m["tvd"] < 1e-6

    m = regbench_metrics(uniform_probs(x, 20), x, pfas)
    assert m["accuracy"] == 0.0  # argmax tie -> id 0 = `.`, never legal
    k = (true > 0).sum(-1)[x != 0]
    expected = np.mean(2 * (1 - k / 20))
    assert m["tvd"] == pytest.approx(expected) and m["tvd_half"] == pytest.approx(expected / 2)
    assert 1.7 < m["tvd"] < 1.9


def test_position_rules(data):
    x, _, pfas = data.test.batch([0])
    m_all = regbench_metrics(exact_distributions(x, pfas), x, pfas)
    sep = data.config.sep_id
    n = int((x != 0).sum())
    assert m_all["num_tvd_positions"] == n
    assert m_all["num_accuracy_positions"] == n - int((x[0, 1:] == sep).sum())
    m_last = regbench_metrics(exact_distributions(x, pfas), x, pfas, positions="last-string")
    last_sep = int(np.where(x[0] == sep)[0][-1])
    assert m_last["num_tvd_positions"] == n - last_sep
    with pytest.raises(OwaiError):
        regbench_metrics(exact_distributions(x, pfas), x, pfas, positions="last")


def test_ngram_baseline_between_uniform_and_oracle(data):
    x, _, pfas = data.test.batch()
    probs = ngram_backoff_probs(x, 20, data.config.sep_id)  # as seq_icl scores it: some rows sum to < 1
    nonpad = x != 0
    sums = probs.sum(-1)[nonpad]
    assert (sums <= 1 + 1e-9).all() and (sums < 1 - 1e-3).any()
    renormalised = ngram_backoff_probs(x, 20, data.config.sep_id, normalize=True)
    np.testing.assert_allclose(renormalised.sum(-1)[nonpad], 1.0, atol=1e-9)
    short = sums < 1 - 1e-9  # rows already summing to 1 are the same either way
    np.testing.assert_allclose(renormalised[nonpad][~short], probs[nonpad][~short], atol=1e-12)
    assert (probs[..., data.config.sep_id] == 0).all()
    m = regbench_metrics(probs, x, pfas)
    u = regbench_metrics(uniform_probs(x, 20), x, pfas)
    assert 0.6 < m["accuracy"] < 1.0
    assert 0.0 < m["tvd"] < u["tvd"]
    assert 0.2 < m["tvd"] < 1.0
