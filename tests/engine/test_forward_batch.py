"""ModelRunner.forward_batch and index_tensors: the step's host metadata as device tensors (one copy per kind)."""

from __future__ import annotations

import pytest
import torch

from deepinfer import SamplingParams
from deepinfer.forward_batch import index_tensors
from deepinfer.block_manager import FULL_GROUP, WINDOW_GROUP
from deepinfer.model_runner import ModelRunner
from deepinfer.scheduler import NewRequestData, ScheduledRequest, SchedulerOutput
from fake_model import FakeModel


def test_index_tensors_are_views_of_one_buffer_in_order():
    a, b, empty, c = index_tensors([[3, 1], [7], [], [-1, 2**40, 5]], "cpu")
    assert a.tolist() == [3, 1] and b.tolist() == [7] and empty.shape == (0,) and c.tolist() == [-1, 2**40, 5]
    assert a.dtype == torch.int64 and a.is_contiguous() and c.is_contiguous()
    assert a.untyped_storage().data_ptr() == c.untyped_storage().data_ptr()  # one buffer, one copy
    (i32,) = index_tensors([[1, 2]], "cpu", torch.int32)
    assert i32.dtype == torch.int32
    assert index_tensors([], "cpu") == []


def test_runner_forward_batch_mixed_prefill_and_decode():
    """From scheduler outputs alone: a prefill chunk (no logits row: its prompt is not done), a finishing prefill
    chunk and a decode of a resumed request: ids, positions, lengths, logits rows and the block tables padded with
    -1 to the longest."""
    p = SamplingParams()
    runner = ModelRunner(FakeModel(block_size=16), FakeModel(block_size=16).allocate_cache(16), "cpu",
                         batch_invariant=True)
    first = SchedulerOutput(0, (ScheduledRequest(1, 1, 0, False, {FULL_GROUP: (2,)}),
                                ScheduledRequest(2, 2, 0, False, {FULL_GROUP: (7, 1, 3)})),
                            (NewRequestData(1, (5, 6, 7), (), p, 0), NewRequestData(2, (8, 9), (42,), p, 0)))
    runner.update_states(first)
    second = SchedulerOutput(1, (ScheduledRequest(0, 4, 0, False, {FULL_GROUP: (4, 9)}),
                                 ScheduledRequest(1, 2, 1, True), ScheduledRequest(2, 1, 2, True)),
                             (NewRequestData(0, tuple(range(10, 20)), (), p, 0),))
    runner.update_states(second)
    fb = runner.forward_batch(second)
    assert fb.input_ids.tolist() == [10, 11, 12, 13, 6, 7, 42]
    assert fb.positions.tolist() == [0, 1, 2, 3, 1, 2, 2]
    assert fb.query_lens == [4, 2, 1] and fb.context_lens == [4, 3, 3]
    assert fb.logits_indices.tolist() == [5, 6]
    assert fb.block_tables.dtype == torch.int32
    assert fb.block_tables.tolist() == [[4, 9, -1], [2, -1, -1], [7, 1, 3]]
    assert fb.batch_invariant
    # finished requests leave the runner; their rows are reused, cleared
    runner.update_states(SchedulerOutput(2, (ScheduledRequest(3, 1, 0, True, {FULL_GROUP: (5,)}),),
                                         (NewRequestData(3, (1,), (), p, 0),), finished_req_ids=(0, 1, 2)))
    assert set(runner.requests) == {3}
    assert runner.forward_batch(SchedulerOutput(3, (ScheduledRequest(3, 1, 0, True),))).block_tables.tolist() == [[5]]
    with pytest.raises(RuntimeError, match="scheduled request 9 has no state"):
        runner.update_states(SchedulerOutput(4, (ScheduledRequest(9, 1, 0, True),)))


def test_runner_applies_released_block_ids_before_new_ones():
    """A sliding-window group's released ids become -1 in the runner's table before the step's new ids are
    appended (a released block may come straight back); an id the table does not hold is refused by name."""
    p = SamplingParams()
    runner = ModelRunner(FakeModel(block_size=16), FakeModel(block_size=16).allocate_cache(16), "cpu")
    runner.update_states(SchedulerOutput(0, (ScheduledRequest(1, 40, 0, False, {FULL_GROUP: (0, 1, 2),
                                                                                 WINDOW_GROUP: (4, 5, 6)}),),
                                         (NewRequestData(1, tuple(range(3, 63)), (), p, 0),)))
    runner.update_states(SchedulerOutput(1, (ScheduledRequest(1, 20, 40, True, {FULL_GROUP: (3,), WINDOW_GROUP: (4,)},
                                                              {WINDOW_GROUP: (4, 5)}),)))
    slot = runner.requests[1].slot
    full, window = runner.block_tables[FULL_GROUP], runner.block_tables[WINDOW_GROUP]
    assert full.ids[slot, :full.num_blocks[slot]].tolist() == [0, 1, 2, 3]
    assert window.ids[slot, :window.num_blocks[slot]].tolist() == [-1, -1, 6, 4]
    with pytest.raises(RuntimeError, match="released_block_ids of request 1 in cache group 'window' lists blocks "
                                           "its table does not hold: \\[9\\]"):
        runner.update_states(SchedulerOutput(2, (ScheduledRequest(1, 1, 60, True, {}, {WINDOW_GROUP: (9,)}),)))
    with pytest.raises(RuntimeError, match="cache group 'other'"):
        runner.update_states(SchedulerOutput(3, (ScheduledRequest(1, 1, 60, True, {}, {"other": (1,)}),)))
