"""`kconvert eval --generations SRC.jsonl CAND.jsonl`: continuations any engine wrote (vLLM,
SGLang, llama.cpp on the real model and its compressed twin, the same prompts and sampling),
read and checked before any statistic, and the files `kconvert eval --generate -o` writes.

One JSON object a line, the completions shape: "prompt" and "completion" (strings; the prompt
non-empty, the completion too unless "finish_reason" says the model stopped: an empty text with
no reason is a failed request more often than an answer), optionally "id" (lines are paired by
id when every line of both files has one, else by line order), "finish_reason" ("length": the
engine's token limit ended it; anything else: it stopped) and "token_ids" (the completion's
token ids, as `--generate -o` writes them). Otherwise, with a tokenizer, each completion's
tokens are its encoding without special tokens.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from kconvert.errors import KconvertError
from kconvert.evaluate.generation import Continuation

LENGTH = "length"  # finish_reason of a continuation the token limit ended (OpenAI, vLLM)
STOP = "stop"


def read_file(path: Path) -> list[tuple[int, dict]]:
    """(line number, object) of every non-blank line, each checked (module docstring)."""
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KconvertError(f"cannot read the generations: {exc}", file=str(path)) from exc
    rows = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise KconvertError(f"line {n} is not JSON: {exc}", file=str(path)) from exc
        if not isinstance(obj, dict):
            raise KconvertError(f"line {n} is not a JSON object", file=str(path))
        for key in ("prompt", "completion"):
            if key not in obj:
                raise KconvertError(f"line {n} has no \"{key}\" (each line needs \"prompt\" "
                                    "and \"completion\")", file=str(path))
            if not isinstance(obj[key], str):
                raise KconvertError(f"line {n}: \"{key}\" must be a string", file=str(path))
        for key in ("id", "finish_reason"):
            if key in obj and not isinstance(obj[key], str | int):
                raise KconvertError(f"line {n}: \"{key}\" must be a string or an integer",
                                    file=str(path))
        if not obj["prompt"]:
            raise KconvertError(f"line {n}: the prompt is empty", file=str(path))
        if not obj["completion"] and "finish_reason" not in obj:
            raise KconvertError(f"line {n}: the completion is empty and no \"finish_reason\" "
                                "says the model stopped there (a failed request?)",
                                file=str(path))
        ids = obj.get("token_ids")
        if ids is not None and not (isinstance(ids, list) and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
            raise KconvertError(f"line {n}: \"token_ids\" must be a list of non-negative "
                                "integers", file=str(path))
        rows.append((n, obj))
    if not rows:
        raise KconvertError("the generations file holds no line", file=str(path))
    return rows


def paired(source: Path, candidate: Path) -> list[tuple[tuple[int, dict], tuple[int, dict]]]:
    """The two files' lines paired: by "id" when every line has one (each id once per file,
    the same ids in both), else in order (the same number of lines); each pair's prompts
    equal."""
    src, cand = read_file(source), read_file(candidate)
    with_ids = [all("id" in obj for _, obj in rows) for rows in (src, cand)]
    if all(with_ids):
        by_id = []
        for path, rows in ((source, src), (candidate, cand)):
            ids: dict[str, tuple[int, dict]] = {}
            for n, obj in rows:
                key = str(obj["id"])
                if key in ids:
                    raise KconvertError(f"line {n}: id {key!r} is also on line {ids[key][0]}",
                                        file=str(path))
                ids[key] = (n, obj)
            by_id.append(ids)
        missing = [k for k in by_id[0] if k not in by_id[1]]
        extra = [k for k in by_id[1] if k not in by_id[0]]
        if missing or extra:
            raise KconvertError(
                f"the two files' ids differ: {len(missing)} of {source} not in the candidate's "
                f"({', '.join(map(repr, missing[:3]))}), {len(extra)} of the candidate's not in "
                f"the source's ({', '.join(map(repr, extra[:3]))})", file=str(candidate))
        pairs = [(row, by_id[1][k]) for k, row in by_id[0].items()]
    else:
        if len(src) != len(cand):
            raise KconvertError(f"{source} holds {len(src)} generations and {candidate} "
                                f"{len(cand)}: without an \"id\" on every line they are "
                                "paired in order, which needs as many", file=str(candidate))
        pairs = list(zip(src, cand, strict=True))
    for (ns, s), (nc, c) in pairs:
        if s["prompt"] != c["prompt"]:
            raise KconvertError(f"line {nc}: its prompt is not the prompt of {source} line "
                                f"{ns}, its pair", file=str(candidate))
    return pairs


def continuation(obj: dict, tokenizer) -> Continuation:
    reason = obj.get("finish_reason")
    tokens = obj.get("token_ids")
    if tokens is None and tokenizer is not None:
        tokens = tokenizer(obj["completion"], add_special_tokens=False)["input_ids"]
    return Continuation(prompt=obj["prompt"], text=obj["completion"], tokens=tokens,
                        hit_limit=None if reason is None else reason == LENGTH,
                        id=str(obj["id"]) if "id" in obj else None)


def read_generations(source: str | Path, candidate: str | Path, tokenizer_dir: str | None
                     ) -> tuple[list[Continuation], list[Continuation]]:
    """Both files' continuations, paired, every line checked before anything else runs;
    tokens where `tokenizer_dir` (a local tokenizer directory) is given."""
    pairs = paired(Path(source), Path(candidate))
    tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir is not None else None
    return ([continuation(s, tokenizer) for (_, s), _ in pairs],
            [continuation(c, tokenizer) for _, (_, c) in pairs])


def load_tokenizer(tokenizer_dir: str):
    """transformers' AutoTokenizer of a local directory (never the Hub)."""
    if not Path(tokenizer_dir).is_dir():
        raise KconvertError("--tokenizer must be a local tokenizer directory",
                            file=str(tokenizer_dir))
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=True,
                                             local_files_only=True)
    except Exception as exc:  # any loading failure is the user's to fix
        raise KconvertError(f"cannot load the tokenizer: {exc}", file=str(tokenizer_dir)) from exc


def write_generations(path: Path, conts: Sequence[Continuation]) -> None:
    """`conts` as a --generations file (id: the prompt's place in the run)."""
    from kconvert.io.files import write_text

    write_text(path, "".join(
        json.dumps({"id": str(i), "prompt": c.prompt, "completion": c.text,
                    "finish_reason": LENGTH if c.hit_limit else STOP,
                    "token_ids": list(c.tokens or ())}) + "\n"
        for i, c in enumerate(conts)))
