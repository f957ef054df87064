"""`das serve`'s configuration flags declared once over the configurations' fields (service/serve_flags.py): each
flag's type, default, bounds and help are its field's, its value lands on its field, and a value its field refuses
is refused naming the flag, before anything starts."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from das.service.cli import app
from das.service.config import GatewayConfig, ServiceConfig
from das.service.engine.config import EngineConfig
from das.service.serve_flags import SERVE_FLAGS, ConfigFlag, FlagValues, with_config_flags


def serve_params(*argv: str) -> dict:
    serve = typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]
    return serve.make_context("serve", list(argv)).params


def test_every_flag_defaults_to_its_field_and_shows_its_description():
    params = serve_params()
    serve = typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]
    options = {p.name: p for p in serve.params}
    for flag in SERVE_FLAGS:
        info = flag.field()
        expected = info.get_default() if flag.path != "engine.model" else "smollm2"
        assert params[flag.parameter] == expected, flag.name
        if info.description:
            assert info.description.split()[1] in options[flag.parameter].help, flag.name


def test_the_flags_values_land_on_their_fields():
    params = serve_params("--k", "4", "--max-restarts", "2", "--header-timeout", "5", "--history-shards", "3",
                          "--eager", "--tensor-parallel-size", "2", "--address", "auto")
    values = FlagValues(SERVE_FLAGS, {flag.parameter: params[flag.parameter] for flag in SERVE_FLAGS})
    engine = EngineConfig.model_validate(values.fields("engine"))
    assert (engine.num_speculative_tokens, engine.enforce_eager, engine.tensor_parallel_size) == (4, True, 2)
    service = ServiceConfig.model_validate({**values.fields("service"), "engine": engine.model_dump()})
    assert (service.failure.max_restarts, service.history.shards, service.address) == (2, 3, "auto")
    assert GatewayConfig.model_validate(values.fields("gateway")).header_timeout_s == 5
    assert values.fields("engine", stub=True) == {"tensor_parallel_size": 2}


def test_the_command_defaults_build_the_configurations_defaults():
    params = serve_params()
    values = FlagValues(SERVE_FLAGS, {flag.parameter: params[flag.parameter] for flag in SERVE_FLAGS})
    service = ServiceConfig.model_validate({**values.fields("service"), "engine": {"kind": "stub"}})
    assert service == ServiceConfig(engine={"kind": "stub"})
    assert GatewayConfig.model_validate(values.fields("gateway")) == GatewayConfig()


@pytest.mark.parametrize("argv, flag", [(["--restart-window", "0"], "--restart-window"),
                                        (["--snapshot-interval", "-1"], "--snapshot-interval"),
                                        (["--body-timeout", "0"], "--body-timeout"),
                                        (["--enable-auto-tool-choice"], "enable_auto_tool_choice requires")])
def test_a_value_its_field_refuses_is_refused_naming_the_flag(argv, flag):
    result = CliRunner().invoke(app, ["serve", "--port", "1", "--stub-engine", *argv])
    assert result.exit_code == 2
    assert " ".join(result.output.split()).startswith(f"error: {flag}"), result.output


def test_a_flag_naming_no_field_fails_where_it_is_declared():
    with pytest.raises(KeyError, match="service.failure.max_retries is not a configuration field"):
        with_config_flags([ConfigFlag("--max-retries", "service.failure.max_retries")])


def test_a_secret_flag_is_read_as_text_and_never_echoed():
    params = serve_params("--token", "s3cret")
    values = FlagValues(SERVE_FLAGS, {flag.parameter: params[flag.parameter] for flag in SERVE_FLAGS})
    settings = GatewayConfig.model_validate(values.fields("gateway"))
    assert settings.token is not None and settings.token.get_secret_value() == "s3cret"
    assert "s3cret" not in repr(settings)
