"""Top-level field checks of the request bodies (Chat Completions, Messages, Responses, Completions), before
deepseek-recipe sees them.

Each API has a table of the fields the engine handles: JSON type, range, and the one value the engine implements
when it implements only one (``stream: false`` offline, ``store: false``, ``echo: false``). Fields the engine does
not implement and that would change the answer (``previous_response_id``, ``guided_json``, ...) are refused with the
reason; fields in neither table are refused as unknown, as OpenAI's and Anthropic's APIs do. Every error is a
``RequestError`` whose ``param`` is the field path in OpenAI's form (``max_tokens``, ``tools[1].type``,
``tool_choice.function.name``). The offline CLI and the HTTP server share these tables; the server allows
``stream: true`` (``check_request(..., stream=True)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

API_KINDS = ("chat", "messages", "responses")  # the chat-template APIs (``ChatFrontend.prepare``)
INT63 = 2 ** 63
INT31 = 2 ** 31
#: deepseek-recipe's max_tokens limit (``ConversionOptions.thinking_max_tokens_upper_bound`` and the non-thinking one)
MAX_OUTPUT_TOKENS = 393216
MAX_STOP_SEQUENCES = 16
MAX_NESTING = 64  # deeper bodies are refused before the recipe walks them


class RequestError(Exception):
    """A request that cannot run; ``record`` is the OpenAI-style error object (``param``: the field path)."""

    def __init__(self, message: str, code: str = "invalid_request_error", status_code: int = 400,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.record = {"message": message, "type": "invalid_request_error", "param": param, "code": code,
                       "status_code": status_code}


def is_error_record(result: dict) -> bool:
    """True for ``{"error": {...}}`` (an engine error record), False for a response object (a Responses object
    carries its own ``"error": null`` field)."""
    return isinstance(result, dict) and set(result) == {"error"}


@dataclass(frozen=True)
class Field:
    """One top-level field: its JSON kinds (``int``, ``number``, ``bool``, ``string``, ``object``, ``array``), the
    closed range of a number, and, when set, the only value the engine implements (others refused, with the
    reason)."""

    kinds: tuple[str, ...]
    lo: float | None = None
    hi: float | None = None
    only: Any = None
    why: str = ""
    among: tuple | None = None  # a string field's allowed values


def _f(*kinds: str, lo=None, hi=None, only=None, why: str = "", among: tuple | None = None) -> Field:
    return Field(kinds, lo, hi, only, why, among)


_OFFLINE = "offline generation answers each request in one response (deepinfer serve streams)"
_NO_STORE = "this engine stores no responses"
_COMMON = {
    "model": _f("string"),
    "stream": _f("bool", only=False, why=_OFFLINE),
    "metadata": _f("object"),
    "seed": _f("int", lo=0, hi=INT63 - 1),
    "service_tier": _f("string"),
    "user": _f("string"),
}
CHAT_FIELDS = {
    **_COMMON,
    "messages": _f("array"),
    "max_tokens": _f("int", lo=1, hi=MAX_OUTPUT_TOKENS),
    "max_completion_tokens": _f("int", lo=1, hi=MAX_OUTPUT_TOKENS),
    "temperature": _f("number", lo=0, hi=2),
    "top_p": _f("number", lo=0, hi=1),
    "top_k": _f("int", lo=-1, hi=INT31 - 1),
    "n": _f("int", lo=1, hi=1),
    "stop": _f("string", "array"),
    "stream_options": _f("object"),
    "logprobs": _f("bool"),
    "top_logprobs": _f("int", lo=0, hi=20),
    "frequency_penalty": _f("number", lo=-2, hi=2),
    "presence_penalty": _f("number", lo=-2, hi=2),
    "logit_bias": _f("object"),
    "tools": _f("array"),
    "tool_choice": _f("string", "object"),
    "parallel_tool_calls": _f("bool"),
    "response_format": _f("object"),
    "structured_outputs": _f("object"),  # vLLM's extension: {json | regex | grammar | choice | json_object}
    "thinking": _f("object"),
    "reasoning_effort": _f("string"),
    "store": _f("bool", only=False, why=_NO_STORE),
    "prompt_cache_key": _f("string"),
    "safety_identifier": _f("string"),
}
MESSAGES_FIELDS = {
    **_COMMON,
    "messages": _f("array"),
    "max_tokens": _f("int", lo=1, hi=MAX_OUTPUT_TOKENS),
    "system": _f("string", "array"),
    "temperature": _f("number", lo=0, hi=1),
    "top_p": _f("number", lo=0, hi=1),
    "top_k": _f("int", lo=0, hi=INT31 - 1),
    "stop_sequences": _f("array"),
    "tools": _f("array"),
    "tool_choice": _f("object"),
    "thinking": _f("object"),
}
RESPONSES_FIELDS = {
    **_COMMON,
    "input": _f("string", "array"),
    "instructions": _f("string"),
    "max_output_tokens": _f("int", lo=1, hi=MAX_OUTPUT_TOKENS),
    "temperature": _f("number", lo=0, hi=2),
    "top_p": _f("number", lo=0, hi=1),
    "top_logprobs": _f("int", lo=0, hi=20),
    "tools": _f("array"),
    "tool_choice": _f("string", "object"),
    "parallel_tool_calls": _f("bool"),
    "text": _f("object"),
    "reasoning": _f("object"),
    "store": _f("bool", only=False, why=_NO_STORE),
    "background": _f("bool", only=False, why="background responses need stored responses"),
    "truncation": _f("string", among=("auto", "disabled")),
    "prompt_cache_key": _f("string"),
    "safety_identifier": _f("string"),
}
COMPLETIONS_FIELDS = {  # /v1/completions (the server's; no chat template)
    "model": _f("string"),
    "stream": _COMMON["stream"],
    "seed": _COMMON["seed"],
    "user": _f("string"),
    "prompt": _f("string", "array"),
    "max_tokens": _f("int", lo=1, hi=MAX_OUTPUT_TOKENS),
    "temperature": _f("number", lo=0, hi=2),
    "top_p": _f("number", lo=0, hi=1),
    "top_k": _f("int", lo=-1, hi=INT31 - 1),
    "n": _f("int", lo=1, hi=1),
    "best_of": _f("int", lo=1, hi=20, only=1, why="one completion per request"),
    "stop": _f("string", "array"),
    "stream_options": _f("object"),
    "frequency_penalty": _f("number", lo=-2, hi=2),
    "presence_penalty": _f("number", lo=-2, hi=2),
    "logit_bias": _f("object"),
    "logprobs": _f("int", lo=0, hi=5, only=0, why="use /v1/chat/completions for logprobs"),
    "echo": _f("bool", only=False, why="the prompt is not echoed"),
    "suffix": _f("string", only="", why="insertion (a suffix) is not supported"),
    "ignore_eos": _f("bool"),  # vLLM's extension: generate max_tokens tokens (benchmarks)
}
FIELDS = {"chat": CHAT_FIELDS, "messages": MESSAGES_FIELDS, "responses": RESPONSES_FIELDS,
          "completions": COMPLETIONS_FIELDS}
REQUIRED = {"chat": ("messages",), "messages": ("messages", "max_tokens"), "responses": ("input",),
            "completions": ("prompt",)}

_GUIDED = "use structured_outputs {json, regex, grammar, choice} (vLLM's current spelling)"
# Fields other engines or API versions implement and this engine does not: refused, never ignored.
UNSUPPORTED = {
    "guided_json": _GUIDED, "guided_regex": _GUIDED, "guided_choice": _GUIDED, "guided_grammar": _GUIDED,
    "guided_decoding_backend": _GUIDED,
    "functions": "the legacy functions API is not supported; use tools", "function_call": "use tool_choice",
    "audio": "these models are text-only", "modalities": "these models are text-only",
    "prediction": "predicted outputs are not supported", "web_search_options": "web search is not supported",
    "previous_response_id": _NO_STORE, "conversation": _NO_STORE, "prompt": "stored prompts are not supported",
    "include": "extra output items are not supported", "max_tool_calls": "tool-call limits are not enforced",
    "mcp_servers": "MCP servers are not supported", "container": "code execution is not supported",
    "context_management": "context management is not supported",
}
# Tool types each API may declare (the recipe drops Responses' web_search / mcp tools silently).
TOOL_TYPES = {"chat": ("function",), "responses": ("function", "namespace")}

_KIND_NAMES = {"int": "an integer", "number": "a number", "bool": "a boolean", "string": "a string",
               "object": "an object", "array": "an array"}


_JSON_KINDS = ((bool, "bool"), (int, "int"), (float, "number"), (str, "string"), (dict, "object"), (list, "array"))


def _kind(v: Any) -> str:
    return next((name for t, name in _JSON_KINDS if isinstance(v, t)), type(v).__name__)  # bool before int


def brief(v: Any) -> str:
    """``repr(v)`` cut to 80 characters: what an error message may echo of a request's value or field name."""
    return repr(v)[:80]


