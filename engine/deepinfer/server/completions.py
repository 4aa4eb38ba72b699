"""``/v1/completions``: a raw prompt (text or token ids, no chat template) through the recipe's stream processor in
plain-text mode (incremental decoding, stop sequences), answered in the OpenAI Completions format."""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass

import deepseek_recipe as R

from deepinfer.api_checks import check_request
from deepinfer.chat import PreparedChat, RequestError, ToolCallIds, _digest, chat_logit_options
from deepinfer.sequence import SamplingParams

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint


@dataclass
class PreparedCompletion(PreparedChat):
    """A ``PreparedChat`` whose parser runs without a template or reasoning; its chat chunks and response are
    rewritten to ``text_completion`` objects."""

    def _text_chunk(self, chunk: dict) -> dict | None:
        choices = []
        for c in chunk.get("choices") or []:
            text = (c.get("delta") or {}).get("content") or ""
            if text or c.get("finish_reason"):
                choices.append({"text": text, "index": 0, "logprobs": None, "finish_reason": c.get("finish_reason")})
        if not choices and chunk.get("usage") is None:
            return None
        return {"id": self.request_id, "object": "text_completion", "created": chunk.get("created"),
                "model": self.model_name, "choices": choices, "usage": chunk.get("usage")}

    def take_events(self) -> list:
        out = []
        for _, data in super().take_events():
            c = self._text_chunk(data)
            if c is not None:
                out.append((None, c))
        return out

    def finish(self, finish_reason: str, num_cached_tokens: int = 0) -> dict:
        chat = super().finish(finish_reason, num_cached_tokens)
        choice = chat["choices"][0]
        usage = {k: chat["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens",
                                               "prompt_tokens_details")}
        return {"id": self.request_id, "object": "text_completion", "created": chat["created"],
                "model": self.model_name, "choices": [{"text": choice["message"].get("content") or "", "index": 0,
                                                       "logprobs": None, "finish_reason": choice["finish_reason"]}],
                "usage": usage, "seed": chat["seed"]}


def _prompt_ids(llm, prompt) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt is empty", param="prompt")
        return llm.encode(prompt)
    if not isinstance(prompt, list) or not prompt:
        raise RequestError("prompt must be a non-empty string or a non-empty list of token ids (one prompt per "
                           "request)", param="prompt")
    ids = []
    for i, t in enumerate(prompt):
        if isinstance(t, bool) or not isinstance(t, int):
            raise RequestError(f"prompt[{i}] must be a token id (an integer), got {type(t).__name__}", param="prompt")
        if llm.vocab_size and not 0 <= t < llm.vocab_size:
            raise RequestError(f"prompt[{i}] = {t} is outside the vocabulary [0, {llm.vocab_size})", param="prompt")
        ids.append(operator.index(t))
    return ids


def prepare_completion(llm, body: dict, stream: bool = False) -> PreparedCompletion:
    """Check and convert one Completions body for ``llm``.

    Fields (``api_checks.COMPLETIONS_FIELDS``, checked by ``check_request``): ``prompt`` (text, or token ids; a list
    holding one of them), ``max_tokens`` (default 16), ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``,
    ``frequency_penalty``, ``presence_penalty``, ``logit_bias``, ``ignore_eos`` (vLLM's: run to ``max_tokens``,
    for benchmarks); ``n``, ``best_of`` > 1, ``echo``, ``suffix`` and
    ``logprobs`` are refused.

    Raises:
        RequestError naming the field; ``context_length_exceeded`` when prompt + max_tokens exceed the context.
    """
    fe = llm.frontend
    check_request(body, "completions", stream=stream)
    ids = _prompt_ids(llm, body["prompt"])
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    max_tokens = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    if len(ids) + max_tokens > fe.max_model_len:
        raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's context "
                           f"length ({fe.max_model_len})", code="context_length_exceeded", param="max_tokens")
    seed = body.get("seed")
    drawn = seed is None
    params = SamplingParams(
        temperature=float(1.0 if body.get("temperature") is None else body["temperature"]),
        top_p=float(1.0 if body.get("top_p") is None else body["top_p"]),
        max_tokens=max_tokens, seed=llm._draw_seed() if drawn else seed, ignore_eos=body.get("ignore_eos") is True,
        **chat_logit_options(body))
    try:
        params.validate(fe.vocab_size)
    except ValueError as e:
        raise RequestError(str(e), param=getattr(e, "param", None)) from None
    # as for chat: a streamed request and its non-streamed twin share the id
    request_id = "cmpl-" + _digest({k: v for k, v in body.items() if k not in ("stream", "stream_options")},
                                   params.seed)[:24]
    conv = R.ConversationRequest(R.Conversation([R.UserMessage("")], thinking_mode=False), fe.model_version)
    gen = R.ChatCompletionRequest.chunk_generator(conv, request_id, fe.served_model_name)
    processor = R.StreamProcessor(gen, R.ParsingOptions(parse_tool_calls=False, stop_sequences=stop), fe.tokenizer)
    created = fe.created if fe.created is not None else int(time.time())
    resp = R.ChatCompletionResponse(request_id, fe.served_model_name, created, len(ids), 0)
    pc = PreparedCompletion(api="completions", request_id=request_id, model_name=fe.served_model_name,
                            prompt_token_ids=ids, params=params, seed_drawn=drawn, want_logprobs=False,
                            processor=processor, response=resp, thinking=False, stop_sequences=stop,
                            sse=[] if stream else None, tool_ids=ToolCallIds(request_id))
    pc._accumulate(processor.push(R.InferenceChunk.ready(prompt_usage=R.PromptUsage(prompt_tokens=len(ids)))))
    return pc
