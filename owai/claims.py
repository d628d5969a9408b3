"""Claims as data: the thesis's statements as checkable predicates over a run's measured numbers.

A recipe's `claims:` list states what the thesis claims, each as one predicate kind from `KINDS`:

    - id: heads3-before-lcm                      # unique in the recipe
      text: the 3-head net is accurate before the lcm (266.7)
      kind: compare                               # compare | close | order | direction
      left: heads3.val.accurate_from
      op: "<"
      right: 266.7                                # a number or a metric reference
      presets: [paper]                            # optional: only runs at these presets are judged
      given: {left: heads3.val.acc, op: ">", right: 0.5}   # optional: judged only where this holds

Kinds (each a small class in `KINDS`, checked strictly when the recipe loads):
  compare    left OP right (+ offset): an inequality between two metrics, or a metric and a number
  close      |metric - target| <= tol (or <= rel * |target|): a metric near a thesis number
  order      metrics in increasing / decreasing order (strict by default): an ordering across methods
  direction  `to` - `from` is above min_change (up) or below -min_change (down): between two settings

A metric reference is a metric name (`heads3.val.accurate_from`), a mapping `{metric: NAME, where:
{field: value}}` that picks one record of a study (e.g. `{metric: accuracy, where: {arch: mm,
num_examples: 1000}}`), or an aggregate `{min|max|mean|max_drop: [references]}` over the references that
were measured (`max_drop`: the largest fall from an earlier member to a later one, members in order,
e.g. a method's accuracy over increasing pre-training lengths; it needs two measured members).
`given` (a `compare` without its own id and text) is a claim's premise: a claim about a
fall from a 1x score, say, means nothing when the 1x score is at chance, so when the premise fails
the verdict is "n/a" with the premise's numbers, neither "holds" nor "misses". The records come
from the run (`records`): a single run is one record of its results rows (plus its params as
dotted keys); a study is one record per row of its <study>.json (nested fields flattened to dotted
keys; a row with `metric` and `mean` also holds its mean under that metric name), and a sweep
without a study one record per grid cell (the selected cells when it selects). A missing metric
makes the verdict "n/a" (not measured), never "holds". Nothing is evaluated as code.

A claim that compares models trained and evaluated in separate runs (chapter 4: Memory Mosaics v2
against the transformer, with against without long-term memory, ...) says `across: runs`. It is
judged only by `owai report RUN_DIR RUN_DIR ...` (`judge_across`), on the records of all the runs
given, each metric picked from the run that names its row (`{metric: qa.32k.score, where: {row:
mmv2-large-32k}}`: every reference of such a claim must say `where`); `presets` keeps the runs at
those presets. A single run's or a sweep's verdicts (`judge_all`) leave cross-run claims out: on one
run they could only be n/a.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from owai.errors import OwaiError, did_you_mean
from owai.values import numeric

HOLDS, MISSES, NA = "holds", "misses", "n/a"


def max_drop(values: list[float]) -> float:
    """The largest fall values[i] - values[j] over i < j (negative when the values only rise): a
    drop between an earlier setting and a later one, e.g. Fig 2.7's "too much pre-training"."""
    return max(a - b for i, a in enumerate(values) for b in values[i + 1:])


AGGREGATES: dict[str, Callable[[list[float]], float]] = {"min": min, "max": max, "mean": lambda v: sum(v) / len(v),
                                                         "max_drop": max_drop}
LEAST_MEMBERS = {"max_drop": 2}  # measured members an aggregate needs (others: one)
OPS: dict[str, Callable[[float, float], bool]] = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}
COMMON_KEYS = ("id", "text", "kind", "presets", "given", "across")
ACROSS_RUNS = "runs"  # `across: runs`: a claim judged on the records of several runs (`judge_across`)

Record = dict[str, Any]


class Missing(Exception):
    """A referenced metric was not measured (the claim is n/a); the message says which."""


# --- metric references -----------------------------------------------------------------------------

