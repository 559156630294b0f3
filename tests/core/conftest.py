"""Test setup for the compiled core."""

from __future__ import annotations

import warnings

# When a hypothesis test fails, its pytest plugin imports hypothesis.extra._patching
# (→ libcst → mypy_extensions, which warns DeprecationWarning at import).  Under
# pytest's -W error that import turns a plain test failure into an INTERNALERROR
# that hides the falsifying example, so import it once here with the warning muted.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    try:
        import hypothesis.extra._patching  # noqa: F401
    except ImportError:  # libcst not installed: the plugin skips the patch too
        pass
