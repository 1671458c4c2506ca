"""The memory plan under context parallelism (`parallel.cp`): a rank's activations are those of its S / cp positions,
except an attention layer's gathered keys and values, which are the whole sequence's on every rank; ZeRO partitions
over the dp × cp replicas."""

import pytest

from moe_dist.config import load_config
from moe_dist.planning.memory import activation_bytes, memory_plan

BASE = [
    "model.d_model=64",
    "model.d_ff=96",
    "model.attention.n_heads=8",
    "model.attention.n_kv_heads=2",
    "model.attention.head_dim=16",
    "model.moe.num_experts=8",
    "model.moe.top_k=2",
    "model.vocab_size=512",
    "train.seq_len=128",
    "train.micro_batch_size=2",
    "train.activation_checkpointing=none",
    "train.eval_batches=4",
]


def _cfg(*extra: str):
    return load_config("configs/debug.json", [*BASE, *extra])


@pytest.mark.parametrize("cp", [2, 4])
def test_activations_are_the_local_positions_plus_the_whole_kv(cp):
    cfg = _cfg("model.mixer_pattern=A", "model.ffn_pattern=E", f"parallel.cp={cp}")
    whole, local = activation_bytes(cfg, 1, 1), activation_bytes(cfg, 1, cp)
    for part in ("mlp", "moe", "head"):  # per token: 1/cp of the tokens, 1/cp of the bytes
        assert local[part] == pytest.approx(whole[part] / cp)
    # attention: the whole sequence's K and V of the 2 KV heads (fp32), kept per attention layer on every rank
    kv = 4 * 2 * 128 * (2 * 2 * 16 * 4)  # layers × micro-batch × S × (K and V × kv heads × head dim × bytes)
    assert local["attention"] == pytest.approx((whole["attention"] - kv) / cp + kv)
    assert local["transient"]["logits"] == pytest.approx(whole["transient"]["logits"] / cp)


def test_zero_partitions_over_dp_times_cp():
    """Same world, same replicas count: (dp 4, cp 1) and (dp 2, cp 2) partition the optimizer state alike; the
    activations differ by the local positions."""
    a = memory_plan(_cfg("model.mixer_pattern=A", "model.ffn_pattern=E"), 4, "cpu")
    b = memory_plan(_cfg("model.mixer_pattern=A", "model.ffn_pattern=E", "parallel.cp=2"), 4, "cpu")
    assert b["layout"]["dp"] == 2 and b["layout"]["cp"] == 2
    assert b["memory_per_rank_gb"]["optimizer"] == pytest.approx(a["memory_per_rank_gb"]["optimizer"])
    assert b["memory_per_rank_gb"]["activations"] < 0.6 * a["memory_per_rank_gb"]["activations"]