def check_ref(ref: Any, where: str) -> None:
    """A metric reference must be a name, {metric, where} or {min|max|mean|max_drop: [refs]}."""
    if isinstance(ref, str):
        if not ref.strip():
            raise OwaiError(f"{where}: empty metric name")
        return
    if isinstance(ref, dict) and len(ref) == 1 and next(iter(ref)) in AGGREGATES:
        (agg, members), = ref.items()
        least = LEAST_MEMBERS.get(agg, 1)
        if not isinstance(members, list) or len(members) < least:
            raise OwaiError(f"{where}: {agg} takes a list of {'at least two' if least > 1 else 'one or more'} metrics")
        for m in members:
            check_ref(m, where)
        return
    if isinstance(ref, dict) and "metric" in ref:
        unknown = set(ref) - {"metric", "where"}
        if unknown:
            raise OwaiError(f"{where}: unknown key {sorted(unknown)[0]!r} in a metric reference (metric, where)")
        if not isinstance(ref["metric"], str) or not ref["metric"]:
            raise OwaiError(f"{where}: metric must be a metric name")
        if not isinstance(ref.get("where", {}), dict):
            raise OwaiError(f"{where}: where must be a mapping {{field: value}}")
        return
    raise OwaiError(f"{where}: expected a metric name, {{metric: NAME, where: {{...}}}} or {{{'|'.join(AGGREGATES)}: [...]}}, "
                    f"got {ref!r}")


def check_number_or_ref(value: Any, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, str, dict)):
        raise OwaiError(f"{where}: expected a number or a metric reference, got {value!r}")
    if not isinstance(value, (int, float)):
        check_ref(value, where)


def label(ref: Any) -> str:
    """A reference as a reader sees it: `accuracy[arch=mm]`, `min(a, b)`, or the number (an
    aggregate names its members, so two aggregates in one claim never share a label)."""
    if isinstance(ref, (int, float)):
        return f"{ref:g}"
    if isinstance(ref, str):
        return ref
    if "metric" in ref:
        sel = ",".join(f"{k}={v}" for k, v in (ref.get("where") or {}).items())
        return f"{ref['metric']}[{sel}]" if sel else ref["metric"]
    (agg, members), = ref.items()
    return f"{agg}({', '.join(label(m) for m in members)})"


def _pick(records: list[Record], name: str, where: dict[str, Any]) -> float:
    """The one record with `name` whose fields match `where`. Of several, the general ones win: a
    record that sets a field (e.g. Fig 2.7's `anneal`) another match leaves null is chosen only by
    naming that field in `where`."""
    found = [r for r in records if name in r and all(r.get(k, _ABSENT) == v for k, v in where.items())]
    if len(found) > 1:
        general = [r for r in found if not any(r.get(k) is not None and any(o.get(k) is None for o in found)
                                                for k in r if k not in where)]
        found = general or found
    text = label({"metric": name, "where": where})
    if not found:
        raise Missing(f"{text} not measured")
    if len(found) > 1:
        raise Missing(f"{text} is ambiguous ({len(found)} records match; add fields to where)")
    value = numeric(found[0][name])
    if value is None:
        raise Missing(f"{text} is not a number ({found[0][name]!r})")
    return value


_ABSENT = object()


def resolve(ref: Any, records: list[Record], numbers: dict[str, float]) -> float:
    """The value of a number or metric reference; the metrics used are added to `numbers`."""
    if isinstance(ref, (int, float)) and not isinstance(ref, bool):
        return float(ref)
    if isinstance(ref, str):
        value = _pick(records, ref, {})
    elif "metric" in ref:
        value = _pick(records, ref["metric"], dict(ref.get("where") or {}))
    else:
        (agg, members), = ref.items()
        values = []
        for m in members:
            try:
                values.append(resolve(m, records, numbers))
            except Missing:
                continue
        if not values:
            raise Missing(f"none of {label(ref)} measured")
        if len(values) < LEAST_MEMBERS.get(agg, 1):
            raise Missing(f"fewer than {LEAST_MEMBERS[agg]} of {label(ref)} measured")
        value = AGGREGATES[agg](values)
    numbers[label(ref)] = value
    return value


# --- predicate kinds -------------------------------------------------------------------------------

