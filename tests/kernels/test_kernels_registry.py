"""attention_backend="auto" picks flashinfer (CUDA + it imports), else triton on CUDA; on the CPU the
native backend where the native kernels run, else torch."""

from __future__ import annotations

import importlib
import types

import pytest

from radix_backend.kernels import native, registry, settings


@pytest.fixture
def installed(monkeypatch):
    """Set what importing triton / flashinfer does: True (imports), False (missing) or an exception."""
    state: dict[str, object] = {}
    real_import = importlib.import_module

    def fake_import(name, *args, **kwargs):
        if name not in state:
            return real_import(name, *args, **kwargs)
        if state[name] is True:
            return types.ModuleType(name)
        if state[name] is False:
            raise ModuleNotFoundError(f"No module named {name!r}")
        raise state[name]

    monkeypatch.setattr(registry.importlib, "import_module", fake_import)

    def set_state(**modules):
        state.update(modules)
        registry._imports.cache_clear()
    yield set_state
    registry._imports.cache_clear()


def test_auto_on_cpu_is_native_or_torch_whatever_is_installed(installed) -> None:
    installed(triton=True, flashinfer=True)
    with settings.overridden(native=False):
        assert registry.available_backends("cpu") == ["torch"]
        assert registry.resolve_backend_name("auto", "cpu") == "torch"
        assert registry.create_attention_backend("torch", "cpu").name == "torch"
        with pytest.raises(ValueError, match="native.*not available here"):
            registry.resolve_backend_name("native", "cpu")
    if native.available():
        assert registry.available_backends("cpu") == ["torch", "native"]
        assert registry.create_attention_backend("auto", "cpu").name == "native"
    with pytest.raises(ValueError, match="native.*not available here"):
        registry.resolve_backend_name("native", "cuda")


def test_auto_on_cuda_prefers_flashinfer_then_triton(installed) -> None:
    installed(triton=True, flashinfer=True)
    assert registry.available_backends("cuda") == ["torch", "triton", "flashinfer"]
    assert registry.resolve_backend_name("auto", "cuda:0") == "flashinfer"
    installed(flashinfer=False)
    assert registry.resolve_backend_name("auto", "cuda") == "triton"
    installed(triton=False)
    assert registry.resolve_backend_name("auto", "cuda") == "torch"


def test_auto_on_cuda_with_batch_invariance_picks_triton_and_its_invariant_kernel(installed) -> None:
    """FlashInfer splits its work by the batch, so invariance takes Triton's invariant kernel."""
    pytest.importorskip("triton")
    installed(triton=True, flashinfer=True)
    assert registry.resolve_backend_name("auto", "cuda", batch_invariant=True) == "triton"
    assert registry.resolve_backend_name("flashinfer", "cuda", batch_invariant=True) == "flashinfer"  # asked for
    assert registry.create_attention_backend("auto", "cuda", batch_invariant=True).batch_invariant
    assert not registry.create_attention_backend("triton", "cuda").batch_invariant
    installed(triton=False)
    assert registry.resolve_backend_name("auto", "cuda", batch_invariant=True) == "flashinfer"


def test_flashinfer_that_fails_to_import_is_skipped(installed, caplog) -> None:
    installed(triton=True, flashinfer=OSError("libcudart.so.13: cannot open shared object"))
    assert registry.resolve_backend_name("auto", "cuda") == "triton"
    assert "flashinfer is installed but does not import" in caplog.text


def test_explicit_names_pass_through_and_unknown_names_raise() -> None:
    assert registry.resolve_backend_name("triton", "cpu") == "triton"
    assert registry.resolve_backend_name("torch", "cuda") == "torch"
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        registry.resolve_backend_name("xformers", "cpu")
    assert registry.create_attention_backend("torch", "cpu").name == "torch"
