"""Fixtures the distributed tests share."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from hf_accum.recipe.testing import TEN_UPDATES, TORCHRUN_2, run_script


@pytest.fixture(scope="session")
def ddp_recipe_run(tmp_path_factory) -> Callable[[str], Path]:
    """engine -> the output directory of the recipe's 10-update DDP run on 2 processes, made on first use: the
    reference run the DeepSpeed and FSDP recipe tests compare with (the same command for both; ~25 s each).
    Read only: the tests copy what they cut."""
    made: dict[str, Path] = {}

    def get(engine: str) -> Path:
        if engine not in made:
            out = tmp_path_factory.mktemp(f"ddp_{engine}") / "ddp"
            run_script(TORCHRUN_2, out, f"engine={engine}", *TEN_UPDATES, timeout=600)
            made[engine] = out
        return made[engine]

    return get
