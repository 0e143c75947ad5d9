"""Tensor parallelism: the compact model's attention heads and MLP columns split over N processes (ranks).

- ``Shard`` (rank, size) slices one layer's weights, in whatever form they come (dense float tensors, Int8Weight,
  Int4Weight, a GGUF tensor's own blocks, pieces of several types), before make_linear quantizes or packs them:
  - column split (the outputs, no communication): qkv by heads (rank r: its hq/N query heads' rows, its hk/N key
    heads' rows and value heads' rows, [q | k | v]; its bias likewise), gate_up by intermediate columns (rank r:
    its slice of the gate rows then its slice of the up rows, [gate_r | up_r]);
  - row split (the inputs, then one all-reduce of the partial sums): o (its inputs are the local heads' attention
    outputs) and down (the local intermediate slice); their bias is added on rank 0 only. An input split must keep
    the blocks of a quantized weight whole (K/N a multiple of 32 for the int4/int8 groups and the legacy GGUF
    types, 256 for the k-quants): otherwise the start is refused, naming the tensor, its type and N.
  The embedding, the norms and the output head are replicated; only rank 0 computes logits. Each rank's KV cache
  holds its kv_heads/N heads.
- ``Group``: the ranks' gloo process group over a TCP store on loopback; ``all_reduce`` is what the model calls.
- Rank 0 is the engine process: ``start_group`` starts ranks 1..N-1 as fresh interpreters (``RankProcess``: the
  subprocess module, since multiprocessing gives a daemon process such as the engine no children), and
  ``GroupRunner`` wraps its ModelRunner: every call that touches the model or the KV cache goes to the other ranks
  first (a socket pair each, ``Channel``: the method's name and its small list arguments, pickled), then runs here,
  so every rank enters the same forwards and collectives in lockstep. ``run_rank`` is the other ranks' loop.
- Failure: a rank that dies takes the group down. Rank 0 watches the other ranks' sentinels from a thread and
  exits at once when one ends (its web worker then fails the open requests and starts a fresh group); a failure
  in rank 0's own share of a step (or a collective past the group's timeout) raises ``GroupLost``, which no step
  catches, so the process exits the same way. The other ranks die with rank 0 (lifeline.die_with_parent).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing.connection
import os
import pickle
import socket
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from ..kernels.quant import BlockWeight, Int4Weight, Int8Weight, StackedWeight, block_type
from .plan import tp_refusal

log = logging.getLogger(__name__)

GROUP_TIMEOUT = 300.0  # seconds a collective (or the start's rendezvous) may wait for the other ranks: a backstop


class GroupLost(BaseException):
    """The ranks are no longer in lockstep (a rank died, or a step failed part-way on this one): the engine process
    must end so that its web worker starts a fresh group. A BaseException, so that no step's error handling, which
    fails the running requests and goes on, can keep a broken group serving."""


# the shard and the weight slicing
def rows_of(w) -> int:
    """Output rows of a weight in any of its forms."""
    if isinstance(w, torch.Tensor):
        return w.shape[0]
    if isinstance(w, BlockWeight):
        return w.raw.shape[0]
    if isinstance(w, StackedWeight):
        return sum(rows_of(p) for p in w.pieces)
    return w.q.shape[0]


def take_rows(w, index: torch.Tensor):
    """Output rows ``index`` (ascending) of a weight in any of its forms, copied: rows are independent in all."""
    if isinstance(w, torch.Tensor):
        return w[index].contiguous()
    if isinstance(w, StackedWeight):
        pieces, start = [], 0
        for p in w.pieces:
            n = rows_of(p)
            mine = index[(index >= start) & (index < start + n)] - start
            if len(mine):
                pieces.append(take_rows(p, mine))
            start += n
        return pieces[0] if len(pieces) == 1 else StackedWeight(pieces)
    return w.map_rows(lambda t: t[index].contiguous())


def block_of(w, dense: tuple[int, str] | None = None) -> tuple[int, str]:
    """(inputs per block, type name) of a weight's form: the inputs that share a scale and stay whole. dense: the
    blocks make_linear quantizes a float weight into (Shard.dense_block), else its dtype's 1."""
    if isinstance(w, torch.Tensor):
        return dense if dense and dense[0] > 1 else (1, str(w.dtype).removeprefix("torch."))
    if isinstance(w, Int4Weight):
        return 32, "int4"
    if isinstance(w, Int8Weight):
        k, groups = w.q.shape[1], w.s.shape[1]
        return (1 if groups == 1 else k // groups), "int8"  # one scale per output channel: any input split keeps it
    name, weights, _ = block_type(w.ggml_type)
    return weights, name


def take_columns(w, start: int, end: int, name: str, size: int, dense: tuple[int, str] | None = None):
    """Inputs start..end-1 of every row of a weight in any of its forms (a rank's share of a row-split layer, of
    ``size`` ranks); ValueError naming the tensor when the share does not keep the form's blocks whole (dense: the
    blocks a float weight is quantized into afterwards)."""
    if isinstance(w, StackedWeight):
        return StackedWeight([take_columns(p, start, end, name, size, dense) for p in w.pieces])
    block, kind = block_of(w, dense)
    if start % block or end % block:
        k = end - start
        raise ValueError(
            f"--tensor-parallel-size {size}: {name} ({kind}, {k * size} inputs per row) would split "
            f"into {k} inputs per rank, not a whole number of its {block}-weight blocks; choose a size "
            f"that keeps them whole"
        )
    if isinstance(w, torch.Tensor):
        return w[:, start:end].contiguous()
    if isinstance(w, Int4Weight):
        return Int4Weight(
            *(
                t[:, a:b].contiguous()
                for t, a, b in (
                    (w.q, start // 2, end // 2),
                    (w.d, start // 32, end // 32),
                    (w.m, start // 32, end // 32),
                )
            )
        )
    if isinstance(w, Int8Weight):
        s = w.s if w.s.shape[1] == 1 else w.s[:, start // block : end // block]
        return Int8Weight(w.q[:, start:end].contiguous(), s.contiguous())
    per_block = block_type(w.ggml_type)[2]
    raw = w.raw[:, start // block * per_block : end // block * per_block].contiguous()
    return BlockWeight(raw, w.ggml_type, end - start)


@dataclasses.dataclass(frozen=True)
class Shard:
    """One rank's share of the model: rank ``rank`` of ``size``; quantize and group: the plan's, which say the
    blocks make_linear quantizes a float weight's inputs into after the split."""

    rank: int
    size: int
    quantize: str = "none"
    group: int | None = None

    @property
    def dense_block(self) -> tuple[int, str]:
        """(inputs per block, name) of the quantization a float weight gets after the split: int4's blocks of 32,
        int8's groups (per output channel from a folder: any split keeps them), none's 1."""
        if self.quantize == "int4":
            return 32, "int4"
        return (self.group or 1, "int8") if self.quantize == "int8" else (1, "none")

    @classmethod
    def of(cls, plan, rank: int) -> Shard:
        """Rank ``rank``'s share of the group the plan runs."""
        return cls(rank, plan.tp, plan.quantize, plan.group)

    def local(self, spec):
        """The ModelSpec as this rank runs it: its own heads and key/value heads."""
        return dataclasses.replace(spec, heads=spec.heads // self.size, kv_heads=spec.kv_heads // self.size)

    def split_layer(self, w: dict, spec, layer: int) -> dict:
        """One layer's weights by role (compact.build_compact's dict) with qkv and gate_up split by their outputs
        and o and down by their inputs; o's bias kept on rank 0 only (it is added once, after the all-reduce)."""
        refusal = tp_refusal(self.size, spec.heads, spec.kv_heads)
        if refusal:
            raise ValueError(refusal)
        if spec.family.parallel and w.get("post_attn_norm") is not None:
            raise ValueError("--tensor-parallel-size: a norm after attention in a parallel block cannot be split")
        n, r, d = self.size, self.rank, spec.head_dim
        hq, hk = spec.heads, spec.kv_heads
        lq, lk = hq // n, hk // n

        def span(start: int, count: int) -> torch.Tensor:
            return torch.arange(start + r * count, start + (r + 1) * count)

        qkv_rows = torch.cat([span(0, lq * d), span(hq * d, lk * d), span((hq + hk) * d, lk * d)])
        up_rows = rows_of(w["gate_up"])
        inter = up_rows // 2 if spec.family.gated else up_rows
        if inter % n:
            raise ValueError(f"--tensor-parallel-size {n}: the MLP's {inter} intermediate columns do not divide by {n}")
        li = inter // n
        gate_up_rows = torch.cat([span(0, li), span(inter, li)]) if spec.family.gated else span(0, li)
        name = f"layer {layer}'s"
        return {
            **w,
            "qkv": take_rows(w["qkv"], qkv_rows),
            "qkv_bias": None if w["qkv_bias"] is None else w["qkv_bias"][qkv_rows].contiguous(),
            "o": take_columns(w["o"], r * lq * d, (r + 1) * lq * d, f"{name} attention output", n, self.dense_block),
            "o_bias": w["o_bias"] if r == 0 else None,
            "gate_up": take_rows(w["gate_up"], gate_up_rows),
            "down": take_columns(w["down"], r * li, (r + 1) * li, f"{name} MLP down projection", n, self.dense_block),
        }


def threads_per_rank(torch_threads: int, size: int) -> int:
    """torch threads for each rank (0: torch's default): the flag's, else the cores shared out among the ranks."""
    if torch_threads or size == 1:
        return torch_threads
    return max(1, (os.cpu_count() or 1) // size)


# the process group
class Group:
    """One rank's side of the ranks' gloo process group (torch.distributed's default group of this process, which
    serves nothing else), over a TCP store on loopback (rank 0 holds the store). ``close`` ends it, so that one
    process may run several groups one after another (the in-process tests)."""

    def __init__(self, rank: int, size: int, store, timeout: float = GROUP_TIMEOUT):
        import torch.distributed as dist

        # gloo takes its network interface from the environment (torch's documented setting): the ranks share this
        # machine, so loopback unless the operator named another
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timedelta(seconds=timeout))
        self.rank, self.size, self.tcp_store = rank, size, store  # rank 0's store lives as long as its group

    @staticmethod
    def store(size: int, port: int = 0, timeout: float = GROUP_TIMEOUT):
        """Rank 0's store on a free loopback port (port 0), or another rank's connection to it."""
        import torch.distributed as dist

        return dist.TCPStore("127.0.0.1", port, size, port == 0, timedelta(seconds=timeout), wait_for_workers=False)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's t, in place (t made contiguous first)."""
        import torch.distributed as dist

        t = t.contiguous()
        dist.all_reduce(t)
        return t

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class Channel:
    """Pickled messages over one end of a socket pair, in order; ``recv`` raises EOFError once the other end is
    gone. Waiting on ``sock`` tells a message has come only while nothing is buffered (a starting rank's word)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._read, self._write = sock.makefile("rb"), sock.makefile("wb")

    def send(self, message: Any) -> None:
        pickle.dump(message, self._write, pickle.HIGHEST_PROTOCOL)
        self._write.flush()

    def recv(self) -> Any:
        try:
            return pickle.load(self._read)
        except pickle.UnpicklingError as exc:  # the other end ended part-way through a message
            raise EOFError(str(exc)) from exc

    def close(self) -> None:
        for f in (self._read, self._write, self.sock):
            try:
                f.close()
            except OSError:
                pass


class RankProcess:
    """Rank ``rank`` (1..N-1) as a fresh interpreter started by rank 0, holding the other end of a socket pair,
    whose first message is its start arguments. ``sentinel`` (a pidfd) becomes readable when it ends."""

    def __init__(self, rank: int, start: tuple):
        ours, theirs = socket.socketpair()
        code = "import sys; from inference_api.engine.parallel import rank_main; rank_main(int(sys.argv[1]))"
        # the package's own folder first, as multiprocessing's spawn hands its children the parent's path
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (_PACKAGE_ROOT, os.environ.get("PYTHONPATH"))))}
        with theirs:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code, str(theirs.fileno())], pass_fds=(theirs.fileno(),), env=env
            )
        self.rank, self.pid = rank, self.proc.pid
        self.sentinel = os.pidfd_open(self.pid)
        self.channel = Channel(ours)
        self.channel.send(start)

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def join(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        self.proc.kill()


_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder that holds inference_api


# the other ranks
def rank_main(fd: int) -> None:
    """Process entry of ranks 1..N-1 (RankProcess): the socket inherited as ``fd``, whose first message is
    run_rank's arguments."""
    channel = Channel(socket.socket(fileno=fd))
    config, plan, rank, port, gguf, model_dir, parent = channel.recv()
    run_rank(config, plan, rank, port, gguf, model_dir, parent, channel)


def run_rank(config, plan, rank: int, port: int, gguf, model_dir, parent: int, conn: Channel) -> None:
    """Ranks 1..N-1: join the group, build this rank's shard of the model and cache through the runner's own build
    path, then run rank 0's calls until it closes the channel or says close. ``parent``: rank 0's process id."""
    from .lifeline import die_with_parent, settle_after_load
    from .model_runner import load_runner

    die_with_parent(parent)
    logging.basicConfig(
        level=config.log_level.upper(), format=f"%(asctime)s engine rank {rank} %(levelname)s %(message)s"
    )
    try:
        threads = threads_per_rank(config.torch_threads, plan.tp)
        if threads:
            torch.set_num_threads(threads)
        group = Group(rank, plan.tp, Group.store(plan.tp, port))
        kernels = None
        if plan.cpu_kernels:
            from ..kernels import load_kernels

            kernels = load_kernels(config.model_cache_dir, level=plan.cpu_level)
        runner = load_runner(config, plan, kernels, gguf, model_dir, Shard.of(plan, rank), group.all_reduce)
        settle_after_load()
    except Exception as exc:
        log.exception("rank %d failed to start", rank)
        conn.send(("failed", f"rank {rank}: {exc}"))
        sys.exit(1)
    conn.send(("ready", None))
    while True:
        try:
            name, args = conn.recv()
        except EOFError:  # rank 0 is gone
            return
        if name == "close":
            return
        try:
            getattr(runner, name)(*args)
        except Exception:
            log.exception("rank %d: %s failed; the group goes down", rank, name)
            sys.exit(1)


class GroupRunner:
    """Rank 0's runner: the calls that touch the model or the KV cache go to every other rank first, then run on
    this rank's ModelRunner (whose model computes the logits); the rest is read from it."""

    def __init__(self, runner, group: Group, ranks: list[RankProcess]):
        self.runner, self.group, self.ranks = runner, group, ranks
        self.device, self.vocab_size, self.cache, self.plan = (
            runner.device,
            runner.vocab_size,
            runner.cache,
            runner.plan,
        )
        self.closing = threading.Event()
        threading.Thread(target=self._watch, name="rank-watch", daemon=True).start()

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(p.pid for p in self.ranks)

    def _watch(self) -> None:
        """A rank that ends takes the group down: this process exits at once, busy or idle, so that the web worker
        fails the open requests and starts a fresh group (the other ranks die with this one)."""
        ended = multiprocessing.connection.wait([p.sentinel for p in self.ranks])
        if self.closing.is_set():
            return
        p = next(p for p in self.ranks if p.sentinel in ended)
        log.critical("tensor-parallel rank %d ended (exit code %s): the engine group goes down", p.rank, p.exitcode)
        os._exit(3)

    def _call(self, name: str, *args):
        try:
            for p in self.ranks:
                p.channel.send((name, args))
            return getattr(self.runner, name)(*args)
        except Exception as exc:
            log.exception("rank 0: %s failed; the group goes down", name)
            raise GroupLost(f"{name} failed on rank 0: {exc}") from exc

    def prefill(self, rows, chunks, starts):
        return self._call("prefill", rows, chunks, starts)

    def decode(self, rows, tokens, positions):
        return self._call("decode", rows, tokens, positions)

    def score(self, row, ids, start=0):
        return self._call("score", row, ids, start)

    def copy_prefix(self, src, dst, length):
        return self._call("copy_prefix", src, dst, length)

    def holds(self, cached: int, length: int) -> bool:
        return self.runner.holds(cached, length)

    @property
    def decode_ahead(self) -> None:
        return None  # no CUDA graphs across ranks: each step is launched when asked

    def close(self, timeout: float = 10.0) -> None:
        """End the other ranks (they leave their loop), killing any that does not within the timeout."""
        self.closing.set()
        for p in self.ranks:
            try:
                p.channel.send(("close", ()))
            except OSError:
                pass
        for p in self.ranks:
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join(timeout)
            p.channel.close()
        self.group.close()


def _status(p: RankProcess) -> tuple[str, str | None]:
    """A starting rank's word: ("ready", None), or ("failed", why) when it said so or ended without a word."""
    try:
        if multiprocessing.connection.wait([p.channel.sock], 0):
            return p.channel.recv()
    except (EOFError, OSError):
        pass
    p.join(5)
    return "failed", f"rank {p.rank} exited (code {p.exitcode})"


def _join(store, size: int, ranks: list[RankProcess]) -> Group:
    """Rank 0's side of the group's rendezvous, which fails as soon as a rank ends before joining it (the
    rendezvous alone would wait for its whole timeout)."""
    joined: dict = {}

    def join() -> None:
        try:
            joined["group"] = Group(0, size, store)
        except Exception as exc:
            joined["error"] = exc

    thread = threading.Thread(target=join, name="rank-join", daemon=True)
    thread.start()
    while thread.is_alive():
        ended = multiprocessing.connection.wait([p.sentinel for p in ranks], timeout=0.2)
        if ended:
            _, message = _status(next(p for p in ranks if p.sentinel in ended))
            raise RuntimeError(f"tensor-parallel {message} before the group formed")
    if "error" in joined:
        raise joined["error"]
    return joined["group"]


def start_group(config, plan, kernels, gguf, model_dir):
    """Rank 0's side of a group of plan.tp ranks: start ranks 1..N-1, join the group, build this rank's shard, wait
    for every rank to be built; a GroupRunner over rank 0's ModelRunner. RuntimeError when a rank fails to start
    (its message), the ranks already started ended."""
    from .model_runner import load_runner

    store = Group.store(plan.tp)
    ranks: list[RankProcess] = []
    group = None
    try:
        for rank in range(1, plan.tp):
            ranks.append(RankProcess(rank, (config, plan, rank, store.port, gguf, model_dir, os.getpid())))
        group = _join(store, plan.tp, ranks)
        runner = load_runner(config, plan, kernels, gguf, model_dir, Shard.of(plan, 0), group.all_reduce)
        for p in ranks:
            multiprocessing.connection.wait([p.channel.sock, p.sentinel])
            status, message = _status(p)
            if status != "ready":
                raise RuntimeError(f"tensor-parallel {message}")
    except BaseException:
        for p in ranks:
            p.kill()
            p.join(10)
        if group is not None:
            group.close()
        raise
    return GroupRunner(runner, group, ranks)
