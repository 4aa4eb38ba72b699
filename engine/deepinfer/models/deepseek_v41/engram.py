"""Engram n-gram hashing for DeepSeek-V4.1 (``docs/deepseek_v41.md``, "Engram").

Each position t is hashed as the 2-gram .. ``max_ngram``-gram ending at t, over *compressed* token ids (a map that
merges tokens which normalise alike). Look-back before position 0 reads the compressed pad id. With
``m_j`` the odd multiplier of look-back j and ``c_{t-j}`` the compressed ids, the n-gram hash is
``(c_t m_0) xor (c_{t-1} m_1) xor ... xor (c_{t-n+1} m_{n-1})`` in int64, reduced modulo the prime of each
(n-gram size, head) and offset to that prime's row range of the layer's table.

The primes are the smallest unused primes above ``engram_vocab_size - 1``, drawn in order over layers, n-gram
sizes and heads; the multipliers come from numpy's PCG64 seeded ``10007 * layer_id``, bounded by
``(int64 max // compressed_vocab) // 2`` and made odd.
"""

from __future__ import annotations

import numpy as np
import torch

from .config import DeepseekV41Config


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    i = 3
    while i * i <= n:
        if n % i == 0:
            return False
        i += 2
    return True


def bucket_primes(cfg: DeepseekV41Config) -> list[list[list[int]]]:
    """``[engram layer][n-gram size - 2][head]`` bucket moduli."""
    seen: set[int] = set()
    out = []
    for _ in cfg.engram_layer_ids:
        per_n = []
        for _ in range(cfg.engram_max_ngram_size - 1):
            heads, cur = [], cfg.engram_vocab_size - 1
            for _ in range(cfg.engram_n_heads):
                cur += 1
                while not _is_prime(cur) or cur in seen:
                    cur += 1
                seen.add(cur)
                heads.append(cur)
            per_n.append(heads)
        out.append(per_n)
    return out


def hash_multipliers(cfg: DeepseekV41Config) -> torch.Tensor:
    """int64 ``[engram layers, max_ngram]``."""
    bound = max(1, (np.iinfo(np.int64).max // cfg.engram_compressed_vocab_size) // 2)
    rows = []
    for layer in cfg.engram_layer_ids:
        v = np.random.default_rng(10007 * layer).integers(0, bound, size=(cfg.engram_max_ngram_size,), dtype=np.int64)
        rows.append(torch.from_numpy(v * 2 + 1))
    return torch.stack(rows)


def compressed_token_map(tokenizer) -> tuple[list[int], int]:
    """Raw id -> compressed id from a ``tokenizers.Tokenizer``; returns (map, compressed vocab size).

    Each id's decoded text is normalised (NFKC, NFD, accents stripped, lower case, runs of whitespace to one space,
    stripped; a token that is exactly one space stays one space); tokens whose texts normalise alike share an id,
    numbered in first-seen order. A partial UTF-8 byte token (decoding to U+FFFD) keys by its raw token string.
    """
    from tokenizers import Regex, normalizers

    keep = "\ue000"
    norm = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), keep),
        normalizers.Strip(), normalizers.Replace(keep, " "),
    ])
    ids: dict[str, int] = {}
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    out = [0] * n
    for t in range(n):
        text = tokenizer.decode([t], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(t)
        else:
            key = norm.normalize_str(text) or text
        out[t] = ids.setdefault(key, len(ids))
    return out, len(ids)


class EngramHasher:
    """Hash ids of every position, for all engram layers at once.

    ``token_map`` int64 ``[vocab]`` (raw -> compressed id). ``__call__(history)`` takes the compressed ids of
    positions 0..end-1 and the chunk start, and returns int64 ``[chunk, engram layers, (max_ngram-1) * heads]``
    table rows for positions start..end-1.
    """

    def __init__(self, cfg: DeepseekV41Config, token_map: torch.Tensor):
        if token_map.dtype != torch.int64 or token_map.shape != (cfg.vocab_size,):
            raise ValueError(f"engram.token_map: expected int64 [{cfg.vocab_size}], got {token_map.dtype} "
                             f"{list(token_map.shape)}")
        if int(token_map.min()) < 0 or int(token_map.max()) >= cfg.engram_compressed_vocab_size:
            raise ValueError(f"engram.token_map: ids must lie in [0, engram_compressed_vocab_size = "
                             f"{cfg.engram_compressed_vocab_size})")
        self.cfg = cfg
        self.token_map = token_map
        self.pad = int(token_map[cfg.engram_pad_id])
        primes = bucket_primes(cfg)
        self.primes = torch.tensor(primes, dtype=torch.int64)  # [layers, n-1, heads]
        flat = [[p for per_n in layer for p in per_n] for layer in primes]
        self.offsets = torch.tensor([np.cumsum([0] + f[:-1]).tolist() for f in flat], dtype=torch.int64)
        self.multipliers = hash_multipliers(cfg)  # [layers, n]
        for i, rows in enumerate(cfg.engram_num_embeddings):
            if sum(flat[i]) != rows:
                raise ValueError(f"engram_num_embeddings[{i}] = {rows} but the bucket primes of layer "
                                 f"{cfg.engram_layer_ids[i]} sum to {sum(flat[i])}")

    def to(self, device: torch.device | str) -> "EngramHasher":
        """Move the map and hash constants to ``device`` (in place); returns self."""
        for k in ("token_map", "primes", "offsets", "multipliers"):
            setattr(self, k, getattr(self, k).to(device))
        return self

    def compress(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.token_map[input_ids]

    def __call__(self, history: torch.Tensor, start: int, base: int = 0) -> torch.Tensor:
        """``history``: the compressed ids of positions ``base .. end-1`` (``base <= max(0, start - max_ngram + 1)``:
        the n-grams of ``start ..`` reach that far back); rows for positions ``start .. end-1``."""
        n = self.cfg.engram_max_ngram_size
        if not 0 <= base <= max(0, start - n + 1):
            raise ValueError(f"engram history: base {base} must lie in [0, max(0, start - {n - 1})] for start {start}")
        pos = torch.arange(start, base + history.numel())
        grams = []
        for j in range(n):
            src = history[(pos - j).clamp_min(base) - base]
            grams.append(torch.where(pos < j, self.pad, src))
        toks = torch.stack(grams, -1)  # [T, n]
        prod = toks.unsqueeze(1) * self.multipliers  # [T, layers, n]
        acc, cols = prod[..., 0], []
        for j in range(1, n):
            acc = acc ^ prod[..., j]
            cols.append(acc.unsqueeze(-1) % self.primes[:, j - 1])
        return torch.cat(cols, -1) + self.offsets
