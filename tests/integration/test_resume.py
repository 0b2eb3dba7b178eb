"""Exact resume: kill training at any moment, run it again, get the same bytes."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import pickle
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ganpipe import checkpoint, dist, exact, files, loop, runtime, strategies, stream
from ganpipe.checkpoint import load, load_newest_checkpoint, run_fingerprint, save_checkpoint
from ganpipe.data.dataset import LmdbImageDataset
from ganpipe.files import NoSpaceError
from ganpipe.params import parse_params
from tests.helpers import TINY_RESNET, Recorder, descendants, stage_env, tiny_params, write_project

#: 100 iterations of a small DCGAN with BatchNorm, a checkpoint every 10.
RUN = tiny_params(
    seed=4,
    devices={"timeout_s": 30},
    model={"z_dim": 16, "g_width": 8, "d_width": 8, "norm": "batch"},
    train={
        "batch_size": 32,
        "kimg": 3.2,
        "checkpoint_kimg": 0.32,
        "keep_checkpoints": 3,
        "log_every_kimg": 0.32,
        "snapshot_kimg": 100,
        "ema_kimg": 0.5,
        # metrics_kimg 0: FID while training needs a feature network (test_train_metrics)
    },
)


def project(root: Path, digits16: Path, **sections) -> Path:
    return write_project(root, RUN, digits16, **sections)


def start(root: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "stages.train"],
        cwd=root,
        env={**stage_env(), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def start_until_a_checkpoint(root: Path) -> subprocess.Popen:
    """Start the train stage and return once it has written its first checkpoint."""
    proc = start(root)
    while not list((root / "checkpoints").glob("*/ckpt-*.pt")):
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.005)
    return proc


def finish(proc: subprocess.Popen) -> str:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return err


def digest(root: Path) -> dict[str, str]:
    out = {}
    for name in ("generator", "discriminator", "g_ema"):
        h = hashlib.sha256()
        for key, tensor in load(root / "models" / f"{name}.pt")["state_dict"].items():
            h.update(key.encode() + tensor.contiguous().numpy().tobytes())
        out[name] = h.hexdigest()
    return out


def newest(root: Path) -> str | None:
    found = sorted((root / "checkpoints").glob("*/ckpt-*.pt"))
    return found[-1].name if found else None


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the stage and every process under it (torchrun's workers run in sessions
    of their own), like a machine going down."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.communicate()


#: Written into a folder on the stage's PYTHONPATH: while the flag file exists, fsync of a
#: checkpoint's temporary file stalls, so the test can kill the run inside a checkpoint
#: write (after the bytes are written, before the rename) every time, not by luck.
STALL_WRITES = """
import os, time
_flag = os.environ.get("STALL_CHECKPOINT_WRITES_WHILE")
if _flag:
    _fsync = os.fsync
    def fsync(fd):
        try:
            name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            name = ""
        while name.startswith(".ckpt-") and os.path.exists(_flag):
            time.sleep(0.01)
        _fsync(fd)
    os.fsync = fsync
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "precision", "loss", "arch"),
    [
        (1, "fp32", "bce", "dcgan"),
        (1, "bf16", "wgan_gp", "dcgan"),
        (2, "fp32", "wgan_gp", "dcgan"),
        (2, "bf16", "bce", "dcgan"),
        (1, "fp32", "hinge", "resnet"),
    ],
)
def test_sigkill_at_random_moments_then_resume_gives_the_same_bytes(
    tmp_path, digits16, digits32, world, precision, loss, arch
):
    # wgan_gp draws its interpolation weights from the global torch RNG every step: the
    # run only ends with the same bytes if every rank's RNG state is restored exactly.
    # resnet: spectral norm's vectors and the weight they were iterated for are buffers.
    sections = {
        "precision": precision,
        "devices": {"nproc_per_node": world},
        "model": {"norm": "layer" if loss == "wgan_gp" else "batch"},
        # 50 iterations, a checkpoint every 5: room for the three kills (each after a new
        # checkpoint, at most about two intervals of progress apiece) and the corrupted
        # newest checkpoint
        "train": {"kimg": 1.6, "checkpoint_kimg": 0.16, "loss": loss},
    }
    data = digits16
    if arch == "resnet":
        sections["model"].update(TINY_RESNET)  # BatchNorm in G, spectral norm in D
        sections["data"] = {"image_size": 32}
        data = digits32
    reference = project(tmp_path / "reference", data, **sections)
    proc = start(reference)
    while proc.poll() is None and newest(reference) is None:
        time.sleep(0.005)
    first_checkpoint = time.monotonic()
    finish(proc)
    window = time.monotonic() - first_checkpoint  # training time after the first checkpoint
    expected = digest(reference)

    root = project(tmp_path / "killed", data, **sections)
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "sitecustomize.py").write_text(STALL_WRITES)
    flag = tmp_path / "stall"
    env = {"PYTHONPATH": f"{faults}:{stage_env()['PYTHONPATH']}"}
    env["STALL_CHECKPOINT_WRITES_WHILE"] = str(flag)
    rng = random.Random(world * 10 + len(precision))
    kills = []
    for attempt in range(3):
        # Wait for the run to make progress (a new checkpoint), then kill it: at a random
        # moment within about one checkpoint interval, or (second kill) inside the next
        # checkpoint write.
        before = newest(root)
        proc = start(root, env)
        while proc.poll() is None and newest(root) == before:
            time.sleep(0.005)
        assert proc.poll() is None, f"the run finished before kill {attempt + 1}"
        if attempt == 1:
            flag.touch()
            while not list((root / "checkpoints").glob("*/.ckpt-*.tmp-*")):
                assert proc.poll() is None, proc.communicate()[1][-2000:]
                time.sleep(0.005)
            kills.append("during a checkpoint write")
        else:
            time.sleep(rng.uniform(0.0, window / 10))  # ~one of the 10 intervals
            kills.append("mid-training")
        kill_group(proc)
        flag.unlink(missing_ok=True)
        if attempt == 1:
            temporaries = list((root / "checkpoints").glob("*/.ckpt-*.tmp-*"))
            assert temporaries, "the kill did not land inside the write"
            for ckpt in (root / "checkpoints").glob("*/ckpt-*.pt"):
                checkpoint.read_checkpoint(ckpt)  # every complete checkpoint still loads
    assert kills == ["mid-training", "during a checkpoint write", "mid-training"]
    checkpoints = sorted((root / "checkpoints").glob("*/ckpt-*.pt"))
    assert checkpoints, "no checkpoint was written before the kills"
    checkpoints[-1].write_bytes(checkpoints[-1].read_bytes()[:1000])  # corrupt the newest
    err = finish(start(root))
    assert "cannot be loaded" in err and "trying the previous one" in err, (
        [c.name for c in checkpoints],
        err,
    )
    assert "resumed from" in err
    assert not list((root / "checkpoints").glob("*/.ckpt-*.tmp-*")), "stale temporaries left"
    assert digest(root) == expected
    # The log was written again from the checkpoint: the same records as the reference's.
    assert logged_values(root) == logged_values(reference)