def _check_field(name: str, spec: Field, v: Any) -> None:
    kind = _kind(v)
    ok = kind in spec.kinds or (kind == "int" and "number" in spec.kinds)
    if not ok:
        want = " or ".join(_KIND_NAMES[k] for k in spec.kinds)
        raise RequestError(f"{name} must be {want}, got {_KIND_NAMES.get(kind, kind)} {brief(v)}", param=name)
    if kind == "number" and not math.isfinite(v):
        raise RequestError(f"{name} must be a finite number, got {v}", param=name)
    if kind in ("int", "number") and (spec.lo is not None or spec.hi is not None):
        if (spec.lo is not None and v < spec.lo) or (spec.hi is not None and v > spec.hi):
            hi = {INT63 - 1: "2**63 - 1", INT31 - 1: "2**31 - 1"}.get(spec.hi, spec.hi)
            rng = f"[{spec.lo}, {hi}]" if spec.hi is not None else f">= {spec.lo}"
            if spec.hi == MAX_OUTPUT_TOKENS:
                rng += " (deepseek-recipe's limit; the prompt and the answer must also fit the model's context)"
            raise RequestError(f"{name} must be {'in ' if rng[0] == '[' else ''}{rng}, got {brief(v)}", param=name)
    if spec.among is not None and kind == "string" and v not in spec.among:
        raise RequestError(f"{name} must be one of {', '.join(map(repr, spec.among))}, got {brief(v)}", param=name)
    if spec.only is not None and v != spec.only:
        raise RequestError(f"{name}: {json_text(v)} is not supported: {spec.why}",
                           code="unsupported_parameter", param=name)


