"""The job configuration's schema: a tree of small dataclasses, and the sizes derived from them.

Every field has a one-line trailing comment (docs/config.md is generated from them by moe_dist/config/doc.py).
Runtime objects (process groups, devices) never live here. Derived sizes are methods of the section that owns
their inputs, so each formula exists once. Loading is in loading.py, the rules a config must satisfy in checks.py;
this module imports neither.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal, Optional

from moe_dist.config.errors import ConfigError, require
from moe_dist.layers.registry import KINDS

__all__ = ["ConfigError", "require"]  # re-exported: rules elsewhere take them from here


@dataclass
class _ModelFields:
    """The model section's own keys; `ModelConfig` adds each layer kind's section (below)."""

    vocab_size: int = 256  # tokens (256 = raw bytes)
    d_model: int = 256  # residual width
    n_layers: int = 4  # decoder blocks
    d_ff: int = 512  # dense SwiGLU hidden size (and expert size unless moe.d_ff is set)
    mixer_pattern: str = "A"  # per-layer mixer, tiled over n_layers: A = attention, M = Mamba, L = MLA
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

    def prefix_lm(self) -> bool:
        """Whether a layer of the model reads the prefix-LM mask (prompt tokens seeing each other), which the trainer
        then builds from the loss mask and passes (each kind's `prefix_lm`)."""
        placed = {kind for pair in self.layer_kinds() for kind in pair if kind is not None}
        return any(k.prefix_lm(self) for k in layer_kinds() if k.name in placed)

    def has_kind(self, kind: str) -> bool:
        """Whether any layer holds `kind` (a mixer or FFN kind)."""
        return any(kind in pair for pair in self.layer_kinds())


def _with_kind_sections(fields: type) -> type:
    """ModelConfig: the model's keys, then one section per layer kind that has settings (`model.<section>`, its
    dataclass declared in the kind's layer file), in registry order."""
    sections = [
        (k.section, k.config, field(default_factory=k.config, metadata={"doc": k.doc}))
        for k in KINDS.values()
        if k.section is not None
    ]
    cls = dataclasses.make_dataclass("ModelConfig", sections, bases=(fields,))
    cls.__module__, cls.__doc__ = __name__, "The model: its own keys and each layer kind's section."
    return cls


ModelConfig = _with_kind_sections(_ModelFields)


def layer_kinds(role: Optional[str] = None) -> list:
    """The layer kinds (layers/registry.py), all or those of `role` ("mixer" | "ffn")."""
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
    threads: int = 0  # torch CPU threads per process (0 = cores less one, and less other work's, / local processes)
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
    # Set it for a GPU the datasheet table lacks, or to compare MFU between machines.
    peak_tflops: Optional[float] = None  # MFU's dense peak per device, TFLOP/s; null = datasheet, else measured

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
