"""The typed schema of params.yaml, and its only reader.

Every section is a frozen pydantic model with ``extra="forbid"``: a typo is an error that
names the key. Types are strict: a quoted number (``image_size: "32"``), a float for an
integer (``seed: 2.0``) or a word for a boolean (``"yes"``) is an error, not a guess. What
YAML and ``dvc exp run -S`` legitimately write still validates: an integer for a float
(``kimg: 5``), a list for a pair (``betas: [0.5, 0.99]``), null for an optional value.

:func:`load_params` collects every problem in the file (unknown keys, wrong types,
out-of-range values, incompatible combinations) and raises one :class:`ParamsError` listing
them all with their dotted key paths, before any work starts.
"""

from __future__ import annotations

import difflib
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)
from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError
from ruamel.yaml.events import (
    AliasEvent,
    CollectionEndEvent,
    CollectionStartEvent,
    ScalarEvent,
)

from ganpipe.errors import UserError

#: Image sizes the DCGAN family supports (4x4 core doubled until the output size).
DCGAN_IMAGE_SIZES = (16, 32, 64)
#: Image sizes the ResNet family supports (4x4 core, one residual block per doubling).
RESNET_IMAGE_SIZES = (32, 64, 128, 256)
#: Image sizes of each ``model.arch``.
IMAGE_SIZES = {"dcgan": DCGAN_IMAGE_SIZES, "resnet": RESNET_IMAGE_SIZES}
#: Resolutions of the ResNet family's feature maps (keys of model.g_channels / d_channels).
RESNET_RESOLUTIONS = (4, 8, 16, 32, 64, 128, 256)
#: Keys of ``model`` that shape one family's networks only (left out of the other's records).
FAMILY_KEYS = {"dcgan": ("g_width", "d_width"), "resnet": ("g_channels", "d_channels")}
#: The operations of train.augment (:mod:`ganpipe.augment`).
AUGMENT_POLICIES = ("color", "translation", "cutout")
#: The folder train.init_from must lie in. A DVC dependency cannot be conditional or null, so
#: dvc.yaml's train stage depends on this whole folder: a model put there, or changed, reruns
#: train (a run without init_from then resumes its own final checkpoint: same bytes).
INIT_DIR = "init"

#: Upper bound of every length and interval in kimg: a billion images. Without one, a value
#: like 1e308 passes validation and overflows when the loop turns it into iterations.
MAX_KIMG = 1_000_000
#: Upper bound of the gradient penalty weights (train.gp_weight, train.r1_gamma).
MAX_PENALTY_WEIGHT = 10_000

#: Largest params file read: the committed params.yaml is about 5 KiB, and the YAML parser is
#: pure Python (about 0.4 s per MiB).
MAX_PARAMS_BYTES = 256 * 1024
#: Most nodes (keys, values, lists) a params document may have with its aliases expanded;
#: the committed params.yaml has about 150. Refuses "billion laughs" alias bombs.
MAX_YAML_NODES = 10_000
#: Deepest nesting of mappings and lists (params.yaml's deepest, train.betas, is level 3).
MAX_YAML_DEPTH = 16


class ParamsError(UserError):
    """params.yaml is invalid. ``problems`` holds one ``(dotted_key, message)`` per problem."""

    def __init__(self, source: str, problems: list[tuple[str, str]]):
        self.source = source
        self.problems = problems
        if [key for key, _ in problems] == ["(file)"]:  # the file itself: one line
            super().__init__(f"{source}: {problems[0][1]}")
            return
        lines = [f"{source}: {len(problems)} problem(s) in params:"]
        lines += [f"  - {key}: {message}" for key, message in problems]
        super().__init__("\n".join(lines))


def _list_to_policy(value: Any) -> Any:
    # train.augment as a YAML list: [color, translation] is color+translation.
    return "+".join(map(str, value)) if isinstance(value, list) and value else value


def _list_to_tuple(value: Any) -> Any:
    # YAML has no tuples: a fixed-length pair arrives as a list, which strict mode refuses.
    return tuple(value) if isinstance(value, list) else value


def _digit_keys_to_int(value: Any) -> Any:
    # JSON (a model file's record) has string keys only: {"32": 64} is resolution 32.
    if isinstance(value, Mapping):
        return {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in value.items()}
    return value


#: Channels per resolution (a model.g_channels / model.d_channels mapping).
ChannelsAt = Annotated[
    dict[int, Annotated[int, Field(ge=1, le=4096)]], BeforeValidator(_digit_keys_to_int)
]


class _Section(BaseModel):
    # strict: no str -> number/bool or float -> int coercion (int -> float is still allowed).
    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        strict=True,
        allow_inf_nan=False,
        use_attribute_docstrings=True,
    )


