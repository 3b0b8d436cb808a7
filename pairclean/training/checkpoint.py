"""Run directory layout, training state for a resumed run, and finding a trained model to evaluate.

    RUN_DIR/run.json              config, target, method, data summary (the run's identity)
    RUN_DIR/state.pt              model + optimizer + scheduler + scaler + epoch + RNG + method state
    RUN_DIR/model-epoch-NNN.pt    plain state_dict after each epoch (sentence-transformers: a directory)
    RUN_DIR/model-best.pt         the epoch with the best validation rSum
    RUN_DIR/metrics.jsonl         one JSON object per logged step and per epoch
    RUN_DIR/diagnostics/epoch-NNN.parquet   per-pair loss and weight of each epoch

Every file is written to a temp name and renamed: a killed run leaves the previous epoch's
complete state, which is where a resumed run continues.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import torch

from pairclean.backends import export_name
from pairclean.ops.atomic import atomic_path
from pairclean.errors import ConfigError, UserError
from pairclean.ops.records import JsonObject, StateDict

RUN_FILE = "run.json"
STATE_FILE = "state.pt"
BEST = "model-best"
_EPOCH_MODEL = re.compile(r"model-epoch-\d+(\.pt)?")  # not the extra networks' model-epoch-NNN-NAME


def epoch_model_name(epoch: int) -> str:
    return f"model-epoch-{epoch:03d}"


def model_path(run_dir: Path, stem: str, backend: str) -> Path:
    return Path(run_dir) / export_name(stem, backend)


def rng_state() -> StateDict:
    """RNG states as tensors and plain Python values, so state.pt loads with weights_only=True."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)]
    state = {"torch": torch.get_rng_state(), "numpy": numpy_state, "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_state(run_dir: Path, state: dict) -> None:
    with atomic_path(Path(run_dir) / STATE_FILE) as tmp:
        torch.save({**state, "rng": rng_state()}, tmp)


def load_state(run_dir: Path) -> StateDict:
    try:
        return torch.load(Path(run_dir) / STATE_FILE, map_location="cpu", weights_only=True)
    except Exception as exc:  # a corrupt or foreign file: one line, never arbitrary unpickling
        raise UserError(f"cannot load {Path(run_dir) / STATE_FILE} safely: {str(exc).splitlines()[0][:200]}") from None


def read_run(run_dir: Path) -> JsonObject:
    path = Path(run_dir) / RUN_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {path}: {exc}") from None


def is_training_run(run_dir: Path) -> bool:
    """A directory whose run.json is a training run's (settings and target): a scoring run's parts
    directory also holds a run.json, and must never be taken for one."""
    try:
        run = json.loads((Path(run_dir) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(run, dict) and isinstance(run.get("settings"), dict) and isinstance(run.get("target"), dict)


def resolve_trained_model(path: Path) -> tuple[JsonObject, Path]:
    """(target description, model file or directory) for a run directory or a model inside one."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"model not found: {path}")
    if path.is_dir() and (path / "modules.json").is_file() and not (path / RUN_FILE).is_file():
        run_dir = path.parent if (path.parent / RUN_FILE).is_file() else None
        desc = read_run(run_dir)["target"] if run_dir else {"backend": "sentence-transformers"}
        return desc, path
    if path.is_dir() and (path / RUN_FILE).is_file():
        desc = read_run(path)["target"]
        best = model_path(path, BEST, desc["backend"])
        if best.exists():
            return desc, best
        epochs = sorted(p for p in path.glob("model-epoch-*") if _EPOCH_MODEL.fullmatch(p.name))
        if not epochs:
            raise UserError(f"{path} holds no trained model yet")
        return desc, epochs[-1]
    if (path.parent / RUN_FILE).is_file():
        return read_run(path.parent)["target"], path
    raise ConfigError(f"{path} is not a pairclean run or model; for a bare open_clip checkpoint give its architecture "
                      "as arch (an open_clip model name)", "arch")


def extra_network_files(model: Path) -> list[Path]:
    """The models of the extra networks saved beside `model` by a run that trained several
    (run.json `extra_networks`; `model-best.pt` -> `model-best-peer.pt`)."""
    model = Path(model)
    run = model.parent / RUN_FILE
    if not run.is_file():
        return []
    names = read_run(model.parent).get("extra_networks") or []
    stem, suffix = (model.name[:-3], ".pt") if model.name.endswith(".pt") else (model.name, "")
    files = [model.parent / f"{stem}-{name}{suffix}" for name in names]
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise UserError(f"{model} belongs to a run of {1 + len(names)} networks, but {missing[0]} is missing")
    return files
