"""moe_dist/parallel/private_api/ against the installed DeepSpeed and torch, in this process (a gloo world of
one, no spawned ranks): every internal it reaches into still exists and still means what the module says.

A tiny DeepSpeed engine with one expert parameter group shows the pieces together: the engine takes the marker
for a DeepSpeed MoE layer, ZeRO reduces the expert group over the EDP group registered under its name, and a
step run through `step_without_update` changes nothing. The multi-process equivalence tests prove the same
integration at real layouts.
"""

from __future__ import annotations

import ast
import functools
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from support import free_port
from torch import nn

from moe_dist.parallel import private_api

GROUP = "ep_size_test"  # a name no training layout uses
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def world():
    """A gloo world of one in this process, adopted by deepspeed.comm as init_distributed does; everything it
    changes (environment, DeepSpeed's registries, torch's default group) is put back afterwards."""
    import deepspeed
    import deepspeed.comm.comm as ds_comm
    from deepspeed.utils import groups

    assert not dist.is_initialized()
    env = dict(os.environ)
    # LOCAL_SIZE (set by the deepspeed launcher) == world size makes DeepSpeed create its shm all-reduce buffer.
    os.environ.update(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        LOCAL_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    shm = Path("/dev/shm", private_api.deepspeed_shm_buffer_name(0))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60))
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    try:
        yield shm
    finally:
        shm.unlink(missing_ok=True)
        for registry in (
            groups._EXPERT_PARALLEL_GROUP,
            groups._EXPERT_PARALLEL_GROUP_RANKS,
            groups._EXPERT_DATA_PARALLEL_GROUP,
            groups._EXPERT_DATA_PARALLEL_GROUP_RANKS,
        ):
            registry.pop(GROUP, None)
        dist.destroy_process_group()
        ds_comm.cdb = None
        os.environ.clear()
        os.environ.update(env)


@pytest.fixture(scope="module")
def expert_groups(world):
    """Our EP and EDP groups (one rank each), registered with DeepSpeed."""
    ep, edp = dist.new_group([0]), dist.new_group([0])
    assert private_api.expert_groups(GROUP) is None
    private_api.register_expert_groups(GROUP, (ep, [0]), (edp, [0]))
    return ep, edp


def test_registered_expert_groups_read_back_through_deepspeeds_getters(expert_groups):
    from deepspeed.utils import groups

    ep, edp = expert_groups
    got = private_api.expert_groups(GROUP)
    assert got is not None and got[0] is ep and got[1] is edp
    # What the engine copies at initialize and ZeRO indexes by a parameter group's name:
    assert groups._get_expert_parallel_group_dict()[GROUP] is ep
    assert groups._get_expert_data_parallel_group_dict()[GROUP] is edp
    assert groups._get_expert_parallel_group_ranks(GROUP) == [0]
    assert groups._get_expert_data_parallel_group_ranks(GROUP) == [0]
    assert groups._get_expert_parallel_world_size(GROUP) == 1 and groups._get_expert_data_parallel_rank(GROUP) == 0


def test_parameter_marks_are_the_ones_deepspeed_reads():
    from deepspeed.moe.utils import is_moe_param
    from deepspeed.runtime.utils import is_model_parallel_parameter

    expert, dense, shard = (nn.Parameter(torch.zeros(2)) for _ in range(3))
    private_api.mark_expert_parameter(expert, GROUP)
    private_api.mark_model_parallel(shard)
    assert is_moe_param(expert) and not is_moe_param(dense) and not is_moe_param(shard)
    assert private_api.expert_group_of(expert) == GROUP and private_api.expert_group_of(dense) is None
    assert is_model_parallel_parameter(shard) and not is_model_parallel_parameter(dense)


def test_marker_is_a_parameter_free_deepspeed_moe_layer():
    from deepspeed.moe.layer import MoE

    marker = private_api.deepspeed_moe_marker(8, 2, "ep_size_2")
    assert isinstance(marker, MoE) and list(marker.parameters()) == []
    assert (marker.num_experts, marker.ep_size, marker.expert_group_name) == (8, 2, "ep_size_2")
    marker.set_deepspeed_parallelism(False)  # what the engine calls on it: a no-op, the groups exist
    with pytest.raises(RuntimeError, match="not a layer"):
        marker(torch.zeros(1))