def logged_values(root: Path) -> dict[str, list[tuple[str, str]]]:
    """(step, value) rows of every logged curve but the measured perf/* ones."""
    curves = root / "metrics" / "train" / "plots" / "metrics"
    found = {}
    for tsv in sorted(curves.rglob("*.tsv")):
        name = tsv.relative_to(curves).as_posix()
        if not name.startswith("perf/"):
            rows = [line.split("\t") for line in tsv.read_text().splitlines()]
            step, value = rows[0].index("step"), rows[0].index(tsv.stem)
            found[name] = [(row[step], row[value]) for row in rows[1:]]
    assert "loss/g.tsv" in found, sorted(found)
    return found


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_non_zero(tmp_path, digits16):
    # Long enough that the signal, sent once the first checkpoint exists (10 iterations in),
    # lands mid-training, 190 iterations before its end (a fixed delay once landed after
    # training, in the interpreter's exit).
    longer = {"kimg": 6.4}
    reference = project(tmp_path / "reference", digits16, train=longer)
    finish(start(reference))
    root = project(tmp_path / "stopped", digits16, train=longer)
    proc = start_until_a_checkpoint(root)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "stopped by signal 15" in err
    assert not (root / "models").exists() or not list((root / "models").iterdir())
    finish(start(root))
    assert digest(root) == digest(reference)


