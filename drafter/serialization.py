"""msgpack serialization of one problem's drafter history: shipped to engines and written to snapshots.

Only token sequences travel (int32 little-endian byte strings); suffix indices are rebuilt on load, which is
O(tokens * max_depth) and keeps the format independent of the native layout. The live segment is not included:
in-flight outputs belong to the engine generating them.

Layout (format "das-problem-history", version 1):
    {"format", "version", "problem_id": str, "max_depth": int,
     "prompts": [bytes], "sealed": [{"policy_version": int, "sequences": [bytes]}]}
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from das.drafter.history import HistoryBank, ProblemHistory, Segment
from das.drafter.msgpack_document import decode_document, require_field

FORMAT = "das-problem-history"
VERSION = 1


class HistoryFormatError(ValueError):
    """A serialized history that cannot be loaded; the message says which part is wrong."""


def dump_problem(history: ProblemHistory) -> bytes:
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "problem_id": history.problem_id,
        "max_depth": history.max_depth,
        "prompts": [_pack(s) for s in history.prompts.sequences()],
        "sealed": [{"policy_version": v, "sequences": [_pack(s) for s in seg.sequences()]}
                   for v, seg in sorted(history.sealed.items())],
    }
    return msgpack.packb(doc, use_bin_type=True)


def load_problem(data: bytes, bank: HistoryBank) -> ProblemHistory:
    """Validates `data` completely, then installs it in `bank` (replacing that problem's prompts and sealed
    segments; its live segment is kept). On any error nothing in the bank changes."""
    doc = decode_document(data, FORMAT, VERSION, HistoryFormatError)
    problem_id = _field(doc, "problem_id", str)
    if not problem_id:
        raise HistoryFormatError("problem_id must be a non-empty string")
    max_depth = _field(doc, "max_depth", int)
    if max_depth != bank.config.max_depth:
        raise HistoryFormatError(f"max_depth {max_depth} differs from this drafter's {bank.config.max_depth}")
    prompts = [_unpack(b, f"prompts[{i}]") for i, b in enumerate(_field(doc, "prompts", list))]
    sealed: list[tuple[int, list[np.ndarray]]] = []
    for i, entry in enumerate(_field(doc, "sealed", list)):
        if not isinstance(entry, dict):
            raise HistoryFormatError(f"sealed[{i}] must be a map")
        version = _field(entry, "policy_version", int, f"sealed[{i}].")
        if version < 0 or (sealed and version <= sealed[-1][0]):
            raise HistoryFormatError(f"sealed[{i}].policy_version {version} is negative or not increasing")
        seqs = [_unpack(b, f"sealed[{i}].sequences[{j}]")
                for j, b in enumerate(_field(entry, "sequences", list, f"sealed[{i}]."))]
        sealed.append((version, seqs))

    history = bank.problem(problem_id)
    history.prompts, history.prompt_keys, history.sealed = Segment.new(max_depth), set(), {}
    for prompt in prompts:
        history.add_prompt(prompt)
    for version, seqs in sealed:
        segment = Segment.new(max_depth)
        for seq in seqs:
            segment.add(seq, sealed=True)
        bank.install_sealed(history, version, segment)
    return history


def _field(doc: dict[str, Any], name: str, kind: type, prefix: str = "") -> Any:
    return require_field(doc, name, kind, HistoryFormatError, prefix)


def _pack(tokens: list[int]) -> bytes:
    return np.asarray(tokens, dtype="<i4").tobytes()


def _unpack(blob: Any, where: str) -> np.ndarray:
    if not isinstance(blob, bytes) or len(blob) % 4:
        raise HistoryFormatError(f"{where} must be int32 token bytes (length a multiple of 4)")
    tokens = np.frombuffer(blob, dtype="<i4").astype(np.int32)
    if tokens.size and int(tokens.min()) < 0:
        raise HistoryFormatError(f"{where} holds a negative token id")
    return tokens
