"""torch on the host: the registered ops (torch.library.opcheck, fake tensors) and
IndexerCPDecode over a 2-process gloo group, on the C++ reference, with its argument checks and
its teardown (close, context manager, registry). Skips without torch."""
from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cpidx  # noqa: E402
from helpers import (golden_cases, golden_decode, process_group, random_decode,  # noqa: E402
                     run_ranks)


def as_torch(b):
    return (torch.from_numpy(b.query.view(np.int16)).view(torch.bfloat16),
            torch.from_numpy(b.cache.view(np.int16)).view(torch.bfloat16),
            torch.from_numpy(b.block_table), torch.from_numpy(b.seq_lens))


def _passing_mode():
    """A TorchDispatchMode that runs every op as it is: a call under it may be traced, so it
    takes the registered op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    return Passing()


def test_ops_registered():
    for name in ("decode_topk", "decode_topk_sparse_table", "prefill_topk", "cp_decode"):
        assert hasattr(torch.ops.cpidx, name)


@pytest.mark.parametrize("case", golden_cases("decode")[:6], ids=lambda c: f"seed{c['seed']}")
def test_golden_decode_cpu_tensors(case):
    b = golden_decode(case)
    q, k, bt, sl = as_torch(b)
    out = torch.full((case["T"], b.rows, case["K"]), 5, dtype=torch.int32)
    cpidx.decode_topk(q, k, bt, sl, b.query_len, out, scale=b.scale, topk=case["K"],
                      init_blocks=case["init"], local_blocks=case["local"],
                      max_seq_len=b.max_seq_len)
    assert out.tolist() == case["ids"]


def test_opcheck_decode_topk():
    rng = np.random.default_rng(1)
    b = random_decode(rng, 2, 2, [300, 40], max_seq_len=512)
    q, k, bt, sl = as_torch(b)
    out = torch.zeros((2, b.rows, 4), dtype=torch.int32)
    torch.library.opcheck(torch.ops.cpidx.decode_topk.default,
                          (q, k, bt, sl, out, 2, 0.5, 4, 0, 1, 512, 0, None),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("op", ["prefill_topk", "decode_topk_sparse_table"])
def test_opcheck_prefill_and_sparse_table_ops(op):
    # The schemas declare every tensor the ops write (out, the sparse tables, error_flag).
    b = random_decode(np.random.default_rng(1), 1, 1, [300, 500], max_seq_len=1024)
    q, k, bt, sl = as_torch(b)
    out = torch.zeros((1, 2, 4), dtype=torch.int32)
    sel = (0.5, 4, 0, 1, 1024, 0)  # scale, topk, init, local, max_seq_len, max_tokens
    if op == "prefill_topk":
        cu, ctx = torch.tensor([0, 1, 2], dtype=torch.int32), sl - 1
        calls = [(q, k, bt, cu, ctx, sl, out, *sel, f)
                 for f in (None, torch.zeros(1, dtype=torch.int32))]
    else:
        tables = (torch.arange(16, dtype=torch.int32).reshape(2, 8),
                  torch.zeros((2, 32), dtype=torch.int32), torch.zeros(2, dtype=torch.int32))
        calls = [(q, k, bt, sl, out, 1, *sel, *tables, 8, None)]
    for args in calls:
        torch.library.opcheck(getattr(torch.ops.cpidx, op).default, args,
                              test_utils=("test_schema", "test_faketensor"))


def test_compile_calls_op_on_cpu():
    rng = np.random.default_rng(2)
    b = random_decode(rng, 2, 1, [700, 129], max_seq_len=768)
    q, k, bt, sl = as_torch(b)
    want = torch.zeros((2, b.rows, 8), dtype=torch.int32)
    cpidx.decode_topk(q, k, bt, sl, 1, want, scale=b.scale, topk=8, max_seq_len=768)

    def f(q, k, bt, sl, out):
        torch.ops.cpidx.decode_topk(q, k, bt, sl, out, 1, 0.5, 8, 0, 1, 768, 0, None)
        return out + 0

    got = torch.compile(f, fullgraph=True, backend="eager")(q, k, bt, sl,
                                                            torch.zeros_like(want))
    assert torch.equal(got, want)


@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated")  # any category
def test_functional_call_dispatches_the_op_only_when_traced(monkeypatch):
    # A plain eager call of cpidx.decode_topk runs its implementation directly (the op's dispatch
    # costs more host time than the rest of the call), bumping the version counters of what it
    # wrote as the op would; wherever something may trace or redirect the call (a dispatch mode,
    # make_fx, torch.compile, meta tensors) it is the op, with the eager call's ids.
    from torch.fx.experimental.proxy_tensor import make_fx

    b = random_decode(np.random.default_rng(4), 2, 1, [700, 129], max_seq_len=768)
    q, k, bt, sl = as_torch(b)
    kw = dict(scale=b.scale, topk=8, max_seq_len=768)
    want = torch.full((2, b.rows, 8), -5, dtype=torch.int32)
    from cpidx import _ops

    real, calls = _ops._decode_now, []

    def spy(*args, **kwargs):  # what the op runs (the direct call runs _api's own reference)
        calls.append(len(args))
        return real(*args, **kwargs)

    monkeypatch.setattr(_ops, "_decode_now", spy)
    flag = torch.zeros(1, dtype=torch.int32)
    versions = (want._version, flag._version)
    cpidx.decode_topk(q, k, bt, sl, 1, want, error_flag=flag, **kw)
    assert calls == [] and int(want.min()) >= -1
    assert want._version > versions[0] and flag._version > versions[1]

    got = torch.full_like(want, -5)
    with _passing_mode():
        cpidx.decode_topk(q, k, bt, sl, 1, got, **kw)
    assert len(calls) == 1 and torch.equal(got, want)
    meta = [t.to("meta") for t in (q, k, bt, sl)]
    cpidx.decode_topk(*meta, 1, torch.empty_like(want, device="meta"), **kw)  # the op's fake
    monkeypatch.undo()
    # A tensor subclass in any argument (here the output) takes the op, whose dispatch writes
    # both of TwoTensor's halves.
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    pair = two_tensor.TwoTensor(torch.full_like(want, -5), torch.full_like(want, -5))
    cpidx.decode_topk(q, k, bt, sl, 1, pair, **kw)
    assert torch.equal(pair.a, want) and torch.equal(pair.b, want)

    def f(q, k, bt, sl, out):
        cpidx.decode_topk(q, k, bt, sl, 1, out, **kw)
        return out + 0

    traced = make_fx(f)(q, k, bt, sl, torch.zeros_like(want))
    assert any("cpidx.decode_topk" in str(n.target) for n in traced.graph.nodes), traced.graph
    other = torch.zeros_like(want)
    cpidx.decode_topk(q, k, bt, sl.flip(0).contiguous(), 1, other, **kw)
    assert torch.equal(traced(q, k, bt, sl.flip(0).contiguous(), torch.zeros_like(want)), other)
    jit = torch.jit.trace(f, (q, k, bt, sl, torch.zeros_like(want)), check_trace=False)
    assert "cpidx::decode_topk" in str(jit.graph), jit.graph  # the op, not a constant
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend=backend)(q, k, bt, sl, torch.zeros_like(want))
    assert torch.equal(got, want)
    targets = [str(n.target) for g in graphs for n in g.graph.nodes]
    assert any("cpidx.decode_topk" in t for t in targets), targets


@pytest.mark.skipif(not hasattr(getattr(torch, "func", None), "functionalize"),
                    reason="needs torch.func.functionalize")
def test_a_functorch_transform_takes_the_op():
    # Under a functorch transform the call is the op, and torch names it (the direct path
    # handed the transform's wrapper tensors to the binding, which read "block_table is null").
    b = random_decode(np.random.default_rng(11), 2, 1, [300, 5], max_seq_len=512)
    q, k, bt, sl = as_torch(b)

    def f(q, k, bt, sl, out):
        cpidx.decode_topk(q, k, bt, sl, 1, out, scale=0.5, topk=4, max_seq_len=512)
        return out + 0

    with pytest.raises(RuntimeError, match="cpidx::decode_topk"):
        torch.func.functionalize(f)(q, k, bt, sl, torch.zeros((2, 2, 4), dtype=torch.int32))


def test_under_a_dispatch_mode_what_the_op_cannot_take_runs_eagerly_or_is_named():
    # The op takes tensors only: a numpy error_flag or numpy output tables take the eager path
    # (which works); a GPU decoder with CPU tensors, or an incomplete table set, is named.
    b = random_decode(np.random.default_rng(11), 2, 1, [300, 5], max_seq_len=512)
    q, k, bt, sl = as_torch(b)
    kw = dict(scale=0.5, topk=4, max_seq_len=512)
    bad = sl.clone()
    bad[0] = 900  # past max_seq_len: clamped and flagged
    flag, want = np.zeros(1, np.int32), np.zeros(1, np.int32)
    cpidx.decode_topk(q, k, bt, bad, 1, torch.zeros((2, 2, 4), dtype=torch.int32),
                      error_flag=want, **kw)
    with _passing_mode():
        cpidx.decode_topk(q, k, bt, bad, 1, torch.zeros((2, 2, 4), dtype=torch.int32),
                          error_flag=flag, **kw)
    assert int(flag[0]) == int(want[0]) != 0
    with _passing_mode(), pytest.raises(ValueError, match="^decoder: a GPU Decoder needs CUDA"):
        cpidx.decode_topk(q, k, bt, sl, 1, torch.zeros((2, 2, 4), dtype=torch.int32),
                          decoder=object(), **kw)
    b = random_decode(np.random.default_rng(1), 1, 1, [300, 500], max_seq_len=1024)
    q, k, bt, sl = as_torch(b)
    kw = dict(scale=0.5, topk=4, max_seq_len=1024)
    attn = torch.arange(16, dtype=torch.int32).reshape(2, 8)
    table, lens = np.full((2, 32), -5, np.int32), np.full(2, -5, np.int32)
    with _passing_mode():
        cpidx.decode_topk(q, k, bt, sl, 1, torch.zeros((1, 2, 4), dtype=torch.int32),
                          attention_block_table=attn, sparse_block_table_out=table,
                          sparse_context_lens_out=lens, block_page_stride=8, **kw)
    assert lens.tolist() == [300, 500]
    with _passing_mode(), pytest.raises(ValueError, match="missing sparse_block_table_out"):
        cpidx.decode_topk(q, k, bt, sl, 1, torch.zeros((1, 2, 4), dtype=torch.int32),
                          attention_block_table=attn, **kw)


def test_eager_calls_bump_the_versions_of_what_they_write():
    # As the op would (autograd sees the overwrite): the sparse tables, and prefill's out.
    b = random_decode(np.random.default_rng(1), 1, 1, [300, 500], max_seq_len=1024)
    q, k, bt, sl = as_torch(b)
    out = torch.zeros((1, 2, 4), dtype=torch.int32)
    table, lens = torch.zeros((2, 32), dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    before = (table._version, lens._version)
    cpidx.decode_topk(q, k, bt, sl, 1, out, scale=0.5, topk=4, max_seq_len=1024,
                      attention_block_table=torch.arange(16, dtype=torch.int32).reshape(2, 8),
                      sparse_block_table_out=table, sparse_context_lens_out=lens,
                      block_page_stride=8)
    assert table._version > before[0] and lens._version > before[1]
    before = out._version
    cpidx.prefill_topk(q, k, bt, torch.tensor([0, 1, 2], dtype=torch.int32), sl - 1, sl, out,
                       scale=0.5, topk=4, max_seq_len=1024)
    assert out._version > before


def test_tensors_reach_the_binding_as_dlpack_capsules():
    # torch's Python-level __dlpack__ (which nanobind calls on a tensor) is skipped: a plain
    # tensor goes to the binding as a capsule; what DLPack cannot carry goes as it is, so the
    # binding's own check reports it as before.
    from cpidx._api import _dl_with, _native

    def _dl(x):
        return _dl_with(torch.Tensor, torch.utils.dlpack.to_dlpack, x)

    t = torch.arange(6, dtype=torch.int32).view(2, 3)[:, 1:]  # strided, with an offset
    assert type(_dl(t)).__name__ == "PyCapsule"
    assert torch.equal(torch.from_dlpack(_dl(t)), t)
    arr = np.zeros(2)
    for x in (None, 3, arr, torch.nn.Parameter(torch.zeros(2))):  # a subclass: as it is
        assert _dl(x) is x
    # Every binding call goes through _native, which converts positional and keyword tensors.
    args, kwargs = _native(lambda *a, **k: (a, k), t, arr, out=t, scale=0.5)
    assert [type(a).__name__ for a in args] == ["PyCapsule", "ndarray"]
    assert type(kwargs["out"]).__name__ == "PyCapsule" and kwargs["scale"] == 0.5
    # One that DLPack refuses (a sparse tensor) goes as it is, the others still as capsules.
    sparse = torch.zeros(2).to_sparse()
    args, kwargs = _native(lambda *a, **k: (a, k), t, sparse, out=t, flag=sparse)
    assert type(args[0]).__name__ == "PyCapsule" and args[1] is sparse
    assert type(kwargs["out"]).__name__ == "PyCapsule" and kwargs["flag"] is sparse
    # The binding still names a refused tensor argument.
    b = random_decode(np.random.default_rng(5), 2, 1, [300], max_seq_len=512)
    q, k, bt, sl = as_torch(b)
    with pytest.raises(TypeError, match="^seq_lens: expected int32, got int64"):
        cpidx.decode_topk(q, k, bt, sl.long(), 1, torch.zeros((2, 1, 4), dtype=torch.int32),
                          scale=1.0, topk=4, max_seq_len=512)


def test_a_float8_cache_of_another_format_or_a_float16_query_is_named():
    # float8_e4m3fn is read as its bits, also when the binding gets the float8 tensor itself;
    # another float8 format (other values for the same bits) and a float16 query are refused.
    from cpidx import _C
    from cpidx._api import _native

    b = random_decode(np.random.default_rng(7), 2, 1, [300, 500], max_seq_len=512)
    q, k, bt, sl = as_torch(b)
    bits = torch.from_numpy(np.random.default_rng(8).integers(0, 0x70, size=k.shape,
                                                              dtype=np.uint8))
    kw = dict(scale=0.5, topk=4, max_seq_len=512)
    want = torch.zeros((2, 2, 4), dtype=torch.int32)
    cpidx.decode_topk(q, bits, bt, sl, 1, want, **kw)
    out = torch.full_like(want, -5)
    _native(_C.ref_decode_topk, q, bits.view(torch.float8_e4m3fn), bt, sl, 1, out,
            init_blocks=0, local_blocks=1, **kw)
    assert torch.equal(out, want)
    out.fill_(-5)
    refused = r"^index_cache: expected bfloat16 or float8_e4m3fn \(or uint16 / uint8 holding"
    for name in ("float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
        with pytest.raises(TypeError, match=rf"{refused} their bits\), got {name}$"):
            cpidx.decode_topk(q, bits.view(getattr(torch, name)), bt, sl, 1, out, **kw)
    with pytest.raises(TypeError, match=r"^index_query: expected bfloat16 \(or uint16 holding "
                                        r"bf16 bits\), got float16$"):
        cpidx.decode_topk(q.half(), k, bt, sl, 1, out, **kw)
    assert (out == -5).all()


def test_the_public_classes_hand_their_tensors_over_as_capsules():
    # cpidx.Decoder and cpidx.Prefiller are the binding's classes with every method that takes
    # tensors (its signature names an ndarray) wrapped as _native wraps a binding function, so a
    # caller of Decoder.decode skips torch's __dlpack__ too. A method added to the binding
    # without its wrapper fails here.
    from cpidx import _C
    from cpidx._api import _with_capsules

    for cls, base, methods in ((cpidx.Decoder, _C.Decoder, 5),
                               (cpidx.Prefiller, _C.Prefiller, 1)):
        assert issubclass(cls, base) and cls.__doc__ == base.__doc__ and cls.__module__ == "cpidx"
        names = [n for n in dir(base) if not n.startswith("_")
                 and "ndarray" in (getattr(base, n).__doc__ or "").split("\n")[0]]
        assert len(names) == methods, names
        for n in names:
            assert getattr(cls, n).__wrapped__ is getattr(base, n), n
            assert getattr(cls, n).__doc__ == getattr(base, n).__doc__, n
    t = torch.arange(4, dtype=torch.int32)
    me = object()
    got_self, args, kwargs = _with_capsules(lambda self, *a, **k: (self, a, k))(
        me, t, 2, out=t, stream=0)
    assert got_self is me and [type(a).__name__ for a in args] == ["PyCapsule", "int"]
    assert type(kwargs["out"]).__name__ == "PyCapsule" and kwargs["stream"] == 0
    assert torch.equal(torch.from_dlpack(args[0]), t)


def test_error_flag_through_the_op_and_compile():
    rng = np.random.default_rng(3)
    b = random_decode(rng, 2, 2, [600, 40], max_seq_len=512)  # 600 > max_seq_len: clamped
    q, k, bt, sl = as_torch(b)
    want = torch.zeros((2, b.rows, 4), dtype=torch.int32)
    clamped = sl.clone()
    clamped[0] = 512
    cpidx.decode_topk(q, k, bt, clamped, 2, want, scale=b.scale, topk=4, max_seq_len=512)
    out, flag = torch.full_like(want, -3), torch.zeros(1, dtype=torch.int32)
    cpidx.decode_topk(q, k, bt, sl, 2, out, scale=b.scale, topk=4, max_seq_len=512,
                      error_flag=flag)
    assert torch.equal(out, want) and int(flag) == cpidx.ERR_SEQ_LEN_OUT_OF_RANGE
    args = (q, k, bt, sl, torch.zeros_like(want), 2, 0.5, 4, 0, 1, 512, 0)
    torch.library.opcheck(torch.ops.cpidx.decode_topk.default, args + (flag,),
                          test_utils=("test_schema", "test_faketensor"))

    def f(q, k, bt, sl, out, flag):
        torch.ops.cpidx.decode_topk(q, k, bt, sl, out, 2, 0.5, 4, 0, 1, 512, 0, flag)
        return out + 0, flag + 0

    flag.zero_()
    got, bits = torch.compile(f, fullgraph=True, backend="eager")(q, k, bt, sl,
                                                                  torch.zeros_like(want), flag)
    assert torch.equal(got, want) and int(bits) == cpidx.ERR_SEQ_LEN_OUT_OF_RANGE
    with pytest.raises(TypeError, match="^error_flag: .*torch.int64 tensor"):
        cpidx.decode_topk(q, k, bt, sl, 2, out, scale=b.scale, topk=4, max_seq_len=512,
                          error_flag=torch.zeros(1, dtype=torch.int64))


def test_sparse_table_as_host_arrays_next_to_a_torch_query():
    # The op takes tensors: numpy table arguments take the eager path (they were compared with
    # None elementwise, numpy's "truth value ... is ambiguous"), with the tensors' result.
    b = random_decode(np.random.default_rng(1), 1, 1, [300, 500], max_seq_len=1024)
    q, k, bt, sl = as_torch(b)
    kw = dict(scale=0.5, topk=4, max_seq_len=1024, block_page_stride=8)
    results = []
    for wrap in (np.asarray, torch.from_numpy):
        out = torch.zeros((1, 2, 4), dtype=torch.int32)
        attn = wrap(np.arange(2 * 8, dtype=np.int32).reshape(2, 8))
        table, lens = wrap(np.full((2, 4 * 8), -5, np.int32)), wrap(np.full(2, -5, np.int32))
        cpidx.decode_topk(q, k, bt, sl, 1, out, attention_block_table=attn,
                          sparse_block_table_out=table, sparse_context_lens_out=lens, **kw)
        results.append((out.tolist(), np.asarray(table).tolist(), np.asarray(lens).tolist()))
    assert results[0] == results[1] and results[0][2] == [300, 500], results


def test_a_tensor_on_another_device_is_named_before_the_op_runs_its_fake():
    # torch dispatches by the arguments' devices: a meta tensor among CPU ones ran the op's fake,
    # writing nothing and raising nothing.
    b = random_decode(np.random.default_rng(2), 2, 1, [300, 500], max_seq_len=1024)
    q, k, bt, sl = as_torch(b)
    kw = dict(scale=0.5, topk=4, max_seq_len=1024)
    out = torch.full((2, 2, 4), -7, dtype=torch.int32)
    for name, args in (("index_cache", (q, k.to("meta"), bt, sl)),
                       ("block_table", (q, k, bt.to("meta"), sl)),
                       ("seq_lens", (q, k, bt, sl.to("meta")))):
        with pytest.raises(ValueError, match=f"^{name}: expected a host array "):
            cpidx.decode_topk(*args, 1, out, **kw)
    with pytest.raises(ValueError, match="^out: expected a host array "):
        cpidx.decode_topk(q, k, bt, sl, 1, out.to("meta"), **kw)
    meta_flag = torch.zeros(1, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="^error_flag: expected one writable int32 element on cpu"):
        cpidx.decode_topk(q, k, bt, sl, 1, out, error_flag=meta_flag, **kw)
    assert (out == -7).all()
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    ctx = torch.tensor([299, 499], dtype=torch.int32)
    with pytest.raises(ValueError, match="^context_lens: expected a host array "):
        cpidx.prefill_topk(q[:2], k, bt, cu, ctx.to("meta"), sl, out[:, :2], **kw)
    with pytest.raises(ValueError, match="^error_flag: expected one writable int32 element on cpu"):
        cpidx.prefill_topk(q[:2], k, bt, cu, ctx, sl, out[:, :2], error_flag=meta_flag, **kw)
    # The registered ops called directly (the README's torch.ops form): the fakes check the
    # devices, so the same mixes raise there too, naming the tensor.
    ops = torch.ops.cpidx
    op_args = (0.5, 4, 0, 1, 1024, 0)  # scale, topk, init, local, max_seq_len, max_tokens
    with pytest.raises(ValueError, match="^cpidx::decode_topk: out is on meta, index_query on cpu"):
        ops.decode_topk(q, k, bt, sl, out.to("meta"), 1, *op_args, None)
    with pytest.raises(ValueError, match="^cpidx::decode_topk: error_flag is on meta"):
        ops.decode_topk(q, k, bt, sl, out, 1, *op_args, meta_flag)
    with pytest.raises(ValueError, match="^cpidx::prefill_topk: context_lens is on meta"):
        ops.prefill_topk(q[:2], k, bt, cu, ctx.to("meta"), sl, out[:, :2], *op_args, None)
    assert (out == -7).all()
    with pytest.raises(ValueError, match="^cpidx::prefill_topk: error_flag is on meta"):
        ops.prefill_topk(q[:2], k, bt, cu, ctx, sl, out[:, :2], *op_args, meta_flag)
    b1 = random_decode(np.random.default_rng(1), 1, 1, [300, 500], max_seq_len=1024)
    tables = (torch.arange(16, dtype=torch.int32).reshape(2, 8),
              torch.zeros((2, 32), dtype=torch.int32, device="meta"),
              torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="^cpidx::decode_topk_sparse_table: "
                                         "sparse_block_table_out is on meta"):
        ops.decode_topk_sparse_table(*as_torch(b1), out[:1], 1, *op_args, *tables, 8, None)
    assert (out == -7).all()
    # All meta (shape propagation): the fakes run, nothing to check but the flag's dtype.
    meta = [t.to("meta") for t in (q, k, bt, sl, out)]
    ops.decode_topk(*meta[:4], meta[4], 1, *op_args, None)
    with pytest.raises(TypeError, match="^error_flag: .*torch.int64"):
        cpidx.decode_topk(*meta, 1, error_flag=torch.zeros(1, dtype=torch.int64, device="meta"),
                          **kw)
    cpidx.decode_topk(q, k, bt, sl, 1, out, **kw)  # all on the CPU: runs
    assert (out != -7).any()


def test_public_methods_without_a_stream_take_torchs_current_stream(monkeypatch):
    # Decoder / Prefiller methods called without stream= run on torch's current stream of the
    # object's device (inside torch.cuda.graph: the capture's), not on the binding's default,
    # the legacy stream 0, which torch's side and capture streams do not wait for.
    # Where torch has no CUDA (this one, or a stand-in without the raw accessor): 0, as before.
    from cpidx import _api
    seen = []

    def method(self, *args, stream=0, **kwargs):
        seen.append(stream)

    class Obj:
        device = 3

    def clear(self, stream=0):  # the binding's clear_error_flag takes its stream by position too
        seen.append(stream)

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1000 + device,
                        raising=False)
    wrapped, cleared = _api._with_capsules(method), _api._clear_on_stream(clear)
    wrapped(Obj())
    wrapped(Obj(), stream=7)
    wrapped(Obj(), stream=None)
    wrapped(Obj(), stream=0)  # asked for by name: the legacy stream it is
    _api._with_capsules(method, streamed=False)(Obj())
    cleared(Obj())
    cleared(Obj(), 9)
    cleared(Obj(), stream=11)
    assert seen == [1003, 7, 1003, 0, 0, 1003, 9, 11]
    monkeypatch.delattr(torch._C, "_cuda_getCurrentRawStream")
    seen.clear()
    wrapped(Obj())
    cleared(Obj())
    assert seen == [0, 0]
    for cls, names in ((cpidx.Decoder, ("decode", "shard_keys", "merge", "cp_decode",
                                        "clear_error_flag")),
                       (cpidx.Prefiller, ("prefill", "clear_error_flag"))):
        for name in names:
            assert getattr(cls, name).__wrapped__ is getattr(cls.__mro__[1], name), name


def test_gpu_calls_check_the_query_before_making_a_decoder(monkeypatch):
    # On CUDA tensors the registry's Decoder / Prefiller is made from index_query's heads (it
    # allocates and synchronises): a bad query must be named as the binding names it, before
    # one is made. Simulated on the CPU: the tensors taken for CUDA ones, the constructors
    # recording what they would have made.
    import cpidx._api as api

    made = []

    def recorder(kind):
        def make(**kw):
            made.append(kind)
            raise KeyError(f"{kind} made")  # stops the call before any CUDA work
        return make

    monkeypatch.setattr(api, "_is_cuda", lambda x: True)
    monkeypatch.setattr(api, "Decoder", recorder("Decoder"))
    monkeypatch.setattr(api, "Prefiller", recorder("Prefiller"))
    k = torch.zeros((4, 128, 128), dtype=torch.bfloat16)
    bt = torch.zeros((1, 8), dtype=torch.int32)
    sl = torch.tensor([300], dtype=torch.int32)
    out = torch.zeros((9, 4, 8), dtype=torch.int32)

    def both(q, cache=k):
        reg = cpidx.Registry()
        kw = dict(scale=1.0, topk=8, init_blocks=0, local_blocks=1, max_seq_len=1024,
                  registry=reg)
        yield lambda: cpidx.decode_topk(q, cache, bt, sl, 1, out, **kw)
        yield lambda: cpidx.prefill_topk(q, cache, bt, torch.tensor([0, 4], dtype=torch.int32),
                                         torch.tensor([0], dtype=torch.int32), sl, out, **kw)

    for shape, dtype, exc, match in (
            ([4, 9, 128], torch.bfloat16, ValueError, r"expected 1 to 8 heads in dim 1, got shape "
                                                      r"\[4, 9, 128\]"),
            ([4, 0, 128], torch.bfloat16, ValueError, "expected 1 to 8 heads"),
            ([4, 128], torch.bfloat16, ValueError, r"expected 3 dims \[tokens, heads, 128\]"),
            ([4], torch.uint16, ValueError, "expected 3 dims"),
            ([4, 2, 64], torch.bfloat16, ValueError, "expected head dim 128"),
            ([4, 2, 128], torch.float32, TypeError, r"expected bfloat16 \(or uint16 holding bf16 "
                                                    r"bits\), got float32")):
        for call in both(torch.zeros(shape, dtype=dtype)):
            with pytest.raises(exc, match="^index_query: " + match):
                call()
    for call in both(torch.zeros((4, 2, 128), dtype=torch.bfloat16), k.float()):
        with pytest.raises(TypeError, match="^index_cache: expected bfloat16 or float8_e4m3fn"):
            call()
    assert made == []
    for call in both(torch.zeros((4, 2, 128), dtype=torch.uint16)):  # good: made, then stopped
        with pytest.raises(KeyError, match="made"):
            call()
    assert made == ["Decoder", "Prefiller"]


def test_gpu_calls_share_a_decoder_per_power_of_two_rows_and_still_check_the_query(monkeypatch):
    # The registry's Decoder is sized for the next power of two >= the rows (at least 64), and a
    # 2-dim query whose dim 1 matches an existing Decoder's heads is still named. Simulated on the
    # CPU: the tensors taken for CUDA ones, the constructors recording what they make.
    import contextlib
    import types

    import cpidx._api as api

    made, calls = [], []

    def make(**kw):
        made.append(kw)
        return types.SimpleNamespace(decode=lambda *a, **k: calls.append("decode"))

    monkeypatch.setattr(api, "_is_cuda", lambda x: True)
    monkeypatch.setattr(api, "_device_current", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(api, "_current_stream", lambda d: 0)
    monkeypatch.setattr(api, "Decoder", make)
    k = torch.zeros((4, 128, 128), dtype=torch.bfloat16)
    kw = dict(scale=1.0, topk=8, max_seq_len=1024, registry=cpidx.Registry())
    for rows, size in ((1, 64), (64, 64), (65, 128), (128, 128)):
        cpidx.decode_topk(torch.zeros((rows, 2, 128), dtype=torch.bfloat16), k,
                          torch.zeros((rows, 8), dtype=torch.int32),
                          torch.full((rows,), 300, dtype=torch.int32), 1,
                          torch.zeros((2, rows, 8), dtype=torch.int32), **kw)
        assert made[-1]["max_tokens"] == size, (rows, made[-1])
    assert len(made) == 2 and len(calls) == 4
    with pytest.raises(ValueError, match=r"^index_query: expected 3 dims"):
        cpidx.decode_topk(torch.zeros((4, 2), dtype=torch.bfloat16), k,
                          torch.zeros((4, 8), dtype=torch.int32),
                          torch.full((4,), 300, dtype=torch.int32), 1,
                          torch.zeros((2, 4, 8), dtype=torch.int32), **kw)
    assert len(made) == 2 and len(calls) == 4


def test_device_helpers_switch_only_to_another_device_and_take_any_devices_stream(monkeypatch):
    # _device_current is a no-op context only for the current device; _current_stream takes
    # torch's raw accessor for an indexed device and the public API for a bare "cuda".
    import contextlib
    import types

    from cpidx._api import _current_stream, _device_current

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert isinstance(_device_current(torch.device("cuda", 0)), contextlib.nullcontext)
    other = _device_current(torch.device("cuda", 1))
    assert isinstance(other, torch.cuda.device) and other.idx == 1
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda i: 1000 + i,
                        raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda d=None: types.SimpleNamespace(cuda_stream=7))
    assert _current_stream(torch.device("cuda", 1)) == 1001
    assert _current_stream(torch.device("cuda")) == 7


def _cp_op(cp, local_q, k, bt, sl, query_len, out, scale, error_flag=None):
    torch.ops.cpidx.cp_decode(cp.handle, local_q, k, bt, sl, out, query_len, scale, None, None,
                              None, None, error_flag)
    return out


def _one_rank_step(seed):
    """A one-rank CPU instance, a batch, and the instance's own ids for it (called directly).

    The ids are checked against the plain decode's, and hold no 77 (the callers' poison; ids
    are below 12 here), so a later call that writes nothing does not equal them."""
    b = random_decode(np.random.default_rng(seed), 2, 2, [1500, 129, 0, 640], max_seq_len=1536)
    q, k, bt, sl = as_torch(b)
    cp = cpidx.IndexerCPDecode(total_heads=2, rank=0, world_size=1, max_tokens=16,
                               max_seq_len=1536, topk=6, init_blocks=1, local_blocks=1,
                               group=None, device="cpu")
    want = torch.full((2, b.rows, 6), -9, dtype=torch.int32)
    cp(q, k, bt, sl, 2, want, scale=b.scale)
    plain = torch.full_like(want, -9)
    cpidx.decode_topk(q, k, bt, sl, 2, plain, scale=b.scale, topk=6, init_blocks=1,
                      local_blocks=1, max_seq_len=1536)
    assert torch.equal(want, plain) and not (want == 77).any() and not (want == -9).any()
    return b, (q, k, bt, sl), cp, want


def test_a_cpu_instance_made_for_cpu_0_takes_cpu_tensors():
    b, (q, k, bt, sl), cp, want = _one_rank_step(10)
    named = cpidx.IndexerCPDecode(total_heads=2, rank=0, world_size=1, max_tokens=16,
                                  max_seq_len=1536, topk=6, init_blocks=1, local_blocks=1,
                                  group=None, device="cpu:0")
    got = torch.full_like(want, 77)
    named(q, k, bt, sl, 2, got, scale=b.scale)
    assert torch.equal(got, want)


def test_a_cpu_instance_refuses_an_error_flag_on_its_arguments():
    # On the host the flag is ORed by Python after the step, where the library cannot see it.
    b, (q, k, bt, sl), cp, want = _one_rank_step(12)
    for where in ("out", "seq_lens"):
        got = torch.full_like(want, 77)
        lens = sl.clone()
        flag = (got if where == "out" else lens).reshape(-1)[1:2]
        with pytest.raises(ValueError, match=f"^error_flag and {where} share memory"):
            cp(q, k, bt, lens, 2, got, scale=b.scale, error_flag=flag)
        assert (got == 77).all() and torch.equal(lens, sl)
    got = torch.full_like(want, 77)
    cp(q, k, bt, sl, 2, got, scale=b.scale, error_flag=torch.zeros(1, dtype=torch.int32))
    assert torch.equal(got, want)


def test_close_refuses_while_a_step_is_in_flight_and_a_step_after_close_began():
    # A shutdown path calling close() (registry.clear(), say) while another thread runs a step:
    # dropping the buffers and communicators under it left the step failing half-way (and, with
    # the torch exchange, its peers waiting in a collective). close() now raises, closing
    # nothing, and goes through once the step returned.
    import threading
    b, (q, k, bt, sl), cp, want = _one_rank_step(14)
    entered, release = threading.Event(), threading.Event()
    step = cp._step

    def held_step(*args, **kwargs):
        entered.set()
        assert release.wait(10)
        return step(*args, **kwargs)

    cp._step = held_step
    got, errors = torch.full_like(want, 77), []

    def run():
        try:
            cp(q, k, bt, sl, 2, got, scale=b.scale)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    assert entered.wait(10)
    with pytest.raises(RuntimeError, match=r"close\(\): 1 step\(s\) in flight on another thread; "
                                           r"nothing was closed"):
        cp.close()
    assert not cp.closed
    release.set()
    t.join()
    assert not errors and torch.equal(got, want)
    # Once close() has begun (claimed), a step raises before it touches anything.
    assert cp._claim_close() is None
    with pytest.raises(RuntimeError, match="is closing"):
        cp(q, k, bt, sl, 2, torch.full_like(want, 77), scale=b.scale)
    with pytest.raises(RuntimeError, match=r"close\(\) is under way on another thread"):
        cp.close()  # a second close() meanwhile goes no further either
    cp._unclaim_close()
    cp(q, k, bt, sl, 2, got, scale=b.scale)
    cp.close()
    assert cp.closed and cp._in_flight == 0
    with pytest.raises(RuntimeError, match="is closed"):
        cp(q, k, bt, sl, 2, got, scale=b.scale)


def test_cp_decode_names_bad_constructor_and_step_arguments():
    kw = dict(total_heads=2, rank=0, world_size=1, max_tokens=16, max_seq_len=1536, topk=6,
              init_blocks=1, local_blocks=1, group=None, device="cpu")
    for change, exc, pattern in (
            (dict(device="meta"), ValueError, r"^device: expected 'cpu', 'cuda' or 'cuda:N', "
                                              r"got 'meta'$"),
            (dict(device="bogus"), ValueError, r"^device: expected 'cpu', 'cuda' or 'cuda:N', "
                                               r"got 'bogus'"),
            (dict(max_tokens=2**30 + 1), ValueError, r"^max_tokens: expected 1 to 2\^30, got "),
            (dict(max_tokens=0), ValueError, r"^max_tokens: expected 1 to 2\^30, got 0$"),
            (dict(total_heads=4, world_size=16), ValueError,
             r"^world_size: expected 1 to 8, got 16$"),
            (dict(host_group=5), TypeError, r"^host_group: expected a torch.distributed "
                                            r"ProcessGroup \(gloo\) or None, got int$"),
            (dict(world_size=2, group=5), TypeError, r"^group: expected a torch.distributed "
                                                     r"ProcessGroup, a vLLM GroupCoordinator or a "
                                                     r"cpidx Communicator, got int$")):
        with pytest.raises(exc, match=pattern):
            cpidx.IndexerCPDecode(**dict(kw, **change))
    b, (q, k, bt, sl), cp, want = _one_rank_step(15)
    got = torch.full_like(want, 77)
    for args, exc, pattern in (
            ((q[0, 0, 0], k, bt, sl), ValueError, r"^local_q: expected shape \[n, 2, 128\] "
                                                  r"\(this rank's heads\), got \[\]$"),
            ((q, None, bt, sl), TypeError, "^kv_cache: expected a torch tensor, got NoneType$"),
            ((q, k, bt.numpy(), sl), TypeError,
             "^block_table: expected a torch tensor, got ndarray$"),
            ((q, k, bt, [1, 2]), TypeError, "^seq_lens: expected a torch tensor, got list$")):
        with pytest.raises(exc, match=pattern):
            cp(*args, 2, got, scale=b.scale)
    with pytest.raises(TypeError, match="^out: expected a torch tensor, got NoneType$"):
        cp(q, k, bt, sl, 2, None, scale=b.scale)
    assert (got == 77).all()


def test_cp_decode_op_is_the_instances_step_eager_compiled_and_checked():
    b, (q, k, bt, sl), cp, want = _one_rank_step(9)
    got = _cp_op(cp, q, k, bt, sl, 2, torch.full_like(want, 77), b.scale)
    assert torch.equal(got, want)

    def f(q, k, bt, sl, out):  # out + 0: the compiled graph reads what the op wrote
        return _cp_op(cp, q, k, bt, sl, 2, out, b.scale) + 0

    for backend in ("eager", "aot_eager"):
        torch._dynamo.reset()
        compiled = torch.compile(f, fullgraph=True, backend=backend)
        got = compiled(q, k, bt, sl, torch.full_like(want, 77))
        assert torch.equal(got, want), backend
    torch.library.opcheck(torch.ops.cpidx.cp_decode.default,
                          (cp.handle, q, k, bt, sl, torch.zeros_like(want), 2, b.scale, None,
                           None, None, None, None),
                          test_utils=("test_schema", "test_faketensor"))
    # The step's flag through the op: a length past max_seq_len is clamped and flagged.
    long = sl.clone()
    long[0] = 5000
    flag = torch.zeros(1, dtype=torch.int32)
    _cp_op(cp, q, k, bt, long, 2, torch.zeros_like(want), b.scale, error_flag=flag)
    assert int(flag) == cpidx.ERR_SEQ_LEN_OUT_OF_RANGE and int(cp.error_flag()) == 0
    with pytest.raises(ValueError, match="^local_q: expected shape"):
        _cp_op(cp, q[:, :1], k, bt, sl, 2, torch.zeros_like(want), b.scale)
    with pytest.raises(ValueError, match="^handle: no IndexerCPDecode has handle -3"):
        torch.ops.cpidx.cp_decode(-3, q, k, bt, sl, want, 2, b.scale, None, None, None, None,
                                  None)
    cp.close()
    with pytest.raises(RuntimeError, match="is closed"):
        _cp_op(cp, q, k, bt, sl, 2, want, b.scale)
    other = cpidx.IndexerCPDecode(total_heads=2, rank=0, world_size=1, max_tokens=16,
                                  max_seq_len=1536, topk=6, init_blocks=1, local_blocks=1,
                                  group=None, device="cpu")
    assert other.handle != cp.handle


@pytest.mark.skipif(not __import__("shutil").which("c++"), reason="inductor needs a C++ compiler")
def test_cp_decode_op_under_inductor_writes_into_a_strided_view():
    # Inductor functionalizes the op's mutated arguments: `out`, a view of a larger buffer (as an
    # engine's topk buffer sliced to the decode rows), must get the ids and nothing else change.
    b, (q, k, bt, sl), cp, want = _one_rank_step(19)

    def f(q, k, bt, sl, buf, flag):
        out = buf[:, 1: 1 + q.shape[0]]
        _cp_op(cp, q, k, bt, sl, 2, out, b.scale, error_flag=flag)
        return out.sum()

    buf = torch.full((2, b.rows + 3, 6), 5, dtype=torch.int32)
    flag = torch.full((1,), 1 << 20, dtype=torch.int32)
    total = torch.compile(f, fullgraph=True)(q, k, bt, sl, buf, flag)
    assert torch.equal(buf[:, 1: 1 + b.rows], want)
    assert bool((buf[:, 0] == 5).all()) and bool((buf[:, 1 + b.rows:] == 5).all())
    assert int(total) == int(want.sum()) and int(flag) == 1 << 20


# torch says so when the caches are off, as this test asks: expected, not a finding.
@pytest.mark.filterwarnings("ignore:dynamo_pgo force disabled:UserWarning")
@pytest.mark.parametrize("backend", [
    "aot_eager",
    pytest.param("inductor", marks=pytest.mark.skipif(not __import__("shutil").which("c++"),
                                                      reason="inductor needs a C++ compiler"))])
def test_cp_decode_op_runs_under_compile_when_nothing_reads_its_outputs(backend):
    # Its collectives are a side effect the schema does not show: a graph that discards the ids
    # (only some ranks read them, say) must still call the op, or that rank skips the step's
    # collectives while the others wait in them. Here the step's trace is the instance's own
    # flag: a length past max_seq_len, clamped and flagged by the step alone.
    import torch._inductor.config as inductor_config

    b, (q, k, bt, sl), cp, want = _one_rank_step(23)
    long = sl.clone()
    long[0] = 5000

    def f(q, k, bt, sl):
        out = torch.empty((2, q.shape[0], 6), dtype=torch.int32)  # internal, never returned
        _cp_op(cp, q, k, bt, sl, 2, out, b.scale)
        return q.float().sum()

    torch._dynamo.reset()
    # No cache: a graph compiled before (without the op marked, say) must not be replayed.
    with inductor_config.patch(force_disable_caches=True):
        torch.compile(f, fullgraph=True, backend=backend)(q, k, bt, long)
    assert int(cp.error_flag()) == cpidx.ERR_SEQ_LEN_OUT_OF_RANGE, backend


def _gloo_rank(rank, world, port, T, results):
    import torch.distributed as dist

    with process_group(rank, world, port, "gloo"):
        rng = np.random.default_rng(7)
        b = random_decode(rng, T, 2, [1500, 129, 0, 640], max_seq_len=1536)
        q, k, bt, sl = as_torch(b)
        cp = cpidx.IndexerCPDecode(total_heads=T, rank=rank, world_size=world, max_tokens=16,
                                   max_seq_len=1536, topk=6, init_blocks=1, local_blocks=1,
                                   group=dist.group.WORLD, device="cpu")
        assert cp.exchange == "torch" and cp.exchange_error_flag() is None
        L, off = cp.local_heads, cp.head_offset
        plain = torch.zeros((T, b.rows, 6), dtype=torch.int32)
        cpidx.decode_topk(q, k, bt, sl, 2, plain, scale=b.scale, topk=6, init_blocks=1,
                          local_blocks=1, max_seq_len=1536)
        ok = True
        # The rank's heads as their own tensor (gathered in place) and as a strided slice of all
        # heads (copied to a contiguous buffer first when T > 1).
        for local_q in (q[:, off: off + L].contiguous(), q[:, off: off + L]):
            out = torch.full((L, b.rows, 6), 77, dtype=torch.int32)
            cp(local_q, k, bt, sl, 2, out, scale=b.scale)
            ok = ok and bool(torch.equal(out, plain[off: off + L]))
        # The step as the torch op, compiled whole (its collectives inside), on both ranks.
        out = torch.full((L, b.rows, 6), 77, dtype=torch.int32)
        compiled = torch.compile(lambda lq, o: _cp_op(cp, lq, k, bt, sl, 2, o, b.scale) + 0,
                                 fullgraph=True, backend="aot_eager")
        ok = ok and bool(torch.equal(compiled(q[:, off: off + L].contiguous(), out),
                                     plain[off: off + L]))
        # A step's own flag through the torch exchange: this rank's bits (a negative length,
        # clamped to 0 on every rank's shard), a bit of the caller's kept, the instance's flag
        # left clear.
        flag = torch.full((1,), 1 << 20, dtype=torch.int32)
        short = sl.clone()
        short[0] = -5
        cp(q[:, off: off + L].contiguous(), k, bt, short, 2, out, scale=b.scale, error_flag=flag)
        ok = ok and int(flag) == (1 << 20) | cpidx.ERR_SEQ_LEN_OUT_OF_RANGE
        ok = ok and int(cp.error_flag()) == 0
        cp.close()
        cp.close()
        try:
            cp(q[:, off: off + L].contiguous(), k, bt, sl, 2, out, scale=b.scale)
            ok = False
        except RuntimeError as e:
            ok = ok and "is closed" in str(e)
        results[rank] = ok


@pytest.mark.parametrize("T", [4, 1])
def test_indexer_cp_decode_gloo_two_ranks(T):
    assert run_ranks(_gloo_rank, T) == {0: True, 1: True}


_CLOSE_THEN_EXIT = """
import datetime, torch.distributed as dist, cpidx
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
cp = cpidx.IndexerCPDecode(total_heads=4, rank=dist.get_rank(), world_size=2, max_tokens=16,
                           max_seq_len=1536, topk=6, init_blocks=1, local_blocks=1,
                           group=dist.group.WORLD, device="cpu")
