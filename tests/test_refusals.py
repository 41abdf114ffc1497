"""Issue 48: every refusal of a bad value in the numeric paths (mfqat/quant, the anchor's refined widths,
export recipes, budgets and group sizes) is reached with the value just outside the allowed range (zero,
negative, NaN, Inf, wrong type or dtype), and its message names the argument or tensor. The value just
inside is accepted. Cases marked xfail(strict) are refusals the code does not make yet (the reason says
where the fix goes); they turn into failures once it is made, so the marker cannot outlive the fix."""
import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import mfqat
from mfqat.anchor.checkpoint import AnchorError, read_anchor
from mfqat.data.sources import tiny_llama, tiny_tokenizer
from mfqat.quant.api import fake_quantize, quantize, quantize_nvfp4
from mfqat.quant.derive import derive_affine
from mfqat.quant.nvfp4 import (e4m3_decode, e4m3_encode, nvfp4_dequantize_blocks, nvfp4_fake_quantize_blocks,
                               nvfp4_quantize_blocks)
from mfqat.quant.packing import pack_codes, unpack_codes
from mfqat.quant.scale_rules import check_scale_rules, resolve_scale_rules
from mfqat.quant.scale_search import quantize_search
from mfqat.storage.manifest import canonical_digest, seal

NAN, INF = float("nan"), float("inf")
X = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))


# --- NVFP4: the per-tensor global scale, blocks, rules ---------------------------------------------------

@pytest.mark.parametrize("g", [0.0, -0.0, -1.0, -1e-30, NAN, INF, -INF, 1e-45],
                         ids=["zero", "minus-zero", "negative", "tiny-negative", "nan", "inf", "minus-inf",
                              "encode-factor-overflows"])
def test_nvfp4_global_scale_outside_the_range_is_refused_everywhere_it_enters(g):
    for call in (lambda: quantize_nvfp4(X, torch.tensor(g)), lambda: quantize_nvfp4(X, g, rule="mlx"),
                 lambda: nvfp4_fake_quantize_blocks(X.reshape(2, 4, 16), torch.tensor(g)),
                 lambda: nvfp4_dequantize_blocks(torch.zeros(2, 16, dtype=torch.uint8),
                                                 torch.full((2,), 0x38, dtype=torch.uint8), torch.tensor(g))):
        with pytest.raises(ValueError, match="nvfp4 global_scale must be a finite positive float32"):
            call()


@pytest.mark.parametrize("g", [1e-30, 1.0, 2688.0, 1e30])
def test_nvfp4_global_scale_just_inside_the_range_is_accepted(g):
    q = quantize_nvfp4(X, torch.tensor(g))
    assert torch.isfinite(q.dequantize(torch.float32)).all()


def test_nvfp4_global_scale_of_another_shape_or_type_is_refused_by_name():
    with pytest.raises(ValueError, match=r"global_scale must be one number per tensor, got shape \(2,\)"):
        quantize_nvfp4(X, torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="global_scale must be a float32 number, got str"):
        quantize_nvfp4(X, "1.0")
    quantize_nvfp4(X, torch.tensor([[3.0]], dtype=torch.float64))  # one number, any float dtype: float32


@pytest.mark.parametrize("n", [0, 8, 15, 17, 32])
def test_nvfp4_blocks_of_other_than_16_are_refused(n):
    with pytest.raises(ValueError, match=f"nvfp4 blocks hold 16 elements, got {n}"):
        nvfp4_quantize_blocks(torch.zeros(2, n))


@pytest.mark.parametrize("rule", ["NVIDIA", "ocp", "", None])
def test_nvfp4_unknown_rule_is_refused_by_name(rule):
    with pytest.raises(ValueError, match=f"unknown nvfp4 rule '{rule}'"):
        nvfp4_quantize_blocks(torch.zeros(2, 16), rule=rule)


@pytest.mark.parametrize("bs", [8, 32, 0, -16])
def test_nvfp4_block_size_is_16_only(bs):
    with pytest.raises(ValueError, match=f"block_size={bs} is not allowed for format 'nvfp4'"):
        quantize(X, "nvfp4", bs)


