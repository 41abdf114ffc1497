"""Training text from JSON-lines datasets: `mfqat train --dataset`, `mfqat mlx-train --data`.

Accepted layouts (those mlx-lm's LoRA trainer reads): a ``.jsonl`` file, or a folder holding
``train.jsonl`` and optionally ``valid.jsonl``. Each line is one JSON object with

* ``"text"``: used as it is;
* ``"messages"`` (chat, a list of ``{"role", "content"}``): rendered with the tokenizer's chat template;
* ``"prompt"`` and ``"completion"``: the prompt followed by the completion.

Records are joined with blank lines and cut into blocks like plain text (no prompt masking). Without
``valid.jsonl`` the held-out text is the last tenth (mfqat.data.sources.split_text).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional, Tuple

from mfqat.data.sources import load_text, split_text


def is_dataset(path: Optional[str]) -> bool:
    """True when ``path`` is a JSON-lines file or a folder with train.jsonl (not plain text)."""
    if not path:
        return False
    p = Path(path)
    return (p.is_file() and p.suffix in (".jsonl", ".ndjson")) or (p.is_dir() and (p / "train.jsonl").is_file())


def render(record: object, tokenizer, where: str) -> str:
    """The training text of one record (see the module docstring); ValueError names ``where``."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if isinstance(record.get("text"), str):
        return record["text"]
    if isinstance(record.get("messages"), list):
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{where}: chat 'messages' need a tokenizer with a chat template, and this model's has "
                             "none; give records with a 'text' field instead")
        return tokenizer.apply_chat_template(record["messages"], tokenize=False)
    if isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
        return record["prompt"] + record["completion"]
    raise ValueError(f"{where}: no 'text', 'messages' or 'prompt'/'completion' field (keys: {sorted(record)})")


def read_jsonl(path: Path, tokenizer) -> str:
    """Every record of a .jsonl file rendered and joined by blank lines; errors name file and line."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: dataset file not found")
    texts: List[str] = []
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{i}: not valid JSON ({e})") from None
            texts.append(render(record, tokenizer, f"{path}:{i}"))
    if not texts:
        raise ValueError(f"{path}: no records")
    return "\n\n".join(texts)


def dataset_texts(source: str, tokenizer) -> Tuple[str, str]:
    """(train, held-out) text of a .jsonl file or a folder with train.jsonl [+ valid.jsonl]."""
    p = Path(source)
    if p.is_dir():
        if not (p / "train.jsonl").is_file():
            raise FileNotFoundError(f"{p}: no train.jsonl in this folder (the layout of mlx-lm's --data)")
        train = read_jsonl(p / "train.jsonl", tokenizer)
        if (p / "valid.jsonl").is_file():
            return train, read_jsonl(p / "valid.jsonl", tokenizer)
        return split_text(train)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: dataset not found (give a .jsonl file or a folder with train.jsonl)")
    if p.suffix not in (".jsonl", ".ndjson"):
        raise ValueError(f"{p}: a dataset is a .jsonl file or a folder with train.jsonl; plain text goes to --text")
    return split_text(read_jsonl(p, tokenizer))


def training_texts(text: Optional[str], dataset: Optional[str], tokenizer) -> Tuple[str, str]:
    """(train, held-out) text from --text (file, folder, pydoc) or --dataset; a JSON-lines --text
    is read as a dataset, never trained on as raw JSON."""
    if text and dataset:
        raise ValueError("give --text (plain text) or a dataset, not both")
    if dataset or is_dataset(text):
        return dataset_texts(dataset or text, tokenizer)
    return split_text(load_text(text))
