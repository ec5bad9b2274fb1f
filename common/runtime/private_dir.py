"""Cache directories whose contents this process may load as code: only ones no other user can have written.

The CPU attention kernel's shared library (common/engine/cpu_attention.py) and JAX's persistent compilation cache
(common/assembly/compilation_cache.py) live at predictable paths under the user's cache directory, and what is loaded
from them runs as this process. A directory someone else owns, or that others may write (a group-writable home, a shared
cache path), could hold a planted library or compiled program, or have a trusted one swapped. So a directory is used
only when it is owned by this user with no group/other write, and every entry in it is owned by this user; when
others may also enter it (a group/other search bit), no entry may be group/other writable either (in a 0700
directory nobody else reaches the entries, whatever their modes). The directories above it must be this user's or
root's, and not writable by others unless sticky (/tmp): from one they may write, they could rename the checked
directory away after the check and put theirs in its place. Otherwise the caller works in a fresh private
temporary directory instead and says why, with the fix.
"""

from __future__ import annotations

import os
import pathlib
import stat

MAX_ENTRIES_CHECKED = 200_000  # a cache larger than this is not scanned to the end: it is refused, not trusted


def untrusted_reason(path: str | os.PathLike) -> str | None:
    """Why code must not be loaded from directory `path` (None: it is private to this user). Symbolic links are not
    followed: a link in place of the directory or of an entry is itself a reason."""
    uid = os.getuid()
    try:
        info = os.lstat(path)
    except OSError as exc:
        return f"cannot inspect it ({exc.strerror})"
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a directory (a symbolic link or another file)"
    if info.st_uid != uid:
        return f"it is owned by uid {info.st_uid}, not by this user (uid {uid})"
    if info.st_mode & 0o022:
        return f"it is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o})"
    reachable = bool(info.st_mode & 0o011)  # others can reach the entries, so their modes matter too
    return _entries_reason(os.fspath(path), uid, reachable) or _ancestors_reason(os.fspath(path), uid)


def _ancestors_reason(path: str, uid: int) -> str | None:
    """Why a directory above `path` lets someone else swap it after this check (they rename it away and put one of
    theirs in its place; a compilation cache is read all run long): one another user owns, or one group or others
    may write without the sticky bit (in a sticky one, /tmp, only an entry's owner may rename it)."""
    ancestor = pathlib.Path(os.path.realpath(os.path.dirname(os.path.abspath(path))))
    for directory in (ancestor, *ancestor.parents):
        try:
            info = os.stat(directory)
        except OSError as exc:
            return f"cannot inspect {directory} ({exc.strerror})"
        if info.st_uid not in (uid, 0):
            return f"{directory} above it is owned by uid {info.st_uid}, who could replace it after this check"
        if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
            return (f"{directory} above it is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o}, "
                    "no sticky bit), who could replace it after this check")
    return None


def _entries_reason(top: str, uid: int, reachable: bool) -> str | None:
    checked, stack = 0, [top]
    while stack:
        directory = stack.pop()
        try:
            entries = list(os.scandir(directory))
        except OSError as exc:
            return f"cannot list {directory} ({exc.strerror})"
        for entry in entries:
            checked += 1
            if checked > MAX_ENTRIES_CHECKED:
                return f"it holds more than {MAX_ENTRIES_CHECKED} entries (not all checked); clear it"
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # gone since the listing (another process of this user replacing its entry)
            if info.st_uid != uid:
                return f"{entry.path} is owned by uid {info.st_uid}, not by this user (uid {uid})"
            if stat.S_ISLNK(info.st_mode):
                return f"{entry.path} is a symbolic link"
            if reachable and info.st_mode & 0o022:
                return f"{entry.path} is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o})"
            if stat.S_ISDIR(info.st_mode):
                stack.append(entry.path)
    return None


def make_private_dir(path: str | os.PathLike) -> str | None:
    """Create `path` and its missing parents as 0700 if absent (os.makedirs would make the parents by the umask,
    group-writable under 002, which the ancestor check refuses); then why it must not be trusted (None: it may be)."""
    missing, directory = [], pathlib.Path(os.path.abspath(path))
    while not os.path.lexists(directory) and directory != directory.parent:
        missing.append(directory)
        directory = directory.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:  # made meanwhile by another process (of this user: the check below says)
            pass
    return untrusted_reason(path)


def fix_hint(path: str | os.PathLike) -> str:
    return f"make it this user's own (`chmod 700 {path}`; remove entries others own or can write) or remove it"
