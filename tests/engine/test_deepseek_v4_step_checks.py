"""DeepSeek-V4 ForwardBatch validation (``PlanBuilder.from_forward_batch``, on the host): sequences are checked in order and, for one sequence, its
lengths, then its positions, then its block-table width, then its block ids; the error names the first fault in
that order (field and sequence index), whatever faults later sequences have."""

from __future__ import annotations

import pytest
import torch

from deepinfer.forward_batch import ForwardBatch
from deepinfer.models import TINY_CONFIG, DeepseekV4Config, allocate_cache
from deepinfer.models.deepseek_v4 import PlanBuilder

NUM_BLOCKS = 4


@pytest.fixture(scope="module")
def cache():
    return allocate_cache(DeepseekV4Config.from_dict(TINY_CONFIG), NUM_BLOCKS, "cpu", torch.float32)


def _check_batch(batch, cache):
    return PlanBuilder(DeepseekV4Config.from_dict(TINY_CONFIG), cache.block_size, cache.num_blocks,
                       "cpu").from_forward_batch(batch)


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
    b = _batch([2, 1, 130], [2, 129, 130], [0, 1, 128] + list(range(130)), [[3, -1], [0, 2], [1, 0]])
    plan = _check_batch(b, cache)
    assert plan.num_tokens == plan.num_rows == 133
    assert plan.positions.tolist() == [0, 1, 128] + list(range(130))
    assert plan.tok_bt[:3].tolist() == [[3, -1], [3, -1], [0, 2]] and plan.tok_bt[3:].tolist() == [[1, 0]] * 130
    assert plan.token_slots.tolist() == [3 * 128, 3 * 128 + 1, 2 * 128] + [128 + p for p in range(128)] + [0, 1]
    empty = torch.zeros(0, dtype=torch.long)
    assert _check_batch(ForwardBatch(empty, empty, [], [], torch.zeros(0, 1, dtype=torch.int32), empty),
                        cache).num_tokens == 0
