"""RegBench metrics (seq_icl `dfa_accuracy`, `model_dfa_diff`) and the in-context n-gram baseline.

Spec: shared/specs/evals.md sec 3.2. Inputs are the model's next-symbol probabilities (or logits)
of shape (N, T, V) at every input position, the (N, T) input ids (padded with `.` = id 0) and the
batch's PFAs (`owai.data.regbench.PFA`, one per row).

* accuracy: argmax symbol (first index on ties, as torch/numpy argmax: a uniform model predicts
  `.` and scores 0) is a legal transition from the current PFA state. Positions whose next input
  token is the separator are skipped; the final position is counted.
* "tvd" (the upstream name; it is the L1 distance sum_v |p_model - p_true|, i.e. 2 x TVD) at every
  non-pad input position, against the exact PFA distribution (uniform over the state's outgoing
  symbols; state reset after a separator). `tvd_half` = L1 / 2 is the textbook TVD.
* positions="all" (default; what the published figures use) or "last-string" (only positions
  from the last separator on, i.e. those predicting symbols of the final string - the thesis
  wording "predict the last token of testing sequences").

Both metrics are pooled over all counted positions of the call (one call = one reference batch).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from owai.errors import OwaiError

POSITIONS = ("all", "last-string")


def _np(x) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().float().numpy() if x.is_floating_point() else x.detach().cpu().numpy()
    return np.asarray(x)


def _softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def exact_distributions(input_ids, pfas) -> np.ndarray:
    """(N, T, V) exact next-symbol distributions of the batch's PFAs (zeros at padding)."""
    ids = _np(input_ids)
    if ids.ndim != 2 or len(pfas) != ids.shape[0]:
        raise OwaiError("regbench: input_ids must be (N, T) with one PFA per row")
    return np.stack([p.next_distributions(row) for p, row in zip(pfas, ids)])


def position_masks(input_ids, sep_id: int, positions: str = "all") -> tuple[np.ndarray, np.ndarray]:
    """(accuracy mask, tvd mask), both (N, T) bool, per the reference's position rules."""
    if positions not in POSITIONS:
        raise OwaiError(f"regbench: positions must be one of {POSITIONS}, got {positions!r}")
    ids = _np(input_ids)
    nonpad = ids != 0
    nxt = np.zeros_like(ids)
    nxt[:, :-1] = ids[:, 1:]
    acc = nonpad & (nxt != sep_id)
    tvd = nonpad.copy()
    if positions == "last-string":
        T = ids.shape[1]
        is_sep = ids == sep_id
        last = np.where(is_sep.any(1), T - 1 - np.argmax(is_sep[:, ::-1], axis=1), 0)
        keep = np.arange(T)[None, :] >= last[:, None]
        acc &= keep
        tvd &= keep
    return acc, tvd


def regbench_metrics(
    probs, input_ids, pfas, *, positions: str = "all", from_logits: bool = False
) -> dict[str, float]:
    """accuracy, "tvd" (= L1, upstream name), tvd_half (= L1/2) and the position counts."""
    p = _np(probs).astype(np.float64)
    ids = _np(input_ids)
    if p.ndim != 3 or p.shape[:2] != ids.shape:
        raise OwaiError(f"regbench: probs must be (N, T, V) matching input_ids {tuple(ids.shape)}")
    if from_logits:
        p = _softmax(p)
    true = exact_distributions(ids, pfas)
    if p.shape[2] != true.shape[2]:
        raise OwaiError(f"regbench: model vocabulary {p.shape[2]} != PFA vocabulary {true.shape[2]}")
    acc_mask, tvd_mask = position_masks(ids, pfas[0].sep_id, positions)
    pred = p.argmax(axis=-1)  # first index on ties (reference tie handling)
    legal = np.take_along_axis(true, pred[..., None], axis=-1)[..., 0] > 0
    l1 = np.abs(p - true).sum(-1)
    n_acc, n_tvd = int(acc_mask.sum()), int(tvd_mask.sum())
    accuracy = float(legal[acc_mask].mean()) if n_acc else float("nan")
    l1_mean = float(l1[tvd_mask].mean()) if n_tvd else float("nan")
    return {
        "accuracy": accuracy,
        "tvd": l1_mean,
        "tvd_half": l1_mean / 2,
        "num_accuracy_positions": n_acc,
        "num_tvd_positions": n_tvd,
    }


