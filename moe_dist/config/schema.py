"""The job configuration's schema: a tree of small dataclasses, and the sizes derived from them.

Every field has a one-line trailing comment (docs/config.md is generated from them by moe_dist/config/doc.py).
Runtime objects (process groups, devices) never live here. Derived sizes are methods of the section that owns
their inputs, so each formula exists once. Loading is in loading.py, the rules a config must satisfy in checks.py;
this module imports neither.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Optional


class ConfigError(ValueError):
    """A configuration problem; the message is one line naming the dotted key."""


def require(cond: bool, message: str) -> None:
    """A config rule: `message` (one line naming the key) as a ConfigError unless `cond` holds."""
    if not cond:
        raise ConfigError(message)


@dataclass
class AttentionConfig:
    n_heads: int = 8  # query heads
    n_kv_heads: int = 8  # key/value heads (grouped-query attention when < n_heads)
    head_dim: Optional[int] = None  # per-head size; null = d_model // n_heads
    rope: bool = True  # rotary position embeddings (Jamba's attention has none: its Mamba layers carry position)
    rope_theta: float = 10000.0  # RoPE base frequency
    sliding_window: Optional[int] = None  # attend only to the last N positions (Mistral/Mixtral); null = all
    impl: Literal["auto", "torch", "triton"] = (
        "auto"  # attention: torch = SDPA, triton = ours, auto = SDPA but ours for documents/prefix-LM on CUDA
    )
    mask: Literal["causal", "prefix"] = "causal"  # prefix = prefix-LM: a document's prompt tokens see each other
    qk_norm: Literal["none", "head", "full"] = "none"  # RMSNorm of q and k: per head (Qwen3), over all heads (OLMoE)
    qkv_bias: bool = False  # biases in the q, k and v projections (Qwen2)
    softmax_scale: Optional[float] = None  # multiplier of q·k before the softmax; null = 1/sqrt(head_dim) (Granite)
    output_gate: bool = False  # wq also gives a sigmoid gate per output channel, per head [q | gate] (Qwen3-Next)
    rope_fraction: float = 1.0  # RoPE rotates the first int(head_dim × this) dims of each head (Qwen3-Next: 0.25)


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
class Mamba2Config:
    d_state: int = 128  # SSM state size N per head (shared by the heads of a group)
    d_conv: int = 4  # depthwise causal conv width (over x, B and C)
    expand: int = 2  # d_inner = expand * d_model when n_heads is null
    n_heads: Optional[int] = None  # SSM heads; null = expand * d_model // head_dim; set: d_inner = n_heads * head_dim
    head_dim: int = 64  # channels per head (one scalar decay per head and step)
    n_groups: int = 1  # B/C groups: the heads are split evenly over them (also the gated norm's groups)
    chunk_size: int = 64  # chunk length of the chunked PyTorch SSD (a power of two)
    dt_min: float = 0.001  # init: the step size softplus(dt_bias) is log-uniform in [dt_min, dt_max]
    dt_max: float = 0.1  # init: upper end of that range
    dt_init_floor: float = 1e-4  # init: lower bound on the sampled step size
    dt_limit: Optional[list[float]] = (
        None  # [low, high] clamp of softplus(dt + dt_bias), high may be Infinity; null = none
    )
    conv_bias: bool = True  # bias in the depthwise conv1d
    proj_bias: bool = False  # bias in in_proj / out_proj
    impl: Literal["auto", "torch", "triton"] = "auto"  # SSD scan: torch = chunked; triton = fla-core's (extra `fla`)

    def d_inner(self, d_model: int) -> int:
        """The SSM width, n_heads * head_dim (the kind's config rules make the default n_heads exact)."""
        return self.heads(d_model) * self.head_dim

    def heads(self, d_model: int) -> int:
        """n_heads, or expand * d_model // head_dim when null."""
        return self.n_heads if self.n_heads is not None else self.expand * d_model // self.head_dim


@dataclass
class GDNConfig:
    n_k_heads: int = 2  # query/key heads (Qwen3-Next: linear_num_key_heads)
    n_v_heads: int = 4  # value heads, a multiple of n_k_heads; each key head serves n_v_heads / n_k_heads of them
    head_k_dim: int = 64  # per-head query/key size (the state is head_k_dim × head_v_dim per value head)
    head_v_dim: int = 64  # per-head value size
    conv_size: int = 4  # width of the causal depthwise conv over q, k and v
    chunk_size: int = 64  # chunk length of the chunked PyTorch delta rule (a power of two); the result is the same
    impl: Literal["auto", "torch", "triton"] = "auto"  # delta rule: torch = chunked; triton = fla-core's (extra `fla`)


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

    def shared_hidden(self, d_ff: int) -> int:
        """Hidden size of the layer's shared SwiGLU (0 without shared experts); `d_ff` is model.d_ff."""
        if self.n_shared_experts == 0:
            return 0
        return self.shared_d_ff or self.n_shared_experts * (self.d_ff or d_ff)


@dataclass
class ModelConfig:
    vocab_size: int = 256  # tokens (256 = raw bytes)
    d_model: int = 256  # residual width
    n_layers: int = 4  # decoder blocks
    d_ff: int = 512  # dense SwiGLU hidden size (and expert size unless moe.d_ff is set)
    mixer_pattern: str = "A"  # per-layer mixer, tiled over n_layers: A = attention, M = Mamba
    ffn_pattern: str = "E"  # per-layer FFN, tiled over n_layers: D = dense SwiGLU, E = MoE
    layers: Optional[list[str]] = None  # one entry per layer, e.g. "attention+moe", "mamba2"; null = the patterns
    norm_eps: float = 1e-5  # RMSNorm epsilon
    norm_zero_centered: bool = False  # RMSNorm weight w is an offset from one, x/rms·(1 + w) (Qwen3-Next; not gdn's)
    tie_embeddings: bool = False  # share the embedding matrix with the LM head
    init_std: float = 0.02  # std of the normal init of projection weights
    ffn_activation: Literal["swiglu", "relu2"] = (
        "swiglu"  # dense FFNs, experts and shared experts: SwiGLU, or relu(x)² without a gate (Nemotron-H)
    )
    embedding_multiplier: float = 1.0  # the embeddings are scaled by this (Granite)
    residual_multiplier: float = 1.0  # each sublayer's output is scaled by this before the residual add (Granite)
    logits_scaling: float = 1.0  # the logits are divided by this (Granite)
    attention: AttentionConfig = field(default_factory=AttentionConfig)  # attention mixer
    mamba: MambaConfig = field(default_factory=MambaConfig)  # Mamba mixer
    mamba2: Mamba2Config = field(default_factory=Mamba2Config)  # Mamba-2 (SSD) mixer ("mamba2" layers)
    gdn: GDNConfig = field(default_factory=GDNConfig)  # Gated DeltaNet mixer ("gdn" layers)
    moe: MoEConfig = field(default_factory=MoEConfig)  # MoE FFN

    def layer_list(self) -> list[str]:
        """Every layer's kinds, e.g. "attention+moe": `layers` as given, or mixer_pattern/ffn_pattern tiled over
        n_layers (A → attention, M → mamba1, D → mlp, E → moe). The one source of what each layer holds."""
        if self.layers is not None:
            return list(self.layers)
        name = {k.letter: k.name for k in layer_kinds() if k.letter}
        mp, fp = self.mixer_pattern, self.ffn_pattern
        return [f"{name[mp[i % len(mp)]]}+{name[fp[i % len(fp)]]}" for i in range(self.n_layers)]

    def layer_kinds(self) -> list[tuple[Optional[str], Optional[str]]]:
        """(mixer, ffn) per layer from `layer_list`, None where a layer has no such sublayer."""
        return [split_layer(entry) for entry in self.layer_list()]

    def has_kind(self, kind: str) -> bool:
        """Whether any layer holds `kind` (a mixer or FFN kind)."""
        return any(kind in pair for pair in self.layer_kinds())


def layer_kinds(role: Optional[str] = None) -> list:
    """The layer kinds (layers/registry.py), all or those of `role` ("mixer" | "ffn"). Imported when asked: the
    kinds' layer files read their sections from this module, so it cannot import them at its own import."""
    from moe_dist.layers.registry import KINDS

    return [k for k in KINDS.values() if role is None or k.role == role]


def split_layer(entry: str) -> tuple[Optional[str], Optional[str]]:
    """ "mamba2+moe" → ("mamba2", "moe"), "moe" → (None, "moe"); unknown parts are left to checks.py to refuse
    (this returns the best split it can: a part that is not an FFN kind is taken as the mixer)."""
    ffns = {k.name for k in layer_kinds("ffn")}
    parts = entry.split("+")
    mixer = parts[0] if parts and parts[0] not in ffns else None
    ffn = parts[-1] if parts and parts[-1] in ffns else None
    return mixer or None, ffn


@dataclass
class ParallelConfig:
    pp: int = 1  # pipeline-parallel degree: the layer list cut into pp stages (the outermost mesh dimension)
    pp_virtual: int = 1  # stages per pipeline rank: > 1 runs the interleaved 1F1B schedule (pp × pp_virtual stages)
    pp_cut: Optional[list[int]] = None  # first layer of each stage after the first (pp·pp_virtual − 1); null: by cost
    tp: int = 1  # tensor-parallel degree
    cp: int = 1  # context-parallel degree: each sequence split over cp ranks (a head and a tail piece each)
    ep: int = 1  # expert-parallel degree (divides dp; with etp = 1 it divides dp × tp)
    etp: Optional[int] = None  # expert tensor-parallel size: tp (null, experts split over TP) or 1 (whole experts)
    sequence_parallel: bool = False  # with tp > 1: norms and residuals hold 1/tp of the sequence (less memory)
    a2a_chunks: int = 1  # ep > 1: dispatch in this many token chunks, all-to-alls overlapping other chunks' experts
    a2a_dedup: Literal["none", "rank", "node"] = (
        "none"  # ep > 1: a token crosses once per node/rank holding any of its experts; none: once per assignment
    )
    timeout_s: float = 600.0  # rendezvous and collective timeout: a missing or hung rank fails the job after this

    @property
    def expert_tp(self) -> int:
        """The expert tensor-parallel size: `etp`, or `tp` when unset."""
        return self.tp if self.etp is None else self.etp


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
    lr_schedule: Literal["cosine", "wsd"] = (
        "cosine"  # after the warmup: cosine decay over the remaining steps to min_lr_ratio × lr, or wsd
        # (warmup-stable-decay): lr held until the last train.decay_fraction of train.steps, then linear decay
    )
    decay_fraction: float = 0.2  # wsd: the last fraction of train.steps, in (0, 1], decaying to min_lr_ratio × lr
    min_lr_ratio: float = 0.1  # final lr as a fraction of lr (end of the cosine or wsd decay)
    warmup_steps: int = 10  # linear warmup steps
    weight_decay: float = 0.1  # AdamW weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW betas
    adam_eps: float = 1e-8  # AdamW epsilon, added to the root of the second moment
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
    checkpoint_parts: list[str] = field(
        default_factory=list
    )  # for selective: attention, mamba, mamba2, gdn, moe_experts, mlp
    grad_accum_dtype: Literal["fp32", "bf16"] = (
        "fp32"  # with dtype bf16: gradients accumulate over micro-batches in this dtype
    )
    grad_reduce_dtype: Literal["fp32", "bf16"] = (
        "fp32"  # with dtype bf16: gradients travel in this dtype when reduced over the data-parallel ranks
    )
    grad_reduce_overlap: Optional[bool] = (
        None  # ZeRO 1/2: reduce the buckets from the gradient hooks, overlapped with the backward; null = off
    )
    param_gather_overlap: Optional[bool] = (
        None  # ZeRO 1/2: gather the updated weights module by module behind the next forward; null = off (blocking)
    )
    grad_reduce_bucket_mb: float = 256.0  # ZeRO 1/2: gradient reduction bucket, MiB of the gradient as it travels
    async_save: bool = False  # checkpoint: snapshot to host memory, write in the background while training goes on
    save_buffer_mb: int = 256  # checkpoint: host memory for tensors gathered and not yet written (synchronous save)
    save_staging_mb: float = 512.0  # checkpoint, async_save: pinned host buffer the snapshot is copied through (MiB)
    save_timeout_s: float = 1800.0  # checkpoint save and load: limit of every wait (writers, their collectives)
    profile_steps: list[int] = field(
        default_factory=list
    )  # optimizer steps to trace with torch.profiler into RUN_DIR/profile/ (Chrome/Perfetto JSON); [] = none
    profile_ranks: list[int] = field(default_factory=lambda: [0])  # global ranks that trace the profile_steps

    def decay_steps(self) -> int:
        """lr_schedule wsd: how many final steps decay, decay_fraction × steps rounded half up to a whole step."""
        return math.floor(self.decay_fraction * self.steps + 0.5)

    def reduce_bucket_elements(self) -> int:
        """grad_reduce_bucket_mb as DeepSpeed's reduce_bucket_size: elements of the dtype the gradients travel in."""
        travels = 2 if self.dtype == "bf16" and self.grad_reduce_dtype == "bf16" else 4
        return int(self.grad_reduce_bucket_mb * 2**20 / travels)

    def grad_accum_steps(self, dp: int) -> int:
        """Micro-batches one rank accumulates per optimizer step with `dp` data-parallel ranks (parallel_checks.py's
        `check_global_batch` makes the division exact)."""
        return self.global_batch_size // (self.micro_batch_size * dp)


@dataclass
class DeepSpeedConfig:
    zero_stage: Literal[0, 1, 2] = 1  # ZeRO stage
    extra: dict = field(default_factory=dict)  # merged verbatim into the DeepSpeed config (expert use)


@dataclass
class PlanConfig:
    device_memory_mib: Optional[int] = (
        None  # memory of one GPU the plan must fit in, MiB (1 MiB = 2^20 bytes); null = the total
        # torch.cuda.mem_get_info reports for this machine's GPU, or an H200's 143,771 MiB without a GPU
    )
    fragmentation_margin: float = (
        0.10  # fraction of the GPU's memory the plan leaves free for the caching allocator's fragmentation
    )
    expert_imbalance: Optional[float] = (
        None  # dropless MoE under EP: planned rows of the busiest expert rank in a micro-batch over the mean;
        # null = the most routing can send one rank, ep·min(top_k, experts/ep)/top_k (our runs reach it)
    )


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)  # architecture
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # parallel layout
    data: DataConfig = field(default_factory=DataConfig)  # training data
    train: TrainConfig = field(default_factory=TrainConfig)  # optimization loop
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)  # DeepSpeed engine settings
    plan: PlanConfig = field(default_factory=PlanConfig)  # assumptions of the memory plan (docs/memory.md)
