"""Exact-match scoring of recall and in-context classification episodes (issue #38).

An answer counts when the model's greedy prediction of every answer token is right given the
episode up to it (teacher forcing): the same verdict as greedy generation from the query's prompt,
computed for all the queries of a batch of episodes in one forward pass. Episodes come from
`owai.data.recall`; the model is any causal LM of the zoo (`model(input_ids=x).logits`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from owai.data.recall import Episode


@torch.no_grad()
def score(model: torch.nn.Module, episodes: Sequence[Episode], device: torch.device, batch_size: int = 4) -> list[list[bool]]:
    """Per episode, per query (in the episode's order): was every answer token predicted?"""
    was_training = model.training
    model.eval()
    out: list[list[bool]] = []
    for first in range(0, len(episodes), batch_size):
        group = episodes[first:first + batch_size]
        x = torch.from_numpy(np.stack([e.tokens for e in group])).to(device)
        pred = model(input_ids=x).logits.argmax(-1).cpu()  # pred[:, t] predicts token t + 1
        for row, episode in enumerate(group):
            out.append([all(int(pred[row, q.start + i - 1]) == tok for i, tok in enumerate(q.answer)) for q in episode.queries])
    model.train(was_training)
    return out


def accuracy_by_group(episodes: Sequence[Episode], correct: Sequence[Sequence[bool]]) -> dict[str, Any]:
    """{"all": (accuracy, n), group: (accuracy, n), ...} over every query of the episodes."""
    hits: dict[str, list[bool]] = defaultdict(list)
    for episode, marks in zip(episodes, correct):
        for q, ok in zip(episode.queries, marks):
            hits[q.group].append(ok)
            hits["all"].append(ok)
    return {g: (sum(v) / len(v), len(v)) for g, v in sorted(hits.items())}
