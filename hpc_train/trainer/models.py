"""The models of the tutorials our users learned from, and the user's own by import path."""

from __future__ import annotations

from torch import nn

from hpc_train.config import ModelSection
from hpc_train.errors import UsageError
from hpc_train.plugins import resolve


class ConvNet(nn.Module):
    """The classic MNIST ConvNet: two conv5x5+BN+ReLU+max-pool blocks (16, 32), then linear."""

    def __init__(self, dropout: float = 0.0, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=5, padding=2), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, kernel_size=5, padding=2), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(7 * 7 * 32, num_classes)

    def forward(self, x):
        return self.fc(self.dropout(self.features(x).flatten(1)))

    def stages(self) -> list[nn.Module]:
        """For dist.strategy=split: the parts applied in order (the forward, cut in two)."""
        return [self.features, nn.Sequential(nn.Flatten(), self.dropout, self.fc)]


class MLP(nn.Module):
    """The two-layer perceptron, 784 -> hidden -> 10."""

    def __init__(self, hidden: int = 50, dropout: float = 0.0, num_classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(784, hidden), nn.ReLU(), nn.Dropout(dropout),
                                 nn.Linear(hidden, num_classes))

    def forward(self, x):
        return self.net(x)

    def stages(self) -> list[nn.Module]:
        """For dist.strategy=split: the hidden layer, then the output layer."""
        return [self.net[:3], self.net[3:]]


class Linear(nn.Module):
    """A single linear layer: for smoke tests, where the model's quality does not matter."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.fc = nn.Linear(784, num_classes)

    def forward(self, x):
        return self.fc(x.flatten(1))

    def stages(self) -> list[nn.Module]:
        """For dist.strategy=split: one layer, one stage."""
        return [nn.Sequential(nn.Flatten(), self.fc)]


def build(cfg: ModelSection) -> nn.Module:
    if cfg.name == "convnet":
        return ConvNet(cfg.dropout)
    if cfg.name == "mlp":
        return MLP(cfg.hidden, cfg.dropout)
    if cfg.name == "linear":
        return Linear()
    model = resolve(cfg.name, "model.name")(cfg)
    if not isinstance(model, nn.Module):
        raise UsageError(f"config: model.name={cfg.name!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model
