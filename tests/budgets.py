"""Hypothesis budgets: one number per test, scaled by the profile in force (tests/README.md).

A test says how many examples it gets in CI, `@settings(max_examples=examples(300))`; the profile
scales that: "ci" runs each test's own number, "dev" (the edit-and-test loop) a tenth of it. A
test without a number gets the profile's `max_examples`, hypothesis's 100 in "ci" and 10 in "dev".

conftest.py loads the profile before any test module is imported: the one HYPOTHESIS_PROFILE names,
else "ci" under `pytest --all` (what CI runs) and "dev" for plain `pytest` and named files.
"""

from __future__ import annotations

from hypothesis import settings

CI_EXAMPLES = 100  # hypothesis's own default: `examples(n)` is n under "ci"
DEV_SHARE = 10  # "dev" runs a tenth of each budget ...
DEV_FLOOR = 5  # ... and never fewer than this

settings.register_profile("ci", max_examples=CI_EXAMPLES)
settings.register_profile("dev", max_examples=CI_EXAMPLES // DEV_SHARE)
PROFILES = ("ci", "dev")


def examples(ci: int) -> int:
    """A test's example budget under the profile in force: `ci` as written in CI, scaled down in
    proportion to the profile's max_examples elsewhere (read when the test module is imported)."""
    scaled = ci * settings.default.max_examples // CI_EXAMPLES
    return ci if scaled >= ci else max(DEV_FLOOR, scaled)
