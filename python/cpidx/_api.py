"""The functional API: decode_topk / prefill_topk on numpy (C++ reference) or torch (GPU decoder),
the bf16 helpers of the host path, and the Registry (the package's one cache)."""
from __future__ import annotations

import atexit
import contextlib
import functools
import numbers
import operator
import sys
import threading
import time
import warnings
from typing import Any, Optional

import numpy as np

from . import _C

BLOCK_SIZE = 128  # tokens per sparse block = index-cache page
HEAD_DIM = 128  # index head dim (the only compiled value)
MAX_TOPK = 64
MAX_QUERY_LEN = 8
MAX_HEADS = 8  # index heads T
MAX_WORLD_SIZE = _C.MAX_WORLD_SIZE  # context-parallel ranks P of the GPU decode (kMaxWorldSize)
MAX_TOKENS = _C.MAX_TOKENS  # a Decoder's largest max_tokens (DecodeConfig::kMaxTokens)
# Bits of an error flag (``error_flag=``, ``Decoder.error_flag()``): values the device clamped
# instead of reading out of bounds (CONTRACT.md section 8).
# A length out of [0, max_seq_len] (decode seq_lens; prefill seq_lens, context_lens, and a
# cu_seqlens_q entry the clamp to a non-decreasing sequence in [0, tokens] moved).
ERR_SEQ_LEN_OUT_OF_RANGE = _C.ERR_SEQ_LEN_OUT_OF_RANGE
ERR_PAGE_OUT_OF_RANGE = _C.ERR_PAGE_OUT_OF_RANGE  # a block-table entry outside the cache


