"""What an encoder backend is, and the one registry that dispatches to backends.

A backend is one registered `Backend` class: it names the modalities it encodes, its default
model, its aliases and how `auto` recognises its models, and it builds both the frozen
`Estimator` (scoring, beta, online OSA) and the trainable `Target` (`pairclean train`,
retrieval evaluation) of one model. `check_backend`, `resolve_backend`, `build_estimator`,
`load_target` and `load_exported` are the only places that choose a backend. Helpers every backend shares (device,
precision, autocast, checkpoint hashes, random texts for beta) live here, so backend modules
import this one and never each other.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import os
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, ClassVar, Protocol

import torch

from pairclean.config import check_choice
from pairclean.errors import ConfigError, UserError
from pairclean.ops.notices import notice_once
from pairclean.ops.records import JsonObject, Keyed

PRECISIONS = ("fp32", "bf16", "fp16")
FALLBACK_BACKEND = "open_clip"  # what `auto` picks when no backend recognises the model (and the pairs hold images)
TEXT_FALLBACK_BACKEND = "sentence-transformers"  # ... when the pairs are text only: a hub or cached sentence model


class Preparer(Protocol):
    """Runs in DataLoader workers (so it must pickle): decode + preprocess images, tokenise texts.
    Optional: `prepare_many(modality, values)`, `prepare_each`'s answer where a preparer does a
    list of values faster than one at a time."""

    def prepare(self, modality: str, value: Any) -> Any: ...
    def collate(self, modality: str, items: list) -> Any: ...


def prepare_each(preparer: Preparer, modality: str, values: list) -> list:
    """`preparer.prepare` of each value, in order, the exception it raised in place of a failed
    value's item (its `prepare_many` where it has one)."""
    many = getattr(preparer, "prepare_many", None)
    if many is not None:
        return many(modality, values)
    return [attempted(functools.partial(preparer.prepare, modality), value) for value in values]


def attempted(step: Callable[[Any], Any], value: Any) -> Any:
    """`step(value)`, or the exception it raised: a bad item becomes an error row, never a dead worker."""
    try:
        return step(value)
    except Exception as exc:
        return exc


class Estimator(Protocol):
    """A frozen dual encoder that maps each side of a pair to unit vectors."""

    device: torch.device
    precision: str
    preparer: Preparer
    model: torch.nn.Module  # the weights: the beta cache fingerprints them, training copies them
    random_init: bool  # the weights were drawn at random (`pretrained` none), not learned

    def finish_batch(self, modality: str, inputs: Any) -> tuple[Any, Keyed[int, str]]:
        """Device preprocessing of one side of a collated batch on the device (JPEGs left for the
        device decoded, resized, cropped); {row: reason} for rows that could not be."""
        ...

    def encode(self, modality: str, batch: Any) -> torch.Tensor:
        """Unit vectors of a batch (uint8 pixels are normalised on the device first)."""
        ...
    def random_batch(self, modality: str, n: int, generator: torch.Generator) -> Any: ...
    def provenance(self) -> JsonObject: ...

    def input_signature(self) -> tuple | None:
        """What the prepared inputs depend on; two estimators with the same signature (not None)
        take the same collated batches, so a second one needs no preparer of its own."""
        ...


class Target(Protocol):
    """A dual encoder under training: what the trainer, the loss and retrieval evaluation use.
    Optional: `loop_preparer`, what the training loop's own loader prepares with where it differs
    from `preparer` (JPEGs left for the device, which `estimator.finish_batch` decodes)."""

    backend: str
    device: torch.device
    preparer: Preparer
    module: torch.nn.Module  # the trained weights (optimiser, DDP, checkpoints)
    estimator: Estimator  # the estimator around `module`: its preparer and input signature

    def encode(self, modality: str, batch: Any) -> torch.Tensor: ...
    def logit_scale(self) -> torch.Tensor: ...
    def frozen_estimator(self) -> Estimator: ...
    def export(self, path: Path) -> Path: ...
    def describe(self) -> JsonObject: ...