# --- in-context n-gram with backoff (seq_icl `ngram.py`, N=3, backoff=True, addone=False) ------


def _backoff_dist(prefix: tuple, n: int, counts: dict, vocab: list[int], totals1: int) -> dict:
    """Next-symbol probabilities over `vocab` given the last n-1 symbols `prefix` (reference rule).

    Seen n-grams get the maximum-likelihood count(prefix+c)/count(prefix); the leftover mass
    beta = 1 - sum goes to unseen symbols in proportion to their (n-1)-order backoff probability.
    The leftover is > 0 because the current context ends with `prefix` with no continuation yet.
    """
    if n == 1:
        return {c: counts[1][(c,)] / totals1 for c in vocab}
    denom = counts[n - 1][prefix]
    seen = {c: counts[n][prefix + (c,)] / denom for c in vocab if counts[n][prefix + (c,)] > 0}
    if len(seen) == len(vocab):
        return seen
    low = _backoff_dist(prefix[1:], n - 1, counts, vocab, totals1)
    unseen = [c for c in vocab if c not in seen]
    beta = max(0.0, 1.0 - sum(seen.values()))
    z = sum(low[c] for c in unseen)
    alpha = beta / z if z > 0 else 0.0
    out = dict(seen)
    out.update({c: alpha * low[c] for c in unseen})
    return out


def ngram_backoff_probs(
    input_ids, vocab_size: int, sep_id: int, n: int = 3, normalize: bool = False
) -> np.ndarray:
    """(N, T, V) in-context n-gram-with-backoff predictions; no training, no access to the PFA.

    At input position t the counts come from the strings of inputs[:t+1] (split at the separator),
    each left-padded with n-1 pad symbols; the vocabulary is the set of symbols seen so far, so the
    baseline never predicts the separator or the pad. Incremental version of seq_icl's
    `predict_with_n_gram_back_off` (same numbers, linear instead of quadratic in T).

    When every seen symbol already follows the prefix, the reference's rule leaves the leftover
    mass unassigned (rows sum to < 1). The default keeps those rows as they are: seq_icl scores its
    n-gram so (`_writes_to_file`'s `dfa_ngram_diff` and `n_gram_dfa_acc`, the numbers it logs;
    tests/test_official_code.py runs that code beside this). `normalize=True` renormalises each row,
    as seq_icl's `prob_distance_dfa_ngram` does, which its scripts import but never call.
    """
    if n < 1:
        raise OwaiError("regbench: n-gram order must be >= 1")
    ids = _np(input_ids)
    PAD = -1  # the reference's "_" padding symbol, distinct from every token id
    out = np.zeros((*ids.shape, vocab_size))
    for row, seq in enumerate(ids.tolist()):
        counts = {k: Counter() for k in range(1, n + 1)}
        vocab: set[int] = set()

        def new_string() -> tuple:
            ctx = (PAD,) * (n - 1)
            for k in range(1, n):  # n-grams of the padding itself
                for i in range(len(ctx) - k + 1):
                    counts[k][ctx[i : i + k]] += 1
            return ctx

        ctx = new_string()
        for t, tok in enumerate(seq):
            if tok == 0:  # padding: stop
                break
            if tok == sep_id:
                ctx = new_string()
            else:
                ctx = ctx + (tok,)
                vocab.add(tok)
                for k in range(1, n + 1):
                    counts[k][ctx[-k:]] += 1
            if not vocab:
                continue
            totals1 = sum(counts[1].values())
            prefix = ctx[-(n - 1) :] if n > 1 else ()
            dist = _backoff_dist(prefix, n, counts, sorted(vocab), totals1)
            for c, pr in dist.items():
                out[row, t, c] = pr
            if normalize:
                z = out[row, t].sum()
                if z > 0:
                    out[row, t] /= z
    return out


def uniform_probs(input_ids, vocab_size: int) -> np.ndarray:
    ids = _np(input_ids)
    return np.full((*ids.shape, vocab_size), 1.0 / vocab_size)