# --- the E4M3 scale helpers ---------------------------------------------------------------------------

@pytest.mark.parametrize("v", [-1.0, -2.0 ** -9, -INF, NAN])
def test_e4m3_encode_refuses_negative_and_nan_scales(v):
    with pytest.raises(ValueError, match="e4m3_encode: block scales must be non-negative and not NaN"):
        e4m3_encode(torch.tensor([0.5, v]))


def test_e4m3_encode_keeps_zero_saturates_inf_and_decode_reads_bytes_only():
    assert e4m3_encode(torch.tensor([0.0, 2.0 ** -9, 448.0, INF, 1e6])).tolist() == [0, 1, 0x7E, 0x7E, 0x7E]
    assert e4m3_decode(torch.tensor([0x7E], dtype=torch.uint8)).item() == 448.0
    for dtype in (torch.float32, torch.int32, torch.int8):
        with pytest.raises(TypeError, match=f"e4m3_decode: nvfp4 scales are E4M3 bytes \\(uint8\\), got {dtype}"):
            e4m3_decode(torch.tensor([0x38]).to(dtype))


# --- block sizes, formats, dtypes, shapes (quantize / fake_quantize / derive) ---------------------------

@pytest.mark.parametrize("fmt,bs", [("mxint4", 0), ("mxint4", -32), ("mxint4", 31), ("mxint4", 33), ("mxint4", 512),
                                    ("mxfp4_e2m1", 4), ("affine4", 16), ("affine4", 48),
                                    ("affine4", 0), ("nf4", 0), ("nf4", -64)])
def test_a_block_size_outside_the_formats_sizes_is_refused_naming_it(fmt, bs):
    for call in (quantize, fake_quantize):
        with pytest.raises(ValueError, match=f"block_size={bs} is not allowed for format '{fmt}'"):
            call(X, fmt, bs)


@pytest.mark.parametrize("bs", [32.0, "32", 32.5, True])
def test_a_block_size_that_is_not_an_integer_is_refused_naming_it(bs):
    for call in (lambda: quantize(X, "mxint4", bs), lambda: fake_quantize(X, "mxint4", bs),
                 lambda: derive_affine(X, "affine4", bs)):
        with pytest.raises(TypeError, match=f"block_size={bs!r} is not an integer"):
            call()


def test_a_numpy_or_tensor_integer_block_size_is_an_integer():
    np = pytest.importorskip("numpy")
    assert quantize(X, "mxint4", np.int64(32)).block_size == 32
    assert quantize(X, "mxint4", torch.tensor(16)).block_size == 16


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.bool, torch.float8_e4m3fn, torch.complex64])
def test_a_tensor_of_another_dtype_is_refused_naming_the_dtype(dtype):
    with pytest.raises(TypeError, match=f"tensor: dtype {dtype} is not supported"):
        quantize(X.to(dtype), "mxint4")


@pytest.mark.parametrize("fmt,exc,match", [("mxint9", ValueError, "unknown format 'mxint9'"),
                                           ("mxint1", ValueError, "unknown format 'mxint1'"),
                                           ("", ValueError, "unknown format ''"),
                                           (None, TypeError, "format must be a name or ElementFormat, got NoneType"),
                                           (4, TypeError, "format must be a name or ElementFormat, got int")])
def test_an_unknown_format_is_refused_naming_it(fmt, exc, match):
    with pytest.raises(exc, match=match):
        quantize(X, fmt)


@pytest.mark.parametrize("shape", [(2, 33), (2, 31), (64, 1), ()])
def test_a_last_axis_not_in_whole_blocks_is_refused_naming_the_shape(shape):
    with pytest.raises(ValueError, match=rf"tensor: shape {re_tuple(shape)} has a last dimension that is not a multiple"):
        quantize(torch.zeros(shape), "mxint4")


def re_tuple(shape) -> str:
    return str(tuple(shape)).replace("(", r"\(").replace(")", r"\)")


