"""The process side of a run: the process group and device mesh (Dist), rank-0 logging with timestamps, host-side
agreement between ranks, seeding, whether the CPU computes bf16 natively, signals as a stop request, workers that
die with their launcher, and the one error report per failure that torchrun shows as the root cause."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import random
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fsdp_lib.config import TrainConfig
from fsdp_lib.errors import TrainError


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    mesh: Any  # DeviceMesh: 1-D ("shard",) or 2-D ("replicate", "shard")
    cpu_group: Any  # gloo group for host-side agreement (signals, checkpoint bookkeeping): never syncs the GPU
    async_ckpt_group: Any  # gloo group used only by background checkpoint writes (see Checkpointer.save)
    # --context-parallel N: ranks g*N .. g*N+N-1 split each sequence of the same micro-batches (context_group);
    # the data plan sees world / N data-parallel ranks.
    context_size: int = 1
    context_group: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def file_threads(self) -> int:
        """Files each rank reads or writes at once (one thread each): the node's cores shared by its processes, at
        least 2 (a read or write waits on the disk as much as on a core), at most 4."""
        return max(2, min(4, (os.cpu_count() or 1) // max(1, self.local_world_size)))

    @property
    def context_rank(self) -> int:
        """This rank's part of each sequence (0 .. --context-parallel - 1)."""
        return self.rank % self.context_size

    @property
    def data_rank(self) -> int:
        """Which micro-batches this rank trains: the same for the ranks of one context group."""
        return self.rank // self.context_size

    @property
    def data_world(self) -> int:
        return self.world_size // self.context_size


ENV_RANK = int(os.environ.get("RANK", "0"))  # the global rank torchrun gave us, known before any process group


def log(message: str, all_ranks: bool = False) -> None:
    """Every line carries a timestamp and the rank; by default only rank 0 prints."""
    if all_ranks or ENV_RANK == 0:
        stamp = dt.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        print(f"[{stamp}][rank{ENV_RANK}] {message}", flush=True)


def _ensure_launcher_env() -> None:
    """Allow `python fsdp_train.py ...` as a single process, as if launched by torchrun."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )


def setup_distributed(cfg: TrainConfig) -> Dist:
    """The process groups and the device mesh. Set-up (connecting every rank to the others) is bounded by
    --init-timeout-s, so a launch or torchrun restart that cannot connect fails in minutes; the groups' collectives
    then get --collective-timeout-s."""
    from torch.distributed.device_mesh import init_device_mesh

    _ensure_launcher_env()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    timeout = dt.timedelta(seconds=cfg.init_timeout_s)
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
    try:
        store = restart_safe_store(rank, world, local_world, timeout)
        if device.type == "cuda":
            dist.init_process_group(
                "cpu:gloo,cuda:nccl", timeout=timeout, device_id=device, store=store, rank=rank, world_size=world
            )
        else:
            dist.init_process_group("gloo", timeout=timeout, store=store, rank=rank, world_size=world)
        cpu_group = dist.new_group(backend="gloo", timeout=timeout)
        async_ckpt_group = dist.new_group(backend="gloo", timeout=timeout)
    except (RuntimeError, dist.DistError) as exc:  # DistStoreError, gloo's connectFullMesh, NCCL's init
        raise TrainError(
            f"rank {rank} of {world} could not set up the process group within --init-timeout-s "
            f"{cfg.init_timeout_s} (MASTER_ADDR={os.environ.get('MASTER_ADDR')} "
            f"MASTER_PORT={os.environ.get('MASTER_PORT')}): {(str(exc).strip() or type(exc).__name__).splitlines()[0]}. Check that every "
            f"rank was started and can reach the others; on a slow start raise --init-timeout-s"
        ) from exc
    if cfg.sharding in ("hybrid", "none"):
        shard = 1 if cfg.sharding == "none" else (cfg.hybrid_shard_size or local_world)
        mesh = init_device_mesh(device.type, (world // shard, shard), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    context = cfg.context_parallel
    groups = [dist.new_group(list(range(g, g + context))) for g in range(0, world, context)] if context > 1 else []
    context_group = groups[rank // context] if groups else None
    collectives = dt.timedelta(seconds=cfg.collective_timeout_s)
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)  # torch >= 2.3
    if set_timeout is None:
        log(
            f"WARNING: this torch cannot change a group's timeout: collectives keep --init-timeout-s {cfg.init_timeout_s}"
        )
    else:
        own = [context_group] if context_group is not None else []  # torch refuses a group this rank is not in
        for group in {dist.group.WORLD, cpu_group, async_ckpt_group, *mesh.get_all_groups(), *own}:
            set_timeout(collectives, group)
    return Dist(rank, world, local_rank, local_world, device, mesh, cpu_group, async_ckpt_group, context, context_group)


def restart_safe_store(rank: int, world: int, local_world: int, timeout: dt.timedelta) -> Any:
    """The key-value store the process group connects through, or None for init_process_group's own (env://).

    torchrun (torch 2.4+) shares its rendezvous TCPStore with the workers and keeps it across `--max-restarts`
    restarts, while the workers' keys carry no attempt number: a restarted group read the addresses its dead
    predecessors had published and failed ("connectFullMesh ... Connection refused") or waited on them until the
    collective timeout. On one node every worker sees the same TORCHELASTIC_RESTART_COUNT, so the keys are put under
    it. Across nodes the agents count restarts differently (a node restarted for another's failure does not count
    it), so no prefix is safe there: the launch scripts set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a fresh store per
    restart) and a run without it gets a warning when restarts are allowed."""
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if not shared or attempt is None:
        return None
    if world != local_world:
        if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
            log(
                "WARNING: a multi-node run with torchrun --max-restarts and torchrun's shared store: a restart may "
                "fail to connect (stale keys of the dead workers). Export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
                "before torchrun on every node (scripts/multinode_launch.sh does)"
            )
        return None
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"fsdp_train/attempt_{attempt}", client)


def all_ranks_agree(flag: bool, d: Dist) -> bool:
    """True if any rank raised the flag. Runs on the gloo CPU group, so it never waits on the GPU."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=d.cpu_group)
    return bool(t.item())


