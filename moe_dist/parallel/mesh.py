"""Process start-up and the parallel layout: world = pp × dp × cp × tp, with ep dividing dp × cp, or dp × cp × tp when
the experts are whole (`parallel.etp` = 1).

Pipeline stages are the outermost dimension: pipeline rank p holds the ranks p · S … (p + 1) · S − 1, S = world / pp,
and every other group lies inside one stage (an EP group never straddles stages), laid out there as below. The pp
group of a rank links the ranks at its position in every stage.

Invariants: ranks are tp-innermost, then cp, then dp: rank = (dp_rank · cp + cp_rank) · tp + tp_rank (a TP group is
`tp` neighbouring ranks, a CP group the `cp` ranks of one dp_rank and tp_rank, inside a node while cp · tp ≤ its
GPUs). CP ranks hold the same weights and see the same micro-batches (each its pieces of every sequence), so
for everything weights-related they are data-parallel replicas: dense parameters keep the (replica, tp) layout
with dp × cp replicas (`Mesh.replicas`, the ZeRO group), and with etp = tp the EP groups are blocks of `ep`
consecutive replicas inside one tp_rank, with etp = 1 blocks of `ep` consecutive global ranks (ep_rank = rank
mod ep), and the EDP groups stride across them. Every group is created here, in the same order on every rank,
the expert groups registered under DeepSpeed's names through private_api/groups.py; the handles live in the Mesh object,
never in module globals. Layouts with examples: docs/parallelism.md, sections "The mesh", "Expert parallelism
folded across TP" and "Context parallelism".
"""

from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from moe_dist.config import ConfigError, JobConfig
from moe_dist.config.parallel_checks import check_layout
from moe_dist.layers.sequence_shard import SeqShard
from moe_dist.parallel import private_api
from moe_dist.parallel.context_parallel import seq_shard


@dataclass(frozen=True)
class DedupGroups:
    """This rank's place in the deduplicated dispatch (`parallel.a2a_dedup`, parallel/dedup.py): the EP group is
    `blocks` blocks of `size` consecutive EP ranks; `rail` links the ranks at this rank's `position` in every block
    (group-rank order = block order), `block` the ranks of this rank's block `index` (None when size is 1)."""

    rail: dist.ProcessGroup
    blocks: int
    index: int
    block: dist.ProcessGroup | None
    size: int
    position: int


@dataclass(frozen=True)
class Mesh:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    dp: int  # data-parallel degree
    dp_rank: int
    ep: int  # expert-parallel degree (divides dp)
    ep_rank: int  # position inside the EP group: which slice of the experts this rank holds
    ep_group: dist.ProcessGroup | None  # all-to-all group (None when ep == 1)
    edp_group: dist.ProcessGroup | None  # ranks holding the same experts; expert grads are reduced here
    ep_group_name: str  # DeepSpeed's name for the expert group ("ep_size_N")
    tp: int = 1  # tensor-parallel degree
    tp_rank: int = 0  # which shard of every tensor-parallel weight this rank holds
    tp_group: dist.ProcessGroup | None = None  # the `tp` neighbouring ranks (None when tp == 1)
    dp_group: dist.ProcessGroup | None = None  # ranks with this tp_rank (None when tp == 1: the world)
    etp: int | None = None  # expert tensor-parallel size: tp (None too: experts split over TP) or 1 (whole)
    ep_dedup: DedupGroups | None = None  # the deduplicated dispatch's groups (None: one row per assignment)
    cp: int = 1  # context-parallel degree: each sequence split over `cp` ranks
    cp_rank: int = 0  # which pieces of every sequence this rank holds (layers/sequence_shard.piece_chunks)
    cp_group: dist.ProcessGroup | None = None  # the `cp` ranks of this dp_rank and tp_rank (None when cp == 1)
    pp: int = 1  # pipeline-parallel degree: stages of the layer list, the outermost dimension
    pp_rank: int = 0  # which stage(s) this rank runs (stage s runs on pipeline rank s mod pp)
    pp_group: dist.ProcessGroup | None = None  # this rank's position in every stage (None when pp == 1)
    mp_group: dist.ProcessGroup | None = None  # pp > 1: the tp × pp ranks of this replica (DeepSpeed's model-parallel)
    embed_group: dist.ProcessGroup | None = None  # pp > 1, tied embeddings: this position of the first and last stage

    @property
    def replicas(self) -> int:
        """Ranks per tp_rank holding the same weights, dp × cp: the ZeRO and expert layouts' data-parallel size."""
        return self.dp * self.cp

    @property
    def replica_rank(self) -> int:
        """This rank's index among them, dp_rank · cp + cp_rank."""
        return self.dp_rank * self.cp + self.cp_rank

    def seq_shard(self, seq_len: int) -> SeqShard | None:
        """This rank's pieces of a micro-batch's sequences of `seq_len` positions; None without CP."""
        return None if self.cp == 1 else seq_shard(self.cp_group, self.cp, self.cp_rank, seq_len)

    @property
    def experts_split(self) -> bool:
        """Whether each TP rank holds a slice of its experts (etp = tp > 1) rather than whole experts."""
        return self.tp > 1 and self.etp != 1

    @property
    def mpu(self) -> "ModelParallelUnit | None":
        """What deepspeed.initialize needs to see the TP and pipeline layout (its data-parallel group excludes TP
        peers and other stages; it holds the dp × cp replicas of one stage). Without either the replicas are the
        world, DeepSpeed's default group."""
        return ModelParallelUnit(self) if self.tp > 1 or self.pp > 1 else None


