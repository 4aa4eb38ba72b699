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


class HostStager:
    """Host-to-device copies that never wait for the device: values are written into one of ``RING`` pinned int64
    buffers (in turn; a buffer is rewritten only once its last copy is done, ``RING`` uploads later: a few steps
    of the engine, so the host never waits on the step in flight) and copied with ``non_blocking=True``. A pageable source would make torch synchronise the stream after the copy, so every
    per-step upload of the engine goes through here. On the CPU the host buffer is the result."""

    RING = 16

    def __init__(self) -> None:
        self._bufs: list = [None] * self.RING
        self._turn = 0

    def upload(self, arrays: list, device: torch.device | str, out: torch.Tensor | None = None) -> torch.Tensor:
        """``arrays`` (numpy int64 / float32-as-int64-bits arrays or int lists) concatenated into one int64 device
        tensor (``out`` when given: it must have exactly that many entries)."""
        import numpy as np

        n = sum(len(a) if isinstance(a, list) else a.size for a in arrays)

        def write(host: torch.Tensor) -> None:
            flat = host.numpy()
            at = 0
            for a in arrays:
                m = len(a) if isinstance(a, list) else a.size
                flat[at:at + m] = np.asarray(a, dtype=np.int64).reshape(-1) if m else 0
                at += m

        return self.upload_filled(n, write, device, out)

    def upload_filled(self, n: int, write, device: torch.device | str, out: torch.Tensor | None = None) -> torch.Tensor:
        """``n`` int64 values that ``write(host)`` puts into a host tensor ``[n]`` (a pinned ring buffer on CUDA),
        copied to one device tensor (``out`` when given: it must have exactly ``n`` entries)."""
        device = torch.device(device)
        if out is not None and out.numel() != n:
            raise ValueError(f"out: {n} int64 entries to upload, the buffer has {out.numel()}")
        if device.type != "cuda":
            host = torch.empty(n, dtype=torch.int64)
            write(host)
            if out is None:
                return host
            out.copy_(host)
            return out
        k = self._turn = (self._turn + 1) % self.RING
        if self._bufs[k] is None or self._bufs[k][0].numel() < n:
            self._bufs[k] = (torch.empty(max(n, 1 << 16), dtype=torch.int64, pin_memory=True), torch.cuda.Event())
        host, done = self._bufs[k]
        done.synchronize()
        write(host[:n])
        dev = out if out is not None else torch.empty(n, dtype=torch.int64, device=device)
        dev.copy_(host[:n], non_blocking=True)
        done.record()
        return dev


_STAGER = HostStager()


def index_tensors(lists: list, device: torch.device | str,
                  dtype: torch.dtype = torch.int64) -> list[torch.Tensor]:
    """Host index lists as 1-D ``dtype`` tensors on ``device``, all from ONE host-to-device copy that does not wait
    for the device (consecutive views of one buffer, each contiguous; see :class:`HostStager`): every
    ``torch.tensor(list, device="cuda")`` is a copy of its own, 10-20 us of host time each, and a synchronisation."""
    buf = _STAGER.upload(lists, device)
    if dtype != torch.int64:
        buf = buf.to(dtype)
    out, at = [], 0
    for values in lists:
        out.append(buf[at:at + len(values)])
        at += len(values)
    return out


def float_tensors(lists: list[list[float]], device: torch.device | str) -> list[torch.Tensor]:
    """Host float lists as 1-D float32 tensors on ``device`` through :func:`index_tensors` (the float32 bits
    travel as int64 and are reinterpreted on the device)."""
    import numpy as np

    bits = [np.asarray(v, dtype=np.float32).view(np.int32).astype(np.int64) for v in lists]
    return [t.to(torch.int32).view(torch.float32) for t in index_tensors(bits, device)]