def json_text(v: Any) -> str:
    return "true" if v is True else "false" if v is False else brief(v)


def _walk_values(body: dict) -> None:
    """Refuse nesting deeper than ``MAX_NESTING``, strings with lone surrogates (not encodable as UTF-8), integers
    beyond 64 bits and non-finite numbers anywhere, naming the path. Iterative, so a deep body cannot exhaust the stack."""
    stack: list[tuple[Any, str, int]] = [(v, k, 1) for k, v in body.items()]
    while stack:
        node, path, depth = stack.pop()
        if depth > MAX_NESTING:
            raise RequestError(f"{path}: nested deeper than {MAX_NESTING} levels", param=path.split(".")[0])
        if isinstance(node, int) and not isinstance(node, bool) and not -INT63 <= node < 2 * INT63:
            raise RequestError(f"{path}: integer {brief(node)} is outside the JSON number range (64 bits)",
                               param=path)
        if isinstance(node, float) and not math.isfinite(node):
            raise RequestError(f"{path}: {node} is not a finite JSON number", param=path)
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError as e:
                raise RequestError(f"{path}: lone surrogate {node[e.start]!r} at character {e.start} (a string "
                                   "must be valid Unicode)", param=path) from None
        elif isinstance(node, dict):
            for k, v in node.items():
                if isinstance(k, str):
                    try:
                        k.encode("utf-8")
                    except UnicodeEncodeError:
                        raise RequestError(f"{path}: an object key holds a lone surrogate", param=path) from None
                stack.append((v, f"{path}.{k}", depth + 1))
        elif isinstance(node, list):
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(node))


