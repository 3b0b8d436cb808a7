"""Plain helpers the tests share (fixtures stay in conftest.py): run the command line in this
process, tiny configs, small real datasets and scores files."""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path

from pairclean.cli import main
from pairclean.scoring.model import ScoreConfig


def exit_code(argv: list) -> int:
    """Run `pairclean ARGV` in this process: its exit code (0 when main returns, as it does on success)."""
    try:
        main([str(a) for a in argv])
    except SystemExit as exc:
        return exc.code
    return 0


def run_cli(argv: list, capsys) -> tuple[int, str, str]:
    """Run `pairclean ARGV` in this process: (exit code, stdout, stderr)."""
    code = exit_code(argv)
    out, err = capsys.readouterr()
    return code, out, err


def tiny_train_config(**overrides):
    """One epoch of the tiny random open_clip model in batches of 8, no workers: seconds per run."""
    from pairclean.training import TrainConfig

    base = dict(model="pairclean-tiny", pretrained="none", epochs=1, batch_size=8, lr=1e-3, warmup_steps=1,
                workers=0, shuffle_buffer=8, log_every=1)
    return TrainConfig(**{**base, **overrides})


def text_pairs(coco_src: Path, out: Path) -> Path:
    """The 16 COCO pairs as text-text pairs (two captions of one image) in WebDataset shards of 8."""
    from pairclean.data.manifest import write_manifest
    from pairclean.data.spec import DatasetSpec
    from pairclean.data.writer import write_shards

    out.mkdir()
    rows = [json.loads(line) for line in (coco_src / "pairs.jsonl").read_text().splitlines()]
    write_shards(({"__key__": str(r["image_id"]), "txt": r["captions"][0], "txt2": r["captions"][1]} for r in rows),
                 out, prefix="text", maxcount=8)
    spec = DatasetSpec(format="webdataset", shards=[str(p) for p in sorted(out.glob("text-*.tar"))], pair="text-text")
    write_manifest(out / "manifest.yaml", spec)
    return out / "manifest.yaml"


def tiny_scores(source: Path, out: Path) -> Path:
    """Score `source` with the tiny random open_clip model (seconds): real scores files for tests."""
    from pairclean.data.dataset import open_dataset
    from pairclean.scoring.model import score

    score(open_dataset(str(source)), out, ScoreConfig(model="pairclean-tiny", pretrained="none", beta_k=64,
                                                      batch_size=8, workers=0, seed=0))
    return out


def forked(fn, fault: str | None = None) -> int:
    """Run fn() in a forked child (with the fault point `fault` armed, pairclean.ops.faults); its
    exit status, or minus the signal that ended it."""
    import open_clip  # noqa: F401 - imported once here rather than in every child
    import torch

    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            if fault:
                os.environ["PAIRCLEAN_FAULT"] = fault
            else:
                os.environ.pop("PAIRCLEAN_FAULT", None)
            torch.set_num_threads(1)  # a forked child must not use the parent's OpenMP pool
            fn()
        except BaseException:  # noqa: BLE001 - report, then leave the child
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def snapshot(*paths: Path) -> dict[str, bytes]:
    """Every file under `paths` with its bytes: what must survive a refused command."""
    files = {}
    for root in paths:
        for f in ([root] if root.is_file() else sorted(root.rglob("*"))):
            if f.is_file():
                files[str(f)] = f.read_bytes()
    return files


def refused(argv, capsys, *keep: Path, message: str = "") -> str:
    """`pairclean ARGV` exits 2 with one line holding `message`, and every file under `keep` is as it was."""
    before = snapshot(*keep)
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
    assert snapshot(*keep) == before
    return err


def killed_after_first_unit(run) -> None:
    """Run `run` in a forked child SIGKILLed (pairclean.ops.faults) once its second part is written."""
    import signal

    assert forked(run, "part-written:2") == -signal.SIGKILL


def trained_and_killed_after_first_epoch(monkeypatch, *args) -> None:
    """`train(*args)` stopped (KeyboardInterrupt) right after its first epoch's state is saved."""
    import pytest

    from pairclean.training import train
    from pairclean.training import trainer

    real_save = trainer.save_state

    def killed_after_first_epoch(run_dir, state):
        real_save(run_dir, state)
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "save_state", killed_after_first_epoch)
    with pytest.raises(KeyboardInterrupt):
        train(*args)
    monkeypatch.setattr(trainer, "save_state", real_save)


def host_copies_without_a_driver(monkeypatch) -> None:
    """`HostCopies` on fake CUDA tensors (no GPU): the page-locked copy made as a plain host copy
    (`to_host`, in kind) and CUDA events that record nothing (what they are for needs a driver)."""
    import torch

    from pairclean.backends import feed

    class Event:
        def __init__(self, blocking: bool = False):
            pass

        def record(self):
            pass

    monkeypatch.setattr(feed, "to_host", lambda t: t.to("cpu", non_blocking=True))
    monkeypatch.setattr(torch.cuda, "Event", Event)
