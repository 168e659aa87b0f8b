"""The installed distribution declares our entry points, they import cleanly, and a failure in
them is logged at ERROR level and re-raised (verl itself only logs plugin errors at debug)."""

import logging
from importlib.metadata import entry_points

import pytest

from verl_quads._plugin_errors import loud


@pytest.mark.parametrize(
    "group, value",
    [
        ("verl.plugins", "verl_quads.integration.verl_plugin:load"),
        ("vllm.general_plugins", "verl_quads.rollout.vllm_plugin:register"),
        ("console_scripts", "verl_quads.cli:main"),
    ],
)
def test_entry_point_declared_and_loads(group, value):
    eps = [ep for ep in entry_points(group=group) if ep.value == value]
    assert eps, f"verl-quads is not installed with the {group} entry point {value}"
    assert callable(eps[0].load())


def test_loud_logs_error_and_reraises(caplog):
    @loud("test plugin")
    def broken():
        raise ImportError("boom")

    with caplog.at_level(logging.DEBUG, logger="verl_quads"):
        with pytest.raises(ImportError, match="boom"):
            broken()
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert errors and "test plugin failed to load" in errors[0].getMessage() and errors[0].exc_info
