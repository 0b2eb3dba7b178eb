"""Class-conditional training, sampling and evaluation (model.conditional)."""

from __future__ import annotations

import pytest
import torch

from ganpipe import build, evaluation, loop, stream
from ganpipe.data.dataset import LmdbImageDataset
from ganpipe.dist import DistContext
from ganpipe.featurenet import Embedding, FeatureNet
from ganpipe.params import parse_params
from ganpipe.sampling import export_pngs, sample_grid, sample_labels
from tests.helpers import tiny_params

CPU = torch.device("cpu")
RAW = tiny_params(
    seed=2,
    data={"image_size": 32},
    model={
        "arch": "resnet",
        "conditional": True,
        "g_channels": {4: 8, 8: 8, 16: 8, 32: 8},
        "d_channels": {4: 8, 8: 8, 16: 8},
    },
    train={"kimg": 0.064, "snapshot_kimg": 1},
    generate={"grid_rows": 3},
)


@pytest.fixture(scope="module")
def train32(digits32) -> LmdbImageDataset:
    """The training split of the shared digits at 32 px."""
    return LmdbImageDataset(digits32 / "train.lmdb", as_uint8=True)


def test_batches_carry_the_real_labels_and_seeded_fake_labels(train32):
    params = parse_params(RAW)
    context = DistContext(device=CPU)
    first = stream.Stream(params, train32, context, 0, 4, num_classes=10).next(0)[0]
    order = stream.EpochBatchSampler(len(train32), 16, params.seed, 0, 1)
    indices = next(iter(order))
    assert torch.equal(first.real_labels, torch.from_numpy(train32.labels()[indices]))
    assert torch.equal(first.fake_labels, stream.fake_labels(params.seed, 0, 16, 10))
    assert not torch.equal(first.fake_labels, stream.fake_labels(params.seed, 1, 16, 10))
    # rank 1 of 2 takes the second half of the global batch's labels, real and fake
    half = stream.Stream(params, train32, DistContext(1, 1, 2, CPU), 0, 4, 10).next(0)[0]
    assert torch.equal(half.real_labels, first.real_labels[8:])
    assert torch.equal(half.fake_labels, first.fake_labels[8:])


class Counted:
    def __init__(self, counts):
        self.counts = counts

    def class_counts(self):
        return self.counts


def test_a_conditional_model_needs_two_classes():
    params = parse_params(RAW)
    assert build.conditional_classes(params, Counted([3, 0, 5])) == 3  # up to the last label
    with pytest.raises(ValueError, match=r"model.conditional=true needs at least 2 classes"):
        build.conditional_classes(params, Counted([0, 7, 0]))
    unconditional = parse_params({**RAW, "model": {**RAW["model"], "conditional": False}})
    assert build.conditional_classes(unconditional, Counted([7])) is None


def test_a_conditional_run_draws_each_class_on_request(train32, tmp_path):
    result = loop.train(parse_params(RAW), train32, CPU, progress=False)
    assert result.num_classes == 10
    g = result.g_ema
    z = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        threes, sevens = g(z, torch.full((4,), 3)), g(z, torch.full((4,), 7))
    assert not torch.equal(threes, sevens)  # the label changes the image
    grid = sample_grid(g, 8, 3, seed=5)
    assert grid.shape == (10 * 34 + 2, 3 * 34 + 2, 3)  # one row of 3 per class, 2 px padding
    # row r is class r: the first row's images are samples 0..2 of class 0
    export_pngs(g, 8, 12, 5, tmp_path / "images", progress=False)
    folders = {p.name: sorted(q.name for q in p.iterdir()) for p in (tmp_path / "images").iterdir()}
    assert folders == {str(c): [f"{i:06d}.png" for i in range(c, 12, 10)] for c in range(10)}


def test_class_accuracy_and_per_class_fid_by_hand():
    net = FeatureNet(channels=1, image_size=32, width=4, num_classes=3)
    with torch.no_grad():  # logits = the first three features
        net.head.weight.copy_(torch.eye(3, 16))
        net.head.bias.zero_()
    classifier = Embedding(net, "0" * 64)
    features = torch.zeros(5, 16, dtype=torch.float64)
    features[[0, 1, 2, 3, 4], [0, 1, 1, 2, 0]] = 1.0  # predicted: 0, 1, 1, 2, 0
    labels = torch.tensor([0, 1, 2, 2, 1])
    assert evaluation.class_accuracy(classifier, features, labels) == pytest.approx(3 / 5)
    real = torch.randn(12, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    fake = torch.randn(9, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    real_labels, fake_labels = torch.arange(12) % 3, sample_labels(range(9), 3)
    per_class = evaluation.fid_per_class(real, real_labels, fake, fake_labels)
    assert per_class == {
        str(c): evaluation.fid(real[real_labels == c], fake[fake_labels == c]) for c in range(3)
    }
