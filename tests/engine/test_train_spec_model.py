"""tools/train_spec_model.py on the CPU: the corpus split, the native-name mapping, and a ``--tiny`` run whose
checkpoint our engine loads and runs exactly like the trained model.

Stated tolerance (fp32 checkpoint, both sides float32 on the CPU): ``max |engine - trained| / max |trained| <= 1e-4``
for the main logits at every position and for the logits of the first two chained MTP draft steps; indexer top-k
ties are counted and must be 0 (``test_deepseek_v4_parity.py`` says why). ``index_topk`` of the tiny run covers
every compressed entry of these prompts, so the untrained indexer does not decide anything.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))

import train_spec_model as T  # noqa: E402
from spec_train import data as D  # noqa: E402
from spec_train import model as SM  # noqa: E402

from deepinfer.forward_batch import ForwardBatch  # noqa: E402
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM  # noqa: E402

MAX_REL_ERR = 1e-4

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max())


# ---- data -------------------------------------------------------------------------------------------------------------


def test_split_is_deterministic_disjoint_and_by_path_only():
    files = D.list_source_files(D.stdlib_root())
    assert files == sorted(files) and len(files) > 100
    train, held = D.split_files(files)
    assert (train, held) == D.split_files(list(files))
    assert not set(train) & set(held) and sorted(train + held) == files
    assert 0.02 < len(held) / len(files) < 0.09  # 5 % of a uniform hash
    for f in held[:5] + train[:5]:  # the documented rule, recomputed
        h = int.from_bytes(hashlib.sha256(f.encode()).digest()[:4], "big")
        assert (h % 1000 < D.DEFAULT_HELDOUT_PERMILLE) == (f in held)
    # a file's side depends on its path alone: splitting any subset gives the same sides
    sub = files[::7]
    st, sh = D.split_files(sub)
    assert set(st) <= set(train) and set(sh) <= set(held)
    # another share moves files one way only
    t2, h2 = D.split_files(files, 100)
    assert set(held) <= set(h2) and set(t2) <= set(train)
    with pytest.raises(ValueError, match="heldout_permille"):
        D.split_files(files, 0)


def test_listing_skips_third_party_folders_and_pack_drops_the_tail(tmp_path):
    for rel in ("a.py", "pkg/b.py", "site-packages/x.py", "pkg/__pycache__/c.py", "pkg/notes.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    assert D.list_source_files(tmp_path) == ["a.py", "pkg/b.py"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="root"):
        D.list_source_files(tmp_path / "empty")
    rows = D.pack([[0, 5, 6], [0, 7], [0, 8, 9, 10]], 3)
    assert rows.tolist() == [[0, 5, 6], [0, 7, 0], [8, 9, 10]]
    with pytest.raises(ValueError, match="row"):
        D.pack([[0, 1]], 3)


def test_heldout_prompts_take_openings_first_then_later_windows():
    docs = [list(range(100, 110)), list(range(200, 230)), list(range(300, 305))]
    got = D.heldout_prompts(docs, ["a", "b", "c"], 5, 3)
    assert [(p["file"], p["offset"]) for p in got] == [("a", 0), ("b", 0), ("b", 6), ("b", 12), ("b", 18)]
    assert got[2]["prompt_token_ids"] == [206, 207, 208]
    assert len(D.heldout_prompts(docs, ["a", "b", "c"], 50, 3)) == 6  # c is too short for any prompt


def test_targets_shift_and_mask():
    rows = torch.arange(10).view(1, 10) + 100
    ids, nxt, y, ys = SM.targets(rows, 3)
    assert ids.tolist() == [list(range(100, 109))] and torch.equal(nxt, y) and y[0, 0] == 101
    for j, t in enumerate(ys):  # step j at position t predicts rows[t + 2]; no chain start before t = j
        assert t[0, :j].eq(SM.IGNORE).all() and t[0, -1] == SM.IGNORE
        assert t[0, j:-1].tolist() == list(range(102 + j, 110))


def test_dense_experts_match_eager_and_the_balancer_moves_biases():
    cfg = SM.model_config(tiny=True)
    rows = torch.randint(0, cfg["vocab_size"], (2, 33), generator=torch.Generator().manual_seed(3))
    results = {}
    for impl in ("dense", "eager"):
        m = SM.SpecModel(cfg, seed=0, experts_implementation=impl)
        loss, _ = SM.train_loss(m, rows, 2, 0.5)
        loss.backward()
        results[impl] = (loss.detach(), {k: p.grad for k, p in m.named_parameters() if p.grad is not None})
    (ld, gd), (le, ge) = results["dense"], results["eager"]
    assert torch.allclose(ld, le, rtol=1e-5, atol=0) and gd.keys() == ge.keys()
    for k in gd:
        assert torch.allclose(gd[k], ge[k], rtol=1e-3, atol=1e-6), k
    # one balancing step: each score-routed router's bias moves by -rate on experts above the mean load
    bal = SM.ExpertBalancer(m, rate=0.25)
    seen = {}
    for r in bal.routers:
        r.register_forward_hook(lambda mod, a, out, r=r: seen.__setitem__(r, out[2].flatten()))
    with torch.no_grad():
        m(rows[:, :-1], rows[:, 1:], 1)
    assert bal.step() is not None and len(seen) == len(bal.routers) == 3  # layers 2 and 3, mtp.0
    for r in bal.routers:
        load = torch.bincount(seen[r], minlength=r.num_experts).float()
        assert torch.equal(r.e_score_correction_bias, 0.25 * torch.sign(load.mean() - load))


# ---- the trained tiny model --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory, one_cpu_thread):
    out = tmp_path_factory.mktemp("spec-tiny") / "ckpt"
    report, model, corpus = T.run(["--tiny", "--out", str(out), "--quant", "fp32", "--no-engine-check",
                                   "--log-every", "1"])
    model.eval()
    return out, report, model, corpus


def test_run_writes_checkpoint_report_and_prompts(trained):
    out, report, model, corpus = trained
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert not list(out.glob(".candidate-*"))
    saved = json.loads((out / T.REPORT).read_text())
    assert saved["format"] == "fp32" and saved["steps_done"] == 6 and saved["stopped_by"] == "steps"
    assert saved["corpus"]["digest"] == corpus.digest and len(saved["curve"]) == 6
    prompts = [json.loads(x) for x in (out / T.PROMPTS).read_text().splitlines()]
    docs = dict(zip(corpus.heldout_files, corpus.heldout_docs))
    assert len(prompts) == report["args"]["num_prompts"]
    for p in prompts:
        ids = docs[p["file"]][p["offset"]:p["offset"] + len(p["prompt_token_ids"])]
        assert ids == p["prompt_token_ids"] and (p["offset"] > 0 or ids[0] == 0)


def test_loss_decreases(trained):
    _, report, _, _ = trained
    first, last = report["metrics"]["initial"], report["metrics"]["train"]
    assert last["lm_loss"] < first["lm_loss"] - 0.3, (first["lm_loss"], last["lm_loss"])
    for a, b in zip(first["mtp_loss"], last["mtp_loss"]):
        assert b < a - 0.3, (a, b)
    curve = [c["lm"] for c in report["curve"]]
    assert sum(curve[-2:]) / 2 < sum(curve[:2]) / 2


def test_native_names_are_the_engines_and_transformers_reads_them(trained):
    out, _, model, _ = trained
    from deepinfer.checkpoint import load_checkpoint, parse_config
    from deepinfer.models.deepseek_v4.params import expected_parameters

    native = SM.to_native(model)
    assert list(native) == list(expected_parameters(parse_config(model.cfg)))
    ckpt = load_checkpoint(out)
    assert all(torch.equal(ckpt.params[k], v) for k, v in native.items())
    # a fresh model takes them back exactly
    other = SM.SpecModel(model.cfg, seed=1)
    SM.load_native(other, native)
    for (k, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), k
    bad = dict(native, **{"mtp.0.e_proj.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="mtp.0.e_proj.weight"):
        SM.load_native(other, bad)
    with pytest.raises(ValueError, match="missing"):
        SM.load_native(other, {k: v for k, v in native.items() if k != "norm.weight"})
    # transformers' own loader maps the written checkpoint onto the same main-model weights
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                            experts_implementation="eager")
    mine = model.lm.state_dict()
    for k, v in hf.state_dict().items():
        assert torch.equal(v, mine[k]), k


def _reference(model, row):
    ids, nxt = row[:-1].view(1, -1), row[1:].view(1, -1)
    with torch.no_grad():
        h, hs = model(ids, nxt, 2)
    w = model.head_weight
    return [torch.nn.functional.linear(x[0], w) for x in (h, *hs)]


def test_engine_runs_the_trained_model_and_its_mtp_layer(trained):
    out, _, model, corpus = trained
    eng = DeepseekV4ForCausalLM.from_checkpoint(out)
    row = corpus.heldout_rows[1]
    ref_main, ref1, ref2 = _reference(model, row)
    ids, nxt = row[:-1], row[1:]
    S = ids.numel()
    every = torch.arange(S)
    bt = torch.tensor([[0]], dtype=torch.int32)
    cache = eng.allocate_cache(1)
    main, streams = eng.forward(ForwardBatch(ids, every, [S], [S], bt, every), cache, return_hidden=True)
    ties = eng.last_indexer_boundary_ties
    assert rel_err(main, ref_main) <= MAX_REL_ERR
    # draft step 1: token t+1 and the main streams at t
    d1, s1 = eng.forward_mtp(ForwardBatch(nxt, every, [S], [S], bt, every), cache, streams, return_hidden=True)
    assert rel_err(d1, ref1) <= MAX_REL_ERR
    # draft step 2: the engine's chain on its own output streams, one position earlier
    chained = torch.cat([streams[:1], s1[:-1]])
    d2 = eng.forward_mtp(ForwardBatch(nxt, every, [S], [S], bt, every), eng.allocate_cache(1), chained)
    ties += eng.last_indexer_boundary_ties
    assert ties == 0
    assert rel_err(d2, ref2) <= MAX_REL_ERR
    # the comparison can fail: the two draft steps (and main vs draft) differ by far more than the tolerance
    assert rel_err(d1, ref2) > 10 * MAX_REL_ERR and rel_err(main, ref1) > 10 * MAX_REL_ERR


def test_llm_loads_the_checkpoint_and_decodes_greedily_like_the_trained_model(trained):
    import deepinfer
    from deepinfer.sequence import SamplingParams

    out, _, model, _ = trained
    prompt = json.loads((out / T.PROMPTS).read_text().splitlines()[0])["prompt_token_ids"]
    llm = deepinfer.LLM(str(out), device="cpu")
    got = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert got.error is None
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(4):
            h, _ = model(torch.tensor([ids]), torch.tensor([ids]), 0)
            ids.append(int(torch.nn.functional.linear(h[0, -1], model.head_weight).argmax()))
    assert got.token_ids == ids[len(prompt):]


def test_quantised_formats_load_in_the_engine(trained, tmp_path):
    _, _, model, corpus = trained
    native = SM.to_native(model)
    ids = corpus.heldout_rows[0][:40]
    from deepinfer.checkpoint import parse_config

    exact = DeepseekV4ForCausalLM.from_parameters(parse_config(model.cfg), native).forward_full(ids)
    for fmt, bound in (("bf16", 0.05), ("fp8-fp4", 0.5)):
        path = T.write_format(tmp_path / fmt, model.cfg, native, fmt)
        got = DeepseekV4ForCausalLM.from_checkpoint(path).forward_full(ids)
        err = rel_err(got, exact)
        assert torch.isfinite(got).all() and 0 < err <= bound, (fmt, err)


def test_format_choice_and_schedule():
    args = T.parse_args(["--out", "x", "--tiny"])
    base = {"lm_loss": 2.0, "accept_len": 2.0}
    ok = {"fp8-fp4": {"lm_loss": 2.019, "accept_len": 1.96}, "bf16": base}
    worse = {"fp8-fp4": {"lm_loss": 2.03, "accept_len": 2.0}, "bf16": base}
    fewer = {"fp8-fp4": {"lm_loss": 2.0, "accept_len": 1.9}, "bf16": base}
    assert [T.choose_format(r, args) for r in (ok, worse, fewer)] == ["fp8-fp4", "bf16", "bf16"]
    args = T.parse_args(["--out", "x", "--steps", "100", "--warmup", "10", "--lr", "1.0"])
    lrs = [T.lr_at(s, args) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0) and lrs[10] == pytest.approx(1.0)
    assert lrs[99] == pytest.approx(0.1, abs=1e-3) and all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    for bad in (["--mtp-depth", "0"], ["--lr", "0"], ["--warmup", "-1"], ["--steps", "0"]):
        with pytest.raises(SystemExit):
            T.parse_args(["--out", "x", *bad])
