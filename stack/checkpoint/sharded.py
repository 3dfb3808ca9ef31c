"""Training checkpoints through torch.distributed.checkpoint (DCP), written while training runs on.

One format and one code path for 1 rank, DDP and FSDP2 — Lightning's distributed-checkpoint
layout (`ModelParallelStrategy`): a folder `step-NNNNNNN.ckpt/` holding DCP shards of
`{"state_dict", "optimizer_0", …}` (`__R_0.distcp`, one per rank that owns data; a tensor
replicated across DDP ranks is written once, from the lowest rank: rank 0's BatchNorm statistics
are the ones DDP broadcasts at the next forward, so resume continues exactly), DCP's `.metadata`, and `meta.pt` with the rest of
Lightning's checkpoint (loops, LR schedule, callbacks such as the loader position, RNG, pipeline).

Asynchronous save (`dcp.async_save`, as torchtitan's `CheckpointManager` does): the training
thread only stages the state (a copy into CPU buffers reused from one checkpoint to the next)
and returns; a background thread writes the
shards, DCP's `.metadata` last (itself written to a temporary name and renamed), every file
fsync'd. Only then does rank 0 rename the folder from `.step-….ckpt.partial` into place, point
`latest` at it (an atomic rename) and prune older checkpoints. A SIGKILL at any instant therefore
leaves `latest` naming a complete checkpoint. One write is in flight at a time: the next save (or
`wait`) first waits for it. The background writes use their own gloo process group, so their
collectives never interleave with the training step's (torchtitan does the same).

Reading never unpickles code: DCP's `.metadata` is a pickle, read here through an unpickler that
admits only DCP's metadata classes and torch sizes/dtypes; non-tensor items (optimizer
param_groups) and `meta.pt` are loaded with `weights_only=True`.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from stack.durable import fsync_dir, write_durably
from stack.errors import StackError
from stack.failpoints import fail_point

LATEST = "latest"
META = "meta.pt"
TENSOR_KEYS = ("state_dict", "optimizer_states")
"""What goes into the DCP shards; everything else of Lightning's checkpoint goes into meta.pt."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:07d}.ckpt"


def split_checkpoint(checkpoint: dict) -> tuple[dict, bytes]:
    """Lightning's checkpoint dict -> (the tensors for DCP, the rest serialized now, while it is still this step's)."""
    rest = dict(checkpoint)
    tensors = {"state_dict": rest.pop("state_dict")}
    tensors.update({f"optimizer_{i}": state for i, state in enumerate(rest.pop("optimizer_states", []))})
    buffer = io.BytesIO()
    torch.save(rest, buffer)
    return tensors, buffer.getvalue()


class _FencedWriter(dcp.FileSystemWriter):
    """DCP's file writer with a fail point after every shard is written and before `.metadata` (the last file)."""

    def finish(self, metadata, results) -> None:
        fail_point("checkpoint-write")
        super().finish(metadata, results)


class ReusedBufferStager(AsyncStager):
    """Stages the state into CPU buffers kept from the previous checkpoint (pinned where CUDA is present), as
    torchtitan's `async_with_pinned_mem` mode does. DCP's default stager allocates fresh memory every time, and
    on a CPU the first touch of every new page costs more than the copy itself. Safe because one write is in
    flight at a time: the buffers are overwritten only after the previous write has finished reading them.
    Costs one copy of the training state in host memory for the whole run."""

    _synchronize_after_execute = False

    def __init__(self):
        self._buffers, self._layout = None, None

    def stage(self, state_dict: dict, **kwargs) -> dict:
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        layout = _tensor_layout(state_dict)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # memory-bound copies; an OpenMP team on a busy machine waits for its slowest thread
        try:
            if layout != self._layout:  # first checkpoint, or the state changed shape (new optimizer state)
                self._buffers = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
                self._layout = layout
            return _copy_state_dict(state_dict, self._buffers)
        finally:
            torch.set_num_threads(threads)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self._buffers, self._layout = None, None


