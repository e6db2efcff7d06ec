"""The native CPU kernels against the PyTorch path: paged attention (the decode and chunk kernels,
AMX tiles against bf16 pairs, every head grouping, sequences sharing prefixes), the fused layer ops
(RMSNorm, rotary, SiLU-and-multiply) and the bf16 GEMM; and the PyTorch path's gathered attention
against each sequence's attention written out."""

from __future__ import annotations

import pytest
import torch

from backends.builtin.worker.models.layers import RMSNorm, rotate_half
from backends.cpu import bf16_native


def filled_cache(kv_dtype: str, dtype: torch.dtype, head_dim: int = 64, kv_heads: int = 3):
    from backends.builtin.worker.attention import LayerKV

    torch.manual_seed(0)
    kv = LayerKV.allocate(64, 16, kv_heads, head_dim, dtype, torch.device("cpu"), int8=kv_dtype == "int8")
    slots = torch.arange(64 * 16)
    kv.write(slots, *(torch.randn(len(slots), kv_heads, head_dim).to(dtype) for _ in "kv"))
    return kv


@pytest.mark.parametrize("dtype, kv_dtype, head_dim", [(torch.float32, "auto", 64), (torch.bfloat16, "auto", 64),
                                                       (torch.float32, "int8", 64), (torch.float32, "auto", 128),
                                                       (torch.bfloat16, "auto", 128)])
