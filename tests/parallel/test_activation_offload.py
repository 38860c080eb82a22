"""Activation offloading (moevlm/parallel/offload.py) changes where saved activations live, never
the numbers.

(a) One process, the tiny model with two images and a dense layer, fp32 on the CPU (host-to-host
copies: every offloaded tensor comes back in a new storage): each scope alone, all of them, under
no recompute, selective recompute and full recompute: the loss and every gradient are bit-identical
to the same recompute setting without offload (`torch.equal`).
(b) Saved bytes per scope (`SavedBytes`, printed per scope with -s): the bytes still held on the
device fall by exactly the device storages offloaded that no other save holds, and where the offloaded share is known from the
shapes it is checked against them: `layer_input` offloads each layer's input (B,S,D) once (fp32:
the input norm saves h; under full recompute the checkpoint's saved input), `core_attn` under
`core_attn` recompute offloads exactly q, k and v of every attention (the checkpoint's inputs),
and none of what the checkpoint recomputes.
(c) The prefetch: backward copies each scope back when it is first needed and, before that scope
runs, starts the copy of the scope before it; a scope opening again starts a new chain.
(d) Every refusal is a config error naming the reason and what to change.
(e) The Qwen3.5 tiny model (Gated DeltaNet layers, the shared expert): `core_attn` wraps each GDN
layer's chunked delta rule too (alone or around its recompute), which moves that core's tensors;
with layer_input and moe, or with mlp (the shared expert), the loss and every gradient stay
bit-identical.
tp2 and pp2 x ep2 run in the layout lists of test_layouts.py and test_pipeline.py.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from test_recompute import image_batch, tiny_config

from moevlm.model import Qwen3VLMoe, VLMConfig
from moevlm.parallel.offload import MODULES, Offload, OffloadState, apply_offload, check
from moevlm.parallel.recompute import SavedBytes, apply_recompute

RECOMPUTES = [("none", ()), ("selective", ("core_attn", "moe_act")), ("full", ())]


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_config()
    torch.manual_seed(0)
    return cfg, Qwen3VLMoe(cfg), image_batch(cfg)


def run(base, batch, recompute, offload):
    model = copy.deepcopy(base)
    apply_recompute(model, *recompute)
    state = apply_offload(model, offload, "cpu", recompute)
    with SavedBytes(model) as meter:
        out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return out.loss.detach(), grads, meter, model, state


def allowed(recompute, scopes) -> tuple[str, ...]:
    return tuple(s for s in scopes if check((s,), recompute) is None)


@pytest.mark.parametrize("recompute", RECOMPUTES, ids=lambda r: r[0])
def test_offload_is_bit_identical_and_frees_what_it_moves(setup, recompute):
    cfg, base, batch = setup
    ref_loss, ref_grads, ref_meter, _, _ = run(base, batch, recompute, ())
    assert all(g is not None for g in ref_grads.values())
    scopes = allowed(recompute, MODULES)
    for offload in [(s,) for s in scopes] + [scopes]:
        loss, grads, meter, model, _ = run(base, batch, recompute, offload)
        assert torch.equal(loss, ref_loss), (recompute, offload)
        assert grads.keys() == ref_grads.keys()
        for n, g in ref_grads.items():
            assert torch.equal(grads[n], g), (recompute, offload, n)
        # every offload scope is a module at its slot; none inside a recomputed region
        regions = [m for m in model.modules() if isinstance(m, Offload)]
        assert regions and {r.scope for r in regions} <= set(offload)
        assert "Offload(" in repr(model) and f"scope={offload[0]}" in repr(model)
        freed = ref_meter.bytes - meter.bytes
        assert meter.offloaded_bytes > 0, offload
        # what left the device is exactly the offloaded storages that no other save holds (a vision
        # block's input tapped by a deepstack merger stays), and nothing else changed
        assert 0 < freed == meter.offloaded_storage_bytes, (offload, freed)
        print(
            f"recompute {recompute[0]} {','.join(recompute[1])} | offload {','.join(offload)} | on device "
            f"{ref_meter.bytes} -> {meter.bytes} B | offloaded share {freed / ref_meter.bytes:.1%} | "
            f"host {meter.offloaded_bytes} B"
        )


def test_layer_input_offloads_each_layer_input_once(setup):
    cfg, base, batch = setup
    B, S = batch["input_ids"].shape
    want = cfg.text.num_layers * B * S * cfg.text.hidden_size * 4  # fp32 (B,S,D) per layer
    for recompute in (("none", ()), ("full", ())):
        ref = run(base, batch, recompute, ())[2].bytes
        meter = run(base, batch, recompute, ("layer_input",))[2]
        assert meter.offloaded_bytes == want and ref - meter.bytes == want, recompute


def text_batch(seed: int = 0) -> dict:
    ids = torch.randint(0, 1000, (1, 64), generator=torch.Generator().manual_seed(seed))
    return dict(input_ids=ids, labels=ids)


def test_recomputed_tensors_are_not_offloaded(setup):
    """core_attn recomputed and offloaded: the offload moves exactly the checkpoint's inputs (q, k, v
    of every layer) and nothing the checkpoint recomputes; without recompute the same scope moves more
    (the attention's internals)."""
    cfg, base, _ = setup
    t, batch = cfg.text, text_batch()
    B, S = batch["input_ids"].shape
    qkv = t.num_layers * B * S * (t.num_heads + 2 * t.num_kv_heads) * t.head_dim * 4
    rec = ("selective", ("core_attn",))
    ref = run(base, batch, rec, ())
    loss, grads, meter, model, _ = run(base, batch, rec, ("core_attn",))
    assert meter.offloaded_bytes == qkv and ref[2].bytes - meter.bytes == qkv
    assert torch.equal(loss, ref[0])
    for n, g in ref[1].items():  # the vision tower has none (no image)
        assert (g is None and grads[n] is None) or torch.equal(grads[n], g), n
    # the Offload wraps the Recompute at the same slot
    wrapped = [m for m in model.modules() if isinstance(m, Offload)]
    assert len(wrapped) == t.num_layers + cfg.vision.depth  # text and vision attention
    assert all(type(m.inner).__name__ == "Recompute" for m in wrapped)
    plain = run(base, batch, ("none", ()), ("core_attn",))[2]
    assert plain.offloaded_bytes > meter.offloaded_bytes


def test_scopes_inside_recomputed_regions_are_refused_or_skipped(setup):
    cfg, base, _ = setup
    assert "inside the regions recomputed by model.recompute=full" in check(
        ("core_attn",), ("full", ())
    )
    assert "model.recompute_modules moe" in check(("moe_act",), ("selective", ("moe",)))
    assert "choose from layer_input" in check(("attn",))
    with pytest.raises(ValueError, match="recompute=full"):
        apply_offload(copy.deepcopy(base), ("moe",), "cpu", ("full", ()))
    # vision blocks recomputed: their attention is skipped, the decoder's is offloaded
    model = copy.deepcopy(base)
    apply_recompute(model, "selective", ("vision",))
    apply_offload(model, ("core_attn",), "cpu", ("selective", ("vision",)))
    owners = [n for n, m in model.named_modules() if isinstance(m, Offload)]
    assert owners and all(not n.startswith("visual") for n in owners), owners
    assert len(owners) == cfg.text.num_layers


def test_prefetch_loads_one_scope_ahead_and_chains_restart(setup):
    cfg, base, _ = setup
    batch = text_batch()
    model = copy.deepcopy(base)
    state = apply_offload(model, ("core_attn",), "cpu")
    groups = []
    opened = state.open

    def record(region, args, owner=None):
        g = opened(region, args, owner)
        groups.append(g)
        return g

    state.open = record
    out = model(**batch)
    L = cfg.text.num_layers
    assert len(groups) == L
    assert groups[0].prev is None and all(g.prev is h for h, g in zip(groups, groups[1:]))
    log = []
    for i, g in enumerate(groups):
        load, own = g.load, g._load_own

        def traced_load(i=i, load=load):
            log.append(("unpack", i))
            load()

        def traced_own(i=i, g=g, own=own):
            if not g.loaded:
                log.append(("copy", i))
            own()

        g.load, g._load_own = traced_load, traced_own
    out.loss.backward()
    first_unpack = {i: log.index(("unpack", i)) for i in range(L)}
    copies = [i for kind, i in log if kind == "copy"]
    assert copies == list(reversed(range(L))), log  # each scope copied back once, last layer first
    # the last layer's copy is on demand; every other layer's starts before its first unpack, at the
    # first unpack of the layer after it (one scope ahead, not more)
    assert log.index(("copy", L - 1)) == first_unpack[L - 1] + 1
    for i in range(L - 1):
        assert first_unpack[i + 1] < log.index(("copy", i)) < first_unpack[i], log
    # a second forward starts a new chain
    groups.clear()
    model(**batch)
    assert groups[0].prev is None and groups[1].prev is groups[0]


class StreamLog:
    """Stands in for `CudaStreams` on the CPU: the streams are names, every call is logged, so the order
    of the offload's stream calls (what makes the CUDA copies safe) is checked without a GPU."""

    pin = False

    def __init__(self):
        self.log, self.now, self.events = [], "compute", 0

    def current(self, device):
        return self.now

    def side(self, device):
        return "side"

    @contextlib.contextmanager
    def using(self, stream):
        before, self.now = self.now, stream
        self.log.append(("enter", stream))
        try:
            yield
        finally:
            self.now = before
            self.log.append(("exit", stream))

    def wait_stream(self, waiter, other):
        self.log.append(("wait_stream", waiter, other))

    def record_stream(self, t, stream):
        self.log.append(("record_stream", stream))

    def record_event(self, stream, timing=False):
        self.events += 1
        self.log.append(("record_event", stream, self.events))
        return self.events

    def wait_event(self, stream, event):
        self.log.append(("wait_event", stream, event))


def _blocks(log):
    """The calls inside each `using` block: [(first index, calls)]."""
    out, cur = [], None
    for i, call in enumerate(log):
        if call[0] == "enter":
            cur = (i, [])
        elif call[0] == "exit":
            out.append(cur)
            cur = None
        elif cur is not None:
            cur[1].append(call)
    return out


def test_cuda_stream_protocol_on_the_cpu(setup):
    """The CUDA path's stream calls, in order, with the copies on the CPU (and its numbers): each copy to
    host waits for the compute stream first and keeps the device tensor's memory for the side stream;
    each copy back records an event on the side stream, which the compute stream waits for before a
    tensor is used, and the tensor is kept for the compute stream."""
    cfg, base, batch = setup
    ref_loss, ref_grads, *_ = run(base, batch, ("none", ()), ())
    model = copy.deepcopy(base)
    state = apply_offload(model, ("layer_input", "core_attn", "moe"), "cpu")
    state.streams = streams = StreamLog()
    out = model(**batch)
    forward = _blocks(streams.log)
    streams.log.append(("backward",))
    start = len(streams.log)
    out.loss.backward()
    assert torch.equal(out.loss.detach(), ref_loss)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, ref_grads[n]), n
    assert len(forward) == state.calls  # one copy block per scope call (each moved something)
    for _, calls in forward:
        assert calls[0] == ("wait_stream", "side", "compute"), calls  # after the producers
        assert calls[1:] and all(c == ("record_stream", "side") for c in calls[1:]), calls
    back = streams.log[start:]
    loads = _blocks(back)
    assert len(loads) == state.calls  # every scope copied back once
    events = set()
    for _, calls in loads:
        assert calls[-1][:2] == ("record_event", "side"), calls  # after its copies
        events.add(calls[-1][2])
    outside = [c for c in back if c[0] in ("wait_event", "record_stream") and c[1] == "compute"]
    waits = [c for c in outside if c[0] == "wait_event"]
    # every unpack waits for its scope's event, then keeps the tensor for the compute stream
    assert {c[2] for c in waits} == events
    assert len(waits) == len([c for c in outside if c[0] == "record_stream"]) > len(events)
    for c in waits:  # never before the event was recorded
        assert back.index(("record_event", "side", c[2])) < back.index(c)


