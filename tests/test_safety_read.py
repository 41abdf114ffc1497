"""Issue 13, reading what was not written: manifest, validation, confinement, fuzzed metadata."""
import json
import struct
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import mfqat
from mfqat.anchor.checkpoint import AnchorError, read_anchor
from mfqat.cli import main as cli_main
from mfqat.data.sources import tiny_llama
from mfqat.storage.manifest import canonical_digest, seal


@pytest.fixture
def copy(untied_anchor, tmp_path):
    import shutil

    return shutil.copytree(untied_anchor, tmp_path / "a")


def meta_of(path):
    return json.loads((path / "mfqat.json").read_text())


def write_meta(path, meta, reseal=True):
    """Edit mfqat.json as a user would; reseal: also recompute the hashes and the digest."""
    if reseal and isinstance(meta, dict):
        seal(meta, path)
        if isinstance(meta.get("files"), dict):
            meta["files"] = {n: meta["manifest"].get(n, d) for n, d in meta["files"].items()}
        meta["digest"] = canonical_digest(meta)
    (path / "mfqat.json").write_text(json.dumps(meta))


def test_edited_metadata_config_and_tokenizer_are_refused(copy):
    meta = meta_of(copy)
    name = next(iter(meta["tensors"]))
    meta["tensors"][name]["format"] = "mxfp8_e4m3"
    write_meta(copy, meta, reseal=False)
    with pytest.raises(AnchorError, match="mfqat.json.*digest"):
        read_anchor(copy)
    write_meta(copy, meta)  # a deliberate edit with a fresh digest: still not an mxint8 tensor
    with pytest.raises(AnchorError, match=f"mfqat.json.*tensors.{name}.format"):
        read_anchor(copy)
    meta["tensors"][name]["format"] = "mxint8"
    write_meta(copy, meta)
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**cfg, "rope_theta": 1.0}))
    with pytest.raises(AnchorError, match="config.json: sha256 mismatch"):
        mfqat.load_anchor(copy)
    write_meta(copy, meta)
    (copy / "tokenizer.json").write_text((copy / "tokenizer.json").read_text().replace("<eos>", "<EOS>"))
    with pytest.raises(AnchorError, match="tokenizer.json: sha256 mismatch"):
        read_anchor(copy)
    with pytest.raises(SystemExit, match="tokenizer.json"):
        cli_main(["verify", str(copy)])


def test_codes_and_scales_dtypes_are_checked(copy):
    sd = load_file(str(copy / "model.safetensors"))
    name = next(k for k in sd if k.endswith(".codes"))
    sd[name] = sd[name].to(torch.int16)
    save_file(sd, str(copy / "model.safetensors"), metadata={"format": "pt"})
    write_meta(copy, meta_of(copy))
    with pytest.raises(AnchorError, match=f"model.safetensors.*{name}.*uint8"):
        read_anchor(copy)


def test_paths_are_confined_to_the_anchor(copy, tmp_path):
    (tmp_path / "outside.safetensors").write_bytes((copy / "model.safetensors").read_bytes())
    original = meta_of(copy)
    for bad in ("../outside.safetensors", str(tmp_path / "outside.safetensors")):
        meta = json.loads(json.dumps(original))
        meta["files"] = {bad: meta["files"]["model.safetensors"]}
        write_meta(copy, meta)
        with pytest.raises(AnchorError, match="files.*outside the anchor"):
            read_anchor(copy)


@pytest.mark.parametrize("field,value,why", [
    ("format_version", 0, "format_version"), ("format_version", -1, "format_version"),
    ("format_version", "1", "format_version.*integer"), ("block_size", 0, "block_size"),
    ("block_size", "32", "block_size"), ("files", None, "files"), ("scale_rule", "round", "scale_rule"),
    ("scale_rules", {"mxint4": "round"}, "scale_rules.*unknown scale rule"),
    ("scale_rules", {"nf4": "ceil"}, "scale_rules.*not an MX format"), ("scale_rules", [], "scale_rules.*mapping"),
])
def test_malformed_fields_name_file_and_field(copy, field, value, why):
    meta = meta_of(copy)
    if value is None:
        del meta[field]
    else:
        meta[field] = value
    write_meta(copy, meta)
    with pytest.raises(AnchorError, match=f"mfqat.json.*{why}"):
        read_anchor(copy)


def test_malformed_tensor_entries_and_non_objects(copy):
    original = meta_of(copy)
    name = next(iter(original["tensors"]))
    for key, value in (("shape", []), ("dtype", "complex512"), ("shape", [64, 0])):
        meta = json.loads(json.dumps(original))
        meta["tensors"][name][key] = value
        write_meta(copy, meta)
        with pytest.raises(AnchorError, match=f"mfqat.json.*tensors.{name}.{key}"):
            read_anchor(copy)
    (copy / "mfqat.json").write_text("[1, 2]")
    with pytest.raises(AnchorError, match="mfqat.json.*JSON object"):
        read_anchor(copy)


def test_version_1_anchors_still_load(copy):
    meta = meta_of(copy)
    for k in ("manifest", "digest", "full_precision"):
        meta.pop(k, None)
    meta["format_version"] = 1
    (copy / "mfqat.json").write_text(json.dumps(meta))
    assert read_anchor(copy).meta["format_version"] == 1
    mfqat.load_anchor(copy, "mxint4")


FIELDS = ["format_version", "anchor_format", "block_size", "scale_rule", "tensors", "tied", "files", "step"]
JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False, allow_infinity=False) |
                    st.text(max_size=12), lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                    max_leaves=6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(FIELDS), value=JSON, inner=st.booleans(), i=st.integers(0, 99), j=st.integers(0, 9))
def test_fuzzed_metadata_only_raises_anchor_error(untied_anchor, tmp_path_factory, field, value, inner, i, j):
    import shutil

    copy = shutil.copytree(untied_anchor, tmp_path_factory.mktemp("fz") / "a")
    meta = meta_of(copy)
    if inner and isinstance(meta.get(field), dict) and meta[field]:
        key = sorted(meta[field])[i % len(meta[field])]
        if isinstance(meta[field][key], dict) and meta[field][key]:
            inner_keys = sorted(meta[field][key])
            meta[field][key][inner_keys[j % len(inner_keys)]] = value
        else:
            meta[field][key] = value
    else:
        meta[field] = value
    write_meta(copy, meta)
    try:
        read_anchor(copy)
    except AnchorError:
        pass


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_safetensors_header_only_raises_anchor_error(untied_anchor, tmp_path_factory, data):
    import shutil

    path = shutil.copytree(untied_anchor, tmp_path_factory.mktemp("fz") / "a")
    raw = bytearray((path / "model.safetensors").read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, 8 + n - 1))
        raw[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    (path / "model.safetensors").write_bytes(bytes(raw))
    write_meta(path, meta_of(path))
    try:
        read_anchor(path)
    except AnchorError:
        pass


def test_layers_left_full_precision_are_named(tmp_path):
    model = tiny_llama(intermediate=80)  # down_proj: in_features 80, not a multiple of 32
    with pytest.warns(UserWarning, match="model.layers.0.mlp.down_proj"):
        path = mfqat.save_anchor(model, tmp_path / "a")
    fp = meta_of(path)["full_precision"]
    assert "model.layers.1.mlp.down_proj.weight" in fp and "not a multiple of 32" in fp["model.layers.1.mlp.down_proj.weight"]
    with pytest.warns(UserWarning, match="down_proj.*full precision"):
        mfqat.load_anchor(path, "mxint2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mfqat.load_anchor(path)  # its own format: nothing to say
