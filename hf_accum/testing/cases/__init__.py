"""Test cases that more than one file of the test suite uses: a torchrun worker and the test that re-derives
its expectations, two workers sharing their data, or a worker script that tests also call in-process.

A test file never imports another test file (``tests/unit/test_suite_layout.py``); what two of them share lives
here. The ``*_worker.py`` modules are scripts as well (``python PATH`` or ``torchrun ... PATH``, see
:func:`script`); every other module is named ``*_case.py`` so that a script run from this folder (whose folder
comes first on ``sys.path``) cannot shadow an installed package.
"""

from __future__ import annotations

import os

HERE = os.path.dirname(os.path.abspath(__file__))


def script(name: str) -> str:
    """The path of the runnable case script ``name`` in this folder."""
    return os.path.join(HERE, name)
