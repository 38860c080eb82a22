"""The step's device-to-host reads (`moevlm.plan.syncs`): the detector names the line of each read
added to a tiny module, on fake CPU and fake CUDA tensors, records none for a function without one;
the tiny job's step has none (`--strict-syncs` exits 0), and a read put back into the model
(`with_a_read`: the visual tokens' positions by `nonzero`, as the model found them before) is
reported by `--strict-syncs` at its line, as often on the CPU step as on fake CUDA per micro-batch."""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest
import torch
from torch import nn

from moevlm.plan.cli import SYNCS_FOUND, main, step_syncs
from moevlm.plan.dry_run import forward_on_fake_cuda
from moevlm.plan.environments import fake_cuda
from moevlm.plan.fake import PlanMode
from moevlm.plan.syncs import SyncCounter, SyncError
from moevlm.train.exit_codes import ExitCode

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.relpath(os.path.abspath(__file__), ROOT)


def line_of(marker: str) -> str:
    """`tests/plan/test_syncs.py:N` of the line that ends with `# marker`."""
    with open(__file__) as f:
        for n, text in enumerate(f, 1):
            if text.rstrip().endswith(f"# {marker}"):
                return f"{HERE}:{n}"
    raise LookupError(marker)


class Reads(nn.Module):
    """Reads the device three ways, and once through `tolist`."""

    def forward(self, x, ids):
        n = ids.sum().item()  # item
        picked = x[ids > 2]  # mask
        where = torch.nonzero(ids)  # nonzero
        rows = ids.tolist()  # tolist
        return x * n, picked, where, rows


def no_reads(x, ids, host):
    """Sizes given from the host: nothing waits on the device."""
    rep = torch.repeat_interleave(ids, ids, output_size=10)
    picked = x[torch.tensor([0, 2], device=x.device)]
    flat = torch.nonzero_static(ids, size=4)
    return x.sum() * 2, rep, picked, flat, host.tolist(), int(host[0])


X, IDS = torch.randn(4), torch.tensor([1, 2, 3, 4])


@contextlib.contextmanager
def watched(device_type: str, strict: bool = False):
    """(x, ids, counter): x (float) and ids (1, 2, 3, 4) fake on the step's device (fake CUDA on a
    CPU-only build), made from real tensors, and a SyncCounter entered above the fake mode."""
    cuda = device_type == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    with fake_cuda() if cuda else contextlib.nullcontext(), PlanMode() as mode:
        x, ids = mode.fake(X, device), mode.fake(IDS, device)
        with SyncCounter(device_type, strict=strict) as syncs:
            yield x, ids, syncs


EXPECTED = [
    ("aten._local_scalar_dense.default", "item"),
    ("aten.index.Tensor", "mask"),
    ("aten.nonzero.default", "nonzero"),
    ("Tensor.tolist", "tolist"),
]


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_each_read_is_named_by_its_line(device_type):
    with watched(device_type) as (x, ids, syncs):
        out = Reads()(x, ids)
    assert out[3] == [1, 2, 3, 4]  # the shadows answer the reads: the step goes on
    found = [(r.op, r.where, r.function) for r in syncs.records]
    assert found == [(op, line_of(m), "forward") for op, m in EXPECTED]
    assert [n for _, _, n in syncs.by_line()] == [1, 1, 1, 1]


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_strict_stops_at_the_first_read_naming_it(device_type):
    with pytest.raises(SyncError, match=line_of("item")) as err:
        with watched(device_type, strict=True) as (x, ids, _):
            Reads()(x, ids)
    assert "_local_scalar_dense" in str(err.value) and "forward" in str(err.value)


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_a_function_without_reads_records_none(device_type):
    host = torch.tensor([5, 6])  # the loader's: read on the host, not a sync
    with watched(device_type) as (x, ids, syncs):
        out = no_reads(x, ids, host)
    assert out[4:] == ([5, 6], 5)
    assert syncs.records == []


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_a_copy_to_the_host_is_one_read_and_what_it_made_is_on_the_host(device_type):
    """On fake CUDA the copy dispatches; on a CPU step `.cpu()` is the tensor itself (an alias)."""
    with watched(device_type) as (_, ids, syncs):
        on_host = ids.cpu()  # copy
        ids.to("cpu", non_blocking=True)  # an asynchronous copy does not wait
        rows = on_host.tolist()
        first, big = int(on_host[0]), on_host[on_host > 2]
    assert (rows, first, big.shape) == ([1, 2, 3, 4], 1, (2,))
    op = "aten._to_copy.default" if device_type == "cuda" else "Tensor.cpu"
    assert [(r.op, r.where) for r in syncs.records] == [(op, line_of("copy"))]


def reading_positions(mask, n, fill=-1):
    """The visual tokens' positions as the model took them before `nonzero_static`: a read."""
    return mask.reshape(-1).nonzero().squeeze(-1)  # injected


@contextlib.contextmanager
def with_a_read():
    """The model with one device-to-host read per deepstack layer (and per video mix) again."""
    import moevlm.model.strategies
    import moevlm.model.vlm

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moevlm.model.strategies, "true_positions", reading_positions)
        mp.setattr(moevlm.model.vlm, "true_positions", reading_positions)
        yield


@pytest.fixture(scope="module")
def tiny_step():
    """The tiny default job's step, run once for the command lines below."""
    from moevlm.config import compose_job

    return step_syncs(compose_job(["data.shards=sample"]))


