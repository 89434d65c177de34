"""``ds-longctx launch``: DeepSpeed's runner, wrapped so that a preemption signal ends in a saved checkpoint with
every process exiting 0 (standard library only: the shell launchers run this file by path, without importing
torch).

    ds-longctx launch --num_gpus 2 train.py --deepspeed_config tiny-cpu.json --save ckpt --resume auto
    launch/single_node.sh ...                       # the same, through this wrapper
    ds-longctx launch mpirun -np 2 python train.py ...   # Open MPI's mpirun (launch/mpi.sh)

Why a wrapper: DeepSpeed's runner (``deepspeed``) and its per-node ``launch.py`` cannot be changed, and neither
survives a preemption notice. The runner has no handler (SIGTERM or SIGUSR1 end it with rc -15 / 138); launch.py
dies of SIGUSR1's default action, and on SIGINT/SIGTERM sends every rank SIGTERM, SIGKILL after 30 s, and exits 1
(deepspeed/launcher/launch.py ``sigkill_handler``). The ranks themselves finish the step and save in every one
of those cases (ds_longctx/dist/runtime.py), but the runner's exit code is then not 0 and a scheduler would count the
preempted job as failed.

What the wrapper does: it starts the runner in a session of its own with SIGUSR1 ignored (the runner, launch.py
and, until the training loop installs its handler, the ranks inherit the ignore), so that a signal to the
wrapper's process group (a scheduler's, Ctrl-C) reaches only the wrapper. The first SIGTERM, SIGINT, SIGUSR1 or
SIGHUP is sent on as SIGUSR1 to the runner's whole group: only the ranks act on it (finish the step, save, exit
0); launch.py then sees every rank exit 0, exits 0, and so does the runner and this wrapper. A second SIGTERM or
SIGINT sends SIGTERM to the group (the ranks end at once); a third, SIGKILL. A signal sent to the runner or
launch.py directly still ends them, but the ranks save; the wrapper waits for every process of the group to end
and exits 0 when rank 0 reported the save of a graceful stop (``DS_LONGCTX_STOP_REPORT``). The ranks watch this
wrapper's pid (``DS_LONGCTX_LAUNCHER_PID``): kill -9 of the wrapper is their launcher's death.

Under mpirun (the first argument ``mpirun``, ``mpiexec`` or ``prterun``): Open MPI 5's mpirun (PRRTE's prterun)
forwards SIGUSR1 to every rank on every node, but on SIGTERM or SIGINT kills its ranks at once (no handler of
theirs runs: the save is lost, rc 1), and it starts each rank in a process group of its own (a signal to the
launcher's group never reaches them). So mpirun runs in a session of its own, and the first SIGTERM, SIGINT,
SIGUSR1 or SIGHUP is sent on as SIGUSR1 to mpirun alone, which forwards it to the ranks; a second SIGTERM or
SIGINT is sent on as SIGTERM (mpirun ends the job now), a third as SIGKILL.

With a hostfile of several hosts the deepspeed runner starts the remote ranks through pdsh, which a signal to
this machine's process group does not reach: there the first signal is sent on as SIGTERM to the runner alone,
whose own handler stops launch.py on every node (its ranks save); the exit code is then the runner's.

Exit code: the runner's (0 after a graceful stop), 128+N when it died of signal N without a reported save.
"""
import os
import signal
import subprocess
import sys
import tempfile
import time

WRAPPER_ENV = "DS_LONGCTX_LAUNCHER_PID"  # runtime.WRAPPER_ENV
STOP_REPORT_ENV = "DS_LONGCTX_STOP_REPORT"  # train.finish writes it on rank 0 after a graceful stop's save
_FORWARDED = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGHUP")
MPI_LAUNCHERS = ("mpirun", "mpiexec", "prterun", "orterun")


# device nodes of the accelerators DeepSpeed detects (CUDA, ROCm, Intel XPU/Gaudi, Ascend, AMD/Intel NPUs)
# (WSL's CUDA: /dev/dxg); Linux only (macOS has MPS without a device node)
_ACCELERATOR_NODES = ("/dev/nvidia*", "/dev/dxg", "/dev/kfd", "/dev/dri/renderD*", "/dev/accel/*", "/dev/davinci*",
                      "/dev/hl*")


