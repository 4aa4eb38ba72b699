"""Issue 25, item 7: the README's claims checked against the code (op names, the batch-invariant cost figures,
skip reasons, the error records' ``param`` convention)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

import deepinfer_ops  # noqa: F401 - registers torch.ops.deepinfer_ops
from deepinfer.presets import preset_config

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _registered() -> set[str]:
    src = (ROOT / "csrc" / "torch_bindings.cpp").read_text(encoding="utf-8")
    return set(re.findall(r'm\.def\(\s*"([a-z0-9_]+)\(', src))


def test_the_op_table_names_registered_ops_or_says_otherwise():
    start = README.index("| domain | ops |")
    rows = README[start:README.index("\n\n", start)].splitlines()[2:]
    registered = _registered()
    assert registered and all(hasattr(torch.ops.deepinfer_ops, n) for n in registered)
    listed = set()
    for row in rows:
        cell = row.split("|")[2]
        listed.update(re.findall(r"registered as `([a-z0-9_]+)`", cell))
        for name in re.findall(r"`([a-z0-9_]+)`", cell):
            if name in registered:
                listed.add(name)
                continue
            aliased = re.search(rf"`{name}` \(registered as `([a-z0-9_]+)`", cell)
            composed = re.search(rf"`{name}` is a Python composition", cell)
            assert aliased or composed, f"README op table: {name!r} is not a registered op and the row does not say so"
            assert hasattr(deepinfer_ops, name), f"README op table: {name!r} is not in deepinfer_ops either"
    assert registered <= listed, f"registered ops missing from the README table: {sorted(registered - listed)}"


def test_batch_invariant_cost_figures_name_the_measured_expert_count():
    rows = json.loads((ROOT / "bench/results/h200/bench_batch_invariant.json").read_text())["rows"]
    shape = rows[0]["shape"]
    claim = f"{shape['num_layers']} layers and {shape['num_experts']} experts, not the preset's " \
            f"{preset_config(shape['checkpoint'])['n_routed_experts']}"
    assert claim in " ".join(README.split())
    by_op = {r["op"]: r["overhead_pct"] for r in rows}
    assert f"prefill +{by_op['engine_prefill']:.1f}%, decode +{by_op['engine_decode']:.1f}%" in README


def test_skip_reasons_and_the_param_convention_are_documented():
    text = " ".join(README.split())
    assert "`pytest -rs`" in text
    assert "`param` is the path of the field at fault in OpenAI's form" in text
