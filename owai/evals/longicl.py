"""LongICLBench in-context classification (Li et al. 2024; thesis sec 4.2.3.3; spec evals.md sec 2).

The model-independent half of `owai eval longicl`: everything that turns a labelled data set into
prompts and model continuations into scores, plus two reference "models" that read the prompt text.

    load_banking77 / load_goemotions / load_tacred / load_hf     data -> ICLData (train, test, labels)
    select_demonstrations                                         n shots of one demo per class (2.3)
    select_queries                                                the fixed evaluation queries (2.4)
    render_prompt                                                 header + demos + query (2.5)
    parse_prediction / accuracy / best_strategy                   parsing and scoring (2.6)
    InContextKNN / MajorityLast / synthetic_task                  the offline CPU variant (2.9)
    evaluate                                                      shots x strategies -> JSON-able dict

A "shot" holds one demonstration per class, so an n-shot prompt has n x K demonstrations.
The demonstration lists are nested: the n-shot list is the first n shots of the (n+1)-shot list,
and `evaluate` selects once for the largest n and slices, so the rule holds by construction.
Queries do not depend on the shot count. The thesis reports the best of four prompt strategies
(delimiter newline/space x within-shot order fixed/shuffled) for each n. `evaluate` reports all
four and marks the best one (an oracle choice made on the evaluation set).

A model is any object with `generate(prompt: str) -> str` (the continuation only) and, optionally,
`count_tokens(prompt: str) -> int`. With `max_tokens` set, a prompt over that budget is an
*overflow*. It is counted and reported, never truncated, and it is left out of the accuracy.

Randomness never touches the global RNGs. Each shuffle, anonymous-label permutation and synthetic
corpus comes from its own `random.Random` seeded with a string that names its purpose.
Accuracies are fractions in [0, 1].
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import hashlib
import json
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from owai import console
from owai.errors import DataMissing, OwaiError, not_utf8, one_line
from owai.evals.answers import AnswerLog

SUITE = "longicl"
DEFAULT_QUERIES = 500  # `--test_number 500` in every LongICLBench script


# --------------------------------------------------------------------------------------------
# Data


@dataclass(frozen=True)
class Example:
    """One labelled row. `label` is the original label string. `extra` holds task fields beyond
    the text, e.g. tacred's {"subject": ..., "object": ...}."""

    text: str
    label: str
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ICLData:
    """A task's demonstration pool (`train`), query pool (`test`) and canonical label list.

    `labels` is the canonical order: anonymous label `class_j` is `labels[j]`. Demonstration order
    is *not* this order, it is the order of first appearance in the pool (spec 2.3).
    `template` picks the prompt format ("banking77", "goemotion", "tacred"; empty = `name`).
    `query_quota` is the number of round-robin rounds over the test pool, or for tacred the
    per-relation cap (None = the task's LongICLBench default). `info` holds loader counts.
    """

    name: str
    train: list[Example]
    test: list[Example]
    labels: list[str]
    template: str = ""
    query_quota: int | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def check_pools(self) -> ICLData:
        """Itself, when both pools hold examples; an empty or header-only split is one error (an
        evaluation of 0 queries would report nothing without a word)."""
        for pool, examples in (("demonstration", self.train), ("query", self.test)):
            if not examples:
                raise OwaiError(f"longicl: {self.name}'s {pool} pool is empty ({self.info.get('source', 'no source')})")
        return self

    @property
    def task(self) -> str:
        """The prompt template's name."""
        return self.template or self.name


def _need_file(path: Path) -> Path:
    if not path.is_file():
        raise DataMissing(f"longicl: data file {path} not found")
    return path


def _read_json_list(file: Path, what: str) -> list:
    """The JSON list in `file` (one-line OwaiError when it is not JSON or not a list of `what`)."""
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OwaiError(f"longicl: {file} is not valid JSON ({one_line(e)})") from None
    if not isinstance(value, list):
        raise OwaiError(f"longicl: {file} must hold a JSON list of {what}, got {type(value).__name__}")
    return value


def _check_labels(labels: list[str], source: Path | str) -> list[str]:
    if not labels or not all(isinstance(x, str) and x for x in labels):
        raise OwaiError(f"longicl: {source}: labels must be a non-empty list of non-empty strings")
    if len(set(labels)) != len(labels):
        raise OwaiError(f"longicl: {source}: duplicate label names")
    return labels


def banking77_id_order(names: Sequence[str]) -> list[str]:
    """The 77 BANKING77 ClassLabel names in Hugging Face id order. That order is the case-insensitive
    alphabetical one (activate_my_card = 0, card_arrival = 11, Refund_not_showing_up sorted among the
    r's). PolyAI's categories.json uses first-appearance order instead."""
    return sorted(names, key=str.lower)


