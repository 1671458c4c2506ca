"""Host syncs a CPU run can see, counted where a GPU step would wait. The budget these tests hold: at most one
device-to-host transfer per MoE layer per micro-batch, the counts the uneven all-to-all needs, and the metrics once
per step; no host-to-device copy at all (a copy from pageable host memory waits for the stream).

`HostSyncs` treats the CPU as the device and follows which tensors are host copies:
  - a TorchFunctionMode sees our Python calls: `.cpu()`, `.tolist()` and `.numpy()` of a device tensor are
    device-to-host transfers; their results, tensors built without a `device=` argument and whatever is computed
    from host tensors alone are host tensors (on a GPU they would live in host memory); a host tensor moved
    with `.to(device)` or `.cuda()`, copied into a device tensor by `copy_`, or used (not 0-dim) as an operand of
    an op beside device tensors, and `torch.tensor`/`torch.as_tensor` of host data with `device=`, are
    host-to-device copies;
  - a TorchDispatchMode sees every aten op, in backward too: `_local_scalar_dense` (what `.item()`, `int()`,
    `float()` and `bool()` of a tensor run), `nonzero`, `masked_select`, indexing with a boolean mask, `bincount`
    (CUDA's reads the input's max on the host), `unique` and `repeat_interleave` without `output_size` (sizes
    read from the device) on a device tensor.
What it cannot see: syncs inside kernels that run none of these ops; a `.cpu()` or `.tolist()` called from an
autograd backward (the function mode is not active there; our backwards call neither: the dispatch mode, which is,
would see the ops behind an `.item()`); a `.to("cpu")` (our code moves to the host with `.cpu()` only); and a
tensor built with `device=` a host tensor's device, which it takes for a device tensor (so a copy of it to the
device is seen where it first meets a host tensor, as "host operand").
"""

from __future__ import annotations

import traceback
import weakref
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from moe_dist.config import MoEConfig, load_config
from moe_dist.layers.moe import LocalDispatcher, MoE
from moe_dist.layers.router import Router
from moe_dist.models.decoder import build_model, lm_loss, materialize_whole
from moe_dist.parallel.dedup import DedupAllToAllDispatcher
from moe_dist.parallel.dispatch import AllToAllDispatcher, TokenSplit
from moe_dist.parallel.mesh import DedupGroups
from moe_dist.train.metrics import StepAccumulator

aten = torch.ops.aten
D2H_METHODS = {"cpu", "tolist", "numpy"}
DATA_DEPENDENT = {
    aten._local_scalar_dense.default: "item",
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten.bincount.default: "bincount",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique",
}


def _caller() -> str:
    """file:line of the innermost frame in moe_dist (where the sync is written)."""
    frames = [f for f in traceback.extract_stack() if "/moe_dist/" in f.filename]
    return f"{frames[-1].filename.split('/moe_dist/')[-1]}:{frames[-1].lineno}" if frames else "?"


class _Host(TorchFunctionMode):
    def __init__(self, syncs: "HostSyncs"):
        super().__init__()
        self.syncs = syncs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        name = getattr(func, "__name__", "")
        host_inputs = all(self.syncs.on_host(t) for t in tensors)
        if name in D2H_METHODS and not host_inputs:
            self.syncs.record(f"{name}()")
        moved = name == "to" and any(isinstance(a, (torch.device, str)) for a in (*args[1:], kwargs.get("device")))
        host = [t for t in tensors if self.syncs.on_host(t)]
        if (moved or name == "cuda") and host:
            self.syncs.record("to(device)")  # host to device: a copy the host waits for (pageable memory)
        elif name == "copy_" and len(tensors) == 2 and self.syncs.on_host(args[1]) and not self.syncs.on_host(args[0]):
            self.syncs.record("copy_()")
        elif name in ("tensor", "as_tensor") and kwargs.get("device") is not None and len(host) == len(tensors):
            self.syncs.record(f"{name}(device=)")  # host data (Python values or a host tensor) copied to the device
        elif host and len(host) < len(tensors) and any(t.dim() > 0 for t in host) and name not in D2H_METHODS:
            self.syncs.record("host operand")  # a host tensor in a device op: copied to the device first
        out = func(*args, **kwargs)
        if name == "cpu" and out is args[0]:
            out = out.clone()  # a CPU tensor's .cpu() is itself; on a GPU it is a new host tensor
        if moved and out is args[0]:
            out = out.clone()  # likewise a move to the device: a new tensor there
        if name in D2H_METHODS or (host_inputs and not moved and (tensors or "device" not in kwargs)):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.syncs.mark_host(t)
        return out


