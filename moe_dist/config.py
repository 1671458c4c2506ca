"""Job configuration: a tree of small dataclasses loaded strictly from JSON.

Every field has a one-line comment. Unknown keys and wrong types are errors naming the dotted path;
`--set a.b.c=VALUE` overrides use the same paths. Runtime objects (process groups, devices) never live here.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional


class ConfigError(ValueError):
    """A configuration problem; the message is one line naming the dotted key."""


@dataclass
class AttentionConfig:
    n_heads: int = 8  # query heads
    n_kv_heads: int = 8  # key/value heads (grouped-query attention when < n_heads)
    head_dim: Optional[int] = None  # per-head size; null = d_model // n_heads
    rope: bool = True  # rotary position embeddings (Jamba's attention has none: its Mamba layers carry position)
    rope_theta: float = 10000.0  # RoPE base frequency
    sliding_window: Optional[int] = None  # attend only to the last N positions (Mistral/Mixtral); null = all
    impl: Literal["auto", "torch", "triton"] = (
        "auto"  # attention: auto/torch = SDPA (flash/cuDNN on CUDA), triton = ours
    )
    mask: Literal["causal", "prefix"] = "causal"  # prefix = prefix-LM: a document's prompt tokens see each other
    qk_norm: Literal["none", "head", "full"] = "none"  # RMSNorm of q and k: per head (Qwen3), over all heads (OLMoE)
    qkv_bias: bool = False  # biases in the q, k and v projections (Qwen2)


@dataclass
class MambaConfig:
    d_state: int = 16  # SSM state size N per channel
    d_conv: int = 4  # depthwise causal conv width
    expand: int = 2  # d_inner = expand * d_model
    dt_rank: Optional[int] = None  # rank of the Δ projection; null = ceil(d_model / 16)
    conv_bias: bool = True  # bias in the depthwise conv1d
    proj_bias: bool = False  # bias in in_proj / out_proj
    inner_norms: bool = False  # Jamba's RMSNorms on Δ, B and C after x_proj
    chunk_size: int = 16  # chunk length of the chunked PyTorch scan (the CPU path; 16 is fastest on CPU)
    impl: Literal["auto", "torch", "triton"] = "auto"  # scan: auto = Triton kernel on CUDA, chunked PyTorch on CPU


@dataclass
class MoEConfig:
    num_experts: int = 8  # routed experts per MoE layer
    top_k: int = 2  # experts chosen per token
    d_ff: Optional[int] = None  # expert hidden size; null = model.d_ff
    capacity_factor: Optional[float] = 1.25  # per-expert capacity multiplier; null = dropless
    min_capacity: int = 0  # lower bound on the per-expert capacity
    drop_policy: Literal["position", "probability"] = "position"  # which over-capacity assignments are dropped
    renormalize: bool = True  # renormalize the top-k weights to sum to 1 (Mixtral)
    aux_loss_coef: float = 0.01  # coefficient of the Switch/GShard load-balancing loss
    z_loss_coef: float = 0.001  # coefficient of the ST-MoE router z-loss
    impl: Literal["auto", "torch", "triton"] = "auto"  # token permutation: auto = Triton kernel on CUDA, PyTorch on CPU
    backend: Literal["native", "megablocks"] = "native"  # expert GEMMs: torch grouped_mm, or MegaBlocks (CUDA only)
    score: Literal["softmax", "sigmoid"] = "softmax"  # router score: softmax over experts (Mixtral) or sigmoid each
    route_scale: float = 1.0  # multiplier of the chosen experts' combine weights (DeepSeek-V3's routed scaling factor)
    bias_update_rate: float = 0.0  # loss-free balancing: per-expert choice bias moved by this × sign each step; 0 = off
    aux_loss_scope: Literal["micro_batch", "sequence", "global_batch"] = (
        "micro_batch"  # load fractions f_i of the aux loss: per micro-batch, per sequence, or the whole step
    )
    global_batch_load: Literal["this_step", "previous_step"] = (
        "this_step"  # aux_loss_scope global_batch's f_i: this step's, from a no-grad routing pre-pass (one extra
        # forward per micro-batch), or the previous step's (no extra forward, one step stale)
    )
    n_groups: int = 1  # expert groups for group-limited routing (contiguous blocks of experts); 1 = off
    topk_groups: int = 1  # groups a token may choose its experts from (best by the sum of their top-2 scores)
    group_by: Literal["experts", "ep_rank", "node"] = "experts"  # what the groups must coincide with under EP
    n_shared_experts: int = 0  # shared experts: a dense SwiGLU on every token beside the routed ones (0 = none)
    shared_d_ff: Optional[int] = None  # hidden size of the shared SwiGLU; null = n_shared_experts × expert d_ff
    shared_gate: bool = False  # scale the shared experts' output by sigmoid(x · w) per token (Qwen2-MoE)
    dead_expert_window: int = 100  # telemetry: an expert is dead when no token reached it in this many steps


@dataclass
class ModelConfig:
    vocab_size: int = 256  # tokens (256 = raw bytes)
    d_model: int = 256  # residual width
    n_layers: int = 4  # decoder blocks
    d_ff: int = 512  # dense SwiGLU hidden size (and expert size unless moe.d_ff is set)
    mixer_pattern: str = "A"  # per-layer mixer, tiled over n_layers: A = attention, M = Mamba
    ffn_pattern: str = "E"  # per-layer FFN, tiled over n_layers: D = dense SwiGLU, E = MoE
    norm_eps: float = 1e-5  # RMSNorm epsilon
    tie_embeddings: bool = False  # share the embedding matrix with the LM head
    init_std: float = 0.02  # std of the normal init of projection weights
    attention: AttentionConfig = field(default_factory=AttentionConfig)  # attention mixer
    mamba: MambaConfig = field(default_factory=MambaConfig)  # Mamba mixer
    moe: MoEConfig = field(default_factory=MoEConfig)  # MoE FFN


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor-parallel degree
    ep: int = 1  # expert-parallel degree (divides dp; with etp = 1 it divides dp × tp)
    etp: Optional[int] = None  # expert tensor-parallel size: tp (null, experts split over TP) or 1 (whole experts)
    sequence_parallel: bool = False  # with tp > 1: norms and residuals hold 1/tp of the sequence (less memory)
    a2a_chunks: int = 1  # ep > 1: dispatch in this many token chunks, all-to-alls overlapping other chunks' experts
    timeout_s: float = 600.0  # rendezvous and collective timeout: a missing or hung rank fails the job after this


@dataclass
class MixtureComponent:
    paths: list[str] = field(default_factory=list)  # shard-set sidecars (PREFIX.json) or globs of them
    weight: float = 1.0  # relative probability that a sequence is drawn from this component


@dataclass
class DataConfig:
    source: Literal["stdlib", "text", "memmap"] = (
        "stdlib"  # embedded stdlib sources, text files, or prepare_data output
    )
    paths: list[str] = field(default_factory=list)  # files or globs for "text"; shard-set sidecars for "memmap"
    val_fraction: float = 0.05  # held-out fraction of the token stream for validation
    max_bytes: Optional[int] = 8_000_000  # cap on bytes read for "stdlib"/"text" (null = all)
    tokenizer: str = "bytes"  # "bytes", or the tokenizer.json / directory the memmap data was prepared with
    mixture: list[MixtureComponent] = field(default_factory=list)  # "memmap": weighted components instead of paths
    document_masking: bool = False  # packed documents: attention, RoPE and Mamba state restart at each document
    align_to_documents: bool = False  # training windows start at a document start (fine-tuning: no cut prompts)


@dataclass
class TrainConfig:
    steps: int = 100  # optimizer steps
    seq_len: int = 128  # tokens per sequence
    global_batch_size: int = 8  # sequences per optimizer step, identical for every layout
    micro_batch_size: int = 4  # sequences per forward on one rank; gradient accumulation is derived
    seed: int = 0  # seed for init and data
    lr: float = 1e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # final lr as a fraction of lr (cosine decay)
    warmup_steps: int = 10  # linear warmup steps
    weight_decay: float = 0.1  # AdamW weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW betas
    grad_clip: float = 1.0  # clip to this global gradient norm (0 = off)
    dtype: Literal["fp32", "bf16"] = "fp32"  # training precision
    save_every: int = 0  # checkpoint every N steps (0 = only at the end)
    eval_every: int = 0  # validation every N steps (0 = only at the end)
    eval_batches: int = 4  # validation micro-batches in one pass, in total over the data-parallel ranks
    histogram_every: int = 10  # TensorBoard histogram period in steps
    image_every: int = 10  # TensorBoard expert-load image period in steps (0 = off)
    threads: int = 0  # torch CPU threads per process (0 = cores / local processes)
    keep_last: int = 0  # checkpoints kept: after each save all but the newest N are deleted (0 = keep all)
    max_nonfinite_steps: int = 5  # stop after this many optimizer steps in a row skipped for NaN/Inf (0 = never)
    compile: bool = False  # torch.compile norms, attention and dense FFNs in place (MoE and Mamba stay eager)
    activation_checkpointing: Literal["none", "full", "selective"] = (
        "none"  # recompute activations in the backward: full = every part below, selective = train.checkpoint_parts
    )
    checkpoint_parts: list[str] = field(default_factory=list)  # for selective: attention, mamba, moe_experts, mlp
    grad_accum_dtype: Literal["fp32", "bf16"] = (
        "fp32"  # with dtype bf16: gradients accumulate over micro-batches and are reduced in this dtype
    )
    async_save: bool = False  # checkpoint: snapshot to host memory, write in the background while training goes on
    save_buffer_mb: int = 256  # checkpoint: host memory for tensors gathered and not yet written (synchronous save)
    save_timeout_s: float = 1800.0  # checkpoint save and load: limit of every wait (writers, their collectives)


@dataclass
class DeepSpeedConfig:
    zero_stage: Literal[0, 1, 2] = 1  # ZeRO stage
    extra: dict = field(default_factory=dict)  # merged verbatim into the DeepSpeed config (expert use)


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)  # architecture
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # parallel layout
    data: DataConfig = field(default_factory=DataConfig)  # training data
    train: TrainConfig = field(default_factory=TrainConfig)  # optimization loop
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)  # DeepSpeed engine settings


# ----------------------------------------------------------------------------------------------- loading


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Check `value` against the annotation `tp`, returning it (ints widened to float where a float is asked)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], path)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices or type(value) is not type(choices[0]):
            raise ConfigError(f"{path}: expected one of {list(choices)}, got {value!r}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__} {value!r}")
        return [_convert(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected an object, got {type(value).__name__} {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected an object, got {type(value).__name__} {value!r}")
        return _build(tp, value, path)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected float, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected int, got {type(value).__name__} {value!r}")
        return value
    if tp in (bool, str):
        if not isinstance(value, tp):
            raise ConfigError(f"{path}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
        return value
    raise ConfigError(f"{path}: unsupported type {_type_name(tp)}")


def _unknown_key(cls: type, key: str, prefix: str) -> ConfigError:
    names = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(key, names, n=1)
    hint = f" (did you mean '{prefix}{close[0]}'?)" if close else f" (valid keys: {', '.join(names)})"
    return ConfigError(f"{prefix}{key}: unknown config key{hint}")


def _build(cls: type, raw: dict, path: str = "") -> Any:
    prefix = f"{path}." if path else ""
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            raise _unknown_key(cls, key, prefix)
        kwargs[key] = _convert(value, hints[key], prefix + key)
    return cls(**kwargs)


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=VALUE` → ("a.b", VALUE parsed as JSON where it parses, else the raw string)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected KEY=VALUE with a dotted KEY")
    key, raw = text.split("=", 1)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip(), value


def _apply_override(raw: dict, cls: type, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node, node_cls = raw, cls
    for depth, part in enumerate(parts):
        prefix = ".".join(parts[:depth])
        prefix = f"{prefix}." if prefix else ""
        if not dataclasses.is_dataclass(node_cls):
            raise ConfigError(f"{prefix}{part}: '{prefix[:-1]}' is not a section")
        names = {f.name for f in dataclasses.fields(node_cls)}
        if part not in names:
            raise _unknown_key(node_cls, part, prefix)
        if depth == len(parts) - 1:
            node[part] = value
            return
        node_cls = typing.get_type_hints(node_cls)[part]
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{prefix}{part}: expected an object")


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> JobConfig:
    """Load a JSON file (or the defaults when `path` is None), apply dotted overrides, validate."""
    raw: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{p}: config file not found")
        try:
            raw = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{p}: the top level must be a JSON object")
    for text in overrides or []:
        key, value = parse_override(text)
        _apply_override(raw, JobConfig, key, value)
    cfg = _build(JobConfig, raw)
    validate(cfg)
    return cfg


def config_to_dict(cfg: JobConfig) -> dict:
    return dataclasses.asdict(cfg)


def config_from_dict(raw: dict) -> JobConfig:
    cfg = _build(JobConfig, raw)
    validate(cfg)
    return cfg


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
    _check(
        a.n_heads > 0 and a.n_kv_heads > 0 and a.n_heads % a.n_kv_heads == 0,
        f"model.attention.n_kv_heads: must divide n_heads={a.n_heads}, got {a.n_kv_heads}",
    )
    if a.head_dim is None:
        _check(
            m.d_model % a.n_heads == 0,
            f"model.attention.n_heads: must divide d_model={m.d_model} when head_dim is null, got {a.n_heads}",
        )
    _check(
        mb.d_state > 0 and mb.d_conv > 0 and mb.expand > 0 and mb.chunk_size > 0,
        "model.mamba: d_state, d_conv, expand and chunk_size must be positive",
    )
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
    _check(
        t.global_batch_size % t.micro_batch_size == 0,
        f"train.global_batch_size: must be a multiple of train.micro_batch_size={t.micro_batch_size}, "
        f"got {t.global_batch_size}",
    )
    _check(len(t.betas) == 2, f"train.betas: expected two numbers, got {t.betas}")
    parts = {"attention", "mamba", "moe_experts", "mlp"}
    _check(
        set(t.checkpoint_parts) <= parts,
        f"train.checkpoint_parts: expected a subset of {sorted(parts)}, got {t.checkpoint_parts}",
    )
    _check(
        t.activation_checkpointing == "selective" or not t.checkpoint_parts,
        f"train.checkpoint_parts: only used with train.activation_checkpointing='selective', "
        f"not {t.activation_checkpointing!r}",
    )
    _check(0.0 < cfg.data.val_fraction < 1.0, f"data.val_fraction: must be in (0, 1), got {cfg.data.val_fraction}")
    _check(
        cfg.data.source == "stdlib" or bool(cfg.data.paths),
        f"data.paths: required when data.source is {cfg.data.source!r}",
    )


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


def shared_d_ff(m: ModelConfig) -> int:
    """Hidden size of an MoE layer's shared SwiGLU (0 without shared experts)."""
    moe = m.moe
    if moe.n_shared_experts == 0:
        return 0
    return moe.shared_d_ff or moe.n_shared_experts * (moe.d_ff or m.d_ff)