def test_group_timeouts_reach_every_group(world):
    from torch.distributed import distributed_c10d as c10d

    extra = dist.new_group([0])  # made after init_process_group: torch's 30-minute default

    def timeout(group) -> timedelta:
        return group._get_backend(torch.device("cpu")).options._timeout

    assert timeout(extra) == timedelta(minutes=30)
    private_api.set_timeout_of_every_group(timedelta(seconds=7))
    assert timeout(extra) == timedelta(seconds=7)
    assert all(timeout(g) == timedelta(seconds=7) for g in c10d._world.pg_map)  # the world and every other group


def test_aborted_nccl_groups_walks_every_group(world):
    dist.new_group([0])
    assert private_api.aborted_nccl_groups() == []  # gloo groups keep no error state: none is reported


def test_shm_buffer_name_is_the_one_deepspeeds_kernel_creates(world):
    shm = world  # deepspeed.init_distributed (the fixture) ran DeepSpeed's shm_initialize
    assert shm.is_file() and shm.stat().st_size > 1 << 20, f"no DeepSpeed shm buffer named {shm.name}"


class _Tiny(nn.Module):
    """A dense layer and an 'expert' layer whose parameters form their own expert group."""

    def __init__(self, expert_group: str | None):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.dense, self.expert = nn.Linear(4, 4), nn.Linear(4, 1)
        if expert_group is not None:
            for p in self.expert.parameters():
                private_api.mark_expert_parameter(p, expert_group)
            self.marker = private_api.deepspeed_moe_marker(1, 1, expert_group)

    def forward(self, x):
        return self.expert(torch.tanh(self.dense(x))).square().mean()


