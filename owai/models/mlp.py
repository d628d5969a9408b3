"""The reference ColoredMNIST model (spec `rich_features.md` §1, RFC `coloredmnist/models.py`).

    featurizer  MLP:    Linear(392, 390) -> ReLU -> Linear(390, 390) -> ReLU   (the 390-d representation)
    head        TopMLP: Linear(390, n_targets)                                  (1 logit, BCE; 2 for RSC/LfF)

Every Linear is initialised with `xavier_uniform_` weights and zero biases, as the reference does.
Inputs are (n, 2, 14, 14) images or (n, 392) flattened rows; the featurizer flattens them. With
hidden = 390 and one target the model has 392*390 + 390 + 390*390 + 390 + 390 + 1 = 306 151
parameters.

The split into `featurizer` and `head` is what the penalties need (`EnvBatch(logits, y, features)`:
Fishr, MMD, CORAL and RSC read the head's input) and what Bonsai-cf needs: `freeze_featurizer()`
turns off the featurizer's gradients, and `trainable_parameters()` is then the head only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

INPUT_DIM = 2 * 14 * 14


@dataclass
class MLPConfig:
    input_dim: int = INPUT_DIM
    hidden: int = 390
    n_targets: int = 1


def _xavier(layer: nn.Linear) -> nn.Linear:
    nn.init.xavier_uniform_(layer.weight)
    nn.init.zeros_(layer.bias)
    return layer


class Featurizer(nn.Module):
    """RFC `MLP`: two ReLU layers; the output is the representation."""

    def __init__(self, input_dim: int = INPUT_DIM, hidden: int = 390) -> None:
        super().__init__()
        self.input_dim = input_dim
        self.lin1 = _xavier(nn.Linear(input_dim, hidden))
        self.lin2 = _xavier(nn.Linear(hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], self.input_dim)
        return torch.relu(self.lin2(torch.relu(self.lin1(x))))


class ColoredMNISTMLP(nn.Module):
    """Featurizer + linear head. `forward(x)` gives the logits ((n, 1) for one target);
    `features_and_logits(x)` gives both (the penalties' `EnvBatch` needs the features)."""

    def __init__(self, config: MLPConfig | None = None) -> None:
        super().__init__()
        self.config = config or MLPConfig()
        c = self.config
        self.featurizer = Featurizer(c.input_dim, c.hidden)
        self.head = _xavier(nn.Linear(c.hidden, c.n_targets))

    def features_and_logits(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.featurizer(x)
        return z, self.head(z)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.featurizer(x))

    def freeze_featurizer(self) -> None:
        """Bonsai-cf: the representation gets no gradient (leave it out of the optimizer too)."""
        for p in self.featurizer.parameters():
            p.requires_grad_(False)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]


def n_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
