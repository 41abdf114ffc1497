"""``--refine`` in bounded memory (issue 44): the same learned scales, KLs and bytes as the algorithm that held
the whole teacher and student in float32, with weights put in per module and decoder layers checkpointed."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mfqat
from mfqat.anchor.checkpoint import anchor_model, read_anchor
from mfqat.data.sources import calibration_blocks, tiny_llama
from mfqat.export import build_plan
from mfqat.export.refine import RefineConfig, refine
from mfqat.export.verify import reference_state
from mfqat.quant.mxtensor import MXTensor

from .conftest import growth_slope

SMALL = dict(steps=4, lr=3e-3, batch=2, seq_len=32, n_blocks=6, n_valid=2)


# The algorithm as it was before issue 44 (mfqat 0cc688a, mfqat/export/refine.py), kept here as the oracle:
# a float32 teacher and student model loaded whole, every tensor of the plan derived at once, float32 codes.

def _ste_bf16(x):
    return x + (x.to(torch.bfloat16).float() - x).detach()


class _OldGroups(nn.Module):
    def __init__(self, q):
        super().__init__()
        self.q = q
        self.codes = q.codes.float().reshape(*q.shape[:-1], q.shape[-1] // q.block_size, q.block_size)
        self.s0, self.b0 = q.scales.float(), q.biases.float()
        self.a = nn.Parameter(torch.zeros_like(self.s0))
        self.c = nn.Parameter(torch.zeros_like(self.s0))

    def scales_biases(self, straight_through=True):
        s, b = self.s0 * (1 + self.a), self.b0 + self.s0 * self.c
        if straight_through:
            return _ste_bf16(s), _ste_bf16(b)
        return s.detach().to(torch.bfloat16).float(), b.detach().to(torch.bfloat16).float()

    def weight(self):
        s, b = self.scales_biases()
        return (self.codes * s.unsqueeze(-1) + b.unsqueeze(-1)).reshape(self.q.shape)

    def learned(self):
        s, b = self.scales_biases(straight_through=False)
        q = self.q
        return MXTensor(q.codes, s, q.fmt, q.block_size, q.dtype, b, q.scale_rule)


def _old_kl(student, teacher, t):
    log_s = F.log_softmax(student.float() / t, dim=-1)
    log_t = F.log_softmax(teacher.float() / t, dim=-1)
    return (log_t.exp() * (log_t - log_s)).sum(-1).mean() * t * t


def old_refine(anchor, plan, calib, cfg):
    targets = {n: q for n, q in plan.tensors(anchor).items() if q.fmt.family == "affine"}
    train, valid = calib[: cfg.n_blocks], calib[cfg.n_blocks: cfg.n_blocks + cfg.n_valid]
    teacher = anchor_model(anchor)
    student = anchor_model(anchor)
    student.load_state_dict(reference_state(anchor, plan), strict=False)
    student.tie_weights()
    for p in list(teacher.parameters()) + list(student.parameters()):
        p.requires_grad_(False)
    groups = {n: _OldGroups(q) for n, q in targets.items()}

    def logits(ids):
        weights = {n: g.weight() for n, g in groups.items()}
        return torch.func.functional_call(student, weights, (ids,), tie_weights=True).logits

    def valid_kl():
        with torch.no_grad():
            return float(sum(_old_kl(logits(ids[None]), teacher(ids[None]).logits, cfg.temperature) for ids in valid)
                         / len(valid))

    before = valid_kl()
    opt = torch.optim.Adam([p for g in groups.values() for p in (g.a, g.c)], lr=cfg.lr)
    gen = torch.Generator().manual_seed(cfg.seed)
    losses = []
    for _ in range(cfg.steps):
        ids = train[torch.randint(0, len(train), (cfg.batch,), generator=gen)]
        with torch.no_grad():
            target = teacher(ids).logits
        loss = _old_kl(logits(ids), target, cfg.temperature)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    after = valid_kl()
    return {"validation_kl_before": before, "validation_kl_after": after, "train_kl_first_last": [losses[0], losses[-1]],
            "learned": {n: g.learned() for n, g in groups.items()}}


def _anchor_only(plan, anchor):
    """The plan refine_anchor learns on: only the tensors the anchor holds quantized."""
    for name in [n for n in plan.formats if n not in anchor.quantized]:
        del plan.formats[name]
        plan.origin.pop(name, None)
    return plan


@pytest.fixture(scope="module")
def anchors(tok, tmp_path_factory):
    root = tmp_path_factory.mktemp("refine_memory")
    return {tie: mfqat.save_anchor(tiny_llama(vocab_size=len(tok), tie=tie, layers=3), root / f"tie{tie}", "mxint8", tok)
            for tie in (True, False)}


@pytest.mark.parametrize("tie,recipe,only_anchor,lazy", [(True, "uniform:affine4", False, True),
                                                          (False, "uniform:affine3", False, False),
                                                          (True, "uniform:affine3", True, True),
                                                          (False, "seed:affine", False, True)])
def test_refine_learns_bit_for_bit_what_the_whole_model_algorithm_learned(anchors, tok, tie, recipe, only_anchor, lazy):
    calib = calibration_blocks(tok, None, n_blocks=8, seq_len=32)
    cfg = RefineConfig(**SMALL)
    old_anchor = read_anchor(anchors[tie])
    old_plan = build_plan(old_anchor, recipe)
    old = old_refine(old_anchor, _anchor_only(old_plan, old_anchor) if only_anchor else old_plan, calib, cfg)
    new_anchor = read_anchor(anchors[tie], lazy=lazy)
    plan = build_plan(new_anchor, recipe)
    new = refine(new_anchor, _anchor_only(plan, new_anchor) if only_anchor else plan, calib, cfg)
    for k in ("validation_kl_before", "validation_kl_after", "train_kl_first_last"):
        assert new[k] == old[k], k
    kept = old["validation_kl_after"] < old["validation_kl_before"]
    assert new["kept"] == kept and new["tensors"] == len(old["learned"])
    assert sorted(plan.learned_scales) == (sorted(old["learned"]) if kept else [])
    for n, q in (old["learned"] if kept else {}).items():
        got = plan.tensor(new_anchor, n)  # the derived codes with the learned scales
        assert torch.equal(got.codes, q.codes) and torch.equal(got.scales, q.scales) and torch.equal(got.biases, q.biases), n


def test_a_weight_the_anchor_lacks_is_refused_not_left_on_the_meta_device(anchors):
    """A parameter left on the meta device is not an error in torch: a CPU forward computes garbage from it."""
    from mfqat.export.lazy_model import LazyModel
    from mfqat.storage.manifest import AnchorError

    a = read_anchor(anchors[False], lazy=True)
    del a.plain["model.norm.weight"]
    with pytest.raises(AnchorError, match=r"missing \['model.norm.weight'\]"):
        LazyModel(a)


MEMORY_PROBE = r"""
import json, sys, torch
import mlx.core, mlx_lm, transformers, mfqat.export
import psutil
from mfqat.anchor.checkpoint import read_anchor
from mfqat.export import build_plan
from mfqat.export.refine import RefineConfig, refine
def hwm():  # this process's own high-water mark (kB)
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1])
base = psutil.Process().memory_info().rss // 1024
anchor = read_anchor(sys.argv[1], lazy=True)
calib = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
r = refine(anchor, build_plan(anchor, "uniform:affine4"), calib,
           RefineConfig(steps=2, batch=1, seq_len=32, n_blocks=1, n_valid=1))
