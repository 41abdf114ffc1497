"""In CI (CI=true) or with MFQAT_REQUIRE_ALL=1, every optional backend and cross-check library must
be present: a missing one would otherwise silently turn its tests into skips."""
import importlib
import os

import pytest
import torch

REQUIRED = os.environ.get("CI") == "true" or os.environ.get("MFQAT_REQUIRE_ALL") == "1"
pytestmark = pytest.mark.skipif(not REQUIRED, reason="set CI=true or MFQAT_REQUIRE_ALL=1 to require every backend")


def test_cpp_extension_loaded():
    from mfqat.quant.kernels import cpp

    assert cpp.AVAILABLE, f"the C++ extension did not load: {cpp.LOAD_ERROR}"
    assert hasattr(torch.ops.mfqat, "fake_quant_mx") and hasattr(torch.ops.mfqat, "quantize_mx")


def test_triton_backend_usable():
    from mfqat.quant.kernels import triton_mx

    importlib.import_module("triton")
    assert triton_mx.AVAILABLE
    assert triton_mx.usable_on(torch.device("cpu")), "TRITON_INTERPRET=1 must be set for the CPU test run"


@pytest.mark.parametrize("module", ["triton", "bitsandbytes", "bitsandbytes.functional", "torchao",
                                    "torchao.prototype.mx_formats.mx_tensor", "mlx.core", "mlx_lm",
                                    "hypothesis", "peft"])
def test_cross_check_library_imports(module):
    importlib.import_module(module)


def test_every_backend_runs():
    from mfqat.quant.kernels import available_backends

    assert set(available_backends("cpu")) == {"reference", "cpp", "triton"}
