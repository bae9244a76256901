"""Start and stop a distributed run: read torchrun's environment, choose backend and device, seed.

    info = nanodist.init()          # under torchrun, or plain `python script.py` (world size 1)
    print0(f"{info.world_size} ranks on {info.backend}")
    ...
    nanodist.shutdown()

Everything else in nanodist asks `dist_info()` instead of `init()`'s result, so it works with any
initialised default process group, whether nanodist created it or not.
"""
from __future__ import annotations

import datetime
import logging
import os
import random
import socket
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from . import group as _group

BACKENDS = ("gloo", "nccl")
DEFAULT_TIMEOUT_S = 300.0
# Per-rank data seeds are spaced far apart so that seed=1 on rank 0 never equals seed=0 on rank 1.
_DATA_SEED_STRIDE = 1_000_003


class DistConfigError(RuntimeError):
    """The distributed set-up is wrong (environment, backend, device); the message says how to fix it."""


def _one_line_for_config_errors(kind, value, tb, _previous=sys.__excepthook__):
    """A script that ends on a DistConfigError (wrong backend, more nccl ranks than GPUs...) prints its reason as
    one line, not a traceback through nanodist's internals: the message already says what to do. Anything else,
    and anything caught (tests, notebooks), is untouched. Installed by init(), the call that raises them."""
    if isinstance(value, DistConfigError):
        rank = os.environ.get("RANK")
        print(f"nanodist{f' (rank {rank})' if rank is not None else ''}: {value}", file=sys.stderr, flush=True)
        return
    _previous(kind, value, tb)


