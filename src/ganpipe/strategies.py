"""The three update strategies of one GAN training iteration, side by side.

Each takes ``n_critic`` global batches (:class:`Batch`: this rank's real images and latents,
and the labels and augmentation draws when configured) and makes ``n_critic`` D updates
and one G update. They differ only in the order of the updates and in which D the
generator's gradient sees (docs/training.md, "Update strategies"):

- ``d_first_retain``: one shared forward; G's gradient against the pre-update D.
- ``d_first_detach``: D steps on detached fakes, then G through a fresh pass of the new D.
- ``g_first_detach``: G steps through the current D, then D on the pre-update G's fakes.

Every backward is restricted with ``inputs=`` to the parameters of the network that is
about to step: no gradient is computed that no optimizer uses, and no loss leaks into the
other network's update. With ``n_critic > 1`` the extra D updates come first for the two
D-first strategies and last for ``g_first_detach``; they use fakes drawn without a graph.

With ``grad_accum > 1`` every phase runs its batch as equal micro-batches whose losses are
divided by ``grad_accum``: the summed gradients are those of the whole batch (exactly so
with a per-sample norm), activations are held for one micro-batch at a time, and DDP
all-reduces once per update (``no_sync`` on all micro-batches but the last).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, fields, replace

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from ganpipe.augment import Augment
from ganpipe.losses import GanLoss

Stats = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Batch:
    """This rank's share of one global batch: what one D update (and a G update) consumes."""

    real: Tensor
    z: Tensor
    real_labels: Tensor | None = None
    """Classes of the real images (class-conditional models only)."""
    fake_labels: Tensor | None = None
    """Classes the fakes of ``z`` are drawn for (class-conditional models only)."""
    draws: dict[str, Tensor] | None = None
    """Augmentation uniforms per pass of D (``real``, ``fake``, ``g``; train.augment only)."""

    @classmethod
    def many(cls, reals: Sequence[Tensor], zs: Sequence[Tensor]) -> list[Batch]:
        """Batches of images and latents only (no labels, no augmentation)."""
        return [cls(real, z) for real, z in zip(reals, zs, strict=True)]

    def tensors(self) -> list[Tensor]:
        """Every tensor of the batch (draws by pass name), in a fixed order."""
        out = []
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, dict):
                out += [value[k] for k in sorted(value)]
            elif value is not None:
                out.append(value)
        return out

    def map(self, fn: Callable[[Tensor], Tensor]) -> Batch:
        """The batch with ``fn`` applied to each of its tensors."""

        def apply(value):
            if isinstance(value, dict):
                return {k: fn(v) for k, v in value.items()}
            return None if value is None else fn(value)

        return replace(self, **{f.name: apply(getattr(self, f.name)) for f in fields(self)})

    def chunk(self, parts: int) -> list[Batch]:
        """``parts`` equal micro-batches, each sample keeping its labels and draws."""

        def split(value):
            if value is None:
                return [None] * parts
            if isinstance(value, dict):
                pieces = {k: split(v) for k, v in value.items()}
                return [{k: v[i] for k, v in pieces.items()} for i in range(parts)]
            pieces = value.chunk(parts)
            if len(pieces) != parts:
                raise ValueError(f"a batch of {len(value)} cannot be split in {parts}")
            return pieces

        columns = {f.name: split(getattr(self, f.name)) for f in fields(self)}
        return [replace(self, **{k: v[i] for k, v in columns.items()}) for i in range(parts)]


