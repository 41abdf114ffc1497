"""Calibration text sampled from the model itself: the ``generated`` source of ``--calib-text``.

Data-free calibration (as in LLM-QAT's self-generated data): the model being quantized writes the text,
so the calibration covers what the model has learned rather than one domain. ``generated_text`` samples
``n_tokens`` tokens in sequences of ``seq_len`` from the start token, temperature 1 and nucleus 0.95,
with a fixed seed (the same text for the same model and machine; a different BLAS may sample
differently). The model is read as ``mfqat.data.sources.load_model`` reads it: an anchor in its own
format, an HF folder or a GGUF. Measured on SmolLM2 (BENCHMARKS.md "Calibration on self-generated
text"): mixing it 1:1 with the training text lowered ``auto:4.7:affine``'s perplexity on a text of
another domain by 9-11% and left it within 1% in domain.
"""
from __future__ import annotations

import math

import torch

from mfqat.data.sources import load_model
from mfqat.progress import progress

GENERATED_SOURCE = "generated"
DEFAULT_TOKENS = 4096  # 32 blocks of 128: the largest default consumer, --refine, reads 36 blocks
MORE_SEED, MORE_BATCH = 1, 64  # the text past DEFAULT_TOKENS: another seed, sampled 64 sequences at a time


def generated_text(model_path: str, n_tokens: int = DEFAULT_TOKENS, seed: int = 0, seq_len: int = 256,
                   batch: int = 8, temperature: float = 1.0, top_p: float = 0.95) -> str:
    """``n_tokens`` (rounded up to whole sequences) sampled from the model at ``model_path``, the
    sequences joined by blank lines; special tokens are left out."""
    if n_tokens < 1 or seq_len < 1:
        raise ValueError(f"generated_text: n_tokens and seq_len must be positive, got {n_tokens}, {seq_len}")
    model, tok = load_model(model_path)
    model.eval()
    return _sample(model, tok, model_path, n_tokens, seed, seq_len, batch, temperature, top_p)


def calibration_generated_text(model_path: str, n_tokens: int = DEFAULT_TOKENS) -> str:
    """The ``generated`` source of ``--calib-text``, at least ``n_tokens`` long: ``generated_text``'s default
    sample (:data:`DEFAULT_TOKENS`, seed 0, 8 sequences at a time), then, where more is needed, the rest
    sampled with seed :data:`MORE_SEED` :data:`MORE_BATCH` sequences at a time (about 2.6x faster on 2 CPU
    cores; a larger batch samples other text, so the default part keeps its batch). The first
    :data:`DEFAULT_TOKENS` are therefore the same whatever ``n_tokens`` is: a consumer reading the first
    blocks (the sensitivity pass) sees the same text as with the default size."""
    model, tok = load_model(model_path)
    model.eval()
    text = _sample(model, tok, model_path, DEFAULT_TOKENS, 0, 256, 8, 1.0, 0.95)
    if n_tokens > DEFAULT_TOKENS:
        more = _sample(model, tok, model_path, n_tokens - DEFAULT_TOKENS, MORE_SEED, 256, MORE_BATCH, 1.0, 0.95)
        text = text + "\n\n" + more
    return text


def _sample(model, tok, model_path: str, n_tokens: int, seed: int, seq_len: int, batch: int, temperature: float,
            top_p: float) -> str:
    """``generated_text``'s sampling, on a loaded model and tokenizer."""
    start = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    if start is None:
        raise ValueError(f"--calib-text {GENERATED_SOURCE}: the tokenizer of {model_path} has no BOS or EOS token "
                         "to start sampling from; give a text file instead")
    n_seq = math.ceil(n_tokens / seq_len)
    texts = []
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for first in progress(range(0, n_seq, batch), desc=f"calibration text from {model_path} ({n_seq * seq_len} tokens)"):
            ids = torch.full((min(batch, n_seq - first), 1), start, dtype=torch.long)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=temperature,
                                 top_p=top_p, top_k=0, max_new_tokens=seq_len, min_new_tokens=seq_len,
                                 pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else start)
            texts += [tok.decode(row[1:], skip_special_tokens=True) for row in out]
    return "\n\n".join(texts)
