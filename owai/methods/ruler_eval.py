"""RULER, long-context recall as the thesis measures it (sec 4.2.3.2, Tables 4.4, 4.5, 4.7, 4.8, C.1, C.2;
spec evals.md sec 1): `owai eval ruler --ctx 32k`.

One run scores one model on RULER's tasks at every context length: qa_1 (SQuAD v2) and qa_2
(HotpotQA), the two the thesis reports (its score per length is their mean, `qa.{ctx}.score`),
and the synthetic niah / vt / cwe / fwe tasks. Prompts are fitted to each length's token budget
with the model's own tokenizer (RULER's 2024 step rule or its 2025 binary search); a prompt the
model cannot take is an overflow, counted, never truncated. Measured: `{task}.{ctx}.score`
(0-100) and, with both QA tasks, `qa.{ctx}.score`.

    data        squad / hotpotqa: the official dev JSON files (a path, or relative to the data root:
                $OWAI_DATA/...), or `hf` / `hf:<id>` for the hub; the essay haystack: a folder of .txt
                essays (RULER's Paul Graham list: $OWAI_DATA/text/paul_graham_essays)
    model       owai.evals.causal_lm.open_model: a run / save_pretrained directory, a Hugging Face id,
                or reference:oracle / reference:null / reference:slot:K (validate the pipeline)
    tokenizer   the model's own (`tokenizer` overrides it); reference models fit prompts with
                `reference_tokenizer` (default: GPT-2's files under the data root, tokenizers/gpt2)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from owai.config import MAX_CONTEXT, MAX_SAMPLES, BaseConfig, EvalPrecision, check_count
from owai.errors import OwaiError
from owai.methods import Method, Outcome
from owai.runs import Run


@dataclass
class Config(BaseConfig):
    tasks: list[str] = field(default_factory=lambda: ["qa_1", "qa_2"])
    ctx: list[str] = field(default_factory=lambda: ["4k", "8k", "16k", "32k"])  # 4k = 4096 tokens, ...
    n: int = 500  # samples per task and length (RULER's default)
    seed: int = 42
    model: str = ""
    tokenizer: str = ""  # overrides the model's own (recorded) tokenizer
    # what fits the prompts of reference models (which have no tokenizer): a folder of GPT-2's
    # encoder.json + vocab.bpe (relative: under the data root), a tokenizer.json or a tokenizer name
    reference_tokenizer: str = "tokenizers/gpt2"
    squad: str = "hf"  # SQuAD v2 dev JSON, hf / hf:<id>, or synthetic (invented facts, offline)
    hotpotqa: str = "hf"  # HotpotQA dev-distractor JSON, hf / hf:<id>, or synthetic
    haystack_dir: str = "text/paul_graham_essays"  # the essay haystack (relative: under the data root)
    rule: str = "2024"  # RULER as published: 2024 (commit 7061a05, step search) or 2025 (head, binary search)
    template: str = "ruler"  # QA prompt: ruler (RULER's base template) or thesis-short
    max_tokens: int = 0  # the model's maximum length for overflow (0 = the model's own limit, if any)
    # a length longer than the model takes is an error before the run unless this is set; then its
    # prompts are counted as overflows (the thesis's "x" columns), never truncated
    allow_overflow: bool = False
    ablate: list[str] = field(default_factory=list)  # e.g. [long_term_memory] (Table C.1), at inference only
    precision: EvalPrecision = "auto"  # bfloat16 on CUDA
    batch_size: int = 1  # prompts per generate call (left-padded; models that cannot pad batch rows of one length)
    # the thesis row this model stands for, to set its numbers beside the measured ones (recipe
    # table4.4-ruler): transformer-small, mmv2-small, transformer-large, mmv2-large (trained at 4k,
    # Table 4.4), the same with -32k (fine-tuned at 32k, Table 4.5), mmv2-large-32k-no-ltm (Table C.1)
    row: str = ""


class Ruler(Method):
    Config = Config
    cli = "owai eval ruler"
    # under torchrun each rank holds the whole model and answers its share of each cell's batches
    # (`causal_lm.generate_all`); rank 0 logs the answers and writes the results
    data_parallel = True

    @staticmethod
    def unused_settings(cfg: Config) -> dict[str, str]:
        """The inputs of the tasks this run does not score (`tasks`), and the reference models'
        tokenizer when the model has its own."""
        from owai.evals import ruler

        unused: dict[str, str] = {}
        if cfg.model and not cfg.model.startswith("reference:"):
            unused["reference_tokenizer"] = ("the tokenizer that fits the prompts of a reference model (--model reference:...); "
                                             f"--model {cfg.model} fits them with its own (--tokenizer overrides it)")
        if not cfg.tasks:
            return unused  # `validate` refuses the empty task list itself
        tasks = f"this run's tasks are {', '.join(map(str, cfg.tasks))} (--tasks)"
        for task, key, name in (("qa_1", "squad", "SQuAD v2"), ("qa_2", "hotpotqa", "HotpotQA")):
            if task not in cfg.tasks:
                unused[key] = f"the {name} dev file of task {task}; {tasks}"
        if not any(t in ruler.QA_TASKS for t in cfg.tasks):
            unused["template"] = f"the QA prompt of tasks qa_1 / qa_2; {tasks}"
        if not essay_tasks(cfg.tasks):  # niah_single_1, niah_multikey_2/3, vt, cwe, fwe read no essay
            unused["haystack_dir"] = f"the essay haystack (--haystack-dir) of tasks {', '.join(essay_tasks())}; {tasks}"
        return unused

    @staticmethod
    def validate(cfg: Config) -> None:
        from owai.evals import ruler
        from owai.evals.causal_lm import REFERENCE, check_ablation, check_model, check_model_choice

        reference = check_model_choice(cfg.model, "reference:oracle / reference:null / reference:slot:K", cfg.ablate)
        if cfg.batch_size < 1:
            raise OwaiError(f"batch_size must be >= 1, got {cfg.batch_size}")
        known = (*ruler.QA_TASKS, *ruler.SYNTHETIC_TASKS)
        bad = [t for t in cfg.tasks if t not in known]
        if not cfg.tasks or bad or len(set(cfg.tasks)) != len(cfg.tasks):
            raise OwaiError(f"tasks {cfg.tasks}: give distinct tasks from {', '.join(known)}")
        if not cfg.ctx:
            raise OwaiError("ctx: give at least one context length (4k, 8k, ... or a number of tokens)")
        budgets = [ruler.parse_context_length(length) for length in cfg.ctx]
        if len(set(budgets)) != len(budgets):
            raise OwaiError(f"ctx {cfg.ctx}: give each context length once (32k and 32K, or 4k and 4096, are one length)")
        check_count("n", cfg.n, 1, MAX_SAMPLES)
        check_count("max_tokens", cfg.max_tokens, 0, MAX_CONTEXT)
        if cfg.rule not in ruler.RULES:
            raise OwaiError(f"rule {cfg.rule!r}: choose {' or '.join(ruler.RULES)}")
        if reference:
            name = cfg.model[len(REFERENCE):]
            if name not in ("oracle", "null") and not (name.startswith("slot:") and name[5:].isdigit() and int(name[5:]) >= 1):
                raise OwaiError(f"{cfg.model}: the RULER reference models are reference:oracle, reference:null, "
                                "reference:slot:K (K >= 1)")
            if not cfg.reference_tokenizer:
                raise OwaiError("a reference model needs reference_tokenizer to fit prompts to token budgets "
                                "(e.g. a folder with GPT-2's encoder.json + vocab.bpe)")
            reference_tokenizer(cfg.reference_tokenizer)  # loads, or one line
        check_ablation(cfg.model, cfg.ablate)  # the model's own settings before the data it is fed
        essays = None
        if essay_tasks(cfg.tasks):
            essays = haystack_folder(cfg.haystack_dir)
            ruler.read_essays(essays)
        offline, pools = "", {}
        for task, kind, source in (("qa_1", "squad", cfg.squad), ("qa_2", "hotpotqa", cfg.hotpotqa)):
            if task in cfg.tasks and not _remote(source):
                pools[task] = ruler.load_qa(kind, source if source == "synthetic" else qa_source(source))  # missing fields: one line
            elif task in cfg.tasks:
                from owai.hub import hub_unreachable

                # no hub: the dataset must be in the local cache (a local read), or the run would fail once
                # started; reading it now refuses before the run directory exists, naming --set squad/hotpotqa
                offline = offline or hub_unreachable()
                if offline:
                    pools[task] = ruler.load_qa(kind, source)
        limit, tok = check_model(cfg.model, cfg.tokenizer)
        check_lengths(cfg, pools, essays, tok)
        limit = cfg.max_tokens or limit
        too_long = [c for c in cfg.ctx if limit and ruler.parse_context_length(c) > limit]
        if too_long and not cfg.allow_overflow:
            raise OwaiError(f"context {', '.join(map(str, too_long))} is longer than the {limit} tokens {cfg.model} takes: "
                            "pass --allow-overflow to count those prompts as overflows (never truncated)")

    def run(self, cfg: Config, run: Run) -> Outcome:
        import contextlib

        from owai import console
        from owai.evals import ruler
        from owai.evals.answers import run_log
        from owai.evals.causal_lm import REFERENCE, open_model

        pools = {}
        for task, kind, source in (("qa_1", "squad", cfg.squad), ("qa_2", "hotpotqa", cfg.hotpotqa)):
            if task in cfg.tasks:
                pools[task] = ruler.load_qa(kind, source if _remote(source) or source == "synthetic" else qa_source(source))
        essays = haystack_folder(cfg.haystack_dir) if essay_tasks(cfg.tasks) else None
        tasks = [ruler.qa_task(t, pools[t], cfg.template, cfg.rule) if t in pools
                 else ruler.synthetic_task(t, essays, cfg.rule) for t in cfg.tasks]

        def reference(name: str) -> Any:
            if name == "null":
                return ruler.NullModel()
            if name == "oracle":
                return ruler.OracleReader(*pools.values())
            return ruler.SlotReader(int(name[5:]), *pools.values())

        model = open_model(cfg.model, cfg.tokenizer, run.device, cfg.precision, reference_data=reference)
        if hasattr(model, "batch_size"):
            model.batch_size = cfg.batch_size
        if cfg.model.startswith(REFERENCE):
            tokenizer = reference_tokenizer(cfg.reference_tokenizer)
        else:
            tokenizer = _OwaiTokenizer(model.tokenizer)
        max_tokens = cfg.max_tokens or getattr(model, "max_tokens", None)
        with contextlib.ExitStack() as stack:
            for name in cfg.ablate:
                stack.enter_context(model.ablate(name))
            result = ruler.evaluate(model, tasks, cfg.ctx, cfg.n, cfg.seed, tokenizer, max_tokens,
                                    answers=run_log(run.path) if run.writes else None)  # rank 0's log
        measured: dict[str, Any] = {}
        for task, by_length in result["results"].items():
            for length, cell in by_length.items():
                if cell["score"] is not None:
                    measured[f"{task}.{length}.score"] = cell["score"]
                console.info(f"{task} {length}: {cell['score']} (n {cell['n']}, overflow {cell['overflow']})")
        for length, score in result.get("qa_mean", {}).items():
            if score is not None:
                measured[f"qa.{length}.score"] = score
        result["model"], result["ablate"], result["max_tokens"] = cfg.model, list(cfg.ablate), max_tokens
        return Outcome(measured, result)


def check_lengths(cfg: Config, pools: dict[str, Any], essays: Path | None, tok: Any) -> None:
    """Each context length must leave room for some of each task's prompts, or every sample would
    overflow and the run score nothing. `Task.smallest` (the template with the least haystack the task
    allows and the answer, counted with the tokenizer that fits the prompts) finds the lengths near that
    floor cheaply; at those the run's own samples are built (small at such lengths) and the length is
    refused when none fits. A QA task whose data the run reads from the hub is checked by its overflow count."""
    from owai.evals import ruler

    if cfg.model.startswith("reference:"):
        counter = reference_tokenizer(cfg.reference_tokenizer)
    else:
        from owai.data.text import load_tokenizer

        counter = _OwaiTokenizer(tok if tok is not None else load_tokenizer(cfg.tokenizer or cfg.model))
    for name in cfg.tasks:
        if name in ruler.QA_TASKS and name not in pools:
            continue
        task = (ruler.qa_task(name, pools[name], cfg.template, cfg.rule) if name in pools
                else ruler.synthetic_task(name, essays, cfg.rule))
        for length in dict.fromkeys(cfg.ctx):
            budget = ruler.parse_context_length(length)
            need = task.smallest(budget, counter, cfg.seed)
            if 2 * need > budget and not any(s.fits for s in task.build(cfg.n, budget, counter, cfg.seed).samples):
                raise OwaiError(f"context {length} is too short for {name}: none of its prompts fits in {budget} tokens "
                                f"with its answer, even with the least haystack (RULER's template and the needles "
                                f"alone take about {need}); give --ctx {need} or more")


def reference_tokenizer(name: str) -> Any:
    """The tokenizer that fits a reference model's prompts: a folder of GPT-2's files (relative to the
    data root allowed), else owai's tokenizer loader (a name, a tokenizer.json, a hub id)."""
    from owai.data.registry import find_relative
    from owai.evals import ruler

    folder = find_relative(name) or Path(name).expanduser()
    if folder.is_dir() and ((folder / "encoder.json").is_file() or (folder / "vocab.json").is_file()):
        return ruler.gpt2_tokenizer(folder)
    from owai.data.text import load_tokenizer

    return _OwaiTokenizer(load_tokenizer(str(folder) if folder.exists() else name))


