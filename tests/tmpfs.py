"""A real small file system for the tests: a tmpfs of a given size and mount options (a full
disk, a read-only one), mounted where the commands a test starts can see it."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import CLI


@dataclasses.dataclass(frozen=True)
class SmallFs:
    """A real tmpfs mounted at `path`, seen by the commands `run` starts. Run as root, it is
    mounted on this machine (`enter` empty); as another user, it is mounted in a user+mount
    namespace of its own, which `enter` (nsenter) runs a command in: this process does not see
    it, so a test looks at it only through `run` (e.g. `exists`)."""

    path: Path
    enter: tuple[str, ...]

    def run(self, *argv, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([*self.enter, *map(str, argv)], capture_output=True, text=True,
                              timeout=timeout)

    def kconvert(self, *args) -> subprocess.CompletedProcess:
        """cli_subprocess where the file system is mounted."""
        return self.run(*CLI, *args)

    def exists(self, path: Path) -> bool:
        probe = self.run("test", "-e", path)
        assert probe.returncode in (0, 1) and not probe.stderr, probe.stderr
        return probe.returncode == 0


@contextlib.contextmanager
def small_fs(where: Path, options: str) -> Iterator[SmallFs]:
    """A real tmpfs at `where` (a new directory) with mount `options` ("size=16k",
    "ro,size=1m", ...). As root it is mounted here, and a refused mount fails the test: CI runs
    the suite as root, and the disk-full and read-only tests must run there. As another user
    it is mounted in a user+mount namespace (unshare --user --map-root-user --mount); the test
    is skipped, saying why, only where that is refused too."""
    where.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)]
    if os.geteuid() == 0:
        done = subprocess.run(mount, capture_output=True, text=True)
        if done.returncode != 0:
            pytest.fail(f"{' '.join(mount)} refused as root: {done.stderr.strip()}")
        try:
            yield _mounted(SmallFs(where, ()))
        finally:
            subprocess.run(["umount", "-l", str(where)], check=True)
        return
    missing = [tool for tool in ("unshare", "nsenter") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"not root, and no {' or '.join(missing)} here to mount a tmpfs in a "
                    "user+mount namespace")
    # The namespace lives as long as this holder: it mounts, says so, then waits.
    holder = subprocess.Popen(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
         '"$@" && echo mounted && exec sleep infinity', "sh", *mount],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if holder.stdout.readline().strip() != "mounted":
            holder.wait(timeout=60)
            pytest.skip(f"not root, and no tmpfs can be mounted in a user+mount namespace "
                        f"here (unshare --user --map-root-user --mount {' '.join(mount)}): "
                        f"{holder.stderr.read().strip()}")
        yield _mounted(SmallFs(where, ("nsenter", f"--target={holder.pid}", "--user",
                                       "--mount", "--preserve-credentials")))
    finally:
        holder.kill()
        holder.communicate()


def _mounted(fs: SmallFs) -> SmallFs:
    """fs, once its path is seen as a mount point where its commands run (else the test would
    write to the ordinary directory beneath and prove nothing)."""
    seen = fs.run("mountpoint", fs.path)
    assert seen.returncode == 0, f"{fs.path} is no mount point: {seen.stdout}{seen.stderr}"
    return fs
