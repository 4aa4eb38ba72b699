"""The tool-call grammar: an xgrammar structural tag for DeepSeek's DSML tool-call syntax.

The syntax is the one deepseek-recipe's encoders render for an assistant turn's calls (``DeepseekV4Encoding``;
``DeepseekV41Encoding`` spells the tags ``<｜DSML｜ calls>``, ``<｜DSML｜ invoke``, ``<｜DSML｜ parameter``)::

    \\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true">raw text</｜DSML｜parameter>
    <｜DSML｜parameter name="KEY" string="false">JSON</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

The recipe's parser recognises the markup by the ``｜DSML｜`` token, not by its text, so the grammar matches that
token with xgrammar's ``TokenFormat`` and every free-text or string span excludes the text ``｜DSML｜``: a model
cannot spell the markup from other tokens (a random one does) nor leave stray markup in ``content``. Arguments are
built per parameter from the tool's JSON schema (xgrammar's own ``deepseek_xml`` style emits the markers as text,
which the parser would not read). See ``docs/engine.md``, "Structured output".
"""

from __future__ import annotations

import json
from typing import Any

DSML_TOKEN = "｜DSML｜"
TOOL_CHOICE_MODES = ("auto", "required", "none")
MAX_TOOL_WHITESPACE = 2  # most whitespace characters in a row inside a JSON argument value
# (calls tag, invoke tag, parameter tag) per model version
_TAGS = {"v4": ("tool_calls", "invoke", "parameter"), "v4.1": (" calls", " invoke", " parameter")}
_STRING_CONSTRAINTS = ("pattern", "format", "minLength", "maxLength")
_REF_PREFIXES = ("#/$defs/", "#/definitions/")


def _st():
    from xgrammar import structural_tag

    return structural_tag


def _literal(text: str) -> list:
    """``text`` as formats: constant strings around ``TokenFormat`` for each ``｜DSML｜``."""
    st = _st()
    parts: list = []
    for i, piece in enumerate(text.split(DSML_TOKEN)):
        if i:
            parts.append(st.TokenFormat(token=DSML_TOKEN))
        if piece:
            parts.append(st.ConstStringFormat(value=piece))
    return parts


def _seq(*items) -> Any:
    st = _st()
    elements = [e for item in items for e in (item if isinstance(item, list) else [item])]
    return elements[0] if len(elements) == 1 else st.SequenceFormat(elements=elements)


def _resolve(schema: Any, root: dict) -> Any:
    """A property schema with a local ``$ref`` (``#/$defs/X``, ``#/definitions/X``) followed, once."""
    ref = schema.get("$ref") if isinstance(schema, dict) else None
    if isinstance(ref, str):
        for prefix in _REF_PREFIXES:
            defs = root.get(prefix[2:-1])
            if ref.startswith(prefix) and isinstance(defs, dict) and isinstance(defs.get(ref[len(prefix):]), dict):
                return defs[ref[len(prefix):]]
    return schema


def _value(schema: Any, root: dict) -> tuple[bool, Any]:
    """``(raw, format)`` of one parameter value: a plain string (or a string enum / const) is raw text
    (``string="true"``); any other value is JSON valid against ``schema`` (``string="false"``), with the root's
    ``$defs`` / ``definitions`` so references resolve."""
    st = _st()
    s = _resolve(schema, root)
    if isinstance(s, dict) and s.get("type") == "string" and not any(k in s for k in _STRING_CONSTRAINTS):
        options = s.get("enum", [s["const"]] if "const" in s else None)
        if options is None:
            return True, st.AnyTextFormat(excludes=[DSML_TOKEN])
        if options and all(isinstance(o, str) and DSML_TOKEN not in o for o in options):
            consts = [st.ConstStringFormat(value=o) for o in options]
            return True, consts[0] if len(consts) == 1 else st.OrFormat(elements=consts)
    if isinstance(schema, dict):
        schema = {**{k: root[k] for k in ("$defs", "definitions") if isinstance(root.get(k), dict)}, **schema}
    else:
        schema = schema if isinstance(schema, bool) else True
    # xgrammar drops length bounds from the strings it filters: keep them exact rather than filtered
    text = json.dumps(schema)
    excludes = [] if '"minLength"' in text or '"maxLength"' in text else [DSML_TOKEN]
    return False, st.JSONSchemaFormat(json_schema=schema, max_whitespace_cnt=MAX_TOOL_WHITESPACE, excludes=excludes)


def _parameter(tag: str, name: Any, raw: bool, value) -> Any:
    """One ``<｜DSML｜parameter name="KEY" string="...">VALUE</｜DSML｜parameter>\\n`` line; ``name`` a string or a
    format (any key)."""
    st = _st()
    flag = "true" if raw else "false"
    if isinstance(name, str):
        head = _literal(f'<{DSML_TOKEN}{tag} name="{name}" string="{flag}">')
    else:
        head = [*_literal(f'<{DSML_TOKEN}{tag} name="'), name, st.ConstStringFormat(value=f'" string="{flag}">')]
    return _seq(head, value, _literal(f"</{DSML_TOKEN}{tag}>\n"))


