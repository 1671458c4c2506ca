"""The one place that issues collectives. Every rank calls these in the same order (a rank that skips one leaves
its peers waiting until the timeout, docs/reliability.md): callers guard what they do with the results, never
whether they call."""

from datetime import timedelta

import torch
import torch.distributed as dist


def _active() -> bool:
    return dist.is_available() and dist.is_initialized()


def _device() -> torch.device:
    """Where small control tensors must live for the default group's backend (NCCL only moves CUDA tensors)."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def all_reduce_sum(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """In-place sum over `group` (the world by default); a no-op without an initialized process group. Host
    tensors (metrics, flags) travel through the backend's device: NCCL reduces CUDA tensors only."""
    if _active():
        device = _device()
        if t.device != device:
            buf = t.to(device)
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
            t.copy_(buf)
        else:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def barrier() -> None:
    if _active():
        dist.barrier()


def _group_device(group: dist.ProcessGroup | None) -> torch.device:
    return _device() if group is None or dist.get_backend(group) != "gloo" else torch.device("cpu")


def broadcast_bytes(data: bytes, src: int = 0, group: dist.ProcessGroup | None = None) -> bytes:
    """Every rank gets rank `src`'s bytes (others pass anything). Raw bytes, never pickle: callers encode
    text or JSON themselves, so a peer cannot make this process run code."""
    if not _active():
        return data
    device = _group_device(group)
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(n, src, group=group)
    if dist.get_rank() == src:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data else n.new_zeros(0).byte()
    else:
        buf = torch.zeros(int(n.item()), dtype=torch.uint8, device=device)
    if n.item():
        dist.broadcast(buf, src, group=group)
    return buf.cpu().numpy().tobytes()


def gather_bytes(data: bytes, group: dist.ProcessGroup | None = None) -> list[bytes]:
    """Rank 0 gets every rank's bytes, in rank order (the other ranks get []); raw bytes, never pickle."""
    if not _active():
        return [data]
    device, world = _group_device(group), dist.get_world_size(group)
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    longest = max(int(s.item()) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8, device=device)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else 0
    root = dist.get_rank(group) == 0
    parts = [torch.empty_like(buf) for _ in range(world)] if root else None
    dist.gather(buf, parts, dst=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return [p[: int(s.item())].cpu().numpy().tobytes() for p, s in zip(parts, sizes)] if root else []


def monitored_barrier(group: dist.ProcessGroup, timeout_s: float) -> None:
    """A barrier on a gloo group whose timeout error on rank 0 lists every rank that did not arrive."""
    if _active():
        dist.monitored_barrier(group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)


def agree_on_error(error: str) -> str:
    """Collective: '' when no rank reports an error, else the message of the lowest rank reporting one.

    Lets every rank take the same branch (fall back, raise) after a check that may fail on some ranks only."""
    if not _active():
        return error
    failed = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=_device())
    failed[dist.get_rank()] = int(bool(error))
    dist.all_reduce(failed, op=dist.ReduceOp.SUM)
    bad = failed.nonzero().flatten().tolist()
    if not bad:
        return ""
    return broadcast_bytes(error.encode(), src=bad[0]).decode()


