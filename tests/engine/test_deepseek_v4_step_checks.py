"""DeepSeek-V4 ForwardBatch validation (``PlanBuilder.from_forward_batch``, on the host): sequences are checked in order and, for one sequence, its
lengths, then its positions, then its block-table width, then its block ids; the error names the first fault in
that order (field and sequence index), whatever faults later sequences have."""

from __future__ import annotations

import pytest
import torch

from deepinfer.forward_batch import ForwardBatch
from deepinfer.models import TINY_CONFIG, DeepseekV4Config, allocate_cache
from deepinfer.models.deepseek_v4 import PlanBuilder

NUM_BLOCKS = 5


@pytest.fixture(scope="module")
def cache():
    return allocate_cache(DeepseekV4Config.from_dict(TINY_CONFIG), NUM_BLOCKS, "cpu", torch.float32)


def _check_batch(batch, cache):
    return PlanBuilder(DeepseekV4Config.from_dict(TINY_CONFIG), cache.block_size, cache.num_blocks,
                       "cpu").from_forward_batch(batch)


@pytest.mark.parametrize("query_lens, context_lens, positions, table, message", [
    # a block listed twice in one table
    ([200], [200], list(range(200)), [[0, 0]], r"sequence 0 lists a block twice"),
    # sequence 1 writes block 0 while sequence 0 reads it
    ([1, 3], [130, 3], [129, 0, 1, 2], [[0, 1], [0, 2]], r"block 0 is written by sequence 1 in this step and also "
                                                         r"used by sequence 0"),
])
def test_blocks_written_by_one_sequence_are_not_used_by_another(cache, query_lens, context_lens, positions, table,
                                                                message):
    with pytest.raises(ValueError, match=message):
        _check_batch(_batch(query_lens, context_lens, positions, table), cache)


def test_shared_full_prefix_blocks_are_allowed(cache):
    """Two sequences reading one full block (a shared prefix) and each writing its own."""
    plan = _check_batch(_batch([1, 1], [130, 129], [129, 128], [[0, 1], [0, 2]]), cache)
    assert plan.tok_bt.tolist() == [[0, 1], [0, 2]]


@pytest.mark.parametrize("ids, li, bt_dtype, message", [
    ([5, 6, 10 ** 7], [2], torch.int32, r"input_ids: token ids must be integers in \[0, "),
    ([5, 6, -1], [2], torch.int32, r"input_ids: token ids must be integers"),
    ([5, 6, 7], [[2]], torch.int32, r"logits_indices: expected 1-D int64"),
    ([5, 6, 7], [2.0], torch.int32, r"logits_indices: expected 1-D int64"),
    ([5, 6, 7], [2], torch.float32, r"block_tables: expected int32 / int64"),
])
def test_bad_values_and_dtypes_name_the_field(cache, ids, li, bt_dtype, message):
    b = ForwardBatch(torch.tensor(ids), torch.arange(3), [3], [3], torch.zeros(1, 1, dtype=bt_dtype), torch.tensor(li))
    with pytest.raises(ValueError, match=message):
        _check_batch(b, cache)


def test_build_checks_host_ids_capacity_and_types(cache):
    from deepinfer.models.deepseek_v4 import Capacity, SeqStep

    b = PlanBuilder(DeepseekV4Config.from_dict(TINY_CONFIG), 128, NUM_BLOCKS, "cpu")
    with pytest.raises(ValueError, match=r"input_ids: 2 ids for 3 tokens"):
        b.build([SeqStep(0, 3, (0,))], [5, 6], [2])
    with pytest.raises(ValueError, match=r"capacity: .* 3 logits rows"):
        b.build([SeqStep(0, 1, (0,))], [1], [0, 0, 0], capacity=Capacity(2, 1, 128))
    with pytest.raises(ValueError, match=r"capacity"):
        b.build([SeqStep(200, 1, (0, 1))], [1], [0], capacity=Capacity(2, 1, 512))
    for bad in (SeqStep(0, 3, ("0",)), SeqStep(0.5, 3, (0,)), SeqStep(0, 3, (True,))):
        with pytest.raises(ValueError, match=r"query_lens|block_tables"):
            b.build([bad], [1, 2, 3], [2])
    with pytest.raises(ValueError, match=r"seqs\[0\]: expected a SeqStep"):
        b.build([(0, 3, (0,))], [1, 2, 3], [2])
    with pytest.raises(ValueError, match=r"logits_indices"):
        b.build([SeqStep(0, 3, (0,))], [1, 2, 3], [1.5])
    with pytest.raises(ValueError, match=r"input_ids: expected a 1-D"):
        b.build([SeqStep(0, 3, (0,))], torch.ones(1, 3, dtype=torch.long), [2])
    with pytest.raises(ValueError, match=r"pad_multiple"):
        b.build([SeqStep(0, 3, (0,))], [1, 2, 3], [2], pad_multiple=-1)