class Backend:
    """One encoder family. Subclass, fill in the class attributes, and decorate with `register_backend`."""

    name: ClassVar[str]
    modalities: ClassVar[tuple[str, ...]]
    default_model: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    export_suffix: ClassVar[str] = ".pt"  # what the target's export adds to a model's name ("": a directory)
    # How its estimators compute at bf16/fp16, pinned in a run's settings: a resumed run computes alike.
    # "autocast": fp32 weights under torch.autocast; "stored": weights stored in the low precision.
    low_precision: ClassVar[str] = "autocast"
    decodes_images: ClassVar[bool] = False  # its `target` takes `decode` (fast, exact, a device decoder)

    @classmethod
    def detects(cls, model: str) -> bool:
        """Whether `--backend auto` should choose this backend for `model`."""
        return False

    @classmethod
    def check_model(cls, model: str, pretrained: str | None) -> None:
        """Refuse, before anything loads, a model or weights this backend cannot have (the cheap
        checks: names it knows; nothing is fetched). Nothing to check by default."""

    @classmethod
    def estimator(cls, model: str, **options) -> Estimator:
        """The frozen estimator; options: pretrained, device, precision, decode, compile, cpu_decode_share."""
        raise UserError(f"the {cls.name} backend builds no estimator (it cannot score)")

    @classmethod
    def target(cls, model: str, pretrained: str, device: str, temperature: float | None) -> Target:
        """The trainable target (temperature None: the backend's own; with `decodes_images`, also
        `decode`: how its training loop's JPEGs are decoded)."""
        raise UserError(f"the {cls.name} backend builds no training target (it cannot be trained)")

    @classmethod
    def exported(cls, description: dict, weights: Path, device: str) -> Target:
        """The target a `pairclean train` run exported to `weights`, from the run's `target` description."""
        raise UserError(f"the {cls.name} backend reloads no trained model")


BACKENDS: dict[str, type[Backend]] = {}


def register_backend(cls: type[Backend]) -> type[Backend]:
    BACKENDS[cls.name] = cls
    return cls


def _canonical(backend: str) -> str | None:
    if backend in BACKENDS:
        return backend
    return next((name for name, cls in BACKENDS.items() if backend in cls.aliases), None)


def check_backend(backend: str, needed: tuple[str, ...] = ()) -> str:
    """The canonical backend name; UserError if unknown or if it cannot encode a needed modality."""
    name = _canonical(backend)
    if name is None:
        check_choice(backend, tuple(BACKENDS), "backend")  # refuses: not a name, not an alias
    encodes = BACKENDS[name].modalities
    missing = [m for m in dict.fromkeys(needed) if m not in encodes]
    if missing:
        from pairclean.data.spec import PAIR_KINDS, modalities

        kinds = [k for k in PAIR_KINDS if set(modalities(k)) <= set(encodes)]
        raise ConfigError(f"the {name} backend cannot encode {', '.join(missing)}: it encodes {', '.join(encodes)} "
                          f"only; for data it can score set pair to {' or '.join(kinds)}", "pair")
    return name


def detect_backend(model: str | None, needed: tuple[str, ...] = ()) -> str:
    """The backend that recognises `model` (an open_clip name, a sentence-transformers directory or
    bundled name, ...); a name none recognises is a sentence-transformers model (from the hub or its
    cache) when the pairs are text only (`needed`), else an open_clip one (which then says it is
    unknown). No model: the fallback backend's default model."""
    if model is None:
        return FALLBACK_BACKEND
    found = next((name for name, cls in BACKENDS.items() if cls.detects(model)), None)
    if found is not None:
        return found
    return TEXT_FALLBACK_BACKEND if needed and set(needed) == {"text"} else FALLBACK_BACKEND


def resolve_backend(backend: str, model: str | None, needed: tuple[str, ...] = ()) -> str:
    """check_backend, with `auto` chosen from the model and the modalities the pairs need."""
    return check_backend(detect_backend(model, needed) if backend == "auto" else backend, needed)


def default_model(backend: str) -> str:
    return BACKENDS[check_backend(backend)].default_model


def check_model(backend: str, model: str | None, pretrained: str | None = None) -> None:
    """The backend's `check_model` for `model` (None: its default model)."""
    cls = BACKENDS[check_backend(backend)]
    cls.check_model(model or cls.default_model, pretrained)


def build_estimator(backend: str = FALLBACK_BACKEND, model: str | None = None, **options) -> Estimator:
    """The frozen estimator of `model` (None: the backend's default model)."""
    cls = BACKENDS[check_backend(backend)]
    return cls.estimator(model or cls.default_model, **options)


def load_target(model: str, pretrained: str | None = "none", backend: str = "auto", device: str = "auto",
                temperature: float | None = None, needed: tuple[str, ...] = (), decode: str = "fast") -> Target:
    """The model to train; `auto` recognises the backend from the model (and the modalities `needed`).
    `pretrained` None: the model's own weights (see the backend)."""
    if temperature is not None and temperature <= 0:
        raise ConfigError("temperature must be positive", "temperature")
    cls = BACKENDS[resolve_backend(backend, model, needed)]
    options = {"decode": decode} if cls.decodes_images else {}  # a backend reading no images has nothing to decode
    return cls.target(model, pretrained, device, temperature, **options)


