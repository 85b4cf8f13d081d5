"""Generated op modules: rendered once into a cache directory, imported from the file.

The file name is a content hash of (source, actdesign version, Triton version), so a stale or
foreign file can never be mistaken for the right one. Files are written atomically, so several
processes loading the same spec at once all succeed; a file whose content does not match its
source (a corrupted cache) is rewritten.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
import threading
import warnings
from pathlib import Path
from types import ModuleType

from actdesign import __version__
from actdesign import spec as spec_mod
from actdesign.codegen.render import render
from actdesign.errors import ActdesignError
from actdesign.files import write_atomic

_LOCK = threading.Lock()
_BY_KEY: dict[str, ModuleType] = {}  # content hash -> module
_BY_SPEC: dict[str, ModuleType] = {}  # canonical spec JSON -> module
_GENERATED: dict = {}  # renderer -> module


def cache_dir() -> Path:
    """$ACTDESIGN_CACHE_DIR, or the user cache directory."""
    env = os.environ.get("ACTDESIGN_CACHE_DIR")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("actdesign")) / "ops"


def load(source) -> ModuleType:
    """The op module of a spec (a path, a dict or a Spec): rendered, cached and imported once."""
    spec = spec_mod.load(source)
    memo = spec.to_json()
    with _LOCK:
        if memo not in _BY_SPEC:
            _BY_SPEC[memo] = _load_source(render(spec))
        return _BY_SPEC[memo]


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
        path = cache_dir() / f"ops_{key}.py"
        _ensure_file(path, text)
        _BY_KEY[key] = _import(path, f"actdesign_ops_{key}")
    return _BY_KEY[key]


def _triton_version() -> str:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _ensure_file(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ActdesignError(f"cannot create the cache directory {str(path.parent)!r} "
                             f"({exc.strerror or exc}); set ACTDESIGN_CACHE_DIR") from None
    try:
        current = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        current = None
    except (OSError, UnicodeDecodeError):
        current = ""
    if current == text:
        return
    if current is not None:
        warnings.warn(f"actdesign: regenerating the corrupted cache file {path}", stacklevel=3)
    write_atomic(path, text)


class _SourceOnlyLoader(importlib.machinery.SourceFileLoader):
    """Compiles from the .py every time: a stale bytecode file can never shadow the source."""

    def get_code(self, fullname):
        return compile(self.get_data(self.path), self.path, "exec", dont_inherit=True)


def _import(path: Path, name: str) -> ModuleType:
    loader = _SourceOnlyLoader(name, str(path))
    module_spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # Triton and inspect look the module up by name
    try:
        loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
