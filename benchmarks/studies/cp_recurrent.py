"""Context parallelism of the recurrent mixers by state passing: per-rank compute and bytes per layer.

    python -m benchmarks.studies.cp_recurrent time --seq 4096     # per-rank CPU time at cp = 1, 2, 4; wall at cp <= 2
    python -m benchmarks.studies.cp_recurrent bytes --seqs 1024 4096 16384   # bytes per layer per rank at cp = 2, 4

Each cp runs in its own gloo world of cp processes on this machine (spawned here, a free port each), every rank
with one thread (torch.set_num_threads(1)). The layers are one Mamba-1, one Mamba-2 and one Gated DeltaNet mixer
of a small model (d_model 256, fp32; shapes in `build`), the same weights on every rank; cp = 1 is the layer
without a shard (the single-process path). Batch 1, total sequence S for every cp.

`time`: per rank, the CPU time of this rank's thread (time.thread_time: compute only, not the gloo threads nor the
waits) of forward + backward of each layer, the minimum over `--reps` after one warm-up, then the maximum over the
ranks; and the wall time (time.perf_counter from a barrier to the end of the rank's backward, the slowest rank's)
for cp <= 2, where every rank has a core of its own on a 2-core machine: inside the cp = 2 world, rank 0 also
times the layer on the whole sequence without a shard (cp = 1), alternating rep by rep with the cp = 2 runs, so
that both wall times see the same background load.

`bytes`: forward only, counting the tensors the layer hands to `SeqShard.gather_pieces` (the conv halo and the
summaries: the payload each rank contributes; an all-gather sends it to the cp − 1 others, and backward's
reduce-scatter moves the same bytes back). Beside it, the head-parallel all-to-all scheme (Megatron-Core, NeMo):
two all-to-alls of the layer's activations per direction, the in_proj output (B·S/cp·W_in) to heads and the mixer
output (B·S/cp·W_out) back to the sequence, of which each rank sends (cp − 1)/cp.
"""

from __future__ import annotations

import argparse
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_dist.config import GDNConfig, Mamba2Config, MambaConfig
from moe_dist.layers.gdn import GatedDeltaNet
from moe_dist.layers.mamba import Mamba
from moe_dist.layers.mamba2 import Mamba2
from moe_dist.layers.sequence_shard import SeqShard
from moe_dist.parallel.context_parallel import seq_shard

D_MODEL = 256
KINDS = ("mamba", "mamba2", "gdn")


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "mamba":  # d_inner 512, d_state 16
        layer = Mamba(D_MODEL, MambaConfig(impl="torch"), 1e-5, 0.02)
    elif kind == "mamba2":  # 8 heads of 64, d_state 64, 1 group
        layer = Mamba2(D_MODEL, Mamba2Config(d_state=64, impl="torch"), 1e-5, 0.02)
    else:  # 2 key heads, 4 value heads, 64 × 64 states
        layer = GatedDeltaNet(D_MODEL, GDNConfig(impl="torch"), 1e-5, 0.02)
    layer.init_weights()
    return layer


def widths(layer: torch.nn.Module) -> tuple[int, int]:
    """(W_in, W_out): the channels the head-parallel scheme moves in (in_proj output) and out (mixer output)."""
    if isinstance(layer, GatedDeltaNet):
        return layer.in_proj_qkvz.out_features + layer.in_proj_ba.out_features, layer.value_dim
    return layer.in_proj.out_features, layer.d_inner


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, cp: int, port: int, mode: str, seqs: list[int], reps: int, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cp)
    payloads: list[int] = []
    gather_pieces = SeqShard.gather_pieces

    def counted(self, summary):
        payloads.append(summary.numel() * summary.element_size())
        return gather_pieces(self, summary)

    SeqShard.gather_pieces = counted  # this process only: count what each layer exchanges
    result = {}
    for kind in KINDS:
        layer = build(kind)
        for seq in seqs:
            shard = seq_shard(dist.group.WORLD, cp, rank, seq) if cp > 1 else None
            x = torch.randn(1, seq, D_MODEL, generator=torch.Generator().manual_seed(seq))
            x = x if shard is None else shard.local(x)
            kw = {} if shard is None else {"shard": shard}
            if mode == "bytes":
                payloads.clear()
                with torch.no_grad():
                    layer(x, **kw)
                result[(kind, seq)] = (list(payloads), widths(layer))
                continue
            whole = torch.randn(1, seq, D_MODEL, generator=torch.Generator().manual_seed(seq))
            cpu, wall, wall_whole = [], [], []
            for _ in range(reps + 1):
                if cp == 2:  # the one-process run, interleaved rep by rep so both see the same machine load
                    dist.barrier()
                    if rank == 0:
                        w0 = time.perf_counter()
                        _step(layer, whole, {})
                        wall_whole.append(time.perf_counter() - w0)
                dist.barrier()
                t0, w0 = time.thread_time(), time.perf_counter()
                _step(layer, x, kw)
                cpu.append(time.thread_time() - t0)
                wall.append(time.perf_counter() - w0)
            result[(kind, seq)] = (min(cpu[1:]), min(wall[1:]), min(wall_whole[1:]) if wall_whole else None)
    queue.put((rank, result))
    dist.barrier()
    dist.destroy_process_group()