print(json.dumps({"base": base, "peak": hwm()}))
"""


def _refine_growth(tmp_path, layers: int) -> tuple:
    """(peak RSS growth of a child refining an mxint8 anchor of a Llama of ``layers`` layers, its bf16 bytes)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1536, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    bf16 = 2 * sum(p.numel() for p in model.parameters())
    path = mfqat.save_anchor(model, tmp_path / f"a{layers}", "mxint8")
    del model
    root = Path(__file__).resolve().parents[1]
    # glibc's heap keeps freed chunks under its mmap threshold, which rises with each freed chunk up to 32 MB: this
    # small model's weights (a few MB each, put in and freed module by module) would stay resident as freed heap
    # (a real model's are above 32 MB and always go back). A fixed threshold counts what is alive.
    env = {**os.environ, "PYTHONPATH": str(root), "MFQAT_PROGRESS": "0", "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(path)], capture_output=True, text=True, env=env,
                         check=True)
    rss = json.loads(out.stdout.strip().splitlines()[-1])
    return (rss["peak"] - rss["base"]) * 1024, bf16


@pytest.mark.slow
def test_refines_memory_grows_by_under_a_byte_and_a_half_per_bf16_byte_of_model(tmp_path):
    """The growth law of refine: peak RSS growth of a child process at 2 and 16 decoder layers of the same width,
    as extra bytes per extra bf16 byte of model (a ratio, never a time). Held: the affine4 codes (half a byte a
    weight) and each group's (a, c) with gradients and Adam's state (measured 0.73); the algorithm before issue 44
    (two float32 models, a float32 reference and float32 codes) grew by about 10; keeping float32 codes (2.74), or
    the float32 weights of every layer for backward (no checkpointing: 4.97), fails."""
    slope = growth_slope(lambda layers: _refine_growth(tmp_path, layers), 2, 16)
    assert slope < 1.5, f"refine's peak grows by {slope:.2f} bytes per bf16 byte of model"


