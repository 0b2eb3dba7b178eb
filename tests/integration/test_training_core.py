"""The training loop: determinism for every strategy and precision, memory, failures."""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import resource
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from ganpipe import augment, build, dist, loop, runtime, stream
from ganpipe.data.dataset import LmdbImageDataset
from ganpipe.params import Params, parse_params
from ganpipe.strategies import STRATEGIES, Batch
from tests.conftest import REPO
from tests.helpers import TINY_RESNET as RESNET_MODEL
from tests.helpers import Recorder, tiny_params, updated

TINY = tiny_params(seed=5, train={"kimg": 0.096, "ema_kimg": 0.05})
#: TINY for the resnet family: its smallest size, 32 px, and a few channels per resolution.
TINY_RESNET = updated(TINY, {"data": {"image_size": 32}, "model": RESNET_MODEL})
CONFIGS = {"dcgan": TINY, "resnet": TINY_RESNET}


def tiny(norm: str = "batch", arch: str = "dcgan", **train):
    raw = json.loads(json.dumps(CONFIGS[arch]))
    raw["train"].update(train)
    raw["model"]["norm"] = norm
    return parse_params(raw)


@pytest.fixture(scope="module")
def train16(digits16):
    """The shared digits at 16 px: their training split."""
    return digits16 / "train.lmdb"


@pytest.fixture(scope="module")
def train32(digits32):
    return digits32 / "train.lmdb"


def train_recorded(params, db, recorder: Recorder) -> loop.TrainResult:
    """``loop.train`` on the LMDB ``db`` on CPU, reporting to ``recorder``."""
    return loop.train(
        params, LmdbImageDataset(db, as_uint8=True), torch.device("cpu"), recorder, progress=False
    )


WORKER = textwrap.dedent(
    """
    import hashlib, json, sys
    from ganpipe import cpu
    from ganpipe.params import parse_params

    raw, db = json.loads(sys.argv[1]), sys.argv[2]
    first = parse_params(raw)
    cpu.pin(first.determinism, first.devices)  # before torch loads, as the stages do
    import torch
    from ganpipe import loop, runtime
    from ganpipe.data.dataset import LmdbImageDataset

    digests = {}
    for strategy in ("d_first_retain", "d_first_detach", "g_first_detach"):
        for precision in ("fp32", "bf16"):
            raw["train"]["strategy"], raw["precision"] = strategy, precision
            params = parse_params(raw)
            runtime.configure_runtime(params.seed, params.devices, params.determinism)
            result = loop.train(params, LmdbImageDataset(db, as_uint8=True),
                                torch.device("cpu"), progress=False)
            h = hashlib.sha256()
            for net in (result.g, result.d, result.g_ema):
                for name, t in net.state_dict().items():
                    h.update(name.encode() + t.contiguous().numpy().tobytes())
            digests[f"{strategy}/{precision}"] = h.hexdigest()
    print(json.dumps(digests))
    """
)


@pytest.mark.parametrize("arch", ["dcgan", "resnet"])
def test_every_strategy_and_precision_is_bit_identical_across_processes(tmp_path, arch, request):
    db = request.getfixturevalue("train16" if arch == "dcgan" else "train32")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    runs = []
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, str(script), json.dumps(CONFIGS[arch]), str(db)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        runs.append(json.loads(out.stdout.splitlines()[-1]))
    assert runs[0] == runs[1]
    digests = runs[0]
    assert len(digests) == 6
    for precision in ("fp32", "bf16"):
        retain, detach, g_first = (
            digests[f"{s}/{precision}"]
            for s in ("d_first_retain", "d_first_detach", "g_first_detach")
        )
        assert detach not in (retain, g_first)
        # the same algorithm (docs/training.md): with BatchNorm in D (dcgan) the running
        # statistics see the batches in another order; resnet's D has no state that a call
        # changes (spectral norm iterates once per weight), so the bytes agree as well
        assert (retain == g_first) == (arch == "resnet")
    assert digests["d_first_detach/fp32"] != digests["d_first_detach/bf16"]


def live_tensors() -> int:
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on some torch objects warns
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def memory_growth(step, steps: int = 300, warmup: int = 30) -> tuple[int, float]:
    """(live tensors, RSS MB) added between the warm-up and the end of ``steps`` calls."""
    for i in range(steps):
        if i == warmup:
            tensors, rss = live_tensors(), rss_mb()
        step(i)
    return live_tensors() - tensors, rss_mb() - rss


def training_steps(strategy: str = "d_first_detach"):
    params = tiny(ema_kimg=1.0)
    runtime.configure_runtime(params.seed, params.devices, params.determinism)
    gan, ema = build.build_gan(params, torch.device("cpu"))
    real = torch.rand(16, 1, 16, 16) * 2 - 1

    def step(i):
        z = stream.latents(0, i, 16, 8)
        STRATEGIES[strategy](gan, Batch.many([real], [z]))
        ema.update(gan.g, 16)

    return step


