"""`owai moons`: chapter 3's exact experiments.

    owai moons                 three moons (Figures 3.5, 3.6, B.1), the default study
    owai moons linear          linear disentanglement sample complexity (Figure 3.1)
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from owai.commands._common import Json, Out, Preset, Quiet, Resume, Sets, run_recipe


class Study(str, Enum):
    three_moons = "three-moons"
    linear = "linear"


RECIPES = {Study.three_moons: "three-moons", Study.linear: "linear-disentanglement"}


def moons(
    study: Annotated[Study, typer.Argument(help="three-moons (Figs 3.5, 3.6, B.1) or linear (Fig 3.1).")] = Study.three_moons,
    preset: Preset = None,
    sets: Sets = None,
    out: Out = Path("runs"),
    resume: Resume = None,
    quiet: Quiet = False,
    as_json: Json = False,
) -> None:
    """Predictive disentanglement, ch. 3: three moons (sec 3.3) or linear sample complexity (sec 3.1)."""
    run_recipe(RECIPES[study], preset, sets, out, resume, quiet, as_json)


def register(app: typer.Typer) -> None:
    app.command("moons")(moons)
