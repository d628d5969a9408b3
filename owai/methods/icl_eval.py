"""In-context classification, LongICLBench as the thesis runs it (sec 4.2.3.3, Figs 4.6-4.9, Table 4.6;
spec evals.md sec 2): `owai eval icl`.

One run scores one model on one task for every shot count (n x K demonstrations, one per class per
shot), with semantic and anonymous (`class_j`) labels, under the four prompt strategies (newline or
space delimiter x fixed or shuffled order within a shot); the thesis reports the best strategy per
point, owai reports it and all four. Measured: `{labels}.{n}shot.acc` (the best strategy's
accuracy). The figure is Figs 4.6-4.9's accuracy against shots.

    task / data     banking77, goemotion (the official files under the data root: $OWAI_DATA/icl/<task>,
                    or `data=hf` for the hub ids), tacred (LongICLBench's processed JSON, licence-gated:
                    the user's folder), synthetic (a generated K-class corpus: no download)
    model           owai.evals.causal_lm.open_model: a run / save_pretrained directory, a Hugging Face
                    id, or reference:knn / reference:last (validate the pipeline without training)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from owai.config import MAX_CONTEXT, MAX_SAMPLES, MAX_SHOTS, BaseConfig, EvalPrecision, check_count
from owai.errors import OwaiError
from owai.methods import Method, Outcome
from owai.runs import Run

TASKS = ("banking77", "goemotion", "tacred", "synthetic")
LABEL_MODES = ("semantic", "anonymous")
DATA_FOLDERS = {"banking77": "icl/banking77", "goemotion": "icl/goemotions", "tacred": "icl/tacred"}
REFERENCES = ("knn", "last")


@dataclass
class Config(BaseConfig):
    task: str = "banking77"
    # the task's folder, or a root holding icl/<task>; "" = $OWAI_DATA/icl/<task>; "hf" = the hub ids
    data: str = ""
    model: str = ""  # a run or save_pretrained directory, a Hugging Face id, or reference:knn|last
    tokenizer: str = ""  # "" = the one the model was trained with / its own
    shots: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5])
    labels: list[str] = field(default_factory=lambda: list(LABEL_MODES))
    strategies: list[str] = field(default_factory=lambda: ["newline-fixed", "newline-shuffled", "space-fixed",
                                                            "space-shuffled"])
    n_queries: int = 500
    max_new_tokens: int = 32  # the longest label is ~50 characters; LongICLBench generates 100
    max_tokens: int = 0  # the model's context for overflow (0 = the model's own limit, if any)
    # a prompt longer than the model takes is an error before the run unless this is set; then such
    # prompts are counted as overflows, never truncated
    allow_overflow: bool = False
    shuffle_seed: int | None = None  # of the shuffled strategies and the synthetic task; None = the run's seed
    trailing_space: bool = True  # LongICLBench's spaces after the header's and the label's colon
    parse: str = "local"  # LongICLBench's answer parsing: local (prompt + continuation) or api (continuation)
    tacred_format: str = "thesis"  # thesis (App. C.2.3) or longiclbench
    synthetic_classes: int = 8
    precision: EvalPrecision = "auto"  # bfloat16 on CUDA
    batch_size: int = 1  # prompts per generate call (left-padded; models that cannot pad batch rows of one length)
    # prefill each prompt set's shared demonstrations once and continue every query from a copy of
    # their cache (CausalLM.shared_prefix; the same answers); false: every prompt prefilled whole
    prefix_cache: bool = True
    # the thesis row this model stands for, to set its numbers beside the measured ones (recipe
    # fig4.6-icl: Table 4.6 gives mmv2-large's); "" = none
    row: str = ""


class InContextClassification(Method):
    Config = Config
    cli = "owai eval icl"
    # under torchrun each rank holds the whole model and answers its share of each prompt set's
    # batches (`causal_lm.generate_all`); rank 0 logs the answers and writes the results
    data_parallel = True

    @staticmethod
    def validate(cfg: Config) -> None:
        from owai.evals.causal_lm import REFERENCE, check_model, check_model_choice
        from owai.evals.longicl import STRATEGIES

        if cfg.task not in TASKS:
            raise OwaiError(f"task {cfg.task!r}: choose one of {', '.join(TASKS)}")
        if cfg.batch_size < 1:
            raise OwaiError(f"batch_size must be >= 1, got {cfg.batch_size}")
        if check_model_choice(cfg.model, "reference:knn / reference:last") and cfg.model[len(REFERENCE):] not in REFERENCES:
            raise OwaiError(f"{cfg.model}: the ICL reference models are {', '.join('reference:' + r for r in REFERENCES)}")
        bad = [m for m in cfg.labels if m not in LABEL_MODES]
        if not cfg.labels or bad:
            raise OwaiError(f"labels {cfg.labels}: choose from {', '.join(LABEL_MODES)}")
        known = [s.name for s in STRATEGIES]
        bad = [s for s in cfg.strategies if s not in known]
        if not cfg.strategies or bad:
            raise OwaiError(f"strategies {cfg.strategies}: choose from {', '.join(known)}")
        if not cfg.shots:
            raise OwaiError("shots: give one or more shot counts")
        for shots in cfg.shots:
            check_count("shots", shots, 1, MAX_SHOTS)
        check_count("n_queries", cfg.n_queries, 1, MAX_SAMPLES)
        for name in ("max_new_tokens", "synthetic_classes"):
            if getattr(cfg, name) < 1:
                raise OwaiError(f"{name} must be >= 1, got {getattr(cfg, name)}")
        check_count("max_tokens", cfg.max_tokens, 0, MAX_CONTEXT)
        if cfg.tacred_format not in ("thesis", "longiclbench"):
            raise OwaiError(f"tacred_format {cfg.tacred_format!r}: choose thesis or longiclbench")
        data = load_task(cfg)  # missing or malformed files: one line, before any run directory
        from owai.evals.longicl import select_demonstrations

        select_demonstrations(data, max(cfg.shots))  # a pool too small for the shots asked for
        limit, tokenizer = check_model(cfg.model, cfg.tokenizer)
        limit = cfg.max_tokens or limit
        if limit and limit <= cfg.max_new_tokens:  # no room left for any prompt, --allow-overflow or not
            raise OwaiError(f"{cfg.model} takes {limit} tokens, no more than the max_new_tokens={cfg.max_new_tokens} "
                            "it is to generate: lower max_new_tokens, or give a model with a longer context")
        if limit and tokenizer is not None and not cfg.allow_overflow:
            longest = longest_prompt(cfg, data, tokenizer)
            if longest + cfg.max_new_tokens > limit:
                raise OwaiError(f"the {max(cfg.shots)}-shot prompts reach {longest} tokens, more than the {limit} "
                                f"{cfg.model} takes with {cfg.max_new_tokens} to generate: pass --allow-overflow to count "
                                "them as overflows (never truncated), or fewer --shots")

    def run(self, cfg: Config, run: Run) -> Outcome:
        from owai import console
        from owai.evals import longicl
        from owai.evals.answers import run_log
        from owai.evals.causal_lm import open_model

        data = load_task(cfg)
        model = open_model(cfg.model, cfg.tokenizer, run.device, cfg.precision, reference_data=_reference)
        if hasattr(model, "batch_size"):
            model.batch_size = cfg.batch_size
        generator = _Generator(model, cfg.max_new_tokens, cfg.prefix_cache)
        max_tokens = cfg.max_tokens or getattr(model, "max_tokens", None)
        budget = max_tokens - cfg.max_new_tokens if max_tokens else None
        strategies = [s for s in longicl.STRATEGIES if s.name in cfg.strategies]
        answers = run_log(run.path) if run.writes else None  # what a resumed run does not ask again (rank 0's)
        measured: dict[str, Any] = {}
        details: dict[str, Any] = {"task": data.name, "model": cfg.model, "max_tokens": max_tokens}
        curves: dict[str, list[float | None]] = {}
        for mode in cfg.labels:
            options = longicl.PromptOptions(labels=mode, shuffle_seed=shuffle_seed(cfg),
                                            trailing_space=cfg.trailing_space, tacred_format=cfg.tacred_format,
                                            parse=cfg.parse)
            result = longicl.evaluate(generator, data, cfg.shots, options, cfg.n_queries, strategies=strategies,
                                      max_tokens=budget, answers=answers)
            details[mode] = result
            curves[mode] = []
            for n in sorted(set(cfg.shots)):
                acc = result["results"][str(n)]["best"]["accuracy"]
                curves[mode].append(acc)
                if acc is not None:
                    measured[f"{mode}.{n}shot.acc"] = acc
                console.info(f"{data.name} {mode} {n}-shot: best {acc if acc is None else round(acc, 4)}")
        plot_curves(run, data.name, cfg.model, sorted(set(cfg.shots)), curves)
        return Outcome(measured, details)


def longest_prompt(cfg: Config, data: Any, tokenizer: Any) -> int:
    """Tokens of the longest prompt the run will build: the most shots, the query whose own part has
    the most tokens, each label mode, the newline delimiter (a space is never longer). The query is
    chosen by tokens, not characters: on goemotion and tacred the longest text is not the one with
    the most tokens (1 to 4 GPT-2 tokens short), so the check before the run could pass a prompt
    that then overflows."""
    from owai.evals import longicl

    shots = longicl.select_demonstrations(data, max(cfg.shots))
    queries = longicl.select_queries(data, cfg.n_queries)
    fields = longicl.PromptOptions(trailing_space=cfg.trailing_space, tacred_format=cfg.tacred_format)
    query = max(queries, key=lambda q: len(tokenizer.encode(longicl.render_query(data, q, fields))))
    lengths = []
    for mode in cfg.labels:
        options = dataclasses.replace(fields, labels=mode)
        prompt, _ = longicl.render_prompt(data, shots, query, options)
        lengths.append(len(tokenizer.encode(prompt)))
    return max(lengths)


class _Generator:
    """A suite model with this run's generation budget (longicl calls generate(prompt)); with
    `prefix_cache`, the model's `shared_prefix` where it has one (longicl.score_prompts enters it)."""

    def __init__(self, model: Any, max_new_tokens: int, prefix_cache: bool = True) -> None:
        self.model, self.max_new_tokens = model, max_new_tokens
        if prefix_cache and hasattr(model, "shared_prefix"):
            self.shared_prefix = model.shared_prefix
        self.batch_size = getattr(model, "batch_size", 1)  # generate_all's progress steps: the model's batches
        if hasattr(model, "count_tokens"):
            self.count_tokens = model.count_tokens
        if hasattr(model, "count_tokens_many"):
            self.count_tokens_many = model.count_tokens_many

    def generate(self, prompt: str) -> str:
        if hasattr(self.model, "tokenizer"):
            return self.model.generate(prompt, max_new_tokens=self.max_new_tokens)
        return self.model.generate(prompt)

    def generate_many(self, prompts: list[str]) -> list[str]:
        if hasattr(self.model, "generate_many"):
            return self.model.generate_many(prompts, max_new_tokens=self.max_new_tokens)
        return [self.generate(p) for p in prompts]