class _OwaiTokenizer:
    """An owai tokenizer (a model's, or a named one) as RULER's Tokenizer: count / encode / decode,
    no special tokens."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        if hasattr(tok, "count_many"):  # counts a batch in parallel: the builders count ahead (ruler.SPECULATE)
            self.count_many = tok.count_many

    def count(self, text: str) -> int:
        return self.tok.count(text)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


def _remote(source: str) -> bool:
    return source == "hf" or source.startswith("hf:")


def essay_tasks(tasks: list[str] | None = None) -> list[str]:
    """The tasks among `tasks` (default: all) that hide their needles in the essay haystack (--haystack-dir):
    RULER's essay NIAH variants. The others read no essay, and their runs need no haystack folder."""
    from owai.evals import ruler

    essay = [t for t, variant in ruler.NIAH_VARIANTS.items() if variant["haystack"] == "essay"]
    return essay if tasks is None else [t for t in tasks if t in essay]


def haystack_folder(text: str) -> Path:
    """The essay folder: a path, or relative to the data root ($OWAI_DATA). Missing: the catalogue's
    line for its entry (where to get the essays) when `text` names it, else what to pass."""
    from owai.data.registry import find_relative, missing_relative
    from owai.errors import DataMissing

    folder = find_relative(text) or Path(text).expanduser()
    if not folder.is_dir():
        raise DataMissing(missing_relative(text) or f"essay haystack {text!r} not found (a folder of .txt essays; "
                          "relative paths are looked up under $OWAI_DATA): pass --haystack-dir DIR")
    return folder


def qa_source(text: str) -> Path:
    """A QA dev file: a path, or relative to the data root. Missing: the catalogue's line for its entry
    when `text` names it (text/squad/dev-v2.0.json), else what to pass."""
    from owai.data.registry import find_relative, missing_relative
    from owai.errors import DataMissing

    path = find_relative(text) or Path(text).expanduser()
    if not path.is_file():
        raise DataMissing(missing_relative(text) or f"QA file {text!r} not found (relative paths are looked up under "
                          "$OWAI_DATA), or use hf / hf:<id> for the hub")
    return path