# ---- nested fields ------------------------------------------------------------------------------------------
# The recipe reports a bad nested value as serde text naming only the top-level field (``invalid type: integer `5`,
# expected a string`` for ``messages``); these tables name the path. Objects with a table are closed: an unknown key
# is refused, as OpenAI's and Anthropic's APIs do. Deeper parts (content-part kinds, schemas) stay the recipe's.
CHAT_MESSAGE = {  # OpenAI's message keys and DeepSeek's (reasoning_content, prefix); latest_reminder is the recipe's
    "role": _f("string", among=("system", "developer", "user", "assistant", "tool", "latest_reminder")),
    "content": _f("string", "array"), "name": _f("string"), "tool_calls": _f("array"),
    "tool_call_id": _f("string"), "reasoning_content": _f("string"), "prefix": _f("bool"),
}
MESSAGES_MESSAGE = {"role": _f("string", among=("user", "assistant")), "content": _f("string", "array")}
CHAT_TOOL_CALL = {"id": _f("string"), "type": _f("string", among=("function",)), "function": _f("object"),
                  "index": _f("int", lo=0, hi=INT31 - 1)}
CHAT_TOOL_CALL_FUNCTION = {"name": _f("string"), "arguments": _f("string")}
CHAT_TOOL = {"type": _f("string"), "function": _f("object")}
CHAT_FUNCTION = {"name": _f("string"), "description": _f("string"), "parameters": _f("object"), "strict": _f("bool")}
CHAT_TOOL_CHOICE = {"type": _f("string", among=("function",)), "function": _f("object")}
MESSAGES_TOOL_CHOICE = {"type": _f("string", among=("auto", "any", "tool", "none")), "name": _f("string"),
                        "disable_parallel_tool_use": _f("bool")}
MIN_THINKING_BUDGET = 1024  # Anthropic's minimum budget_tokens; it must also stay below max_tokens
THINKING = {"type": _f("string", among=("enabled", "disabled", "adaptive")),
            "budget_tokens": _f("int", lo=MIN_THINKING_BUDGET)}
TOOL_CHOICE_STRINGS = ("none", "auto", "required")


def _check_object(v: Any, path: str, table: dict[str, Field], required: tuple[str, ...] = ()) -> dict:
    """``v`` is an object whose keys are in ``table`` (each value checked like a top-level field; null passes) and
    whose ``required`` keys are set. Returns it."""
    if not isinstance(v, dict):
        raise RequestError(f"{path} must be an object, got {_KIND_NAMES.get(_kind(v), _kind(v))} {brief(v)}",
                           param=path)
    for k, x in v.items():
        spec = table.get(k)
        if spec is None:
            raise RequestError(f"{path}: unrecognized field {brief(k)} (known: {', '.join(table)})",
                               code="unknown_parameter", param=f"{path}.{k[:80]}")
        if x is not None:
            _check_field(f"{path}.{k}", spec, x)
    for k in required:
        if v.get(k) is None:
            raise RequestError(f"{path}.{k} is required", param=f"{path}.{k}")
    return v


def _check_parts(content: Any, path: str) -> None:
    """A content array: objects with a string ``type``; a text part's ``text`` is a string."""
    if not isinstance(content, list):
        return
    for j, part in enumerate(content):
        where = f"{path}[{j}]"
        if not isinstance(part, dict):
            raise RequestError(f"{where} must be a content part (an object), got {brief(part)}", param=where)
        if not isinstance(part.get("type"), str):
            raise RequestError(f"{where}.type must be a string, got {brief(part.get('type'))}", param=f"{where}.type")
        if part["type"] in ("text", "input_text", "output_text") and not isinstance(part.get("text"), str):
            raise RequestError(f"{where}.text must be a string, got {brief(part.get('text'))}", param=f"{where}.text")


