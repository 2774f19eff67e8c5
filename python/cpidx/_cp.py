"""IndexerCPDecode: the seed's context-parallel decode (vLLM MiniMax-M3 indexer), drop-in.

One instance per (rank, geometry, group) holds every buffer of a step, sized from maxima at
construction, so ``__call__`` allocates nothing and never synchronises: it can be captured in a
CUDA graph and replayed with new lengths. The exchange (the two all-gathers of a step) follows
``exchange`` and ``group``; ``self.exchange`` says which one runs ("peer", "nccl", "torch", or
"none" when ``world_size == 1``). See :class:`IndexerCPDecode` for the rule and the teardown.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import inspect
import itertools
import os
import threading
import time
import uuid
import warnings
import weakref
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from . import _C
from ._api import (BLOCK_SIZE, MAX_HEADS, MAX_QUERY_LEN, MAX_TOKENS, MAX_TOPK, MAX_WORLD_SIZE,
                   Decoder, HostGroupError, _as_bits, _cache_dtype_name, _capture_refusal,
                   _check_error_flag, _check_host_arrays, _current_stream, _device_current,
                   _native, _or_host_error_bits, _refuse_during_capture, _table_read, registry)

_DTYPES = {"bf16": "bf16", "bfloat16": "bf16", "fp8_e4m3": "fp8_e4m3",
           "float8_e4m3fn": "fp8_e4m3"}
_EXCHANGES = ("auto", "peer", "nccl", "torch")
_CACHE_DTYPES = ("bf16", "fp8_e4m3")  # a cache dtype's code in the step's agreement
# What the ranks of a step agree on besides its rows (the C++ reference's cp_decode agrees on
# the same): the call's query_len and scale, then the instance's settings. Ranks that differ in
# one of them would merge wrong ids without an error (or gather different sizes).
_PER_CALL_SETTINGS = ("query_len", "scale")
_AGREED_SETTINGS = _PER_CALL_SETTINGS + ("topk", "init_blocks", "local_blocks", "total_heads",
                                         "max_seq_len", "cache_dtype")

# How long a host group this library makes waits for a rank: to be made, and in each all-reduce
# (torch's default for its gloo groups: a rank may reach close() long after the others).
HOST_GROUP_TIMEOUT = datetime.timedelta(minutes=30)
# How long a rank's NCCL communicator waits at construction for the other ranks to join its init
# (the library's default, 10 min; None without the NCCL communicator built): a rank that fails
# after the construction's all_gather of verdicts, or whose process is gone, costs the others
# this, not a wait forever.
NCCL_INIT_TIMEOUT = (datetime.timedelta(seconds=_C.nccl_init_timeout_seconds)
                     if _C.has_nccl else None)

# Every constructed instance by its ``handle`` (torch.ops.cpidx.cp_decode takes the handle); an
# instance leaves when it is garbage-collected.
_HANDLES = itertools.count(1)
_BY_HANDLE: "weakref.WeakValueDictionary[int, IndexerCPDecode]" = weakref.WeakValueDictionary()

# What instances let go of while a live CUDA graph may still use it (their close() could not
# agree): kept until the process exits, as a graph may replay into it.
_KEPT_FOR_LIVE_GRAPHS: list = []
_EXCHANGE_BUFFERS = ("_q_local", "_q_gathered", "_q_full", "_keys", "_keys_gathered")
_AFTER_HOST_FAILURE = ("close() this instance on every rank and make a new one (over a new group "
                       "where the host group was the caller's own: it failed too)")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _resolve_device(device: Any) -> torch.device:
    """The device an instance runs on, one spelling each: ``"cuda"`` is the current CUDA device,
    ``"cpu:0"`` the CPU (tensors there say ``"cpu"``). Anything else is named as ``device``."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {device!r} ({e})") \
            from e
    if d.type not in ("cpu", "cuda"):  # meta, mps, xpu...: neither path runs there
        raise ValueError(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {str(d)!r}")
    if d.type == "cpu":
        return torch.device("cpu")
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return d


def _cache_dtype_key(cache_dtype: Any) -> Optional[str]:
    """``"bf16"`` or ``"fp8_e4m3"`` for any of their names (``torch.bfloat16`` too); None."""
    return _DTYPES.get(str(cache_dtype).replace("torch.", ""))


def _host_group_of(group: Any) -> Any:
    """The gloo group that ``group`` brings for the ranks to agree through, or None: the
    ``cpu_group`` of a vLLM GroupCoordinator, or ``group`` itself when it is a gloo group."""
    if isinstance(group, _C.Communicator) or group is None:
        return None
    cpu_group = getattr(group, "cpu_group", None)
    if cpu_group is not None:
        return cpu_group
    device_group = getattr(group, "device_group", group)
    return device_group if "gloo" in str(dist.get_backend(device_group)).lower() else None


def _host_token() -> Optional[str]:
    """Rank 0's name for the host group the ranks are about to make: a fresh uuid, or None when
    there is no default store to make it on (no ``init_process_group``, or an MPI default
    group) or no gloo."""
    if not dist.is_gloo_available():
        return None
    try:
        if str(dist.get_backend()).lower() == "mpi":  # its default store is a placeholder
            return None
        dist.distributed_c10d._get_default_store()
    except (ValueError, RuntimeError, AttributeError, KeyError):
        return None
    return uuid.uuid4().hex


def _make_host_group(group: Any, token: Optional[str],
                     timeout: Optional[datetime.timedelta] = None) -> Any:
    """A gloo group over the ranks of ``group`` (in its rank order), for a group that brings
    none (an NCCL-only ProcessGroup); None when ``token`` is None. Every rank calls it with the
    ``token`` rank 0 broadcast: the group lives on the default store under that name, so the
    ranks meet whatever groups each made before (torch names its groups by each rank's own
    count), and a group made again (after ``close()``) never meets a stale one. A rank missing
    for ``timeout`` (``HOST_GROUP_TIMEOUT``) makes it fail rather than wait; the same bound holds
    for each all-reduce on it. Dropped with its last reference (it is not registered with
    torch.distributed)."""
    if token is None:
        return None
    timeout = HOST_GROUP_TIMEOUT if timeout is None else timeout
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    try:
        store = dist.PrefixStore(f"cpidx/host/{token}/",
                                 dist.distributed_c10d._get_default_store())
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    except (ValueError, RuntimeError) as e:
        raise RuntimeError(f"group: could not make the host (gloo) group the {size} ranks agree "
                           f"through (rank {rank}, within {timeout}): {e}") from e


def _float32_bits(x: float) -> int:
    """The bits of ``x`` as the kernels get it (float32; a finite value past its range is inf,
    as in the binding's conversion, where struct.pack would raise)."""
    return int(torch.tensor(float(x), dtype=torch.float32).view(torch.int32))


def _float32_of_bits(bits: int) -> str:
    """The float32 whose bits these are, in the fewest digits that name it ("0.1")."""
    return str(np.int32(bits).view(np.float32))


# When a collective of this module that may have run on gloo last completed (time.monotonic()), or
# None (each is noted whatever its backend: an NCCL one costs the exit at most the wait below, and a
# group's backend name does not always tell where a collective runs). Gloo's worker thread lets go
# of a collective's tensors just after its wait() has returned here, and torch frees a tensor's hold
# on its Python object under the GIL, so that worker waits for the GIL while this thread runs on. If
# the interpreter starts exiting before it got it (a close() just before exit, say), taking it then
# ends the worker inside C++ and the process aborts ("terminate called without an active
# exception"), as after a bare ProcessGroupGloo.allreduce(...).wait() before exit. At exit,
# _let_gloo_workers_finish gives them the GIL first.
_gloo_done_at: Optional[float] = None
_GLOO_SETTLE_S = 0.05  # how long after its last collective exit waits for gloo's workers


def _gloo_done() -> None:
    global _gloo_done_at
    _gloo_done_at = time.monotonic()


def _let_gloo_workers_finish() -> None:
    """At interpreter exit (atexit, before the interpreter finalizes): sleeps, the GIL released,
    until _GLOO_SETTLE_S after this module's last gloo collective (at least 1 ms), so that gloo's
    workers have let go of its tensors (_gloo_done_at)."""
    if _gloo_done_at is not None:
        time.sleep(max(_GLOO_SETTLE_S - (time.monotonic() - _gloo_done_at), 0.001))


atexit.register(_let_gloo_workers_finish)


def _all_reduce_max(group: Any, values: torch.Tensor) -> None:
    """In-place MAX all-reduce of a host tensor over ``group`` (a registered ProcessGroup or
    one made by :func:`_make_host_group`), waited for."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    group.allreduce([values], opts).wait()
    _gloo_done()


class IndexerCPDecode:
    """Decode top-k for this rank's index heads, scored context-parallel.

    Holds the persistent buffers so the path is allocation-free under CUDA graph capture. Every
    shape is sized from ``max_seq_len`` (pass ``max_model_len``) and ``max_tokens``. The buffers
    are scratch for a single call, so one instance serves every indexer layer on a rank (see
    :func:`get_shared_cp_decode`).

    Exchange (``exchange``; ``self.exchange`` reports the one chosen):

    * ``"auto"`` with a ``torch.distributed`` ProcessGroup (or vLLM GroupCoordinator: its
      ``device_group`` / ``cpu_group`` are used) on CUDA: rank 0 makes an NCCL unique id,
      one ``all_gather_object`` hands it to the group (with each rank's set-up verdict: a rank
      whose Decoder cannot be made fails every rank there) and every rank joins the library's NCCL
      communicator; then, over it, the peer communicator (one-shot stores into CUDA-IPC-mapped
      buffers, about 2-3 us per gather against 6-9 for NCCL, and the key gather fused into the
      decode kernels), sized for the step's larger gather at ``max_tokens``
      (:func:`cpidx.cp_gather_bytes`). Its factory fails on every rank together when the ranks
      are not all on one host with P2P access between their GPUs (or the bound is above 16 MiB),
      so every rank falls back to NCCL together; ``peer_unavailable_reason`` keeps the reason.
      Without the NCCL communicator built (``cpidx.has_nccl``), or on ``device="cpu"``: the two
      all-gathers are ``torch.distributed.all_gather_into_tensor`` around the Decoder's
      ``shard_keys`` and ``merge`` (the seed's structure), on the C++ reference on the CPU.
    * ``"peer"``: the peer communicator or an exception (the same on every rank); needs CUDA and
      ``cpidx.has_peer`` and ``cpidx.has_nccl``. ``"nccl"``: the NCCL communicator or an
      exception. ``"torch"``: the torch collectives.
    * ``group`` a :class:`cpidx.Communicator` (device memory: NCCL or peer): it runs the step
      (``exchange`` must be ``"auto"`` or its ``kind``). The caller owns it: ``close()`` leaves
      it open.
    * ``world_size == 1``: the plain decode, no exchange (``"none"``; ``group`` may be None).

    Agreement (``check_agreement``): before its first collective, a step can check this rank's
    arguments (all that the step would refuse) and agree with the other ranks, through a host group,
    on the decode rows ``n`` and the step's settings: the call's ``query_len`` and ``scale``, the
    instances' ``topk``, ``init_blocks``, ``local_blocks``, ``total_heads``, ``max_seq_len`` and
    ``cache_dtype``. Then a rank with bad arguments raises its own error and the others a
    ``ValueError`` naming ``local_q`` (a peer's arguments were refused), and ranks that disagree on
    ``n`` or a setting all raise one naming it, instead of some waiting forever in a collective (or
    merging wrong ids without an error). Every rank must make the call, with 0 rows when it has
    none. The check is one gloo all-reduce of 18 integers, a median 0.44-0.47 ms between two
    processes on a 2-core machine (0.28-0.33 for the rows alone; a CPU instance adds a second, small
    one after its scoring, so that a rank whose scoring raised fails every rank), paid by every
    layer's call, so by default (``None``) it runs only while a CUDA graph is captured: nothing on
    its replays, and every captured batch size checked once. ``True`` checks every step, eager ones
    too (for debugging, as ``TORCH_DISTRIBUTED_DEBUG`` does for torch's collectives); ``False``
    never. The host group is the ``cpu_group`` of a vLLM GroupCoordinator (any ``group`` with
    ``device_group`` and ``cpu_group``), or ``group`` itself when it is a gloo group. For any other
    ProcessGroup (NCCL-only) the instance makes a gloo group over the same ranks at construction
    (unless ``check_agreement=False``), on the default store under a name rank 0 draws (sent with
    the NCCL unique id), waiting at most ``cpidx._cp.HOST_GROUP_TIMEOUT`` (30 min, torch's default)
    for a rank, there and in each all-reduce; ``close()`` drops it. With a
    :class:`cpidx.Communicator` as ``group``, with ``check_agreement=False`` over an NCCL-only
    group, or without ``init_process_group``'s store (or under an MPI default group), there is none
    and no check, as with the C++ NCCL communicator without a host channel; ``check_agreement=True``
    then warns once.
    A host group that fails (a rank missing past the timeout, a peer gone) cannot be used again:
    that step raises :class:`cpidx.HostGroupError`, so do later steps that agree, and ``close()``
    lets the instance go without a collective (as when dropped; what a live CUDA graph may still use
    is kept until the process exits) with a ``RuntimeWarning``. Gloo's timeouts are not atomic
    across ranks, so normally (not provably) every rank raises together.
    ``host_group=``, a gloo ProcessGroup of the same ranks in the same order, is used instead
    of all of the above (the one way to agree over a :class:`cpidx.Communicator` as ``group``).
    ``cp.check_agreement`` says what applies: ``"every step"``, ``"captures"`` or ``None``.
    ``close()`` agrees through the host group whatever ``check_agreement`` says (below); over
    an NCCL-only group ``check_agreement=False`` makes none, so ``close()`` does not agree.

    The NCCL communicator's init waits at most ``cpidx._cp.NCCL_INIT_TIMEOUT`` (10 min) for
    every rank: past it, the ranks still waiting raise RuntimeError ("a rank never joined").

    A peer exchange never hangs: a rank whose peer stops sending gives up after the
    communicator's timeout (5 s) and raises ``cpidx.PEER_ERROR_TIMEOUT`` in every rank's error
    bits (its own and its peers', through the peer mappings); read them with
    ``exchange_error_flag()`` after a batch of steps (a blocking read).

    Teardown: ``close()`` is collective: every rank calls it, in the same order for all of its
    instances. It closes the peer communicator (which waits for every rank before freeing its
    buffers) and then the NCCL one, and frees the workspace; it is idempotent, and any later
    use raises; with a host group the ranks agree first, and when one cannot close (a live
    CUDA graph holds its gathers) every rank raises and none closes anything.
    ``with IndexerCPDecode(...) as cp:`` closes on a normal exit. An instance
    dropped without ``close()``, or a ``with`` block left by an exception, never waits for
    other ranks: its peer communicator is abandoned (this rank's buffers stay allocated until
    the process exits, since a peer may still map them), so garbage collection and interpreter
    exit cannot hang on a rank that exited first.

    Under ``torch.compile``: ``torch.ops.cpidx.cp_decode(cp.handle, local_q, kv_cache,
    block_table, seq_lens, out, query_len, scale, attention_block_table, sparse_block_table_out,
    sparse_context_lens_out, block_page_stride, error_flag)`` is this step as one op (every
    argument positional, ``None`` where unused), which the compiler keeps whole: a compiled model
    keeps the context-parallel path. Compiled code names the instance by its handle (a
    per-process number, guarded on ``cp.handle``): it must not outlive the instance, nor be
    reused in another process.

    Inside a CUDA-graph capture (on the current stream), creating an instance and a ``close()``
    that closes communicators (collective, synchronising) raise ``RuntimeError`` before any CUDA
    call, and the capture stays valid.

    CUDA graphs first: destroy (``del``) every CUDA graph that captured a step before
    ``close()`` or dropping the instance. NCCL's communicator destroy waits until every live
    graph holding one of its kernels is gone, and a replay of such a graph uses the peer
    communicator's buffers and the instance's workspace. So while one lives ``close()`` raises
    ``RuntimeError`` naming how many gathers such graphs hold: with a host group on every rank
    (they agree first); without one where an NCCL communicator the instance made refuses to
    close. Otherwise, without a host group, no rank can refuse alone (the peer communicator's
    teardown is collective), so the instance closes and keeps what the graphs use until the
    process exits, with a ``RuntimeWarning``. An instance dropped while one lives lets go of
    its communicators without destroying them. Instances shared
    through :data:`cpidx.registry` and still open at interpreter exit are not destroyed at all
    (their communicators go with the process), so exit never waits on a graph or a rank.
    """

    def __init__(self, *, total_heads: int, rank: int, world_size: int, max_tokens: int,
                 max_seq_len: int, topk: int, init_blocks: int, local_blocks: int, group: Any,
                 device: Any, head_dim: int = 128, cache_dtype: Any = "bf16",
                 max_query_len: int = 8, exchange: str = "auto",
                 check_agreement: Optional[bool] = None, host_group: Any = None) -> None:
        # Steps in flight (on any thread) and whether close() has begun: close() refuses while a
        # step runs, and a step refuses once close() has begun (both under the lock).
        self._lock = threading.Lock()
        self._in_flight = 0
        self._closing = False
        if total_heads < 1 or world_size < 1:
            raise ValueError(f"total_heads and world_size must be >= 1, got {total_heads} and "
                             f"{world_size}")
        if total_heads > MAX_HEADS:
            raise ValueError(f"total_heads: expected 1 to {MAX_HEADS}, got {total_heads}")
        if world_size > MAX_WORLD_SIZE:  # the GPU decode's bound; a CPU instance keeps it too
            raise ValueError(f"world_size: expected 1 to {MAX_WORLD_SIZE}, got {world_size}")
        if total_heads >= world_size:
            if total_heads % world_size:
                raise ValueError(f"index heads must divide evenly across TP ranks: total_heads "
                                 f"{total_heads}, world_size {world_size}")
            local_heads, replicas = total_heads // world_size, 1
        else:
            if world_size % total_heads:
                raise ValueError(f"TP ranks must replicate index heads evenly: total_heads "
                                 f"{total_heads}, world_size {world_size}")
            local_heads, replicas = 1, world_size // total_heads
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: expected 0 <= rank < world_size = {world_size}, got {rank}")
        if head_dim != 128:
            raise ValueError(f"head_dim: expected 128, got {head_dim}")
        if not 1 <= topk <= MAX_TOPK:
            raise ValueError(f"topk: expected 1 to {MAX_TOPK}, got {topk}")
        for name, value in (("init_blocks", init_blocks), ("local_blocks", local_blocks)):
            if value < 0:  # else every step would refuse it (the CUDA Decoder refuses it here)
                raise ValueError(f"{name}: expected >= 0, got {value}")
        if not 1 <= max_tokens <= MAX_TOKENS:  # the library's Decoder's bound, on either device
            raise ValueError(f"max_tokens: expected 1 to 2^30, got {max_tokens}")
        if not 1 <= max_query_len <= MAX_QUERY_LEN:
            raise ValueError(f"max_query_len: expected 1 to {MAX_QUERY_LEN}, got {max_query_len}")
        if not 1 <= max_seq_len <= 2**31 - 1:
            raise ValueError(f"max_seq_len: expected 1 to 2^31-1, got {max_seq_len}")
        if host_group is not None and not isinstance(host_group, dist.ProcessGroup):
            raise TypeError(f"host_group: expected a torch.distributed ProcessGroup (gloo) or "
                            f"None, got {type(host_group).__name__}")
        if host_group is not None and world_size > 1 and (
                dist.get_world_size(host_group) != world_size or
                dist.get_rank(host_group) != rank):
            raise ValueError(f"host_group: rank {dist.get_rank(host_group)} of "
                             f"{dist.get_world_size(host_group)}, expected rank {rank} of "
                             f"{world_size}")
        if exchange not in _EXCHANGES:
            raise ValueError(f"exchange: expected one of {', '.join(map(repr, _EXCHANGES))}, "
                             f"got {exchange!r}")
        self.total_heads = total_heads
        self.local_heads = local_heads
        self.replicas = replicas
        self.head_offset = (rank // replicas) * local_heads
        self.rank = rank
        self.world_size = world_size
        self.max_tokens = max_tokens
        self.max_seq_len = max_seq_len
        self.max_query_len = max_query_len
        self.max_blocks = _cdiv(max_seq_len, BLOCK_SIZE)
        self.topk = topk
        self.init_blocks = init_blocks
        self.local_blocks = local_blocks
        self.group = group
        self.device = _resolve_device(device)
        self.cache_dtype = _cache_dtype_key(cache_dtype)
        if self.cache_dtype is None:
            raise ValueError(f"cache_dtype: expected bf16 or fp8_e4m3, got {cache_dtype}")
        self._cuda = self.device.type == "cuda"
        if exchange in ("peer", "nccl") and not self._cuda:
            raise ValueError(f"exchange: {exchange!r} needs device='cuda', got device "
                             f"{str(self.device)!r}; use 'torch' or 'auto'")

        self._decoder = None
        # CPU instances: the reference's bits of clamped values, OR-ed in by each step.
        self._host_errors = None if self._cuda else torch.zeros(1, dtype=torch.int32)
        if self._cuda:
            _refuse_during_capture("creating an IndexerCPDecode")
        # This rank's part (the CUDA Decoder: an allocation that can fail on one rank alone).
        # With peers, its failure is told to them in the construction's collective below, so
        # that every rank raises instead of the others waiting there until the group's timeout.
        local_failure: Optional[BaseException] = None
        # The library runs the exchange (NCCL, or the peer communicator over it) unless this is
        # the torch exchange, whose steps gather through buffers of their own: its Decoder then
        # reserves none of cp_decode's (exchange_buffers).
        self._library_exchange = self._cuda and exchange != "torch" and _C.has_nccl
        torch_exchange = world_size > 1 and not isinstance(group, _C.Communicator) and \
            not self._library_exchange
        try:
            self._decoder = self._make_decoder(head_dim, exchange_buffers=not torch_exchange)
        except Exception as e:  # noqa: BLE001 - raised after the peers heard of it
            if world_size == 1:
                raise
            local_failure = e
        self._comm = None  # a cpidx Communicator, when the library runs the exchange
        self._owned: list = []  # communicators this instance made, in closing order
        self._pg = None  # the torch ProcessGroup of the torch exchange
        self._host = None  # the host (gloo) group the steps and close() agree through
        self._host_failure: Optional[str] = None  # why the host group failed, once it has
        self._closed = False
        self.exchange = "none"
        self.peer_unavailable_reason: Optional[str] = None  # why "auto" did not get the peer
        if world_size > 1:
            self._setup_exchange(group, exchange, make_host=check_agreement is not False,
                                 host_group=host_group, warn_unchecked=bool(check_agreement),
                                 local_failure=local_failure)
        # What the steps agree on (close() agrees whenever there is a host group).
        self.check_agreement: Optional[str] = None
        if self._host is not None and check_agreement is not False:
            self.check_agreement = "every step" if check_agreement else "captures"
        # The step as a torch op: torch.ops.cpidx.cp_decode(cp.handle, ...).
        self.handle = next(_HANDLES)
        _BY_HANDLE[self.handle] = self

    # ---- construction helpers -------------------------------------------------------------
    def _make_decoder(self, head_dim: int, exchange_buffers: bool) -> Any:
        """This rank's CUDA Decoder (None on the CPU, where steps run on the reference)."""
        if not self._cuda:
            return None
        return Decoder(total_heads=self.total_heads, world_size=self.world_size, rank=self.rank,
                       max_tokens=self.max_tokens, max_seq_len=self.max_seq_len, topk=self.topk,
                       init_blocks=self.init_blocks, local_blocks=self.local_blocks,
                       device=self.device.index, max_query_len=self.max_query_len,
                       cache_dtype=self.cache_dtype, head_dim=head_dim,
                       exchange_buffers=exchange_buffers)

    def _setup_exchange(self, group: Any, exchange: str, make_host: bool, host_group: Any,
                        warn_unchecked: bool, local_failure: Optional[BaseException]) -> None:
        if isinstance(group, _C.Communicator):
            if local_failure is not None:  # no torch group to tell the peers through
                raise local_failure
            if (group.rank, group.world_size) != (self.rank, self.world_size):
                raise ValueError(f"group: communicator is rank {group.rank} of "
                                 f"{group.world_size}, expected rank {self.rank} of "
                                 f"{self.world_size}")
            if not self._cuda or not group.device_memory:
                raise ValueError("group: a cpidx Communicator needs device='cuda' and a "
                                 "device-memory communicator (NCCL or peer)")
            if group.device != self.device.index:  # its gathers would run on that device
                raise ValueError(f"group: the communicator gathers on cuda:{group.device}, this "
                                 f"instance runs on {self.device}")
            if exchange not in ("auto", group.kind):
                raise ValueError(f"exchange: {exchange!r} does not match the given cpidx "
                                 f"Communicator ({group.kind!r}); pass exchange='auto'")
            self._comm, self.exchange = group, group.kind
            self._host = host_group
            self._warn_if_unchecked(warn_unchecked, group)
            return
        if group is None:
            raise ValueError(f"group: world_size is {self.world_size}, so a torch.distributed "
                             f"ProcessGroup or a cpidx Communicator is needed, got None")
        device_group = getattr(group, "device_group", group)  # vLLM GroupCoordinator or a PG
        cpu_group = getattr(group, "cpu_group", None)
        if not isinstance(device_group, dist.ProcessGroup):
            raise TypeError(f"group: expected a torch.distributed ProcessGroup, a vLLM "
                            f"GroupCoordinator or a cpidx Communicator, got "
                            f"{type(group).__name__}")
        if dist.get_world_size(device_group) != self.world_size or \
                dist.get_rank(device_group) != self.rank:
            raise ValueError(f"group: rank {dist.get_rank(device_group)} of "
                             f"{dist.get_world_size(device_group)}, expected rank {self.rank} "
                             f"of {self.world_size}")
        library = self._library_exchange  # as the Decoder was made for
        if exchange == "nccl" and not library:
            raise ValueError("exchange: 'nccl' needs a cpidx build with the NCCL communicator "
                             "(cpidx.has_nccl is False)")
        if exchange == "peer" and not (library and _C.has_peer):
            raise ValueError(f"exchange: 'peer' needs a cpidx build with the peer and NCCL "
                             f"communicators (cpidx.has_peer is {_C.has_peer}, cpidx.has_nccl "
                             f"is {_C.has_nccl})")
        # One all_gather carries what the ranks must share, from rank 0: the NCCL unique id, and
        # the name of the host group this instance makes when the group brings none; and each
        # rank's own set-up verdict.
        self._host = host_group if host_group is not None else _host_group_of(group)
        make_host = make_host and self._host is None
        if library:
            # NVLS off on every rank before anything below can create an NCCL communicator (the
            # all_gather over an NCCL group creates torch's): NCCL reads the setting once per
            # process. Another value set by the user stays, and the library's NCCL factories
            # refuse it.
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        uid, token = self._share_from_rank0(
            cpu_group if cpu_group is not None else device_group,
            lambda: (_C.nccl_unique_id() if library else None,
                     _host_token() if make_host else None), local_failure)
        if make_host:
            self._host = _make_host_group(device_group, token)
        self._warn_if_unchecked(warn_unchecked, group)
        if library:
            nccl = _C.make_nccl_communicator(
                uid, self.world_size, self.rank, self.device.index,
                init_timeout_seconds=NCCL_INIT_TIMEOUT.total_seconds())
            self._owned.append(nccl)
            self._comm, self.exchange = nccl, "nccl"
            if exchange in ("auto", "peer") and _C.has_peer:
                self._setup_peer(nccl, required=exchange == "peer")
        else:
            self._pg = device_group
            self._alloc_exchange_buffers()
            self.exchange = "torch"

    def _warn_if_unchecked(self, asked: bool, group: Any) -> None:
        """check_agreement=True without a host group to agree through warns, before any
        communicator is made: a warning raised as an error (``-W error``) then leaves none
        behind. Every rank warns alike (whether one is made is rank 0's word, broadcast)."""
        if asked and self._host is None:
            warnings.warn(f"IndexerCPDecode(check_agreement=True): group {group!r} has no "
                          f"host (gloo) group to agree through: steps are not checked",
                          stacklevel=4)  # the caller of IndexerCPDecode(...)

    def _share_from_rank0(self, group: Any, make: Any,
                          local_failure: Optional[BaseException]) -> Any:
        """``make()`` on rank 0 of ``group``, handed to every rank, with every rank's own
        set-up verdict (``local_failure``: its Decoder could not be made): one all_gather of
        small objects, made on every rank whatever its verdict. When ``make()`` raises on rank
        0 (``ncclGetUniqueId`` without a usable network interface, say) or a rank could not set
        up, every rank raises, rather than the others waiting in a collective until the group's
        timeout: the failing rank its own error, the others a RuntimeError naming it."""
        failed = local_failure
        mine: tuple = ("ok", None)
        if failed is not None:
            mine = ("set-up", f"{type(failed).__name__}: {failed}")
        elif self.rank == 0:
            try:
                mine = ("made", make())
            except Exception as e:  # noqa: BLE001 - the other ranks must hear of it
                failed = e
                mine = ("failed", f"{type(e).__name__}: {e}")
        boxes: list = [None] * self.world_size
        nccl = "nccl" in str(dist.get_backend(group)).lower()
        with torch.cuda.device(self.device) if nccl and self._cuda else contextlib.nullcontext():
            dist.all_gather_object(boxes, mine, group=group)  # NCCL: on the current device
            _gloo_done()  # on gloo where the group serves the CPU ("cpu:gloo,cuda:nccl" too)
        if failed is not None:
            raise failed
        for q, (verdict, value) in enumerate(boxes):
            if verdict == "failed":
                raise RuntimeError(f"group: rank 0 could not make what it hands the "
                                   f"{self.world_size} ranks (the NCCL unique id, the host "
                                   f"group's name), so this rank cannot join: {value}")
            if verdict == "set-up":
                raise RuntimeError(f"group: rank {q} could not set up its part of the "
                                   f"instance, so no rank makes one: {value}")
        return boxes[0][1]

    def _setup_peer(self, nccl: Any, required: bool) -> None:
        """The peer communicator over the NCCL one. Its factory fails on every rank together,
        so every rank takes the same branch below (no rank is left in a collective)."""
        bound = _C.cp_gather_bytes(total_heads=self.total_heads, world_size=self.world_size,
                                   rank=self.rank, max_tokens=self.max_tokens, topk=self.topk)
        try:
            peer = _C.make_peer_communicator(nccl, self.device.index, bound)
        except (ValueError, NotImplementedError, RuntimeError) as e:
            if not required:
                self.peer_unavailable_reason = str(e)
                return
            self._owned.clear()
            nccl.close()  # collective, and every rank is here
            raise type(e)(f"exchange: 'peer' is unavailable: {e}") from e
        self._owned.insert(0, peer)  # closed before its bootstrap
        self._comm, self.exchange = peer, "peer"

    def _alloc_exchange_buffers(self) -> None:
        n, L, T, P, K = self.max_tokens, self.local_heads, self.total_heads, self.world_size, \
            self.topk
        D = 128

        def buf(numel: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(numel, dtype=dtype, device=self.device)

        self._q_local = buf(n * L * D, torch.bfloat16)
        self._q_gathered = buf(P * n * L * D, torch.bfloat16)
        self._q_full = buf(n * T * D, torch.bfloat16)
        self._keys = buf(T * n * K, torch.int64)
        self._keys_gathered = buf(P * T * n * K, torch.int64)

    # ---- the step -------------------------------------------------------------------------
    def __call__(self, local_q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, query_len: int, out: torch.Tensor, *, scale: float,
                 attention_block_table: Optional[torch.Tensor] = None,
                 sparse_block_table_out: Optional[torch.Tensor] = None,
                 sparse_context_lens_out: Optional[torch.Tensor] = None,
                 block_page_stride: Optional[int] = None,
                 error_flag: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Write ``[local_heads, n, topk]`` block ids for this rank's heads; returns ``out``.

        ``error_flag``: optional int32 tensor of one element on the instance's device, into which
        this step ORs its ``cpidx.ERR_*`` bits (as ``error_flag()`` would get them: this rank's
        clamped values), stream-ordered and capturable; the instance's own flag is then left
        untouched (a flag per layer, say, with no clear and no copy between steps)."""
        with self._lock:  # close() refuses while a step runs, and a step after close() began
            self._check_open()
            self._in_flight += 1
        try:
            return self._call(local_q, kv_cache, block_table, seq_lens, query_len, out, scale,
                              attention_block_table, sparse_block_table_out,
                              sparse_context_lens_out, block_page_stride, error_flag)
        finally:
            with self._lock:
                self._in_flight -= 1

    def _call(self, local_q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
              seq_lens: torch.Tensor, query_len: int, out: torch.Tensor, scale: float,
              attention_block_table: Optional[torch.Tensor],
              sparse_block_table_out: Optional[torch.Tensor],
              sparse_context_lens_out: Optional[torch.Tensor], block_page_stride: Optional[int],
              error_flag: Optional[torch.Tensor]) -> torch.Tensor:
        """The step of ``__call__``, counted in flight."""
        table = dict(attention_block_table=attention_block_table,
                     sparse_block_table_out=sparse_block_table_out,
                     sparse_context_lens_out=sparse_context_lens_out,
                     block_page_stride=block_page_stride)
        # This instance's device current: its kernels go to that device's stream, and a capture
        # is seen there. The ranks agree while capturing (each batch size an engine captures, on
        # every rank), or every step when asked.
        with _device_current(self.device) if self._cuda else contextlib.nullcontext():
            agree = self.check_agreement == "every step" or (
                self.check_agreement == "captures" and self._cuda and
                torch.cuda.is_current_stream_capturing())
            # The library's cp_decode checks its own arguments before its first collective (a
            # world of one on the GPU too: its plain decode); the other paths (and an agreement)
            # need them checked here, all of them (~10-15 us).
            by_library = self._comm is not None or (self.world_size == 1 and self._cuda)
            n, refused = self._check_step(local_q, kv_cache, block_table, seq_lens, query_len,
                                          out, scale, table, error_flag,
                                          full=agree or not by_library)
            if agree:
                self._agree(n, refused, query_len, scale)
            elif refused is not None:
                raise refused
            if n == 0:
                return out
            return self._step(n, local_q, _as_bits(kv_cache), block_table, seq_lens, query_len,
                              out, scale, table, error_flag, agree)

    def _step(self, n: int, local_q: torch.Tensor, kv_cache: torch.Tensor,
              block_table: torch.Tensor, seq_lens: torch.Tensor, query_len: int,
              out: torch.Tensor, scale: float, table: dict,
              error_flag: Optional[torch.Tensor], agree: bool) -> torch.Tensor:
        """The step after its checks and agreement (``n > 0`` rows, this instance's device
        current). ``agree``: the ranks agreed on this step (and agree on a CPU step's scoring
        too)."""
        stream = self._stream()

        def host_bits(bits: int) -> None:  # a CPU step's reference bits, after its collectives
            if error_flag is not None:
                _or_host_error_bits(error_flag, bits)
            else:
                self._host_errors |= bits

        if self.world_size == 1:
            if self._cuda:  # no communicator: the plain decode, checked as cp_decode's
                self._decoder.cp_decode(None, local_q, kv_cache, block_table, seq_lens,
                                        query_len, out, scale=scale, error_flag=error_flag,
                                        stream=stream, **table)
            else:
                host_bits(_native(
                    _C.ref_decode_topk, local_q, kv_cache, block_table, seq_lens, query_len,
                    out, scale=scale, max_seq_len=self.max_seq_len, **self._sel(), **table))
            return out
        if self._comm is not None:
            self._decoder.cp_decode(self._comm, local_q, kv_cache, block_table, seq_lens,
                                    query_len, out, scale=scale, error_flag=error_flag,
                                    stream=stream, **table)
            return out
        full = self._full_queries(local_q)
        T, K, P = self.total_heads, self.topk, self.world_size
        keys = self._keys[: T * n * K].view(T, n, K)
        if self._cuda:
            self._decoder.shard_keys(full, kv_cache, block_table, seq_lens, query_len, keys,
                                     scale=scale, error_flag=error_flag, stream=stream)
        else:
            failure = None
            try:
                bits = _native(
                    _C.ref_shard_topk_keys, full, kv_cache, block_table, seq_lens, query_len,
                    keys, scale=scale, max_seq_len=self.max_seq_len, world_size=P,
                    rank=self.rank, **self._sel())
            except Exception as e:  # noqa: BLE001 - a MemoryError, say: raised after agreeing
                if not agree:
                    raise
                failure = e
            if agree:
                self._agree_scored(failure)
        gathered = self._keys_gathered[: P * T * n * K]
        dist.all_gather_into_tensor(gathered, keys.view(-1), group=self._pg)
        _gloo_done()  # gloo on the CPU, or a CUDA instance's exchange="torch" over gloo
        gathered = gathered.view(P, T, n, K)
        if self._cuda:
            self._decoder.merge(gathered, seq_lens, query_len, out, stream=stream, **table)
        else:
            _native(_C.ref_merge_topk_keys, gathered, seq_lens, query_len, out,
                    max_seq_len=self.max_seq_len, head_offset=self.head_offset, **self._sel(),
                    **table)
            host_bits(bits)
        return out

    def _check_step(self, local_q: Any, kv_cache: Any, block_table: Any, seq_lens: Any,
                    query_len: int, out: Any, scale: float, table: dict, error_flag: Any,
                    full: bool) -> tuple[int, Optional[BaseException]]:
        """This rank's decode rows and what the step would refuse in its arguments (None: fine),
        checked on the host before any collective: the rows and the error flag only unless
        ``full``."""
        try:
            # local_q first: error_flag is checked against its device, which must be this
            # instance's (a flag on the right device next to a query on the wrong one blamed the
            # flag).
            if not isinstance(local_q, torch.Tensor):
                raise TypeError(f"local_q: expected a torch tensor, got {type(local_q).__name__}")
            if local_q.device != self.device:
                raise ValueError(f"local_q: expected a tensor on {self.device} (the instance's "
                                 f"device), got one on {local_q.device}")
            _check_error_flag(error_flag, local_q)
            if local_q.dim() != 3 or local_q.shape[1] != self.local_heads:
                raise ValueError(f"local_q: expected shape [n, {self.local_heads}, 128] (this "
                                 f"rank's heads), got {list(local_q.shape)}")
            n = int(local_q.shape[0])
            if n > self.max_tokens:
                raise ValueError(f"local_q: {n} rows exceed max_tokens {self.max_tokens}")
            for name, t in (("kv_cache", kv_cache), ("block_table", block_table),
                            ("seq_lens", seq_lens), ("out", out)):
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"{name}: expected a torch tensor, got {type(t).__name__}")
            if n == 0:
                return 0, None
            if not self._cuda:  # the flag is ORed here after the step: the library never sees it
                _check_host_arrays((), error_flag,
                                   _table_read(block_table, seq_lens, self.max_seq_len),
                                   local_q=local_q, kv_cache=kv_cache, block_table=block_table,
                                   seq_lens=seq_lens, out=out, **table)
            if not full:
                return n, None
            args = (local_q, _as_bits(kv_cache), block_table, seq_lens, query_len, out)
            if self._cuda:
                self._decoder.check_cp_decode(*args, scale=scale, error_flag=error_flag, **table)
            else:
                _native(_C.ref_check_cp_decode, *args, scale=scale, max_seq_len=self.max_seq_len,
                        local_heads=self.local_heads, max_tokens=self.max_tokens,
                        max_query_len=self.max_query_len, **self._sel(), **table)
                # The reference runs either cache dtype; the CUDA Decoder only its own, and a CPU
                # run must refuse what the GPU run would.
                got = _cache_dtype_name(kv_cache)
                if got != self.cache_dtype:
                    raise ValueError(f"kv_cache: dtype must be {self.cache_dtype} (the instance's "
                                     f"cache_dtype), got {got}")
            return n, None
        except Exception as e:  # the peers must hear of it before anyone enters a collective
            return -1, e

    def _agree(self, n: int, refused: Optional[BaseException], query_len: int,
               scale: float) -> None:
        """All ranks reach the same verdict on this step: one MAX all-reduce of ``(v, -v)`` for
        the rows ``n`` and for each of ``_AGREED_SETTINGS``, so every rank learns the least and
        the most of each. A rank whose arguments were refused offers -1 rows (its settings go
        uncompared). Raises on every rank unless all have the same rows and settings."""
        mine = [-1] + [0] * len(_AGREED_SETTINGS)
        if refused is None:
            mine = [n] + self._settings(n, query_len, scale)
        pairs = torch.tensor([x for v in mine for x in (v, -v)], dtype=torch.int64)
        try:
            self._host_all_reduce(pairs, "the step's agreement")
        except HostGroupError as e:
            if refused is None:
                raise
            raise HostGroupError(f"{e}; and this rank's arguments were refused: "
                                 f"{type(refused).__name__}: {refused}") from refused
        most, least = pairs[0::2].tolist(), [-v for v in pairs[1::2].tolist()]
        if refused is not None:
            raise refused
        if least[0] < 0:
            raise ValueError(f"local_q: another rank's arguments for this step were refused (it "
                             f"raised; no collective ran); this rank has {n} decode rows")
        if least[0] != most[0]:
            raise ValueError(f"local_q: the {self.world_size} ranks disagree on the decode rows "
                             f"(num_reqs * query_len): this rank has {n}, the ranks have "
                             f"{least[0]} to {most[0]}; every rank must decode the same batch")
        for i, name in enumerate(_AGREED_SETTINGS, start=1):
            if least[i] != most[i]:
                show = {"scale": _float32_of_bits,
                        "cache_dtype": _CACHE_DTYPES.__getitem__}.get(name, str)
                whose, must = ("ranks", "run the same step") if name in _PER_CALL_SETTINGS \
                    else ("ranks' instances", "make its instance with the same settings")
                raise ValueError(f"{name}: the {self.world_size} {whose} disagree on {name} (this "
                                 f"rank {show(mine[i])}, the ranks {show(least[i])} to "
                                 f"{show(most[i])}); every rank must {must}")

    def _settings(self, n: int, query_len: int, scale: float) -> list:
        """This rank's ``_AGREED_SETTINGS`` as integers: scale by its float32 bits (ordered as
        the values, for a scale > 0), the cache dtype by its code. A call without rows offers 0
        for its own (nothing checked them, and nothing runs: the rows disagree, or all are 0)."""
        call = [int(query_len), _float32_bits(scale)] if n > 0 else [0, 0]
        return call + [self.topk, self.init_blocks, self.local_blocks, self.total_heads,
                       self.max_seq_len, _CACHE_DTYPES.index(self.cache_dtype)]

    def _sel(self) -> dict:
        return dict(topk=self.topk, init_blocks=self.init_blocks, local_blocks=self.local_blocks)

    def _full_queries(self, local_q: torch.Tensor) -> torch.Tensor:
        """All-gather ``[n, local_heads, D]`` queries to ``[n, total_heads, D]``."""
        n, L, T, P, R = local_q.shape[0], self.local_heads, self.total_heads, \
            self.world_size, self.replicas
        D = local_q.shape[-1]
        if local_q.dtype != torch.bfloat16:  # uint16 holding bf16 bits (checked before)
            local_q = local_q.view(torch.bfloat16)
        if local_q.is_contiguous():
            q = local_q  # gathered in place, as cp_decode does
        else:
            q = self._q_local[: n * L * D].view(n, L, D)
            q.copy_(local_q)
        gathered = self._q_gathered[: P * n * L * D]
        dist.all_gather_into_tensor(gathered, q.reshape(-1), group=self._pg)
        _gloo_done()
        # Replicated ranks carry the same head; keep the first of each group.
        owners = gathered.view(P, n, L, D)[::R]
        full = self._q_full[: n * T * D].view(n, T, D)
        full.view(n, P // R, L, D).copy_(owners.permute(1, 0, 2, 3))
        return full

    def error_flag(self) -> torch.Tensor:
        """int32 [1] on the instance's device: ``cpidx.ERR_*`` bits of the values this rank's
        steps clamped instead of reading out of bounds (a seq_len, a block-table entry of its
        shard) since the last ``clear_error_flag``, by the steps given no ``error_flag`` of their
        own; read it when convenient (the library never syncs on it). A CPU instance's steps OR
        the reference's bits into a CPU tensor."""
        self._check_open()
        return self._decoder.error_flag() if self._decoder is not None else self._host_errors

    def clear_error_flag(self) -> None:
        self._check_open()
        if self._decoder is not None:
            with torch.cuda.device(self.device):  # the Decoder refuses another current device
                self._decoder.clear_error_flag(stream=self._stream())
        else:
            self._host_errors.zero_()

    def exchange_error_flag(self) -> Optional[int]:
        """The peer exchange's error bits since the last clear: 0 when fine,
        ``cpidx.PEER_ERROR_TIMEOUT`` when this rank or a peer gave up waiting (after the
        communicator's timeout: the steps since then have undefined results, and every rank's
        instance must be recreated). None for the NCCL and torch exchanges and at
        ``world_size == 1``. A blocking device read: call it after synchronising the stream that
        ran the steps (after a batch of graph replays, say), never inside a capture."""
        self._check_open()
        return self._comm.read_error_flag() if self._comm is not None else None

    def clear_exchange_error_flag(self) -> None:
        """Stream-ordered clear of those bits (on the current stream)."""
        self._check_open()
        if self._comm is not None:
            with torch.cuda.device(self.device):  # its stream's device current
                self._comm.clear_error_flag(stream=self._stream())

    # ---- teardown ---------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Collective: every rank calls it (in the same order for all its instances). Closes the
        peer communicator, then the NCCL one (those this instance made; a Communicator passed as
        ``group`` stays open), and frees the buffers. Idempotent; any later use raises. Destroy
        the CUDA graphs that captured its steps first: while one lives it raises (can be called
        again once they are gone) or keeps what they use (see the class docstring). With a host
        group the ranks agree first: when one cannot close, every rank raises and none closes
        anything. A step in flight on another thread makes it raise (with a host group, on
        every rank, the instances of the torch exchange too), closing nothing, as does a
        close() under way on another thread; from the moment it goes ahead, steps raise."""
        if self._closed:
            return
        if self._agrees_to_close():
            try:
                self._agree_to_close()  # claims the close when it goes ahead
            except HostGroupError:
                try:  # still claimed: no step starts on what is let go
                    self._let_go_without_agreement()
                except BaseException:
                    self._unclaim_close()
                    raise
                return
        else:
            why = self._claim_close()
            if why is not None:
                raise RuntimeError(f"{self!r}.close(): {why}; nothing was closed: call close() "
                                   f"again once it returned")
        held = None
        try:
            # Without a host group no rank can refuse for all (a peer communicator's close is
            # collective): under a live graph this rank closes, and keeps what the graph uses.
            if self._host is None:
                held = self._graph_blocker()
            while self._owned:
                self._owned[0].close()  # raises before anything is dropped if it cannot close
                self._owned.pop(0)
        except BaseException:
            self._unclaim_close()  # still open: its steps may run again
            raise
        if held is not None:
            self._keep_for_live_graphs([])
        self._drop()
        if held is not None:
            warnings.warn(f"{self!r}.close(): {held}: its buffers are kept until the process "
                          f"exits (no host group to agree on closing later)", RuntimeWarning,
                          stacklevel=2)  # the caller of close()

    def _claim_close(self) -> Optional[str]:
        """Why close() cannot go ahead on this rank's side now (a step in flight on another
        thread), or None, after which steps raise as on a closed instance (atomically with the
        check: a step starting meanwhile is either counted here or refused)."""
        with self._lock:
            if self._closing:
                return "close() is under way on another thread"
            if self._in_flight:
                return f"{self._in_flight} step(s) in flight on another thread"
            self._closing = True
            return None

    def _unclaim_close(self) -> None:
        with self._lock:
            self._closing = False

    def _agree_to_close(self) -> None:
        """Raises (closing nothing) when this rank cannot close now: a CUDA graph is being
        captured (checked before any CUDA call), a live graph holds a gather of its steps, a
        call is in flight on another thread. With a host group every rank closes or none does:
        the ranks all-reduce their answers first, each reaching the all-reduce whatever its
        own, so that no rank closes while another raised (the next collective, a new instance
        for the same key say, would find them out of step) and none is left waiting in it."""
        blocker = None
        if self._owned:  # closing communicators allocates and synchronises: not in a capture
            blocker = _capture_refusal(f"{self!r}.close() (collective: it closes its "
                                       f"communicators)")
        if self._host is None:  # alone: the communicators' close() raises their own reasons
            if blocker is None:
                why = self._claim_close()
                blocker = None if why is None else f"{self!r}.close(): {why}"
            if blocker is not None:
                raise RuntimeError(blocker)
            return
        if blocker is None:
            why = self._local_close_blocker() or self._claim_close()
            blocker = None if why is None else f"{self!r}.close(): {why}"
        any_blocked = torch.tensor([0 if blocker is None else 1], dtype=torch.int64)
        self._host_all_reduce(any_blocked, "close()'s agreement")  # HostGroupError: still claimed
        if blocker is not None:
            raise RuntimeError(f"{blocker}; nothing was closed, on any rank: call close() again "
                               f"on every rank")
        if int(any_blocked):
            self._unclaim_close()
            raise RuntimeError(f"{self!r}.close(): another rank cannot close yet (it raised the "
                               f"reason); nothing was closed, on any rank: call close() again on "
                               f"every rank")

    def _local_close_blocker(self) -> Optional[str]:
        """Why this rank's communicators cannot close now (a live CUDA graph holds one of
        their gathers, a call is in flight on another thread), asked without closing; None if
        they can. An error asking is a reason too."""
        with self._lock:
            if self._in_flight:
                return f"{self._in_flight} step(s) in flight on another thread"
        try:
            why = (c._close_blocker(ignore_dependents=True, peer_graphs=True)
                   for c in self._owned)
            return next((w for w in why if w), None) or (
                None if self._comm in self._owned else self._graph_blocker())
        except Exception as e:  # noqa: BLE001 - reported as the reason
            return f"{type(e).__name__}: {e}"

    def _graph_blocker(self) -> Optional[str]:
        """Live CUDA graphs that captured steps through this instance's communicator (its own
        or the caller's): their replays use its buffers, the communicator's and the workspace.
        None when there are none, or no count (the torch exchange)."""
        count = getattr(self._comm, "_gathers_in_live_graphs", None)
        try:
            held = count(1.0) if count is not None and not self._comm.closed else 0
        except Exception as e:  # noqa: BLE001 - not knowing counts as held (kept, not freed)
            return f"its live CUDA graphs could not be counted ({type(e).__name__}: {e})"
        return None if held <= 0 else (f"{held} gather(s) of its steps are in CUDA graphs that "
                                       f"are still alive (delete those graphs first)")

    def _keep_for_live_graphs(self, comms: list) -> None:
        """What a live graph may still use, kept until the process exits instead of freed."""
        _KEPT_FOR_LIVE_GRAPHS.append((self._decoder, comms,
                                      [self.__dict__.get(n) for n in _EXCHANGE_BUFFERS]))

    def _let_go_without_agreement(self) -> None:
        """close() once the host group has failed: no agreement can be had any more, nor a
        collective trusted, so the instance goes as one dropped without close() does, on every
        rank alike (each meets the failure). When this rank could not close (a live CUDA graph
        holds its gathers, say), its communicators and workspace are kept until the process
        exits instead of freed under that graph. Warns after letting go, so that warnings
        raised as errors still find the instance closed."""
        capturing = _capture_refusal(f"{self!r}.close()")
        if capturing is not None:  # nothing may be let go inside a capture either
            raise RuntimeError(capturing)
        blocker = self._local_close_blocker()
        kept = ""
        if blocker is not None:
            for comm in self._owned:
                comm._leak_at_exit()
            self._keep_for_live_graphs(self._owned)
            kept = (f"; this rank could not close ({blocker}), so its communicators and buffers "
                    f"are kept until the process exits")
        self._drop()
        warnings.warn(f"{self!r}.close(): the host group failed ({self._host_failure}): the "
                      f"instance was let go without a collective, as when dropped{kept}",
                      RuntimeWarning, stacklevel=3)

    def _agree_scored(self, failure: Optional[BaseException]) -> None:
        """A CPU step's scoring, agreed before its key gather when the step was agreed on: a
        rank whose scoring raised (an allocation, say) raises that, and every other rank says
        so, where they would otherwise wait in the gather until the group's timeout."""
        flag = torch.tensor([0 if failure is None else 1], dtype=torch.int64)
        self._host_all_reduce(flag, "the step's scoring agreement")
        if failure is not None:
            raise failure
        if flag.item() != 0:
            raise RuntimeError(f"{self!r}: another rank's scoring failed this step (it raised); "
                               f"no keys were gathered and no ids written")

    def _host_all_reduce(self, values: torch.Tensor, what: str) -> None:
        """MAX all-reduce over the host group. Its failure is kept: the group is unusable from
        then on, so later steps that agree raise at once and close() lets the instance go
        without a collective."""
        if self._host_failure is not None:
            raise HostGroupError(f"{self!r}: {what}: the host group failed earlier "
                                 f"({self._host_failure}); {_AFTER_HOST_FAILURE}")
        try:
            _all_reduce_max(self._host, values)
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError or DistBackendError
            self._host_failure = f"{type(e).__name__}: {e}"
            raise HostGroupError(f"{self!r}: {what}: the host (gloo) group failed: "
                                 f"{self._host_failure}; the ranks may be out of step: "
                                 f"{_AFTER_HOST_FAILURE}") from e

    def _agrees_to_close(self) -> bool:
        """Whether close() agrees with the other ranks first: it closes communicators this
        instance made, or has a host group to agree through (so that when one rank cannot close,
        a step in flight there say, every rank keeps its instance and the registries stay
        alike)."""
        return self._closes_collectively() or (
            not self._closed and self._host is not None and self.world_size > 1)

    def _closes_collectively(self) -> bool:
        """Whether close() closes communicators this instance made (collective, synchronising)."""
        return not self._closed and bool(self._owned)

    def __enter__(self) -> "IndexerCPDecode":
        self._check_open()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            # The other ranks may not get here: no collective. Dropping the communicators takes
            # their non-collective teardown (the peer one is abandoned).
            self._drop()

    def _leak_at_exit(self) -> None:
        """Interpreter exit (the registry's atexit hook): closed without destroying the
        communicators this instance made, so exit never waits for another rank or for a CUDA
        graph that still holds an NCCL kernel."""
        for comm in self._owned:
            comm._leak_at_exit()
        self._drop()

    def _drop(self) -> None:
        self._closed = True
        self._owned = []
        self._comm = self._pg = self._decoder = self._host = None
        for name in _EXCHANGE_BUFFERS:
            self.__dict__.pop(name, None)

    def _stream(self) -> int:
        """The current torch stream of this instance's device (0 on the CPU)."""
        return _current_stream(self.device) if self._cuda else 0

    def _check_open(self) -> None:
        if self._closed or self._closing:
            raise RuntimeError(f"{self!r} is closed" if self._closed else
                               f"{self!r} is closing (close() was called on another thread)")

    def __repr__(self) -> str:
        get = self.__dict__.get  # also for an instance whose construction failed part-way
        return (f"IndexerCPDecode(rank {get('rank')} of {get('world_size')}, exchange "
                f"{get('exchange')!r}, device {str(get('device'))!r})")


def _by_handle(handle: int) -> IndexerCPDecode:
    """The instance whose ``handle`` this is (a closed one too: its step then raises)."""
    cp = _BY_HANDLE.get(handle)
    if cp is None:
        raise ValueError(f"handle: no IndexerCPDecode has handle {handle} (not an instance's "
                         f"handle, or its instance was garbage-collected)")
    return cp


def get_shared_cp_decode(**kwargs: Any) -> IndexerCPDecode:
    """One :class:`IndexerCPDecode` per rank and geometry (and group), shared by all layers.

    Each of M3's sparse layers has its own indexer; the buffers are written and consumed within
    one call and layers run in order on one stream, so all layers reuse one set. The instances
    live in :data:`cpidx.registry` (``registry.clear()`` closes them: collective); the key is the
    constructor's arguments with their defaults applied and the spellings of one value made one
    (dtype names, ``"cuda"`` for the current CUDA device), ``group`` and ``host_group`` by
    identity. A closed instance is replaced by a new one on the next call.
    """
    return registry.cp_decode(**kwargs)


_PARAMETERS: Optional[dict] = None  # IndexerCPDecode's parameters and their defaults


def _registry_key(kwargs: dict) -> tuple:
    """The registry's key for ``IndexerCPDecode(**kwargs)``: the arguments with their defaults
    applied and the spellings of one value made one (``"bfloat16"`` or ``torch.bfloat16`` for
    ``"bf16"``, ``"cuda"`` for the current CUDA device, ``"cpu:0"`` for ``"cpu"``), the groups by
    identity. Spelling out a default must not make a second instance: each has its own workspace
    and communicators, made collectively."""
    global _PARAMETERS
    if _PARAMETERS is None:  # read once: inspect.signature costs ~40 us, a call's key ~5
        _PARAMETERS = {name: p.default for name, p in
                       inspect.signature(IndexerCPDecode).parameters.items()}
    missing = [k for k, v in _PARAMETERS.items()
               if v is inspect.Parameter.empty and k not in kwargs]
    if missing or not _PARAMETERS.keys() >= kwargs.keys():  # the constructor names the mistake
        return tuple(sorted((k, str(v)) for k, v in kwargs.items()))
    args = {k: v for k, v in _PARAMETERS.items() if v is not inspect.Parameter.empty}
    args.update(kwargs)
    groups = tuple(id(args.pop(name, None)) for name in ("group", "host_group"))
    args["cache_dtype"] = _cache_dtype_key(args["cache_dtype"]) or args["cache_dtype"]
    try:
        args["device"] = _resolve_device(args["device"])
    except (RuntimeError, TypeError, AssertionError):  # not a device (or no CUDA): the
        pass  # constructor names it
    # A bool apart from its string and its int (check_agreement=False is not 0, nor "False").
    return tuple(sorted((k, isinstance(v, bool), str(v)) for k, v in args.items())) + groups
