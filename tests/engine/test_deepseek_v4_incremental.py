"""DeepSeek-V4 incremental state through block tables: chunked prefill, token-by-token decode and mixed batches
must reproduce one full-sequence forward (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.forward_batch import ForwardBatch
from deepinfer.models import TINY_CONFIG, DeepseekV4Config, init_parameters
from deepinfer.models.deepseek_v4.config import CSA
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer_ops.testing.compare import TOLERANCES, assert_close

TOL = TOLERANCES[torch.float32]  # atol 1e-5, rtol 1e-5: incremental == full forward


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.fixture(scope="module")
def model():
    c = DeepseekV4Config.from_dict(TINY_CONFIG)
    return DeepseekV4ForCausalLM.from_parameters(c, init_parameters(c, 0))


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, TINY_CONFIG["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed))


def _table(blocks: list[int], width: int = 8) -> torch.Tensor:
    t = torch.full((1, width), -1, dtype=torch.int32)
    t[0, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    return t


def _full(model, ids: torch.Tensor, logit_rows: torch.Tensor):
    """One full-sequence forward: (logits at ``logit_rows``, final mHC streams at every position)."""
    n = ids.numel()
    nb = (n + 127) // 128
    batch = ForwardBatch(ids, torch.arange(n), [n], [n], _table(list(range(nb)), max(nb, 1)), logit_rows)
    return model.forward(batch, model.allocate_cache(nb), return_hidden=True)


# chunk boundaries of the 100/77/123 schedule over 600 tokens, and a spread of other rows
CHUNKS = (100, 77, 123, 100, 77, 123)
ROWS600 = torch.unique(torch.cat([torch.arange(0, 600, 23), torch.tensor([99, 100, 176, 177, 299, 300, 599])]))


@pytest.fixture(scope="module")
def seq600(model):
    ids = _ids(600, 5)
    logits, streams = _full(model, ids, ROWS600)
    return ids, logits, streams


def test_chunked_prefill_matches_full(model, seq600):
    ids, full_logits, full_streams = seq600
    cache = model.allocate_cache(9)
    cache_layers_poison(cache)
    bt = _table([7, 2, 8, 0, 5])  # scattered block ids
    pos, logits, streams = 0, [], []
    for q in CHUNKS:
        rows = ROWS600[(ROWS600 >= pos) & (ROWS600 < pos + q)] - pos
        batch = ForwardBatch(ids[pos:pos + q], torch.arange(pos, pos + q), [q], [pos + q], bt, rows)
        lg, st = model.forward(batch, cache, return_hidden=True)
        logits.append(lg)
        streams.append(st)
        pos += q
    assert pos == ids.numel()
    assert_close(torch.cat(streams), full_streams, TOL, name="chunked prefill final streams")
    assert_close(torch.cat(logits), full_logits, TOL, name="chunked prefill logits")


def test_token_by_token_decode_matches_full(model, seq600):
    ids, _, full_streams = seq600
    cache = model.allocate_cache(4)
    cache_layers_poison(cache)
    bt = _table([3, 1, 0])
    p0, p1 = 236, 262  # crosses CSA windows, the HCA window closing at 256 and the block boundary at 256
    _, st = model.forward(ForwardBatch(ids[:p0], torch.arange(p0), [p0], [p0], bt, torch.tensor([p0 - 1])), cache,
                          return_hidden=True)
    streams, logits = [st], []
    for p in range(p0, p1):
        lg, st = model.forward(ForwardBatch(ids[p:p + 1], torch.tensor([p]), [1], [p + 1], bt, torch.tensor([0])), cache,
                               return_hidden=True)
        streams.append(st)
        logits.append(lg)
    assert_close(torch.cat(streams), full_streams[:p1], TOL, name="decode final streams")
    ref_logits, _ = _full(model, ids[:p1], torch.arange(p0, p1))
    assert_close(torch.cat(logits), ref_logits, TOL, name="decode logits")


def test_mixed_batch_matches_separate_sequences(model, seq600):
    """One step holding a prefill chunk of one sequence and a decode of another, sharing the pools."""
    ids_a, _, full_a = seq600
    ids_b = _ids(140, 9)
    _, full_b = _full(model, ids_b, torch.tensor([0]))
    cache = model.allocate_cache(8)
    cache_layers_poison(cache)
    bt = torch.tensor([[6, 1, 4, -1], [2, 7, -1, -1]], dtype=torch.int32)
    # step 1: a[0:130] and b[0:139] as prefills
    s1 = ForwardBatch(torch.cat([ids_a[:130], ids_b[:139]]), torch.cat([torch.arange(130), torch.arange(139)]),
                      [130, 139], [130, 139], bt, torch.tensor([129, 130 + 138]))
    l1, st1 = model.forward(s1, cache, return_hidden=True)
    # step 2: a continues with a 131-token chunk, b decodes its last token
    s2 = ForwardBatch(torch.cat([ids_a[130:261], ids_b[139:140]]), torch.cat([torch.arange(130, 261), torch.tensor([139])]),
                      [131, 1], [261, 140], bt, torch.tensor([0, 64, 130, 131]))
    l2, st2 = model.forward(s2, cache, return_hidden=True)
    assert_close(st1, torch.cat([full_a[:130], full_b[:139]]), TOL, name="step 1 streams")
    assert_close(st2, torch.cat([full_a[130:261], full_b[139:140]]), TOL, name="step 2 streams")
    ref_a, _ = _full(model, ids_a[:261], torch.tensor([129, 130, 194, 260]))
    ref_b, _ = _full(model, ids_b, torch.tensor([138, 139]))
    assert_close(l1, torch.stack([ref_a[0], ref_b[0]]), TOL, name="step 1 logits")
    assert_close(l2, torch.stack([ref_a[1], ref_a[2], ref_a[3], ref_b[1]]), TOL, name="step 2 logits")


def test_full_blocks_can_be_shared_as_a_prefix(model, seq600):
    """A full block is a snapshot: a second sequence reusing the first two blocks of another (same 256 tokens)
    continues from them alone, even though the owner's step ran past the block end (200 -> 300)."""
    ids_a, _, _ = seq600
    cache = model.allocate_cache(5)
    cache_layers_poison(cache)
    bt_a = _table([4, 0, 2])
    model.forward(ForwardBatch(ids_a[:200], torch.arange(200), [200], [200], bt_a, torch.tensor([199])), cache)
    model.forward(ForwardBatch(ids_a[200:300], torch.arange(200, 300), [100], [300], bt_a, torch.tensor([99])), cache)
    ids_b = torch.cat([ids_a[:256], _ids(60, 21)])
    bt_b = _table([4, 0, 3])
    rows = torch.tensor([0, 31, 59])
    lg, st = model.forward(ForwardBatch(ids_b[256:], torch.arange(256, 316), [60], [316], bt_b, rows), cache,
                           return_hidden=True)
    ref_lg, ref_st = _full(model, ids_b, rows + 256)
    assert_close(st, ref_st[256:], TOL, name="prefix-shared streams")
    assert_close(lg, ref_lg, TOL, name="prefix-shared logits")


