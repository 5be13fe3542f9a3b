"""A wrapper, not a torchrun worker (the recipe it runs leaves its own process group): the recipe
(``recipes/finetune_llama.py`` of this checkout) run unchanged under whatever launcher starts this script,
with two pauses at which a test types Ctrl-C (tests/integration/test_interrupted_runs.py):

    accelerate launch ctrl_c_recipe.py REPORT_DIR <the recipe's arguments>

1. at the first micro-batch built once ``checkpoint-2`` is complete (in update 3), until this process has
   received a stop signal (SIGINT or SIGTERM);
2. right after the first file of the stop's checkpoint is written into its staging directory, until it receives
   another stop signal or the test creates ``REPORT_DIR/go`` (to let the checkpoint complete).

Each pause is announced by a line ``ctrl-c test: rank R paused ...`` (stderr), so the test types Ctrl-C at a
known moment instead of after a guessed sleep; a pause gives up after :data:`PAUSE_LIMIT_S`. Stop signals are
counted by wrapping the handler the run installs (which still runs: the wrapping only counts). When the script
ends, ``REPORT_DIR/exit-<rank>.json`` holds its exit code and ``time.monotonic()`` (one clock for every process
of the machine), so the test can tell whether the launcher outlived it.
"""

from __future__ import annotations

from hf_accum.startup import keep_bitsandbytes_out

keep_bitsandbytes_out()  # what the recipe's lean_start does for this run (no quantization), before torch loads

import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import runpy  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable  # noqa: E402

import torch  # noqa: E402

from hf_accum import batching  # noqa: E402
from hf_accum.checkpointing.checkpoint import STAGING_PREFIX, checkpoint_path, is_complete_checkpoint  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
RECIPE = os.path.join(ROOT, "recipes", "finetune_llama.py")
PAUSE_LIMIT_S = 120.0
RANK = int(os.environ.get("RANK", "0"))
STAGED_CHECKPOINT = re.compile(re.escape(STAGING_PREFIX) + r"(checkpoint-\d+)")

stop_signals_received = 0


def say(text: str) -> None:
    os.write(2, f"ctrl-c test: rank {RANK} {text}\n".encode())


def pause(what: str, until_signals: int, go: str | None = None) -> None:
    """Wait (in the main thread, where the run's signal handler runs and may raise) for the n-th stop signal,
    or for the file ``go``."""
    say(f"paused {what}")
    deadline = time.monotonic() + PAUSE_LIMIT_S
    while stop_signals_received < until_signals and not (go and os.path.exists(go)):
        if time.monotonic() > deadline:
            say(f"nothing came within {PAUSE_LIMIT_S:.0f} s; going on")
            return
        time.sleep(0.02)


def count_stop_signals() -> None:
    real_signal = signal.signal

    def install(number: Any, handler: Any) -> Any:
        if number in (signal.SIGINT, signal.SIGTERM) and getattr(handler, "__name__", "") == "_handle":
            handler = counted(handler)
        return real_signal(number, handler)

    signal.signal = install  # type: ignore[assignment]


def counted(handler: Callable[[int, Any], None]) -> Callable[[int, Any], None]:
    def handle(number: int, frame: Any) -> None:
        global stop_signals_received
        stop_signals_received += 1  # before the handler: the second one raises KeyboardInterrupt
        handler(number, frame)

    return handle


def pause_in_update_3(output_dir: str) -> None:
    for collator in (batching.PaddingCollator, batching.PackingCollator):
        collate = collator.__call__
        state = {"paused": False}

        def call(self: Any, examples: Any, collate: Callable = collate, state: dict = state) -> Any:
            if not state["paused"] and is_complete_checkpoint(checkpoint_path(output_dir, 2)):
                state["paused"] = True
                pause("in update 3", 1)
            return collate(self, examples)

        collator.__call__ = call  # type: ignore[method-assign]


def pause_in_the_stop_checkpoint(go: str) -> None:
    save = torch.save
    state = {"paused": False}

    def call(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        save(obj, f, *args, **kwargs)
        staged = STAGED_CHECKPOINT.search(str(f))
        if staged and stop_signals_received and not state["paused"]:
            state["paused"] = True
            pause(f"writing {staged.group(1)}", 2, go)

    torch.save = call


def report_exit(report_dir: str, code: object) -> None:
    with open(os.path.join(report_dir, f"exit-{RANK}.json"), "w") as handle:
        json.dump({"code": code, "monotonic": time.monotonic(), "pid": os.getpid()}, handle)


def main() -> None:
    report_dir, argv = sys.argv[1], sys.argv[2:]
    output_dir = next(arg.split("=", 1)[1] for arg in argv if arg.startswith("training.output_dir="))
    say(f"pid {os.getpid()}")
    count_stop_signals()
    pause_in_update_3(output_dir)
    pause_in_the_stop_checkpoint(os.path.join(report_dir, "go"))
    sys.argv = [RECIPE, *argv]
    code: object = "no SystemExit"
    try:
        runpy.run_path(RECIPE, run_name="__main__")
    except SystemExit as end:
        code = end.code
        raise
    except BaseException as error:
        code = type(error).__name__
        raise
    finally:
        report_exit(report_dir, code)


if __name__ == "__main__":
    main()
