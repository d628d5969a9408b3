"""Chapter 2's named pretrained weights, checked before a study starts (owai.models.vision,
owai.models.hf_vision, owai.hub): torchvision names found in owai's or torch.hub's cache, refused in one
line where they are missing and cannot be downloaded, left to download where they can; SWAG's image
sizes; headers read instead of whole files; timm's ViT key names; Hugging Face hub ids whose weights
are not cached. Every weights file here is a few hundred KB, made in tmp_path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from owai import hub
from owai.errors import DataMissing, OwaiError
from owai.models import vision
from conftest import as_sets, cli_in_process

pytestmark = pytest.mark.usefixtures("one_thread")

URL = "https://download.pytorch.org/models/vit_mini_4-0123abcd.pth"  # a stand-in named weight of vit_mini_4
NAME = "TINY_V1"


@pytest.fixture
def named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Path]:
    """vit_mini_4 with two named weights (TINY_V1 at its 32 px, TINY_E2E at 48 px, as SWAG's E2E ViTs
    are larger than their architecture's 224), an empty owai cache and torch.hub directory."""
    monkeypatch.setitem(vision.WEIGHTS, "vit_mini_4", {NAME: URL, "TINY_E2E": URL.replace("4-0123", "4_e2e-0123")})
    monkeypatch.setitem(vision.WEIGHTS_IMAGE_SIZE, ("vit_mini_4", "TINY_E2E"), 48)
    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "owai-cache"))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    monkeypatch.delenv("https_proxy", raising=False)
    monkeypatch.delenv("ALL_PROXY", raising=False)
    monkeypatch.delenv("all_proxy", raising=False)
    return {"owai": tmp_path / "owai-cache" / "weights", "torch": tmp_path / "torch-home" / "hub" / "checkpoints"}


def _vit_file(path: Path, image_size: int = 32, classes: int = 1000) -> Path:
    """A torchvision-keyed vit_mini_4 state dict at `image_size` (.pth or .safetensors by suffix)."""
    torch.manual_seed(0)
    state = {k: v.contiguous() for k, v in vision.build_backbone("vit_mini_4", classes, image_size=image_size).state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path)) if path.suffix == ".safetensors" else torch.save(state, path)
    return path


def _unreachable(monkeypatch: pytest.MonkeyPatch, why: str = "test: no network") -> list[tuple[str, int]]:
    """download.pytorch.org (every host) unreachable; returns the connections tried."""
    tried: list[tuple[str, int]] = []
    monkeypatch.setattr(hub, "_connect", lambda host, port: tried.append((host, port)) or why)
    return tried


# -- torchvision names ---------------------------------------------------------------------------------


def test_a_named_weight_not_cached_and_not_downloadable_is_one_line_naming_where_it_was_looked_for(named, monkeypatch):
    tried = _unreachable(monkeypatch)
    with pytest.raises(DataMissing) as e:
        vision.check_weights("vit_mini_4", NAME)
    message = str(e.value)
    assert "\n" not in message and "weights TINY_V1 of vit_mini_4 are not on this machine" in message
    assert f"in {named['owai']} and {named['torch']}" in message and "vit_mini_4-0123abcd.pth" in message
    assert "download.pytorch.org is unreachable (test: no network)" in message and f"download {URL} into {named['owai']}" in message
    assert tried == [("download.pytorch.org", 443)]


def test_a_named_weight_that_can_be_downloaded_passes_and_the_run_downloads_it(named, monkeypatch):
    _unreachable(monkeypatch, why="")  # reachable: the check leaves the download to the run
    assert vision.check_weights("vit_mini_4", NAME) == 32
    assert not named["owai"].exists()
    fetched = []

    def download(url: str, dest: Path) -> None:
        fetched.append(url)
        _vit_file(Path(dest))

    monkeypatch.setattr("owai.io.download", download)
    assert vision.resolve_weights("vit_mini_4", NAME) == named["owai"] / "vit_mini_4-0123abcd.pth"
    assert fetched == [URL]


