"""Reading a user's input: a JSON file into a pydantic model, with errors that name the file and the field, and
the command line's argument types.

The CLI reads strategies, cost models and hardware descriptions from files. A bad one should say which file, where
in it, and what is wrong, in one line: not `Expecting ',' delimiter` without a file name, and not pydantic's
multi-line dump with its documentation links. The argument types (`positive`) live here, not in `tbo.tools.cli`,
because every subcommand's parser uses them, `tbo predict`'s (`tbo.tools.predict.cli`) too, and the CLI imports
those parsers: a type defined in the CLI made an import circle.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

__all__ = ["describe_validation_error", "read_json", "load_json_model", "positive"]

M = TypeVar("M", bound=BaseModel)


def describe_validation_error(exc: ValidationError, limit: int = 3) -> str:
    """Each of the first ``limit`` errors as ``field 'a.b': message (got value)``, joined by '; '."""
    parts = []
    for err in exc.errors()[:limit]:
        where = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        got = f" (got {err['input']!r})" if "input" in err and err["type"] not in ("missing", "value_error") else ""
        parts.append(f"{f'field {where!r}: ' if where else ''}{msg}{got}")
    more = exc.error_count() - limit
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


#: the largest JSON file read (a strategy, costs, hardware or model config is a few KiB)
MAX_JSON_FILE_BYTES = 16 << 20


def read_json(path: str | Path, what: str) -> Any:
    """The parsed JSON of ``path``; a missing, unreadable or malformed file is a ValueError naming ``what`` and it,
    and so is one that is not a regular file (a FIFO would block the read forever, ``/dev/zero`` never end) or is
    over `MAX_JSON_FILE_BYTES`."""
    import stat

    try:
        st = Path(path).stat()
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{what} {path}: not a regular file")
        if st.st_size > MAX_JSON_FILE_BYTES:
            raise ValueError(f"{what} {path}: {st.st_size} bytes, more than the {MAX_JSON_FILE_BYTES} read")
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"{what} {path}: cannot read it ({exc.strerror or exc})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} {path}: not valid JSON, line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except RecursionError:  # json.loads recurses once per level of nesting
        raise ValueError(f"{what} {path}: nested too deeply to be a {what}") from None


def load_json_model(cls: type[M], path: str | Path, what: str, **extra: Any) -> M:
    """``cls`` validated from the JSON object in ``path`` (with ``extra`` fields added), errors naming the file."""
    data = read_json(path, what)
    if not isinstance(data, dict):
        raise ValueError(f"{what} {path}: expected a JSON object with {cls.__name__}'s fields, got "
                         f"{type(data).__name__}")
    try:
        return cls.model_validate({**data, **extra})
    except ValidationError as exc:
        raise ValueError(f"{what} {path}: {describe_validation_error(exc)}") from None


def positive(text: str) -> int:
    """An argparse type: an integer >= 1 (argparse names the flag in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value
