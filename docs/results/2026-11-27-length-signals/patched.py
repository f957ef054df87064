"""The package's `simulate_batch` with lines of its source replaced, for this folder's prototypes: each differs from
the package only by its edits, each asserted to match exactly one line of today's source."""
import inspect
from collections.abc import Callable
from typing import Any

from das.scheduler import simulator


def patched_simulate_batch(*edits: tuple[str, str], **names: Any) -> Callable[..., Any]:
    """simulate_batch with every (old, new) line edit applied; `names`: globals the new lines read."""
    source = inspect.getsource(simulator.simulate_batch)
    for old, new in edits:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    namespace = {**vars(simulator), **names}
    exec(compile(source, simulator.__file__, "exec"), namespace)
    return namespace["simulate_batch"]


def simulate_with(batch_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> simulator.ArmResult:
    """`simulator.simulate(*args, **kwargs)` with `batch_fn` as its simulate_batch."""
    original = simulator.simulate_batch
    simulator.simulate_batch = batch_fn
    try:
        return simulator.simulate(*args, **kwargs)
    finally:
        simulator.simulate_batch = original