def _check_messages(body: dict, api: str) -> None:
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        return
    table = CHAT_MESSAGE if api == "chat" else MESSAGES_MESSAGE
    for i, m in enumerate(msgs):
        path = f"messages[{i}]"
        if api == "messages" and isinstance(m, dict) and m.get("role") == "system":
            raise RequestError(f"{path}.role: 'system' is not a Messages role (user or assistant); the system "
                               "prompt goes in the top-level system field", param=f"{path}.role")
        _check_object(m, path, table, ("role",))
        if m.get("content") is None and not (m["role"] == "assistant" and m.get("tool_calls")):
            raise RequestError(f"{path}.content is required", param=f"{path}.content")
        _check_parts(m.get("content"), f"{path}.content")
        for j, call in enumerate(m.get("tool_calls") or []):
            cpath = f"{path}.tool_calls[{j}]"
            _check_object(call, cpath, CHAT_TOOL_CALL, ("function",))
            _check_object(call["function"], f"{cpath}.function", CHAT_TOOL_CALL_FUNCTION, ("name",))


def _check_tool_list(body: dict, api: str) -> None:
    for i, t in enumerate(body.get("tools") or []):
        path = f"tools[{i}]"
        if not isinstance(t, dict):
            raise RequestError(f"{path} must be a tool (an object), got {brief(t)}", param=path)
        if api == "chat":
            _check_object(t, path, CHAT_TOOL, ("type",))
            if t["type"] == "function":
                _check_object(t.get("function"), f"{path}.function", CHAT_FUNCTION, ("name",))
        elif api == "messages" or t.get("type") == "function":  # Messages: a custom tool; server tools carry a type
            if t.get("type") is None or t.get("type") in ("custom", "function"):
                if not isinstance(t.get("name"), str):
                    raise RequestError(f"{path}.name must be a string, got {brief(t.get('name'))}",
                                       param=f"{path}.name")


def dsml_key_problem(key: str) -> str | None:
    """Why a tool's argument name cannot be written in DeepSeek's DSML call syntax (``<｜DSML｜parameter
    name="KEY" ...>``), or None: deepseek-recipe's parser reads no call whose name holds a ``"`` or a character
    up to U+0020 (the space and the ASCII controls below it), so such an argument could never be passed."""
    bad = next((c for c in key if c == '"' or ord(c) <= 0x20), None)
    return None if bad is None else f"it holds {bad!r}"


def _check_argument_names(body: dict, api: str) -> None:
    """Each function tool's ``properties`` names can be written as DSML parameter names (``dsml_key_problem``);
    skipped with ``tool_choice`` none (the recipe then renders no tools)."""
    choice = body.get("tool_choice")
    if choice == "none" or (isinstance(choice, dict) and choice.get("type") == "none" and api == "messages"):
        return
    for i, t in enumerate(body.get("tools") or []):
        if not isinstance(t, dict) or (api == "responses" and t.get("type") != "function"):
            continue
        where, schema = ((f"tools[{i}].function.parameters", (t.get("function") or {}).get("parameters"))
                         if api == "chat" else (f"tools[{i}].input_schema", t.get("input_schema"))
                         if api == "messages" else (f"tools[{i}].parameters", t.get("parameters")))
        props = schema.get("properties") if isinstance(schema, dict) else None
        for key in props if isinstance(props, dict) else ():
            why = dsml_key_problem(key)
            if why:
                raise RequestError(f"{where}.properties: the argument name {key!r} cannot be written in DeepSeek's "
                                   f"DSML tool-call syntax ({why}), so the model could never pass it",
                                   code="unsupported_parameter", param=f"{where}.properties")


def tool_choice_requires_call(body: dict, api: str) -> bool:
    """The body's ``tool_choice`` asks for a call (Chat / Responses ``"required"`` or a named function; Messages
    ``any`` or ``tool``)."""
    choice = body.get("tool_choice")
    if api == "messages":
        return isinstance(choice, dict) and choice.get("type") in ("any", "tool")
    return api in ("chat", "responses") and (choice == "required" or isinstance(choice, dict))


def required_tool_name(body: dict, api: str) -> str | None:
    """The tool a named ``tool_choice`` asks for (Chat ``function.name``, Messages / Responses ``name``), or None."""
    choice = body.get("tool_choice")
    if not isinstance(choice, dict) or not tool_choice_requires_call(body, api):
        return None
    name = (choice.get("function") or {}).get("name") if api == "chat" else choice.get("name")
    return name if isinstance(name, str) else None