class ModelParallelUnit:
    """The Megatron-style `mpu` interface DeepSpeed queries: the TP group is its tensor-parallel group, and the
    TP × pipeline ranks of one replica its model-parallel group (the TP group when pp = 1).

    ZeRO then reduces gradients over the DP group only, and its gradient norm sums over the model-parallel group
    the squares of parameters marked `model_parallel` (TP shards) on every TP rank and of the others (replicated
    over TP) on tp_rank 0 alone: each stage's parameters are counted once."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh

    def get_model_parallel_rank(self) -> int:
        return self.mesh.pp_rank * self.mesh.tp + self.mesh.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.mesh.pp * self.mesh.tp

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self.mesh.tp_group if self.mesh.pp == 1 else self.mesh.mp_group

    def get_tensor_model_parallel_rank(self) -> int:
        return self.mesh.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.mesh.tp

    def get_tensor_model_parallel_group(self) -> dist.ProcessGroup:
        return self.mesh.tp_group

    def get_data_parallel_rank(self) -> int:
        return self.mesh.replica_rank

    def get_data_parallel_world_size(self) -> int:
        return self.mesh.replicas

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.mesh.dp_group


def ep_layout(dp: int, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """(EP groups, EDP groups) as lists of dp ranks; pure index math."""
    ep_groups = [list(range(start, start + ep)) for start in range(0, dp, ep)]
    edp_groups = [list(range(pos, dp, ep)) for pos in range(ep)]
    return ep_groups, edp_groups


def layout_groups(
    dp: int, ep: int, tp: int, etp: int | None = None, cp: int = 1, pp: int = 1
) -> dict[str, list[list[int]]]:
    """Every group of the layout as lists of global ranks (rank = pp_rank · S + (dp_rank · cp + cp_rank) · tp +
    tp_rank, S = dp · cp · tp ranks per stage); pure index math. "dp" is the replica group of each tp_rank (dp × cp
    ranks: ZeRO's), "cp" the CP groups (cp > 1), "pp" (pp > 1) the ranks at one position of every stage.
    etp (default tp): experts split over TP, EP inside each tp_rank's replicas; 1: EP over consecutive ranks."""
    stage = _stage_groups(dp, ep, tp, etp, cp)
    if pp == 1:
        return stage
    size = dp * cp * tp
    groups = {kind: [[p * size + r for r in g] for p in range(pp) for g in gs] for kind, gs in stage.items()}
    groups["pp"] = [[p * size + r for p in range(pp)] for r in range(size)]
    groups["mp"] = [[p * size + r * tp + t for p in range(pp) for t in range(tp)] for r in range(dp * cp)]
    groups["embed"] = [[r, (pp - 1) * size + r] for r in range(size)]  # a tied embedding's two holders
    return groups


def _stage_groups(dp: int, ep: int, tp: int, etp: int | None, cp: int) -> dict[str, list[list[int]]]:
    """layout_groups of one stage (pipeline rank 0's ranks)."""
    cp_groups = [[(d * cp + c) * tp + t for c in range(cp)] for d in range(dp) for t in range(tp)]
    dp = dp * cp  # from here on: replicas, indexed by dp_rank · cp + cp_rank
    groups = {
        "tp": [[d * tp + t for t in range(tp)] for d in range(dp)],
        "dp": [[d * tp + t for d in range(dp)] for t in range(tp)],
        **({"cp": cp_groups} if cp > 1 else {}),
    }
    if etp == 1 and tp > 1:
        groups["ep"], groups["edp"] = ep_layout(dp * tp, ep)
        return groups
    ep_dp, edp_dp = ep_layout(dp, ep)
    groups["ep"] = [[d * tp + t for d in g] for t in range(tp) for g in ep_dp]
    groups["edp"] = [[d * tp + t for d in g] for t in range(tp) for g in edp_dp]
    return groups


def dedup_blocks(ep_ranks: list[int], local_world_size: int, unit: str) -> list[list[int]]:
    """The blocks of an EP group (its global ranks in EP order) for `parallel.a2a_dedup` `unit`: single ranks
    ("rank"), or each node's ranks ("node": rank // local_world_size), which must be consecutive in the group and
    equally many on every node. Pure index math; a ConfigError names the key otherwise."""
    if unit == "rank":
        return [[r] for r in ep_ranks]
    blocks: list[list[int]] = []
    for r in ep_ranks:
        if blocks and blocks[-1][0] // local_world_size == r // local_world_size:
            blocks[-1].append(r)
        else:
            blocks.append([r])
    nodes = [b[0] // local_world_size for b in blocks]
    if len(set(nodes)) != len(nodes) or len({len(b) for b in blocks}) != 1:
        raise ConfigError(
            f"parallel.a2a_dedup: 'node' needs the expert-parallel group's ranks in equal consecutive blocks per "
            f"node; group {ep_ranks} on nodes of {local_world_size} ranks has blocks {blocks}"
        )
    return blocks


def _dedup_groups(ep_groups: list[list[int]], local_world_size: int, unit: str, rank: int, ep_group):
    """Create the rails and blocks of every EP group (a collective: all ranks, same order); this rank's
    DedupGroups, or None where its EP group is one block (one node: nothing to deduplicate across)."""
    layout = [dedup_blocks(g, local_world_size, unit) for g in ep_groups]
    mine = next(blocks for blocks in layout if any(rank in b for b in blocks))
    index = next(i for i, b in enumerate(mine) if rank in b)
    size, position = len(mine[0]), mine[index].index(rank)
    if size == 1:  # a rail per EP group: the EP group itself; blocks of one rank need no group
        return DedupGroups(ep_group, len(mine), index, None, 1, 0)
    rail, _ = _new_groups([[b[j] for b in blocks] for blocks in layout for j in range(size)], rank)
    block, _ = _new_groups([b for blocks in layout for b in blocks], rank)
    return DedupGroups(rail, len(mine), index, block, size, position) if len(mine) > 1 else None


def ep_rank_of(rank: int, ep: int, tp: int, etp: int | None) -> int:
    """Position of global rank `rank` in its EP group (which slice of the experts it holds); etp None: tp."""
    return (rank if etp == 1 else rank // tp) % ep


def _new_groups(all_groups: list[list[int]], rank: int) -> tuple[dist.ProcessGroup, list[int]]:
    """Create every group of the list (a collective: all ranks, same order); return this rank's and its ranks."""
    mine = None
    for ranks in all_groups:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = (group, ranks)
    assert mine is not None, f"rank {rank} is in none of {all_groups}"
    return mine


def new_gloo_group(timeout_s: float) -> dist.ProcessGroup | None:
    """Collective (every rank, same point): a gloo group of the whole world with its own timeout, for host-side
    collectives that must not share the training groups' limit or stream (checkpoint saves); None alone."""
    if not dist.is_initialized():
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What an NCCL group's watchdog does when a collective fails or outlives its timeout (TORCH_NCCL_ASYNC_ERROR_HANDLING,
# read by each NCCL group when it is made). torch's default, 3, and torchrun's, 1, rethrow in the watchdog thread:
# the process ends with SIGABRT and a C++ log, never our one-line error. 2 aborts that group's communicators only:
# the hung kernels return, and the next collective on the group raises DistBackendError ("NCCL communicator was
# aborted ...") in the training thread, which guard.operation reports in one line (exit 1). Waits stay asynchronous
# (TORCH_NCCL_BLOCKING_WAIT would make every wait a host sync). docs/reliability.md, "Hangs and timeouts".
NCCL_ASYNC_ERROR_HANDLING = "2"


def set_nccl_error_handling() -> None:
    """Set at start-up, before the first group: ours replaces the launcher's (torchrun sets 1 for its workers)."""
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = NCCL_ASYNC_ERROR_HANDLING


def set_group_timeouts(timeout_s: float, keep: tuple = ()) -> None:
    """Give every process group this rank belongs to the collective timeout `timeout_s`.

    init_process_group applies it to the world group only: groups made later by `dist.new_group` get torch's
    default (30 minutes on gloo, 10 on NCCL), and DeepSpeed makes its expert and data-parallel groups that way, so
    a stopped rank would hang an expert all-to-all for half an hour. Call again after anything that makes groups
    (deepspeed.initialize). Groups in `keep` (the checkpoint group, with its own limit) are left as they are.
    """
    private_api.set_timeout_of_every_group(timedelta(seconds=timeout_s), keep)


@contextmanager
def group_timeouts(timeout_s: float, restore_s: float, keep: tuple = ()):
    """Every process group of this rank except those in `keep` times out after `timeout_s` inside the block; when
    the block ends, however it ends, every group but `keep` gets `restore_s`, groups made inside the block too.
    The one place a limit is set and restored (guard.operation applies it to the operation it names)."""
    set_group_timeouts(timeout_s, keep)
    try:
        yield
    finally:
        set_group_timeouts(restore_s, keep)


def _torchelastic_attempt_store(timeout: timedelta) -> dist.Store | None:
    """The rendezvous store for this torchrun attempt, namespaced by the restart count; None outside torchrun.

    torchrun's default (static) rendezvous hands every restart attempt the same TCPStore, hosted by the agent,
    with no per-attempt prefix: a restarted gloo group reads the dead attempt's addresses and hangs until the
    timeout. A prefix per attempt makes `torchrun --max-restarts N` restarts work (c10d rendezvous is fine either
    way).
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"moe_dist/attempt_{attempt}", client)


def _all_ranks_local() -> bool:
    """Whether the launcher started every rank on this node (deepspeed: CROSS_SIZE nodes; torchrun and
    accelerate: LOCAL_WORLD_SIZE of WORLD_SIZE)."""
    if "CROSS_SIZE" in os.environ:
        return os.environ["CROSS_SIZE"] == "1"
    return os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE")) == os.environ.get("WORLD_SIZE")


def _own_store(timeout: timedelta) -> dist.Store | None:
    """The rendezvous store when this job's rank 0 hosts it (the deepspeed launcher, or RANK/WORLD_SIZE/MASTER_*
    set by hand), listening on loopback when every rank is on this node, else on the launcher's MASTER_ADDR only.

    torch's TCPStore server listens on every interface, and nothing authenticates its clients; binding the socket
    ourselves and handing it over (master_listen_fd) keeps it off the other interfaces. Under torchrun the agent
    hosts the store (_torchelastic_attempt_store) and this is not used."""
    if "MASTER_ADDR" not in os.environ or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    host = "127.0.0.1" if _all_ranks_local() else os.environ["MASTER_ADDR"]
    port, rank, world = int(os.environ["MASTER_PORT"]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank != 0:
        return dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(address)
    listener.listen(1024)
    store = dist.TCPStore(host, port, world, is_master=True, timeout=timeout, master_listen_fd=listener.detach())
    return store


def _unlink_deepspeed_shm(rank: int, world_size: int) -> None:
    """Remove the name of this rank's DeepSpeed shared-memory all-reduce buffer once every rank has mapped it.

    On CPU, DeepSpeed's shm all-reduce (when all ranks are local) creates one /dev/shm buffer per rank in
    init_distributed (named as private_api.deepspeed_shm_buffer_name says), maps every peer's, and never unlinks
    them: 69 MB of RAM-backed tmpfs per rank outlive every run (22 GB after a few test runs filled this machine).
    After a barrier every rank has mapped every buffer, so the names can go; the mappings stay valid until the
    processes exit, killed or not.
    """
    if world_size == 1:
        return
    dist.barrier()  # every rank, whether or not DeepSpeed made a buffer: the same collectives everywhere
    Path("/dev/shm", private_api.deepspeed_shm_buffer_name(rank)).unlink(missing_ok=True)


def init_distributed(cfg: JobConfig, timeout_s: float | None = None) -> Mesh:
    """Join the process group the launcher describes (deepspeed, torchrun, accelerate), or form a world of one.

    Plain `python launch/train.py` sets no launcher variables; we fill them in for a single process so the
    same code path (and DeepSpeed) runs everywhere, and give that world of one an in-memory store: a TCP store
    would listen on every network interface for no one.
    """
    import deepspeed  # imported here: it probes the accelerator at import time

    alone = "RANK" not in os.environ
    if alone:
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
        )
    set_nccl_error_handling()  # on CPU runs too: harmless for gloo, and the start-up is the same everywhere
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s if timeout_s is not None else cfg.parallel.timeout_s)
        backend = "nccl" if cuda else "gloo"
        store = dist.HashStore() if alone else _torchelastic_attempt_store(timeout) or _own_store(timeout)
        if _all_ranks_local():
            # gloo listens on the host name's address unless told otherwise (its only knob is this variable,
            # read when each group is made): a job of one node needs no interface but loopback.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        if store is not None:
            dist.init_process_group(
                backend,
                store=store,
                rank=int(os.environ["RANK"]),
                world_size=int(os.environ["WORLD_SIZE"]),
                timeout=timeout,
            )
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout, auto_mpi_discovery=False)  # adopts it
    rank, world_size = dist.get_rank(), dist.get_world_size()
    _unlink_deepspeed_shm(rank, world_size)
    dp = check_layout(cfg, world_size)
    ep, tp, etp, cp, pp = cfg.parallel.ep, cfg.parallel.tp, cfg.parallel.expert_tp, cfg.parallel.cp, cfg.parallel.pp
    stage_rank = rank % (world_size // pp)  # the position inside this rank's stage, which the layout below indexes
    dp_rank = stage_rank // (tp * cp)
    name = f"ep_size_{ep}" if etp == tp else f"ep_size_{ep}_etp_{etp}"
    layout = layout_groups(dp, ep, tp, etp, cp, pp)
    tp_group = dp_group = ep_group = edp_group = cp_group = pp_group = mp_group = embed_group = None
    if pp > 1:
        pp_group, _ = _new_groups(layout["pp"], rank)
        mp_group, _ = _new_groups(layout["mp"], rank)
        for ranks in layout["embed"] if cfg.model.tie_embeddings else []:  # every rank makes every group
            group = dist.new_group(ranks)
            embed_group = group if rank in ranks else embed_group  # None on the middle stages' ranks
    if tp > 1:
        tp_group, _ = _new_groups(layout["tp"], rank)
    if tp > 1 or pp > 1:  # else the replicas are the world
        dp_group, _ = _new_groups(layout["dp"], rank)
    if cp > 1:
        cp_group, _ = _new_groups(layout["cp"], rank)
    if ep > 1:
        if private_api.expert_groups(name) is None:
            private_api.register_expert_groups(name, _new_groups(layout["ep"], rank), _new_groups(layout["edp"], rank))
        ep_group, edp_group = private_api.expert_groups(name)
    # torchrun and accelerate set LOCAL_WORLD_SIZE, the deepspeed launcher LOCAL_SIZE
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", world_size)))
    dedup = None
    if ep > 1 and cfg.parallel.a2a_dedup != "none":
        dedup = _dedup_groups(layout["ep"], local_world, cfg.parallel.a2a_dedup, rank, ep_group)
    set_group_timeouts(timeout_s if timeout_s is not None else cfg.parallel.timeout_s)
    return Mesh(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world,
        device=device,
        dp=dp,
        dp_rank=dp_rank,
        ep=ep,
        ep_rank=ep_rank_of(stage_rank, ep, tp, etp),
        ep_group=ep_group,
        edp_group=edp_group,
        ep_group_name=name,
        tp=tp,
        tp_rank=rank % tp,
        tp_group=tp_group,
        dp_group=dp_group,
        etp=etp,
        ep_dedup=dedup,
        cp=cp,
        cp_rank=(rank // tp) % cp,
        cp_group=cp_group,
        pp=pp,
        pp_rank=rank // (world_size // pp),
        pp_group=pp_group,
        mp_group=mp_group,
        embed_group=embed_group,
    )