@pytest.mark.slow
def test_ctrl_c_stops_two_ddp_processes_with_a_checkpoint(tmp_path, digits16):
    """SIGINT to the stage's process group, as Ctrl-C in a terminal sends it: torchrun (in a
    session of its own) gets it once, through the stage; every rank saves and stops."""
    sections = {"devices": {"nproc_per_node": 2}, "train": {"kimg": 16}}
    root = project(tmp_path / "stopped", digits16, **sections)
    proc = start_until_a_checkpoint(root)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    # The rank-0 worker's line, then the stage's own.
    stopped = re.search(r"stopped by signal 2 after (\d+) images; checkpoint (\S+);", err)
    assert stopped, err[-3000:]
    assert "run the stage again to resume" in err
    state = checkpoint.read_checkpoint(root / stopped.group(2))
    assert state["images_seen"] == int(stopped.group(1))
    assert len(state["rng"]) == 2  # both ranks' RNG states
    assert not (root / "models").exists() or not list((root / "models").iterdir())
    assert not [p for p in descendants(os.getpid()) if p != proc.pid and is_stage(p)], (
        "a worker outlived the stop"
    )


def is_stage(pid: int) -> bool:
    try:
        return b"stages.train" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def numerics(params) -> dict:
    return runtime.numerics_record(params.determinism, params.devices, torch.device("cpu"))


def fingerprint(params, dataset_sha256: str = "") -> str:
    return run_fingerprint(params, dataset_sha256, numerics(params))[0]


def changed(section: str, **values):
    """RUN with ``values`` set in ``section``, validated."""
    return parse_params({**RUN, section: {**RUN.get(section, {}), **values}})


def test_a_different_training_config_gets_its_own_run(tmp_path):
    base = parse_params(RUN)
    assert fingerprint(changed("train", kimg=10, log_every_kimg=1)) == fingerprint(base)
    assert fingerprint(changed("train", lr_g=1e-3)) != fingerprint(base)
    assert fingerprint(changed("devices", cpu_threads=2)) != fingerprint(base)  # other bits


def test_only_what_changes_the_trained_bits_is_fingerprinted():
    """Issue 13: other stages' params, intervals, addresses resume the run; the training
    params, the world size, the device actually used and the CPU mode do not."""
    base = fingerprint(parse_params(RUN))
    resumes = [
        changed("eval", num_samples=500, kid_subset_size=50),
        changed("featurenet", epochs=2),
        changed("generate", seed=7, num_images=3),
        changed("train", keep_checkpoints=1, snapshot_kimg=1, num_workers=1),
        changed("train", metrics_kimg=1, metrics_num_samples=500),  # measured on the EMA
        changed("devices", accelerator="cpu", gpus=[0], timeout_s=60),  # cpu, as auto here
        changed("data", on_bad_image="skip"),  # the training set's hash stands for the data
    ]
    for params in resumes:
        assert fingerprint(params) == base, params
    restarts = [
        parse_params({**RUN, "seed": 5}),
        parse_params({**RUN, "precision": "bf16"}),
        changed("model", norm="instance"),
        changed("train", grad_accum=2),
        changed("train", xflip=True),
        changed("generate", grid_rows=3),  # the run's logged grids are that size
        changed("devices", nproc_per_node=2),
        changed("determinism", cpu_isa="native"),
    ]
    for params in restarts:
        assert fingerprint(params) != base, params
    on_gpu = {**numerics(parse_params(RUN)), "device": "cuda"}  # the device actually used
    assert run_fingerprint(parse_params(RUN), "", on_gpu)[0] != base


