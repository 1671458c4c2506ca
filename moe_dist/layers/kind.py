"""What the rest of the system asks of a layer kind, declared by the kind beside its math.

A `LayerKind` is one mixer (attention, Mamba-1, Mamba-2, Gated DeltaNet, ...) or FFN (dense, MoE) as the decoder,
activation checkpointing, tensor parallelism, the memory plan, the performance model and the config checks see it.
Each layer file ends with its `KIND`; `layers/registry.py` maps the kind names of the layer list to them. Nothing
outside a kind's file (and its Hugging Face mappers) names the kind: adding one is a layer file and a registry line.

`TensorSplit` is the tensor-parallel seam: the interface a kind's TP rule receives. The layers own it; its
implementation, with the collectives, lives in parallel/tensor_parallel.py. A rule changes the module in place:
it shards parameters (rank's rows of each block), marks the module a TP region, and wraps what needs a collective
in the calls below, so the layer's own forward stays single-device math.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Protocol

import torch
from torch import nn

from moe_dist.config.errors import require

if TYPE_CHECKING:
    from moe_dist.config.schema import JobConfig, ModelConfig

Parts = int | tuple[int, ...]  # a sharded dim's blocks: n equal ones, or their sizes (each block split alone)


class TensorSplit(Protocol):
    """This rank's place in the tensor-parallel group, and the operations a kind's TP rule may use."""

    tp: int  # the group's size
    rank: int  # this rank's index in it
    experts_split: bool  # MoE experts are split over the group (etp = tp), or whole on each rank (etp = 1)

    def shard(self, module: nn.Module, name: str, dim: int, parts: Parts = 1) -> None:
        """Replace module.<name> by this rank's 1/tp of each block of `dim` (marked for checkpoints and the norm)."""

    def region(self, module: nn.Module) -> None:
        """The module's first input enters the TP region (copy, or sequence all-gather) and its output leaves it
        (sum, or reduce-scatter); an output (tensor, extra) leaves by its tensor."""

    def sum_grad(self, param: nn.Parameter) -> None:
        """A replicated parameter whose gradient each rank has only part of: summed over the group."""

    def model_parallel(self, param: nn.Parameter) -> None:
        """A parameter that differs per rank without a TP dim (another rank's whole experts): counted once each."""

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Identity forward, gradient summed over the group (a replicated activation used by every rank's part)."""

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group forward, identity backward (partial results of every rank's part)."""

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """All-gather along `dim` in rank order; backward returns each rank its slice of the summed gradient."""

    def scale_grad(self, x: torch.Tensor, factor: float) -> torch.Tensor:
        """Identity forward; the gradient multiplied by `factor` (a replicated input whose gradient is summed)."""


@dataclass(frozen=True)
class LayerKind:
    """One layer kind's description. Per-token figures are per token of one rank's micro-batch, at `tp` ranks of
    tensor parallelism and `cp` of context parallelism; `a` is the activation dtype's bytes."""

    name: str  # its name in the layer list ("attention", "mamba2", "moe")
    config: Optional[type]  # the dataclass of its settings, `model.<section>` (None: it reads the model's keys)
    role: Literal["mixer", "ffn"]
    module: type[nn.Module]  # what `build` returns (the registry finds a module's kind by its class)
    build: Callable[[ModelConfig, Any], nn.Module]  # (model config, device kernels are chosen for) → module
    part: str  # its name in train.checkpoint_parts (an MoE layer's recompute covers its experts only)
    section: Optional[str] = None  # the model config's section of its settings (`model.<section>`)
    letter: Optional[str] = None  # its letter in model.mixer_pattern / model.ffn_pattern
    doc: str = ""  # one line for the config reference
    # Config rules (one-line ConfigErrors naming the key): `check(job, placed)` runs for every kind, its section's own
    # rules always (the defaults pass them) and those that relate it to the model where a layer `placed` it;
    # `check_tp` where a layer places it and parallel.tp > 1.
    check: Optional[Callable[[JobConfig, bool], None]] = None
    check_tp: Optional[Callable[[JobConfig], None]] = None
    tp_rule: Optional[Callable[[nn.Module, TensorSplit], None]] = None  # None: no tensor parallelism
    prefix_lm: Callable[[ModelConfig], bool] = lambda m: (
        False
    )  # whether it reads the prefix-LM mask (the trainer passes it)
    compilable: bool = False  # static shapes: train.compile may torch.compile it (not data-dependent rows or scans)
    # The slow paths the module built for `device` takes in the run `job` (start-up warns of each): (job, module,
    # device) → reasons.
    slow_paths: Callable[[JobConfig, nn.Module, torch.device], list[str]] = lambda cfg, module, device: []
    # Inference state for incremental decoding: (module, batch, max_len, device, dtype) → state (None: stateless).
    new_state: Optional[Callable[[nn.Module, int, int, torch.device, torch.dtype], Any]] = None
    # Forward FLOPs per token beyond the weights' matmuls (attention scores, scans), sequence length S.
    flops_per_token: Callable[[ModelConfig, int], float] = lambda m, S: 0.0
    # Bytes autograd keeps inside the sublayer per token (beyond its input norm), by (job, tp, cp, a).
    activation_bytes: Callable[[JobConfig, int, int, int], float] = lambda cfg, tp, cp, a: 0.0
    # Bytes per position of the whole sequence that the kind gathers under context parallelism and keeps for the
    # backward (attention's keys and values; a recurrent kind's per-piece summaries are O(state), not per position).
    cp_gathered_bytes: Callable[[ModelConfig, int, int], float] = lambda m, tp, a: 0.0
    # Collectives the kind's own forward issues per micro-batch, beyond its TP region's boundaries: (job, tp, cp,
    # tokens per micro-batch, a) → [(collective, label, "tp" | "cp", payload bytes, times per forward, times per
    # backward)]; a forward's are issued again where the kind is recomputed.
    collectives: Callable[[JobConfig, int, int, int, int], list[tuple[str, str, str, float, int, int]]] = (
        lambda cfg, tp, cp, tokens, a: []
    )


def divides(value: int, key: str, what: str, tp: int) -> None:
    """The tensor-parallel rule of a split dimension, as a one-line ConfigError naming the key."""
    require(value % tp == 0, f"{key}: {what} {value} is not divisible by parallel.tp={tp}")


def piece_collectives(micro_batch_size: int, cp: int, summary: float, halo: float) -> list:
    """A recurrent kind's state passing under CP (`collectives`' form): every piece's summary and conv halo, bytes
    per piece of one sequence, all-gathered in its forward; their gradients reduce-scattered in its backward."""
    calls = []
    for label, per_piece in (("cp_state", summary), ("cp_halo", halo)):
        payload = 2 * cp * micro_batch_size * per_piece  # every piece of the micro-batch's sequences
        calls += [("all_gather", label, "cp", payload, 1, 0), ("reduce_scatter", label, "cp", payload, 0, 1)]
    return calls
