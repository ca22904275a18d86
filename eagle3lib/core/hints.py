"""The "did you mean" hint every error about a misspelled name carries."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(word: str, options: Iterable[str]) -> str:
    """" (did you mean 'x'?)" for the closest option, or "" when none is close."""
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""
