"""FID, KID and precision/recall of a generator against real images, in a chosen feature space.

The feature extractor (the pipeline's own feature network, or the standard FID
Inception-v3 read from a local file) is applied once per image. FID and KID are then
computed by torchmetrics from those features: the metrics get an identity "network" that
hands the features through (under DDP the features are gathered first and the metrics run
on rank 0 alone, with torchmetrics' own syncing off). Precision/recall (Kynkäänniemi et
al., 2019) use k-nearest-neighbour balls in the same space. Real-image features are cached
by (dataset hash, extractor hash), so evaluating many runs extracts them once.
"""

from __future__ import annotations

import hashlib
import logging
import warnings
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from ganpipe import exact, runtime
from ganpipe.checkpoint import hashed_bytes, load, read_hashed, read_model_file, write_bytes_atomic
from ganpipe.errors import UserError
from ganpipe.featurenet import from_record
from ganpipe.files import NoSpaceError, file_sha256
from ganpipe.sampling import sample_labels, sample_latents, to_uint8

log = logging.getLogger(__name__)

#: torch hub names weight files by the first 8 hex digits of their sha256.
INCEPTION_SHA256_PREFIX = "6726825d"
#: The header of a feature cache file (see :func:`ganpipe.checkpoint.hashed_bytes`).
CACHE_MAGIC = b"ganpipe-feature-cache sha256="


class ExtractorError(UserError):
    """The feature extractor's weights are missing, altered or of the wrong kind."""


def load_featurenet(path: Path) -> nn.Module:
    """The frozen feature network, after checking the file against its ``.sha256`` record.

    Raises:
        ExtractorError: a file is missing, or the weights do not match their record.
        ModelFileError: the weights cannot be loaded (their record was replaced with them).
    """
    record_file = path.with_suffix(".sha256")
    if not path.exists() or not record_file.exists():
        raise ExtractorError(
            f"{path} or {record_file} is missing; run `dvc repro featurenet` to train the "
            "feature network"
        )
    expected = record_file.read_text().split()[0]
    actual = file_sha256(path)
    if actual != expected:
        raise ExtractorError(
            f"{path} has sha256 {actual} but {record_file} records {expected}: the weights "
            "changed after training; run `dvc repro featurenet`"
        )
    return read_model_file(path, lambda record: from_record(record, actual), "featurenet")


class InceptionFeatures(nn.Module):
    """The standard FID Inception-v3 pool features (2048) of [-1, 1] images (any channels).

    Images are quantised to uint8 and grey images repeated to RGB, as FID implementations do
    with image files; torchmetrics' Inception resizes them to 299 x 299.
    """

    def __init__(self, path: Path, digest: str):
        super().__init__()
        from torchmetrics.image.fid import NoTrainInceptionV3

        self.net = NoTrainInceptionV3(
            name="inception-v3-compat", features_list=["2048"], feature_extractor_weights_path=path
        )
        self.num_features = 2048
        self.digest = digest

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        pixels = to_uint8(images)
        if pixels.shape[1] == 1:
            pixels = pixels.repeat(1, 3, 1, 1)
        return self.net(pixels).reshape(len(images), -1)


def load_inception(path: str | Path | None, expected_sha256: str | None) -> nn.Module:
    """The FID Inception from a local weights file, hash checked before anything loads it."""
    if path is None or not Path(path).is_file():
        raise ExtractorError(
            f"eval.inception_weights={path}: no such file. ganpipe never downloads weights: "
            "copy weights-inception-2015-12-05-6726825d.pth (torch-fidelity's FID Inception) "
            "to this machine and set eval.inception_weights to its path"
        )
    path = Path(path)
    actual = file_sha256(path)
    if expected_sha256 is not None and actual != expected_sha256:
        raise ExtractorError(
            f"eval.inception_weights={path} has sha256 {actual}, not "
            f"eval.inception_sha256={expected_sha256}; use the right file or fix the hash"
        )
    if expected_sha256 is None and not actual.startswith(INCEPTION_SHA256_PREFIX):
        raise ExtractorError(
            f"eval.inception_weights={path} has sha256 {actual}, which is not the standard "
            f"FID Inception (sha256 {INCEPTION_SHA256_PREFIX}...); use that file, or set "
            "eval.inception_sha256 to this file's hash to accept it deliberately"
        )
    try:
        load(path)  # weights only: a file carrying code is refused here, never run
    except Exception as exc:
        raise ExtractorError(f"eval.inception_weights={path} cannot be loaded: {exc}") from exc
    return InceptionFeatures(path, actual)