cp.close()
"""


def test_close_just_before_exit_leaves_the_process_to_exit_cleanly():
    # A script that ends right after close() (whose agreement is a gloo all-reduce), leaving the
    # process group to the interpreter's exit, as under torchrun. Gloo's worker lets go of a
    # collective's tensors just after its wait() returns, taking the GIL to do it; a process that
    # began to exit before the worker got the GIL aborted ("terminate called without an active
    # exception", SIGABRT) in about one run in four. cpidx's atexit hook now gives the workers the
    # GIL first. Four runs of two ranks, each rank its own interpreter with OMP_NUM_THREADS=1, as
    # torchrun sets it (without the hook, three test runs in four failed so).
    import socket
    import subprocess
    import sys

    for run in range(4):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        procs = [subprocess.Popen([sys.executable, "-c", _CLOSE_THEN_EXIT],
                                  env=dict(os.environ, MASTER_ADDR="127.0.0.1",
                                           MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE="2",
                                           OMP_NUM_THREADS="1"),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(2)]
        try:
            outs = [p.communicate(timeout=120)[0] for p in procs]
        finally:  # a rank left waiting (its peer failed at once: a port taken, say) is killed
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        codes = [p.returncode for p in procs]
        assert codes == [0, 0], f"run {run}: exit codes {codes}: {outs}"


def _gloo_agreement_rank(rank, world, port, results):
    """Steps that one rank cannot run (other rows, refused arguments, no rows) raise on every
    rank before any collective, and a scoring that raises on one rank raises on every rank
    before the key gather; a good step afterwards still equals the plain decode."""
    import torch.distributed as dist

    seen = []
    with process_group(rank, world, port, "gloo"):
        T, Q, K = 2, 2, 6
        b = random_decode(np.random.default_rng(11), T, Q, [1500, 129, 700, 640],
                          max_seq_len=1536)
        q, k, bt, sl = as_torch(b)
        cp = cpidx.IndexerCPDecode(total_heads=T, rank=rank, world_size=world, max_tokens=16,
                                   max_seq_len=1536, topk=K, init_blocks=1, local_blocks=1,
                                   group=dist.group.WORLD, device="cpu", check_agreement=True,
                                   max_query_len=Q)
        off = cp.head_offset

        def step(reqs, seq_lens=None, error_flag=None):
            rows = reqs * Q
            out = torch.full((1, rows, K), 77, dtype=torch.int32)
            lens = sl[:reqs] if seq_lens is None else seq_lens
            cp(q[:rows, off: off + 1].contiguous(), k, bt[:reqs], lens, Q, out, scale=b.scale,
               error_flag=error_flag)
            return out

        def beyond_q():  # Q = 4 rows of one request, past the instance's max_query_len 2
            out = torch.zeros((1, 4, K), dtype=torch.int32)
            cp(q[:4, off: off + 1].contiguous(), k, bt[:1], sl[:1], 4, out, scale=b.scale)

        def scoring_fails_on_rank_1():  # after the agreement: an allocation, say
            real = cpidx._C.ref_shard_topk_keys

            def fail(*args, **kwargs):
                raise MemoryError("no room for the scores")
            if rank == 1:
                cpidx._C.ref_shard_topk_keys = fail
            try:
                return step(2)
            finally:
                cpidx._C.ref_shard_topk_keys = real

        cases = [
            ("rows differ", lambda: step(2 if rank == 0 else 3)),
            ("scoring fails on rank 1", scoring_fails_on_rank_1),
            ("bad argument on rank 1", lambda: step(3, sl[:3].long() if rank == 1 else None)),
            ("no rows on rank 0", lambda: step(0 if rank == 0 else 2)),
            ("query_len past the bound on rank 1", lambda: step(2) if rank == 0 else beyond_q()),
            ("bad error_flag on rank 1", lambda: step(
                2, error_flag=torch.zeros(2 if rank == 1 else 1, dtype=torch.int32))),
        ]
        for name, run in cases:
            try:
                run()
                seen.append((name, None, ""))
            except Exception as e:  # noqa: BLE001 - the test records what each rank raised
                seen.append((name, type(e).__name__, str(e)))
        plain = torch.zeros((T, 4 * Q, K), dtype=torch.int32)
        cpidx.decode_topk(q, k, bt, sl, Q, plain, scale=b.scale, topk=K, init_blocks=1,
                          local_blocks=1, max_seq_len=1536)
        seen.append(("good step", None, str(bool(torch.equal(step(4)[0], plain[off])))))
        seen.append(("agreement on", None, str(cp.check_agreement)))
        # bf16 bits as uint16 on one rank: the same ids (the torch exchange gathers
        # them as bits, not as numbers).
        bits = torch.zeros((T, 4 * Q, K), dtype=torch.int32)
        mine = q[:, off: off + 1].contiguous()
        cp(mine.view(torch.uint16) if rank == 1 else mine, k, bt, sl, Q, bits[off: off + 1],
           scale=b.scale)
        seen.append(("bits", None, str(bool(torch.equal(bits[off], plain[off])))))
        # By default the ranks agree only while capturing (none on the CPU): a good step runs.
        default = cpidx.IndexerCPDecode(total_heads=T, rank=rank, world_size=world,
                                        max_tokens=16, max_seq_len=1536, topk=K, init_blocks=1,
                                        local_blocks=1, group=dist.group.WORLD, device="cpu")
        seen.append(("default", None, str(default.check_agreement)))
        default.close()
        cp.close()
        results[rank] = seen


def test_indexer_cp_decode_ranks_fail_together_instead_of_hanging():
    results = run_ranks(_gloo_agreement_rank)
    r0, r1 = (dict((name, (kind, msg)) for name, kind, msg in results[r]) for r in (0, 1))
    for r in (r0, r1):
        kind, msg = r["rows differ"]
        assert kind == "ValueError" and "disagree on the decode rows" in msg, msg
        assert "the ranks have 4 to 6" in msg, msg
        kind, msg = r["no rows on rank 0"]
        assert kind == "ValueError" and "the ranks have 0 to 4" in msg, msg
        assert r["good step"] == (None, "True") and r["agreement on"] == (None, "every step")
        assert r["bits"] == (None, "True") and r["default"] == (None, "captures")
    kind, msg = r1["bad argument on rank 1"]
    assert kind == "TypeError" and msg.startswith("seq_lens"), msg
    kind, msg = r0["bad argument on rank 1"]
    assert kind == "ValueError" and "another rank's arguments for this step were refused" in msg
    kind, msg = r1["query_len past the bound on rank 1"]
    assert kind == "ValueError" and msg.startswith("query_len: expected 1 to max_query_len 2")
    kind, msg = r0["query_len past the bound on rank 1"]
    assert kind == "ValueError" and "another rank's arguments" in msg
    kind, msg = r1["scoring fails on rank 1"]
    assert kind == "MemoryError" and msg == "no room for the scores", msg
    kind, msg = r0["scoring fails on rank 1"]
    assert kind == "RuntimeError" and "another rank's scoring failed this step" in msg, msg
    kind, msg = r1["bad error_flag on rank 1"]
    assert kind == "ValueError" and msg.startswith("error_flag: expected one writable int32"), msg
    kind, msg = r0["bad error_flag on rank 1"]
    assert kind == "ValueError" and "another rank's arguments" in msg, msg


def _gloo_settings_rank(rank, world, port, results):
    """Ranks that agree on the rows but not on a setting of the step (query_len, scale) or of
    their instances (topk) raise on every rank, naming it, before any collective (the torch
    exchange would merge wrong ids without an error); with the same settings the step equals
    the plain decode."""
    import torch.distributed as dist

    seen = {}
    with process_group(rank, world, port, "gloo"):
        T, K = 2, 6
        b = random_decode(np.random.default_rng(43), T, 2, [1500, 129, 700, 640],
                          max_seq_len=1536)
        q, k, bt, sl = as_torch(b)
        kw = dict(total_heads=T, rank=rank, world_size=world, max_tokens=16, max_seq_len=1536,
                  init_blocks=1, local_blocks=1, group=dist.group.WORLD, device="cpu",
                  check_agreement=True, max_query_len=2)
        cp = cpidx.IndexerCPDecode(topk=K, **kw)
        off = cp.head_offset
        gathers = [0]
        real_gather = dist.all_gather_into_tensor

        def counted(*args, **kwargs):
            gathers[0] += 1
            return real_gather(*args, **kwargs)

        dist.all_gather_into_tensor = counted

        def step(inst, query_len, reqs, scale=b.scale, topk=K):
            out = torch.full((1, reqs * query_len, topk), 77, dtype=torch.int32)
            gathers[0] = 0
            try:
                inst(q[: reqs * query_len, off: off + 1].contiguous(), k, bt[:reqs], sl[:reqs],
                     query_len, out, scale=scale)
                return None, "", gathers[0], bool((out == 77).all())
            except Exception as e:  # noqa: BLE001 - the test records what each rank raised
                return type(e).__name__, str(e), gathers[0], bool((out == 77).all())

        # 4 rows each: 2 requests of 2 queries on rank 0, 4 requests of 1 on rank 1.
        seen["query_len"] = step(cp, 2, 2) if rank == 0 else step(cp, 1, 4)
        seen["scale"] = step(cp, 2, 2, scale=1.0 if rank == 0 else 0.5)
        # No rows on any rank: nothing runs, so the step's settings need not agree.
        seen["no rows"] = step(cp, 1 + rank, 0, scale=0.5 + rank)
        other = cpidx.IndexerCPDecode(topk=K if rank == 0 else 4, **kw)
        seen["topk"] = step(other, 2, 2, topk=other.topk)
        other.close()
        plain = torch.zeros((T, 8, K), dtype=torch.int32)
        cpidx.decode_topk(q, k, bt, sl, 2, plain, scale=b.scale, topk=K, init_blocks=1,
                          local_blocks=1, max_seq_len=1536)
        out = torch.full((1, 8, K), 77, dtype=torch.int32)
        cp(q[:, off: off + 1].contiguous(), k, bt, sl, 2, out, scale=b.scale)
        seen["same settings"] = bool(torch.equal(out[0], plain[off]))
        cp.close()
        results[rank] = seen


def test_indexer_cp_decode_ranks_disagreeing_on_settings_fail_together():
    results = run_ranks(_gloo_settings_rank)
    for rank, mine in ((0, ("2", "1.0", "6")), (1, ("1", "0.5", "4"))):
        seen = results[rank]
        for (name, rest), value in zip((
                ("query_len", "the 2 ranks disagree on query_len (this rank {}, the ranks 1 to 2); "
                              "every rank must run the same step"),
                ("scale", "the 2 ranks disagree on scale (this rank {}, the ranks 0.5 to 1.0); "
                          "every rank must run the same step"),
                ("topk", "the 2 ranks' instances disagree on topk (this rank {}, the ranks 4 to "
                         "6); every rank must make its instance with the same settings")), mine):
            kind, msg, gathers, untouched = seen[name]
            assert (kind, msg) == ("ValueError", f"{name}: " + rest.format(value)), seen[name]
            assert gathers == 0 and untouched, seen[name]  # no collective ran, nothing written
        assert seen["same settings"] and seen["no rows"] == (None, "", 0, True), seen


def _made_host_group_rank(rank, world, port, results):
    """An instance over a group that brings no host group (an NCCL-only ProcessGroup; a gloo
    group stands in for one here, its host group hidden) makes its own: two TP groups of two
    ranks at once, after ranks 0 and 1 alone made a local-synchronisation group (torch's group
    names then differ between the ranks), and again after close(). Steps agree through it."""
    import torch.distributed as dist

    import cpidx._cp as cp_module

    seen = []
    with process_group(rank, world, port, "gloo"):
        tp_groups = [dist.new_group(r) for r in ([0, 1], [2, 3])]
        if rank < 2:
            dist.new_group([0, 1], use_local_synchronization=True)
        tp = tp_groups[rank // 2]
        cp_module._host_group_of = lambda group: None  # as for an NCCL-only group
        T, Q, K = 2, 1, 6
        b = random_decode(np.random.default_rng(23 + rank // 2), T, Q, [1500, 129, 700, 640],
                          max_seq_len=1536)
        q, k, bt, sl = as_torch(b)
        plain = torch.zeros((T, 4, K), dtype=torch.int32)
        cpidx.decode_topk(q, k, bt, sl, Q, plain, scale=b.scale, topk=K, init_blocks=1,
                          local_blocks=1, max_seq_len=1536)
        me = dist.get_rank(tp)
        for made in ("first", "again"):
            dist.barrier()  # both TP groups make theirs at once (one store, two names)
            cp = cpidx.IndexerCPDecode(total_heads=T, rank=me, world_size=2, max_tokens=16,
                                       max_seq_len=1536, topk=K, init_blocks=1, local_blocks=1,
                                       group=tp, device="cpu", check_agreement=True)
            seen.append((made, "agreement", cp.check_agreement,
                         type(cp._host).__name__ if cp._host is not None else None))
            off = cp.head_offset
            reqs = (2 if me == 0 else 3) if rank < 2 else (1 if me == 0 else 4)
            out = torch.full((1, reqs, K), 77, dtype=torch.int32)
            try:
                cp(q[:reqs, off: off + 1].contiguous(), k, bt[:reqs], sl[:reqs], Q, out,
                   scale=b.scale)
                seen.append((made, "rows differ", None, None))
            except ValueError as e:
                seen.append((made, "rows differ", "ValueError", str(e)))
            out = torch.full((1, 4, K), 77, dtype=torch.int32)
            cp(q[:, off: off + 1].contiguous(), k, bt, sl, Q, out, scale=b.scale)
            seen.append((made, "good step", bool(torch.equal(out[0], plain[off])), None))
            cp.close()
            seen.append((made, "closed", cp.closed, cp._host))
        results[rank] = seen


def test_indexer_cp_decode_makes_a_host_group_when_its_group_brings_none():
    results = run_ranks(_made_host_group_rank, world=4)
    for rank in range(4):
        seen = {(made, what): (a, b) for made, what, a, b in results[rank]}
        rows = "2 to 3" if rank < 2 else "1 to 4"  # each TP group agrees within itself
        for made in ("first", "again"):
            assert seen[(made, "agreement")] == ("every step", "ProcessGroupGloo"), seen
            kind, msg = seen[(made, "rows differ")]
            assert kind == "ValueError" and f"the ranks have {rows}" in msg, msg
            assert seen[(made, "good step")] == (True, None), seen
            assert seen[(made, "closed")] == (True, None), seen


def _host_group_timeout_rank(rank, world, port, results):
    """A rank that never joins: the host group's making fails within its timeout, by name."""
    import datetime
    import time

    import torch.distributed as dist

    import cpidx._cp as cp_module

    with process_group(rank, world, port, "gloo"):
        if rank == 0:
            start = time.monotonic()
            try:
                cp_module._make_host_group(dist.group.WORLD, "alone",
                                           datetime.timedelta(seconds=2))
                results[rank] = ("made", time.monotonic() - start)
            except RuntimeError as e:
                results[rank] = (str(e), time.monotonic() - start)
        dist.barrier()