class _Ops(TorchDispatchMode):
    def __init__(self, syncs: "HostSyncs"):
        super().__init__()
        self.syncs = syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        if not all(self.syncs.on_host(t) for t in leaves if isinstance(t, torch.Tensor)):
            if func in DATA_DEPENDENT:
                self.syncs.record(DATA_DEPENDENT[func])
            elif func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default) and any(
                isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in tree_leaves(args[1])
            ):
                self.syncs.record("boolean-mask index")
            elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
                self.syncs.record("repeat_interleave without output_size")
        return func(*args, **kwargs)


class HostSyncs:
    """Context manager: `events` lists (what, where) for every sync a GPU would make inside it."""

    def __init__(self):
        self._host: dict[int, weakref.ref] = {}  # by id: a tensor's == is elementwise
        self.events: list[tuple[str, str]] = []
        self._modes = (_Host(self), _Ops(self))

    def on_host(self, t: torch.Tensor) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def mark_host(self, t: torch.Tensor) -> None:
        self._host[id(t)] = weakref.ref(t)

    def record(self, what: str) -> None:
        self.events.append((what, _caller()))

    def __enter__(self):
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


def moe_layer(**cfg_kw) -> MoE:
    torch.manual_seed(0)
    moe = MoE(16, 32, MoEConfig(num_experts=8, top_k=2, **cfg_kw), init_std=0.5, n_layers=2)
    moe.init_weights()
    return moe


def fwd_bwd(moe: MoE, x: torch.Tensor) -> None:
    y, stats = moe(x)
    (y.square().sum() + stats.aux_loss + stats.z_loss).backward()


def test_the_counter_sees_what_it_claims(one_thread):
    # It can fail: each kind of sync it names is seen on device tensors, none on host copies.
    x = torch.arange(6)
    with HostSyncs() as s:
        x.tolist()
        int(x.sum())
        x[x > 2]
        torch.bincount(x)
        torch.repeat_interleave(x, x)
        host = x.cpu()
        host.tolist(), int(host.sum()), host[host > 2], torch.repeat_interleave(host, host)
        torch.tensor([1, 2]).tolist()  # built on the host
        torch.repeat_interleave(x, x, output_size=15)  # size given: no sync
        x.cpu().to(x.device).tolist()  # moved back to the device: a transfer again
    assert [what for what, _ in s.events] == [
        "tolist()",
        "item",
        "boolean-mask index",
        "bincount",
        "repeat_interleave without output_size",
        "cpu()",
        "cpu()",
        "to(device)",
        "tolist()",
    ]


def test_the_counter_sees_host_to_device_copies(one_thread):
    # It can fail: each way a host tensor reaches the device is seen, none of the device's own constructions.
    x = torch.arange(6)
    with HostSyncs() as s:
        host = torch.tensor([3, 1, 2])  # built on the host
        host.to(x.device)
        torch.empty(3, dtype=torch.long, device=x.device).copy_(host)
        torch.tensor([1, 2], device=x.device)
        torch.as_tensor(x[0], device=x.device)  # already there: no copy
        x[:3] + host  # a host operand of a device op
        x[:3] + torch.tensor(2)  # a 0-dim host tensor is passed as a scalar: no copy
        torch.arange(3, device=x.device) + x[:3]  # built on the device
        torch.zeros(2, device=x.device).copy_(x[:2])
        host.to(torch.float32)  # a dtype change stays on the host
    assert [what for what, _ in s.events] == ["to(device)", "copy_()", "tensor(device=)", "host operand"]