def test_not_a_tensor_is_refused():
    with pytest.raises(TypeError, match="tensor: expected a torch.Tensor, got list"):
        quantize([0.0] * 32, "mxint4")


# --- scale rules --------------------------------------------------------------------------------------

@pytest.mark.parametrize("rule", ["round", "FLOOR", "", None, "search"])
def test_an_unknown_scale_rule_is_refused_naming_it(rule):
    with pytest.raises(ValueError, match=f"unknown scale_rule '{rule}'"):
        quantize(X, "mxint4", scale_rule=rule)
    with pytest.raises(ValueError, match=f"unknown scale_rule {rule!r}"):
        resolve_scale_rules(rule)


def test_a_scale_rule_on_a_non_mx_format_is_refused():
    with pytest.raises(ValueError, match="scale_rule 'ceil' applies to MX formats only, not 'nf4'"):
        quantize(X, "nf4", scale_rule="ceil")


@pytest.mark.parametrize("rules,match", [
    (["ceil"], r"scale_rules: expected a mapping \{format: rule\}, got list"),
    ({"affine4": "ceil"}, "scale_rules: 'affine4' is not an MX format"),
    ({"nvfp4": "floor"}, "scale_rules: 'nvfp4' is not an MX format"),
    ({"mxint4": "up"}, r"scale_rules\['mxint4'\]: unknown scale rule 'up'"),
    ({"mxint4": None}, r"scale_rules\['mxint4'\]: unknown scale rule None"),
    ({"mxint8": "search"}, r"scale_rules\['mxint8'\]: the 'search' rule is for"),
    ({"mxfp8_e4m3": "search"}, r"scale_rules\['mxfp8_e4m3'\]: the 'search' rule is for"),
])
def test_a_bad_scale_rule_mapping_is_refused_naming_the_entry(rules, match):
    with pytest.raises(ValueError, match=match):
        check_scale_rules(rules)


# --- the scale search's importance --------------------------------------------------------------------

@pytest.mark.parametrize("value", [-1.0, -1e-30, NAN, INF, -INF])
def test_search_importance_negative_or_not_finite_is_refused(value):
    imp = torch.ones(64)
    imp[7] = value
    with pytest.raises(ValueError, match="importance must be finite and non-negative"):
        quantize_search(X, "mxint4", 32, importance=imp)
    imp[7] = 0.0  # zero is a channel that never fires: allowed
    quantize_search(X, "mxint4", 32, importance=imp)


@pytest.mark.parametrize("n", [63, 65, 32, 1])
def test_search_importance_of_another_length_is_refused(n):
    with pytest.raises(ValueError, match=f"importance has {n} entries but the tensor's last axis has 64"):
        quantize_search(X, "mxint4", 32, importance=torch.ones(n))


def test_search_of_a_non_mx_format_or_a_partial_block_is_refused():
    with pytest.raises(ValueError, match="scale search applies to MX formats only, not 'affine4'"):
        quantize_search(X, "affine4", 32)
    with pytest.raises(ValueError, match=r"shape \(2, 48\): last dimension is not a multiple of block_size=32"):
        quantize_search(torch.zeros(2, 48), "mxint4", 32)


# --- packing ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [0, 9, -4, 16, True, 4.0])
def test_packing_at_other_than_1_to_8_bits_is_refused(bits):
    with pytest.raises(ValueError, match=f"bits={bits!r}: codes are packed at 1 to 8 bits"):
        pack_codes(torch.zeros(2, 32, dtype=torch.int32), bits)
    with pytest.raises(ValueError, match=f"bits={bits!r}"):
        unpack_codes(torch.zeros(2, 16, dtype=torch.uint8), bits, 32, True)


def test_packing_rows_that_do_not_fill_whole_bytes_or_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="cannot pack a last dimension of 3 codes of 3 bits into whole bytes"):
        pack_codes(torch.zeros(2, 3, dtype=torch.int32), 3)
    with pytest.raises(ValueError, match="packed last dimension is 4 bytes, expected 16 for 32 codes of 4 bits"):
        unpack_codes(torch.zeros(2, 4, dtype=torch.uint8), 4, 32, True)