def test_made_host_group_fails_within_its_timeout_when_a_rank_never_joins():
    msg, seconds = run_ranks(_host_group_timeout_rank)[0]
    assert msg.startswith("group: could not make the host (gloo) group the 2 ranks"), msg
    assert 1.5 < seconds < 30, seconds  # its 2 s timeout, not another failure


def _make_and_step(kw, seed):
    """An instance of ``IndexerCPDecode(**kw)`` (one head a rank of two) and one step of a
    two-request batch through it: after a failed construction, the ranks are still in step."""
    b = random_decode(np.random.default_rng(seed), 2, 1, [700, 129], max_seq_len=1024)
    q, k, bt, sl = as_torch(b)
    cp = cpidx.IndexerCPDecode(**kw)
    out = torch.zeros((1, 2, 4), dtype=torch.int32)
    cp(q[:, cp.head_offset: cp.head_offset + 1].contiguous(), k, bt, sl, 1, out, scale=b.scale)
    return cp


def _rank0_cannot_make_rank(rank, world, port, results):
    """Rank 0 fails to make what the construction's all_gather hands the ranks (here the host
    group's name; on CUDA the NCCL unique id, from the same call): every rank raises at once, not
    only rank 0 with the others left in the collective until the group's timeout (10 s here). Then the ranks are
    still in step: a new instance is made and agrees on a step."""
    import datetime
    import time

    import torch.distributed as dist

    import cpidx._cp as cp_module

    seen = {}
    with process_group(rank, world, port, "gloo", timeout=datetime.timedelta(seconds=10)):
        cp_module._host_group_of = lambda group: None  # as for an NCCL-only group: one is made
        made = cp_module._host_token

        def cannot_make():
            raise RuntimeError("ncclGetUniqueId: Bootstrap : no socket interface found")

        if rank == 0:
            cp_module._host_token = cannot_make
        kw = dict(total_heads=2, rank=rank, world_size=world, max_tokens=8, max_seq_len=1024,
                  topk=4, init_blocks=0, local_blocks=1, group=dist.group.WORLD, device="cpu",
                  check_agreement=True)
        start = time.monotonic()
        try:
            cpidx.IndexerCPDecode(**kw)
            seen["made"] = None
        except RuntimeError as e:
            seen["made"] = str(e)
        seen["seconds"] = time.monotonic() - start
        cp_module._host_token = made
        cp = _make_and_step(kw, 41)
        seen["then"] = cp.check_agreement
        cp.close()
        results[rank] = seen