def test_the_numerics_are_part_of_the_fingerprint():
    params = parse_params(RUN)
    runtime.apply_cpu_numerics(params.determinism)  # as every stage does
    record = numerics(params)
    assert record["cpu_isa"] == "portable" and record["aten_cpu_capability"] == "AVX2"
    assert record["mkldnn"] is False and record["mkl_cbwr"] == "COMPATIBLE"
    assert "cpu" not in record  # portable: nothing of this machine, so files match elsewhere
    assert record["exact_ops"] == exact.PORTABLE_OPS  # its own sqrt, Adam...: named
    older = {k: v for k, v in record.items() if k != "exact_ops"}  # a run from before them
    assert run_fingerprint(params, "", older)[0] != run_fingerprint(params, "", record)[0]
    native = changed("determinism", cpu_isa="native")
    assert numerics(native)["cpu"]["flags"]  # native bits belong to this CPU model
    other_torch = {**record, "torch": "0.0.0"}
    assert run_fingerprint(params, "", other_torch)[0] != fingerprint(params)


@pytest.mark.slow
def test_changed_params_start_fresh_and_leave_the_old_run_alone(tmp_path, digits16):
    root = project(tmp_path / "p", digits16, train={"kimg": 0.64})
    finish(start(root))
    first_runs = sorted(p.name for p in (root / "checkpoints").iterdir())
    project(root, digits16, train={"kimg": 0.64, "lr_d": 1e-3})
    err = finish(start(root))
    assert "no checkpoint for these params" in err and first_runs[0] in err
    assert len(list((root / "checkpoints").iterdir())) == 2
    project(root, digits16, train={"kimg": 0.96, "lr_d": 1e-3})  # longer: resumes
    err = finish(start(root))
    assert "resumed from" in err and "000000000640" in err


class Payload:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def with_header(payload: bytes) -> bytes:
    """A checkpoint file around ``payload``, with a valid sha256 header."""
    return checkpoint.MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload


# torch warns that the plain pickle below is not its own protocol: it is not, on purpose.
@pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")
def test_a_checkpoint_carrying_code_is_refused(tmp_path, caplog):
    run_dir = tmp_path / "run"
    save_checkpoint(STATE, run_dir, 32, keep=5)
    evil = Payload()
    evil.marker = tmp_path / "pwned"
    # A plain pickle, and a torch file whose header checks out: weights_only refuses both.
    (run_dir / checkpoint.checkpoint_name(64)).write_bytes(
        with_header(pickle.dumps({"format": checkpoint.CHECKPOINT_FORMAT, "evil": evil}))
    )
    (run_dir / checkpoint.checkpoint_name(96)).write_bytes(
        with_header(checkpoint.torch_bytes({"format": checkpoint.CHECKPOINT_FORMAT, "e": evil}))
    )
    torch_file = tmp_path / "model.pt"
    torch.save({"format": 1, "evil": evil}, torch_file)
    with pytest.raises(pickle.UnpicklingError):
        load(torch_file)
    with pytest.raises(pickle.UnpicklingError):
        checkpoint.read_checkpoint(run_dir / checkpoint.checkpoint_name(96))
    state = load_newest_checkpoint(run_dir)
    assert state is not None and state["images_seen"] == 32
    assert not evil.marker.exists(), "the payload ran"
    assert caplog.text.count("cannot be loaded") == 2
    assert sorted(p.name for p in run_dir.glob("*.corrupt")) == [
        checkpoint.checkpoint_name(64) + ".corrupt",
        checkpoint.checkpoint_name(96) + ".corrupt",
    ]


#: The smallest state :func:`checkpoint.read_checkpoint` accepts.
STATE = {"fingerprint": "f" * 64, "iteration": 1, "images_seen": 32, "g": {}, "d": {}, "g_ema": {}}


