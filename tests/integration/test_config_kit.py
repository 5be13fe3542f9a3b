"""The recipe's config kit points one way: importing it, and reading its own sections' keys, imports no torch
and no component of the recipe (data, modeling, preference, ...); the components import the config. Checked in a
fresh interpreter, as a user's ``python -c`` would see it (one process: the control in the same run imports the
checks, which do load torch, so the probe is shown to see it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# What the kit must not load: the heavy libraries, and the recipe's components (the modules that import the config).
PROBE = """
import json, sys

HEAVY = ("torch", "transformers", "peft", "accelerate", "trl", "datasets")
COMPONENTS = ("hf_accum.recipe.data", "hf_accum.recipe.modeling", "hf_accum.recipe.preference",
              "hf_accum.recipe.accumulation_section", "hf_accum.recipe.preflight", "hf_accum.recipe.launch")

def loaded():
    return sorted(name for name in sys.modules if name in HEAVY or name.startswith(COMPONENTS))

import hf_accum.recipe.config as kit
from hf_accum.recipe.config.layers import merge_layers
from hf_accum.recipe.embedded import default_config_path

after_import = loaded()
OWN = ("model", "data", "accumulation", "dpo")  # the HF sections (training, lora, ...) are read from HF's classes
keys = {section: kit.valid_keys(section) for section in OWN}
tree, sources, notes = merge_layers([(kit.BUILTIN, {"objective": "dpo"}),
                                     ("yaml", kit.load_yaml(default_config_path("dpo"))),
                                     (kit.COMMAND_LINE, {"dpo": {"beta": "0.25"}})])
config = kit.build_config({key: value for key, value in tree.items() if key in OWN or key == "objective"}, sources)
after_reading = loaded()
import hf_accum.recipe.checks  # the control: the checks import the components, and torch with them
print(json.dumps({"after_import": after_import, "after_reading": after_reading, "control": loaded(),
                  "keys": {section: len(names) for section, names in keys.items()},
                  "beta": config.dpo.beta, "beta_from": config.source("dpo.beta")}))
"""


def test_the_config_kit_imports_no_torch_and_no_component():
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["after_import"] == [], f"`import hf_accum.recipe.config` loaded {seen['after_import']}"
    assert seen["after_reading"] == [], f"reading the recipe's own sections loaded {seen['after_reading']}"
    # the reads did read and type something: the keys, and a value coerced from its command-line string
    assert all(count > 0 for count in seen["keys"].values())
    assert (seen["beta"], seen["beta_from"]) == (0.25, "command line")
    assert "torch" in seen["control"] and "hf_accum.recipe.data" in seen["control"]  # the probe sees torch loaded
