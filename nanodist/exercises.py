"""Checking a reader's answers to a chapter's exercises: right, or wrong with a hint -- never the answer.

In a chapter, each exercise is four cells:

    expect("5.1", bytes_per_step("fsdp", 3e9, 8) / 1e9)      # hidden (removed from the page, collapsed in Jupyter)
    answer = ...                                             # the reader's cell
    check(answer, exercise="5.1", hint="count the collectives of one step")
    answer = bytes_per_step("fsdp", 3e9, 8) / 1e9            # the solution, collapsed until opened
    check(answer, exercise="5.1", hint="...")

The expected value is computed in the hidden cell, so the check cell shows only what to do. An answer may also
be a function: expect(key, cases=[(args, result), ...]) checks it on inputs the reader does not see. An
unanswered exercise holds `...` (Ellipsis): the check then prints the hint.

A predict-then-run exercise has no hidden answer: the reader writes a prediction, then runs a cell that measures
the thing on their own machine (a changed setting, a counted event), and compare() sets one against the other:

    prediction = ...                                         # the reader's cell
    measured = (gathers(True), gathers(False))               # the run: visible, it is the experiment
    compare(prediction, measured, exercise="5.5", hint="...")
    prediction = (5, 3)                                      # the solution, collapsed until opened; it
    compare(prediction, measured, exercise="5.5", hint="", reveal=False)   # prints the verdict alone
"""
from __future__ import annotations

import math
from typing import Any

_EXPECTED: dict[str, dict] = {}


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


def expect(exercise: str, value: Any = None, *, cases: list[tuple] | None = None, rel_tol: float = 1e-6) -> None:
    """Register what exercise `exercise` expects: a value, or (for a function) cases [(args, result), ...]."""
    if (value is None) == (cases is None):
        raise ValueError("expect: give either a value or cases, not both")
    _EXPECTED[exercise] = {"value": value, "cases": cases, "rel_tol": rel_tol}


def _verdict(answer, exercise: str) -> tuple[bool, str]:
    if exercise not in _EXPECTED:
        raise KeyError(f"exercise {exercise!r} has no expected answer: run the chapter's cells in order (the hidden "
                       f"cell before the exercise registers it)")
    e = _EXPECTED[exercise]
    if e["cases"] is None:
        return is_right(answer, e["value"], e["rel_tol"]), ""
    if not callable(answer):
        return False, " (the answer is a function)"
    for args, result in e["cases"]:
        try:
            got = answer(*args)
        except Exception as err:  # the reader's function raised: say so, without the inputs' expected result
            return False, f" ({type(err).__name__} for inputs {args!r})"
        if got is ...:
            return False, "unanswered"
        if not is_right(got, result, e["rel_tol"]):
            return False, f" (wrong for inputs {args!r}: got {got!r})"
    return True, ""


def check(answer, expected: Any = None, hint: str = "", rel_tol: float = 1e-6, *, exercise: str | None = None) -> None:
    """Print whether `answer` is right; print `hint` when it is not (or not given yet).

    With exercise=, the expected value is the one registered by expect() in a hidden cell; expected= is the older
    form, for an answer that may be shown."""
    if answer is ...:
        print(f"Not answered yet. Hint: {hint}")
        return
    if exercise is not None:
        ok, why = _verdict(answer, exercise)
    else:
        ok, why = is_right(answer, expected, rel_tol), ""
    if why == "unanswered":  # a function whose body is still `...`
        print(f"Not answered yet. Hint: {hint}")
    elif ok:
        print("Right!")
    elif callable(answer):
        print(f"Not quite{why}. Hint: {hint}")
    else:
        print(f"Not quite ({answer!r}){why}. Hint: {hint}")


def compare(prediction, measured, *, exercise: str, hint: str, rel_tol: float = 1e-6, reveal: bool = True,
            measured_by: str = "this machine measured") -> None:
    """A predict-then-run exercise's check: the reader's `prediction` against what their own run `measured`.

    Until the reader has predicted (`...`), nothing measured is shown, only what to do and the hint: the run must
    not answer the question before it is asked. Once they have, both are printed (the measurement is theirs, just
    made), with the verdict; floats agree within rel_tol, lists and tuples element-wise. reveal=False prints the
    verdict alone: the solution's cell, whose output stays on the page when its code is folded. `measured_by` says
    where `measured` came from ("the projection gives", for a number a model computed rather than a run)."""
    if prediction is ...:
        print(f"Exercise {exercise}: write your prediction first (replace the ...), then run this cell again. "
              f"Hint: {hint}")
        return
    if not reveal:
        print("Right!" if is_right(prediction, measured, rel_tol) else f"Not quite. Hint: {hint}")
        return
    if is_right(prediction, measured, rel_tol):
        print(f"Right! You predicted {prediction!r}; {measured_by} {measured!r}.")
    else:
        print(f"Not quite: you predicted {prediction!r}; {measured_by} {measured!r}. Hint: {hint}")