def _check_tool_choice(body: dict, api: str) -> None:
    choice = body.get("tool_choice")
    if choice is None:
        return
    if isinstance(choice, str) and choice not in TOOL_CHOICE_STRINGS:
        raise RequestError(f"tool_choice must be one of {', '.join(map(repr, TOOL_CHOICE_STRINGS))} or an object, "
                           f"got {brief(choice)}", param="tool_choice")
    if api == "chat" and isinstance(choice, dict):
        _check_object(choice, "tool_choice", CHAT_TOOL_CHOICE, ("type", "function"))
        _check_object(choice["function"], "tool_choice.function", {"name": _f("string")}, ("name",))
    elif api == "messages":
        _check_object(choice, "tool_choice", MESSAGES_TOOL_CHOICE, ("type",))
        if choice["type"] == "tool" and not isinstance(choice.get("name"), str):
            raise RequestError("tool_choice.name is required (a string) with type 'tool'", param="tool_choice.name")
    elif api == "responses" and isinstance(choice, dict) and choice.get("type") == "function" \
            and not isinstance(choice.get("name"), str):
        raise RequestError(f"tool_choice.name must be a string, got {brief(choice.get('name'))}",
                           param="tool_choice.name")
    if tool_choice_requires_call(body, api) and not body.get("tools"):
        raise RequestError(f"tool_choice {json_text(choice)} asks for a tool call, but the body declares no tools",
                           param="tool_choice")


def _check_thinking(body: dict, api: str) -> None:
    th = body.get("thinking")
    if th is None or api == "responses":
        return
    _check_object(th, "thinking", THINKING, ("type",))
    budget, max_tokens = th.get("budget_tokens"), body.get("max_tokens", body.get("max_completion_tokens"))
    if th["type"] == "enabled" and isinstance(budget, int) and isinstance(max_tokens, int) and budget >= max_tokens:
        raise RequestError(f"thinking.budget_tokens ({budget}) must be less than max_tokens ({max_tokens}), as in "
                           f"Anthropic's API (budget_tokens >= {MIN_THINKING_BUDGET} and < max_tokens)",
                           param="thinking.budget_tokens")


# Responses input items the engine renders (an item without a type is a message); deepseek-recipe drops the
# others without a word, which would change the prompt (an ``item_reference`` to a stored item, a ``bogus`` one).
RESPONSES_INPUT_ITEMS = ("message", "function_call", "function_call_output", "reasoning", "custom_tool_call",
                         "custom_tool_call_output")


def _check_input_items(body: dict) -> None:
    items = body.get("input")
    for i, item in enumerate(items if isinstance(items, list) else ()):
        ty = item.get("type") if isinstance(item, dict) else None
        if ty is None:
            continue
        path = f"input[{i}].type"
        if not isinstance(ty, str):
            raise RequestError(f"{path} must be a string, got {brief(ty)}", param=path)
        if ty not in RESPONSES_INPUT_ITEMS:
            why = _NO_STORE if ty == "item_reference" else "this engine renders only " + ", ".join(
                RESPONSES_INPUT_ITEMS)
            raise RequestError(f"{path}: {ty!r} input items are not supported ({why})",
                               code="unsupported_parameter", param=path)


def _check_nested(body: dict, api: str) -> None:
    """The nested fields of the tables above, naming the path."""
    if api in ("chat", "messages"):
        _check_messages(body, api)
        _check_thinking(body, api)
    if api == "responses":
        _check_input_items(body)
    if api in API_KINDS:
        _check_tool_list(body, api)
        _check_tool_choice(body, api)
        _check_argument_names(body, api)


def declared_tool_names(body: dict, api: str) -> frozenset[str] | None:
    """Names of the function tools a body declares; None when a Responses namespace tool makes names compound."""
    tools = body.get("tools")
    if not isinstance(tools, list):
        return frozenset()
    names = set()
    for t in tools:
        if not isinstance(t, dict):
            continue
        if api == "responses" and t.get("type") == "namespace":
            return None
        fn = t.get("function") if api == "chat" else t
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names.add(fn["name"])
    return frozenset(names)


