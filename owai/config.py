"""Typed configs: dataclass schemas, strict validation, layered overrides.

Every method declares its parameters as a (nested) dataclass whose defaults are the thesis's
settings. A resolved config is built from layers, each checked against that schema:

    dataclass defaults <- recipe `params` <- recipe preset <- `--set a.b=value` overrides

An unknown key, a wrong type or a bad `--set` path raises `OwaiError` naming the dotted path; so
does, for a method's whole config, a size that cannot fit in memory (`check_sizes`) or a rate or
probability outside its range (`check_ranges`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import re
import types
import typing
from typing import Any, Literal, Union

import yaml

from owai.errors import OwaiError, did_you_mean


@dataclasses.dataclass
class Runtime:
    """Where and how a run executes; shared by every method."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    # only float32 is accepted (check_runtime_dtype): no method computes in this dtype; mixed precision
    # is each method's own setting (train.precision, pretrain.precision, an evaluation's precision)
    dtype: Literal["float32", "bfloat16"] = "float32"
    threads: int = 0  # torch intra-op threads; 0 = torch's default
    deterministic: bool = True
    # flush subnormal floats to zero on CPU: a sharpening softmax produces them and they made
    # three-moons backward passes 4x slower (values < 1.2e-38 change nothing measurable)
    flush_denormal: bool = True
    # an experiment tracker mirroring metrics.jsonl (owai.trackers; rank 0 only): "none",
    # "tensorboard" or "wandb" (each needs its extra); the `--tracker` flag sets it
    tracker: Literal["none", "tensorboard", "wandb"] = "none"


# The dtype of an evaluated model's weights (owai.evals.causal_lm.CausalLM: "auto" = bfloat16 on CUDA,
# float32 elsewhere): the `precision` of the ruler, icl and harness evaluations.
EvalPrecision = Literal["auto", "float32", "bfloat16"]


@dataclasses.dataclass
class BaseConfig:
    """Fields every method config has; method configs subclass this."""

    seed: int = 0
    runtime: Runtime = dataclasses.field(default_factory=Runtime)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    if origin is dict:
        k, v = typing.get_args(tp)
        return f"dict[{_type_name(k)}, {_type_name(v)}]"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _same_shape(tp: Any, value: Any) -> bool:
    """Whether `value` is the container `tp` asks for (a mapping for dataclasses and dicts, a list)."""
    if dataclasses.is_dataclass(tp) or typing.get_origin(tp) is dict:
        return isinstance(value, dict)
    return typing.get_origin(tp) is list and isinstance(value, list)


