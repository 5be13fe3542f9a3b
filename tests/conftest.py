import os
import sys

# Test helpers (tests/tiny.py, tests/references.py, ...) are imported as plain modules.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