@dataclasses.dataclass
class Verdict:
    """One claim judged: holds / misses / n/a, the numbers behind it and the comparison made."""

    id: str
    text: str
    kind: str
    verdict: str
    numbers: dict[str, float]
    detail: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Kind:
    """A predicate kind: its keys (required, optional), a schema check and the test itself."""

    name: ClassVar[str]
    required: ClassVar[tuple[str, ...]]
    optional: ClassVar[dict[str, Any]] = {}
    refs: ClassVar[tuple[str, ...]]  # the keys that hold numbers or metric references (a list: `metrics`)

    @classmethod
    def check(cls, spec: dict[str, Any], where: str) -> None:
        """Kind-specific types (the keys are checked by `check_claim`)."""

    @classmethod
    def test(cls, spec: dict[str, Any], get: Callable[[Any], float]) -> tuple[bool, str]:
        """(holds, the comparison as text); `get` resolves a reference (raises Missing)."""
        raise NotImplementedError


def _check_float(spec: dict[str, Any], key: str, where: str, minimum: float | None = None) -> None:
    value = spec.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (minimum is not None and value < minimum):
        bound = f" >= {minimum:g}" if minimum is not None else ""
        raise OwaiError(f"{where}: {key} must be a number{bound}, got {value!r}")


class Compare(Kind):
    """left OP right (+ offset), e.g. ERM's worst-test accuracy < the oracle's - 0.2."""

    name, required, optional = "compare", ("left", "op", "right"), {"offset": 0.0}
    refs = ("left", "right")

    @classmethod
    def check(cls, spec: dict[str, Any], where: str) -> None:
        check_number_or_ref(spec["left"], f"{where}: left")
        check_number_or_ref(spec["right"], f"{where}: right")
        if spec["op"] not in OPS:
            raise OwaiError(f"{where}: op must be one of {', '.join(OPS)}, got {spec['op']!r}")
        _check_float(spec, "offset", where)

    @classmethod
    def test(cls, spec: dict[str, Any], get: Callable[[Any], float]) -> tuple[bool, str]:
        left, right, offset = get(spec["left"]), get(spec["right"]), float(spec.get("offset", 0.0))
        rhs = f"{right:.4g}" + (f" {'+' if offset >= 0 else '-'} {abs(offset):g}" if offset else "")
        return OPS[spec["op"]](left, right + offset), f"{left:.4g} {spec['op']} {rhs}"


class Close(Kind):
    """|metric - target| <= tol (absolute) or <= rel * |target|, e.g. within 0.05 of the thesis's 0.709."""

    name, required, optional = "close", ("metric", "target"), {"tol": None, "rel": None}
    refs = ("metric", "target")

    @classmethod
    def check(cls, spec: dict[str, Any], where: str) -> None:
        check_ref(spec["metric"], f"{where}: metric")
        check_number_or_ref(spec["target"], f"{where}: target")
        if (spec.get("tol") is None) == (spec.get("rel") is None):
            raise OwaiError(f"{where}: give exactly one of tol (absolute) or rel (relative)")
        _check_float(spec, "tol", where, 0.0)
        _check_float(spec, "rel", where, 0.0)

    @classmethod
    def test(cls, spec: dict[str, Any], get: Callable[[Any], float]) -> tuple[bool, str]:
        value, target = get(spec["metric"]), get(spec["target"])
        tol = float(spec["tol"]) if spec.get("tol") is not None else float(spec["rel"]) * abs(target)
        return abs(value - target) <= tol, f"|{value:.4g} - {target:.4g}| = {abs(value - target):.4g} <= {tol:.4g}"