# ---- bf16 on the host ---------------------------------------------------------------------
def bf16_bits(x: Any) -> np.ndarray:
    """float array -> uint16 bf16 bit patterns (round to nearest even; NaN stays NaN). A copy."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        rounded[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)  # keep sign, force quiet NaN
    return rounded


def bf16_to_float32(bits: Any) -> np.ndarray:
    """uint16 bf16 bit patterns -> float32 (exact). Anything but uint16 bits (floats, other
    integers) is refused: converted by value, they would give other numbers silently."""
    b = np.asarray(bits)
    if b.dtype.kind != "u" or b.dtype.itemsize != 2:  # uint16 of either byte order
        raise TypeError(f"bits: expected uint16 bf16 bit patterns, got dtype {b.dtype}")
    return (b.astype(np.uint32) << 16).view(np.float32)


def _host_bf16(x: Any, name: str) -> Any:
    """numpy float arrays become bf16 bits (a copy, outside the hot path); others pass through."""
    if isinstance(x, np.ndarray) and x.dtype.kind == "f":
        return bf16_bits(x)
    return x


def _host_bytes(x: Any) -> Optional[tuple]:
    """[first byte, past the last) of a host array or CPU tensor, from its strides; None when it
    is empty or neither."""
    if isinstance(x, np.ndarray):
        base, item, strides = x.__array_interface__["data"][0], x.itemsize, x.strides
    elif _is_torch(x) and not x.is_cuda and x.device.type == "cpu":
        item = x.element_size()
        base, strides = x.data_ptr(), [st * item for st in x.stride()]
    else:
        return None
    if any(n == 0 for n in x.shape):
        return None
    lo = base + sum((n - 1) * st for n, st in zip(x.shape, strides) if st < 0)
    hi = base + item + sum((n - 1) * st for n, st in zip(x.shape, strides) if st > 0)
    return lo, hi


def _table_read(block_table: Any, seq_lens: Any, max_seq_len: Any) -> Any:
    """The part of a block table a call reads, as the library spans it: a row a request, its
    first cdiv(max_seq_len, 128) columns. The whole table where that part cannot be told (a
    shape or bound the binding will refuse)."""
    shape, lens = getattr(block_table, "shape", None), getattr(seq_lens, "shape", None)
    if shape is None or len(shape) != 2 or lens is None or len(lens) != 1 or \
            not isinstance(max_seq_len, numbers.Integral) or max_seq_len < 1:
        return block_table
    rows, cols = int(lens[0]), -(-int(max_seq_len) // BLOCK_SIZE)
    if rows < 1 or shape[0] < rows or shape[1] < cols:
        return block_table
    return block_table[:rows, :cols]


def _check_host_arrays(outputs: tuple, error_flag: Any, table_read: Any = None,
                       **arrays: Any) -> None:
    """What the binding cannot name on the host path: numpy arrays of another byte order than
    the machine's, and read-only outputs (its generic TypeError names no argument); and an
    error flag sharing memory with an argument (on the host the flag is ORed here, after the
    call, so the library's own check never sees it). ``table_read``: the part of
    ``block_table`` the call reads (_table_read), which the flag is judged against, as the
    library judges it on the GPU."""
    for name, a in arrays.items():
        if not isinstance(a, np.ndarray):
            continue
        if not a.dtype.isnative:
            raise TypeError(f"{name}: expected the machine's byte order, got dtype {a.dtype.str}")
        if name in outputs and not a.flags.writeable:
            raise ValueError(f"{name}: expected a writeable array, got a read-only one")
    flag = _host_bytes(error_flag)
    if flag is None:
        return
    for name, a in arrays.items():
        span = _host_bytes(table_read if name == "block_table" and table_read is not None else a)
        if span is not None and flag[0] < span[1] and span[0] < flag[1]:
            raise ValueError(f"error_flag and {name} share memory: an output must not overlap "
                             "another argument")


def _torch_module():
    """torch if it is already imported (never imports it: the numpy path stays torch-free)."""
    return sys.modules.get("torch")


def _is_torch(x: Any) -> bool:
    torch = _torch_module()
    return torch is not None and isinstance(x, torch.Tensor)


def _is_cuda(x: Any) -> bool:
    return _is_torch(x) and x.is_cuda


def _as_bits(t: Any) -> Any:
    """torch float8 caches go to the binding as uint8 bits (a view, zero-copy)."""
    torch = _torch_module()
    if torch is not None and t.dtype in (getattr(torch, "float8_e4m3fn", None),):
        return t.view(torch.uint8)
    return t


def _dl_with(tensor: Any, to_dlpack: Any, x: Any) -> Any:
    """A torch tensor as a DLPack capsule for the binding, which imports it as is: given the
    tensor, nanobind calls torch's Python-level ``Tensor.__dlpack__`` (~3 us a tensor on the CI
    machine's CPU, against ~0.4 us for ``torch.utils.dlpack.to_dlpack``; torch versions whose
    ``stream`` argument defaults to None also make the legacy default stream wait for the
    current one there, per tensor). Anything else (None, numbers, numpy arrays, a tensor DLPack
    cannot carry) goes as it is, so the binding's own checks see it as before. ``tensor`` and
    ``to_dlpack``: torch's, looked up once for a call's arguments."""
    if type(x) is not tensor:
        return x
    try:
        return to_dlpack(x)
    except (RuntimeError, BufferError, TypeError):  # the binding names it, as before
        return x


# ---- Scalars the binding cannot convert, named ------------------------------------------------
# nanobind refuses a scalar it cannot convert (None, a float for an int, an int past the C type)
# with a TypeError that lists the signature but names no argument. On that error (never on the
# way of a call that succeeds) the arguments are read against the binding's signature and the
# first bad scalar is named instead. Its ints are C ints but for these (int64_t, uintptr_t).
_C_INT = (-(1 << 31), (1 << 31) - 1)
_WIDE_INTS = {"stream": (0, (1 << 64) - 1), "max_seq_len": (-(1 << 63), (1 << 63) - 1),
              "max_bytes_per_rank": (-(1 << 63), (1 << 63) - 1)}


def _signature_params(fn: Any) -> list:
    """[(name, annotation)] of a binding's first signature, from nanobind's ``__nb_signature__``
    (``*`` and ``self`` included, as written); [] when it has none."""
    sig = getattr(fn, "__nb_signature__", None)
    if not sig:
        return []
    text = sig[0][0]
    inner = text[text.index("(") + 1:text.rindex(") ->")]
    params, depth, start = [], 0, 0
    for i, ch in enumerate(inner + ","):
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        elif ch == "," and depth == 0:
            part = inner[start:i].strip()
            start = i + 1
            name, _, annotation = part.partition(":")
            params.append((name.strip(), annotation.split(" = ")[0].strip()))
    return params


def _scalar_type_error(name: str, kind: str, value: Any) -> Optional[Exception]:
    """A TypeError naming ``name`` when ``value`` cannot be a ``kind`` at all, else None. As
    nanobind converts: an int from anything with ``__index__``, a float from anything with
    ``__float__`` or ``__index__`` (not from a str), a bool or a str from one only."""
    if value is None:
        return TypeError(f"{name}: expected {kind}, got None")
    has = functools.partial(hasattr, type(value))
    ok = {"int": has("__index__"), "float": has("__float__") or has("__index__"),
          "bool": isinstance(value, bool), "str": isinstance(value, str)}[kind]
    if ok:
        return None
    what = {"int": "an int", "float": "a number"}.get(kind, kind)
    return TypeError(f"{name}: expected {what}, got {type(value).__name__}")


def _bad_scalar(fn: Any, args: tuple, kwargs: dict) -> Optional[Exception]:
    """The error naming a scalar argument of ``fn`` that nanobind cannot convert, or None when
    every scalar converts (the TypeError then was about something else). Types first, then
    ranges: an int past a C int is judged so unless it is one of _WIDE_INTS, so a wide argument
    the binding takes does not hide another's bad type."""
    params = [p for p in _signature_params(fn) if p[0] != "*"]
    given = dict(zip((name for name, _ in params), args))
    given.update(kwargs)
    scalars = []
    for name, annotation in params:
        optional = annotation.endswith(" | None")
        kind = annotation[:-len(" | None")] if optional else annotation
        if name in given and kind in ("int", "float", "bool", "str") and \
                not (optional and given[name] is None):
            scalars.append((name, kind, given[name]))
    for name, kind, value in scalars:
        error = _scalar_type_error(name, kind, value)
        if error is not None:
            return error
    for name, kind, value in scalars:
        lo, hi = _WIDE_INTS.get(name, _C_INT)
        if kind == "int" and not lo <= operator.index(value) <= hi:
            return ValueError(f"{name}: expected an int from {lo} to {hi}, got {value}")
    return None


def _call_naming_scalars(fn: Any, args: Any, kwargs: dict) -> Any:
    try:
        return fn(*args, **kwargs)
    except TypeError as e:
        if "incompatible function arguments" not in str(e):
            raise
        named = _bad_scalar(fn, tuple(args), kwargs)
        if named is None:
            raise
        raise named from None


