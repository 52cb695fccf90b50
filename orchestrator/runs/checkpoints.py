"""Where a run's epoch checkpoints live, which is the newest, and whether a file is one: checked
without torch (``spotswarm check`` reads a run without importing it), as tensors and plain values
only, so a file from an object store or a shared disk runs no code when it is looked at.  Reading
and writing the tensors themselves is ``checkpoint_io.py``'s."""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path
from typing import Any

from orchestrator.config.schema import ClusterConfig

PATTERN = "epoch-*.pt"

# what torch.save writes for tensors, parameters and plain containers; anything else is refused
_CONTAINERS = {("collections", "OrderedDict"), ("torch", "Size"), ("torch", "device")}
_BUILTINS = {"set", "frozenset", "bytearray", "slice", "complex"}
_PY2_NAMES = {"__builtin__": "builtins", "copy_reg": "copyreg"}


def checkpoint_directory(config: ClusterConfig, run_dir: Path) -> Path:
    """Where a run's epoch checkpoints go: ``checkpoint.directory``, else the run directory's own."""
    return Path(config.checkpoint.directory or Path(run_dir) / "checkpoints")


def checkpoint_path(directory: Path, epoch: int) -> Path:
    return Path(directory) / f"epoch-{epoch:06d}.pt"


def checkpoint_files(directory: Path) -> list[tuple[int, Path]]:
    """The epoch checkpoints in ``directory``, oldest first."""
    files = [(int(f.stem[6:]), f) for f in Path(directory).glob(PATTERN) if f.stem[6:].isdigit()]
    return sorted(files)


def prune_checkpoints(directory: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints."""
    for _, old in checkpoint_files(directory)[:-keep]:
        old.unlink(missing_ok=True)


def _allowed(module: str, name: str) -> bool:
    if (module, name) in _CONTAINERS or (module == "builtins" and name in _BUILTINS):
        return True
    if module == "torch._utils" and name.startswith("_rebuild_"):
        return True
    if module in ("torch", "torch.storage") and (name.endswith("Storage") or name in _DTYPES):
        return True
    return False


_DTYPES = {"float16", "bfloat16", "float32", "float64", "uint8", "int8", "int16", "int32", "int64", "bool",
           "complex64", "complex128", "float", "double", "half", "long", "int", "short"}


class _Stub:
    """What a tensor, storage or container unpickles to here: its arguments, never its code."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __setitem__(self, key: Any, value: Any) -> None:  # an OrderedDict's items
        pass


class _Inspector(pickle.Unpickler):
    def __init__(self, data: bytes, storages: set[str]) -> None:
        super().__init__(io.BytesIO(data))
        self.storages = storages

    def find_class(self, module: str, name: str) -> Any:
        module = _PY2_NAMES.get(module, module)  # torch.save writes protocol 2, which names them so
        if not _allowed(module, name):
            raise pickle.UnpicklingError(f"refers to {module}.{name}, which is not a tensor or a plain value")
        return _Stub

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        if str(pid[2]) not in self.storages:
            raise pickle.UnpicklingError(f"tensor storage {pid[2]} is missing")
        return _Stub()


def checkpoint_epoch(path: Path) -> int:
    """The epoch a checkpoint file holds, once it is found whole (every member's CRC) and made only of
    tensors and plain values.  ValueError says why a file is refused."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
            if bad is not None:
                raise ValueError(f"{bad} is damaged")
            names = archive.namelist()
            pickles = [n for n in names if n.endswith("/data.pkl")]
            if len(pickles) != 1:
                raise ValueError("no data.pkl in it")
            prefix = pickles[0][: -len("data.pkl")] + "data/"
            storages = {n[len(prefix):] for n in names if n.startswith(prefix)}
            data = _Inspector(archive.read(pickles[0]), storages).load()
        if not isinstance(data, dict) or "state" not in data or not isinstance(data.get("epoch"), int):
            raise ValueError("it is not a mapping with an integer 'epoch' and a 'state'")
        return data["epoch"]
    except Exception as e:  # noqa: BLE001 - a file is refused in many ways, each a bad file
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(f"checkpoint {path} cannot be read as tensors and plain values "
                         f"({type(e).__name__}: {first[:300]})") from None
