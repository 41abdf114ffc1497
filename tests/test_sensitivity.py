"""auto:BPW sensitivity: the measured KL of one tensor equals a brute-force KL computed by
lowering only that tensor by hand (Slice-and-Scale of the anchor) and comparing the logits."""
import pytest
import torch

import mfqat
from mfqat.data.sources import tiny_llama
from mfqat.export.sensitivity import ladder, measure


@pytest.fixture(scope="module")
def anchor(tmp_path_factory):
    model = tiny_llama(vocab_size=256)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # peaked distributions: KLs well above float noise
    path = mfqat.save_anchor(model, tmp_path_factory.mktemp("sens") / "a", "mxint8")
    return mfqat.read_anchor(path)


def brute_force_kl(anchor, name: str, probe: str, blocks: torch.Tensor) -> float:
    model = mfqat.load_anchor(anchor.path)  # every tensor in the anchor's format
    with torch.no_grad():
        ref = torch.log_softmax(model(input_ids=blocks).logits.double(), -1)
        param = dict(model.named_parameters())[name]
        param.copy_(mfqat.slice_and_scale(anchor.quantized[name], probe).dequantize(torch.float32))
        low = torch.log_softmax(model(input_ids=blocks).logits.double(), -1)
    return (ref.exp() * (ref - low)).sum(-1).mean().item()


@pytest.mark.parametrize("probe", ["mxint2", "mxint4"])
def test_measured_kl_equals_brute_force(anchor, probe):
    names = ["model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.weight"]
    blocks = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    sens = measure(anchor, names, probe, blocks)
    for name in names:
        want = brute_force_kl(anchor, name, probe, blocks)
        assert want > 1e-6, name
        assert sens[name].probe_kl == pytest.approx(want, rel=1e-3, abs=5e-8), name  # float32 noise ~2e-8
        # relative weight error of the probe level, also by hand
        w8 = anchor.quantized[name].dequantize(torch.float32)
        wp = mfqat.slice_and_scale(anchor.quantized[name], probe).dequantize(torch.float32)
        assert sens[name].rel_error[probe] == pytest.approx(((wp - w8) ** 2).sum().item() / (w8 ** 2).sum().item(),
                                                             rel=1e-6)
        assert sens[name].rel_error["mxint8"] == 0.0 and set(sens[name].rel_error) == set(ladder("mxint8"))
    # lowering q_proj in layer 1 and down_proj in layer 0 does not cost the same
    assert sens[names[0]].probe_kl != pytest.approx(sens[names[1]].probe_kl, rel=1e-2)


# The fast pass (issue 34): a probe replays the decoder layers before its tensor's layer from the
# reference forward (mfqat.export.replay); its scores must be those of the plain full-forward pass.
FAMILIES = {  # tiny configs as in tests/test_families.py
    "llama": None,  # tiny_llama: untied lm_head, so the head-only replay is exercised
    "gemma3_text": ("gemma3_text", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=128,
                                        layer_types=["sliding_attention", "full_attention"])),  # tied embeddings
    "qwen3_5_moe": ("qwen3_5_moe_text", dict(  # hybrid linear/full attention with MoE experts
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"])),
}


def _family_anchor(name: str, path):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    if FAMILIES[name] is None:
        model = tiny_llama(vocab_size=256)
    else:
        model_type, extra = FAMILIES[name]
        kw = {**dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=128, vocab_size=256), **extra}
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20)  # peaked distributions: KLs well above float noise
    return mfqat.read_anchor(mfqat.save_anchor(model, path, "mxint8"))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_replayed_pass_scores_equal_the_plain_pass(family, tmp_path):
    from mfqat.export.recipes import _matrix_weights

    anchor = _family_anchor(family, tmp_path / "a")
    names = list(anchor.quantized) + _matrix_weights(anchor)
    blocks = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    plain = measure(anchor, names, "mxint3", blocks, replay=False)
    fast = measure(anchor, names, "mxint3", blocks)
    assert list(fast) == names
    for name in names:
        assert plain[name].probe_kl > 1e-7, name  # every probe moves the output: a skipped one would show
        assert fast[name].probe_kl == plain[name].probe_kl, name  # the same logits, bit for bit
        assert fast[name].rel_error == plain[name].rel_error