def test_a_flipped_byte_is_caught_and_the_previous_checkpoint_used(tmp_path, caplog):
    run_dir = tmp_path / "run"
    save_checkpoint({**STATE, "g": {"w": torch.ones(1000)}}, run_dir, 32, keep=2)
    newer = save_checkpoint(
        {**STATE, "images_seen": 64, "g": {"w": torch.ones(1000)}}, run_dir, 64, 2
    )
    data = bytearray(newer.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the tensor bytes: torch.load alone would not notice
    newer.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match="sha256 mismatch"):
        checkpoint.read_checkpoint(newer)
    assert load_newest_checkpoint(run_dir)["images_seen"] == 32
    assert f"{newer} cannot be loaded" in caplog.text
    # Moved aside: the next save prunes by age among loadable files only, so keep=1 cannot
    # delete the good checkpoint and keep the damaged one.
    save_checkpoint({**STATE, "images_seen": 96}, run_dir, 96, keep=1)
    assert [p.name for p in checkpoint.list_checkpoints(run_dir)] == [
        checkpoint.checkpoint_name(96)
    ]


def test_a_checkpoint_of_another_run_is_skipped(tmp_path, caplog):
    run_dir = tmp_path / "run"
    save_checkpoint(STATE, run_dir, 32, keep=5)
    save_checkpoint({**STATE, "images_seen": 64, "fingerprint": "e" * 64}, run_dir, 64, keep=5)
    assert load_newest_checkpoint(run_dir, "f" * 64)["images_seen"] == 32
    assert "belongs to run eeeeeeeeeeeeeeee" in caplog.text
    assert load_newest_checkpoint(run_dir, "0" * 64) is None


def test_stale_temporaries_of_killed_writes_are_removed(tmp_path, digits16):
    params = parse_params({**RUN, "train": {**RUN["train"], "kimg": 0.32}})
    stale = tmp_path / ".ckpt-000000000032.pt.tmp-4242"
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_bytes(b"half a checkpoint")
    dataset = LmdbImageDataset(digits16 / "train.lmdb", as_uint8=True)
    loop.train(params, dataset, torch.device("cpu"), progress=False, run_dir=tmp_path)
    assert not stale.exists()
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["ckpt-000000000320.pt"]


def test_a_diverged_run_keeps_the_last_good_checkpoint(tmp_path, digits16, monkeypatch):
    calls = {"n": 0}
    move = stream.to_device_images

    def poisoned(batch, device):
        calls["n"] += 1
        images = move(batch, device)
        return images * float("nan") if calls["n"] == 15 else images

    monkeypatch.setattr(stream, "to_device_images", poisoned)
    params = parse_params(RUN)  # checkpoints every 10 iterations
    assert_diverges_keeping_the_first_checkpoint(
        params, digits16, tmp_path / "run", "non-finite loss at step 15"
    )


def assert_diverges_keeping_the_first_checkpoint(params, digits16, run_dir, message):
    """Training stops with ``message``; only the checkpoint of iteration 10 (320 images),
    made before the divergence, is on disk."""
    with pytest.raises(FloatingPointError, match=message):
        loop.train(
            params,
            LmdbImageDataset(digits16 / "train.lmdb", as_uint8=True),
            torch.device("cpu"),
            progress=False,
            run_dir=run_dir,
        )
    assert [p.name for p in checkpoint.list_checkpoints(run_dir)] == [
        checkpoint.checkpoint_name(320)
    ]


def test_non_finite_weights_are_never_checkpointed(tmp_path, digits16, monkeypatch):
    """The loss of a step is computed before its update: a step that turns the weights
    non-finite shows a finite loss. The weights are checked before every save."""
    strategy = strategies.STRATEGIES["d_first_detach"]
    calls = {"n": 0}

    def poisoning(gan, batches):
        stats = strategy(gan, batches)
        calls["n"] += 1
        if calls["n"] == 20:  # after the update of the step that ends with a checkpoint
            with torch.no_grad():
                next(dist.unwrap(gan.d).parameters()).fill_(float("inf"))
        return stats

    monkeypatch.setitem(strategies.STRATEGIES, "d_first_detach", poisoning)
    assert_diverges_keeping_the_first_checkpoint(
        parse_params(RUN), digits16, tmp_path / "run", "non-finite weights after step 20"
    )


