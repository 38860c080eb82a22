"""The attribution of a plan's peak: the live storages at the peak by kind, module and op.

A real CPU run of a small module stack checks the labels themselves (the module whose forward or
backward made a storage, saved activations, gradients); a tiny job's dry run checks that the split
sums to the peak and that each kind is where it must be."""

from __future__ import annotations

import torch
import torch.nn as nn
from test_dry_run import COMMON  # a short quiet job (the dry-run tests')

from moevlm.config import compose_job
from moevlm.plan.attribution import ModuleStack, module_name, saved_as_activations, summarize
from moevlm.plan.dry_run import dry_run
from moevlm.plan.fake import StorageTracker


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 32)
        self.act = nn.ReLU()
        self.down = nn.Linear(32, 8)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Block(), _Block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_module_names_drop_wrappers_and_layer_indices():
    assert module_name("text.layers.12.mlp.experts") == "text.layers.*.mlp.experts"
    assert module_name("text.layers.3._fsdp_wrapped_module.region") == "text.layers.*"
    assert module_name("0.fc") == "*.fc"
    assert module_name("") == ""


def test_labels_of_a_real_step_name_their_module_kind_and_op():
    net = _Net()
    x = torch.randn(64, 8)
    where = ModuleStack(net)
    mem = StorageTracker(where)
    mem.track(list(net.parameters()))
    mem.attribution.label_params(net)
    mem.attribution.phase = "step"
    with where, mem, saved_as_activations(mem):
        y = net(x)
        # after the forward: each block's ReLU output is kept for backward (by relu and down)
        live = {k: v for k, v in mem.attribution.live.items() if v}
        saved = {(k.module, k.op) for k in live if k.kind == "saved activations"}
        assert ("layers.*.act", "aten.relu") in saved, saved
        relu_bytes = sum(v for k, v in live.items() if k.module == "layers.*.act")
        assert relu_bytes == 2 * 64 * 32 * 4  # the two blocks' (64, 32) fp32 outputs
        y.square().sum().backward()
        mem.attribution.label_grads(net)
    split = mem.split_at_peak()
    assert sum(split.values()) == mem.peak_bytes > 0
    live = {k: v for k, v in mem.attribution.live.items() if v}
    grads = sum(v for k, v in live.items() if k.kind == "gradients")
    assert grads == sum(p.numel() * 4 for p in net.parameters())
    assert {k.module for k in live if k.kind == "gradients"} == {"layers.*.up", "layers.*.down"}
    weights = sum(v for k, v in live.items() if k.kind == "weights")
    assert weights == grads
    # backward temporaries carry the module whose backward made them
    ever = set(mem.attribution.live)
    assert ("temporaries", "layers.*.act", "aten.threshold_backward", "backward") in ever, ever
    out = summarize(split)
    assert sum(out["by_kind"].values()) == mem.peak_bytes


def test_dry_run_attribution_sums_to_the_peak_with_each_kind_in_place(tmp_path):
    job = compose_job(COMMON + [f"train.run_dir={tmp_path}", "train.global_batch_size=2"])
    plan = dry_run(job, bf16=False)
    a = plan.attribution
    kinds = a["by_kind"]
    assert sum(kinds.values()) == plan.peak_bytes
    assert sum(a["by_module"].values()) <= plan.peak_bytes
    # AdamW in fp32: two moments per parameter (and a step count per tensor)
    assert kinds["optimizer state"] == plan.optimizer_bytes
    assert 2 * plan.params_bytes <= kinds["optimizer state"] <= 2 * plan.params_bytes + 4096
    # the peak is in the second micro-batch's backward: the first one's gradients are all there
    assert kinds["gradients"] == plan.grads_bytes == plan.params_bytes
    assert kinds["weights"] >= plan.params_bytes  # + buffers (rotary tables, router bias)
    assert kinds["saved activations"] > 0
    # a known activation: the experts' grouped GEMM output saved for backward in every MoE layer
    saved = {t["module"] for t in a["by_kind_and_module"] if t["kind"] == "saved activations"}
    assert any(m.startswith("text.layers.*") for m in saved), a["by_kind_and_module"]
    assert all(t["bytes"] > 0 for t in a["top"])
