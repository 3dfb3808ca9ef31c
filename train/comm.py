"""Bytes each rank sends in collectives, measured at the calls (not computed from the model).

`CommBytes` wraps the `torch.distributed` collectives that FSDP2, DDP's default
communication hook and Lightning go through (`all_gather_single`,
`all_gather_into_tensor`, `reduce_scatter_single`, `reduce_scatter_tensor`,
`all_reduce`) and, while `counting`, records each call's tensor size, dtype and
group size. DDP's gradient buckets are all-reduced in C++ unless a communication
hook is registered, so `count_ddp` registers torch's default all-reduce hook, which
calls `dist.all_reduce` and is counted like the rest.

"Sent" is what this rank puts on the wire under the ring algorithms NCCL and gloo
use for these collectives (Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms
for clusters of workstations", JPDC 2009): an all-gather or reduce-scatter over `n`
ranks sends (n-1)/n of the full tensor, an all-reduce twice that. A group of one
rank sends nothing.

`WireBytes` counts the same traffic where it leaves the process: the kernel's per-connection
count of TCP payload bytes sent (`tcp_info.tcpi_bytes_sent`, Linux >= 4.19) summed over this
process's TCP connections, less those of the rendezvous store (MASTER_PORT), and less the bytes
sent again (`tcpi_bytes_retrans`), counted apart: a retransmission carries nothing new. On a busy
two-core machine the kernel's tail loss probe (RFC 8985) resends a connection's last segment when
the peer's ACK is late, and a whole segment (seen: 20 KiB in one step on loopback) would otherwise
read as traffic the collectives made. It sees what gloo
puts on the wire (each byte once); NCCL over NVLink or InfiniBand bypasses TCP, so on GPUs it reads nothing and
the counts at the calls are what there is. Measured with it (2 and 3 ranks, torch 2.14 gloo): an
all-gather and an all-reduce send exactly what the ring algorithm above says; a reduce-scatter
sends as much as an all-reduce of the same input, twice the ring figure (gloo reduces the whole
tensor everywhere and keeps a shard), so FSDP2 on CPU ranks sends more than its NCCL floor.
"""

from __future__ import annotations

import functools
import os
import socket
import struct
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

# name -> (kind, positional index and keyword of the full-size tensor, positional index of `group`)
_COLLECTIVES = {
    "all_gather_single": ("all_gather", 0, "output_tensor", 2),
    "all_gather_into_tensor": ("all_gather", 0, "output_tensor", 2),
    "reduce_scatter_single": ("reduce_scatter", 1, "input", 3),
    "reduce_scatter_tensor": ("reduce_scatter", 1, "input", 3),
    "all_reduce": ("all_reduce", 0, "tensor", 2),
}
_RING_FACTOR = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0}
_active: list["CommBytes"] = []
_originals: dict = {}


class CommBytes:
    """Per-collective byte counts of this rank while `counting` is True."""

    def __init__(self):
        self.counting = False
        self.calls: dict[tuple[str, str], int] = defaultdict(int)  # (kind, dtype) -> calls
        self.payload: dict[tuple[str, str], int] = defaultdict(int)  # (kind, dtype) -> full-tensor bytes
        self.sent: dict[tuple[str, str], float] = defaultdict(float)  # (kind, dtype) -> bytes sent (ring)
        _install()
        _active.append(self)

    def close(self) -> None:
        if self in _active:
            _active.remove(self)

    def record(self, kind: str, tensor: torch.Tensor, group) -> None:
        ranks = dist.get_world_size(group) if group is not None else dist.get_world_size()
        key = (kind, str(tensor.dtype).removeprefix("torch."))
        self.calls[key] += 1
        self.payload[key] += tensor.nbytes
        self.sent[key] += _RING_FACTOR[kind] * tensor.nbytes * (ranks - 1) / ranks

    def sent_bytes(self, kind: str | None = None) -> float:
        return sum(v for (k, _), v in self.sent.items() if kind is None or k == kind)

    def summary(self, steps: int = 1) -> dict:
        """{"all_gather/bfloat16": {"calls", "payload_mb", "sent_mb"}, ...} per step."""
        return {f"{k}/{d}": {"calls": self.calls[(k, d)] / steps, "payload_mb": self.payload[(k, d)] / steps / 2**20,
                             "sent_mb": self.sent[(k, d)] / steps / 2**20} for k, d in sorted(self.calls)}

    def reset(self) -> None:
        self.calls.clear()
        self.payload.clear()
        self.sent.clear()


