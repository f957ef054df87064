"""Checks for the bundled code tasks (`service/client/code_tasks.py`): a test per task, and the tool an agent calls to run
them.

`CODE_TASK_TESTS[name]` is Python source of plain `assert` statements against the task's function (or class); it
runs after the model's code in a fresh interpreter (`python -I`, its own temporary directory, a wall-clock
timeout), so a reply that loops, exits or crashes cannot harm the caller. `check_code` turns a model's reply into
a `CodeCheck`: passed, and the failures as text short enough to hand back to the model as a tool's output.
"""

from __future__ import annotations

import asyncio
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from das.service.client.code_tasks import CODE_TASKS

CODE_TASK_TESTS: dict[str, str] = {
    "running_median": """
assert running_median([5, 15, 1, 3]) == [5, 10.0, 5, 4.0]
assert running_median([]) == []
assert running_median([2]) == [2]
assert running_median([3, 1, 2]) == [3, 2.0, 2]
""",
    "merge_intervals": """
assert merge_intervals([(1, 3), (2, 6), (8, 10), (15, 18)]) == [(1, 6), (8, 10), (15, 18)]
assert merge_intervals([]) == []
assert merge_intervals([(5, 7), (1, 2), (2, 4)]) == [(1, 4), (5, 7)]
assert merge_intervals([(1, 10), (2, 3)]) == [(1, 10)]
""",
    "roman_to_int": """
assert roman_to_int("MCMXCIV") == 1994
assert roman_to_int("III") == 3
assert roman_to_int("XLII") == 42
assert roman_to_int("CDXLIV") == 444
""",
    "word_frequencies": """
assert word_frequencies("the cat and the hat", 2) == [('the', 2), ('and', 1)]
assert word_frequencies("B b a A c", 3) == [('a', 2), ('b', 2), ('c', 1)]
assert word_frequencies("It's it's IT'S", 1) == [("it's", 3)]
assert word_frequencies("", 3) == []
""",
    "balanced_brackets": """
assert balanced_brackets("f(a[1]) {x}") is True
assert balanced_brackets("(]") is False
assert balanced_brackets("") is True
assert balanced_brackets("((") is False
assert balanced_brackets("{[()()]}") is True
""",
    "matrix_spiral": """
assert matrix_spiral([[1, 2, 3], [4, 5, 6], [7, 8, 9]]) == [1, 2, 3, 6, 9, 8, 7, 4, 5]
assert matrix_spiral([[1, 2], [3, 4], [5, 6]]) == [1, 2, 4, 6, 5, 3]
assert matrix_spiral([[7]]) == [7]
assert matrix_spiral([]) == []
""",
    "lru_cache_class": """
cache = LRUCache(2)
cache.put(1, 1); cache.put(2, 2)
assert cache.get(1) == 1
cache.put(3, 3)
assert cache.get(2) == -1
cache.put(4, 4)
assert cache.get(1) == -1 and cache.get(3) == 3 and cache.get(4) == 4
cache.put(3, 30)
assert cache.get(3) == 30
""",
    "dijkstra": """
assert shortest_paths({"a": [("b", 1), ("c", 4)], "b": [("c", 2)], "c": []}, "a") == {'a': 0, 'b': 1, 'c': 3}
assert shortest_paths({"a": [], "b": [("a", 1)]}, "a") == {'a': 0}
assert shortest_paths({"s": [("t", 5), ("u", 1)], "u": [("t", 1)], "t": []}, "s") == {'s': 0, 'u': 1, 't': 2}
""",
    "parse_duration": """
assert parse_duration("1h30m") == 5400
assert parse_duration("45s") == 45
assert parse_duration("2d 4h") == 187200
assert parse_duration("30m1h") == 5400
for bad in ("", "5x", "h"):
    try:
        parse_duration(bad)
    except ValueError:
        pass
    else:
        raise AssertionError(f"parse_duration({bad!r}) did not raise ValueError")
""",
    "csv_column_stats": """
assert column_stats("a,b\\n1,x\\n3,y\\n", "a") == {'count': 2, 'mean': 2.0, 'min': 1.0, 'max': 3.0}
assert column_stats("a,b\\n1,x\\nn/a,y\\n5,z\\n", "a") == {'count': 2, 'mean': 3.0, 'min': 1.0, 'max': 5.0}
try:
    column_stats("a,b\\n1,2\\n", "c")
except KeyError:
    pass
else:
    raise AssertionError("a missing column did not raise KeyError")
""",
    "longest_common_subsequence": """
assert len(longest_common_subsequence("ABCBDAB", "BDCABA")) == 4
assert longest_common_subsequence("abc", "abc") == "abc"
assert longest_common_subsequence("abc", "def") == ""
lcs = longest_common_subsequence("AGGTAB", "GXTXAYB")
assert lcs == "GTAB"
""",
    "flatten_json": """
assert flatten_json({"a": {"b": 1, "c": [2, 3]}}) == {'a.b': 1, 'a.c.0': 2, 'a.c.1': 3}
assert flatten_json({}) == {}
assert flatten_json({"x": [{"y": 1}]}) == {'x.0.y': 1}
""",
}

_CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


@dataclass(frozen=True)
class CodeCheck:
    """A reply's test outcome. `feedback`: what the tool hands back to the model (the failing assertion or error,
    at most `max_feedback_chars` of it); empty when `passed`."""

    passed: bool
    feedback: str


def extract_code(reply: str) -> str:
    """The Python code of a model's reply: its code blocks joined (an unclosed last block counts), else the reply
    itself."""
    blocks = _CODE_BLOCK.findall(reply)
    return "\n\n".join(blocks) if blocks else reply


async def check_code(task_name: str, reply: str, timeout_s: float = 10.0, max_feedback_chars: int = 800) -> CodeCheck:
    """Run task `task_name`'s tests against the code in `reply` in a fresh interpreter, at most `timeout_s` seconds
    of wall clock (then killed: the feedback says so). Raises KeyError for a task without tests."""
    tests = CODE_TASK_TESTS[task_name]
    program = extract_code(reply) + "\n\n" + tests
    with tempfile.TemporaryDirectory(prefix="das-check-") as workdir:
        script = Path(workdir) / "check.py"
        script.write_text(program)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", str(script), cwd=workdir, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        try:
            output, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            return CodeCheck(False, f"the tests did not finish within {timeout_s:g} s (an endless loop?)")
        if proc.returncode == 0:
            return CodeCheck(True, "")
        # the traceback names the script by its temporary path: the same reply must get the same feedback (a
        # trajectory's next turn is its context plus this text, compared across speculation arms)
        text = output.decode(errors="replace").replace(workdir, "<tests>").strip() or f"exit status {proc.returncode}"
    # the end of a traceback names the failing line and the error: keep that end
    return CodeCheck(False, text[-max_feedback_chars:])


def code_task_names() -> list[str]:
    """The bundled tasks' names, in `CODE_TASKS` order (every one has tests)."""
    return [name for name, _ in CODE_TASKS]