# --- derived group sizes: derive_affine, load_anchor ---------------------------------------------------


@pytest.mark.parametrize("group", [0, -64, 16, 48, 256])
def test_a_derived_group_size_outside_mlx_affine_sizes_is_refused(untied_anchor, group):
    with pytest.raises(ValueError, match=f"block_size={group} is not allowed for format 'affine4'"):
        derive_affine(X, "affine4", group)
    with pytest.raises(ValueError, match=f"block_size={group} is not allowed for format 'affine4'"):
        mfqat.load_anchor(untied_anchor, "affine4", group_size=group)


def test_save_anchor_refuses_a_non_integer_block_size(tmp_path):
    with pytest.raises(TypeError, match="block_size=32.0 is not an integer"):
        mfqat.save_anchor(tiny_llama(), tmp_path / "a", block_size=32.0)
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("bs", [-32, 31])
def test_save_anchor_refuses_a_block_size_the_format_does_not_take(tmp_path, bs):
    with pytest.raises(ValueError, match=f"block_size[= ]{bs}"):
        mfqat.save_anchor(tiny_llama(), tmp_path / "a", block_size=bs)
    assert not (tmp_path / "a").exists()


def test_save_anchor_refuses_block_size_zero_naming_it(tmp_path):
    with pytest.raises(ValueError, match="block_size=0"):
        mfqat.save_anchor(tiny_llama(), tmp_path / "a", block_size=0)


# --- the anchor's refined widths (learned scales): mfqat.json fields and the width files ----------------

@pytest.fixture(scope="module")
def refined_anchor(tmp_path_factory):
    """An anchor holding the affine4 width learned with QATConfig.learn_scales (group 32; untrained: the
    learned values are the derived ones, which is enough for the refusals)."""
    tok = tiny_tokenizer()
    model = mfqat.prepare(tiny_llama(vocab_size=len(tok)), mfqat.QATConfig(formats=["mxint8", "affine4"],
                                                                           affine_group_size=32, learn_scales=True))
    return mfqat.save_anchor(model, tmp_path_factory.mktemp("ref") / "a", tokenizer=tok)


def _copy(src, tmp_path):
    import shutil

    return shutil.copytree(src, tmp_path / "a")


def _reseal(path, meta):
    """Write mfqat.json with fresh hashes and digest: the edit a tool that knows the format would make."""
    seal(meta, path)
    meta["files"] = {n: meta["manifest"][n] for n in meta["files"]}
    meta["digest"] = canonical_digest(meta)
    (path / "mfqat.json").write_text(json.dumps(meta))


def _rewrite_refined(path, meta, raw) -> str:
    """Save ``raw`` as the affine4 width file under the name of its own content hash (as refine names it),
    list it in place of the old one and reseal: only the values inside are wrong."""
    import hashlib

    from safetensors.torch import save

    old = meta["refined"]["affine4"]["file"]
    data = save(raw)
    name = old.rsplit("-", 1)[0] + f"-{hashlib.sha256(data).hexdigest()[:12]}.safetensors"
    (path / old).unlink()
    (path / name).write_bytes(data)
    meta["refined"]["affine4"]["file"] = name
    meta["manifest"] = {(name if k == old else k): v for k, v in meta["manifest"].items()}
    _reseal(path, meta)
    return name


def test_the_refined_fixture_reads_and_loads(refined_anchor):
    a = read_anchor(refined_anchor)
    assert set(a.learned_scales) == {"affine4"} and a.learned_scales["affine4"].group_size == 32
    mfqat.load_anchor(refined_anchor, "affine4", group_size=32)


@pytest.mark.parametrize("group", [0, -32, 16, 48, True, 32.0, "32", None])
def test_a_refined_width_with_a_bad_group_size_is_refused_naming_the_field(refined_anchor, tmp_path, group):
    path = _copy(refined_anchor, tmp_path)
    meta = json.loads((path / "mfqat.json").read_text())
    meta["refined"]["affine4"]["group_size"] = group
    _reseal(path, meta)
    with pytest.raises(AnchorError, match=r"mfqat\.json: field 'refined\.affine4"):
        read_anchor(path)


