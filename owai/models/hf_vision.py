"""Hugging Face image models as feature backbones (SEER RegNets, ViT ImageNet-21k, ...), frozen or trainable.

Thesis §2.2 probes, fine-tunes and concatenates networks trained elsewhere: the SEER RegNets
(`facebook/regnet-y-{320,640,1280}-seer`) and the ImageNet-21k ViTs (`google/vit-{base,large}-patch16-224-in21k`)
exist only as `transformers` checkpoints. `HFImageBackbone` wraps any supported one as an owai backbone:
a module mapping a batch of images to (B, feature_dim) features, with a `feature_dim` attribute, so
`ConcatFeatures`, probes and fine-tuning treat it like an `owai.models.vision` backbone with its head stripped.

    x (B, 3, S, S), normalised with input_mean / input_std (ImageNet's unless the caller says; CIFAR
                                    images under rich-features' data.transforms: thesis carry CIFAR's)
      -> x * scale + shift          re-normalised to the checkpoint's own image_mean / image_std
                                    (preprocessor_config.json; absent = ImageNet = identity)
      -> AutoModel (base model, no classification head; `transformers`' own code, never remote code)
      -> pooled models  (RegNet, ResNet, BiT, ConvNeXt, Swin, BEiT): pooler_output flattened  (B, C)
         class-token models (ViT, DeiT, ViT-MSN, DINOv2): last_hidden_state[:, 0], the class token
                                    after the final LayerNorm (what ViTForImageClassification reads,
                                    not the tanh pooler, which is not even built)
      -> (B, feature_dim)           feature_dim from the config: hidden_sizes[-1] or hidden_size

At a resolution other than the checkpoint's (`config.image_size`, e.g. fine-tuning a 224 ViT at 384)
a model with a learned grid of absolute position embeddings (ViT, DeiT, ViT-MSN) is rebuilt once at
`image_size`, its grid resized as the original ViT code and RRL do (`resize_position_grid`: a linear
zoom, scipy's `ndimage.zoom(order=1)`), so fine-tuning trains the new grid; at any other input size, or
for models without such a grid, the position embeddings are interpolated (bicubic, `transformers`' own)
at every forward, `interpolate_pos_encoding=True`.

Recipes name such a checkpoint among weight files with the prefix `hf:` (`hf:facebook/regnet-y-320-seer`,
`hf:/data/ckpt/vit-in21k`): `is_hf_source`, `hf_source`, and `check_hf_source` (validation before a run).
Every failure (no config.json, unreadable or foreign weights, an unsupported model type, a hub id that
cannot be fetched) is a one-line `OwaiError` naming the source.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import Tensor, nn

from owai.errors import DataMissing, OwaiError, one_line
from owai.hub import hub_unreachable
from owai.models.vision import IMAGENET_MEAN, IMAGENET_STD, resize_position_grid

PREFIX = "hf:"

# model_type -> where the features are: "pooled" = pooler_output flattened, "cls" = last_hidden_state[:, 0].
# The width is config.hidden_sizes[-1] for the convolutional ones, config.hidden_size otherwise.
POOLED_CONV = ("regnet", "resnet", "bit", "convnext", "convnextv2")
POOLED_TOKENS = ("swin", "swinv2", "beit", "data2vec-vision")  # pooler = mean of tokens (+ LN) or BEiT's CLS
CLASS_TOKEN = ("vit", "deit", "vit_msn", "dinov2", "dinov2_with_registers")
SUPPORTED = POOLED_CONV + POOLED_TOKENS + CLASS_TOKEN
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json",
                "pytorch_model.bin", "pytorch_model.bin.index.json")


def is_hf_source(text: object) -> bool:
    """True when `text` names a Hugging Face checkpoint: `hf:<hub id>` or `hf:<local directory>`."""
    return isinstance(text, str) and text.startswith(PREFIX)


def hf_source(text: str) -> str:
    """The hub id or directory of `text` without its `hf:` prefix (text without one is returned as is)."""
    source = text.removeprefix(PREFIX).strip()
    if not source:
        raise OwaiError(f"{text!r}: name a Hugging Face hub id or a local directory after 'hf:'")
    return source


def _local_dir(source: str) -> Path | None:
    """`source` as a local checkpoint directory (checked to hold config.json), or None for a hub id."""
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise OwaiError(f"hf:{source}: directory has no config.json (not a transformers checkpoint)")
        return path
    if path.exists():
        raise OwaiError(f"hf:{source}: not a directory (a transformers checkpoint is a directory with config.json)")
    if source.startswith(("/", "./", "../", "~")) or source.count("/") > 1:
        raise OwaiError(f"hf:{source}: no such directory")
    return None


@contextlib.contextmanager
def _quiet(local: bool) -> Iterator[None]:
    """transformers' warnings (e.g. the load report listing an ignored classification head) and, for a
    local load, its progress bar, silenced for the duration; hub downloads keep theirs."""
    from transformers.utils import logging as tlog

    verbosity, bar = tlog.get_verbosity(), tlog.is_progress_bar_enabled()
    tlog.set_verbosity_error()
    if local:
        tlog.disable_progress_bar()
    try:
        yield
    finally:
        tlog.set_verbosity(verbosity)
        if bar and local:
            tlog.enable_progress_bar()


def _load_config(source: str) -> tuple[Any, Path | None]:
    """(transformers config of `source`, its local directory or None); OwaiError if it cannot be read
    or its model type is not a supported image model."""
    from transformers import AutoConfig

    local = _local_dir(source)
    if local is not None:
        try:
            json.loads((local / "config.json").read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise OwaiError(f"hf:{source}: config.json is not valid JSON ({one_line(e)})") from None
    problem = ""
    try:
        with _quiet(True):
            if local is not None:
                config = AutoConfig.from_pretrained(str(local), local_files_only=True)
            else:
                try:  # the hub cache first: no network round trips (which retry for ~20 s when offline)
                    config = AutoConfig.from_pretrained(source, local_files_only=True)
                except OSError:
                    problem = hub_unreachable()
                    if problem:
                        raise OSError(f"not in the local Hugging Face cache ({_hub_cache()}), and {problem}") from None
                    config = AutoConfig.from_pretrained(source)
    except Exception as e:  # noqa: BLE001 - OSError, ValueError (unknown model type, remote code), hub errors
        if local is not None:
            raise OwaiError(f"hf:{source}: cannot read the checkpoint's config ({one_line(e)})") from None
        error = DataMissing if problem else OwaiError  # not on this machine, or not on the hub either
        raise error(f"hf:{source}: checkpoint not found locally or on the Hugging Face hub ({one_line(e)}); "
                    f"pass a local directory holding its config.json and weights") from None
    model_type = getattr(config, "model_type", "")
    if model_type not in SUPPORTED:
        raise OwaiError(f"hf:{source}: model type {model_type!r} is not a supported image backbone "
                        f"(supported: {', '.join(SUPPORTED)})")
    return config, local


def _feature_dim(config: Any, source: str) -> int:
    """The feature width read from the config (nothing is run): hidden_sizes[-1] or hidden_size."""
    if config.model_type in POOLED_CONV:
        sizes = getattr(config, "hidden_sizes", None)
        dim = sizes[-1] if isinstance(sizes, (list, tuple)) and sizes else None
    else:
        dim = getattr(config, "hidden_size", None)
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise OwaiError(f"hf:{source}: cannot tell the feature width of this {config.model_type} from its config")
    return dim


def hf_feature_dim(text: str) -> int:
    """The feature width of the model `text` (with or without `hf:`), from its config alone."""
    source = hf_source(text) if is_hf_source(text) else text
    config, _ = _load_config(source)
    return _feature_dim(config, source)


def check_hf_source(text: str, image_size: int | None = None) -> None:
    """Cheap validation before a run starts: the config of `text` (with or without `hf:`) reads and is a
    supported image model whose patches tile `image_size` (when given), and its weights are there and
    readable (`_check_weights`)."""
    source = hf_source(text)
    config, local = _load_config(source)
    _check_patches(config, source, image_size)
    _check_weights(source, local)


def _hub_cache() -> str:
    """The Hugging Face hub cache transformers reads and downloads into ($HF_HUB_CACHE, else $HF_HOME/hub)."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _check_weights(source: str, local: Path | None) -> None:
    """The checkpoint's weights before a run: the first of WEIGHT_FILES that a local directory holds, or
    that the Hugging Face cache holds for a hub id, readable from its header alone (a .safetensors
    header, a memory-mapped .bin: `vision.weight_shapes`), and every shard a sharded index names. For a
    hub id, weights (or shards) not in the cache pass where the hub can be reached (`from_pretrained`
    downloads them when the run starts) and are one DataMissing line where it cannot (offline mode,
    or no connection: `hub.hub_unreachable`), naming the cache looked in."""
    from owai.models.vision import weight_shapes

    def find(name: str) -> Path | None:
        if local is not None:
            return local / name if (local / name).is_file() else None
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(source, name)
        return Path(found) if isinstance(found, str) and Path(found).is_file() else None

    def absent(what: str, verb: str = "is") -> None:
        if local is not None:
            raise OwaiError(f"hf:{source}: {what} {verb} not in the directory")
        problem = hub_unreachable()
        if problem:
            raise DataMissing(f"hf:{source}: {what} {verb} not in the local Hugging Face cache ({_hub_cache()}) and "
                              f"{problem}; download it there on a machine with a network (`hf download {source}`), "
                              "or pass a local directory holding config.json and the weights")

    present = next(((name, path) for name in WEIGHT_FILES if (path := find(name)) is not None), None)
    if present is None:
        absent(f"its weights file ({' or '.join(WEIGHT_FILES[::2])})")
        return  # the run downloads it
    name, path = present
    files = [path]
    if name.endswith(".index.json"):
        try:
            shards = sorted(set(json.loads(path.read_text())["weight_map"].values()))
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise OwaiError(f"hf:{source}: {name} is not a weights index ({one_line(e)})") from None
        files = [found for shard in shards if (found := find(shard)) is not None]
        if len(files) < len(shards):
            absent(f"{len(shards) - len(files)} of {len(shards)} weight shards named in {name}", "are")
    for file in files:
        weight_shapes(file)