def leaky_steps():
    history = []  # the classic leak: a running tensor kept outside any module, every step

    def leaky(i):
        history.append(torch.zeros(64 * 1024))  # 256 KiB a step

    return leaky


MEMORY_CASES = {  # name: (factory, its arguments)
    "d_first_retain": ("training_steps", "d_first_retain"),
    "d_first_detach": ("training_steps", "d_first_detach"),
    "g_first_detach": ("training_steps", "g_first_detach"),
    "leak": ("leaky_steps",),
}


def growth_in_forks() -> dict[str, tuple[int, float]]:
    """``memory_growth`` of every case, each in a child forked from this process before any
    case ran: all start from the same clean state, and one import serves them all."""
    results = {}
    for name, (factory, *args) in MEMORY_CASES.items():
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            status = 1
            try:
                os.write(write, json.dumps(memory_growth(globals()[factory](*args))).encode())
                status = 0
            finally:
                os._exit(status)
        os.close(write)
        with os.fdopen(read) as pipe:
            text = pipe.read()
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0, name
        results[name] = tuple(json.loads(text))
    return results


@pytest.fixture(scope="module")
def memory_growths() -> dict[str, tuple[int, float]]:
    """``growth_in_forks`` run in a new interpreter: in this one, memory freed by earlier
    tests is reused by the allocator and hides growth from RSS."""
    code = (
        "import json; from ganpipe import cpu; from ganpipe.params import Params; "
        "cpu.pin(Params().determinism, Params().devices); "  # before torch, as conftest does
        "from tests.integration import test_training_core as t; "
        "print(json.dumps(t.growth_in_forks()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.slow  # 300 steps per strategy in forks, ~40 s: not for the inner loop
@pytest.mark.xdist_group("memory")  # one worker measures every case once (module fixture)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_training_and_ema_keep_memory_flat_over_300_steps(memory_growths, strategy):
    tensors, rss = memory_growths[strategy]
    assert tensors == 0
    assert rss < 20, f"RSS grew by {rss:.1f} MB"


@pytest.mark.slow
@pytest.mark.xdist_group("memory")
def test_the_memory_check_catches_a_leak(memory_growths):
    tensors, rss = memory_growths["leak"]
    assert tensors == 270 and rss > 50


def test_a_non_finite_loss_names_the_step_strategy_and_loss(train16, monkeypatch):
    calls = {"n": 0}
    real_move = stream.to_device_images

    def poisoned(batch, device):
        calls["n"] += 1
        images = real_move(batch, device)
        return images * float("nan") if calls["n"] == 3 else images

    monkeypatch.setattr(stream, "to_device_images", poisoned)
    params = tiny(strategy="g_first_detach", loss="hinge")
    with pytest.raises(FloatingPointError) as info:
        loop.train(
            params, LmdbImageDataset(train16, as_uint8=True), torch.device("cpu"), progress=False
        )
    message = str(info.value)
    assert "non-finite loss at step 3" in message
    assert "train.strategy=g_first_detach" in message and "train.loss=hinge" in message


def test_fp16_counts_the_steps_the_scalers_skip(train16, monkeypatch):
    huge = lambda precision, device: torch.amp.GradScaler(  # noqa: E731
        device.type, init_scale=2.0**100, enabled=precision == "fp16"
    )
    monkeypatch.setattr(runtime, "grad_scaler", huge)
    params = tiny().model_copy(update={"precision": "fp16"})
    recorder = Recorder()
    result = train_recorded(params, train16, recorder)
    # 2**100 overflows fp16 at once: both networks skip steps until their scale fits.
    assert result.skipped_steps["g"] > 0 and result.skipped_steps["d"] > 0
    logged = recorder.scalars[-1][1]
    for net in ("g", "d"):
        assert logged[f"amp/skipped_steps/{net}"] == result.skipped_steps[net]
        assert logged[f"amp/scale/{net}"] == 2.0 ** (100 - result.skipped_steps[net])


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_fp16_with_several_critic_steps(train16, strategy):
    """Each network's scaler is updated right after its step: D may step n_critic times
    per iteration (a shared scaler refuses to unscale D's gradients twice before update)."""
    params = tiny(norm="layer", strategy=strategy, n_critic=2, kimg=0.128)
    params = params.model_copy(update={"precision": "fp16"})
    recorder = Recorder()
    result = train_recorded(params, train16, recorder)
    assert result.iterations == 4 and result.images_seen == 128
    logged = recorder.scalars[-1][1]
    assert logged["amp/skipped_steps/d"] == result.skipped_steps["d"]
    # The default scale 2**16 halves once per skipped step (growth needs 2000 good steps).
    assert logged["amp/scale/d"] == 2.0 ** (16 - result.skipped_steps["d"])
    assert logged["amp/scale/g"] == 2.0 ** (16 - result.skipped_steps["g"])
    assert all(torch.isfinite(p).all() for p in result.g.parameters())


@pytest.mark.parametrize(
    ("loss", "r1_gamma", "precision"),
    [("hinge", 0.0, "fp16"), ("wgan_gp", 1.0, "bf16"), ("bce", 1.0, "fp32")],
)
def test_resnet_trains_with_every_loss_penalty_and_precision(train32, loss, r1_gamma, precision):
    """BatchNorm in resnet's G is allowed with the gradient penalties (D has no norm layer);
    each configuration trains to finite weights and logs its D scores."""
    params = tiny(arch="resnet", loss=loss, r1_gamma=r1_gamma, n_critic=2, kimg=0.064)
    params = params.model_copy(update={"precision": precision})
    recorder = Recorder()
    result = train_recorded(params, train32, recorder)
    assert result.iterations == 2 and result.images_seen == 64
    assert all(torch.isfinite(p).all() for net in (result.g, result.d) for p in net.parameters())
    logged = recorder.scalars[-1][1]
    assert math.isfinite(logged["loss/d"]) and logged["grad_norm/d"] > 0
    assert ("amp/scale/d" in logged) == (precision == "fp16")


def test_n_critic_counts_images_shown_to_d(train16):
    recorder = Recorder()
    params = tiny(norm="layer", n_critic=3, loss="wgan_gp", kimg=0.144)
    result = train_recorded(params, train16, recorder)
    assert result.iterations == 3 and result.images_seen == 144  # 3 x (3 x 16)
    assert [seen for seen, _ in recorder.scalars] == [48, 96, 144]
    assert {"grad_norm/d", "grad_norm/g", "d/real", "d/fake"} <= set(recorder.scalars[0][1])
    assert recorder.grids[-1][0] == 144


LOGGED_KEYS = {
    "loss/g",
    "loss/d",
    "d/real",
    "d/fake",
    "d/real_sign",
    "grad_norm/g",
    "grad_norm/d",
    "perf/images_per_s",
    "perf/step_ms",
    "perf/peak_memory_mb",
    "kimg",
    "lr/g",
    "lr/d",
}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_logged_scalars_are_exactly_the_documented_keys(train16, precision):
    """No amp/* outside fp16; learning rates as configured, scaled by train.lr_scaling."""
    recorder = Recorder()
    params = tiny(
        kimg=0.048,
        log_every_kimg=0.016,
        lr_g=4e-4,
        lr_d=1e-4,
        lr_scaling="sqrt",
        reference_batch=64,
    ).model_copy(update={"precision": precision})
    train_recorded(params, train16, recorder)
    assert [seen for seen, _ in recorder.scalars] == [16, 32, 48]  # logged every 16 images
    for seen, logged in recorder.scalars:
        assert set(logged) == LOGGED_KEYS
        # batch 16 at reference 64 under sqrt scaling: half the configured rates
        assert logged["lr/g"] == pytest.approx(2e-4, rel=1e-12)
        assert logged["lr/d"] == pytest.approx(5e-5, rel=1e-12)
        assert logged["kimg"] == pytest.approx(seen / 1000, rel=1e-12)
        assert logged["perf/images_per_s"] > 0 and logged["perf/step_ms"] > 0
        assert logged["perf/peak_memory_mb"] > 0
        assert all(math.isfinite(value) for value in logged.values())
        assert logged["grad_norm/g"] > 0 and logged["grad_norm/d"] > 0


def test_data_loader_workers_give_bit_identical_weights(train16, monkeypatch):
    """Batches are functions of the step: two worker processes read the same batches, and
    so does the training set held resident (no DataLoader)."""
    workers = []
    real_loader = stream.DataLoader

    def recording_loader(*args, **kwargs):
        workers.append(kwargs["num_workers"])
        return real_loader(*args, **kwargs)

    monkeypatch.setattr(stream, "DataLoader", recording_loader)
    states = []
    for num_workers, resident_mb in ((0, 0), (2, 0), (0, 1)):
        result = loop.train(
            tiny(kimg=0.048, num_workers=num_workers, resident_mb=resident_mb),
            LmdbImageDataset(train16, as_uint8=True),
            torch.device("cpu"),
            progress=False,
        )
        nets = {"g": result.g, "d": result.d, "g_ema": result.g_ema}
        states.append({name: net.state_dict() for name, net in nets.items()})
    assert workers == [0, 2]  # the resident run made no DataLoader
    for other in states[1:]:
        for name, state in states[0].items():
            assert state.keys() == other[name].keys()
            for key, tensor in state.items():
                assert torch.equal(tensor, other[name][key]), (name, key)


@pytest.mark.parametrize("start", [0, 37])
def test_the_resident_training_set_gives_the_loader_s_batches(train16, caplog, start):
    """Held on the device, the training set yields exactly the DataLoader's batches and
    labels, across epoch boundaries and from any starting iteration (a resume)."""
    dataset = LmdbImageDataset(train16, as_uint8=True)
    context = dist.DistContext(device=torch.device("cpu"))
    streams = []
    for budget in (0, 1):  # MiB: the training digits at 16 px take 0.2 of one
        params = tiny(batch_size=64, resident_mb=budget, n_critic=2)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ganpipe.stream"):
            streams.append(stream.Stream(params, dataset, context, start, start + 30))
        assert ("training set on cpu" in caplog.text) == (budget > 0)
    per_epoch = len(dataset) // 64
    assert per_epoch < 30 * 2  # the 30 iterations cross an epoch boundary
    loaded, resident = list(streams[0].batches), list(streams[1].batches)
    assert len(loaded) == len(resident) == 60  # n_critic global batches per iteration
    for (images, labels), (held_images, held_labels) in zip(loaded, resident, strict=True):
        assert torch.equal(images, held_images) and torch.equal(labels, held_labels)


@pytest.mark.parametrize("resident_mb", [0, 1])
def test_mirrored_batches_are_the_plain_ones_flipped_where_the_draws_say(train16, resident_mb):
    """train.xflip mirrors the reals of global batch k where flips(seed, k) is true, in each
    rank's share of the batch as in the whole; latents and labels are untouched."""
    dataset = LmdbImageDataset(train16, as_uint8=True)
    whole = dist.DistContext(device=torch.device("cpu"))
    rank1 = dist.DistContext(1, 1, 2, torch.device("cpu"))
    plain, mirrored = (tiny(n_critic=2, resident_mb=resident_mb, xflip=x) for x in (False, True))
    flipped = 0
    for it in (0, 3):
        base = stream.Stream(plain, dataset, whole, it, it + 1).next(it)
        ours = stream.Stream(mirrored, dataset, whole, it, it + 1).next(it)
        half = stream.Stream(mirrored, dataset, rank1, it, it + 1).next(it)
        for k, (b, o, h) in enumerate(zip(base, ours, half, strict=True)):
            flips = augment.flips(mirrored.seed, it * 2 + k, 16)
            for i in range(16):
                expected = b.real[i].flip(-1) if flips[i] else b.real[i]
                assert torch.equal(o.real[i], expected), (it, k, i)
            assert torch.equal(h.real, o.real[8:]) and torch.equal(o.z, b.z)
            flipped += int(flips.sum())
    assert 0 < flipped < 4 * 16


def test_only_an_lmdb_set_read_as_uint8_is_held_resident(train16):
    assert stream.resident_bytes(LmdbImageDataset(train16)) is None
    dataset = LmdbImageDataset(train16, as_uint8=True)
    assert stream.resident_bytes(dataset) == len(dataset) * 16 * 16
    images, labels = stream.read_all(dataset, torch.device("cpu"), chunk=100)
    assert torch.equal(images.permute(0, 2, 3, 1), torch.from_numpy(dataset.uint8_array()))
    assert torch.equal(labels, torch.from_numpy(dataset.labels()))


def test_peak_rss_probe_is_available():
    # The strategies benchmark reads ru_maxrss; make sure this platform reports it.
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss > 0


def test_the_runtime_turns_determinism_on_without_loading_torch_s_compiler():
    """torch.use_deterministic_algorithms imports torch._inductor for a flag of its own: a
    stage that compiles nothing (generate, evaluate) sets torch's flag alone."""
    code = (
        "import sys; from ganpipe import cpu; from ganpipe.params import Params; "
        "p = Params(); cpu.pin(p.determinism, p.devices); import torch; "
        "from ganpipe import runtime; runtime.configure_runtime(0, p.devices, p.determinism); "
        "print(torch.are_deterministic_algorithms_enabled(), "
        "torch.is_deterministic_algorithms_warn_only_enabled(), 'torch._inductor' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split() == ["True", "False", "False"], out.stderr[-2000:]
    import torch._inductor.config  # loaded: its flag is set too, as torch's own call sets it

    try:
        runtime.use_deterministic_algorithms(False)
        assert not torch.are_deterministic_algorithms_enabled()
        assert torch._inductor.config.deterministic is False
        runtime.use_deterministic_algorithms(True)
        assert torch.are_deterministic_algorithms_enabled()
        assert torch._inductor.config.deterministic is True
    finally:
        runtime.use_deterministic_algorithms(Params().determinism.deterministic)