@dataclass
class Gan:
    """Everything a strategy touches."""

    g: nn.Module
    d: nn.Module
    opt_g: torch.optim.Optimizer
    opt_d: torch.optim.Optimizer
    loss: GanLoss
    scaler_g: torch.amp.GradScaler
    scaler_d: torch.amp.GradScaler
    """One GradScaler per network (active in fp16 only). Each is updated right after its
    network steps: with ``n_critic > 1`` D steps several times per iteration, and a shared
    scaler would refuse to unscale D's gradients a second time before ``update()``, while
    ``d_first_retain`` must not change G's scale between G's backward and G's step."""
    autocast: Callable[[], AbstractContextManager]
    grad_accum: int = 1
    """Micro-batches per update: their gradients add up before the optimizer steps."""
    augment: Augment | None = None
    """Applied to every image D sees (train.augment), with the batch's draws of the pass."""
    skipped: dict[str, Tensor] = field(init=False)
    """Optimizer steps the fp16 scalers skipped (inf/NaN gradients), per network: device
    counters, added to in place (a CUDA graph replays into the same memory) and read
    (:meth:`skipped_steps`) at log and checkpoint intervals only."""

    def __post_init__(self):
        device = next(self.g.parameters()).device
        self.skipped = {net: torch.zeros((), dtype=torch.int64, device=device) for net in "gd"}

    def skipped_steps(self) -> dict[str, int]:
        """:attr:`skipped` read back to the host (a sync with the device)."""
        return {name: int(count) for name, count in self.skipped.items()}

    def micro(self, batch: Batch) -> list[Batch]:
        """This rank's batch as ``grad_accum`` equal micro-batches."""
        return batch.chunk(self.grad_accum)

    def fake(self, batch: Batch) -> Tensor:
        """G's images for the batch's latents (and classes)."""
        if batch.fake_labels is None:
            return self.g(batch.z)
        return self.g(batch.z, batch.fake_labels)

    def score(self, images: Tensor, batch: Batch, which: str) -> Tensor:
        """D's scores of the batch's reals (``which="real"``) or fakes (``"fake"``: D's
        update, ``"g"``: G's), augmented with that pass's draws."""
        if self.augment is not None:
            images = self.augment(images, batch.draws[which])
        labels = batch.real_labels if which == "real" else batch.fake_labels
        return self.d(images) if labels is None else self.d(images, labels)

    def accumulating(self, net: nn.Module, last: bool) -> AbstractContextManager:
        """DDP's ``no_sync`` for every micro-batch but the last.

        DDP decides at forward time whether the coming backward all-reduces, so the forward
        and the backward of a micro-batch both run inside this context.
        """
        if last or not isinstance(net, DistributedDataParallel):
            return nullcontext()
        return net.no_sync()

    def frozen(self, net: nn.Module) -> AbstractContextManager:
        """DDP's ``no_sync`` for a pass through the network that does not step.

        Its reducer would otherwise stay armed by that forward and all-reduce the next
        backward that reaches its parameters, even one inside ``no_sync``.
        """
        return self.accumulating(net, last=False)

    def d_loss(self, real_scores, fake_scores, batch: Batch, fake: Tensor) -> torch.Tensor:
        """D's loss, plus its penalty (which runs its own D forward) when configured.

        The penalty's D sees the reals' labels and augmentation: its gradient is taken with
        respect to the images before augmentation."""
        loss = self.loss.d(real_scores, fake_scores)
        if self.loss.penalty is not None:

            def critic(images: Tensor) -> Tensor:
                return self.score(images, batch, "real")

            loss = loss + self.loss.penalty(critic, batch.real, fake.detach())
        return loss

    def backward(self, loss: torch.Tensor, net: nn.Module, retain_graph: bool = False) -> None:
        """Backward into ``net``'s parameters only."""
        params = [p for p in net.parameters() if p.requires_grad]
        scaler = self.scaler_g if net is self.g else self.scaler_d
        scaler.scale(loss).backward(inputs=params, retain_graph=retain_graph)

    def step(self, opt: torch.optim.Optimizer) -> torch.Tensor:
        """Unscale, measure the gradient norm, step (skipped by the scaler on inf/NaN)."""
        name = "g" if opt is self.opt_g else "d"
        scaler = self.scaler_g if name == "g" else self.scaler_d
        grads = [
            p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None
        ]
        if scaler.is_enabled():
            # The scaler skips the step iff a scaled gradient holds inf/NaN (its unscale
            # kernel tests the values before multiplying): the same test here, counted on
            # the device, so that no step waits for the host (get_scale() would).
            found_inf = ~torch.stack([g.isfinite().all() for g in grads]).all()
            self.skipped[name].add_(found_inf)
        scaler.unscale_(opt)
        norm = torch.nn.utils.get_total_norm(grads)
        scaler.step(opt)
        scaler.update()
        return norm


class _Record:
    """Losses and scores of one phase, summed over its micro-batches (on the loss's device:
    no host-to-device copy, which a CUDA graph capture would refuse)."""

    def __init__(self):
        self.loss: torch.Tensor | None = None
        self.scores: list[torch.Tensor] = []

    def add(self, loss: torch.Tensor, *scores: torch.Tensor) -> None:
        loss = loss.detach().float()
        self.loss = loss if self.loss is None else self.loss + loss
        self.scores += [s.detach().float() for s in scores]

    def scores_of(self, which: int, per_micro: int) -> torch.Tensor:
        """Every micro-batch's scores of pass ``which`` (of ``per_micro`` per micro-batch)."""
        return torch.cat([s.flatten() for s in self.scores[which::per_micro]])


def _stats(d: _Record, g: _Record, norm_d, norm_g) -> Stats:
    real = d.scores_of(0, 2)
    return {
        "loss/d": d.loss,
        "loss/g": g.loss,
        "d/real": real.mean(),
        "d/fake": d.scores_of(1, 2).mean(),
        # ADA's r_t: the mean sign of D's scores on the reals (1: D sure of every one)
        "d/real_sign": real.sign().mean(),
        "grad_norm/d": norm_d.detach(),
        "grad_norm/g": norm_g.detach(),
    }


def _d_micro(gan: Gan, batch: Batch, fake, last: bool, record: _Record) -> None:
    """D's forward and backward on one micro-batch (``fake`` is used detached)."""
    with gan.accumulating(gan.d, last):
        with gan.autocast():
            fake_scores = gan.score(fake.detach(), batch, "fake")
            real_scores = gan.score(batch.real, batch, "real")
        loss = gan.d_loss(real_scores, fake_scores, batch, fake) / gan.grad_accum
        gan.backward(loss, gan.d)
    record.add(loss, real_scores, fake_scores)


