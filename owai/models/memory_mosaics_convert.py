"""Official Memory Mosaics checkpoints (facebookresearch/MemoryMosaics) -> owai MemoryMosaicsForCausalLM.

Two sources, detected from the key names or given explicitly:

- "library": `Library/memory_mosaics` `StackAssoMem`, both the regular model (memory_mosaics.py) and
  the "eft" one (memory_mosaics_eft.py, CUDA leaky average). Keys: `emb.weight`, `head.weight`,
  `ln_out.*`, and per block `blocks.{i}.`:
      ln1.*, ln2.*,
      attn.k_featurizer.conv.{weight (C,C,1), bias}      | eft: attn.leaky_average.linear.*
      attn.leaky_key_beta (H)                             | eft: attn.leaky_average.leaky_beta_{w,u}_under
      attn.kernel_beta, attn.value_beta (H), attn.v_featurizer.{linear.*, coef (H)}, attn.c_proj.*,
      pmem.k_featurizer.conv.* | pmem.leaky_average.*, pmem.leaky_key_beta, pmem.kernel_beta,
      pmem.value_beta (H), pmem.pmem.M_k{j}, M_v{j} (1,H,P,hs), pmem.c_proj.*
  Logits x 1/sqrt(C), fan-in init, key-scale exponent clamped at 5 per side.
- "nano": `nanoMosaics/mosaic_model.py` `MemoryMosaic`. Keys: `mosaic.wte.weight`, `lm_head.weight`,
  `mosaic.ln_f.*`, and per block `mosaic.h.{i}.`: ln_1.*, ln_2.*,
      attn.k_featurizer.{W_k.*, leaky_avg.leaky_key_beta (1,H,1,1), key_scale (1,H,1,1)},
      attn.v_featurizer.{W_v.*, coef, val_scale (1,H,1,1)}, attn.c_proj.*,
      mlp.k_featurizer.*, mlp.P_k, mlp.P_v (count,1,H,P,hs), mlp.out_scale, mlp.c_proj.*
  and the buffers `leaky_avg.coef`, `attn.bias` (ignored). No logit scale, 0.02 init, the whole
  key-scale exponent clamped at log(2^16 - 1) (a later revision of the file uses 5: pass
  key_scale_max_exp=5.0 for those checkpoints).

The config (n_layer, n_embd, n_head, pmem_size, pmem_count, vocab_size, bias, tying, attn_only) is
inferred from the shapes. pre_ln cannot be: it comes from the checkpoint's `model_args` when
`load_official_checkpoint` finds them, else the default True; pass overrides as keyword arguments.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

from owai.errors import OwaiError, one_line
from owai.models.memory_mosaics import MemoryMosaicsConfig, MemoryMosaicsForCausalLM

SOURCES = ("library", "nano")

# what each codebase implies beyond the shapes
SOURCE_DEFAULTS: dict[str, dict[str, Any]] = {
    "library": dict(init="library", logit_scale="inv_sqrt_dim", key_clamp="library", key_scale_max_exp=5.0),
    "nano": dict(init="nano", logit_scale="none", key_clamp="nano", key_scale_max_exp=math.log(2**16 - 1),
                 ic_dropout=0.0, hd_dropout=0.0),
}


def _unwrap(obj: Any) -> dict[str, torch.Tensor]:
    """A training checkpoint {"model": sd, ...} or a bare state dict -> sd without compile/DDP prefixes."""
    if isinstance(obj, dict):
        for key in ("model", "state_dict", "model_state_dict"):
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise OwaiError("memory mosaics checkpoint: expected a state dict of tensors (or {'model': state_dict})")
    out = {}
    for name, tensor in obj.items():
        while name.startswith(("_orig_mod.", "module.")):
            name = name.split(".", 1)[1]
        out[name] = tensor
    return out


def detect_source(state_dict: dict[str, torch.Tensor]) -> str:
    """'nano' for nanoMosaics key names, 'library' for Library ones."""
    if any(k.startswith("mosaic.") for k in state_dict):
        return "nano"
    if any(k.startswith("blocks.") for k in state_dict) or "emb.weight" in state_dict:
        return "library"
    raise OwaiError("memory mosaics checkpoint: neither Library (blocks.*) nor nanoMosaics (mosaic.*) key names")


class _Taker:
    """Pops source tensors by name, so that unused ones can be reported."""

    def __init__(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.sd, self.used = state_dict, set()

    def has(self, name: str) -> bool:
        return name in self.sd

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.sd:
            raise OwaiError(f"memory mosaics checkpoint: missing key {name!r}")
        self.used.add(name)
        return self.sd[name]

    def leftover(self, ignore: re.Pattern | None = None) -> list[str]:
        return [k for k in self.sd if k not in self.used and not (ignore and ignore.fullmatch(k))]


def _n_layers(state_dict: dict[str, torch.Tensor], prefix: str) -> int:
    ids = {int(m.group(1)) for k in state_dict if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))}
    if not ids:
        raise OwaiError("memory mosaics checkpoint: no blocks found")
    return max(ids) + 1


def _linear(out: dict, take: _Taker, dst: str, src: str, bias: bool, conv: bool = False) -> None:
    weight = take(src + ".weight")
    if conv:  # Conv1d(C, C, kernel_size=1) == Linear
        if weight.dim() != 3 or weight.shape[-1] != 1:
            raise OwaiError(f"memory mosaics checkpoint: {src}.weight has shape {tuple(weight.shape)}; "
                            "only key kernel size 1 is supported")
        weight = weight[..., 0]
    out[dst + ".weight"] = weight
    if bias:
        out[dst + ".bias"] = take(src + ".bias")


def _scalar(take: _Taker, src: str, n_head: int) -> torch.Tensor:
    t = take(src)
    if t.numel() != n_head:
        raise OwaiError(f"memory mosaics checkpoint: {src} has {t.numel()} values, expected one per head ({n_head})")
    return t.reshape(n_head)


def _tied(take: _Taker, emb: str, head: str) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Embedding and head matrices (either may be absent when tied) and whether they are tied."""
    e = take(emb) if take.has(emb) else None
    h = take(head) if take.has(head) else None
    if e is None and h is None:
        raise OwaiError(f"memory mosaics checkpoint: missing key {emb!r}")
    if e is None or h is None:
        w = e if e is not None else h
        return w, w, True
    return e, h, bool(e.shape == h.shape and torch.equal(e, h))