def coerce(tp: Any, value: Any, path: str) -> Any:
    """Check `value` against type `tp` and return it (ints are accepted for floats)."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise OwaiError(f"{path}: expected a mapping, got {type(value).__name__} {_describe(value)}")
        return build(tp, value, path)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise OwaiError(f"{path}: expected one of {_type_name(tp)}, got {_describe(value)}")
        return value
    if origin in (Union, types.UnionType):
        shaped: OwaiError | None = None  # the error of the first option of the value's shape
        for option in typing.get_args(tp):
            if option is type(None) and value is None:
                return None
            if option is type(None):
                continue
            try:
                return coerce(option, value, path)
            except OwaiError as e:
                shaped = shaped or (e if _same_shape(option, value) else None)
        if shaped is not None:  # e.g. a mapping with a bad entry: name the entry, not the union
            raise shaped
        raise OwaiError(f"{path}: expected {_type_name(tp)}, got {type(value).__name__} {_describe(value)}")
    if origin is list:
        if not isinstance(value, list):
            raise OwaiError(f"{path}: expected {_type_name(tp)}, got {type(value).__name__} {_describe(value)}")
        (item_tp,) = typing.get_args(tp)
        return [coerce(item_tp, item, f"{path}[{i}]") for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise OwaiError(f"{path}: expected {_type_name(tp)}, got {type(value).__name__} {_describe(value)}")
        key_tp, val_tp = typing.get_args(tp)
        return {coerce(key_tp, k, f"{path}"): coerce(val_tp, v, f"{path}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise OwaiError(f"{path}: expected float, got {type(value).__name__} {_describe(value)}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise OwaiError(f"{path}: expected int, got {type(value).__name__} {_describe(value)}")
        return value
    if tp in (bool, str):
        if not isinstance(value, tp):
            raise OwaiError(f"{path}: expected {tp.__name__}, got {type(value).__name__} {_describe(value)}")
        return value
    raise TypeError(f"unsupported config type {tp!r} at {path}")


_TYPE_HINTS: dict[Any, dict[str, Any]] = {}


def type_hints(cls: Any) -> dict[str, Any]:
    """typing.get_type_hints of a config dataclass, once per class (read-only: callers never change it).
    Each call evaluates the class's string annotations anew, and a sweep's design resolves its recipe
    once per point, each resolve reading the hints of every section again (a study of 100 points took
    seconds in them)."""
    hints = _TYPE_HINTS.get(cls)
    if hints is None:
        hints = _TYPE_HINTS[cls] = typing.get_type_hints(cls)
    return hints


def build(cls: type, data: dict[str, Any], path: str = "params") -> Any:
    """Instantiate dataclass `cls` from `data`, rejecting unknown keys and wrong types."""
    hints = type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in names]
    if unknown:
        raise OwaiError(f"{path}: unknown key {unknown[0]!r}{did_you_mean(unknown[0], names)} (known: {', '.join(names)})")
    kwargs = {name: coerce(hints[name], data[name], f"{path}.{name}") for name in names if name in data}
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise OwaiError(f"{path}: missing required key {missing[0]!r}")
    obj = cls(**kwargs)
    if isinstance(obj, BaseConfig):  # a method's whole config: sizes must fit in memory, rates in their ranges
        check_runtime_dtype(obj, path)
        check_sizes(obj, path)
        check_ranges(obj, path)
    return obj


def check_runtime_dtype(cfg: Any, path: str = "params") -> None:
    """Refuse runtime.dtype other than float32: no method computes in it (each trains or evaluates in
    float32 unless its own precision setting asks for bf16), so env.json would record a bfloat16 run
    whose numbers are float32's. The refusal names the method's precision settings, where it has any."""
    dtype = cfg.runtime.dtype
    if dtype == "float32":
        return
    settings = [field_path for field_path, name, _ in _number_fields(cfg, "", (str,)) if name == "precision"]
    where = (f"set {' / '.join(settings)} instead" if settings else "this method computes in float32 only")
    raise OwaiError(f"{path}.runtime.dtype={dtype} changes nothing (no method computes in runtime.dtype); {where}")


# The largest value of each size-like setting (flags and --set alike; docs/decisions.md, issue #40):
# generous beside the thesis, small enough that a typo (10000000k) is refused before a run starts.
MAX_CONTEXT = 1 << 20  # tokens (1024k): 8x RULER's longest length (128k), the longest context a run plans
MAX_SAMPLES = 100_000  # RULER samples per task and length, ICL queries (both 500 in the papers)
MAX_SHOTS = 1024  # ICL demonstrations per class, harness few-shot examples (the thesis's: <= 25)
MAX_DOCUMENTS = 1_000_000  # harness documents per task (--limit; far above any task the thesis runs)
MAX_LAYERS = 1024  # blocks of a language model (--depth, model.n_layer; the thesis's: <= 32)
MAX_NETWORKS = 1024  # rich-features networks n of Cat_n / Distill_n (the thesis's: <= 10)
MAX_EXAMPLES = 1_000_000  # RegBench training automata (the thesis's: <= 20,000)
MAX_WORKERS = 1024  # local worker processes of a sweep (--workers)


def check_count(name: str, value: Any, low: int, high: int) -> None:
    """A size-like setting must be an integer in [low, high]; else one line naming it and both bounds."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise OwaiError(f"{name} must be between {low:,} and {high:,}, got {value!r}")


# Size fields by role, by field name, in every method's config. One batch's activations need at
# least batch x (length x width + length^2 + 3 x image^2) floats (tokens x features, one attention
# map, one RGB input); a config whose lower bound exceeds the machine's memory cannot run.
BATCH_FIELDS = ("batch_size", "eval_batch_size", "batch_per_domain")
LENGTH_FIELDS = ("block_size",)
WIDTH_FIELDS = ("n_embd", "hidden", "n_features")
IMAGE_FIELDS = ("image_size",)


def memory_bytes() -> int:
    """This machine's physical memory in bytes (1 TiB where the OS does not say)."""
    import os

    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return 1 << 40


