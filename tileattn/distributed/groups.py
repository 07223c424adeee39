"""Process groups: who the ranks are, a small all-gather of Python objects, and the
transport for each kind of memory.

* `MPIGroup` (`init()` under ``mpiexec``/``mpirun``): MPI for NumPy arrays and for the
  all-gather; for CuPy arrays an NCCL communicator, made on first use with its unique id
  broadcast over MPI.
* `NCCLGroup` (`init()` with ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` and no
  MPI launcher): NCCL only, its unique id exchanged through the TCP store of
  `cupyx.distributed`; the all-gather runs over NCCL too. CuPy arrays only.
* `SimulatedGroup` (`simulate(P, fn)`): P ranks as P threads of one process.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading

from ..backends import BackendUnavailableError
from .transports import (
    MPITransport,
    NCCLTransport,
    SimulatedTransport,
    SimulatedWorld,
    simulated_allgather,
)

_EXTRA = "pip install 'tileattn[distributed]' (mpi4py and the mpich wheel)"


def _device_of(like) -> int:
    return int(like.device.id)


class MPIGroup:
    """Ranks of an mpi4py communicator (``MPI.COMM_WORLD`` by default)."""

    def __init__(self, comm):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.local_rank = comm.Split_type(_split_type_shared(), key=self.rank).Get_rank()
        self._host = MPITransport(comm)
        self._nccl = {}

    def allgather(self, value) -> list:
        return self.comm.allgather(value)

    def transport(self, memory: str, like=None):
        if memory != "cuda":
            return self._host
        device = _device_of(like)
        if device not in self._nccl:
            import cupy

            from cupy.cuda import nccl  # a submodule cupy.cuda does not import itself

            unique_id = self.comm.bcast(nccl.get_unique_id() if self.rank == 0 else None)
            with cupy.cuda.Device(device):
                communicator = nccl.NcclCommunicator(self.size, unique_id, self.rank)
            self._nccl[device] = NCCLTransport(communicator, self.rank, self.size, device)
        return self._nccl[device]

    def __repr__(self):
        return f"MPIGroup(rank={self.rank}, size={self.size})"


def _split_type_shared():
    from mpi4py import MPI

    return MPI.COMM_TYPE_SHARED


class NCCLGroup:
    """Ranks started with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT: NCCL only."""

    def __init__(self, rank: int, size: int, local_rank: int, host: str, port: int):
        import cupy
        import cupyx.distributed

        self.rank, self.size, self.local_rank = rank, size, local_rank
        cupy.cuda.Device(local_rank).use()
        # init_process_group exchanges NCCL's unique id through its TCP store; the
        # communicator it made is the one NCCL object the ring needs.
        # force_store: without it cupyx would use MPI's COMM_WORLD when mpi4py imports,
        # which outside mpiexec is a world of one.
        backend = cupyx.distributed.init_process_group(size, rank, host=host, port=port,
                                                       **_store_only())
        self._transport = NCCLTransport(backend._comm, rank, size, local_rank)

    def allgather(self, value) -> list:
        return [pickle.loads(b) for b in self._transport.allgather_bytes(pickle.dumps(value))]

    def transport(self, memory: str, like=None):
        if memory != "cuda":
            raise ValueError("a group started from RANK/WORLD_SIZE (no MPI) carries CuPy "
                             "arrays only (NCCL); start NumPy ranks with mpiexec")
        return self._transport

    def __repr__(self):
        return f"NCCLGroup(rank={self.rank}, size={self.size})"


def _store_only() -> dict:
    """The keyword that keeps cupyx's rendezvous on its TCP store even where mpi4py imports:
    ``force_store`` in recent CuPy, ``use_mpi`` in older releases (14.x among them)."""
    import inspect

    import cupyx.distributed

    parameters = inspect.signature(cupyx.distributed.init_process_group).parameters
    if "force_store" in parameters:
        return {"force_store": True}
    if "use_mpi" in parameters:
        return {"use_mpi": False}
    return {}


class SimulatedGroup:
    """One rank of P simulated in threads of one process (`simulate`)."""

    def __init__(self, world: SimulatedWorld, rank: int):
        self.world, self.rank, self.size, self.local_rank = world, rank, world.size, 0
        self._transports = {}

    def allgather(self, value) -> list:
        return simulated_allgather(self.world, self.rank, value)

    def transport(self, memory: str, like=None):
        key = (memory, _device_of(like) if memory == "cuda" else None)
        if key not in self._transports:
            self._transports[key] = SimulatedTransport(self.world, self.rank, memory, key[1])
        return self._transports[key]

    def __repr__(self):
        return f"SimulatedGroup(rank={self.rank}, size={self.size})"


def _launched_by_mpi() -> bool:
    markers = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "MPI_LOCALRANKID",
               "HYDI_CONTROL_FD", "PMI_FD")
    return any(name in os.environ for name in markers)


def init(comm=None):
    """The group of ranks this process belongs to, from the launcher's environment.

    Parameters
    ----------
    comm : mpi4py communicator, optional
        Use these ranks (default ``MPI.COMM_WORLD``).

    Under ``mpiexec``/``mpirun`` (or when `comm` is given, or when neither launcher is
    recognised: a plain ``python`` is then a group of one), the group is MPI's: NumPy arrays
    travel over MPI and CuPy arrays over NCCL, whose unique id is broadcast over MPI. With
    ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set and no MPI launcher, the
    group is NCCL's alone (CuPy arrays; ``LOCAL_RANK`` picks the GPU).

    Returns
    -------
    group : has ``rank``, ``size`` and ``local_rank`` (this rank's index among the ranks of
        its host: the GPU to use, ``cupy.cuda.Device(group.local_rank).use()``).
    """
    env = os.environ
    if comm is None and not _launched_by_mpi() and all(
            name in env for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        if "cupy" not in sys.modules and _missing("cupy"):
            raise BackendUnavailableError("init() from RANK/WORLD_SIZE runs NCCL, which needs "
                                          "CuPy: pip install 'tileattn[gpu]'")
        return NCCLGroup(int(env["RANK"]), int(env["WORLD_SIZE"]),
                         int(env.get("LOCAL_RANK", env["RANK"])), env["MASTER_ADDR"],
                         int(env["MASTER_PORT"]))
    try:
        from mpi4py import MPI
    except ImportError as error:
        raise BackendUnavailableError(f"tileattn.distributed needs mpi4py ({error}): "
                                      f"{_EXTRA}") from None
    return MPIGroup(MPI.COMM_WORLD if comm is None else comm)


def _missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


def simulate(size: int, function, *args, device=None, **kwargs) -> list:
    """Run ``function(group, *args, **kwargs)`` as `size` ranks, one thread each, of one
    process; returns each rank's result, in rank order.

    With ``device`` (a GPU index) every rank's thread computes on a non-blocking CuPy stream
    of its own, as separate processes would, and the ring's copies run on further streams.
    An exception on any rank is raised here (the first rank's); the other ranks are not
    interrupted, so `function` must not wait on a rank that failed (the distributed
    functions' up-front agreement check is there for exactly that).
    """
    world = SimulatedWorld(size)
    results, errors = [None] * size, [None] * size

    def rank_main(rank):
        try:
            if device is None:
                results[rank] = function(SimulatedGroup(world, rank), *args, **kwargs)
                return
            import cupy

            with cupy.cuda.Device(device), cupy.cuda.Stream(non_blocking=True) as stream:
                results[rank] = function(SimulatedGroup(world, rank), *args, **kwargs)
                stream.synchronize()
        except BaseException as error:  # noqa: BLE001 - handed to the caller below
            errors[rank] = error
            world.fail()

    threads = [threading.Thread(target=rank_main, args=(rank,), daemon=True)
               for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    secondary = (threading.BrokenBarrierError, RuntimeError)
    first = next((e for e in errors if e is not None and not isinstance(e, secondary)),
                 next((e for e in errors if e is not None), None))
    if first is not None:
        raise first
    return results
