"""Claiming work through the shared parts directory, with no server."""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class GroupClaims:
    """Work claiming through the shared parts directory, no server: the process (rank or DataLoader
    worker, on any node that sees the directory) that creates `claims/N.json` first does item N.
    The create is exclusive (O_EXCL, atomic on local filesystems and NFSv3+), so an item is done
    by one process however many race for it; a process that dies leaves its claim, and the next
    run, which clears every claim once it holds the run lock, does the item again."""

    dir: Path

    def claim(self, group: int) -> bool:
        try:
            fd = os.open(self.dir / f"{group}.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as fh:
            json.dump({"rank": int(os.environ.get("RANK", "0")), "pid": os.getpid(), "host": socket.gethostname(),
                       "time": time.time()}, fh)
        return True

    def holders(self) -> dict[int, dict]:
        """The claims on disk, by group (unreadable ones, being written, as {})."""
        found = {}
        for path in self.dir.glob("*.json"):
            try:
                found[int(path.stem)] = json.loads(path.read_text())
            except (OSError, ValueError):
                found[int(path.stem)] = {}
        return found
