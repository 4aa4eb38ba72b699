"""Engine configuration (the model's own configuration lives in ``deepinfer.models``)."""

from __future__ import annotations

import math
from dataclasses import dataclass


MAX_SPECULATIVE_TOKENS = 5


@dataclass
class EngineConfig:
    """Settings of the offline engine.

    Attributes:
        block_size: tokens per cache block; must equal the model's ``CacheSpec.block_size`` (128 for V4).
        num_blocks: cache blocks to allocate; ``None`` derives it (see ``LLM``): from the device memory left
            when the model reports bytes per block, else enough for ``max_num_seqs`` full-length sequences,
            capped at ``max_cache_blocks``.
        max_cache_blocks: upper bound for a derived ``num_blocks``.
        gpu_memory_utilization: fraction of the free device memory the cache and the decode CUDA graphs may take
            when ``num_blocks`` is derived.
        cpu_cache_gib: on the CPU, the most memory (GiB) a derived cache may take.
        max_num_batched_tokens: per-step token budget (prefill chunks + decodes) of the scheduler.
        max_num_seqs: most sequences running at once.
        max_model_len: context limit in tokens (prompt + output); ``None`` takes the model's. A value above the
            model's ``max_position_embeddings`` is lowered to it, with a warning.
        batch_invariant: per-row computation everywhere: every model step runs in the model's batch-invariant
            mode (``ForwardBatch.batch_invariant``: fixed-shape chunks for the torch GEMMs, batch-invariant FP8
            GEMMs, row-wise sparse attention), the sampler reduces one row at a time and prefill chunks end at
            multiples of ``prefill_chunk_align``, so a request's logits and draws do not depend on what it is
            batched with (issue 7).
        prefill_chunk_align: in batch-invariant mode a prefill chunk that does not end its prompt ends at a
            multiple of this many positions (a multiple of the attention split-KV size; default ``block_size``).
        enable_image_fetch: let the recipe fetch image URLs (off by default). When on, only public addresses are
            allowed and each image is capped at ``image_max_bytes``.
        image_max_bytes: byte limit per fetched image.
        device: torch device of the model and cache (``None``: from ``DEEPINFER_ACCELERATOR``, default auto = CUDA when
            deepinfer_ops was built with CUDA and a GPU is visible, else CPU).
        seed: base of the seeds drawn for requests without one; ``None`` draws from the OS.
        gemm: GEMM path / weight format of a model ``LLM`` loads from a checkpoint (``DeepseekV4ForCausalLM``'s
            ``gemm``): ``"auto"`` (FP8 on CUDA, dequantised elsewhere), ``"fp8"`` (FP8 weights with 128x128 block
            scales, FP8 GEMMs and the fused FP8 MoE) or ``"dequant"`` (weights dequantised to bf16 / fp32, torch
            GEMMs). A model object passed to ``LLM`` keeps its own.
        enforce_eager: never capture or replay CUDA graphs (decode steps of the FP8 path on CUDA otherwise replay
            a graph captured per batch-size bucket at start-up).
        kv_cache_dtype: storage of the window KV, compressed KV and indexer keys: ``"auto"`` (the model dtype),
            ``"bf16"`` or ``"fp8"`` (DeepSeek-V4: MODEL1 FP8 entries and FP8 indexer keys; the compressor state stays
            in the model dtype). A model that cannot store the choice refuses it naming ``kv_cache_dtype``.
        async_scheduling: schedule and enqueue step N + 1 while the device runs step N; the sampled ids stay on the
            device and feed the next step, stops and finishes are applied one step late (the extra token of a
            finished request is dropped). Rows whose draw needs the token before (penalties, a grammar) wait
            for it behind the next forward (``docs/engine.md``, Overlap).
        enable_prefix_caching: share the cache blocks of common prompt prefixes between requests and keep freed
            blocks' content in an LRU until the memory is needed (``docs/prefix-cache.md``); a hit counts as computed
            tokens and is reported as cached prompt tokens.
        prefix_replay_tokens: a hit whose end has no cached window snapshot recomputes at least this many positions
            before it to rebuild the sliding-window KV and the compressor state (rounded to a block). ``None``: the
            model's exact bound (DeepSeek-V4: layers x window, outputs equal those without the hit); a smaller value
            (DeepInfer's 140) is cheaper but changes outputs after the hit.
        host_cache_gib: the prefix cache's host-memory tier: GiB of host memory (pinned on CUDA) that keeps the
            content of evicted cached blocks and restores it on a hit (``docs/prefix-cache.md``); 0 (default): off.
            Needs ``enable_prefix_caching`` and a model with cache groups.
        speculative_method: ``None`` (off) or ``"mtp"``: speculative decoding with the model's MTP layer as the
            drafter (``docs/speculative.md``). Speculative steps run in order (no asynchronous overlap), decode
            steps on CUDA through their own graphs; requests with penalties, a logit bias or
            ``structured_outputs`` decode without drafts.
        num_speculative_tokens: drafts per sequence and step with speculation on (1 to 5; default 3).
        spec_schedule: ``"confidence"`` (the verified length per sequence maximises expected accepted tokens per
            unit of step cost, from the drafts' confidences) or ``"fixed"`` (always ``num_speculative_tokens``).
            Batch-invariant mode always uses the fixed length (the scheduled one depends on the batch).
        spec_admit_hold: under the confidence schedule on CUDA, steps a waiting request may be held while fewer than
            ``max(1, max_num_seqs // 8)`` slots are free (or fewer than the requests waiting), so that admissions
            come in groups: a step that admits runs eagerly and verifies no draft (``docs/speculative.md``). 0
            admits at once; default 8.
        data_parallel_size: DP attention ranks (``docs/expert-parallel.md``). Above 1, ``LLM`` spawns one process
            per rank (torch.multiprocessing; NCCL on CUDA, gloo on the CPU); each rank runs its own engine over its
            share of the requests (its own scheduler and cache) and the results come back in request order.
        expert_parallel_size: 1 (every rank holds every expert) or ``data_parallel_size`` (the routed experts are
            spread over the ranks; the MoE layers meet across ranks every step and idle ranks run empty steps).
        num_redundant_experts: extra expert slots per MoE layer (replicas of hot experts), with expert parallelism.
        eplb_interval: engine steps between expert-load rebalances (None: the initial placement stays).
        eplb_window: steps of expert counts a rebalance looks at.
        dp_prefill_budget: under expert parallelism, the most prefill tokens all DP ranks together compute in one
            step, shared out by the ranks each step from their demands (decode tokens never wait for it), so one
            rank's long prompt delays the others' decode steps by at most this many prefill tokens' work. None:
            ``max_num_batched_tokens``.
        dist_backend: ``"gloo"`` / ``"nccl"`` (None: NCCL on CUDA, gloo on the CPU).
        dist_timeout_s: seconds a collective may wait for the other ranks before it fails (a crashed or stuck rank
            then ends the run with an error instead of a hang).
    """

    block_size: int = 128
    num_blocks: int | None = None
    max_cache_blocks: int = 4096
    gpu_memory_utilization: float = 0.85
    cpu_cache_gib: float = 1.0
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None
    batch_invariant: bool = False
    prefill_chunk_align: int | None = None
    enable_image_fetch: bool = False
    image_max_bytes: int = 20 * 1024 * 1024
    device: str | None = None
    seed: int | None = None
    gemm: str = "auto"
    enforce_eager: bool = False
    async_scheduling: bool = True
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    prefix_replay_tokens: int | None = None
    host_cache_gib: float = 0.0
    speculative_method: str | None = None
    num_speculative_tokens: int = 3
    spec_schedule: str = "confidence"
    spec_admit_hold: int = 8
    data_parallel_size: int = 1
    expert_parallel_size: int = 1
    num_redundant_experts: int = 0
    eplb_interval: int | None = None
    eplb_window: int = 128
    dp_prefill_budget: int | None = None
    dist_backend: str | None = None
    dist_timeout_s: float = 600.0

    @property
    def parallel(self):
        """The :class:`deepinfer.parallel.config.ParallelConfig` of these settings."""
        from deepinfer.parallel.config import ParallelConfig

        return ParallelConfig(self.data_parallel_size, self.expert_parallel_size, self.num_redundant_experts,
                              self.eplb_window, self.eplb_interval, self.dist_backend,
                              self.dp_prefill_budget, self.dist_timeout_s)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field when a setting has the wrong type or is out of range."""
        for name in ("block_size", "max_cache_blocks", "max_num_batched_tokens", "max_num_seqs", "image_max_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"EngineConfig.{name} must be an integer, got {v!r}")
        for name in ("num_blocks", "max_model_len", "prefill_chunk_align", "seed", "prefix_replay_tokens"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise ValueError(f"EngineConfig.{name} must be an integer or None, got {v!r}")
        for name in ("batch_invariant", "enable_image_fetch", "enforce_eager", "async_scheduling",
                     "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineConfig.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("gpu_memory_utilization", "cpu_cache_gib", "host_cache_gib"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"EngineConfig.{name} must be a finite number, got {v!r}")
        if self.cpu_cache_gib <= 0:
            raise ValueError(f"EngineConfig.cpu_cache_gib must be positive, got {self.cpu_cache_gib}")
        if self.host_cache_gib < 0:
            raise ValueError(f"EngineConfig.host_cache_gib must be >= 0, got {self.host_cache_gib}")
        if self.host_cache_gib and not self.enable_prefix_caching:
            raise ValueError("EngineConfig.host_cache_gib needs enable_prefix_caching (the host tier keeps evicted "
                             "prefix-cache blocks)")
        if self.block_size <= 0:
            raise ValueError(f"EngineConfig.block_size must be positive, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"EngineConfig.num_blocks must be positive, got {self.num_blocks}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"EngineConfig.max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"EngineConfig.max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.prefix_replay_tokens is not None and self.prefix_replay_tokens < 1:
            raise ValueError(f"EngineConfig.prefix_replay_tokens must be >= 1, got {self.prefix_replay_tokens}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"EngineConfig.max_model_len must be positive, got {self.max_model_len}")
        align = self.chunk_align
        if align <= 0:
            raise ValueError(f"EngineConfig.prefill_chunk_align must be positive, got {align}")
        if self.batch_invariant and self.max_num_batched_tokens < align:
            raise ValueError(
                f"EngineConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= prefill_chunk_align "
                f"({align}) in batch-invariant mode, or a long prompt could never advance"
            )
        if self.kv_cache_dtype not in ("auto", "bf16", "fp8"):
            raise ValueError(f"EngineConfig.kv_cache_dtype must be 'auto', 'bf16' or 'fp8', got {self.kv_cache_dtype!r}")
        if self.gemm not in ("auto", "fp8", "dequant"):
            raise ValueError(f"EngineConfig.gemm must be 'auto', 'fp8' or 'dequant', got {self.gemm!r}")
        if self.speculative_method not in (None, "mtp"):
            raise ValueError(f"EngineConfig.speculative_method must be None or 'mtp', got {self.speculative_method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"EngineConfig.num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {k!r}")
        if self.spec_schedule not in ("confidence", "fixed"):
            raise ValueError(f"EngineConfig.spec_schedule must be 'confidence' or 'fixed', got {self.spec_schedule!r}")
        h = self.spec_admit_hold
        if isinstance(h, bool) or not isinstance(h, int) or h < 0:
            raise ValueError(f"EngineConfig.spec_admit_hold must be an integer >= 0, got {h!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"EngineConfig.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        self.parallel.validate()
        if self.speculative_method is not None and self.expert_parallel_size > 1:
            raise ValueError("EngineConfig.speculative_method: not supported with expert_parallel_size > 1 yet (every "
                             "rank must run the same forwards per step)")
        if self.batch_invariant and self.dp_prefill_budget is not None and self.dp_prefill_budget < align:
            raise ValueError(f"EngineConfig.dp_prefill_budget ({self.dp_prefill_budget}) must be >= "
                             f"prefill_chunk_align ({align}) in batch-invariant mode, or a long prompt could never "
                             f"advance")

    @property
    def num_drafts(self) -> int:
        """Drafts per sequence and step: ``num_speculative_tokens`` with speculation on, else 0."""
        return self.num_speculative_tokens if self.speculative_method is not None else 0

    @property
    def chunk_align(self) -> int:
        return self.prefill_chunk_align if self.prefill_chunk_align is not None else self.block_size
