"""Issue 55: what is read back (a checkpoint, a beta record, a scores file of another dataset) is
checked against what it must be, and a command's output never lands on the scored dataset's files."""

from __future__ import annotations

import pytest

from helpers import run_cli


@pytest.mark.parametrize("where, value", [("text_projection", "scalar"), ("visual.conv1.weight", "vector"),
                                          ("positional_embedding", "vector")])
def test_a_checkpoint_with_a_scalar_or_vector_for_a_matrix_is_one_line(tmp_path, coco_shards, capsys, where, value):
    """Before (89907df): IndexError (tuple index out of range) while explaining why the checkpoint
    does not fit, exit 1 with a crash log, in score and in `train --online --estimator-pretrained`."""
    import open_clip
    import torch

    from pairclean.backends.open_clip import register_model_configs

    register_model_configs()
    state = open_clip.create_model("pairclean-tiny").state_dict()
    state[where] = torch.tensor(1.0) if value == "scalar" else torch.zeros(7)
    torch.save(state, tmp_path / "bad.pt")
    commands = (["score", coco_shards, "--out", tmp_path / "s.parquet", "--model", "pairclean-tiny",
                 "--pretrained", tmp_path / "bad.pt", "--workers", "0"],
                ["train", coco_shards, "--out", tmp_path / "run", "--model", "pairclean-tiny", "--pretrained", "none",
                 "--online", "--estimator-model", "pairclean-tiny", "--estimator-pretrained", tmp_path / "bad.pt",
                 "--epochs", "1", "--batch-size", "8", "--workers", "0"])
    for argv in commands:
        code, _, err = run_cli(argv, capsys)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
        assert "cannot load pairclean-tiny" in lines[0] and "IndexError" not in err