def test_start_layers_follow_the_layer_and_the_tied_embedding(tmp_path):
    from mfqat.export.replay import start_layers

    llama = mfqat.load_anchor(_family_anchor("llama", tmp_path / "l").path)
    start = start_layers(llama, ["model.layers.1.mlp.up_proj.weight", "lm_head.weight", "model.embed_tokens.weight"])
    assert start == {"model.layers.1.mlp.up_proj.weight": 1, "lm_head.weight": 2, "model.embed_tokens.weight": 0}
    gemma = mfqat.load_anchor(_family_anchor("gemma3_text", tmp_path / "g").path)
    assert gemma.get_output_embeddings().weight is gemma.get_input_embeddings().weight
    assert start_layers(gemma, ["model.embed_tokens.weight"]) == {"model.embed_tokens.weight": 0}


class _InPlaceLayer(torch.nn.Module):
    """A residual layer that adds to its input in place (as some implementations do)."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)

    def forward(self, x):
        return x.add_(torch.tanh(self.lin(x)))


class _InPlaceModel(torch.nn.Module):
    def __init__(self, width: int = 8, n_layers: int = 3):
        super().__init__()
        self.emb = torch.nn.Embedding(16, width)
        self.layers = torch.nn.ModuleList(_InPlaceLayer(width) for _ in range(n_layers))

    def forward(self, input_ids):
        from types import SimpleNamespace

        x = self.emb(input_ids)
        for layer in self.layers:
            x = layer(x)
        return SimpleNamespace(logits=x)


def test_replay_from_every_layer_equals_the_full_forward_when_layers_write_in_place():
    from mfqat.export.replay import LayerReplay

    torch.manual_seed(0)
    model, ids = _InPlaceModel(), torch.arange(6).view(1, 6)
    with torch.no_grad():
        full = model(input_ids=ids).logits
        replay = LayerReplay(model)
        assert torch.equal(replay.record(input_ids=ids), full)
        for _ in range(2):  # a replay must not change what later replays start from
            for start in range(len(model.layers) + 1):
                assert torch.equal(replay.logits_from(start, input_ids=ids), full), start
        assert all("forward" not in layer.__dict__ for layer in model.layers)  # the layers are restored


def _loaded_pass(anchor, names, probe, blocks):
    """The pass on the model loaded whole (what measure ran before it read weights lazily): each tensor swapped
    in place for its probe value, a full forward, the KL; the oracle of the lazy pass."""
    from mfqat.anchor.checkpoint import anchor_model
    from mfqat.export.sensitivity import in_format

    model = anchor_model(anchor)
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        ref = torch.log_softmax(model(input_ids=blocks).logits.float(), dim=-1)
        out = {}
        for name in names:
            original = params[name].data.clone()
            params[name].data.copy_(in_format(anchor, name, probe).dequantize(torch.float32))
            low = torch.log_softmax(model(input_ids=blocks).logits.float(), dim=-1)
            params[name].data.copy_(original)
            out[name] = max((ref.exp() * (ref - low)).sum(-1).mean().item(), 0.0)
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_lazily_run_pass_scores_equal_the_model_loaded_whole(family, tmp_path):
    """Issue 44: the sensitivity pass reads each module's weights from the anchor as it runs (never the whole
    model); every probe's KL is the one of the model loaded whole, bit for bit, tied embeddings and experts
    included, from an anchor read lazily."""
    from mfqat.export.recipes import _matrix_weights

    path = _family_anchor(family, tmp_path / "a").path
    anchor = mfqat.read_anchor(path, lazy=True)
    names = list(anchor.quantized) + _matrix_weights(anchor)
    blocks = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    want = _loaded_pass(mfqat.read_anchor(path), names, "mxint3", blocks)
    got = measure(anchor, names, "mxint3", blocks)
    assert {n: s.probe_kl for n, s in got.items()} == want


def test_large_matrices_measured_in_row_chunks_score_as_whole(anchor, monkeypatch):
    """A matrix over sensitivity.CHUNK_ELEMENTS (a 1B+ model's embedding and head) is measured a block of rows at a
    time: the same probe tensor (so the same KL, bit for bit) and the same relative errors up to the summation
    order, for plain and quantized tensors, MX and derived (affine) levels."""
    from mfqat.export import sensitivity

    names = ["model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.down_proj.weight"]
    levels = ["mxint3", "affine4", "affine6", "mxint8"]
    blocks = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    whole = measure(anchor, names, "affine4", blocks, levels=levels)
    monkeypatch.setattr(sensitivity, "CHUNK_ELEMENTS", 1000)
    monkeypatch.setattr(sensitivity, "ROWS_ELEMENTS", 64 * 7 + 3)  # 7 rows a chunk, an uneven last chunk
    for name in names:
        assert sensitivity._chunk_rows(anchor, name, levels, 64) is not None, f"{name} is not measured in chunks"
    chunked = measure(anchor, names, "affine4", blocks, levels=levels)
    for name in names:
        assert chunked[name].probe_kl == whole[name].probe_kl > 0, name
        assert chunked[name].numel == whole[name].numel, name
        assert chunked[name].rel_error == pytest.approx(whole[name].rel_error, rel=1e-5, abs=1e-12), name
        assert chunked[name].rel_error["mxint3"] > chunked[name].rel_error["affine6"] > 0, name


def test_a_matrix_with_stored_learned_scales_is_measured_whole(anchor, tmp_path, monkeypatch):
    """An anchor that stores learned scales for a derived width (mfqat refine) is measured with them: such a matrix
    is not cut into row chunks (the chunks would be derived without them), so its errors are the whole tensor's."""
    import shutil

    from mfqat.anchor.learned_scales_store import add_learned_scales
    from mfqat.export import sensitivity
    from mfqat.quant.derive import derive, derived_group

    path = tmp_path / "a"
    shutil.copytree(anchor.path, path)
    name = "model.layers.0.mlp.down_proj.weight"
    group = derived_group("affine4", 64)
    q = derive(anchor.quantized[name].dequantize(torch.float32), "affine4", group)
    learned = {name: type(q)(q.codes, q.scales * 1.25, q.fmt, q.block_size, q.dtype, q.biases)}
    add_learned_scales(path, "affine4", group, learned, {"steps": 0})
    stored = mfqat.read_anchor(path)
    levels = ["mxint3", "affine4", "mxint8"]
    blocks = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    whole = measure(stored, [name], "mxint3", blocks, levels=levels)
    monkeypatch.setattr(sensitivity, "CHUNK_ELEMENTS", 1000)
    monkeypatch.setattr(sensitivity, "ROWS_ELEMENTS", 64 * 7 + 3)
    assert sensitivity._chunk_rows(stored, name, levels, 64) is None
    assert sensitivity._chunk_rows(anchor, name, levels, 64) is not None  # without the stored width: in chunks
    got = measure(stored, [name], "mxint3", blocks, levels=levels)
    assert got[name].rel_error == whole[name].rel_error
    plain = measure(anchor, [name], "mxint3", blocks, levels=levels)
    assert plain[name].rel_error["affine4"] != pytest.approx(got[name].rel_error["affine4"], rel=1e-3)


def test_a_probe_outside_the_levels_is_refused(anchor):
    blocks = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="probe format mxint2 is not one of the levels mxint4, mxint8"):
        measure(anchor, ["lm_head.weight"], "mxint2", blocks, levels=["mxint4", "mxint8"])
