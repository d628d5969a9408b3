"""lm-evaluation-harness adapter: Table 4.1's 19 benchmarks (thesis sec 4.2.3.1, Tables 4.1-4.3; spec
evals.md sec 5).

`OwaiLM` is a `TemplateLM` (the harness's route A) over an `owai.evals.causal_lm.CausalLM`, so any model
`open_model` opens (an owai run directory, a save_pretrained directory, a hub id) runs the harness's
tasks through owai's own tokenizer, and `CausalLM.ablate("long_term_memory")` gives Tables 4.2 / 4.3's
"without long-term memory" rows. It is registered as the harness model `owai` (the import registers it:
the harness CLI only sees it once this module is imported, so owai calls the Python API, `evaluate`),
after the harness's own models, which stay usable in the same process (`simple_evaluate(model="hf")`).

It scores as the harness's HFLM does on the same model and tokenizer: text is encoded as transformers
encodes it (special-token strings are special tokens, the tokenizer's BOS is added unless the text
starts with it: `Tokenizer.encode_as_transformers`), the empty-context prefix is the BOS token, else
the end-of-text token, and the maximum length comes from the config as HFLM reads it
(`causal_lm.config_max_length`; for a foreign config that has none, as HFLM, the tokenizer's
`model_max_length`, else 2048; owai's own models without a position table have no limit).

    loglikelihood        context + continuation in one forward; the continuation's positions scored;
                         the sequence left-truncated to the model's length when it has one
    loglikelihood_rolling  disjoint windows of the model's length (or ROLLING_WINDOW), EOT prefix
    generate_until       greedy (do_sample / temperature are ignored), cut at `until` (stopping as
                         HFLM's criterion does, on the text with special tokens), at most `max_gen_toks`
                         new tokens (or an alias, read by the harness's `normalize_gen_kwargs`); the
                         prompt left-truncated to leave room for them, a budget over the model's
                         length refused

Requests run one at a time (batch size 1): owai's models need no padding mask, and the thesis's
models are scored once, not tuned. `OracleLM` (`reference:oracle`) reads the gold answer of each
request's document from its task, so it must score 1.0 on any task whose target is a choice or a
string: it validates the pipeline offline (the recipe's cpu preset, with the smoke tasks below).

Under torchrun (`DataParallelLM`): every rank holds the whole model and lm-eval's evaluator shards the
work through the LM's `rank`, `world_size`, `all_gather`, `gather_object` and `barrier` (lm-eval
0.4.13; owai implements them on its own process group, gloo or NCCL, without accelerate): each rank
answers the requests of its share of every task's documents (built whole, as one process builds
them, then shared out: `_share_documents`), rank 0 gathers the per-document metrics and logs every
rank's answers in the one answer log, and every rank returns rank 0's results (`evaluate`).

Task names (spec sec 5.2): `THESIS_TASKS` maps the thesis's 19 columns, in Table 4.1's order, to harness
tasks; `PERSISTENT` (the first 13, Table 4.2) and `NEW` (the last 6, Table 4.3). `race_middle` is not
built into the harness: owai ships its YAML in `TASKS_DIR`, with two offline smoke tasks
(`owai_mc_smoke`, `owai_gen_smoke`: 20 hand-written questions each, JSONL beside the YAML).

No code from task files (owai's rule: no code from data or configs): the task YAMLs of `include_path`
folders, and every file they `include:`, are read before a run with a loader that refuses `!function`
and Python tags (`check_task_files`: lm-eval would import and run them), may name only lm-eval's
registered metrics (another name is an `evaluate` script it would download and run) and may not
replace a task, group or tag of lm-eval or owai (`task_index`). lm-eval's own task folder and owai's
`TASKS_DIR` are installed code and trusted. Templates render in a Jinja sandbox (`_sandbox_templates`).
Tasks lm-eval marks `unsafe_code` (humaneval, mbpp, ...) run the model's generated code unsandboxed:
`code_tasks` finds them through groups and tags, and they run only when the user confirms it
(`confirm_run_unsafe_code`).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from owai.errors import OwaiError
from owai.evals.answers import AnswerLog, answer_key

TASKS_DIR = Path(__file__).resolve().parent / "harness_tasks"
SMOKE_TASKS = ("owai_mc_smoke", "owai_gen_smoke")
OWAI_TASKS = (*SMOKE_TASKS, "race_middle")
ROLLING_WINDOW = 4096  # windows of loglikelihood_rolling for a model without a length limit (thesis: 4k)
DEFAULT_GEN_TOKS = 256  # the harness's default max_gen_toks
INSTALL_HINT = "lm-evaluation-harness is not installed: pip install 'owai[eval]'"

# (thesis column, harness task, main metric) in Table 4.1's column order (spec sec 5.2).
THESIS_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("obqa", "openbookqa", "acc_norm"),
    ("arc easy", "arc_easy", "acc"),
    ("winogrande", "winogrande", "acc"),
    ("arc challenge", "arc_challenge", "acc_norm"),
    ("piqa", "piqa", "acc"),
    ("boolq", "boolq", "acc"),
    ("hellaswag", "hellaswag", "acc_norm"),
    ("nq", "nq_open", "exact_match"),
    ("siqa", "social_iqa", "acc"),
    ("tqa", "triviaqa", "exact_match"),
    ("gsm8k", "gsm8k", "exact_match"),
    ("mmlu alt", "mmlu_continuation", "acc"),  # [ASSUMPTION] "alt" = the cloze/continuation format
    ("human eval+", "humaneval_plus", "pass@1"),
    ("squad", "squad_completion", "contains"),  # squadv2 needs evaluate.load (hub); thesis does not say
    ("bbh", "bbh_fewshot", "exact_match"),
    ("math", "minerva_math", "exact_match"),
    ("mbpp", "mbpp", "pass_at_1"),
    ("race middle", "race_middle", "acc"),  # owai's YAML (TASKS_DIR)
    ("race high", "race", "acc"),
)
THESIS_TASKS: list[str] = [task for _, task, _ in THESIS_COLUMNS]
PERSISTENT: list[str] = THESIS_TASKS[:13]  # Table 4.2: long-term memory off barely changes them
NEW: list[str] = THESIS_TASKS[13:]  # Table 4.3: they need the context (long-term memory)
MAIN_METRIC: dict[str, str] = {task: metric for _, task, metric in THESIS_COLUMNS} | {
    "owai_mc_smoke": "acc", "owai_gen_smoke": "exact_match", "mmlu": "acc", "squadv2": "exact",
    "hendrycks_math": "exact_match", "gsm8k_cot": "exact_match", "bbh_cot_fewshot": "exact_match"}
# the tasks of THESIS_TASKS / MAIN_METRIC that lm-eval marks unsafe_code (they execute the model's code);
# other task names are looked up in the task index (code_tasks)
UNSAFE_TASKS = ("humaneval_plus", "mbpp")
FILTER_PREFERENCE = ("strict-match", "remove_whitespace", "none", "create_test")


def require_harness() -> Any:
    """The `lm_eval` package, or one line saying how to install it."""
    try:
        import lm_eval
        import lm_eval.api.model  # noqa: F401
    except ImportError:
        raise OwaiError(INSTALL_HINT) from None
    except Exception as exc:  # noqa: BLE001 - e.g. a harness release that does not import under this transformers
        raise OwaiError(f"lm-evaluation-harness does not import ({type(exc).__name__}: {exc}); "
                        "pip install 'owai[eval]' pins a release that does") from None
    return lm_eval


require_harness()  # the classes below subclass the harness's

import lm_eval.models  # noqa: E402,F401  (the harness's own models first: it fills its registry only when empty)
import lm_eval.tasks  # noqa: E402
from lm_eval.api.model import LM, TemplateLM  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402

HARNESS_DEFAULT_LENGTH = 2048  # HFLM's maximum length when a model's config gives none (lm_eval.defaults)
HARNESS_TASKS_DIR = Path(lm_eval.tasks.__file__).resolve().parent  # lm-eval's own task YAMLs (installed code)
TRUSTED_TASK_DIRS = (HARNESS_TASKS_DIR, TASKS_DIR)


def _sandbox_templates() -> None:
    """Render the harness's Jinja templates (a task's doc_to_text, doc_to_target, ...) in Jinja's
    sandbox: lm-eval renders them in a plain `Environment`, where a template from a task file reaches
    Python (`{{ cycler.__init__.__globals__.os }}`). The sandbox refuses underscore attributes and
    unsafe calls; the harness's own templates render as before."""
    from jinja2.sandbox import SandboxedEnvironment
    from lm_eval import utils

    if isinstance(utils.env, SandboxedEnvironment):
        return
    env = SandboxedEnvironment(loader=utils.env.loader, undefined=utils.env.undefined,
                               keep_trailing_newline=utils.env.keep_trailing_newline)
    env.filters.update(utils.env.filters)  # regex_replace
    utils.env = env