def load_banking77(root: Path) -> ICLData:
    """BANKING77 from PolyAI's files in `root`: `train.csv`, `test.csv` (columns text,category; the
    category is the label *name*) and `categories.json`. Labels are in Hugging Face id order (see
    `banking77_id_order`) so that `class_j` means the same with `load_hf("banking77")`."""
    root = Path(root)
    cat_file = _need_file(root / "categories.json")
    names = _read_json_list(cat_file, "category names")
    labels = banking77_id_order(_check_labels(names, cat_file))
    known = set(labels)

    def read(split: str) -> list[Example]:
        path = _need_file(root / f"{split}.csv")
        rows: list[Example] = []
        try:
            with path.open(newline="", encoding="utf-8") as f:
                reader = csv.reader(f)
                header = next(reader, None)
                if header != ["text", "category"]:
                    raise OwaiError(f"longicl: {path}: header must be 'text,category', got {header!r}")
                for row in reader:
                    if len(row) != 2:
                        raise OwaiError(f"longicl: {path} line {reader.line_num}: expected 2 fields, got {len(row)}")
                    text, cat = row
                    if cat not in known:
                        raise OwaiError(f"longicl: {path} line {reader.line_num}: unknown category {cat!r}")
                    rows.append(Example(text, cat))
        except UnicodeDecodeError as e:
            raise OwaiError(f"longicl: {not_utf8(path, e)}") from None
        return rows

    train, test = read("train"), read("test")
    return ICLData("banking77", train, test, labels, info={"source": str(root)})


def _goemotion_rows(rows: list[tuple[str, list[int], str]], names: list[str]) -> tuple[list[Example], int]:
    """Single-label rows as Examples (file order), and the number of rows read."""
    out = []
    for text, ids, row_id in rows:
        if len(ids) == 1:
            out.append(Example(text, names[ids[0]], {"id": row_id}))
    return out, len(rows)


def load_goemotions(root: Path, eval_split: str = "test") -> ICLData:
    """GoEmotions from the official TSV files in `root` (columns text, comma-separated label ids,
    comment id; no header) and `labels.txt` (names in id order). Only single-label rows are kept
    (spec 2.2). `eval_split` is "test" (LongICLBench) or "dev"."""
    root = Path(root)
    if eval_split not in ("test", "dev"):
        raise OwaiError(f"longicl: goemotion eval_split must be 'test' or 'dev', got {eval_split!r}")
    label_file = _need_file(root / "labels.txt")
    try:
        lines = label_file.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise OwaiError(f"longicl: {not_utf8(label_file, e)}") from None
    names = _check_labels([s.strip() for s in lines if s.strip()], label_file)

    def read(split: str) -> list[tuple[str, list[int], str]]:
        path = _need_file(root / f"{split}.tsv")
        rows = []
        try:
            with path.open(newline="", encoding="utf-8") as f:
                reader = csv.reader(f, delimiter="\t")  # quoted fields unescaped, as the hub's go_emotions reader does
                for row in reader:
                    if len(row) != 3:
                        raise OwaiError(f"longicl: {path} line {reader.line_num}: expected 3 tab-separated fields, got {len(row)}")
                    try:
                        ids = [int(s) for s in row[1].split(",")]
                    except ValueError:
                        raise OwaiError(f"longicl: {path} line {reader.line_num}: label ids {row[1]!r} are not integers") from None
                    if not all(0 <= i < len(names) for i in ids):
                        raise OwaiError(f"longicl: {path} line {reader.line_num}: label id out of range 0..{len(names) - 1} in {row[1]!r}")
                    rows.append((row[0], ids, row[2]))
        except UnicodeDecodeError as e:
            raise OwaiError(f"longicl: {not_utf8(path, e)}") from None
        return rows

    train, n_train = _goemotion_rows(read("train"), names)
    test, n_test = _goemotion_rows(read(eval_split), names)
    info = {"source": str(root), "eval_split": eval_split, "train_rows": n_train, "test_rows": n_test}
    return ICLData("goemotion", train, test, names, info=info)


# LongICLBench's fixed relation list (`selected_labels` in its tacred scripts). It is the standard
# TACRED relation id order 1..41 without no_relation, and it agrees with the spec's partial listing:
# org:founded_by, per:employee_of, org:alternate_names, ..., per:country_of_death.
TACRED_RELATIONS = [
    "org:founded_by", "per:employee_of", "org:alternate_names", "per:cities_of_residence",
    "per:children", "per:title", "per:siblings", "per:religion", "per:age", "org:website",
    "per:stateorprovinces_of_residence", "org:member_of", "org:top_members/employees",
    "per:countries_of_residence", "org:city_of_headquarters", "org:members",
    "org:country_of_headquarters", "per:spouse", "org:stateorprovince_of_headquarters",
    "org:number_of_employees/members", "org:parents", "org:subsidiaries", "per:origin",
    "org:political/religious_affiliation", "per:other_family", "per:stateorprovince_of_birth",
    "org:dissolved", "per:date_of_death", "org:shareholders", "per:alternate_names", "per:parents",
    "per:schools_attended", "per:cause_of_death", "per:city_of_death", "per:stateorprovince_of_death",
    "org:founded", "per:country_of_birth", "per:date_of_birth", "per:city_of_birth", "per:charges",
    "per:country_of_death",
]
NO_RELATION = "no_relation"
TACRED_FIELDS = ("sentence", "relation", "subject_entity", "object_entity")


