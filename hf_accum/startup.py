"""Process start-up without a package the run will not use: :func:`keep_bitsandbytes_out`.

PEFT imports bitsandbytes eagerly whenever it is installed (``peft.helpers``, and through it every process that
imports ``transformers.Trainer``, TRL or PEFT), and bitsandbytes wraps four of its kernels in ``torch.compile`` as
it is imported, which imports torch's inductor stack: ~1.5-2.4 CPU-s, a third of the recipe's start-up on a
2-core CPU, paid by every process of a run that quantizes nothing (measured with ``python -X importtime``:
``bitsandbytes.backends.default.ops`` -> ``torch._inductor.compile_fx``).

``sys.modules["bitsandbytes"] = None`` is Python's documented way to make a package look absent
(``import`` raises ``ModuleNotFoundError``, ``importlib.util.find_spec`` answers ``None``), so PEFT's,
Accelerate's and transformers' availability checks all take their no-bitsandbytes branch, which is what a run
without quantization or 8-bit optimizers executes anyway. The caller decides that the run needs none (the recipe:
:func:`hf_accum.recipe.command_line.bitsandbytes_needed`, from its command line and YAML, before any heavy
import); a package already imported is left alone.
"""

from __future__ import annotations

import sys

BITSANDBYTES = "bitsandbytes"


def keep_bitsandbytes_out() -> bool:
    """Make ``import bitsandbytes`` fail in this process as if it were not installed, unless it is already
    imported. Call it first thing, before PEFT / transformers' Trainer / TRL are imported. True if it did."""
    if BITSANDBYTES in sys.modules:
        return False
    sys.modules[BITSANDBYTES] = None  # type: ignore[assignment]  # None: "not importable" (the import system's rule)
    return True


def bitsandbytes_kept_out() -> bool:
    """Whether :func:`keep_bitsandbytes_out` took effect in this process."""
    return BITSANDBYTES in sys.modules and sys.modules[BITSANDBYTES] is None
