"""FID and KID of the EMA generator while training, measured as the evaluate stage measures.

The same functions as :mod:`ganpipe.evaluation` and the evaluate stage (generated features
of samples ``range(num_samples)`` from the latents of ``(eval.seed, i)``, torchmetrics'
FID and seeded KID against the val split's features), so the curve is on the scale of
``metrics/eval/metrics.json``. Nothing here draws from a training RNG stream: the latents
come from their own seeded generators and KID restores the CPU generator it seeds, so a run
with metrics trains the same bytes as one without.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ganpipe.dist import DistContext
from ganpipe.params import Params

#: Log keys of a measurement: the curves, and the best point so far (values, not curves).
CURVE_PREFIX, BEST_PREFIX = "metrics/", "best/"
FID, KID = f"{CURVE_PREFIX}fid", f"{CURVE_PREFIX}kid"
BEST_FID, BEST_KIMG = f"{BEST_PREFIX}fid", f"{BEST_PREFIX}kimg"


@dataclass
class Ruler:
    """What FID/KID while training measure with: the feature extractor and the real val
    features (the main rank only: the others wait for its result), and ``identity``, every
    setting the values depend on (on every rank; a resumed run keeps the history it
    recorded only when it is the same)."""

    identity: dict
    extractor: nn.Module | None = None
    real: torch.Tensor | None = None

    @staticmethod
    def describe(params: Params, extractor_sha256: str, val_sha256: str, numerics: str) -> dict:
        """The ``identity`` of a ruler: the evaluate stage's ``ruler`` record (feature network
        and val split) and the settings of the measurement."""
        cfg = params.eval
        return {
            "ruler": {
                "extractor": cfg.feature_extractor,
                "extractor_sha256": extractor_sha256,
                "val_sha256": val_sha256,
            },
            "num_samples": params.train.metrics_num_samples,
            "seed": cfg.seed,
            "batch_size": cfg.batch_size,
            "kid_subsets": cfg.kid_subsets,
            "kid_subset_size": cfg.kid_subset_size,
            "numerics": numerics,
        }

    def measure(
        self, g_ema: nn.Module, context: DistContext, z_dim: int, num_classes: int | None
    ) -> dict[str, float]:
        """``{FID: ..., KID: ...}`` of ``g_ema`` (eval mode, no gradients), on every rank.

        The main rank computes; the others wait in the broadcast of its result, which must
        come within ``devices.timeout_s`` (:meth:`DistContext.wait_for_main`). Only rank 0's
        EMA is measured (another rank's has its own BatchNorm statistics), so this is one
        process's value.

        Raises:
            WaitTimeoutError: on a rank other than 0, the measurement outlasted
                devices.timeout_s (gloo); the message names the keys that size it.
        """
        # torchmetrics loads torchvision and torch._dynamo (seconds of start-up): only in
        # runs that measure.
        from ganpipe import evaluation

        scores, settings = None, self.identity
        if context.is_main:
            fake = evaluation.generated_features(
                g_ema,
                self.extractor,
                settings["seed"],
                range(settings["num_samples"]),
                z_dim,
                settings["batch_size"],
                context.device,
                progress=False,
                num_classes=num_classes,
            )
            kid_mean, _ = evaluation.kid(
                self.real,
                fake,
                settings["kid_subsets"],
                settings["kid_subset_size"],
                settings["seed"],
            )
            scores = {FID: evaluation.fid(self.real, fake), KID: kid_mean}
        return context.wait_for_main(
            scores,
            f"a FID/KID measurement while training (train.metrics_num_samples="
            f"{settings['num_samples']}, eval.feature_extractor="
            f"{settings['ruler']['extractor']}, eval.batch_size={settings['batch_size']}; "
            "one every train.metrics_kimg)",
            "raise devices.timeout_s above what one measurement takes on rank 0, lower "
            "train.metrics_num_samples, or set train.metrics_kimg 0",
        )


def is_better(fid: float, best: dict | None) -> bool:
    """A finite FID below the best so far (the earlier point wins a tie)."""
    return math.isfinite(fid) and (best is None or fid < best["fid"])
