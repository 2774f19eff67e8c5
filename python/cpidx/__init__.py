"""cpidx: the decode-time indexer of block-sparse attention, context-parallel across ranks.

Functional API (destination passing: the caller allocates every output):

* :func:`decode_topk` -- top-K block ids ``[heads, n, topk]`` for decode rows. numpy arrays (or
  CPU tensors) run the C++ reference; torch CUDA tensors run the GPU decoder on the current
  stream (no allocation, no sync, capturable in a CUDA graph after one warm-up call).
* :func:`prefill_topk` -- the same selection for prefill tokens.
* ``error_flag=`` (both): a one-element int32 array or tensor into which a call ORs
  ``ERR_SEQ_LEN_OUT_OF_RANGE`` / ``ERR_PAGE_OUT_OF_RANGE`` when it clamped bad values instead of
  reading out of bounds (on the device, stream-ordered, for CUDA tensors).
* :class:`IndexerCPDecode` / :func:`get_shared_cp_decode` -- the context-parallel decode of the
  seed (vLLM's MiniMax-M3 indexer), drop-in: ``__call__`` writes ``[local_heads, n, topk]``.
* :data:`registry` -- the one documented cache: GPU decoders of the functional API and the
  shared ``IndexerCPDecode`` instances. ``registry.clear()`` frees them (and closes the shared
  instances: collective, every rank calls it).
* :class:`Communicator` -- the library's NCCL and peer communicators (``has_nccl``,
  ``has_peer``); :func:`cp_gather_bytes` is the per-rank bound a peer communicator needs, and
  its ``read_error_flag()`` returns ``PEER_ERROR_TIMEOUT`` once a rank gave up waiting for a peer.

bf16 on the host: numpy has no bfloat16, so host arrays carry bf16 as ``uint16`` bit patterns
(:func:`bf16_bits` converts float arrays; float32 arrays given directly are converted by the
wrappers, a copy). fp8 e4m3 caches are ``uint8`` bit patterns (or torch ``float8_e4m3fn``).

With torch importable, the ops are also registered as ``torch.ops.cpidx.decode_topk``,
``torch.ops.cpidx.decode_topk_sparse_table``, ``torch.ops.cpidx.prefill_topk`` and
``torch.ops.cpidx.cp_decode`` (an IndexerCPDecode's step by its ``handle``; a compiled graph
keeps it where nothing reads its outputs, since its collectives must run on every rank), with
fake implementations, so they work under ``torch.compile``. Their arguments are all positional
and required, ``error_flag`` last (``None`` for none).
"""
try:  # torch is optional (the numpy path needs only numpy). Imported before _C so that the
    # CUDA runtime and NCCL it loads are the ones _C binds to (same sonames).
    import torch as _torch
except ImportError:  # pragma: no cover - torch is optional
    _torch = None

from . import _C
from ._api import (
    BLOCK_SIZE,
    Decoder,
    ERR_PAGE_OUT_OF_RANGE,
    ERR_SEQ_LEN_OUT_OF_RANGE,
    HEAD_DIM,
    MAX_HEADS,
    MAX_QUERY_LEN,
    MAX_TOKENS,
    MAX_TOPK,
    MAX_WORLD_SIZE,
    HostGroupError,
    Prefiller,
    Registry,
    bf16_bits,
    bf16_to_float32,
    cp_gather_bytes,
    decode_topk,
    prefill_topk,
    registry,
)

__version__ = _C.__version__  # include/cpidx/version.h

__all__ = [
    "BLOCK_SIZE",
    "ERR_PAGE_OUT_OF_RANGE",
    "ERR_SEQ_LEN_OUT_OF_RANGE",
    "HEAD_DIM",
    "MAX_HEADS",
    "MAX_QUERY_LEN",
    "MAX_TOKENS",
    "MAX_TOPK",
    "MAX_WORLD_SIZE",
    "Registry",
    "bf16_bits",
    "bf16_to_float32",
    "decode_topk",
    "prefill_topk",
    "registry",
    "IndexerCPDecode",
    "HostGroupError",
    "get_shared_cp_decode",
    "Decoder",
    "Prefiller",
    "Communicator",
    "cp_gather_bytes",
    "gpu_available",
    "cuda_built",
    "has_nccl",
    "has_peer",
    "PEER_ERROR_TIMEOUT",
]

Communicator = _C.Communicator
gpu_available = _C.gpu_available
cuda_built = _C.cuda_built
has_nccl = _C.has_nccl
has_peer = _C.has_peer
PEER_ERROR_TIMEOUT = _C.PEER_ERROR_TIMEOUT

if _torch is not None:
    from . import _ops  # noqa: F401  (registers torch.ops.cpidx.*)
    from ._cp import IndexerCPDecode, get_shared_cp_decode
else:

    def _needs_torch(*_args, **_kwargs):
        raise ImportError("cpidx.IndexerCPDecode needs torch (pip install torch)")

    IndexerCPDecode = _needs_torch  # type: ignore[assignment]
    get_shared_cp_decode = _needs_torch  # type: ignore[assignment]
