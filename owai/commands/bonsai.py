"""`owai bonsai`: invariant learning on ColoredMNIST (thesis §2.3.3, Table 2.4).

    owai bonsai                                        IRMv1 from random init on ColoredMNIST (cpu preset)
    owai bonsai --method vrex --init erm               vREx after the ERM-init (anneal) phase
    owai bonsai --dataset inverse-coloredmnist --method erm

`--dataset/--method/--init` are `--set dataset=/method=/init=` overrides of the recipe
`table2.4-coloredmnist`. `--init bonsai|bonsai-cf` builds the Bonsai representation first
(`owai.methods.bonsai`, spec §3.1). Camelyon17 is not implemented yet: the method's validation
says so before any run directory exists.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from owai.commands._common import Json, Out, Preset, Quiet, Resume, Sets, run_recipe
from owai.errors import OwaiError

RECIPE = "table2.4-coloredmnist"


class Dataset(str, Enum):
    coloredmnist = "coloredmnist"
    inverse = "inverse-coloredmnist"
    camelyon17 = "camelyon17"


class Init(str, Enum):
    rand = "rand"
    erm = "erm"
    bonsai = "bonsai"
    bonsai_cf = "bonsai-cf"


def bonsai(
    dataset: Annotated[Optional[Dataset], typer.Option("--dataset", "-d", help="coloredmnist (Table 2.4) or inverse-coloredmnist (Table 2.5).")] = None,
    method: Annotated[Optional[str], typer.Option("--method", "-m", help="erm, irm, vrex, sd, iga, fish, fishr, clove, rerm, mmd, coral.")] = None,
    init: Annotated[Optional[Init], typer.Option("--init", "-i", help="rand (penalty from step 0), erm (after penalty.anneal_iters ERM steps), bonsai (from the Bonsai representation) or bonsai-cf (Bonsai, featurizer frozen).")] = None,
    preset: Preset = None,
    sets: Sets = None,
    out: Out = Path("runs"),
    resume: Resume = None,
    quiet: Quiet = False,
    as_json: Json = False,
) -> None:
    """Invariant learning on ColoredMNIST (sec 2.3.3): one penalty method, from random, ERM or Bonsai init."""
    chosen = [f"dataset={dataset.value}" if dataset else None, f"method={method}" if method else None,
              f"init={init.value}" if init else None]
    overrides = [c for c in chosen if c] + list(sets or [])
    if resume is not None and (dataset or method or init):
        raise OwaiError("--resume takes its config from the run directory; drop --dataset/--method/--init")
    run_recipe(None if resume is not None else RECIPE, preset, overrides or None, out, resume, quiet, as_json)


def register(app: typer.Typer) -> None:
    app.command("bonsai")(bonsai)
