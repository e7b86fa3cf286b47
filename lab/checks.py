"""Type and range checks for config fields, shared by every public config of the lab (engine, sampling, simulator,
workloads): each raises the caller's ``ValueError`` subclass naming the owner, the field, the value and what is
allowed."""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import numbers
import types
import typing
from collections import abc

from .errors import ArgumentError, InputError
from .user_files import shown


def check_int(owner: str, name: str, value, low: int, high: int | None = None, optional: bool = False,
              error: type[ValueError] = InputError) -> None:
    """An integer (not a bool) in ``[low, high]``; None too when ``optional``."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low or \
            (high is not None and value > high):
        allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
        raise error(f"{owner}.{name}={shown(value)}: expected {allowed}" + (" or None" if optional else ""))


def check_real(owner: str, name: str, value, low: float, high: float = math.inf, low_open: bool = False,
               allow_inf: bool = False, error: type[ValueError] = InputError) -> None:
    """A real number (not a bool, not NaN; finite unless ``allow_inf``) in ``[low, high]`` (``(low, high]`` when
    ``low_open``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value) or \
            (math.isinf(value) and not allow_inf) or value < low or value > high or (low_open and value == low):
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise error(f"{owner}.{name}={shown(value)}: expected a{'' if allow_inf else ' finite'} number in {interval}")


def check_choice(owner: str, name: str, value, choices, error: type[ValueError] = InputError) -> None:
    """One of ``choices`` (compared only when ``value`` is a string)."""
    if not isinstance(value, str) or value not in choices:
        raise error(f"{owner}.{name}={shown(value)}: expected one of {', '.join(map(str, choices))}")


def check_bool(owner: str, name: str, value, error: type[ValueError] = InputError) -> None:
    if not isinstance(value, bool):
        raise error(f"{owner}.{name}={shown(value)}: expected True or False")


# ---- public entry points: their arguments against their type hints ---------------------------------------------
def entry_point(target=None, *, forwards=None, sets: tuple[str, ...] = ()):
    """Decorate a public function or class so that a call with arguments it does not take raises ``ArgumentError``
    naming the function and the argument, never ``TypeError``/``AttributeError`` from deep inside.

    Checked at every call: unknown keywords (named, with the accepted ones listed), too many positional arguments,
    a missing one, and each annotated argument against its type hint (``int`` takes integers but not bools,
    ``float`` any real number, ``list``/``tuple``/``Sequence`` hints a list or tuple whose items match, ``dict``
    hints a mapping whose keys and values match, ``Callable`` anything callable, unions any member; a hint that
    cannot be resolved is not checked). A class is checked through its ``__init__``; a dataclass's field types are
    left to its own ``check()``, which names their ranges too (a config may be built first and checked when used).
    ``forwards``: the callable that receives the ``**keywords`` (the keywords it accepts are accepted, less
    ``sets``, the ones the function passes itself)."""
    def decorate(obj):
        if inspect.isclass(obj):
            obj.__init__ = _checked(obj.__init__, obj.__name__, forwards, sets, types=not dataclasses.is_dataclass(obj))
            obj.__entry_point__ = True
            return obj
        return _checked(obj, obj.__name__, forwards, sets, types=True)
    return decorate if target is None else decorate(target)


def _checked(function, name: str, forwards, sets: tuple[str, ...], types: bool):
    """``function`` wrapped in the checks of ``entry_point``, shown as ``name``."""
    signature = inspect.signature(function)
    resolved: list = []  # hints and accepted keywords, resolved at the first call (names defined later in a module)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if not resolved:
            resolved.extend((_hints(function) if types else {}, accepted_keywords(wrapper)))
        _check_call(name, signature, *resolved, args, kwargs)
        return function(*args, **kwargs)

    wrapper.__entry_point__ = True
    wrapper.__entry_forwards__ = (forwards, frozenset(sets))
    return wrapper