def evaluation_cut_short(stop: StopRequest | None, d: Dist) -> bool:
    """An evaluation's check before each micro-batch: True, said once, when a stop was requested on any rank
    (Ctrl-C, SIGTERM), so the pass ends without figures and the run saves and exits; stop None: never (the last
    step's pass, which a rerun would not make up). Every rank calls it as often: it is a collective."""
    if stop is None or not all_ranks_agree(stop.requested, d):
        return False
    log("evaluation cut short by the stop request: no validation figures at this step")
    return True


def broadcast_object(obj: Any, d: Dist) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=d.cpu_group)
    return box[0]


# /proc/cpuinfo flags that give bf16 matmuls a vectorised path in torch's oneDNN (x86: AVX512-BF16, AMX, AVX-512
# core, AVX-NE-CONVERT; aarch64's Features: bf16); read only where torch cannot say itself
CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "avx512bw", "avx_ne_convert", "bf16"})


def cpu_flags_say_bf16(cpuinfo: str) -> bool | None:
    """Whether /proc/cpuinfo's text lists one of CPU_BF16_FLAGS; None when it lists no flags at all."""
    rows = (line.partition(":") for line in cpuinfo.splitlines())
    flags = {flag for key, _, value in rows if key.strip() in ("flags", "Features") for flag in value.split()}
    return bool(flags & CPU_BF16_FLAGS) if flags else None


def cpu_has_bf16_matmuls() -> bool | None:
    """Whether torch computes bf16 matmuls natively on this CPU: its own test (oneDNN's bf16 support), else the
    CPU's flags; None where neither can tell."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        pass
    try:
        return cpu_flags_say_bf16(Path("/proc/cpuinfo").read_text())
    except OSError:
        return None


def cpu_bf16_warning(
    precision: str, device: torch.device, native: Callable[[], bool | None] = cpu_has_bf16_matmuls
) -> str | None:
    """The warning for bf16 compute on a CPU where torch emulates bf16 matmuls (`native()` False); None elsewhere
    or where that is unknown. `native` is asked only for bf16 on a CPU."""
    if precision != "bf16" or device.type != "cpu" or native() is not False:
        return None
    return (
        "WARNING: --precision bf16 on a CPU without native bf16 matmuls (torch's oneDNN reports no bf16 support: "
        "no AVX512-BF16, AMX or AVX-512): torch emulates them, 5-80x slower than fp32 on the AMD EPYC measured "
        "(BENCHMARKS.md, GRPO at a real vocabulary); --precision fp32, what auto picks on a CPU, is faster here"
    )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


ERROR_GRACE_S = 15.0  # how long a rank other than 0 leaves the report of an error to rank 0


def report_error(message: str, exit_code: int) -> int:
    """One clear message from one rank; returns the exit code.

    An error every rank hits is reported by rank 0 alone: the other ranks wait to be stopped by torchrun,
    which ends every worker as soon as one fails; only an error rank 0 did not hit outlives the wait and is
    reported by the rank that hit it. Under torchrun the message also goes into the worker's error file
    (TORCHELASTIC_ERROR_FILE), which torchrun prints last, as the root cause, instead of "To enable traceback"."""
    if ENV_RANK != 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # StopRequest turned SIGTERM into a flag; now it must end us
        time.sleep(ERROR_GRACE_S)
    log(f"ERROR: {message}", all_ranks=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with contextlib.suppress(OSError):  # the format torch.distributed.elastic's ErrorHandler writes
            extra = {"py_callstack": message, "timestamp": str(int(time.time()))}
            Path(error_file).write_text(json.dumps({"message": {"message": message, "extraInfo": extra}}))
    return exit_code


PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_launcher() -> None:
    """A worker started by torchrun ends within seconds when torchrun itself dies (kill -9, the OOM killer):
    orphans would otherwise keep training unattended, beside the rerun. Linux sends SIGKILL the moment the
    parent dies (PR_SET_PDEATHSIG); a watchdog thread polling the parent pid covers other systems. Being killed
    never leaves a partial checkpoint: a save only becomes a step_N folder by its final atomic rename."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # not under torchrun: the user's shell is no launcher to follow
        return
    launcher = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    threading.Thread(target=_watch_launcher, args=(launcher,), name="launcher-watchdog", daemon=True).start()


