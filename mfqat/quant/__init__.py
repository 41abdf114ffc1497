"""Quantization: the pure-PyTorch reference (the oracle), MXTensor, packing and dispatch."""
from .api import dequantize, fake_quantize, fake_quantize_through, quantize, validate
from .mxtensor import MXTensor
from .packing import pack_codes, unpack_codes

__all__ = ["quantize", "dequantize", "fake_quantize", "fake_quantize_through", "validate", "MXTensor", "pack_codes", "unpack_codes"]
