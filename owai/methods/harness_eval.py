"""Table 4.1's 19 benchmarks through lm-evaluation-harness (thesis sec 4.2.3.1, Tables 4.1-4.3; spec
evals.md sec 5): `owai eval harness`.

One run scores one model on harness tasks (default: the thesis's 19, `owai.evals.harness.THESIS_TASKS`)
with `simple_evaluate` and owai's `OwaiLM` adapter. Measured: `<task>.<metric>`, each task's main
metric on the harness's 0-1 scale (e.g. `arc_easy.acc`, `gsm8k.exact_match`), and `persistent.avg` /
`new.avg` (Tables 4.2 / 4.3) when all 13 / 6 of their tasks ran. Details: the harness's results
dict (per-task metrics with their filters, configs, shots, versions).

    model       owai.evals.causal_lm.open_model: a run / save_pretrained directory or a Hugging Face id;
                reference:oracle reads the gold answers (must score 1.0: validates the pipeline);
                hflm:ID_OR_DIR runs the harness's own HFLM instead of owai's adapter (its batching,
                its tokenizer handling), to compare owai's numbers with the harness's usual ones
    tasks       harness task names, owai's (race_middle, owai_mc_smoke, owai_gen_smoke) and those of
                `include_path` folders of task YAMLs (data only: no `!function`, no name lm-eval or
                owai already has; `owai.evals.harness.check_task_files`)
    ablate      long_term_memory: Tables 4.2 / 4.3's "without long-term memory" row
    confirm_run_unsafe_code
                the user's opt-in to tasks that run the model's generated code unsandboxed (those
                lm-eval marks unsafe_code: humaneval_plus and mbpp among the 19, reached directly or
                through a group or tag); without it they are refused before the run; with it the
                run has HF_ALLOW_CODE_EVAL=1 (`--confirm-run-unsafe-code`)

Under torchrun (`torchrun --nproc_per_node W -m owai eval harness ...`) every rank loads the whole model
and answers the requests of its share of every task's documents (`owai.evals.harness.DataParallelLM`);
rank 0 logs every answer in the one answers.jsonl (a kill on W ranks resumes on any number) and writes
the run directory; the numbers are one process's. Each task needs a document per rank (`limit` >= W).

The 19 benchmarks read hub datasets (online only). Needs the `eval` extra: pip install 'owai[eval]'.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from owai.config import MAX_DOCUMENTS, MAX_SHOTS, BaseConfig, EvalPrecision, check_count
from owai.errors import OwaiError
from owai.methods import Method, Outcome
from owai.runs import Run

ORACLE = "reference:oracle"
HFLM = "hflm:"  # the harness's own Hugging Face model class


def _thesis_tasks() -> list[str]:
    # kept in step with owai.evals.harness.THESIS_TASKS (which imports the harness)
    return ["openbookqa", "arc_easy", "winogrande", "arc_challenge", "piqa", "boolq", "hellaswag", "nq_open",
            "social_iqa", "triviaqa", "gsm8k", "mmlu_continuation", "humaneval_plus", "squad_completion",
            "bbh_fewshot", "minerva_math", "mbpp", "race_middle", "race"]


@dataclass
class Config(BaseConfig):
    tasks: list[str] = field(default_factory=_thesis_tasks)
    model: str = ""  # a run or save_pretrained directory, a Hugging Face id, or reference:oracle
    tokenizer: str = ""  # "" = the one the model was trained with / its own
    num_fewshot: int | None = None  # None = each task's default (gsm8k 5, bbh_fewshot 3, minerva_math 4, ...)
    limit: int = 0  # documents per task (0 = all)
    ablate: list[str] = field(default_factory=list)  # e.g. [long_term_memory] (Tables 4.2, 4.3)
    include_path: list[str] = field(default_factory=list)  # extra folders of task YAMLs (data only, no code)
    # run tasks that execute the model's generated code (lm-eval's unsafe_code: humaneval_plus, mbpp),
    # unsandboxed, with HF_ALLOW_CODE_EVAL=1: the user's explicit opt-in, never a recipe default
    confirm_run_unsafe_code: bool = False
    max_gen_toks: int = 256  # generation budget when a task sets none
    seed: int = 1234  # the harness's seeds (few-shot sampling)
    precision: EvalPrecision = "auto"  # bfloat16 on CUDA
    # the thesis row this model stands for (recipe table4.1-harness): transformer-small, mmv2-small,
    # transformer-large, mmv2-large (4k), the same with -32k, mmv2-large-32k-no-ltm (Tables 4.2, 4.3)
    row: str = ""


@contextlib.contextmanager
def _download_errors() -> Iterator[None]:
    """A hub download failing mid-run (a dataset validate could not see, e.g. a Python task's) as one
    line, not an internal error with a ConnectionError."""
    from owai.errors import DataMissing, one_line

    try:
        yield
    except ConnectionError as exc:
        raise DataMissing(f"the harness could not download a task's dataset ({one_line(exc, 200)}): run where the "
                          "Hugging Face hub can be reached, or with the dataset in its local cache") from None


def check_hflm(target: str, tokenizer: str = "") -> None:
    """Before a run, what the harness's HFLM needs for `hflm:TARGET`: accelerate (the `eval` extra), a
    model directory or hub id (cached, or the hub answers) whose config loads, and the tokenizer given."""
    from owai.data.text import check_tokenizer
    from owai.errors import one_line

    if not target:
        raise OwaiError("hflm: needs a Hugging Face id or a model directory after it")
    try:
        import accelerate  # noqa: F401  (HFLM imports it)
    except ImportError:
        raise OwaiError("the harness's HFLM needs accelerate: pip install 'owai[eval]'") from None
    path = Path(target).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise OwaiError(f"hflm:{target}: no config.json there (a save_pretrained model directory)")
    elif target.startswith((".", "/", "~")) or target.count("/") > 1:
        raise OwaiError(f"hflm:{target}: no such model directory (and not a Hugging Face id)")
    else:
        check_tokenizer(target)  # a hub id: in the local cache or the hub answers, one line otherwise
    if tokenizer:
        check_tokenizer(tokenizer)
    try:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(str(path) if path.exists() else target)
    except Exception as exc:  # noqa: BLE001 - unknown model type, bad JSON, hub errors: one line
        raise OwaiError(f"hflm:{target}: its model config does not load ({one_line(exc)})") from None


class Harness(Method):
    Config = Config
    cli = "owai eval harness"
    # under torchrun each rank holds the whole model and answers the requests of its share of every
    # task's documents (`harness.DataParallelLM`); rank 0 logs every answer and writes the results
    data_parallel = True

    @staticmethod
    def unused_settings(cfg: Config) -> dict[str, str]:
        """The generation budget of owai's adapter (`OwaiLM`), which the oracle and the harness's own
        HFLM do not use."""
        if cfg.model == ORACLE:
            return {"max_gen_toks": f"the generation budget of owai's adapter for a model; --model {ORACLE} reads the gold "
                                    "answers"}
        if cfg.model.startswith(HFLM):
            return {"max_gen_toks": f"the generation budget of owai's adapter for a model; --model {cfg.model} runs the "
                                    "harness's own HFLM, with its own budget"}
        return {}

    @staticmethod
    def validate(cfg: Config) -> None:
        from owai.evals.causal_lm import check_ablation, check_model, check_model_choice

        reference = check_model_choice(cfg.model, "reference:oracle", cfg.ablate)
        if not cfg.tasks or len(set(cfg.tasks)) != len(cfg.tasks):
            raise OwaiError(f"tasks {cfg.tasks}: give distinct harness task names")
        check_count("limit", cfg.limit, 0, MAX_DOCUMENTS)
        if cfg.num_fewshot is not None:
            check_count("num_fewshot", cfg.num_fewshot, 0, MAX_SHOTS)
        if cfg.max_gen_toks < 1:
            raise OwaiError(f"max_gen_toks must be >= 1, got {cfg.max_gen_toks}")
        for folder in cfg.include_path:
            if not Path(folder).expanduser().is_dir():
                raise OwaiError(f"include_path {folder!r} is not a folder of task YAMLs")
        if reference and cfg.model != ORACLE:
            raise OwaiError(f"{cfg.model}: the harness's reference model is {ORACLE}")
        from owai.evals.harness import require_harness

        require_harness()
        from owai import distributed
        from owai.evals import harness

        if distributed.launched_by_torchrun():
            harness.check_data_parallel()
            ranks = distributed.launch_world_size()
            if 0 < cfg.limit < ranks:  # each rank needs a document of every task (else: one line at the task's load)
                raise OwaiError(f"limit {cfg.limit}: fewer documents per task than the {ranks} ranks of this torchrun "
                                f"job; give at least {ranks}, or run on fewer ranks")
        from owai.hub import hub_unreachable

        folders = [str(Path(p).expanduser()) for p in cfg.include_path]
        harness.check_task_files(folders)  # before lm-eval reads them: data, never code
        known = set(harness.THESIS_TASKS) | set(harness.OWAI_TASKS) | set(harness.MAIN_METRIC)
        offline = hub_unreachable() if any(t not in harness.SMOKE_TASKS for t in cfg.tasks) else ""
        index = None
        if folders or offline or any(t not in known for t in cfg.tasks):  # index the tasks only when needed (seconds)
            index = harness.task_index(folders)  # an include_path name that replaces a built-in one: refused
            unknown = [t for t in cfg.tasks if t not in index]
            if unknown:
                raise OwaiError(f"unknown harness task(s) {', '.join(unknown)} (lm_eval --tasks list shows them; "
                                "task YAML folders: --set include_path=[DIR])")
            code = harness.code_tasks(index, list(cfg.tasks))
        else:
            code = [t for t in cfg.tasks if t in harness.UNSAFE_TASKS]
        if code and not cfg.confirm_run_unsafe_code:
            raise OwaiError(f"harness task(s) {', '.join(code)} run the model's generated code, unsandboxed, on this "
                            "machine (lm-eval marks them unsafe_code): to run them, opt in with "
                            "--confirm-run-unsafe-code (--set confirm_run_unsafe_code=true); else leave them out of --tasks")
        if offline:  # a hub dataset not in the cache would fail mid-run (a ConnectionError): refused here
            harness.check_offline(index, list(cfg.tasks), offline)
        if cfg.model.startswith(HFLM):
            if cfg.ablate:
                raise OwaiError("the harness's HFLM has no owai ablation switch: use an owai model path for --ablate")
            check_hflm(cfg.model[len(HFLM):], cfg.tokenizer)
            return
        check_model(cfg.model, cfg.tokenizer)
        check_ablation(cfg.model, cfg.ablate)

    def run(self, cfg: Config, run: Run) -> Outcome:
        from owai import console, distributed
        from owai.evals import harness
        from owai.evals.answers import run_log
        from owai.evals.causal_lm import open_model
        from owai.hub import cache_only, hub_unreachable

        manager = harness.task_manager([str(Path(p).expanduser()) for p in cfg.include_path])
        with contextlib.ExitStack() as stack:
            stack.enter_context(_download_errors())
            if hub_unreachable():  # the datasets validate found in the cache are read from it alone
                stack.enter_context(cache_only())
            if cfg.model == ORACLE:
                model: Any = harness.OracleLM(manager, list(cfg.tasks))
                max_length = None
            elif cfg.model.startswith(HFLM):
                from lm_eval.models.huggingface import HFLM as HarnessHFLM

                from owai.runtime import auto_precision

                # the precision owai's own path runs in (bf16 on CUDA), so the two paths compare like with like
                model = HarnessHFLM(pretrained=cfg.model[len(HFLM):], device=str(run.device), batch_size=1,
                                    dtype=auto_precision(cfg.precision, run.device),
                                    **({"tokenizer": cfg.tokenizer} if cfg.tokenizer else {}))
                max_length = model.max_length
            else:
                lm = open_model(cfg.model, cfg.tokenizer, run.device, cfg.precision)
                for name in cfg.ablate:
                    stack.enter_context(lm.ablate(name))
                model = harness.OwaiLM(lm, max_gen_toks=cfg.max_gen_toks)
                max_length = model.max_length
            if distributed.world().world_size > 1:  # one log, rank 0's, which every rank's answers reach
                model = harness.DataParallelLM(model, run_log(run.path) if run.writes else None)
            else:
                harness.log_answers(model, run_log(run.path))  # what a resume does not ask again
            if cfg.confirm_run_unsafe_code:
                console.info("confirm_run_unsafe_code: tasks lm-eval marks unsafe_code run the model's code unsandboxed")
            result = harness.evaluate(model, list(cfg.tasks), cfg.num_fewshot, cfg.limit, manager=manager,
                                      seed=cfg.seed, confirm_run_unsafe_code=cfg.confirm_run_unsafe_code)
        measured: dict[str, Any] = harness.main_metrics(result, list(cfg.tasks))
        measured.update(harness.averages(measured))
        for key, value in measured.items():
            console.info(f"{key}: {value:.4f}")
        missing = [t for t in cfg.tasks if not any(k.startswith(f"{t}.") for k in measured)]
        if missing:
            console.info(f"no main metric found for {', '.join(missing)} (see details.results)")
        result.update(model=cfg.model, ablate=list(cfg.ablate), max_length=max_length, limit=cfg.limit,
                      num_fewshot=cfg.num_fewshot)
        return Outcome(measured, result)
