"""Quantization: the pure-PyTorch reference (the oracle), MXTensor, packing and dispatch."""
from mfqat.quant.api import dequantize, fake_quantize, fake_quantize_through, quantize, validate
from mfqat.quant.mxtensor import MXTensor
from mfqat.quant.packing import pack_codes, unpack_codes

__all__ = ["quantize", "dequantize", "fake_quantize", "fake_quantize_through", "validate", "MXTensor", "pack_codes", "unpack_codes"]