def test_timed_copy_starts_after_its_wait_for_the_producers(setup):
    """With timing on (tests/gpu/test_offload.py reads the events), each copy to host's start event is
    recorded on the side stream after it waits for the compute stream: the start is the copy's, not
    the moment the side stream reached the wait."""
    cfg, base, batch = setup
    model = copy.deepcopy(base)
    state = apply_offload(model, ("layer_input", "core_attn", "moe"), "cpu")
    state.streams = streams = StreamLog()
    state.timing = True
    model(**batch).loss.backward()
    forward = [calls for _, calls in _blocks(streams.log) if calls[0][0] == "wait_stream"]
    assert len(forward) == state.calls
    for calls in forward:
        assert calls[0] == ("wait_stream", "side", "compute") and calls[1][:2] == (
            "record_event",
            "side",
        ), calls
        assert calls[-1][:2] == ("record_event", "side"), calls  # its end, after the copies
    d2h = [e for e in state.events if e[0] == "d2h"]
    assert len(d2h) == state.calls and all(start < end for _, _, start, end in d2h)


@pytest.mark.parametrize(
    "recompute, offload",
    [(RECOMPUTES[0], ("layer_input", "core_attn", "moe")), (RECOMPUTES[1], ("core_attn", "mlp"))],
    ids=["none", "selective"],
)
def test_qwen35_gdn_core_is_offloaded_bit_identical(recompute, offload):
    """`mlp` wraps the shared expert where `moe` is not chosen; `core_attn` the GDN core, or its
    Recompute."""
    cfg = VLMConfig.preset("qwen3_5_tiny")
    torch.manual_seed(0)
    base, batch = Qwen3VLMoe(cfg), text_batch()
    ref_loss, ref_grads, *_ = run(base, batch, recompute, ())
    model = copy.deepcopy(base)
    apply_recompute(model, *recompute)
    state = apply_offload(model, offload, "cpu", recompute)
    groups = _recorded_groups(state)
    with SavedBytes(model) as meter:
        out = model(**batch)
    # every GDN core's group moved something to the host, before backward brings it back
    core = [g for g in groups if g.region in _gdn_cores(model)]
    core_bytes = [sum(e.host.nbytes for e in _on_host(g)) for g in core]
    gdn_layers = sum(t == "linear_attention" for t in cfg.text.layer_types)
    assert len(core) == gdn_layers and min(core_bytes) > 0, core_bytes
    scopes = {m.scope for m in model.modules() if isinstance(m, Offload)}
    assert scopes == set(offload), scopes
    shared = [n for n, m in model.named_modules() if n.endswith("shared_expert.region")]
    assert bool(shared) == ("mlp" in offload)
    out.loss.backward()
    assert meter.offloaded_bytes > sum(core_bytes)
    assert torch.equal(out.loss.detach(), ref_loss)
    for n, p in model.named_parameters():
        assert (p.grad is None and ref_grads[n] is None) or torch.equal(p.grad, ref_grads[n]), n
    print(f"recompute {recompute[0]} | offload {','.join(offload)} | GDN cores {core_bytes} B")


