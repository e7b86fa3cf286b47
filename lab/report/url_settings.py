"""A page's settings as URL query parameters: each widget's value written as text (``encode``) and read back
(``decode``) against what the widget accepts, so a shared or bookmarked link reopens the page as it was, and a link
that was edited by hand, or made by an older version of the app, falls back to the widget's default instead of
failing."""
from __future__ import annotations

import json
import math

MISSING = object()  # ``decode``'s answer when the text does not give a value the widget accepts


def encode(value) -> str:
    """A widget value as URL text: strings as they are, booleans as ``true``/``false``, numbers in Python's shortest
    form, lists (a multiselect's) as JSON."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return json.dumps(list(value), separators=(",", ":"))
    return str(value)


def decode(text: str, default, options=None, min_value=None, max_value=None):
    """The value ``text`` (``encode``'s) stands for, of the type of ``default``, or ``MISSING`` when it is not one
    the widget accepts: not of that type, not among ``options`` (every element, for a list), a number outside
    ``min_value`` .. ``max_value`` or not finite."""
    try:
        if isinstance(default, bool):
            if text not in ("true", "false"):
                return MISSING
            value = text == "true"
        elif isinstance(default, int):
            value = int(text)
        elif isinstance(default, float):
            value = float(text)
            if not math.isfinite(value):
                return MISSING
        elif isinstance(default, (list, tuple)):
            value = json.loads(text)
            if not isinstance(value, list):
                return MISSING
        else:
            value = text
    except (TypeError, ValueError):
        return MISSING
    if options is not None:
        choices = list(options)
        if isinstance(value, list):
            if any(item not in choices for item in value) or len(set(map(repr, value))) != len(value):
                return MISSING
            value = [choices[choices.index(item)] for item in value]  # the option itself (its type)
        elif value not in choices:
            matches = [choice for choice in choices if str(choice) == text]  # a select_slider of numbers
            if not matches:
                return MISSING
            value = matches[0]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if (min_value is not None and value < min_value) or (max_value is not None and value > max_value):
            return MISSING
    return value
