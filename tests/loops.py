"""Test access to the audited runners (hf_accum.checking): the loop and the naive negative control."""

from hf_accum.checking import Scenario, fresh_accelerator, run_exact, run_naive  # noqa: F401