def load_tacred(path: Path) -> ICLData:
    """TACRED as LongICLBench's processed files in directory `path`: `train_tacred.json` and
    `test_tacred.json`, each a JSON list of {sentence, relation, subject_entity, object_entity}.
    `no_relation` rows are dropped. The data is LDC-gated: it is never downloaded."""
    path = Path(path)
    known = set(TACRED_RELATIONS)

    def read(split: str) -> tuple[list[Example], int]:
        file = _need_file(path / f"{split}_tacred.json")
        rows = _read_json_list(file, "rows")
        out = []
        for i, row in enumerate(rows):
            if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in TACRED_FIELDS):
                raise OwaiError(f"longicl: {file} row {i}: needs string fields {', '.join(TACRED_FIELDS)}")
            rel = row["relation"]
            if rel == NO_RELATION:
                continue
            if rel not in known:
                raise OwaiError(f"longicl: {file} row {i}: unknown relation {rel!r}")
            out.append(Example(row["sentence"], rel, {"subject": row["subject_entity"], "object": row["object_entity"]}))
        return out, len(rows)

    (train, n_train), (test, n_test) = read("train"), read("test")
    info = {"source": str(path), "train_rows": n_train, "test_rows": n_test}
    return ICLData("tacred", train, test, list(TACRED_RELATIONS), info=info)


# Hub ids: name -> (repository, config). banking77's parquet mirror is legacy-datasets/banking77.
HF_DATASETS = {
    "banking77": ("PolyAI/banking77", None),
    "PolyAI/banking77": ("PolyAI/banking77", None),
    "legacy-datasets/banking77": ("legacy-datasets/banking77", None),
    "go_emotions": ("google-research-datasets/go_emotions", "simplified"),
    "goemotion": ("google-research-datasets/go_emotions", "simplified"),
    "google-research-datasets/go_emotions": ("google-research-datasets/go_emotions", "simplified"),
}


def load_hf(name: str) -> ICLData:
    """banking77 or go_emotions (config `simplified`) from the Hugging Face hub through
    `datasets.load_dataset`. An unreachable hub, or no `datasets` package, raises DataMissing.
    tacred is not on the hub in usable form: use `load_tacred`."""
    if name not in HF_DATASETS:
        raise OwaiError(f"longicl: unknown hub dataset {name!r}; known: {', '.join(HF_DATASETS)}")
    repo, config = HF_DATASETS[name]
    from owai.hub import load_dataset

    ds = load_dataset(repo, *([config] if config else []), what=f"longicl: {repo}")
    if repo.endswith("banking77"):
        names = list(ds["train"].features["label"].names)

        def split(s: str) -> list[Example]:
            return [Example(text, names[y]) for text, y in zip(ds[s]["text"], ds[s]["label"])]

        return ICLData("banking77", split("train"), split("test"), names, info={"source": repo})
    names = list(ds["train"].features["labels"].feature.names)

    def rows(s: str) -> list[tuple[str, list[int], str]]:
        return list(zip(ds[s]["text"], ds[s]["labels"], ds[s]["id"]))

    train, n_train = _goemotion_rows(rows("train"), names)
    test, n_test = _goemotion_rows(rows("test"), names)
    info = {"source": f"{repo}/{config}", "train_rows": n_train, "test_rows": n_test}
    return ICLData("goemotion", train, test, names, info=info)


# --------------------------------------------------------------------------------------------
# Demonstration and query selection (spec 2.3, 2.4)

# Default query quota: round-robin rounds over the test pool, or tacred's per-relation cap.
QUERY_QUOTA = {"banking77": 7, "goemotion": 25, "tacred": 20}


def label_order(pool: Sequence[Example]) -> list[str]:
    """Labels in order of first appearance in `pool`."""
    return list(dict.fromkeys(ex.label for ex in pool))


def round_robin(pool: Sequence[Example], rounds: int) -> list[list[Example]]:
    """`rounds` rounds of one row per label (labels in first-appearance order, rows in pool order).

    An exhausted label is replaced by the next unused row of the first later label that still has
    rows (a round can then hold a label twice); if no later label has any, nothing replaces it, as
    LongICLBench's `select_data` does (it never looks back at earlier labels). A round can thus be
    short; once the whole pool is used up, no further rounds follow.
    """
    order = label_order(pool)
    buckets: dict[str, list[Example]] = {y: [] for y in order}
    for ex in pool:
        buckets[ex.label].append(ex)
    used = dict.fromkeys(order, 0)
    left = len(pool)
    out: list[list[Example]] = []
    for _ in range(rounds):
        if left == 0:
            break
        shot: list[Example] = []
        for i in range(len(order)):
            if left == 0:
                break
            for y in order[i:]:
                if used[y] < len(buckets[y]):
                    shot.append(buckets[y][used[y]])
                    used[y] += 1
                    left -= 1
                    break
        out.append(shot)
    return out


def tacred_shots(pool: Sequence[Example], relations: Sequence[str], n_shots: int | None = None) -> list[list[Example]]:
    """LongICLBench's tacred selection: one pass over `pool` in stored order. A row is taken if its
    relation is one of `relations` and not yet in the current shot. The shot closes once every
    relation has appeared, and the next shot starts from the following row (skipped rows are not
    revisited). Returns complete shots only, at most `n_shots`."""
    wanted = set(relations)
    shots: list[list[Example]] = []
    current: list[Example] = []
    seen: set[str] = set()
    for ex in pool:
        if n_shots is not None and len(shots) >= n_shots:
            break
        if ex.label in wanted and ex.label not in seen:
            current.append(ex)
            seen.add(ex.label)
            if len(seen) == len(wanted):
                shots.append(current)
                current, seen = [], set()
    return shots