def _convert_library(take: _Taker, sd: dict) -> tuple[dict, dict]:
    emb, head, tied = _tied(take, "emb.weight", "head.weight")
    V, C = emb.shape
    L = _n_layers(sd, "blocks.")
    H = take("blocks.0.attn.kernel_beta").numel()
    eft = take.has("blocks.0.attn.leaky_average.linear.weight")
    if take.has("blocks.0.attn.v_featurizer.conv.weight"):
        raise OwaiError("memory mosaics checkpoint: v_fe_type='linearconv' values are not supported "
                        "(the paper runs use lowrlinearconv)")
    attn_only = not any(k.startswith("blocks.0.pmem.") for k in sd)
    bias = take.has("blocks.0.ln1.bias")
    cfg: dict[str, Any] = dict(vocab_size=V, n_embd=C, n_layer=L, n_head=H, bias=bias, attn_only=attn_only,
                               tie_word_embeddings=tied)
    count = len([k for k in sd if re.fullmatch(r"blocks\.0\.pmem\.pmem\.M_k\d+", k)])
    if not attn_only:
        if count == 0:
            raise OwaiError("memory mosaics checkpoint: missing key 'blocks.0.pmem.pmem.M_k0'")
        cfg.update(pmem_count=count, pmem_size=sd["blocks.0.pmem.pmem.M_k0"].shape[-2])

    out: dict[str, torch.Tensor] = {"model.wte.weight": emb, "lm_head.weight": head}

    def keys(dst: str, src: str) -> None:  # a key extractor, regular or eft
        if eft:
            _linear(out, take, dst + ".proj", src + ".leaky_average.linear", bias)
            w = _scalar(take, src + ".leaky_average.leaky_beta_w_under", H)
            u_name = src + ".leaky_average.leaky_beta_u_under"
            if take.has(u_name) and not torch.equal(take(u_name).reshape(-1), w):
                raise OwaiError(f"memory mosaics checkpoint: {u_name} differs from the w rate "
                                "(sep_w_on_t=True is not supported)")
            out[dst + ".leak"] = w
        else:
            _linear(out, take, dst + ".proj", src + ".k_featurizer.conv", bias, conv=True)
            out[dst + ".leak"] = _scalar(take, src + ".leaky_key_beta", H)
        out[dst + ".scale"] = _scalar(take, src + ".kernel_beta", H)

    for i in range(L):
        o, s = f"model.h.{i}.", f"blocks.{i}."
        out[o + "ln_1.weight"] = take(s + "ln1.weight")
        if bias:
            out[o + "ln_1.bias"] = take(s + "ln1.bias")
        keys(o + "ctx.key", s + "attn")
        _linear(out, take, o + "ctx.value.proj", s + "attn.v_featurizer.linear", bias)
        out[o + "ctx.value.mix"] = _scalar(take, s + "attn.v_featurizer.coef", H)
        out[o + "ctx.value.scale"] = _scalar(take, s + "attn.value_beta", H)
        _linear(out, take, o + "ctx.c_proj", s + "attn.c_proj", bias)
        if attn_only:
            continue
        out[o + "ln_2.weight"] = take(s + "ln2.weight")
        if bias:
            out[o + "ln_2.bias"] = take(s + "ln2.bias")
        keys(o + "pmem.key", s + "pmem")
        out[o + "pmem.mem_k"] = torch.stack([take(f"{s}pmem.pmem.M_k{j}").reshape(H, -1, C // H) for j in range(count)])
        out[o + "pmem.mem_v"] = torch.stack([take(f"{s}pmem.pmem.M_v{j}").reshape(H, -1, C // H) for j in range(count)])
        out[o + "pmem.out_scale"] = _scalar(take, s + "pmem.value_beta", H)
        _linear(out, take, o + "pmem.c_proj", s + "pmem.c_proj", bias)
    out["model.ln_f.weight"] = take("ln_out.weight")
    if bias:
        out["model.ln_f.bias"] = take("ln_out.bias")
    return cfg, out


def _convert_nano(take: _Taker, sd: dict) -> tuple[dict, dict]:
    emb, head, tied = _tied(take, "mosaic.wte.weight", "lm_head.weight")
    V, C = emb.shape
    L = _n_layers(sd, "mosaic.h.")
    H = take("mosaic.h.0.attn.k_featurizer.key_scale").numel()
    bias = take.has("mosaic.h.0.ln_1.bias")
    pk = take.sd.get("mosaic.h.0.mlp.P_k")
    if pk is None or pk.dim() != 5:
        raise OwaiError("memory mosaics checkpoint: missing key 'mosaic.h.0.mlp.P_k' (count, 1, H, P, hs)")
    cfg: dict[str, Any] = dict(vocab_size=V, n_embd=C, n_layer=L, n_head=H, bias=bias, tie_word_embeddings=tied,
                               pmem_count=pk.shape[0], pmem_size=pk.shape[3])
    out: dict[str, torch.Tensor] = {"model.wte.weight": emb, "lm_head.weight": head}

    def keys(dst: str, src: str) -> None:
        _linear(out, take, dst + ".proj", src + ".W_k", bias)
        out[dst + ".leak"] = _scalar(take, src + ".leaky_avg.leaky_key_beta", H)
        out[dst + ".scale"] = _scalar(take, src + ".key_scale", H)

    for i in range(L):
        o, s = f"model.h.{i}.", f"mosaic.h.{i}."
        for n in ("1", "2"):
            out[f"{o}ln_{n}.weight"] = take(f"{s}ln_{n}.weight")
            if bias:
                out[f"{o}ln_{n}.bias"] = take(f"{s}ln_{n}.bias")
        keys(o + "ctx.key", s + "attn.k_featurizer")
        _linear(out, take, o + "ctx.value.proj", s + "attn.v_featurizer.W_v", bias)
        out[o + "ctx.value.mix"] = _scalar(take, s + "attn.v_featurizer.coef", H)
        out[o + "ctx.value.scale"] = _scalar(take, s + "attn.v_featurizer.val_scale", H)
        _linear(out, take, o + "ctx.c_proj", s + "attn.c_proj", bias)
        keys(o + "pmem.key", s + "mlp.k_featurizer")
        out[o + "pmem.mem_k"] = take(s + "mlp.P_k")[:, 0]
        out[o + "pmem.mem_v"] = take(s + "mlp.P_v")[:, 0]
        out[o + "pmem.out_scale"] = _scalar(take, s + "mlp.out_scale", H)
        _linear(out, take, o + "pmem.c_proj", s + "mlp.c_proj", bias)
    out["model.ln_f.weight"] = take("mosaic.ln_f.weight")
    if bias:
        out["model.ln_f.bias"] = take("mosaic.ln_f.bias")
    return cfg, out


# nano's registered buffers: the T x T leaky coefficients and the causal mask
_NANO_BUFFERS = re.compile(r"mosaic\.h\.\d+\.(attn|mlp)\.k_featurizer\.leaky_avg\.coef|mosaic\.h\.\d+\.attn\.bias")


def convert_official_state_dict(
    state_dict: dict[str, torch.Tensor], source: str | None = None, **config_overrides: Any
) -> tuple[MemoryMosaicsConfig, dict[str, torch.Tensor]]:
    """Official state dict (or a {'model': sd} checkpoint; `_orig_mod.`/`module.` prefixes are fine)
    -> (MemoryMosaicsConfig, owai state dict for MemoryMosaicsForCausalLM.load_state_dict).

    source: "library" | "nano" | None (detect). config_overrides win over the inferred values and the
    source defaults (e.g. pre_ln=False, ic_dropout=0.0). Unknown, missing or mis-shaped keys -> OwaiError,
    and so does a Library setting owai does not implement (v_shift != 1, ...), given as an override or
    found in the checkpoint's `model_args`.
    """
    config_overrides = _check_fixed_args(config_overrides)
    if isinstance(state_dict, dict):
        _hints(state_dict)  # a {'model': sd, 'model_args': {...}} checkpoint: refuse v_shift != 1 etc.
    sd = _unwrap(state_dict)
    source = source or detect_source(sd)
    if source not in SOURCES:
        raise OwaiError(f"memory mosaics checkpoint: source={source!r}, expected one of {SOURCES}")
    take = _Taker(sd)
    cfg_kwargs, out = (_convert_library if source == "library" else _convert_nano)(take, sd)
    leftover = take.leftover(_NANO_BUFFERS if source == "nano" else None)
    if leftover:
        more = f" (+{len(leftover) - 3} more)" if len(leftover) > 3 else ""
        raise OwaiError(f"memory mosaics checkpoint: unexpected {source} keys {leftover[:3]}{more}")
    config = MemoryMosaicsConfig(**{**cfg_kwargs, **SOURCE_DEFAULTS[source], **config_overrides})
    with torch.device("meta"):  # shapes only, no memory and no init
        expected = {k: v.shape for k, v in MemoryMosaicsForCausalLM(config).state_dict().items()}
    if set(expected) != set(out):
        diff = sorted(set(expected) ^ set(out))[:3]
        raise OwaiError(f"memory mosaics checkpoint: converted keys do not match the model: {diff}")
    for name, shape in expected.items():
        if out[name].shape != shape:
            got = tuple(out[name].shape)
            raise OwaiError(f"memory mosaics checkpoint: {name} has shape {got}, expected {tuple(shape)}")
    return config, {k: v.contiguous() for k, v in out.items()}


# Library feature-extractor settings the weights cannot show, and the only values owai implements:
# v_shift 1 (v_t mixes v~_t and v~_{t+1}; query t reads pairs j <= t-1). Another v_shift changes the
# value look-ahead, the attention mask and the zeroed first rows, with the same tensor shapes.
_FIXED_LIBRARY_ARGS: dict[str, Any] = dict(v_shift=1, att_shift=0, v_kernel_size=2, k_kernel_size=1,
                                           v_fe_type="lowrlinearconv", k_fe_type="linearconv")


def _check_fixed_args(settings: dict[str, Any]) -> dict[str, Any]:
    """Drop the fixed Library settings from `settings`; OwaiError (one line) if one differs from owai's."""
    rest = dict(settings)
    for name, want in _FIXED_LIBRARY_ARGS.items():
        if name in rest and rest.pop(name) != want:
            raise OwaiError(f"memory mosaics checkpoint: {name}={settings[name]!r} is not supported "
                            f"(owai implements {name}={want!r}, the paper setting)")
    return rest


def _hints(checkpoint: Any) -> dict[str, Any]:
    """Settings that shapes cannot tell, from a training checkpoint's `model_args` (Library/nano train.py).
    The fixed feature-extractor settings (v_shift ...) are checked here, not passed on."""
    args = checkpoint.get("model_args") if isinstance(checkpoint, dict) else None
    if not isinstance(args, dict):
        return {}
    _check_fixed_args({k: args[k] for k in _FIXED_LIBRARY_ARGS if k in args})
    hints = {k: args[k] for k in ("pre_ln", "ic_dropout", "hd_dropout") if k in args}
    if "dropout" in args:  # nano: one dropout for everything
        hints.setdefault("ic_dropout", args["dropout"])
        hints.setdefault("hd_dropout", args["dropout"])
    return hints


def load_official_checkpoint(
    path: str | Path, source: str | None = None, **config_overrides: Any
) -> MemoryMosaicsForCausalLM:
    """Official checkpoint file (torch `ckpt.pt` loaded with weights_only=True, or .safetensors) ->
    owai MemoryMosaicsForCausalLM in eval mode. See `convert_official_state_dict` for the arguments."""
    path = Path(path)
    if not path.is_file():
        raise OwaiError(f"memory mosaics checkpoint: no file {path}")
    if path.suffix == ".safetensors":
        from owai.io import read_safetensors

        checkpoint: Any = read_safetensors(path)  # unreadable: one line naming the file
    else:
        try:
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - any unreadable file is a user error here
            raise OwaiError(f"memory mosaics checkpoint: cannot read {path}: {one_line(err)}") from err
    config, sd = convert_official_state_dict(checkpoint, source, **{**_hints(checkpoint), **config_overrides})
    model = MemoryMosaicsForCausalLM(config)
    model.load_state_dict(sd, strict=True)
    return model.eval()