def accepted_keywords(function) -> set[str] | None:
    """The keywords ``function`` (a function or a class) accepts, those it forwards included; None for any."""
    signature = inspect.signature(function)
    names = {p.name for p in signature.parameters.values()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"}
    if not any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        return names
    target = function.__init__ if inspect.isclass(function) else function
    forwards, sets = getattr(target, "__entry_forwards__", (None, frozenset()))
    if forwards is None:
        return None
    further = accepted_keywords(forwards)
    return None if further is None else names | (further - sets)


def _check_call(name: str, signature: inspect.Signature, hints: dict, accepted: set[str] | None, args: tuple,
                kwargs: dict) -> None:
    """Raise ``ArgumentError`` for a call of ``name`` that does not fit ``signature``, ``hints`` and the ``accepted``
    keywords (None: any)."""
    if accepted is not None:
        unknown = sorted(set(kwargs) - accepted)
        if unknown:
            raise ArgumentError(f"{name}({unknown[0]}={kwargs[unknown[0]]!r:.60}): unknown argument "
                                f"{', '.join(map(repr, unknown))}; accepted: {', '.join(sorted(accepted))}")
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise ArgumentError(f"{name}(): {exc}; accepted: {', '.join(sorted(accepted or signature.parameters))}") \
            from None
    for argument, value in bound.arguments.items():
        hint = hints.get(argument)
        if hint is None or signature.parameters[argument].kind in (inspect.Parameter.VAR_POSITIONAL,
                                                                   inspect.Parameter.VAR_KEYWORD):
            continue
        problem = _problem(value, hint)
        if problem is not None:
            raise ArgumentError(f"{name}({argument}={value!r:.60}): expected {_describe(hint)}, got {problem}")


def _hints(function) -> dict:
    """``function``'s parameter hints, resolved; one that cannot be (a name only imported for type checkers) is left
    out."""
    try:
        hints = typing.get_type_hints(function)
    except Exception:  # noqa: BLE001 - one unresolvable hint: resolve them one by one
        hints = {p.name: _resolved(p.annotation, function.__globals__)
                 for p in inspect.signature(function).parameters.values()}
    hints.pop("return", None)
    return {name: hint for name, hint in hints.items() if hint not in (None, inspect.Parameter.empty)}


def _resolved(annotation, namespace: dict):
    """``annotation`` evaluated in ``namespace`` when it is a string; None when it cannot be."""
    if not isinstance(annotation, str):
        return annotation
    try:
        return eval(annotation, namespace)  # the module's own annotation, as typing.get_type_hints does
    except Exception:  # noqa: BLE001 - a name only imported for type checkers: not checked
        return None


def _problem(value, hint) -> str | None:
    """None when ``value`` matches ``hint``; else what does not (the value, or the item of it that does not)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any or hint is object or isinstance(hint, (typing.TypeVar, typing.ForwardRef, str)):
        return None
    if origin in (typing.Union, types.UnionType):
        return None if any(_problem(value, member) is None for member in args) else _shown(value)
    if hint is None or hint is type(None):
        return None if value is None else _shown(value)
    if origin is typing.Literal:
        return None if value in args else _shown(value)
    if origin is abc.Callable or hint is abc.Callable or hint is typing.Callable:
        return None if callable(value) else _shown(value)
    if origin is not None:
        return _container_problem(value, origin, args)
    if hint is bool:
        return None if isinstance(value, bool) else _shown(value)
    if hint is int:
        return None if isinstance(value, numbers.Integral) and not isinstance(value, bool) else _shown(value)
    if hint is float:
        return None if isinstance(value, numbers.Real) and not isinstance(value, bool) else _shown(value)
    if isinstance(hint, type):
        return None if isinstance(value, hint) else _shown(value)
    return None  # a hint of another kind (a Protocol, NewType, ...): not checked


def _container_problem(value, origin, args: tuple) -> str | None:
    """``_problem`` for a parameterised hint: ``list[int]``, ``tuple[int, ...]``, ``dict[str, X]``, ..."""
    if origin in (list, tuple, abc.Sequence, abc.MutableSequence):
        if not isinstance(value, (list, tuple)) and not (origin is abc.Sequence and isinstance(value, abc.Sequence)
                                                         and not isinstance(value, (str, bytes))):
            return _shown(value)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                return f"{len(value)} items ({_shown(value)}), not {len(args)}"
            items = list(zip(value, args))
        else:
            items = [(item, args[0]) for item in value] if args else []
        for index, (item, item_hint) in enumerate(items):
            if (problem := _problem(item, item_hint)) is not None:
                return f"item [{index}] {problem}"
        return None
    if origin in (dict, abc.Mapping, abc.MutableMapping):
        if not isinstance(value, origin if origin is not dict else abc.Mapping):
            return _shown(value)
        if args:
            for key, item in value.items():
                if (problem := _problem(key, args[0])) is not None:
                    return f"key {problem}"
                if (problem := _problem(item, args[1])) is not None:
                    return f"item [{key!r:.30}] {problem}"
        return None
    if origin is type:
        return None if isinstance(value, type) else _shown(value)
    return None if not isinstance(origin, type) or isinstance(value, origin) else _shown(value)


def _shown(value) -> str:
    return f"{type(value).__name__} {value!r:.60}"


def _describe(hint) -> str:
    """``hint`` in words: ``SimConfig or None``, ``a list of int``, ``a callable``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(member) for member in args)
    if hint is None or hint is type(None):
        return "None"
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin is abc.Callable or hint in (abc.Callable, typing.Callable):
        return "a callable"
    if origin in (list, tuple, abc.Sequence, abc.MutableSequence):
        return "a list or tuple" + (f" of {_describe(args[0])}" if args and (len(args) == 1 or args[-1] is Ellipsis)
                                    else "")
    if origin in (dict, abc.Mapping, abc.MutableMapping):
        return "a mapping" + (f" of {_describe(args[0])} to {_describe(args[1])}" if args else "")
    names = {bool: "True or False", int: "an integer", float: "a number", str: "a string"}
    if hint in names:
        return names[hint]
    return getattr(hint, "__name__", str(hint))