def _engine(zero_stage: int, expert_group: str | None, bf16: bool = False):
    import deepspeed

    from moe_dist.train.optim import param_groups

    model = _Tiny(expert_group)
    opt = torch.optim.AdamW(param_groups(model, 0.0), lr=0.1)
    config = {
        "train_batch_size": 1,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    if bf16:  # bf16 weights with fp32 gradient accumulation
        config.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine, model


def _backward(engine, seed: int) -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
    engine.backward(engine(x))


def _full_state(model) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, p in model.named_parameters():
        assert private_api.has_partitioned_fp32_state(p), name
        out[name] = safe_get_full_fp32_param(p).clone()
        for k in ("exp_avg", "exp_avg_sq"):
            state = safe_get_full_optimizer_state(p, k)
            assert state is not None, f"{k} of {name} unreachable"
            out[f"{k}.{name}"] = state.clone()
    return out


def test_zero_engine_reduces_the_expert_group_over_its_edp_group_and_skips_without_update(expert_groups):
    _, edp = expert_groups
    engine, model = _engine(1, GROUP)
    assert engine.has_moe_layers  # the marker was taken for a DeepSpeed MoE layer
    opt = engine.optimizer
    expert_index = next(i for i, g in enumerate(opt.optimizer.param_groups) if g.get("moe"))
    assert opt.real_dp_process_group[expert_index] is edp  # ZeRO reduces and partitions it over our EDP group
    inner = private_api.inner_optimizer(engine)
    assert isinstance(inner, torch.optim.AdamW) and inner.param_groups[expert_index].get("moe")
    # the tensors its Adam state is keyed by: one fp32 partition per group
    partitions = private_api.zero_fp32_partitions(engine)
    assert [p for g in inner.param_groups for p in g["params"]] == partitions
    assert all(t.dtype == torch.float32 and t.dim() == 1 for t in partitions)

    _backward(engine, 0)
    grads = private_api.reduced_gradient_partitions(opt)
    assert grads and all(torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)
    engine.step()
    private_api.relink_zero_optimizer_state(opt)  # the expert group's moments become reachable
    before = _full_state(model)

    def adam_steps() -> list[float]:
        return [opt.optimizer.state[p]["step"].item() for g in opt.optimizer.param_groups for p in g["params"]]

    steps_before = adam_steps()

    _backward(engine, 1)
    assert private_api.step_without_update(engine)
    assert not engine.was_step_applied()
    after = _full_state(model)
    assert all(torch.equal(before[k], after[k]) for k in before), "a held-back step changed the state"
    assert adam_steps() == steps_before == [1.0] * len(steps_before)

    _backward(engine, 2)
    engine.step()  # and a normal step still moves every parameter
    moved = _full_state(model)
    assert all(not torch.equal(before[n], moved[n]) for n, _ in model.named_parameters())


def test_zero1_with_bf16_and_fp32_accumulation_keeps_the_zero_optimizer_within_the_routing(world):
    """Without it DeepSpeed wraps ZeRO 1 + bf16 + fp32 accumulation in BF16_Optimizer, whose state our checkpoints
    do not read; within it, the ZeRO optimizer with an fp32 accumulation buffer per parameter."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    engine, _ = _engine(1, None, bf16=True)
    assert isinstance(engine.optimizer, BF16_Optimizer)
    with private_api.zero1_keeps_its_optimizer():
        engine, model = _engine(1, None, bf16=True)
    assert isinstance(engine.optimizer, DeepSpeedZeroOptimizer) and engine.optimizer.use_grad_accum_attribute
    engine.backward(engine(torch.randn(3, 4, generator=torch.Generator().manual_seed(0)).bfloat16()))
    reduced = private_api.reduced_gradient_partitions(engine.optimizer)
    assert reduced and all(g.dtype == torch.float32 for g in reduced)  # what the step reads: the fp32 sums
    engine.step()
    assert all(private_api.has_partitioned_fp32_state(p) for p in model.parameters())
    _full_state(model)  # master weights and moments reachable, as checkpoints read them


@dataclass
class _Out:
    loss: torch.Tensor


class _Branchy(nn.Module):
    """Four layers (a 20-element bucket each) and a side layer that only the step's first micro-batch uses; the
    output is a dataclass, in which DeepSpeed finds no tensor to hang its backward prologue on."""

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
            self.side = nn.Linear(4, 4)
        self.use_side = True

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return _Out((x + self.side(x) if self.use_side else x).square().mean())


def _zero1_step_gradient(overlap: bool) -> torch.Tensor:
    """The fp32 gradient partition ZeRO 1 hands the optimizer after two bf16 micro-batches."""
    import deepspeed

    model = _Branchy()
    config = {
        "train_batch_size": 2,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 20, "overlap_comm": overlap},
        "bf16": {"enabled": True},
        "data_types": {"grad_accum_dtype": "fp32"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    with private_api.zero1_keeps_its_optimizer():
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
    private_api.overlap_zero1_reduction(engine)
    for i in range(2):
        model.use_side = i == 0
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(i)).bfloat16()
        engine.backward(engine(x).loss)
        if i == 0:
            engine.step()  # a micro-step
    grads = torch.cat([g.flatten() for g in private_api.reduced_gradient_partitions(engine.optimizer)])
    engine.step()
    return grads


def test_overlapped_zero1_reduces_the_steps_sum_over_several_buckets(world):
    """DeepSpeed's overlapped stage 1, corrected: the two micro-batches' sum (a bucket per layer, the side layer
    used by the first micro-batch only), exactly what the reduction after the backward hands the optimizer.
    Uncorrected, the hooks reduced micro-batch 1 alone and the side layer never."""
    assert private_api.deepspeed_version_unchecked_for_overlap() is None  # else the corrections are refused
    plain = _zero1_step_gradient(overlap=False)
    assert plain.abs().sum() > 0
    assert torch.equal(_zero1_step_gradient(overlap=True), plain)


def test_torch_optimizer_step_is_held_back_too(world):
    engine, model = _engine(0, None)
    assert private_api.inner_optimizer(engine) is engine.optimizer  # no wrapper at ZeRO 0 in fp32
    assert private_api.zero_fp32_partitions(engine) is None and private_api.zero_weight_buffers(engine) is None
    assert private_api.reduced_gradient_partitions(engine.optimizer) is None  # gradients live in p.grad
    _backward(engine, 0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert private_api.step_without_update(engine)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert "step" not in vars(engine.optimizer)  # the shadowing no-op is gone again
    _backward(engine, 1)
    engine.step()
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())


def test_weight_buffers_and_the_step_without_its_gather(expert_groups):
    """ZeRO 1's flat bf16 buffers hold every parameter of their group within the partitions of their group's
    ranks; with the gather replaced, an applied step asks for it once (`gather()`, after `before_step()`), a step
    held back does not, and the weights a world of one ends with are the plain step's, bit for bit (its single
    partition is the whole buffer: the step itself writes it)."""
    from deepspeed.runtime.zero import stage_1_and_2

    _, edp = expert_groups
    trained = {}
    for replaced in (False, True):
        with private_api.zero1_keeps_its_optimizer():
            engine, model = _engine(1, GROUP, bf16=True)
        buffers = private_api.zero_weight_buffers(engine)
        assert buffers is not None and {id(p) for b in buffers for p in b.params} == {id(p) for p in model.parameters()}
        assert any(b.group is edp for b in buffers) and any(b.group is not edp for b in buffers)
        for b in buffers:
            assert b.flat.dtype == torch.bfloat16 and b.partition_numel * dist.get_world_size(b.group) == b.flat.numel()
            start, size = b.flat.data_ptr(), b.flat.element_size()
            for p in b.params:
                assert start <= p.data_ptr() and p.data_ptr() + p.numel() * size <= start + b.flat.numel() * size
        calls = []
        plain_gather = stage_1_and_2.all_gather_dp_groups
        if replaced:
            private_api.replace_zero_weight_gather(
                engine,
                gather=functools.partial(calls.append, "gather"),
                before_step=functools.partial(calls.append, "before"),
            )
        for seed in range(2):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed)).bfloat16()
            engine.backward(engine(x))
            if seed == 0:
                engine.step()
            else:
                assert private_api.step_without_update(engine)
            assert stage_1_and_2.all_gather_dp_groups is plain_gather  # put back after each step
        assert calls == (["before", "gather", "before"] if replaced else [])
        trained[replaced] = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert all(torch.equal(trained[True][n], trained[False][n]) for n in trained[False])


def test_declared_deepspeed_is_the_checked_one_and_installed():
    """pyproject.toml admits exactly the DeepSpeed release private_api was checked against (a range would let a
    fresh install pick a version the overlaps refuse), and that is the one installed."""
    from importlib.metadata import version

    from packaging.requirements import Requirement

    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (req,) = [r for r in map(Requirement, declared) if r.name == "deepspeed"]
    assert [(s.operator, s.version) for s in req.specifier] == [("==", private_api.CHECKED_AGAINST["deepspeed"])]
    assert req.specifier.contains(version("deepspeed"))
    assert private_api.deepspeed_version_unchecked_for_overlap() is None


# ------------------------------------------------------------------------------ DeepSpeed internals elsewhere


# DeepSpeed's marks on parameters besides its `ds_*` ones (ZeRO 3's, the pipeline engine's): ZeRO 1/2's mapping
PARAMETER_MARKS = {"_hp_mapping"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _internal(path: str) -> bool:
    """A dotted DeepSpeed path that is no public API: under deepspeed.runtime or deepspeed.utils.groups (the expert
    group registries), or through a `_` name."""
    parts = path.split(".")
    return "runtime" in parts or parts[:3] == ["deepspeed", "utils", "groups"] or any(_private(p) for p in parts)


def _dotted(node: ast.AST) -> tuple[str, list[str]] | None:
    """`a.b.c` as ("a", ["b", "c"]); None for anything but names and attributes."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return (node.id, attrs[::-1]) if isinstance(node, ast.Name) else None