def _check_tools(body: dict, api: str) -> None:
    tools = body.get("tools")
    allowed = TOOL_TYPES.get(api)
    if isinstance(tools, list) and allowed:
        for i, t in enumerate(tools):
            ty = t.get("type") if isinstance(t, dict) else None
            if isinstance(ty, str) and ty not in allowed:
                raise RequestError(f"tools[{i}].type: {ty!r} tools are not supported by this engine (only "
                                   f"{', '.join(allowed)})", code="unsupported_parameter", param=f"tools[{i}].type")
    choice = body.get("tool_choice")
    if not isinstance(choice, dict):
        return
    if api == "chat":
        fn = choice.get("function")
        name, path = (fn.get("name"), "tool_choice.function.name") if isinstance(fn, dict) else (None, "")
    else:
        name, path = choice.get("name"), "tool_choice.name"
    names = declared_tool_names(body, api)
    if isinstance(name, str) and names is not None:
        if name not in names:
            raise RequestError(f"{path}: {name!r} is not one of the declared tools "
                               f"({', '.join(sorted(names)) or 'none'})", param=path)


def check_request(body: dict, api: str, stream: bool = False) -> None:
    """Check the top-level fields of one request body of ``api`` (``"chat"``, ``"messages"``, ``"responses"``,
    ``"completions"``). ``stream``: the caller streams the answer (the server), so ``stream: true`` is allowed.

    Null fields pass (the recipe applies its defaults), except required ones (``max_tokens`` for Messages).
    Raises:
        RequestError: ``param`` is the field path: a field of the wrong JSON type, a number out of range or not
            finite, an unknown field (``code="unknown_parameter"``), a field or value the engine does not implement
            (``code="unsupported_parameter"``), a missing required field, more than ``MAX_STOP_SEQUENCES`` stop
            strings or an empty one, a string with a lone surrogate, an integer beyond 64 bits or a non-finite
            number at any depth, nesting deeper than ``MAX_NESTING``, a tool type other than a function, a
            ``tool_choice`` naming an undeclared tool, or a Responses input item of a type the engine does not
            render (``item_reference``, ``web_search_call``, ...; ``RESPONSES_INPUT_ITEMS``), or a function
            tool's argument name the DSML call syntax cannot carry (``dsml_key_problem``).
        ValueError: an unknown ``api``.
    """
    if api not in FIELDS:
        raise ValueError(f"api must be one of {tuple(FIELDS)}, got {api!r}")
    table = {**FIELDS[api], "stream": _f("bool")} if stream else FIELDS[api]
    for name, v in body.items():
        if not isinstance(name, str):
            raise RequestError(f"field names must be strings, got {brief(name)}")
        spec = table.get(name)
        if spec is None and name in UNSUPPORTED:  # Completions' prompt is a field; elsewhere a stored prompt
            if v is None:
                continue
            raise RequestError(f"{name} is not supported: {UNSUPPORTED[name]}", code="unsupported_parameter",
                               param=name)
        if spec is None:
            raise RequestError(f"unrecognized request field {brief(name)} for the {api} API",
                               code="unknown_parameter", param=name[:80])
        if v is not None:
            _check_field(name, spec, v)
    for name in REQUIRED[api]:
        if body.get(name) is None:
            raise RequestError(f"{name} is required", param=name)
    key = "stop_sequences" if api == "messages" else "stop"
    stops = body.get(key)
    if stops == "":
        raise RequestError(f"{key} must be a non-empty string", param=key)
    if isinstance(stops, list):
        if len(stops) > MAX_STOP_SEQUENCES:
            raise RequestError(f"{key}: at most {MAX_STOP_SEQUENCES} stop strings, got {len(stops)}", param=key)
        for i, s in enumerate(stops):
            if not isinstance(s, str) or not s:
                raise RequestError(f"{key}[{i}] must be a non-empty string, got {brief(s)}", param=f"{key}[{i}]")
    _walk_values(body)
    _check_nested(body, api)
    _check_tools(body, api)
