"""Structured output: constraints compiled with xgrammar, per-request matchers and the token bitmask.

A request's ``SamplingParams.structured_outputs`` (:class:`StructuredOutputsParams`) names one constraint. The
engine compiles it with :class:`GrammarCompiler` (a worker pool off the step loop, a timeout, a byte-limited cache)
before the request is queued; the runner keeps a :class:`RequestMatcher` per constrained request, fills the step's
bitmask rows on the host and the sampler masks the logits (:func:`apply_token_bitmask`). Tool calls are constrained
with an xgrammar structural tag for DeepSeek's DSML call syntax (``deepinfer.tool_grammar``). See
``docs/engine.md``, "Structured output".
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from deepinfer.sequence import SamplingParamError

_KINDS = ("json", "json_object", "regex", "grammar", "choice", "structural_tag")
MAX_SPEC_CHARS = 1 << 20  # longest schema / regex / grammar text accepted (1 MiB)
MAX_CHOICES = 1024


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint (vLLM's ``structured_outputs`` names); exactly one of the constraint fields is set.

    Attributes:
        json: a JSON schema (dict, or its JSON text): the output is one JSON value valid against it.
        json_object: True: the output is one JSON object (any keys).
        regex: the output fully matches this regular expression.
        grammar: the output is a sentence of this EBNF grammar (xgrammar / GBNF syntax, start rule ``root``).
        choice: the output is exactly one of these strings.
        structural_tag: an xgrammar structural tag (``{"type": "structural_tag", "format": {...}}``, a dict or its
            JSON text): the output follows its format (the Chat API's tool-call grammar,
            ``deepinfer.tool_grammar``).
        after_token_id: when set, the constraint starts after the first occurrence of this token id in the output
            (thinking mode: ``</think>``); the tokens before it are free.
        error_param: the request field a compilation error names (default ``structured_outputs.<field>``; the Chat
            API's tool-call grammar names ``tools``). Not part of the cache key.

    JSON is generated compactly (no whitespace between tokens, ``","`` and ``":"`` separators): a model cannot loop
    on whitespace.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | None = None
    structural_tag: dict | str | None = None
    after_token_id: int | None = None
    error_param: str | None = None

    def kind(self) -> str:
        """The constraint field that is set."""
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def validate(self) -> None:
        """Raise ``SamplingParamError`` (``param`` ``"structured_outputs.<field>"``) for a wrong type, a text over
        ``MAX_SPEC_CHARS``, an empty choice list or not exactly one constraint set."""
        set_ = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise SamplingParamError("structured_outputs", "structured_outputs must set exactly one of json, "
                                     f"json_object, regex, grammar, choice, structural_tag; got {set_ or 'none'}")
        kind = set_[0]
        v = getattr(self, kind)
        field = f"structured_outputs.{kind}"
        if kind in ("json", "structural_tag"):
            what = "a JSON schema" if kind == "json" else "a structural tag"
            if not isinstance(v, (dict, str)) or isinstance(v, bool):
                raise SamplingParamError(field, f"{field} must be {what} (an object or its JSON text), got "
                                                f"{type(v).__name__}")
            if isinstance(v, str):
                if len(v) > MAX_SPEC_CHARS:
                    raise SamplingParamError(field, f"{field} is longer than {MAX_SPEC_CHARS} characters")
                try:
                    parsed = json.loads(v)
                except ValueError as e:
                    raise SamplingParamError(field, f"{field} is not valid JSON: {e}") from None
                if not isinstance(parsed, (dict, bool)) or (kind == "structural_tag" and not isinstance(parsed, dict)):
                    raise SamplingParamError(field, f"{field} must be {what} object")
            elif len(json.dumps(v)) > MAX_SPEC_CHARS:
                raise SamplingParamError(field, f"{field} is longer than {MAX_SPEC_CHARS} characters")
        elif kind == "json_object":
            if v is not True:
                raise SamplingParamError(field, f"{field} must be true or unset, got {v!r}")
        elif kind in ("regex", "grammar"):
            if not isinstance(v, str) or not v:
                raise SamplingParamError(field, f"{field} must be a non-empty string, got {v!r}")
            if len(v) > MAX_SPEC_CHARS:
                raise SamplingParamError(field, f"{field} is longer than {MAX_SPEC_CHARS} characters")
        else:
            if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)) or not v \
                    or not all(isinstance(c, str) and c for c in v):
                raise SamplingParamError(field, f"{field} must be a non-empty list of non-empty strings, got {v!r}")
            if len(v) > MAX_CHOICES or sum(map(len, v)) > MAX_SPEC_CHARS:
                raise SamplingParamError(field, f"{field} holds more than {MAX_CHOICES} choices or "
                                                f"{MAX_SPEC_CHARS} characters")
        a = self.after_token_id
        if a is not None and (isinstance(a, bool) or not isinstance(a, int) or a < 0):
            raise SamplingParamError("structured_outputs.after_token_id",
                                     f"structured_outputs.after_token_id must be a token id >= 0, got {a!r}")

    def cache_key(self) -> tuple[str, str]:
        """``(kind, canonical text)``: equal constraints share one compiled grammar."""
        kind = self.kind()
        v = getattr(self, kind)
        if kind in ("json", "structural_tag"):
            return kind, json.dumps(_canonical(json.loads(v) if isinstance(v, str) else v))
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            return kind, json.dumps(list(v))
        return kind, v


def _canonical(v, keep_order: bool = False):
    """``v`` with every object's keys sorted, except the members of ``properties``: their declared order is the
    order the generated JSON writes them in (a schema may put ``reasoning`` before ``answer`` on purpose)."""
    if isinstance(v, dict):
        items = v.items() if keep_order else sorted(v.items())
        return {k: _canonical(x, k == "properties" and not keep_order) for k, x in items}
    if isinstance(v, list):
        return [_canonical(x) for x in v]
    return v


class GrammarError(ValueError):
    """A constraint xgrammar cannot compile; ``param`` names the request field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class GrammarCompiler:
    """Compiles constraints with xgrammar on a small worker pool, with a cache bounded in bytes.

    Args:
        tokenizer_json: the model's ``tokenizer.json`` (byte-level BPE); the xgrammar tokenizer info is built from
            it once, on the first compilation.
        vocab_size: the model's logits width (the bitmask covers it; ids past the tokenizer's are never allowed).
        stop_token_ids: the ids that end a constrained output when its grammar is complete (the model's EOS).
        cache_bytes: most bytes of compiled grammars kept (least recently used dropped first; a grammar larger
            than the limit is used but not kept).
        max_workers: compilation threads.
        timeout_s: a compilation still running after this many seconds fails its request (``LLMEngine``).
        max_pending: most compilations queued or running; more fail at once.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, stop_token_ids, cache_bytes: int = 256 << 20,
                 max_workers: int = 2, timeout_s: float = 30.0, max_pending: int = 256) -> None:
        self.tokenizer_json = tokenizer_json
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        self.cache_bytes = int(cache_bytes)
        self.timeout_s = float(timeout_s)
        self.max_pending = int(max_pending)
        self.num_compiled = 0  # compilations run (cache misses)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="deepinfer-grammar")
        self._lock = threading.Lock()
        self._init_lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._cached_bytes = 0
        self._pending: dict[tuple[str, str], Future] = {}
        self._compiler = None

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """A future of the compiled grammar (``xgrammar.CompiledGrammar``) of ``spec``; a cached one is done at
        once, one already compiling is shared. It fails with :class:`GrammarError` naming the field."""
        key = spec.cache_key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                f: Future = Future()
                f.set_result(hit)
                return f
            f = self._pending.get(key)
            if f is not None:
                return f
            if len(self._pending) >= self.max_pending:
                f = Future()
                f.set_exception(GrammarError("structured_outputs", f"structured_outputs: more than "
                                             f"{self.max_pending} grammars are compiling; retry later"))
                return f
            f = self._pool.submit(self._compile, spec, key)
            self._pending[key] = f
            return f

    def _xgr_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr
            from tokenizers import Tokenizer

            vocab = Tokenizer.from_file(self.tokenizer_json).get_vocab(with_added_tokens=True)
            encoded = [""] * min(max(vocab.values()) + 1, self.vocab_size)
            for text, i in vocab.items():
                if i < len(encoded):
                    encoded[i] = text
            info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=self.vocab_size,
                                     stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def _compile(self, spec: StructuredOutputsParams, key: tuple[str, str]):
        try:
            with self._init_lock:  # the tokenizer info is built once
                comp = self._xgr_compiler()
            kind, text = key
            try:
                if kind == "json":
                    g = comp.compile_json_schema(text, any_whitespace=False, separators=(",", ":"))
                elif kind == "json_object":
                    g = comp.compile_json_schema('{"type": "object"}', any_whitespace=False, separators=(",", ":"))
                elif kind == "regex":
                    g = comp.compile_regex(text)
                elif kind == "grammar":
                    g = comp.compile_grammar(text)
                elif kind == "structural_tag":
                    g = comp.compile_structural_tag(text)
                else:
                    g = comp.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in json.loads(text)))
            except (RuntimeError, ValueError, TypeError) as e:
                msg = str(e).strip().splitlines()
                detail = msg[-1] if msg else type(e).__name__
                if "] " in detail and detail.startswith("["):  # drop xgrammar's "[time] file:line:" prefix
                    detail = detail.split(": ", 1)[-1]
                field = spec.error_param or f"structured_outputs.{kind}"
                raise GrammarError(field, f"{field}: xgrammar cannot compile it: {detail}") from None
            self._store(key, g)
            return g
        finally:
            with self._lock:
                self._pending.pop(key, None)

    def _store(self, key: tuple[str, str], g) -> None:
        size = int(g.memory_size_bytes)
        with self._lock:
            self.num_compiled += 1
            if size > self.cache_bytes or key in self._cache:
                return
            self._cache[key] = g
            self._cached_bytes += size
            while self._cached_bytes > self.cache_bytes:
                _, old = self._cache.popitem(last=False)
                self._cached_bytes -= int(old.memory_size_bytes)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class RequestMatcher:
    """One request's grammar state: an ``xgrammar.GrammarMatcher`` advanced with each accepted output token.

    With ``after_token_id`` the matcher starts after that token first appears in the output (``active`` False
    before). ``failed`` is set when a token the grammar rejects was accepted (never, when every token was drawn
    under the mask); the runner then reports the request as failed. ``max_rollback_tokens`` (default 0) is how many
    of the last accepted tokens :meth:`rollback` can undo, and the most draft tokens :meth:`fill_draft_masks`
    takes (speculative decoding).
    """

    __slots__ = ("matcher", "after_token_id", "active", "failed", "dead_end", "_history")

    def __init__(self, compiled, after_token_id: int | None = None, output_token_ids=(),
                 max_rollback_tokens: int = 0) -> None:
        import xgrammar as xgr

        if isinstance(max_rollback_tokens, bool) or not isinstance(max_rollback_tokens, int) \
                or max_rollback_tokens < 0:
            raise ValueError(f"max_rollback_tokens must be an int >= 0, got {max_rollback_tokens!r}")
        self.matcher = xgr.GrammarMatcher(compiled)  # xgrammar's rollback is unbounded; ours is not
        self.after_token_id = after_token_id
        self.active = after_token_id is None
        self.failed = False
        self.dead_end = False  # the grammar allowed no next token (it matches no string from here)
        # per accepted token, newest last: (the xgrammar matcher took it, active before, failed before)
        self._history: deque[tuple[bool, bool, bool]] = deque(maxlen=max_rollback_tokens)
        for t in output_token_ids:  # a resumed (preempted) request replays its output
            self.accept(t)

    @property
    def max_rollback_tokens(self) -> int:
        return self._history.maxlen

    @property
    def num_rollback_tokens(self) -> int:
        """How many of the last accepted tokens :meth:`rollback` can undo now."""
        return len(self._history)

    def accept(self, token_id: int) -> bool:
        """Advance by one output token; False (and ``failed``) when the grammar rejects it."""
        was_active, was_failed = self.active, self.failed
        took = False
        if not self.active:
            self.active = token_id == self.after_token_id
        elif not self.failed and not self.matcher.is_terminated():
            took = self.matcher.accept_token(int(token_id))
            self.failed = not took
        if self._history.maxlen:
            self._history.append((took, was_active, was_failed))
        return not self.failed

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` :meth:`accept` calls: the grammar state, ``active`` and ``failed`` are as
        they were before them (``dead_end`` is cleared; the next :meth:`fill` sets it).

        Raises:
            ValueError: ``num_tokens`` is negative or more than :attr:`num_rollback_tokens`.
        """
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not 0 <= num_tokens <= len(
                self._history):
            raise ValueError(f"rollback: num_tokens must be an int in [0, {len(self._history)}] (the tokens "
                             f"accepted within max_rollback_tokens={self._history.maxlen}), got {num_tokens!r}")
        if num_tokens == 0:
            return
        took = 0
        for _ in range(num_tokens):
            t, self.active, self.failed = self._history.pop()
            took += t
        if took:
            self.matcher.rollback(took)
        self.dead_end = False

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (``[rows, ceil(V / 32)]`` int32, bit ``t % 32`` of
        word ``t // 32`` set when token ``t`` is allowed); an inactive matcher allows every token, and so does one
        that took its stop token (its request ends with that token; the step in flight behind it is dropped)."""
        if not self.active or self.failed or self.matcher.is_terminated():
            bitmask[row] = -1
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)
            self.dead_end = not bool(bitmask[row].any())  # the host bitmask: no device read

    def fill_draft_masks(self, bitmask: torch.Tensor, rows, draft_tokens) -> int:
        """Masks of the ``k + 1`` positions a speculative step verifies: the next token, then after each draft.

        Row ``rows[i]`` of ``bitmask`` gets the mask after ``draft_tokens[:i]`` (row 0: :meth:`fill` now), for
        every ``i`` up to the number of drafts the grammar accepts; the rows after the first rejected draft (or
        after one that completes the grammar) are set to all tokens allowed: the verifier rejects that draft under
        its own row, and drops what follows. The matcher is left as it was (the drafts are accepted, then rolled
        back); the caller then passes the tokens the verification keeps to :meth:`accept`. ``dead_end`` is that of
        row 0.

        Args:
            bitmask: ``[R, ceil(V / 32)]`` int32 on the host.
            rows: ``k + 1`` distinct row indices of ``bitmask``.
            draft_tokens: ``k`` token ids, ``k <= max_rollback_tokens``.
        Returns:
            How many leading drafts the grammar accepts (``0 .. k``).
        Raises:
            ValueError: ``len(rows) != len(draft_tokens) + 1``, or more drafts than ``max_rollback_tokens``.
        """
        rows, drafts = [int(r) for r in rows], [int(t) for t in draft_tokens]
        if len(rows) != len(drafts) + 1:
            raise ValueError(f"fill_draft_masks: rows must hold len(draft_tokens) + 1 = {len(drafts) + 1} entries, "
                             f"got {len(rows)}")
        if len(drafts) > self._history.maxlen:
            raise ValueError(f"fill_draft_masks: draft_tokens holds {len(drafts)} tokens, more than "
                             f"max_rollback_tokens={self._history.maxlen}")
        self.fill(bitmask, rows[0])
        dead_end, history = self.dead_end, list(self._history)  # the drafts may push older entries out
        accepted = 0
        filled = 1  # rows written
        for i, t in enumerate(drafts):
            word = int(bitmask[rows[i], t // 32]) if 0 <= t < bitmask.shape[1] * 32 else 0
            if not (word >> (t % 32)) & 1:
                break
            self.accept(t)
            accepted += 1
            if self.active and self.matcher.is_terminated():  # a stop token: the output ends here
                break
            self.fill(bitmask, rows[i + 1])
            filled += 1
        for r in rows[filled:]:
            bitmask[r] = -1
        self.rollback(accepted)
        self.dead_end = dead_end
        self._history.clear()
        self._history.extend(history)
        return accepted


_BIT_CACHE: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Logits with the tokens each constrained row disallows set to ``-inf`` (a new float32 tensor).

    Args:
        logits: ``[n, V]`` float (upcast to float32; not modified).
        rows: ``[m]`` int64, the constrained rows (distinct), on the logits' device.
        bitmask: ``[m, ceil(V / 32)]`` int32 on the logits' device; bit ``t % 32`` of word ``t // 32`` of entry j
            set when token ``t`` is allowed in row ``rows[j]``.
    Elementwise (each element depends on its own logit and bit only), so a row's result does not depend on the
    batch. On the CPU it is xgrammar's kernel (``apply_token_bitmask_inplace``), elsewhere torch ops
    (:func:`_apply_token_bitmask_torch`, tested equal). Raises ValueError for a bitmask narrower than
    ``ceil(V / 32)`` or a row count mismatch.
    """
    out = logits.float().clone()
    m = rows.numel()
    if m == 0:
        return out
    vocab = out.shape[1]
    if bitmask.dim() != 2 or bitmask.shape[0] != m or bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"apply_token_bitmask: bitmask must be [{m}, >= {-(-vocab // 32)}], got "
                         f"{tuple(bitmask.shape)}")
    if out.device.type == "cpu":  # xgrammar's C++ kernel, in place (the same result as below)
        import xgrammar as xgr

        if m == out.shape[0] and rows.tolist() == list(range(m)):  # every row, in order
            xgr.apply_token_bitmask_inplace(out, bitmask.contiguous(), vocab_size=vocab)
            return out
        sub = out.index_select(0, rows)  # xgrammar's indices pick bitmask rows too: ours are compact
        xgr.apply_token_bitmask_inplace(sub, bitmask.contiguous(), vocab_size=vocab)
        return out.index_copy_(0, rows, sub)
    return _apply_token_bitmask_torch(out, rows, bitmask)


def _apply_token_bitmask_torch(out: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """:func:`apply_token_bitmask` in torch ops, in place on the float32 ``out``."""
    vocab = out.shape[1]
    key = (str(out.device), vocab)
    if key not in _BIT_CACHE:
        ids = torch.arange(vocab, device=out.device)
        _BIT_CACHE[key] = (ids // 32, (ids % 32).to(torch.int32))
    word, bit = _BIT_CACHE[key]
    allowed = ((bitmask[:, word] >> bit) & 1).bool()
    out[rows] = torch.where(allowed, out[rows], torch.full_like(out[rows], float("-inf")))
    return out
