"""A job refused before training: its errors, and how a list of problems is quoted.

Every check raises ``InputError`` (or a subclass) alike on every rank (``collective``),
so that only rank 0 reports it and every rank ends with exit status 2
(``parallel.train.lifecycle``). See ``docs/failures.md``.
"""

from __future__ import annotations

from typing import Sequence

MAX_LISTED = 8  # problems quoted in the message; the rest are counted


class InputError(ValueError):
    """Bad data, config or model/grid combination, found before training. Raised alike on
    every rank (``collective``), so only rank 0 needs to report it."""

    collective = True


class ConfigError(InputError):
    """A config value that cannot work; the message names the key."""


def quote_problems(what: str, problems: Sequence[str], after: str = "") -> str:
    """``"<n> <what> (and k more):"`` and the first ``MAX_LISTED`` problems, one a line,
    then ``after``: the one format of a check that found several problems."""
    more = f" (and {len(problems) - MAX_LISTED} more)" if len(problems) > MAX_LISTED else ""
    return f"{len(problems)} {what}{more}:\n  " + "\n  ".join(problems[:MAX_LISTED]) + after