_sandbox_templates()


@register_model("owai")
class OwaiLM(TemplateLM):
    """The harness's LM over a `CausalLM` (batch size 1). `lm` is an opened model; from the harness
    CLI, `--model owai --model_args pretrained=DIR[,tokenizer=NAME]` opens one with `open_model`."""

    def __init__(self, lm: Any = None, pretrained: str = "", tokenizer: str = "", max_length: int | None = None,
                 max_gen_toks: int = DEFAULT_GEN_TOKS, device: Any = None, precision: str = "auto",
                 batch_size: Any = 1, **kwargs: Any) -> None:
        super().__init__()
        if lm is None:
            if not pretrained:
                raise OwaiError("OwaiLM: pass an opened model (lm=) or pretrained=DIR")
            from owai.evals.causal_lm import open_model

            lm = open_model(pretrained, tokenizer, device, precision)
        self.lm = lm
        self._max_length = int(max_length) if max_length else lm.max_tokens
        if self._max_length is None and not str(getattr(lm.model.config, "model_type", "")).startswith("owai_"):
            # a foreign model whose config names no length, as HFLM (lm_eval's resolve_max_length): the
            # tokenizer's model_max_length when transformers' tokenizer config sets one, else 2048
            self._max_length = getattr(lm.tokenizer, "model_max_length", None) or HARNESS_DEFAULT_LENGTH
        self.max_gen_toks = int(max_gen_toks)
        if getattr(lm.tokenizer, "eot_id", None) is None:
            raise OwaiError(f"{lm.label}: its tokenizer has no end-of-text token (the harness's prefix token)")
        self._prefix_text = lm.tokenizer.decode([self.prefix_token_id])

    # -- tokens -------------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return int(self.lm.tokenizer.eot_id)

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is scored after: the BOS token if the tokenizer has one, else end-of-text (HFLM's rule)."""
        bos = getattr(self.lm.tokenizer, "bos_id", None)
        return int(bos) if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int | None:
        """The model's length limit (None: any length; rolling windows then use ROLLING_WINDOW)."""
        return self._max_length

    @property
    def device(self) -> Any:
        return self.lm.device

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """`string` as HFLM encodes it: the tokenizer's additions (BOS) unless asked not to or the text
        already starts with the prefix token; special-token strings are special tokens."""
        add = True if add_special_tokens is None else bool(add_special_tokens)
        if add_special_tokens is None and self._prefix_text and string.startswith(self._prefix_text):
            add = False
        return list(self.lm.tokenizer.encode_as_transformers(string, add_special_tokens=add))

    def tok_decode(self, tokens: Any, **kwargs: Any) -> str:
        return self.lm.tokenizer.decode([int(t) for t in tokens], skip_special=True)  # HFLM's tok_decode

    # -- scoring ------------------------------------------------------------------------------------
    def _score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        return self.lm.score_tokens(context, continuation, self._max_length)

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), every continuation token the argmax) per request
        `((context, continuation), context_tokens, continuation_tokens)`."""
        out = []
        for key, context, continuation in _track(requests, "harness loglikelihood", disable_tqdm):
            answer = self._score(list(context), list(continuation))
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
            out.append(answer)
        return out

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        window = self._max_length or ROLLING_WINDOW
        out = []
        for request in _track(requests, "harness loglikelihood_rolling", disable_tqdm):
            (text,) = request.args
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=window,
                context_len=1)]
            total = sum(ll for ll, _ in self._loglikelihood_tokens([(None, c, t) for c, t in windows], disable_tqdm=True))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        from lm_eval.models.utils import normalize_gen_kwargs

        out = []
        for request in _track(requests, "harness generate_until", disable_tqdm):
            context, gen_kwargs = request.args
            # read as HFLM reads them: max_gen_toks or its aliases (max_new_tokens, max_tokens,
            # max_completion_tokens), else the adapter's budget; `until` a string or a list
            kwargs = normalize_gen_kwargs(dict(gen_kwargs or {}), self.max_gen_toks)
            until = [s for s in kwargs["until"] if isinstance(s, str)]
            text = self.greedy(context, int(kwargs["max_gen_toks"]), until)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out

    def greedy(self, context: str, max_new_tokens: int, until: list[str]) -> str:
        """The greedy continuation of `context`, cut before the first `until` string or the end-of-text
        token. Generation stops as soon as a stop string appears in the generated tokens decoded with
        their special tokens (HFLM's stopping criterion: a special token's text, `<|im_end|>`, stops
        it), and the answer is decoded without them. With a length limit the prompt keeps its last
        `max_length - max_new_tokens` tokens; a budget that leaves no room is refused, as HFLM refuses it."""
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList

        ids = self.tok_encode(context) or [self.prefix_token_id]
        if self._max_length:
            if max_new_tokens >= self._max_length:
                raise OwaiError(f"{self.lm.label}: a task asks for {max_new_tokens} generated tokens but the model "
                                f"takes {self._max_length} tokens in all (prompt included); lm-evaluation-harness "
                                "refuses this too: leave that task out or use a model with a longer context")
            ids = ids[-(self._max_length - max_new_tokens):]
        x = torch.tensor([ids], device=self.lm.device)
        stops = [s for s in until if s]
        decode = self.lm.tokenizer.decode  # special tokens kept, as HFLM's stop check decodes

        class _Until(StoppingCriteria):
            def __call__(self, input_ids: Any, scores: Any, **kw: Any) -> Any:
                text = decode([int(t) for t in input_ids[0, x.shape[1]:].tolist()])
                done = any(s in text for s in stops)
                return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

        with torch.no_grad():
            y = self.lm.model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                       do_sample=False, eos_token_id=self.eot_token_id, pad_token_id=self.eot_token_id,
                                       stopping_criteria=StoppingCriteriaList([_Until()]) if stops else None)
        return self.lm.continuation_text([int(t) for t in y[0, x.shape[1]:].tolist()], tuple(stops))


class OracleLM(LM):
    """`reference:oracle`: puts all probability on each request's gold answer, read from its task's
    document (`doc_to_target` / `doc_to_choice`), and generates the gold string; it must score 1.0."""

    def __init__(self, task_manager: Any, tasks: list[str]) -> None:
        super().__init__()
        self.tasks: dict[str, Any] = dict(task_manager.load(list(tasks))["tasks"])  # leaf tasks by name

    def _gold(self, request: Any) -> tuple[Any, Any]:
        task = self.tasks[request.task_name]
        return task, task.doc_to_target(request.doc)

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out = []
        for request in requests:
            task, gold = self._gold(request)
            _, continuation = request.args
            choices = task.doc_to_choice(request.doc) if task.OUTPUT_TYPE == "multiple_choice" else None
            if choices is not None and isinstance(gold, int):
                gold = choices[gold]
            right = continuation.strip() == str(gold).strip()
            out.append((0.0, True) if right else (-math.inf, False))
        return out

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        return [0.0 for _ in requests]

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        out = []
        for request in requests:
            _, gold = self._gold(request)
            out.append(str(gold[0] if isinstance(gold, list) else gold))
        return out


def _track(requests: list, description: str, disable: bool) -> Any:
    """The requests with owai's progress bar (the harness's `disable_tqdm` switches it off)."""
    from owai import console

    return requests if disable else console.track(requests, total=len(requests), description=description)


def task_manager(include_path: list[str] | None = None) -> Any:
    """The harness's TaskManager over its own tasks, owai's (TASKS_DIR) and `include_path` folders
    (which `check_task_files` and `task_index` must have passed: the manager loads their YAMLs).

    Without folders it is `builtin_tasks()`, the one indexed once per process: indexing lm-eval's
    ~15k task entries takes seconds (8-9 s on a 2-core test host), and a run that checked its tasks
    against that index would otherwise index them all again. A manager builds its tasks anew from
    their YAMLs at each `load`, so one serves every run. With folders, whose files may change
    between runs, a new manager each time."""
    if not include_path:
        return builtin_tasks()
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=[str(TASKS_DIR), *include_path])


# ---------------------------------------------------------------- include_path task files: data, never code

class _CodeTag(Exception):
    """A YAML tag that names Python code (`!function utils.fn`, `!!python/...`) or that owai does not know."""


def _refuse_tag(loader: Any, node: Any) -> Any:
    value = node.value if isinstance(node.value, str) else "..."
    raise _CodeTag(f"{node.tag} {value}".strip())


def _task_file_loader() -> type:
    """A YAML loader for task files: YAML's plain types only; every other tag, `!function` (which
    lm-eval imports) and `!!python/...` included, raises `_CodeTag` instead of being constructed."""
    import yaml

    base = yaml.CSafeLoader if getattr(yaml, "__with_libyaml__", False) else yaml.SafeLoader

    class TaskFileLoader(base):  # type: ignore[misc,valid-type]
        pass

    TaskFileLoader.add_constructor(None, _refuse_tag)
    return TaskFileLoader


# settings with which a task file would make lm-eval or transformers run code from elsewhere: an
# `evaluate` metric script (hf_evaluate), a hub or local `custom_generate/generate.py` (HFLM's generate)
CODE_KEYS = ("trust_remote_code", "custom_generate", "hf_evaluate")


def _trusted(path: Path) -> bool:
    """A file or folder in lm-eval's own task folder or owai's (installed code)."""
    return any(path == root or root in path.parents for root in TRUSTED_TASK_DIRS)


def _check_settings(data: Any, path: Path, metrics: Any) -> None:
    """A task file's settings that would run code though no tag names it (CODE_KEYS, a prompt file,
    a metric not in `metrics`, lm-eval's metric registry), at any depth (a group's task overrides)."""
    items = list(data.items()) if isinstance(data, dict) else list(enumerate(data)) if isinstance(data, list) else []
    for key, value in items:
        if key in CODE_KEYS and value not in (None, False):
            raise OwaiError(f"harness task file {path} sets {key}: owai runs no code from task files")
        if key == "use_prompt" and isinstance(value, str) and ".yaml" in value:
            raise OwaiError(f"harness task file {path} reads prompts from another YAML (use_prompt: {value}): "
                            "put doc_to_text / doc_to_target in the task file")
        if key == "metric_list" and isinstance(value, list):
            for metric in value:
                name = metric.get("metric") if isinstance(metric, dict) else None
                if not isinstance(name, str) or name not in metrics:
                    raise OwaiError(f"harness task file {path}: metric {name!r} is not one of lm-eval's registered "
                                    f"metrics ({', '.join(sorted(metrics.keys()))}); owai runs no code from task "
                                    "files (another name is an evaluate script lm-eval would run)")
        _check_settings(value, path, metrics)


def _check_task_file(path: Path, seen: set[Path], metrics: Any) -> None:
    import yaml

    from owai.errors import one_line

    path = path.expanduser().resolve()
    if path in seen or _trusted(path):
        return
    seen.add(path)
    try:
        data = yaml.load(path.read_bytes(), Loader=_task_file_loader())  # noqa: S506 - a safe loader
    except _CodeTag as exc:
        raise OwaiError(f"harness task file {path} uses the YAML tag `{exc}`: owai runs no code from task files "
                        "(!function and Python tags are refused; use lm-eval's templates, filters and metrics)") from None
    except (OSError, yaml.YAMLError) as exc:
        raise OwaiError(f"harness task file {path} does not read as YAML ({one_line(exc, 160)})") from None
    _check_settings(data, path, metrics)
    includes = data.get("include") if isinstance(data, dict) else None
    for include in includes if isinstance(includes, list) else [] if includes is None else [includes]:
        if not isinstance(include, str) or not include:
            raise OwaiError(f"harness task file {path}: include {include!r} is not a file name")
        target = Path(include) if Path(include).is_absolute() else path.parent / include  # as lm-eval resolves it
        if not target.expanduser().is_file():
            raise OwaiError(f"harness task file {path} includes {include}, which is not a file")
        _check_task_file(target, seen, metrics)


def check_task_files(folders: list[str]) -> None:
    """Before a run: every task YAML under the `include_path` folders (*.yaml, *.yml, recursively) and
    every file they `include:` (relative to the including file's folder, or absolute) holds data only:
    no `!function` or other Python tag, no setting that loads code (CODE_KEYS), only lm-eval's
    registered metrics. lm-eval's task folder and owai's TASKS_DIR are trusted; only the given
    folders and their includes are read."""
    import lm_eval.api.metrics  # noqa: F401  (fills the metric registry)
    from lm_eval.api.registry import metric_registry

    seen: set[Path] = set()
    for folder in folders:
        root = Path(folder).expanduser().resolve()
        if _trusted(root):
            continue
        for path in sorted({*root.glob("**/*.yaml"), *root.glob("**/*.yml")}):
            if path.is_file():
                _check_task_file(path, seen, metric_registry)


@functools.lru_cache(maxsize=1)
def builtin_tasks() -> Any:
    """The TaskManager of lm-eval's tasks and owai's (indexed once per process: seconds)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=[str(TASKS_DIR)])


