"""A script for launcher tests: runs hf_accum.recipe.launch.check_launch on the training section given as
JSON in argv[1], as the recipe does before loading a model; exit 2 with the message on a LaunchError."""

import json
import sys

from hf_accum.recipe.launch import LaunchError, check_launch

print("probe started", flush=True)
try:
    launch = check_launch(json.loads(sys.argv[1]))
except LaunchError as error:
    print(f"error: {error}", file=sys.stderr)
    raise SystemExit(2) from None
print(json.dumps({"backend": launch.backend, "world_size": launch.world_size, "num_nodes": launch.num_nodes}))
