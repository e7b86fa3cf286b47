"""The one reader of files a user hands the lab (traces, profiles, kernel CSVs, checkpoint configs, sweep grids, the
sweep store's rows): every loader reads its file through here, so every file meets the same hygiene. A file is
decoded strictly (UTF-8; a byte-order mark, UTF-16 or a byte that is not UTF-8 is named as such) and bounded in size;
JSON and YAML refuse a key given twice in any mapping, nesting deeper than ``MAX_DEPTH``, integers of more than
``MAX_INT_DIGITS`` digits and (YAML) anchors and aliases (a "billion laughs" alias bomb); a CSV refuses repeated
column names and rows with more or fewer fields than its header. Lines are split on ``"\\n"`` only (a U+2028 inside
a JSON string is text, not a line break). Every error is the caller's ``ValueError`` subclass (``error``, like
``lab.checks``), naming the file, the line and the field, and never echoing more than ``SHOWN`` characters of a
field."""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

from .errors import InputError


class UserFileError(InputError):
    """A file the user gave is not well-formed (its encoding, size, syntax or structure)."""


MAX_FILE_BYTES = 2**31  # traces: the largest public ones are well below 2 GiB
MAX_SETTINGS_BYTES = 2**26  # profiles, grids, configs, kernel CSVs: 64 MiB is thousands of times what they hold
MAX_DEPTH = 64  # nesting of JSON / YAML; the lab's own files nest at most 4 deep
MAX_INT_DIGITS = 40  # an int64 has 19 digits; anything past 40 is junk (and past float range near 309)
SHOWN = 60  # at most this many characters of a field in a message

_BOMS = ((b"\xef\xbb\xbf", "starts with a UTF-8 byte-order mark (BOM); save it as UTF-8 without one"),
         (b"\xff\xfe\x00\x00", "is UTF-32; save it as UTF-8"), (b"\x00\x00\xfe\xff", "is UTF-32; save it as UTF-8"),
         (b"\xff\xfe", "is UTF-16; save it as UTF-8"), (b"\xfe\xff", "is UTF-16; save it as UTF-8"))
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_LONG_INTEGER = re.compile(r'"(?:[^"\\]|\\.)*"|(-?\d{' + str(MAX_INT_DIGITS + 1) + r',})(?![.\deE])', re.DOTALL)


def shown(value, limit: int = SHOWN) -> str:
    """``repr(value)`` cut to ``limit`` characters: a message never echoes a huge field."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"… ({len(text)} characters)"


# ---- bytes and text ---------------------------------------------------------------------------------------------
def read_bytes(path: str | Path, error: type[ValueError] = UserFileError, max_bytes: int = MAX_FILE_BYTES) -> bytes:
    """The file's bytes; ``error`` when it cannot be read or is larger than ``max_bytes`` (checked before reading)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise error(f"{path}: the file holds {size:,} bytes; at most {max_bytes:,} are read")
        with open(path, "rb") as handle:  # a device or a pipe reports no size: read one byte past the bound at most
            data = handle.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise error(f"{path}: more than {max_bytes:,} bytes; at most {max_bytes:,} are read")
        return data
    except OSError as exc:
        raise error(f"{path}: cannot read the file ({exc.strerror or exc})") from None