def _critic_update(gan: Gan, batch: Batch) -> None:
    """An extra D update (n_critic > 1) on fakes made without a graph."""
    gan.opt_d.zero_grad(set_to_none=True)
    for i, micro in enumerate(gan.micro(batch)):
        with torch.no_grad(), gan.autocast():
            fake = gan.fake(micro)
        _d_micro(gan, micro, fake, i == gan.grad_accum - 1, _Record())
    gan.step(gan.opt_d)


def d_first_retain(gan: Gan, batches: Sequence[Batch]) -> Stats:
    """One shared forward; both gradients against the pre-update D, then both steps."""
    for batch in batches[:-1]:
        _critic_update(gan, batch)
    gan.opt_d.zero_grad(set_to_none=True)
    gan.opt_g.zero_grad(set_to_none=True)
    rec_d, rec_g = _Record(), _Record()
    for i, micro in enumerate(gan.micro(batches[-1])):
        last = i == gan.grad_accum - 1
        with gan.accumulating(gan.g, last), gan.accumulating(gan.d, last):
            with gan.autocast():
                fake = gan.fake(micro)
                fake_scores = gan.score(fake, micro, "fake")
                real_scores = gan.score(micro.real, micro, "real")
            loss_d = gan.d_loss(real_scores, fake_scores, micro, fake) / gan.grad_accum
            loss_g = gan.loss.g(fake_scores) / gan.grad_accum
            gan.backward(loss_d, gan.d, retain_graph=True)
            gan.backward(loss_g, gan.g)
        rec_d.add(loss_d, real_scores, fake_scores)
        rec_g.add(loss_g)
    norm_d = gan.step(gan.opt_d)
    norm_g = gan.step(gan.opt_g)
    return _stats(rec_d, rec_g, norm_d, norm_g)


def d_first_detach(gan: Gan, batches: Sequence[Batch]) -> Stats:
    """D on detached fakes and steps; then G through a fresh pass of the updated D.

    With one micro-batch, G's forward of the D phase is kept for the G phase. With
    ``grad_accum > 1`` the D phase makes its fakes without a graph and the G phase runs G
    again per micro-batch: keeping every micro-batch's graph would cost the memory that
    accumulation saves, and DDP must see each micro-batch's forward just before its backward.
    """
    for batch in batches[:-1]:
        _critic_update(gan, batch)
    keep_graph = gan.grad_accum == 1
    micros = gan.micro(batches[-1])
    gan.opt_d.zero_grad(set_to_none=True)
    rec_d, rec_g, fakes = _Record(), _Record(), []
    for i, micro in enumerate(micros):
        with torch.set_grad_enabled(keep_graph), gan.autocast():
            fake = gan.fake(micro)
        _d_micro(gan, micro, fake, i == gan.grad_accum - 1, rec_d)
        fakes.append(fake)
    norm_d = gan.step(gan.opt_d)

    gan.opt_g.zero_grad(set_to_none=True)
    for i, (micro, fake) in enumerate(zip(micros, fakes, strict=True)):
        with gan.accumulating(gan.g, i == gan.grad_accum - 1), gan.frozen(gan.d):
            with gan.autocast():
                if not keep_graph:
                    fake = gan.fake(micro)
                loss_g = gan.loss.g(gan.score(fake, micro, "g")) / gan.grad_accum
            gan.backward(loss_g, gan.g)
        rec_g.add(loss_g)
    norm_g = gan.step(gan.opt_g)
    return _stats(rec_d, rec_g, norm_d, norm_g)


def g_first_detach(gan: Gan, batches: Sequence[Batch]) -> Stats:
    """G through the current D and steps; then D on the detached pre-update fakes."""
    micros = gan.micro(batches[0])
    gan.opt_g.zero_grad(set_to_none=True)
    rec_d, rec_g, fakes = _Record(), _Record(), []
    for i, micro in enumerate(micros):
        with gan.accumulating(gan.g, i == gan.grad_accum - 1), gan.frozen(gan.d):
            with gan.autocast():
                fake = gan.fake(micro)
                loss_g = gan.loss.g(gan.score(fake, micro, "g")) / gan.grad_accum
            gan.backward(loss_g, gan.g)
        rec_g.add(loss_g)
        fakes.append(fake.detach())
    norm_g = gan.step(gan.opt_g)

    gan.opt_d.zero_grad(set_to_none=True)
    for i, (micro, fake) in enumerate(zip(micros, fakes, strict=True)):
        _d_micro(gan, micro, fake, i == gan.grad_accum - 1, rec_d)
    norm_d = gan.step(gan.opt_d)
    for batch in batches[1:]:
        _critic_update(gan, batch)
    return _stats(rec_d, rec_g, norm_d, norm_g)


Strategy = Callable[[Gan, Sequence[Batch]], Stats]

STRATEGIES: dict[str, Strategy] = {
    "d_first_retain": d_first_retain,
    "d_first_detach": d_first_detach,
    "g_first_detach": g_first_detach,
}
