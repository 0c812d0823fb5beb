# SPDX-License-Identifier: Apache-2.0
"""Files a root agent writes where another local user may reach: opened so that no one can turn them elsewhere.

`Dir(path)` checks a directory once and holds it open; every file is then opened relative to that fd, so a rename
or a link swapped into the path after the check changes nothing. The rules (docs/SECURITY.md, "Local files"):
- a private directory (spool, traces, the state file's): not a symbolic link, owned by us, writable by no one else
  (then narrowed to 0700); a missing one is made 0700, its missing parents too;
- a shared one (`--out`, which may be /tmp): that, or sticky and owned by root or us — like /tmp, where others may
  add names but never move or remove ours;
- a file in either: a regular file owned by us with one link (a hard link would write through to another file),
  else refused; a new one is made O_EXCL, 0600. Opened O_NOFOLLOW|O_NONBLOCK: a planted FIFO cannot block us.
A refusal raises UnsafeFile, one line: the path and why.
"""
from __future__ import annotations

import errno
import os
import stat

from jobprobe.core.errors import UnsafeFile

FILE_MODE = 0o600
DIR_MODE = 0o700
_OPEN = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK   # O_NONBLOCK: no effect on a regular file's reads and writes


class Dir:
    """A directory checked by the rules above and held open (`fd`); close() when done. `narrow`: an existing
    directory of ours is set to 0700 (False for one the agent only keeps a file in, such as the state file's, which
    may hold the admin's other files: other users may need to pass through it)."""

    def __init__(self, path: str, shared: bool = False, narrow: bool = True):
        self.path = os.path.abspath(path or ".")
        self.fd = -1
        _make_dirs(self.path)
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as err:   # O_DIRECTORY|O_NOFOLLOW on a link says ENOTDIR: said as what it is
            raise (UnsafeFile(f"{self.path}: a symbolic link; refused") if os.path.islink(self.path)
                   else _refusal(self.path, err)) from None
        try:
            st, me = os.fstat(fd), os.geteuid()
            private = st.st_uid == me and not st.st_mode & 0o022
            if not (private or shared and st.st_mode & stat.S_ISVTX and st.st_uid in (0, me)):
                why = "writable by group or others" if st.st_uid == me else f"owned by uid {st.st_uid}"
                raise UnsafeFile(f"{self.path}: a directory {why}; the agent writes only in one of its own"
                                 f"{' or a sticky one (like /tmp)' if shared else ''}")
            if private and narrow and not shared and stat.S_IMODE(st.st_mode) != DIR_MODE:
                os.fchmod(fd, DIR_MODE)          # ours, made wider by hand or by an older agent
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def at(self, name: str) -> str:
        return os.path.join(self.path, name)

    def open(self, name: str, flags: int = os.O_WRONLY | os.O_APPEND, mode: int = FILE_MODE, create: bool = True,
             exclusive: bool = False) -> int:
        """`name` opened with `flags` (O_TRUNC applied only once the file is found ours): made if missing (and
        `create`), O_EXCL and `mode`; an existing one only if a regular file of ours with one link (and not
        `exclusive`), narrowed to `mode`. FileNotFoundError when missing and not `create`; UnsafeFile when refused."""
        _check_name(self.path, name)
        trunc, flags = flags & os.O_TRUNC, flags & ~(os.O_TRUNC | os.O_CREAT | os.O_EXCL)
        if create:
            try:
                fd = os.open(name, flags | _OPEN | os.O_CREAT | os.O_EXCL, mode, dir_fd=self.fd)
                os.fchmod(fd, mode)                                 # mode passed through the umask
                return fd
            except FileExistsError:
                if exclusive:
                    raise UnsafeFile(f"{self.at(name)}: exists already; the agent makes this file new") from None
        try:
            fd = os.open(name, flags | _OPEN, dir_fd=self.fd)
        except FileNotFoundError:
            raise
        except OSError as err:
            raise _refusal(self.at(name), err) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise UnsafeFile(f"{self.at(name)}: not a regular file ({_kind(st.st_mode)}); refused")
            if st.st_uid != os.geteuid():
                raise UnsafeFile(f"{self.at(name)}: owned by uid {st.st_uid}; the agent writes only its own files")
            if st.st_nlink != 1:
                raise UnsafeFile(f"{self.at(name)}: has {st.st_nlink} hard links (one may be another file); refused")
            if stat.S_IMODE(st.st_mode) & ~mode:
                os.fchmod(fd, mode)
            if trunc:
                os.ftruncate(fd, 0)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def read(self, name: str) -> bytes | None:
        """The whole of file `name` (ours, regular: open()'s checks), or None if there is none."""
        try:
            fd = self.open(name, os.O_RDONLY, create=False)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            return f.read()

    def write_atomic(self, name: str, data: bytes) -> None:
        """`name` replaced by `data` at once: written to a temp file made O_EXCL here, then renamed over it (a
        rename replaces a planted link itself, never what it points to). Not fsynced: as before, a crash may
        leave the old content, never a mix."""
        tmp = f".{name}.{os.getpid()}.tmp"
        try:
            os.unlink(tmp, dir_fd=self.fd)          # left by a crash of an agent with our pid: ours, in our dir
        except FileNotFoundError:
            pass
        fd = self.open(tmp, os.O_WRONLY, exclusive=True)
        try:
            write_all(fd, data)
            os.close(fd)
            fd = -1
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            try:
                os.unlink(tmp, dir_fd=self.fd)
            except OSError:
                pass
            raise

    def exists(self, name: str) -> bool:
        try:
            os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            return True
        except FileNotFoundError:
            return False

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def unlink(self, name: str, missing_ok: bool = True) -> None:
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def names(self) -> list[str]:
        return os.listdir(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Dir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_all(fd: int, data: bytes) -> None:
    """All of `data` to `fd`; OSError(ENOSPC) when the file system takes part of it and then nothing."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(28, "No space left on device")
        view = view[n:]


def _make_dirs(path: str) -> None:
    """`path` and its missing parents made, each 0700 whatever the umask."""
    if os.path.lexists(path):
        return
    parent = os.path.dirname(path)
    if parent != path:
        _make_dirs(parent)
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        return                         # made by another at the same moment: Dir's check says what it is
    except OSError as err:
        raise _refusal(path, err) from None
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchmod(fd, DIR_MODE)        # mkdir's mode passed through the umask
    finally:
        os.close(fd)


def _check_name(where: str, name: str) -> None:
    if not name or "/" in name or "\0" in name or name in (".", ".."):
        raise UnsafeFile(f"{where}: {name!r} is not a file name in it")


def _refusal(path: str, err: OSError) -> Exception:
    why = {errno.ELOOP: "a symbolic link", errno.ENOTDIR: "not a directory", errno.EISDIR: "a directory",
           errno.ENXIO: "a FIFO or socket with no reader"}.get(err.errno)
    if why is None:
        return err                      # EACCES, ENOSPC, EROFS ...: the caller's to say
    return UnsafeFile(f"{path}: {why}; refused")


def _kind(mode: int) -> str:
    return next((k for test, k in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISLNK, "a symbolic link"),
                                   (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                                   (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
                 if test(mode)), "not a regular file")