def _arguments(parameters: Any, tag: str) -> list:
    """The parameter lines of one call: the schema's properties in declared order (each required one present,
    the others optional, no other key), or any keys with any values when the schema lists no properties."""
    st = _st()
    props = parameters.get("properties") if isinstance(parameters, dict) else None
    if not isinstance(props, dict) or not props:
        if isinstance(parameters, dict) and parameters.get("additionalProperties") is False:
            return []
        key = st.RegexFormat(pattern=r'[^"<>\s]+')
        any_raw = _parameter(tag, key, True, st.AnyTextFormat(excludes=[DSML_TOKEN]))
        any_json = _parameter(tag, key, False, _value(True, {})[1])
        return [st.StarFormat(content=st.OrFormat(elements=[any_raw, any_json]))]
    required = set(parameters.get("required") or ())
    out = []
    for name, schema in props.items():
        raw, value = _value(schema, parameters)
        line = _parameter(tag, name, raw, value)
        out.append(line if name in required else st.OptionalFormat(content=line))
    return out


def tool_call_structural_tag(tools, mode: str, version: str = "v4", block_open: bool = False,
                             parallel: bool = True) -> dict:
    """The structural tag (``StructuredOutputsParams.structural_tag``) that constrains an answer's tool calls;
    apply it after the reasoning (``after_token_id``).

    Args:
        tools: the callable function tools in Chat Completions form (``[{"type": "function", "function": {"name",
            "parameters", ...}}]``: deepseek-recipe's ``OutputConstraint.schema``), named as the model writes them.
        mode: ``"auto"``: free text, optionally followed by one calls block of one or more calls, each naming a
            listed tool with arguments valid against its ``parameters``; the answer ends with the block.
            ``"required"``: the answer is such a block. ``"none"``: free text only. Free text never holds the text
            ``｜DSML｜`` (so no other markup, and no call in ``"none"``).
        version: ``"v4"`` or ``"v4.1"`` (the DSML spelling).
        block_open: ``"required"`` only: the prompt already ends with the block's opening line (the recipe's
            prompt for a required or named ``tool_choice``, ``ParsingOptions.starts_in_tool_calls``), so the answer
            starts at the first call; otherwise it starts with ``"\\n\\n"`` and the opening line, as the encoder
            renders a turn's calls.
        parallel: False: a block holds exactly one call (OpenAI's ``parallel_tool_calls: false``, Anthropic's
            ``disable_parallel_tool_use``).

    Arguments: a plain string property (no ``pattern`` / ``format`` / length bounds) is raw text, a string enum
    one of its values; any other property is JSON valid against its schema (xgrammar's JSON-schema support, at most
    ``MAX_TOOL_WHITESPACE`` whitespace characters in a row). Properties come in the schema's declared order, the
    required ones always; keys the schema does not list are not offered (a valid subset of what
    ``additionalProperties`` allows). A tool without ``properties`` takes any keys with any values. Returns the
    structural tag as a dict (``{"type": "structural_tag", "format": ...}``). Raises ValueError for an unknown
    ``mode`` / ``version``, or ``"auto"`` / ``"required"`` without tools.
    """
    st = _st()
    if version not in _TAGS:
        raise ValueError(f"version must be one of {sorted(_TAGS)}, got {version!r}")
    if mode not in TOOL_CHOICE_MODES:
        raise ValueError(f"mode must be one of {TOOL_CHOICE_MODES}, got {mode!r}")
    calls, invoke, param = _TAGS[version]
    text = st.AnyTextFormat(excludes=[DSML_TOKEN, "<think>", "</think>"])
    if mode == "none":
        return st.StructuralTag(format=text).model_dump(mode="json")
    invokes = []
    for tool in tools:
        fn = tool["function"]
        args = _arguments(fn.get("parameters"), param)
        if version == "v4.1":  # the V4.1 encoder leaves a blank line in a call without arguments
            args.append(st.OptionalFormat(content=st.ConstStringFormat(value="\n")))
        invokes.append(_seq(_literal(f'<{DSML_TOKEN}{invoke} name="{fn["name"]}">\n'), args,
                            _literal(f"</{DSML_TOKEN}{invoke}>\n")))
    if not invokes:
        raise ValueError(f"tool_choice {mode!r} needs at least one tool")
    one_call = invokes[0] if len(invokes) == 1 else st.OrFormat(elements=invokes)
    calls_list = st.PlusFormat(content=one_call) if parallel else one_call
    end = _literal(f"</{DSML_TOKEN}{calls}>")
    block = _seq(_literal(f"<{DSML_TOKEN}{calls}>\n"), calls_list, end)
    if mode == "auto":
        fmt = _seq(text, st.OptionalFormat(content=block))
    elif block_open:
        fmt = _seq(calls_list, end)
    else:
        fmt = _seq(st.ConstStringFormat(value="\n\n"), block)
    return st.StructuralTag(format=fmt).model_dump(mode="json")