def all_to_all_equal(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Not differentiable: chunk i of dim 0 goes to rank i of `group`; returns what every rank sent here."""
    t = t.contiguous()  # the output must be too: the collective fills it in memory order
    out = torch.empty_like(t)
    dist.all_to_all_single(out, t, group=group)
    return out


def _issue_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group, async_op: bool = False):
    """Issue the uneven all-to-all of rows: (sent, received, work); `received` is filled once `work` is waited for
    (at once unless async_op), and both buffers must stay alive until then."""
    x = x.contiguous()  # the output is filled in memory order, and so is the input read
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    return x, out, dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=async_op)


class _AllToAllRows(torch.autograd.Function):
    """Uneven all-to-all of rows; backward sends the gradient back along the transposed splits. Hand-written:
    torch.distributed.nn.functional.all_to_all_single is deprecated (a FutureWarning in torch 2.13), and the
    replacement it names, in torch.distributed._functional_collectives, is private."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return _issue_rows(x, out_splits, in_splits, group)[1]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _issue_rows(grad, ctx.in_splits, ctx.out_splits, ctx.group)[1], None, None, None


def all_to_all_rows(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Differentiable uneven all-to-all of rows: in_splits[i] rows go to rank i, out_splits[i] arrive from it."""
    return _AllToAllRows.apply(x, out_splits, in_splits, group)


class _InFlight:
    """One uneven all-to-all in flight each way: the forward's, then its gradient's (see `RowsInFlight`)."""

    def __init__(self, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup):
        self.out_splits, self.in_splits, self.group = out_splits, in_splits, group
        self.work = None
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # (sent, received): alive until the wait

    def start(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        sent, out, self.work = _issue_rows(x, out_splits, in_splits, self.group, async_op=True)
        self.buffers = (sent, out)
        return out

    def wait(self) -> torch.Tensor:
        self.work.wait()
        out = self.buffers[1]
        self.work = self.buffers = None
        return out


class _StartRows(torch.autograd.Function):
    """Issue the all-to-all (its output is filled once `_WaitRows` has waited); backward waits for the gradient's
    all-to-all, which `_WaitRows.backward` issued."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, flight: _InFlight) -> torch.Tensor:
        ctx.flight = flight
        return flight.start(x, flight.out_splits, flight.in_splits)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.flight.wait(), None  # `grad` is what _WaitRows.backward already sent


class _WaitRows(torch.autograd.Function):
    """Wait for the all-to-all; backward issues the gradient's all-to-all (the transposed splits) and returns at
    once, so that autograd runs other work (another chunk's expert backward) before `_StartRows.backward` waits."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, flight: _InFlight) -> torch.Tensor:
        ctx.flight = flight
        return flight.wait().view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        flight = ctx.flight
        flight.start(grad, flight.in_splits, flight.out_splits)
        return grad, None


class RowsInFlight:
    """An uneven all-to-all of rows issued asynchronously (`all_to_all_rows_async`); `wait()` returns its rows.

    Differentiable both ways: the gradient's all-to-all is issued asynchronously too, when autograd reaches the
    wait, and waited for where autograd reaches the start. Every rank must issue and wait in the same order."""

    def __init__(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup):
        self._flight = _InFlight(out_splits, in_splits, group)
        self._out = _StartRows.apply(x, self._flight)

    def wait(self) -> torch.Tensor:
        return _WaitRows.apply(self._out, self._flight)


def all_to_all_rows_async(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
) -> RowsInFlight:
    """`all_to_all_rows` without blocking: in_splits[i] rows go to rank i, out_splits[i] arrive from it once the
    returned handle's `wait()` returns them."""
    return RowsInFlight(x, out_splits, in_splits, group)


# ------------------------------------------------------------------------------- tensor-parallel regions
# Hand-written rather than torch.distributed.nn.functional.all_reduce: that one sums gradients in backward too,
# which is right for neither boundary of a tensor-parallel region (Megatron's f and g).


class _CopyToRegion(torch.autograd.Function):
    """Enter a TP region: identity forward; backward sums the partial input gradients of the group's ranks."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromRegion(torch.autograd.Function):
    """Leave a TP region: forward sums the ranks' partial outputs; backward is the identity (the sum's gradient
    reaches every rank's partial output unchanged)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def copy_to_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _ReduceFromRegion.apply(x, group)


def all_reduce_max(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """In-place max over `group` (not differentiable)."""
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


def reduce_sum_async(t: torch.Tensor, dst: int, group: dist.ProcessGroup):
    """Start the sum of every rank's `t` onto global rank `dst` of `group`; returns the work to wait for. `t` must
    stay alive and unwritten until then (on `dst` it holds the sum afterwards). Gloo runs it on its own threads:
    the caller goes on computing while it travels."""
    return dist.reduce(t, dst, group=group, async_op=True)


def broadcast_async(t: torch.Tensor, src: int, group: dist.ProcessGroup):
    """Start sending global rank `src`'s `t` into every rank's `t` of `group` (contiguous, in place); returns the work
    to wait for before reading `t` (or, on `src`, writing it)."""
    return dist.broadcast(t, src, group=group, async_op=True)


def all_gather_list(t: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Not differentiable: every rank's `t` (equal shapes), in group-rank order."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def _all_gather_single(out: torch.Tensor, src: torch.Tensor, group: dist.ProcessGroup) -> None:
    # torch 2.13 renamed all_gather_into_tensor (the old name warns); older torch has only the old one.
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, src, group=group)


def _reduce_scatter_single(out: torch.Tensor, src: torch.Tensor, group: dist.ProcessGroup) -> None:
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, src, group=group)


def _all_gather_along(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    src = x.movedim(dim, 0).contiguous()
    out = src.new_empty((src.shape[0] * dist.get_world_size(group), *src.shape[1:]))
    _all_gather_single(out, src, group=group)
    return out.movedim(0, dim)


def _reduce_scatter_along(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    src = x.movedim(dim, 0).contiguous()
    out = src.new_empty((src.shape[0] // dist.get_world_size(group), *src.shape[1:]))
    _reduce_scatter_single(out, src, group=group)
    return out.movedim(0, dim)


def _segment_index(sizes: list[int], width: int, device: torch.device) -> torch.Tensor:
    """Where the rows of consecutive segments of `sizes` rows sit when segment i starts at row i·width."""
    return torch.cat([torch.arange(i * width, i * width + n, device=device) for i, n in enumerate(sizes)])


def _width(sizes: list[int]) -> int:
    return max(max(sizes), 1)  # never an empty collective: every rank issues it, with or without rows


def _gather_rows(x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    width = _width(sizes)
    padded = x.new_zeros((width, *x.shape[1:]))
    padded[: x.shape[0]] = x
    out = x.new_empty((len(sizes) * width, *x.shape[1:]))
    _all_gather_single(out, padded, group=group)
    return out.index_select(0, _segment_index(sizes, width, x.device))


def _reduce_scatter_rows(x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    width = _width(sizes)
    padded = x.new_zeros((len(sizes) * width, *x.shape[1:]))
    padded.index_copy_(0, _segment_index(sizes, width, x.device), x.contiguous())
    out = x.new_empty((width, *x.shape[1:]))
    _reduce_scatter_single(out, padded, group=group)
    return out[: sizes[dist.get_rank(group)]]


class _Transposed(torch.autograd.Function):
    """A linear collective `fwd(x, *args)` whose gradient is the collective `bwd(grad, *args)`: all-gather and
    reduce-scatter are each other's transpose (along the sequence, or of uneven row blocks)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fwd, bwd, *args) -> torch.Tensor:
        ctx.bwd, ctx.args = bwd, args
        return fwd(x, *args)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.bwd(grad.contiguous(), *ctx.args), None, None, *(None for _ in ctx.args)


def gather_rows(x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Uneven all-gather: rank i of `group` gives sizes[i] rows, every rank gets all of them in rank order (padded
    to the largest block on the wire: equal-size collectives exist on every backend). Backward: each rank's block
    of the gradient summed over the group."""
    return _Transposed.apply(x, _gather_rows, _reduce_scatter_rows, sizes, group)


def reduce_scatter_rows(x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """The transpose of `gather_rows`: x holds a block of sizes[i] rows for every rank i; rank i gets its block
    summed over the group. Backward: the blocks' gradients all-gathered."""
    return _Transposed.apply(x, _reduce_scatter_rows, _gather_rows, sizes, group)


def gather_sequence(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Enter a sequence-parallel TP region: all-gather the ranks' sequence slices along `dim`; backward sums the
    ranks' partial gradients and keeps this rank's slice (reduce-scatter)."""
    return _Transposed.apply(x, _all_gather_along, _reduce_scatter_along, dim, group)


def scatter_sequence(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Leave a sequence-parallel TP region: sum the partial outputs and keep this rank's sequence slice
    (reduce-scatter); backward all-gathers the slices' gradients."""
    return _Transposed.apply(x, _reduce_scatter_along, _all_gather_along, dim, group)
