"""Every rule a loaded config must satisfy beyond its types, each stated once.

`validate` holds the rules that need only the config (load_config and config_from_dict run it); the parallel
layout's rules live in parallel_checks.py (`check_parallel` from here, `check_layout` where the world size is
known). Each failure is a ConfigError of one line naming the key (tests/config/test_config.py). Rules that need files
(data paths, tokenizers, the run directory) are checked where those are read, with errors naming the key as well.
Depends on schema.py and parallel_checks.py; loading.py imports this module.
"""

from __future__ import annotations

from moe_dist.config.parallel_checks import check_global_batch, check_parallel
from moe_dist.config.schema import (
    FFN_KINDS,
    MIXER_KINDS,
    DataConfig,
    GDNConfig,
    JobConfig,
    Mamba2Config,
    ModelConfig,
    MoEConfig,
    PlanConfig,
    TrainConfig,
    require,
)


def validate(cfg: JobConfig) -> None:
    """Cross-field checks that do not depend on the world size (see `check_layout` for those)."""
    m, a, mb, moe, t = cfg.model, cfg.model.attention, cfg.model.mamba, cfg.model.moe, cfg.train
    require(
        a.mask == "causal" or cfg.data.document_masking,
        "model.attention.mask: 'prefix' needs data.document_masking=true (the prompt is found per document)",
    )
    for name in ("vocab_size", "d_model", "n_layers", "d_ff"):
        require(getattr(m, name) > 0, f"model.{name}: must be positive, got {getattr(m, name)}")
    require(
        bool(m.mixer_pattern) and set(m.mixer_pattern) <= {"A", "M"},
        f"model.mixer_pattern: letters A (attention) and M (Mamba) only, got {m.mixer_pattern!r}",
    )
    require(
        bool(m.ffn_pattern) and set(m.ffn_pattern) <= {"D", "E"},
        f"model.ffn_pattern: letters D (dense) and E (MoE) only, got {m.ffn_pattern!r}",
    )
    for name in ("mixer_pattern", "ffn_pattern"):
        n = len(getattr(m, name))
        require(m.n_layers % n == 0, f"model.{name}: length {n} must divide model.n_layers={m.n_layers}")
    _check_layers(m)
    for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
        require(getattr(m, name) > 0, f"model.{name}: must be positive, got {getattr(m, name)}")
    require(
        a.softmax_scale is None or a.softmax_scale > 0,
        f"model.attention.softmax_scale: must be positive or null, got {a.softmax_scale}",
    )
    require(
        a.n_heads > 0 and a.n_kv_heads > 0 and a.n_heads % a.n_kv_heads == 0,
        f"model.attention.n_kv_heads: must divide n_heads={a.n_heads}, got {a.n_kv_heads}",
    )
    if a.head_dim is None:
        require(
            m.d_model % a.n_heads == 0,
            f"model.attention.n_heads: must divide d_model={m.d_model} when head_dim is null, got {a.n_heads}",
        )
    rotary = int((a.head_dim or m.d_model // max(a.n_heads, 1)) * a.rope_fraction)
    require(
        0 < a.rope_fraction <= 1 and rotary % 2 == 0 and rotary > 0,
        f"model.attention.rope_fraction: must be in (0, 1] and rotate an even number of head dims, "
        f"got {a.rope_fraction} ({rotary} dims)",
    )
    require(
        mb.d_state > 0 and mb.d_conv > 0 and mb.expand > 0 and mb.chunk_size > 0,
        "model.mamba: d_state, d_conv, expand and chunk_size must be positive",
    )
    _check_mamba2_fields(m.mamba2)
    if m.has_kind("mamba2"):
        check_mamba2(m.d_model, m.mamba2)
    require(moe.num_experts > 0, f"model.moe.num_experts: must be positive, got {moe.num_experts}")
    require(
        0 < moe.top_k <= moe.num_experts,
        f"model.moe.top_k: must be in [1, num_experts={moe.num_experts}], got {moe.top_k}",
    )
    require(
        moe.capacity_factor is None or moe.capacity_factor > 0,
        f"model.moe.capacity_factor: must be positive or null (dropless), got {moe.capacity_factor}",
    )
    _check_moe_recipes(moe)
    check_parallel(cfg)
    require(t.steps > 0, f"train.steps: must be positive, got {t.steps}")
    require(t.seq_len > 0, f"train.seq_len: must be positive, got {t.seq_len}")
    require(t.micro_batch_size > 0, f"train.micro_batch_size: must be positive, got {t.micro_batch_size}")
    check_global_batch(t.global_batch_size, t.micro_batch_size, 1)  # the data-parallel part: check_layout
    parts = {"attention", "mamba", "mamba2", "gdn", "moe_experts", "mlp"}
    require(
        set(t.checkpoint_parts) <= parts,
        f"train.checkpoint_parts: expected a subset of {sorted(parts)}, got {t.checkpoint_parts}",
    )
    require(
        t.activation_checkpointing == "selective" or not t.checkpoint_parts,
        f"train.checkpoint_parts: only used with train.activation_checkpointing='selective', "
        f"not {t.activation_checkpointing!r}",
    )
    _check_schedule(t)
    _check_run_settings(t)
    _check_data(cfg.data)
    _check_gdn(cfg.model.gdn)
    _check_plan(cfg.plan)


def _check_plan(p: PlanConfig) -> None:
    mib = p.device_memory_mib
    require(mib is None or mib > 0, f"plan.device_memory_mib: must be positive or null, got {mib}")
    margin = p.fragmentation_margin
    require(0 <= margin < 1, f"plan.fragmentation_margin: must be in [0, 1), got {margin}")
    rho = p.expert_imbalance
    require(rho is None or rho >= 1, f"plan.expert_imbalance: must be >= 1 (the mean load) or null, got {rho}")


def _check_moe_recipes(moe: MoEConfig) -> None:
    """The routing options of model.moe beyond top-k (scores, balancing, groups, shared experts)."""
    require(moe.route_scale > 0, f"model.moe.route_scale: must be positive, got {moe.route_scale}")
    require(moe.bias_update_rate >= 0, f"model.moe.bias_update_rate: must be >= 0, got {moe.bias_update_rate}")
    require(
        moe.n_groups >= 1 and moe.num_experts % moe.n_groups == 0,
        f"model.moe.n_groups: must divide model.moe.num_experts={moe.num_experts}, got {moe.n_groups}",
    )
    require(
        1 <= moe.topk_groups <= moe.n_groups,
        f"model.moe.topk_groups: must be in [1, n_groups={moe.n_groups}], got {moe.topk_groups}",
    )
    reachable = moe.topk_groups * (moe.num_experts // moe.n_groups)
    require(
        moe.top_k <= reachable,
        f"model.moe.top_k: {moe.top_k} experts cannot be chosen from topk_groups={moe.topk_groups} groups of "
        f"{moe.num_experts // moe.n_groups} experts",
    )
    require(moe.n_shared_experts >= 0, f"model.moe.n_shared_experts: must be >= 0, got {moe.n_shared_experts}")
    require(
        moe.shared_d_ff is None or moe.shared_d_ff > 0,
        f"model.moe.shared_d_ff: must be positive or null, got {moe.shared_d_ff}",
    )
    require(moe.dead_expert_window >= 1, f"model.moe.dead_expert_window: must be >= 1, got {moe.dead_expert_window}")


def _check_mamba2_fields(mb: Mamba2Config) -> None:
    """The rules of model.mamba2 that hold whatever d_model is (the default section passes them)."""
    for name in ("d_state", "d_conv", "expand", "head_dim", "n_groups", "chunk_size"):
        require(getattr(mb, name) > 0, f"model.mamba2.{name}: must be positive, got {getattr(mb, name)}")
    require(
        mb.chunk_size & (mb.chunk_size - 1) == 0,
        f"model.mamba2.chunk_size: must be a power of two, got {mb.chunk_size}",
    )
    require(
        mb.n_heads is None or (mb.n_heads > 0 and mb.n_heads % mb.n_groups == 0),
        f"model.mamba2.n_groups: must divide model.mamba2.n_heads={mb.n_heads}, got {mb.n_groups}",
    )
    require(
        0 < mb.dt_init_floor and 0 < mb.dt_min <= mb.dt_max,
        f"model.mamba2.dt_min: need 0 < dt_min <= dt_max and dt_init_floor > 0, got {mb.dt_min}, {mb.dt_max}, "
        f"{mb.dt_init_floor}",
    )
    require(
        mb.dt_limit is None or (len(mb.dt_limit) == 2 and 0 <= mb.dt_limit[0] < mb.dt_limit[1]),
        f"model.mamba2.dt_limit: expected [low, high] with 0 <= low < high, or null, got {mb.dt_limit}",
    )


def check_mamba2(d_model: int, mb: Mamba2Config) -> None:
    """The shape rules of a Mamba-2 layer in a model of width `d_model`, besides `_check_mamba2_fields`: the layer
    runs them when it is built, and validate for a config that places Mamba-2 layers)."""
    _check_mamba2_fields(mb)
    if mb.n_heads is None:
        d_inner = mb.expand * d_model
        require(
            d_inner % mb.head_dim == 0,
            f"model.mamba2.head_dim: must divide d_inner = expand * d_model = {d_inner} when n_heads is null, "
            f"got {mb.head_dim}",
        )
    heads = mb.heads(d_model)
    require(
        heads % mb.n_groups == 0,
        f"model.mamba2.n_groups: must divide the {heads} heads (d_inner / head_dim), got {mb.n_groups}",
    )


def _check_layers(m: ModelConfig) -> None:
    """model.layers: per entry at most one mixer kind then at most one FFN kind, "+"-joined, not empty; one entry
    per layer; the patterns stay at their defaults (one way to say what each layer holds)."""
    if m.layers is None:
        return
    require(
        m.mixer_pattern == "A" and m.ffn_pattern == "E",
        "model.layers: set either model.layers or model.mixer_pattern/ffn_pattern, not both",
    )
    require(
        len(m.layers) == m.n_layers,
        f"model.layers: {len(m.layers)} entries, but model.n_layers={m.n_layers}",
    )
    for i, entry in enumerate(m.layers):
        parts = entry.split("+") if isinstance(entry, str) else []
        ok = 1 <= len(parts) <= 2 and all(parts)
        if ok and len(parts) == 2:
            ok = parts[0] in MIXER_KINDS and parts[1] in FFN_KINDS
        elif ok:
            ok = parts[0] in MIXER_KINDS or parts[0] in FFN_KINDS
        require(
            ok,
            f"model.layers[{i}]: expected a mixer ({'|'.join(MIXER_KINDS)}), an FFN ({'|'.join(FFN_KINDS)}) "
            f"or mixer+FFN, got {entry!r}",
        )


def _check_schedule(t: TrainConfig) -> None:
    """The optimizer and the learning-rate schedule (train/optim.py)."""
    require(len(t.betas) == 2, f"train.betas: expected two numbers, got {t.betas}")
    require(t.adam_eps > 0, f"train.adam_eps: must be positive, got {t.adam_eps}")
    require(0.0 < t.decay_fraction <= 1.0, f"train.decay_fraction: must be in (0, 1], got {t.decay_fraction}")
    if t.lr_schedule == "wsd":
        decay = t.decay_steps()
        require(
            decay >= 1 and t.warmup_steps + decay <= t.steps,
            f"train.decay_fraction: {t.decay_fraction} of train.steps={t.steps} is {decay} decay steps; wsd needs "
            f"at least 1 and train.warmup_steps={t.warmup_steps} + them <= train.steps",
        )


def _check_run_settings(t: TrainConfig) -> None:
    """Checkpoint keeping, saving and the non-finite guard (train/loop.py, train/checkpoint.py, train/guard.py)."""
    for key in ("keep_last", "max_nonfinite_steps", "save_buffer_mb"):
        require(getattr(t, key) >= 0, f"train.{key}: must be >= 0, got {getattr(t, key)}")
    require(t.save_timeout_s > 0, f"train.save_timeout_s: must be > 0, got {t.save_timeout_s}")
    require(
        t.save_staging_mb * 2**20 >= 1024, f"train.save_staging_mb: must be >= 1/1024 (1 KiB), got {t.save_staging_mb}"
    )
    bad = [s for s in t.profile_steps if not 1 <= s <= t.steps]
    require(not bad, f"train.profile_steps: {bad} outside the run's optimizer steps 1..{t.steps}")


def _check_data(d: DataConfig) -> None:
    """The data section's rules that need no file (the files are checked where the data is read)."""
    require(0.0 < d.val_fraction < 1.0, f"data.val_fraction: must be in (0, 1), got {d.val_fraction}")
    require(not d.mixture or d.source == "memmap", "data.mixture: only the 'memmap' source takes a mixture")
    if d.source == "text":
        require(bool(d.paths), "data.paths: required when data.source is 'text'")
    if d.source == "memmap":
        require(not (d.mixture and d.paths), "data.paths: give either data.paths or data.mixture, not both")
        require(
            bool(d.mixture or d.paths),
            "data.paths: the memmap source needs shard-set sidecars (PREFIX.json) or data.mixture",
        )
    for i, c in enumerate(d.mixture):
        require(c.weight > 0, f"data.mixture[{i}].weight: must be positive, got {c.weight}")


def _check_gdn(g: GDNConfig) -> None:
    """The Gated DeltaNet mixer's shapes (checked whether or not a layer uses it: its defaults satisfy them)."""
    for key in ("n_k_heads", "n_v_heads", "head_k_dim", "head_v_dim", "conv_size", "chunk_size"):
        require(getattr(g, key) > 0, f"model.gdn.{key}: must be positive, got {getattr(g, key)}")
    require(
        g.n_v_heads % g.n_k_heads == 0,
        f"model.gdn.n_k_heads: must divide n_v_heads={g.n_v_heads}, got {g.n_k_heads}",
    )
    require(
        g.chunk_size & (g.chunk_size - 1) == 0,
        f"model.gdn.chunk_size: must be a power of two, got {g.chunk_size}",
    )
