"""build_forward_batch and index_tensors: the step's host metadata as device tensors (one copy per kind)."""

from __future__ import annotations

import torch

from deepinfer import SamplingParams
from deepinfer.forward_batch import index_tensors
from deepinfer.model_runner import build_forward_batch
from deepinfer.scheduler import ScheduledSeq
from deepinfer.sequence import Sequence


def test_index_tensors_are_views_of_one_buffer_in_order():
    a, b, empty, c = index_tensors([[3, 1], [7], [], [-1, 2**40, 5]], "cpu")
    assert a.tolist() == [3, 1] and b.tolist() == [7] and empty.shape == (0,) and c.tolist() == [-1, 2**40, 5]
    assert a.dtype == torch.int64 and a.is_contiguous() and c.is_contiguous()
    assert a.untyped_storage().data_ptr() == c.untyped_storage().data_ptr()  # one buffer, one copy
    (i32,) = index_tensors([[1, 2]], "cpu", torch.int32)
    assert i32.dtype == torch.int32
    assert index_tensors([], "cpu") == []


def test_build_forward_batch_mixed_prefill_and_decode():
    """A prefill chunk (no logits row: its prompt is not done), a finishing prefill chunk and a decode: ids,
    positions, lengths, logits rows and the block tables padded with -1 to the longest."""
    p = SamplingParams()
    chunk = Sequence(0, list(range(10, 20)), p, 0, block_tables={"full": [4, 9]})
    done = Sequence(1, [5, 6, 7], p, 0, num_computed_tokens=1, block_tables={"full": [2]})
    dec = Sequence(2, [8, 9], p, 0, output_token_ids=[42], num_computed_tokens=2, block_tables={"full": [7, 1, 3]})
    fb = build_forward_batch([ScheduledSeq(chunk, 4, 0, False), ScheduledSeq(done, 2, 1, True),
                              ScheduledSeq(dec, 1, 2, True)], "cpu", True)
    assert fb.input_ids.tolist() == [10, 11, 12, 13, 6, 7, 42]
    assert fb.positions.tolist() == [0, 1, 2, 3, 1, 2, 2]
    assert fb.query_lens == [4, 2, 1] and fb.context_lens == [4, 3, 3]
    assert fb.logits_indices.tolist() == [5, 6]
    assert fb.block_tables.dtype == torch.int32
    assert fb.block_tables.tolist() == [[4, 9, -1], [2, -1, -1], [7, 1, 3]]
    assert fb.batch_invariant
