"""Every file the project writes: checked before the work starts, written atomically, never over an input.

``check_output(path, inputs=..., suffixes=...)`` refuses, in one line naming the path, an output that is a
directory, lies in a folder that is missing or not writable, has the wrong extension, or is one of the
command's inputs (the same file under another name too). Commands call it for every output before they
start their work, so a bad path costs nothing.

``atomic_output(path)`` yields a temporary path beside the target; when the block ends without an error
the file is flushed to disk (fsync) and renamed over the target in one step, and otherwise the temporary
file is removed: a failed or interrupted command leaves an existing file exactly as it was, and never
leaves a truncated one. ``atomic_directory(path)`` does the same for a whole directory (a packed model):
it is built beside the target and renamed into place only when complete. A path that existed before the
command is never removed, whatever it is (a file, a device node, a directory).
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from moe_offload.errors import ConfigError


def check_output(path, *, inputs: Iterable = (), suffixes: tuple[str, ...] = (), what: str = "output",
                 directory: bool = False) -> Path:
    """``path`` as a Path if a command may write it, else ConfigError naming the path and the problem.

    ``inputs`` are the files the command reads (an output may not be one of them); ``suffixes`` the
    extensions the output must have (a plot's format follows its extension); ``directory`` for outputs
    that are directories (``pack -o``), which must not exist yet or be empty."""
    try:
        return _check_output(Path(path), inputs, suffixes, what, directory)
    except OSError as exc:  # a name too long, a symlink loop in the way
        raise ConfigError(f"{path}: cannot write the {what} there: {exc.strerror or exc}") from None


def _check_output(path: Path, inputs: Iterable, suffixes: tuple[str, ...], what: str, directory: bool) -> Path:
    given = path
    if str(path) in ("", "."):
        raise ConfigError(f"{what} path {str(path)!r} names no file")
    if directory:
        if path.exists() and not path.is_dir():
            raise ConfigError(f"{path}: exists and is not a directory")
        if path.is_dir() and any(path.iterdir()):
            raise ConfigError(f"{path}: exists and is not empty; write into a new directory")
    elif path.is_dir():
        raise ConfigError(f"{path}: is a directory; give a file name for the {what}")
    elif path.exists() and not path.is_file():
        raise ConfigError(f"{path}: exists and is not a regular file; will not write the {what} over it")
    if suffixes and path.suffix.lower() not in suffixes:
        raise ConfigError(f"{path}: the {what} must end in {' or '.join(suffixes)}")
    if not directory and path.is_symlink():  # the file written is the one the link names (atomic_output)
        target = Path(os.path.realpath(path))
        if not target.parent.is_dir():
            raise ConfigError(f"{path}: a symlink to {target}, whose folder does not exist; folders are made "
                              "only along the path given, never through a link")
        path = target
    parent = _existing_ancestor(path.parent)
    if parent is None or not parent.is_dir():
        raise ConfigError(f"{path}: the folder {path.parent} cannot be created (a file is in the way)")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{path}: the folder {parent} is not writable")
    try:  # a file made and dropped there: what access() cannot tell root (a pseudo-filesystem such as /proc)
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as exc:
        raise ConfigError(f"{path}: the folder {parent} is not writable ({exc.strerror or exc})") from None
    for source in inputs:
        if source is not None and _same_file(path, Path(source)):
            raise ConfigError(f"{given}: is also an input of this command; write the {what} to another file")
    return given


@contextmanager
def atomic_output(path) -> Iterator[Path]:
    """Yield a temporary file beside ``path``; rename it over ``path`` (after fsync) if the block succeeds.

    A symlink at ``path`` keeps pointing where it did: the file it points to is the one replaced. A path that
    is not a regular file (a device node, a FIFO, a directory) is never replaced, even by a caller that did
    not call check_output first (the Python API). Missing folders are made along the path given, never through
    a symlink: a link into a folder that does not exist (``d.html -> /nonexistent/dir/x.html``) is refused."""
    given = Path(path)
    path = _target_of(given)
    if path is not given and not path.parent.is_dir():
        raise ConfigError(f"{given}: a symlink to {path}, whose folder does not exist; folders are made only along "
                          "the path given, never through a link")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=_temporary_prefix(path), suffix=".partial", dir=path.parent)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot write: {exc.strerror or exc}") from None
    os.close(handle)
    temporary = Path(temporary)
    try:
        # mkstemp makes the file private (0600); the result gets the mode of the file it replaces, or the
        # mode a new file gets under this process's umask, as if written in place.
        os.chmod(temporary, _mode_of(path, 0o666))
        yield temporary
        _fsync(temporary)
        os.replace(temporary, path)
        _fsync_directory(path.parent)
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        raise ConfigError(f"{path}: cannot write: {exc.strerror or exc}") from None
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def _target_of(path: Path) -> Path:
    """The file a write to ``path`` replaces: the end of its symlinks; refused when not a regular file."""
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    if os.path.lexists(target) and not target.is_file():
        raise ConfigError(f"{path}: exists and is not a regular file; will not write over it")
    return target


def _temporary_prefix(path: Path) -> str:
    """The name of a temporary file beside ``path``: after ``path`` where its name is text; a name with bytes
    that are not UTF-8 (kept by Python as lone surrogates) would be refused by the writers that take names as
    UTF-8 text (pyarrow, safetensors), so then a fixed one: the rename at the end writes any name."""
    try:
        path.name.encode("utf-8")
    except UnicodeEncodeError:
        return ".moe-offload-output."
    return f".{path.name}."


def write_atomically(path, data: bytes | str) -> Path:
    """Write ``data`` to ``path`` through :func:`atomic_output`."""
    with atomic_output(path) as temporary:
        if isinstance(data, str):
            temporary.write_text(data, encoding="utf-8")
        else:
            temporary.write_bytes(data)
    return Path(path)


@contextmanager
def atomic_directory(path) -> Iterator[Path]:
    """Yield an empty staging directory beside ``path``; rename it to ``path`` if the block succeeds (an
    empty directory at ``path`` is replaced), else remove the staging directory."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=_temporary_prefix(path), suffix=".partial", dir=path.parent))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot write: {exc.strerror or exc}") from None
    try:
        os.chmod(staging, _mode_of(path, 0o777))
        yield staging
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()
        os.rename(staging, path)
        _fsync_directory(path.parent)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise ConfigError(f"{path}: cannot write: {exc.strerror or exc}") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _umask()  # read once: setting it back and forth is not thread-safe