def _positive(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise OwaiError(f"longicl: {name} must be a positive integer, got {v!r}")
    return v


def select_demonstrations(data: ICLData, n_shots: int) -> list[list[Example]]:
    """The demonstrations of an n-shot prompt, as n shots. The n-shot list is a prefix of the
    (n+1)-shot one. A pool too small for n shots is an error, so no prompt is silently shorter."""
    n_shots = _positive("shots", n_shots)
    if data.task == "tacred":
        shots = tacred_shots(data.train, data.labels, n_shots)
        if len(shots) < n_shots:
            raise OwaiError(f"longicl: tacred train pool holds only {len(shots)} complete shots of "
                            f"{len(data.labels)} relations, {n_shots} asked")
        return shots
    shots = round_robin(data.train, n_shots)
    k = len(label_order(data.train))
    if len(shots) < n_shots or len(shots[-1]) < k:
        raise OwaiError(f"longicl: {data.name} train pool ({len(data.train)} rows) is too small for {n_shots} shots of {k}")
    return shots


def select_queries(data: ICLData, n_queries: int = DEFAULT_QUERIES, quota: int | None = None) -> list[Example]:
    """The evaluation queries (spec 2.4): round-robin with `quota` rounds over the test pool
    (banking77 7, goemotion 25), or for tacred the test file in order with at most `quota` rows
    per relation (20). Then the first `n_queries`, or fewer if the selection is shorter.
    They do not depend on the shot count."""
    n_queries = _positive("n_queries", n_queries)
    if quota is None:
        quota = data.query_quota if data.query_quota is not None else QUERY_QUOTA.get(data.task)
    if quota is None:
        raise OwaiError(f"longicl: no query quota for task {data.task!r}; set ICLData.query_quota")
    quota = _positive("query quota", quota)
    if data.task == "tacred":
        counts: dict[str, int] = {}
        picked = []
        for ex in data.test:
            if counts.get(ex.label, 0) < quota:
                counts[ex.label] = counts.get(ex.label, 0) + 1
                picked.append(ex)
    else:
        picked = [ex for shot in round_robin(data.test, quota) for ex in shot]
    return picked[:n_queries]


# --------------------------------------------------------------------------------------------
# Prompts (spec 2.5)


@dataclass(frozen=True)
class TaskFormat:
    """A task's prompt format. `stop_marker` is where a continuation is cut (the next field, as the
    official script cuts it); `input_marker` / `label_marker` find the fields when a prompt is read
    back. `fold_case`: the official script lower-cases the answer and the gold label (banking77,
    goemotion); tacred's compares them as written."""

    header: str
    input_marker: str
    label_marker: str
    stop_marker: str
    fold_case: bool = True


TASKS = {
    "banking77": TaskFormat(
        "Given a customer service query, please predict the intent of the query. The predict answer "
        "must come from the demonstration examples with the exact format. The examples are as follows:",
        "service query:", "intent category:", "service query"),
    "goemotion": TaskFormat(
        "Given a comment, please predict the emotion category of this comment. The predict answer "
        "must come from the demonstration examples with the exact format. The examples are as follows:",
        "comment:", "emotion category:", "comment: "),
    "tacred": TaskFormat(
        "Given a sentence and a pair of subject and object entities within the sentence, please "
        "predict the relation between the given entities. The examples are as follows:",
        "sentence:", " is:", "sentence:", fold_case=False),
}
DELIMITERS = {"newline": "\n", "space": " "}
LABEL_MODES = ("semantic", "anonymous")
TACRED_FORMATS = ("thesis", "longiclbench")
TACRED_LONGICL_LABEL = "the relation between the two entities is:"  # LongICLBench's tacred label field, and its parser's marker
PARSE_PATHS = ("local", "api")


def task_format(task: str) -> TaskFormat:
    """The prompt format of a task template name (an unknown name is an OwaiError)."""
    if task not in TASKS:
        raise OwaiError(f"longicl: unknown task template {task!r}; known: {', '.join(TASKS)}")
    return TASKS[task]


@dataclass(frozen=True)
class PromptOptions:
    """How prompts are rendered. `delimiter` follows every field ("\\n" or " "). `shuffle` permutes
    the demonstrations inside each shot (shot r uses an RNG seeded by (shuffle_seed, r), so shuffled
    prompts are nested too). `labels`: "semantic" or "anonymous" (`class_j`, j = index in the
    canonical list, or a seeded random bijection when `anon_permute` is set; owai's own mode, not
    LongICLBench's). `trailing_space` (default, as LongICLBench): a space after the header's colon
    and after the final label colon. `parse`: how LongICLBench reads the answer, "local" (its
    local-model path: the prompt + the continuation) or "api" (the continuation alone)."""

    delimiter: str = "\n"
    shuffle: bool = False
    shuffle_seed: int = 0
    labels: str = "semantic"
    anon_permute: int | None = None
    trailing_space: bool = True
    tacred_format: str = "thesis"
    parse: str = "local"

    def __post_init__(self) -> None:
        if self.delimiter not in DELIMITERS.values():
            raise OwaiError(f"longicl: delimiter must be a newline or a single space, got {self.delimiter!r}")
        if self.labels not in LABEL_MODES:
            raise OwaiError(f"longicl: labels must be one of {LABEL_MODES}, got {self.labels!r}")
        if self.parse not in PARSE_PATHS:
            raise OwaiError(f"longicl: parse must be one of {PARSE_PATHS}, got {self.parse!r}")
        if self.tacred_format not in TACRED_FORMATS:
            raise OwaiError(f"longicl: tacred_format must be one of {TACRED_FORMATS}, got {self.tacred_format!r}")


@dataclass(frozen=True)
class Strategy:
    """One prompt strategy of the thesis sweep: a delimiter and a within-shot order."""

    name: str
    delimiter: str
    shuffle: bool


STRATEGIES = (
    Strategy("newline-fixed", "\n", False),
    Strategy("newline-shuffled", "\n", True),
    Strategy("space-fixed", " ", False),
    Strategy("space-shuffled", " ", True),
)


def label_space(labels: Sequence[str], mode: str = "semantic", permute_seed: int | None = None) -> dict[str, str]:
    """Original label -> the string the prompt shows. Anonymous: `class_{j}` with j the index in
    `labels`, or, with `permute_seed`, j = a seeded random permutation of the indices."""
    if mode == "semantic":
        return {y: y for y in labels}
    if mode != "anonymous":
        raise OwaiError(f"longicl: labels must be one of {LABEL_MODES}, got {mode!r}")
    ids = list(range(len(labels)))
    if permute_seed is not None:
        random.Random(f"longicl-anon:{permute_seed}").shuffle(ids)
    return {y: f"class_{j}" for y, j in zip(labels, ids)}


def shuffle_shots(shots: Sequence[Sequence[Example]], seed: int) -> list[list[Example]]:
    """Each shot permuted by its own RNG seeded by (seed, shot index); the shot sequence is kept."""
    out = []
    for r, shot in enumerate(shots):
        s = list(shot)
        random.Random(f"longicl-shuffle:{seed}:{r}").shuffle(s)
        out.append(s)
    return out


def _fields(task: str, ex: Example, options: PromptOptions) -> tuple[list[str], str]:
    """(the fields before the label, the label field's prefix ending in a colon)."""
    if task == "banking77":
        return [f"service query: {ex.text}"], "intent category:"
    if task == "goemotion":
        return [f"comment: {ex.text}"], "emotion category:"
    if task == "tacred":
        try:
            subj, obj = ex.extra["subject"], ex.extra["object"]
        except KeyError:
            raise OwaiError("longicl: a tacred example needs extra['subject'] and extra['object']") from None
        if options.tacred_format == "thesis":
            return [f"sentence: {ex.text}"], f"the relation between {subj} and {obj} is:"
        return [f"sentence: {ex.text}", f"the subject is {subj} and the object is {obj}"], TACRED_LONGICL_LABEL
    task_format(task)  # raises for an unknown task
    raise AssertionError(task)


def _shown(ex: Example, space: Mapping[str, str]) -> str:
    try:
        return space[ex.label]
    except KeyError:
        raise OwaiError(f"longicl: label {ex.label!r} is not in the task's label list") from None


def render_context(data: ICLData, shots: Sequence[Sequence[Example]], options: PromptOptions) -> str:
    """Header and demonstrations, every field followed by the delimiter (the part of the prompt
    shared by all queries)."""
    fmt, d = task_format(data.task), options.delimiter
    space = label_space(data.labels, options.labels, options.anon_permute)
    if options.shuffle:
        shots = shuffle_shots(shots, options.shuffle_seed)
    parts = [fmt.header + (" " if options.trailing_space else "") + d]
    for shot in shots:
        for ex in shot:
            before, label_field = _fields(data.task, ex, options)
            parts.extend(f + d for f in before)
            parts.append(f"{label_field} {_shown(ex, space)}{d}")
    return "".join(parts)


def render_query(data: ICLData, query: Example, options: PromptOptions) -> str:
    """The query part: its fields, then the label field's prefix up to the colon."""
    before, label_field = _fields(data.task, query, options)
    return "".join(f + options.delimiter for f in before) + label_field + (" " if options.trailing_space else "")


def gold_label(data: ICLData, query: Example, options: PromptOptions) -> str:
    """The query's label as the prompt's label space writes it."""
    return _shown(query, label_space(data.labels, options.labels, options.anon_permute))


def render_prompt(data: ICLData, shots: Sequence[Sequence[Example]], query: Example,
                  options: PromptOptions | None = None) -> tuple[str, str]:
    """(prompt, gold label string in the prompt's label space) for one query."""
    options = options or PromptOptions()
    return render_context(data, shots, options) + render_query(data, query, options), gold_label(data, query, options)


# --------------------------------------------------------------------------------------------
# Parsing and scoring (spec 2.6)


def parse_prediction(continuation: str, task: str, query: str | None = None, prompt: str | None = None,
                     label_marker: str | None = None) -> str:
    """The predicted label as LongICLBench's script of the task reads it (each task with its own
    markers; `label_marker` overrides the task's, e.g. tacred's LongICLBench template's "the
    relation between the two entities is:"). The response is the continuation (its API path) or
    `prompt` + continuation (its local-model path). If the query text is in the response, the part
    after its last occurrence, stripped, is cut to what lies between the first and second label
    markers (or kept whole without a marker) and at the next input marker; otherwise the response
    is cut at the first input marker. Then stripped, cut at the first newline, lower-cased (not
    tacred: its script compares as written) and stripped."""
    fmt = task_format(task)
    marker = (label_marker or fmt.label_marker).strip()
    response = continuation if prompt is None else prompt + continuation
    if query is None or query not in response:
        response = response.split(fmt.stop_marker)[0].strip()
    else:
        parts = response.split(query)[-1].strip().split(marker)
        response = parts[1].split(fmt.stop_marker)[0].strip() if len(parts) > 1 else parts[0].strip()
    answer = response.strip().split("\n")[0]
    return (answer.lower() if fmt.fold_case else answer).strip()


def is_correct(prediction: str, gold: str, fold_case: bool = True) -> bool:
    """Exact match of a parsed prediction against the gold label, lower-cased with `fold_case`
    (banking77 and goemotion's scripts; tacred's compares as written)."""
    return prediction == (gold.lower() if fold_case else gold)


def accuracy(predictions: Sequence[str], golds: Sequence[str], fold_case: bool = True) -> float:
    """Fraction of exact matches (see `is_correct`)."""
    if len(predictions) != len(golds):
        raise OwaiError(f"longicl: {len(predictions)} predictions for {len(golds)} gold labels")
    if not golds:
        raise OwaiError("longicl: accuracy of an empty set of queries")
    return sum(is_correct(p, g, fold_case) for p, g in zip(predictions, golds)) / len(golds)


def best_strategy(results: Mapping[str, float | None]) -> tuple[str | None, float | None]:
    """(name, accuracy) of the best strategy. The first one wins a tie. Strategies whose accuracy is
    None (every prompt overflowed) are skipped. This is the thesis's oracle choice on the evaluation
    set."""
    best: tuple[str | None, float | None] = (None, None)
    for name, acc in results.items():
        if acc is not None and (best[1] is None or acc > best[1]):
            best = (name, acc)
    return best


# --------------------------------------------------------------------------------------------
# Reading a prompt back, and the reference models (spec 2.9)

_WORD = re.compile(r"\w+")


def read_prompt(prompt: str) -> tuple[str, list[tuple[str, str]], str]:
    """(task, [(demonstration input text, shown label)], query input text) from a rendered prompt.

    The task is recognised by its header. The fields are found by their markers (an input marker
    preceded by whitespace starts a block, and the block's label follows the last label marker in
    it), so both delimiters work. Input text that itself contains a field marker can be misread.
    """
    for task, fmt in TASKS.items():
        if prompt.startswith(fmt.header):
            break
    else:
        raise OwaiError("longicl: the prompt does not start with a known LongICLBench header")
    body = prompt[len(fmt.header):]
    blocks = re.split(r"(?:^|(?<=\s))" + re.escape(fmt.input_marker), body)[1:]
    if not blocks:
        raise OwaiError(f"longicl: no {fmt.input_marker!r} field in the prompt")
    pairs = []
    for block in blocks:
        at = block.rfind(fmt.label_marker)
        if at < 0:
            raise OwaiError(f"longicl: a {fmt.input_marker!r} block has no {fmt.label_marker.strip()!r} field")
        pairs.append((block[:at].strip(), block[at + len(fmt.label_marker):].strip()))
    *demos, (query, _) = pairs
    return task, demos, query


class InContextKNN:
    """Predicts the label of the demonstration that shares the most distinct words (lower-cased
    `\\w+` tokens) with the query. The earliest demonstration wins a tie. It reads the prompt text
    only, so it is blind to the label names: semantic and anonymous labels score the same."""

    def generate(self, prompt: str) -> str:
        _, demos, query = read_prompt(prompt)
        if not demos:
            return ""
        q = set(_WORD.findall(query.lower()))
        best, best_overlap = 0, -1
        for i, (text, _) in enumerate(demos):
            overlap = len(q & set(_WORD.findall(text.lower())))
            if overlap > best_overlap:
                best, best_overlap = i, overlap
        return " " + demos[best][1]


class MajorityLast:
    """Predicts the label of the last demonstration (pure recency bias; accuracy ~ 1/K)."""

    def generate(self, prompt: str) -> str:
        _, demos, _ = read_prompt(prompt)
        return " " + demos[-1][1] if demos else ""


# --------------------------------------------------------------------------------------------
# Offline synthetic corpus (spec 2.9)

_ONSETS = "b c d f g h k l m n p r s t v z br dr gr kl pl tr st".split()
_VOWELS = "a e i o u".split()
_TOPICS = ("problem", "request", "question", "issue", "status", "change", "update", "support")


def synthetic_task(k_classes: int = 8, seed: int = 0, *, n_train: int = 20, n_test: int = 10,
                   n_signature: int = 5, n_filler: int = 3000, length: tuple[int, int] = (8, 20),
                   signatures_per_example: tuple[int, int] = (1, 2), template: str = "banking77") -> ICLData:
    """A K-class corpus for offline runs. Class c has a stem, `n_signature` signature words built
    from the stem, and the semantic label `{stem}_{topic}`. An example has length[0]..length[1]
    words, of which signatures_per_example[0]..[1] are distinct signature words of its class and the
    rest are drawn uniformly from a shared filler vocabulary. The vocabulary is large (3000) so that
    chance overlaps of filler words stay rare and the signature words carry the signal: with 300,
    InContextKNN no longer improves with shots. The train pool (n_train per class) and the test pool
    (n_test per class) are each in a fixed shuffled order. The template defaults to banking77's."""
    k_classes, n_train, n_test = (_positive(n, v) for n, v in (("k_classes", k_classes), ("n_train", n_train), ("n_test", n_test)))
    n_signature, n_filler = _positive("n_signature", n_signature), _positive("n_filler", n_filler)
    lo, hi = length
    s_lo, s_hi = signatures_per_example
    if not (1 <= s_lo <= s_hi <= min(n_signature, lo) and lo <= hi):
        raise OwaiError(f"longicl: synthetic sizes need 1 <= {s_lo} <= {s_hi} <= min(n_signature, {lo}) and {lo} <= {hi}")
    task_format(template)
    rng = random.Random(f"longicl-synthetic:{seed}")
    used: set[str] = set()

    def word(syllables: int, prefix: str = "") -> str:
        while True:
            w = prefix + "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables))
            if w not in used:
                used.add(w)
                return w

    stems = [word(2) for _ in range(k_classes)]
    signatures = [[word(1, prefix=stem) for _ in range(n_signature)] for stem in stems]
    labels = [f"{stem}_{_TOPICS[c % len(_TOPICS)]}" for c, stem in enumerate(stems)]
    filler = [word(3) for _ in range(n_filler)]

    def example(c: int) -> Example:
        n = rng.randint(lo, hi)
        words = rng.sample(signatures[c], rng.randint(s_lo, s_hi))
        words += [rng.choice(filler) for _ in range(n - len(words))]
        rng.shuffle(words)
        return Example(" ".join(words), labels[c])

    def pool(per_class: int) -> list[Example]:
        rows = [example(c) for c in range(k_classes) for _ in range(per_class)]
        rng.shuffle(rows)
        return rows

    train, test = pool(n_train), pool(n_test)
    info = {"seed": seed, "signatures": dict(zip(labels, signatures))}
    return ICLData(f"synthetic-{k_classes}", train, test, labels, template=template, query_quota=n_test, info=info)


# --------------------------------------------------------------------------------------------
# The driver


class ICLModel(Protocol):
    def generate(self, prompt: str) -> str: ...


def prompt_hash(prompt: str) -> str:
    """Short content hash of a prompt (16 hex digits of its sha256)."""
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:16]