def accelerator_env(environ, nodes=None):
    """On a machine without any accelerator device node (and DS_ACCELERATOR unset): ``{"DS_ACCELERATOR": "cpu"}``,
    DeepSpeed's own fallback there, chosen once here; otherwise every process (the runner, launch.py, each rank)
    warns "Setting accelerator to CPU. If you have GPU ... we were unable to detect it". Else ``{}``."""
    import glob

    if environ.get("DS_ACCELERATOR") or (nodes is None and not sys.platform.startswith("linux")):
        return {}
    found = [n for pattern in _ACCELERATOR_NODES for n in glob.glob(pattern)] if nodes is None else nodes
    return {} if found else {"DS_ACCELERATOR": "cpu"}


def _is_mpi(argv):
    return bool(argv) and os.path.basename(argv[0]) in MPI_LAUNCHERS


def _hostfile_hosts(argv):
    """The hosts of the deepspeed runner's --hostfile (DeepSpeed's default /job/hostfile when it exists): one
    "host slots=N" line each, '#' comments."""
    path = "/job/hostfile"
    for i, a in enumerate(argv):
        if a == "--hostfile" and i + 1 < len(argv):
            path = argv[i + 1]
        elif a.startswith("--hostfile="):
            path = a.split("=", 1)[1]
        elif not a.startswith("-") and a.endswith(".py"):
            break  # the user script: the rest are its arguments
    try:
        with open(path) as f:
            return [ln.split()[0] for ln in (line.split("#", 1)[0].strip() for line in f) if ln]
    except OSError:
        return []


def _say(text):
    sys.stderr.write(f"ds-longctx launch: {text}\n")
    sys.stderr.flush()


def _group_alive(pgid):
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    fd, report = tempfile.mkstemp(prefix="ds_longctx-stop-", suffix=".txt")
    os.close(fd)
    os.unlink(report)  # rank 0 creates it after a graceful stop's save
    env = dict(os.environ, **{WRAPPER_ENV: str(os.getpid()), STOP_REPORT_ENV: report})
    quiet = accelerator_env(os.environ)
    if quiet:
        _say("no accelerator device on this machine (/dev/nvidia*, /dev/kfd, ...): DS_ACCELERATOR=cpu for every "
             "process (set DS_ACCELERATOR to choose)")
        env.update(quiet)
    received = []
    mpi = _is_mpi(argv)
    # the deepspeed runner over pdsh (several hosts): only the runner's own handler reaches the remote ranks
    pdsh = not mpi and len(set(_hostfile_hosts(argv))) > 1 and "--no_ssh" not in argv

    def on_signal(signum, frame):
        received.append(signum)
        name = signal.Signals(signum).name
        if len(received) == 1:
            _say(f"received {name}: asking the ranks to finish this step, save a checkpoint and exit (send SIGTERM "
                 "again to end now)")
            send = signal.SIGUSR1
        elif signum == signal.SIGUSR1 or signum == signal.SIGHUP:
            return
        else:
            again = sum(1 for s in received[1:] if s in (signal.SIGTERM, signal.SIGINT))
            send = signal.SIGTERM if again == 1 else signal.SIGKILL
            to = "mpirun (it ends its ranks)" if mpi else "the runner" if pdsh else "every process"
            _say(f"received {name} again: ending the job now ({signal.Signals(send).name} to {to})")
        if pdsh and send == signal.SIGUSR1:
            send = signal.SIGTERM
        try:
            if mpi or pdsh:  # mpirun forwards SIGUSR1 to its ranks (each in a group of its own), kills on SIGTERM
                os.kill(proc.pid, send)
            else:
                os.killpg(proc.pid, send)
        except ProcessLookupError:
            pass

    def child_setup():
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)

    if mpi:  # mpirun resets its ranks' signals: its own SIGUSR1 must stay at its default (forward)
        proc = subprocess.Popen(argv, env=env, start_new_session=True)
    else:
        proc = subprocess.Popen([sys.executable, "-m", "deepspeed.launcher.runner", *argv], env=env,
                                start_new_session=True, preexec_fn=None if pdsh else child_setup)
    for name in _FORWARDED:
        signal.signal(getattr(signal, name), on_signal)
    while True:
        try:
            code = proc.wait()
            break
        except KeyboardInterrupt:  # pragma: no cover (SIGINT has our handler)
            continue
    while _group_alive(proc.pid):  # the ranks of a runner or launch.py that was signalled directly
        time.sleep(0.2)
    saved = None
    if os.path.exists(report):
        with open(report) as f:
            saved = f.read().strip()
        os.unlink(report)
    if code != 0 and saved:
        how = f"died of {signal.Signals(-code).name}" if code < 0 else f"exited {code}"
        _say(f"{'mpirun' if mpi else 'the deepspeed runner'} {how}, after the ranks saved ({saved}): exit 0")
        return 0
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