def _native(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn`` (a binding) called with its torch tensor arguments as DLPack capsules (_dl_with);
    a scalar it cannot convert is named (_bad_scalar)."""
    torch = _torch_module()
    if torch is None:
        return _call_naming_scalars(fn, args, kwargs)
    tensor, to_dlpack = torch.Tensor, torch.utils.dlpack.to_dlpack
    try:  # inline, without a function call an argument (the common case)
        args = [to_dlpack(a) if type(a) is tensor else a for a in args]
        kwargs = {name: to_dlpack(a) if type(a) is tensor else a for name, a in kwargs.items()}
    except (RuntimeError, BufferError, TypeError):  # one DLPack cannot carry goes as it is
        args = [_dl_with(tensor, to_dlpack, a) for a in args]
        kwargs = {name: _dl_with(tensor, to_dlpack, a) for name, a in kwargs.items()}
    return _call_naming_scalars(fn, args, kwargs)


def _default_stream(device: int) -> int:
    """The stream a public method runs on when given none: torch's current stream on ``device``
    where torch with CUDA is imported (the binding's own default, 0, is the legacy stream, which
    torch's side and capture streams do not wait for: a call inside ``torch.cuda.graph`` would
    run at once, outside the graph), else 0 as before."""
    torch = _torch_module()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None) if torch is not None else None
    return raw(device) if raw is not None else 0


def _with_capsules(method: Any, streamed: bool = True) -> Any:
    """A binding method whose torch tensor arguments go as DLPack capsules (as ``_native``):
    the public classes' methods, so that a caller of ``Decoder.decode`` pays no more host time
    a tensor than the functional API does (bench/host_overhead.py). ``streamed``: the method
    takes a keyword-only ``stream=``, which defaults to ``_default_stream``."""
    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if streamed and kwargs.get("stream") is None:
            kwargs["stream"] = _default_stream(self.device)
        return _native(method, self, *args, **kwargs)  # self is no tensor: it goes as it is
    return call


def _clear_on_stream(method: Any) -> Any:
    """``clear_error_flag(stream=None)`` of the public classes: the stream by position or name,
    by default ``_default_stream``."""
    @functools.wraps(method)
    def call(self: Any, stream: Optional[int] = None) -> Any:
        return method(self, stream=_default_stream(self.device) if stream is None else stream)
    return call


def cp_gather_bytes(*, total_heads: int, world_size: int, rank: int = 0, max_tokens: int,
                    topk: int) -> int:
    """Bytes per rank of the larger all-gather of a context-parallel step of up to max_tokens
    rows (its queries or its keys): the max_bytes_per_rank a peer communicator needs."""
    return _native(_C.cp_gather_bytes, total_heads=total_heads, world_size=world_size, rank=rank,
                   max_tokens=max_tokens, topk=topk)


def _init_naming_scalars(base: Any) -> Any:
    """``__init__`` of a public class over ``base``: its scalar arguments named (_bad_scalar)."""
    @functools.wraps(base.__init__)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        _call_naming_scalars(base.__init__, (self,) + args, kwargs)
    return __init__


class Decoder(_C.Decoder):
    __doc__ = _C.Decoder.__doc__
    __module__ = "cpidx"
    __init__ = _init_naming_scalars(_C.Decoder)
    decode = _with_capsules(_C.Decoder.decode)
    shard_keys = _with_capsules(_C.Decoder.shard_keys)
    merge = _with_capsules(_C.Decoder.merge)
    cp_decode = _with_capsules(_C.Decoder.cp_decode)
    check_cp_decode = _with_capsules(_C.Decoder.check_cp_decode, streamed=False)
    clear_error_flag = _clear_on_stream(_C.Decoder.clear_error_flag)


class Prefiller(_C.Prefiller):
    __doc__ = _C.Prefiller.__doc__
    __module__ = "cpidx"
    __init__ = _init_naming_scalars(_C.Prefiller)
    prefill = _with_capsules(_C.Prefiller.prefill)
    clear_error_flag = _clear_on_stream(_C.Prefiller.clear_error_flag)


def _cache_dtype_name(cache: Any) -> str:
    bits = cache.element_size() if _is_torch(cache) else cache.dtype.itemsize
    return "fp8_e4m3" if bits == 1 else "bf16"


def _check_gpu_inputs(index_query: Any, index_cache: Any) -> None:
    """What the registry's GPU Decoder / Prefiller is made from (the query's heads, the cache's
    dtype), checked by the binding's own checks before one is made: making one allocates and
    synchronises (refused inside a capture), and a bad query would otherwise be reported as the
    decoder's total_heads, an argument the caller never passed. Run on a registry miss only: an
    existing object's call checks every argument itself."""
    _native(_C.check_query_and_cache, index_query, _as_bits(index_cache))


def _heads(index_query: Any) -> int:
    """The registry key's head count: -1 for a query that is not 3-dimensional, a key no object
    has, so that the miss's check (_check_gpu_inputs) names the query."""
    return index_query.shape[1] if len(index_query.shape) == 3 else -1


def _rows(index_query: Any) -> int:
    """The query's rows for the registry key's default size (1 for a 0-dim query, which the
    miss's check then names)."""
    return index_query.shape[0] if len(index_query.shape) >= 1 else 1


def _check_one_device(index_query: Any, **tensors: Any) -> None:
    """Before a registered op: every torch tensor argument on index_query's device. torch
    dispatches an op by its arguments' devices, so a meta tensor among CPU ones would run the
    op's fake (nothing written, no error); the binding names other mixes, but only once reached.
    The error flag is checked by its own rule (_check_error_flag), also before the op."""
    want = index_query.device
    tensor = _torch_module().Tensor  # imported: index_query is a tensor
    for name, t in tensors.items():
        if isinstance(t, tensor) and t.device != want:  # in the binding's words
            raise ValueError(f"{name}: expected a CUDA tensor on {want}, got {t.device}"
                             if want.type == "cuda" else
                             f"{name}: expected a host array (numpy or a CPU tensor), got "
                             f"{t.device}")


def _current_stream(device: Any) -> int:
    """The current stream of ``device`` (a torch.device or an index), as its cudaStream_t. torch's
    raw accessor (what torch.compile's generated code calls) takes ~0.3 us; the public
    ``current_stream(...).cuda_stream`` builds a Stream object first (bench/host_overhead.py)."""
    torch = _torch_module()
    index = device if isinstance(device, int) else device.index
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None and index is not None:
        return raw(index)
    return torch.cuda.current_stream(device).cuda_stream