def test_attention_query_chunking_is_invisible(model, seq600, monkeypatch):
    from deepinfer.models.deepseek_v4.compressor import Indexer

    ids, full_logits, full_streams = seq600
    monkeypatch.setattr(Indexer, "QUERY_CHUNK", 45)  # the class default is 512
    lg, st = _full(model, ids, ROWS600)
    assert_close(st, full_streams, TOL, name="query-chunked streams")
    assert_close(lg, full_logits, TOL, name="query-chunked logits")


def test_batched_forward_full_equals_single(model):
    a, b = _ids(150, 11), _ids(150, 12)
    bt = torch.tensor([[3, 0], [1, 2]], dtype=torch.int32)
    rows = torch.tensor([0, 149, 150, 299])
    both = ForwardBatch(torch.cat([a, b]), torch.arange(150).repeat(2), [150, 150], [150, 150], bt, rows)
    lg, st = model.forward(both, model.allocate_cache(4), return_hidden=True)
    la, sa = _full(model, a, torch.tensor([0, 149]))
    lb, sb = _full(model, b, torch.tensor([0, 149]))
    assert_close(st, torch.cat([sa, sb]), TOL, name="batched streams")
    assert_close(lg, torch.cat([la, lb]), TOL, name="batched logits")
    # the [B, S] convenience goes through the same code
    short = torch.stack([a[:20], b[:20]])
    full = model.forward_full(short)
    assert full.shape == (2, 20, model.config.vocab_size)
    assert_close(full[1], model.forward_full(b[:20]), TOL, name="forward_full row 1")


