"""Lexical path checks done on the host before anything reaches the sandbox.

Every path a caller hands us is relative to the sandbox work dir (`/work`); an absolute path
is accepted only when it lies inside `/work`. `..` that climbs out, NUL bytes and empty paths
are refused here; symlinks are resolved *inside* the sandbox by `_inside.py` (the link target
only has meaning there) and refused the same way.
"""

from __future__ import annotations

import posixpath

from .types import PathEscapeError

WORK_DIR = "/work"


def resolve_in_workdir(path: str, *, allow_root: bool = False) -> str:
    """Return the absolute, normalised path inside `/work` that `path` names, or raise PathEscapeError."""
    if not isinstance(path, str):
        raise TypeError(f"sandbox paths are str, got {type(path).__name__}")
    if path == "" or "\0" in path:
        raise PathEscapeError(f"invalid sandbox path {path!r}: empty or contains a NUL byte")
    joined = path if path.startswith("/") else posixpath.join(WORK_DIR, path)
    normal = posixpath.normpath(joined)
    if normal.startswith("//"):
        normal = "/" + normal.lstrip("/")
    inside = normal == WORK_DIR or normal.startswith(WORK_DIR + "/")
    if not inside:
        raise PathEscapeError(
            f"path {path!r} resolves to {normal!r}, outside the sandbox work dir {WORK_DIR}: "
            "use a path relative to the work dir without '..' that climbs out"
        )
    if normal == WORK_DIR and not allow_root:
        raise PathEscapeError(f"path {path!r} names the work dir itself, not a file in it")
    return normal