def _normalisation(config_dir: Path | None, source: str) -> tuple[list[float], list[float], float]:
    """(image_mean, image_std, rescale) the checkpoint's preprocessor expects for pixels in [0, 255]
    times rescale (1/255 normally); ImageNet's when the checkpoint has no preprocessor_config.json."""
    if config_dir is not None:
        path: str | None = str(config_dir / "preprocessor_config.json")
        if not Path(path).is_file():
            path = None
    else:
        from transformers.utils import cached_file

        try:
            path = cached_file(source, "preprocessor_config.json", local_files_only=bool(hub_unreachable()),
                               _raise_exceptions_for_missing_entries=False,
                               _raise_exceptions_for_connection_errors=False)
        except Exception:  # noqa: BLE001 - unreachable: fall back to ImageNet's, like a missing file
            path = None
    if path is None:
        return list(IMAGENET_MEAN), list(IMAGENET_STD), 1 / 255
    try:
        proc = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise OwaiError(f"hf:{source}: preprocessor_config.json is not valid JSON ({one_line(e)})") from None
    rescale = float(proc.get("rescale_factor", 1 / 255)) if proc.get("do_rescale", True) else 1.0
    if not proc.get("do_normalize", True):
        return [0.0] * 3, [1.0] * 3, rescale
    stats = []
    for key, default in (("image_mean", IMAGENET_MEAN), ("image_std", IMAGENET_STD)):
        v = proc.get(key, default)
        v = [v] * 3 if isinstance(v, (int, float)) else v
        if (not isinstance(v, list) or len(v) != 3 or not all(isinstance(c, (int, float)) for c in v)
                or not all(math.isfinite(c) for c in v)):
            raise OwaiError(f"hf:{source}: preprocessor_config.json {key} must be 3 numbers, got {v!r}")
        stats.append([float(c) for c in v])
    if min(stats[1]) <= 0 or not math.isfinite(rescale) or rescale <= 0:
        raise OwaiError(f"hf:{source}: preprocessor_config.json has a non-positive image_std or rescale_factor")
    return stats[0], stats[1], rescale