def _recorded_groups(state: OffloadState) -> list:
    """The list `state` will append each scope call's group to as it opens."""
    groups, opened = [], state.open
    state.open = lambda r, a, o=None: groups.append(g := opened(r, a, o)) or g
    return groups


def _on_host(group) -> list:
    """A scope call's entries alive (saved for backward) and on the host."""
    return [e for e in (r() for r in group.entries) if e is not None and e.host is not None]


def _gdn_cores(model) -> list:
    """The Offload regions at Gated DeltaNet layers' core_region slots."""
    return [m for n, m in model.named_modules() if n.endswith("linear_attn.core_region")]


def test_parameters_views_and_casts_stay_on_the_device():
    """A scope keeps the weights of the module it runs (a transposed view, a dtype cast: not
    nn.Parameter objects, as a tensor-parallel shard's local view is not) and moves the activations."""

    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            return self._forward(x)

        def _forward(self, x):
            h = x @ self.w.t()  # saves x and a view of w
            return (
                (h.double() @ self.w.double()).sin().sum()
            )  # saves h's and w's casts, sin's input

    mod = Mlp()
    region = Offload("mlp", OffloadState("cpu"))
    x = torch.randn(4, 8, requires_grad=True)
    want = torch.autograd.grad(mod._forward(x), (x, mod.w))
    with SavedBytes(mod) as meter:
        y = region(mod._forward, x)
    got = torch.autograd.grad(y, (x, mod.w))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    moved = {key[0] for key in meter._offloaded}
    assert x.untyped_storage().data_ptr() in moved  # the activation went
    assert mod.w.untyped_storage().data_ptr() not in moved  # the weight's view stayed
    # x (4x8 fp32), h as float64 and sin's input (4x8 float64 each): never w's view or cast
    assert meter.offloaded_bytes == 4 * 8 * 4 + 2 * 4 * 8 * 8