def _device_current(device: Any) -> Any:
    """A context that makes ``device`` (a CUDA torch.device) current for a call: the GPU objects
    refuse another current device, and the current stream is that device's. Nothing to switch
    (a no-op context) when it is current already, as it is in an engine's steps."""
    torch = _torch_module()
    if device.index is not None and torch.cuda.current_device() == device.index:
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _capture_refusal(what: str) -> Optional[str]:
    """Why ``what`` may not run now, when the current CUDA stream is capturing a graph (read
    without any CUDA call), else None. ``what`` allocates device memory or synchronises
    (creating a Decoder, Prefiller or IndexerCPDecode; a collective close), which a capture
    forbids: CUDA's own refusal would also invalidate the capture, this one leaves it valid."""
    torch = _torch_module()
    if torch is None or not torch.cuda.is_available():
        return None
    if torch.cuda.is_current_stream_capturing():
        return (f"{what}: a CUDA graph is being captured on the current stream, and this "
                f"allocates and synchronises, which a capture forbids; do it before capturing "
                f"(the capture is still valid)")
    return None


def _refuse_during_capture(what: str) -> None:
    """Raises _capture_refusal's reason, if any."""
    why = _capture_refusal(what)
    if why is not None:
        raise RuntimeError(why)


def _check_error_flag(error_flag: Any, index_query: Any) -> None:
    """``error_flag``: one int32 element, where the inputs live (a numpy array or CPU tensor for
    host inputs, a tensor on the query's device for CUDA inputs)."""
    if error_flag is None:
        return
    if _is_torch(error_flag):
        torch = _torch_module()
        where = error_flag.device
        int32 = error_flag.dtype == torch.int32
        ok = error_flag.numel() == 1
        kind = f"{error_flag.dtype} tensor of {error_flag.numel()} elements on {where}"
    elif isinstance(error_flag, np.ndarray):
        where = "cpu"
        int32 = error_flag.dtype == np.int32
        ok = error_flag.size == 1 and error_flag.flags.writeable
        kind = f"{error_flag.dtype} array of {error_flag.size} elements" + (
            "" if error_flag.flags.writeable else " (read-only)")
    else:
        raise TypeError(f"error_flag: expected a one-element int32 array or tensor, got "
                        f"{type(error_flag).__name__}")
    want = index_query.device if _is_cuda(index_query) else "cpu"
    if not int32 or not ok or str(where) != str(want):
        # A wrong dtype is a TypeError, as the bindings raise it; the rest a ValueError.
        raise (ValueError if int32 else TypeError)(
            f"error_flag: expected one writable int32 element on {want} (the inputs' device), "
            f"got a {kind}")


def _or_host_error_bits(error_flag: Any, bits: int) -> None:
    if error_flag is not None and bits:
        flat = error_flag.reshape(-1)  # a view: one element
        flat[0] = int(flat[0]) | int(bits)


def _op_takes(error_flag: Any, index_query: Any, *tensors: Any) -> bool:
    """Whether a functional call goes through its registered op: wherever something may trace
    or redirect it (torch.compile, torch.jit.trace, a dispatch mode such as make_fx's, a
    torch.func transform, a tensor subclass among the arguments, meta tensors), since the op's
    dispatch costs more host time than the rest of an eager call (bench/host_overhead.py). A
    plain eager call on CUDA or CPU tensors runs the same implementation directly
    (_bump_versions stands in for the op's own bookkeeping). The ops take a tensor flag or
    none; another one goes to the eager path, which names it."""
    torch = _torch_module()
    plain = torch.Tensor
    if error_flag is not None and not isinstance(error_flag, plain):
        return False
    if torch.compiler.is_compiling():  # first: dynamo traces no call below
        return True
    if type(index_query) is not plain or not (index_query.is_cuda or index_query.is_cpu):
        return True
    for t in tensors:
        if t is not None and type(t) is not plain and isinstance(t, plain):
            return True
    if error_flag is not None and type(error_flag) is not plain:
        return True
    dispatch_stack, transforms = _redirect_probes(torch)
    return dispatch_stack() > 0 or transforms() or torch.jit.is_tracing()


@functools.lru_cache(maxsize=None)
def _redirect_probes(torch: Any) -> tuple:
    """torch's probes of a dispatch mode and of a torch.func transform (looked up once; a torch
    without one reports "redirected" or "not", as the op then stays safe)."""
    return (getattr(torch._C, "_len_torch_dispatch_stack", lambda: 1),
            getattr(torch._C, "_are_functorch_transforms_active", lambda: False))


def _bump_versions(*tensors: Any) -> None:
    """What the op's mutates_args does for the tensors a direct eager call wrote: their version
    counters move, so that autograd refuses a tensor saved for backward and since overwritten."""
    torch = _torch_module()
    if torch is None:  # host arrays: nothing to bump
        return
    for t in tensors:  # one at a time: a list is taken only from torch 2.5
        if t is not None and isinstance(t, torch.Tensor):
            torch.autograd.graph.increment_version(t)


def _token_bucket(n: int) -> int:
    """Decoder size for the functional API when max_tokens is not given: the next power of two
    (at least 64), so a handful of decoders serve every batch size."""
    return max(64, 1 << max(0, int(n) - 1).bit_length())


# ---- The registry -------------------------------------------------------------------------
class HostGroupError(RuntimeError):
    """An IndexerCPDecode's host (gloo) group failed (a rank missing past its timeout, a peer
    gone). gloo closes its connections then, so the group cannot be used again: steps that agree
    raise this, and close() lets the instance go without a collective."""


