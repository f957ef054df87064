"""The bundled code prompt set (`code:N`): HumanEval-style Python function completions written for this project.

Each task is a function signature with a docstring; the model is asked for the whole function. Outputs run from a
few lines to a page (some samples add an explanation), a mild length tail, unlike reasoning-gym's long repeating
stragglers: the workload on which speculation must not cost anything (issue 19). There is no checker: these
tasks are for speed benchmarks, and their rewards are None like a file prompt's.
"""

from __future__ import annotations

CODE_SYSTEM_PROMPT = ("You are an expert Python programmer. Complete the function the user gives. Reply with the "
                      "whole function in one Python code block.")

# (name, the function to complete); ids are `code/<name>`, in this order.
CODE_TASKS: tuple[tuple[str, str], ...] = (
    ("running_median", '''def running_median(values: list[float]) -> list[float]:
    """Return, for every prefix of `values`, the median of that prefix.
    >>> running_median([5, 15, 1, 3])
    [5, 10.0, 5, 4.0]
    """'''),
    ("merge_intervals", '''def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge overlapping closed intervals and return them sorted by start.
    >>> merge_intervals([(1, 3), (2, 6), (8, 10), (15, 18)])
    [(1, 6), (8, 10), (15, 18)]
    """'''),
    ("roman_to_int", '''def roman_to_int(numeral: str) -> int:
    """Convert a Roman numeral (I, V, X, L, C, D, M, with subtractive pairs) to an integer.
    >>> roman_to_int("MCMXCIV")
    1994
    """'''),
    ("word_frequencies", '''def word_frequencies(text: str, top: int) -> list[tuple[str, int]]:
    """Count the words of `text` (case-insensitive, letters and apostrophes only) and return the `top` most
    frequent as (word, count), ties broken alphabetically.
    >>> word_frequencies("the cat and the hat", 2)
    [('the', 2), ('and', 1)]
    """'''),
    ("balanced_brackets", '''def balanced_brackets(text: str) -> bool:
    """Whether every (, [ and { in `text` is closed by the matching bracket in the right order; other characters
    are ignored.
    >>> balanced_brackets("f(a[1]) {x}")
    True
    >>> balanced_brackets("(]")
    False
    """'''),
    ("matrix_spiral", '''def matrix_spiral(matrix: list[list[int]]) -> list[int]:
    """Return the elements of a rectangular matrix in clockwise spiral order, starting at the top left.
    >>> matrix_spiral([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    [1, 2, 3, 6, 9, 8, 7, 4, 5]
    """'''),
    ("lru_cache_class", '''class LRUCache:
    """A least-recently-used cache of at most `capacity` entries: `get(key)` returns the value or -1 and marks
    the key as used; `put(key, value)` inserts or updates and evicts the least recently used key when full.
    >>> cache = LRUCache(2); cache.put(1, 1); cache.put(2, 2); cache.get(1)
    1
    """

    def __init__(self, capacity: int) -> None:'''),
    ("dijkstra", '''def shortest_paths(graph: dict[str, list[tuple[str, float]]], source: str) -> dict[str, float]:
    """Dijkstra's algorithm: the length of the shortest path from `source` to every node reachable from it.
    `graph` maps a node to its (neighbour, non-negative edge weight) pairs.
    >>> shortest_paths({"a": [("b", 1), ("c", 4)], "b": [("c", 2)], "c": []}, "a")
    {'a': 0, 'b': 1, 'c': 3}
    """'''),
    ("parse_duration", '''def parse_duration(text: str) -> int:
    """Parse a duration such as "1h30m", "45s" or "2d 4h" into seconds (units d, h, m, s; any order, optional
    spaces). Raise ValueError on anything else.
    >>> parse_duration("1h30m")
    5400
    """'''),
    ("csv_column_stats", '''def column_stats(csv_text: str, column: str) -> dict[str, float]:
    """Read CSV text with a header row and return the count, mean, min and max of the numeric values in
    `column` (cells that are not numbers are skipped). Raise KeyError if the column is missing.
    >>> column_stats("a,b\\n1,x\\n3,y\\n", "a")
    {'count': 2, 'mean': 2.0, 'min': 1.0, 'max': 3.0}
    """'''),
    ("longest_common_subsequence", '''def longest_common_subsequence(a: str, b: str) -> str:
    """Return one longest common subsequence of `a` and `b` (dynamic programming, O(len(a) * len(b))).
    >>> longest_common_subsequence("ABCBDAB", "BDCABA")
    'BCBA'
    """'''),
    ("flatten_json", '''def flatten_json(value: object, prefix: str = "") -> dict[str, object]:
    """Flatten nested dicts and lists into one dict whose keys are dotted paths (list items by index).
    >>> flatten_json({"a": {"b": 1, "c": [2, 3]}})
    {'a.b': 1, 'a.c.0': 2, 'a.c.1': 3}
    """'''),
)
