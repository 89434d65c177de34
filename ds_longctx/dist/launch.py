"""Launcher glue: rank discovery from SLURM/MPI, hostfile checks, the startup layout line.

    python -m ds_longctx.dist.launch check-hostfile HOSTFILE --deepspeed_config CFG
    python -m ds_longctx.dist.launch layout --deepspeed_config CFG --world N
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from typing import Dict, Optional

from ..config import load_ds_config, parse
from ..errors import ConfigError, command_line
from .layout import Layout


def env_from_slurm() -> bool:
    """Fill RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR from SLURM when srun started us without them.

    DeepSpeed discovers MPI ranks itself (mpi4py); srun only sets SLURM_* variables.
    """
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ or "SLURM_NTASKS" not in os.environ:
        return False
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    if "MASTER_ADDR" not in os.environ:
        nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST", "127.0.0.1")
        try:
            first = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                                   check=True).stdout.split()[0]
        except (OSError, subprocess.CalledProcessError, IndexError):
            first = re.split(r"[,\[]", nodelist)[0]
        os.environ["MASTER_ADDR"] = first
    os.environ.setdefault("MASTER_PORT", str(DEFAULT_MASTER_PORT))
    return True


DEFAULT_MASTER_PORT = 29500

# the process count as each launcher exports it: deepspeed/torchrun, Open MPI, MPICH/Intel MPI, srun
_WORLD_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")


def launched_world_size() -> int:
    """Processes of this job as the launcher announced them, before any process group exists (1 when
    started as a plain ``python script.py``)."""
    for var in _WORLD_VARS:
        value = os.environ.get(var)
        if value and value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def check_launch(sp: int) -> int:
    """The world must be a multiple of ``sequence_parallel_size``; checked from the launcher's environment
    before any model is built (an SP-8 config started on one process otherwise builds the whole model
    first). The process group's size once it is started (train.py starts it first, so every rank reaches the
    verdict after the rendezvous, together). Same verdict on every rank. Returns the world size."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else launched_world_size()
    if world % sp:
        how = ("one process: a plain `python` start, or a launcher asked for one" if world == 1
               else f"the launcher started {world} processes")
        # the wording of checks.check_against's same check (which runs later, for callers of initialize)
        raise ConfigError("sequence_parallel_size", f"{sp} does not divide the world size {world} ({how})",
                          f"launch a multiple of {sp} processes (e.g. deepspeed --num_gpus {sp} ..., torchrun "
                          f"--nproc_per_node {sp} ...), or set sequence_parallel_size to a divisor of {world}")
    return world


def master_port(distributed_port: Optional[int] = None) -> int:
    """The rendezvous port: an explicit ``MASTER_PORT`` in the environment (what every launcher and
    ``mpirun -x MASTER_PORT`` set), else the ``distributed_port`` given to ``initialize``, else 29500."""
    env = os.environ.get("MASTER_PORT")
    if env is not None:
        if not env.isdigit() or not 0 < int(env) < 65536:
            raise ConfigError("MASTER_PORT", f"{env!r} is not a TCP port", "set it to a free port in 1..65535")
        return int(env)
    return int(distributed_port) if distributed_port is not None else DEFAULT_MASTER_PORT


def read_hostfile(path: str) -> Dict[str, int]:
    """DeepSpeed hostfile format: one ``hostname slots=N`` per line; # starts a comment."""
    if not os.path.exists(path):
        raise ConfigError("hostfile", f"{path!r} does not exist", "write one 'hostname slots=N' line per node")
    hosts: Dict[str, int] = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            m = re.fullmatch(r"(\S+)\s+slots\s*=\s*(\d+)", line)
            if not m:
                raise ConfigError(f"hostfile line {n}", f"cannot parse {line!r}", "write 'hostname slots=N'")
            if m.group(1) in hosts:
                raise ConfigError(f"hostfile line {n}", f"host {m.group(1)!r} appears twice", "list each host once")
            hosts[m.group(1)] = int(m.group(2))
    if not hosts:
        raise ConfigError("hostfile", f"{path} lists no hosts", "write one 'hostname slots=N' line per node")
    return hosts


def check_hostfile(path: str, sp: int) -> Dict[str, int]:
    """An SP group is a block of consecutive ranks; it must tile the hosts' slots exactly."""
    hosts = read_hostfile(path)
    world = sum(hosts.values())
    if world % sp:
        raise ConfigError("sequence_parallel_size", f"{sp} does not divide the {world} slots of {path} "
                          f"({', '.join(f'{h}={s}' for h, s in hosts.items())})",
                          f"give the hosts a multiple of {sp} slots in total, or change the SP degree")
    for host, slots in hosts.items():
        if slots % sp and sp % slots:
            raise ConfigError("sequence_parallel_size", f"host {host} has {slots} slots, which neither holds whole "
                              f"SP groups of {sp} nor divides one, so a group would straddle hosts unevenly",
                              f"use slots that are a multiple or a divisor of {sp} on every host")
    if len(set(hosts.values())) > 1 and any(s < sp for s in hosts.values()):
        raise ConfigError("hostfile", "hosts have different slot counts and SP groups span hosts",
                          "give every host the same number of slots")
    return hosts


def layout_line(world: int, sp: int) -> str:
    dp = Layout(world=world, sp=sp).dp
    return (f"[ds_longctx] layout: world={world} = sp {sp} x dp {dp}; SP groups are consecutive ranks "
            f"[0..{sp - 1}], [{sp}..{2 * sp - 1}], ...; ZeRO-3 shards over all {world} ranks")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ds_longctx.dist.launch")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check-hostfile")
    c.add_argument("hostfile")
    c.add_argument("--deepspeed_config", required=True)
    lay = sub.add_parser("layout")
    lay.add_argument("--deepspeed_config", required=True)
    lay.add_argument("--world", type=int, required=True)
    args = p.parse_args(argv)
    return command_line("ds_longctx: error", lambda _: _run(args), None)


def _run(args) -> int:
    sp = parse(load_ds_config(args.deepspeed_config)).sequence_parallel_size
    if args.cmd == "check-hostfile":
        hosts = check_hostfile(args.hostfile, sp)
        print(layout_line(sum(hosts.values()), sp))
    else:
        if args.world % sp:
            raise ConfigError("sequence_parallel_size", f"{sp} does not divide the world size {args.world}",
                              f"launch a multiple of {sp} processes")
        print(layout_line(args.world, sp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