@pytest.mark.parametrize("fmt", ["mxint4", "affine9", "nvfp4"])
def test_a_refined_width_that_is_not_affine_is_refused_naming_it(refined_anchor, tmp_path, fmt):
    path = _copy(refined_anchor, tmp_path)
    meta = json.loads((path / "mfqat.json").read_text())
    meta["refined"][fmt] = meta["refined"].pop("affine4")
    _reseal(path, meta)
    with pytest.raises(AnchorError, match=f"field 'refined': '{fmt}' is not an affine width"):
        read_anchor(path)


@pytest.mark.parametrize("value,part", [(NAN, "scales"), (INF, "scales"), (-INF, "biases"), (NAN, "biases")])
def test_a_refined_file_holding_nan_or_inf_is_refused_naming_file_and_tensor(refined_anchor, tmp_path, value, part):
    path = _copy(refined_anchor, tmp_path)
    meta = json.loads((path / "mfqat.json").read_text())
    name = meta["refined"]["affine4"]["file"]
    raw = load_file(str(path / name))
    key = sorted(k for k in raw if k.endswith(f".{part}"))[0]
    raw[key] = raw[key].clone()
    raw[key].view(-1)[3] = value
    name = _rewrite_refined(path, meta, raw)
    with pytest.raises(AnchorError, match=f"{name}: {key}: learned scales and biases are finite bfloat16 values"):
        read_anchor(path)


def test_a_refined_file_of_another_dtype_is_refused_naming_it(refined_anchor, tmp_path):
    path = _copy(refined_anchor, tmp_path)
    meta = json.loads((path / "mfqat.json").read_text())
    name = meta["refined"]["affine4"]["file"]
    raw = {k: v.float() for k, v in load_file(str(path / name)).items()}
    name = _rewrite_refined(path, meta, raw)
    with pytest.raises(AnchorError, match=f"{name}: .*finite bfloat16 values, got torch.float32"):
        read_anchor(path)


def test_a_refined_width_in_an_older_format_version_or_outside_the_manifest_is_refused(refined_anchor, tmp_path):
    path = _copy(refined_anchor, tmp_path)
    meta = json.loads((path / "mfqat.json").read_text())
    meta["format_version"] = 3
    _reseal(path, meta)
    with pytest.raises(AnchorError, match="field 'refined' needs format version 4, the file says 3"):
        read_anchor(path)


# --- export: recipes, budgets, group sizes, scale dtypes ------------------------------------------------

@pytest.fixture(scope="module")
def read(untied_anchor):
    return read_anchor(untied_anchor)


@pytest.mark.parametrize("recipe,match", [
    ("bogus", "unknown recipe 'bogus'"), ("auto:", "unknown recipe 'auto:'"), ("uniform:", "unknown recipe 'uniform:'"),
    ("uniform:mxint9", "unknown format 'mxint9'"), ("auto:abc", "recipe 'auto:abc': write the budget in bits per weight"),
    ("auto:-1", r"recipe 'auto:-1': the budget is below the smallest plan: \d\.\d+ stored bits/weight"),
    ("auto:0", r"recipe 'auto:0': the budget is below"), ("auto:4.4", r"recipe 'auto:4.4': the budget is below"), ("auto:4.5:nvfp4", "recipe 'auto:4.5:nvfp4': nvfp4 has one width"),
    ("seed:mxfp", "recipe 'seed:mxfp' asks for the mxfp family but the anchor is mxint8"),
    ("uniform:mxfp4", "recipe 'uniform:mxfp4' asks for the mxfp family but the anchor is mxint8"),
])
def test_a_bad_recipe_or_budget_is_refused_naming_it(read, recipe, match):
    from mfqat.export.recipes import build_plan

    with pytest.raises(ValueError, match=match):
        build_plan(read, recipe)