def _check_tensor_parallel(cfg: JobConfig) -> None:
    """Every dimension tensor parallelism splits must divide evenly by parallel.tp (see parallel/tensor_parallel.py)."""
    m, tp = cfg.model, cfg.parallel.tp
    a, mb, moe = m.attention, m.mamba, m.moe

    def divides(value: int, key: str, what: str) -> None:
        _check(value % tp == 0, f"{key}: {what} {value} is not divisible by parallel.tp={tp}")

    divides(m.vocab_size, "model.vocab_size", "the vocabulary (split across tensor-parallel ranks)")
    if "A" in m.mixer_pattern:
        _check(
            a.qk_norm != "full",
            "model.attention.qk_norm: 'full' (one norm over all heads) is not supported with parallel.tp > 1",
        )
        divides(a.n_heads, "model.attention.n_heads", "query heads")
        divides(a.n_kv_heads, "model.attention.n_kv_heads", "key/value heads")
    if "M" in m.mixer_pattern:
        divides(mb.expand * m.d_model, "model.mamba.expand", "d_inner = expand * d_model =")
        _check(
            not mb.proj_bias,
            "model.mamba.proj_bias: biases of Mamba's in/out projections are not supported with parallel.tp > 1",
        )
    if "D" in m.ffn_pattern:
        divides(m.d_ff, "model.d_ff", "the dense FFN hidden size")
    if "E" in m.ffn_pattern:
        if expert_tp(cfg) > 1:  # parallel.etp=1 keeps the experts whole
            divides(moe.d_ff or m.d_ff, "model.moe.d_ff", "the expert hidden size")
        if shared_d_ff(m):
            divides(shared_d_ff(m), "model.moe.shared_d_ff", "the shared experts' hidden size")
    if cfg.parallel.sequence_parallel:
        divides(cfg.train.seq_len, "train.seq_len", "with parallel.sequence_parallel, the sequence length")


