"""``python -m benchmarks [options]``: run the benchmarks from a checkout (see benchmarks/README.md)."""

from benchmarks.run import main

raise SystemExit(main())
