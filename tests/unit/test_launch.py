"""The launcher's capacity check (pure; the processes themselves: tests/integration/test_ddp.py)."""

from __future__ import annotations

import pytest

from stages._launch import LaunchError, check_capacity

GiB = 2**30


def test_as_many_processes_as_cores_and_memory_hold_are_launched():
    check_capacity(2, True, cores=2, per_process_bytes=GiB // 2, available_bytes=GiB)


def test_more_processes_than_cores_on_cpu_are_refused_naming_the_key_and_fixes():
    with pytest.raises(LaunchError) as caught:
        check_capacity(64, True, cores=2, per_process_bytes=None, available_bytes=None)
    message = str(caught.value)
    assert "devices.nproc_per_node=64 processes on CPU" in message and "2 CPU core(s)" in message
    assert "devices.oversubscribe: true" in message


def test_on_gpus_the_cores_do_not_bound_the_processes():
    check_capacity(8, False, cores=2, per_process_bytes=GiB, available_bytes=100 * GiB)


def test_processes_that_memory_cannot_hold_are_refused_with_the_numbers():
    with pytest.raises(LaunchError) as caught:
        check_capacity(4, False, cores=64, per_process_bytes=GiB, available_bytes=3 * GiB)
    assert "need at least 4.0 GiB of memory (1024 MiB each" in str(caught.value)
    assert "3.0 GiB is available" in str(caught.value)
