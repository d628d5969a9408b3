"""Language-model evaluations of sec 3.5 / App. B.4, for any model of the LM zoo.

    validation_loss         mean next-token loss on fixed windows (Fig 3.8 curves, Table B.2)
    per_position_loss       loss at each position of a window, averaged over windows (Fig 3.9)
    attention_profile       the last token's attention over the window, per layer and head,
                            averaged over sequences, at the training context and beyond (Figs B.5-B.7)
    continuations           greedy and beam-2 continuations of Eldan & Li's 24 prompts (Tables B.4/B.5)

With a `BatchLog` (the run's answer log, `owai.evals.answers`) the losses and continuations log
each batch's result as it is computed, and a resumed evaluation computes only the batches a kill
left: what it reads back are the numbers the batches gave, added up in the same order, so the
resumed results are the uninterrupted run's to the last bit.

Models are called as Hugging Face causal LMs (`model(input_ids=x).logits`, `model.generate`) and
expose `last_token_attention(x) -> (n_layer, B, H, T)`. Windows come from `TokenWindows`. With
`eot` (models trained with document-wise masking) the losses pass `position_ids` restarting after
every end-of-text token, so a window crossing documents is read as the model was trained to.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch
import torch.nn.functional as F

from owai import distributed
from owai.evals.answers import AnswerLog, answer_key

PROMPTS_FILE = "eldan_li_prompts.txt"
IGNORE_INDEX = -100  # cross-entropy's default ignore_index


@dataclass(frozen=True)
class BatchLog:
    """Where one evaluation pass logs its per-batch results: a run's answer log, and the pass's
    scope (the model's label, the pass, its window length, ...) in every key.

    A batch's key is its scope, its index and a hash of its tokens, so a batch read back is the one
    the pass would compute. Under torchrun every rank has its own log, and a batch is read back only
    when every rank has its own one logged (`distributed.on_every_rank`): with FSDP a forward pass is
    a collective that every rank must enter, so no rank may skip one that another computes."""

    answers: AnswerLog
    scope: tuple[Any, ...]
    device: torch.device

    def key(self, index: int, *tensors: torch.Tensor) -> str:
        digest = hashlib.sha256()
        for t in tensors:
            digest.update(str((t.dtype, tuple(t.shape))).encode())
            digest.update(t.detach().cpu().contiguous().numpy().tobytes())
        return answer_key("lm-batch", *self.scope, index, digest.hexdigest())

    def logged(self, key: str, valid: Callable[[Any], bool]) -> Any:
        """The result logged under `key` when every rank has its own (None otherwise, or when a
        result is not `valid`: damaged, it is computed again)."""
        value = self.answers.get(key)
        ok = value is not None and valid(value)
        return value if distributed.on_every_rank(ok, self.device) else None

    def add(self, key: str, value: Any) -> None:
        """Log one batch's result, on disk (fsynced) before the next batch starts: a kill, even a
        SIGKILL, loses at most the batch it interrupts. A batch takes far longer than the write."""
        self.answers.add_batch({key: value})


def _numbers(value: Any, n: int) -> bool:
    """`value` is a list of `n` numbers (NaN included: a model's loss can be one)."""
    return isinstance(value, list) and len(value) == n and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)


def eldan_li_prompts() -> list[str]:
    """The 24 prompts of Eldan & Li (2023) as the thesis's Table B.4 lists them."""
    text = resources.files("owai.evals").joinpath(PROMPTS_FILE).read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


LOSS_CHUNK = 1 << 27  # logits (rows x vocabulary) whose float32 log-softmax is taken at once: 512 MB


def token_losses(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, eot: int | None = None) -> torch.Tensor:
    """Per-token cross-entropy (B, T) of predicting y from x, in float32 (documents split at `eot`).

    The float32 log-softmax is taken a slice of positions at a time (at most LOSS_CHUNK logits): a
    long window's (B, T, V) logits stay in the model's dtype, where a float32 copy of them all and
    its log-softmax would take 8 bytes per logit more (a 128k-token window with a 50k vocabulary:
    51 GB beside bfloat16 logits of 13 GB). Each row's loss is the same number either way."""
    if eot is None:
        logits = model(input_ids=x).logits  # (B, T, V)
    else:
        from owai.data.packing import document_positions

        logits = model(input_ids=x, position_ids=document_positions(x, eot)).logits
    B, T, V = logits.shape
    rows = max(1, LOSS_CHUNK // max(1, B * V))
    if rows >= T:
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none").view_as(y)
    out = torch.empty(B, T, dtype=torch.float32, device=logits.device)
    for start in range(0, T, rows):
        part = logits[:, start:start + rows]
        out[:, start:start + rows] = F.cross_entropy(part.float().flatten(0, 1), y[:, start:start + rows].flatten(),
                                                     reduction="none").view(B, -1)
    return out


@torch.no_grad()
def validation_loss(model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
                    eot: int | None = None) -> float:
    """Mean next-token loss over the given (x, y) batches; targets equal to -100 (padding, masked
    separators) are not counted."""
    total, count = loss_totals(model, batches, device, eot)
    return total / max(count, 1)


def loss_totals(model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
                eot: int | None = None, log: BatchLog | None = None) -> tuple[float, int]:
    """(summed next-token loss, counted targets) over the batches, in eval mode: the parts of a mean
    that several processes, each with its own batches, add up exactly. With `log`, each batch's
    (sum, count) is logged, and a batch logged before is not computed again."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i, (x, y) in enumerate(batches):
        key = log.key(i, x, y) if log is not None else ""
        part = log.logged(key, lambda v: _numbers(v, 2)) if log is not None else None
        if part is None:
            y = y.to(device)
            part = [token_losses(model, x.to(device), y, eot).sum().item(), int((y != IGNORE_INDEX).sum())]
            if log is not None:
                log.add(key, part)
        total += float(part[0])
        count += int(part[1])
    model.train(was_training)
    return total, count


@torch.no_grad()
def per_position_loss(
    model: torch.nn.Module, windows: Iterable[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
    eot: int | None = None, log: BatchLog | None = None,
) -> tuple[list[float], int]:
    """Loss at each position of the window averaged over all windows: (curve of length T, windows).
    With `log`, each batch's per-position sums are logged, and a batch logged before is not computed
    again."""
    model.eval()
    total: torch.Tensor | None = None
    n = 0
    for i, (x, y) in enumerate(windows):
        key = log.key(i, x, y) if log is not None else ""
        logged = log.logged(key, lambda v: _numbers(v, x.shape[1])) if log is not None else None
        if logged is not None:
            losses = torch.tensor(logged, dtype=torch.float64)
        else:
            losses = token_losses(model, x.to(device), y.to(device), eot).sum(0).double().cpu()  # (T,)
            if log is not None:
                log.add(key, losses.tolist())  # float64 values: JSON gives them back exactly
        total = losses if total is None else total + losses
        n += x.shape[0]
    if total is None:
        return [], 0
    return (total / n).tolist(), n


@torch.no_grad()
def attention_profile(model: torch.nn.Module, windows: Iterable[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, int]:
    """The last position's attention weights averaged over sequences: ((n_layer, H, T), sequences)."""
    model.eval()
    total: torch.Tensor | None = None
    n = 0
    for x in windows:
        att = model.last_token_attention(x.to(device)).double().sum(1).cpu()  # (L, H, T)
        total = att if total is None else total + att
        n += x.shape[0]
    if total is None:
        raise ValueError("attention_profile needs at least one window")
    return total / n, n


def attention_summary(profile: torch.Tensor, block: int) -> dict[str, float]:
    """Figs B.5 / B.6 in two numbers, from a last-token profile (n_layer, H, T) averaged over layers
    and heads (the figures' dotted line): `first`, the weight on position 0 against the uniform 1/T
    (an attention sink is far above 1), and, for a window longer than the training context `block`,
    `beyond`, the mass on the T - block positions further back than any distance seen in training
    (a flat pattern keeps about (T - block) / T of it, one whose far weights vanish almost none)."""
    mean = profile.double().mean(dim=(0, 1))
    length = mean.shape[0]
    out = {"first": float(mean[0]) * length}
    if length > block:
        out["beyond"] = float(mean[: length - block].sum())
    return out


@torch.no_grad()
def continuations(
    model: torch.nn.Module, tokenizer: Any, prompts: list[str], device: torch.device, max_new_tokens: int = 48,
    beams: tuple[int, ...] = (1, 2), progress: Callable[[], Any] | None = None, log: BatchLog | None = None,
) -> list[dict[str, str]]:
    """Continue each prompt greedily (beams=1) and with beam search (unnormalised scores, as the
    reference's); stops at end-of-text.
    `progress()` is called after each prompt (a progress bar's update). With `log`, each prompt's
    continuations are logged, and a prompt logged before is not continued again.

    A model with a learned position table (`context_limit`) sees only the prompt's last
    `limit - max_new_tokens` tokens, as the reference crops its context to block_size."""
    from torch.distributed.fsdp import FSDPModule

    from owai.models.lm import context_limit

    model.eval()
    sharded = isinstance(model, FSDPModule)
    limit = context_limit(model)
    if limit is not None:
        max_new_tokens = min(max_new_tokens, limit // 2)
    names = [_beam_name(beam) for beam in beams]
    rows = []
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([tokenizer.encode(prompt)], device=device)
        if limit is not None:
            ids = ids[:, -(limit - max_new_tokens) :]
        key = log.key(i, ids, torch.tensor([max_new_tokens, *beams])) if log is not None else ""
        row = log.logged(key, lambda v: isinstance(v, dict) and v.get("prompt") == prompt and all(
            isinstance(v.get(name), str) for name in names)) if log is not None else None
        if row is None:
            row = _continue(model, tokenizer, prompt, ids, max_new_tokens, beams, sharded)
            if log is not None:
                log.add(key, row)
        rows.append(row)
        if progress is not None:
            progress()
    return rows


def _continue(model: torch.nn.Module, tokenizer: Any, prompt: str, ids: torch.Tensor, max_new_tokens: int,
              beams: tuple[int, ...], sharded: bool) -> dict[str, str]:
    """One row of `continuations`: the prompt, and its continuation with each number of beams."""
    row = {"prompt": prompt}
    for beam in beams:
        out = model.generate(
            ids,
            synced_gpus=sharded,  # FSDP ranks step together until every one has finished
            max_new_tokens=max_new_tokens,
            do_sample=False,
            num_beams=beam,
            eos_token_id=tokenizer.eot_id,
            pad_token_id=tokenizer.eot_id,
            # beams scored by their summed log-probability, not divided by length: the
            # reference's beam_generate ranks by the raw product of probabilities
            **({"length_penalty": 0.0} if beam > 1 else {}),
        )
        new = out[0, ids.shape[1] :].tolist()
        if tokenizer.eot_id in new:
            new = new[: new.index(tokenizer.eot_id)]
        row[_beam_name(beam)] = tokenizer.decode(new)
    return row


def _beam_name(beams: int) -> str:
    """A continuation's column: greedy, beam2, ..."""
    return "greedy" if beams == 1 else f"beam{beams}"


def only_inputs(windows: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[torch.Tensor]:
    for x, _ in windows:
        yield x


def mean_over(curve: list[float], start: int, stop: int | None = None) -> float | None:
    """Mean of curve[start:stop] (e.g. loss after the first 50 tokens); None when the range is
    empty (a context shorter than `start`): undefined, not NaN, which would fail the run."""
    part = curve[start:stop]
    return sum(part) / len(part) if part else None
