"""The ring's one communication step, over MPI, NCCL, or threads of one process.

A transport does one thing for the ring: `shift(arrays)` starts sending each array to rank
``rank + 1`` and receiving arrays of the same shapes and dtypes from rank ``rank - 1``
(both modulo the group size), and returns a `Pending` whose `wait()` gives the received
arrays. The ring computes on the block in hand between `shift` and `wait`, so the next
block is in flight while the current one is computed.

* `MPITransport`: NumPy arrays, non-blocking ``Isend``/``Irecv`` of the arrays' bytes
  (bfloat16 has no MPI datatype; bytes need none).
* `NCCLTransport`: CuPy arrays, ``send``/``recv`` inside one ``groupStart``/``groupEnd`` on
  a stream of its own. An event recorded on the caller's stream orders the sends after the
  compute that produced the arrays; an event recorded on the comm stream makes the
  caller's stream wait, in `wait()`, only for the arrays it is about to use.
* `SimulatedTransport`: P ranks as P threads of one process, for tests and for the
  benchmark's ``--simulate``. NumPy arrays are copied; CuPy arrays are copied device to
  device on a stream of the sender's own with the same two events as NCCL, so the ring's
  stream ordering is exercised exactly as NCCL exercises it.
"""

from __future__ import annotations

import pickle
import queue
import sys
import threading

import numpy as np

from .layouts import contiguous, empty_like_shape


class Pending:
    """Arrays in flight; `wait()` returns the received ones, in the order they were sent."""

    def __init__(self, wait, progress=None):
        self._wait = wait
        self._progress = progress
        self._done = None

    def progress(self) -> None:
        """Let a transport that needs the caller's help to move data (MPI without an
        asynchronous progress thread) move some; called between the ring's block calls."""
        if self._progress is not None and self._done is None:
            self._progress()

    def wait(self) -> list:
        if self._done is None:
            self._done = self._wait()
        return self._done


def _as_bytes(array):
    return array.reshape(-1).view(np.uint8)


# --------------------------------------------------------------------------- MPI


class MPITransport:
    """NumPy arrays over an mpi4py communicator."""

    def __init__(self, comm):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._shifts = 0

    def shift(self, arrays) -> Pending:
        from mpi4py import MPI

        arrays = [contiguous(a) for a in arrays]
        received = [np.empty(a.shape, a.dtype) for a in arrays]
        after, before = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        requests = []
        # Each shift has tags of its own, so that two shifts in flight at once (the
        # backward's K/V and dK/dV) never match each other's messages.
        first_tag = (self._shifts % 1000) * 16
        self._shifts += 1
        for tag, (out, into) in enumerate(zip(arrays, received), start=first_tag):
            requests.append(self.comm.Irecv(_as_bytes(into), source=before, tag=tag))
            requests.append(self.comm.Isend(_as_bytes(out), dest=after, tag=tag))

        def wait():
            MPI.Request.Waitall(requests)
            arrays.clear()  # the sent arrays were kept alive until here
            return received

        return Pending(wait, progress=lambda: MPI.Request.Testall(requests))


# --------------------------------------------------------------------------- NCCL


class NCCLTransport:
    """CuPy arrays over a `cupy.cuda.nccl.NcclCommunicator`, on a comm stream of its own."""

    def __init__(self, communicator, rank: int, size: int, device_id: int):
        import cupy

        self.cupy = cupy
        from cupy.cuda import nccl  # a submodule cupy.cuda does not import itself

        self.nccl = nccl
        self.communicator = communicator
        self.rank, self.size, self.device_id = rank, size, device_id
        with cupy.cuda.Device(device_id):
            self.stream = cupy.cuda.Stream(non_blocking=True)

    def shift(self, arrays) -> Pending:
        cupy, nccl = self.cupy, self.nccl
        arrays = [contiguous(a) for a in arrays]
        # Allocated on the caller's stream before the event below, so that the comm
        # stream writes them only after every earlier use of that memory there.
        received = [empty_like_shape(a, a.shape, a.dtype) for a in arrays]
        ready = cupy.cuda.Event(disable_timing=True)
        ready.record(cupy.cuda.get_current_stream())
        self.stream.wait_event(ready)
        after, before = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        nccl.groupStart()
        for out, into in zip(arrays, received):
            self.communicator.send(out.data.ptr, out.nbytes, nccl.NCCL_UINT8, after,
                                   self.stream.ptr)
            self.communicator.recv(into.data.ptr, into.nbytes, nccl.NCCL_UINT8, before,
                                   self.stream.ptr)
        nccl.groupEnd()
        done = cupy.cuda.Event(disable_timing=True)
        done.record(self.stream)

        def wait():
            cupy.cuda.get_current_stream().wait_event(done)
            arrays.clear()  # freed only once the caller's stream is ordered after the sends
            return received

        return Pending(wait)

    def allgather_bytes(self, payload: bytes, capacity: int = 1 << 16) -> list:
        """Every rank's `payload` (at most `capacity` bytes), gathered over NCCL."""
        cupy = self.cupy
        if len(payload) > capacity - 8:
            raise ValueError(f"allgather payload of {len(payload)} bytes exceeds {capacity - 8}")
        framed = np.zeros(capacity, np.uint8)
        framed[:8] = np.frombuffer(np.int64(len(payload)).tobytes(), np.uint8)
        framed[8:8 + len(payload)] = np.frombuffer(payload, np.uint8)
        with cupy.cuda.Device(self.device_id):
            send = cupy.asarray(framed)
            gathered = cupy.empty(capacity * self.size, np.uint8)
            self.communicator.allGather(send.data.ptr, gathered.data.ptr, capacity,
                                        self.nccl.NCCL_UINT8, self.stream.ptr)
            self.stream.synchronize()
            host = gathered.get().reshape(self.size, capacity)
        return [bytes(row[8:8 + int(row[:8].view(np.int64)[0])]) for row in host]


