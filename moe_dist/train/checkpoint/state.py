"""What a rank holds, as a checkpoint sees it: its parameters under their global names (experts by global
index) and their fp32 values and Adam moments, read from (and created in) DeepSpeed's optimizer.

The names and full shapes are the same whatever the (dp, ep, tp) layout (`Stored.entry`), which is what makes
the checkpoint layout-independent and lets every rank compute the same writer plan (plan.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moe_dist.layers.experts import Experts
from moe_dist.parallel import private_api
from moe_dist.parallel.mesh import Mesh
from moe_dist.parallel.private_api import inner_optimizer
from moe_dist.parallel.tensor_parallel import Parts, gather_shards
from moe_dist.train.checkpoint.plan import MOMENTS, Entry


@dataclass
class Stored:
    param: nn.Parameter
    name: str  # the parameter's name (stacked expert weights: without the expert index)
    names: list[str]  # global tensor names: one, or one per local expert of a stacked expert parameter
    stacked: bool
    tp_dim: int | None = None  # the parameter's dim split over tensor-parallel ranks (apply_tp), if any
    tp_parts: Parts = 1  # blocks of that dim split separately (tensor_parallel.shard: Mamba in_proj's components)

    def whole(self, local: torch.Tensor, mesh: Mesh) -> torch.Tensor:
        """Collective over the TP group for a TP-sharded parameter: the full tensor from this rank's slice."""
        return local if self.tp_dim is None else gather_shards(local, mesh.tp_group, self.tp_dim, self.tp_parts)

    def full_shape(self, mesh: Mesh) -> tuple:
        """Shape of each stored tensor (one expert's, for a stacked parameter), whatever the TP layout."""
        shape = list(self.param.shape)
        if self.tp_dim is not None:
            shape[self.tp_dim] *= mesh.tp
        return tuple(shape[1:] if self.stacked else shape)

    def entry(self, mesh: Mesh) -> Entry:
        return Entry(self.name, self.full_shape(mesh), len(self.names) * mesh.ep if self.stacked else 0)


def stored_params(model: nn.Module, mesh: Mesh) -> list[Stored]:
    """This rank's parameters with their global names, in the same order on every rank."""
    experts = {id(p): m for m in model.modules() if isinstance(m, Experts) for p in m.parameters(recurse=False)}
    out = []
    for name, p in model.named_parameters():
        module = experts.get(id(p))
        tp = {"tp_dim": getattr(p, "tp_dim", None), "tp_parts": getattr(p, "tp_parts", 1)}
        if module is None:
            out.append(Stored(p, name, [name], False, **tp))
        else:
            names = [f"{name}.{module.expert_offset + j}" for j in range(p.shape[0])]
            out.append(Stored(p, name, names, True, **tp))
    return out


def pipeline_whole(model: nn.Module) -> tuple[list[Entry], dict[str, tuple], list[int]] | None:
    """Where `model` is this rank's pipeline part (parallel/pipeline.py): the whole model's entries, its buffers'
    shapes (built on the meta device from its config) and the stage cut; None for a whole model."""
    starts = getattr(model, "starts", None)
    if starts is None:
        return None
    from moe_dist.models.decoder import build_model
    from moe_dist.train.checkpoint.plan import model_entries

    whole = build_model(model.cfg)
    buffers = {name: tuple(b.shape) for name, b in stored_buffers(whole).items()}
    return model_entries(whole), buffers, starts


def stored_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Persistent buffers by global name (the routers' balancing state): replicated and identical on every rank,
    so rank 0 writes them and every rank reads them; they have no optimizer moments."""
    params = {name for name, _ in model.named_parameters()}
    return {name: t for name, t in model.state_dict(keep_vars=True).items() if name not in params}


def link_optimizer_state(engine) -> None:
    """(Re)build DeepSpeed's per-parameter views of the partitioned Adam state.

    ZeRO 1/2 links them once, right after the first parameter group's first step, when later groups have no
    state yet, and never again: their moments would then be unreachable. Linking once all state exists fixes it.
    """
    private_api.relink_zero_optimizer_state(engine.optimizer)


def full_state(engine, p: nn.Parameter, key: str) -> torch.Tensor:
    """fp32 value (key "param") or an Adam moment of one local parameter. Collective under ZeRO (over the
    parameter's data-parallel group): a fresh tensor there; without ZeRO the live one (copy before training on)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if private_api.has_partitioned_fp32_state(p):  # ZeRO 1/2: fp32 master weights and moments are partitioned
        return safe_get_full_fp32_param(p) if key == "param" else safe_get_full_optimizer_state(p, key)
    return p.detach().float() if key == "param" else inner_optimizer(engine).state[p][key]


def adam_step(engine) -> int:
    steps = [int(s["step"]) for s in inner_optimizer(engine).state.values() if "step" in s]
    return max(steps, default=0)


def ensure_optimizer_state(engine, adam_step: int) -> None:
    """Create Adam state where none exists yet (a fresh engine has none before its first step)."""
    inner = inner_optimizer(engine)
    flats = private_api.zero_fp32_partitions(engine)
    params = flats if flats is not None else [p for g in inner.param_groups for p in g["params"]]
    on_device = any(g.get("fused") or g.get("capturable") for g in inner.param_groups)
    for p in params:
        state = inner.state[p]
        for k in MOMENTS:
            state.setdefault(k, torch.zeros_like(p, memory_format=torch.preserve_format))
        # As torch's Adam creates it: fp32, on the parameter's device when fused/capturable (its kernels read it
        # there; a CPU step beside CUDA parameters fails the first fused step after a resume), else on the CPU.
        state["step"] = torch.tensor(float(adam_step), dtype=torch.float32, device=p.device if on_device else "cpu")
    link_optimizer_state(engine)
