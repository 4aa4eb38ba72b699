"""Model runner: turns the scheduler's choice into a ``ForwardBatch``, runs the model, samples.

How the engine calls the model (the whole contract, see ``deepinfer.forward_batch``):

    cache = allocate_cache(model, num_blocks, block_size)           # once
    logits = model.forward(batch: ForwardBatch, cache)               # every step, under torch.inference_mode()
    # logits: [len(batch.logits_indices), vocab] float32, row r = next-token logits of token logits_indices[r]

``batch.block_tables`` row i lists sequence i's blocks (``-1`` pads); the model writes the new tokens' cache
entries through it and reads the earlier ones through it.
"""

from __future__ import annotations

import time

import torch

from deepinfer.forward_batch import ForwardBatch, index_tensors
from deepinfer.sampler import Sampler
from deepinfer.scheduler import ScheduledSeq


def allocate_cache(model, num_blocks: int, block_size: int):
    """Ask the model for its paged cache of ``num_blocks`` blocks of ``block_size`` tokens.

    The model exposes ``allocate_cache(num_blocks)`` (its block size is fixed by its cache spec, which must equal
    ``block_size``; checked when the model reports ``cache_spec.block_size`` or ``config_block_size``).

    Raises:
        ValueError: the model's block size differs from the engine's.
        TypeError: the model has no ``allocate_cache``.
    """
    spec = getattr(model, "cache_spec", None)
    model_bs = getattr(spec, "block_size", None) or getattr(model, "config_block_size", None)
    if model_bs is not None and int(model_bs) != block_size:
        raise ValueError(f"EngineConfig.block_size ({block_size}) differs from the model's cache block size ({model_bs})")
    if not hasattr(model, "allocate_cache"):
        raise TypeError(f"{type(model).__name__} has no allocate_cache(num_blocks): it does not implement the engine contract")
    return model.allocate_cache(num_blocks)


def build_forward_batch(scheduled: list[ScheduledSeq], device: torch.device | str,
                        batch_invariant: bool = False) -> ForwardBatch:
    """The ``ForwardBatch`` of one step (``batch_invariant`` is copied into it: the model's batch-invariant mode).

    Sequence i contributes ``scheduled[i].num_new_tokens`` tokens at positions
    ``[num_computed_tokens, num_computed_tokens + num_new_tokens)``; a logits row is requested for each sequence whose
    step reaches the end of its context (prompt done or decode).
    """
    input_ids: list[int] = []
    positions: list[int] = []
    query_lens: list[int] = []
    context_lens: list[int] = []
    logits_indices: list[int] = []
    max_blocks = max(len(item.seq.block_table) for item in scheduled)
    tables: list[list[int]] = []
    offset = 0
    for item in scheduled:
        seq, n = item.seq, item.num_new_tokens
        start = seq.num_computed_tokens
        input_ids.extend(seq.token_at(start, start + n))
        positions.extend(range(start, start + n))
        query_lens.append(n)
        context_lens.append(start + n)
        tables.append(list(seq.block_table) + [-1] * (max_blocks - len(seq.block_table)))
        offset += n
        if item.needs_logits:
            logits_indices.append(offset - 1)
    ids_t, pos_t, logits_t = index_tensors([input_ids, positions, logits_indices], device)  # one copy
    return ForwardBatch(
        input_ids=ids_t,
        positions=pos_t,
        query_lens=query_lens,
        context_lens=context_lens,
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        logits_indices=logits_t,
        batch_invariant=batch_invariant,
    )


class ModelRunner:
    """Runs one scheduled step: forward, then sample the sequences that need a next token."""

    def __init__(self, model, cache, device: torch.device | str, batch_invariant: bool = False) -> None:
        self.model = model
        self.cache = cache
        self.device = torch.device(device)
        self.batch_invariant = batch_invariant
        self.sampler = Sampler(batch_invariant=batch_invariant)
        self.last_enqueue_seconds = 0.0

    @torch.inference_mode()
    def step(self, scheduled: list[ScheduledSeq]) -> tuple[list[int], list[float], list, float]:
        """Returns ``(token_ids, logprobs, top_logprobs, seconds)`` for the sequences with ``needs_logits``, in order.
        ``self.last_enqueue_seconds``: the host time until ``model.forward`` returned (batch building included; on
        CUDA the kernels are queued by then, not finished: a step whose total is close to it is host-bound)."""
        t0 = time.perf_counter()
        batch = build_forward_batch(scheduled, self.device, self.batch_invariant)
        logits = self.model.forward(batch, self.cache)
        self.last_enqueue_seconds = time.perf_counter() - t0
        n_logits = int(batch.logits_indices.shape[0])
        if logits.dim() != 2 or logits.shape[0] != n_logits:
            raise RuntimeError(f"model.forward returned logits of shape {tuple(logits.shape)}, expected [{n_logits}, vocab]")
        seqs = [item.seq for item in scheduled if item.needs_logits]
        tokens, logprobs, tops = self.sampler(logits, seqs) if seqs else ([], [], [])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return tokens, logprobs, tops, time.perf_counter() - t0