class DataParams(_Section):
    """Where the images come from and how they are turned into LMDB."""

    source: Literal["digits", "folder", "cifar10", "mnist"] = "digits"
    """digits: scikit-learn's bundled 8x8 digits (no files needed); folder: an image folder
    (class sub-folders or flat); cifar10: the python-batches directory; mnist: IDX files."""
    path: str | None = None
    """Folder or files for folder / cifar10 / mnist (relative to the repo root); null for digits."""
    image_size: int = Field(32, ge=8, le=1024)
    """Output side length in pixels (resize short side, then center crop)."""
    channels: Literal[1, 3] = 1
    """1 (grayscale, ITU-R 601-2 luma) or 3 (RGB)."""
    val_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    """Fraction of the images held out for validation, chosen by ``data.split_seed``. Above 0:
    the featurenet stage measures its accuracy and the evaluate stage compares samples on this
    split, so it must hold at least one image."""
    split_seed: int = Field(0, ge=0, lt=2**63)
    """Seed of the train/val split. It belongs to the dataset, not to an experiment: the val
    split is half of the ruler every metric is measured with, so experiments with different
    training ``seed`` values are compared on the same images."""
    on_bad_image: Literal["error", "skip"] = "error"
    """error: stop at the first unreadable image, naming it; skip: leave it out and record it."""

    @model_validator(mode="after")
    def _path_matches_source(self) -> DataParams:
        if self.source == "digits" and self.path is not None:
            raise ValueError(
                f"data.path={self.path!r} is set but data.source=digits reads no files; "
                "remove data.path or choose data.source folder, cifar10 or mnist"
            )
        if self.source != "digits" and not self.path:
            raise ValueError(
                f"data.source={self.source} needs data.path (the folder holding the files)"
            )
        return self