# Table 4.6: MMv2 large, semantic labels, largest shot count (accuracy as a fraction).
THESIS_TABLE_4_6 = {"banking77": (10, 0.895), "tacred": (10, 0.630), "goemotion": (16, 0.314)}


def score_prompts(model: ICLModel, data: ICLData, shots: Sequence[Sequence[Example]], queries: Sequence[Example],
                  options: PromptOptions, *, max_tokens: int | None = None, n_examples: int = 3,
                  progress: Callable[[int], Any] | None = None, answers: AnswerLog | None = None) -> dict[str, Any]:
    """One strategy, one shot count: render, check the token budget, generate, parse, score.
    `progress(k)` (a progress bar's update) after every k queries answered or overflowed; `answers`:
    the run's log of continuations (`generate_all`) and of each scored prompt set, which a resumed
    run reads back instead of rendering and counting its prompts again."""
    count: Callable[[str], int] | None = getattr(model, "count_tokens", None)
    if max_tokens is not None and count is None:
        raise OwaiError("longicl: max_tokens needs a model with count_tokens(prompt)")
    context = render_context(data, shots, options)
    space = label_space(data.labels, options.labels, options.anon_permute)
    label_marker = TACRED_LONGICL_LABEL if data.task == "tacred" and options.tacred_format == "longiclbench" else None
    correct = scored = overflow = 0
    longest: int | None = None
    examples = []
    from owai.evals.answers import answer_key, rank0_value
    from owai.evals.causal_lm import generate_all

    # a prompt set scored before a kill is read back whole: its prompts are not counted again
    key = answer_key("longicl-cell", prompt_hash(context), [prompt_hash(render_query(data, q, options)) for q in queries],
                     dataclasses.asdict(options), max_tokens, n_examples, data.task)
    # (a check that cannot raise: it runs on rank 0 alone, while the other ranks wait for its answer)
    done = rank0_value(answers, key, lambda v: isinstance(v, dict) and type(v.get("n_scored")) is int
                       and type(v.get("n_overflow")) is int and v["n_scored"] + v["n_overflow"] == len(queries))
    if done is not None:
        if progress is not None:
            progress(len(queries))
        return done
    prompts = [context + render_query(data, q, options) for q in queries]
    counts = _token_counts(model, prompts) if count is not None else [None] * len(prompts)
    pending: list[tuple[dict[str, Any], str, str]] = []  # (record, prompt, gold) of the queries shown
    for i, (q, prompt, n_tokens) in enumerate(zip(queries, prompts, counts)):
        gold = _shown(q, space)
        record: dict[str, Any] = {"query": i, "prompt_sha256": prompt_hash(prompt), "gold": gold}
        if n_tokens is not None:
            n_tokens = int(n_tokens)
            longest = n_tokens if longest is None else max(longest, n_tokens)
            record["prompt_tokens"] = n_tokens
            if max_tokens is not None and n_tokens > max_tokens:
                overflow += 1
                record["overflow"] = True
        pending.append((record, prompt, gold))
    shown = [(r, p, g) for r, p, g in pending if not r.get("overflow")]
    asked = [p for _, p, _ in shown]
    # the prompts share their demonstrations: a model that can (`CausalLM.shared_prefix`) prefills
    # their common token prefix once and continues each prompt from a copy of its cache
    shared = getattr(model, "shared_prefix", None)
    with shared(asked) if shared is not None and len(asked) > 1 else contextlib.nullcontext():
        continuations = iter(generate_all(model, asked, progress=progress, answers=answers))  # batched where the model can
    if progress is not None and overflow:
        progress(overflow)
    for record, prompt, gold in pending:
        if record.get("overflow"):
            if len(examples) < n_examples:
                examples.append(record)
            continue
        out = next(continuations)
        if not isinstance(out, str):
            raise OwaiError(f"longicl: model.generate must return a string, got {type(out).__name__}")
        query = queries[record["query"]]
        pred = parse_prediction(out, data.task, query.text, prompt if options.parse == "local" else None,
                                label_marker)
        ok = is_correct(pred, gold, task_format(data.task).fold_case)
        scored += 1
        correct += ok
        if len(examples) < n_examples:
            examples.append(record | {"continuation": out[:200], "prediction": pred, "correct": ok})
    result = {
        "accuracy": correct / scored if scored else None,
        "n_correct": correct,
        "n_scored": scored,
        "n_overflow": overflow,
        "max_prompt_tokens": longest,
        "examples": examples,
    }
    if answers is not None:
        answers.add_batch({key: result})
    return result