def check_layout(cfg: JobConfig, world_size: int) -> int:
    """Validate the parallel layout against the world size; return the data-parallel degree. Each error is one
    line naming the key, its value and the world size (the launcher's WORLD_SIZE, checked before start-up)."""
    tp, ep, etp = cfg.parallel.tp, cfg.parallel.ep, expert_tp(cfg)
    _check(world_size % tp == 0, f"parallel.tp: {tp} does not divide the world size {world_size}")
    dp = world_size // tp
    if etp == tp:
        _check(
            dp % ep == 0,
            f"parallel.ep: {ep} must divide the data-parallel degree {dp} (world {world_size} / tp {tp}; "
            f"parallel.etp=1 lets it divide dp × tp)",
        )
    else:
        _check(
            world_size % ep == 0,
            f"parallel.ep: {ep} must divide dp × tp = world size {world_size} with parallel.etp=1 (tp {tp})",
        )
    chunks = cfg.parallel.a2a_chunks
    _check(chunks >= 1, f"parallel.a2a_chunks: must be at least 1, got {chunks}")
    ranks = f"{dp} data-parallel ranks (world size {world_size} / parallel.tp={tp})"
    # The engine's, checked here (at start-up) rather than in validate(): tools that build no engine (bench) take it.
    _check(
        cfg.train.dtype == "fp32" or cfg.train.grad_accum_dtype == "bf16" or cfg.deepspeed.zero_stage == 2,
        "deepspeed.zero_stage: bf16 training with fp32 gradient accumulation (train.grad_accum_dtype, the default) "
        "needs ZeRO stage 2; set deepspeed.zero_stage=2, or train.grad_accum_dtype=bf16 to accumulate in bf16",
    )
    micro = cfg.train.global_batch_size // cfg.train.micro_batch_size
    _check(
        micro % dp == 0,
        f"train.global_batch_size: {cfg.train.global_batch_size} sequences = {micro} micro-batches of "
        f"train.micro_batch_size={cfg.train.micro_batch_size}, not divisible among {ranks}",
    )
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


def expert_tp(cfg: JobConfig) -> int:
    """The expert tensor-parallel size: `parallel.etp`, or `parallel.tp` when unset."""
    return cfg.parallel.tp if cfg.parallel.etp is None else cfg.parallel.etp


def grad_accum_steps(cfg: JobConfig, dp: int) -> int:
    return cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp)
