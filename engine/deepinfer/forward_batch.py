"""The explicit per-step argument of the model: what the scheduler decided to run this step.

Contract between the engine (scheduler, block manager, model runner) and the model:

* The engine owns memory. Every sequence has one block table; a block covers ``block_size`` consecutive token
  positions of that sequence (``block_size`` = ``CacheSpec.block_size``, a multiple of the largest compression
  ratio, 128 for V4). A sequence whose context holds L tokens owns ``ceil(L / block_size)`` blocks, and the same
  block ids address every cache kind of every layer (window KV, compressed entries, indexer keys, partial-window
  compressor state): the model decides what each block stores, the engine only hands out ids.
* One step mixes prefill chunks and decodes: sequence i contributes ``query_lens[i]`` consecutive new tokens
  ending at position ``context_lens[i] - 1``; its earlier ``context_lens[i] - query_lens[i]`` tokens are already
  in the cache (written by earlier steps through the same block table).
* The model writes the new tokens' cache entries during the forward and returns logits for ``logits_indices``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """One model step.

    Attributes:
        input_ids: ``[num_tokens]`` int64, the new tokens of all sequences concatenated in sequence order.
        positions: ``[num_tokens]`` int64, each token's absolute position in its sequence.
        query_lens: per sequence, number of new tokens this step (sum = num_tokens), each >= 1.
        context_lens: per sequence, tokens in the context once this step is done (cached + new).
        block_tables: ``[num_seqs, max_blocks]`` int32 block ids into the cache pools; -1 pads unused slots.
        logits_indices: ``[num_logits]`` int64 rows of the token dimension whose logits are returned
            (usually the last new token of each sequence that finishes its prompt or decodes).
        batch_invariant: compute every token's row with a reduction order that depends neither on the number of
            tokens in the step nor on the other sequences (fixed-shape chunks for the torch GEMMs, batch-invariant
            FP8 GEMMs, row-wise sparse attention), so a request's logits are bitwise the same alone or in any
            batch, and however its prefill is cut into chunks. Slower; see ``DeepseekV4ForCausalLM`` for the design.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    query_lens: list[int]
    context_lens: list[int]
    block_tables: torch.Tensor
    logits_indices: torch.Tensor
    batch_invariant: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def index_tensors(lists: list[list[int]], device: torch.device | str,
                  dtype: torch.dtype = torch.int64) -> list[torch.Tensor]:
    """Host index lists as 1-D ``dtype`` tensors on ``device``, all from ONE host-to-device copy (consecutive views
    of one buffer, each contiguous): every ``torch.tensor(list, device="cuda")`` is a copy of its own, 10-20 us of
    host time each, and the per-step metadata of a decode step is host-bound."""
    flat = [v for values in lists for v in values]
    buf = torch.tensor(flat, dtype=dtype, device=device)
    out, at = [], 0
    for values in lists:
        out.append(buf[at:at + len(values)])
        at += len(values)
    return out
