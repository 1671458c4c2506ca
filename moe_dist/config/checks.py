"""Every rule a loaded config must satisfy beyond its types, each stated once.

`validate` holds the rules that need only the config (load_config and config_from_dict run it); `check_layout`
those that need the world size too (the launcher's WORLD_SIZE, at start-up and in --dry-run). Each failure is a
ConfigError of one line naming the key (tests/test_config.py). Rules that need files (data paths, tokenizers, the
run directory) are checked where those are read, with errors naming the key as well. Depends on schema.py only;
loading.py imports this module.
"""

from __future__ import annotations

import math

from moe_dist.config.schema import (
    FFN_KINDS,
    MIXER_KINDS,
    ConfigError,
    DataConfig,
    GDNConfig,
    JobConfig,
    Mamba2Config,
    ModelConfig,
    MoEConfig,
    PlanConfig,
    TrainConfig,
)


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def validate(cfg: JobConfig) -> None:
    """Cross-field checks that do not depend on the world size (see `check_layout` for those)."""
    m, a, mb, moe, t = cfg.model, cfg.model.attention, cfg.model.mamba, cfg.model.moe, cfg.train
    _check(
        a.mask == "causal" or cfg.data.document_masking,
        "model.attention.mask: 'prefix' needs data.document_masking=true (the prompt is found per document)",
    )
    for name in ("vocab_size", "d_model", "n_layers", "d_ff"):
        _check(getattr(m, name) > 0, f"model.{name}: must be positive, got {getattr(m, name)}")
    _check(
        bool(m.mixer_pattern) and set(m.mixer_pattern) <= {"A", "M"},
        f"model.mixer_pattern: letters A (attention) and M (Mamba) only, got {m.mixer_pattern!r}",
    )
    _check(
        bool(m.ffn_pattern) and set(m.ffn_pattern) <= {"D", "E"},
        f"model.ffn_pattern: letters D (dense) and E (MoE) only, got {m.ffn_pattern!r}",
    )
    for name in ("mixer_pattern", "ffn_pattern"):
        n = len(getattr(m, name))
        _check(m.n_layers % n == 0, f"model.{name}: length {n} must divide model.n_layers={m.n_layers}")
    _check_layers(m)
    for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
        _check(getattr(m, name) > 0, f"model.{name}: must be positive, got {getattr(m, name)}")
    _check(
        a.softmax_scale is None or a.softmax_scale > 0,
        f"model.attention.softmax_scale: must be positive or null, got {a.softmax_scale}",
    )
    _check(
        a.n_heads > 0 and a.n_kv_heads > 0 and a.n_heads % a.n_kv_heads == 0,
        f"model.attention.n_kv_heads: must divide n_heads={a.n_heads}, got {a.n_kv_heads}",
    )
    if a.head_dim is None:
        _check(
            m.d_model % a.n_heads == 0,
            f"model.attention.n_heads: must divide d_model={m.d_model} when head_dim is null, got {a.n_heads}",
        )
    rotary = int((a.head_dim or m.d_model // max(a.n_heads, 1)) * a.rope_fraction)
    _check(
        0 < a.rope_fraction <= 1 and rotary % 2 == 0 and rotary > 0,
        f"model.attention.rope_fraction: must be in (0, 1] and rotate an even number of head dims, "
        f"got {a.rope_fraction} ({rotary} dims)",
    )
    _check(
        mb.d_state > 0 and mb.d_conv > 0 and mb.expand > 0 and mb.chunk_size > 0,
        "model.mamba: d_state, d_conv, expand and chunk_size must be positive",
    )
    _check_mamba2_fields(m.mamba2)
    if m.has_kind("mamba2"):
        check_mamba2(m.d_model, m.mamba2)
    _check(moe.num_experts > 0, f"model.moe.num_experts: must be positive, got {moe.num_experts}")
    _check(
        0 < moe.top_k <= moe.num_experts,
        f"model.moe.top_k: must be in [1, num_experts={moe.num_experts}], got {moe.top_k}",
    )
    _check(
        moe.capacity_factor is None or moe.capacity_factor > 0,
        f"model.moe.capacity_factor: must be positive or null (dropless), got {moe.capacity_factor}",
    )
    _check_moe_recipes(moe)
    _check(cfg.parallel.tp >= 1 and cfg.parallel.ep >= 1, "parallel.tp and parallel.ep must be >= 1")
    _check_context_parallel(cfg)
    _check_pipeline(cfg)
    etp = cfg.parallel.etp
    _check(
        etp is None or etp in (1, cfg.parallel.tp),
        f"parallel.etp: must be 1 or parallel.tp={cfg.parallel.tp} (or null: tp), got {etp}",
    )
    _check(
        etp != 1 or cfg.parallel.tp == 1 or cfg.parallel.ep > 1,
        f"parallel.etp: 1 with parallel.tp={cfg.parallel.tp} needs parallel.ep > 1 (whole experts replicated over "
        "TP would compute every token tp times); set parallel.ep or leave parallel.etp null",
    )
    if cfg.parallel.tp > 1:
        _check_tensor_parallel(cfg)
        _check(
            not t.compile,
            "train.compile: not supported with parallel.tp > 1 (the tensor-parallel region hooks "
            "issue collectives inside the compiled modules)",
        )
    _check(
        cfg.parallel.ep == 1 or cfg.deepspeed.zero_stage >= 1,
        "deepspeed.zero_stage: expert parallelism (parallel.ep > 1) needs ZeRO stage 1 or 2 (stage 0's gradient "
        "clipping in DeepSpeed averages per-rank norms instead of computing the global norm)",
    )
    _check(
        t.dtype == "fp32" or cfg.deepspeed.zero_stage >= 1,
        "deepspeed.zero_stage: bf16 training needs ZeRO stage 1 or 2 here (checkpoints read its fp32 master weights)",
    )
    _check(
        moe.num_experts % cfg.parallel.ep == 0,
        f"parallel.ep: must divide model.moe.num_experts={moe.num_experts}, got {cfg.parallel.ep}",
    )
    _check(t.steps > 0, f"train.steps: must be positive, got {t.steps}")
    _check(t.seq_len > 0, f"train.seq_len: must be positive, got {t.seq_len}")
    _check(t.micro_batch_size > 0, f"train.micro_batch_size: must be positive, got {t.micro_batch_size}")
    check_global_batch(t.global_batch_size, t.micro_batch_size, 1)  # the data-parallel part: check_layout
    parts = {"attention", "mamba", "mamba2", "gdn", "moe_experts", "mlp"}
    _check(
        set(t.checkpoint_parts) <= parts,
        f"train.checkpoint_parts: expected a subset of {sorted(parts)}, got {t.checkpoint_parts}",
    )
    _check(
        t.activation_checkpointing == "selective" or not t.checkpoint_parts,
        f"train.checkpoint_parts: only used with train.activation_checkpointing='selective', "
        f"not {t.activation_checkpointing!r}",
    )
    _check_schedule(t)
    _check_run_settings(t)
    _check_data(cfg.data)
    _check_gdn(cfg.model.gdn)
    _check_plan(cfg.plan)


def _check_context_parallel(cfg: JobConfig) -> None:
    """`parallel.cp`: the sequence splits into 2·cp equal pieces, and what CP does not support is refused. (Whether
    every mixer of the model has a shard-aware forward is checked where the layers are known:
    parallel/context_parallel.check_mixers.)"""
    cp, t = cfg.parallel.cp, cfg.train
    _check(cp >= 1, f"parallel.cp: must be >= 1, got {cp}")
    if cp == 1:
        return
    _check(
        t.seq_len % (2 * cp) == 0,
        f"parallel.cp: train.seq_len={t.seq_len} must be divisible by 2·cp = {2 * cp} (a head and a tail piece "
        f"per rank)",
    )
    _check(
        not cfg.parallel.sequence_parallel,
        "parallel.sequence_parallel: not supported with parallel.cp > 1 (the TP sequence split of CP pieces is "
        "untested)",
    )
    _check(
        cfg.model.moe.drop_policy != "probability" or cfg.model.moe.capacity_factor is None,
        "model.moe.drop_policy: 'probability' is not supported with parallel.cp > 1 (drops in global score order "
        "would need every piece's scores); use 'position' or capacity_factor=null",
    )
    _check(not t.compile, "train.compile: not supported with parallel.cp > 1 (CP exchanges run inside the mixers)")
    tp, m2 = cfg.parallel.tp, cfg.model.mamba2
    _check(
        tp == 1 or not cfg.model.has_kind("mamba2") or m2.n_groups >= tp,
        f"model.mamba2.n_groups: {m2.n_groups} < parallel.tp={tp} is not supported with parallel.cp > 1 (a rank "
        f"would hold part of a B/C group, whose state the pieces pass)",
    )


def _check_pipeline(cfg: JobConfig) -> None:
    """`parallel.pp`, `pp_virtual`, `pp_cut`: the layer list cuts into pp × pp_virtual non-empty stages."""
    pa, n = cfg.parallel, cfg.model.n_layers
    _check(pa.pp >= 1, f"parallel.pp: must be >= 1, got {pa.pp}")
    _check(pa.pp_virtual >= 1, f"parallel.pp_virtual: must be >= 1, got {pa.pp_virtual}")
    _check(pa.pp > 1 or pa.pp_virtual == 1, f"parallel.pp_virtual: {pa.pp_virtual} needs parallel.pp > 1")
    stages = pa.pp * pa.pp_virtual
    _check(
        stages <= n,
        f"parallel.pp: pp × pp_virtual = {stages} stages for model.n_layers={n} (every stage needs a layer)",
    )
    if pa.pp_cut is not None:
        cut = list(pa.pp_cut)
        _check(
            len(cut) == stages - 1 and cut == sorted(set(cut)) and all(0 < c < n for c in cut),
            f"parallel.pp_cut: {cut} must be {stages - 1} increasing layer indices in 1..{n - 1} (the first layer of "
            f"each stage after the first)",
        )


def _check_plan(p: PlanConfig) -> None:
    mib = p.device_memory_mib
    _check(mib is None or mib > 0, f"plan.device_memory_mib: must be positive or null, got {mib}")
    margin = p.fragmentation_margin
    _check(0 <= margin < 1, f"plan.fragmentation_margin: must be in [0, 1), got {margin}")
    rho = p.expert_imbalance
    _check(rho is None or rho >= 1, f"plan.expert_imbalance: must be >= 1 (the mean load) or null, got {rho}")


def _check_moe_recipes(moe: MoEConfig) -> None:
    """The routing options of model.moe beyond top-k (scores, balancing, groups, shared experts)."""
    _check(moe.route_scale > 0, f"model.moe.route_scale: must be positive, got {moe.route_scale}")
    _check(moe.bias_update_rate >= 0, f"model.moe.bias_update_rate: must be >= 0, got {moe.bias_update_rate}")
    _check(
        moe.n_groups >= 1 and moe.num_experts % moe.n_groups == 0,
        f"model.moe.n_groups: must divide model.moe.num_experts={moe.num_experts}, got {moe.n_groups}",
    )
    _check(
        1 <= moe.topk_groups <= moe.n_groups,
        f"model.moe.topk_groups: must be in [1, n_groups={moe.n_groups}], got {moe.topk_groups}",
    )
    reachable = moe.topk_groups * (moe.num_experts // moe.n_groups)
    _check(
        moe.top_k <= reachable,
        f"model.moe.top_k: {moe.top_k} experts cannot be chosen from topk_groups={moe.topk_groups} groups of "
        f"{moe.num_experts // moe.n_groups} experts",
    )
    _check(moe.n_shared_experts >= 0, f"model.moe.n_shared_experts: must be >= 0, got {moe.n_shared_experts}")
    _check(
        moe.shared_d_ff is None or moe.shared_d_ff > 0,
        f"model.moe.shared_d_ff: must be positive or null, got {moe.shared_d_ff}",
    )
    _check(moe.dead_expert_window >= 1, f"model.moe.dead_expert_window: must be >= 1, got {moe.dead_expert_window}")


def _check_mamba2_fields(mb: Mamba2Config) -> None:
    """The rules of model.mamba2 that hold whatever d_model is (the default section passes them)."""
    for name in ("d_state", "d_conv", "expand", "head_dim", "n_groups", "chunk_size"):
        _check(getattr(mb, name) > 0, f"model.mamba2.{name}: must be positive, got {getattr(mb, name)}")
    _check(
        mb.chunk_size & (mb.chunk_size - 1) == 0,
        f"model.mamba2.chunk_size: must be a power of two, got {mb.chunk_size}",
    )
    _check(
        mb.n_heads is None or (mb.n_heads > 0 and mb.n_heads % mb.n_groups == 0),
        f"model.mamba2.n_groups: must divide model.mamba2.n_heads={mb.n_heads}, got {mb.n_groups}",
    )
    _check(
        0 < mb.dt_init_floor and 0 < mb.dt_min <= mb.dt_max,
        f"model.mamba2.dt_min: need 0 < dt_min <= dt_max and dt_init_floor > 0, got {mb.dt_min}, {mb.dt_max}, "
        f"{mb.dt_init_floor}",
    )
    _check(
        mb.dt_limit is None or (len(mb.dt_limit) == 2 and 0 <= mb.dt_limit[0] < mb.dt_limit[1]),
        f"model.mamba2.dt_limit: expected [low, high] with 0 <= low < high, or null, got {mb.dt_limit}",
    )


def check_mamba2(d_model: int, mb: Mamba2Config) -> None:
    """The shape rules of a Mamba-2 layer in a model of width `d_model`, besides `_check_mamba2_fields`: the layer
    runs them when it is built, and validate for a config that places Mamba-2 layers)."""
    _check_mamba2_fields(mb)
    if mb.n_heads is None:
        d_inner = mb.expand * d_model
        _check(
            d_inner % mb.head_dim == 0,
            f"model.mamba2.head_dim: must divide d_inner = expand * d_model = {d_inner} when n_heads is null, "
            f"got {mb.head_dim}",
        )
    heads = mb.heads(d_model)
    _check(
        heads % mb.n_groups == 0,
        f"model.mamba2.n_groups: must divide the {heads} heads (d_inner / head_dim), got {mb.n_groups}",
    )


def _check_layers(m: ModelConfig) -> None:
    """model.layers: per entry at most one mixer kind then at most one FFN kind, "+"-joined, not empty; one entry
    per layer; the patterns stay at their defaults (one way to say what each layer holds)."""
    if m.layers is None:
        return
    _check(
        m.mixer_pattern == "A" and m.ffn_pattern == "E",
        "model.layers: set either model.layers or model.mixer_pattern/ffn_pattern, not both",
    )
    _check(
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
        _check(
            ok,
            f"model.layers[{i}]: expected a mixer ({'|'.join(MIXER_KINDS)}), an FFN ({'|'.join(FFN_KINDS)}) "
            f"or mixer+FFN, got {entry!r}",
        )


def _check_tensor_parallel(cfg: JobConfig) -> None:
    """Every dimension tensor parallelism splits must divide evenly by parallel.tp (see parallel/tensor_parallel.py)."""
    m, tp = cfg.model, cfg.parallel.tp
    a, mb, moe = m.attention, m.mamba, m.moe

    def divides(value: int, key: str, what: str) -> None:
        _check(value % tp == 0, f"{key}: {what} {value} is not divisible by parallel.tp={tp}")

    divides(m.vocab_size, "model.vocab_size", "the vocabulary (split across tensor-parallel ranks)")
    _check(
        m.ffn_activation == "swiglu",
        f"model.ffn_activation: {m.ffn_activation!r} FFNs do not support tensor parallelism yet (parallel.tp > 1)",
    )
    if m.has_kind("mamba2"):
        _check_mamba2_tp(m.d_model, m.mamba2, tp)
    if m.has_kind("gdn"):  # each key head keeps its value heads (a multiple of n_k_heads, so they split too)
        divides(m.gdn.n_k_heads, "model.gdn.n_k_heads", "Gated DeltaNet key heads")
    if m.has_kind("attention"):
        _check(
            a.qk_norm != "full",
            "model.attention.qk_norm: 'full' (one norm over all heads) is not supported with parallel.tp > 1",
        )
        divides(a.n_heads, "model.attention.n_heads", "query heads")
        divides(a.n_kv_heads, "model.attention.n_kv_heads", "key/value heads")
    if m.has_kind("mamba1"):
        divides(mb.expand * m.d_model, "model.mamba.expand", "d_inner = expand * d_model =")
        _check(
            not mb.proj_bias,
            "model.mamba.proj_bias: biases of Mamba's in/out projections are not supported with parallel.tp > 1",
        )
    if m.has_kind("mlp"):
        divides(m.d_ff, "model.d_ff", "the dense FFN hidden size")
    if m.has_kind("moe"):
        if cfg.parallel.expert_tp > 1:  # parallel.etp=1 keeps the experts whole
            divides(moe.d_ff or m.d_ff, "model.moe.d_ff", "the expert hidden size")
        if moe.shared_hidden(m.d_ff):
            divides(moe.shared_hidden(m.d_ff), "model.moe.shared_d_ff", "the shared experts' hidden size")
    if cfg.parallel.sequence_parallel:
        divides(cfg.train.seq_len, "train.seq_len", "with parallel.sequence_parallel, the sequence length")


def _check_mamba2_tp(d_model: int, mb: Mamba2Config, tp: int) -> None:
    """Mamba-2 under TP (parallel/tensor_parallel.py, `_mamba2`): heads split; whole groups per rank, or one group
    spread over tp / n_groups ranks, each holding 1/(tp / n_groups) of its B/C state channels."""
    heads, g = mb.heads(d_model), mb.n_groups
    _check(
        heads % tp == 0,
        f"model.mamba2.n_heads: the {heads} Mamba-2 heads (n_heads, or expand * d_model / head_dim) are not "
        f"divisible by parallel.tp={tp}",
    )
    _check(
        g % tp == 0 or tp % g == 0,
        f"model.mamba2.n_groups: {g} groups must be a multiple or a divisor of parallel.tp={tp}",
    )
    if g < tp:
        _check(
            mb.d_state % (tp // g) == 0,
            f"model.mamba2.d_state: {mb.d_state} is not divisible by parallel.tp / n_groups = {tp // g} (each group's "
            "B and C are split over that many ranks)",
        )
    _check(
        not mb.proj_bias,
        "model.mamba2.proj_bias: biases of Mamba-2's in/out projections are not supported with parallel.tp > 1",
    )


def check_layout(cfg: JobConfig, world_size: int) -> int:
    """Validate the parallel layout against the world size; return the data-parallel degree. Each error is one
    line naming the key, its value and the world size (the launcher's WORLD_SIZE, checked before start-up)."""
    tp, ep, etp, cp, pp = cfg.parallel.tp, cfg.parallel.ep, cfg.parallel.expert_tp, cfg.parallel.cp, cfg.parallel.pp
    _check(world_size % pp == 0, f"parallel.pp: {pp} does not divide the world size {world_size}")
    world = world_size  # profile ranks count every rank; the layout checks below count one pipeline stage's
    world_size //= pp  # ranks (pp is the outermost mesh dimension)
    _check(world_size % tp == 0, f"parallel.tp: {tp} does not divide the world size {world_size}")
    _check(
        (world_size // tp) % cp == 0,
        f"parallel.cp: {cp} does not divide world size / parallel.tp = {world_size} / {tp} = {world_size // tp}",
    )
    dp = world_size // (tp * cp)
    if etp == tp:  # expert parallelism spans the ranks holding the same weights: dp × cp of them per tp_rank
        _check(
            (dp * cp) % ep == 0,
            f"parallel.ep: {ep} must divide the data-parallel degree {dp * cp} (world {world_size} / tp {tp}"
            f"{', dp × cp with parallel.cp' if cp > 1 else ''}; parallel.etp=1 lets it divide dp × tp)",
        )
    else:
        _check(
            world_size % ep == 0,
            f"parallel.ep: {ep} must divide dp × tp = world size {world_size} with parallel.etp=1 (tp {tp})",
        )
    chunks = cfg.parallel.a2a_chunks
    _check(chunks >= 1, f"parallel.a2a_chunks: must be at least 1, got {chunks}")
    if cfg.parallel.a2a_dedup != "none" and ep > 1:
        _check(chunks == 1, f"parallel.a2a_dedup: {cfg.parallel.a2a_dedup!r} takes parallel.a2a_chunks=1, got {chunks}")
        _check(
            cfg.parallel.expert_tp == 1,
            f"parallel.a2a_dedup: {cfg.parallel.a2a_dedup!r} needs whole experts: parallel.tp=1 or parallel.etp=1 "
            f"(got tp {tp}, etp {cfg.parallel.etp})",
        )
    cp_part = f" / parallel.cp={cp}" if cp > 1 else ""
    ranks = f"{dp} data-parallel ranks (world size {world_size} / parallel.tp={tp}{cp_part})"
    # The engine's, checked here (at start-up) rather than in validate(): tools that build no engine (bench) take it.
    check_grad_reduction(cfg)
    check_global_batch(cfg.train.global_batch_size, cfg.train.micro_batch_size, dp, ranks)
    bad = [r for r in cfg.train.profile_ranks if not 0 <= r < world]
    _check(not bad, f"train.profile_ranks: {bad} outside the world's ranks 0..{world - 1}")
    _check(
        cfg.train.eval_batches % dp == 0,
        f"train.eval_batches: {cfg.train.eval_batches} is not divisible among {ranks}",
    )
    if ep > 1 and cfg.model.moe.group_by == "ep_rank":
        _check(
            cfg.model.moe.n_groups == ep,
            f"model.moe.n_groups: group_by 'ep_rank' needs one group per EP rank, n_groups = parallel.ep = {ep}, "
            f"got {cfg.model.moe.n_groups}",
        )
    return dp


def check_global_batch(global_batch_size: int, micro_batch_size: int, dp: int, ranks: str = "") -> None:
    """The global batch is cut into whole micro-batches, dealt evenly to the `dp` data-parallel ranks (the rule
    of the data's micro_batch_rows; `ranks` describes the layout in the message)."""
    _check(
        micro_batch_size > 0 and global_batch_size % micro_batch_size == 0,
        f"train.global_batch_size: must be a multiple of train.micro_batch_size={micro_batch_size}, "
        f"got {global_batch_size}",
    )
    micro = global_batch_size // micro_batch_size
    _check(
        micro % dp == 0,
        f"train.global_batch_size: {global_batch_size} sequences = {micro} micro-batches of "
        f"train.micro_batch_size={micro_batch_size}, not divisible among {ranks or f'{dp} data-parallel ranks'}",
    )


def _check_schedule(t: TrainConfig) -> None:
    """The optimizer and the learning-rate schedule (train/optim.py)."""
    _check(len(t.betas) == 2, f"train.betas: expected two numbers, got {t.betas}")
    _check(t.adam_eps > 0, f"train.adam_eps: must be positive, got {t.adam_eps}")
    _check(0.0 < t.decay_fraction <= 1.0, f"train.decay_fraction: must be in (0, 1], got {t.decay_fraction}")
    if t.lr_schedule == "wsd":
        decay = t.decay_steps()
        _check(
            decay >= 1 and t.warmup_steps + decay <= t.steps,
            f"train.decay_fraction: {t.decay_fraction} of train.steps={t.steps} is {decay} decay steps; wsd needs "
            f"at least 1 and train.warmup_steps={t.warmup_steps} + them <= train.steps",
        )


def _check_run_settings(t: TrainConfig) -> None:
    """Checkpoint keeping, saving and the non-finite guard (train/loop.py, train/checkpoint.py, train/guard.py)."""
    for key in ("keep_last", "max_nonfinite_steps", "save_buffer_mb"):
        _check(getattr(t, key) >= 0, f"train.{key}: must be >= 0, got {getattr(t, key)}")
    _check(t.save_timeout_s > 0, f"train.save_timeout_s: must be > 0, got {t.save_timeout_s}")
    _check(
        t.save_staging_mb * 2**20 >= 1024, f"train.save_staging_mb: must be >= 1/1024 (1 KiB), got {t.save_staging_mb}"
    )
    bad = [s for s in t.profile_steps if not 1 <= s <= t.steps]
    _check(not bad, f"train.profile_steps: {bad} outside the run's optimizer steps 1..{t.steps}")


def _check_data(d: DataConfig) -> None:
    """The data section's rules that need no file (the files are checked where the data is read)."""
    _check(0.0 < d.val_fraction < 1.0, f"data.val_fraction: must be in (0, 1), got {d.val_fraction}")
    _check(not d.mixture or d.source == "memmap", "data.mixture: only the 'memmap' source takes a mixture")
    if d.source == "text":
        _check(bool(d.paths), "data.paths: required when data.source is 'text'")
    if d.source == "memmap":
        _check(not (d.mixture and d.paths), "data.paths: give either data.paths or data.mixture, not both")
        _check(
            bool(d.mixture or d.paths),
            "data.paths: the memmap source needs shard-set sidecars (PREFIX.json) or data.mixture",
        )
    for i, c in enumerate(d.mixture):
        _check(c.weight > 0, f"data.mixture[{i}].weight: must be positive, got {c.weight}")


def _check_gdn(g: GDNConfig) -> None:
    """The Gated DeltaNet mixer's shapes (checked whether or not a layer uses it: its defaults satisfy them)."""
    for key in ("n_k_heads", "n_v_heads", "head_k_dim", "head_v_dim", "conv_size", "chunk_size"):
        _check(getattr(g, key) > 0, f"model.gdn.{key}: must be positive, got {getattr(g, key)}")
    _check(
        g.n_v_heads % g.n_k_heads == 0,
        f"model.gdn.n_k_heads: must divide n_v_heads={g.n_v_heads}, got {g.n_k_heads}",
    )
    _check(
        g.chunk_size & (g.chunk_size - 1) == 0,
        f"model.gdn.chunk_size: must be a power of two, got {g.chunk_size}",
    )


def check_grad_reduction(cfg: JobConfig) -> None:
    """The gradient reduction options against what the DeepSpeed engine can honour (train/optim.py)."""
    t, stage = cfg.train, cfg.deepspeed.zero_stage
    _check(
        t.grad_reduce_bucket_mb > 0 and math.isfinite(t.grad_reduce_bucket_mb),
        f"train.grad_reduce_bucket_mb: must be a positive number of MiB, got {t.grad_reduce_bucket_mb}",
    )
    _check(
        t.reduce_bucket_elements() >= 1,
        f"train.grad_reduce_bucket_mb: {t.grad_reduce_bucket_mb} MiB holds no whole gradient element",
    )
    _check(
        not t.grad_reduce_overlap or stage == 2,
        f"train.grad_reduce_overlap: true is not honoured at deepspeed.zero_stage={stage} (stage 0 reduces from no "
        "gradient hooks; DeepSpeed 0.19.8's overlapped stage 1 reduces the wrong gradients once a step spans more "
        "than one bucket); set it false or null, or use stage 2",
    )
    zero = cfg.deepspeed.extra.get("zero_optimization")
    _check(
        not isinstance(zero, dict) or not {"overlap_comm", "reduce_bucket_size"} & set(zero),
        "deepspeed.extra: zero_optimization's overlap_comm / reduce_bucket_size are train.grad_reduce_overlap / "
        "train.grad_reduce_bucket_mb; set those instead",
    )