@pytest.mark.parametrize(
    "cfg_kw",
    [
        {"capacity_factor": 1.0},
        {"capacity_factor": 1.0, "drop_policy": "probability", "aux_loss_scope": "sequence"},
        {"score": "sigmoid", "bias_update_rate": 0.01, "n_groups": 2, "topk_groups": 1, "capacity_factor": None},
    ],
    ids=["capacity", "probability-sequence", "sigmoid-bias-groups"],
)
def test_router_forward_and_backward_make_no_sync(cfg_kw, one_thread):
    router = Router(16, MoEConfig(num_experts=8, top_k=2, **cfg_kw), init_std=0.5)
    router.init_weights()
    x = torch.randn(4, 24, 16, generator=torch.Generator().manual_seed(0))
    with HostSyncs() as s:
        routing, stats = router(x.view(-1, 16), 24)
        (routing.weight_A.sum() + stats.aux_loss + stats.z_loss).backward()
    assert s.events == []  # bincount and the capacity mask used to sync here (two per call on CUDA)
    assert stats.dropped.item() > 0 or cfg_kw["capacity_factor"] is None


def test_moe_layer_local_dispatcher_syncs_only_for_the_kept_row_count(one_thread):
    x = torch.randn(2, 40, 16, generator=torch.Generator().manual_seed(1))
    with HostSyncs() as s:
        fwd_bwd(moe_layer(capacity_factor=None), x)
    assert s.events == []  # dropless: every size is known on the host
    moe = moe_layer(capacity_factor=1.0)
    with HostSyncs() as s:
        fwd_bwd(moe, x)
    # with capacity the kept rows' count R sizes the grouped GEMM: one transfer, in forward only
    assert [what for what, _ in s.events] == ["cpu()"], s.events
    assert s.events[0][1].startswith("layers/router.py")  # Routing.kept_rows
    with torch.no_grad():
        assert moe(x)[1].dropped.item() > 0


@pytest.fixture(scope="module")
def solo_group():
    """A one-process gloo group (the default group when none exists yet): the all-to-all dispatcher's real code."""
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60))
    yield dist.new_group([0])
    if made:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["ep", "ep-tp-split", "ep-chunks3"])
@pytest.mark.parametrize("capacity_factor", [1.0, None], ids=["capacity", "dropless"])
def test_all_to_all_dispatcher_makes_one_transfer_per_layer(solo_group, kind, capacity_factor, one_thread):
    moe = moe_layer(capacity_factor=capacity_factor)
    perm = moe.dispatcher.permutation
    a2a = AllToAllDispatcher(solo_group, 1, 0, 8, perm)
    moe.dispatcher = {  # the chunked dispatcher cuts the kept rows into 3 token parts with fixed-size index math
        "ep": a2a,
        "ep-tp-split": AllToAllDispatcher(solo_group, 1, 0, 8, perm, split=TokenSplit(solo_group, 1, 0)),
        "ep-chunks3": AllToAllDispatcher(solo_group, 1, 0, 8, perm, chunks=3),
    }[kind]
    x = torch.randn(2, 40, 16, generator=torch.Generator().manual_seed(2))
    with HostSyncs() as s:
        fwd_bwd(moe, x)
    # the counts for the uneven all-to-all, one copy; no host-to-device copy (there were three per chunk: the two
    # segment permutations and the group sizes, built on the host and moved to the device)
    assert [what for what, _ in s.events] == ["cpu()"], s.events
    assert s.events[0][1].startswith("parallel/dispatch.py")
    local = moe_layer(capacity_factor=capacity_factor)  # the same weights: the same output as the local dispatcher
    exact = kind != "ep-chunks3"  # chunks run the expert GEMMs on fewer rows at a time: fp32 rounding may differ
    torch.testing.assert_close(moe(x)[0], local(x)[0], rtol=0 if exact else 1e-5, atol=0 if exact else 1e-5)


