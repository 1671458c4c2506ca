"""Every rule a loaded config must satisfy beyond its types, each stated once.

`validate` holds the rules that need only the config (load_config and config_from_dict run it); the parallel
layout's rules live in parallel_checks.py (`check_parallel` from here, `check_layout` where the world size is
known). Each failure is a ConfigError of one line naming the key (tests/config/test_config.py). Rules that need files
(data paths, tokenizers, the run directory) are checked where those are read, with errors naming the key as well.
Depends on schema.py and parallel_checks.py; loading.py imports this module.
"""

from __future__ import annotations

import math

from moe_dist.config.parallel_checks import check_global_batch, check_parallel
from moe_dist.config.schema import (
    DataConfig,
    JobConfig,
    ModelConfig,
    PlanConfig,
    TrainConfig,
    layer_kinds,
    require,
)


def validate(cfg: JobConfig) -> None:
    """Cross-field checks that do not depend on the world size (see `check_layout` for those)."""
    m, t = cfg.model, cfg.train
    for name in ("vocab_size", "d_model", "n_layers", "d_ff"):
        require(getattr(m, name) > 0, f"model.{name}: must be positive, got {getattr(m, name)}")
    _check_patterns(m)
    _check_layers(m)
    for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
        require(getattr(m, name) > 0, f"model.{name}: must be positive, got {getattr(m, name)}")
    placed = {kind for pair in m.layer_kinds() for kind in pair if kind is not None}
    for kind in layer_kinds():  # every kind's section; what relates it to the model where a layer places it
        if kind.check is not None:
            kind.check(cfg, kind.name in placed)
    check_parallel(cfg)
    require(t.steps > 0, f"train.steps: must be positive, got {t.steps}")
    require(t.seq_len > 0, f"train.seq_len: must be positive, got {t.seq_len}")
    require(t.micro_batch_size > 0, f"train.micro_batch_size: must be positive, got {t.micro_batch_size}")
    check_global_batch(t.global_batch_size, t.micro_batch_size, 1)  # the data-parallel part: check_layout
    parts = {kind.part for kind in layer_kinds()}
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
    _check_plan(cfg.plan)


def advisories(cfg: JobConfig) -> list[str]:
    """Settings that are legal but probably not meant, one `warning:` line each (launch/train.py prints them at
    start-up): a warm-up longer than the run never reaches train.lr."""
    t = cfg.train
    out = []
    if t.warmup_steps > t.steps:
        peak = t.lr * t.steps / t.warmup_steps
        out.append(
            f"warning: train.warmup_steps={t.warmup_steps} > train.steps={t.steps}: the run ends in the warm-up, "
            f"at lr {peak:.3g} of train.lr={t.lr:g}"
        )
    return out


def _check_patterns(m: ModelConfig) -> None:
    """model.mixer_pattern / ffn_pattern: the kinds' letters, each pattern's length dividing n_layers."""
    for name, role in (("mixer_pattern", "mixer"), ("ffn_pattern", "ffn")):
        letters = {k.letter: k.name for k in layer_kinds(role) if k.letter}
        pattern = getattr(m, name)
        require(
            bool(pattern) and set(pattern) <= set(letters),
            f"model.{name}: letters {', '.join(f'{c} ({n})' for c, n in letters.items())} only, got {pattern!r}",
        )
        require(
            m.n_layers % len(pattern) == 0,
            f"model.{name}: length {len(pattern)} must divide model.n_layers={m.n_layers}",
        )


def _check_plan(p: PlanConfig) -> None:
    mib = p.device_memory_mib
    require(mib is None or mib > 0, f"plan.device_memory_mib: must be positive or null, got {mib}")
    margin = p.fragmentation_margin
    require(0 <= margin < 1, f"plan.fragmentation_margin: must be in [0, 1), got {margin}")
    rho = p.expert_imbalance
    require(rho is None or rho >= 1, f"plan.expert_imbalance: must be >= 1 (the mean load) or null, got {rho}")


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
    mixers, ffns = ({k.name for k in layer_kinds(role)} for role in ("mixer", "ffn"))
    for i, entry in enumerate(m.layers):
        parts = entry.split("+") if isinstance(entry, str) else []
        ok = 1 <= len(parts) <= 2 and all(parts)
        if ok and len(parts) == 2:
            ok = parts[0] in mixers and parts[1] in ffns
        elif ok:
            ok = parts[0] in mixers or parts[0] in ffns
        require(
            ok,
            f"model.layers[{i}]: expected a mixer ({'|'.join(sorted(mixers))}), an FFN ({'|'.join(sorted(ffns))}) "
            f"or mixer+FFN, got {entry!r}",
        )


def _check_schedule(t: TrainConfig) -> None:
    """The optimizer and the learning-rate schedule (train/optim.py): every value torch's AdamW or the schedule
    would refuse (or silently misuse) steps into, named here before anything is built."""
    require(math.isfinite(t.lr) and t.lr > 0, f"train.lr: must be a positive finite number, got {t.lr}")
    require(
        t.peak_tflops is None or (math.isfinite(t.peak_tflops) and t.peak_tflops > 0),
        f"train.peak_tflops: must be null or a positive number of TFLOP/s, got {t.peak_tflops}",
    )
    require(0.0 <= t.min_lr_ratio <= 1.0, f"train.min_lr_ratio: must be in [0, 1], got {t.min_lr_ratio}")
    require(t.warmup_steps >= 0, f"train.warmup_steps: must be >= 0, got {t.warmup_steps}")
    require(t.weight_decay >= 0, f"train.weight_decay: must be >= 0, got {t.weight_decay}")
    require(t.grad_clip >= 0, f"train.grad_clip: must be >= 0 (0 = off), got {t.grad_clip}")
    require(len(t.betas) == 2, f"train.betas: expected two numbers, got {t.betas}")
    for i, b in enumerate(t.betas):
        require(0.0 <= b < 1.0, f"train.betas[{i}]: must be in [0, 1), got {b}")
    require(math.isfinite(t.adam_eps) and t.adam_eps > 0, f"train.adam_eps: must be positive, got {t.adam_eps}")
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
