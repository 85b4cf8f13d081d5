"""Generated op modules: rendered once into a private cache directory, imported from the text.

The file name is a content hash of (source, actdesign version, Triton version), so a stale or
foreign file can never be mistaken for the right one, and the same op always has the same
module name. The cache is trusted only as far as it is private: its directories are made
0700 whatever the umask, and one owned by another user or writable by others is refused.
Nothing read from it is used unchecked: an op module is compiled from the source rendered
here (the file must match it, or it is rewritten), and other artifacts (tables, numba's
compiled kernels) are sealed, a first line holding the sha256 of the rest. Files are written
0600 and atomically, the first writer winning, so processes loading one spec at once all
succeed and leave one file.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import linecache
import os
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from types import ModuleType

from actdesign import __version__
from actdesign import spec as spec_mod
from actdesign.errors import ActdesignError

_LOCK = threading.Lock()
_BY_KEY: dict[str, ModuleType] = {}  # content hash -> module
_BY_SPEC: dict[str, ModuleType] = {}  # the spec's behaviour, as JSON -> module
_GENERATED: dict = {}  # renderer -> module
_RESOLVED: dict[str, Path] = {}  # $ACTDESIGN_CACHE_DIR as given -> the directory it named then
_SEAL = b"# actdesign sha256 "


def cache_dir() -> Path:
    """$ACTDESIGN_CACHE_DIR (a relative one resolved against the directory current when first
    used here), or the user cache directory."""
    env = os.environ.get("ACTDESIGN_CACHE_DIR")
    if env is not None:
        if not env.strip():
            raise ActdesignError("ACTDESIGN_CACHE_DIR is set but empty: unset it or name a "
                                 "directory")
        if env not in _RESOLVED:
            _RESOLVED[env] = Path(env).expanduser().absolute()
        return _RESOLVED[env]
    import platformdirs

    return Path(platformdirs.user_cache_dir("actdesign")) / "ops"


def private_dir(path: Path) -> Path:
    """`path`, created with mode 0700 (parents too, whatever the umask) and refused unless it
    is ours and writable by no one else: anything in it may be run."""
    missing = []
    while not path.exists() and path.parent != path:
        missing.append(path)
        path = path.parent
    for made in reversed(missing):
        try:
            made.mkdir(mode=0o700)
        except FileExistsError:
            pass  # made meanwhile by another process: checked below
        except OSError as exc:
            raise ActdesignError(f"cannot create the cache directory {str(made)!r} "
                                 f"({exc.strerror or exc}); set ACTDESIGN_CACHE_DIR") from None
        else:
            os.chmod(made, 0o700)  # mkdir's mode is masked by the umask
    path = missing[0] if missing else path
    info = path.stat()
    if not hasattr(os, "getuid"):  # no POSIX owners and modes here
        return path
    if info.st_uid != os.getuid():
        raise ActdesignError(f"the cache directory {str(path)!r} belongs to another user; set "
                             "ACTDESIGN_CACHE_DIR to a directory of your own")
    if info.st_mode & 0o022:
        raise ActdesignError(f"the cache directory {str(path)!r} is writable by others: run "
                             f"chmod 700 {str(path)!r} or set ACTDESIGN_CACHE_DIR to a private "
                             "directory")
    return path


def seal(data: bytes) -> bytes:
    """`data` after a first line holding its sha256."""
    return _SEAL + hashlib.sha256(data).hexdigest().encode() + b"\n" + data


def read_verified(path: Path) -> bytes | None:
    """The data of a sealed file; None when it is missing, or (with a warning) when its seal
    does not match: the caller makes the data again and rewrites the file."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError:
        raw = b""
    head, _, data = raw.partition(b"\n")
    if head == seal(data).partition(b"\n")[0]:
        return data
    warnings.warn(f"actdesign: regenerating the corrupted cache file {path}", stacklevel=3)
    return None


def write_private(path: Path, data: bytes, replace: bool = False) -> None:
    """Write `data` to `path` with mode 0600, atomically. Unless `replace`, an existing file
    is kept: when processes race, the first writer wins and all read one file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:  # mkstemp makes it 0600
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
            except OSError:  # no hard links on this file system: the last writer wins
                os.replace(tmp, path)
    except OSError as exc:
        raise ActdesignError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None
    finally:
        Path(tmp).unlink(missing_ok=True)


def load(source) -> ModuleType:
    """The op module of a spec (a path, a dict or a Spec): rendered, cached and imported once."""
    spec = spec_mod.load(source)
    memo = spec_mod.behaviour_json(spec)
    with _LOCK:
        if memo not in _BY_SPEC:
            from actdesign.codegen.render import render  # printing imports sympy

            _BY_SPEC[memo] = _load_source(render(spec))
        return _BY_SPEC[memo]


def rebuild(spec: dict, name: str):
    """An instance, not yet initialised, of class `name` of a spec's op module: how pickled
    op modules come back, in any process, the module regenerated from the spec if need be."""
    cls = getattr(load(spec), name)
    return cls.__new__(cls)


def load_source(text: str) -> ModuleType:
    """A rendered module's source: written to the cache once, imported once."""
    with _LOCK:
        return _load_source(text)


def generated(render) -> ModuleType:
    """The module a renderer without arguments makes, rendered and imported once."""
    if render not in _GENERATED:  # a race only renders twice: load_source is memoized
        _GENERATED[render] = load_source(render())
    return _GENERATED[render]


def _load_source(text: str) -> ModuleType:
    key = hashlib.sha256("\0".join((text, __version__, _triton_version())).encode())
    key = key.hexdigest()[:24]
    if key not in _BY_KEY:
        folder = private_dir(cache_dir())
        private_dir(folder / "__pycache__")  # numba's (sealed) kernels
        path = folder / f"ops_{key}.py"
        _ensure_file(path, text)
        _BY_KEY[key] = _import(path, text, f"actdesign_ops_{key}")
    return _BY_KEY[key]


def _triton_version() -> str:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _ensure_file(path: Path, text: str) -> None:
    """The file holds `text` (Triton and numba read it): written, or rewritten if it differs."""
    try:
        current = path.read_bytes()
    except FileNotFoundError:
        current = None
    except OSError:
        current = b""
    if current == text.encode():
        return
    if current is not None:
        warnings.warn(f"actdesign: regenerating the corrupted cache file {path}", stacklevel=4)
    write_private(path, text.encode(), replace=current is not None)


def _import(path: Path, text: str, name: str) -> ModuleType:
    """The module compiled from `text`, never from what the file holds now; inspect (Triton
    reads its kernels' source) is given the same text."""
    lines = text.splitlines(keepends=True)
    linecache.cache[str(path)] = (len(text), None, lines, str(path))  # never re-read
    module_spec = importlib.util.spec_from_loader(name, loader=None, origin=str(path))
    module = importlib.util.module_from_spec(module_spec)
    module.__file__ = str(path)
    sys.modules[name] = module  # Triton and inspect look the module up by name
    try:
        exec(compile(text, str(path), "exec", dont_inherit=True), module.__dict__)
    except BaseException:
        del sys.modules[name]
        raise
    return module
