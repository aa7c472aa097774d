"""Reading a Lightning checkpoint someone handed over without running code from it.

A ``.ckpt`` file is a pickle, and unpickling can call any function the file names
(``os.system``). treelit reads checkpoints with ``torch.load(weights_only=True)``:
tensors, containers and plain values only (a checkpoint treelit writes holds nothing
else), anything else refused before it is built. ``resume_from`` reads the file this
way first (its step and MLflow run), and Lightning's own restore is given
``weights_only=True`` too.

A sharded checkpoint (a directory, ``trainer=fsdp2*``) has more: ``meta.pt`` (read as
above), torch's distributed-checkpoint ``.metadata``, which torch's ``FileSystemReader``
reads with plain ``pickle.load`` whatever ``weights_only`` says, and the ``.distcp``
data files, whose non-tensor items (optimizer settings) torch's default load planner
reads with ``torch.load(weights_only=False)``. :func:`check_sharded_metadata` reads
``.metadata`` first with an unpickler that builds only torch's checkpoint-metadata
types and refuses any other global, then every non-tensor item with
``weights_only=True``, and requires every data file it names to lie in the directory;
a crafted file is refused, naming it, before torch reads it.

Before any of that, :func:`verify_checkpoint` checks the checkpoint against the manifest
treelit wrote with it (size and SHA-256 of every file, :mod:`treelit.utils.integrity`): a
truncated, altered or missing file is named in one line instead of surfacing as a
deserialization error from inside torch. A single-file checkpoint without a manifest
(written before treelit recorded manifests, or copied without it) is checked against the
CRC-32 each entry of its zip archive carries, and one warning says why it had none.
:func:`load_checkpoint` and :func:`check_sharded_metadata` run it first.
"""

from __future__ import annotations

import io
import logging
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any, Union

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only

from treelit.models.errors import CheckpointError
from treelit.utils.integrity import MANIFEST, MANIFEST_SUFFIX, verify
from treelit.utils.paths import confined, not_a_checkpoint

log = logging.getLogger(__name__)

__all__ = ["load_checkpoint", "check_sharded_metadata", "check_zip_entries", "verify_checkpoint"]


def verify_checkpoint(path: Union[str, Path], what: str = "resume_from") -> bool:
    """Check a checkpoint (a file, or a sharded directory) against its manifest; a
    :class:`CheckpointError` naming the first file that is missing, truncated or altered.
    False when it has no manifest (an older checkpoint: nothing to check against)."""
    return verify(path, what, error=CheckpointError) is not None


def _no_manifest(path: Path) -> str:
    """Why ``path`` has no manifest, as far as its folder tells."""
    if Path(f"{path}{MANIFEST_SUFFIX}.partial").is_file():
        return (f"its manifest {path.name}{MANIFEST_SUFFIX}.partial was never renamed into place: the run that wrote "
                "it was stopped between the two renames")
    return "none beside it: copied or moved without it, removed, or written before treelit recorded manifests"


def _unchecked(path: Path, what: str, crc: bool = False) -> None:
    if getattr(rank_zero_only, "rank", 0) == 0:  # one warning for a run, not one per process
        how = ("checked against the CRC-32s of its zip entries instead (damaged bytes are found; a consistent "
               "rewrite is not)" if crc else "its files are read unchecked")
        log.warning("%s: %s has no manifest (%s): %s", what, path, _no_manifest(path), how)


def check_zip_entries(path: Path, what: str) -> bool:
    """A checkpoint without a manifest, checked against the CRC-32 every entry of its zip
    archive carries (``torch.save`` writes one): a :class:`CheckpointError` naming the first
    entry that fails. False when the file is not a zip archive (nothing to check)."""
    if not zipfile.is_zipfile(path):
        return False
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise CheckpointError(f"{what}: {path} is damaged: its zip archive does not read ({exc}); it has no "
                              "manifest, so its entries' CRC-32s were checked") from None
    if bad is not None:
        raise CheckpointError(f"{what}: {path} is damaged: its entry {bad} fails its CRC-32 (it has no manifest, so "
                              "its entries' CRC-32s were checked)")
    return True


def _refusal(exc: BaseException) -> str:
    text = str(exc)
    m = re.search(r"Unsupported global: GLOBAL (\S+)", text)
    if m:
        return f"it names {m.group(1)}, which is not tensor or plain data"
    m = re.search(r"WeightsUnpickler error: ([^\n]+)", text)
    return m.group(1).strip() if m else (text.strip().splitlines() or [type(exc).__name__])[0]