def _install() -> None:
    """Wrap the collectives once per process; the wrappers cost a dict update per call."""
    for name, (kind, index, keyword, group_index) in _COLLECTIVES.items():
        if name in _originals or not hasattr(dist, name):
            continue
        original = _originals[name] = getattr(dist, name)
        setattr(dist, name, _counted(original, kind, index, keyword, group_index))


def _counted(original, kind: str, index: int, keyword: str, group_index: int):
    @functools.wraps(original)
    def call(*args, **kwargs):
        if any(counter.counting for counter in _active):
            tensor = args[index] if len(args) > index else kwargs[keyword]
            group = args[group_index] if len(args) > group_index else kwargs.get("group")
            for counter in _active:
                if counter.counting:
                    counter.record(kind, tensor, group)
        return original(*args, **kwargs)
    return call


def count_ddp(model) -> bool:
    """Route a DistributedDataParallel model's gradient all-reduce through `dist.all_reduce` (counted).

    Registers torch's default all-reduce hook, which does what DDP's built-in reducer does
    (divide by the world size, all-reduce the bucket). Returns False for any other model."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return False
    model.register_comm_hook(state=None, hook=default_hooks.allreduce_hook)
    return True


_TCP_INFO_BYTES_SENT = 200
"""Byte offset of `tcpi_bytes_sent` (u64) in Linux's `struct tcp_info` (include/uapi/linux/tcp.h, since 4.19);
`tcpi_bytes_retrans` (u64, the same kernel) follows it."""
_TCP_INFO_LENGTH = _TCP_INFO_BYTES_SENT + 16


@dataclass(frozen=True)
class WireCount:
    """TCP bytes sent: `payload` each byte once, `retransmitted` the bytes sent again (loss, or a late ACK)."""

    payload: int
    retransmitted: int

    def __add__(self, other: WireCount) -> WireCount:
        return WireCount(self.payload + other.payload, self.retransmitted + other.retransmitted)

    def __sub__(self, other: WireCount) -> WireCount:
        return WireCount(self.payload - other.payload, self.retransmitted - other.retransmitted)


def wire_count(tcp_info: bytes) -> WireCount | None:
    """The sent and retransmitted byte counts in a `getsockopt(TCP_INFO)` answer; None if it is too short to hold
    them (a kernel older than 4.19)."""
    if len(tcp_info) < _TCP_INFO_LENGTH:
        return None
    sent, retransmitted = struct.unpack_from("QQ", tcp_info, _TCP_INFO_BYTES_SENT)
    return WireCount(sent - retransmitted, retransmitted)


class WireBytes:
    """TCP payload bytes this process has sent to its peers, read from the kernel (see the module docstring)."""

    def __init__(self, store_port: int | None = None):
        port = store_port if store_port is not None else os.environ.get("MASTER_PORT")
        self.store_port = int(port) if port else None

    def total(self) -> WireCount | None:
        """The bytes sent so far (payload and retransmitted) on every open TCP connection of this process except
        the store's; None where the kernel does not say (not Linux, or a kernel older than 4.19). A connection
        closed meanwhile drops out."""
        if not hasattr(socket, "TCP_INFO") or not os.path.isdir("/proc/self/fd"):
            return None
        total = WireCount(0, 0)
        for name in os.listdir("/proc/self/fd"):
            sent = self._sent_on(int(name))
            if sent is None:
                return None
            total += sent
        return total

    def _sent_on(self, fd: int) -> WireCount | None:
        """Bytes sent on `fd` if it is a connected TCP socket not talking to the store, WireCount(0, 0) for any
        other descriptor, None if the kernel's tcp_info is too short to hold the counts."""
        nothing = WireCount(0, 0)
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                return nothing
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:  # closed since listdir, or not ours to read
            return nothing
        with sock:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                return nothing
            try:
                ports = (sock.getsockname()[1], sock.getpeername()[1])
            except OSError:  # listening or not connected
                return nothing
            if self.store_port in ports:
                return nothing
            return wire_count(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256))