def _step(layer: torch.nn.Module, x: torch.Tensor, kw: dict) -> None:
    """Forward and backward of one layer on a fresh leaf input."""
    layer.zero_grad(set_to_none=True)
    layer(x.clone().requires_grad_(), **kw).square().mean().backward()


def run_world(cp: int, mode: str, seqs: list[int], reps: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, cp, port, mode, seqs, reps, queue)) for r in range(cp)]
    for p in procs:
        p.start()
    results = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"cp={cp}: a rank exited with {p.exitcode}")
    return [results[r] for r in range(cp)]


def report_time(seq: int, reps: int) -> None:
    cpu, wall = {}, {}
    for cp in (1, 2, 4):
        ranks = run_world(cp, "time", [seq], reps)
        for kind in KINDS:
            cpu.setdefault(kind, []).append(max(r[(kind, seq)][0] for r in ranks))
            if cp == 2:  # (one process on the whole sequence, the slowest of the 2 ranks), from the same world
                wall[kind] = ranks[0][(kind, seq)][2], max(r[(kind, seq)][1] for r in ranks)
    print(f"S = {seq}, batch 1, forward + backward, one thread per rank (min of {reps}, slowest rank)\n")
    print("| mixer | CPU s/rank cp=1 | cp=2 | cp=4 | cp=2 / cp=1 | cp=4 / cp=1 | wall s cp=1 | wall s cp=2 |")
    print("|---|---|---|---|---|---|---|---|")
    for kind in KINDS:
        (c1, c2, c4), (w1, w2) = cpu[kind], wall[kind]
        print(f"| {kind} | {c1:.3f} | {c2:.3f} | {c4:.3f} | {c2 / c1:.2f} | {c4 / c1:.2f} | {w1:.3f} | {w2:.3f} |")


def report_bytes(seqs: list[int]) -> None:
    print("Bytes per layer per rank, forward (backward's reduce-scatter moves the same), fp32 activations, batch 1\n")
    print("| mixer | S | cp | gathers | payload B/rank (halo + summary) | sent B/rank | head-parallel a2a B/rank |")
    print("|---|---|---|---|---|---|---|")
    for cp in (2, 4):
        ranks = run_world(cp, "bytes", seqs, 1)
        for kind in KINDS:
            for seq in seqs:
                payloads, (w_in, w_out) = ranks[0][(kind, seq)]
                sent = (cp - 1) * sum(payloads)
                a2a = (seq // cp) * (w_in + w_out) * 4 * (cp - 1) // cp
                parts = " + ".join(str(p) for p in payloads)
                print(f"| {kind} | {seq} | {cp} | {len(payloads)} | {parts} | {sent} | {a2a} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["time", "bytes"])
    parser.add_argument("--seq", type=int, default=4096, help="time: the total sequence length")
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096, 16384], help="bytes: sequence lengths")
    parser.add_argument("--reps", type=int, default=3, help="time: timed repetitions after one warm-up")
    args = parser.parse_args()
    if args.mode == "time":
        report_time(args.seq, args.reps)
    else:
        report_bytes(args.seqs)


if __name__ == "__main__":
    main()