@dataclass(frozen=True)
class DistInfo:
    """Who this process is in the run. Immutable; returned by `init()` and `dist_info()`."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    backend: str = "gloo"
    device: torch.device = torch.device("cpu")
    seed: int = 0

    @property
    def is_main(self) -> bool:
        """True on global rank 0: the rank that logs, writes results and saves checkpoints."""
        return self.rank == 0

    @property
    def data_seed(self) -> int:
        """A seed that differs on every rank, for data order and augmentation (use it in a generator of its own)."""
        return self.seed * _DATA_SEED_STRIDE + self.rank + 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def group(self) -> "_group.Group":
        """The world as a nanodist Group (what every module's `group=None` means)."""
        return _group.Group.world()


_info: DistInfo | None = None  # set by init(), cleared by shutdown()
_owns_group = False  # whether init() created the default process group (then shutdown() destroys it)


# ----------------------------------------------------------------------------- environment

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env_int(env, name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None:
        if default is None:
            raise DistConfigError(f"environment variable {name} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise DistConfigError(f"environment variable {name}={raw!r} is not an integer") from None


def read_env(env=None) -> dict | None:
    """Parse the variables torchrun sets. Returns None when none is set (a plain `python` run).

    Raises DistConfigError naming the missing or inconsistent variables when only some are set.
    """
    env = os.environ if env is None else env
    present = [k for k in _TORCHRUN_VARS + ("LOCAL_RANK",) if k in env]
    if not present:
        return None
    missing = [k for k in _TORCHRUN_VARS if k not in env]
    if missing:
        raise DistConfigError(
            f"incomplete distributed environment: {', '.join(present)} set but {', '.join(missing)} "
            f"missing. Launch with torchrun (e.g. `torchrun --nproc_per_node=2 script.py`), set all of "
            f"{', '.join(_TORCHRUN_VARS)}, or unset them all to run as a single process."
        )
    rank, world = _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE")
    # Hand-made launches (mp.spawn, SLURM scripts) often set only the global variables: one node then.
    local_rank = _env_int(env, "LOCAL_RANK", rank)
    local_world = _env_int(env, "LOCAL_WORLD_SIZE", world)
    if world < 1:
        raise DistConfigError(f"WORLD_SIZE={world} must be at least 1")
    if not 0 <= rank < world:
        raise DistConfigError(f"RANK={rank} is outside 0..WORLD_SIZE-1 = 0..{world - 1}")
    if not 0 <= local_rank < local_world:
        raise DistConfigError(f"LOCAL_RANK={local_rank} is outside 0..LOCAL_WORLD_SIZE-1 = 0..{local_world - 1}")
    port = _env_int(env, "MASTER_PORT")
    if not 0 < port < 65536:
        raise DistConfigError(f"MASTER_PORT={port} is not a TCP port (1..65535)")
    node_rank = _env_int(env, "GROUP_RANK", rank // local_world)
    return dict(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
                node_rank=node_rank, master_addr=env["MASTER_ADDR"], master_port=port)


def choose_backend(requested: str | None, local_world_size: int) -> str:
    """nccl when CUDA has a GPU for every local rank, otherwise gloo; `requested` or NANODIST_BACKEND win."""
    requested = requested or os.environ.get("NANODIST_BACKEND") or None
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested is None:
        if n_gpu >= local_world_size and n_gpu > 0:
            return "nccl"
        if n_gpu > 0:  # a GPU machine training on the CPU deserves a word, not silence
            get_logger().warning(
                f"{n_gpu} GPU(s) visible but {local_world_size} local ranks: nccl needs one GPU per rank, so "
                f"this run uses gloo on the CPU. Launch with --nproc_per_node={n_gpu} to train on the GPUs, or set "
                f"NANODIST_BACKEND=gloo to silence this.")
        return "gloo"
    requested = requested.lower()
    if requested not in BACKENDS:
        raise DistConfigError(f"unknown backend {requested!r}: use one of {', '.join(BACKENDS)}")
    if requested == "nccl":
        if n_gpu == 0:
            raise DistConfigError("backend 'nccl' needs CUDA GPUs and this machine has none: use backend='gloo'")
        if n_gpu < local_world_size:
            raise DistConfigError(
                f"backend 'nccl' needs one GPU per local rank: {local_world_size} local ranks but {n_gpu} GPU(s). "
                f"Launch with --nproc_per_node={n_gpu}, or use backend='gloo' to share GPUs/CPU."
            )
    return requested


def choose_device(requested: str | torch.device | None, backend: str, local_rank: int) -> torch.device:
    """cuda:<local_rank> for nccl, cpu for gloo; `requested` or NANODIST_DEVICE win ('cpu', 'cuda')."""
    requested = requested or os.environ.get("NANODIST_DEVICE") or None
    if requested is None:
        requested = "cuda" if backend == "nccl" else "cpu"
    dev = torch.device(requested)
    if dev.type == "cpu":
        if backend == "nccl":
            raise DistConfigError("backend 'nccl' works on CUDA tensors only: use device='cuda' or backend='gloo'")
        return torch.device("cpu")
    if dev.type != "cuda":
        raise DistConfigError(f"unsupported device {requested!r}: use 'cpu' or 'cuda'")
    if not torch.cuda.is_available():
        raise DistConfigError(f"device {requested!r} requested but CUDA is not available here: use device='cpu'")
    n_gpu = torch.cuda.device_count()
    # Several gloo ranks may share one GPU; nccl was already checked to have one GPU per local rank.
    index = dev.index if dev.index is not None else local_rank % n_gpu
    if index >= n_gpu:
        raise DistConfigError(f"device {requested!r} requested but only {n_gpu} GPU(s) are visible")
    return torch.device("cuda", index)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously); a no-op on the CPU. Use it around timings."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and every CUDA device) with one seed."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """This process's random generators, as plain values and tensors (torch.load(weights_only=True) reads them):
    python's `random`, numpy's global generator, torch's CPU generator and every CUDA device's."""
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(mt), gauss], "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos),
                                                             int(has_gauss), float(cached)],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what rng_state() captured."""
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.int64).astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _timeout_s(timeout: float | None) -> float:
    """The timeout in seconds: the argument, else NANODIST_TIMEOUT, else 300; a positive, finite number."""
    source = "timeout"
    if timeout is None:
        raw = os.environ.get("NANODIST_TIMEOUT")
        source = f"NANODIST_TIMEOUT={raw!r}"
        try:
            timeout = float(raw) if raw else DEFAULT_TIMEOUT_S
        except ValueError:
            raise DistConfigError(f"NANODIST_TIMEOUT={raw!r} is not a number of seconds") from None
    timeout = float(timeout)
    if not (timeout > 0 and timeout != float("inf")):
        raise DistConfigError(f"{source if source != 'timeout' else f'timeout={timeout!r}'} must be a positive number "
                              f"of seconds (how long the rendezvous and each collective may wait), e.g. 300")
    return timeout


# ----------------------------------------------------------------------------- init / shutdown

def stack_dumps_on_sigusr1() -> bool:
    """`kill -USR1 <pid>` then prints every thread's Python stack to stderr (faulthandler), and the process goes
    on: what a timed-out nanodist.launch asks of each rank before it kills them (Chapter 7: which rank hangs,
    and where). A program's own SIGUSR1 handler is left alone. Returns whether it is registered."""
    import faulthandler
    import signal
    if not hasattr(signal, "SIGUSR1"):  # Windows
        return False
    if signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL:  # a handler of Python's, or None: one set from C
        return False
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    except (ValueError, RuntimeError, AttributeError, OSError):  # a stderr with no file descriptor (a notebook's)
        return False
    return True


def init(backend: str | None = None, device: str | torch.device | None = None, seed: int = 0,
         timeout: float | None = None) -> DistInfo:
    """Join the run that torchrun started (or become a world of one) and return who we are.

    - backend: 'gloo' or 'nccl' (default: nccl when every local rank has a GPU, else gloo; env NANODIST_BACKEND)
    - device: 'cpu' or 'cuda' (default: cuda:<local_rank> with nccl, else cpu; env NANODIST_DEVICE)
    - seed: python/numpy/torch are seeded with `seed` on every rank, so models initialise identically;
      `info.data_seed` differs per rank for data order and augmentation.
    - timeout: seconds a collective or the rendezvous may wait before failing (default 300; env NANODIST_TIMEOUT).

    Idempotent: a second call returns the same DistInfo. If a default process group already exists
    (created by someone else), init() adopts it. Errors are DistConfigError with what to do.
    """
    global _info, _owns_group
    if _info is not None and dist.is_initialized():
        return _info
    if sys.excepthook is sys.__excepthook__:  # a script's own hook (or IPython's) is left alone
        sys.excepthook = _one_line_for_config_errors
    stack_dumps_on_sigusr1()
    timeout_s = _timeout_s(timeout)
    if dist.is_initialized():  # someone else made the group: describe it, do not own it
        _info = _describe_group(device, seed)
        _group.set_world_device(_info.device)
        seed_everything(seed)
        return _info
    env = read_env()
    world = env["world_size"] if env else 1
    local_world = env["local_world_size"] if env else 1
    local_rank = env["local_rank"] if env else 0
    backend = choose_backend(backend, local_world)
    dev = choose_device(device, backend, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    pg_timeout = datetime.timedelta(seconds=timeout_s)
    if env is None:
        # A world of one still gets a process group, so collectives run unchanged in `python lab.py`.
        # On a GPU it names its device (device_id), as the ranks of a launched run do: barrier() and nccl then know
        # which GPU is theirs instead of guessing.
        one = {"device_id": dev} if dev.type == "cuda" else {}
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=pg_timeout, **one)
    else:
        _die_with_launcher()
        _rendezvous(backend, env, dev, pg_timeout)
    _owns_group = True
    _group.set_world_device(dev)
    _info = DistInfo(
        rank=env["rank"] if env else 0, local_rank=local_rank, world_size=world, local_world_size=local_world,
        node_rank=env["node_rank"] if env else 0, backend=backend, device=dev, seed=seed,
    )
    seed_everything(seed)
    return _info


WAIT_NOTICE_S = 10.0  # a rank still waiting for its peers says so after this long, and every 30 s after
JOIN_GRACE_S = 3.0  # past the timeout, a rank that torch still keeps waiting gives up by itself


def _die_with_launcher() -> None:
    """A launched rank (torchrun's worker) asks the kernel for SIGTERM when its parent -- the torchrun agent --
    dies (Linux's PR_SET_PDEATHSIG): an agent killed by SIGKILL runs no clean-up, and its workers would train on
    to the end. (nanodist.launch guards its own tree the same way, through nanodist.reaper.) Elsewhere: nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the signal was armed
        raise DistConfigError("this rank's launcher (torchrun's agent) has already exited: stopping")


def _rendezvous(backend: str, env: dict, dev: torch.device, timeout: datetime.timedelta) -> None:
    addr, port = env["master_addr"], env["master_port"]
    kwargs = dict(backend=backend, init_method="env://", timeout=timeout)
    if dev.type == "cuda":
        kwargs["device_id"] = dev  # lets nccl bind eagerly: failures show here, not at the first collective
    joined = threading.Event()
    start = time.monotonic()

    limit = timeout.total_seconds()

    def say_that_we_wait():  # silence for minutes looks like a hang; a line a while says what it is
        delay = min(WAIT_NOTICE_S, limit)
        while not joined.wait(delay):
            waited = time.monotonic() - start
            if waited >= limit + JOIN_GRACE_S:
                # torch's store client retries its connection past the timeout it was given (a lone rank 1 took
                # 28 s of a 10 s timeout): the limit is kept here, where the message says it
                print(f"nanodist (rank {env['rank']}): rank {env['rank']} could not join the process group at "
                      f"MASTER_ADDR={addr} MASTER_PORT={port} within {limit:.0f} s (NANODIST_TIMEOUT): gave up "
                      f"after {waited:.0f} s. Check that every rank was started, that rank 0 can listen on that "
                      f"address and port, and that the other hosts can reach it (firewall, MASTER_ADDR spelling).",
                      file=sys.stderr, flush=True)
                os._exit(1)  # the join is inside torch's C++ and cannot be interrupted from here
            others = env["world_size"] - 1
            print(f"[rank {env['rank']}] still waiting for the other {others} rank(s) of the run to join at "
                  f"MASTER_ADDR={addr} MASTER_PORT={port} ({waited:.0f} s so far; giving up after "
                  f"{limit:.0f} s, NANODIST_TIMEOUT). Were all {env['world_size']} ranks started?",
                  file=sys.stderr, flush=True)
            delay = min(30.0, max(0.5, limit + JOIN_GRACE_S - waited))

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # Under torchrun the agent hosts the store, and after a restart (--max-restarts) it is the same store with
        # the dead attempt's keys still in it: gloo would look up the old ranks' addresses and fail to connect.
        # Each attempt gets keys of its own.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.TCPStore(addr, int(port), env["world_size"], is_master=False, timeout=timeout)
        kwargs = {k: v for k, v in kwargs.items() if k != "init_method"}
        kwargs.update(store=dist.PrefixStore(f"/nanodist/attempt_{attempt}", store), rank=env["rank"],
                      world_size=env["world_size"])
    threading.Thread(target=say_that_we_wait, daemon=True).start()
    try:
        dist.init_process_group(**kwargs)
    except (RuntimeError, TimeoutError, ValueError, OSError) as e:
        text = str(e)
        if "EADDRINUSE" in text or "address already in use" in text.lower():
            raise DistConfigError(
                f"rank {env['rank']} could not listen on MASTER_ADDR={addr} MASTER_PORT={port}: address in use. "
                f"Choose another MASTER_PORT (or let nanodist.launch pick a free one)") from e
        raise DistConfigError(
            f"rank {env['rank']} could not join the process group at MASTER_ADDR={addr} MASTER_PORT={port} "
            f"within {limit:.0f} s (NANODIST_TIMEOUT; gave up after {time.monotonic() - start:.0f} s: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). "
            f"Check that every rank was started, that rank 0 can listen on that address and port, and that "
            f"the other hosts can reach it (firewall, MASTER_ADDR spelling)."
        ) from e
    finally:
        joined.set()


def _describe_group(device, seed: int) -> DistInfo:
    rank, world = dist.get_rank(), dist.get_world_size()
    env = os.environ
    local_rank = int(env.get("LOCAL_RANK", rank))
    local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    backend = str(dist.get_backend()).lower()
    backend = "nccl" if "nccl" in backend else "gloo" if "gloo" in backend else backend
    dev = choose_device(device, backend, local_rank) if backend in BACKENDS else torch.device("cpu")
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world, local_world_size=local_world,
                    node_rank=int(env.get("GROUP_RANK", rank // max(local_world, 1))), backend=backend,
                    device=dev, seed=seed)


def shutdown() -> None:
    """Leave the run cleanly: destroy the process group init() created. Safe to call twice."""
    global _info, _owns_group
    from . import diverge
    diverge.stop()  # its watchdog talks to the store: stopped before the store goes
    if _owns_group and dist.is_initialized():
        dist.destroy_process_group()
    _info, _owns_group = None, False
    _group.set_world_device(None)


def dist_info() -> DistInfo:
    """Who this process is, from init()'s record, any default process group, or else world size 1."""
    if _info is not None and dist.is_initialized():
        return _info
    if dist.is_available() and dist.is_initialized():
        return _describe_group(None, 0)
    return DistInfo()


def get_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", 0))


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


# ----------------------------------------------------------------------------- ports

_issued_ports: set[int] = set()
_port_lock = threading.Lock()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, never the same twice in this process."""
    with _port_lock:
        for _ in range(100):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _issued_ports:
                _issued_ports.add(port)
                return port
    raise RuntimeError("could not find a free TCP port on 127.0.0.1")


# ----------------------------------------------------------------------------- printing and logging

def print0(*args, **kwargs) -> None:
    """print() on global rank 0 only (every rank in a world of one)."""
    if get_rank() == 0:
        print(*args, **kwargs, flush=True)


class _RankFilter(logging.Filter):
    def __init__(self, all_ranks: bool):
        super().__init__()
        self.all_ranks = all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = get_rank()
        return self.all_ranks or record.rank == 0


def warn_if_differed(who: str, differ: list[str]) -> list[str]:
    """After Group.broadcast_from_first made every rank start from rank 0's model: say which tensors had differed
    (they would have trained a mixture of models) and what to do about it. Returns `differ`."""
    if differ:
        get_logger().warning(f"{who}: ranks started with different values for {len(differ)} tensor(s) "
                             f"({', '.join(differ[:5])}{', ...' if len(differ) > 5 else ''}); rank 0's were "
                             f"broadcast to all. Seed model init identically on every rank.")
    return differ


def get_logger(name: str = "nanodist", all_ranks: bool | None = None, level: int = logging.INFO) -> logging.Logger:
    """A logger whose lines start with `[rank R]`; only rank 0 emits unless all_ranks (or NANODIST_LOG_ALL_RANKS=1)."""
    explicit = all_ranks
    if all_ranks is None:
        all_ranks = os.environ.get("NANODIST_LOG_ALL_RANKS", "0") not in ("", "0", "false", "False")
    logger = logging.getLogger(name)
    logger.setLevel(level)
    logger.propagate = False
    ours = [h for h in logger.handlers if getattr(h, "_nanodist", False)]
    if ours and explicit is None:
        return logger  # configured already: keep the caller's choice of ranks
    for h in ours:
        logger.removeHandler(h)
    handler = logging.StreamHandler(sys.stdout)
    handler._nanodist = True
    handler.setFormatter(logging.Formatter("[rank %(rank)s] %(message)s"))
    handler.addFilter(_RankFilter(all_ranks))
    logger.addHandler(handler)
    return logger