def test_rank0_failing_to_make_what_it_hands_the_ranks_fails_every_rank_at_once():
    results = run_ranks(_rank0_cannot_make_rank)
    r0, r1 = results[0], results[1]
    assert r0["made"] == "ncclGetUniqueId: Bootstrap : no socket interface found", r0
    assert r1["made"].startswith("group: rank 0 could not make what it hands the 2 ranks"), r1
    assert "RuntimeError: ncclGetUniqueId: Bootstrap : no socket interface found" in r1["made"]
    for r in (r0, r1):
        assert r["seconds"] < 5, r  # not the group's 10 s timeout
        assert r["then"] == "every step", r


def _rank1_cannot_set_up_rank(rank, world, port, results):
    """Rank 1 cannot make its part (on CUDA its Decoder: an allocation that fails on one rank
    alone; here the same method made to raise): every rank raises at once, rank 1 its own error
    and rank 0 one naming rank 1, not rank 0 left in the construction's collective until the
    group's timeout (10 s here). With a host group given (no collective needed otherwise) and
    without. Then the ranks are still in step: an instance is made and runs a step."""
    import datetime
    import time

    import torch.distributed as dist

    import cpidx._cp as cp_module

    seen = {}
    with process_group(rank, world, port, "gloo", timeout=datetime.timedelta(seconds=10)):
        make = cp_module.IndexerCPDecode._make_decoder

        def cannot_make(self, head_dim, exchange_buffers):
            seen["exchange_buffers"] = exchange_buffers  # the torch exchange: its own buffers
            raise RuntimeError("cudaMalloc: out of memory")

        kw = dict(total_heads=2, rank=rank, world_size=world, max_tokens=8, max_seq_len=1024,
                  topk=4, init_blocks=0, local_blocks=1, group=dist.group.WORLD, device="cpu")
        for how, extra in (("default", {}), ("host group", dict(host_group=dist.group.WORLD))):
            if rank == 1:
                cp_module.IndexerCPDecode._make_decoder = cannot_make
            start = time.monotonic()
            try:
                cpidx.IndexerCPDecode(**kw, **extra)
                seen[how] = None
            except RuntimeError as e:
                seen[how] = str(e)
            seen[how + " seconds"] = time.monotonic() - start
            cp_module.IndexerCPDecode._make_decoder = make
        cp = _make_and_step(kw, 42)
        seen["then"] = cp.closed
        cp.close()
        results[rank] = seen


