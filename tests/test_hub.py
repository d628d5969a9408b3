"""owai.hub (whether the Hugging Face hub can be reached; hub datasets from the local cache alone
when it cannot) and owai.errors.one_line (an exception as one message line)."""

from __future__ import annotations

import sys
import time
import types

import pytest

from owai import hub
from owai.errors import DataMissing, OwaiError, one_line

UNREACHABLE = "the hub (huggingface.co) is unreachable (test)"


def test_one_line():
    assert one_line(ValueError("first\n\n  second")) == "ValueError: first"
    assert one_line(ValueError("")) == "ValueError"  # an empty message: the type, never an IndexError
    assert one_line(ValueError("\n  \n")) == "ValueError"
    assert one_line(OwaiError("already for the user\nmore")) == "already for the user"  # no type prefix
    assert one_line(RuntimeError("x" * 500), 50) == "RuntimeError: " + "x" * 33 + "..."
    assert len(one_line(RuntimeError("x" * 500), 50)) == 50
    assert one_line(RuntimeError("x" * 500), None).endswith("x" * 500)


def _stand_in_datasets(monkeypatch, seen: list) -> None:
    """A `datasets` module whose load_dataset records the offline flags it runs under."""
    import huggingface_hub.constants as constants

    config = types.SimpleNamespace(HF_HUB_OFFLINE=False, HF_DATASETS_OFFLINE=False)

    def load_dataset(path, *args, **kwargs):
        seen.append((path, args, kwargs, config.HF_HUB_OFFLINE, config.HF_DATASETS_OFFLINE, constants.HF_HUB_OFFLINE))
        if path == "cached/set":
            return {"train": [1, 2]}
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub\nsecond line")

    module = types.SimpleNamespace(load_dataset=load_dataset, config=config)
    monkeypatch.setitem(sys.modules, "datasets", module)
    monkeypatch.setitem(sys.modules, "datasets.config", config)


def test_unreachable_hub_reads_the_cache_alone(monkeypatch):
    import huggingface_hub.constants as constants

    seen: list = []
    _stand_in_datasets(monkeypatch, seen)
    monkeypatch.setattr(hub, "hub_unreachable", lambda: UNREACHABLE)
    before = constants.HF_HUB_OFFLINE
    assert hub.load_dataset("cached/set", "cfg", split="train", what="x") == {"train": [1, 2]}
    assert seen[-1] == ("cached/set", ("cfg",), {"split": "train"}, True, True, True)  # offline while loading
    with pytest.raises(DataMissing) as e:
        hub.load_dataset("nobody/missing", what="dataset 'nobody/missing'", hint="; use a local path")
    assert str(e.value) == ("cannot load dataset 'nobody/missing' from the Hugging Face hub (ConnectionError: "
                            f"Couldn't reach 'nobody/missing' on the Hub; read from the local cache only: {UNREACHABLE}); "
                            "use a local path")
    assert sys.modules["datasets.config"].HF_HUB_OFFLINE is False  # restored, also after a failure
    assert constants.HF_HUB_OFFLINE == before


def test_reachable_hub_is_asked(monkeypatch):
    seen: list = []
    _stand_in_datasets(monkeypatch, seen)
    monkeypatch.setattr(hub, "hub_unreachable", lambda: "")
    with pytest.raises(DataMissing, match=r"^cannot load y from the Hugging Face hub \(ConnectionError: Couldn't reach "
                                          r"'nobody/missing' on the Hub\)$"):
        hub.load_dataset("nobody/missing", what="y")
    assert seen[-1][3:5] == (False, False)  # not forced offline


def test_a_local_path_is_not_probed(monkeypatch, tmp_path):
    seen: list = []
    _stand_in_datasets(monkeypatch, seen)

    def probe():
        raise AssertionError("a local folder needs no hub")

    monkeypatch.setattr(hub, "hub_unreachable", probe)
    with pytest.raises(DataMissing):
        hub.load_dataset(str(tmp_path), what="z")
    assert seen[-1][0] == str(tmp_path)


def test_offline_mode_is_read_at_call_time(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    assert not hub.offline_mode()
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # set after the clients were imported
    assert hub.offline_mode() == "HF_DATASETS_OFFLINE"
    assert hub.hub_unreachable() == "Hugging Face offline mode is set (HF_DATASETS_OFFLINE)"


def test_behind_a_proxy_the_clients_are_left_to_ask(monkeypatch, behind_a_proxy):
    """A node that reaches the hub only through HTTPS_PROXY: no direct connection is tried."""
    for name in hub.OFFLINE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    assert hub.hub_unreachable() == ""
    monkeypatch.setenv("NO_PROXY", "huggingface.co")  # the hub bypasses the proxy: probed directly
    monkeypatch.setattr(hub, "_probe", lambda host, port: f"{host}:{port}")
    assert hub.hub_unreachable() == "huggingface.co:443"


def test_real_datasets_fails_at_once_without_the_hub(monkeypatch):
    """With the installed `datasets`, an id that is not cached fails without its retries (20-30 s
    without a network) when the hub cannot be reached."""
    pytest.importorskip("datasets")
    monkeypatch.setattr(hub, "hub_unreachable", lambda: UNREACHABLE)
    start = time.monotonic()
    with pytest.raises(DataMissing, match=r"owai-no-such-org/no-such-set.*read from the local cache only: the hub"):
        hub.load_dataset("owai-no-such-org/no-such-set", what="'owai-no-such-org/no-such-set'")
    assert time.monotonic() - start < 5