class DevicesParams(_Section):
    """Where training runs."""

    accelerator: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: CUDA when available, else CPU."""
    gpus: Literal["all"] | list[Annotated[int, Field(ge=0, le=1023)]] = "all"
    """GPUs the workers may use: all, or a list of indices (becomes CUDA_VISIBLE_DEVICES)."""
    nproc_per_node: int = Field(1, ge=1, le=1024)
    """Training processes on this machine (one per GPU on CUDA)."""
    nnodes: int = Field(1, ge=1, le=4096)
    """Machines taking part; more than 1 uses torchrun's c10d rendezvous."""
    node_rank: int = Field(0, ge=0, le=4095)
    """This machine's index among the nodes (0 .. nnodes-1)."""
    rdzv_endpoint: str = Field("127.0.0.1:29400", pattern=r"^[^\s:]+:\d{1,5}$")
    """host:port of the rendezvous (node 0's address) when nnodes > 1."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Collective backend; auto: nccl on CUDA, gloo on CPU."""
    timeout_s: int = Field(300, ge=5, le=86400)
    """Seconds a collective may wait before the run fails (a dead or stuck rank). Also the
    longest the other ranks wait while rank 0 alone measures FID while training (one
    train.metrics_kimg point, or the val split's first pass through the extractor)."""
    cpu_threads: int = Field(2, ge=1, le=256)
    """Intra-op threads per process. On CPU the thread count changes the bits of the result,
    so it is part of the run's configuration."""
    oversubscribe: bool = False
    """Launch more processes on this machine than it has CPU cores (on CPU), or than its
    memory is estimated to hold (each process's footprint taken as the launcher's own).
    Off: such a launch is refused before any process starts; on: for testing DDP on a small
    machine, at the cost of speed (the bits do not depend on it)."""

    @property
    def world_size(self) -> int:
        """Total number of training processes."""
        return self.nproc_per_node * self.nnodes

    @model_validator(mode="after")
    def _consistent(self) -> DevicesParams:
        problems = []
        if self.node_rank >= self.nnodes:
            problems.append(
                f"devices.node_rank={self.node_rank} must be below devices.nnodes={self.nnodes}"
            )
        if self.backend == "nccl" and self.accelerator == "cpu":
            problems.append(
                "devices.backend=nccl needs CUDA but devices.accelerator=cpu; use backend gloo "
                "or auto"
            )
        if int(self.rdzv_endpoint.rsplit(":", 1)[1]) > 65535:
            problems.append(
                f"devices.rdzv_endpoint={self.rdzv_endpoint} names a port above 65535; use a "
                "free port of node 0, e.g. 29400"
            )
        if isinstance(self.gpus, list) and len(set(self.gpus)) != len(self.gpus):
            problems.append(f"devices.gpus={self.gpus} lists a GPU twice")
        if isinstance(self.gpus, list) and self.gpus and len(self.gpus) < self.nproc_per_node:
            problems.append(
                f"devices.nproc_per_node={self.nproc_per_node} is more than the "
                f"{len(self.gpus)} GPU(s) in devices.gpus={self.gpus}; lower it or list more"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self


class DeterminismParams(_Section):
    """Bit-for-bit reproducibility switches."""

    deterministic: bool = True
    """torch.use_deterministic_algorithms(True); errors on ops without a deterministic kernel."""
    cudnn_benchmark: bool = False
    """cuDNN autotuning: faster convolutions, but the chosen kernel (and the bits) may vary."""
    cpu_isa: Literal["portable", "native"] = "portable"
    """CPU code paths. portable: the same bits on every x86-64 CPU with AVX2 and FMA, Intel or
    AMD (ATen's own convolutions over MKL in its cross-vendor reproducible mode, ATen kernels
    at AVX2; slower training on CPU, see docs/reproducibility.md); native: the fastest code for
    this CPU (oneDNN), bits hold for this CPU model only. On a GPU it governs the CPU-side
    work (latents, data) only."""

    @model_validator(mode="after")
    def _benchmark_breaks_determinism(self) -> DeterminismParams:
        if self.deterministic and self.cudnn_benchmark:
            raise ValueError(
                "determinism.cudnn_benchmark=true contradicts determinism.deterministic=true; "
                "turn one of them off"
            )
        return self


class ModelParams(_Section):
    """Generator and discriminator architecture."""

    arch: Literal["dcgan", "resnet"] = "dcgan"
    """Network family. dcgan: DCGAN (Radford et al. 2016) for 16, 32 or 64 pixel images,
    widths from g_width / d_width; resnet: SNGAN/BigGAN-style residual networks (Miyato et al.
    2018, Brock et al. 2019) for 32, 64, 128 or 256 pixels, widths from g_channels /
    d_channels, spectral norm on every layer of D; the family that can be conditional."""
    z_dim: int = Field(100, ge=1, le=4096)
    """Latent vector length."""
    g_width: int = Field(32, ge=1, le=1024)
    """dcgan: channels of the generator's last hidden layer; earlier layers double it."""
    d_width: int = Field(32, ge=1, le=1024)
    """dcgan: channels of the discriminator's first layer; later layers double it."""
    g_channels: ChannelsAt = Field(
        default_factory=lambda: {4: 128, 8: 128, 16: 64, 32: 32, 64: 32, 128: 16, 256: 16}
    )
    """resnet: channels of the generator's feature maps at each resolution (4 .. 256), the
    output of the residual block that reaches it; the entries up to data.image_size are used."""
    d_channels: ChannelsAt = Field(
        default_factory=lambda: {4: 128, 8: 128, 16: 64, 32: 32, 64: 32, 128: 16}
    )
    """resnet: channels of the discriminator's feature maps at each resolution (4 .. 128), the
    output of the residual block that reaches it; the entries below data.image_size are used."""
    norm: Literal["batch", "sync_batch", "instance", "layer", "spectral", "none"] = "batch"
    """Normalisation in G and D hidden layers. batch: BatchNorm (the paper's), statistics per
    process; sync_batch: BatchNorm with statistics over all processes (CUDA only);
    instance / layer: per-sample (DDP equals one process with the whole batch);
    spectral: spectral norm on every conv instead. resnet: G's normalisation only (D always
    has spectral norm and no normalisation layer)."""
    conditional: bool = False
    """Class-conditional G and D (resnet only): class-conditional normalisation in G (a gain
    and bias per class) and a projection discriminator (Miyato & Koyama 2018). Needs a dataset
    with at least 2 classes and a normalisation layer in G (norm batch, sync_batch, instance
    or layer)."""

    @model_validator(mode="after")
    def _consistent(self) -> ModelParams:
        problems = []
        for key in ("g_channels", "d_channels"):
            odd = sorted(r for r in getattr(self, key) if r not in RESNET_RESOLUTIONS)
            if odd:
                problems.append(
                    f"model.{key} has resolution(s) {', '.join(map(str, odd))}; the resolutions "
                    f"are {', '.join(map(str, RESNET_RESOLUTIONS))}"
                )
        if self.conditional and self.arch != "resnet":
            problems.append(
                f"model.conditional=true is not supported by model.arch={self.arch} (its D ends "
                "in a convolution, with no feature vector to project a label on); use "
                "model.arch resnet or conditional false"
            )
        elif self.conditional and self.norm in ("spectral", "none"):
            problems.append(
                f"model.conditional=true conditions G through its normalisation layers, which "
                f"model.norm={self.norm} has none of; use model.norm batch, instance or layer"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_serializer(mode="wrap")
    def _family_keys_only(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A model file's record and a run's fingerprint hold the keys that shape this family's
        # networks only: another family's keys (and conditional, when off) would change the
        # bytes of every model file whenever a family is added, and mean nothing there.
        data = handler(self)
        for arch, keys in FAMILY_KEYS.items():
            if arch != self.arch:
                for key in keys:
                    data.pop(key, None)
        if not self.conditional:
            data.pop("conditional", None)
        return data

    def channels_problems(self, image_size: int) -> list[str]:
        """What is missing from g_channels / d_channels for ``image_size`` (resnet)."""
        problems = []
        for key, top in (("g_channels", image_size), ("d_channels", image_size // 2)):
            needed = [r for r in RESNET_RESOLUTIONS if r <= top]
            missing = [r for r in needed if r not in getattr(self, key)]
            if missing:
                problems.append(
                    f"model.{key} has no channels for resolution(s) "
                    f"{', '.join(map(str, missing))}; data.image_size={image_size} needs "
                    f"{', '.join(map(str, needed))}"
                )
        return problems


class TrainParams(_Section):
    """The training run."""

    strategy: Literal["d_first_retain", "d_first_detach", "g_first_detach"] = "d_first_detach"
    """Update strategy; see docs/training.md, "Update strategies"."""
    loss: Literal["bce", "hinge", "wgan_gp"] = "bce"
    """bce: binary cross-entropy for D, non-saturating loss for G; hinge: hinge loss for D,
    -D(G(z)) for G; wgan_gp: Wasserstein critic with gradient penalty (use n_critic 5)."""
    gp_weight: float = Field(10.0, ge=0, le=MAX_PENALTY_WEIGHT)
    """Weight λ of WGAN-GP's gradient penalty (only with loss wgan_gp). Gulrajani et al.
    2017 use 10; at most 10,000."""
    r1_gamma: float = Field(0.0, ge=0, le=MAX_PENALTY_WEIGHT)
    """Weight γ of the R1 penalty γ/2·E||∇D(x)||² on real images, with any loss; 0 = off.
    StyleGAN2-ADA's configurations use 0.01 (CIFAR-10) to 10; at most 10,000."""
    n_critic: int = Field(1, ge=1, le=100)
    """D updates per G update; each D update sees its own real batch."""
    batch_size: int = Field(64, ge=1, le=65536)
    """Global batch size (images per optimizer step)."""
    grad_accum: int = Field(1, ge=1, le=1024)
    """Micro-batches per optimizer step: each process runs batch_size / (world size x
    grad_accum) images at a time and adds up their gradients (less memory, same update with a
    per-sample norm)."""
    kimg: float = Field(100.0, gt=0, le=MAX_KIMG)
    """Length of training, in thousands of real images shown to D; at most 1,000,000 (a
    billion images; StyleGAN2 trains FFHQ for 25,000)."""
    optimizer: Literal["adam", "sgd"] = "adam"
    """adam (with betas) or plain sgd (no momentum; a baseline, and exact DDP checks)."""
    lr_g: float = Field(2.0e-4, gt=0, le=1.0)
    """Learning rate of G at train.reference_batch."""
    lr_d: float = Field(2.0e-4, gt=0, le=1.0)
    """Learning rate of D at train.reference_batch."""
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    """How learning rates follow the batch size: lr * (batch_size / reference_batch) for
    linear, its square root for sqrt."""
    reference_batch: int = Field(64, ge=1, le=65536)
    """Batch size the learning rates were tuned for (with lr_scaling)."""
    betas: Annotated[
        tuple[Annotated[float, Field(ge=0.0, lt=1.0)], Annotated[float, Field(ge=0.0, lt=1.0)]],
        BeforeValidator(_list_to_tuple),
    ] = (0.5, 0.999)
    """Adam (beta1, beta2)."""
    ema_kimg: float = Field(5.0, ge=0, le=MAX_KIMG)
    """Half-life of the EMA of G's weights, in thousands of images; 0 turns EMA off. At most
    1,000,000, as train.kimg."""
    checkpoint_kimg: float = Field(10.0, gt=0, le=MAX_KIMG)
    """Interval of full-state checkpoints (exact resume), in thousands of images; at most
    1,000,000, as train.kimg (a longer interval than the run checkpoints at the end only)."""
    keep_checkpoints: int = Field(2, ge=1, le=1000)
    """How many of the newest checkpoints of a run to keep."""
    snapshot_kimg: float = Field(10.0, gt=0, le=MAX_KIMG)
    """Interval of progress grids (fixed latents) in the training log, in thousands of
    images; at most 1,000,000, as train.kimg."""
    log_every_kimg: float = Field(1.0, gt=0, le=MAX_KIMG)
    """Interval of scalar logging (losses, D outputs, images/s), in thousands of images; at
    most 1,000,000, as train.kimg."""
    metrics_kimg: float = Field(10.0, ge=0, le=MAX_KIMG)
    """Interval of FID and KID of EMA-G while training, in thousands of images (and at the
    end); 0 = off. Measured as the evaluate stage measures (eval.feature_extractor, the val
    split, eval.seed, eval.batch_size, eval.kid_subsets, eval.kid_subset_size) on
    train.metrics_num_samples samples; the lowest FID's EMA is models/g_ema_best.pt. At most
    1,000,000, as train.kimg."""
    metrics_num_samples: int = Field(2000, ge=2, le=1_000_000)
    """Generated images per FID/KID while training (with train.metrics_kimg); at least
    eval.kid_subset_size. Equal to eval.num_samples, the last point is the evaluate stage's
    FID of models/g_ema.pt."""
    activation_checkpointing: bool = False
    """Recompute each G and D block's activations in backward (torch.utils.checkpoint,
    non-reentrant) instead of storing them: less memory, one more forward per block."""
    num_workers: int = Field(0, ge=0, le=64)
    """DataLoader worker processes. 0 reads in the training process, which is fastest for
    small images on a 2-core machine."""
    resident_mb: float = Field(1024.0, ge=0, le=1_048_576)
    """Hold the training set on the training device as uint8 (read once; each batch is then
    gathered by index from the same permutation, no DataLoader) when it takes at most this
    many MiB; 0 always reads through the DataLoader. The batches are the same either way."""
    cuda_graph: bool = True
    """On a GPU, capture each training iteration in a CUDA graph after 11 eager ones and
    replay it (far fewer kernel launches; the same bits as eager). Eager, with the reason in
    the log, under DDP or activation_checkpointing; false: always eager. No effect on CPU."""
    augment: Annotated[str, BeforeValidator(_list_to_policy)] = Field("none", max_length=64)
    """Differentiable augmentation of every image D sees, real and generated, in every pass
    (DiffAugment, Zhao et al. 2020): none, or operations of color, translation and cutout
    joined by + (e.g. color+translation+cutout, DiffAugment's choice for small data; a YAML
    list or commas are accepted too, but `dvc exp run -S` reads a comma as a sweep). Random
    numbers derive from the seed and the batch: runs stay reproducible."""
    augment_p: float = Field(1.0, ge=0.0, le=1.0)
    """Probability that an image is augmented (ADA's strength p; DiffAugment uses 1); with
    augment_target, the p training starts from."""
    augment_target: float | None = Field(None, gt=0.0, lt=1.0)
    """Adaptive strength (ADA, Karras et al. 2020): null keeps augment_p fixed; a target for
    r_t, the mean sign of D's outputs on one batch of reals per iteration (ADA uses 0.6),
    makes p rise while r_t is above it (D sure of the reals: it is memorising them) and fall
    while below. p and r_t are logged as augment/p and d/real_sign."""
    augment_speed_kimg: float = Field(100.0, gt=0, le=MAX_KIMG)
    """Adaptive strength: p moves by at most 1 per this many kimg (ADA uses 500 on runs of
    tens of thousands of kimg)."""
    xflip: bool = False
    """Mirror the real images: each one D sees is flipped left to right with probability 1/2,
    drawn from the seed, the global batch and its place in the batch (StyleGAN2-ADA's
    --mirror). The LMDB files, the validation split and the feature network stay as they
    are: metrics with and without mirroring share one ruler. For data whose mirror images
    are plausible (faces, scenes), not digits or text."""
    init_from: str | None = Field(None, max_length=1024)
    """Fine-tuning: start G, D and the EMA from the model files of an earlier run, a folder
    inside init/ holding generator.pt, discriminator.pt and g_ema.pt as the train stage
    writes them to models/ (e.g. init/digits04); the model and data.image_size /
    data.channels params must make networks of the files' shapes. Optimizers, ADA's p and
    the count of kimg start afresh; a checkpoint of the run itself still wins (resume).
    null: random weights from seed."""

    @field_validator("augment")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value == "none":
            return value
        names = [name.strip() for name in re.split(r"[,+]", value)]
        unknown = [name for name in names if name not in AUGMENT_POLICIES]
        if unknown or len(set(names)) != len(names):
            raise ValueError(
                f"train.augment={value!r}: use none or {', '.join(AUGMENT_POLICIES)} joined by +, "
                "without repeats (e.g. color+translation+cutout)"
            )
        return "+".join(names)

    @field_validator("init_from")
    @classmethod
    def _inside_init_dir(cls, value: str | None) -> str | None:
        if value is None:
            return value
        parts = Path(value).parts
        if Path(value).is_absolute() or ".." in parts or len(parts) < 2 or parts[0] != INIT_DIR:
            raise ValueError(
                f"train.init_from={value!r} is not a folder inside {INIT_DIR}/, the folder "
                f"dvc.yaml's train stage depends on; put the model files there (e.g. `mkdir -p "
                f"{INIT_DIR}/NAME && cp models/{{generator,discriminator,g_ema}}.pt "
                f"{INIT_DIR}/NAME/`, or `dvc add {INIT_DIR}/NAME`) and set "
                f"train.init_from: {INIT_DIR}/NAME"
            )
        return Path(value).as_posix()

    @model_validator(mode="after")
    def _adaptive_needs_a_policy(self) -> TrainParams:
        if self.augment_target is not None and self.augment == "none":
            raise ValueError(
                f"train.augment_target={self.augment_target} tunes the strength of "
                "train.augment, which is none; set train.augment (e.g. "
                "color+translation+cutout) or augment_target null"
            )
        return self

    @property
    def augment_policy(self) -> tuple[str, ...]:
        """The augmentation operations in order; empty for none."""
        return () if self.augment == "none" else tuple(self.augment.split("+"))


class GenerateParams(_Section):
    """Sample generation from the trained generator."""

    seed: int = Field(123, ge=0, lt=2**63)
    """Seed of the latents of the sample grid."""
    grid_rows: int = Field(8, ge=1, le=64)
    """The grid is grid_rows x grid_rows images."""
    num_images: int = Field(64, ge=0, le=1_000_000)
    """Individual PNGs exported to samples/images/ for external tools (0: none)."""
    truncation: float | None = Field(None, gt=0, le=10)
    """Truncation trick: latents beyond ±truncation are redrawn (less variety, more typical
    samples); null draws plain N(0, I)."""
    interpolation_steps: int = Field(10, ge=2, le=64)
    """Images in the latent interpolation strip (samples/interpolation.png)."""
    interpolation_rows: int = Field(4, ge=1, le=64)
    """Strips, one pair of end points each."""


class FeaturenetParams(_Section):
    """The feature network of FID/KID/precision-recall, trained by the featurenet stage on
    the real training split (classification of the labels, or rotation prediction when the
    data has a single class)."""

    width: int = Field(16, ge=4, le=512)
    """Channels of the first conv layer; features are 4 x width wide."""
    epochs: int = Field(6, ge=1, le=1000)
    """Passes over the training split."""
    batch_size: int = Field(64, ge=1, le=65536)
    """Images per step."""
    lr: float = Field(1.0e-3, gt=0, le=1.0)
    """Adam learning rate."""
    seed: int = Field(0, ge=0, lt=2**63)
    """Seed of the feature network's weights and data order. With ``data.split_seed`` it fixes
    the ruler of the metrics: experiments that differ only in the training ``seed`` are
    measured in one feature space."""


class EvalParams(_Section):
    """The evaluate stage: FID, KID and precision/recall of EMA-G against the val split."""

    feature_extractor: Literal["featurenet", "inception"] = "featurenet"
    """featurenet: the network of the featurenet stage; inception: the standard FID
    Inception-v3, read from eval.inception_weights (never downloaded)."""
    inception_weights: str | None = None
    """Local file of the FID Inception weights (torch-fidelity's
    weights-inception-2015-12-05-6726825d.pth); needed with feature_extractor inception."""
    inception_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    """Expected sha256 of inception_weights; null accepts only the standard file, whose
    sha256 begins with 6726825d."""
    num_samples: int = Field(2000, ge=2, le=1_000_000)
    """Generated images compared with the real val split."""
    batch_size: int = Field(250, ge=1, le=65536)
    """Images per generation and feature batch (per process)."""
    seed: int = Field(2024, ge=0, lt=2**63)
    """Seed of the generated samples' latents."""
    kid_subsets: int = Field(50, ge=1, le=10000)
    """KID is the mean (± std) over this many random subsets."""
    kid_subset_size: int = Field(100, ge=2, le=100_000)
    """Images per KID subset; at most the number of real and of generated images."""
    pr_k: int = Field(3, ge=1, le=100)
    """k of the k-NN radii of precision/recall (Kynkäänniemi et al. 2019 use 3)."""

    @model_validator(mode="after")
    def _consistent(self) -> EvalParams:
        problems = []
        if self.feature_extractor == "inception" and self.inception_weights is None:
            problems.append(
                "eval.feature_extractor=inception needs eval.inception_weights: the path of a "
                "local copy of weights-inception-2015-12-05-6726825d.pth (nothing is "
                "downloaded); or use feature_extractor featurenet"
            )
        if self.kid_subset_size > self.num_samples:
            problems.append(
                f"eval.kid_subset_size={self.kid_subset_size} is more than "
                f"eval.num_samples={self.num_samples}; lower it or generate more"
            )
        if self.pr_k >= self.num_samples:
            problems.append(
                f"eval.pr_k={self.pr_k} needs more than {self.pr_k} samples; raise eval.num_samples"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self


class Params(_Section):
    """The whole of params.yaml."""

    seed: int = Field(0, ge=0, lt=2**63)
    """Training seed: G's and D's initial weights, the data order, the latents and the
    augmentations derive from it. The split (``data.split_seed``) and the feature network of
    the metrics (``featurenet.seed``) do not: changing ``seed`` reruns train, generate and
    evaluate only, and their metrics stay comparable."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Autocast precision of the forward passes; fp16 adds a GradScaler."""
    data: DataParams = DataParams()
    devices: DevicesParams = DevicesParams()
    determinism: DeterminismParams = DeterminismParams()
    model: ModelParams = ModelParams()
    train: TrainParams = TrainParams()
    generate: GenerateParams = GenerateParams()
    featurenet: FeaturenetParams = FeaturenetParams()
    eval: EvalParams = EvalParams()

    @model_validator(mode="after")
    def _sections_fit_together(self) -> Params:
        problems = _cross_section_problems(self.data, self.model, self.train, self.devices)
        problems += _metrics_problems(self.train, self.eval)
        if problems:
            raise ValueError("; ".join(problems))
        return self


def _cross_section_problems(
    data: DataParams | None,
    model: ModelParams | None,
    train: TrainParams | None,
    devices: DevicesParams | None = None,
) -> list[str]:
    """Rules that involve more than one section; a ``None`` section (invalid) skips its rules."""
    problems = []
    if data and model and data.image_size not in IMAGE_SIZES[model.arch]:
        problems.append(
            f"data.image_size={data.image_size} is not supported by model.arch={model.arch}; "
            f"use one of {', '.join(map(str, IMAGE_SIZES[model.arch]))}"
            + "".join(
                f" (or model.arch {other}: {', '.join(map(str, sizes))})"
                for other, sizes in IMAGE_SIZES.items()
                if other != model.arch and data.image_size in sizes
            )
        )
    elif data and model and model.arch == "resnet":
        problems += model.channels_problems(data.image_size)
    if (
        train
        and model
        and model.arch == "dcgan"  # resnet's D has no normalisation layer, whatever the norm
        and (train.loss == "wgan_gp" or train.r1_gamma > 0)
        and model.norm in ("batch", "sync_batch")
    ):
        problems.append(
            f"train.loss={train.loss} with train.r1_gamma={train.r1_gamma} penalises D's "
            f"gradient per sample, which BatchNorm (model.norm={model.norm}) mixes across the "
            "batch; use model.norm layer, instance, spectral or none"
        )
    if train and devices and train.batch_size % (devices.world_size * train.grad_accum):
        world, parts = devices.world_size, devices.world_size * train.grad_accum
        problems.append(
            f"train.batch_size={train.batch_size} is not divisible by world size {world} "
            f"(devices.nproc_per_node x devices.nnodes) x train.grad_accum={train.grad_accum}; "
            f"use a multiple of {parts}"
        )
    if model and devices and model.norm == "sync_batch" and devices.accelerator == "cpu":
        problems.append(
            "model.norm=sync_batch needs CUDA (SyncBatchNorm only works with GPU modules) but "
            "devices.accelerator=cpu; use norm batch, instance, layer or none on CPU"
        )
    if (
        train
        and model
        and model.arch == "dcgan"  # resnet's recomputation replays the power iteration's vectors
        and train.activation_checkpointing
        and model.norm == "spectral"
    ):
        problems.append(
            "train.activation_checkpointing=true with model.norm=spectral (model.arch=dcgan): "
            "the recomputed forward would advance spectral norm's power iteration a second "
            "time and change the gradients; turn checkpointing off, use another norm, or "
            "model.arch resnet"
        )
    return problems


def _metrics_problems(train: TrainParams | None, eval_: EvalParams | None) -> list[str]:
    """The in-training metrics (train.metrics_*) against the eval settings they share."""
    if not (train and eval_ and train.metrics_kimg > 0):
        return []
    if eval_.kid_subset_size > train.metrics_num_samples:
        return [
            f"eval.kid_subset_size={eval_.kid_subset_size} is more than "
            f"train.metrics_num_samples={train.metrics_num_samples} (KID while training); "
            "raise train.metrics_num_samples, lower eval.kid_subset_size, or set "
            "train.metrics_kimg 0"
        ]
    return []


def _valid_or_none(section: type[_Section], raw: Any) -> Any:
    try:
        return section.model_validate(raw or {})
    except ValidationError:
        return None  # the section's own problems are listed already


def _cross_section_problems_of_raw(raw: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Cross-section rules, checked even when unrelated sections are invalid.

    Pydantic skips ``Params``' own validator when any section fails; this runs the same
    rules for every combination of sections that are valid by themselves.
    """
    sections = [
        _valid_or_none(section, raw.get(name))
        for name, section in (
            ("data", DataParams),
            ("model", ModelParams),
            ("train", TrainParams),
            ("devices", DevicesParams),
        )
    ]
    problems = _cross_section_problems(*sections)
    problems += _metrics_problems(sections[2], _valid_or_none(EvalParams, raw.get("eval")))
    return [("(top level)", p) for p in problems]


def _fields_at(loc: tuple[Any, ...]) -> list[str]:
    """Field names of the section at ``loc`` (for "did you mean" hints)."""
    model: type[BaseModel] = Params
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None or not (
            isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
        ):
            return []
        model = field.annotation
    return list(model.model_fields)


#: Why a key has the range it has, where the bound alone does not say (added to range errors).
_RANGE_REASONS = {
    "data.val_fraction": (
        "the featurenet stage measures its accuracy and the evaluate stage compares samples on "
        "the validation split, so both need one; use e.g. 0.1"
    ),
}


#: What each pattern-checked key expects, by field name (a pattern mismatch reports it).
_PATTERN_MESSAGES = {
    "rdzv_endpoint": "expected host:port, e.g. 10.0.0.1:29400",
    "inception_sha256": "expected a sha256: 64 lowercase hex digits, as `sha256sum FILE` prints",
}


def _describe(error: Mapping[str, Any]) -> tuple[str, str]:
    """Turn one pydantic error into ``(dotted_key, message with the fix)``."""
    loc = tuple(error["loc"])
    key = ".".join(str(p) for p in loc) or "(top level)"
    kind = error["type"]
    if kind == "extra_forbidden":
        known = _fields_at(loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        hint = f" Did you mean {'.'.join([*map(str, loc[:-1]), close[0]])}?" if close else ""
        return key, f"unknown key.{hint} Valid keys here: {', '.join(known)}"
    if kind == "missing" and loc and isinstance(loc[-1], int):
        parent = ".".join(str(p) for p in loc[:-1])
        return parent, f"too few items (got {error.get('input')!r}); see the default in params.yaml"
    if kind == "string_pattern_mismatch":
        expected = _PATTERN_MESSAGES.get(loc[-1] if loc else "", "does not match its pattern")
        return key, f"{expected} (got {error.get('input')!r})"
    if kind == "value_error":
        # Our cross-field validators write complete sentences that name their keys.
        return key, str(error["msg"]).removeprefix("Value error, ")
    got = error.get("input")
    shown = "" if isinstance(got, Mapping) else f" (got {got!r})"
    reason = (
        f"; {_RANGE_REASONS[key]}"
        if key in _RANGE_REASONS and kind.startswith(("greater", "less"))
        else ""
    )
    return key, f"{error['msg']}{shown}{_type_hint(kind, got)}{reason}"


def _type_hint(kind: str, got: Any) -> str:
    """The fix for a strict-mode type error that YAML quoting or a stray ``.0`` caused."""
    if kind == "bool_type" and isinstance(got, str):
        return "; write true or false (without quotes)"
    if kind in ("int_type", "float_type") and isinstance(got, str):
        try:
            float(got)
        except ValueError:
            return ""
        return "; write the number without quotes"
    if kind == "int_type" and isinstance(got, float) and got.is_integer():
        return f"; write a whole number, e.g. {int(got)}"
    return ""


def parse_params(raw: Any, source: str = "params") -> Params:
    """Validate an already-parsed params mapping.

    Args:
        raw: The mapping read from YAML (``None`` means all defaults).
        source: Name of the origin, used in the error message.

    Raises:
        ParamsError: listing every problem found.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ParamsError(source, [("(top level)", "expected a mapping of sections")])
    try:
        return Params.model_validate(dict(raw))
    except ValidationError as exc:
        problems = [_describe(e) for e in exc.errors()]
        problems += [p for p in _cross_section_problems_of_raw(raw) if p not in problems]
        raise ParamsError(source, problems) from None


def load_params(path: str | Path = "params.yaml") -> Params:
    """Read and validate params.yaml; the only reader of that file.

    Raises:
        ParamsError: the file is missing, unreadable, not UTF-8, too large, not YAML, holds
            an alias bomb, or holds invalid values (all listed).
    """
    path = Path(path)
    try:
        text = read_text_bounded(path)
        raw = read_yaml(text)
    except (_FileProblem, YamlBudgetError) as exc:
        raise ParamsError(str(path), [("(file)", str(exc))]) from None
    except YAMLError as exc:
        raise ParamsError(str(path), [("(file)", f"not valid YAML: {exc}")]) from None
    return parse_params(raw, str(path))


class _FileProblem(Exception):
    """The params file cannot be read as params YAML (the message says why and the fix)."""


def read_text_bounded(path: Path) -> str:
    """The UTF-8 text of ``path``, refusing what is not a regular file of at most
    :data:`MAX_PARAMS_BYTES` (the parser is pure Python: a huge file would take minutes)."""
    try:
        # O_NONBLOCK: opening a FIFO named params.yaml must not wait for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise _FileProblem("not found; run from the repo root") from None
    except OSError as exc:
        raise _FileProblem(f"cannot be opened ({exc.strerror}); check its permissions") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _FileProblem("not a regular file; params must be a YAML file")
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_PARAMS_BYTES + 1)
    if len(data) > MAX_PARAMS_BYTES:
        raise _FileProblem(
            f"larger than {MAX_PARAMS_BYTES // 1024} KiB (the committed params.yaml is about "
            "5 KiB); it is not a params file, or shorten it"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise _FileProblem(
            f"not UTF-8 text (byte 0x{data[exc.start]:02x} on line {line}); save it as UTF-8"
        ) from None


def read_yaml(text: str) -> Any:
    """Parse params YAML as DVC does (YAML 1.2, ruamel's safe loader).

    So ganpipe validates exactly the values DVC records and ``dvc exp run -S`` writes:
    ``1e-3`` is a number (PyYAML's YAML 1.1 reads it as a string), ``yes`` is a string, not
    a boolean, and a key given twice is an error instead of a silent override.

    The document's shape is checked first, from the parser's events and before anything is
    built (:func:`check_yaml_shape`): aliases that expand beyond :data:`MAX_YAML_NODES` (a
    "billion laughs" bomb: a few KB that validation would walk for hours) and nesting beyond
    :data:`MAX_YAML_DEPTH` (the composer recurses) are refused.

    Raises:
        YAMLError: invalid YAML, or a document beyond those budgets.
    """
    check_yaml_shape(text)
    return YAML(typ="safe", pure=True).load(text)


class YamlBudgetError(YAMLError):
    """A YAML document too large once its aliases are expanded, or nested too deeply."""


def check_yaml_shape(text: str) -> None:
    """Count the nodes of ``text`` with every alias expanded, and its nesting depth, in one
    pass over the parser's events (nothing is built, so a bomb costs no memory).

    Raises:
        YamlBudgetError: beyond :data:`MAX_YAML_NODES` nodes, beyond :data:`MAX_YAML_DEPTH`
            levels, or an alias inside the node it names (a recursive structure).
    """
    expanded: dict[Any, int] = {}  # anchor -> nodes of its node with aliases expanded
    open_nodes: list[list[Any]] = []  # [anchor, nodes so far] of each collection being read
    aliased = False
    for event in YAML(typ="safe", pure=True).parse(text):
        if isinstance(event, CollectionStartEvent):
            if len(open_nodes) >= MAX_YAML_DEPTH:
                raise YamlBudgetError(
                    f"nested deeper than {MAX_YAML_DEPTH} levels (params.yaml uses 3); "
                    "it is not a params file"
                )
            open_nodes.append([event.anchor, 1])
            continue
        if isinstance(event, CollectionEndEvent):
            anchor, nodes = open_nodes.pop()
        elif isinstance(event, ScalarEvent):
            anchor, nodes = event.anchor, 1
        elif isinstance(event, AliasEvent):
            if any(event.anchor == a for a, _ in open_nodes):
                raise YamlBudgetError(
                    f"the alias *{event.anchor} is inside the node &{event.anchor} it names "
                    "(a recursive structure); write the values out"
                )
            anchor, nodes = None, expanded.get(event.anchor, 0)  # undefined: the loader says
            aliased = True
        else:
            continue
        if anchor is not None:
            expanded[anchor] = nodes
        if open_nodes:
            open_nodes[-1][1] += nodes
        if nodes > MAX_YAML_NODES or (open_nodes and open_nodes[-1][1] > MAX_YAML_NODES):
            raise YamlBudgetError(
                f"more than {MAX_YAML_NODES:,} keys and values"
                + (" once its aliases (*name) are expanded (an alias bomb?)" if aliased else "")
                + "; params.yaml holds about 150: "
                + ("write the values out instead of aliasing them" if aliased else "shorten it")
            )


def params_digest(section: BaseModel) -> dict[str, Any]:
    """A plain JSON-able dict of a params section (for metadata and checkpoints)."""
    return section.model_dump(mode="json")