class Order(Kind):
    """metrics in increasing or decreasing order, e.g. Bonsai-cf > Bonsai > random init."""

    name, required, optional = "order", ("metrics", "order"), {"strict": True}
    refs = ("metrics",)

    @classmethod
    def check(cls, spec: dict[str, Any], where: str) -> None:
        if not isinstance(spec["metrics"], list) or len(spec["metrics"]) < 2:
            raise OwaiError(f"{where}: metrics must be a list of at least two metric references")
        for m in spec["metrics"]:
            check_number_or_ref(m, f"{where}: metrics")
        if spec["order"] not in ("increasing", "decreasing"):
            raise OwaiError(f"{where}: order must be increasing or decreasing, got {spec['order']!r}")
        if not isinstance(spec.get("strict", True), bool):
            raise OwaiError(f"{where}: strict must be true or false")

    @classmethod
    def test(cls, spec: dict[str, Any], get: Callable[[Any], float]) -> tuple[bool, str]:
        values = [get(m) for m in spec["metrics"]]
        up = spec["order"] == "increasing"
        op = (operator.lt if up else operator.gt) if spec.get("strict", True) else (operator.le if up else operator.ge)
        sign = {operator.lt: "<", operator.le: "<=", operator.gt: ">", operator.ge: ">="}[op]
        return all(op(a, b) for a, b in zip(values, values[1:])), f" {sign} ".join(f"{v:.4g}" for v in values)


class Direction(Kind):
    """A change between two settings: `to` - `from` > min_change (up) or < -min_change (down)."""

    name, required, optional = "direction", ("from", "to", "direction"), {"min_change": 0.0}
    refs = ("from", "to")

    @classmethod
    def check(cls, spec: dict[str, Any], where: str) -> None:
        check_ref(spec["from"], f"{where}: from")
        check_ref(spec["to"], f"{where}: to")
        if spec["direction"] not in ("up", "down"):
            raise OwaiError(f"{where}: direction must be up or down, got {spec['direction']!r}")
        _check_float(spec, "min_change", where, 0.0)

    @classmethod
    def test(cls, spec: dict[str, Any], get: Callable[[Any], float]) -> tuple[bool, str]:
        start, end, least = get(spec["from"]), get(spec["to"]), float(spec.get("min_change", 0.0))
        change = end - start
        holds = change > least if spec["direction"] == "up" else change < -least
        bound = f"> {least:g}" if spec["direction"] == "up" else f"< {0.0 - least:g}"  # 0.0 - 0.0: "< 0", not "< -0"
        return holds, f"{end:.4g} - {start:.4g} = {change:+.4g} {bound}"


KINDS: dict[str, type[Kind]] = {k.name: k for k in (Compare, Close, Order, Direction)}


# --- schema -------------------------------------------------------------------------------------

def check_claims(claims: Any, recipe_id: str, presets: list[str]) -> None:
    """Strict schema of a recipe's claims; one OwaiError naming the recipe and the claim."""
    if not isinstance(claims, list):
        raise OwaiError(f"recipe {recipe_id}: claims must be a list")
    seen: set[str] = set()
    for i, spec in enumerate(claims):
        name = spec.get("id") if isinstance(spec, dict) else None
        where = f"recipe {recipe_id}: claim {name or f'#{i + 1}'}"
        if not isinstance(spec, dict):
            raise OwaiError(f"{where}: expected a mapping, got {type(spec).__name__}")
        check_claim(spec, where, presets)
        if spec["id"] in seen:
            raise OwaiError(f"{where}: id repeats an earlier claim")
        seen.add(spec["id"])


def check_claim(spec: dict[str, Any], where: str, presets: list[str]) -> None:
    for key in ("id", "text", "kind"):
        if not isinstance(spec.get(key), str) or not spec[key].strip():
            raise OwaiError(f"{where}: {key} must be a non-empty string")
    kind = KINDS.get(spec["kind"])
    if kind is None:
        raise OwaiError(f"{where}: unknown kind {spec['kind']!r}{did_you_mean(str(spec['kind']), KINDS)} "
                        f"(kinds: {', '.join(KINDS)})")
    missing = [k for k in kind.required if k not in spec]
    if missing:
        raise OwaiError(f"{where}: kind {kind.name} needs {missing[0]!r}")
    unknown = set(spec) - set(COMMON_KEYS) - set(kind.required) - set(kind.optional)
    if unknown:
        keys, key = (*COMMON_KEYS, *kind.required, *kind.optional), sorted(unknown)[0]
        raise OwaiError(f"{where}: unknown key {key!r}{did_you_mean(key, keys)} (keys of {kind.name}: {', '.join(keys)})")
    if "presets" in spec:
        own = spec["presets"]
        if not isinstance(own, list) or not own or not all(isinstance(p, str) for p in own):
            raise OwaiError(f"{where}: presets must be a non-empty list of preset names")
        bad = [p for p in own if p not in presets]
        if bad:
            raise OwaiError(f"{where}: preset {bad[0]!r} is not a preset of the recipe ({', '.join(presets)})")
    if "given" in spec:
        given = spec["given"]
        if not isinstance(given, dict) or set(Compare.required) - set(given) or set(given) - {*Compare.required, *Compare.optional}:
            raise OwaiError(f"{where}: given must be a mapping {{left, op, right[, offset]}} (a compare)")
        Compare.check(given, f"{where}: given")
    kind.check(spec, where)
    if "across" in spec:
        check_across(spec, kind, where)


