"""A deterministic stand-in for the DeepSeek-V4 model that implements the engine contract.

Its cache stores token ids: ``forward`` writes each new token at ``cache[block_tables[i, pos // B], pos % B]``, then
reads a sequence's whole context back *through its block table* and derives the next-token logits from a hash of
that context. A wrong block table, a block shared between live sequences, or cache state lost across steps
(preemption, chunking) changes the context read back and so the logits; an unwritten slot (-1) raises.
``reference_logits(context)`` gives the logits straight from the token list, for comparisons.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from deepinfer.forward_batch import ForwardBatch


@dataclass
class FakeConfig:
    vocab_size: int = 129280
    max_position_embeddings: int = 4096
    eos_token_id: int = 1
    eos_every: int = 23  # a context whose hash is divisible by this strongly prefers EOS (ends some requests)


@dataclass
class FakeCacheSpec:
    block_size: int = 128


class FakeCache:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.tokens = torch.full((num_blocks, block_size), -1, dtype=torch.int64)


def context_hash(context: list[int]) -> int:
    return int.from_bytes(hashlib.blake2b(torch.tensor(context, dtype=torch.int64).numpy().tobytes(),
                                          digest_size=8).digest(), "little") & ((1 << 63) - 1)


class FakeModel:
    """``forward(batch, cache) -> [num_logits, vocab] float32``; ``allocate_cache(num_blocks)``."""

    def __init__(self, config: FakeConfig | None = None, block_size: int = 128) -> None:
        self.config = config or FakeConfig()
        self.cache_spec = FakeCacheSpec(block_size)
        self.num_forward_calls = 0
        self.max_tokens_per_call = 0

    def allocate_cache(self, num_blocks: int) -> FakeCache:
        return FakeCache(num_blocks, self.cache_spec.block_size)

    def reference_logits(self, context: list[int]) -> torch.Tensor:
        """``[vocab]`` float32 logits of the next token after ``context``."""
        h = context_hash(context)
        g = torch.Generator().manual_seed(h)
        logits = torch.randn(self.config.vocab_size, generator=g) * 10.0  # peaked, like a trained LM
        if h % self.config.eos_every == 0:
            logits[self.config.eos_token_id] = 100.0
        else:
            logits[self.config.eos_token_id] = -100.0
        return logits

    def forward(self, batch: ForwardBatch, cache: FakeCache) -> torch.Tensor:
        self.num_forward_calls += 1
        self.max_tokens_per_call = max(self.max_tokens_per_call, batch.num_tokens)
        bs = self.cache_spec.block_size
        assert sum(batch.query_lens) == batch.num_tokens
        # 1. write every new token through its sequence's block table
        seq_idx = torch.repeat_interleave(torch.arange(batch.num_seqs), torch.tensor(batch.query_lens))
        ends = torch.cumsum(torch.tensor(batch.query_lens), 0) - 1
        starts = ends + 1 - torch.tensor(batch.query_lens)
        expected = torch.tensor(batch.context_lens)[seq_idx] - torch.tensor(batch.query_lens)[seq_idx] \
            + (torch.arange(batch.num_tokens) - starts[seq_idx])
        assert torch.equal(batch.positions.cpu(), expected), "positions must be consecutive and end at context_len - 1"
        pos = batch.positions.cpu()
        blocks = batch.block_tables.cpu().long()[seq_idx, pos // bs]
        assert bool((blocks >= 0).all()), "a new token has no block in its block table"
        cache.tokens[blocks, pos % bs] = batch.input_ids.cpu()
        ends = ends.tolist()
        # 2. logits for the requested rows from the context read back through the block table
        rows = []
        for idx in batch.logits_indices.tolist():
            i = ends.index(idx)  # logits are only requested for a sequence's last new token
            ctx = batch.context_lens[i]
            nb = -(-ctx // bs)
            blocks = batch.block_tables[i, :nb].long()
            assert bool((blocks >= 0).all())
            context = cache.tokens[blocks].reshape(-1)[:ctx]
            assert bool((context >= 0).all()), f"sequence {i}: unwritten cache slot in its context"
            rows.append(self.reference_logits(context.tolist()))
        if not rows:
            return torch.empty(0, self.config.vocab_size)
        return torch.stack(rows)


def reference_greedy(model: FakeModel, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding straight from ``reference_logits`` (no cache, no batching); stops at EOS (not included)."""
    ctx = list(prompt)
    out = []
    for _ in range(max_tokens):
        t = int(torch.argmax(model.reference_logits(ctx)))
        if t == model.config.eos_token_id:
            break
        out.append(t)
        ctx.append(t)
    return out


class ScriptedModel(FakeModel):
    """Emits ``script`` after any prompt: the next token is ``script[k]`` for the longest ``k`` such that the context
    (read back through the block table) ends with ``script[:k]``; EOS after the whole script."""

    def __init__(self, script: list[int], vocab_size: int = 129280, eos_token_id: int = 1, block_size: int = 128):
        super().__init__(FakeConfig(vocab_size=vocab_size, eos_token_id=eos_token_id), block_size)
        self.script = list(script)

    def reference_logits(self, context: list[int]) -> torch.Tensor:
        k = 0
        for j in range(min(len(self.script), len(context)), 0, -1):
            if context[-j:] == self.script[:j]:
                k = j
                break
        logits = torch.zeros(self.config.vocab_size)
        logits[self.script[k] if k < len(self.script) else self.config.eos_token_id] = 50.0
        return logits
