"""Argument types shared by ``python -m lab`` and ``python -m simulator``: a bad flag is an argparse error (exit 2,
one ``error:`` line naming the flag) before any work starts."""
from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from lab.errors import InputError, user_errors


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    return _int_at_least(text, 0)


def positive_float(text: str) -> float:
    """A finite number > 0."""
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def positive_ints(text: str) -> tuple[int, ...]:
    """A comma-separated list of integers >= 1."""
    values = tuple(positive_int(part) for part in text.split(",") if part.strip())
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


TOKEN_IDS = re.compile(r"\s*\d+\s*(,\s*\d+\s*)+")  # what a text prompt that was meant as token ids looks like


def token_ids(text: str) -> list[int]:
    """A comma-separated list of token ids (integers >= 0), at least one: ``--prompt-ids 1,2,3``."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids (integers >= 0), got {text!r}")
    return values


def batch_contexts(text: str) -> tuple[tuple[int, int], ...]:
    """A comma-separated list of ``BATCHxCONTEXT`` pairs of integers >= 1 (``64x512,8x32768``)."""
    pairs = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        batch, sep, context = part.lower().partition("x")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected BATCHxCONTEXT pairs such as 64x512, got {part!r}")
        pairs.append((positive_int(batch), positive_int(context)))
    if not pairs:
        raise argparse.ArgumentTypeError(f"expected comma-separated BATCHxCONTEXT pairs, got {text!r}")
    return tuple(pairs)


def device(text: str) -> str:
    """``cpu`` or ``cuda[:N]`` for a GPU this machine has."""
    from lab.hardware import check_device

    try:
        return check_device(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def output_csv(text: str) -> str:
    """A CSV path that can be written, or a folder (existing, or ending in ``/``) to write one named from the run's
    settings and the time into; creatable and writable either way (checked before any run, so no result is lost at
    the end). An empty string means: write nothing."""
    if not text:
        return text
    path = Path(text)
    if path.is_dir() or text.endswith(("/", os.sep)):
        _check_creatable(path, text)
        return text
    return output_file(text)


def output_file(text: str) -> str:
    """A file path that can be written (any extension), checked before any run."""
    path = Path(text)
    if not text:
        raise argparse.ArgumentTypeError("an empty path; give a file")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file")
    if path.exists() and not path.is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a regular file (a device or a pipe); give a file")
    _check_creatable(path.parent, text)
    if path.exists() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not writable")
    return text


def refuse_shared_outputs(args: argparse.Namespace, *names: str, inputs: list[tuple[str, object]] = ()) -> None:
    """Raise ``InputError`` when two of the output options ``names`` (argparse dests) name the same file (the second
    write would replace the first's result, or a store), or when an output names a file the command reads
    (``inputs``: (what it is, its path) pairs, such as ``("the trace", args.workload)``; symbolic and hard links
    followed): the write would replace the input."""
    outputs = [(name, getattr(args, name, None)) for name in names]
    for what, value in inputs:
        if not value:
            continue
        if Path(str(value)).is_dir():  # a checkpoint: every file in it is read
            for name, output in outputs:
                if output and Path(str(value)).resolve() in Path(output).resolve().parents:
                    raise InputError(f"--{name.replace('_', '-')} {output} is inside {what} {value}, which this "
                                     f"command reads; write the output elsewhere")
            continue
        if not Path(str(value)).is_file():
            continue
        for name, output in outputs:
            if output and (Path(output).resolve() == Path(str(value)).resolve()
                           or Path(output).exists() and _same_file(Path(output), Path(str(value)))):
                raise InputError(f"--{name.replace('_', '-')} {output} would overwrite {what} {value}, which this "
                                 f"command reads; give the output another file")
    seen: dict[Path, str] = {}
    for name in names:
        value = getattr(args, name, None)
        if not value or value.endswith(("/", os.sep)) or Path(value).is_dir():
            continue  # unset, or a folder that each output names its own file in
        path = Path(value).resolve()
        if path in seen:
            raise InputError(f"--{seen[path].replace('_', '-')} and --{name.replace('_', '-')} both write {value}; "
                             f"give each output its own file")
        seen[path] = name


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def output_folder(text: str) -> str:
    """A folder that exists and is writable, or can be created (checked before any run)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path; give a folder")
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file; give a folder")
    _check_creatable(path, text)
    return text


def _check_creatable(folder: Path, text: str) -> None:
    """``folder`` exists and is writable, or its nearest existing ancestor is a writable folder."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: cannot write into {str(folder)!r}")
    try:  # permissions can say yes where writing cannot (a read-only or virtual file system, root's view of /proc)
        import tempfile

        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: cannot write into {str(folder)!r} ({exc.strerror})") from None


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
    return value


def key_values(text: str, what: str) -> dict[str, str]:
    """``a=1,b=2`` as ``{"a": "1", "b": "2"}``. A part without ``=`` or a key given twice (one side would silently
    win) raises ``InputError`` naming it; ``what`` names the option in the message."""
    pairs: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, equals, value = part.partition("=")
        key = key.strip()
        if not equals or not key:
            raise InputError(f"{what}: expected name=value, got {part!r}")
        if key in pairs:
            raise InputError(f"{what}: {key!r} is given twice ({key}={pairs[key]} and {part}); give each once")
        pairs[key] = value.strip()
    return pairs


def refuse_ignored(names, reason: str) -> None:
    """Raise ``ValueError`` naming the options among ``names`` (argparse dests this invocation set) that the rest of
    the command would ignore; ``reason`` says why. Nothing when ``names`` is empty."""
    if names:
        options = ", ".join("--" + name.replace("_", "-") for name in names)
        raise InputError(f"{options} would be ignored: {reason}")


def cli_settings(args: argparse.Namespace, *outputs: str) -> dict:
    """A command's options as the settings of what it writes (``lab.report.results.settings_of``), leaving out the
    ``outputs`` options (where results go does not produce them)."""
    from lab.report.results import settings_of

    return settings_of({name: value for name, value in vars(args).items()
                        if name not in ("out", *outputs) and not callable(value)})


DEVICE_HELP = "cpu or cuda[:N] (default: cuda when there is one)"


def model_options(parser: argparse.ArgumentParser, device_default: str | None = None) -> None:
    """The model and where it runs: --model, --device, --block-size, --backend."""
    parser.add_argument("--model", default="tiny", help="preset or local Qwen3 checkpoint directory")
    parser.add_argument("--device", type=device, default=device_default, help=DEVICE_HELP)
    parser.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    parser.add_argument("--backend", default="auto", help="attention backend: auto, torch, cupy or reference")


def scheduler_options(parser: argparse.ArgumentParser) -> None:
    """The scheduler's modes and caps and the host pool for swapping, one flag per ``SchedulingSettings`` field
    (``--max-num-seqs`` ...), with its default and help: the same in every command."""
    from dataclasses import MISSING, fields

    from lab.sched.scheduler import SchedulingSettings

    for f in fields(SchedulingSettings):
        if isinstance(f.default, bool):  # --name / --no-name
            parser.add_argument(f"--{f.name.replace('_', '-')}", action=argparse.BooleanOptionalAction,
                                default=f.default, help=f"{f.metadata['help']} (default: %(default)s)")
            continue
        choices = f.metadata.get("choices")
        kind = None if choices else non_negative_int if f.default == 0 else positive_int
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=kind, choices=choices,
                            default=None if f.default is MISSING else f.default,
                            help=f"{f.metadata['help']} (default: %(default)s)")


def scheduling_settings(args: argparse.Namespace) -> dict:
    """Every ``SchedulingSettings`` field as ``scheduler_options`` parsed it: what a command passes on whole, so that
    no flag it offers is dropped on the way."""
    from dataclasses import fields

    from lab.sched.scheduler import SchedulingSettings

    return {f.name: getattr(args, f.name) for f in fields(SchedulingSettings)}


def run_command(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    """Parse ``argv`` and run the chosen command (``args.run``): 0, or 2 with one ``error:`` line for the lab's
    errors, bad values and files (no traceback)."""
    import sys

    args = parser.parse_args(argv)
    try:
        status = args.run(args)
    except user_errors() as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return status or 0  # a command may answer 1 (a check that found a difference)
