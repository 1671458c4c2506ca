"""The parallel layout's rules, each stated once: `check_parallel` those that need only the config (validate runs
it), `check_layout` those that need the world size too (the launcher's WORLD_SIZE, at start-up and in --dry-run).
Each failure is a ConfigError of one line naming the key. Depends on schema.py only."""

from __future__ import annotations

import math

from moe_dist.config.schema import JobConfig, layer_kinds, require


def check_parallel(cfg: JobConfig) -> None:
    """The layout's rules that need no world size: each degree's own constraints, what TP, CP and PP split evenly, and
    what the engine needs under EP and bf16."""
    moe, t = cfg.model.moe, cfg.train
    require(cfg.parallel.tp >= 1 and cfg.parallel.ep >= 1, "parallel.tp and parallel.ep must be >= 1")
    _check_context_parallel(cfg)
    _check_pipeline(cfg)
    etp = cfg.parallel.etp
    require(
        etp is None or etp in (1, cfg.parallel.tp),
        f"parallel.etp: must be 1 or parallel.tp={cfg.parallel.tp} (or null: tp), got {etp}",
    )
    require(
        etp != 1 or cfg.parallel.tp == 1 or cfg.parallel.ep > 1,
        f"parallel.etp: 1 with parallel.tp={cfg.parallel.tp} needs parallel.ep > 1 (whole experts replicated over "
        "TP would compute every token tp times); set parallel.ep or leave parallel.etp null",
    )
    if cfg.parallel.tp > 1:
        _check_tensor_parallel(cfg)
        require(
            not t.compile,
            "train.compile: not supported with parallel.tp > 1 (the tensor-parallel region hooks "
            "issue collectives inside the compiled modules)",
        )
    require(
        cfg.parallel.ep == 1 or cfg.deepspeed.zero_stage >= 1,
        "deepspeed.zero_stage: expert parallelism (parallel.ep > 1) needs ZeRO stage 1 or 2 (stage 0's gradient "
        "clipping in DeepSpeed averages per-rank norms instead of computing the global norm)",
    )
    require(
        t.dtype == "fp32" or cfg.deepspeed.zero_stage >= 1,
        "deepspeed.zero_stage: bf16 training needs ZeRO stage 1 or 2 here (checkpoints read its fp32 master weights)",
    )
    require(
        moe.num_experts % cfg.parallel.ep == 0,
        f"parallel.ep: must divide model.moe.num_experts={moe.num_experts}, got {cfg.parallel.ep}",
    )


def _check_context_parallel(cfg: JobConfig) -> None:
    """`parallel.cp`: the sequence splits into 2·cp equal pieces, and what CP does not support is refused. (Whether
    every mixer of the model has a shard-aware forward is checked where the layers are known:
    models/decoder.check_context_parallel.)"""
    cp, t = cfg.parallel.cp, cfg.train
    require(cp >= 1, f"parallel.cp: must be >= 1, got {cp}")
    if cp == 1:
        return
    require(
        t.seq_len % (2 * cp) == 0,
        f"parallel.cp: train.seq_len={t.seq_len} must be divisible by 2·cp = {2 * cp} (a head and a tail piece "
        f"per rank)",
    )
    require(
        not cfg.parallel.sequence_parallel,
        "parallel.sequence_parallel: not supported with parallel.cp > 1 (the TP sequence split of CP pieces is "
        "untested)",
    )
    require(
        cfg.model.moe.drop_policy != "probability" or cfg.model.moe.capacity_factor is None,
        "model.moe.drop_policy: 'probability' is not supported with parallel.cp > 1 (drops in global score order "
        "would need every piece's scores); use 'position' or capacity_factor=null",
    )
    require(not t.compile, "train.compile: not supported with parallel.cp > 1 (CP exchanges run inside the mixers)")


def _check_pipeline(cfg: JobConfig) -> None:
    """`parallel.pp`, `pp_virtual`, `pp_cut`: the layer list cuts into pp × pp_virtual non-empty stages."""
    pa, n = cfg.parallel, cfg.model.n_layers
    require(pa.pp >= 1, f"parallel.pp: must be >= 1, got {pa.pp}")
    require(pa.pp_virtual >= 1, f"parallel.pp_virtual: must be >= 1, got {pa.pp_virtual}")
    require(pa.pp > 1 or pa.pp_virtual == 1, f"parallel.pp_virtual: {pa.pp_virtual} needs parallel.pp > 1")
    stages = pa.pp * pa.pp_virtual
    require(
        stages <= n,
        f"parallel.pp: pp × pp_virtual = {stages} stages for model.n_layers={n} (every stage needs a layer)",
    )
    if pa.pp_cut is not None:
        cut = list(pa.pp_cut)
        require(
            len(cut) == stages - 1 and cut == sorted(set(cut)) and all(0 < c < n for c in cut),
            f"parallel.pp_cut: {cut} must be {stages - 1} increasing layer indices in 1..{n - 1} (the first layer of "
            f"each stage after the first)",
        )