def _mode_of(path: Path, default: int) -> int:
    """The permission bits of ``path`` if it exists, else ``default`` under the process's umask."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return default & ~_UMASK


def _existing_ancestor(folder: Path) -> Path | None:
    for candidate in (folder, *folder.parents):
        if candidate.exists():
            return candidate
    return None


def _same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one file: the same inode when both exist (a link, another spelling),
    else the same resolved path (two outputs of one command)."""
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
        return a.resolve() == b.resolve()
    except (OSError, RuntimeError):
        return False


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_directory(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # some filesystems do not open directories; the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _CheckedStdout:
    """``sys.stdout`` while a command runs (:func:`checked_stdout`): a write that fails (a full disk, /dev/full,
    a terminal gone) is one ConfigError line instead of an OSError traceback; a closed pipe stays
    BrokenPipeError, which the command line ends quietly as Unix tools do. Text the stream's encoding cannot
    hold (a file name with bytes that are not UTF-8, which Python keeps as lone surrogates) is written with
    backslash escapes, as Python writes it to stderr, instead of failing with UnicodeEncodeError."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._checked(self._stream.write, text)
        except UnicodeEncodeError:
            encoding = getattr(self._stream, "encoding", None) or "utf-8"
            return self._checked(self._stream.write, text.encode(encoding, "backslashreplace").decode(encoding))

    def flush(self) -> None:
        self._checked(self._stream.flush)

    def _checked(self, method, *args):
        try:
            return method(*args)
        except BrokenPipeError:
            raise
        except OSError as exc:
            self._stream = _discard_stdout()
            raise ConfigError(f"standard output: cannot write: {exc.strerror or exc}") from None

    def __getattr__(self, name):  # isatty, fileno, encoding...: those of the stream
        return getattr(self._stream, name)


def _discard_stdout():
    """Point file descriptor 1 at /dev/null and drop what is buffered, so that neither a later write nor the
    interpreter's last flush at exit fails again on the stream that failed."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.__stdout__.fileno())
    except (OSError, AttributeError, ValueError):
        pass  # no real descriptor (a test's captured stdout): nothing at exit to fail
    return open(os.devnull, "w")


@contextmanager
def checked_stdout() -> Iterator[None]:
    """Run a command with its standard output checked (:class:`_CheckedStdout`); what it printed is flushed
    before the block ends, so that a failure to write it is reported as the command's error, not lost at
    exit."""
    stream = sys.stdout
    sys.stdout = checked = _CheckedStdout(stream)
    try:
        yield
        checked.flush()
    finally:
        sys.stdout = stream