@pytest.mark.parametrize("tie", [True, False])
def test_one_steps_gradients_equal_the_whole_models_bit_for_bit(anchors, tok, tie):
    """The float32 gradients of every (a, c) (the learned bfloat16 values can hide an ulp): one step's KL
    backward through the lazily filled, checkpointed model against the whole student of the old algorithm."""
    from mfqat.export.lazy_model import LazyModel
    from mfqat.export.lazy_model import anchor_source as _teacher_source
    from mfqat.export.refine import _Groups, _kl, _student_source

    a = read_anchor(anchors[tie], lazy=True)
    plan = build_plan(a, "uniform:affine4")
    ids = calibration_blocks(tok, None, n_blocks=2, seq_len=32)
    teacher = anchor_model(read_anchor(anchors[tie]))
    with torch.no_grad():
        target = teacher(ids).logits
    old = {n: _OldGroups(q) for n, q in plan.tensors(a).items()}
    student = anchor_model(read_anchor(anchors[tie]))
    student.load_state_dict(reference_state(a, plan), strict=False)
    student.tie_weights()
    weights = {n: g.weight() for n, g in old.items()}
    _old_kl(torch.func.functional_call(student, weights, (ids,), tie_weights=True).logits, target, 1.0).backward()
    new = {n: _Groups(plan.tensor(a, n)) for n in plan.formats}
    model = LazyModel(a)
    assert model.checkpointed
    _kl(model.logits(_student_source(a, plan, new, _teacher_source(a)), ids), target, 1.0).backward()
    for n in old:
        assert torch.equal(new[n].a.grad, old[n].a.grad) and torch.equal(new[n].c.grad, old[n].c.grad), n