@torch.inference_mode()
def features_of(
    extractor: nn.Module,
    batches: Iterable[torch.Tensor],
    device: torch.device,
    total: int | None = None,
    desc: str = "features",
    progress: bool = True,
) -> torch.Tensor:
    """Features (float64, CPU) of [-1, 1] image batches."""
    extractor.to(device).eval()
    out = []
    with tqdm(total=total, desc=desc, unit="img", disable=not progress, mininterval=1.0) as bar:
        for images in batches:
            out.append(extractor(images.to(device)).double().cpu())
            bar.update(len(images))
    return torch.cat(out)


def real_features(
    extractor: nn.Module,
    dataset: torch.utils.data.Dataset,
    dataset_sha256: str,
    batch_size: int,
    device: torch.device,
    cache_dir: Path | None,
    progress: bool = True,
    numerics: str = "",
) -> torch.Tensor:
    """Features of every image of ``dataset``, cached by (dataset hash, extractor hash,
    ``numerics``: a digest of :func:`ganpipe.runtime.numerics_record`, since features
    computed on other CPU code paths differ in their last bits).

    A cache file carries the sha256 of its bytes, as checkpoints do: one that is damaged
    (one flipped bit in the features would shift FID), foreign or of an older format is
    deleted with a warning naming it, and the features are extracted again.
    """
    cache = None
    key = {"dataset": dataset_sha256, "extractor": extractor.digest, "numerics": numerics}
    if cache_dir is not None:
        digest = hashlib.sha256(numerics.encode()).hexdigest()[:8]
        cache = cache_dir / f"{dataset_sha256[:16]}-{extractor.digest[:16]}-{digest}.pt"
        if cache.exists():
            try:
                cached = read_hashed(cache, CACHE_MAGIC)
                if all(cached.get(k) == v for k, v in key.items()):
                    log.info("real features from cache %s", cache)
                    return cached["features"]
            except Exception as exc:  # a damaged cache is rebuilt, never trusted
                cache.unlink(missing_ok=True)
                log.warning(
                    "feature cache %s cannot be used (%s: %s); deleted it, extracting the real "
                    "features again",
                    cache,
                    type(exc).__name__,
                    str(exc).splitlines()[0][:200] if str(exc) else "",
                )
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size)
    feats = features_of(
        extractor,
        (images for images, _ in loader),
        device,
        len(dataset),
        "real features",
        progress,
    )
    if cache is not None:
        try:
            write_bytes_atomic(hashed_bytes({**key, "features": feats}, CACHE_MAGIC), cache)
        except NoSpaceError as exc:  # the cache only saves time: go on without it
            log.warning("the real features are not cached: %s", exc)
    return feats


@torch.inference_mode()
def generated_features(
    generator: nn.Module,
    extractor: nn.Module,
    seed: int,
    indices: range,
    z_dim: int,
    batch_size: int,
    device: torch.device,
    progress: bool = True,
    num_classes: int | None = None,
) -> torch.Tensor:
    """Features of generated samples ``indices`` (generator in eval mode); a conditional
    generator (``num_classes``) draws sample ``i`` for class :func:`sample_labels`."""
    generator.to(device).eval()

    def batches():
        for start in range(indices.start, indices.stop, batch_size):
            chunk = range(start, min(start + batch_size, indices.stop))
            z = sample_latents(seed, chunk, z_dim).to(device)
            if num_classes is None:
                yield generator(z).clamp(-1, 1)
            else:
                labels = sample_labels(chunk, num_classes).to(device)
                yield generator(z, labels).clamp(-1, 1)

    return features_of(extractor, batches(), device, len(indices), "generated features", progress)


def class_accuracy(classifier: nn.Module, features: torch.Tensor, labels: torch.Tensor) -> float:
    """The share of generated samples that the feature network's classifier (trained on the
    real training split) puts in the class they were drawn for: does a 3 look like a 3.

    ``classifier`` is the :class:`ganpipe.featurenet.Embedding` whose ``features`` they are;
    its classification head turns them into logits.
    """
    head = classifier.net.head
    logits = head(features.to(head.weight.device, head.weight.dtype))
    return (logits.argmax(1).cpu() == labels).double().mean().item()


def fid_per_class(
    real: torch.Tensor, real_labels: torch.Tensor, fake: torch.Tensor, fake_labels: torch.Tensor
) -> dict[str, float]:
    """FID between the real and the generated images of each class; a class with fewer than
    2 images on either side is left out."""
    out = {}
    for label in sorted(set(fake_labels.tolist())):
        ours, theirs = real[real_labels == label], fake[fake_labels == label]
        if len(ours) >= 2 and len(theirs) >= 2:
            out[str(label)] = fid(ours, theirs)
    return out


