"""The fused Triton quantizers and the fused FP8 linear on a GPU, against the torch reference.

Bytes and scales must be identical to ``backend="torch"`` (the reference the CPU tests pin) on every
case: partial blocks, non-contiguous inputs, e4m3/e5m2, exact and power-of-two scales, float32 and
bf16 inputs, all-zero groups, wide dynamic range.  The fused linear must compute the same function as
the reference linear up to GEMM summation order.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu]
if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("needs a CUDA GPU with FP8 (sm_89+)", allow_module_level=True)
pytest.importorskip("triton")

from fp8rl.bench.kernels import COLWISE_CANDIDATES, ROWWISE_CANDIDATES, TILES_CANDIDATES  # noqa: E402
from fp8rl.quant import (  # noqa: E402
    NonFiniteError,
    QuantSpec,
    fp8_gemm,
    kernels,
    launch_config,
    quantize,
    quantize_activation,
    quantize_weight,
)
from fp8rl.quant.block_linear import block_linear_supported, quantize_block_input, quantize_block_weight  # noqa: E402
from fp8rl.quant.formats import get_format  # noqa: E402
from fp8rl.quant.gemm import block_scaled_mm, outer_major  # noqa: E402

hopper = pytest.mark.skipif(torch.cuda.get_device_capability()[0] != 9, reason="cuBLAS block scaling is sm_90 only")
SHAPES = [(4096, 4096), (1000, 3000), (129, 257), (7, 128), (1, 1), (300, 64)]


def _input(shape: tuple[int, int], seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, generator=gen, device="cuda") * torch.logspace(-4, 3, shape[1], device="cuda")
    x = x.to(dtype)
    x[0, 0] = 0.0
    if shape[0] > 2 and shape[1] > 130:
        x[1, :128] = 0.0  # an all-zero group
        x[2, 5] = -x[2].abs().max() * 2  # a negative maximum
    return x


def _same(a, b) -> None:  # type: ignore[no-untyped-def]
    assert a.data.shape == b.data.shape and a.scale_inv.shape == b.scale_inv.shape
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    assert torch.equal(a.scale_inv, b.scale_inv)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("block", [(128, 128), (1, 128), (1, 64), (32, 32)])
def test_fused_quantizers_are_bit_identical_to_the_reference(shape, granularity, fmt, pow2, block) -> None:
    if granularity != "block" and block != (128, 128):
        pytest.skip("block shape only matters for block granularity")
    x = _input(shape, hash((shape, granularity, fmt, pow2, block)) % 2**31)
    ref = quantize(x, granularity, fmt, block, pow2, backend="torch")
    got = quantize(x, granularity, fmt, block, pow2, backend="triton")
    _same(got, ref)


@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_non_contiguous_and_other_dtypes(granularity: str, dtype: torch.dtype) -> None:
    x = _input((384, 1000), 7, dtype).t()  # a transposed view: strides (1, 1000)
    for block in [(128, 128), (1, 128)]:
        _same(
            quantize(x, granularity, "e4m3", block, backend="triton"),
            quantize(x, granularity, "e4m3", block, backend="torch"),
        )


def test_three_dimensional_activations() -> None:
    x = _input((6, 2048), 3).view(2, 3, 2048)
    _same(
        quantize(x, "block", "e4m3", (1, 128), backend="triton"),
        quantize(x, "block", "e4m3", (1, 128), backend="torch"),
    )
    _same(quantize(x, "row", "e4m3", backend="triton"), quantize(x, "row", "e4m3", backend="torch"))


@pytest.mark.parametrize("m", [1, 100, 128, 1000])
@pytest.mark.parametrize("pow2", [False, True])
def test_one_pass_rowwise_and_colwise_equal_the_reference_of_x_and_x_transposed(m: int, pow2: bool) -> None:
    x = _input((m, 768), m)
    spec = QuantSpec(pow2_scales=pow2)
    q, s, qt, st = quantize_block_input(x, spec, rowwise=True, colwise=True)
    assert q is not None and s is not None and qt is not None and st is not None
    ref = quantize_activation(x, spec, backend="torch")
    ref_t = quantize_activation(x.t(), spec, backend="torch")
    assert s.stride(0) == 1 and st.stride(0) == 1  # outer-dim major, as cuBLAS reads them
    assert torch.equal(q[:m].view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(s[:m], ref.scale_inv)
    assert torch.equal(qt[:, :m].view(torch.uint8), ref_t.data.view(torch.uint8))
    assert torch.equal(st, ref_t.scale_inv)
    assert not q[m:].view(torch.uint8).any() and not qt[:, m:].view(torch.uint8).any()  # zero padding rows


@pytest.mark.parametrize(
    "config", [(*c, "") for c in ROWWISE_CANDIDATES] + COLWISE_CANDIDATES, ids=lambda c: "-".join(map(str, c))
)
def test_every_launch_config_gives_the_same_bytes(config: tuple[int, int, str]) -> None:
    """Every configuration ``fp8rl bench kernels --sweep`` may pick (and ``FP8RL_QUANT_LAUNCH`` then use)."""
    from fp8rl.quant.formats import E4M3

    x = _input((1000, 1024), 5)
    colwise = bool(config[2])
    want = kernels.quantize_groups(x, E4M3, False, 128, colwise=colwise)
    got = kernels.quantize_groups(x, E4M3, False, 128, colwise=colwise, config=config)
    for a, b in zip(got, want, strict=True):
        if a is not None:
            assert b is not None and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    for warps in TILES_CANDIDATES:
        _same_tiles = kernels.quantize_tiles(x, E4M3, True, transpose=True, warps=warps)
        ref = kernels.quantize_tiles(x, E4M3, True, transpose=True)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(_same_tiles, ref, strict=True))


def test_weight_tiles_and_transpose_equal_the_reference_of_w_and_w_transposed() -> None:
    w = _input((640, 384), 11) * 0.02
    spec = QuantSpec()
    bw = quantize_block_weight(w, spec, transpose=True)
    ref, ref_t = quantize_weight(w, spec, backend="torch"), quantize_weight(w.t(), spec, backend="torch")
    assert bw.qt is not None
    assert torch.equal(bw.q.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(bw.scale, ref.scale_inv)
    assert torch.equal(bw.qt.view(torch.uint8), ref_t.data.view(torch.uint8))


@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_raises(granularity: str, bad: float) -> None:
    x = _input((256, 256), 1)
    x[100, 3] = bad
    with pytest.raises(NonFiniteError):
        quantize(x, granularity, backend="triton")
    # the unchecked path gives a non-finite scale instead of an error
    assert not torch.isfinite(quantize(x, granularity, backend="triton", check_finite=False).scale_inv).all()


def test_auto_backend_uses_the_kernels_on_cuda() -> None:
    assert kernels.kernels_available(torch.zeros(1, device="cuda"))
    with pytest.raises(ValueError, match="backend='triton'"):
        quantize(torch.zeros(4, 4), "block", backend="triton")  # a CPU tensor


@hopper
@pytest.mark.parametrize("mnk", [(256, 512, 1024), (4096, 4096, 4096), (100, 1536, 256)])
def test_block_gemms_match_emulation(mnk: tuple[int, int, int]) -> None:
    m, n, k = mnk
    spec = QuantSpec()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    # forward: 1x128 x 128x128 (padded rows)
    xq, xs, _, _ = quantize_block_input(x, spec, rowwise=True, colwise=False)
    assert xq is not None and xs is not None
    bw = quantize_block_weight(w, spec, transpose=False)
    fast = block_scaled_mm(xq, xs, bw.q, bw.scale_cublas, True)[:m].float()
    ref = fp8_gemm(quantize_activation(x, spec), quantize_weight(w, spec), torch.float32, backend="emulated")
    assert ((fast - ref).norm() / ref.norm()).item() < 4e-3
    # wgrad shape: 1x128 x 1x128
    wq = quantize_activation(w, spec)
    xa = quantize_activation(x, spec)
    fast = block_scaled_mm(xa.data, outer_major(xa.scale_inv), wq.data, outer_major(wq.scale_inv), False).float()
    ref = fp8_gemm(xa, wq, torch.float32, backend="emulated")
    assert ((fast - ref).norm() / ref.norm()).item() < 4e-3


@hopper
@pytest.mark.parametrize("m", [64, 1000, 4096])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("granularity", ["block", "row"])
def test_fused_train_linear_matches_the_reference_linear(m: int, bias: bool, granularity: str) -> None:
    """The block and the row recipe's fused paths (``fp8rl.quant.block_linear``, ``fp8rl.quant.row_linear``)."""
    from fp8rl.quant.row_linear import row_linear_supported
    from fp8rl.train.fp8_linear import FP8TrainLinear, _FP8LinearFunction

    torch.manual_seed(m)
    base = torch.nn.Linear(512, 768, bias=bias, device="cuda", dtype=torch.bfloat16)
    lin = FP8TrainLinear.from_linear(base, QuantSpec(granularity=granularity))  # type: ignore[arg-type]
    supported = block_linear_supported if granularity == "block" else row_linear_supported
    assert supported(512, 768, lin.spec, torch.device("cuda")) and lin._fused_operands() is not None
    x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(m, 768, device="cuda", dtype=torch.bfloat16)

    def run(fused: bool) -> list[torch.Tensor]:
        x.grad = None
        for p in lin.parameters():
            p.grad = None
        y = lin(x) if fused else _FP8LinearFunction.apply(x, lin.weight, lin.bias, lin.spec)
        y.backward(g)
        out = [y.detach().float(), x.grad.float(), lin.weight.grad.float()]
        return out + ([lin.bias.grad.float()] if bias else [])

    fused, ref = run(True), run(False)
    for a, b in zip(fused, ref, strict=True):
        assert ((a - b).norm() / b.norm()).item() < 1e-2


