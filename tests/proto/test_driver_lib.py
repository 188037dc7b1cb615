"""driver_lib: where the CUDA driver and HIP runtime are looked for, and what a host without them is told."""

from __future__ import annotations

import os

import pytest
import torch

from dspark_sidecar.proto import driver_lib

_TORCH_HIP = os.path.join(os.path.dirname(torch.__file__), "lib", "libamdhip64.so")


@pytest.fixture
def loader(monkeypatch):
    """ctypes.CDLL recorded: the names in `loads` open (as a marker string), any other raises the loader's OSError."""
    tried, loads = [], set()

    def cdll(name):
        tried.append(name)
        if name not in loads:
            raise OSError(f"{name}: cannot open shared object file: No such file or directory")
        return f"lib:{name}"

    monkeypatch.setattr(driver_lib.ctypes, "CDLL", cdll)
    return tried, loads


def test_torch_s_own_hip_runtime_is_tried_first_then_rocm_path_then_the_loader(monkeypatch):
    """torch/lib's copy first: the system's is a second runtime whose contexts and IPC mappings are not torch's."""
    monkeypatch.setenv("ROCM_PATH", "/opt/rocm-7.1")
    monkeypatch.setattr(driver_lib.ctypes.util, "find_library", lambda name: "libamdhip64.so.7")
    assert driver_lib.hip_runtime_candidates() == [_TORCH_HIP, "/opt/rocm-7.1/lib/libamdhip64.so", "libamdhip64.so",
                                                   "libamdhip64.so.7"]
    monkeypatch.delenv("ROCM_PATH")
    monkeypatch.setattr(driver_lib.ctypes.util, "find_library", lambda name: "libamdhip64.so")  # no repeat
    assert driver_lib.hip_runtime_candidates() == [_TORCH_HIP, "/opt/rocm/lib/libamdhip64.so", "libamdhip64.so"]


def test_the_first_candidate_that_loads_is_the_runtime_and_no_later_one_is_opened(loader, monkeypatch):
    tried, loads = loader
    monkeypatch.setattr(driver_lib, "hip_runtime_candidates", lambda: ["/a/libamdhip64.so", "/b/libamdhip64.so",
                                                                       "libamdhip64.so"])
    loads.update({"/b/libamdhip64.so", "libamdhip64.so"})
    assert driver_lib.hip_runtime() == "lib:/b/libamdhip64.so"
    assert tried == ["/a/libamdhip64.so", "/b/libamdhip64.so"]


def test_no_hip_runtime_names_every_place_tried_and_the_loader_s_reason(loader, monkeypatch):
    tried, _ = loader
    monkeypatch.setattr(driver_lib, "hip_runtime_candidates", lambda: ["/a/libamdhip64.so", "libamdhip64.so"])
    with pytest.raises(OSError) as got:
        driver_lib.hip_runtime()
    assert tried == ["/a/libamdhip64.so", "libamdhip64.so"]
    assert str(got.value) == ("HIP runtime (libamdhip64) not found; tried /a/libamdhip64.so: /a/libamdhip64.so: "
                              "cannot open shared object file: No such file or directory; libamdhip64.so: "
                              "libamdhip64.so: cannot open shared object file: No such file or directory")


def test_the_cuda_driver_is_the_versioned_soname(loader):
    """libcuda.so (unversioned) is the toolkit's link-time stub on many hosts: every call on it fails."""
    tried, loads = loader
    loads.add("libcuda.so.1")
    assert driver_lib.cuda_driver() == "lib:libcuda.so.1" and tried == ["libcuda.so.1"]