def test_mtp_runs_and_is_consistent_through_the_cache(model):
    ids = _ids(201, 13)
    n = 199
    bt = _table([1, 0])
    rows = torch.arange(0, n, 11)
    _, streams = model.forward(ForwardBatch(ids[:n], torch.arange(n), [n], [n], bt, rows), model.allocate_cache(2),
                               return_hidden=True)
    assert streams.shape == (n, model.config.hc_mult, model.config.hidden_size)
    # full MTP pass: row t combines the main streams at t with token t+1
    full = model.forward_mtp(ForwardBatch(ids[1:n + 1], torch.arange(n), [n], [n], bt, rows), model.allocate_cache(2), streams)
    assert full.shape == (rows.numel(), model.config.vocab_size) and torch.isfinite(full).all()
    # chunked MTP through its own cache layer
    cache = model.allocate_cache(2)
    cache_layers_poison(cache)
    outs = []
    for a, b in ((0, 90), (90, 150), (150, n)):
        r = rows[(rows >= a) & (rows < b)] - a
        batch = ForwardBatch(ids[a + 1:b + 1], torch.arange(a, b), [b - a], [b], bt, r)
        outs.append(model.forward_mtp(batch, cache, streams[a:b]))
    assert_close(torch.cat(outs), full, TOL, name="chunked MTP logits")
    # a second draft step chains on the MTP block's own output streams
    lg, mtp_streams = model.forward_mtp(ForwardBatch(ids[1:n + 1], torch.arange(n), [n], [n], bt, rows),
                                        model.allocate_cache(2), streams, return_hidden=True)
    assert_close(lg, full, TOL, name="MTP logits with return_hidden")
    assert mtp_streams.shape == streams.shape and not torch.allclose(mtp_streams, streams)
    # the MTP prediction depends on the token and on the hidden streams
    other_tok = model.forward_mtp(ForwardBatch(ids[2:n + 2], torch.arange(n), [n], [n], bt, rows), model.allocate_cache(2), streams)
    assert not torch.allclose(other_tok, full)
    other_hid = model.forward_mtp(ForwardBatch(ids[1:n + 1], torch.arange(n), [n], [n], bt, rows), model.allocate_cache(2),
                                  streams.roll(1, dims=0))
    assert not torch.allclose(other_hid, full)
    with pytest.raises(ValueError, match="hidden_streams"):
        model.forward_mtp(ForwardBatch(ids[1:3], torch.arange(2), [2], [2], bt, torch.arange(2)), cache, streams[:3])


@pytest.mark.parametrize(
    "field, make",
    [
        ("query_lens", lambda ids: ForwardBatch(ids, torch.arange(4), [3], [3], _table([0]), torch.tensor([0]))),
        ("positions", lambda ids: ForwardBatch(ids, torch.arange(1, 5), [4], [4], _table([0]), torch.tensor([0]))),
        ("block_tables", lambda ids: ForwardBatch(ids, torch.arange(4), [4], [4], _table([9]), torch.tensor([0]))),
        ("block_tables", lambda ids: ForwardBatch(ids, torch.arange(4), [4], [4], _table([-1]), torch.tensor([0]))),
        ("block_tables", lambda ids: ForwardBatch(ids, torch.arange(126, 130), [4], [130], _table([0], width=1), torch.tensor([0]))),
        ("logits_indices", lambda ids: ForwardBatch(ids, torch.arange(4), [4], [4], _table([0]), torch.tensor([4]))),
        ("context_len", lambda ids: ForwardBatch(ids, torch.arange(4), [4], [3], _table([0]), torch.tensor([0]))),
    ],
)
def test_bad_batch_names_the_field(model, field, make):
    cache = model.allocate_cache(2)
    with pytest.raises(ValueError, match=field):
        model.forward(make(_ids(4, 1)), cache)


def cache_layers_poison(cache) -> None:
    """NaN-fill every pool: a step that reads a slot no earlier step wrote shows up as NaN logits."""
    for layer in cache.layers:
        for t in layer.values():
            t.fill_(float("nan"))


def test_empty_step_and_no_logits(model):
    cache = model.allocate_cache(2)
    cache_layers_poison(cache)
    empty = torch.zeros(0, dtype=torch.long)
    out = model.forward(ForwardBatch(empty, empty, [], [], torch.zeros(0, 1, dtype=torch.int32), empty), cache)
    assert out.shape == (0, model.config.vocab_size)
    assert all(torch.isnan(t).all() for layer in cache.layers for t in layer.values()), "an empty step wrote the cache"
    out = model.forward(ForwardBatch(_ids(5, 3), torch.arange(5), [5], [5], _table([1]), empty), cache)
    assert out.shape == (0, model.config.vocab_size)
    assert not torch.isnan(cache.layers[0]["kv"][1, :5]).any() and torch.isnan(cache.layers[0]["kv"][1, 5:]).all()
    assert torch.isnan(cache.layers[0]["kv"][0]).all(), "a block outside the table was written"


