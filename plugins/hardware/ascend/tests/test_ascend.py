"""Ascend selection without the hardware: the probe is safe without torch-npu, `--device auto` prefers an
available NPU, an unavailable one is a clear error. A stand-in ``torch_npu`` module (a test double at the
boundary we cannot reach here: the Ascend driver) plays the hardware. The real-device test is marked npu."""

from __future__ import annotations

import subprocess
import sys
import types

import omnirl_plugin_ascend
import pytest

from omnirl_core.errors import PluginError
from omnirl_core.plugins import PluginManager
from omnirl_core.resolve import resolve_device


def _manager() -> PluginManager:
    m = PluginManager()
    m.load_modules(["omnirl_plugin_cpu", "omnirl_plugin_ascend"])
    return m


def test_registering_imports_neither_torch_nor_torch_npu():
    code = ("import sys; from omnirl_core.plugins import PluginManager; m = PluginManager(); "
            "m.load_modules(['omnirl_plugin_ascend']); s = m.registries['device'].resolve('npu'); "
            "print(s.name, s.backend, s.ray_resource, 'torch' in sys.modules, 'torch_npu' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["ascend", "hccl", "NPU", "False", "False"]


def test_probe_without_torch_npu_is_zero_and_auto_picks_cpu():
    assert omnirl_plugin_ascend.probe() == 0  # torch-npu is never installed in this environment
    assert resolve_device(_manager(), "auto").name == "cpu"
    with pytest.raises(PluginError, match="Device 'ascend' is not available"):
        resolve_device(_manager(), "npu")


@pytest.fixture
def stand_in_npus(monkeypatch):
    """A stand-in torch_npu that reports two NPUs (no Ascend driver here)."""
    import importlib.machinery
    import importlib.util

    import torch

    fake = types.ModuleType("torch_npu")
    fake.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    npu = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 2)
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: fake.__spec__ if name == "torch_npu" else real_find_spec(name, *a))
    return npu


def test_auto_prefers_available_npus(stand_in_npus):
    assert omnirl_plugin_ascend.probe() == 2
    spec = resolve_device(_manager(), "auto")
    assert (spec.name, spec.torch_device, spec.backend, spec.visible_devices_env) == (
        "ascend", "npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES")


def test_a_broken_torch_npu_reads_as_no_device(stand_in_npus):
    def boom():
        raise RuntimeError("libhccl.so: cannot open shared object file")

    stand_in_npus.device_count = boom
    assert omnirl_plugin_ascend.probe() == 0


@pytest.mark.npu
@pytest.mark.skipif(omnirl_plugin_ascend.probe() == 0, reason="needs an Ascend NPU with torch-npu")
def test_matmul_on_a_real_npu():
    import torch

    assert omnirl_plugin_ascend.probe() > 0
    x = torch.ones(4, 4, device="npu")
    assert float((x @ x).sum().cpu()) == 64.0
