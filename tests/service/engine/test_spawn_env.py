"""restored_environ (service/engine/spawn_env.py): whatever happens inside, the named variables come back."""

from __future__ import annotations

import os

import pytest

from das.service.engine.spawn_env import restored_environ


def test_set_and_unset_variables_come_back_even_after_an_error(monkeypatch):
    monkeypatch.setenv("DAS_TEST_KEPT", "before")
    monkeypatch.delenv("DAS_TEST_ABSENT", raising=False)
    with pytest.raises(RuntimeError), restored_environ(["DAS_TEST_KEPT", "DAS_TEST_ABSENT"]):
        os.environ["DAS_TEST_KEPT"] = "inside"
        os.environ["DAS_TEST_ABSENT"] = "inside"
        raise RuntimeError("the engine failed to start")
    assert os.environ["DAS_TEST_KEPT"] == "before" and "DAS_TEST_ABSENT" not in os.environ
    with restored_environ(["DAS_TEST_KEPT"]):
        del os.environ["DAS_TEST_KEPT"]
    assert os.environ["DAS_TEST_KEPT"] == "before"
