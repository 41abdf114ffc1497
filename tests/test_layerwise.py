"""The layer-major forward (mfqat.export.layerwise: ``--gptq``'s input moments, one layer's held at a time) hands
every nn.Linear exactly the inputs the whole model's forward hands it, bit for bit, batch by batch, in every family
mfqat supports (dense, MoE, hybrid attention, the vision-language release's text model), the output head included."""
from collections import defaultdict

import pytest
import torch
from torch import nn

import mfqat
from mfqat.anchor.checkpoint import anchor_model
from mfqat.export.layerwise import layer_stages
from mfqat.export.lazy_model import LazyModel, anchor_source
from mfqat.models.catalog import SUPPORTED, build


def _inputs_of(named_linears, run):
    """{name: [input of each call]} of the Linears while ``run()`` runs."""
    seen = defaultdict(list)
    hooks = [m.register_forward_hook(lambda _m, inp, _o, n=n: seen[n].append(inp[0].detach().clone()))
             for n, m in named_linears]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return seen


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_layer_by_layer_inputs_are_the_whole_forwards_in_every_family(name, tmp_path):
    model_type, extra = SUPPORTED[name]
    path = mfqat.save_anchor(build(model_type, extra, 256), tmp_path / "a", "mxint8")
    calib = torch.randint(0, 256, (5, 16), generator=torch.Generator().manual_seed(0))  # batches of 2, 2 and 1
    whole = anchor_model(mfqat.read_anchor(path))

    def forward_whole():
        with torch.no_grad():
            for i in range(0, 5, 2):
                whole(calib[i:i + 2], use_cache=False)
    want = _inputs_of([(n, m) for n, m in whole.named_modules() if isinstance(m, nn.Linear)], forward_whole)

    anchor = mfqat.read_anchor(path, lazy=True)
    got, stages = defaultdict(list), []
    for stage in layer_stages(LazyModel(anchor, checkpoint_layers=False), anchor_source(anchor), calib, batch_size=2):
        stages.append(stage.name)
        seen = _inputs_of([(n, m) for n, m in stage.modules if isinstance(m, nn.Linear)], stage.run)
        assert not set(seen) & set(got), f"{name}: {stage.name} runs Linears an earlier stage ran"
        got.update(seen)
    assert stages[-1] == "tail" and len(stages) > 2
    assert sorted(got) == sorted(want), f"{name}: Linears seen differ"
    for n in want:
        assert len(got[n]) == len(want[n]), f"{name}: {n} called {len(got[n])} times, not {len(want[n])}"
        for g, w in zip(got[n], want[n]):
            assert torch.equal(g, w), f"{name}: {n}: max diff {(g - w).abs().max().item()}"


def test_a_stage_must_run_before_the_next(tmp_path):
    model_type, extra = SUPPORTED[sorted(SUPPORTED)[0]]
    anchor = mfqat.read_anchor(mfqat.save_anchor(build(model_type, extra, 256), tmp_path / "a", "mxint8"), lazy=True)
    stages = layer_stages(LazyModel(anchor, checkpoint_layers=False), anchor_source(anchor), torch.zeros(2, 8).long())
    next(stages)
    with pytest.raises(RuntimeError, match="was not run"):
        next(stages)


def _tiny(tmp_path, tie=True):
    from mfqat.data.sources import tiny_llama

    torch.manual_seed(0)
    return mfqat.read_anchor(mfqat.save_anchor(tiny_llama(vocab_size=256, tie=tie), tmp_path / "a", "mxint8"), lazy=True)


def test_a_layers_weights_are_let_go_before_the_caller_works_on_its_stage(tmp_path, monkeypatch):
    """One layer's float32 weights at a time: when a stage has run, no tensor the source gave is still alive."""
    import gc
    import weakref

    from mfqat.export import gptq, lazy_model

    anchor = _tiny(tmp_path, tie=False)
    given = []
    plain = lazy_model.anchor_source

    def recording(a, *args, **kwargs):
        source = plain(a, *args, **kwargs)

        def get(name):
            t = source(name)
            given.append((name, weakref.ref(t)))
            return t
        return get
    monkeypatch.setattr(lazy_model, "anchor_source", recording)
    names = [n for n in anchor.quantized if n.endswith("proj.weight")] + ["lm_head.weight"]
    calib = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    stages = 0
    for moments in gptq.input_moments(anchor, calib, names, batch_size=2):
        stages += 1
        gc.collect()
        alive = [n for n, ref in given if ref() is not None]
        assert not alive, f"stage {stages}: still held: {sorted(set(alive))[:4]}"
        assert moments
    assert stages == anchor.config["num_hidden_layers"] + 1  # an untied head: the tail is measured too


def test_a_model_that_changes_the_hidden_state_between_layers_is_refused(tmp_path):
    anchor = _tiny(tmp_path)
    lazy = LazyModel(anchor, checkpoint_layers=False)
    layers = lazy.model.model.layers
    layers[1].register_forward_pre_hook(lambda _m, args: (args[0] * 1,) + tuple(args[1:]))
    with pytest.raises(ValueError, match="changes between decoder layers 0 and 1"):
        next(layer_stages(lazy, anchor_source(anchor), torch.zeros(2, 8).long()))


@pytest.mark.parametrize("tie", [True, False])
def test_after_hands_each_layer_the_inputs_of_the_model_on_those_weights(tmp_path, tie):
    from mfqat.models import layer_index

    def layer_of(name):
        i = layer_index(name)
        return None if i is None else f"model.layers.{i}"

    """GPTQ's sequential mode: with ``after``, stage i's first Linear sees what the whole model on the ``after`` weights
    hands layer i (the embedding included), and the head sees that model's last hidden state; without it, the
    anchor's (so the two differ: the test would catch ``after`` being ignored). ``after`` is asked lazily: a layer's
    new weights, set by the caller once its stage has run (as GPTQ sets its codes), are those the layer runs on."""
    anchor = _tiny(tmp_path, tie=tie)
    low, base = anchor_source(anchor, "mxint4"), anchor_source(anchor)
    final = lambda name: low(name) * (0.5 if "embed" in name else 1)  # noqa: E731  (the embedding is plain here)
    done = set()  # the layers whose new weights the caller has set
    after = lambda name: final(name) if layer_of(name) in done else base(name)  # noqa: E731
    calib = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))
    lazy = LazyModel(anchor, checkpoint_layers=False)
    firsts = [n for n, m in lazy.model.named_modules() if n.endswith("q_proj")] + ["lm_head"]

    def whole(source):
        linears = [(n, m) for n, m in lazy.model.named_modules() if n in firsts]

        def run():
            for i in range(0, 3, 2):
                lazy.logits(source, calib[i:i + 2])
        return _inputs_of(linears, run)

    def staged(**kw):
        got = {}
        for stage in layer_stages(lazy, anchor_source(anchor), calib, batch_size=2, **kw):
            got.update(_inputs_of([(n, m) for n, m in stage.modules if n in firsts], stage.run))
            done.add(stage.name)
        return got
    done.add(None)  # the embedding's, set up front
    want, plain = whole(final), whole(base)
    got, got_plain = staged(after=after), staged()
    assert sorted(got) == sorted(firsts)
    for n in firsts:
        for g, w, p, gp in zip(got[n], want[n], plain[n], got_plain[n]):
            assert torch.equal(g, w), f"{n}: max diff {(g - w).abs().max().item()} from the model on `after`"
            assert torch.equal(gp, p)
    assert not torch.equal(want["lm_head"][0], plain["lm_head"][0])  # mxint4 weights do change the inputs