@pytest.mark.parametrize("recipe", ["auto:nan", "auto:inf", "auto:1e400", "auto:-inf"])
def test_a_non_finite_budget_is_refused_naming_the_recipe(read, recipe):
    from mfqat.export.recipes import build_plan

    with pytest.raises(ValueError, match=f"recipe '{recipe}'.*finite"):
        build_plan(read, recipe)


@pytest.mark.parametrize("bits", [0, 1, 9, -4, 4.5, True])
def test_seed_base_bits_outside_2_to_8_are_refused_by_the_api(read, bits):
    from mfqat.export.recipes import build_plan

    with pytest.raises(ValueError, match="base_bits"):
        build_plan(read, "seed", base_bits=bits)


@pytest.mark.parametrize("group", [0, -64, 16, 48, 256])
def test_an_export_group_size_outside_mlx_affine_sizes_is_refused(read, group):
    from mfqat.export.recipes import build_plan

    with pytest.raises(ValueError, match=rf"^model\.layers\.0\.self_attn\.q_proj\.weight: .*[ =]{group}\b"):
        build_plan(read, "uniform:affine4", derived_group=group)


def test_an_anchor_block_size_mlx_cannot_store_is_refused_naming_the_tensor():
    from mfqat.export.mlx_sizes import check_mlx_group_size

    for bs, mode in ((16, "affine"), (48, "affine"), (64, "mxfp4"), (0, "mxfp8"), (32, "nvfp4")):
        with pytest.raises(ValueError, match=f"w.weight: the anchor's block size {bs} cannot be exported"):
            check_mlx_group_size(bs, [("w.weight", (mode, 4))])
    assert check_mlx_group_size(32, [("w.weight", ("affine", 4)), ("b", None)]) == 32


@pytest.mark.parametrize("dtype", ["float16", "fp32", "", None])
def test_an_unknown_scale_dtype_is_refused_naming_it(dtype):
    from mfqat.export.mlx_sizes import resolve_scale_dtype

    with pytest.raises(ValueError, match=f"scale_dtype '{dtype}': choose one of"):
        resolve_scale_dtype(dtype, {})


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_budget_check_takes_a_lazy_anchors_auto_scale_dtype_from_its_headers(tmp_path, monkeypatch, dtype):
    """check_stored_budget (the command line's check before an export) works from names and shapes; with no dtype
    in config.json the auto scale dtype comes from the weights' dtype, which a lazily read anchor gives from its
    safetensors headers: the same answer as the weights themselves, no tensor read."""
    from mfqat.export.recipes import check_stored_budget
    from mfqat.storage.tensor_files import TensorFile

    path = mfqat.save_anchor(tiny_llama().to(getattr(torch, dtype)), tmp_path / "a", "mxint8")

    def refusal(anchor, scale_dtype="auto") -> str:
        anchor.config = {k: v for k, v in anchor.config.items() if k not in ("dtype", "torch_dtype")}
        with pytest.raises(ValueError, match="recipe 'auto:1'") as e:
            check_stored_budget(anchor, "auto:1", scale_dtype=scale_dtype)
        return str(e.value)

    whole = read_anchor(path)
    assert {k: v.dtype for k, v in whole.plain.items()} == {k: getattr(torch, dtype) for k in whole.plain}
    explicit = {d: refusal(whole, d) for d in ("bfloat16", "float32")}
    assert explicit["bfloat16"] != explicit["float32"], "the smallest budget does not depend on the scale dtype"
    assert refusal(whole) == explicit[dtype]
    lazy = read_anchor(path, lazy=True)
    monkeypatch.setattr(TensorFile, "read", lambda self, name: pytest.fail(f"{name} was read"))
    assert refusal(lazy) == explicit[dtype]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_an_export_from_a_folder_without_a_dtype_in_its_config_reads_each_tensor_once(tmp_path, monkeypatch, dtype):
    """The auto scale dtype of an HF folder whose config.json names no dtype is the weights' (bfloat16 scales for
    a bfloat16 model, float32 for a float32 one), from the headers: the export reads each tensor once, the
    embedding included (it was read a second time just to look at its dtype)."""
    from collections import Counter

    from mfqat.export import to_mlx
    from mfqat.storage.tensor_files import TensorFile

    src, tok = tmp_path / "src", tiny_tokenizer()
    tiny_llama(vocab_size=len(tok), tie=True).to(getattr(torch, dtype)).save_pretrained(src)
    tok.save_pretrained(src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k not in ("dtype", "torch_dtype")}))
    reads, read = Counter(), TensorFile.read
    monkeypatch.setattr(TensorFile, "read", lambda self, name: reads.update([name]) or read(self, name))
    rep = to_mlx(src, tmp_path / "out", recipe="uniform:mxint4", verify=False)
    assert rep["scale_dtype"] == dtype
    assert reads["model.embed_tokens.weight"] == 1 and set(reads.values()) == {1}, reads


