"""Claiming work through the shared parts directory, with no server."""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from pairclean.ops.records import JsonObject, Keyed


@dataclass(frozen=True)
class GroupClaims:
    """Work claiming through the shared parts directory, no server: the process (rank or DataLoader
    worker, on any node that sees the directory) that creates `claims/N.json` first does item N.
    The create is exclusive (O_EXCL, atomic on local filesystems and NFSv3+), so an item is done
    by one process however many race for it; a process that dies leaves its claim, and the next
    run, which clears every claim once it holds the run lock, does the item again.

    `share` (parts on an object store, which has no exclusive create): the claims live on each
    machine, so each torchrun rank first keeps its own share of the items (item N is rank
    N mod world size's) and claims them among its DataLoader workers only."""

    dir: Path
    share: bool = False

    @classmethod
    def on_this_machine(cls) -> GroupClaims:
        """Claims in a fresh folder of this machine's temp directory, made by the process that claims."""
        return cls(Path(tempfile.gettempdir()) / f"pairclean-claims-{uuid.uuid4().hex}", share=True)

    def claim(self, group: int) -> bool:
        if self.share:
            world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
            if group % world != rank:
                return False
            (self.dir / str(rank)).mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self._path(group), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as fh:
            json.dump({"rank": int(os.environ.get("RANK", "0")), "pid": os.getpid(), "host": socket.gethostname(),
                       "time": time.time()}, fh)
        return True

    def _path(self, group: int) -> Path:
        return (self.dir / os.environ.get("RANK", "0") if self.share else self.dir) / f"{group}.json"

    def holders(self) -> Keyed[int, JsonObject]:
        """The claims on disk, by group (unreadable ones, being written, as {})."""
        found = {}
        for path in self.dir.glob("*.json"):
            try:
                found[int(path.stem)] = json.loads(path.read_text())
            except (OSError, ValueError):
                found[int(path.stem)] = {}
        return found