def _check_patches(config: Any, source: str, image_size: int | None) -> None:
    """image_size (when given) is a positive integer that the model's patches tile: interpolating or
    resizing the position embeddings needs whole patches."""
    if image_size is None:
        return
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 1:
        raise OwaiError(f"hf:{source}: image_size must be a positive integer, got {image_size!r}")
    patch = getattr(config, "patch_size", None)
    if isinstance(patch, int) and image_size % patch:
        raise OwaiError(f"hf:{source}: image_size {image_size} is not a multiple of the patch size {patch}")


POSITIONS = "embeddings.position_embeddings"  # (1, prefix tokens + g x g, D): ViT, DeiT, ViT-MSN


def _at_resolution(model: nn.Module, model_class: Any, kwargs: dict[str, Any], image_size: int) -> nn.Module:
    """`model` rebuilt for image_size x image_size inputs with its position grid resized once
    (`resize_position_grid`), when it has a learned absolute grid of its config's image_size; otherwise
    (no such grid, or already at image_size) `model` itself, which then interpolates at every forward."""
    import copy

    config = model.config
    native, patch = getattr(config, "image_size", None), getattr(config, "patch_size", None)
    if ("interpolate_pos_encoding" not in inspect.signature(model.forward).parameters  # DINOv2 always interpolates
            or not isinstance(native, int) or not isinstance(patch, int) or native == image_size or native % patch):
        return model
    state = model.state_dict()
    positions = state.get(POSITIONS)
    if positions is None or positions.dim() != 3:
        return model
    prefix = positions.shape[1] - (native // patch) ** 2
    if prefix < 0:
        return model
    resized = copy.deepcopy(config)
    resized.image_size = image_size
    with torch.random.fork_rng(devices=[]):  # the fresh weights are all overwritten below
        rebuilt = model_class(resized, **kwargs).to(torch.float32)
    state[POSITIONS] = resize_position_grid(positions, prefix, image_size // patch)
    try:
        rebuilt.load_state_dict(state, strict=True)
    except RuntimeError:  # a model whose other weights depend on the size (none known): interpolate instead
        return model
    return rebuilt


class HFImageBackbone(nn.Module):
    """A transformers image model as a (B, 3, S, S) -> (B, feature_dim) feature backbone.

    `source` is a local checkpoint directory (config.json + weights, read with local_files_only) or a
    hub id (`hf:` prefix allowed). Only the base model is built: a checkpoint's classification head is
    ignored; ViT-like models are built without their pooler, and mask tokens (never used: no masking is
    asked for) get requires_grad=False, so every trainable parameter receives a gradient (DDP). Weights
    the base model needs but the checkpoint lacks are an error, not a silent random initialisation.
    `image_size`, when given, is checked against the patch size of patch models (interpolating the
    position embeddings needs whole patches), and a model with a learned absolute position grid is
    rebuilt for it once (`_at_resolution`). `input_mean` / `input_std` are the statistics the input
    was normalised with, which the module undoes before applying the checkpoint's own: a checkpoint
    always sees its own preprocessing. Fresh, the module is in training mode, like `build_backbone`'s.
    """

    def __init__(self, source: str, image_size: int | None = None,
                 input_mean: tuple[float, ...] = IMAGENET_MEAN, input_std: tuple[float, ...] = IMAGENET_STD) -> None:
        super().__init__()
        from transformers import AutoModel

        self.source = hf_source(source)
        config, local = _load_config(self.source)
        self.model_type: str = config.model_type
        self.feature_dim: int = _feature_dim(config, self.source)
        self.pooled = self.model_type not in CLASS_TOKEN
        _check_patches(config, self.source, image_size)
        self.image_size = image_size

        model_class = AutoModel._model_mapping[type(config)]
        kwargs: dict[str, Any] = {}
        if "add_pooling_layer" in inspect.signature(model_class.__init__).parameters:
            kwargs["add_pooling_layer"] = self.pooled  # pooled models need it (BEiT), class-token ones do not
        where = str(local) if local is not None else self.source
        try:
            with _quiet(local is not None):
                model, info = AutoModel.from_pretrained(
                    where, config=config, local_files_only=local is not None or bool(hub_unreachable()), dtype=torch.float32,
                    output_loading_info=True, use_kernels=False, **kwargs)  # owai.models.lm.load_pretrained says why
        except Exception as e:  # noqa: BLE001 - OSError, safetensors/pickle errors, hub errors: one line
            from owai.models.vision import _load_problem  # never passes on torch's advice to unpickle unsafely

            why = _load_problem(e) if "weights_only" in str(e) or "Unsupported global" in str(e) else one_line(e)
            raise OwaiError(f"hf:{self.source}: cannot load the checkpoint ({why})") from None
        missing = sorted(k for k in info.get("missing_keys", ())
                         if not k.endswith("num_batches_tracked") and not k.startswith("pooler."))
        bad = sorted(str(k) for k in info.get("mismatched_keys", ()))
        if missing or bad:
            what = "lacks" if missing else "has other shapes for"
            raise OwaiError(f"hf:{self.source}: checkpoint {what} {len(missing or bad)} weight tensors of the "
                            f"{self.model_type} base model "
                            f"(e.g. {(missing or bad)[0]}): not a checkpoint of this architecture")
        if image_size is not None:
            model = _at_resolution(model, model_class, kwargs, image_size)
        self.model = model.train()
        for name, p in self.model.named_parameters():
            if name.split(".")[-1] == "mask_token":
                p.requires_grad_(False)

        forward_args = inspect.signature(self.model.forward).parameters
        native = getattr(self.model.config, "image_size", None)
        self.native_size: int | None = native if isinstance(native, int) else None
        self._interpolate_arg = "interpolate_pos_encoding" in forward_args

        mean, std, rescale = _normalisation(local, self.source)
        gain = 255.0 * rescale  # pixel values in [0, 1] -> the processor's [0, 255] * rescale_factor
        gain = 1.0 if abs(gain - 1.0) < 1e-9 else gain
        # x_model = (gain * (x * std_in + mean_in) - mean_m) / std_m = x * scale + shift
        scale = [gain * si / sm for si, sm in zip(input_std, std)]
        shift = [(gain * mi - mm) / sm for mi, mm, sm in zip(input_mean, mean, std)]
        self.register_buffer("scale", torch.tensor(scale).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("shift", torch.tensor(shift).view(1, 3, 1, 1), persistent=False)

    def describe(self) -> str:
        """One line for messages: the source, model type and feature width."""
        return f"hf:{self.source} ({self.model_type}, {self.feature_dim}-d features)"

    def extra_repr(self) -> str:
        return f"source={self.source!r}, feature_dim={self.feature_dim}"

    def forward(self, x: Tensor) -> Tensor:
        """(B, 3, S, S) ImageNet-normalised images -> (B, feature_dim) features."""
        if x.dim() != 4 or x.shape[1] != 3:
            raise OwaiError(f"{self.describe()}: expected images (B, 3, S, S), got shape {tuple(x.shape)}")
        kwargs: dict[str, Any] = {}
        native = self.native_size
        if self._interpolate_arg and native is not None and tuple(x.shape[-2:]) != (native, native):
            kwargs["interpolate_pos_encoding"] = True
        out = self.model(pixel_values=x * self.scale + self.shift, **kwargs)
        if self.pooled:
            pooled = getattr(out, "pooler_output", None)
            if pooled is None:
                raise OwaiError(f"{self.describe()}: the model returned no pooler_output")
            feats = pooled.flatten(1)  # (B, C, 1, 1) or (B, C) -> (B, C)
        else:
            hidden = getattr(out, "last_hidden_state", None)
            if hidden is None or hidden.dim() != 3:
                raise OwaiError(f"{self.describe()}: the model returned no (B, N, D) last_hidden_state")
            feats = hidden[:, 0]  # the class token after the final LayerNorm
        if tuple(feats.shape) != (x.shape[0], self.feature_dim):
            raise OwaiError(f"{self.describe()}: features have shape {tuple(feats.shape)}, "
                            f"expected ({x.shape[0]}, {self.feature_dim})")
        return feats
