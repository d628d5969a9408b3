"""Self-supervised rich representations (thesis App. A.3.3, Table A.4): SimSiam pre-training, the
self-supervised Distill_n (heads regress the networks' features), subsampled probes (CIFAR10 1 %),
and the formulas they rest on; and vision transformers as the n networks (Figure 2.4's stand-in)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import as_sets, cli_in_process
from owai.errors import OwaiError

RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "tableA.4-simsiam.yaml")
# SimSiam on the packaged MNIST file's digits 0-4 (8 images per class), ResNet-18 at 16 px, a few updates
TINY = [
    "data.base=mnist-t10k", "data.target=mnist-t10k", "data.limit_per_class=8", "data.image_size=16",
    "data.eval_batch_size=64", "data.workers=0",
    "pretrain.epochs=1.0", "pretrain.batch_size=8", "pretrain.checkpoint_every=2", "pretrain.ssl_dim=32",
    "pretrain.ssl_pred_dim=8",
    "probe.n=2", "probe.sizes=[1,2]", "probe.epochs=2", "probe.milestones=[1]", "probe.batch_size=8",
    "probe.checkpoint_every=2", "probe.log_every=2", "probe.baselines=[]",
    "distill.epochs=1.0", "distill.batch_size=8", "distill.warmup_epochs=0.5", "distill.milestones=[0.8]",
    "distill.checkpoint_every=2", "distill.log_every=2",
]


def _cli(args: list[str], capsys) -> tuple[int, str, str]:
    return cli_in_process(["rich-features", "-r", RECIPE, "-p", "cpu", *args, "-q"], capsys)


def test_simsiam_loss_is_the_symmetrised_negative_cosine_with_stop_gradient() -> None:
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(6, 5, generator=gen, requires_grad=True)
    z = torch.randn(6, 5, generator=gen, requires_grad=True)
    from owai.models.rich import simsiam_loss

    loss = simsiam_loss(p, z)
    p1, p2, z1, z2 = p.detach()[:3], p.detach()[3:], z.detach()[:3], z.detach()[3:]
    by_hand = -0.5 * (sum(float(F.cosine_similarity(p1[i], z2[i], dim=0)) for i in range(3)) / 3
                      + sum(float(F.cosine_similarity(p2[i], z1[i], dim=0)) for i in range(3)) / 3)
    assert float(loss.detach()) == pytest.approx(by_hand, abs=1e-6)
    loss.backward()
    assert p.grad is not None and p.grad.abs().sum() > 0
    assert z.grad is None  # the stop-gradient: no gradient reaches the projections
    aligned = torch.cat([z.detach()[3:] * 2.0, z.detach()[:3] * 0.5])  # p1 || z2, p2 || z1
    assert float(simsiam_loss(aligned, z.detach())) == pytest.approx(-1.0, abs=1e-6)


def test_feature_distill_loss_is_one_minus_cosine_summed_over_heads() -> None:
    from owai.models.rich import feature_distill_loss

    gen = torch.Generator().manual_seed(1)
    student = [torch.randn(4, 3, generator=gen) for _ in range(2)]
    teacher = [torch.randn(4, 3, generator=gen) for _ in range(2)]
    by_hand = 0.0
    for s, t in zip(student, teacher):
        cos = [float(s[b] @ t[b] / (s[b].norm() * t[b].norm())) for b in range(4)]
        by_hand += sum(1 - c for c in cos) / 4
    assert float(feature_distill_loss(student, teacher)) == pytest.approx(by_hand, abs=1e-6)
    assert float(feature_distill_loss(teacher, [3.0 * t for t in teacher])) == pytest.approx(0.0, abs=1e-6)


def test_simsiam_normalises_each_view_alone() -> None:
    """Chen & He's code (and the CIFAR code behind RRL's checkpoints) calls the network on each view
    separately, so every BatchNorm's batch statistics are one view's: in training mode, view 1's
    projections and predictions do not depend on view 2's images (with both views in one batch they
    would)."""
    from owai.models.rich import SimSiam, strip_head
    from owai.models.vision import build_backbone

    torch.manual_seed(0)
    net = SimSiam(strip_head(build_backbone("resnet18", 1)), dim=32, pred_dim=8, proj_layers=2).train()
    gen = torch.Generator().manual_seed(1)
    one, two, other = (torch.randn(4, 3, 32, 32, generator=gen) for _ in range(3))
    p, z = net(torch.cat([one, two]))
    p_other, z_other = net(torch.cat([one, 3.0 * other + 1.0]))
    assert p.shape == z.shape == (8, 32)
    torch.testing.assert_close(z[:4], z_other[:4])
    torch.testing.assert_close(p[:4], p_other[:4])
    assert not torch.allclose(z[4:], z_other[4:])
    with pytest.raises(OwaiError, match=r"^SimSiam takes two stacked views \(2B, \.\.\.\), got a batch of 3$"):
        net(torch.randn(3, 3, 32, 32))


def test_the_projector_hidden_width_is_the_backbones_unless_given() -> None:
    """Chen & He's ImageNet code widens the projector's hidden layers to the backbone's width; the
    SimSiam CIFAR setting uses 2048 (pretrain.ssl_hidden_dim)."""
    from owai.models.rich import SimSiam, strip_head
    from owai.models.vision import build_backbone

    default = SimSiam(strip_head(build_backbone("resnet18", 1)), dim=64, pred_dim=8, proj_layers=2)
    wide = SimSiam(strip_head(build_backbone("resnet18", 1)), dim=64, pred_dim=8, proj_layers=2, hidden_dim=128)
    assert [m.out_features for m in default.projector if isinstance(m, torch.nn.Linear)] == [512, 64]
    assert [m.out_features for m in wide.projector if isinstance(m, torch.nn.Linear)] == [128, 64]
    assert wide.projector[3].in_features == 128


def test_the_cifar_resnet18_keeps_the_32px_grid() -> None:
    """resnet18_cifar (TH A.1 / A.3.3's network): conv1 3x3 stride 1, no max-pool, so layer4 sees a 4 x 4
    grid of a 32 px image (1 x 1 with the ImageNet stem); 11,168,832 parameters without the head, the
    torchvision-style keys of resnet18; its wide variants are Table A.4's r18w2 / r18w4."""
    from owai.methods.rich_features import WIDE
    from owai.models.vision import build_backbone

    cifar, imagenet = build_backbone("resnet18_cifar", 10), build_backbone("resnet18", 10)
    assert cifar.conv1.kernel_size == (3, 3) and cifar.conv1.stride == (1, 1)
    assert set(cifar.state_dict()) == set(imagenet.state_dict())
    assert sum(p.numel() for n, p in cifar.named_parameters() if not n.startswith("fc.")) == 11_168_832
    grids = {}
    for name, net in (("cifar", cifar), ("imagenet", imagenet)):
        net.layer4.register_forward_hook(lambda m, i, o, name=name: grids.__setitem__(name, tuple(o.shape[-2:])))
        net.eval()(torch.randn(1, 3, 32, 32))
    assert grids == {"cifar": (4, 4), "imagenet": (1, 1)}
    assert build_backbone(WIDE["resnet18_cifar"].format(k=2), 10).feature_dim == 1024


def test_pretraining_in_epochs_passes_over_every_image_once_per_epoch(tmp_path, capsys, monkeypatch) -> None:
    """pretrain.sampling=epochs (the reference SimSiam CIFAR loader): N // B updates per epoch, each a
    slice of that epoch's permutation; the cache key differs from the default's (with replacement)."""
    from owai.experiment import resolve
    from owai.methods import rich_features as rf
    from owai.recipes import load

    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))
    sets = [*TINY, "pretrain.epochs=2.0", "pretrain.batch_size=16", "pretrain.sampling=epochs"]
    code, _, err = _cli(["--stage", "pretrain", "--seeds", "0", *as_sets(sets), "-o", str(tmp_path / "runs")], capsys)
    assert code == 0, err
    results = next((tmp_path / "runs").rglob("results.json"))
    details = json.loads(results.read_text())["details"]
    n = details["split_sizes"]["train"]
    assert details["steps"] == 2 * (n // 16) and n % 16  # the last incomplete batch of each epoch dropped
    cfg, _ = resolve(load(RECIPE), "cpu", sets)
    default, _ = resolve(load(RECIPE), "cpu", [*TINY, "pretrain.epochs=2.0", "pretrain.batch_size=16"])
    assert rf.pretrain_key(cfg, 0) != rf.pretrain_key(default, 0)


def test_simsiam_views_are_two_independent_reproducible_augmentations() -> None:
    from owai.data.classification import load_digits
    from owai.data.domainbed import StepBatches
    from owai.methods.rich_features import OneDomain

    data = OneDomain(load_digits())
    batches = StepBatches(data, [0], [torch.arange(50)], 4, 16, True, seed=3, steps=2, views=2)
    x, y, _ = batches[1]
    assert x.shape == (8, 3, 16, 16) and y.shape == (4,)
    assert not torch.allclose(x[:4], x[4:])  # the two views of each image differ
    again, _, _ = StepBatches(data, [0], [torch.arange(50)], 4, 16, True, seed=3, steps=2, views=2)[1]
    assert torch.equal(x, again)
    one, y1, _ = StepBatches(data, [0], [torch.arange(50)], 4, 16, True, seed=3, steps=2)[1]
    assert torch.equal(y1, y) and one.shape == (4, 3, 16, 16)  # same images picked as with one view


def test_target_fraction_keeps_that_share_of_every_class(tmp_path) -> None:
    from owai.experiment import resolve
    from owai.methods import rich_features as rf
    from owai.recipes import load

    cfg, _ = resolve(load(RECIPE), "cpu", ["data.base=mnist-t10k", "data.target=mnist-t10k", "data.target_fraction=0.1"])
    full = rf.load_split(cfg, "mnist-t10k", "train", ["5", "6"])
    part = rf.load_split(cfg, "mnist-t10k", "train", ["5", "6"], 0.1)
    counts, kept = torch.bincount(full.labels).tolist(), torch.bincount(part.labels).tolist()
    assert kept == [math.ceil(0.1 * c) for c in counts]
    again = rf.load_split(cfg, "mnist-t10k", "train", ["5", "6"], 0.1)
    assert torch.equal(part.labels, again.labels) and torch.equal(part.images, again.images)


@pytest.fixture(scope="module")
def ssl_cache(tmp_path_factory, one_thread) -> Path:
    """Two SimSiam networks (seeds 0, 1) at TINY scale in a cache."""
    root = tmp_path_factory.mktemp("rich-ssl")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OWAI_CACHE", str(root / "cache"))
        from owai.cli import main

        try:
            main(["rich-features", "--stage", "pretrain", "-r", RECIPE, "-p", "cpu", "--seeds", "0,1",
                  *as_sets(TINY), "-o", str(root / "runs"), "-q"])
        except SystemExit as e:
            assert not e.code
    return root / "cache"


def test_simsiam_pretraining_caches_features_without_a_head(ssl_cache) -> None:
    from safetensors.torch import load_file

    files = sorted((ssl_cache / "pretrained").glob("resnet18-*.safetensors"))
    assert len(files) == 2
    state = load_file(str(files[0]))
    assert "fc.weight" not in state and "conv1.weight" in state
    assert not any(k.startswith(("projector", "predictor")) for k in state)
    assert not torch.equal(state["conv1.weight"], load_file(str(files[1]))["conv1.weight"])


def test_simsiam_networks_probe_their_own_classes_and_distill_on_features(ssl_cache, tmp_path, capsys,
                                                                       monkeypatch) -> None:
    """Self-supervised networks never saw a label: probing the base classes themselves (Table A.4's
    CIFAR10 column) is allowed, on 1/2 of the images; Distill_2 regresses their features."""
    monkeypatch.setenv("OWAI_CACHE", str(ssl_cache))
    rc, _, err = _cli(["--stage", "distill,probe", "--seeds", "0,1", *as_sets(TINY),
                       "--set", 'data.target_classes=["0","1","2","3","4"]', "--set", "data.target_fraction=0.5",
                       "-o", str(tmp_path)], capsys)
    assert rc == 0, err
    run_dir = next((tmp_path / "tableA.4-simsiam").iterdir())
    results = json.loads((run_dir / "results.json").read_text())
    measured = {r["metric"]: r["measured"] for r in results["rows"]}
    assert {"cat1.acc", "cat2.acc", "distill2.acc", "single.acc"} <= set(measured)
    assert "distill2.base_acc" not in measured  # no heads, no base accuracy
    assert results["details"]["split_sizes"]["train"] == 5 * 4  # half of each class's 8 training images
    assert results["details"]["distill"]["target"] == "features"


def test_simsiam_networks_refuse_logit_distillation(ssl_cache, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("OWAI_CACHE", str(ssl_cache))
    rc, _, err = _cli(["--stage", "distill", "--seeds", "0,1", *as_sets(TINY), "--set", "distill.target=logits",
                       "-o", str(tmp_path)], capsys)
    assert rc != 0 and "distill.target=features" in err and len(err.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())


def test_supervised_networks_still_refuse_overlapping_classes(tmp_path, capsys) -> None:
    rc, _, err = _cli(["--stage", "pretrain", *as_sets(TINY), "--set", "pretrain.objective=supervised",
                       "--set", "pretrain.transfer_probe=true", "--set", 'data.target_classes=["4","5"]',
                       "-o", str(tmp_path)], capsys)
    assert rc != 0 and "4" in err and len(err.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())


def test_the_ssl_transfer_recipes_read_the_simsiam_recipes_networks() -> None:
    """tableA.5-swav's and tableA.6-seer's cpu stand-ins evaluate tableA.4-simsiam's cached networks:
    the same pre-training settings, so the same cache key."""
    from owai.experiment import resolve
    from owai.methods.rich_features import pretrain_key
    from owai.recipes import load

    local = ["data.base=mnist-t10k", "data.target=mnist-t10k", "stage=pretrain"]
    key = pretrain_key(resolve(load(RECIPE), "cpu", local)[0], 0)
    for other in ("tableA.5-swav", "tableA.6-seer"):
        assert pretrain_key(resolve(load(other), "cpu", local)[0], 0) == key, other
    supervised = resolve(load(RECIPE), "cpu", [*local, "pretrain.objective=supervised",
                                              'data.target_classes=["5","6"]'])[0]
    assert pretrain_key(supervised, 0) != key


def test_a_vit_is_probed_at_its_own_image_size(tmp_path, capsys) -> None:
    rc, _, err = cli_in_process(["rich-features", "-r", "fig2.4-vit", "-p", "cpu", "--stage", "pretrain",
                                 "--set", "data.image_size=16", "-o", str(tmp_path), "-q"], capsys)
    assert rc != 0 and "vit_mini_4 is built for 32 px images" in err and len(err.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())


def test_vit_networks_pretrain_distill_probe_and_two_stage(tmp_path, capsys, monkeypatch, one_thread) -> None:
    """Figure 2.4's stand-in end to end at miniature scale: ViTs keep their head under `heads.head`
    (not `fc`), which loading and distillation must find."""
    monkeypatch.setenv("OWAI_CACHE", str(tmp_path / "cache"))
    tiny = ["data.base=mnist-t10k", "data.target=mnist-t10k", "data.limit_per_class=8", "pretrain.epochs=1.0",
            "pretrain.batch_size=8", "distill.epochs=1.0", "distill.batch_size=8", "finetune.epochs=0.5",
            "finetune.batch_size=8", "probe.batch_size=8", "probe.epochs=1", "probe.milestones=[]"]
    base = ["rich-features", "-r", "fig2.4-vit", "-p", "cpu", "--seeds", "0,1", *as_sets(tiny), "-q"]
    rc, _, err = cli_in_process([*base, "--stage", "pretrain", "-o", str(tmp_path / "pre")], capsys)
    assert rc == 0, err
    rc, _, err = cli_in_process([*base, "--stage", "distill,probe,two-stage", "-o", str(tmp_path / "eval")], capsys)
    assert rc == 0, err
    run_dir = next((tmp_path / "eval" / "fig2.4-vit").iterdir())
    results = json.loads((run_dir / "results.json").read_text())
    measured = {r["metric"] for r in results["rows"]}
    assert {"distill2.base_acc", "cat2.acc", "distill2.acc", "two_stage.cat2.acc", "ft.ensemble.acc", "single.last.acc",
            "ft.single.last.acc"} <= measured
    # Fig 2.4's claims compare Cat2 with the second (larger, on the paper preset: ViT-L/16) network alone
    verdicts = {v["id"]: v for v in results["claims"]}
    assert verdicts["vit-cat2-beats-one"]["verdict"] in ("holds", "misses")
    assert set(verdicts["vit-cat2-beats-one"]["numbers"]) == {"cat2.acc", "single.last.acc"}
    assert set(verdicts["vit-two-stage-beats-one"]["numbers"]) == {"two_stage.cat2.acc", "ft.single.last.acc"}
    assert verdicts["vit-two-stage-beats-one"]["verdict"] in ("holds", "misses")
