"""The checkpoint format: round trip, atomic commit, checksum verification, retention."""

from __future__ import annotations

import json

import pytest
import torch

from owai.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from owai.errors import OwaiError
from owai.models.moon_memory import MoonMemory, MoonMemoryConfig
from owai.optim import MLXAdamW


def trained_state():
    torch.manual_seed(0)
    model = MoonMemory(MoonMemoryConfig(n_heads=3))
    opt = MLXAdamW(model.parameters(), lr=1e-2)
    x = torch.randn(2, 10, 6)
    model(x).square().mean().backward()
    opt.step()
    return model, opt


def test_round_trip_restores_model_optimizer_and_rng(tmp_path):
    model, opt = trained_state()
    rng = torch.get_rng_state()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "torch_rng": rng, "recent": [0.5, 0.25]}
    path = save_checkpoint(tmp_path, 7, state)
    step, loaded = load_checkpoint(path)
    assert step == 7 and loaded["recent"] == [0.5, 0.25]
    model2, opt2 = MoonMemory(MoonMemoryConfig(n_heads=3)), None
    model2.load_state_dict(loaded["model"])
    opt2 = MLXAdamW(model2.parameters(), lr=1.0)
    opt2.load_state_dict(loaded["optimizer"])
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    assert opt2.param_groups[0]["lr"] == 1e-2
    for p1, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(opt.state[p1]["m"], opt2.state[p2]["m"])
    assert torch.equal(loaded["torch_rng"], rng)
    assert (path / "tensors.safetensors").is_file() and (path / "state.json").is_file()


def test_retention_and_latest(tmp_path):
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, {"x": torch.tensor([step])}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000003", "step-000004"]
    assert latest_checkpoint(tmp_path).name == "step-000004"


def test_uncommitted_temporary_checkpoint_is_ignored(tmp_path):
    save_checkpoint(tmp_path, 5, {"x": torch.zeros(2)})
    (tmp_path / ".tmp-step-000010-abc").mkdir()  # what a kill during a save leaves behind
    assert latest_checkpoint(tmp_path).name == "step-000005"


def test_corrupted_tensors_fail_checksum(tmp_path):
    path = save_checkpoint(tmp_path, 1, {"x": torch.arange(100.0)})
    blob = bytearray((path / "tensors.safetensors").read_bytes())
    blob[-5] ^= 0xFF
    (path / "tensors.safetensors").write_bytes(bytes(blob))
    with pytest.raises(OwaiError, match="corrupt: tensors.safetensors does not match its sha256"):
        load_checkpoint(path)


def test_corrupted_or_missing_state_json(tmp_path):
    path = save_checkpoint(tmp_path, 1, {"x": torch.zeros(1)})
    (path / "state.json").write_text("{not json")
    with pytest.raises(OwaiError, match="state.json is not valid JSON"):
        load_checkpoint(path)
    (path / "state.json").unlink()
    with pytest.raises(OwaiError, match="incomplete"):
        load_checkpoint(path)


def test_foreign_file_is_rejected(tmp_path):
    path = save_checkpoint(tmp_path, 1, {"x": torch.zeros(1)})
    (path / "state.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(OwaiError, match="not an owai-checkpoint-v1"):
        load_checkpoint(path)


def test_runtime_device_dtype_and_seeds():
    from owai import runtime
    from owai.config import BaseConfig, Runtime, build

    assert runtime.derive_seed(1, "train", 5) == runtime.derive_seed(1, "train", 5)
    assert runtime.derive_seed(1, "train", 5) != runtime.derive_seed(1, "train", 6)
    a = torch.rand(3, generator=runtime.generator(7, "x"))
    assert torch.equal(a, torch.rand(3, generator=runtime.generator(7, "x")))
    with runtime.applied(Runtime(device="cpu", dtype="bfloat16"), seed=3) as (device, dtype):  # the test process's own settings after
        assert device.type == "cpu" and dtype is torch.bfloat16
    with runtime.autocast(device, dtype):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype is torch.bfloat16
    with runtime.autocast(device, torch.float32):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype is torch.float32
    if not torch.cuda.is_available():
        with pytest.raises(OwaiError, match="no CUDA device"):
            runtime.select_device("cuda")
    with pytest.raises(OwaiError, match=r"^params\.runtime\.threads must be between 0 and 1,024, got -1$"):  # refused when built
        build(BaseConfig, {"runtime": {"threads": -1}})


def test_checkpoint_files_are_readable_by_others(tmp_path):
    import os
    import stat

    from owai.io import umask

    path = save_checkpoint(tmp_path, 1, {"x": torch.zeros(1)})
    expected = 0o666 & ~umask()
    for f in (path / "state.json", path / "tensors.safetensors"):
        assert stat.S_IMODE(os.stat(f).st_mode) == expected
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o777 & ~umask()


def test_non_finite_checkpoint_with_a_rewritten_checksum_is_refused(tmp_path):
    """A checksum proves the bytes are the ones written, not that they are usable: NaN weights
    (here with a matching sha256, as in the audit) are refused on load, and never written."""
    import hashlib
    import math

    from safetensors.torch import load_file, save_file

    from owai.checkpoint import NonFiniteError

    model, opt = trained_state()
    path = save_checkpoint(tmp_path, 4, {"model": model.state_dict(), "optimizer": opt.state_dict()})
    tensors = load_file(str(path / "tensors.safetensors"))
    tensors["state/model/key.r"][0, 0] = math.nan
    save_file(tensors, str(path / "tensors.safetensors"))
    meta = json.loads((path / "state.json").read_text())
    meta["sha256"] = hashlib.sha256((path / "tensors.safetensors").read_bytes()).hexdigest()
    (path / "state.json").write_text(json.dumps(meta))
    with pytest.raises(NonFiniteError, match=r"step-000004 holds non-finite values \(state/model/key.r\)"):
        load_checkpoint(path)
    with pytest.raises(NonFiniteError, match="refusing to write checkpoint"):
        save_checkpoint(tmp_path, 5, {"model": {"w": torch.tensor([math.inf])}})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000004"]


def test_identity_is_recorded_and_checked(tmp_path):
    from owai.checkpoint import recorded_identity

    identity = {"recipe": "three-moons", "stage": "heads3-r0", "model": {"w": [3, 3]}}
    path = save_checkpoint(tmp_path, 2, {"w": torch.zeros(3, 3)}, identity=identity)
    assert recorded_identity(path) == identity
    assert load_checkpoint(path, expect=identity)[0] == 2
    with pytest.raises(OwaiError, match="written by stage 'heads3-r0', not 'heads1-r0'"):
        load_checkpoint(path, expect={**identity, "stage": "heads1-r0"})
    with pytest.raises(OwaiError, match=r"another shape: w is \[3, 3\] there, \[1, 3\] here"):
        load_checkpoint(path, expect={**identity, "model": {"w": [1, 3]}})
