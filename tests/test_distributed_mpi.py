"""tileattn.distributed over real MPI ranks: `mpiexec -n 2` and `-n 4` (oversubscribed on
a 2-core machine) run tests/distributed_worker.py, whose every rank checks its gathered
results against the golden model; a rank that fails ends the run with a non-zero status.

Skips only where mpi4py or mpiexec is not installed (``pip install 'tileattn[distributed]'``
installs both), and fails instead under ``CI``, whose install command includes them.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tileattn

WORKER = Path(__file__).with_name("distributed_worker.py")
TIMEOUT_S = 300


def _mpiexec() -> str:
    """The mpiexec beside this Python (the mpich wheel's), else the one on PATH."""
    beside = Path(sys.executable).with_name("mpiexec")
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    missing = [name for name, absent in (("mpi4py", importlib.util.find_spec("mpi4py") is None),
                                         ("mpiexec", found is None)) if absent]
    if missing:
        reason = (f"{' and '.join(missing)} not installed: "
                  "pip install 'tileattn[distributed]'")
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return found


def _environment() -> dict:
    env = dict(os.environ)
    # The workers import the tileattn these tests import, wherever it is installed.
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(tileattn.__file__).parents[1])] + env.get("PYTHONPATH", "").split(os.pathsep))
    # MPICH busy-polls while it waits; with more ranks than cores, yielding keeps the
    # oversubscribed run from crawling.
    env.setdefault("MPIR_CVAR_CH4_SHM_POSIX_EAGER_YIELD", "1")
    env.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (device notes)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        # Open MPI's mpiexec refuses to start as root unless told twice (containers and the
        # GPU machines run as root); MPICH ignores both.
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def launch(ranks: int, *args: str, env=None, launcher=True) -> str:
    env = env or _environment()
    mpiexec = _mpiexec()  # skips (or fails in CI) without mpi4py and mpiexec, either way
    prefix = [mpiexec, "-n", str(ranks)] if launcher else []
    command = [*prefix, sys.executable, str(WORKER), *args]
    try:
        result = subprocess.run(command, capture_output=True, text=True, env=env, check=False,
                                timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"{' '.join(command)} did not finish in {TIMEOUT_S} s (a hang?)\n"
                    f"{error.stdout}\n{error.stderr}")
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{' '.join(command)} exited {result.returncode}:\n{output}"
    for rank in range(ranks):
        assert f"rank {rank}: done" in result.stdout, output
    return output


@pytest.mark.parametrize("ranks", [2, 4])
def test_exact_over_mpi(ranks):
    launch(ranks, "exact", "cpu")


@pytest.mark.parametrize("ranks", [2, 4])
def test_mismatches_raise_on_every_rank_over_mpi(ranks):
    output = launch(ranks, "mismatch")
    assert output.count("ok shape") == ranks


@pytest.mark.parametrize("ranks", [2, 4])
def test_shard_unshard_over_mpi(ranks):
    launch(ranks, "shard")


def test_plain_python_is_a_group_of_one():
    """init() outside any launcher: MPI's singleton world, one rank, the ring still runs."""
    output = launch(1, "exact", "cpu", launcher=False)
    assert "MPIGroup(rank=0, size=1)" in output


def _needs_gpu():
    from tileattn import backends

    reason = backends.availability("gpu")
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.gpu
def test_nccl_group_of_one():
    """Under mpiexec: NCCL's unique id broadcast over MPI, CuPy arrays over NCCL, and a
    group of one equal to tileattn.forward/backward value for value."""
    _needs_gpu()
    launch(1, "nccl")


@pytest.mark.gpu
def test_nccl_group_of_one_from_rank_and_world_size():
    """Without MPI: init() from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (cupyx's TCP
    store), the all-gather over NCCL too."""
    _needs_gpu()
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = _environment()
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    output = launch(1, "nccl", env=env, launcher=False)
    assert "NCCLGroup" in output