def test_a_full_disk_during_a_save_leaves_the_previous_checkpoints_intact(tmp_path, monkeypatch):
    import errno

    run_dir = tmp_path / "run"
    for images in (32, 64):
        save_checkpoint({**STATE, "images_seen": images}, run_dir, images, 5)
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", full)  # write_bytes_atomic's fsync
    with pytest.raises(NoSpaceError, match="No space left"):
        save_checkpoint({**STATE, "images_seen": 96}, run_dir, 96, 5)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before  # no leftovers
    assert load_newest_checkpoint(run_dir)["images_seen"] == 64


def without_measurements(records):
    """Logged records without perf/* (timings differ from run to run)."""
    return [
        (seen, {k: v for k, v in scalars.items() if not k.startswith("perf/")})
        for seen, scalars in records
    ]


def test_a_resumed_run_writes_the_whole_log_again(tmp_path, digits16):
    """DVC clears the log before it reruns the stage: the resumed run's log must hold the
    records and grids from before the interruption too, as if it had never stopped."""
    params = parse_params({**RUN, "train": {**RUN["train"], "kimg": 0.96, "log_every_kimg": 0.064}})
    params = params.model_copy(
        update={"train": params.train.model_copy(update={"snapshot_kimg": 0.192})}
    )
    dataset = LmdbImageDataset(digits16 / "train.lmdb", as_uint8=True)
    whole = Recorder()
    loop.train(params, dataset, torch.device("cpu"), whole, False, tmp_path / "a")

    polls = {"n": 0}

    def stop_after_13() -> bool:
        polls["n"] += 1
        return polls["n"] == 13

    with pytest.raises(loop.TrainingInterrupted):
        loop.train(
            params, dataset, torch.device("cpu"), Recorder(), False, tmp_path / "b", stop_after_13
        )
    resumed = Recorder()
    loop.train(params, dataset, torch.device("cpu"), resumed, False, tmp_path / "b")
    assert without_measurements(resumed.scalars) == without_measurements(whole.scalars)
    assert [seen for seen, _ in resumed.grids] == [seen for seen, _ in whole.grids]
    assert [seen for seen, _ in whole.grids] == [192, 384, 576, 768, 960]


def test_an_augmented_run_resumes_to_the_same_bytes(tmp_path, digits16):
    """The augmentation draws are functions of the seed and the batch, and ADA's p is part
    of the checkpoint: a run interrupted and resumed augments every batch as the
    uninterrupted run does, with the same p at every step."""
    train = {
        **RUN["train"],
        "kimg": 0.64,
        "log_every_kimg": 0.064,
        "augment": "color+translation+cutout",
        "augment_p": 0.5,
        "augment_target": 0.6,
        "augment_speed_kimg": 0.5,  # p moves by 32 / 500 per iteration
    }
    raw = {**RUN, "train": train}
    params = parse_params(raw)
    dataset = LmdbImageDataset(digits16 / "train.lmdb", as_uint8=True)
    log_whole = Recorder()
    whole = loop.train(params, dataset, torch.device("cpu"), log_whole, False, tmp_path / "a")
    polls = {"n": 0}

    def stop_after_7() -> bool:
        polls["n"] += 1
        return polls["n"] == 7

    with pytest.raises(loop.TrainingInterrupted):
        loop.train(params, dataset, torch.device("cpu"), None, False, tmp_path / "b", stop_after_7)
    log_resumed = Recorder()
    resumed = loop.train(params, dataset, torch.device("cpu"), log_resumed, False, tmp_path / "b")
    plain = loop.train(
        parse_params({**raw, "train": {**train, "augment": "none", "augment_target": None}}),
        dataset,
        torch.device("cpu"),
        progress=False,
    )
    for name in ("g", "d", "g_ema"):
        ours, theirs = getattr(whole, name).state_dict(), getattr(resumed, name).state_dict()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), name
    assert without_measurements(log_resumed.scalars) == without_measurements(log_whole.scalars)
    # p followed r_t down (D unsure at first) and up, by 32 / 500 per iteration, two
    # iterations per record, clamped to [0, 1]
    ps = [scalars["augment/p"] for _, scalars in log_whole.scalars]
    assert min(ps) < 0.5 < max(ps), ps
    moves = [round(abs(b - a) / (32 / 500), 3) for a, b in itertools.pairwise([0.5, *ps])]
    assert all(m in (0, 1, 2) or p in (0, 1) for m, p in zip(moves, ps, strict=True)), ps
    d_plain = plain.d.state_dict()
    assert any(not torch.equal(v, d_plain[k]) for k, v in whole.d.state_dict().items())


