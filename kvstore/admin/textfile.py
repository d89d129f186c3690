"""A Prometheus textfile: metric families in the text exposition format (version 0.0.4),
published the way node-exporter's textfile collector expects.

**Format.** Each family is a ``# HELP`` and a ``# TYPE`` line, then one sample per line
(``name{label="value"} number``). Counter names end in ``_total`` (the name on the HELP and
TYPE lines too, as the Prometheus client libraries write it). Label values are escaped
(backslash, double quote, newline); a name that is not valid UTF-8 (a hostile directory name)
is written with its undecodable bytes as ``\\xNN`` text, so the file is always UTF-8.

**Publication.** :meth:`Textfile.write` never leaves a half-written file under the final name:
it writes a temporary file in the same directory (hidden, and not ending in ``.prom``, so the
collector never reads it), fsyncs it and renames it over the final name. A reader sees the old
file or the new one, whole. The temporary file is created with ``O_EXCL | O_NOFOLLOW``: a
symbolic link or any entry already at its name makes the write fail instead of being followed.
The final name is never opened: a symbolic link (or a FIFO) there is replaced by the rename,
never written through. The file is made mode 0644 whatever the umask, so a collector running
as another user can read it.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import secrets
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.errors import ConfigError

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
_KINDS = ("counter", "gauge")
_FILE_MODE = 0o644
_TEMP_TOKEN_BYTES = 8


@dataclass(frozen=True)
class Family:
    """One metric family: its exposed name, type, help text and samples (labels, value)."""

    name: str
    kind: str  # "counter" (name ends in _total) or "gauge"
    help: str
    samples: Sequence[tuple[Mapping[str, str], float]] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not _METRIC_NAME.match(self.name):
            raise ValueError(f"expected a Prometheus metric name, got {self.name!r}")
        if self.kind not in _KINDS:
            raise ValueError(f"expected a metric type in {_KINDS}, got {self.kind!r}")
        if self.kind == "counter" and not self.name.endswith("_total"):
            raise ValueError(f"expected a counter name ending in _total, got {self.name!r}")
        for labels, _ in self.samples:
            bad = [k for k in labels if not _LABEL_NAME.match(k) or k.startswith("__")]
            if bad:
                raise ValueError(f"expected Prometheus label names, got {bad!r}")


def exposition(families: Sequence[Family]) -> str:
    """The text exposition of ``families``, in their order (a family without samples is left
    out: a HELP/TYPE pair with no sample says nothing)."""
    lines: list[str] = []
    for fam in families:
        if not fam.samples:
            continue
        lines.append(f"# HELP {fam.name} {_escape_help(fam.help)}")
        lines.append(f"# TYPE {fam.name} {fam.kind}")
        for labels, value in fam.samples:
            lines.append(f"{fam.name}{_labels(labels)} {_number(value)}")
    return "".join(line + "\n" for line in lines)


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{escape_label_value(v)}"' for k, v in labels.items())
    return "{" + inner + "}"


def escape_label_value(value: str) -> str:
    """``value`` as a label value: valid UTF-8 text with ``\\``, ``"`` and newline escaped."""
    text = value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class Textfile:
    """The file at ``path``, rewritten whole and atomically by each :meth:`write`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.directory = path.parent
        self.name = path.name

    def check(self) -> None:
        """Raise :class:`ConfigError` (one line naming the path) unless :meth:`write` can
        work: the directory exists, is a directory, takes a new file, and the final name is
        not a directory. Creates and removes one temporary file; writes nothing else."""
        where = f"--metrics {str(self.path)!r}"
        if not self.name or self.name in (".", ".."):
            raise ConfigError(f"{where}: expected a file name, got a directory path")
        try:
            dir_fd = _open_dir(self.directory)
        except FileNotFoundError:
            raise ConfigError(
                f"{where}: expected an existing directory, {str(self.directory)!r} does not exist"
            ) from None
        except NotADirectoryError:
            raise ConfigError(
                f"{where}: expected a directory, {str(self.directory)!r} is not one"
            ) from None
        except OSError as exc:
            raise ConfigError(
                f"{where}: cannot open directory {str(self.directory)!r}: {exc.strerror or exc}"
            ) from None
        try:
            try:
                st = os.lstat(self.name, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
            else:
                if stat.S_ISDIR(st.st_mode):
                    raise ConfigError(f"{where}: expected a file, got a directory")
            try:
                fd, temp = self._create_temp(dir_fd)
            except OSError as exc:
                raise ConfigError(
                    f"{where}: cannot create a file in {str(self.directory)!r}: "
                    f"{exc.strerror or exc}"
                ) from None
            os.close(fd)
            os.unlink(temp, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)

    def write(self, text: str) -> None:
        """Replace the file with ``text`` atomically (see the module docstring). Raises
        OSError; then the temporary file is gone and the old file, if any, is unchanged."""
        data = text.encode("utf-8")
        dir_fd = _open_dir(self.directory)
        try:
            fd, temp = self._create_temp(dir_fd)
            try:
                try:
                    os.fchmod(fd, _FILE_MODE)
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view) :]
                    os.fsync(fd)  # the rename must not publish an empty file after a crash
                finally:
                    os.close(fd)
                os.rename(temp, self.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temp, dir_fd=dir_fd)
                raise
        finally:
            os.close(dir_fd)

    def _create_temp(self, dir_fd: int) -> tuple[int, str]:
        """A new temporary file beside the final name: (fd, name). ``O_EXCL | O_NOFOLLOW``:
        whatever is already at the name (a planted symbolic link) fails the open."""
        # Hidden and not ending in .prom: the textfile collector reads only *.prom files.
        temp = f".{self.name[:200]}.{secrets.token_hex(_TEMP_TOKEN_BYTES)}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        return os.open(temp, flags, _FILE_MODE, dir_fd=dir_fd), temp


def _open_dir(path: Path) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
