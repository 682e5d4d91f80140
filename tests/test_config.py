"""The config surface: unknown or malformed COMMLIB_* variables raise; argument > environment >
default."""

import pytest

import commlib
from commlib import config


def test_typo_names_the_closest_option(monkeypatch):
    monkeypatch.setenv("COMMLIB_TIMEOUTT", "5")
    with pytest.raises(commlib.CommConfigError, match="COMMLIB_TIMEOUTT.*did you mean COMMLIB_TIMEOUT"):
        config.check_environment()


def test_malformed_value(monkeypatch):
    monkeypatch.setenv("COMMLIB_TIMEOUT", "soon")
    with pytest.raises(commlib.CommConfigError, match="COMMLIB_TIMEOUT='soon' is malformed"):
        config.get("timeout")
    monkeypatch.setenv("COMMLIB_TIMEOUT_MODE", "explode")
    with pytest.raises(commlib.CommConfigError, match="'abort' or 'raise'"):
        config.get("timeout_mode")


def test_precedence(monkeypatch):
    assert config.get("timeout") == 600.0
    monkeypatch.setenv("COMMLIB_TIMEOUT", "7")
    assert config.get("timeout") == 7.0
    assert config.get("timeout", 3) == 3
    monkeypatch.setenv("COMMLIB_TIMEOUT", "0")
    assert config.get("timeout") is None
    monkeypatch.setenv("COMMLIB_DEBUG", "yes")
    assert config.get("debug") is True


def test_init_applies_precedence(monkeypatch):
    monkeypatch.setenv("COMMLIB_TIMEOUT", "9")
    monkeypatch.setenv("COMMLIB_DEBUG", "1")
    try:
        world = commlib.init(backend="self", timeout=4)
        assert world.timeout == 4 and world.debug is True
    finally:
        commlib.finalize()


def test_unknown_backend():
    with pytest.raises(commlib.CommBackendError, match="'backend' = 'ucx'.*one of"):
        commlib.init(backend="ucx")