@hopper
def test_linears_reading_one_input_share_its_quantization_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """q/k/v-style linears on one tensor quantize it once; outputs and gradients are those of separate inputs."""
    from fp8rl.train import fp8_linear
    from fp8rl.train.fp8_linear import FP8TrainLinear

    torch.manual_seed(0)
    lins = [
        FP8TrainLinear.from_linear(
            torch.nn.Linear(512, n, bias=False, device="cuda", dtype=torch.bfloat16), QuantSpec()
        )
        for n in (512, 128, 128)
    ]
    base = torch.randn(2, 300, 512, device="cuda", dtype=torch.bfloat16)
    g = [torch.randn(2, 300, lin.out_features, device="cuda", dtype=torch.bfloat16) for lin in lins]
    calls = []
    real = fp8_linear.quantize_block_input
    monkeypatch.setattr(fp8_linear, "quantize_block_input", lambda *a, **k: calls.append(1) or real(*a, **k))

    def run(shared: bool) -> list[torch.Tensor]:
        for lin in lins:
            lin.weight.grad = None
        x = base.clone().requires_grad_(True)
        inputs = [x * 1 for _ in lins] if not shared else [x * 1] * len(lins)
        ys = [lin(inp) for lin, inp in zip(lins, inputs, strict=True)]
        torch.autograd.backward(ys, g)
        return [y.detach() for y in ys] + [lin.weight.grad for lin in lins] + [x.grad]

    separate = run(False)
    n_separate = len(calls)
    calls.clear()
    shared = run(True)
    assert n_separate == 6 and len(calls) == 1 + 3  # one input quantization, then each linear's dY
    for a, b in zip(shared[:-1], separate[:-1], strict=True):
        assert torch.equal(a, b)
    # dX: the same three products, summed by autograd in an order that may differ
    assert ((shared[-1] - separate[-1]).float().norm() / separate[-1].float().norm()).item() < 1e-2
    x = base.clone()
    lins[0](x)
    with torch.no_grad():
        x.mul_(2)  # modified in place: its old FP8 copy is stale
    calls.clear()
    lins[1](x)
    assert len(calls) == 1
    del x
    assert fp8_linear._shared_input._ref is None  # freed with the activation it came from