def check_pipeline_runtime(cfg: JobConfig) -> None:
    """Training only (plans take any layout): what the pipeline runtime (parallel/pipeline.py) does not run yet is
    refused rather than run wrong."""
    pa = cfg.parallel
    if pa.pp > 1:
        for unsupported, what in (
            (pa.cp > 1, f"parallel.cp={pa.cp}"),
            (cfg.train.compile, "train.compile=true"),
        ):
            require(not unsupported, f"parallel.pp: {pa.pp} does not run with {what} yet")
        moe = cfg.model.moe
        require(
            not (moe.aux_loss_scope == "global_batch" and moe.global_batch_load == "this_step"),
            "model.moe.global_batch_load: 'this_step' needs a routing pre-pass of the whole step, which "
            "parallel.pp > 1 does not run; use 'previous_step'",
        )


def _check_pipeline_micro_batches(cfg: JobConfig, micro: int) -> None:
    """The schedule's need: 1F1B fills the pipeline with pp micro-batches; interleaved 1F1B also runs them in
    rounds of pp (torch.distributed.pipelining's rule: the count a multiple of the rounds, max(1, m // pp))."""
    pp, v = cfg.parallel.pp, cfg.parallel.pp_virtual
    require(
        micro >= pp,
        f"train.global_batch_size: {cfg.train.global_batch_size} gives {micro} micro-batches per pipeline, fewer than "
        f"parallel.pp={pp} stages need (global_batch_size >= pp × micro_batch_size × data-parallel ranks)",
    )
    rounds = max(1, micro // pp)
    require(
        v == 1 or micro % rounds == 0,
        f"train.global_batch_size: {micro} micro-batches per pipeline is not a multiple of the interleaved schedule's "
        f"{rounds} rounds of parallel.pp={pp} (parallel.pp_virtual={v})",
    )


def _check_tensor_parallel(cfg: JobConfig) -> None:
    """Every dimension tensor parallelism splits must divide evenly by parallel.tp (see parallel/tensor_parallel.py)."""
    m, tp = cfg.model, cfg.parallel.tp

    def divides(value: int, key: str, what: str) -> None:
        require(value % tp == 0, f"{key}: {what} {value} is not divisible by parallel.tp={tp}")

    divides(m.vocab_size, "model.vocab_size", "the vocabulary (split across tensor-parallel ranks)")
    for kind in layer_kinds():  # each kind placed in the model splits its own dimensions (its tp_rule)
        if not m.has_kind(kind.name):
            continue
        require(
            kind.tp_rule is not None,
            f"model.layers: {kind.name} layers do not support tensor parallelism yet (parallel.tp > 1)",
        )
        if kind.check_tp is not None:
            kind.check_tp(cfg)
    if cfg.parallel.sequence_parallel:
        divides(cfg.train.seq_len, "train.seq_len", "with parallel.sequence_parallel, the sequence length")


def check_layout(cfg: JobConfig, world_size: int) -> int:
    """Validate the parallel layout against the world size; return the data-parallel degree. Each error is one
    line naming the key, its value and the world size (the launcher's WORLD_SIZE, checked before start-up)."""
    tp, ep, etp, cp, pp = cfg.parallel.tp, cfg.parallel.ep, cfg.parallel.expert_tp, cfg.parallel.cp, cfg.parallel.pp
    require(world_size % pp == 0, f"parallel.pp: {pp} does not divide the world size {world_size}")
    world = world_size  # profile ranks count every rank; the layout checks below count one pipeline stage's
    world_size //= pp  # ranks (pp is the outermost mesh dimension)
    require(world_size % tp == 0, f"parallel.tp: {tp} does not divide the world size {world_size}")
    require(
        (world_size // tp) % cp == 0,
        f"parallel.cp: {cp} does not divide world size / parallel.tp = {world_size} / {tp} = {world_size // tp}",
    )
    dp = world_size // (tp * cp)
    if etp == tp:  # expert parallelism spans the ranks holding the same weights: dp × cp of them per tp_rank
        require(
            (dp * cp) % ep == 0,
            f"parallel.ep: {ep} must divide the data-parallel degree {dp * cp} (world {world_size} / tp {tp}"
            f"{', dp × cp with parallel.cp' if cp > 1 else ''}; parallel.etp=1 lets it divide dp × tp)",
        )
    else:
        require(
            world_size % ep == 0,
            f"parallel.ep: {ep} must divide dp × tp = world size {world_size} with parallel.etp=1 (tp {tp})",
        )
    chunks = cfg.parallel.a2a_chunks
    require(chunks >= 1, f"parallel.a2a_chunks: must be at least 1, got {chunks}")
    if cfg.parallel.a2a_dedup != "none" and ep > 1:
        require(
            chunks == 1, f"parallel.a2a_dedup: {cfg.parallel.a2a_dedup!r} takes parallel.a2a_chunks=1, got {chunks}"
        )
        require(
            cfg.parallel.expert_tp == 1,
            f"parallel.a2a_dedup: {cfg.parallel.a2a_dedup!r} needs whole experts: parallel.tp=1 or parallel.etp=1 "
            f"(got tp {tp}, etp {cfg.parallel.etp})",
        )
    cp_part = f" / parallel.cp={cp}" if cp > 1 else ""
    ranks = f"{dp} data-parallel ranks (world size {world_size} / parallel.tp={tp}{cp_part})"
    # The engine's, checked here (at start-up) rather than in validate(): tools that build no engine (bench) take it.
    check_grad_reduction(cfg)
    check_global_batch(cfg.train.global_batch_size, cfg.train.micro_batch_size, dp, ranks)
    if pp > 1:
        _check_pipeline_micro_batches(cfg, cfg.train.grad_accum_steps(dp))
    bad = [r for r in cfg.train.profile_ranks if not 0 <= r < world]
    require(not bad, f"train.profile_ranks: {bad} outside the world's ranks 0..{world - 1}")
    require(
        cfg.train.eval_batches % dp == 0,
        f"train.eval_batches: {cfg.train.eval_batches} is not divisible among {ranks}",
    )
    if ep > 1 and cfg.model.moe.group_by == "ep_rank":
        require(
            cfg.model.moe.n_groups == ep,
            f"model.moe.n_groups: group_by 'ep_rank' needs one group per EP rank, n_groups = parallel.ep = {ep}, "
            f"got {cfg.model.moe.n_groups}",
        )
    return dp


def check_global_batch(global_batch_size: int, micro_batch_size: int, dp: int, ranks: str = "") -> None:
    """The global batch is cut into whole micro-batches, dealt evenly to the `dp` data-parallel ranks (the rule
    of the data's micro_batch_rows; `ranks` describes the layout in the message)."""
    require(
        micro_batch_size > 0 and global_batch_size % micro_batch_size == 0,
        f"train.global_batch_size: must be a multiple of train.micro_batch_size={micro_batch_size}, "
        f"got {global_batch_size}",
    )
    micro = global_batch_size // micro_batch_size
    require(
        micro % dp == 0,
        f"train.global_batch_size: {global_batch_size} sequences = {micro} micro-batches of "
        f"train.micro_batch_size={micro_batch_size}, not divisible among {ranks or f'{dp} data-parallel ranks'}",
    )


def check_grad_reduction(cfg: JobConfig) -> None:
    """The gradient reduction options against what the DeepSpeed engine can honour (train/optim.py)."""
    t, stage = cfg.train, cfg.deepspeed.zero_stage
    require(
        t.grad_reduce_bucket_mb > 0 and math.isfinite(t.grad_reduce_bucket_mb),
        f"train.grad_reduce_bucket_mb: must be a positive number of MiB, got {t.grad_reduce_bucket_mb}",
    )
    require(
        t.reduce_bucket_elements() >= 1,
        f"train.grad_reduce_bucket_mb: {t.grad_reduce_bucket_mb} MiB holds no whole gradient element",
    )
    require(
        not t.grad_reduce_overlap or stage in (1, 2),
        f"train.grad_reduce_overlap: true is not honoured at deepspeed.zero_stage={stage} (stage 0 reduces from no "
        "gradient hooks); set it false or null, or use stage 1 or 2",
    )
    if t.grad_reduce_overlap and stage == 1:
        from moe_dist.parallel.private_api import CHECKED_AGAINST, deepspeed_version_unchecked_for_overlap

        installed = deepspeed_version_unchecked_for_overlap()
        require(
            installed is None,
            f"train.grad_reduce_overlap: true at deepspeed.zero_stage=1 corrects DeepSpeed's overlapped stage 1, "
            f"checked against deepspeed {CHECKED_AGAINST['deepspeed']} only, installed {installed}; set it false",
        )
    require(
        not t.param_gather_overlap or stage in (1, 2),
        f"train.param_gather_overlap: true needs partitioned weights to gather (deepspeed.zero_stage 1 or 2), got "
        f"stage {stage}; set it false or null",
    )
    if t.param_gather_overlap:
        from moe_dist.parallel.private_api import CHECKED_AGAINST, deepspeed_version_unchecked_for_overlap

        installed = deepspeed_version_unchecked_for_overlap()
        require(
            installed is None,
            f"train.param_gather_overlap: true replaces DeepSpeed's gather after the step, checked against deepspeed "
            f"{CHECKED_AGAINST['deepspeed']} only, installed {installed}; set it false",
        )
    zero = cfg.deepspeed.extra.get("zero_optimization")
    require(
        not isinstance(zero, dict) or not {"overlap_comm", "reduce_bucket_size"} & set(zero),
        "deepspeed.extra: zero_optimization's overlap_comm / reduce_bucket_size are train.grad_reduce_overlap / "
        "train.grad_reduce_bucket_mb; set those instead",
    )