def deepspeed_reaches(source: str) -> list[str]:
    """Each reach into DeepSpeed internals in `source`, as "line: what": an import or attribute path of deepspeed
    through `runtime`, `utils.groups` or a `_` name; an assignment into a DeepSpeed module or class (patching it);
    a `_` attribute of an engine or optimizer, or an engine's method replaced; any attribute of the engine's
    optimizer wrapper (`engine.optimizer.x`, also through a name bound to it or getattr/setattr/hasattr); ZeRO's
    marks on parameters (`_hp_mapping`, `ds_*`). Public use passes: `import deepspeed`, deepspeed.initialize,
    deepspeed.utils.safe_get_full_*, engine.step(), handing `engine.optimizer` to a function, our own attributes on
    an engine. An engine (optimizer) is any name or attribute with "engine" ("optim") in it: a lint, not a proof."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    tree = ast.parse(source)
    bound: dict[str, str] = {}  # local name -> the DeepSpeed path it stands for
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "deepspeed":
                    bound[a.asname or "deepspeed"] = a.name if a.asname else "deepspeed"
                    if _internal(a.name):
                        found.append((node.lineno, f"imports {a.name}"))
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "deepspeed":
            for a in node.names:
                bound[a.asname or a.name] = f"{node.module}.{a.name}"
                if _internal(f"{node.module}.{a.name}"):
                    found.append((node.lineno, f"imports {node.module}.{a.name}"))

    def named(node, *words: str) -> bool:
        d = _dotted(node)
        return d is not None and any(w in (d[1][-1] if d[1] else d[0]).lower() for w in words)

    def engine(node) -> bool:
        return named(node, "engine")

    wrappers: set[str] = set()  # names bound to the engine's optimizer

    def wrapper(node) -> bool:  # DeepSpeed's optimizer wrapper: engine.optimizer, or a name bound to it
        if isinstance(node, ast.Name):
            return node.id in wrappers
        return isinstance(node, ast.Attribute) and node.attr == "optimizer" and engine(node.value)

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and wrapper(node.value):
            wrappers.update(t.id for t in node.targets if isinstance(t, ast.Name))
    for node in ast.walk(tree):
        stores = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            stores = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
            obj, name = node.args[0], node.args[1] if len(node.args) > 1 else None
            name = name.value if isinstance(name, ast.Constant) and isinstance(name.value, str) else None
            if node.func.id in ("getattr", "setattr", "hasattr", "delattr") and name is not None:
                if wrapper(obj):
                    found.append((node.lineno, f"{node.func.id}(engine.optimizer, {name!r})"))
                elif named(obj, "engine", "optim") and _private(name):
                    found.append((node.lineno, f"{node.func.id}({ast.unparse(obj)}, {name!r})"))
                elif name in PARAMETER_MARKS or name.startswith("ds_"):
                    found.append((node.lineno, f"{node.func.id}(..., {name!r}): DeepSpeed's parameter attribute"))
            if node.func.id in ("setattr", "delattr"):
                stores = [ast.Attribute(value=obj, attr=name or "?", lineno=node.lineno)]
        while any(isinstance(t, (ast.Tuple, ast.List, ast.Starred)) for t in stores):  # a, b.c = ...
            stores = [e for t in stores for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])]
            stores = [t.value if isinstance(t, ast.Starred) else t for t in stores]
        for target in stores:
            if not isinstance(target, ast.Attribute):
                continue
            d = _dotted(target)
            if d is not None and d[0] in bound:
                found.append((node.lineno, f"patches {'.'.join([bound[d[0]], *d[1]])}"))
            elif engine(target.value) and hasattr(DeepSpeedEngine, target.attr):
                found.append((node.lineno, f"replaces engine.{target.attr}"))
        if isinstance(node, ast.Attribute):
            d = _dotted(node)
            if d is not None and d[0] in bound and _internal(".".join([bound[d[0]], *d[1]])):
                found.append((node.lineno, f"uses {'.'.join([bound[d[0]], *d[1]])}"))
            elif wrapper(node.value):
                found.append((node.lineno, f"engine.optimizer.{node.attr}"))
            elif named(node.value, "engine", "optim") and _private(node.attr):
                found.append((node.lineno, f"{ast.unparse(node.value)}.{node.attr}"))
            elif node.attr in PARAMETER_MARKS or node.attr.startswith("ds_"):
                found.append((node.lineno, f".{node.attr}: DeepSpeed's parameter attribute"))
    return [f"{line}: {what}" for line, what in sorted(set(found))]


def test_the_reach_scan_flags_internals_and_passes_public_use():
    reaches = """