# --- a PEFT adapter converted for mlx-lm: only what mlx-lm's plain LoRA layer computes ------------------

def _peft_adapter(folder, **config):
    """A PEFT LoRA adapter folder as peft's save_pretrained writes it (rank 2, alpha 4, q_proj of block 0)."""
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4,
                                                            "lora_dropout": 0.0, **config}))
    g = torch.Generator().manual_seed(0)
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(2, 64, generator=g),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(64, 2, generator=g)},
              str(folder / "adapter_model.safetensors"))
    return folder


SAFE_PEFT = {"use_dora": False, "use_rslora": False, "fan_in_fan_out": False, "rank_pattern": {}, "alpha_pattern": {},
             "modules_to_save": None, "bias": "none", "lora_bias": False, "use_qalora": False,
             "layer_replication": None, "target_parameters": None}


def test_a_plain_peft_lora_adapter_converts_with_scale_alpha_over_r(tmp_path):
    from mfqat.mxqlora.mlx_adapter import peft_to_mlx

    out = peft_to_mlx(_peft_adapter(tmp_path / "peft", **SAFE_PEFT), tmp_path / "mlx")
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["lora_parameters"]["scale"] == 2.0 and cfg["lora_parameters"]["keys"] == ["self_attn.q_proj"]
    w = load_file(str(out / "adapters.safetensors"))
    assert w["model.layers.0.self_attn.q_proj.lora_a"].shape == (64, 2)


@pytest.mark.parametrize("key,value", [("use_rslora", True), ("use_dora", True), ("fan_in_fan_out", True),
                                       ("rank_pattern", {"q_proj": 4}), ("alpha_pattern", {"q_proj": 8}),
                                       ("modules_to_save", ["lm_head"]), ("bias", "all"), ("lora_bias", True),
                                       ("use_qalora", True), ("layer_replication", [[0, 1]]),
                                       ("target_parameters", ["mlp.experts.gate_up_proj"])])
def test_a_peft_variant_mlx_lm_cannot_compute_is_refused_naming_the_option(tmp_path, key, value):
    """rsLoRA scales by alpha / sqrt(r), DoRA rescales the weight's norm, fan-in-fan-out stores the matrices
    transposed: converted as plain LoRA each would run with the wrong scale or layout, so each is refused."""
    from mfqat.mxqlora.mlx_adapter import peft_to_mlx

    src = _peft_adapter(tmp_path / "peft", **{**SAFE_PEFT, key: value})
    with pytest.raises(ValueError, match=re.escape(f"adapter_config.json: {key}={value!r} has no mlx-lm LoRA equivalent")):
        peft_to_mlx(src, tmp_path / "mlx")
    assert not (tmp_path / "mlx").exists()


def test_a_peft_adapter_of_another_type_is_refused(tmp_path):
    from mfqat.mxqlora.mlx_adapter import peft_to_mlx

    with pytest.raises(ValueError, match="peft_type 'IA3'; only LoRA adapters convert"):
        peft_to_mlx(_peft_adapter(tmp_path / "peft", peft_type="IA3"), tmp_path / "mlx")
