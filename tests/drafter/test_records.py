"""The rollout history format: round trips, validation with file/line/field in every error, and statistics."""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from das.drafter.records import (
    MAX_TOKEN_ID,
    RecordError,
    RolloutRecord,
    history_stats,
    load_rollouts,
    read_rollouts,
    write_rollouts,
)

GOOD = {"problem_id": "p1", "policy_version": 3, "sample_index": 0, "prompt_token_ids": [1, 2, 3],
        "output_token_ids": [4, 5], "finish_reason": "stop", "reward": 0.5}


def _records() -> list[RolloutRecord]:
    return [
        RolloutRecord("p1", 0, 0, (1, 2), (3, 4, 5), "stop", 1.0),
        RolloutRecord("p1", 0, 1, (1, 2), (), "abort", None),
        RolloutRecord("problème-2", 7, 3, (0,), (MAX_TOKEN_ID, 0), None, -2.5),
        RolloutRecord("p1", 1, 0, (1, 2), (3, 4), "stop", None, -(2**63)),
    ]


@pytest.mark.parametrize("name", ["h.jsonl", "h.jsonl.gz"])
def test_round_trip(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    assert write_rollouts(path, _records()) == 4
    assert load_rollouts(path) == _records()
    assert (path.read_bytes()[:2] == b"\x1f\x8b") == name.endswith(".gz")
    assert [p.name for p in tmp_path.iterdir()] == [name]  # no temp file left behind


def test_written_lines_are_compact_and_optional_fields_omitted(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    write_rollouts(path, _records())
    lines = path.read_text().splitlines()
    assert lines[0] == ('{"problem_id":"p1","policy_version":0,"sample_index":0,"prompt_token_ids":[1,2],'
                        '"output_token_ids":[3,4,5],"finish_reason":"stop","reward":1.0}')
    assert "reward" not in json.loads(lines[1])
    assert "finish_reason" not in json.loads(lines[2])
    assert "sample_key" not in json.loads(lines[0]) and json.loads(lines[3])["sample_key"] == -(2**63)


def test_gzip_detected_by_magic_not_name(tmp_path: Path) -> None:
    gz, plain = tmp_path / "a.jsonl.gz", tmp_path / "b.jsonl"
    write_rollouts(gz, _records())
    write_rollouts(plain, _records())
    gz.rename(tmp_path / "gz-named-plain.jsonl")
    plain.rename(tmp_path / "plain-named.jsonl.gz")
    assert load_rollouts(tmp_path / "gz-named-plain.jsonl") == _records()
    assert load_rollouts(tmp_path / "plain-named.jsonl.gz") == _records()


def test_gzip_output_is_deterministic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_rollouts(tmp_path / "a.jsonl.gz", _records())
    first = (tmp_path / "a.jsonl.gz").read_bytes()
    monkeypatch.setattr(time, "time", lambda: 2e9)  # a later clock must not change the bytes
    write_rollouts(tmp_path / "a.jsonl.gz", _records())
    assert (tmp_path / "a.jsonl.gz").read_bytes() == first


def test_failed_write_keeps_old_file(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    write_rollouts(path, _records())
    before = path.read_bytes()

    def broken():
        yield _records()[0]
        raise RuntimeError("producer died")

    with pytest.raises(RuntimeError):
        write_rollouts(path, broken())
    with pytest.raises(TypeError):
        write_rollouts(path, [GOOD])  # type: ignore[list-item]
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["h.jsonl"]


def test_blank_lines_skipped_and_reading_streams(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    path.write_text("\n" + json.dumps(GOOD) + "\n  \n" + json.dumps(GOOD) + "\n{broken\n")
    it = read_rollouts(path)
    assert next(it).problem_id == "p1"  # records before a bad line are delivered before the error
    assert next(it).problem_id == "p1"
    with pytest.raises(RecordError, match=r"h\.jsonl:5: invalid JSON"):
        next(it)


def test_construction_normalises_and_freezes() -> None:
    rec = RolloutRecord("p", np.int64(2), 1, [1, 2], np.array([7, 8], dtype=np.int32), None, 1)
    assert rec.prompt_token_ids == (1, 2) and rec.output_token_ids == (7, 8)
    assert all(type(t) is int for t in rec.output_token_ids) and type(rec.policy_version) is int
    assert rec.reward == 1.0 and type(rec.reward) is float
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.problem_id = "q"  # type: ignore[misc]
    with pytest.raises(RecordError, match=r"^field 'prompt_token_ids'\[1\]: token id -1"):
        RolloutRecord("p", 0, 0, (1, -1), ())


# (change to GOOD, field, index or None, fragment of the reason)
BAD = [
    ({"problem_id": ""}, "problem_id", None, "non-empty string"),
    ({"problem_id": 5}, "problem_id", None, "non-empty string"),
    ({"policy_version": -1}, "policy_version", None, "int >= 0"),
    ({"policy_version": "1"}, "policy_version", None, "int >= 0"),
    ({"policy_version": True}, "policy_version", None, "int >= 0"),
    ({"policy_version": 1.0}, "policy_version", None, "int >= 0"),
    ({"sample_index": -3}, "sample_index", None, "int >= 0"),
    ({"sample_index": None}, "sample_index", None, "int >= 0"),
    ({"prompt_token_ids": []}, "prompt_token_ids", None, "must not be empty"),
    ({"prompt_token_ids": "1 2"}, "prompt_token_ids", None, "list of token ids"),
    ({"prompt_token_ids": [1, True]}, "prompt_token_ids", 1, "not an int"),
    ({"prompt_token_ids": [1, 2.0]}, "prompt_token_ids", 1, "not an int"),
    ({"prompt_token_ids": [2**31]}, "prompt_token_ids", 0, "token id 2147483648 outside [0, 2147483647]"),
    ({"output_token_ids": [1, 2, 3, -5]}, "output_token_ids", 3, "token id -5 outside [0, 2147483647]"),
    ({"output_token_ids": [[1]]}, "output_token_ids", 0, "not an int"),
    ({"output_token_ids": None}, "output_token_ids", None, "list of token ids"),
    ({"finish_reason": 3}, "finish_reason", None, "string or null"),
    ({"reward": float("nan")}, "reward", None, "finite number"),
    ({"reward": float("inf")}, "reward", None, "finite number"),
    ({"reward": "0.5"}, "reward", None, "finite number"),
    ({"reward": True}, "reward", None, "finite number"),
    ({"reward": 10**400}, "reward", None, "finite number"),
    ({"sample_key": 2**63}, "sample_key", None, "int64 or null"),
    ({"sample_key": "7"}, "sample_key", None, "int64 or null"),
    ({"sample_key": True}, "sample_key", None, "int64 or null"),
    ({"extra": 1}, "extra", None, "not a field of the format"),
    ({"output_token_ids": ...}, "output_token_ids", None, "missing"),
    ({"problem_id": ...}, "problem_id", None, "missing"),
]


@pytest.mark.parametrize(("change", "field", "index", "reason"), BAD, ids=[f"{f}-{i}" for i, (_, f, *_) in
                                                                          enumerate(BAD)])
@pytest.mark.parametrize("gz", [False, True])
def test_validation_names_file_line_and_field(tmp_path: Path, change: dict, field: str, index: int | None,
                                              reason: str, gz: bool) -> None:
    bad = {k: v for k, v in {**GOOD, **change}.items() if v is not ...}
    text = json.dumps(GOOD) + "\n\n" + json.dumps(bad) + "\n" + json.dumps(GOOD) + "\n"  # bad one on line 3
    path = tmp_path / "traces.jsonl"
    path.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
    with pytest.raises(RecordError) as info:
        load_rollouts(path)
    err = info.value
    assert (err.path, err.line, err.field, err.index) == (str(path), 3, field, index)
    where = f"field {field!r}" + (f"[{index}]" if index is not None else "")
    assert str(err).startswith(f"{path}:3: {where}: ")
    assert reason in str(err)
    # The same rule holds for the in-memory API, with the line when given.
    with pytest.raises(RecordError, match=r"^line 9: " + where.replace("[", r"\[")):
        RolloutRecord.from_dict(bad, line=9)


@pytest.mark.parametrize(("content", "reason"), [
    (b"{not json}\n", "invalid JSON"),
    (b"[1, 2]\n", "expected a JSON object, got list"),
    (b'"p1"\n', "expected a JSON object, got str"),
    (b'{"problem_id": "\xff"}\n', "not UTF-8"),
    (b'{"reward": ' + b"1" * 5000 + b"}\n", "invalid JSON"),  # past Python's int digit limit
])
def test_line_errors_without_field(tmp_path: Path, content: bytes, reason: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + content)
    with pytest.raises(RecordError, match=f"^{path}:2: {reason}") as info:
        load_rollouts(path)
    assert info.value.field is None


def test_truncated_gzip_is_a_record_error(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl.gz"
    write_rollouts(path, _records() * 50)
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(RecordError, match=rf"^{path}:\d+: corrupt gzip data"):
        load_rollouts(path)


token_ids = st.lists(st.integers(0, MAX_TOKEN_ID), max_size=40)
records = st.builds(
    RolloutRecord,
    problem_id=st.text(min_size=1, max_size=20),
    policy_version=st.integers(0, 2**40),
    sample_index=st.integers(0, 2**20),
    prompt_token_ids=token_ids.filter(bool).map(tuple),
    output_token_ids=token_ids.map(tuple),
    finish_reason=st.none() | st.text(max_size=10),
    reward=st.none() | st.floats(allow_nan=False, allow_infinity=False),
)


@settings(max_examples=60, deadline=None)
@given(recs=st.lists(records, max_size=8), gz=st.booleans())
def test_round_trip_property(tmp_path_factory: pytest.TempPathFactory, recs: list[RolloutRecord],
                             gz: bool) -> None:
    path = tmp_path_factory.mktemp("prop") / ("h.jsonl.gz" if gz else "h.jsonl")
    assert write_rollouts(path, recs) == len(recs)
    back = load_rollouts(path)
    assert back == recs
    for a, b in zip(back, recs):  # -0.0 == 0.0, so compare the sign as well
        assert a.reward is None or math.copysign(1, a.reward) == math.copysign(1, b.reward)
    assert [RolloutRecord.from_dict(r.to_dict()) for r in recs] == recs


def _line(pid: str, version: int, n_out: int, reason: str | None, reward: float | None) -> str:
    d = {"problem_id": pid, "policy_version": version, "sample_index": 0, "prompt_token_ids": [1, 2, 3],
         "output_token_ids": [9] * n_out, "finish_reason": reason, "reward": reward}
    return json.dumps(d)


def _stats_file(path: Path) -> None:
    """Version 0: lengths 2 2 2 3 4 4 4 5 12 12 12 (problems a, b; the 12s end by 'length'; reward 1 below 5
    tokens else 0). Version 1: lengths 0 and 10 (problems a, c; no reward). Version 2: two empty outputs
    (problem d, no finish reason, reward 0.5). Values are chosen so that the quantiles are exact in binary."""
    lines = [_line("ab"[i % 2], 0, n, "length" if n == 12 else "stop", 1.0 if n < 5 else 0.0)
             for i, n in enumerate([2, 2, 2, 3, 4, 4, 4, 5, 12, 12, 12])]
    lines += [_line("a", 1, 0, "stop", None), _line("c", 1, 10, "stop", None)]
    lines += [_line("d", 2, 0, None, 0.5), _line("d", 2, 0, None, 0.5)]
    path.write_text("\n".join(lines) + "\n")


def test_history_stats_known_values(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    _stats_file(path)
    s = history_stats(path)
    assert (s.rollouts, s.problems, s.policy_versions) == (15, 4, 3)
    assert (s.prompt_tokens, s.output_tokens) == (45, 72)
    assert s.finish_reasons == {"stop": 10, "length": 3}
    assert s.mean_reward == 8 / 13

    v0, v1, v2 = s.versions
    assert (v0.policy_version, v0.rollouts, v0.problems, v0.mean_reward) == (0, 11, 2, 7 / 11)
    assert dataclasses.astuple(v0.output_lengths) == (2, 2.0, 4.0, 12.0, 12.0, 12, 62 / 11, 3.0)
    assert (v1.policy_version, v1.rollouts, v1.problems, v1.mean_reward) == (1, 2, 2, None)
    # Two values: linear interpolation between them; median 5, so max / median = 2.
    assert dataclasses.astuple(v1.output_lengths) == (0, 1.0, 5.0, 9.0, 9.9, 10, 5.0, 2.0)
    assert (v2.rollouts, v2.problems, v2.mean_reward) == (2, 1, 0.5)
    assert v2.output_lengths.straggler_ratio is None  # median 0: no ratio

    # Pooled: 0 0 0 2 2 2 3 4 4 4 5 10 12 12 12.
    assert dataclasses.astuple(s.output_lengths) == (0, 0.0, 4.0, 12.0, 12.0, 12, 4.8, 3.0)
    assert s.mean_straggler_ratio == 2.5  # mean of the per-batch ratios 3 and 2 (version 2 has none)

    d = json.loads(json.dumps(s.to_dict()))
    assert d["versions"][1]["output_lengths"]["p99"] == 9.9
    assert d["output_lengths"]["straggler_ratio"] == 3.0 and d["rollouts"] == 15


def test_history_stats_empty_file_and_print(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rich.console import Console

    (tmp_path / "e.jsonl").write_text("\n")
    s = history_stats(tmp_path / "e.jsonl")
    assert (s.rollouts, s.output_lengths, s.versions, s.mean_reward) == (0, None, (), None)
    json.dumps(s.to_dict())

    _stats_file(tmp_path / "h.jsonl")
    console = Console(record=True, width=100)
    history_stats(tmp_path / "h.jsonl").print(console)
    text = console.export_text()
    assert "max/p50" in text and "length" in text and "3.00" in text

    # Strings from the file that look like rich markup are shown as they are.
    monkeypatch.chdir(tmp_path)  # a short relative name: not wrapped at the console width
    write_rollouts("[red]m.jsonl", [RolloutRecord("p", 0, 0, (1,), (2,), "[/bold]x")])
    history_stats("[red]m.jsonl").print(console)
    text = console.export_text()
    assert "[/bold]x" in text and "[red]m.jsonl" in text


@pytest.mark.parametrize("name, problems, samples", [("traces-smollm2.jsonl.gz", 30, 8),
                                                     ("traces-qwen2.5-coder-0.5b.jsonl.gz", 15, 8),
                                                     ("traces-smollm2-66x16.jsonl.gz", 66, 16)])
def test_bundled_traces_hold_what_their_readme_says(name: str, problems: int, samples: int) -> None:
    """Three epochs of `samples` samples per problem, every rollout finished (stop or length) and within 1,024
    tokens."""
    records = load_rollouts(Path(__file__).parents[1] / "fixtures" / name)
    groups: dict[tuple[int, str], list[int]] = {}
    for r in records:
        groups.setdefault((r.policy_version, r.problem_id), []).append(r.sample_index)
    assert len(records) == problems * samples * 3 and len({pid for _, pid in groups}) == problems
    assert {v for v, _ in groups} == {0, 1, 2} and all(sorted(s) == list(range(samples)) for s in groups.values())
    assert all(r.finish_reason in ("stop", "length") and 0 < len(r.output_token_ids) <= 1024 for r in records)


def test_the_held_out_traces_hold_what_their_readme_says() -> None:
    """Two epochs of 4 samples of each of the 10 prompts of heldout-code-prompts.jsonl, unscored, within 320 tokens."""
    fixtures = Path(__file__).parents[1] / "fixtures"
    records = load_rollouts(fixtures / "traces-heldout-qwen2.5-coder-code.jsonl.gz")
    lines = (fixtures / "heldout-code-prompts.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["problem_id"] for line in lines if line]
    assert len(records) == 80 and sorted({r.problem_id for r in records}) == sorted(prompts) and len(prompts) == 10
    assert sorted({(r.policy_version, r.sample_index) for r in records}) == [(v, i) for v in (0, 1) for i in range(4)]
    assert all(r.reward is None and 0 < len(r.output_token_ids) <= 320 for r in records)
