"""The one directory rdkv writes to on its own: converted models (:mod:`rdkv.models`) and the CPU decode's built
library (:mod:`rdkv.kernels.cpu_dequant`).

``$RDKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/rdkv``, else ``~/.cache/rdkv``. It holds code rdkv loads into the
process, so it is created 0700 whatever the umask, used only while it belongs to the current user, and made 0700
again if it has become group- or world-writable: nobody else can plant or replace a file in it.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import RDKVError


def cache_dir() -> Path:
    """The cache directory (see the module docstring), created if missing and checked private.

    Raises :class:`RDKVError` when it is not a directory or belongs to another user."""
    env = os.environ.get("RDKV_CACHE_DIR")
    xdg = os.environ.get("XDG_CACHE_HOME")
    path = Path(env).expanduser() if env else (Path(xdg) if xdg else Path.home() / ".cache") / "rdkv"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise RDKVError(f"rdkv's cache directory {path} is not a directory (a link?): remove it or set RDKV_CACHE_DIR")
    if info.st_uid != os.getuid():
        raise RDKVError(f"rdkv's cache directory {path} belongs to another user (uid {info.st_uid}): set "
                        "RDKV_CACHE_DIR to a directory of your own")
    if info.st_mode & 0o077:
        path.chmod(0o700)
    return path


def trusted(path: Path) -> bool:
    """Whether ``path`` is a regular file of the current user's that nobody else may write."""
    try:
        info = path.lstat()
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o022
