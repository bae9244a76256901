"""Checking a reader's answers to a chapter's exercises: right, or wrong with a hint.

    check(answer, expected=19, hint="global rank = node rank x ranks per node + local rank")

An unanswered exercise holds `...` (Ellipsis): the check then only prints the hint.
"""
from __future__ import annotations

import math


def _equal(answer, expected, rel_tol: float) -> bool:
    if isinstance(expected, (list, tuple)):
        return isinstance(answer, (list, tuple)) and len(answer) == len(expected) and all(
            _equal(a, e, rel_tol) for a, e in zip(answer, expected))
    if isinstance(expected, float) or isinstance(answer, float):
        try:
            return math.isclose(float(answer), float(expected), rel_tol=rel_tol)
        except (TypeError, ValueError):
            return False
    return answer == expected


def is_right(answer, expected, rel_tol: float = 1e-6) -> bool:
    """Whether `answer` equals `expected`: floats within rel_tol, lists and tuples element-wise."""
    return answer is not ... and _equal(answer, expected, rel_tol)


def check(answer, expected, hint: str, rel_tol: float = 1e-6) -> None:
    """Print whether `answer` is right; print `hint` when it is not (or not given yet)."""
    if answer is ...:
        print(f"Not answered yet. Hint: {hint}")
    elif is_right(answer, expected, rel_tol):
        print("Right!")
    else:
        print(f"Not quite ({answer!r}). Hint: {hint}")
