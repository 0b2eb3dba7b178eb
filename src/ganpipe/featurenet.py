"""The feature network of the evaluation metrics, trained offline on the real training split.

FID, KID and precision/recall compare distributions of image *features*. The standard
features come from an ImageNet Inception-v3 that cannot be downloaded here, so the pipeline
trains its own: a small CNN that classifies the dataset's labels, or — when the data has a
single class — predicts which of four rotations was applied (a self-supervised task that
still needs shape features). The pooled activations before the classifier head are the
features. Training is deterministic from ``seed``; the frozen weights are saved with their
sha256, which names the feature space in caches and metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from ganpipe import exact, runtime
from ganpipe.params import FeaturenetParams

log = logging.getLogger(__name__)

ROTATIONS = 4


class FeatureNet(nn.Module):
    """Conv (stride 1), then stride-2 convs down to 4x4, average pool, linear head.

    ``embed`` gives the (N, 4 x width) features; ``forward`` the class logits.
    """

    def __init__(self, channels: int, image_size: int, width: int, num_classes: int):
        super().__init__()
        self.channels, self.image_size = channels, image_size
        layers: list[nn.Module] = [
            nn.Conv2d(channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
        ]
        size, c = image_size, width
        while size > 4:
            out = min(2 * c, 4 * width)
            layers += [
                nn.Conv2d(c, out, 4, stride=2, padding=1, bias=False),
                nn.BatchNorm2d(out),
                nn.ReLU(inplace=True),
            ]
            size, c = size // 2, out
        if c != 4 * width:
            layers += [nn.Conv2d(c, 4 * width, 1, bias=False), nn.BatchNorm2d(4 * width)]
            layers += [nn.ReLU(inplace=True)]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(4 * width, num_classes)
        self.num_features = 4 * width

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        return self.body(images).mean(dim=(2, 3))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(images))


class Embedding(nn.Module):
    """A frozen network's features as a module: ``(N, C, H, W)`` in [-1, 1] -> ``(N, d)``.

    Always in eval mode (BatchNorm uses its running statistics, so a sample's features do
    not depend on the rest of its batch). ``digest`` is the sha256 of the weights file,
    ``task`` what the network was trained for (``classification`` or ``rotation``).
    """

    def __init__(self, net: FeatureNet, digest: str, task: str = "classification"):
        super().__init__()
        self.net = net.eval().requires_grad_(False)
        self.num_features = net.num_features
        self.digest = digest
        self.task = task

    def train(self, mode: bool = True) -> Embedding:
        return super().train(False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net.embed(images.float())


def rotated(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each image in its four rotations (0, 90, 180, 270 degrees) and the rotation labels."""
    views = [torch.rot90(images, k, dims=(2, 3)) for k in range(ROTATIONS)]
    labels = torch.arange(ROTATIONS).repeat_interleave(len(images))
    return torch.cat(views), labels


@dataclass
class FeaturenetResult:
    net: FeatureNet
    task: str
    """``classification`` or ``rotation``."""
    num_classes: int
    val_accuracy: float
    train_accuracy: float


def _batches(
    dataset: Dataset, batch_size: int, generator: torch.Generator | None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    yield from DataLoader(
        dataset, batch_size=batch_size, shuffle=generator is not None, generator=generator
    )


def _inputs(task: str, images: torch.Tensor, labels: torch.Tensor):
    return rotated(images) if task == "rotation" else (images, labels.long())


@torch.inference_mode()
def accuracy(net: FeatureNet, dataset: Dataset, task: str, device: torch.device) -> float:
    """Share of correctly predicted labels (or rotations) on ``dataset``, net in eval mode."""
    net.eval()
    right = total = 0
    for images, labels in _batches(dataset, 256, None):
        x, y = _inputs(task, images.to(device), labels.to(device))
        right += (net(x).argmax(dim=1) == y).sum().item()
        total += len(y)
    return right / total


def classes_for(class_counts: list[int]) -> int:
    """``classes`` of :func:`train_featurenet` for a dataset with ``class_counts`` images per
    label: the classifier needs an output for every label up to the last one present, an
    empty class before it included (``data.on_bad_image: skip`` keeps an empty class
    folder's label); fewer than 2 labels present means rotation prediction."""
    present = [label for label, count in enumerate(class_counts) if count > 0]
    return present[-1] + 1 if len(present) >= 2 else len(present)


def train_featurenet(
    cfg: FeaturenetParams,
    seed: int,
    train_set: Dataset,
    val_set: Dataset,
    classes: int,
    shape: tuple[int, int, int],
    device: torch.device,
    progress: bool = True,
) -> FeaturenetResult:
    """Train the feature network on ``train_set``; report its accuracy on ``val_set``.

    ``classes`` is the number of labels in the data; with fewer than 2 the task is rotation
    prediction. ``shape`` is (height, width, channels). Weights and batch order come from
    ``seed`` alone.
    """
    task = "classification" if classes >= 2 else "rotation"
    num_classes = classes if task == "classification" else ROTATIONS
    height, _, channels = shape
    torch.manual_seed(runtime.derive_seed(seed, "featurenet", "weights"))
    net = FeatureNet(channels, height, cfg.width, num_classes).to(device)
    opt = torch.optim.Adam(net.parameters(), lr=cfg.lr, fused=exact.fused_adam(device))
    order = runtime.seeded_generator(seed, "featurenet", "order")
    steps = cfg.epochs * -(-len(train_set) // cfg.batch_size)
    bar = tqdm(total=steps, desc="featurenet", unit="step", disable=not progress, mininterval=1.0)
    with bar:
        for _ in range(cfg.epochs):
            net.train()
            for images, labels in _batches(train_set, cfg.batch_size, order):
                x, y = _inputs(task, images.to(device), labels.to(device))
                loss = nn.functional.cross_entropy(net(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                bar.update()
                bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    result = FeaturenetResult(
        net=net.cpu().eval(),
        task=task,
        num_classes=num_classes,
        val_accuracy=accuracy(net, val_set, task, torch.device("cpu")),
        train_accuracy=accuracy(net, train_set, task, torch.device("cpu")),
    )
    log.info(
        "featurenet (%s, %d features): accuracy %.4f held out, %.4f on the training split",
        task,
        net.num_features,
        result.val_accuracy,
        result.train_accuracy,
    )
    return result


def record(result: FeaturenetResult, cfg: FeaturenetParams, shape) -> dict:
    """What the weights file holds (loaded with ``weights_only=True``)."""
    height, _, channels = shape
    return {
        "net": "featurenet",
        "task": result.task,
        "num_classes": result.num_classes,
        "channels": channels,
        "image_size": height,
        "width": cfg.width,
        "val_accuracy": result.val_accuracy,
        "state_dict": result.net.state_dict(),
    }


def from_record(rec: dict, digest: str) -> Embedding:
    """The frozen feature extractor stored in a weights record."""
    net = FeatureNet(rec["channels"], rec["image_size"], rec["width"], rec["num_classes"])
    net.load_state_dict(rec["state_dict"])
    return Embedding(net, digest, rec["task"])
