"""The config surface: unknown or malformed COMMLIB_* variables raise (at commlib.init too), and
every option resolves argument > environment > default."""

import os

import pytest

import commlib
from commlib import config


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for key in [k for k in os.environ if k.startswith("COMMLIB_")]:
        monkeypatch.delenv(key)
    commlib.finalize()
    yield
    commlib.finalize()


def test_typo_names_the_closest_option(monkeypatch):
    monkeypatch.setenv("COMMLIB_TIMEOUTT", "5")
    with pytest.raises(commlib.CommConfigError, match="COMMLIB_TIMEOUTT.*did you mean COMMLIB_TIMEOUT"):
        config.check_environment()


@pytest.mark.parametrize("typo, closest", [("COMMLIB_DEBGU", "COMMLIB_DEBUG"),
                                           ("COMMLIB_TIMEOUT_MOD", "COMMLIB_TIMEOUT_MODE"),
                                           ("COMMLIB_BAKCEND", "COMMLIB_BACKEND")])
def test_init_refuses_a_typo(monkeypatch, typo, closest):
    monkeypatch.setenv(typo, "1")
    with pytest.raises(commlib.CommConfigError) as info:
        commlib.init(backend="self")
    text = str(info.value)
    assert f"unknown environment variable {typo}" in text and f"did you mean {closest}?" in text, text
    assert "Fix:" in text
    assert not commlib.is_initialized()


def test_unrelated_typo_points_to_the_table(monkeypatch):
    monkeypatch.setenv("COMMLIB_ZZZZZZZZ", "1")
    with pytest.raises(commlib.CommConfigError, match="see docs/configuration.md"):
        config.check_environment()


@pytest.mark.parametrize("var, value, rule", [
    ("COMMLIB_TIMEOUT", "soon", "could not convert"),
    ("COMMLIB_TIMEOUT", "2s", "could not convert"),
    ("COMMLIB_TIMEOUT", "-1", "must be >= 0 seconds"),
    ("COMMLIB_DEBUG", "maybe", "1/0, true/false"),
    ("COMMLIB_TIMEOUT_MODE", "explode", "'abort' or 'raise'"),
    ("COMMLIB_LOG", "LOUD", "DEBUG, INFO, WARNING or ERROR"),
    ("COMMLIB_SHM_STREAM_BYTES", "lots", "is not a size in bytes"),
    ("COMMLIB_SHM_STREAM_BYTES", "0.1K", "not a whole number of bytes"),
    ("COMMLIB_SHM_STREAM_BYTES", "inf", "not a whole number of bytes"),
    ("COMMLIB_SHM_SLOT_BYTES", "6K", "multiple of 4096"),
])
def test_malformed_value_raises_at_init(monkeypatch, var, value, rule):
    monkeypatch.setenv(var, value)
    with pytest.raises(commlib.CommConfigError) as info:
        commlib.init(backend="self")
    text = str(info.value)
    assert f"{var}={value!r} is malformed" in text and rule in text and "Fix:" in text, text


@pytest.mark.parametrize("text, value", [("4096", 4096), ("64K", 65536), ("16m", 16 << 20),
                                         ("1MiB", 1 << 20), ("2MB", 2 << 20), ("1G", 1 << 30),
                                         ("1.5K", 1536)])
def test_byte_sizes_take_binary_units(monkeypatch, text, value):
    assert config.parse_bytes(text) == value
    monkeypatch.setenv("COMMLIB_SHM_STREAM_BYTES", text)
    assert config.get("shm_stream_bytes") == value


def test_precedence_argument_environment_default(monkeypatch):
    assert config.get("timeout") == 600.0 and config.get("debug") is False
    assert config.get("timeout_mode") == "abort"
    monkeypatch.setenv("COMMLIB_TIMEOUT", "7")
    monkeypatch.setenv("COMMLIB_DEBUG", "yes")
    monkeypatch.setenv("COMMLIB_TIMEOUT_MODE", "RAISE")
    assert config.get("timeout") == 7.0 and config.get("debug") is True
    assert config.get("timeout_mode") == "raise"
    assert config.get("timeout", 3) == 3 and config.get("debug", False) is False
    assert config.get("timeout_mode", "abort") == "abort"
    monkeypatch.setenv("COMMLIB_TIMEOUT", "0")
    assert config.get("timeout") is None  # 0 disables


def test_init_defaults():
    world = commlib.init(backend="self")
    assert world.timeout == 600.0 and world.debug is False and world.blocking is True


def test_init_environment_over_default(monkeypatch):
    monkeypatch.setenv("COMMLIB_TIMEOUT", "9")
    monkeypatch.setenv("COMMLIB_DEBUG", "1")
    monkeypatch.setenv("COMMLIB_TIMEOUT_MODE", "raise")
    world = commlib.init(backend="self")
    assert world.timeout == 9.0 and world.debug is True and world.blocking is False
    assert commlib.new_group().timeout == 9.0  # groups inherit the world's
    assert commlib.new_group(timeout=2).timeout == 2  # the argument wins


def test_init_argument_over_environment(monkeypatch):
    monkeypatch.setenv("COMMLIB_TIMEOUT", "9")
    monkeypatch.setenv("COMMLIB_DEBUG", "1")
    monkeypatch.setenv("COMMLIB_TIMEOUT_MODE", "raise")
    world = commlib.init(backend="self", timeout=4, debug=False, timeout_mode="abort")
    assert world.timeout == 4 and world.debug is False and world.blocking is True
    commlib.finalize()
    assert commlib.init(backend="self", timeout=0).timeout is None  # 0 disables, even over env


def test_backend_from_environment(monkeypatch):
    monkeypatch.setenv("COMMLIB_BACKEND", "self")
    assert commlib.init().backend.name == "self"
    commlib.finalize()
    monkeypatch.setenv("COMMLIB_BACKEND", "ucx")
    with pytest.raises(commlib.CommBackendError, match=r"'backend' = 'ucx': no such backend\. "
                                                       r"Fix: use one of \[.*'mpi'.*'self'"):
        commlib.init()


def test_unknown_backend_argument():
    with pytest.raises(commlib.CommBackendError, match="'backend' = 'ucx'.*one of"):
        commlib.init(backend="ucx")


def test_every_option_is_in_the_table():
    table = config.markdown_table()
    for option in config.OPTIONS.values():
        assert f"`{option.env}`" in table and f"`{option.name}`" in table


def test_forced_algorithm_name_is_checked(monkeypatch):
    monkeypatch.setenv("COMMLIB_ALGO", "ringg")
    with pytest.raises(commlib.CommConfigError) as info:
        commlib.init(backend="self")
    text = str(info.value)
    assert "COMMLIB_ALGO='ringg' is malformed" in text and "did you mean 'ring'?" in text, text
    assert "'rabenseifner'" in text and "Fix:" in text
    monkeypatch.setenv("COMMLIB_ALGO", "ring")
    assert config.get("algo") == "ring"