def _number_fields(obj: Any, prefix: str, kinds: tuple[type, ...] = (int,)) -> list[tuple[str, str, Any]]:
    """(dotted path, field name, value) of every field below dataclass `obj` holding one of `kinds`."""
    found = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            found += _number_fields(value, f"{prefix}{f.name}.", kinds)
        elif isinstance(value, kinds) and not isinstance(value, bool):
            found.append((f"{prefix}{f.name}", f.name, value))
    return found


# Optimisation settings by role, by field name, in every method's config (as the size fields above):
# a learning rate is > 0 (its schedule's end points >= 0), a regulariser's strength >= 0, a count of
# threads or worker processes in [0, MAX_WORKERS], a seed a 64-bit integer, a dropout or momentum in
# [0, 1), a fraction in [0, 1]; no float setting is NaN or infinite. A method's own `validate` adds
# what is specific to it (min_lr <= lr, a fraction that must be above 0, ...).
SCHEDULE_END_FIELDS = ("min_lr", "warmup_lr", "lr_end")
NON_NEGATIVE_FIELDS = ("weight_decay", "l2", "grad_clip", "clip")
COUNT_FIELDS = ("threads", "workers")  # threads, loader or tokeniser processes: 0 = the default, at most MAX_WORKERS
UNIT_INTERVAL_FIELDS = ("dropout", "momentum")
SEED_RANGE = (-(2**63), 2**63 - 1)  # a 64-bit integer: torch.manual_seed overflows beyond it, inside the run


def _setting_range(name: str) -> tuple[str, typing.Callable[[float], bool]] | None:
    """(what the value must be, test) for field `name`, or None where its role sets no range."""
    if name == "seed" or name.endswith("_seed"):
        return "a 64-bit integer (-2**63 to 2**63 - 1)", lambda v: SEED_RANGE[0] <= v <= SEED_RANGE[1]
    if name in COUNT_FIELDS:  # torch.set_num_threads(100000) crashes the process; as many loaders would swamp it
        return f"between 0 and {MAX_WORKERS:,}", lambda v: 0 <= v <= MAX_WORKERS
    if name in SCHEDULE_END_FIELDS:
        return ">= 0", lambda v: v >= 0
    if name == "lr" or name.endswith("_lr"):
        return "> 0", lambda v: v > 0
    if name in NON_NEGATIVE_FIELDS or name.endswith("_weight_decay"):
        return ">= 0", lambda v: v >= 0
    if name in UNIT_INTERVAL_FIELDS or name.endswith("_dropout"):
        return "in [0, 1)", lambda v: 0 <= v < 1
    if name.endswith(("fraction", "_share", "_ratio")):
        return "in [0, 1]", lambda v: 0 <= v <= 1
    return None


def check_ranges(cfg: Any, path: str = "params") -> None:
    """Reject a NaN or infinite float setting, and a rate or probability outside its range (by the
    field's name, `_setting_range`), in one line naming it, before a run starts training on it."""
    for field_path, name, value in _number_fields(cfg, "", (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise OwaiError(f"{path}.{field_path} must be a finite number, got {value!r}")
        rule = _setting_range(name)
        if rule is not None and not rule[1](value):
            raise OwaiError(f"{path}.{field_path} must be {rule[0]}, got {value!r}")


def check_sizes(cfg: Any, path: str = "params", limit: int | None = None) -> None:
    """Reject sizes (batch, context, width, image) whose smallest possible activation memory
    exceeds `limit` bytes (default: this machine's memory), before anything is allocated. A context
    length beyond MAX_CONTEXT is refused first, naming the maximum."""
    fields = _number_fields(cfg, "")
    for field_path, name, value in fields:
        if name in LENGTH_FIELDS and value > MAX_CONTEXT:
            raise OwaiError(f"{path}: {field_path} must be at most {MAX_CONTEXT:,} tokens (1024k), got {value:,}")

    def largest(names: tuple[str, ...]) -> tuple[str, int]:
        chosen = [(p, v) for p, n, v in fields if n in names and v > 0]
        return max(chosen, key=lambda pv: pv[1]) if chosen else ("", 0)

    batch, length, width, image = (largest(n) for n in (BATCH_FIELDS, LENGTH_FIELDS, WIDTH_FIELDS, IMAGE_FIELDS))
    if not batch[0]:
        return
    per_example = max(length[1], 1) * max(width[1], 1) + length[1] ** 2 + 3 * image[1] ** 2
    needed = 4 * batch[1] * per_example
    limit = memory_bytes() if limit is None else limit
    if needed > limit:
        named = ", ".join(f"{p}={v}" for p, v in (batch, length, width, image) if p)
        biggest = max((pv for pv in (batch, length, image) if pv[0]), key=lambda pv: pv[1])
        raise OwaiError(f"{path}: {named} need at least {needed / 2**30:,.0f} GiB for one batch, more than this "
                        f"machine's {limit / 2**30:,.0f} GiB; lower {biggest[0]}")


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge: mappings merge key by key, anything else replaces."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """yaml.SafeLoader that also reads `1e-3` (no dot) as a float, as YAML 1.2 does. It parses with
    libyaml where PyYAML was built with it (its wheels are): the recipes are 0.3 MB of YAML, which the
    pure-Python parser takes 0.4 s to read (libyaml 0.04 s), and `owai recipes list` reads them all."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|\.[0-9_]+(?:[eE][-+]?[0-9]+)?"
               r"|[0-9][0-9_]*[eE][-+]?[0-9]+|\.inf|\.Inf|\.INF|\.nan|\.NaN|\.NAN)$"),
    list("-+0123456789."),
)