def load_exported(description: dict, weights: str | os.PathLike, device: str = "auto") -> Target:
    """A model `pairclean train` exported, by the backend its run recorded."""
    return BACKENDS[check_backend(description["backend"])].exported(description, Path(weights), device)


def export_name(stem: str, backend: str) -> str:
    """The file or directory name the backend's target exports a model called `stem` to."""
    return stem + BACKENDS[check_backend(backend)].export_suffix


# ---------------------------------------------------------------- shared by the backends

def pick_device(requested: str = "auto") -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except RuntimeError as exc:
        raise UserError(f"unknown device {requested!r}: {exc}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {requested} requested but CUDA is not available")
    return device


def autocast_context(device: torch.device, precision: str):
    """Autocast for bf16/fp16; fp16 only on CUDA (CPU fp16 matmuls are slow and lossy)."""
    check_choice(precision, PRECISIONS, "precision")
    if precision == "fp32":
        return nullcontext()
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError("precision fp16 needs a CUDA device; use bf16 or fp32 on CPU", "precision")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def cpu_bf16_native() -> bool:
    """True when this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX): bf16 autocast then
    beats fp32; elsewhere oneDNN emulates it, usually slower than fp32."""
    try:
        with open("/proc/cpuinfo") as fh:
            flags = next((line for line in fh if line.startswith("flags")), "").split()
        if flags:
            return "avx512_bf16" in flags or "amx_bf16" in flags
    except OSError:
        pass
    try:  # not Linux: oneDNN's own check (true on some CPUs that only emulate bf16)
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_precision(device: str | torch.device, precision: str) -> str:
    """`auto` -> the fastest safe precision here: bf16 (or fp16) on CUDA, bf16 on CPUs with native
    bf16, fp32 otherwise. Explicit choices pass through, with a notice when bf16 is emulated."""
    device = device if isinstance(device, torch.device) else pick_device(device)
    if precision == "auto":
        if device.type == "cuda":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return "bf16" if device.type == "cpu" and cpu_bf16_native() else "fp32"
    autocast_context(device, precision)  # UserError for unknown / impossible combinations
    if precision == "bf16" and device.type == "cpu" and not cpu_bf16_native():
        notice_once("bf16-emulated", "this CPU has no native bf16 (AVX512-BF16/AMX): precision bf16 is emulated "
                                     "and probably slower than fp32", "precision")
    return precision


_DIGESTS: dict[tuple[str, int, int], str] = {}  # (resolved path, size, mtime_ns) -> sha256


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """sha256 of a file, read once per process: a run pins a checkpoint's hash in its settings and
    names it in the provenance, and a file changed in between (other size or mtime) is read again."""
    stat = os.stat(path)
    key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
    if key not in _DIGESTS:
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            while block := fh.read(chunk):
                digest.update(block)
        _DIGESTS[key] = digest.hexdigest()
    return _DIGESTS[key]


def random_vocabulary_texts(words: list[str], n: int, generator: torch.Generator, max_words: int = 15) -> list[str]:
    """n random texts of 1..max_words vocabulary entries: beta's random inputs for Hugging Face tokenizers."""
    lengths = torch.randint(1, max_words + 1, (n,), generator=generator)
    return [" ".join(words[i] for i in torch.randint(0, len(words), (int(k),), generator=generator)) for k in lengths]


def move_batch(batch: Any, device: torch.device) -> Any:
    """A collated batch (a tensor, a dict of tensors, or a record with `to`, such as an
    ImageBatch) on `device`, copied asynchronously from page-locked memory."""
    if isinstance(batch, dict):
        return {k: move_batch(v, device) for k, v in batch.items()}
    return batch.to(device, non_blocking=True) if hasattr(batch, "to") else batch


def host_values(values, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Values computed on the host (row indices, image sizes) as a tensor on `device`, without
    waiting for it: `torch.tensor(values, device=cuda)` copies with a stream synchronisation, so the
    host would wait for all the work queued before it (a batch's decode, the model on the batch
    before). A copy from pageable memory is staged by the driver before the call returns, so the
    temporary host tensor may go at once."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def frozen_copy(estimator: Estimator, module: torch.nn.Module) -> Estimator:
    """The estimator around a frozen copy of `module` as it is now (the official OSA code's online estimator)."""
    frozen = copy.copy(estimator)
    frozen.model = copy.deepcopy(module).eval().requires_grad_(False)
    return frozen
