"""A shared-memory all-reduce / all-gather for the ranks of one group on one node (vLLM's
`cpu_communicator.py` swaps gloo for its C++ `shm_allreduce`; this is the same shape in torch ops).

Layout of one file in /dev/shm (mapped by every rank, unlinked once all have mapped it, so nothing
is left behind by a crash): one 64-byte flag per rank, then two buffers of `world_size` slots of
`slot_bytes` each. An all-reduce of step g:

  1. rank r copies its tensor into slot r of buffer g % 2 and stores g into its flag;
  2. it waits until every flag reads >= g (the barrier);
  3. it sums the slots in rank order 0, 1, ... (every rank the same order, so every rank gets the
     same bits: ranks that sample from these values must agree on every token).

Two buffers make one barrier per call enough: a rank writes buffer g % 2 again at step g + 2, which
it reaches only after every rank arrived at barrier g + 1, that is after every rank finished reading
step g. x86 stores become visible in program order, so a flag seen means the data before it is
there. Tensors larger than a slot go in slot-sized pieces. bf16 sums accumulate in fp32 (as vLLM's
kernel does), then round once.

Waiting polls a few hundred times, then yields the core, then sleeps in 20 us naps: ranks that
outnumber the cores (or share them with other work) must let the late one run; the naps cost up to
~0.1 ms a call there, the polls nothing when every rank has its core. A rank that never arrives fails the call after
`timeout_s` instead of hanging (the executor also watches its workers' processes)."""

from __future__ import annotations

import contextlib
import os
import time
import uuid

import torch

_FLAG_BYTES = 64  # one cache line per rank's flag: no false sharing between spinning ranks
_SPINS_BEFORE_YIELD = 200  # ~0.2-0.4 ms of polling: a peer that is running arrives within it
_SPINS_BEFORE_SLEEP = 400
_SLEEP_S = 20e-6


def _fine_timer_slack() -> None:
    """Let the barrier's 20 us naps be ~20 us: Linux rounds a thread's sleeps up by its timer slack
    (50 us by default), which would make every nap cost 70 us."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK: 1 us
    except (OSError, AttributeError):
        pass


class ShmCommunicator:
    def __init__(self, path: str, rank: int, world_size: int, slot_bytes: int, create: bool,
                 timeout_s: float = 120.0) -> None:
        self.rank, self.world_size, self.slot_bytes = rank, world_size, slot_bytes
        self.timeout_s = timeout_s
        self.path = path
        header = _FLAG_BYTES * world_size
        total = header + 2 * world_size * slot_bytes
        if create:
            with open(path, "wb") as f:
                f.truncate(total)
        self._mem = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
        flags = self._mem[:header].view(torch.int64)
        self._flags = flags.numpy()[:: _FLAG_BYTES // 8]  # rank r's flag: element r (a numpy view)
        self._data = self._mem[header:]
        self._gen = 0
        _fine_timer_slack()

    @staticmethod
    def new_path() -> str:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
        return os.path.join(base, f"tokenloom-allreduce-{uuid.uuid4().hex}")

    def unlink(self) -> None:
        """Remove the file (the mappings stay valid): called once every rank has mapped it."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _slot(self, buf: int, rank: int, nbytes: int) -> torch.Tensor:
        start = (buf * self.world_size + rank) * self.slot_bytes
        return self._data[start : start + nbytes]

    def _barrier(self) -> None:
        self._gen += 1
        gen = self._gen
        self._flags[self.rank] = gen
        flags = self._flags
        spins = 0
        deadline = None
        while flags.min() < gen:
            spins += 1
            if spins > _SPINS_BEFORE_YIELD:
                # Yield, then sleep: on a machine with more runnable threads than cores, the rank we
                # wait for may need this core (sched_yield alone does not guarantee it runs).
                if spins < _SPINS_BEFORE_SLEEP:
                    os.sched_yield()
                else:
                    time.sleep(_SLEEP_S)
                if deadline is None:
                    deadline = time.monotonic() + self.timeout_s
                elif spins % 256 == 0 and time.monotonic() > deadline:
                    late = [r for r in range(self.world_size) if flags[r] < gen]
                    raise RuntimeError(f"shared-memory all-reduce: rank(s) {late} did not arrive within "
                                       f"{self.timeout_s:.0f} s (a worker died or hangs)")

    def _chunks(self, x: torch.Tensor) -> list[torch.Tensor]:
        per = max(1, self.slot_bytes // x.element_size())
        flat = x.view(-1)
        return [flat[i : i + per] for i in range(0, flat.numel(), per)]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, in place (x must be contiguous); returns x."""
        for piece in self._chunks(x):
            buf = (self._gen + 1) % 2
            nbytes = piece.numel() * piece.element_size()
            self._slot(buf, self.rank, nbytes).view(piece.dtype).copy_(piece)
            self._barrier()
            slots = [self._slot(buf, r, nbytes).view(piece.dtype) for r in range(self.world_size)]
            if piece.dtype == torch.float32:
                torch.add(slots[0], slots[1], out=piece)
                for s in slots[2:]:
                    piece.add_(s)
            else:  # bf16: accumulate in fp32, round once
                acc = slots[0].float()
                for s in slots[1:]:
                    acc.add_(s.float())
                piece.copy_(acc)
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x (same shape on each), in rank order; fresh tensors."""
        nbytes = x.numel() * x.element_size()
        if nbytes > self.slot_bytes:
            raise ValueError(f"all_gather of {nbytes} bytes exceeds the {self.slot_bytes}-byte slot")
        buf = (self._gen + 1) % 2
        self._slot(buf, self.rank, nbytes).view(x.dtype).copy_(x.contiguous().view(-1))
        self._barrier()
        return [self._slot(buf, r, nbytes).view(x.dtype).view(x.shape).clone() for r in range(self.world_size)]