def load_yaml(text: str) -> Any:
    """Parse YAML safely (no object construction), reading 1e-3 as a float."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader


@functools.lru_cache(maxsize=4096)
def _override_value(raw: str) -> Any:
    """A `--set` value as `load_yaml` reads it (the raw text where it is no YAML), parsed once per
    text: a sweep's design applies the same overrides to every point."""
    try:
        return load_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError:
        return raw


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse `a.b.c=value`; the value is read as YAML (so 1e-3 is a float, [1,2] a list)."""
    if "=" not in text:
        raise OwaiError(f"--set {text!r}: expected KEY.PATH=VALUE")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not key.strip() or any(not p for p in parts):
        raise OwaiError(f"--set {text!r}: empty key in path")
    return parts, copy.deepcopy(_override_value(raw))  # a copy: the caller's config may change a list it holds


def override_leaves(text: str) -> list[tuple[str, Any]]:
    """The dotted keys a `--set KEY=VALUE` writes, each with its value: KEY, or for a mapping
    (`--set 'penalty={weight: 3}'`) each key under it."""
    parts, value = parse_override(text)

    def walk(key: str, value: Any) -> list[tuple[str, Any]]:
        if isinstance(value, dict) and value:
            return [leaf for k, v in value.items() for leaf in walk(f"{key}.{k}", v)]
        return [(key, value)]

    return walk(".".join(parts), value)


def apply_overrides(cls: type, data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `--set` overrides to a params dict, checking each path exists in schema `cls`."""
    out = dict(data)
    for text in overrides:
        parts, value = parse_override(text)
        schema: Any = cls
        for i, part in enumerate(parts):
            if not dataclasses.is_dataclass(schema):
                raise OwaiError(f"--set {text!r}: {'.'.join(parts[:i])} is not a section")
            names = [f.name for f in dataclasses.fields(schema)]
            if part not in names:
                where = ".".join(parts[:i]) or "params"
                raise OwaiError(f"--set {text!r}: unknown key {part!r} in {where}{did_you_mean(part, names)} "
                                f"(known: {', '.join(names)})")
            schema = type_hints(schema)[part]
        node = out
        for part in parts[:-1]:
            node[part] = dict(node.get(part) or {})
            node = node[part]
        # a mapping given for a section sets the keys it names, as `--set section.key=...` each would
        # (override_leaves reads it so); a mapping-valued setting (dict[str, ...]) is replaced whole
        node[parts[-1]] = _into_section(schema, node.get(parts[-1]), value)
    return out


def _into_section(schema: Any, current: Any, value: Any) -> Any:
    """`value` written over `current` at a key of type `schema`: into a section (a dataclass) key by
    key, recursively through its sections; anything else replaces."""
    if not (dataclasses.is_dataclass(schema) and isinstance(value, dict) and value):
        return value
    hints = type_hints(schema)
    out = dict(current) if isinstance(current, dict) else {}
    for key, item in value.items():
        out[key] = _into_section(hints.get(key), out.get(key), item)
    return out