COUNT_BATCH = 64  # prompts counted at once: a batch of 10-shot prompts is ~1.5M tokens of encodings in memory


def _token_counts(model: Any, prompts: list[str]) -> list[int]:
    """`model.count_tokens` of each prompt: `count_tokens_many` a batch at a time where the model has
    it (a Rust tokenizer counts a batch in parallel), else one by one."""
    many = getattr(model, "count_tokens_many", None)
    if many is None:
        return [model.count_tokens(p) for p in prompts]
    counts: list[int] = []
    for start in range(0, len(prompts), COUNT_BATCH):
        counts += list(many(prompts[start:start + COUNT_BATCH]))
    if len(counts) != len(prompts):
        raise OwaiError(f"longicl: the model counted {len(counts)} of {len(prompts)} prompts")
    return counts


def sweep_strategies(model: ICLModel, data: ICLData, shots: Sequence[Sequence[Example]], queries: Sequence[Example],
                     options: PromptOptions | None = None, strategies: Sequence[Strategy] = STRATEGIES,
                     **kwargs: Any) -> dict[str, Any]:
    """Every strategy's result (delimiter and shuffle taken from the strategy, the rest from
    `options`) and the best one: {"strategies": {name: result}, "best": {"strategy", "accuracy"}}."""
    options = options or PromptOptions()
    results = {s.name: score_prompts(model, data, shots, queries,
                                     dataclasses.replace(options, delimiter=s.delimiter, shuffle=s.shuffle), **kwargs)
               for s in strategies}
    name, acc = best_strategy({k: r["accuracy"] for k, r in results.items()})
    return {"strategies": results, "best": {"strategy": name, "accuracy": acc}}


