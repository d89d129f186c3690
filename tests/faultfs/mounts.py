"""Mount points of faultfs: unmounting and finding them, without importing FUSE (the test's
side needs these where fusepy is missing, to skip; the daemon needs them to clean up)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess


def unmount_commands(mount: str, lazy: bool) -> list[list[str]]:
    """The ways to unmount ``mount`` here, in order: fusermount (v2 or v3), then umount (root)."""
    flag = "-uz" if lazy else "-u"
    tools = [[tool, flag, mount] for tool in ("fusermount", "fusermount3") if shutil.which(tool)]
    if os.geteuid() == 0 and shutil.which("umount"):
        tools.append(["umount", *(["-l"] if lazy else []), mount])
    return tools


def lazy_unmount(mount: str) -> bool:
    """Detach ``mount`` now (MNT_DETACH), whatever still uses it; True when a tool succeeded."""
    for command in unmount_commands(mount, lazy=True):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            done = subprocess.run(command, capture_output=True, timeout=30, check=False)
            if done.returncode == 0:
                return True
    return False


def is_mounted(mount: str) -> bool:
    """Is ``mount`` a mount point now? Read from /proc/self/mountinfo: a ``stat`` of a
    frozen mount point would hang."""
    target = mount.replace(" ", "\\040")
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
        return any(line.split()[4] == target for line in f)