def _tensor_layout(tree, prefix: str = "") -> tuple:
    """(path, shape, dtype) of every tensor in a nested dict/list: equal layouts can share staging buffers."""
    if isinstance(tree, dict):
        return tuple(item for key, value in tree.items() for item in _tensor_layout(value, f"{prefix}/{key}"))
    if isinstance(tree, (list, tuple)):
        return tuple(item for i, value in enumerate(tree) for item in _tensor_layout(value, f"{prefix}/{i}"))
    if isinstance(tree, torch.Tensor):
        local = tree.to_local() if hasattr(tree, "to_local") else tree
        return ((prefix, tuple(local.shape), local.dtype),)
    return ()


class AsyncCheckpointWriter:
    """Writes checkpoints into `directory` in the background, one at a time; rank 0 commits each one as `latest`."""

    def __init__(self, directory: Path, keep: int):
        self.directory, self.keep = Path(directory), keep
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-commit")
        self._pending: tuple[Future, Path] | None = None
        self._group = None
        self._stager = ReusedBufferStager()

    def use_own_process_group(self) -> None:
        """Give the background writes a gloo group of their own (collective: every rank calls it once)."""
        if self._group is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo")

    def clear_partial(self, step: int) -> None:
        """Rank 0, before a save: remove what a crashed earlier write of this step left."""
        self.directory.mkdir(parents=True, exist_ok=True)
        _remove(self.directory / f".{checkpoint_name(step)}.partial")

    def start(self, checkpoint: dict, step: int, rank_zero: bool) -> Path:
        """Stage `checkpoint` (Lightning's dict) and write it in the background; returns its final path."""
        self.wait()
        final = self.directory / checkpoint_name(step)
        temp = self.directory / f".{final.name}.partial"
        tensors, meta = split_checkpoint(checkpoint)
        no_dist = not (dist.is_available() and dist.is_initialized())
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
        upload = dcp.async_save(tensors, storage_writer=_FencedWriter(temp, sync_files=True),
                                process_group=self._group, no_dist=no_dist, async_stager=self._stager,
                                planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True))
        job = self._executor.submit(self._finish, upload, temp, final, meta if rank_zero else None)
        self._pending = (job, final)
        return final

    def wait(self, raise_errors: bool = True) -> Path | None:
        """Block until the write in flight (if any) is complete; returns its path, or None if there was none
        (or it failed and `raise_errors` is False). Interrupted (Ctrl-C), the write stays pending for the next wait."""
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

        if self._pending is None:
            return None
        job, final = self._pending
        try:
            job.result()
        except (Exception, CheckpointException) as exc:
            self._pending = None
            if raise_errors:
                raise CheckpointWriteFailed(
                    f"checkpoint {final} could not be written ({type(exc).__name__}: {first_line(exc)}); "
                    f"checkpoints/{LATEST} still names the previous complete one. Free disk space or fix the "
                    "folder's permissions, then resume from it") from exc
            return None
        self._pending = None
        return final

    def _finish(self, upload: Future, temp: Path, final: Path, meta: bytes | None) -> None:
        """Background: wait for DCP's write, then (rank 0) make the checkpoint durable and `latest`."""
        if meta is not None:
            temp.mkdir(parents=True, exist_ok=True)
            write_durably(temp / META, meta)
        upload.result()
        if meta is not None:
            self._commit(temp, final)

    def _commit(self, temp: Path, final: Path) -> None:
        fsync_dir(temp)
        fail_point("checkpoint-commit")
        _remove(final)
        os.replace(temp, final)
        fsync_dir(self.directory)
        write_atomically(self.directory / LATEST, final.name + "\n")
        self._prune(final)
        fail_point("checkpoint-committed")

    def _prune(self, newest: Path) -> None:
        done = sorted(p for p in self.directory.glob("step-*.ckpt") if p != newest)
        for old in done[: max(0, len(done) - (self.keep - 1))]:
            _remove(old)


class CheckpointWriteFailed(StackError):
    """A background checkpoint write failed (disk full, permissions); the previous checkpoint stays `latest`."""


def write_atomically(path: Path, text: str) -> None:
    temp = path.with_name(f".{path.name}.partial")
    write_durably(temp, text.encode())
    os.replace(temp, path)
    fsync_dir(path.parent)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


