import pytest

from deepinfer.block_manager import BlockManager, blocks_for
from deepinfer.sequence import SamplingParams, Sequence


def _seq(i, n=1):
    return Sequence(seq_id=i, prompt_token_ids=[5] * n, params=SamplingParams(), seed=0)


def test_blocks_for():
    assert [blocks_for(n, 128) for n in (0, 1, 127, 128, 129, 256, 257)] == [0, 1, 1, 1, 2, 2, 3]


def test_allocate_grow_and_free():
    bm = BlockManager(num_blocks=5, block_size=4)
    a, b = _seq(0), _seq(1)
    bm.allocate(a, 5)  # 2 blocks
    assert a.block_table == [0, 1] and bm.num_free_blocks == 3
    bm.allocate(a, 8)  # still 2 blocks
    assert a.block_table == [0, 1]
    bm.allocate(b, 1)
    assert b.block_table == [2]
    assert bm.blocks_needed(a, 13) == 2 and bm.can_allocate(a, 13)
    assert not bm.can_allocate(a, 17)  # needs 3 more, 2 free
    with pytest.raises(RuntimeError, match="needs 3 blocks, 2 free"):
        bm.allocate(a, 17)
    assert a.block_table == [0, 1]  # untouched by the failed call
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 4
    bm.allocate(a, 16)  # 4 blocks: the free list hands out 3, 4 first, then the freed 0, 1
    assert a.block_table == [3, 4, 0, 1]
    assert len(set(a.block_table) & set(b.block_table)) == 0
    bm.free(b)
    bm.free(a)
    assert sorted(bm.free_blocks) == list(range(5))


def test_free_checks_ownership():
    bm = BlockManager(num_blocks=2, block_size=4)
    a, b = _seq(0), _seq(1)
    bm.allocate(a, 4)
    b.block_tables = {"full": list(a.block_table)}  # a corrupted table
    with pytest.raises(RuntimeError, match="owned by 0"):
        bm.free(b)


@pytest.mark.parametrize("num_blocks,block_size", [(0, 4), (3, 0)])
def test_bad_sizes(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)