def _step_in_flight_on_one_rank_rank(rank, world, port, results):
    """A step in flight on rank 0 (its count, as a step held on another thread leaves it) when
    every rank clears the registry holding a torch-exchange instance with a host group: every
    rank raises and keeps its instance (before, rank 1 closed and dropped its instance, and the
    next construction waited alone in its collective). Then both clear, and a new instance runs
    a step."""
    import datetime

    import torch.distributed as dist

    seen = {}
    with process_group(rank, world, port, "gloo", timeout=datetime.timedelta(seconds=10)):
        kw = dict(total_heads=2, rank=rank, world_size=world, max_tokens=8, max_seq_len=1024,
                  topk=4, init_blocks=0, local_blocks=1, group=dist.group.WORLD, device="cpu")
        cp = cpidx.get_shared_cp_decode(**kw)
        seen["exchange"] = (cp.exchange, cp._host is not None)
        if rank == 0:
            cp._in_flight = 1
        try:
            cpidx.registry.clear()
            seen["clear"] = None
        except RuntimeError as e:
            seen["clear"] = str(e)
        seen["kept"] = (cp.closed, cpidx.get_shared_cp_decode(**kw) is cp)
        if rank == 0:
            cp._in_flight = 0
        cpidx.registry.clear()
        seen["closed"] = cp.closed
        _make_and_step(kw, 43).close()
        results[rank] = seen


