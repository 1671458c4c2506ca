"""Host syncs a CPU run can see: `aten._local_scalar_dense` is what `.item()` (and `int()`/`float()` of a tensor)
dispatches to, on every device, so counting it under a TorchDispatchMode pins down where a GPU step would wait.
What it cannot see: `.tolist()` and `.cpu()` of a CPU tensor dispatch no copy here (they do on a GPU), nor
syncs inside a kernel (CUDA `bincount`, boolean-mask indexing): those are stated in the code where they remain."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_dist.config import load_config
from moe_dist.models.decoder import build_model, lm_loss, materialize
from moe_dist.train.metrics import StepAccumulator


class CountScalarReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_step_metrics_read_nothing_per_layer_and_move_once_per_step(one_thread):
    cfg = load_config("configs/debug.json")
    model = materialize(build_model(cfg.model), "cpu", seed=0)
    acc = StepAccumulator(2, cfg.model.moe.num_experts)
    batch = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    for _ in range(3):  # micro-batches
        out = model(batch[:, :-1])
        loss = lm_loss(out.logits, batch[:, 1:])
        with CountScalarReads() as reads:
            acc.add(loss, loss, out)
        assert reads.count == 0  # was one `.item()` per MoE layer per micro-batch
    record = acc.reduce()
    assert [sum(layer["tokens_per_expert"]) for layer in record["moe"]] == [
        3 * 2 * 32 * 2
    ] * 2  # 3 micro-batches of 2 x 32 tokens, top-2
    expected_dropped = sum(s.dropped.item() for s in out.moe_stats) * 3
    assert sum(sum(layer["dropped_per_expert"]) for layer in record["moe"]) == expected_dropped
