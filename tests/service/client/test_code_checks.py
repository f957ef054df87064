"""The code tasks' checks (service/client/code_checks.py): every task has tests, a right reply passes, a wrong one fails
with the failing assertion as feedback, an endless loop is killed at the timeout."""

from __future__ import annotations

import asyncio

import pytest

from das.service.client.code_checks import CODE_TASK_TESTS, check_code, code_task_names, extract_code

ROMAN = '''Here it is:
```python
def roman_to_int(numeral: str) -> int:
    values = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}
    total = 0
    for a, b in zip(numeral, numeral[1:] + " "):
        total += -values[a] if b != " " and values[a] < values[b] else values[a]
    return total
```
It walks the numeral once.'''


def test_every_task_has_tests():
    assert set(code_task_names()) == set(CODE_TASK_TESTS)


def test_extract_code_takes_the_blocks_or_the_whole_reply():
    assert extract_code(ROMAN).startswith("def roman_to_int") and "It walks" not in extract_code(ROMAN)
    assert extract_code("```python\nx = 1\n") == "x = 1\n"
    assert extract_code("x = 2") == "x = 2"


def test_a_right_reply_passes():
    assert asyncio.run(check_code("roman_to_int", ROMAN)).passed


def test_a_wrong_reply_fails_with_the_failing_assertion():
    check = asyncio.run(check_code("roman_to_int", "def roman_to_int(numeral):\n    return 1994\n"))
    assert not check.passed
    assert "AssertionError" in check.feedback and 'roman_to_int("III") == 3' in check.feedback


def test_the_same_reply_gets_the_same_feedback():
    """The traceback's script path is a fresh temporary directory each run; the feedback must not carry it, or
    the same trajectory diverges between runs (das bench agent compares arms turn by turn)."""
    reply = "def roman_to_int(numeral):\n    raise ValueError(numeral)\n"
    first, second = (asyncio.run(check_code("roman_to_int", reply)) for _ in range(2))
    assert first.feedback == second.feedback and "ValueError" in first.feedback
    assert "das-check-" not in first.feedback and '"<tests>/check.py"' in first.feedback


def test_an_endless_loop_is_killed_at_the_timeout():
    check = asyncio.run(check_code("roman_to_int", "while True:\n    pass\n", timeout_s=1.0))
    assert not check.passed and "did not finish within 1 s" in check.feedback


def test_a_task_without_tests_is_refused():
    with pytest.raises(KeyError):
        asyncio.run(check_code("no_such_task", ROMAN))
