"""Requests as the engine tracks them: sampling parameters, tokens, cache blocks, status and timings."""

from __future__ import annotations

import enum
import itertools
import numbers
import reprlib
import secrets
from dataclasses import dataclass, field

SEED_LIMIT = 1 << 63
PENALTY_LIMIT = 2.0  # |frequency_penalty|, |presence_penalty| <= 2 (OpenAI's range)
LOGIT_BIAS_LIMIT = 100.0  # |logit_bias[token]| <= 100 (OpenAI's range)
MAX_STOP_TOKEN_IDS = 1024  # stop_token_ids per request
FLOAT32_MAX = 3.4028234663852886e38  # temperature's bound: the sampler divides float32 logits by it
# the top_logprobs entry of a token whose request asked for none: one shared empty tuple, so that a step stores
# no new container per token (the garbage collector would scan every one; RequestOutput gives lists)
NO_TOP_LOGPROBS: tuple = ()


class SamplingParamError(ValueError):
    """A sampling parameter out of range; ``param`` is the field's name (for the error record's ``param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    Attributes:
        temperature: 0 means greedy (argmax); > 0 divides the logits before the Gumbel-max draw.
        top_k: keep the k most likely tokens (ties: lower token id first); 0 or -1 keeps all.
        top_p: keep the smallest set of most likely tokens whose probability reaches ``top_p`` (1.0 keeps all).
        max_tokens: most output tokens; must be >= 1.
        seed: seed of the counter-based draws, in ``[0, 2**63)``; ``None`` draws one, which the output reports.
        stop_token_ids: token ids that end the output (the id is not appended); the model's EOS is always one
            unless ``ignore_eos``. At most ``MAX_STOP_TOKEN_IDS``, each below the vocabulary size; any iterable
            is read once by :meth:`validate` and kept as a tuple.
        ignore_eos: keep generating past EOS (benchmarks).
        top_logprobs: also report this many most likely tokens and their log-probabilities per step (0..20).
        frequency_penalty / presence_penalty: in [-2, 2]; before temperature and filtering, the logit of every token
            the request has generated so far is lowered by ``presence_penalty + frequency_penalty * count`` (count =
            its number of occurrences in the output; the prompt does not count) -- OpenAI's definition.
        logit_bias: ``{token_id: bias}``, bias in [-100, 100], added to that token's logit after the penalties and
            before temperature (also for greedy requests; -100 in practice bans a token, +100 forces it).
        structured_outputs: a ``deepinfer.structured.StructuredOutputsParams`` (JSON schema, JSON object, regex,
            EBNF grammar or choice list): tokens the constraint forbids are masked out after the penalties and bias
            (incompatible with ``ignore_eos``: a constrained output ends when its grammar is complete).
        Reported log-probabilities stay those of the unmodified model distribution.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    top_logprobs: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    structured_outputs: "StructuredOutputsParams | None" = None

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ``SamplingParamError`` (a ValueError; the field in ``.param``) when a parameter has the wrong type or
        is out of range. ``vocab_size``: when given, ``logit_bias`` ids
        must be below it."""
        def number(v) -> bool:
            return not isinstance(v, bool) and isinstance(v, (int, float))

        def integer(v) -> bool:
            return not isinstance(v, bool) and isinstance(v, int)

        def plain(v):  # NumPy (or other registered) scalars as Python numbers, as prompts take NumPy ints
            if isinstance(v, (bool, int, float)) or not isinstance(v, numbers.Real):
                return v
            return int(v) if isinstance(v, numbers.Integral) else float(v)

        for name in ("temperature", "top_k", "top_p", "max_tokens", "seed", "top_logprobs", "frequency_penalty",
                     "presence_penalty"):
            setattr(self, name, plain(getattr(self, name)))
        if isinstance(self.logit_bias, dict) and any(type(k) is not int or type(b) not in (int, float)
                                                     for k, b in self.logit_bias.items()):
            self.logit_bias = {plain(k): plain(b) for k, b in self.logit_bias.items()}

        if not number(self.temperature) or not (0.0 <= self.temperature <= FLOAT32_MAX):
            raise SamplingParamError("temperature", f"temperature must be a finite number >= 0 (at most float32's "
                                     f"largest, the sampler's dtype), got {self.temperature!r}")
        if not integer(self.top_k) or not -1 <= self.top_k < 2 ** 31:
            raise SamplingParamError("top_k",
                                     f"top_k must be an integer: -1, 0 or positive (< 2**31), got {self.top_k!r}")
        if not number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise SamplingParamError("top_p", f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not integer(self.max_tokens) or self.max_tokens < 1:
            raise SamplingParamError("max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not integer(self.top_logprobs) or not 0 <= self.top_logprobs <= 20:
            raise SamplingParamError("top_logprobs",
                                     f"top_logprobs must be an integer in [0, 20], got {self.top_logprobs!r}")
        if self.seed is not None and (not integer(self.seed) or not 0 <= self.seed < SEED_LIMIT):
            raise SamplingParamError("seed", f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        ids = self.stop_token_ids
        if not isinstance(ids, (str, bytes, dict)) and hasattr(ids, "__iter__"):
            # read once, at most one past the limit (an endless iterable ends here), and kept as read, so that
            # every request sharing these parameters sees the same ids, valid or not
            ids = tuple(plain(t) for t in itertools.islice(ids, MAX_STOP_TOKEN_IDS + 1))
            self.stop_token_ids = ids
        limit = f"[0, {vocab_size})" if vocab_size else ">= 0"
        if not isinstance(ids, tuple) or len(ids) > MAX_STOP_TOKEN_IDS \
                or not all(integer(t) and 0 <= t and (not vocab_size or t < vocab_size) for t in ids):
            raise SamplingParamError("stop_token_ids", f"stop_token_ids must be a sequence of at most "
                                     f"{MAX_STOP_TOKEN_IDS} token ids in {limit}, got {reprlib.repr(ids)}")
        if not isinstance(self.ignore_eos, bool):
            raise SamplingParamError("ignore_eos", f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not number(v) or not -PENALTY_LIMIT <= v <= PENALTY_LIMIT:
                raise SamplingParamError(name, f"{name} must be a number in [-2, 2], got {v!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise SamplingParamError("logit_bias", f"logit_bias must be a dict {{token_id: bias}}, got "
                                                       f"{type(self.logit_bias).__name__}")
            for tok, bias in self.logit_bias.items():
                if not integer(tok) or tok < 0 or (vocab_size and tok >= vocab_size):
                    limit = f"[0, {vocab_size})" if vocab_size else ">= 0"
                    raise SamplingParamError("logit_bias", f"logit_bias keys must be token ids {limit}, got {tok!r}")
                if not number(bias) or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                    raise SamplingParamError("logit_bias", f"logit_bias[{tok}] must be a number in [-100, 100], "
                                                           f"got {bias!r}")

        if self.structured_outputs is not None:
            from deepinfer.structured import StructuredOutputsParams

            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise SamplingParamError("structured_outputs", "structured_outputs must be a "
                                         f"StructuredOutputsParams, got {type(self.structured_outputs).__name__}")
            self.structured_outputs.validate()
            if self.ignore_eos:
                raise SamplingParamError("ignore_eos", "ignore_eos cannot be combined with structured_outputs (a "
                                         "constrained output ends when its grammar is complete)")

    @property
    def adjusts_logits(self) -> bool:
        """True when penalties or a logit bias change this request's logits before sampling."""
        return bool(self.frequency_penalty or self.presence_penalty or self.logit_bias)


def draw_seed() -> int:
    """A fresh seed in ``[0, 2**63)`` from the OS entropy source."""
    return secrets.randbits(63)


@dataclass(frozen=True)
class RequestFailure:
    """Why a request failed, as the scheduler reports it: ``kind`` (a short code such as ``"cache_exhausted"``,
    ``"nan_logits"``) and a message for people. The output processor turns it into the error record the API layer
    returns (``deepinfer.engine.error_record``)."""

    kind: str
    message: str
    param: str | None = None  # the request field at fault, when there is one


def interrupted_error() -> dict:
    """The error record of a request that a Ctrl-C / SIGTERM stopped before it finished (during loading or a run):
    ``{"type": "server_error", "code": "interrupted", "message", "param": None, "status_code": 500}``."""
    return {"type": "server_error", "code": "interrupted", "message": "the run was interrupted before this request "
            "finished", "param": None, "status_code": 500}


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One request inside the engine.

    ``num_computed_tokens`` counts the context positions whose cache entries exist; ``block_tables[group]`` holds
    the block ids of each cache group covering them (block j covers positions ``[j * block_size, (j + 1) *
    block_size)``; ``-1`` for a block a sliding-window group released, see ``deepinfer.block_manager``).
    Preemption by recompute frees the blocks and resets ``num_computed_tokens`` to 0; the output tokens are kept
    and are recomputed as part of the context.

    Prefix caching (``deepinfer.block_manager``, ``docs/prefix-cache.md``): ``num_cached_tokens`` prompt tokens were
    served from the cache at the first admission (usage); ``prefix_shared_tokens`` positions of the kept group are
    shared blocks the request never writes and ``window_floor`` the first position of its sliding-window tables (the
    current admission); ``block_hashes`` are the chain hashes of its full blocks so far.
    """

    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_token_id: int | None = None  # the EOS / stop id that ended it (not appended)
    failure: RequestFailure | None = None  # set by the scheduler when the request failed (finish_reason "error")
    error: dict | None = None  # the error record the API returns, built from ``failure`` by the engine
    grammar: object | None = None  # the compiled ``structured_outputs`` (an ``xgrammar.CompiledGrammar``)
    num_preemptions: int = 0
    # tokens sampled by scheduled steps whose results are not applied yet (0 or 1; 2 while an asynchronous step
    # runs behind one in flight): positions [num_tokens, num_tokens + num_pending) are in the model's hands
    num_pending: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0
    prefix_shared_tokens: int = 0
    prefix_branch: int = 0  # the shared length when its hit replayed the exact bound (a window snapshot there)
    window_floor: int = 0
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    num_registered_blocks: int = 0  # full blocks already given their chain hash (block manager bookkeeping)
    # (number of output tokens counted, {token_id: count}) for the penalties; kept up to date by the sampler
    _output_counts: tuple[int, dict[int, int]] | None = field(default=None, repr=False, compare=False)

    @property
    def block_table(self) -> list[int]:
        """The table of the first cache group (``"full"``: the only one of a single-group model); read-only."""
        return next(iter(self.block_tables.values()), [])

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Context positions not yet scheduled (pending tokens included: their ids come from the device)."""
        return self.num_tokens + self.num_pending - self.num_computed_tokens

    def token_at(self, start: int, end: int) -> list[int]:
        """Context tokens at positions ``[start, end)`` (prompt then output)."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    def output_token_counts(self) -> dict[int, int]:
        """``{token_id: occurrences}`` over ``output_token_ids`` (updated incrementally: O(new tokens) per call)."""
        done, counts = self._output_counts or (0, {})
        if done > len(self.output_token_ids):  # outputs were reset: count again
            done, counts = 0, {}
        for t in self.output_token_ids[done:]:
            counts[t] = counts.get(t, 0) + 1
        self._output_counts = (len(self.output_token_ids), counts)
        return counts

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
