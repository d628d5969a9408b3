"""The method registry: a recipe's `method` names one of these classes.

Each method is a small class (DomainBed style) with a typed `Config` dataclass whose defaults are
the thesis's settings, and a `run(cfg, run)` that trains/evaluates through the shared loop and
returns the measured numbers. Entries are import paths so that listing recipes or printing
`--help` does not import torch. Adding a method = one module + one line here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from owai.errors import OwaiError

if TYPE_CHECKING:
    from owai.runs import Run

REGISTRY: dict[str, str] = {
    "three_moons": "owai.methods.three_moons:ThreeMoons",
    "linear_disentanglement": "owai.methods.linear_disentanglement:LinearDisentanglement",
    "coloredmnist": "owai.methods.coloredmnist:ColoredMNISTInvariance",
    "lm_pretrain": "owai.methods.language_model:LanguageModelPretraining",
    "lm_eval": "owai.methods.language_model:LanguageModelEvaluation",
    "lm_recall": "owai.methods.recall:RecallPretraining",
    "regbench": "owai.methods.regbench:RegBench",
    "dropout_ft": "owai.methods.dropout_ft:DropoutFineTuning",
    "camelyon17": "owai.methods.camelyon17:Camelyon17Bonsai",
    "twobits": "owai.methods.twobits:TwoBitsLandscape",
    "rich_features": "owai.methods.rich_features:RichFeatures",
    "icl": "owai.methods.icl_eval:InContextClassification",
    "ruler": "owai.methods.ruler_eval:Ruler",
    "harness": "owai.methods.harness_eval:Harness",
    "corpus_stats": "owai.methods.corpus_stats:CorpusStatistics",
}


@dataclass
class Outcome:
    """What a method returns: named measured numbers (matched to the recipe's thesis numbers by
    name) and free-form details (curves, matrices) that go into results.json as they are."""

    measured: dict[str, Any]
    details: dict[str, Any] = field(default_factory=dict)


class Method:
    """Base class: subclasses set `Config` and `cli`, and implement `run`."""

    Config: ClassVar[type]
    cli: ClassVar[str]  # the CLI command that runs it, e.g. "owai moons three-moons"
    # Settings (dotted params paths) that `--resume RUN --set KEY=VALUE` may change: optimisation
    # settings, e.g. a lower train.lr after the run failed on NaN, and settings that change no number
    # (data.prefetch); they stay out of the checkpoints' config hash.
    resume_overrides: ClassVar[tuple[str, ...]] = ()
    # Whether it runs data-parallel under torchrun (each rank its share of the batches, rank 0
    # writes): the language models. Any other method is refused under torchrun, where every rank
    # would repeat the whole run beside the others (`owai.commands._common.refuse_one_process_method`).
    data_parallel: ClassVar[bool] = False
    # Whether `cli --recipe ID --preset P --set ...` makes exactly one run; False where the subcommand
    # runs the recipe's study, sweep or chain (dropout-ft, rich-features, eval regbench) or cannot
    # run from those alone (mosaic-eval: its MODEL_DIR arguments): a run's recorded command is then
    # `owai recipes run ID --single ...` (`experiment.command_line`)
    one_run_command: ClassVar[bool] = True

    @classmethod
    def lr_override(cls, stage: str) -> str | None:
        """The resume override that lowers the learning rate of training stage `stage` (where a run
        hit NaN): the one whose section is the stage's name or its first word ("probe-net0" ->
        probe.lr), else the first; None when no override reaches that stage."""
        for key in cls.resume_overrides:
            if key.split(".")[0] in (stage, stage.split("-")[0]):
                return key
        return cls.resume_overrides[0] if cls.resume_overrides else None

    @staticmethod
    def validate(cfg: Any) -> None:
        """Reject impossible settings (sizes, ranges) with an OwaiError; called before any run
        directory is created, so bad input never leaves a half-written run."""

    @staticmethod
    def unused_settings(cfg: Any) -> dict[str, str]:
        """Settings (dotted params paths) that a run of `cfg` never reads, each with the reason, e.g.
        a Memory Mosaics-only model field in a run that trains GPT2 alone. A new run refuses them when
        the user sets them (`--set`), since a value that changes nothing reads as a result it is not;
        a recipe's presets may still carry them (one preset serves several architectures)."""
        return {}

    def run(self, cfg: Any, run: "Run") -> Outcome:
        raise NotImplementedError


def is_registered(name: str) -> bool:
    return name in REGISTRY


def method_class(name: str) -> type[Method]:
    if name not in REGISTRY:
        raise OwaiError(f"unknown method {name!r} (known: {', '.join(REGISTRY)})")
    module, attr = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), attr)