def test_a_mirrored_run_resumes_to_the_same_bytes(tmp_path, digits16):
    """train.xflip's flips are functions of the seed and the batch: a mirrored run
    interrupted and resumed ends with the bytes of one never stopped, which differ from
    those of the same run unmirrored."""
    train = {**RUN["train"], "kimg": 0.384, "n_critic": 2, "xflip": True}
    raw = {**RUN, "train": train}
    params = parse_params(raw)
    dataset = LmdbImageDataset(digits16 / "train.lmdb", as_uint8=True)
    cpu = torch.device("cpu")
    log_whole, log_resumed = Recorder(), Recorder()
    whole = loop.train(params, dataset, cpu, log_whole, False, tmp_path / "a")
    polls = {"n": 0}

    def stop_after_3() -> bool:
        polls["n"] += 1
        return polls["n"] == 3

    with pytest.raises(loop.TrainingInterrupted):
        loop.train(params, dataset, cpu, None, False, tmp_path / "b", stop_after_3)
    resumed = loop.train(params, dataset, cpu, log_resumed, False, tmp_path / "b")
    plain = loop.train(
        parse_params({**raw, "train": {**train, "xflip": False}}), dataset, cpu, progress=False
    )
    for name in ("g", "d", "g_ema"):
        ours, theirs = getattr(whole, name).state_dict(), getattr(resumed, name).state_dict()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), name
    assert without_measurements(log_resumed.scalars) == without_measurements(log_whole.scalars)
    d_plain = plain.d.state_dict()
    assert any(not torch.equal(v, d_plain[k]) for k, v in whole.d.state_dict().items())


def test_resuming_a_finished_run_logs_it_again(tmp_path, digits16):
    params = parse_params({**RUN, "train": {**RUN["train"], "kimg": 0.64}})
    dataset = LmdbImageDataset(digits16 / "train.lmdb", as_uint8=True)

    first, again = Recorder(), Recorder()
    loop.train(params, dataset, torch.device("cpu"), first, progress=False, run_dir=tmp_path)
    result = loop.train(
        params, dataset, torch.device("cpu"), again, progress=False, run_dir=tmp_path
    )
    assert again.scalars == first.scalars and again.grids == first.grids
    assert [g[0] for g in again.grids] == [640]
    assert result.images_seen == 640


def test_new_code_does_not_resume_an_old_run(monkeypatch):
    params = parse_params(RUN)
    before = fingerprint(params)
    monkeypatch.setattr(checkpoint, "code_digest", lambda: "0" * 64)
    assert fingerprint(params) != before


def test_new_data_does_not_resume_an_old_run():
    params = parse_params(RUN)
    assert fingerprint(params, "a" * 64) != fingerprint(params, "b" * 64)


def test_the_code_digest_ignores_comments_formatting_and_docstrings():
    plain = "def f(x):\n    return x + 1\n"
    dressed = 'def f(x):\n    """Add one."""\n    # why\n    return (x +\n            1)\n'
    changed = "def f(x):\n    return x + 2\n"
    assert checkpoint.source_digest(plain) == checkpoint.source_digest(dressed)
    assert checkpoint.source_digest(plain) != checkpoint.source_digest(changed)
