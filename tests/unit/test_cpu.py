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