@pytest.mark.parametrize("unit, transfers", [("rank", 1), ("node", 2)])
@pytest.mark.parametrize("capacity_factor", [1.0, None], ids=["capacity", "dropless"])
def test_dedup_dispatcher_transfers_once_per_stage(solo_group, unit, transfers, capacity_factor, one_thread):
    """The deduplicated dispatch moves its counts to the host once per all-to-all stage: one count exchange carries
    the pairs and the assignments sent to each block, so single-rank blocks ("rank") need no second transfer;
    node blocks add the plain dispatcher's inside the node."""
    moe = moe_layer(capacity_factor=capacity_factor)
    perm = moe.dispatcher.permutation
    groups = DedupGroups(solo_group, 1, 0, solo_group if unit == "node" else None, 1, 0)
    inner = AllToAllDispatcher(solo_group, 1, 0, 8, perm) if unit == "node" else LocalDispatcher(perm)
    moe.dispatcher = DedupAllToAllDispatcher(8, perm, groups, inner)
    x = torch.randn(2, 40, 16, generator=torch.Generator().manual_seed(2))
    with HostSyncs() as s:
        fwd_bwd(moe, x)
    assert [what for what, _ in s.events] == ["cpu()"] * transfers, s.events
    assert all(where.startswith(("parallel/dedup.py", "parallel/dispatch.py")) for _, where in s.events), s.events
    local = moe_layer(capacity_factor=capacity_factor)
    torch.testing.assert_close(moe(x)[0], local(x)[0], rtol=1e-6, atol=1e-6)


def test_decoder_step_syncs_once_per_moe_layer_at_most(one_thread):
    cfg = load_config("configs/debug.json")  # attention + Mamba mixers, MoE with capacity on every other layer
    model = materialize_whole(build_model(cfg.model), "cpu", seed=0)
    batch = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    with HostSyncs() as s:
        out = model(batch[:, :-1])
        (lm_loss(out.logits, batch[:, 1:]) + out.aux_loss + out.z_loss).backward()
    n_moe = len(out.moe_stats)
    assert n_moe == 2
    assert [what for what, _ in s.events] == ["cpu()"] * n_moe, s.events  # the kept counts, one per MoE layer
    assert all(where.startswith("layers/router.py") for _, where in s.events)


def test_step_metrics_read_nothing_per_layer_and_move_once_per_step(one_thread):
    cfg = load_config("configs/debug.json")
    model = materialize_whole(build_model(cfg.model), "cpu", seed=0)
    batch = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    with HostSyncs() as s:  # from the accumulator's construction on, so its host buffers are known as such
        acc = StepAccumulator(2, cfg.model.moe.num_experts)
        for _ in range(3):  # micro-batches
            with torch.no_grad():
                out = model(batch[:, :-1])
            loss = lm_loss(out.logits, batch[:, 1:])
            before = len(s.events)
            acc.add(loss, loss, out)
            assert s.events[before:] == []  # was one `.item()` per MoE layer per micro-batch
        before = len(s.events)
        record = acc.reduce()
    assert [what for what, _ in s.events[before:]] == ["cpu()"]  # the step's one transfer of metrics
    assert [sum(layer["tokens_per_expert"]) for layer in record["moe"]] == [
        3 * 2 * 32 * 2
    ] * 2  # 3 micro-batches of 2 x 32 tokens, top-2
    expected_dropped = sum(s.dropped.item() for s in out.moe_stats) * 3
    assert sum(sum(layer["dropped_per_expert"]) for layer in record["moe"]) == expected_dropped