@hopper
def test_checkpointed_first_forward_skips_the_transposed_copy_and_changes_no_bit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under ``checkpoint_contexts`` a region's first forward quantizes its inputs without the transposed copy
    (placeholders pass the checkpoint's determinism check); outputs and gradients equal those of the plain
    checkpoint and of no checkpointing, bit for bit."""
    from torch.utils.checkpoint import checkpoint

    from fp8rl.train import fp8_linear
    from fp8rl.train.fp8_linear import FP8TrainLinear, checkpoint_contexts

    torch.manual_seed(0)

    def linear(k: int, n: int) -> FP8TrainLinear:
        lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        return FP8TrainLinear.from_linear(lin, QuantSpec())

    up, down = linear(512, 1024), linear(1024, 512)
    base = torch.randn(2, 300, 512, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(2, 300, 512, device="cuda", dtype=torch.bfloat16)
    colwise: list[bool] = []
    real = fp8_linear.quantize_block_input
    monkeypatch.setattr(
        fp8_linear, "quantize_block_input", lambda *a, **k: colwise.append(k["colwise"]) or real(*a, **k)
    )

    def region(x: torch.Tensor) -> torch.Tensor:
        return down(torch.nn.functional.silu(up(x)))

    def run(mode: str) -> list[torch.Tensor]:
        up.weight.grad = down.weight.grad = None
        x = base.clone().requires_grad_(True)
        if mode == "none":
            y = region(x)
        else:
            kw = {"context_fn": checkpoint_contexts} if mode == "contexts" else {}
            y = checkpoint(region, x, use_reentrant=False, **kw)
        y.backward(g)
        assert up.weight.grad is not None and down.weight.grad is not None and x.grad is not None
        return [y.detach(), up.weight.grad, down.weight.grad, x.grad]

    plain = run("none")
    colwise.clear()
    skipped = run("contexts")
    # first forward: two inputs, rowwise only; recompute: both copies; backward: dY of each linear
    assert colwise[:2] == [False, False] and colwise[2:4] == [True, True]
    colwise.clear()
    stock = run("checkpoint")
    assert colwise[:2] == [True, True]
    for a, b, c in zip(skipped, stock, plain, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_profiled_quantization_is_reported_by_launch_shape() -> None:
    """``StepProfile`` pairs the profiler's quantization kernels with ``record_launches``' labels in launch order."""
    from fp8rl.train.step_profile import QUANT_CALLS_PREFIX, QUANT_MS_PREFIX, StepProfile

    x = torch.randn(1000, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    prof = StepProfile(torch.device("cuda"))
    prof.arm()
    with prof.around() as out:
        for _ in range(3):
            kernels.quantize_groups(x, get_format("e4m3"), False, rowwise=True, colwise=True, rows_out=1024)
        kernels.quantize_tiles(w, get_format("e4m3"), False, transpose=True)
    if launch_config.GROUPS_COLWISE_CONFIG[2] == "split":  # a rowwise launch and a transposed one per call
        assert out[QUANT_CALLS_PREFIX + "1x128/1024x512/rowwise"] == 3
        assert out[QUANT_CALLS_PREFIX + "1x128/1024x512/transposed"] == 3
    else:
        assert out[QUANT_CALLS_PREFIX + "1x128/1024x512/rowwise_transposed"] == 3
    assert out[QUANT_CALLS_PREFIX + "128x128/256x512/tiles_transposed"] == 1
    assert all(out[k] > 0 for k in out if k.startswith(QUANT_MS_PREFIX))


@hopper
def test_fused_weight_is_quantized_once_per_weight_version() -> None:
    from fp8rl.train.fp8_linear import FP8TrainLinear

    lin = FP8TrainLinear.from_linear(torch.nn.Linear(256, 256, device="cuda", dtype=torch.bfloat16), QuantSpec())
    first = lin._fused_operands()
    assert first is not None and lin._fused_operands() is first  # same version: cached
    with torch.no_grad():
        lin.weight.add_(1.0)  # an optimizer step writes the parameter in place
    second = lin._fused_operands()
    assert second is not None and second is not first
    assert torch.equal(second.q.view(torch.uint8), quantize_weight(lin.weight, lin.spec).data.view(torch.uint8))


def test_weight_requantized_in_place_keeps_its_buffers_and_equals_a_fresh_quantization() -> None:
    """``refresh_weight`` (what CUDA graphs need): new bytes and scales in the very buffers the graphs read."""
    from fp8rl.train.fp8_linear import FP8TrainLinear

    lin = FP8TrainLinear.from_linear(torch.nn.Linear(384, 640, device="cuda", dtype=torch.bfloat16), QuantSpec())
    lin.prepare()
    old = lin._fused_weight
    assert old is not None and old.qt is not None and old.scale_t is not None
    ptrs = [t.data_ptr() for t in (old.q, old.scale_cublas, old.qt, old.scale_t_cublas)]
    with torch.no_grad():
        lin.weight.mul_(-3.0)
    lin.refresh_weight()
    new = lin._fused_weight
    assert new is not None and new.qt is not None and new.scale_t_cublas is not None
    assert [t.data_ptr() for t in (new.q, new.scale_cublas, new.qt, new.scale_t_cublas)] == ptrs
    assert lin._fused_operands() is new  # its key is the new weight version: no second quantization
    fresh = quantize_block_weight(lin.weight.detach(), lin.spec, transpose=True)
    assert fresh.qt is not None and fresh.scale_t_cublas is not None
    for a, b in [(new.q, fresh.q), (new.qt, fresh.qt)]:
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(new.scale_cublas, fresh.scale_cublas) and torch.equal(new.scale_t_cublas, fresh.scale_t_cublas)
    with pytest.raises(ValueError, match="cannot requantize a \\[384, 640\\] weight"):
        quantize_block_weight(lin.weight.detach().t(), lin.spec, transpose=True, into=new)


@hopper
def test_fused_inference_linear_matches_the_reference() -> None:
    from fp8rl.rollout.fp8_linear import FP8InferenceLinear

    base = torch.nn.Linear(384, 256, device="cuda", dtype=torch.bfloat16)
    lin = FP8InferenceLinear.from_linear(base, QuantSpec())
    x = torch.randn(3, 5, 384, device="cuda", dtype=torch.bfloat16)
    fast = lin(x).float()
    ref = fp8_gemm(
        quantize_activation(x.reshape(-1, 384), lin.spec), lin.quantized_weight(), torch.float32, bias=lin.bias
    )
    assert ((fast.reshape(-1, 256) - ref).norm() / ref.norm()).item() < 1e-2
    new = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16) * 0.02
    lin.load_(new)  # a weight sync refreshes the cuBLAS-layout scales
    fast = lin(x).float().reshape(-1, 256)
    ref = fp8_gemm(
        quantize_activation(x.reshape(-1, 384), lin.spec), quantize_weight(new, lin.spec), torch.float32, bias=lin.bias
    )
    assert ((fast - ref).norm() / ref.norm()).item() < 1e-2


def test_requantize_for_rollout_on_cuda_equals_cpu_bytes() -> None:
    from fp8rl.sync import requantize_for_rollout

    gen = torch.Generator().manual_seed(0)
    weights = {"a.weight": torch.randn(384, 256, generator=gen).bfloat16(), "norm": torch.randn(256, generator=gen)}
    spec = QuantSpec()
    cpu = requantize_for_rollout(weights, {"a.weight"}, spec)
    gpu = requantize_for_rollout({k: v.cuda() for k, v in weights.items()}, {"a.weight"}, spec)
    a, b = gpu["a.weight"], cpu["a.weight"]
    assert torch.equal(a.data.cpu().view(torch.uint8), b.data.view(torch.uint8))
    assert torch.equal(a.scale_inv.cpu(), b.scale_inv)
    bad = dict(weights, **{"a.weight": weights["a.weight"].clone()})
    bad["a.weight"][0, 0] = float("nan")
    with pytest.raises(NonFiniteError):
        requantize_for_rollout({k: v.cuda() for k, v in bad.items()}, {"a.weight"}, spec)
