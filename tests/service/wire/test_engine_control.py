"""One control message for vLLM's RL control verbs: parsed by its verb, its arguments the engine method's, its
replies combined as the verb says."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter, ValidationError

from das.service.wire.engine_control import AbortSamples, EngineControl, IsPaused, Pause, Resume

CONTROL: TypeAdapter[EngineControl] = TypeAdapter(EngineControl)


@pytest.mark.parametrize("data, kind, arguments", [
    ({"verb": "pause", "mode": "keep", "clear_cache": False}, Pause, {"mode": "keep", "clear_cache": False}),
    ({"verb": "pause"}, Pause, {"mode": "abort", "clear_cache": True}),
    ({"verb": "resume"}, Resume, {}),
    ({"verb": "is_paused"}, IsPaused, {}),
    ({"verb": "abort_samples"}, AbortSamples, {}),
])
def test_a_message_is_its_verb_with_the_engine_methods_arguments(data, kind, arguments) -> None:
    message = CONTROL.validate_python(data)
    assert type(message) is kind and message.arguments() == arguments
    assert CONTROL.validate_python(message.model_dump()) == message  # what crosses to an engine actor comes back


@pytest.mark.parametrize("data", [{"verb": "reboot"}, {"verb": "pause", "mode": "later"},
                                  {"verb": "resume", "mode": "keep"}])
def test_an_unknown_verb_mode_or_argument_is_refused(data) -> None:
    with pytest.raises(ValidationError):
        CONTROL.validate_python(data)


def test_replies_combine_as_the_verb_says() -> None:
    assert IsPaused.combine([False, True]) is True and IsPaused.combine([False, False]) is False
    assert AbortSamples.combine([2, 0, 3]) == 5
    assert Pause().combine([None, None]) is None and Resume().combine([]) is None