def test_behind_a_proxy_a_download_is_left_to_the_proxy(named, behind_a_proxy):
    assert hub.host_unreachable(URL) == ""
    assert vision.check_weights("vit_mini_4", NAME) == 32


@pytest.mark.parametrize("where", ["owai", "torch"])
def test_a_named_weight_in_owais_or_torch_hubs_cache_is_found_and_checked_without_the_network(named, monkeypatch, where):
    _unreachable(monkeypatch)
    path = _vit_file(named[where] / "vit_mini_4-0123abcd.pth")
    assert vision.check_weights("vit_mini_4", NAME) == 32  # found: no download, no connection asked
    assert vision.resolve_weights("vit_mini_4", NAME) == path
    path.write_bytes(path.read_bytes()[:2000])  # cut: a cached file that cannot load is refused too
    with pytest.raises(OwaiError, match="cannot read weights file"):
        vision.check_weights("vit_mini_4", NAME)


def test_the_check_reads_headers_not_tensors(named, monkeypatch, tmp_path):
    """A .safetensors file: its header (read_safetensors never called); a .pth: memory-mapped."""
    st = _vit_file(tmp_path / "vit.safetensors")
    pth = _vit_file(tmp_path / "vit.pth")
    monkeypatch.setattr("owai.io.read_safetensors", lambda *a, **k: pytest.fail("read every tensor"))
    loads = []
    real = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(k.get("mmap")) or real(*a, **k))
    assert vision.check_weights("vit_mini_4", str(st)) == 32
    assert vision.check_weights("vit_mini_4", str(pth)) == 32
    assert loads == [True]
    legacy = tmp_path / "legacy.pth"  # torch's old non-zip format cannot be mapped: read as before
    torch.save(torch.load(pth), legacy, _use_new_zipfile_serialization=False)
    assert vision.check_weights("vit_mini_4", str(legacy)) == 32


# -- SWAG's image sizes --------------------------------------------------------------------------------


def test_swag_e2e_weights_take_their_own_image_size():
    assert vision.weights_image_size("vit_b_16", "IMAGENET1K_SWAG_E2E_V1") == 384
    assert vision.weights_image_size("vit_l_16", "IMAGENET1K_SWAG_E2E_V1") == 512
    assert vision.weights_image_size("vit_b_16", "IMAGENET1K_SWAG_LINEAR_V1") == 224
    assert vision.weights_image_size("vit_l_16", "IMAGENET1K_V1") == 224
    assert vision.weights_image_size("resnet50", "IMAGENET1K_V2") == 0  # any size


DFT = ["dropout-ft", "-p", "tiny", "-q"]