def test_bfloat16_model_and_cache(model, seq600):
    """bf16 weights, activations and cache run end to end (incrementally) and stay close to fp32."""
    ids, full_logits, _ = seq600
    m16 = DeepseekV4ForCausalLM.from_parameters(model.config, {k: v for k, v in model.state_dict().items()}, torch.bfloat16)
    cache = m16.allocate_cache(3)
    assert cache.layers[1]["comp"].dtype == torch.bfloat16
    bt = _table([2, 0, 1])
    rows = ROWS600[ROWS600 < 300]
    got = [m16.forward(ForwardBatch(ids[:200], torch.arange(200), [200], [200], bt, rows[rows < 200]), cache)]
    got.append(m16.forward(ForwardBatch(ids[200:300], torch.arange(200, 300), [100], [300], bt, rows[rows >= 200] - 200), cache))
    got = torch.cat(got)
    ref = full_logits[: rows.numel()]
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0)
    assert cos > 0.99, f"bf16 vs fp32 cosine {cos}"


def test_fused_input_projections_follow_weight_changes():
    """The compressor / indexer input projections run as one concatenated GEMM whose parts are views of it, fused at
    load time (the forward never rewires a parameter): an in-place weight update reaches the next forward, and a
    replaced weight does after ``fuse_weights`` (it then equals a model built with the new weights)."""
    from deepinfer.models.deepseek_v4.loading import fuse_weights

    c = DeepseekV4Config.from_dict(TINY_CONFIG)
    params = init_parameters(c, 0)
    m = DeepseekV4ForCausalLM.from_parameters(c, dict(params))
    ids = _ids(300, 5)
    csa = next(i for i, layer in enumerate(m.layers) if layer.attn.layer_type == CSA)
    attn = m.layers[csa].attn
    fused = attn.x_fused
    assert attn.compressor.wgate.weight.data_ptr() > fused.data_ptr()  # a view into the concatenation
    assert attn.indexer.weights_proj.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    before = {n: p.data_ptr() for n, p in m.named_parameters()}
    m.forward_full(ids)
    assert {n: p.data_ptr() for n, p in m.named_parameters()} == before  # no parameter rewired by the forward
    g = torch.Generator().manual_seed(9)
    new_gate = torch.randn(attn.compressor.wgate.weight.shape, generator=g) * 0.1
    new_wp = torch.randn(attn.indexer.weights_proj.weight.shape, generator=g) * 0.1
    with torch.no_grad():
        attn.compressor.wgate.weight.copy_(new_gate)  # in place
    params[f"layers.{csa}.attn.compressor.wgate.weight"] = new_gate
    assert_close(m.forward_full(ids), DeepseekV4ForCausalLM.from_parameters(c, dict(params)).forward_full(ids), TOL,
                 name="logits after an in-place update")
    attn.indexer.weights_proj.weight = torch.nn.Parameter(new_wp, requires_grad=False)  # replaced
    fuse_weights(m)
    params[f"layers.{csa}.attn.indexer.weights_proj.weight"] = new_wp
    fresh = DeepseekV4ForCausalLM.from_parameters(c, params)
    assert_close(m.forward_full(ids), fresh.forward_full(ids), TOL, name="logits after weight changes")


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_batched_decode_equals_each_sequence_alone(model, batch_invariant):
    """Decode steps of several sequences together (compressor windows and rings handled batched over the
    sequences) give each sequence what it gets decoding alone: bitwise in batch-invariant mode, within float32
    tolerance otherwise. The lengths cross window ends (ratios 4 and 128), block ends (128 tokens) and start at
    one token (window 0 has no previous window)."""
    lens = [1, 3, 126, 127, 253]
    steps = 4
    seqs = [_ids(n + steps, 40 + i) for i, n in enumerate(lens)]
    width = 3
    tables = [list(range(width * i, width * i + width)) for i in range(len(lens))]

    def run(members):
        cache = model.allocate_cache(width * len(lens))
        bt = torch.tensor([tables[i] for i in members], dtype=torch.int32)
        pre = ForwardBatch(torch.cat([seqs[i][:lens[i]] for i in members]),
                           torch.cat([torch.arange(lens[i]) for i in members]), [lens[i] for i in members],
                           [lens[i] for i in members], bt, torch.tensor([0]), batch_invariant=batch_invariant)
        model.forward(pre, cache)
        out = []
        for k in range(steps):
            ids = torch.stack([seqs[i][lens[i] + k] for i in members])
            pos = torch.tensor([lens[i] + k for i in members])
            b = ForwardBatch(ids, pos, [1] * len(members), [lens[i] + k + 1 for i in members], bt,
                             torch.arange(len(members)), batch_invariant=batch_invariant)
            out.append(model.forward(b, cache))
        return torch.stack(out, dim=1)  # [members, steps, vocab]

    together = run(list(range(len(lens))))
    for i in range(len(lens)):
        alone = run([i])[0]
        if batch_invariant:
            assert torch.equal(alone, together[i]), f"sequence {i} (length {lens[i]})"
        else:
            assert_close(alone, together[i], TOL, name=f"sequence {i} logits")