# --------------------------------------------------------------------------- threads


class SimulatedWorld:
    """What the P threads of a simulated group share: per rank a mailbox of arrivals and a
    queue of posted receive buffers, and a barrier for the all-gather."""

    def __init__(self, size: int):
        self.size = size
        self.mailboxes = [queue.Queue() for _ in range(size)]
        self.posted = [queue.Queue() for _ in range(size)]
        self.barrier = threading.Barrier(size)
        self.slots = [None] * size
        self.failed = threading.Event()

    def fail(self) -> None:
        """A rank raised: the others stop waiting for it (as MPI_Abort would end them)."""
        self.failed.set()
        self.barrier.abort()

    def take(self, box: queue.Queue):
        """The next item of `box`, or a RuntimeError once another rank has failed."""
        while True:
            try:
                return box.get(timeout=0.05)
            except queue.Empty:
                if self.failed.is_set():
                    raise RuntimeError("another simulated rank failed") from None


class SimulatedTransport:
    """One rank's end of a simulated ring.

    As with NCCL, a rank receives into buffers it allocates on its own stream (CuPy's pool
    then reuses them in that stream's order), the sender's comm stream waits for the
    sender's compute and for the receiver's buffers, and each side's stream waits, in
    `wait()`, for the copies that read or wrote its memory.
    """

    def __init__(self, world: SimulatedWorld, rank: int, memory: str, device_id=None):
        self.world, self.rank, self.size, self.memory = world, rank, world.size, memory
        self.cupy = sys.modules["cupy"] if memory == "cuda" else None
        if memory == "cuda":
            with self.cupy.cuda.Device(device_id):
                self.stream = self.cupy.cuda.Stream(non_blocking=True)

    def _event_on(self, stream):
        event = self.cupy.cuda.Event(disable_timing=True)
        event.record(stream)
        return event

    def shift(self, arrays) -> Pending:
        arrays = [contiguous(a) for a in arrays]
        after = (self.rank + 1) % self.size
        if self.memory != "cuda":
            self.world.mailboxes[after].put([a.copy() for a in arrays])
            mailbox = self.world.mailboxes[self.rank]
            return Pending(lambda: self.world.take(mailbox))
        cupy = self.cupy
        compute = cupy.cuda.get_current_stream()
        received = [empty_like_shape(a, a.shape, a.dtype) for a in arrays]
        self.world.posted[self.rank].put((received, self._event_on(compute)))
        targets, targets_ready = self.world.take(self.world.posted[after])
        self.stream.wait_event(self._event_on(compute))
        self.stream.wait_event(targets_ready)
        for source, target in zip(arrays, targets):
            cupy.cuda.runtime.memcpyAsync(target.data.ptr, source.data.ptr, source.nbytes,
                                          cupy.cuda.runtime.memcpyDeviceToDevice,
                                          self.stream.ptr)
        sent = self._event_on(self.stream)
        self.world.mailboxes[after].put(sent)
        mailbox = self.world.mailboxes[self.rank]

        def wait():
            arrived = self.world.take(mailbox)
            current = cupy.cuda.get_current_stream()
            current.wait_event(arrived)
            current.wait_event(sent)
            arrays.clear()
            return received

        return Pending(wait)


def simulated_allgather(world: SimulatedWorld, rank: int, value) -> list:
    """Every simulated rank's `value` (pickled, so no rank shares a mutable object)."""
    world.barrier.wait()
    world.slots[rank] = pickle.dumps(value)
    world.barrier.wait()
    gathered = [pickle.loads(slot) for slot in world.slots]
    world.barrier.wait()
    return gathered
