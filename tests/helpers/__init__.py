"""Helpers shared by the tests, the benchmarks (``bench/``, which put the repository root on
``sys.path``) and CI's smoke test. Kept out of the installed package: nothing a user runs needs
them, and a wheel should not ship test scaffolding."""