def task_index(include_path: list[str] | None = None) -> dict[str, Any]:
    """The harness's task index (name -> entry: tasks, groups, tags; their YAMLs parsed, no function
    resolved) over lm-eval's tasks, owai's and the `include_path` folders (passed by
    `check_task_files`), as `task_manager(include_path)` merges them. A name a folder defines that
    lm-eval or owai has already is refused: it would silently replace that task."""
    from lm_eval.tasks import TaskManager

    index = dict(builtin_tasks().task_index)
    folders = [str(Path(p).expanduser()) for p in include_path or [] if not _trusted(Path(p).expanduser().resolve())]
    if not folders:
        return index
    theirs = TaskManager(include_path=folders, include_defaults=False).task_index
    for name, entry in theirs.items():
        if name in index:  # a tag has no file of its own: the first task it tags names one
            path = entry.yaml_path or next((theirs[t].yaml_path for t in sorted(entry.tags) if t in theirs), None)
            raise OwaiError(f"harness task file {path} uses the task, group or tag name {name!r}, a name lm-eval or "
                            "owai already has: rename it (an include_path task may not replace a built-in one)")
    return {**index, **theirs}


def _leaves(index: dict[str, Any], tasks: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(who, config) of each leaf task `tasks` run, from the task index alone: groups and tags walked
    to their leaf tasks, a group's settings applied to its members as the harness applies them; who
    is "TASK" or "GROUP's subtask TASK". Nothing for another harness layout."""
    try:
        from lm_eval.tasks._factory import GROUP_FIELD_NAMES
        from lm_eval.tasks._index import Kind
    except ImportError:  # another harness layout: nothing checked before the run (the run's own error stays one line)
        return

    def walk(top: str, item: Any, overrides: dict[str, Any], depth: int) -> Iterator[tuple[str, dict[str, Any]]]:
        if depth > 16:  # a group that includes itself: the harness reports it when it loads
            return
        if isinstance(item, dict):
            if "group" in item and item["group"] not in index:  # an inline group
                members = item.get("task") or []
                more = {k: v for k, v in item.items() if k not in GROUP_FIELD_NAMES}
                for member in members if isinstance(members, list) else [members]:
                    yield from walk(top, member, {**more, **overrides}, depth + 1)
                return
            name = item.get("group", item.get("task"))
            overrides = {**overrides, **{k: v for k, v in item.items() if k not in ("group", "task")}}
        else:
            name = item
        who = str(name) if name == top else f"{top}'s subtask {name}"
        entry = index.get(name)
        if entry is None:  # an inline task: its settings are the overrides
            yield who, overrides
        elif entry.kind is Kind.TAG:
            for task in sorted(entry.tags):
                if task in index:
                    yield from walk(top, task, overrides, depth + 1)
        elif entry.kind is Kind.GROUP:
            cfg = entry.cfg or {}
            members = cfg.get("task") or []
            more = {k: v for k, v in cfg.items() if k not in GROUP_FIELD_NAMES}
            for member in members if isinstance(members, list) else [members]:
                yield from walk(top, member, {**more, **overrides}, depth + 1)
        else:
            yield who, {**(entry.cfg or {}), **overrides}

    for top in tasks:
        yield from walk(top, top, {}, 0)


def code_tasks(index: dict[str, Any], tasks: list[str]) -> list[str]:
    """The leaf tasks of `tasks` (through groups and tags) that run the model's generated code: those
    lm-eval marks `unsafe_code` (it refuses them unless `confirm_run_unsafe_code`), as "TASK" or
    "GROUP's subtask TASK". `index`: `task_index`'s."""
    return list(dict.fromkeys(who for who, cfg in _leaves(index, tasks)
                              if cfg.get("unsafe_code", False) is not False))  # lm-eval's own test


def hub_datasets(index: dict[str, Any], tasks: list[str]) -> dict[tuple[str, str | None], tuple[str, dict[str, Any]]]:
    """The hub datasets `tasks` read, from the harness's task index alone (its YAML configs; nothing is
    downloaded): (dataset_path, dataset_name) -> (the first task reading it, "TASK" or "GROUP's subtask
    TASK", and its dataset_kwargs). `index`: `task_index`'s.
    Groups and tags are walked to their leaf tasks (`_leaves`). A task with its own loader
    (custom_dataset, a Python class), a packaged builder (json, csv, parquet, ...) or an existing local
    path reads no hub dataset."""
    try:
        from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES
    except ImportError:  # another datasets layout: nothing checked before the run
        return {}

    found: dict[tuple[str, str | None], tuple[str, dict[str, Any]]] = {}
    for who, cfg in _leaves(index, tasks):
        path = cfg.get("dataset_path")
        if "class" in cfg or cfg.get("custom_dataset") or not isinstance(path, str) or path in _PACKAGED_DATASETS_MODULES \
                or Path(path).expanduser().exists():
            continue
        kwargs = dict(cfg.get("dataset_kwargs") or {})
        kwargs.pop("trust_remote_code", None)  # as the harness drops it under datasets >= 4
        found.setdefault((path, cfg.get("dataset_name")), (who, kwargs))
    return found


def check_offline(index: dict[str, Any], tasks: list[str], why: str) -> None:
    """Before a run while the hub cannot be reached (`why`): each hub dataset `tasks` read must be in the
    local datasets cache (asked of `datasets` itself, from the cache alone), else one line naming the
    task and its dataset. Without it the harness fails mid-run with a ConnectionError."""
    from owai.errors import DataMissing
    from owai.hub import dataset_cached

    for (path, name), (task, kwargs) in hub_datasets(index, tasks).items():
        if not dataset_cached(path, name, **kwargs):
            dataset = path + (f" ({name})" if name else "")
            raise DataMissing(f"harness task {task} reads the hub dataset {dataset}, which is not in the local "
                              f"Hugging Face datasets cache, and {why}: run it where the hub can be reached once "
                              "(the cache keeps it), or pick tasks with local data (owai_mc_smoke, owai_gen_smoke, "
                              "an include_path task)") from None


REQUEST_TYPES = ("loglikelihood", "loglikelihood_rolling", "generate_until")


def log_answers(lm: Any, answers: AnswerLog) -> Any:
    """Make `lm` (any harness LM: OwaiLM, the harness's HFLM, OracleLM) log the answer of every
    request in `answers`, as it is computed (the harness's cache hook, which every LM calls per
    request), and answer a request logged before (a resumed run) from the log, sending only the
    others to the model. Returns `lm`, whose three request methods are wrapped on the instance.
    The harness's own request cache (`CachingLM`) is not used: it stores answers as pickles."""
    from lm_eval.api.model import CacheHook

    class LogHook(CacheHook):
        def __init__(self) -> None:
            super().__init__(None)

        def add_partial(self, attr: str, req: Any, res: Any) -> None:
            _record(answers, attr, answer_key(attr, *req), res)

    lm.set_cache_hook(LogHook())
    for kind in REQUEST_TYPES:
        setattr(lm, kind, _answered_from(answers, kind, getattr(lm, kind)))
    return lm


def _logged(answers: AnswerLog, kind: str, key: str) -> Any:
    """The answer `answers` holds for a request of `kind`, as the harness's LMs return it (a
    log-likelihood as a (float, bool) tuple), or None when there is none or it is not of that form
    (a damaged line: the request is asked again)."""
    if kind == "generate_until":
        return answers.get(key, str)
    value = answers.get(key)
    number = (int, float)
    if kind == "loglikelihood" and isinstance(value, list) and len(value) == 2 \
            and isinstance(value[0], number) and not isinstance(value[0], bool) and isinstance(value[1], bool):
        return tuple(value)
    if kind == "loglikelihood_rolling" and isinstance(value, number) and not isinstance(value, bool):
        return value
    return None


def _answered_from(answers: AnswerLog, kind: str, method: Any) -> Any:
    """`method` (an LM's request method of `kind`) for only the requests `answers` lacks; the rest
    come from the log."""

    def answer(requests: list, disable_tqdm: bool = False) -> list:
        keys = [answer_key(kind, *request.args) for request in requests]
        out = [_logged(answers, kind, key) for key in keys]
        todo = [i for i, value in enumerate(out) if value is None]
        try:
            computed = method([requests[i] for i in todo], disable_tqdm=disable_tqdm) if todo else []
        finally:  # what the cache hook logged, a Ctrl-C included
            answers.flush()
        if len(computed) != len(todo):
            raise OwaiError(f"the harness model answered {len(computed)} of {len(todo)} {kind} requests")
        for i, value in zip(todo, computed):
            out[i] = value
            _record(answers, kind, keys[i], value)  # for an LM that does not call the cache hook
        answers.flush()
        return out

    return answer


def _record(answers: AnswerLog, kind: str, key: str, value: Any) -> None:
    """Log a request's answer (a tuple as a JSON list) unless the log holds it already."""
    if _logged(answers, kind, key) is None:
        answers.add(key, list(value) if isinstance(value, tuple) else value)


# ---------------------------------------------------------------- data parallelism under torchrun

MAX_ROUND = 4096  # requests a rank answers in one round under torchrun, at most


def check_data_parallel() -> None:
    """Under torchrun, before the run: the installed harness distributes requests through the LM's own
    `rank`, `world_size`, `all_gather`, `gather_object` and `barrier` (lm-eval 0.4.13, the release
    owai pins), which `DataParallelLM` implements on owai's process group. Earlier releases call
    accelerate's `lm.accelerator` from their evaluator instead: refused, one line."""
    if not callable(getattr(LM, "gather_object", None)):
        version = getattr(require_harness(), "__version__", "this release")
        raise OwaiError(f"lm-evaluation-harness {version} runs data-parallel only through accelerate's Accelerator; "
                        "`owai eval harness` runs under torchrun with the release owai pins: pip install 'owai[eval]'")


def next_round(size: int, slowest: float) -> int:
    """The number of requests each rank answers in the next round under torchrun, from this round's
    `size` and the seconds its slowest rank took: doubled while a round is short, halved when it is
    long, so that the answers reach rank 0's log about every FLUSH_SECONDS as in one process. Every
    rank computes it from the same gathered figures, so the ranks agree on every round."""
    from owai.evals.answers import FLUSH_SECONDS

    if slowest < FLUSH_SECONDS / 2:
        return min(MAX_ROUND, size * 2)
    if slowest > FLUSH_SECONDS * 2:
        return max(1, size // 2)
    return size


class DataParallelLM(LM):
    """Any harness LM (`OwaiLM`, `OracleLM`, the harness's HFLM) as one rank of a torchrun job, every
    rank holding the whole model: lm-eval gives this rank its share of each task's documents (`rank`,
    `world_size`; see `evaluate`), pads the ranks' request counts to the largest, and gathers the
    per-document metrics on rank 0 through the collectives below (owai's process group: gloo on the
    CPU, NCCL on CUDA; no accelerate). The inner LM answers alone (an HFLM that took accelerate's
    ranks is set back to rank 0 of 1: its rolling log-likelihoods would otherwise synchronise inside).

    Answers and resume: `answers` is rank 0's log (None on the other ranks). For each request method
    every rank sends its requests' keys (`answer_key`, as `log_answers` keys them in one process) to
    rank 0, which says which the log holds; each rank then answers the rest in rounds (`next_round`
    requests, at most), and after each round every answer of the round is gathered and rank 0 logs
    them as one line. So the job keeps one answers.jsonl, keyed by question, not by rank: a run killed
    on W ranks (or in one process) resumes on any number, asking only what the log lacks."""

    def __init__(self, inner: Any, answers: AnswerLog | None = None) -> None:
        super().__init__()
        from owai import distributed

        check_data_parallel()
        ranks = distributed.world()
        self.inner, self.answers = inner, answers
        self._rank, self._world_size = ranks.rank, ranks.world_size
        if getattr(inner, "world_size", 1) != 1:
            inner._rank, inner._world_size = 0, 1

    def __getattr__(self, name: str) -> Any:
        """What the wrapper does not define, the inner LM's (as lm-eval's own CachingLM forwards):
        simple_evaluate reads `tokenizer`, `get_model_info`, `batch_sizes` and `MULTIMODAL` off the
        LM it was given, so the results hold the same tokenizer information as in one process."""
        if name == "inner":  # not set yet (during __init__): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def device(self) -> Any:
        """Where lm-eval puts the request counts it gathers: the CPU (gloo's), on every machine."""
        import torch

        return torch.device("cpu")

    def all_gather(self, tensor: Any) -> Any:
        from owai import distributed

        return distributed.gather_tensors(tensor)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        from owai import distributed

        every = distributed.gather_objects(obj)
        return every if self.rank == dst else None

    def barrier(self) -> None:
        from owai import distributed

        distributed.barrier()

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return self._answer("loglikelihood", requests)

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        return self._answer("loglikelihood_rolling", requests)

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        return self._answer("generate_until", requests)

    def _looked_up(self, kind: str, keys: list[str]) -> dict[int, Any]:
        """Rank 0: the answers its log holds for `keys` (one rank's requests), by position."""
        if self.answers is None:
            return {}
        logged = {i: _logged(self.answers, kind, key) for i, key in enumerate(keys)}
        return {i: value for i, value in logged.items() if value is not None}

    def _answer(self, kind: str, requests: list) -> list:
        """This rank's answers to `requests` (its share, of request type `kind`): those rank 0's log
        holds from it, the rest from the inner LM in rounds, each round's answers logged by rank 0."""
        import time

        from owai import console, distributed

        keys = [answer_key(kind, *request.args) for request in requests]
        asked = distributed.gather_objects((kind, keys))
        reply: tuple[list[dict[int, Any]] | None, str | None] | None = None
        if self.rank == 0:
            kinds = sorted({k for k, _ in asked})
            if len(kinds) > 1:
                reply = (None, f"the torchrun ranks asked different harness requests at once ({', '.join(kinds)}): "
                               "a task gave some rank no document")
            else:
                reply = ([self._looked_up(kind, theirs) for _, theirs in asked], None)
        found, error = distributed.broadcast_object(reply)
        if error is not None:
            raise OwaiError(error)
        out = [found[self.rank].get(i) for i in range(len(requests))]
        todo = [i for i, value in enumerate(out) if value is None]
        method = getattr(self.inner, kind)
        left = sum(len(theirs) for _, theirs in asked) - sum(len(f) for f in found)  # every rank's, for the bar
        size, done = 1, 0
        with console.Bar(f"harness {kind}", left) as bar:
            while True:
                chunk = todo[done:done + size]
                start = time.monotonic()
                computed = list(method([requests[i] for i in chunk], disable_tqdm=True)) if chunk else []
                if len(computed) != len(chunk):
                    raise OwaiError(f"the harness model answered {len(computed)} of {len(chunk)} {kind} requests")
                done += len(chunk)
                for i, value in zip(chunk, computed):
                    out[i] = value
                answered = {keys[i]: list(value) if isinstance(value, tuple) else value for i, value in zip(chunk, computed)}
                rounds = distributed.gather_objects((answered, len(chunk), time.monotonic() - start, len(todo) - done))
                if self.answers is not None:
                    self.answers.add_batch({key: value for theirs, *_ in rounds for key, value in theirs.items()})
                bar.update(sum(n for _, n, _, _ in rounds))
                if all(remaining == 0 for *_, remaining in rounds):
                    return out
                size = next_round(size, max(seconds for _, _, seconds, _ in rounds))


def _share_documents(manager: Any, limit: int, ranks: Any) -> Any:
    """`manager.load` for rank `ranks.rank` of a torchrun job: each task loaded must have a document for
    every rank (else one line: a rank with none would fail inside lm-eval), and builds its requests as
    one process does, every document in order, keeping this rank's share (document i on rank i mod W,
    the share lm-eval's `doc_iterator` gives it when it reads the results). lm-eval's own sharded
    build draws each rank's few-shot examples from the task's seeded sampler afresh ("TODO: need to
    offset doc_id by rank" in its api/task.py), so with shots a rank's prompts were not one process's;
    built whole, they are, and so are the answers and the numbers."""
    load = manager.load

    def share(task: Any) -> None:
        build = task.build_all_requests

        def build_share(*args: Any, rank: int = 0, world_size: int = 1, **kwargs: Any) -> None:
            build(*args, rank=0, world_size=1, **kwargs)
            task._instances = [i for i in task._instances if i.doc_id % world_size == rank]

        task.build_all_requests = build_share

    def load_shared(*args: Any, **kwargs: Any) -> Any:
        loaded = load(*args, **kwargs)
        for name, task in loaded["tasks"].items():
            documents = len(task.eval_docs)
            n = min(documents, limit) if limit else documents
            if n < ranks.world_size:
                raise OwaiError(f"harness task {name} has {n} document{'s' if n != 1 else ''}"
                                f"{' (--limit)' if limit and limit < documents else ''}, fewer than the "
                                f"{ranks.world_size} ranks of this torchrun job: run it "
                                f"{f'on at most {n} ranks' if n > 1 else 'in one process'}")
            share(task)
        return loaded

    return load_shared


def evaluate(model: Any, tasks: list[str], num_fewshot: int | None = None, limit: int = 0,
             include_path: list[str] | None = None, manager: Any = None, seed: int = 1234,
             confirm_run_unsafe_code: bool = False) -> dict[str, Any]:
    """Run `tasks` on `model` (an OwaiLM, OracleLM or any harness LM) with `simple_evaluate`; the
    harness's results dict, JSON-able (samples dropped). `confirm_run_unsafe_code` (the user's opt-in)
    lets the tasks lm-eval marks unsafe_code run the model's code: it is passed on, with
    HF_ALLOW_CODE_EVAL=1 (evaluate's code_eval asks for it) while the harness runs; without it the
    harness refuses them.

    Under torchrun (more than one rank) every rank calls it with the whole model: `model` runs as a
    `DataParallelLM` (wrapped here unless it is one), each rank answers the requests of its share of
    every task's documents (`_share_documents`), rank 0 gathers the metrics, and every rank returns
    rank 0's results. The metrics are one process's, gathered in rank order rather than document
    order: a mean of 0/1 scores (acc, exact_match: every main metric of the 19) is the same number,
    a mean of other floats may differ in its last bits."""
    import contextlib
    import os
    from unittest import mock

    import lm_eval.evaluator
    from lm_eval import simple_evaluate

    from owai import distributed

    manager = manager or task_manager(include_path)
    ranks = distributed.world()
    with contextlib.ExitStack() as stack:
        if ranks.world_size > 1:
            model = model if isinstance(model, DataParallelLM) else DataParallelLM(model)
            stack.enter_context(mock.patch.object(manager, "load", _share_documents(manager, limit, ranks)))
        if hasattr(lm_eval.evaluator, "get_git_commit_hash"):
            stack.enter_context(mock.patch.object(lm_eval.evaluator, "get_git_commit_hash", _quiet_git_hash))
        if confirm_run_unsafe_code:
            stack.enter_context(mock.patch.dict(os.environ, {"HF_ALLOW_CODE_EVAL": "1"}))
        try:
            result = simple_evaluate(model=model, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit or None,
                                     task_manager=manager, log_samples=False, bootstrap_iters=0,
                                     confirm_run_unsafe_code=bool(confirm_run_unsafe_code), random_seed=seed,
                                     numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)
        except ValueError as exc:
            # lm-eval's few-shot sampler draws `random.sample(pool, n)`: a pool is known only once its task's
            # documents are loaded, so a --num-fewshot above it surfaces here, not at validation
            if num_fewshot and "Sample larger than population" in str(exc):
                raise OwaiError(f"--num-fewshot {num_fewshot}: more examples than the few-shot pool of a task among "
                                f"{', '.join(tasks)} holds; give fewer shots (or none, for each task's default)") from exc
            raise
    if ranks.rank == 0:
        if result is None:
            raise OwaiError("the harness returned no results")
        result = {k: v for k, v in dict(result).items() if k not in ("samples", "config")}
        result = json.loads(json.dumps(result, default=str, allow_nan=True))
    return distributed.broadcast_object(result) if ranks.world_size > 1 else result


def _quiet_git_hash() -> str | None:
    """The harness's `git_hash` (the commit of the working directory's repository, if any) without
    git's "fatal: not a git repository" on stderr outside one: the harness runs `git describe` with
    the terminal's stderr, which `--quiet` must not show."""
    import subprocess

    try:
        found = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (found.stdout.strip() or None) if found.returncode == 0 else None


def main_metrics(result: dict[str, Any], tasks: list[str]) -> dict[str, float]:
    """`<task>.<metric>`: each of `tasks`' (a task's or a group's) main metric, as the harness reports it (0-1).
    The metric is MAIN_METRIC's for known tasks (else the first one reported); of its filters the
    first of FILTER_PREFERENCE (gsm8k: strict-match), else the first reported."""
    measured: dict[str, float] = {}
    cells = {**result.get("results", {}), **result.get("groups", {})}
    for task in tasks:
        cell = cells.get(task)
        if not cell:
            continue
        keys = [k for k in cell if "," in k and "_stderr" not in k and isinstance(cell[k], (int, float))]
        if not keys:
            continue
        metric = MAIN_METRIC.get(task) or keys[0].split(",")[0]
        matching = [k for k in keys if k.split(",")[0] == metric]
        if not matching:
            continue
        ranked = sorted(matching, key=lambda k: FILTER_PREFERENCE.index(k.split(",", 1)[1])
                        if k.split(",", 1)[1] in FILTER_PREFERENCE else len(FILTER_PREFERENCE))
        measured[f"{task}.{metric}"] = float(cell[ranked[0]])
    return measured


def averages(measured: dict[str, float]) -> dict[str, float]:
    """persistent.avg / new.avg (Tables 4.2 / 4.3) when all of their tasks were measured."""
    out = {}
    for name, tasks in (("persistent", PERSISTENT), ("new", NEW)):
        values = [measured.get(f"{t}.{MAIN_METRIC[t]}") for t in tasks]
        if all(v is not None for v in values):
            out[f"{name}.avg"] = sum(values) / len(values)
    return out