class Features(nn.Module):
    """An identity "feature network" for torchmetrics: the inputs already are features."""

    def __init__(self, num_features: int):
        super().__init__()
        self.num_features = num_features

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return features


def fid(real: torch.Tensor, fake: torch.Tensor) -> float:
    """Fréchet distance between Gaussians fitted to the two feature sets (torchmetrics)."""
    # torchmetrics loads torchvision and torch._dynamo (seconds of start-up): imported where
    # a metric is computed, so that a stage or command that refuses its inputs stops at once.
    from torchmetrics.image.fid import FrechetInceptionDistance

    metric = FrechetInceptionDistance(
        feature=Features(real.shape[1]), reset_real_features=False, sync_on_compute=False
    )
    metric.update(real, real=True)
    metric.update(fake, real=False)
    return float(metric.compute())


def kid(
    real: torch.Tensor, fake: torch.Tensor, subsets: int, subset_size: int, seed: int
) -> tuple[float, float]:
    """Kernel inception distance, mean and std over random subsets (torchmetrics).

    torchmetrics draws the subsets from the global CPU RNG; it is seeded here and restored
    afterwards, so the value is a function of the inputs and ``seed`` and no other random
    stream moves.
    """
    from torchmetrics.image.kid import KernelInceptionDistance  # as in fid()

    with warnings.catch_warnings():  # "will save all extracted features": that is the point
        warnings.filterwarnings("ignore", message=".*save all extracted features")
        metric = KernelInceptionDistance(
            feature=Features(real.shape[1]),
            subsets=subsets,
            subset_size=subset_size,
            sync_on_compute=False,
        )
    metric.update(real, real=True)
    metric.update(fake, real=False)
    # The CPU generator only (torch.manual_seed would reseed every CUDA device's too, which
    # a training run measured on a GPU draws from), restored afterwards.
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(runtime.derive_seed(seed, "kid-subsets"))
        mean, std = metric.compute()
    return float(mean), float(std)


def _kth_neighbour_radii(points: torch.Tensor, k: int, chunk: int = 1024) -> torch.Tensor:
    """Distance from each point to its k-th nearest other point of the same set."""
    radii = []
    for start in range(0, len(points), chunk):
        d = exact.cdist(points[start : start + chunk], points)
        radii.append(d.kthvalue(k + 1, dim=1).values)  # k + 1: the point itself is at 0
    return torch.cat(radii)


def _coverage(reference: torch.Tensor, radii: torch.Tensor, queries: torch.Tensor) -> float:
    """Share of ``queries`` inside at least one ball (reference point, radius)."""
    inside = 0
    for start in range(0, len(queries), 1024):
        d = exact.cdist(queries[start : start + 1024], reference)
        inside += (d <= radii.unsqueeze(0)).any(dim=1).sum().item()
    return inside / len(queries)


def precision_recall(real: torch.Tensor, fake: torch.Tensor, k: int) -> tuple[float, float]:
    """Improved precision and recall (Kynkäänniemi et al., 2019).

    Precision: share of generated samples within the k-NN ball of some real sample (are the
    samples realistic?). Recall: share of real samples within the k-NN ball of some
    generated sample (is the real variety covered?).
    """
    precision = _coverage(real, _kth_neighbour_radii(real, k), fake)
    recall = _coverage(fake, _kth_neighbour_radii(fake, k), real)
    return precision, recall


def all_metrics(
    real: torch.Tensor,
    fake: torch.Tensor,
    kid_subsets: int,
    kid_subset_size: int,
    pr_k: int,
    seed: int,
) -> dict[str, float]:
    """``fid``, ``kid``, ``kid_std``, ``precision``, ``recall`` of two feature sets."""
    if kid_subset_size > min(len(real), len(fake)):
        raise UserError(
            f"eval.kid_subset_size={kid_subset_size} is more than the {len(real)} real and "
            f"{len(fake)} generated images; lower it (or use a larger val split)"
        )
    kid_mean, kid_std = kid(real, fake, kid_subsets, kid_subset_size, seed)
    precision, recall = precision_recall(real, fake, pr_k)
    return {
        "fid": fid(real, fake),
        "kid": kid_mean,
        "kid_std": kid_std,
        "precision": precision,
        "recall": recall,
    }