def load_checkpoint(path: Union[str, Path], what: str = "resume_from") -> Any:
    """``torch.load(path, weights_only=True)`` on CPU (memory-mapped when the file is a zip
    archive). A file that names anything but tensors and plain data is refused with a
    :class:`CheckpointError` naming it; so is an unreadable one."""
    p = Path(path)
    inside = (p.parent / MANIFEST).is_file()  # a sharded checkpoint's meta.pt: checked with its folder
    verified = inside or verify_checkpoint(p, what)
    why = not_a_checkpoint(p)  # say what the file is not, before torch's loader has its say
    if why:
        raise CheckpointError(f"{what}: {p} is not a checkpoint: {why}")
    crc = not verified and check_zip_entries(p, what)
    try:
        try:
            loaded = torch.load(p, map_location="cpu", mmap=True, weights_only=True)
            if not verified:
                _unchecked(p, what, crc)
            return loaded
        except pickle.UnpicklingError:
            raise
        except Exception:  # not a zip archive (mmap needs one): a plain load says what is wrong
            loaded = torch.load(p, map_location="cpu", weights_only=True)
            if not verified:
                _unchecked(p, what, crc)
            return loaded
    except pickle.UnpicklingError as exc:
        if "Weights only load failed" in str(exc):
            raise CheckpointError(f"{what}: {p} is refused: {_refusal(exc)} (checkpoints are read as tensors and "
                                  "plain data only; code in them is never run)") from None
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{what}: {p} is not a readable Lightning checkpoint "
                              f"(truncated or not a checkpoint file: {why})") from None
    except Exception as exc:
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{what}: {p} is not a readable Lightning checkpoint "
                              f"(truncated or not a checkpoint file: {why})") from None


# what torch's distributed checkpoint writes into .metadata (torch 2.13): its metadata dataclasses,
# tensor sizes, dtypes, layouts and memory formats, the file name of each item
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if name in _METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which is not distributed-checkpoint metadata")


def check_sharded_metadata(directory: Union[str, Path], what: str = "resume_from") -> None:
    """Refuse a sharded checkpoint whose ``.metadata`` files name anything but torch's
    checkpoint-metadata types (torch reads them with plain ``pickle.load``)."""
    d = Path(directory)
    verified = verify_checkpoint(d, what)
    names = {f.name for f in d.glob("*.metadata")} | ({".metadata"} if (d / ".metadata").is_file() else set())
    for f in (d / name for name in sorted(names)):
        try:
            metadata = _MetadataUnpickler(io.BytesIO(f.read_bytes())).load()
            items = metadata.state_dict_metadata
            storage = dict(metadata.storage_data or {})
        except pickle.UnpicklingError as exc:
            raise CheckpointError(f"{what}: {f} is refused: {exc} (it would run code when torch reads it)") from None
        except Exception as exc:
            raise CheckpointError(f"{what}: {f} is not readable distributed-checkpoint metadata "
                                  f"({type(exc).__name__}: {exc})") from None
        _check_byte_items(d, f, items, storage, what)
    if not verified:
        _unchecked(d, what)


def _check_byte_items(d: Path, metadata_file: Path, items: Any, storage: Any, what: str) -> None:
    """Each data file ``storage`` names lies in ``d``; each non-tensor item loads weights-only."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata  # heavy (~1 s CPU): sharded checkpoints only

    for index, info in storage.items():
        data = confined(d, info.relative_path, f"{what}: {metadata_file}: data file", error=CheckpointError)
        if not isinstance(items.get(index.fqn), BytesStorageMetadata):
            continue  # a tensor: torch reads it weights-only
        where = f"{what}: {data}: item {index.fqn!r}"
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{where} is stored transformed ({', '.join(info.transform_descriptors)}); "
                                  "treelit cannot check it before torch unpickles it")
        try:
            with open(data, "rb") as fh:
                fh.seek(int(info.offset))
                raw = fh.read(int(info.length))
            torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            if "Weights only load failed" in str(exc):
                raise CheckpointError(f"{where} is refused: {_refusal(exc)} (torch would unpickle it with "
                                      "weights_only=False)") from None
            raise CheckpointError(f"{where} is not readable ({type(exc).__name__}: {exc})") from None
        except Exception as exc:
            raise CheckpointError(f"{where} is not readable ({type(exc).__name__}: "
                                  f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''})") from None
