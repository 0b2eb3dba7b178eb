"""The portable CPU mode's pins (ganpipe.cpu), without running any training."""

from __future__ import annotations

import pytest
import torch

from ganpipe import cpu, runtime
from ganpipe.params import DeterminismParams, DevicesParams

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse4_2 avx avx2 fma f16c

processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse4_2 avx avx2 fma f16c
"""


def test_cpu_info_reads_the_model_and_the_vector_flags(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    info = cpu.cpu_info(path)
    assert info["model"] == "AMD EPYC 7B13"
    assert info["flags"] == ["sse4_2", "avx", "avx2", "fma", "f16c"]
    assert cpu.cpu_info(tmp_path / "missing")["flags"] is None


def test_the_portable_mode_pins_every_library_and_native_only_the_threads():
    assert cpu.numerics_env("portable", 3) == {
        "OMP_NUM_THREADS": "3",
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_CBWR": "COMPATIBLE",  # MKL's AVX2 branch is Intel-only: AMD would not follow
        "MKL_DYNAMIC": "FALSE",
        "OMP_DYNAMIC": "FALSE",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    }
    assert cpu.numerics_env("native", 2) == {"OMP_NUM_THREADS": "2"}


@pytest.mark.parametrize(
    ("info", "words"),
    [
        (
            {"arch": "x86_64", "model": "Intel Xeon E5-2670", "flags": ["sse4_2", "avx"]},
            ["lacks avx2, fma", "Intel Xeon E5-2670"],
        ),
        ({"arch": "aarch64", "model": "Neoverse", "flags": []}, ["is aarch64"]),
        ({"arch": "x86_64", "model": "?", "flags": None}, ["cannot read this CPU's flags"]),
    ],
)
def test_a_cpu_without_avx2_is_refused_naming_the_key_and_the_fix(info, words):
    with pytest.raises(cpu.CpuError) as caught:
        cpu.check_cpu("portable", info)
    message = str(caught.value)
    assert "determinism.cpu_isa=portable" in message
    assert "determinism.cpu_isa: native" in message
    for word in words:
        assert word in message
    cpu.check_cpu("native", info)  # native runs anywhere


def test_this_machine_can_run_the_portable_mode():
    cpu.check_cpu("portable")  # the default must work where the project is developed


def test_pinning_after_torch_is_loaded_is_refused_unless_pinned_so_already():
    assert "torch" in __import__("sys").modules
    with pytest.raises(RuntimeError, match="after torch was imported"):
        cpu.pin(DeterminismParams(cpu_isa="native"), DevicesParams())
    with pytest.raises(RuntimeError, match="after torch was imported"):
        cpu.pin(DeterminismParams(), DevicesParams(cpu_threads=3))  # another thread count
    cpu.pin(DeterminismParams(), DevicesParams())  # this session's pins (tests/conftest.py)
    assert cpu.pinned_mode() == "portable"


def test_a_process_pinned_to_another_mode_is_refused():
    # this test session was pinned to the default, portable, by tests/conftest.py
    assert cpu.pinned_mode() == "portable"
    with pytest.raises(ValueError, match=r"cpu_isa=native but this process was pinned to"):
        runtime.apply_cpu_numerics(DeterminismParams(cpu_isa="native"))
    runtime.apply_cpu_numerics(DeterminismParams())
    assert torch.backends.cpu.get_cpu_capability() == "AVX2"
    assert torch.backends.mkldnn.enabled is False
    assert runtime.mkl_cbwr() == "COMPATIBLE"  # as MKL itself reports it


# --- devices.gpus: CUDA_VISIBLE_DEVICES set before torch loads, in every stage -------------


def test_a_gpu_list_becomes_cuda_visible_devices_in_nvidia_smi_order():
    devices = DevicesParams(gpus=[1])
    assert cpu.gpu_env(devices, {}) == {
        "CUDA_VISIBLE_DEVICES": "1",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }
    two = DevicesParams(gpus=[3, 1], nproc_per_node=2)
    assert cpu.gpu_env(two, {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}) == {
        "CUDA_VISIBLE_DEVICES": "3,1"  # an order the user chose stays
    }
    # torchrun's workers inherit the launcher's selection and pin it again: the same value
    assert cpu.gpu_env(two, {"CUDA_VISIBLE_DEVICES": "3,1"})["CUDA_VISIBLE_DEVICES"] == "3,1"
    # all (the default) and CPU runs leave whatever the environment selects alone
    assert cpu.gpu_env(DevicesParams(), {"CUDA_VISIBLE_DEVICES": "2"}) == {}
    assert cpu.gpu_env(DevicesParams(accelerator="cpu", gpus=[1]), {}) == {}


def test_a_gpu_list_contradicting_the_environment_is_refused():
    with pytest.raises(cpu.GpuSelectionError) as caught:
        cpu.gpu_env(DevicesParams(gpus=[1]), {"CUDA_VISIBLE_DEVICES": "2,3"})
    message = str(caught.value)
    assert "devices.gpus=[1]" in message and "CUDA_VISIBLE_DEVICES='2,3'" in message
    assert "set devices.gpus: all" in message and "unset CUDA_VISIBLE_DEVICES" in message


def test_selecting_gpus_after_torch_is_loaded_is_refused():
    with pytest.raises(RuntimeError, match="after torch was imported"):
        cpu.pin_gpus(DevicesParams(gpus=[1]))


@pytest.fixture
def visible_gpus(monkeypatch):
    """Pretend this process was pinned to a GPU list and CUDA sees ``n`` GPUs."""

    def pretend(pinned, n):
        monkeypatch.setattr(cpu, "_pinned_gpus", pinned)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return pretend


@pytest.mark.parametrize(
    ("gpus", "seen", "words"),
    [
        # CUDA_VISIBLE_DEVICES=1 on a one-GPU machine: CUDA sees nothing
        ([1], 0, "devices.gpus=[1] but CUDA sees none of them: this machine has no GPU 1"),
        # =0,5 on a two-GPU machine: 5 hides itself (and all listed after it)
        ([0, 5], 1, "devices.gpus=[0, 5] names GPU 5, which this machine lacks (CUDA sees 1 "),
        ([], 0, "devices.gpus=[] selects no GPU but devices.accelerator=cuda"),
    ],
)
def test_a_listed_gpu_the_machine_lacks_is_an_error_naming_it(visible_gpus, gpus, seen, words):
    visible_gpus(gpus, seen)
    devices = DevicesParams(accelerator="cuda", gpus=gpus)
    with pytest.raises(ValueError) as caught:
        runtime.check_gpus(devices)
    assert words in str(caught.value)
    assert "nvidia-smi -L" in str(caught.value) or "use devices.accelerator=cpu" in str(
        caught.value
    )


def test_listed_gpus_that_exist_pass_and_too_many_processes_do_not(visible_gpus):
    visible_gpus([2, 3], 2)
    runtime.check_gpus(DevicesParams(gpus=[2, 3], nproc_per_node=2))
    visible_gpus(None, 1)
    with pytest.raises(ValueError, match="nproc_per_node=2 is more than the 1 GPU"):
        runtime.check_gpus(DevicesParams(nproc_per_node=2))


def test_a_gpu_list_in_a_process_that_did_not_select_it_is_refused(visible_gpus):
    # CUDA would number every GPU from 0 and train on the first: the bug of issue 13
    visible_gpus(None, 2)
    with pytest.raises(ValueError, match=r"devices.gpus=\[1\] but this process did not select"):
        runtime.check_gpus(DevicesParams(gpus=[1]))


def test_auto_with_a_listed_gpu_that_is_missing_does_not_fall_back_to_the_cpu(visible_gpus):
    visible_gpus([1], 0)
    with pytest.raises(ValueError, match="this machine has no GPU 1"):
        runtime.resolve_device(DevicesParams(gpus=[1]))  # accelerator auto
    visible_gpus(None, 0)
    if not torch.cuda.is_available():
        assert runtime.resolve_device(DevicesParams(gpus=[])).type == "cpu"
        assert runtime.resolve_device(DevicesParams()).type == "cpu"