def test_plain_without_autograd(setup):
    cfg, base, batch = setup
    model = copy.deepcopy(base)
    apply_offload(model, MODULES, "cpu")
    want = base(**batch).loss.detach()
    groups = []
    state = next(m for m in model.modules() if isinstance(m, Offload)).state
    opened = state.open
    state.open = lambda r, a, o=None: groups.append(r) or opened(r, a, o)
    with torch.no_grad():
        assert torch.equal(model(**batch).loss, want)
    assert not groups


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.offload_modules=[attn]"], r"model.offload_modules has \['attn'\]; choose from"),
        (
            ["model.offload_modules=[core_attn]", "model.recompute=full"],
            r"\['core_attn'\] lie inside the regions recomputed by model.recompute=full.*layer_input",
        ),
        (
            [
                "model.offload_modules=[moe_act]",
                "model.recompute=selective",
                "model.recompute_modules=[moe]",
            ],
            r"\['moe_act'\] lie inside the regions recomputed by model.recompute_modules moe",
        ),
        (
            ["model.offload_modules=[core_attn]", "train.compile=true"],
            r"model.offload_modules=\[core_attn\] with train.compile=true: .*use train.compile=false",
        ),
        (
            ["model.offload_modules=[moe]", "model.cuda_graph_scope=[moe_router]"],
            r"model.offload_modules=\[moe\] overlaps model.cuda_graph_scope \['moe_router'\]",
        ),
        (
            ["model.offload_modules=[layer_input]", "model.cuda_graph_scope=[attn]"],
            r"overlaps model.cuda_graph_scope \['attn'\]",
        ),
    ],
)
def test_config_errors(overrides, message):
    from moevlm.config import compose_job, validate
    from moevlm.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        validate(compose_job(overrides), 1, environment=False)