def test_native_kernel_equals_the_pytorch_path(dtype, kv_dtype, head_dim):
    import copy

    from backends.builtin.worker import kernels
    from backends.builtin.worker.attention import AttentionMetadata, paged_attention

    kv = filled_cache(kv_dtype, dtype, head_dim)
    assert kernels.available(torch.device("cpu"), kv.data.dtype, head_dim), kernels._failed
    tables = [[3, 7, 9, 11, 20], [1, 2], [30, 31, 32], [40]]
    ctx = [70, 20, 40, 1]
    # both kernels (the chunk kernel where AVX-512 builds it); the decode kernel with chunks on the
    # PyTorch path (AVX2, bf16 on AMX); the PyTorch path alone
    paths = (((True, True),) if kernels.load().chunk_attention_native() else ()) + ((True, False), (False, False))
    # decode only, mixed, short chunks only; chunks over several 16-token tiles: after cached
    # tokens (40 of 70, 39 of 40), a whole prompt (20 of 20)
    for q_lens in ([1, 1, 1, 1], [1, 5, 1, 1], [3, 5, 2, 1], [40, 20, 39, 1]):
        tokens = sum(q_lens)
        q, k, v = (torch.randn(tokens, h, head_dim).to(dtype) for h in (9, 3, 3))
        outs = []
        for use_kernel, chunk_kernel in paths:
            meta = AttentionMetadata.build(q_lens, ctx, tables, 16, torch.device("cpu"), dtype, use_kernel,
                                           chunk_kernel)
            assert (meta.kernel is not None) == (use_kernel and 1 in q_lens)
            assert (meta.chunks is not None) == (chunk_kernel and max(q_lens) > 1)
            assert bool(meta.gather) == (not chunk_kernel and (max(q_lens) > 1 or not use_kernel))
            outs.append(paged_attention(q, k, v, copy.deepcopy(kv), meta, head_dim**-0.5).float())
        for out in outs[:-1]:
            assert (out - outs[-1]).abs().max().item() < (2e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_chunk_kernel_on_amx_tiles_equals_its_bf16_pairs(head_dim):
    """Where AMX runs, bf16 chunks take the kernel's tile products: they equal its VDPBF16PS walk
    (the path of every other AVX512-BF16 CPU) for whole prompts over several 128-token items,
    chunks after cached tokens, and chunks whose rows fill no whole 16-row tile."""
    from backends.builtin.worker import kernels

    if not kernels.chunk_amx(torch.bfloat16):
        pytest.skip(f"AMX bf16 tiles do not run here (this CPU multiplies bf16 with {bf16_native() or 'neither'})")
    kv = filled_cache("auto", torch.bfloat16, head_dim)
    tables = torch.tensor([list(range(0, 20)), list(range(20, 40)), list(range(40, 60)), [60, 61, 62, 63] + [0] * 16])
    q_lens, ctx = [300, 200, 5, 17], [300, 310, 40, 64]
    q = torch.randn(sum(q_lens), 9, head_dim).to(torch.bfloat16)
    starts, ctx = torch.cumsum(torch.tensor([0] + q_lens), 0), torch.tensor(ctx)
    tiles, pairs = (kernels.chunk_attention(q, kv, tables, starts, ctx, head_dim**-0.5, amx=amx).float()
                    for amx in (True, False))
    assert tiles.isfinite().all()
    assert (tiles - pairs).abs().max().item() < 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gathered_attention_equals_dense_attention(dtype):
    """The PyTorch path against each sequence's attention written out: chunks of one length (no
    query padding) and of several, whole prompts (plainly causal) and chunks after cached tokens, a
    step of one class alone (its tokens taken in place) and steps of several, single tokens in
    one; the queries a view into a wider tensor, as the model's split of its QKV projection gives them."""
    import copy

    from backends.builtin.worker.attention import AttentionMetadata, paged_attention

    kv = filled_cache("auto", dtype)
    tables = [[3, 7, 9, 11, 20], [1, 2], [30, 31, 32], [40]]
    for q_lens, ctx in (([5, 5, 5, 5], [70, 20, 40, 5]), ([4, 4, 4], [4, 4, 4]), ([9, 5, 9, 1], [70, 20, 40, 1]),
                        ([1, 5, 5, 1], [70, 20, 40, 1])):
        tokens, n = sum(q_lens), len(q_lens)
        qkv = torch.randn(tokens, (9 + 3 + 3) * 64, dtype=dtype)
        q, k, v = (x.view(tokens, -1, 64) for x in qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1))
        cache = copy.deepcopy(kv)
        meta = AttentionMetadata.build(q_lens, ctx, tables[:n], 16, torch.device("cpu"), dtype, False)
        out = paged_attention(q, k, v, cache, meta, 0.125)
        start = 0
        for q_len, context, table in zip(q_lens, ctx, tables):
            slots = torch.tensor([table[p // 16] * 16 + p % 16 for p in range(context)])
            keys, values = (cache.data[i].view(-1, 3, 64)[slots].double().repeat_interleave(3, dim=1) for i in (0, 1))
            scores = torch.einsum("qhd,khd->hqk", q[start : start + q_len].double(), keys) * 0.125
            causal = torch.arange(context)[None, :] <= torch.arange(context - q_len, context)[:, None]
            want = torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), values)
            assert (out[start : start + q_len].double() - want).abs().max().item() < 1e-5
            start += q_len


def decode_gap(kv, tables: list[list[int]], ctx: list[int], heads: int, dtype: torch.dtype) -> float:
    """The largest difference between the native decode kernel and the PyTorch path, one decode
    token per table (head size 64, random queries, keys and values)."""
    import copy

    from backends.builtin.worker.attention import AttentionMetadata, paged_attention

    kv_heads = kv.data.shape[3]
    q, k, v = (torch.randn(len(tables), h, 64).to(dtype) for h in (heads, kv_heads, kv_heads))
    native, reference = (
        paged_attention(q, k, v, copy.deepcopy(kv),
                        AttentionMetadata.build([1] * len(tables), ctx, tables, 16, torch.device("cpu"), dtype,
                                                use_kernel, False),
                        64**-0.5).float()
        for use_kernel in (True, False))
    return (native - reference).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_kernel_answers_every_token_of_sequences_sharing_prefixes(dtype):
    """The kernel takes tokens in the order of their first block (a shared prefix's sequences back
    to back, the groups interleaved here as arrivals leave them); each token's output is still
    its own sequence's."""
    groups = {3: [[7, 9], [7, 10], [8], [11, 12, 13], [14], [15]], 1: [[2], [5, 6]], 40: [[]]}
    tables = [[first, *rest] for first, rests in groups.items() for rest in rests]
    tables = tables[::2] + tables[1::2]  # the groups interleaved, as arrivals leave them
    ctx = [16 * len(table) - 3 * (i % 5) for i, table in enumerate(tables)]
    gap = decode_gap(filled_cache("auto", dtype, kv_heads=3), tables, ctx, 9, dtype)
    assert gap < (2e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [2, 4, 8, 12, 16])
def test_native_decode_kernel_serves_every_head_grouping(dtype, heads):
    """1, 2, 4, 6 and 8 query heads per KV head: the kernel sums the values of up to four at once."""
    gap = decode_gap(filled_cache("auto", dtype, kv_heads=2), [[3, 7, 9, 11, 20], [1, 2], [40]], [70, 20, 1],
                     heads, dtype)
    assert gap < (2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_native_layer_ops_equal_the_pytorch_path():
    """The fused bf16 ops round where PyTorch's operators round: the same bf16 values, but for
    RMSNorm's sum of squares, added in another order (a bf16 ulp, rarely: the order follows the
    vector width, and AVX2's 8 lanes differ on 0.9-1.4e-4 of the values, AVX-512's on fewer)."""
    ops = kernels_layer_ops(torch.bfloat16)
    torch.manual_seed(0)
    norm = RMSNorm(576, 1e-5).bfloat16()
    norm.weight.data.normal_()
    for scale in (0.01, 1.0, 30.0):
        x, residual = (torch.randn(2, 2000, 576) * scale).bfloat16()
        want = norm(x.clone(), residual.clone(), None)
        got = norm(x.clone(), residual.clone(), ops)
        assert torch.equal(got[1], want[1])  # the residual stream: exact
        differ = got[0] != want[0]
        assert differ.float().mean() < 3e-4
        # an ulp of the normalized value, then the weight's rounding: within 2^-6 of the value
        assert ((got[0].float() - want[0].float()).abs() <= want[0].float().abs() * 2**-6).all()
    first = norm(x.clone(), None, ops)  # the first layer: no residual yet
    assert torch.equal(first[1], x) and (first[0] != norm(x.clone(), None, None)[0]).float().mean() < 3e-4
    for got, want in rotary_and_silu(ops, torch.bfloat16):
        assert torch.equal(got, want)


def test_native_layer_ops_in_float32_stay_within_float32_rounding():
    ops = kernels_layer_ops(torch.float32)
    torch.manual_seed(0)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data.normal_()
    x, residual = torch.randn(2, 2000, 576) * 30
    want = norm(x.clone(), residual.clone(), None)
    got = norm(x.clone(), residual.clone(), ops)
    assert torch.equal(got[1], want[1])  # one addition: exact
    torch.testing.assert_close(got[0], want[0], rtol=4e-6, atol=1e-6)
    for got, want in rotary_and_silu(ops, torch.float32):
        torch.testing.assert_close(got, want, rtol=4e-6, atol=1e-6)


def test_native_bf16_linear_rounds_float32_sums_once():
    """The native bf16 GEMM (AVX512-BF16): exact products, float32 sums, one rounding to bf16, as
    oneDNN's; rows in groups of 8 and items of up to 256, columns in blocks of 16 and items of 6."""
    from backends.builtin.worker import kernels
    from backends.builtin.worker.model_runner import PackedLinear, PairedLinear

    ops = kernels.load()
    assert ops is not None, kernels._failed
    if not ops.bf16_linear_native():
        pytest.skip("this CPU has no AVX512-BF16: bf16 Linears stay on oneDNN here")
    chosen = kernels.bf16_linear(torch.device("cpu"), torch.bfloat16)
    assert (chosen is not None) == (bf16_native() == "AVX512-BF16")  # AMX keeps oneDNN's tiles
    assert kernels.bf16_linear(torch.device("cpu"), torch.float32) is None
    torch.manual_seed(0)
    for rows in (0, 1, 7, 9, 16, 40, 300):
        for outputs, inputs, bias in ((960, 576, False), (48, 34, True), (208, 10, False)):
            linear = torch.nn.Linear(inputs, outputs, bias=bias).bfloat16()
            x = torch.randn(rows, inputs).bfloat16() * 3
            got = PairedLinear(linear, ops)(x)
            assert got.shape == (rows, outputs) and got.dtype == torch.bfloat16
            exact = torch.nn.functional.linear(x.double(), linear.weight.double(),
                                               None if linear.bias is None else linear.bias.double())
            # half a bf16 ulp for the rounding, and float32's for sums over `inputs` terms
            magnitude = torch.nn.functional.linear(x.double().abs(), linear.weight.double().abs())
            assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + magnitude * inputs * 2**-24).all()
            onednn = PackedLinear(linear)(x)
            # oneDNN sums in its own order (on AMX tiles, another again): where terms cancel, each
            # result carries its own float32 error
            assert ((got.double() - onednn.double()).abs()
                    <= onednn.double().abs() * 2**-7 + 2 * magnitude * inputs * 2**-24).all()
    with pytest.raises(RuntimeError, match=r"laid out \[N/16, K/2, 16, 2\] for K = 576"):
        ops.bf16_linear(torch.zeros(2, 576).bfloat16(), torch.zeros(60, 16, 288, 2).bfloat16())


def kernels_layer_ops(dtype):
    from backends.builtin.worker import kernels

    ops = kernels.layer_ops(torch.device("cpu"), dtype)
    assert ops is not None, kernels._failed
    assert kernels.layer_ops(torch.device("cpu"), torch.float16) is None
    return ops


def rotary_and_silu(ops, dtype):
    """(native, PyTorch) pairs: rotary embedding of qkv's three parts, then SiLU-and-multiply."""
    import torch.nn.functional as F

    tokens, heads, kv_heads, dim = 37, 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    angles = torch.arange(tokens).float()[:, None] / 10000 ** (torch.arange(0, dim, 2).float() / dim)
    cos, sin = torch.cat((angles, angles), -1).cos().to(dtype), torch.cat((angles, angles), -1).sin().to(dtype)
    rotated = qkv.clone()
    ops.rotary(rotated, cos, sin, heads, kv_heads)
    for part, n, start in ((0, heads, 0), (1, kv_heads, heads * dim), (2, kv_heads, (heads + kv_heads) * dim)):
        x = qkv[:, start:start + n * dim].reshape(tokens, n, dim)
        want = x if part == 2 else x * cos[:, None] + rotate_half(x) * sin[:, None]  # values are not rotated
        yield rotated[:, start:start + n * dim].reshape(tokens, n, dim), want
    gate_up = torch.randn(tokens, 2 * 1536).to(dtype) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    yield ops.silu_mul(gate_up), F.silu(gate) * up


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_lora_gather_matmul_equals_the_pytorch_path(dtype):
    """Each token on its adapter's slot (or none), adapters interleaved and in runs longer than a
    tile, a fused Linear's parts with ranks of their own (0: a part the adapter leaves alone)."""
    from types import SimpleNamespace

    from backends.builtin.worker import kernels
    from backends.builtin.worker.lora import LoRALinear, LoRAWeights

    ops = kernels.load()
    assert ops is not None, kernels._failed
    torch.manual_seed(0)
    sizes, k, max_rank, slots = (40, 24, 24), 56, 16, 3
    parts = [(f"p{i}", size) for i, size in enumerate(sizes)]
    holder = SimpleNamespace(max_loras=slots, token_slots=None, ops=None)  # what a LoRALinear reads of its slots
    linear = LoRALinear(torch.nn.Linear(k, sum(sizes), bias=False).to(dtype), holder, parts, k, max_rank, dtype,
                        torch.device("cpu"))
    for slot, ranks in enumerate(((16, 5, 0), (1, 16, 16), (7, 0, 3))):
        factors = {name: (torch.randn(rank, k), torch.randn(size, rank))
                   for (name, size), rank in zip(parts, ranks) if rank}
        linear.load(slot, LoRAWeights(max(ranks), factors))
    x = torch.randn(30, k).to(dtype)
    holder.token_slots = torch.tensor([0, 2, -1, 1, 0, 1, 2, -1, 0, 0, *([1] * 12), *([2] * 8)], dtype=torch.int32)
    holder.ops = None
    expected = linear(x)
    holder.ops = ops
    got = linear(x)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: y rounded once here, twice there
    scale = expected.float().abs().max().item()
    assert torch.allclose(got.float(), expected.float(), rtol=tolerance, atol=tolerance * scale)
    holder.token_slots = None
    assert torch.equal(linear(x), linear.base(x))  # no adapter in the step: the base alone
