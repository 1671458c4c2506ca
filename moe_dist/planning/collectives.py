"""The communication side of the performance model: collectives' α–β cost on a cluster's links.

One (α, β) pair for links inside a node and one across nodes; textbook collective algorithms (a ring for
all-reduce, reduce-scatter, all-gather; pairwise for all-to-all; a tree for tiny all-reduces where the hardware
says NCCL takes one). `Call` is one collective of a step as workload.py lists them; the fit of α and β to measured
runs is fit.py's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KINDS = ("all_to_all", "all_reduce", "reduce_scatter", "all_gather", "other")
SCALAR_ALL_REDUCES_PER_STEP = 5  # gradient-norm pieces and the metrics vector (measured: 4-6 tiny calls)

# --------------------------------------------------------------------------------------------- collectives


def collective_terms(kind: str, n: int, payload_bytes: float) -> tuple[int, float]:
    """(latency hops, bytes each rank sends) of one collective on n ranks.

    payload_bytes: all-reduce — the buffer; all-gather — the gathered (output) buffer; reduce-scatter — the
    input buffer; all-to-all — what this rank holds for all destinations (its own share stays local);
    other (broadcast, barrier) — the buffer, sent once along a tree.
    """
    if n <= 1:
        return 0, 0.0
    if kind == "all_reduce":  # ring: reduce-scatter then all-gather
        return 2 * (n - 1), 2.0 * (n - 1) / n * payload_bytes
    if kind in ("reduce_scatter", "all_gather", "all_to_all"):
        return n - 1, (n - 1) / n * payload_bytes
    if kind == "other":
        return math.ceil(math.log2(n)), float(payload_bytes)
    raise ValueError(f"unknown collective kind {kind!r}")


@dataclass(frozen=True)
class Link:
    alpha_s: float  # latency per hop (message), seconds
    beta_Bps: float  # bandwidth per rank, bytes/second

    def time(self, hops: float, wire_bytes: float) -> float:
        return hops * self.alpha_s + wire_bytes / self.beta_Bps


@dataclass(frozen=True)
class Hardware:
    name: str
    flops_per_s: float  # sustained rate on the FLOPs a device runs (peak × a share on a GPU; fitted on a CPU)
    ranks_per_node: int
    intra: Link  # inside a node (NVLink; loopback on one CPU machine)
    inter: Link  # across nodes (InfiniBand; the veth links between network namespaces)
    memory_bytes: float | None = None  # device memory, for the fit check of a layout
    peak_flops_per_s: float | None = None  # for reporting MFU
    tree_all_reduce: bool = False  # tiny all-reduces take a tree's 2·⌈log2 n⌉ hops (NCCL picks it), not a ring's


# Overlap windows a call can hide behind (predict_step): the backward of the step's last micro-batch (the gradient
# reduction's buckets are issued as that backward produces them) and the forward of the next step's first
# micro-batch (the updated parameters' all-gather, where the caller asks for it: `overlap_param_gather`).
LAST_BACKWARD, NEXT_FORWARD = "last_backward", "next_forward"


@dataclass(frozen=True)
class Call:
    """One collective issued `count` times per step by every rank of its group."""

    kind: str
    label: str  # what it moves: "moe_rows", "moe_counts", "tp_act", "dense_grad", "expert_param", "cp_kv", ...
    group_size: int
    ranks_per_node: int  # ranks of the group on one node (== group_size when it stays inside a node)
    payload_bytes: float
    count: float
    hides_behind: str | None = None  # LAST_BACKWARD / NEXT_FORWARD: asynchronous, overlaps that compute
    tree: bool = False  # a latency-bound all-reduce of a few bytes: a tree where `Hardware.tree_all_reduce`

    @property
    def spans_nodes(self) -> bool:
        return self.ranks_per_node < self.group_size


def call_time(call: Call, hw: Hardware) -> float:
    """Seconds for one instance of `call`: α per hop plus the bytes over the slowest link they cross."""
    hops, wire = collective_terms(call.kind, call.group_size, call.payload_bytes)
    if call.tree and hw.tree_all_reduce:
        hops = min(hops, 2 * math.ceil(math.log2(call.group_size)))
    if not call.spans_nodes:
        return hw.intra.time(hops, wire)
    n, g = call.group_size, call.ranks_per_node
    if call.kind == "all_to_all":  # a (g-1)/n share stays in the node, (n-g)/n crosses it, concurrently
        intra = call.payload_bytes * (g - 1) / n
        inter = call.payload_bytes * (n - g) / n
        return hops * hw.inter.alpha_s + max(intra / hw.intra.beta_Bps, inter / hw.inter.beta_Bps)
    # A ring spanning nodes moves at the pace of its slowest edge (one NIC per rank: NCCL's rings use them all).
    return hops * hw.inter.alpha_s + wire / min(hw.intra.beta_Bps, hw.inter.beta_Bps)


def bottleneck_features(
    kind: str, n: int, g: int, payload_bytes: float, wire_bytes: float | None = None
) -> tuple[float, float]:
    """(hops, bytes) whose α–β cost `call_time` charges to the slower link: the regression features of a fit.

    wire_bytes overrides the bytes a rank sends (an uneven all-to-all measured exactly).
    """
    hops, wire = collective_terms(kind, n, payload_bytes)
    if wire_bytes is not None:
        wire = wire_bytes
    if g < n and kind == "all_to_all" and n > 1:
        wire = wire * (n - g) / (n - 1)  # the inter-node share of what this rank sends
    return hops, wire


# Published figure (NVIDIA H200 Tensor Core GPU datasheet, SXM): BF16 Tensor Core 1,979 TFLOPS *with sparsity*,
# i.e. 989 TFLOPS dense. The cluster around it: cluster.py.
H200_BF16_DENSE_PEAK = 989e12