def test_accepted_settings_validate():
    from moevlm.config import compose_job, validate

    for overrides in (
        ["model.offload_modules=[layer_input]", "model.recompute=full"],
        ["model.offload_modules=[core_attn,moe]", "model.cuda_graph_scope=[]"],
        ["model.offload_modules=[vision]", "model.recompute=full"],
    ):
        validate(compose_job(overrides), 1, environment=False)


def test_trainer_runs_offload_and_logs_it(tmp_path):
    """One step through the Trainer (config, validation, build_model): the same loss and gradient norm
    as without offload, and each metrics record names the scopes."""
    from one_step import first_records

    def look(name, trainer):
        assert (trainer.parallel.offload is None) == (name == "none")

    recs = first_records(
        tmp_path, {"none": [], "on": ["model.offload_modules=[layer_input,core_attn,moe]"]}, look
    )
    a, b = recs["none"], recs["on"]
    assert a["offload"] == "none" and b["offload"] == "layer_input,core_attn,moe"
    assert b["loss"] == a["loss"] and b["grad_norm"] == a["grad_norm"]


def test_lora_adapters_under_recompute_and_offload():
    """LoRA adapters (attention, MLP, experts, vision; B drawn non-zero) under selective and full
    recompute, each with every allowed offload scope: the loss and the adapters' gradients equal the
    adapters' run with neither (recompute: 1e-6 relative; offload on top: bit-identical to the same
    recompute), the frozen base gets no gradient, and each recompute keeps fewer bytes."""
    cfg = tiny_config()
    cfg.lora.rank, cfg.lora.modules = 8, ("attn", "mlp", "experts", "vision")
    torch.manual_seed(0)
    base = Qwen3VLMoe(cfg.validate())
    with torch.no_grad():
        for n, p in base.named_parameters():
            if n.endswith("B"):
                p.normal_(0.0, 0.02)
    batch = image_batch(cfg)
    ref_loss, ref_grads, ref_meter, _, _ = run(base, batch, ("none", ()), ())
    trained = {n for n, g in ref_grads.items() if g is not None}
    assert trained and all(".lora." in n for n in trained)
    assert any(".experts.lora." in n for n in trained) and any(
        n.startswith("vision.") for n in trained
    )
    for recompute in RECOMPUTES[1:]:
        loss, grads, meter, _, _ = run(base, batch, recompute, ())
        assert meter.bytes < ref_meter.bytes, recompute
        assert ((loss - ref_loss).abs() / ref_loss.abs()).item() <= 1e-6, recompute
        for n in trained:
            assert ((grads[n] - ref_grads[n]).norm() / ref_grads[n].norm()).item() <= 1e-6, n
        scopes = allowed(recompute, MODULES)
        off_loss, off_grads, off_meter, _, _ = run(base, batch, recompute, scopes)
        assert off_meter.offloaded_bytes > 0 and torch.equal(off_loss, loss), (recompute, scopes)
        assert {n for n, g in off_grads.items() if g is not None} == trained
        assert all(torch.equal(off_grads[n], grads[n]) for n in trained), (recompute, scopes)
