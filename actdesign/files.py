"""Writing files so that a reader never sees a partial one."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from .errors import ActdesignError


def check_writable(path: str | Path) -> Path:
    """Fail early, before any long computation, if `path` cannot be written."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ActdesignError(f"cannot write {str(path)!r}: it is a directory")
    if not parent.is_dir():
        raise ActdesignError(f"cannot write {str(path)!r}: directory {str(parent)!r} "
                             "does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ActdesignError(f"cannot write {str(path)!r}: permission denied")
    return path


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write to a temporary file in the same directory, then rename it over `path`."""
    path = check_writable(path)
    mode = "wb" if isinstance(data, bytes) else "w"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, **({} if mode == "wb" else {"encoding": "utf-8"})) as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise ActdesignError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_json(path: str | Path, what: str):
    """A JSON file's data; NaN and infinities are refused. Errors name the file and say why."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ActdesignError(f"{what} file {str(path)!r} not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ActdesignError(f"cannot read {what} {str(path)!r}: {exc}") from None
    return loads_json(text, str(path))


def loads_json(text: str, origin: str):
    def reject(constant):
        raise ValueError(f"non-finite number {constant}")

    try:
        return json.loads(text, parse_constant=reject)
    except ValueError as exc:
        raise ActdesignError(f"{origin}: not valid JSON ({exc})") from None