def _watch_launcher(launcher: int) -> None:
    while os.getppid() == launcher:
        time.sleep(1.0)
    log(f"the launcher (torchrun, pid {launcher}) is gone: stopping this worker", all_ranks=True)
    os.kill(os.getpid(), signal.SIGKILL)


class StopRequest:
    """Once training has started (`training`), SIGTERM/SIGINT only set a flag; the ranks agree on it at the next step
    boundary, save and exit 0. Before (tokenising, loading, a DPO reference pass: minutes, with no step to save
    at), either stops at once, as a KeyboardInterrupt("SIGINT"/"SIGTERM"): the newest checkpoint is already on disk,
    and a preemption's SIGTERM would otherwise meet its SIGKILL while the run went on."""

    def __init__(self) -> None:
        global _STOP
        self.requested = False
        self.training = False
        self.first: int | None = None  # the signal that asked for the checkpoint
        self.at_once: int | None = None  # the signal before training that stops the run (raise_if_stopped)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)
        _STOP = self
        if sys.unraisablehook is not _quiet_dropped_interrupts:
            _HOOKS.append(sys.unraisablehook)
            sys.unraisablehook = _quiet_dropped_interrupts

    def start_training(self) -> None:
        """From here a signal stops at the next step boundary, after a checkpoint; one that came before stops now."""
        raise_if_stopped()
        self.training = True

    def _handle(self, signum: int, frame: Any) -> None:
        if not self.training:
            self.at_once = signum
            raise KeyboardInterrupt(signal.Signals(signum).name)
        # a second Ctrl-C means now; torchrun passes a second Ctrl-C on to its workers as SIGTERM, so after a Ctrl-C
        # any signal does (a scheduler's repeated SIGTERM still only asks for the checkpoint)
        if self.requested and signal.SIGINT in (signum, self.first):
            self.at_once = signum
            raise KeyboardInterrupt("SIGINT")
        self.requested, self.first = True, signum
        log(f"received {signal.Signals(signum).name}: will checkpoint at the end of this step and exit", all_ranks=True)


_STOP: StopRequest | None = None  # the run's (the last one made)


_HOOKS: list[Callable[[Any], None]] = []  # the unraisable hook in place before the run's (at most one)


def _quiet_dropped_interrupts(unraisable: Any) -> None:
    """A KeyboardInterrupt Python drops is no error to print with a traceback: raise_if_stopped acts on it."""
    if not isinstance(unraisable.exc_value, KeyboardInterrupt):
        (_HOOKS[-1] if _HOOKS else sys.__unraisablehook__)(unraisable)


def clear_stop_request() -> None:
    """The run is over: its signals no longer stop anything in this process (an in-process caller's next run)."""
    global _STOP
    _STOP = None
    if sys.unraisablehook is _quiet_dropped_interrupts and _HOOKS:
        sys.unraisablehook = _HOOKS.pop()


# What gloo and NCCL say when the other end of a collective is gone (killed, out of memory): the survivor's error
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "communicator was aborted")


def peer_lost(exc: BaseException) -> bool:
    """Whether `exc` is a collective failing because another process of the launch died: its cause is that
    process's (torchrun's summary names it), and this one's traceback only buried it."""
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in PEER_LOST)


def stopped_at_once() -> int | None:
    """The signal that stopped this process at once (before training, or a second Ctrl-C in it), or None: an error
    raised since, by a save or a collective it cut short or by a peer it stopped too, is that stop, not a fault."""
    return _STOP.at_once if _STOP is not None else None


def raise_if_stopped() -> None:
    """A signal before training raises KeyboardInterrupt where the run is, but Python drops one raised inside a
    weakref callback or a __del__ ("Exception ignored in ..."), and the run would go on and train: the token
    cache's loops (tokenising, the other ranks' wait for it) and the start-up's end (StopRequest.start_training)
    look at the flag the signal left too."""
    if _STOP is not None and _STOP.at_once is not None and not _STOP.training:
        raise KeyboardInterrupt(signal.Signals(_STOP.at_once).name)


def reshard_all(root: torch.nn.Module) -> None:
    """A no-grad forward leaves the FSDP units that do not reshard after forward (the last decoder layer) gathered,
    with their unsharded parameters registered: the optimizer, built next, must see the sharded ones."""
    from torch.distributed.fsdp import FSDPModule

    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@contextlib.contextmanager
def eagerly() -> Iterator[None]:
    """Compiled code (--compile on's decoder layers) runs eagerly inside: the start-up probes, evaluation and
    sample generation run other shapes than the training step, and compiling them too would turn the training
    graph dynamic and spend the recompile limit."""
    with torch.compiler.set_stance("force_eager"):
        yield
