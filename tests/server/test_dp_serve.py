"""``deepinfer serve`` over data-parallel ranks with expert parallelism (2 gloo processes): the same answers as one
engine (batch-invariant mode), concurrent requests spread over the ranks, streams, and a clean stop of the ranks."""

from __future__ import annotations

import concurrent.futures
import time

import openai
import pytest

from server_util import RunningServer
from deepinfer import LLM

KW = dict(batch_invariant=True, max_num_batched_tokens=256, num_blocks=24, max_num_seqs=8)


@pytest.fixture(scope="module")
def servers():
    ref = RunningServer(LLM("tiny", **KW))
    dp_llm = LLM("tiny", data_parallel_size=2, expert_parallel_size=2, num_redundant_experts=2, eplb_interval=3, **KW)
    dp = RunningServer(dp_llm)
    yield ref, dp
    dp.close()
    ref.close()
    t = time.monotonic()
    dp_llm.close()  # the stop message ends both ranks' loops at the same iteration: no kill needed
    assert not any(p.is_alive() for p in dp_llm._dp_group._procs)
    assert [p.exitcode for p in dp_llm._dp_group._procs] == [0, 0], time.monotonic() - t


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def test_dp_serve_equals_one_engine(servers):
    ref, dp = servers
    a, b = _client(ref), _client(dp)
    model = ref.llm.served_model_name

    def ask(client, i):
        r = client.completions.create(model=model, prompt=[5 + i, 17, 99 * i + 3], max_tokens=4 + i, seed=i,
                                      temperature=0.8)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(6) as pool:  # concurrent: both ranks take requests
        got = list(pool.map(lambda i: ask(b, i), range(6)))
    assert got == [ask(a, i) for i in range(6)]
    assert dp.loop.engine.has_unfinished_requests() is False and min(dp.loop.engine.num_sent) >= 1
    # a stream: its deltas add up to the answer one engine gives
    kw = dict(model=model, messages=[{"role": "user", "content": "Say something."}], max_tokens=6, seed=11)
    text = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or c.choices[0].delta.content or ""
                   for c in b.chat.completions.create(**kw, stream=True) if c.choices)
    want = a.chat.completions.create(**kw).choices[0].message
    assert text == (want.model_extra or {}).get("reasoning_content", "") + (want.content or "")
    with pytest.raises(RuntimeError, match="serving"):  # the ranks serve: no offline call meanwhile
        dp.llm.generate([[1, 2]])
    # a refused request comes back as the error one engine gives
    with pytest.raises(openai.BadRequestError) as e:
        b.completions.create(model=model, prompt=[1, 2], max_tokens=5000)
    assert "context" in e.value.body["message"]
