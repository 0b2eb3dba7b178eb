"""Evaluation metrics against hand-computed references, and the extractors' file checks."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import scipy.linalg
import torch

from ganpipe import evaluation
from ganpipe.evaluation import ExtractorError
from ganpipe.featurenet import classes_for, rotated, train_featurenet
from ganpipe.params import FeaturenetParams
from ganpipe.sampling import sample_latents, slerp


def points(*xs: float) -> torch.Tensor:
    """1-D points as 2-D features (second coordinate 0)."""
    return torch.tensor([[x, 0.0] for x in xs], dtype=torch.float64)


@pytest.mark.parametrize(
    ("real", "fake", "k", "expected"),
    [
        # k=1: every real ball has radius 1; fakes 0.2 and 0.4 have radius 0.2 and only
        # cover the real point 0.
        (points(0, 1, 2, 3), points(0.2, 0.4), 1, (1.0, 0.25)),
        # k=1: 5.5 is 2.5 from the real point 3 (radius 1): outside. The two fakes are 4
        # apart: radius 4 each, which covers the reals 0 .. 3.
        (points(0, 1, 2, 3), points(5.5, 1.5), 1, (0.5, 1.0)),
        # k=1: real radii 1: 4.5 (1.5 from 3) is outside. Fake radii 3.0 (4.5), 0.5 (1.5),
        # 0.5 (1.0): the real 0 is 1.0 from the nearest fake: outside; 1, 2, 3 inside.
        (points(0, 1, 2, 3), points(4.5, 1.5, 1.0), 1, (2 / 3, 0.75)),
        # k=2: real radii 2, 1, 1, 2, so 4.5 is inside; fake radii 3.5, 3.0, 3.5 cover all.
        (points(0, 1, 2, 3), points(4.5, 1.5, 1.0), 2, (1.0, 1.0)),
    ],
)
def test_precision_recall_match_hand_computed_values(real, fake, k, expected):
    assert evaluation.precision_recall(real, fake, k) == pytest.approx(expected)


def test_kth_neighbour_radii_by_hand():
    radii = evaluation._kth_neighbour_radii(points(0, 1, 2, 3), 2)
    assert radii.tolist() == [2.0, 1.0, 1.0, 2.0]


def gaussians(seed: int, n: int = 600, d: int = 6):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(n, d, generator=gen, dtype=torch.float64)
    mix = torch.randn(d, d, generator=gen, dtype=torch.float64) * 0.5
    b = torch.randn(n, d, generator=gen, dtype=torch.float64) @ (torch.eye(d) + mix) + 0.3
    return a, b


def test_fid_matches_the_formula_with_scipy_sqrtm():
    a, b = gaussians(0)
    x, y = a.numpy(), b.numpy()
    mu1, mu2 = x.mean(0), y.mean(0)
    s1, s2 = np.cov(x, rowvar=False), np.cov(y, rowvar=False)
    covmean = scipy.linalg.sqrtm(s1 @ s2).real
    expected = ((mu1 - mu2) ** 2).sum() + np.trace(s1 + s2 - 2 * covmean)
    assert evaluation.fid(a, b) == pytest.approx(expected, rel=1e-6)
    assert evaluation.fid(a, a) == pytest.approx(0.0, abs=1e-6)


def test_kid_with_one_full_subset_is_the_unbiased_polynomial_mmd():
    a, b = gaussians(1, n=200)
    d = a.shape[1]

    def k(x, y):
        return (x @ y.T / d + 1) ** 3

    m = len(a)
    kxx, kyy, kxy = k(a, a), k(b, b), k(a, b)
    expected = (
        (kxx.sum() - kxx.diagonal().sum()) / (m * (m - 1))
        + (kyy.sum() - kyy.diagonal().sum()) / (m * (m - 1))
        - 2 * kxy.mean()
    )
    mean, _ = evaluation.kid(a, b, subsets=1, subset_size=m, seed=0)
    assert mean == pytest.approx(expected.item(), rel=1e-9)


def test_same_inputs_give_the_same_bits():
    a, b = gaussians(2)
    first = evaluation.all_metrics(a, b, 20, 100, 3, seed=7)
    assert first == evaluation.all_metrics(a, b, 20, 100, 3, seed=7)
    assert first["fid"] > 0.1 and 0 < first["precision"] <= 1


def test_kid_subset_larger_than_the_data_is_refused():
    a, b = gaussians(3, n=50)
    with pytest.raises(ValueError, match="eval.kid_subset_size=100 is more than the 50 real"):
        evaluation.all_metrics(a, b, 5, 100, 3, seed=0)


def test_latents_depend_on_the_sample_index_only():
    whole = sample_latents(3, range(10), 5)
    parts = torch.cat([sample_latents(3, range(0, 4), 5), sample_latents(3, range(4, 10), 5)])
    assert torch.equal(whole, parts)
    assert not torch.equal(whole, sample_latents(4, range(10), 5))
    truncated = sample_latents(3, range(200), 5, truncation=0.5)
    assert truncated.abs().max() <= 0.5
    assert sample_latents(3, range(200), 5).abs().max() > 2  # untruncated tails exist


def test_slerp_keeps_the_ends_and_the_norm_of_orthogonal_unit_vectors():
    a, b = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    t = torch.tensor([0.0, 0.5, 1.0])
    path = slerp(a.expand(3, -1), b.expand(3, -1), t)
    assert torch.allclose(path[0], a[0]) and torch.allclose(path[2], b[0], atol=1e-6)
    assert torch.allclose(path.norm(dim=1), torch.ones(3))
    assert torch.allclose(path[1], torch.tensor([0.5**0.5, 0.5**0.5]))


def test_inception_weights_missing_or_altered_are_refused(tmp_path):
    with pytest.raises(ExtractorError, match="never downloads weights"):
        evaluation.load_inception(tmp_path / "absent.pth", None)
    fake = tmp_path / "weights.pth"
    torch.save({"w": torch.zeros(2)}, fake)
    with pytest.raises(ExtractorError, match="not the standard FID Inception"):
        evaluation.load_inception(fake, None)
    with pytest.raises(ExtractorError, match="not eval.inception_sha256=" + "0" * 64):
        evaluation.load_inception(fake, "0" * 64)


def test_inception_from_a_local_file_gives_2048_features(tmp_path, monkeypatch):
    """The architecture with random weights stands in for the real file (not shipped)."""
    from torch_fidelity import feature_extractor_inceptionv3 as fidelity

    net_class = fidelity.FeatureExtractorInceptionV3
    with monkeypatch.context() as patch:  # build it without weights: random initialisation
        patch.setattr(fidelity, "load_state_dict_from_url", lambda *a, **k: {})
        patch.setattr(net_class, "load_state_dict", lambda self, state: None)
        torch.manual_seed(0)
        state = net_class("inception-v3-compat", ["2048"]).state_dict()
    path = tmp_path / "inception.pth"
    torch.save(state, path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()

    def no_download(*args, **kwargs):
        raise AssertionError("tried to download")

    monkeypatch.setattr(fidelity, "load_state_dict_from_url", no_download)
    extractor = evaluation.load_inception(path, digest)
    images = torch.rand(3, 1, 32, 32) * 2 - 1
    feats = evaluation.features_of(extractor, [images], torch.device("cpu"), progress=False)
    assert feats.shape == (3, 2048) and feats.dtype == torch.float64
    assert extractor.digest == digest
    # the weights really came from the file: a second file gives other features
    state = {k: v + 0.01 if v.is_floating_point() else v for k, v in state.items()}
    other = tmp_path / "other.pth"
    torch.save(state, other)
    moved = evaluation.load_inception(other, hashlib.sha256(other.read_bytes()).hexdigest())
    assert not torch.equal(
        feats, evaluation.features_of(moved, [images], torch.device("cpu"), progress=False)
    )


class Blobs(torch.utils.data.Dataset):
    """Single-class images with an orientation: a bright bar in the top rows."""

    def __init__(self, n: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.images = torch.rand(n, 1, 16, 16, generator=gen) * 0.2 - 1
        self.images[:, :, :3, 2:12] = 1.0

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i], 0


def test_rotated_views_and_labels():
    images = torch.arange(2 * 4.0).reshape(2, 1, 2, 2)
    views, labels = rotated(images)
    assert labels.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert torch.equal(views[:2], images)
    assert torch.equal(views[2], torch.rot90(images[0], 1, dims=(1, 2)))


def test_single_class_data_trains_rotation_prediction():
    cfg = FeaturenetParams(width=8, epochs=10, batch_size=32, lr=3e-3)
    result = train_featurenet(
        cfg, 0, Blobs(256, 0), Blobs(64, 1), 1, (16, 16, 1), torch.device("cpu"), progress=False
    )
    assert result.task == "rotation" and result.num_classes == 4
    assert result.val_accuracy > 0.9  # the bar's position gives the rotation away
    again = train_featurenet(
        cfg, 0, Blobs(256, 0), Blobs(64, 1), 1, (16, 16, 1), torch.device("cpu"), progress=False
    )
    for a, b in zip(result.net.state_dict().values(), again.net.state_dict().values(), strict=True):
        assert torch.equal(a, b)  # deterministic from the seed


def test_the_classifier_has_an_output_for_every_label_present():
    assert classes_for([5, 3]) == 2
    assert classes_for([5, 0, 3]) == 3  # an empty class between two keeps its label
    assert classes_for([5, 3, 0]) == 2  # a trailing empty class needs no output
    assert classes_for([0, 0, 4]) == 1  # one class present: rotation prediction
    assert classes_for([]) == 0