class Registry:
    """The package's one cache, explicit and documented (no other hidden global state).

    * ``decoder(...)``: one GPU :class:`cpidx.Decoder` per (device, heads, max_tokens,
      max_seq_len, topk, init_blocks, local_blocks, cache dtype), used by :func:`decode_topk` on
      CUDA tensors. Creating one allocates its workspace and synchronises, so the first call of a
      shape must happen before CUDA-graph capture (inside one it raises ``RuntimeError`` naming
      the shape, before any CUDA call: the capture stays valid).
    * ``prefiller(...)``: one GPU :class:`cpidx.Prefiller` per the same key, used by
      :func:`prefill_topk` on CUDA tensors.
    * ``cp_decode(**kwargs)``: one :class:`cpidx.IndexerCPDecode` per (rank, geometry, group),
      shared by every layer of a model (see :func:`cpidx.get_shared_cp_decode`); a closed one is
      replaced on the next call.

    Entries live until :meth:`clear` (collective when it holds IndexerCPDecode instances: it
    closes them); at interpreter exit they are dropped without a collective and without
    destroying their communicators (which could wait for a live CUDA graph). Delete the CUDA
    graphs that captured calls before :meth:`clear`: a decoder or prefiller dropped under a live
    graph keeps its workspace (the graph's replays use it) until the process exits, with a
    ``RuntimeWarning``. A workspace serves one stream at a time: layers run in order on one
    stream, as in the engine; calls of one shape from two streams at once (two threads) share
    it and must not overlap: pass each its own ``registry=`` or ``decoder=``.
    ``cpidx.registry`` is the default instance; pass your own ``registry=`` to keep separate
    sets.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._decoders: dict = {}
        self._prefillers: dict = {}
        self._cp: dict = {}
        self._making: dict = {}  # (store id, key) -> Event: a decoder or prefiller being made

    def _cached(self, store: dict, key: tuple, make: Any) -> Any:
        """The entry for ``key``, made by ``make()`` under the registry's lock when missing or
        closed (the shared IndexerCPDecode instances: their creation is collective, so the
        threads of a rank make them one at a time; ``make`` checks for a capture itself)."""
        with self._lock:
            obj = store.get(key)
            if obj is None or getattr(obj, "closed", False):
                obj = store[key] = make()
            return obj

    def _cached_apart(self, store: dict, key: tuple, make: Any, what: Any,
                      check: Any = None) -> Any:
        """The entry for ``key`` of a store whose objects' creation makes no collective
        (decoders, prefillers), made by ``make()`` when missing or closed, outside the
        registry's lock: calls of other shapes (other threads, other devices) go on meanwhile,
        and one thread makes a key while the others wanting it wait. On a miss ``check()``,
        when given, runs first (a call's arguments that sized the key), then the capture check
        naming ``what()``."""
        obj = store.get(key)  # a hit, the common case, without the lock (one dict read)
        if obj is not None and not getattr(obj, "closed", False):
            return obj
        slot, mine, made = (id(store), key), threading.Event(), None
        registered = False
        try:
            while True:
                with self._lock:
                    obj = store.get(key)
                    if obj is not None and not getattr(obj, "closed", False):
                        return obj
                    pending = self._making.get(slot)
                    if pending is None:
                        if check is not None:
                            check()
                        _refuse_during_capture(f"creating {what()} (the first call of this "
                                               f"shape)")
                        registered = True  # first: the finally below then always cleans up
                        self._making[slot] = mine
                        break
                pending.wait()  # made, or failed (then this thread tries itself)
            made = make()
            return made
        finally:
            if registered:  # also on an interrupt (KeyboardInterrupt): no waiter stays blocked
                with self._lock:
                    if made is not None:
                        store[key] = made
                    if self._making.get(slot) is mine:
                        del self._making[slot]
                mine.set()

    def decoder(self, *, device: int, heads: int, max_tokens: int, max_seq_len: int, topk: int,
                init_blocks: int, local_blocks: int, cache_dtype: str = "bf16",
                _check: Any = None) -> Decoder:
        key = (device, heads, max_tokens, max_seq_len, topk, init_blocks, local_blocks, cache_dtype)
        return self._cached_apart(self._decoders, key, lambda: Decoder(
            total_heads=heads, world_size=1, rank=0, max_tokens=max_tokens,
            max_seq_len=max_seq_len, topk=topk, init_blocks=init_blocks,
            local_blocks=local_blocks, device=device, cache_dtype=cache_dtype),
            lambda: f"a Decoder (max_tokens={max_tokens}, max_seq_len={max_seq_len}, "
                    f"{heads} heads)", _check)

    def prefiller(self, *, device: int, heads: int, max_tokens: int, max_seq_len: int, topk: int,
                  init_blocks: int, local_blocks: int, cache_dtype: str = "bf16",
                  _check: Any = None) -> Prefiller:
        key = (device, heads, max_tokens, max_seq_len, topk, init_blocks, local_blocks, cache_dtype)
        return self._cached_apart(self._prefillers, key, lambda: Prefiller(
            num_heads=heads, max_tokens=max_tokens, max_seq_len=max_seq_len, topk=topk,
            init_blocks=init_blocks, local_blocks=local_blocks, device=device,
            cache_dtype=cache_dtype),
            lambda: f"a Prefiller (max_tokens={max_tokens}, max_seq_len={max_seq_len}, "
                    f"{heads} heads)", _check)

    def cp_decode(self, **kwargs: Any) -> Any:
        from ._cp import IndexerCPDecode, _registry_key

        return self._cached(self._cp, _registry_key(kwargs), lambda: IndexerCPDecode(**kwargs))

    def clear(self) -> None:
        """Drop every decoder and prefiller and close every shared IndexerCPDecode (their device
        memory goes with them). Collective when it holds IndexerCPDecode instances with
        world_size > 1: every rank calls it, having created its instances in the same order.
        The instances whose close() is collective are closed first, in that order, each tried
        after one raised too (the ranks stay in step); only once they all closed are the others
        closed (those with a host group agree through it first, so that a step in flight on one
        rank keeps the instance on every rank) and the decoders and prefillers dropped. So when
        a rank cannot close (every rank then raises, having agreed on it), no rank drops more
        than the others:
        the first error is raised after all were tried, and an instance that could not close
        stays in the registry (open, and returned by the next ``cp_decode`` of its key), so a
        later ``clear()`` tries it again."""
        with self._lock:
            shared = list(self._cp.items())
            collective = [(key, cp) for key, cp in shared if cp._closes_collectively()]
            others = [(key, cp) for key, cp in shared if not cp._closes_collectively()]
            refusal = None
            if collective:
                refusal = _capture_refusal("Registry.clear() (it closes the shared "
                                           "IndexerCPDecode instances: collective)")
        if refusal is not None:
            # Nothing is closed or dropped during a capture; each collective close is still
            # called, and refuses too, after agreeing with the other ranks through its host
            # group (every rank raises there), so a rank that is not capturing is not left
            # waiting for this one.
            for _, cp in collective:
                try:
                    cp.close()
                except Exception:  # noqa: BLE001 - refused, as expected; reported below
                    pass
            raise RuntimeError(refusal)
        # The closes that make no collective (and dropping the decoders) wait for the collective
        # ones, whose verdict every rank reaches alike (they agree first): when one rank cannot
        # close, no rank drops anything else either, and the registries stay alike. Moving them
        # after the collective closes changes no rank's sequence of collectives.
        error = self._close_and_forget(collective)
        held = 0
        if error is None:
            with self._lock:
                dropped = list(self._decoders.values()) + list(self._prefillers.values())
                self._decoders.clear()
                self._prefillers.clear()
            # After the grace their destructors give graphs just deleted (CUDA releases them on
            # an internal thread): one grace for all of them, not one each; its running out on
            # a held one lets their destructors wait the short grace (GraphHolds).
            until = time.monotonic() + 0.1
            held = sum(1 for obj in dropped
                       if getattr(obj, "launches_in_live_graphs", lambda _: 0)(
                           max(0.0, until - time.monotonic())) > 0)
            del dropped  # their workspaces go now, but for those that live graphs still use
            error = self._close_and_forget(others)
        if error is not None:
            raise error
        if held:  # last: a warning raised as an error must not cut the closes short
            warnings.warn(f"Registry.clear(): {held} decoder(s) / prefiller(s) dropped while "
                          f"CUDA graphs that captured their calls are alive: their workspaces, "
                          f"which the graphs' replays use, are kept until the process exits "
                          f"(delete the graphs before clear())", RuntimeWarning, stacklevel=2)

    def _close_and_forget(self, entries: list) -> Optional[BaseException]:
        """close() each shared ``(key, instance)`` and drop it from the registry once closed;
        the first error, after all were tried (the ranks stay in step), or None."""
        error: Optional[BaseException] = None
        for key, cp in entries:
            try:
                cp.close()
            except Exception as e:  # noqa: BLE001 - keep the ranks in step: close the others
                error = error or e
                continue
            with self._lock:
                if self._cp.get(key) is cp:
                    del self._cp[key]
        return error

    def _drop_all(self) -> None:
        self._decoders.clear()
        self._prefillers.clear()
        self._cp.clear()

    def _drop_at_exit(self) -> None:
        """Interpreter exit: other ranks may have exited already and the engine's CUDA graphs
        usually still live, so nothing here may wait: the shared instances let go of their
        communicators without destroying them (their resources go with the process), then every
        entry is dropped."""
        with self._lock:
            shared = list(self._cp.values())
            self._drop_all()
        for cp in shared:
            if not cp.closed:
                cp._leak_at_exit()

    def __len__(self) -> int:
        return len(self._decoders) + len(self._prefillers) + len(self._cp)


registry = Registry()
# Release device memory (and the native objects) before the interpreter tears modules down.
atexit.register(registry._drop_at_exit)


# ---- decode / prefill ---------------------------------------------------------------------
def decode_topk(index_query: Any, index_cache: Any, block_table: Any, seq_lens: Any,
                query_len: int, out: Any, *, scale: float, topk: int, init_blocks: int = 0,
                local_blocks: int = 1, max_seq_len: int,
                attention_block_table: Any = None, sparse_block_table_out: Any = None,
                sparse_context_lens_out: Any = None, block_page_stride: Optional[int] = None,
                max_tokens: Optional[int] = None, decoder: Any = None,
                registry: Optional[Registry] = None, error_flag: Any = None) -> Any:
    """Top-K block ids of every head of ``index_query`` for decode rows (CONTRACT.md 3-4).

    index_query ``[n, heads, 128]`` bf16 (rows request-major: ``row = req * query_len + t``),
    index_cache ``[pages, 128, 128]`` bf16 or fp8 e4m3, block_table int32
    ``[num_reqs, >= cdiv(max_seq_len, 128)]``, seq_lens int32 ``[num_reqs]``; writes int32 ids
    ``[heads, n, topk]`` into ``out`` and returns it. The four sparse-table arguments go
    together (one head only; CONTRACT.md section 6).

    numpy arrays / CPU tensors: the C++ reference (bf16 as uint16 bits, or float arrays rounded
    here). torch CUDA tensors: the GPU decoder on the current stream (called directly when
    eager; under torch.compile through ``torch.ops.cpidx.decode_topk``), ``decoder`` if given
    (its topk, init_blocks, local_blocks and max_seq_len must be the call's), else the
    registry's decoder for this shape (``max_tokens`` fixes its size; default: the next power of
    two >= n), whose workspace serves one stream at a time (:class:`Registry`). With
    ``decoder`` or ``registry`` given, or the sparse-table arguments as host arrays, the call
    goes to the binding directly rather than through the op, also under torch.compile (a graph
    break there: ``fullgraph=True`` refuses it). Host arrays keep the same ``max_tokens`` rule:
    a call of more rows is refused on either path.

    ``error_flag``: optional one-element int32 array or tensor on the inputs' device. The call
    ORs into it the bits of the values it clamped instead of reading out of bounds
    (``ERR_SEQ_LEN_OUT_OF_RANGE``: a seq_len < 0 or > max_seq_len; ``ERR_PAGE_OUT_OF_RANGE``: a
    block-table entry outside the cache), and the ids are those of the clamped values. On CUDA
    tensors the kernels OR into it themselves, stream-ordered (read it after the step; nothing
    syncs, and it can be captured: a replay ORs into the same tensor), and the decoder's own flag
    (``Decoder.error_flag()``) is left untouched.
    """
    if _is_torch(index_query):
        torch = _torch_module()
        _check_one_device(index_query, index_cache=index_cache, block_table=block_table,
                          seq_lens=seq_lens, out=out,
                          attention_block_table=attention_block_table,
                          sparse_block_table_out=sparse_block_table_out,
                          sparse_context_lens_out=sparse_context_lens_out)
        use_op = _op_takes(error_flag, index_query, index_cache, block_table, seq_lens, out,
                           attention_block_table, sparse_block_table_out,
                           sparse_context_lens_out)
        if use_op:  # before the op (a meta flag would run its fake); _decode_now checks its own
            _check_error_flag(error_flag, index_query)
        if attention_block_table is None and sparse_block_table_out is None and \
                sparse_context_lens_out is None and block_page_stride is None and decoder is None \
                and registry is None and use_op:
            torch.ops.cpidx.decode_topk(index_query, _as_bits(index_cache), block_table, seq_lens,
                                        out, query_len, float(scale), topk, init_blocks,
                                        local_blocks, max_seq_len, max_tokens or 0, error_flag)
            return out
        # The op takes tensors: table arguments that are host arrays (or missing, which the
        # binding names) go to the eager path, as a host error_flag does.
        tables = (attention_block_table, sparse_block_table_out, sparse_context_lens_out)
        if decoder is None and registry is None and use_op and block_page_stride is not None \
                and all(_is_torch(x) for x in tables):
            torch.ops.cpidx.decode_topk_sparse_table(
                index_query, _as_bits(index_cache), block_table, seq_lens, out, query_len,
                float(scale), topk, init_blocks, local_blocks, max_seq_len, max_tokens or 0,
                attention_block_table, sparse_block_table_out, sparse_context_lens_out,
                int(block_page_stride), error_flag)
            return out
    # Not a registered-op case (an eager call, host arrays, an explicit decoder, or an incomplete
    # table argument set that the binding will name): call the implementation directly.
    _decode_now(index_query, index_cache, block_table, seq_lens, query_len, out, scale=scale,
                topk=topk, init_blocks=init_blocks, local_blocks=local_blocks,
                max_seq_len=max_seq_len, attention_block_table=attention_block_table,
                sparse_block_table_out=sparse_block_table_out,
                sparse_context_lens_out=sparse_context_lens_out,
                block_page_stride=block_page_stride, max_tokens=max_tokens, decoder=decoder,
                registry=registry, error_flag=error_flag)
    _bump_versions(out, sparse_block_table_out, sparse_context_lens_out, error_flag)
    return out


def _check_host_max_tokens(max_tokens: Any, rows: int, what: str, most: int) -> None:
    """On CUDA tensors ``max_tokens`` sizes the registry's Decoder or Prefiller, which refuses a
    bad bound and a call past it; host arrays keep the same rule, so that a call the reference
    takes runs on the GPU too. None or 0: automatic (no bound). ``most``: the largest bound."""
    if max_tokens is None or (isinstance(max_tokens, numbers.Integral) and max_tokens == 0):
        return
    if not isinstance(max_tokens, numbers.Integral):
        raise TypeError(f"max_tokens: expected an int, got {type(max_tokens).__name__}")
    if not 1 <= max_tokens <= most:
        raise ValueError(f"max_tokens: expected 1 to {most} (None or 0: automatic), got "
                         f"{max_tokens}")
    if rows > max_tokens:
        raise ValueError(f"index_query: {rows} {what} exceed max_tokens ({max_tokens})")


def _check_decoder_matches(decoder: Any, **wanted: int) -> None:
    """A decoder passed explicitly runs with its own selection and bound: the call's must match,
    or it would silently compute something other than what was asked."""
    for name, value in wanted.items():
        built = getattr(decoder, name)
        if value != built:
            raise ValueError(f"{name}: {value} differs from the decoder's ({name}={built}, fixed "
                             f"when it was created); pass the same value or another decoder")


def _decode_now(index_query: Any, index_cache: Any, block_table: Any, seq_lens: Any,
                query_len: int, out: Any, *, scale: float, topk: int, init_blocks: int,
                local_blocks: int, max_seq_len: int, attention_block_table: Any = None,
                sparse_block_table_out: Any = None, sparse_context_lens_out: Any = None,
                block_page_stride: Optional[int] = None, max_tokens: Optional[int] = None,
                decoder: Any = None, registry: Optional[Registry] = None,
                error_flag: Any = None) -> None:
    """The eager implementation behind decode_topk and its torch op."""
    _check_error_flag(error_flag, index_query)
    table = {} if attention_block_table is None and sparse_block_table_out is None and \
        sparse_context_lens_out is None and block_page_stride is None else dict(
            attention_block_table=attention_block_table,
            sparse_block_table_out=sparse_block_table_out,
            sparse_context_lens_out=sparse_context_lens_out,
            block_page_stride=block_page_stride)  # none given: the binding's defaults, the same
    if _is_cuda(index_query):
        device = index_query.device
        if decoder is not None:
            _check_decoder_matches(decoder, topk=topk, init_blocks=init_blocks,
                                   local_blocks=local_blocks, max_seq_len=max_seq_len)
        else:
            reg = registry if registry is not None else globals()["registry"]
            decoder = reg.decoder(device=device.index, heads=_heads(index_query),
                                  max_tokens=max_tokens or _token_bucket(_rows(index_query)),
                                  max_seq_len=max_seq_len, topk=topk, init_blocks=init_blocks,
                                  local_blocks=local_blocks,
                                  cache_dtype=_cache_dtype_name(index_cache),
                                  _check=lambda: _check_gpu_inputs(index_query, index_cache))
        with _device_current(device):  # its stream's device is current
            stream = _current_stream(device)
            decoder.decode(index_query, _as_bits(index_cache), block_table, seq_lens, query_len,
                           out, scale=scale, error_flag=error_flag, stream=stream, **table)
        return
    if decoder is not None:
        raise ValueError("decoder: a GPU Decoder needs CUDA tensors, got host arrays")
    _check_host_max_tokens(max_tokens, _rows(index_query), "rows (num_reqs * query_len)",
                           MAX_TOKENS)
    query = _host_bf16(index_query, "index_query")  # float arrays of any byte order: bf16 bits
    cache = _as_bits(_host_bf16(index_cache, "index_cache"))
    _check_host_arrays(("out", "sparse_block_table_out", "sparse_context_lens_out"), error_flag,
                       _table_read(block_table, seq_lens, max_seq_len), index_query=query,
                       index_cache=cache, block_table=block_table, seq_lens=seq_lens, out=out,
                       **table)
    bits = _native(_C.ref_decode_topk, query, cache, block_table, seq_lens, query_len, out,
                   scale=scale, topk=topk, init_blocks=init_blocks, local_blocks=local_blocks,
                   max_seq_len=max_seq_len, **table)
    _or_host_error_bits(error_flag, bits)


def prefill_topk(index_query: Any, index_cache: Any, block_table: Any, cu_seqlens_q: Any,
                 context_lens: Any, seq_lens: Any, out: Any, *, scale: float, topk: int,
                 init_blocks: int = 0, local_blocks: int = 1, max_seq_len: int,
                 max_tokens: Optional[int] = None, registry: Optional[Registry] = None,
                 error_flag: Any = None) -> Any:
    """Top-K block ids for prefill tokens (CONTRACT.md section 7): query ``i`` of request ``req``
    (rows ``cu_seqlens_q[req] <= row < cu_seqlens_q[req + 1]``) sits at
    ``context_lens[req] + i``. Writes int32 ``[heads, tokens, topk]`` into ``out``, returns it.

    Host arrays: the C++ reference. torch CUDA tensors: the GPU prefill kernel on the current
    stream (under torch.compile through ``torch.ops.cpidx.prefill_topk``) through the registry's
    :class:`cpidx.Prefiller` for this shape (``max_tokens`` fixes its size; default: the next
    power of two >= tokens; with ``registry`` given, that registry's, called directly rather
    than through the op; host arrays keep the same rule: a call of more tokens is refused).
    Allocation-free after the first call of a shape. ``error_flag``: as
    for :func:`decode_topk` (the prefiller's own flag is left untouched on CUDA tensors); here
    ``ERR_SEQ_LEN_OUT_OF_RANGE`` also stands for a ``context_lens`` or ``seq_lens`` entry out of
    ``[0, max_seq_len]`` and a ``cu_seqlens_q`` that is not non-decreasing in ``[0, tokens]``
    (clamped into such a sequence), ``ERR_PAGE_OUT_OF_RANGE`` for a block-table entry outside
    the cache.
    """
    if _is_torch(index_query):
        _check_one_device(index_query, index_cache=index_cache, block_table=block_table,
                          cu_seqlens_q=cu_seqlens_q, context_lens=context_lens,
                          seq_lens=seq_lens, out=out)
    if _is_torch(index_query) and registry is None and _op_takes(
            error_flag, index_query, index_cache, block_table, cu_seqlens_q, context_lens,
            seq_lens, out):
        _check_error_flag(error_flag, index_query)  # before the op, as in decode_topk
        _torch_module().ops.cpidx.prefill_topk(
            index_query, _as_bits(index_cache), block_table, cu_seqlens_q, context_lens,
            seq_lens, out, float(scale), topk, init_blocks, local_blocks, max_seq_len,
            max_tokens or 0, error_flag)
        return out
    _prefill_now(index_query, index_cache, block_table, cu_seqlens_q, context_lens, seq_lens, out,
                 scale=scale, topk=topk, init_blocks=init_blocks, local_blocks=local_blocks,
                 max_seq_len=max_seq_len, max_tokens=max_tokens, registry=registry,
                 error_flag=error_flag)
    _bump_versions(out, error_flag)
    return out


def _prefill_now(index_query: Any, index_cache: Any, block_table: Any, cu_seqlens_q: Any,
                 context_lens: Any, seq_lens: Any, out: Any, *, scale: float, topk: int,
                 init_blocks: int, local_blocks: int, max_seq_len: int,
                 max_tokens: Optional[int] = None, registry: Optional[Registry] = None,
                 error_flag: Any = None) -> None:
    _check_error_flag(error_flag, index_query)
    tokens = _rows(index_query)
    if tokens == 0:  # nothing to check or write, on either path
        return
    if not _is_cuda(index_query):
        _check_host_max_tokens(max_tokens, tokens, "tokens", _C_INT[1])  # a Prefiller's C int
        query = _host_bf16(index_query, "index_query")
        cache = _as_bits(_host_bf16(index_cache, "index_cache"))
        _check_host_arrays(("out",), error_flag, _table_read(block_table, seq_lens, max_seq_len),
                           index_query=query, index_cache=cache, block_table=block_table,
                           cu_seqlens_q=cu_seqlens_q, context_lens=context_lens,
                           seq_lens=seq_lens, out=out)
        bits = _native(_C.ref_prefill_topk, query, cache, block_table, cu_seqlens_q,
                       context_lens, seq_lens, out, scale=scale, topk=topk,
                       init_blocks=init_blocks, local_blocks=local_blocks,
                       max_seq_len=max_seq_len)
        _or_host_error_bits(error_flag, bits)
        return
    reg = registry if registry is not None else globals()["registry"]
    pre = reg.prefiller(device=index_query.device.index, heads=_heads(index_query),
                        max_tokens=max_tokens or _token_bucket(tokens), max_seq_len=max_seq_len,
                        topk=topk, init_blocks=init_blocks, local_blocks=local_blocks,
                        cache_dtype=_cache_dtype_name(index_cache),
                        _check=lambda: _check_gpu_inputs(index_query, index_cache))
    with _device_current(index_query.device):  # its stream's device is current
        stream = _current_stream(index_query.device)
        pre.prefill(index_query, _as_bits(index_cache), block_table, cu_seqlens_q, context_lens,
                    seq_lens, out, scale=scale, error_flag=error_flag, stream=stream)