def _reference(name: str) -> Any:
    from owai.evals import longicl

    return {"knn": longicl.InContextKNN, "last": longicl.MajorityLast}[name]()


def shuffle_seed(cfg: Config) -> int:
    """The seed of the shuffled prompts and of the synthetic task: `shuffle_seed`, else the run's
    `seed` (so a study's seeds shuffle differently; both default to 0)."""
    return cfg.seed if cfg.shuffle_seed is None else cfg.shuffle_seed


def load_task(cfg: Config) -> Any:
    """The task's ICLData from the configured data (module docstring)."""
    from owai.evals import longicl

    if cfg.task == "synthetic":
        return longicl.synthetic_task(cfg.synthetic_classes, shuffle_seed(cfg))
    if cfg.data == "hf":
        if cfg.task == "tacred":
            raise OwaiError("tacred is licence-gated (LDC2018T24): give the folder of LongICLBench's processed JSON")
        return longicl.load_hf(cfg.task).check_pools()
    folder = task_folder(cfg.task, cfg.data)
    loader = {"banking77": longicl.load_banking77, "goemotion": longicl.load_goemotions,
              "tacred": longicl.load_tacred}[cfg.task]
    return loader(folder).check_pools()


def task_folder(task: str, data: str) -> Path:
    """The task's folder by owai's data-root rule (`registry.find_relative`): under `data` when given
    (data/icl/<task>, data/<task>, or `data` itself), else under $OWAI_DATA, then the cache."""
    from owai.data.registry import data_env_problem, find_relative
    from owai.errors import DataMissing

    sub = DATA_FOLDERS[task]
    for rel in (sub, Path(sub).name):
        found = find_relative(rel, data or None)
        if found is not None and found.is_dir() and any(found.iterdir()):
            return found
    if data:
        root = Path(data).expanduser()
        if root.is_dir() and any(root.iterdir()):
            return root
        raise DataMissing(f"{task}: no data at {root} (looked for {root / sub} and {root})")
    problem = data_env_problem()
    raise DataMissing(f"{task}: {problem + '; set it to a folder' if problem else 'set $OWAI_DATA'} (with {sub}/ under it), "
                      "or --set data=DIR, or data=hf for the hub ids")


def plot_curves(run: Run, task: str, model: str, shots: list[int], curves: dict[str, list[float | None]]) -> None:
    """Figs 4.6-4.9's format: accuracy (%) against the number of shots, one line per label mode."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 3.5))
    for mode, accs in curves.items():
        points = [(n, 100 * a) for n, a in zip(shots, accs) if a is not None]
        if points:
            ax.plot(*zip(*points), marker="o", label=f"{mode} labels")
    ax.set_xticks(shots)
    ax.set_xlabel("shots (one demonstration per class each)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(f"{task}: {Path(model).name or model}")
    if ax.lines:
        ax.legend()
    else:  # no prompt fitted the context at any shot count (details' n_overflow): say so, not an empty plot
        ax.text(0.5, 0.5, "no prompt scored: each overflowed\nthe model's context (see n_overflow)",
                ha="center", va="center", transform=ax.transAxes)
    run.save_figure(fig, f"icl_{task}")