# ---------------------------------------------------------------- reading

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_METADATA_CLASSES = frozenset({
    (_DCP_METADATA, "Metadata"), (_DCP_METADATA, "StorageMeta"), (_DCP_METADATA, "MetadataIndex"),
    (_DCP_METADATA, "TensorStorageMetadata"), (_DCP_METADATA, "BytesStorageMetadata"),
    (_DCP_METADATA, "ChunkStorageMetadata"), (_DCP_METADATA, "TensorProperties"),
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
    ("collections", "OrderedDict"),
})
"""Every global a `.metadata` written by DCP names: plain data classes (no reader, writer, stager, planner or
file system), torch sizes and layouts, and the checkpoint's own path."""
_DTYPE_NAMES = frozenset(name for name, value in vars(torch).items() if isinstance(value, torch.dtype))


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a pickle: admit only the globals in `_METADATA_CLASSES` and torch dtypes.

    The name is checked before anything is imported or fetched: importing a module runs its top-level code,
    so a pickle naming `this` or a module of DCP's own (a stager, an fsspec reader) must stop at its name."""

    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_CLASSES or (module == "torch" and name in _DTYPE_NAMES):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


class _SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        with open(Path(self.path) / ".metadata", "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
        _check_storage_files(metadata)
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _check_storage_files(metadata) -> None:
    """Every shard `.metadata` names is a plain file name in the checkpoint's own folder: a name such as
    `../../home/you/.ssh/id_rsa` would read a file from elsewhere into the weights."""
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise pickle.UnpicklingError(f"the metadata is a {type(metadata).__name__}, not DCP's Metadata")
    for info in metadata.storage_data.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not name or name != os.path.basename(name) or name in (".", ".."):
            raise pickle.UnpicklingError(f"a shard is named {name!r}, not a file name inside the checkpoint folder")


class _SafeFullLoadPlanner(_EmptyStateDictLoadPlanner):
    """Loads every item at its full size (any number of shards -> one tensor), non-tensors weights-only."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._nested_dict import set_element

        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn],
                    torch.load(value, weights_only=True))


def load_sharded_checkpoint(path: Path) -> dict:
    """The full Lightning checkpoint dict of the folder at `path` (every tensor whole, on CPU) — in this process
    alone, whatever the number of ranks that wrote it."""
    path = Path(path)
    state = torch.load(path / META, map_location="cpu", weights_only=True)
    # read (and check) the metadata once before DCP does: DCP catches a failure to read it, logs it with its
    # traceback on the root logger, retries, and only then raises, so a bad file printed two tracebacks
    _SafeReader(path).read_metadata()
    tensors: dict = {}
    _load_state_dict(tensors, storage_reader=_SafeReader(path), planner=_SafeFullLoadPlanner(), no_dist=True)
    state["state_dict"] = tensors.pop("state_dict")
    count = sum(1 for key in tensors if key.startswith("optimizer_"))
    state["optimizer_states"] = [_integer_parameter_ids(tensors[f"optimizer_{i}"]) for i in range(count)]
    return state


def _integer_parameter_ids(optimizer_state: dict) -> dict:
    """DCP stores keys as strings; `Optimizer.load_state_dict` matches parameters by integer id (and would
    silently drop state keyed "0", "1", …). FSDP2's optimizer state is keyed by parameter name: left as is."""
    per_parameter = optimizer_state.get("state", {})
    if per_parameter and all(isinstance(key, str) and key.isdigit() for key in per_parameter):
        optimizer_state["state"] = {int(key): value for key, value in per_parameter.items()}
    return optimizer_state


def first_line(exc: BaseException) -> str:
    """The root cause's first line (DCP wraps each rank's failure in a CheckpointException)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException) and exc.failures:
        exc = next(iter(exc.failures.values()))
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def read_checkpoint_safely(path: Path) -> dict:
    """`load_sharded_checkpoint`, with any failure to read it (truncated, garbage, a pickle naming code)
    turned into a StackError naming the checkpoint."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    try:
        return load_sharded_checkpoint(path)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - any failure to read is the same answer
        detail = first_line(exc)
        raise StackError(f"train.resume: {path} is not a readable training checkpoint ({detail[:300]}); it is "
                         "truncated, corrupt or not written by `stack train`. Resume from another checkpoint in "
                         "its folder, or start fresh without train.resume") from exc