from deepspeed.runtime.zero import stage_1_and_2
import deepspeed
from deepspeed.utils import groups
stage_1_and_2.all_gather_dp_groups = lambda **kw: None
opt = engine.optimizer
opt.step = step
x = engine.optimizer.bit16_groups_flat
y = getattr(engine.optimizer, "optimizer", None)
engine._backward_prologue()
engine.backward = backward
z = deepspeed.runtime.zero.stage_1_and_2
groups._EXPERT_PARALLEL_GROUP["x"] = g
deepspeed.comm._x = 1
engine.backward, other = backward, 1
optimizer._hp_optimizer_states_linked = False
partitioned = hasattr(p, "_hp_mapping") or p.ds_pipe_replicated
"""
    got = deepspeed_reaches(reaches)
    assert sorted({int(r.split(":")[0]) for r in got}) == [2, 4, 5, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], got
    assert "5: patches deepspeed.runtime.zero.stage_1_and_2.all_gather_dp_groups" in got
    assert "11: replaces engine.backward" in got and "7: engine.optimizer.step" in got
    public = """
import deepspeed
from deepspeed.utils import safe_get_full_fp32_param
engine, *_ = deepspeed.initialize(model=m, optimizer=o, config=c)
deepspeed.init_distributed(dist_backend="gloo")
engine.backward(engine(x))
engine.step()
ok = engine.was_step_applied() and engine.is_gradient_accumulation_boundary()
partitions = private_api.reduced_gradient_partitions(engine.optimizer)
zero = isinstance(engine.optimizer, object)
engine.deferred_gather = None
engine.deferred_gather.wait_all()
print(deepspeed.__version__, safe_get_full_fp32_param(p), engine.module)
inner_optimizer(engine).state[p]["exp_avg"].zero_()
owner._parameters["w"] = p
"""
    assert deepspeed_reaches(public) == []


PRIVATE_API = REPO / "moe_dist/parallel/private_api"


def _reaches_outside_private_api(sources: dict[Path, str]) -> list[str]:
    """Each reach into DeepSpeed internals of `sources` (path -> text) in a file outside the private_api package."""
    return [
        f"{f.relative_to(REPO)}:{r}"
        for f, text in sources.items()
        if PRIVATE_API not in f.parents
        for r in deepspeed_reaches(text)
    ]


def test_nothing_but_private_api_reaches_into_deepspeed():
    """Every DeepSpeed internal moe_dist uses goes through the private_api package, where each function's docstring
    says what breaks when it moves: no other file of moe_dist/, kernels/, launch/ or benchmarks/ reaches one."""
    files = [f for d in ("moe_dist", "kernels", "launch", "benchmarks") for f in sorted((REPO / d).rglob("*.py"))]
    assert any(f.name == "param_gather.py" for f in files) and len(files) > 50
    sources = {f: f.read_text() for f in files}
    # The scan sees the package's own reaches: the exclusion by path is what lets them through.
    flagged = {f.name for f, text in sources.items() if PRIVATE_API in f.parents and deepspeed_reaches(text)}
    assert flagged >= {"groups.py", "zero.py", "zero_overlap.py", "pipeline.py"}, flagged
    # The same code anywhere else is reported: beside the package, in another module, in a package named alike.
    zero = sources[PRIVATE_API / "zero.py"]
    elsewhere = ["moe_dist/parallel/private_api.py", "moe_dist/parallel/mesh.py", "moe_dist/train/private_api/zero.py"]
    for path in elsewhere:
        assert _reaches_outside_private_api({REPO / path: zero}), path
    reaches = _reaches_outside_private_api(sources)
    assert not reaches, f"DeepSpeed internals outside moe_dist/parallel/private_api/: {reaches}"