def evaluate(model: ICLModel, data: ICLData, shots: Sequence[int], options: PromptOptions | None = None,
             n_queries: int = DEFAULT_QUERIES, *, strategies: Sequence[Strategy] = STRATEGIES,
             max_tokens: int | None = None, n_examples: int = 3, answers: AnswerLog | None = None) -> dict[str, Any]:
    """Accuracy per shot count and per strategy, plus the best strategy, as a JSON-able dict. With
    `answers` (the run's log), a resumed run asks the model only for what a kill left unanswered.

    The demonstrations are selected once for max(shots) and sliced, and the queries once. A prompt
    over `max_tokens` (counted with `model.count_tokens`) is an overflow: it is reported in
    `n_overflow` and not scored, and the accuracy is over the scored prompts (None if none were).
    """
    options = options or PromptOptions()
    shot_counts = sorted({_positive("shots", n) for n in shots})
    if not shot_counts:
        raise OwaiError("longicl: no shot counts given")
    if not strategies:
        raise OwaiError("longicl: no prompt strategies given")
    if max_tokens is not None:
        _positive("max_tokens", max_tokens)
    queries = select_queries(data, n_queries)
    all_shots = select_demonstrations(data, shot_counts[-1])
    results = {}
    with console.Bar(f"icl {data.name} {options.labels}", total=len(shot_counts) * len(strategies) * len(queries)) as bar:
        for n in shot_counts:
            bar.update(0, status=f"{n}-shot")
            sweep = sweep_strategies(model, data, all_shots[:n], queries, options, strategies, progress=bar.update,
                                     max_tokens=max_tokens, n_examples=n_examples, answers=answers)
            results[str(n)] = {"n_demonstrations": sum(len(s) for s in all_shots[:n])} | sweep
    config = {
        "task": data.task,
        "shots": shot_counts,
        "n_queries_requested": n_queries,
        "strategies": [dataclasses.asdict(s) for s in strategies],
        "labels": options.labels,
        "anon_permute": options.anon_permute,
        "shuffle_seed": options.shuffle_seed,
        "trailing_space": options.trailing_space,
        "parse": options.parse,
        "max_tokens": max_tokens,
    }
    if data.task == "tacred":
        config["tacred_format"] = options.tacred_format
    if options.labels == "anonymous":
        config["label_map"] = label_space(data.labels, options.labels, options.anon_permute)
    out: dict[str, Any] = {
        "suite": SUITE,
        "data": data.name,
        "config": config,
        "n_queries": len(queries),
        "queries_sha256": prompt_hash("\x1e".join(f"{q.label}\x1f{q.text}" for q in queries)),
        "results": results,
    }
    if data.name in THESIS_TABLE_4_6 and options.labels == "semantic":
        n, acc = THESIS_TABLE_4_6[data.name]
        out["thesis"] = {"shots": n, "accuracy": acc, "source": "Table 4.6, MMv2 large, semantic labels"}
    return out