def test_dropout_ft_refuses_swag_at_another_size_and_checks_it_at_its_own_before_the_study(tmp_path, capsys, monkeypatch):
    """vit_b_16 with SWAG's E2E weights: at 224 px one line naming 384; at 384 px the weights are looked
    for (here: not cached, download.pytorch.org unreachable), and no sweep directory is made."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    _unreachable(monkeypatch)
    swag = [*DFT, "--backbone", "vit_b_16", "--weights", "IMAGENET1K_SWAG_E2E_V1", "-o", str(tmp_path / "runs")]
    code, _, err = cli_in_process([*swag, "--set", "data.image_size=224"], capsys)
    assert code == 2 and err.strip().splitlines() == [
        "error: vit_b_16 with weights IMAGENET1K_SWAG_E2E_V1 is built for 384 px images: set data.image_size=384"], err
    code, _, err = cli_in_process([*swag, "--set", "data.image_size=384"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "weights IMAGENET1K_SWAG_E2E_V1 of vit_b_16 are not on this machine" in err and "vit_b_16_swag-9ac1b537.pth" in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("command", [DFT, ["sweep", "table2.8-dropout", "-p", "tiny", "-q", "--set", "pretrain.steps=0"]])
def test_a_sweep_of_a_missing_named_weight_does_not_start(named, tmp_path, capsys, monkeypatch, command):
    tried = _unreachable(monkeypatch)
    weights = ["--weights", NAME] if command is DFT else ["--set", f"model.weights={NAME}"]
    code, _, err = cli_in_process([*command, *as_sets(["model.backbone=vit_mini_4"]), *weights, "-o", str(tmp_path / "runs")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "weights TINY_V1 of vit_mini_4 are not on this machine" in err, err
    assert not (tmp_path / "runs").exists()
    assert set(tried) == {("download.pytorch.org", 443)}  # (owai's own `_connect` asks once per process)


def test_dropout_ft_builds_a_vit_at_its_weights_image_size(named, monkeypatch, tmp_path):
    """A 48 px vit_mini_4 file (as SWAG E2E's 384 for vit_b_16): validation asks for 48 px, and the model
    is built at 48 with the file's grid; a 21k-class head in the file is ignored (it is replaced)."""
    from owai.experiment import resolve
    from owai.methods.dropout_ft import build_model
    from owai.recipes import load

    path = _vit_file(tmp_path / "vit48.safetensors", image_size=48, classes=21843)
    assert vision.weights_image_size("vit_mini_4", str(path)) == 48
    sets = ["model.backbone=vit_mini_4", f"model.weights={path}", "pretrain.steps=0"]
    with pytest.raises(OwaiError, match=f"vit_mini_4 with weights {path} is built for 48 px images: set data.image_size=48"):
        resolve(load("table2.8-dropout"), "tiny", sets)
    cfg, _ = resolve(load("table2.8-dropout"), "tiny", [*sets, "data.image_size=48"])
    model = build_model(cfg, 4, path, torch.device("cpu"))
    assert model.backbone.image_size == 48
    from safetensors.torch import load_file

    assert torch.equal(model.backbone.encoder.pos_embedding, load_file(str(path))["encoder.pos_embedding"])
    assert model(torch.randn(2, 3, 48, 48)).shape == (2, 4)


# -- timm's ViT key names ------------------------------------------------------------------------------

DEPTH, DIM, HEADS, PATCH = 4, 128, 4, 4  # vit_mini_4


def _timm_state(grid: int = 8, head: int | None = 21843, pre_logits: bool = False) -> dict[str, torch.Tensor]:
    """A state dict under timm's VisionTransformer names and shapes (timm 1.0's vision_transformer.py:
    cls_token, pos_embed, patch_embed.proj, blocks.i.{norm1, attn.qkv, attn.proj, norm2, mlp.fc1,
    mlp.fc2}, norm, head; the old ImageNet-21k files' pre_logits.fc), random, for vit_mini_4."""
    g = torch.Generator().manual_seed(3)

    def r(*shape: int, scale: float = 0.05, mean: float = 0.0) -> torch.Tensor:
        return mean + scale * torch.randn(*shape, generator=g)

    state = {"cls_token": r(1, 1, DIM), "pos_embed": r(1, 1 + grid * grid, DIM),
             "patch_embed.proj.weight": r(DIM, 3, PATCH, PATCH), "patch_embed.proj.bias": r(DIM)}
    for i in range(DEPTH):
        b = f"blocks.{i}."
        state |= {b + "norm1.weight": r(DIM, mean=1.0), b + "norm1.bias": r(DIM),
                  b + "attn.qkv.weight": r(3 * DIM, DIM), b + "attn.qkv.bias": r(3 * DIM),
                  b + "attn.proj.weight": r(DIM, DIM), b + "attn.proj.bias": r(DIM),
                  b + "norm2.weight": r(DIM, mean=1.0), b + "norm2.bias": r(DIM),
                  b + "mlp.fc1.weight": r(4 * DIM, DIM), b + "mlp.fc1.bias": r(4 * DIM),
                  b + "mlp.fc2.weight": r(DIM, 4 * DIM), b + "mlp.fc2.bias": r(DIM)}
    state |= {"norm.weight": r(DIM, mean=1.0), "norm.bias": r(DIM)}
    if head:
        state |= {"head.weight": r(head, DIM), "head.bias": r(head)}
    if pre_logits:
        state |= {"pre_logits.fc.weight": r(DIM, DIM), "pre_logits.fc.bias": r(DIM)}
    return state


def _timm_features(s: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The class token after the final norm, computed from timm's tensors as timm's ViT computes it:
    conv patches, [cls; patches] + pos_embed, pre-norm blocks whose qkv output splits as (3, heads, head_dim)."""
    b = x.shape[0]
    t = F.conv2d(x, s["patch_embed.proj.weight"], s["patch_embed.proj.bias"], stride=PATCH).flatten(2).transpose(1, 2)
    t = torch.cat([s["cls_token"].expand(b, -1, -1), t], 1) + s["pos_embed"]
    n = t.shape[1]
    for i in range(DEPTH):
        p = f"blocks.{i}."
        h = F.layer_norm(t, (DIM,), s[p + "norm1.weight"], s[p + "norm1.bias"], eps=1e-6)
        q, k, v = F.linear(h, s[p + "attn.qkv.weight"], s[p + "attn.qkv.bias"]).reshape(b, n, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        a = torch.softmax(q @ k.transpose(-2, -1) * (DIM // HEADS) ** -0.5, -1) @ v  # (B, heads, N, head_dim)
        t = t + F.linear(a.transpose(1, 2).reshape(b, n, DIM), s[p + "attn.proj.weight"], s[p + "attn.proj.bias"])
        h = F.layer_norm(t, (DIM,), s[p + "norm2.weight"], s[p + "norm2.bias"], eps=1e-6)
        t = t + F.linear(F.gelu(F.linear(h, s[p + "mlp.fc1.weight"], s[p + "mlp.fc1.bias"])), s[p + "mlp.fc2.weight"], s[p + "mlp.fc2.bias"])
    return F.layer_norm(t, (DIM,), s["norm.weight"], s["norm.bias"], eps=1e-6)[:, 0]


INCEPTION = {"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5]}  # timm's statistics of the ImageNet-21k ViTs


def _timm_repo(folder: Path, state: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    """`state` saved as timm publishes it on the hub: model.safetensors and config.json (its pretrained_cfg)."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"))
    cfg = {"architecture": "vit_mini", "num_classes": 21843, "pretrained_cfg": {"tag": "augreg_in21k", **INCEPTION}}
    (folder / "config.json").write_text(json.dumps(config if config is not None else cfg))
    return folder / "model.safetensors"