def test_a_step_in_flight_on_one_rank_keeps_the_instance_on_every_rank():
    results = run_ranks(_step_in_flight_on_one_rank_rank)
    for rank, r in results.items():
        assert r["exchange"] == ("torch", True), r
        assert r["kept"] == (False, True), (rank, r)
        assert r["closed"] is True, r
    assert "1 step(s) in flight on another thread; nothing was closed, on any rank" in \
        results[0]["clear"], results[0]
    assert "another rank cannot close yet" in results[1]["clear"], results[1]


def test_a_rank_that_cannot_set_up_fails_every_rank_at_once():
    results = run_ranks(_rank1_cannot_set_up_rank)
    r0, r1 = results[0], results[1]
    for how in ("default", "host group"):
        assert r1[how] == "cudaMalloc: out of memory", r1
        assert r0[how] == ("group: rank 1 could not set up its part of the instance, so no rank "
                           "makes one: RuntimeError: cudaMalloc: out of memory"), r0
        for r in (r0, r1):
            assert r[how + " seconds"] < 5, r  # not the group's 10 s timeout
    assert r0["then"] is False and r1["then"] is False
    assert r1["exchange_buffers"] is False  # gloo: the torch exchange, with buffers of its own


def _unchecked_warning_rank(rank, world, port, results):
    """check_agreement=True where no host group can be had (no default store, as under MPI)
    warns, naming the caller's line, before the exchange is set up: raised as an error, it
    leaves nothing made (here the torch exchange's buffers stand for the communicators)."""
    import warnings

    import torch.distributed as dist

    import cpidx._cp as cp_module

    seen = {}
    with process_group(rank, world, port, "gloo"):
        cp_module._host_group_of = lambda group: None  # as for an NCCL-only group
        cp_module._host_token = lambda: None  # and no store to make one on
        made = []
        real_alloc = cp_module.IndexerCPDecode._alloc_exchange_buffers
        cp_module.IndexerCPDecode._alloc_exchange_buffers = \
            lambda self: (made.append(self), real_alloc(self))
        kw = dict(total_heads=2, rank=rank, world_size=world, max_tokens=8, max_seq_len=1024,
                  topk=4, init_blocks=0, local_blocks=1, group=dist.group.WORLD, device="cpu",
                  check_agreement=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cp = cpidx.IndexerCPDecode(**kw)
        seen["warned"] = [(str(w.message), os.path.basename(w.filename)) for w in caught]
        seen["unchecked"] = (cp.check_agreement, len(made))
        cp.close()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            try:
                cpidx.IndexerCPDecode(**kw)
                seen["as error"] = None
            except UserWarning as w:
                seen["as error"] = (str(w), len(made))
        results[rank] = seen


def test_check_agreement_without_a_host_group_warns_before_setting_up_the_exchange():
    for seen in run_ranks(_unchecked_warning_rank).values():
        (msg, where), = seen["warned"]
        assert "has no host (gloo) group to agree through" in msg, msg
        assert where == "test_torch_cpu.py", where
        assert seen["unchecked"] == (None, 1), seen
        msg, made = seen["as error"]
        assert "steps are not checked" in msg and made == 1, seen  # nothing more made


def _host_group_failure_rank(rank, world, port, results):
    """A made host group that times out (rank 1 late past its 2 s): that step raises
    HostGroupError on both ranks (rank 0's own refused argument named too), so do later agreeing
    steps, at once; close() then lets the instance go without a collective and warns, keeping
    what a live graph may use on the rank that could not close (rank 0), and closed even where
    the warning is raised as an error (rank 1). Then the same with close() itself late. With
    check_agreement=False no host group is made."""
    import datetime
    import time
    import warnings

    import torch.distributed as dist

    import cpidx._cp as cp_module

    seen = {}
    with process_group(rank, world, port, "gloo"):
        cp_module._host_group_of = lambda group: None  # as for an NCCL-only group
        cp_module.HOST_GROUP_TIMEOUT = datetime.timedelta(seconds=2)
        b = random_decode(np.random.default_rng(29), 2, 1, [700, 129], max_seq_len=1024)
        q, k, bt, sl = as_torch(b)
        kw = dict(total_heads=2, rank=rank, world_size=world, max_tokens=8, max_seq_len=1024,
                  topk=4, init_blocks=0, local_blocks=1, group=dist.group.WORLD, device="cpu",
                  check_agreement=True)

        def step(cp, lens=sl):
            out = torch.zeros((1, 2, 4), dtype=torch.int32)
            try:
                cp(q[:, cp.head_offset: cp.head_offset + 1].contiguous(), k, bt, lens, 1, out,
                   scale=b.scale)
                return None
            except Exception as e:  # noqa: BLE001 - the test records what each rank raised
                return type(e).__name__, str(e)

        def close(cp, late, blocked=False, as_error=False):
            comm = _ClosableComm(blocked=blocked)  # stands in for the NCCL communicator
            cp._owned = [comm]
            if late:
                time.sleep(4)
            raised = None
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("error" if as_error else "always")
                try:
                    cp.close()
                except RuntimeWarning as w:
                    raised = str(w)
            warned = [str(w.message) for w in caught if w.category is RuntimeWarning]
            kept = any(comm in entry[1] for entry in cp_module._KEPT_FOR_LIVE_GRAPHS)
            return cp.closed, comm.closes, comm.leaked, kept, warned or [raised]

        cp = cpidx.IndexerCPDecode(**kw)
        if rank == 1:
            time.sleep(4)
        seen["late step"] = step(cp, sl.long() if rank == 0 else sl)
        start = time.monotonic()
        seen["next step"] = step(cp)
        seen["next step seconds"] = time.monotonic() - start
        seen["close after"] = close(cp, late=False, blocked=rank == 0, as_error=rank == 1)
        cp = cpidx.IndexerCPDecode(**kw)
        seen["good step"] = step(cp)
        seen["late close"] = close(cp, late=rank == 1)
        off = cpidx.IndexerCPDecode(**dict(kw, check_agreement=False))
        seen["opted out"] = (off._host, off.check_agreement)
        off.close()
        results[rank] = seen


def test_a_failed_host_group_fails_its_steps_and_lets_close_go_without_a_collective():
    results = run_ranks(_host_group_failure_rank)
    for rank in (0, 1):
        seen = results[rank]
        kind, msg = seen["late step"]
        assert kind == "HostGroupError" and "the host (gloo) group failed" in msg, msg
        assert ("this rank's arguments were refused: TypeError: seq_lens" in msg) == (rank == 0)
        kind, msg = seen["next step"]
        assert kind == "HostGroupError" and "the host group failed earlier" in msg, msg
        assert seen["next step seconds"] < 1, seen
        closed, closes, leaked, kept, warned = seen["close after"]
        assert closed and closes == 0 and len(warned) == 1, seen  # let go, not closed
        assert "let go without a collective" in warned[0], warned
        # Rank 0 could not close (its communicator blocked, as under a live graph): kept.
        assert (leaked, kept) == ((True, True) if rank == 0 else (False, False)), seen
        assert ("could not close" in warned[0]) == (rank == 0), warned
        assert seen["good step"] is None, seen
        closed, closes, leaked, kept, warned = seen["late close"]
        assert closed and closes == 0 and not leaked and len(warned) == 1, seen
        assert seen["opted out"] == (None, None), seen


def _given_host_group_rank(rank, world, port, results):
    """host_group= replaces the group's own (any group: a cpidx.Communicator's too); one of
    another size is refused by name before any collective."""
    import torch.distributed as dist

    seen = {}
    with process_group(rank, world, port, "gloo"):
        mine = dist.new_group([0, 1], backend="gloo")
        singles = [dist.new_group([r], backend="gloo") for r in range(world)]
        b = random_decode(np.random.default_rng(37), 2, 1, [700, 129, 300], max_seq_len=1024)
        q, k, bt, sl = as_torch(b)
        kw = dict(total_heads=2, rank=rank, world_size=world, max_tokens=8, max_seq_len=1024,
                  topk=4, init_blocks=0, local_blocks=1, group=dist.group.WORLD, device="cpu")
        try:
            cpidx.IndexerCPDecode(**kw, host_group=singles[rank])
        except ValueError as e:
            seen["wrong size"] = str(e)
        cp = cpidx.IndexerCPDecode(**kw, host_group=mine)
        seen["host"] = (cp._host is mine, cp.check_agreement)
        cp.close()
        reqs = 2 if rank == 0 else 3
        out = torch.zeros((1, reqs, 4), dtype=torch.int32)
        agreeing = cpidx.IndexerCPDecode(**kw, host_group=mine, check_agreement=True)
        try:
            agreeing(q[:reqs, agreeing.head_offset: agreeing.head_offset + 1].contiguous(), k,
                     bt[:reqs], sl[:reqs], 1, out, scale=b.scale)
        except ValueError as e:
            seen["rows differ, agreed"] = str(e)
        agreeing.close()
        results[rank] = seen


def test_indexer_cp_decode_agrees_through_a_given_host_group():
    results = run_ranks(_given_host_group_rank)
    for rank in (0, 1):
        seen = results[rank]
        assert seen["wrong size"] == f"host_group: rank 0 of 1, expected rank {rank} of 2", seen
        assert seen["host"] == (True, "captures"), seen
        assert "the ranks have 2 to 3" in seen["rows differ, agreed"], seen


class _ClosableComm:
    """Stands in for a library communicator an instance made: close() refuses while `blocked`
    (as an NCCL one does while a live CUDA graph holds its gathers)."""

    def __init__(self, blocked):
        self.blocked, self.closes, self.leaked = blocked, 0, False

    def _leak_at_exit(self):
        self.leaked = True

    def _close_blocker(self, ignore_dependents=False, peer_graphs=False):
        return "a CUDA graph still holds 2 of its gathers" if self.blocked else None

    def close(self):
        if self.blocked:
            raise RuntimeError("a CUDA graph still holds 2 of its gathers")
        self.closes += 1


def _gloo_close_rank(rank, world, port, results):
    """registry.clear() where one rank cannot close yet (its communicator refuses, then it is
    capturing a graph): every rank raises and keeps its instance (none closes), so the ranks
    stay in step; it keeps the entries whose close makes no collective too (a one-rank instance
    ahead of it in the registry, a decoder), on every rank; once it can, every rank closes."""
    import torch.distributed as dist

    seen = {}
    with process_group(rank, world, port, "gloo"):
        reg = cpidx.Registry()
        kw = dict(total_heads=2, rank=rank, world_size=world, max_tokens=16, max_seq_len=1536,
                  topk=6, init_blocks=1, local_blocks=1, group=dist.group.WORLD, device="cpu",
                  check_agreement=False)  # steps unchecked; close() agrees all the same
        alone = reg.cp_decode(**dict(kw, rank=0, world_size=1, group=None))
        reg._decoders["a GPU decoder"] = object()  # stands in for one (no GPU here)
        cp = reg.cp_decode(**kw)
        comm = _ClosableComm(blocked=rank == 1)
        cp._owned = [comm]
        try:
            reg.clear()
            seen["first"] = None
        except RuntimeError as e:
            seen["first"] = str(e)
        seen["kept"] = (len(reg), cp.closed, comm.closes, reg.cp_decode(**kw) is cp,
                        alone.closed)
        comm.blocked = False
        # Rank 1 alone is capturing a CUDA graph (faked: no GPU here): it refuses before any CUDA
        # call, and rank 0, which is not, raises with it instead of waiting for it.
        saved = torch.cuda.is_available, torch.cuda.is_current_stream_capturing
        if rank == 1:
            torch.cuda.is_available = lambda: True
            torch.cuda.is_current_stream_capturing = lambda: True
        try:
            reg.clear()
            seen["capture"] = None
        except RuntimeError as e:
            seen["capture"] = str(e)
        finally:
            torch.cuda.is_available, torch.cuda.is_current_stream_capturing = saved
        seen["kept again"] = (len(reg), cp.closed, comm.closes, alone.closed)
        reg.clear()
        seen["second"] = (len(reg), cp.closed, comm.closes, alone.closed)
        results[rank] = seen


def test_registry_clear_closes_on_every_rank_or_on_none():
    results = run_ranks(_gloo_close_rank)
    r0, r1 = results[0], results[1]
    assert "another rank cannot close yet" in r0["first"], r0["first"]
    assert "a CUDA graph still holds 2 of its gathers" in r1["first"], r1["first"]
    assert "another rank cannot close yet" in r0["capture"], r0["capture"]
    assert "Registry.clear() (it closes the shared" in r1["capture"], r1["capture"]
    assert "capture is still valid" in r1["capture"], r1["capture"]
    for r in (r0, r1):
        assert "nothing was closed, on any rank" in r["first"], r["first"]
        assert r["kept"] == (3, False, 0, True, False), r["kept"]
        assert r["kept again"] == (3, False, 0, False), r["kept again"]
        assert r["second"] == (0, True, 1, True), r["second"]


def test_indexer_cp_decode_checks_its_bounds_by_name():
    base = dict(total_heads=4, rank=0, world_size=1, max_tokens=8, max_seq_len=1024, topk=16,
                init_blocks=0, local_blocks=1, group=None, device="cpu")
    for name, bad in (("topk", 0), ("topk", 10**6), ("max_tokens", 0), ("max_query_len", 9),
                      ("max_seq_len", 2**31), ("total_heads", 16), ("init_blocks", -1),
                      ("local_blocks", -1), ("rank", 1)):
        with pytest.raises(ValueError, match=f"^{name}: "):
            cpidx.IndexerCPDecode(**dict(base, **{name: bad}))
    with pytest.raises(ValueError, match="^total_heads and world_size must be >= 1, got 0"):
        cpidx.IndexerCPDecode(**dict(base, total_heads=0))
    cp = cpidx.IndexerCPDecode(**base)
    assert cp.check_agreement is None  # one rank: nothing to agree on
    # Each bound itself is accepted: the most heads, topk and (a step's) rows.
    edge = cpidx.IndexerCPDecode(**dict(base, total_heads=cpidx.MAX_HEADS, topk=cpidx.MAX_TOPK))
    assert edge.local_heads == cpidx.MAX_HEADS and edge.topk == cpidx.MAX_TOPK
    b = random_decode(np.random.default_rng(3), 4, 1, [300, 900], max_seq_len=1024)
    q, k, bt, sl = as_torch(b)
    cp = cpidx.IndexerCPDecode(**dict(base, max_tokens=b.rows))
    out, want = torch.full((4, b.rows, 16), 77, dtype=torch.int32), torch.zeros((4, b.rows, 16),
                                                                                dtype=torch.int32)
    cp(q, k, bt, sl, 1, out, scale=b.scale)
    cpidx.decode_topk(q, k, bt, sl, 1, want, scale=b.scale, topk=16, max_seq_len=1024)
    assert torch.equal(out, want)


def test_registry_shares_one_instance_however_its_arguments_are_spelled():
    reg = cpidx.Registry()
    base = dict(total_heads=4, rank=0, world_size=1, max_tokens=8, max_seq_len=1024, topk=16,
                init_blocks=0, local_blocks=1, group=None, device="cpu")
    cp = reg.cp_decode(**base)
    for spelled in (dict(exchange="auto", head_dim=128, max_query_len=8),
                    dict(cache_dtype="bfloat16"), dict(cache_dtype=torch.bfloat16),
                    dict(device="cpu:0"), dict(device=torch.device("cpu")),
                    dict(check_agreement=None, host_group=None)):
        assert reg.cp_decode(**dict(base, **spelled)) is cp, spelled
    assert len(reg) == 1
    other = reg.cp_decode(**dict(base, topk=8))
    assert other is not cp and len(reg) == 2
    # A bool is not its int: check_agreement=0 is not False (the constructor reads 0 as None).
    assert reg.cp_decode(**dict(base, check_agreement=0)) is not \
        reg.cp_decode(**dict(base, check_agreement=False))
    # Nor is it its string: "False" is truthy (agree on every step).
    assert reg.cp_decode(**dict(base, check_agreement="False")) is not \
        reg.cp_decode(**dict(base, check_agreement=False))
    with pytest.raises(TypeError, match="device"):
        reg.cp_decode(**{k: v for k, v in base.items() if k != "device"})
    with pytest.raises(TypeError, match="no_such"):
        reg.cp_decode(**dict(base, no_such=1))
    reg.clear()


def test_indexer_cp_decode_names_its_own_arguments():
    b = random_decode(np.random.default_rng(5), 4, 1, [300, 900], max_seq_len=1024)
    q, k, bt, sl = as_torch(b)
    cp = cpidx.IndexerCPDecode(total_heads=4, rank=0, world_size=1, max_tokens=8,
                               max_seq_len=1024, topk=16, init_blocks=0, local_blocks=1,
                               group=None, device="cpu")
    out = torch.zeros((4, 2, 16), dtype=torch.int32)
    with pytest.raises(TypeError, match="^local_q: "):
        cp(q.float(), k, bt, sl, 1, out, scale=b.scale)
    with pytest.raises(ValueError, match="^kv_cache: "):
        cp(q, k[:, :64], bt, sl, 1, out, scale=b.scale)
    with pytest.raises(ValueError, match="^out: "):
        cp(q, k, bt, sl, 1, out[:2], scale=b.scale)
    out.fill_(-7)
    cp(q, k, bt, sl, 1, out, scale=b.scale)
    want = torch.zeros_like(out)
    cpidx.decode_topk(q, k, bt, sl, 1, want, scale=b.scale, topk=16, init_blocks=0,
                      local_blocks=1, max_seq_len=1024)
    assert torch.equal(out, want)
    # A step without rows returns at once: the other arguments (2 requests here) go unchecked.
    empty = torch.full((4, 0, 16), 77, dtype=torch.int32)
    assert cp(q[:0], k, bt, sl, 1, empty, scale=b.scale) is empty


def test_a_host_group_of_another_size_is_named():
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=10))
    try:
        with pytest.raises(ValueError, match=r"^host_group: rank 0 of 1, expected rank 0 of 2"):
            cpidx.IndexerCPDecode(total_heads=4, rank=0, world_size=2, max_tokens=8,
                                  max_seq_len=1024, topk=16, init_blocks=0, local_blocks=1,
                                  group=None, device="cpu", host_group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def test_cpu_instance_refuses_a_cache_of_another_dtype_than_its_own():
    # The reference runs either dtype; a CUDA instance's Decoder only its cache_dtype. A CPU run
    # (an engine's test, say) must refuse what the GPU run would, naming kv_cache.
    b = random_decode(np.random.default_rng(31), 2, 1, [300, 900], max_seq_len=1024)
    q, k, bt, sl = as_torch(b)
    bits = np.random.default_rng(32).integers(0, 0x70, size=k.shape, dtype=np.uint8)
    fp8 = torch.from_numpy(bits)  # finite e4m3 values (0x7f is NaN)
    kw = dict(total_heads=2, rank=0, world_size=1, max_tokens=8, max_seq_len=1024, topk=8,
              init_blocks=0, local_blocks=1, group=None, device="cpu")
    out = torch.zeros((2, 2, 8), dtype=torch.int32)
    for cache_dtype, wrong, right in (("fp8_e4m3", k, fp8), ("bf16", fp8, k),
                                      (torch.float8_e4m3fn, k, fp8.view(torch.float8_e4m3fn))):
        cp = cpidx.IndexerCPDecode(**kw, cache_dtype=cache_dtype)
        with pytest.raises(ValueError, match=f"^kv_cache: dtype must be {cp.cache_dtype} "):
            cp(q, wrong, bt, sl, 1, out, scale=b.scale)
        want = torch.zeros_like(out)
        cpidx.decode_topk(q, right, bt, sl, 1, want, scale=b.scale, topk=8, max_seq_len=1024)
        out.fill_(-7)
        cp(q, right, bt, sl, 1, out, scale=b.scale)
        assert torch.equal(out, want), cache_dtype


def test_a_step_names_local_q_on_another_device_before_its_error_flag(monkeypatch):
    # error_flag is checked against local_q's device: a query on another device than the
    # instance's, next to a flag on the right one, must be named, not the flag. (A meta tensor
    # stands for a CUDA one, taken for it as the reviewer did: no GPU here.)
    import cpidx._api as api

    monkeypatch.setattr(api, "_is_cuda", lambda x: isinstance(x, torch.Tensor) and (
        x.device.type in ("cuda", "meta")))
    cp = _world_one(total_heads=2)
    local_q = torch.empty((1, 2, 128), dtype=torch.bfloat16, device="meta")
    k = torch.zeros((4, 128, 128), dtype=torch.bfloat16)
    args = (k, torch.zeros((1, 8), dtype=torch.int32), torch.tensor([300], dtype=torch.int32), 1,
            torch.zeros((2, 1, 6), dtype=torch.int32))
    for flag in (torch.zeros(1, dtype=torch.int32), None):
        with pytest.raises(ValueError, match=r"^local_q: expected a tensor on cpu \(the "
                                             r"instance's device\), got one on meta"):
            cp(local_q, *args, scale=0.5, error_flag=flag)
    with pytest.raises(TypeError, match="^local_q: expected a torch tensor, got ndarray"):
        cp(np.zeros((1, 2, 128), np.uint16), *args, scale=0.5)


def test_shared_cp_decode_registry():
    kw = dict(total_heads=4, rank=0, world_size=1, max_tokens=8, max_seq_len=1024, topk=16,
              init_blocks=0, local_blocks=1, group=None, device="cpu")
    cpidx.registry.clear()
    a = cpidx.get_shared_cp_decode(**kw)
    assert cpidx.get_shared_cp_decode(**kw) is a
    assert cpidx.get_shared_cp_decode(**dict(kw, topk=8)) is not a
    cpidx.registry.clear()
    assert a.closed  # clear() closes the shared instances
    b = cpidx.get_shared_cp_decode(**kw)
    assert b is not a and not b.closed
    b.close()
    c = cpidx.get_shared_cp_decode(**kw)  # a closed instance is replaced
    assert c is not b and not c.closed
    cpidx.registry.clear()
    assert c.closed


def test_registry_exit_hook_lets_go_without_closing():
    # At interpreter exit nothing may wait (other ranks, live CUDA graphs): the hook marks the
    # shared instances closed without their collective close().
    from cpidx._api import Registry

    reg = Registry()
    kw = dict(total_heads=4, rank=0, world_size=1, max_tokens=8, max_seq_len=1024, topk=16,
              init_blocks=0, local_blocks=1, group=None, device="cpu")
    a = reg.cp_decode(**kw)
    b = reg.cp_decode(**dict(kw, topk=8))
    b.close()

    def no_collective_at_exit():
        raise AssertionError("close() called from the exit hook")

    a.close = no_collective_at_exit
    reg._drop_at_exit()
    assert a.closed and b.closed and len(reg) == 0


def test_indexer_cp_decode_geometry_errors():
    base = dict(rank=0, max_tokens=8, max_seq_len=1024, topk=16, init_blocks=0, local_blocks=1,
                group=None, device="cpu")
    with pytest.raises(ValueError, match="divide evenly"):
        cpidx.IndexerCPDecode(total_heads=6, world_size=4, **base)
    with pytest.raises(ValueError, match="replicate"):
        cpidx.IndexerCPDecode(total_heads=3, world_size=4, **base)
    with pytest.raises(ValueError, match="group"):
        cpidx.IndexerCPDecode(total_heads=4, world_size=2, **base)


def _world_one(**kw):
    args = dict(total_heads=4, rank=0, world_size=1, max_tokens=8, max_seq_len=1536, topk=6,
                init_blocks=1, local_blocks=1, group=None, device="cpu")
    args.update(kw)
    return cpidx.IndexerCPDecode(**args)


def test_cpu_instance_reports_clamped_values_in_its_error_flag():
    # The reference's bits of a CPU step, OR-ed into cp.error_flag() (they were dropped).
    rng = np.random.default_rng(17)
    b = random_decode(rng, 4, 1, [1536, 700], max_seq_len=1536)
    q, k, bt, sl = as_torch(b)
    cp = _world_one()
    out = torch.zeros((4, b.rows, 6), dtype=torch.int32)
    cp(q, k, bt, sl, 1, out, scale=b.scale)
    assert cp.error_flag().dtype == torch.int32 and int(cp.error_flag()) == 0
    bad = bt.clone()
    bad[1, 2] = k.shape[0] + 5  # a page past the cache, in request 1's visible blocks
    cp(q, k, bad, sl, 1, out, scale=b.scale)
    assert int(cp.error_flag()) == cpidx.ERR_PAGE_OUT_OF_RANGE
    cp(q, k, bt, torch.tensor([2000, 700], dtype=torch.int32), 1, out, scale=b.scale)
    assert int(cp.error_flag()) == cpidx.ERR_PAGE_OUT_OF_RANGE | cpidx.ERR_SEQ_LEN_OUT_OF_RANGE
    cp.clear_error_flag()
    assert int(cp.error_flag()) == 0
    # A step's own flag (error_flag=): its bits OR-ed there, the instance's flag left clear.
    flag = torch.full((1,), 0x40, dtype=torch.int32)
    cp(q, k, bad, sl, 1, out, scale=b.scale, error_flag=flag)
    assert int(flag) == 0x40 | cpidx.ERR_PAGE_OUT_OF_RANGE and int(cp.error_flag()) == 0
    for wrong, exc in ((torch.zeros(2, dtype=torch.int32), ValueError),
                       (torch.zeros(1, dtype=torch.int64), TypeError),
                       (np.zeros(1, np.int32)[:0], ValueError)):
        with pytest.raises(exc, match="^error_flag: expected one writable int32 element"):
            cp(q, k, bad, sl, 1, out, scale=b.scale, error_flag=wrong)
    assert int(cp.error_flag()) == 0


def test_example_layer_runs_on_the_cpu():
    # examples/indexer_layer.py, one process on the CPU (its comparisons and its device-error
    # read; the two-process GPU runs: scripts/device_python.sh).
    import subprocess
    import sys

    from helpers import ROOT

    example = os.path.join(ROOT, "examples", "indexer_layer.py")
    done = subprocess.run([sys.executable, example, "--device", "cpu"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "indexer_layer: OK" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize("exchange", ["peer", "nccl"])
def test_library_exchanges_on_the_cpu_are_refused_by_name(exchange):
    with pytest.raises(ValueError, match=f"exchange: '{exchange}' needs device='cuda'"):
        _world_one(exchange=exchange)


def test_unknown_exchange_is_named():
    with pytest.raises(ValueError, match="exchange: expected one of 'auto', 'peer', 'nccl', "
                                         "'torch', got 'ipc'"):
        _world_one(exchange="ipc")


def test_cpidx_communicator_as_group_is_checked():
    a, _ = cpidx._C._thread_communicators(2)
    with pytest.raises(ValueError, match="group: a cpidx Communicator needs device='cuda'"):
        _world_one(world_size=2, group=a)
    a.close()
    with pytest.raises(RuntimeError, match="is closed"):
        _world_one(world_size=2, group=a)


def _one_step(cp):
    """A step of the world-one instance, checked against the plain decode when it runs."""
    rng = np.random.default_rng(9)
    b = random_decode(rng, 4, 2, [1500, 129, 0, 640], max_seq_len=1536)
    q, k, bt, sl = as_torch(b)
    want = torch.zeros((4, b.rows, 6), dtype=torch.int32)
    cpidx.decode_topk(q, k, bt, sl, 2, want, scale=b.scale, topk=cp.topk,
                      init_blocks=cp.init_blocks, local_blocks=cp.local_blocks,
                      max_seq_len=cp.max_seq_len)

    def step():
        out = torch.full((4, b.rows, 6), 77, dtype=torch.int32)
        cp(q, k, bt, sl, 2, out, scale=b.scale)
        assert torch.equal(out, want)

    return step


def test_close_is_idempotent_and_a_later_call_raises_naming_the_instance():
    cp = _world_one()
    step = _one_step(cp)
    step()
    assert not cp.closed and cp.exchange == "none" and cp.exchange_error_flag() is None
    cp.clear_exchange_error_flag()
    cp.close()
    cp.close()
    assert cp.closed
    for use in (step, cp.error_flag, cp.clear_error_flag, cp.exchange_error_flag,
                cp.clear_exchange_error_flag):
        with pytest.raises(RuntimeError, match=r"IndexerCPDecode\(rank 0 of 1, exchange 'none', "
                                               r"device 'cpu'\) is closed"):
            use()


class _GraphHeldComm(_ClosableComm):
    """Stands in for a peer communicator an instance made and steps through, with `held` of its
    gathers in live CUDA graphs: its close() does not refuse (the teardown is collective)."""

    def __init__(self, held):
        super().__init__(blocked=False)
        self.held, self.closed = held, False

    def _gathers_in_live_graphs(self, wait_seconds=0.0):
        if self.held is None:
            raise RuntimeError("cudaDeviceSynchronize: an illegal memory access")
        return -1 if self.closed else self.held

    def _close_blocker(self, ignore_dependents=False, peer_graphs=False):
        # A peer communicator refuses for live graphs only when asked (peer_graphs).
        return f"{self.held} of its gathers are held" if peer_graphs and self.held else None

    def close(self):
        super().close()
        self.closed = True


def test_without_a_host_group_close_keeps_what_a_live_graph_uses():
    """No host group to agree through: a rank whose graphs hold its steps' gathers cannot refuse
    for every rank, so close() closes its communicators and keeps its workspace until the
    process exits, warning; with no graph it frees it, silently."""
    import warnings

    import cpidx._cp as cp_module

    for held in (2, None, 0):  # None: the count raises, which counts as held
        cp = _world_one()
        comm = _GraphHeldComm(held)
        cp._owned, cp._comm = [comm], comm  # as a peer exchange's instance without a host group
        if held:  # with a host group the agreement asks for the peer's graphs too
            assert cp._local_close_blocker() == "2 of its gathers are held"
        before = len(cp_module._KEPT_FOR_LIVE_GRAPHS)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cp.close()
        warned = [w for w in caught if w.category is RuntimeWarning]
        kept = len(cp_module._KEPT_FOR_LIVE_GRAPHS) - before == 1
        assert cp.closed and comm.closes == 1 and not comm.leaked
        if held == 0:
            assert not kept and not warned, [str(w.message) for w in warned]
            continue
        assert kept and len(warned) == 1, [str(w.message) for w in warned]
        assert "kept until the process exits" in str(warned[0].message)
        assert ("2 gather(s) of its steps are in CUDA graphs" if held else
                "could not be counted (RuntimeError: cudaDeviceSynchronize") in \
            str(warned[0].message)
        assert warned[0].filename == __file__  # points at the caller of close()


def test_context_manager_closes_on_both_exits():
    with _world_one() as cp:
        _one_step(cp)()
        assert not cp.closed
    assert cp.closed
    with pytest.raises(RuntimeError, match="closed"):
        with cp:
            pass
    with pytest.raises(KeyError):
        with _world_one() as cp:
            comm = _FakeCommunicator()
            cp._owned = [comm]  # as if it had made one: an exception's exit closes no collective
            raise KeyError("leave without a collective")
    assert cp.closed and comm.closes == 0


class _FakeCommunicator:
    """Stands in for a communicator an instance made (whose close() is collective)."""

    def __init__(self) -> None:
        self.closes = 0

    def close(self) -> None:
        self.closes += 1


def test_cp_decode_creation_and_collective_close_refused_during_a_capture(monkeypatch):
    # A capture forbids allocating and synchronising, and CUDA's refusal would also invalidate
    # it: IndexerCPDecode refuses first, naming what, and changes nothing. (The capture is
    # faked: no GPU here. The Registry's part: test_numpy.py, which CI runs without torch.)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    with pytest.raises(RuntimeError, match="creating an IndexerCPDecode: a CUDA graph is being "
                                           "captured"):
        _world_one(device="cuda:0")
    plain = _world_one()  # made no communicator: nothing collective to close
    plain.close()
    assert plain.closed
    cp = _world_one()
    comm = _FakeCommunicator()
    cp._owned = [comm]  # as if it had made one
    with pytest.raises(RuntimeError, match=r"IndexerCPDecode\(rank 0 of 1, exchange 'none', "
                                           r"device 'cpu'\)\.close\(\) \(collective.*capture "
                                           r"is still valid"):
        cp.close()
    assert not cp.closed and comm.closes == 0
    capturing[0] = False
    cp.close()
    assert cp.closed and comm.closes == 1