def _batch(query_lens, context_lens, positions, table):
    n = len(positions)
    return ForwardBatch(torch.zeros(n, dtype=torch.long), torch.tensor(positions), query_lens, context_lens,
                        torch.tensor(table, dtype=torch.int32).view(len(query_lens), -1),
                        torch.zeros(1 if n else 0, dtype=torch.long))


@pytest.mark.parametrize(
    "query_lens, context_lens, positions, table, message",
    [
        # sequence 0's positions are wrong, sequence 1 has a bad length: sequence 0 is reported
        ([2, 0, 2], [7, 5, 2], [5, 7, 0, 1], [[0], [1], [2]], r"positions: sequence 0 must hold 5\.\.6"),
        ([2, 2, 1], [2, 2, 0], [0, 1, 0, 2, 0], [[0], [1], [2]], r"positions: sequence 1 must hold 0\.\.1"),
        # sequence 0's block id is bad, sequence 1 has a bad length
        ([1, 1], [1, 0], [0, 0], [[-1], [1]], r"block_tables: sequence 0 uses a block id"),
        ([1, 1], [1, 0], [0, 0], [[9], [1]], r"block_tables: sequence 0 uses a block id"),
        # sequence 0's row is too short, sequence 1 has a bad length
        ([1, 1], [130, 0], [129, 0], [[0], [1]], r"block_tables: sequence 0 needs 2 blocks"),
        # one sequence with wrong positions AND a too-short row: positions are checked first
        ([2], [130], [128, 130], [[0]], r"positions: sequence 0 must hold 128\.\.129"),
        # one sequence with wrong positions AND a bad block id
        ([2], [2], [1, 2], [[7]], r"positions: sequence 0 must hold 0\.\.1"),
        # sequence 0 has a bad block id, sequence 1 wrong positions: sequence 0 first
        ([1, 1], [1, 1], [0, 3], [[7], [0]], r"block_tables: sequence 0 uses a block id"),
        # a negative query length after a sequence with wrong positions
        ([3, -1, 1], [3, 0, 1], [0, 1, 5], [[0], [1], [2]], r"positions: sequence 0 must hold 0\.\.2"),
        # the same faults one sequence later
        ([1, 2, 1], [1, 2, 0], [0, 0, 5, 0], [[0], [1], [2]], r"positions: sequence 1 must hold 0\.\.1"),
        ([1, 1, 1], [1, 130, 0], [0, 129, 0], [[0], [1], [2]], r"block_tables: sequence 1 needs 2 blocks"),
    ],
)
def test_first_fault_in_sequence_order_is_reported(cache, query_lens, context_lens, positions, table, message):
    with pytest.raises(ValueError, match=message):
        _check_batch(_batch(query_lens, context_lens, positions, table), cache)


def test_positions_must_equal_the_expected_values_exactly(cache):
    """Non-integral float positions are not truncated into valid ones."""
    b = ForwardBatch(torch.zeros(2, dtype=torch.long), torch.tensor([0.0, 1.5]), [2], [2],
                     torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"positions: sequence 0 must hold 0\.\.1"):
        _check_batch(b, cache)


def test_valid_batches_give_each_sequence_its_rows_positions_and_blocks(cache):
    b = _batch([2, 1, 130], [2, 129, 130], [0, 1, 128] + list(range(130)), [[3, -1], [0, 2], [1, 4]])
    plan = _check_batch(b, cache)
    assert plan.num_tokens == plan.num_rows == 133
    assert plan.positions.tolist() == [0, 1, 128] + list(range(130))
    assert plan.tok_bt[:3].tolist() == [[3, -1], [3, -1], [0, 2]] and plan.tok_bt[3:].tolist() == [[1, 4]] * 130
    assert plan.token_slots.tolist() == [3 * 128, 3 * 128 + 1, 2 * 128] + [128 + p for p in range(128)] + [512, 513]
    empty = torch.zeros(0, dtype=torch.long)
    assert _check_batch(ForwardBatch(empty, empty, [], [], torch.zeros(0, 1, dtype=torch.int32), empty),
                        cache).num_tokens == 0