def _pixels(size: int) -> torch.Tensor:
    return torch.rand(2, 3, size, size, generator=torch.Generator().manual_seed(1))


def _imagenet(p: torch.Tensor) -> torch.Tensor:
    """Pixels in [0, 1] as owai's pipelines hand them to a network: ImageNet-normalised."""
    return (p - torch.tensor(vision.IMAGENET_MEAN).view(1, 3, 1, 1)) / torch.tensor(vision.IMAGENET_STD).view(1, 3, 1, 1)


def test_timm_vit_names_map_onto_owais_vit_and_give_timms_features(tmp_path):
    """timm's names and layout (qkv fused as q, k, v) under owai's ViT give the features timm's ViT
    computes from the same tensors, on the images normalised as timm's config.json says (0.5 / 0.5)
    while owai hands the network ImageNet-normalised ones."""
    timm = _timm_state(head=None, pre_logits=True)  # timm's orig_in21k: no head; older files: pre_logits
    mapped = vision.checkpoint_keys({f"module.{k}": v for k, v in timm.items()})
    model = vision.build_backbone("vit_mini_4", num_classes=1)
    own = {k for k in model.state_dict() if not k.startswith("heads.")}
    assert set(mapped) == own  # every timm key mapped, nothing left over, pre_logits dropped
    path = _timm_repo(tmp_path / "augreg", _timm_state())  # augreg_in21k: a 21843-class head
    assert vision.check_weights("vit_mini_4", str(path)) == 32
    vision.load_torchvision_weights(model, path, features_only=True)
    pixels = _pixels(32)
    with torch.no_grad():
        got = vision.features(model.eval(), _imagenet(pixels))
        assert torch.allclose(got, _timm_features(_timm_state(), (pixels - 0.5) / 0.5), atol=1e-5)
        assert not torch.allclose(got, _timm_features(_timm_state(), _imagenet(pixels)), atol=1e-3)
    assert "input_scale" not in model.state_dict()