def decode(data: bytes, name: str, error: type[ValueError] = UserFileError, max_bytes: int = MAX_FILE_BYTES) -> str:
    """``data`` (a file's or an upload's bytes) as UTF-8 text, strictly: a byte-order mark, UTF-16/32 or an invalid
    byte is named with its line."""
    if len(data) > max_bytes:
        raise error(f"{name}: the file holds {len(data):,} bytes; at most {max_bytes:,} are read")
    for mark, problem in _BOMS:
        if data.startswith(mark):
            raise error(f"{name}: the file {problem}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise error(f"{name}: line {line}: byte {data[exc.start]:#04x} at offset {exc.start} is not valid UTF-8") \
            from None
    if "\x00" in text:  # UTF-16 without a byte-order mark decodes as UTF-8 with a NUL in every other byte
        line = text.count("\n", 0, text.index("\x00")) + 1
        raise error(f"{name}: line {line}: a NUL byte (is the file UTF-16? save it as UTF-8)")
    return text


def read_text(path: str | Path, error: type[ValueError] = UserFileError, max_bytes: int = MAX_FILE_BYTES) -> str:
    """A file's text, read and decoded strictly (``read_bytes`` then ``decode``)."""
    return decode(read_bytes(path, error, max_bytes), str(path), error, max_bytes)


def lines(text: str) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` split on ``"\\n"`` only (``str.splitlines`` also splits on U+2028, U+0085, …, which
    JSON strings may hold); a ``"\\r"`` before the ``"\\n"`` is dropped."""
    for number, line in enumerate(text.split("\n"), 1):
        yield number, line.removesuffix("\r")


# ---- JSON -------------------------------------------------------------------------------------------------------
class _Refused(UserFileError):
    """Raised inside ``json.loads`` by its hooks; turned into the caller's error with the line."""

    def __init__(self, problem: str, position: int | None = None):
        super().__init__(problem)
        self.problem, self.position = problem, position


def _unique_pairs(pairs: list) -> dict:
    seen = set()
    for key, _ in pairs:
        if key in seen:
            raise _Refused(f"key {shown(key)} is given twice in one object")
        seen.add(key)
    return dict(pairs)


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {len(text.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _check_depth(text: str) -> None:
    """Refuse nesting deeper than ``MAX_DEPTH`` before parsing (the parser recurses once per level)."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return
    depth = 0
    outside = _JSON_STRING.sub(lambda m: '"' + " " * (len(m.group()) - 2) + '"', text)  # positions kept
    for match in re.finditer(r"[\[\]{}]", outside):
        depth += 1 if match.group() in "[{" else -1
        if depth > MAX_DEPTH:
            raise _Refused(f"nested more than {MAX_DEPTH} deep", match.start())


def _duplicate_position(text: str) -> int | None:
    """Where the first object that repeats a key starts (the pure-Python parser, which knows positions; run only
    on the error path)."""
    decoder = json.JSONDecoder(object_pairs_hook=_unique_pairs, parse_int=lambda s: 0)

    def parse_object(s_and_end, *args):
        try:
            return json.decoder.JSONObject(s_and_end, *args)
        except _Refused as exc:
            if exc.position is None:
                exc.position = s_and_end[1] - 1
            raise

    decoder.parse_object = parse_object
    decoder.scan_once = json.scanner.py_make_scanner(decoder)
    try:
        decoder.decode(text)
    except _Refused as exc:
        return exc.position
    except (ValueError, RecursionError):
        return None
    return None


def _line_of(text: str, position: int | None) -> int | None:
    return None if position is None else text.count("\n", 0, position) + 1


def loads_json(text: str, name: str, error: type[ValueError] = UserFileError, line: int | None = None):
    """Parse ``text`` as JSON, strictly (no repeated key at any depth, nesting at most ``MAX_DEPTH``, integers of
    at most ``MAX_INT_DIGITS`` digits); ``line``: the file line ``text`` is (a JSON-lines record)."""
    try:
        _check_depth(text)
        return json.loads(text, object_pairs_hook=_unique_pairs, parse_int=_bounded_int)
    except json.JSONDecodeError as exc:
        where, problem = (line or 1) + exc.lineno - 1, f"not valid JSON ({exc.msg}, column {exc.colno})"
    except _Refused as exc:
        position = exc.position
        if position is None and exc.problem.startswith("key"):
            position = _duplicate_position(text)
        elif position is None:
            match = next((m for m in _LONG_INTEGER.finditer(text) if m.group(1)), None)
            position = match and match.start(1)
        offset = _line_of(text, position)
        where, problem = (None if offset is None else (line or 1) + offset - 1), exc.problem
    raise error(f"{name}: {'' if where is None else f'line {where}: '}{problem}")


def read_json(path: str | Path, error: type[ValueError] = UserFileError, max_bytes: int = MAX_SETTINGS_BYTES):
    """A JSON file, read, decoded and parsed strictly."""
    return loads_json(read_text(path, error, max_bytes), str(path), error)


# ---- YAML -------------------------------------------------------------------------------------------------------
def _yaml_loader(name: str, error: type[ValueError]):
    import yaml

    def where(mark) -> str:
        return f"{name}: line {mark.line + 1}"

    class StrictLoader(yaml.SafeLoader):
        """YAML's safe loader, refusing aliases (the alias bomb), nesting past ``MAX_DEPTH``, a mapping that gives
        a key twice (plain YAML keeps the last silently) and integers of more than ``MAX_INT_DIGITS`` digits."""

        depth = 0

        def compose_node(self, parent, index):
            event = self.peek_event()
            if isinstance(event, yaml.AliasEvent):
                raise error(f"{where(event.start_mark)}: alias *{shown(event.anchor)[1:-1]}: anchors and aliases "
                            f"are not read (write the values out)")
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise error(f"{where(event.start_mark)}: nested more than {MAX_DEPTH} deep")
            try:
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                try:
                    repeated = key in seen
                except TypeError:
                    raise error(f"{where(key_node.start_mark)}: a key that is a list or mapping") from None
                if repeated:
                    raise error(f"{where(key_node.start_mark)}: key {shown(key)} is given twice")
                seen.add(key)
            return super().construct_mapping(node, deep)

        def construct_yaml_int(self, node):
            digits = sum(c.isalnum() for c in node.value)  # hex and octal too
            if digits > MAX_INT_DIGITS:
                raise error(f"{where(node.start_mark)}: an integer of {digits} digits (at most {MAX_INT_DIGITS})")
            if ":" in node.value:  # YAML 1.1's base 60 (1:30 is 90): a time or a ratio misread as a number
                raise error(f"{where(node.start_mark)}: {shown(node.value)} reads as a base-60 number in YAML 1.1; "
                            f"quote it, or give the number itself")
            return super().construct_yaml_int(node)

        def construct_yaml_float(self, node):
            if ":" in node.value:
                raise error(f"{where(node.start_mark)}: {shown(node.value)} reads as a base-60 number in YAML 1.1; "
                            f"quote it, or give the number itself")
            return super().construct_yaml_float(node)

        def construct_yaml_bool(self, node):
            if node.value.lower() not in ("true", "false"):  # YAML 1.1 also reads yes/no/on/off (and y/n) as booleans
                raise error(f"{where(node.start_mark)}: {shown(node.value)} reads as a boolean in YAML 1.1; write "
                            f"true or false (or quote it for text)")
            return super().construct_yaml_bool(node)

    StrictLoader.add_constructor("tag:yaml.org,2002:int", StrictLoader.construct_yaml_int)
    StrictLoader.add_constructor("tag:yaml.org,2002:float", StrictLoader.construct_yaml_float)
    StrictLoader.add_constructor("tag:yaml.org,2002:bool", StrictLoader.construct_yaml_bool)
    return StrictLoader


def loads_yaml(text: str, name: str, error: type[ValueError] = UserFileError):
    """Parse ``text`` as one YAML document (JSON included), strictly (see ``_yaml_loader``)."""
    import yaml

    try:
        return yaml.load(text, Loader=_yaml_loader(name, error))  # a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise error(f"{name}: {where}not valid YAML ({exc.problem or exc.context})") from None
    except yaml.YAMLError as exc:
        raise error(f"{name}: not valid YAML ({shown(str(exc), 200)})") from None


def read_yaml(path: str | Path, error: type[ValueError] = UserFileError, max_bytes: int = MAX_SETTINGS_BYTES):
    """A YAML (or JSON) file, read, decoded and parsed strictly."""
    return loads_yaml(read_text(path, error, max_bytes), str(path), error)


# ---- CSV --------------------------------------------------------------------------------------------------------
def csv_rows(text: str, name: str, error: type[ValueError] = UserFileError, required: tuple[str, ...] = (),
             max_rows: int | None = None) -> tuple[list[str], list[list[str]], list[int]]:
    """A CSV's header (names stripped of spaces, each given once, holding ``required``), its rows (each with
    exactly as many fields as the header; blank lines only at the end) and each row's line number."""
    import csv
    import io

    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    try:
        header = [column.strip() for column in next(reader, [])]
        if not header:
            raise error(f"{name}: line 1: no header (the file is empty or starts with a blank line)")
        repeated = sorted({column for column in header if header.count(column) > 1})
        if repeated:
            raise error(f"{name}: line 1: the header names column(s) {', '.join(map(shown, repeated))} more than "
                        f"once")
        missing = [column for column in required if column not in header]
        if missing:
            raise error(f"{name}: line 1: missing column(s) {', '.join(missing)}; found "
                        f"{shown(', '.join(header), 200)}")
        rows, numbers, blank_at = [], [], 0
        for row in reader:
            if max_rows is not None and len(rows) >= max_rows:
                break
            if not row:
                blank_at = blank_at or reader.line_num
                continue
            if blank_at:
                raise error(f"{name}: line {blank_at} is blank (only the end of the file may be)")
            if len(row) != len(header):
                raise error(f"{name}: line {reader.line_num} has {len(row)} fields but the header has {len(header)}"
                            f"{f' (an extra field {shown(row[len(header)])})' if len(row) > len(header) else ''}")
            rows.append(row)
            numbers.append(reader.line_num)
    except csv.Error as exc:
        raise error(f"{name}: line {reader.line_num}: not a readable CSV ({exc})") from None
    return header, rows, numbers


def csv_frame(text: str, name: str, error: type[ValueError] = UserFileError, required: tuple[str, ...] = (),
              max_rows: int | None = None):
    """``csv_rows`` as a ``pandas.DataFrame`` of strings, indexed by each row's line number; ``error`` when it has
    no rows."""
    import pandas as pd

    header, rows, numbers = csv_rows(text, name, error, required, max_rows)
    if not rows:
        raise error(f"{name}: the file has a header but no rows")
    return pd.DataFrame(rows, columns=header, index=numbers)


def csv_table(text: str, name: str, error: type[ValueError] = UserFileError):
    """A CSV checked by ``csv_rows``, its columns typed as ``pandas.read_csv`` types them (an exported table)."""
    import io

    import pandas as pd

    csv_rows(text, name, error)
    return pd.read_csv(io.StringIO(text))


def numeric_column(frame, column: str, name: str, error: type[ValueError] = UserFileError):
    """``frame[column]`` (strings, ``csv_frame``'s) as float64; ``error`` names the line and the field of the first
    one that is not a finite number (more than ``MAX_INT_DIGITS`` digits before the point counts as not one)."""
    import numpy as np
    import pandas as pd

    text = frame[column].str.strip()
    values = pd.to_numeric(text, errors="coerce").to_numpy(dtype=np.float64)
    bad = ~np.isfinite(values) | (text.str.len() > 2 * MAX_INT_DIGITS).to_numpy()
    if bad.any():
        row = int(np.argmax(bad))
        raise error(f"{name}: line {frame.index[row]}, column {column}: {shown(frame[column].iloc[row])} is not a "
                    f"finite number")
    return values
