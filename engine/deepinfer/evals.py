"""``deepinfer eval``: accuracy on AIME-, GPQA- and HLE-style items from a local JSONL file (docs/eval.md).

Item formats (one JSON object per line; ``id`` optional, default ``line-N``):

- ``aime``: ``{"id", "problem": str, "answer": int or digit string}``; the model's answer is the integer in its last
  ``\\boxed{...}``.
- ``gpqa``: ``{"id", "question": str, "choices": [str, ...] (2..26), "answer": letter or 0-based index}``; the
  model's answer is its last ``Answer: X`` (or ``\\boxed{X}``) choice letter.
- ``hle``: ``{"id", "question": str, "answer": str, "answer_type"?: "exactMatch" | "multipleChoice"}``; the model's
  answer is its last ``Exact Answer: ...`` / ``Answer: ...`` line, compared with the reference after normalising
  case, spaces, surrounding ``$`` / ``**`` and a final period (HLE's closed-form items; its judge-graded items and
  images are not supported and refused).

An answer that cannot be extracted (no box, not an integer, an error record, an empty reply) is counted wrong with
its reason; it never stops the run. Scores: pass@1 per item = the mean over its repeats; the task's pass@1 = the
mean over items, with a 95 % normal-approximation confidence interval from the per-item means.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

TASKS = ("aime", "gpqa", "hle")
AIME_SUFFIX = "\n\nPlease reason step by step, and put your final answer within \\boxed{}."
GPQA_SUFFIX = ("\n\nThink step by step, then end your reply with a line of the form 'Answer: X', where X is the "
               "letter of the correct choice.")
HLE_SYSTEM = ("Your response should be in the following format:\nExplanation: {your explanation for your answer "
              "choice}\nExact Answer: {your succinct, final answer}\nConfidence: {your confidence score between 0% "
              "and 100% for your answer}")
HLE_TYPES = ("exactMatch", "multipleChoice")
Z95 = 1.959963984540054


@dataclass(frozen=True)
class Item:
    """One evaluation item: its id, the chat messages sent and the reference answer (normalised per task)."""

    id: str
    messages: tuple
    answer: str


class DataError(ValueError):
    """A bad line of the data file; the message names the file, the line and the field."""


# ---------------------------------------------------------------------------- loading
def load_items(task: str, path: str | Path) -> list[Item]:
    """The items of ``path`` for ``task``; raises ``DataError`` naming the line and field of the first bad one."""
    if task not in TASKS:
        raise ValueError(f"--task must be one of {', '.join(TASKS)}, got {task!r}")
    items, seen = [], {}
    with open(path, encoding="utf-8") as f:
        for no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}: line {no}"
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise DataError(f"{where}: malformed JSON: {e}") from None
            if not isinstance(rec, dict):
                raise DataError(f"{where}: an item must be a JSON object")
            item = _ITEM[task](rec, where, f"line-{no}")
            if item.id in seen:
                raise DataError(f"{where}: id {item.id!r} repeats line {seen[item.id]}")
            seen[item.id] = no
            items.append(item)
    if not items:
        raise DataError(f"{path}: no items")
    return items


def _text(rec: dict, key: str, where: str) -> str:
    v = rec.get(key)
    if not isinstance(v, str) or not v.strip():
        raise DataError(f"{where}: {key!r} must be a non-empty string")
    return v


def _id(rec: dict, where: str, default: str) -> str:
    v = rec.get("id", default)
    if isinstance(v, bool) or not isinstance(v, (str, int)):
        raise DataError(f"{where}: 'id' must be a string or an integer")
    return str(v)


def _aime_item(rec: dict, where: str, default_id: str) -> Item:
    ans = rec.get("answer")
    ref = parse_int(ans) if isinstance(ans, str) else (ans if isinstance(ans, int) and not isinstance(ans, bool)
                                                        else None)
    if ref is None:
        raise DataError(f"{where}: 'answer' must be an integer (or a string of one), got {ans!r}")
    user = {"role": "user", "content": _text(rec, "problem", where) + AIME_SUFFIX}
    return Item(_id(rec, where, default_id), (user,), str(ref))


def _gpqa_item(rec: dict, where: str, default_id: str) -> Item:
    choices = rec.get("choices")
    if not isinstance(choices, list) or not 2 <= len(choices) <= 26 or not all(
            isinstance(c, str) and c.strip() for c in choices):
        raise DataError(f"{where}: 'choices' must be a list of 2 to 26 non-empty strings")
    letters = [chr(ord("A") + i) for i in range(len(choices))]
    ans = rec.get("answer")
    if isinstance(ans, int) and not isinstance(ans, bool) and 0 <= ans < len(choices):
        ref = letters[ans]
    elif isinstance(ans, str) and ans.strip().upper() in letters:
        ref = ans.strip().upper()
    else:
        raise DataError(f"{where}: 'answer' must be a choice letter {letters[0]}..{letters[-1]} or a 0-based index, "
                        f"got {ans!r}")
    body = _text(rec, "question", where) + "\n\n" + "\n".join(f"{k}) {c}" for k, c in zip(letters, choices))
    return Item(_id(rec, where, default_id), ({"role": "user", "content": body + GPQA_SUFFIX},), ref)


def _hle_item(rec: dict, where: str, default_id: str) -> Item:
    kind = rec.get("answer_type", "exactMatch")
    if kind not in HLE_TYPES:
        raise DataError(f"{where}: 'answer_type' {kind!r} is not closed-form (exact match needs one of "
                        f"{', '.join(HLE_TYPES)})")
    if rec.get("image"):
        raise DataError(f"{where}: 'image': image items are not supported (text-only evaluation)")
    ref = normalize_answer(_text(rec, "answer", where))
    msgs = ({"role": "system", "content": HLE_SYSTEM}, {"role": "user", "content": _text(rec, "question", where)})
    return Item(_id(rec, where, default_id), msgs, ref)


_ITEM = {"aime": _aime_item, "gpqa": _gpqa_item, "hle": _hle_item}


# ---------------------------------------------------------------------------- answer extraction
def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None when there is none or
    it is not closed."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
        j += 1
    return None


def parse_int(text: str) -> int | None:
    """An integer written plainly (``042``, ``1,000``, ``$17$``, ``17^\\circ``, ``\\text{17}``), else None."""
    t = text.strip().strip("$").strip()
    t = re.sub(r"^\\text\{(.*)\}$", r"\1", t).strip()
    t = re.sub(r"\^\s*\{?\\circ\}?$", "", t).strip()
    t = t.replace("\\,", "").replace("\\!", "").replace(",", "").replace(" ", "").rstrip(".")
    return int(t) if re.fullmatch(r"[+-]?\d{1,12}", t) else None


# "Answer: C", "the answer is (C)", "**Answer:** C": the letter itself is upper case ("answer is a ..." is no choice)
_CHOICE = re.compile(r"(?i:answer)\s*(?:(?i:is)\s*)?[:：]?\s*[\*\(\[]*\s*([A-Z])(?![A-Za-z])")
_EXACT = re.compile(r"^\s*\**\s*(?:exact\s+)?answer\s*\**\s*[:：]\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE)


def normalize_answer(text: str) -> str:
    """Case-folded, spaces collapsed, surrounding ``$`` / ``**`` / quotes and a final period removed."""
    t = " ".join(text.split())
    for _ in range(3):
        t = t.strip().strip("*").strip().strip("$").strip().strip("\"'`").strip()
        t = t[:-1] if t.endswith(".") else t
    return t.casefold()


def extract(task: str, text: str) -> tuple[str | None, str | None]:
    """``(answer, None)`` as compared with the reference, or ``(None, reason)`` when no answer can be read."""
    if not isinstance(text, str) or not text.strip():
        return None, "empty reply"
    if task == "aime":
        boxed = last_boxed(text)
        if boxed is None:
            return None, "no \\boxed{} answer"
        n = parse_int(boxed)
        return (str(n), None) if n is not None else (None, f"boxed answer is not an integer: {boxed[:80]!r}")
    if task == "gpqa":
        found = _CHOICE.findall(text)
        if found:
            return found[-1], None
        m = re.fullmatch(r"\s*(?:\\text\{\s*)?([A-Z])\s*\}?\s*", last_boxed(text) or "")
        return (m.group(1), None) if m else (None, "no 'Answer: X' choice letter")
    found = _EXACT.findall(text)
    if not found:
        return None, "no 'Exact Answer:' line"
    return normalize_answer(found[-1]), None


# ---------------------------------------------------------------------------- scoring
def score(records: list[dict]) -> dict:
    """pass@1 over per-item means of ``correct``, its standard error and 95 % interval (None for one item)."""
    by_item: dict[str, list[bool]] = {}
    for r in records:
        by_item.setdefault(r["id"], []).append(bool(r["correct"]))
    means = [sum(v) / len(v) for v in by_item.values()]
    n = len(means)
    mean = sum(means) / n if n else 0.0
    se = math.sqrt(sum((m - mean) ** 2 for m in means) / (n - 1) / n) if n > 1 else None
    ci = [max(0.0, mean - Z95 * se), min(1.0, mean + Z95 * se)] if se is not None else None
    return {"pass@1": mean, "stderr": se, "ci95": ci, "num_items": n, "num_samples": len(records),
            "num_correct": sum(1 for r in records if r["correct"]),
            "num_unparsed": sum(1 for r in records if r.get("extracted") is None),
            "num_errors": sum(1 for r in records if r.get("error")),
            "per_item": {k: sum(v) / len(v) for k, v in by_item.items()}}


def sample_seed(item_id: str, repeat: int, base: int) -> int:
    """A fixed seed per (item, repeat), so a resumed run draws what the uninterrupted one would have."""
    h = hashlib.sha256(f"{base}:{item_id}:{repeat}".encode()).digest()
    return int.from_bytes(h[:7], "little")


# ---------------------------------------------------------------------------- the run
@dataclass
class EvalSettings:
    task: str
    num_repeats: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    thinking: bool = True
    seed: int = 0
    model: str | None = None  # the model name sent in each request (a server); None: the served one
    checkpoint: str | None = None  # what answers (the engine's --model), recorded in the log

    def fingerprint(self) -> dict:
        """What must match for a log to be resumed (repeats may grow)."""
        return {"task": self.task, "temperature": self.temperature, "top_p": self.top_p,
                "max_tokens": self.max_tokens, "thinking": self.thinking, "seed": self.seed, "model": self.model,
                "checkpoint": self.checkpoint}


def request_body(item: Item, repeat: int, s: EvalSettings) -> dict:
    """The Chat Completions body of one sample."""
    body = {"messages": [dict(m) for m in item.messages], "temperature": s.temperature, "top_p": s.top_p,
            "seed": sample_seed(item.id, repeat, s.seed),
            "thinking": {"type": "enabled" if s.thinking else "disabled"}}
    if s.max_tokens is not None:
        body["max_tokens"] = s.max_tokens
    if s.model is not None:
        body["model"] = s.model
    return body


def read_log(path: Path, settings: EvalSettings) -> dict[tuple[str, int], dict]:
    """The finished samples of a log, by ``(id, repeat)``; a log of other settings is refused (``ValueError``);
    a torn last line (a killed run) is dropped."""
    done: dict[tuple[str, int], dict] = {}
    if not path.exists():
        return done
    want = settings.fingerprint()
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):  # a last line cut by a kill: dropped, so appending starts a fresh line
        data = data[:data.rfind(b"\n") + 1]
        with open(path, "r+b") as f:
            f.truncate(len(data))
    for no, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            rec["id"], rec["repeat"]  # noqa: B018 - a log line has both
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"--log {path}: line {no} is not a deepinfer eval record") from None
        if rec.get("settings") != want:
            raise ValueError(f"--log {path}: line {no} was written with other settings ({rec.get('settings')}); "
                             f"this run has {want}. Use another --log, or --restart to discard it")
        done[(rec["id"], rec["repeat"])] = rec
    return done


def run_eval(items: list[Item], settings: EvalSettings, generate: Callable[[list[dict]], list[dict]],
             log_path: Path, restart: bool = False, chunk_size: int = 64, progress=None) -> dict:
    """Run every (item, repeat) sample not yet in ``log_path``, appending each finished chunk to it; return the
    report (``score`` plus the settings and counts).

    ``generate(bodies) -> [{"text", "finish_reason"} or {"error": {...}}]`` answers Chat Completions bodies (the
    engine or a server). A result whose ``error`` has code ``interrupted`` is not logged (the next run redoes it)."""
    if restart and log_path.exists():
        log_path.unlink()
    done = read_log(log_path, settings)
    todo = [(it, k) for it in items for k in range(settings.num_repeats) if (it.id, k) not in done]
    say = progress or (lambda line: None)
    say(f"eval {settings.task}: {len(items)} items x {settings.num_repeats} repeats, {len(todo)} samples to run "
        f"({len(items) * settings.num_repeats - len(todo)} in the log)")
    interrupted = False
    with open(log_path, "a", encoding="utf-8") as log:
        for start in range(0, len(todo), chunk_size):
            part = todo[start:start + chunk_size]
            results = generate([request_body(it, k, settings) for it, k in part])
            for (it, k), res in zip(part, results):
                err = res.get("error") if isinstance(res, dict) else {"message": f"bad result {res!r}"[:200]}
                if err and err.get("code") == "interrupted":
                    interrupted = True
                    continue
                text = "" if err else res.get("text") or ""
                answer, reason = (None, f"request failed: {err.get('message', '')}"[:300]) if err else extract(
                    settings.task, text)
                rec = {"id": it.id, "repeat": k, "correct": answer is not None and answer == it.answer,
                       "extracted": answer, "reference": it.answer, "reason": reason,
                       "finish_reason": None if err else res.get("finish_reason"), "error": err or None,
                       "reply_tail": text[-300:], "settings": settings.fingerprint()}
                done[(it.id, k)] = rec
                log.write(json.dumps(rec, ensure_ascii=False) + "\n")
            log.flush()
            say(f"eval {settings.task}: {min(start + chunk_size, len(todo))}/{len(todo)} samples")
            if interrupted:
                break
    ids = {it.id for it in items}
    records = [r for (i, k), r in done.items() if i in ids and k < settings.num_repeats]
    report = {"task": settings.task, **score(records), "num_repeats": settings.num_repeats,
              "settings": settings.fingerprint(), "log": str(log_path), "complete": not interrupted and len(
                  records) == len(items) * settings.num_repeats}
    return report


# ---------------------------------------------------------------------------- answer sources
def engine_generate(llm) -> Callable[[list[dict]], list[dict]]:
    """``generate`` over ``LLM.chat`` (continuous batching over each chunk)."""

    def gen(bodies: list[dict]) -> list[dict]:
        out = []
        for res in llm.chat(bodies, api="chat"):
            if set(res) == {"error"}:
                out.append(res)
                continue
            choice = res["choices"][0]
            out.append({"text": choice["message"].get("content") or "", "finish_reason": choice["finish_reason"]})
        return out

    return gen


def server_generate(url: str, api_key: str, concurrency: int = 16, timeout: float = 3600.0):
    """``generate`` over a running server's ``/v1/chat/completions`` (the official ``openai`` client), at most
    ``concurrency`` requests open."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    client = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key, max_retries=2, timeout=timeout)
    if not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {concurrency!r}")

    served: list[str] = []

    def one(body: dict) -> dict:
        b = dict(body)
        extra = {"thinking": b.pop("thinking")}
        model = b.pop("model", None)
        if model is None:
            if not served:
                served.append(client.models.list().data[0].id)
            model = served[0]
        try:
            r = client.chat.completions.create(model=model, **b, extra_body=extra)
        except openai.APIStatusError as e:
            body = e.body if isinstance(e.body, dict) else {}
            return {"error": {"message": str(body.get("message") or e), "code": body.get("code"),
                              "status_code": e.status_code}}
        except openai.APIError as e:
            return {"error": {"message": f"{type(e).__name__}: {e}", "code": "connection_error"}}
        return {"text": r.choices[0].message.content or "", "finish_reason": r.choices[0].finish_reason}

    def gen(bodies: list[dict]) -> list[dict]:
        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(one, bodies))

    return gen
