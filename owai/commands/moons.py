"""`owai moons`: chapter 3's exact experiments.

    owai moons                                  three moons (Figures 3.5, 3.6, B.1), the default study
    owai moons --recipe linear-disentanglement  linear disentanglement sample complexity (Figure 3.1)
    owai moons linear                           the same (the positional study name is an alias of --recipe)
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Optional

import typer

from owai.commands._common import RunOptions, options, study_recipe
from owai.errors import OwaiError


class Study(str, Enum):
    three_moons = "three-moons"
    linear = "linear"
    linear_disentanglement = "linear-disentanglement"


RECIPES = {Study.three_moons: "three-moons", Study.linear: "linear-disentanglement",
           Study.linear_disentanglement: "linear-disentanglement"}
METHODS = ("three_moons", "linear_disentanglement")


@options
def moons(
    study: Annotated[Optional[Study], typer.Argument(
        help="Alias of --recipe: three-moons (Figs 3.5, 3.6, B.1) or linear (Fig 3.1).", show_default=False)] = None,
    recipe: Annotated[Optional[str], typer.Option(
        "--recipe", "-r", help="three-moons (default), linear-disentanglement, or a recipe file of either method.")] = None,
    opts: RunOptions = RunOptions(),
) -> None:
    """Predictive disentanglement, ch. 3: three moons (sec 3.3) or linear sample complexity (sec 3.1)."""
    if study is not None and recipe is not None and RECIPES[study] != recipe:
        raise OwaiError(f"the study {study.value!r} and --recipe {recipe!r} disagree; give one of them")
    chosen = recipe if recipe is not None else RECIPES[study] if study is not None else None
    if opts.resume is None:
        chosen = chosen or RECIPES[Study.three_moons]
        study_recipe(chosen, METHODS)
    opts.run(chosen, opts.sets, methods=METHODS if chosen is None else None)


def register(app: typer.Typer) -> None:
    app.command("moons")(moons)