def _metric_refs(value: Any) -> list[Any]:
    """The metric references in a claim's value: a number has none, an aggregate (or `order`'s
    list) those of its members."""
    if isinstance(value, (int, float)):
        return []
    if isinstance(value, list):
        return [r for m in value for r in _metric_refs(m)]
    if isinstance(value, dict) and len(value) == 1 and next(iter(value)) in AGGREGATES:
        return _metric_refs(next(iter(value.values())))
    return [value]


def check_across(spec: dict[str, Any], kind: type[Kind], where: str) -> None:
    """`across: runs`, and every metric of the claim (and of its premise) picked from one run with
    `{metric, where}`: several runs' records each hold every metric of their recipe, so a bare name
    would match them all (ambiguous, n/a) instead of the run the claim means."""
    if spec["across"] != ACROSS_RUNS:
        raise OwaiError(f"{where}: across must be {ACROSS_RUNS!r} (a claim judged on several runs' records), "
                        f"got {spec['across']!r}")
    parts = [(spec, kind)] + ([(spec["given"], Compare)] if "given" in spec else [])
    for part, part_kind in parts:
        for key in part_kind.refs:
            for ref in _metric_refs(part[key]):
                if not (isinstance(ref, dict) and "metric" in ref and ref.get("where")):
                    raise OwaiError(f"{where}: a cross-run claim picks each metric's run: write {label(ref)} as "
                                    f"{{metric: NAME, where: {{row: ...}}}}")


def is_across(spec: dict[str, Any]) -> bool:
    """Whether a claim is judged across runs (`across: runs`) rather than on one run or sweep."""
    return spec.get("across") == ACROSS_RUNS


# --- evaluation ---------------------------------------------------------------------------------

def judge(spec: dict[str, Any], records: list[Record], preset: str | None = None) -> Verdict:
    """One claim on a run's records: holds / misses, or n/a when a metric is missing (or the claim
    is for other presets than the run's)."""
    numbers: dict[str, float] = {}
    base = {"id": spec["id"], "text": spec["text"], "kind": spec["kind"]}
    if spec.get("presets") and preset is not None and preset not in spec["presets"]:
        return Verdict(**base, verdict=NA, numbers={}, detail=f"judged at preset {', '.join(spec['presets'])} only")
    try:
        if "given" in spec:
            premise, premise_detail = Compare.test(spec["given"], lambda ref: resolve(ref, records, numbers))
            if not premise:
                return Verdict(**base, verdict=NA, numbers=numbers, detail=f"premise fails, not judged: not {premise_detail}")
        holds, detail = KINDS[spec["kind"]].test(spec, lambda ref: resolve(ref, records, numbers))
    except Missing as e:
        return Verdict(**base, verdict=NA, numbers=numbers, detail=str(e))
    return Verdict(**base, verdict=HOLDS if holds else MISSES, numbers=numbers, detail=detail if holds else f"not: {detail}")


def judge_all(claims: list[dict[str, Any]], records: list[Record], preset: str | None = None) -> list[dict[str, Any]]:
    """The claims of one run or one sweep judged on its records; cross-run claims are left out
    (`judge_across` judges them on several runs)."""
    return [judge(spec, records, preset).to_json() for spec in claims if not is_across(spec)]