@pytest.fixture(scope="module")
def tiny_step_read():
    """The same step with the read put back."""
    from moevlm.config import compose_job

    with with_a_read():
        return step_syncs(compose_job(["data.shards=sample"]))


def test_the_tiny_step_reads_nothing_on_either_device(tiny_step):
    """The micro-batch brings what the model reads on the host (grids, cu_seqlens, the visual
    token counts), and sizes come from there: no read on the CPU step nor on fake CUDA."""
    from moevlm.config import compose_job

    syncs = SyncCounter("cuda")
    forward_on_fake_cuda(compose_job(["data.shards=sample"]), watch=syncs)
    assert syncs.records == [] and tiny_step.count == 0 and tiny_step.lines == []


def test_the_cpu_step_finds_the_fake_cuda_forwards_reads_in_every_micro_batch(tiny_step_read):
    """The CPU step's device rule against the device's own: the tiny job's forward on fake CUDA
    (`forward_on_fake_cuda`) reads at the same lines, as many times per micro-batch."""
    from moevlm.config import compose_job

    syncs = SyncCounter("cuda")
    with with_a_read():
        forward_on_fake_cuda(compose_job(["data.shards=sample"]), watch=syncs)
    on_cpu = {where: n for where, _, n in tiny_step_read.lines}
    assert syncs.records and set(on_cpu) == {line_of("injected")}
    for where, _, n in syncs.by_line():
        assert on_cpu.get(where) == n * tiny_step_read.micro_batches, where


def _run(argv: list[str], found, monkeypatch) -> tuple[int, str]:
    """`main(argv)`'s status and stdout, its step one already run (`tiny_step`, `tiny_step_read`)."""
    import moevlm.plan.cli

    monkeypatch.setattr(moevlm.plan.cli, "step_syncs", lambda job, world: found)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(argv)
    return status, out.getvalue()


def test_strict_syncs_reports_a_read_by_its_line(tiny_step, tiny_step_read, monkeypatch):
    """None today: exit 0.  A read put back: named by its file and line, counted per step, exit 1."""
    status, out = _run(["--strict-syncs"], tiny_step, monkeypatch)
    assert status == ExitCode.OK and out.startswith("device-to-host syncs per training step: 0 ")
    status, out = _run(["--strict-syncs"], tiny_step_read, monkeypatch)
    head, *rows = out.strip().splitlines()
    assert head.startswith("device-to-host syncs per training step: ")
    total = int(head.split(": ")[1].split()[0])
    assert "2 micro-batches" in head and "fake-world dry run" in head
    assert status == SYNCS_FOUND and total > 0
    counted = 0
    for row in rows[1:]:
        count, where, ops = row.split(maxsplit=2)
        assert where == line_of("injected") and ops == "nonzero", row
        counted += int(count)
    assert counted == total and total % 2 == 0  # the same reads in each micro-batch


def test_syncs_reports_and_exits_0(tiny_step_read, monkeypatch):
    status, out = _run(["--syncs", "--json"], tiny_step_read, monkeypatch)
    found = json.loads(out)
    assert status == ExitCode.OK
    assert len(found["records"]) == sum(n for _, _, n in found["lines"]) > 0
    assert all(r["where"] == line_of("injected") for r in found["records"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout, micro_batches",
    [([], 4), (["parallel.world_size=2", "parallel.pp=2"], 8)],
    ids=["one-process", "pp2"],
)
def test_two_short_runs_count_what_every_micro_batch_reads(layout, micro_batches):
    """The counts from 2 and 3 micro-batches (pp 2: 4 and 6, past the schedule's warm-up),
    extrapolated to the step's 4 (pp 2: 8), equal those of the step with every micro-batch run,
    line by line."""
    from moevlm.config import compose_job

    job = compose_job(["data.shards=sample", f"train.global_batch_size={micro_batches}", *layout])
    with with_a_read():
        short, full = step_syncs(job), step_syncs(job, every_micro_batch=True)
    assert "extrapolated" in short.how and "extrapolated" not in full.how
    assert short.micro_batches == full.micro_batches == micro_batches
    assert short.lines == full.lines and short.count == len(full.records) > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe",
    [["h100_1gpu"], ["h200_1gpu"], ["h100_fsdp", "model.moe_capacity_factor=1.25"]],
    ids=["h100_1gpu", "h200_1gpu", "h100_fsdp-capacity"],
)
def test_recipes_read_nothing_at_their_widths(recipe):
    """The one-GPU proxies and an FSDP + cp 2 + EP 8 layout with the capacity-bounded all-to-all
    (h100_fsdp's dropless exchange reads its split sizes: the one inherent read) at their real widths
    and budgets, 2 decoder layers per stage and the tower's first 9 blocks (every layer reads alike;
    block 8 feeds the first deepstack layer, whose positions were a read; the full depth:
    `python -m moevlm.plan +experiment=NAME --strict-syncs`, docs/plans.md).  With the read put back
    the same step finds it."""
    from moevlm.config import compose_job

    name, *more = recipe
    job = compose_job([f"+experiment={name}", "data.shards=sample", *more])
    shallow = [f"model.num_layers={2 * job.parallel.pp}", "model.vision_depth=9"]
    job = compose_job([f"+experiment={name}", "data.shards=sample", *more, *shallow])
    found = step_syncs(job)
    assert found.count == 0, found.lines
    if name == "h100_1gpu":
        with with_a_read():
            assert [w for w, _, _ in step_syncs(job).lines] == [line_of("injected")]