@pytest.mark.parametrize("config", [None, {"architecture": "vit_mini"}, "not json"])
def test_a_timm_vit_without_its_image_statistics_is_one_line(tmp_path, config):
    folder = tmp_path / "bare"
    path = _timm_repo(folder, _timm_state())
    if config is None:
        (folder / "config.json").unlink()
    else:
        (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    with pytest.raises(OwaiError, match="holds timm's ViT names: owai reads the image statistics from the config.json") as e:
        vision.check_weights("vit_mini_4", str(path))
    assert "\n" not in str(e.value)


def test_a_timm_vit_variant_owai_does_not_build_is_one_line(tmp_path):
    state = _timm_state() | {f"blocks.{i}.ls1.gamma": torch.ones(DIM) for i in range(DEPTH)}  # layer scale
    path = _timm_repo(tmp_path / "deit3", state)
    with pytest.raises(OwaiError, match=r"does not match VisionTransformer: unexpected keys \(4\): blocks.0.ls1.gamma") as e:
        vision.check_weights("vit_mini_4", str(path))
    assert "\n" not in str(e.value)


def test_rich_features_reads_a_timm_vit_file_at_another_image_size_with_its_grid_resized_once(tmp_path):
    """Figure 2.4's protocol for a 224 px ImageNet-21k ViT at 384 px (here 32 -> 48): the grid is zoomed
    once as for a Hugging Face ViT, the images renormalised to timm's 0.5 / 0.5; the check before the
    run reads the header only."""
    from owai.methods.rich_features import Network, check_external_features, external_features, load_network

    path = _timm_repo(tmp_path / "augreg", _timm_state())
    check_external_features("vit_mini_4", path, 48)
    resized = vision.resize_position_grid(_timm_state()["pos_embed"], 1, 12)
    assert torch.equal(external_features("vit_mini_4", path, 48)["encoder.pos_embedding"], resized)
    net = load_network(Network(0, str(path), "vit_mini_4", 0, None, path, external=True), "imagenet", 48).eval()
    pixels = _pixels(48)
    with torch.no_grad():
        assert torch.allclose(net(_imagenet(pixels)), _timm_features(_timm_state() | {"pos_embed": resized}, (pixels - 0.5) / 0.5),
                              atol=1e-5)
    with pytest.raises(OwaiError, match="image_size 50 is not a multiple of the patch size 4"):
        check_external_features("vit_mini_4", path, 50)
    wide = _timm_repo(tmp_path / "wide", _timm_state() | {"pos_embed": torch.zeros(1, 65, 64)})
    with pytest.raises(OwaiError, match=r"is not a vit_mini_4: encoder.pos_embedding has shape \(1, 65, 64\)"):
        check_external_features("vit_mini_4", wide, 48)


def test_a_dropout_ft_model_rebuilt_for_a_trained_state_reads_images_as_its_timm_weights_did(tmp_path):
    """The study's ensembles and weight averages build the model without its weights file and load each
    run's trained state: a timm ViT's map to its own image statistics (0.5 / 0.5) is no tensor of that
    state, and without it every rebuilt model read the images ImageNet-normalised (other predictions)."""
    from owai.experiment import resolve
    from owai.methods.dropout_ft import build_model
    from owai.recipes import load

    path = _timm_repo(tmp_path / "augreg", _timm_state())
    sets = ["model.backbone=vit_mini_4", f"model.weights={path}", "pretrain.steps=0", "data.image_size=32"]
    cfg, _ = resolve(load("table2.8-dropout"), "tiny", sets)
    trained = build_model(cfg, 4, path, torch.device("cpu")).eval()
    rebuilt = build_model(cfg, 4, None, torch.device("cpu")).eval()
    rebuilt.load_state_dict(trained.state_dict())
    x = _imagenet(_pixels(32))
    with torch.no_grad():
        assert torch.equal(rebuilt(x), trained(x))


# -- Hugging Face hub ids ------------------------------------------------------------------------------


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A Hugging Face hub cache holding the config of `owai-test/vit` (revision main), no weights."""
    from transformers import ViTConfig

    root = tmp_path / "hf-hub"
    repo = root / "models--owai-test--vit"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
              patch_size=8).save_pretrained(repo / "snapshots" / "abc123")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(root))
    return repo / "snapshots" / "abc123"


def test_a_hub_id_whose_weights_are_not_cached_fails_before_the_run_offline_and_passes_online(hub_cache, monkeypatch):
    from owai.models.hf_vision import check_hf_source

    monkeypatch.setattr("owai.models.hf_vision.hub_unreachable", lambda: "Hugging Face offline mode is set (HF_HUB_OFFLINE)")
    with pytest.raises(DataMissing) as e:
        check_hf_source("hf:owai-test/vit", 32)
    assert "\n" not in str(e.value) and str(hub_cache.parents[2]) in str(e.value)
    assert "hf:owai-test/vit: its weights file (model.safetensors or pytorch_model.bin) is not in the local Hugging Face cache" in str(e.value)
    monkeypatch.setattr("owai.models.hf_vision.hub_unreachable", lambda: "")
    check_hf_source("hf:owai-test/vit", 32)  # from_pretrained downloads them when the run starts


def test_cached_hub_weights_are_checked_from_their_headers_shards_included(hub_cache, monkeypatch):
    from owai.models.hf_vision import check_hf_source

    monkeypatch.setattr("owai.models.hf_vision.hub_unreachable", lambda: "offline (test)")
    save_file({"a": torch.zeros(2)}, str(hub_cache / "model-00001-of-00002.safetensors"))
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (hub_cache / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(DataMissing, match="1 of 2 weight shards named in model.safetensors.index.json are not in the local"):
        check_hf_source("hf:owai-test/vit")
    save_file({"b": torch.zeros(2)}, str(hub_cache / "model-00002-of-00002.safetensors"))
    check_hf_source("hf:owai-test/vit")
    (hub_cache / "model-00002-of-00002.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(OwaiError, match="corrupt or truncated safetensors file"):
        check_hf_source("hf:owai-test/vit")


def test_rich_features_with_a_hub_model_not_cached_offline_is_one_line_before_any_run(hub_cache, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    recipe = str(Path(__file__).resolve().parents[1] / "recipes" / "tableA.6-seer.yaml")
    code, _, err = cli_in_process(["rich-features", "-r", recipe, "-p", "cpu", "--stage", "probe", "-q",
                                   *as_sets(["data.base=mnist-t10k", "data.target=mnist-t10k", "data.image_size=32",
                                             "probe.n=1", "probe.sizes=[1]", 'probe.weights=["hf:owai-test/vit"]']),
                                   "-o", str(tmp_path / "runs")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "hf:owai-test/vit: its weights file" in err and "HF_HUB_OFFLINE" in err
    assert not (tmp_path / "runs").exists()


def test_rich_features_takes_vit_files_at_the_probes_size_but_not_a_student_it_builds(tmp_path):
    """probe.weights' ViT files take data.image_size (grids resized); distill's student is a
    model.backbone that owai builds at its own size, refused before the run at another."""
    from owai.experiment import resolve
    from owai.recipes import load

    path = _timm_repo(tmp_path / "augreg", _timm_state())
    sets = [f"probe.weights=['vit_mini_4:{path}','vit_mini_4:{path}']", "probe.n=2", "data.image_size=48",
            "distill.target=features"]
    resolve(load("fig2.4-vit"), "cpu", [*sets, "stage=probe"], missing_ok=True)
    with pytest.raises(OwaiError, match="vit_mini_4 is built for 32 px images: set data.image_size=32"):
        resolve(load("fig2.4-vit"), "cpu", [*sets, "stage=distill,probe"], missing_ok=True)