def judge_across(claims: list[dict[str, Any]], runs: list[tuple[list[Record], str | None]]) -> list[dict[str, Any]]:
    """The cross-run claims (`across: runs`) judged on the records of several runs, each given with
    its preset: a claim with `presets` sees only the runs at those presets (n/a when none is), and
    picks each metric from the run its `where` names (n/a when no run does, "ambiguous" when two do)."""
    out = []
    for spec in claims:
        if not is_across(spec):
            continue
        own = spec.get("presets")
        records = [r for of_run, preset in runs if not own or preset in own for r in of_run]
        if own and not records:
            out.append(Verdict(id=spec["id"], text=spec["text"], kind=spec["kind"], verdict=NA, numbers={},
                               detail=f"judged on runs at preset {', '.join(own)} only").to_json())
            continue
        out.append(judge(spec, records).to_json())
    return out


def flatten(value: Any, prefix: str = "") -> Record:
    """Nested dicts as dotted keys; only scalars (numbers, strings, booleans, null) are kept."""
    out: Record = {}
    if isinstance(value, dict):
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif value is None or isinstance(value, (int, float, str, bool)):
        out[prefix[:-1]] = value
    return out


def run_records(results: dict[str, Any], params: dict[str, Any] | None = None) -> list[Record]:
    """A single run: one record, its measured numbers by metric name and its params (dotted keys)."""
    record = _short_keys(flatten(params or {}))
    record.update({row["metric"]: row.get("measured") for row in results.get("rows", [])})
    return [record]


def study_records(rows: list[dict[str, Any]]) -> list[Record]:
    """A study's rows (<study>.json): one flattened record each; a row naming its `metric` with a
    `mean` (the Bonsai tables) also holds the mean under that name."""
    records = []
    for row in rows:
        record = flatten(row)
        if isinstance(row.get("metric"), str) and "mean" in row:
            record[row["metric"]] = row["mean"]
        records.append(record)
    return records


def _short_keys(grid: dict[str, Any]) -> Record:
    """Grid values by full dotted key and, where unambiguous, by the last part (`data.num_examples`
    is also `num_examples`)."""
    out = dict(grid)
    lasts = [k.rsplit(".", 1)[-1] for k in grid]
    for key, last in zip(grid, lasts):
        if lasts.count(last) == 1 and last not in out:
            out[last] = grid[key]
    return out


def summary_records(summary: dict[str, Any]) -> list[Record]:
    """A sweep without a study: one record per grid cell (the selected cell per group when the
    sweep selects), its grid values and the mean over seeds of each metric."""
    selection = summary.get("selection")
    groups = ([{"grid": {**(g.get("grid") or {}), **g["key"]}, "metrics": g["metrics"]} for g in selection["groups"]]
              if selection else summary.get("groups", []))
    return [{**_short_keys(g.get("grid") or {}), **{m["metric"]: m["mean"] for m in g["metrics"]}} for g in groups]


STUDY_SKIP = {"sweep.json", "summary.json", "multi_run.json"}


def study_file(sweep_dir: Path) -> Path | None:
    """The study's <stem>.json in a sweep directory (written by `write_study_files`), if any."""
    import json

    for path in sorted(sweep_dir.glob("*.json")):
        if path.name in STUDY_SKIP:
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("rows"), list) and "sweep_dir" in data:
            return path
    return None


def sweep_records(sweep_dir: Path, summary: dict[str, Any]) -> tuple[list[Record], str]:
    """(records, where they come from) of a sweep directory: its study's rows if it has a study,
    else its summary's cells."""
    import json

    path = study_file(sweep_dir)
    if path is not None:
        return study_records(json.loads(path.read_text())["rows"]), path.name
    return summary_records(summary), "summary.json"


def summary_counts(verdicts: list[dict[str, Any]]) -> str:
    """`3 holds, 1 misses, 2 n/a` (only the non-zero ones), or `no claims`."""
    parts = [f"{sum(v['verdict'] == k for v in verdicts)} {k}" for k in (HOLDS, MISSES, NA)]
    return ", ".join(p for p in parts if not p.startswith("0 ")) or "no claims"