@pytest.mark.parametrize("shape", [(5, 128), (2, 3, 64)])
def test_the_affine_weight_function_gives_autograds_values_and_gradients_in_row_chunks(shape, monkeypatch):
    """The refine weight W = q * s + b built by one autograd Function (it keeps the uint8 codes, not a float32
    copy) and its gradients reduced a few rows at a time (uneven last chunk, stacked experts): bit for bit what
    autograd gives for the plain expression."""
    import mfqat.export.refine as refine

    monkeypatch.setattr(refine, "_CHUNK_ELEMENTS", 300)  # 2 rows of 128 (4 of 64) a chunk
    gen = torch.Generator().manual_seed(0)
    bs = 32
    codes = torch.randint(0, 16, shape, generator=gen, dtype=torch.uint8)
    groups = shape[:-1] + (shape[-1] // bs,)
    s0, b0 = torch.randn(groups, generator=gen), torch.randn(groups, generator=gen)
    grad = torch.randn(shape, generator=gen)
    s1, b1 = s0.clone().requires_grad_(), b0.clone().requires_grad_()
    w1 = refine._AffineWeight.apply(codes, s1, b1, shape, bs)
    w1.backward(grad)
    s2, b2 = s0.clone().requires_grad_(), b0.clone().requires_grad_()
    w2 = (codes.float().reshape(*groups, bs) * s2.unsqueeze(-1) + b2.unsqueeze(-1)).reshape(shape)
    w2.backward(grad)
    assert torch.equal(w1, w2)
    assert torch.equal(s1.grad, s2.grad) and torch.equal(b1.grad, b2.grad)


@pytest.mark.parametrize("recipe", ["uniform:affine4", "uniform:affine3"])
def test_a_lean_embedding_and_head_learn_bit_for_bit_what_whole_matrices_learn(anchors, tok, recipe, monkeypatch):
    """The student's untied embedding and head are never built whole (rows looked up, the head's gradient in row
    chunks) whatever their size: the same KLs and learned scales as the whole-model oracle, bit for bit."""
    from mfqat.export import lean_matrices

    monkeypatch.setattr(lean_matrices, "_ROWS_ELEMENTS", 4096)  # several row chunks of the head's gradient
    calib = calibration_blocks(tok, None, n_blocks=8, seq_len=32)
    cfg = RefineConfig(**SMALL)
    old_anchor = read_anchor(anchors[False])
    old = old_refine(old_anchor, build_plan(old_anchor, recipe), calib, cfg)
    anchor = read_anchor(anchors[False], lazy=True)
    plan = build_plan(anchor, recipe)
    calls = []
    monkeypatch.setattr(lean_matrices._Head, "backward", _counted(lean_matrices._Head.backward, calls))
    new = refine(anchor, plan, calib, cfg)
    assert calls, "the lean head was not used"
    for k in ("validation_kl_before", "validation_kl_after", "train_kl_first_last"):
        assert new[k] == old[k], k
    for n, q in old["learned"].items():
        got = plan.tensor(anchor, n)
        assert torch.equal(got.scales, q.scales) and torch.equal(got.biases, q.biases), n


def test_a_lean_tied_matrix_learns_what_the_whole_one_learns_to_rounding(anchors, tok, monkeypatch):
    """A tied embedding and head (one matrix): the two uses' gradients are reduced to the groups separately, so
    the result equals the whole-matrix one up to float32 rounding."""
    from mfqat.export import lean_matrices

    calib = calibration_blocks(tok, None, n_blocks=8, seq_len=32)
    cfg = RefineConfig(**SMALL)
    calls = []
    monkeypatch.setattr(lean_matrices._Rows, "backward", _counted(lean_matrices._Rows.backward, calls))
    whole_anchor = read_anchor(anchors[True], lazy=True)
    whole = refine(whole_anchor, build_plan(whole_anchor, "uniform:affine4"), calib, cfg)
    monkeypatch.setattr(lean_matrices, "LEAN_MATRIX_BYTES", 0)
    anchor = read_anchor(anchors[True], lazy=True)
    plan = build_plan(anchor, "uniform:affine4")
    assert not calls, "a small tied matrix went lean"
    lean = refine(anchor, plan, calib, cfg)
    assert calls, "the lean embedding was not used"
    assert lean["validation_kl_after"] == pytest.approx(whole["validation_kl_after"], rel=1e-4)
    assert lean["validation_kl_before"] == whole["validation_kl_before"]


def _counted(fn, calls):
    def run(*args):
        calls.append(1)
        return fn(*args)
    return staticmethod(run)


def test_codes_waiting_on_disk_give_the_same_refine_bit_for_bit(anchors, tok, tmp_path, monkeypatch):
    """RefineConfig.spill_dir (what export-mlx passes: its staging folder): every learner's codes go to one file
    and are read back as asked; the same KLs and learned scales, and the file is gone afterwards."""
    import dataclasses

    from mfqat.export import code_spill

    calib = calibration_blocks(tok, None, n_blocks=8, seq_len=32)
    cfg = RefineConfig(**SMALL)
    results = []
    for spill_dir in (None, tmp_path / "spill"):
        anchor = read_anchor(anchors[False], lazy=True)
        plan = build_plan(anchor, "uniform:affine3")
        if spill_dir is not None:
            spill_dir.mkdir()
        results.append((refine(anchor, plan, calib, dataclasses.replace(cfg, spill_dir=spill_dir)),
                        {n: plan.tensor(anchor, n) for n in plan.learned_scales}))
    reads = []
    monkeypatch.setattr(code_spill.SpilledCodes, "get", _counted_method(code_spill.SpilledCodes.get, reads))
    (held, held_tensors), (spilled, spilled_tensors) = results
    for k in ("validation_kl_before", "validation_kl_after", "train_kl_first_last", "kept"):
        assert spilled[k] == held[k], k
    assert held["kept"] and sorted(spilled_tensors) == sorted(held_tensors)
    for n, q in held_tensors.items():
        assert torch.equal(spilled_tensors[n].scales, q.scales) and torch.equal(spilled_tensors[n].biases, q.biases)
    assert list((tmp_path / "spill").iterdir()) == []
    anchor = read_anchor(anchors[False], lazy=True)
    plan = build_plan(anchor, "uniform:affine3")
    (tmp_path / "spill2").mkdir()
    refine(anchor, plan, calib, dataclasses.replace(cfg, steps=1, spill_dir=tmp_path / "spill2"))
    assert reads, "the codes were not read back from the spill file"


def test_mfqat_refine_leaves_nothing_beside_the_anchor(anchors, tmp_path, monkeypatch):
    """mfqat refine spills the codes to a temporary folder beside the anchor (never inside the user's anchor) and
    removes it."""
    import shutil

    from mfqat.export import code_spill
    from mfqat.export.refine import refine_anchor

    folders = []
    real = code_spill.CodeSpill.__init__

    def spy(self, folder):
        folders.append(folder)
        real(self, folder)
    monkeypatch.setattr(code_spill.CodeSpill, "__init__", spy)
    path = tmp_path / "anchor"
    shutil.copytree(anchors[False], path)
    refine_anchor(path, ["affine4"], cfg=RefineConfig(**{**SMALL, "steps": 1}))
    assert len(folders) == 1 and folders[0].parent == tmp_path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["anchor"]


def _counted_method(fn, calls):
    def run(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)
    return run
