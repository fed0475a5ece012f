"""cudadoctor_ops.depthwise_conv2d against a float64 F.conv2d reference.

Every test needs a CUDA GPU and the built extension; without them the module skips with the reason.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU: depthwise_conv2d tests need one", allow_module_level=True)

try:
    import cudadoctor_ops  # noqa: E402
except ImportError as exc:  # pragma: no cover - depends on the build
    pytest.skip(f"cudadoctor_ops is not built: {exc}", allow_module_level=True)

from cudadoctor_ops import DepthwiseConv2d, depthwise_conv2d  # noqa: E402

pytestmark = pytest.mark.gpu

DEV = "cuda"
ops = torch.ops.cudadoctor_ops

# (N, C, H, W, multiplier, (kh, kw), stride, padding, dilation)
CASES = [
    (2, 8, 16, 16, 1, (3, 3), 1, 1, 1),  # fast 3x3 s1
    (2, 8, 17, 19, 1, (3, 3), 2, 1, 1),  # fast 3x3 s2, odd input
    (1, 16, 33, 35, 1, (5, 5), 1, 2, 1),  # fast 5x5 s1, odd
    (3, 8, 21, 23, 1, (5, 5), 2, 2, 1),  # fast 5x5 s2, odd
    (2, 8, 20, 18, 1, (7, 7), 1, 3, 1),  # fast 7x7 s1
    (2, 8, 15, 29, 1, (7, 7), 2, 3, 1),  # fast 7x7 s2, odd
    (2, 8, 16, 16, 1, (3, 3), 1, 3, 1),  # padding larger than half the kernel
    (2, 8, 12, 10, 1, (5, 5), 2, 4, 1),  # padding larger than half, stride 2
    (2, 8, 9, 11, 1, (3, 3), 1, 0, 1),  # no padding
    (2, 8, 13, 13, 1, (3, 3), 1, 2, 2),  # dilation 2
    (1, 8, 14, 15, 1, (3, 3), 2, 1, 2),  # dilation 2, stride 2
    (2, 8, 4, 3, 1, (5, 5), 1, 2, 1),  # H and W smaller than the kernel
    (2, 8, 2, 6, 1, (7, 7), 2, 3, 1),  # tiny, stride 2
    (1, 4, 10, 12, 1, (3, 5), (1, 2), (1, 2), 1),  # rectangular kernel, unequal stride
    (2, 4, 11, 9, 2, (3, 3), 1, 1, 1),  # channel multiplier 2
    (1, 3, 7, 7, 1, (1, 1), 1, 0, 1),  # 1x1
    (1, 6, 9, 9, 1, (3, 3), 1, 1, 1),  # C not a multiple of the NHWC vector width
    (2, 24, 56, 56, 1, (3, 3), 2, 1, 1),  # MobileNet-like, stride 2
    (2, 32, 130, 130, 1, (3, 3), 1, 1, 1),  # several tiles across W
    (1, 16, 14, 14, 1, (5, 5), 1, 2, 1),  # EfficientNet-like 5x5
    (1, 8, 11, 11, 1, (4, 4), 1, 2, 1),  # even kernel
]

TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2.5e-2, torch.float64: 1e-12}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LAYOUTS = ["nchw", "channels_last"]


def _case_id(case) -> str:
    n, c, h, w, m, k, s, p, d = case
    return f"{n}x{c}x{h}x{w}-m{m}-k{k[0]}x{k[1]}-s{s}-p{p}-d{d}"


def _make(case, dtype, layout, requires_grad=False, bias=True, seed=0):
    n, c, h, w, m, k, s, p, d = case
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(n, c, h, w, device=DEV, dtype=torch.float32, generator=g).to(dtype)
    wt = torch.randn(c * m, 1, *k, device=DEV, dtype=torch.float32, generator=g).to(dtype)
    b = torch.randn(c * m, device=DEV, dtype=torch.float32, generator=g).to(dtype) if bias else None
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    for t in (x, wt, b):
        if t is not None:
            t.requires_grad_(requires_grad)
    return x, wt, b, s, p, d


def _ref(x, wt, b, s, p, d):
    """float64 reference (same rounded inputs) with autograd."""
    xd = x.detach().double().requires_grad_(True)
    wd = wt.detach().double().requires_grad_(True)
    bd = b.detach().double().requires_grad_(True) if b is not None else None
    out = F.conv2d(xd, wd, bd, s, p, d, groups=x.shape[1])
    return xd, wd, bd, out


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.abs().max().item()
    if scale == 0:
        scale = 1.0
    return (got.double() - ref).abs().max().item() / scale


@pytest.mark.parametrize("impl", ["auto", "direct"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_forward_backward_match_float64(case, dtype, layout, impl):
    x, wt, b, s, p, d = _make(case, dtype, layout, requires_grad=True)
    out = depthwise_conv2d(x, wt, b, s, p, d, impl=impl)
    xd, wd, bd, ref = _ref(x, wt, b, s, p, d)
    assert out.shape == ref.shape
    assert out.dtype == dtype
    if layout == "channels_last" and x.shape[1] > 1:
        assert out.is_contiguous(memory_format=torch.channels_last)
    assert _rel_err(out, ref) < TOL[dtype], "forward"

    g = torch.randn(out.shape, device=DEV, dtype=torch.float32).to(dtype)
    if layout == "channels_last":
        g = g.contiguous(memory_format=torch.channels_last)
    out.backward(g)
    ref.backward(g.double())
    assert _rel_err(x.grad, xd.grad) < TOL[dtype], "grad input"
    assert _rel_err(wt.grad, wd.grad) < TOL[dtype], "grad weight"
    assert _rel_err(b.grad, bd.grad) < TOL[dtype], "grad bias"


@pytest.mark.parametrize("case", [c for c in CASES if c[4] == 1 and c[8] == 1][:8], ids=_case_id)
def test_fast_and_direct_agree_fp32(case):
    x, wt, b, s, p, d = _make(case, torch.float32, "nchw")
    a = depthwise_conv2d(x, wt, b, s, p, d, impl="auto")
    r = depthwise_conv2d(x, wt, b, s, p, d, impl="direct")
    torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)


def test_env_var_selects_direct(monkeypatch):
    case = CASES[0]
    x, wt, b, s, p, d = _make(case, torch.float32, "nchw")
    monkeypatch.setenv("CUDADOCTOR_OPS_DEPTHWISE_IMPL", "direct")
    a = depthwise_conv2d(x, wt, b, s, p, d)
    monkeypatch.setenv("CUDADOCTOR_OPS_DEPTHWISE_IMPL", "bogus")
    with pytest.raises(ValueError, match="impl"):
        depthwise_conv2d(x, wt, b, s, p, d)
    monkeypatch.delenv("CUDADOCTOR_OPS_DEPTHWISE_IMPL")
    torch.testing.assert_close(a, depthwise_conv2d(x, wt, b, s, p, d), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_weight_grad_is_deterministic(layout):
    case = (4, 32, 64, 64, 1, (3, 3), 1, 1, 1)
    x, wt, b, s, p, d = _make(case, torch.float32, layout, requires_grad=True)
    g = torch.randn(4, 32, 64, 64, device=DEV)
    grads = []
    for _ in range(2):
        wt.grad = None
        depthwise_conv2d(x, wt, b, s, p, d).backward(g)
        grads.append(wt.grad.clone())
    assert torch.equal(grads[0], grads[1])


def test_empty_batch():
    x = torch.randn(0, 8, 10, 10, device=DEV, requires_grad=True)
    w = torch.randn(8, 1, 3, 3, device=DEV, requires_grad=True)
    b = torch.randn(8, device=DEV, requires_grad=True)
    out = depthwise_conv2d(x, w, b, 1, 1)
    assert out.shape == (0, 8, 10, 10)
    out.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w))
    assert torch.equal(b.grad, torch.zeros_like(b))


def test_large_activation_values():
    # Per-channel reductions in float32 over many positions stay accurate.
    case = (8, 16, 64, 64, 1, (3, 3), 1, 1, 1)
    x, wt, b, s, p, d = _make(case, torch.float32, "nchw", requires_grad=True)
    with torch.no_grad():
        x.mul_(100).add_(1000)
    out = depthwise_conv2d(x, wt, b, s, p, d)
    xd, wd, bd, ref = _ref(x, wt, b, s, p, d)
    assert _rel_err(out, ref) < 2e-5
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g.double())
    assert _rel_err(wt.grad, wd.grad) < 5e-5
    assert _rel_err(x.grad, xd.grad) < 2e-5


def test_gradcheck_double():
    for case, impl in [((2, 3, 7, 6, 1, (3, 3), 1, 1, 1), "auto"),
                       ((1, 2, 8, 7, 2, (3, 2), 2, 2, 2), "direct")]:
        x, wt, b, s, p, d = _make(case, torch.float64, "nchw", requires_grad=True)
        assert torch.autograd.gradcheck(
            lambda x, w, b: depthwise_conv2d(x, w, b, s, p, d, impl=impl), (x, wt, b)
        )


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[9], CASES[14]], ids=_case_id)
def test_opcheck(case, layout):
    x, wt, b, s, p, d = _make(case, torch.float32, layout, requires_grad=True)
    sp, pp, dp = ([v, v] if isinstance(v, int) else list(v) for v in (s, p, d))
    torch.library.opcheck(ops.depthwise_conv2d.default, (x, wt, b, sp, pp, dp, 0))
    torch.library.opcheck(ops.depthwise_conv2d.default, (x, wt, None, sp, pp, dp, 1))
    out = ops.depthwise_conv2d(x.detach(), wt.detach(), None, sp, pp, dp, 0)
    g = torch.randn_like(out)
    xd, wd = x.detach(), wt.detach()
    torch.library.opcheck(ops.depthwise_conv2d_backward_input.default, (g, xd, wd, sp, pp, dp, 0))
    torch.library.opcheck(
        ops.depthwise_conv2d_backward_weight.default, (g, xd, wd, sp, pp, dp, True, 0)
    )


class _Block(torch.nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.dw = DepthwiseConv2d(c, c, 3, stride=1, padding=1)
        self.pw = torch.nn.Conv2d(c, c, 1)
        self.dw2 = DepthwiseConv2d(c, c, 5, stride=2, padding=2, bias=False)

    def forward(self, x):
        return self.dw2(torch.relu(self.pw(self.dw(x))))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_torch_compile_fullgraph(layout):
    torch.manual_seed(0)
    model = _Block(16).to(DEV)
    x = torch.randn(2, 16, 20, 20, device=DEV)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    eager = model(x)
    compiled = torch.compile(model, fullgraph=True)
    got = compiled(x)
    torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)
    got.sum().backward()
    gw = model.dw.weight.grad.clone()
    model.zero_grad()
    model(x).sum().backward()
    torch.testing.assert_close(gw, model.dw.weight.grad, rtol=1e-4, atol=1e-4)


def test_module_matches_conv2d_and_state_dict():
    torch.manual_seed(0)
    ref = torch.nn.Conv2d(12, 24, 3, stride=2, padding=1, groups=12).to(DEV)
    mod = DepthwiseConv2d(12, 24, 3, stride=2, padding=1).to(DEV)
    assert set(mod.state_dict()) == set(ref.state_dict())
    mod.load_state_dict(ref.state_dict())
    ref.load_state_dict(mod.state_dict())
    assert isinstance(mod, torch.nn.Conv2d) and mod.groups == 12
    x = torch.randn(3, 12, 15, 17, device=DEV)
    torch.testing.assert_close(mod(x), ref(x), rtol=1e-4, atol=1e-4)
    same = DepthwiseConv2d(8, kernel_size=5, padding="same").to(DEV)
    xs = torch.randn(1, 8, 9, 9, device=DEV)
    assert same(xs).shape == xs.shape
    torch.testing.assert_close(same(xs), F.conv2d(xs, same.weight, same.bias, 1, 2, 1, 8),
                               rtol=1e-4, atol=1e-4)
    # Other devices fall back to nn.Conv2d.forward.
    cpu = DepthwiseConv2d(4, 4, 3, padding=1)
    assert cpu(torch.randn(1, 4, 5, 5)).shape == (1, 4, 5, 5)
    with pytest.raises(ValueError, match="groups"):
        DepthwiseConv2d(4, 4, 3, groups=2)
    with pytest.raises(ValueError, match="multiple"):
        DepthwiseConv2d(4, 6, 3)


def test_bad_arguments_raise_clear_errors():
    x = torch.randn(2, 4, 8, 8, device=DEV)
    w = torch.randn(4, 1, 3, 3, device=DEV)
    with pytest.raises(RuntimeError, match=r"weight must have shape \[C\*multiplier, 1, kh, kw\]"):
        depthwise_conv2d(x, torch.randn(4, 2, 3, 3, device=DEV))
    with pytest.raises(RuntimeError, match="weight must have shape"):
        depthwise_conv2d(x, torch.randn(6, 1, 3, 3, device=DEV))
    with pytest.raises(RuntimeError, match="weight must have shape"):
        depthwise_conv2d(x, torch.randn(4, 3, 3, device=DEV))
    with pytest.raises(RuntimeError, match="padding must be non-negative"):
        depthwise_conv2d(x, w, padding=-1)
    with pytest.raises(RuntimeError, match="stride must be positive"):
        depthwise_conv2d(x, w, stride=0)
    with pytest.raises(RuntimeError, match="dilation must be positive"):
        depthwise_conv2d(x, w, dilation=(1, 0))
    with pytest.raises(RuntimeError, match="weight dtype .* does not match input dtype"):
        depthwise_conv2d(x, w.half())
    with pytest.raises(RuntimeError, match="bias dtype"):
        depthwise_conv2d(x, w, torch.randn(4, device=DEV, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"bias must have shape \[4\]"):
        depthwise_conv2d(x, w, torch.randn(5, device=DEV))
    with pytest.raises(RuntimeError, match="must be a CUDA tensor"):
        depthwise_conv2d(x.cpu(), w.cpu())
    with pytest.raises(RuntimeError, match="weight is on cpu"):
        depthwise_conv2d(x, w.cpu())
    with pytest.raises(RuntimeError, match="input must be 4-D"):
        depthwise_conv2d(x[0], w)
    with pytest.raises(RuntimeError, match="smaller than the dilated kernel"):
        depthwise_conv2d(torch.randn(1, 4, 2, 2, device=DEV), w)
    with pytest.raises(TypeError, match="stride"):
        depthwise_conv2d(x, w, stride=(1, 2, 3))
    with pytest.raises(TypeError, match="depthwise_conv2d: padding must be an int or a pair of ints"):
        depthwise_conv2d(x, w, padding=1.5)
    with pytest.raises(RuntimeError, match="input dtype must be"):
        depthwise_conv2d(x.int(), w.int())


# ---- forward kernels: current ("auto"), previous ("tiled_v1") and direct ------------------------

# (N, C, H, W, k, stride, padding): fast-path forward cases (multiplier 1, dilation 1). The NCHW
# kernels load 16-byte chunks of a row when W is a multiple of 16 / element size (4 for float32,
# 8 for 16-bit types) and single elements otherwise; both are covered for every dtype.
FWD_FAST_CASES = [
    (2, 16, 16, 16, 3, 1, 1),  # W % 8 == 0: chunk loads for every dtype
    (2, 16, 17, 20, 3, 2, 1),  # W % 4 == 0, W % 8 != 0: chunk loads for float32 only
    (1, 8, 33, 35, 5, 1, 2),  # odd sizes: element loads
    (3, 8, 21, 24, 5, 2, 2),  # stride 2, odd H
    (2, 8, 20, 18, 7, 1, 3),  # W % 4 != 0
    (2, 8, 15, 29, 7, 2, 3),  # odd, stride 2
    (1, 8, 130, 136, 3, 1, 1),  # several tiles across H and W
    (1, 8, 70, 66, 5, 2, 2),  # several tiles, stride 2, W % 4 != 0
    (2, 512, 20, 24, 3, 1, 1),  # many planes: tall tiles (8 rows per thread)
    (1, 1024, 9, 13, 5, 2, 2),  # tall tiles, odd sizes, stride 2
    (1, 8, 40, 40, 7, 1, 3),  # 7x7 on a wider image
    (2, 16, 16, 16, 3, 1, 3),  # padding wider than half the kernel
    (2, 8, 2, 3, 3, 1, 1),  # tiny H and W
    (1, 8, 1, 1, 3, 1, 1),  # 1x1 input
    (2, 8, 4, 3, 7, 2, 3),  # H and W smaller than the kernel, stride 2
    (1, 8, 3, 9, 5, 1, 2),  # H smaller than the kernel
    (1, 12, 9, 10, 3, 1, 1),  # C % 8 != 0: 16-bit channels_last takes the 4-channel kernels
    (1, 6, 9, 9, 3, 2, 1),  # C % 4 != 0: channels_last takes the direct kernel
    # stride 1, W % 4 == 0, every padding mod 4 for each fast kernel size: the float32 kernel's
    # window offsets 0..3 in its 16-byte staged rows ((-padding) mod 4)
    (2, 8, 12, 16, 3, 1, 0),
    (2, 8, 12, 16, 3, 1, 2),
    (1, 8, 20, 20, 5, 1, 0),
    (1, 8, 20, 24, 5, 1, 1),
    (1, 8, 20, 24, 5, 1, 2),
    (1, 8, 20, 24, 5, 1, 3),
    (1, 8, 20, 20, 7, 1, 0),
    (1, 8, 20, 20, 7, 1, 2),
    (1, 8, 20, 20, 7, 1, 5),
    # rows of three 128-column warp segments, the last one partly outside (fwd_nchw_shfl)
    (1, 8, 9, 260, 3, 1, 1),
    (1, 8, 11, 260, 5, 1, 2),
]

FWD_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _fwd_id(case) -> str:
    n, c, h, w, k, s, p = case
    return f"{n}x{c}x{h}x{w}-k{k}-s{s}-p{p}"


def _fwd_make(case, dtype, layout, seed=1):
    n, c, h, w, k, s, p = case
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(n, c, h, w, device=DEV, generator=g).to(dtype)
    wt = torch.randn(c, 1, k, k, device=DEV, generator=g).to(dtype)
    b = torch.randn(c, device=DEV, generator=g).to(dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    return x, wt, b, s, p


def _check_forward_impls(x, wt, b, s, p):
    """auto, tiled_v1 and direct against float64, and auto against direct."""
    dtype = x.dtype
    ref = F.conv2d(x.double(), wt.double(), b.double(), s, p, 1, groups=x.shape[1])
    outs = {impl: depthwise_conv2d(x, wt, b, s, p, impl=impl)
            for impl in ("auto", "tiled_v1", "direct")}
    for impl, out in outs.items():
        assert out.shape == ref.shape and out.dtype == dtype, impl
        if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
            assert out.is_contiguous(memory_format=torch.channels_last), impl
        assert _rel_err(out, ref) < FWD_TOL[dtype], f"{impl} vs float64"
    # Same float32 accumulation, different order: agree to about one rounding of the dtype.
    torch.testing.assert_close(outs["auto"].float(), outs["direct"].float(),
                               rtol=FWD_TOL[dtype], atol=FWD_TOL[dtype] * ref.abs().max().item())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", FWD_FAST_CASES, ids=_fwd_id)
def test_forward_kernels_match_float64_and_direct(case, dtype, layout):
    _check_forward_impls(*_fwd_make(case, dtype, layout))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_misaligned_data_pointer(dtype, layout):
    # A view one element into its storage: the data pointer is not 16-byte aligned, so the
    # 16-byte paths must step aside (element loads, or the older/direct kernels).
    n, c, h, w = 2, 16, 12, 16
    shape = (n, h, w, c) if layout == "channels_last" else (n, c, h, w)
    buf = torch.randn(n * c * h * w + 1, device=DEV).to(dtype)
    x = buf[1:].view(shape)
    if layout == "channels_last":
        x = x.permute(0, 3, 1, 2)
        assert x.is_contiguous(memory_format=torch.channels_last)
    assert x.data_ptr() % 16 != 0
    g = torch.Generator(device=DEV).manual_seed(2)
    wt = torch.randn(c, 1, 3, 3, device=DEV, generator=g).to(dtype)
    b = torch.randn(c, device=DEV, generator=g).to(dtype)
    for s in (1, 2):
        _check_forward_impls(x, wt, b, s, 1)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_empty_batch_every_impl(dtype, layout):
    x = torch.randn(0, 16, 12, 12, device=DEV).to(dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    wt = torch.randn(16, 1, 3, 3, device=DEV).to(dtype)
    for impl in ("auto", "tiled_v1", "direct"):
        out = depthwise_conv2d(x, wt, None, 2, 1, impl=impl)
        assert out.shape == (0, 16, 6, 6) and out.dtype == dtype


def test_impl_names():
    x, wt, b, s, p = _fwd_make(FWD_FAST_CASES[0], torch.float32, "nchw")
    ref = depthwise_conv2d(x, wt, b, s, p, impl="direct")
    for impl in ("auto", "tiled_v1"):
        torch.testing.assert_close(depthwise_conv2d(x, wt, b, s, p, impl=impl), ref,
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="tiled_v1"):
        depthwise_conv2d(x, wt, b, s, p, impl="tiled_v2")
    # The compiled op's own check of an unknown impl code runs in a child process (see
    # test_compiled_op_bad_arguments_raise_runtime_error_in_subprocess).


# ---- channels_last forward, third generation --------------------------------------------------
# "auto" runs the third-generation channels_last kernel (input tiles staged in shared memory with
# cp.async) for float16/bfloat16 when C % 8 == 0 and input and output are 16-byte aligned, and
# otherwise falls back to the second-/first-generation kernels or the direct kernel. "nhwc_v3",
# where this build names it, asks for that kernel explicitly (float32 included) with the same
# fallbacks.

from cudadoctor_ops import depthwise as _dw_module  # noqa: E402

V3_IMPLS = ["auto"] + (["nhwc_v3"] if "nhwc_v3" in _dw_module._IMPLS else [])
V3_DTYPES = [torch.float16, torch.bfloat16, torch.float32]
V3_KS = [(3, 1), (3, 2), (5, 1), (5, 2), (7, 1), (7, 2)]
# Odd sizes, square, 1x1 (channels_last and contiguous at once: the NCHW path), one row, H smaller
# than the kernel, and a width of two column tiles.
V3_HW = [(13, 17), (7, 7), (1, 1), (1, 5), (3, 9), (9, 70)]
# 12 is not a multiple of 8: the 16-byte kernels step aside (4-channel kernel).
V3_C = [8, 16, 24, 144, 12]


def _v3_check(x, wt, b, s, p, impls=None):
    """Every impl in `impls` (default V3_IMPLS) against F.conv2d in float64."""
    ref = F.conv2d(x.double(), wt.double(), None if b is None else b.double(), s, p, 1,
                   groups=x.shape[1])
    for impl in impls or V3_IMPLS:
        out = depthwise_conv2d(x, wt, b, s, p, impl=impl)
        assert out.shape == ref.shape and out.dtype == x.dtype, impl
        if not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
            assert out.is_contiguous(memory_format=torch.channels_last), impl
        err = _rel_err(out, ref)
        assert err < FWD_TOL[x.dtype], f"{impl}: relative error {err:.2e} against float64"


def _v3_tensors(n, c, h, w, k, dtype, bias, seed=3):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(n, c, h, w, device=DEV, generator=g).to(dtype)
    x = x.contiguous(memory_format=torch.channels_last)
    wt = torch.randn(c, 1, k, k, device=DEV, generator=g).to(dtype)
    b = torch.randn(c, device=DEV, generator=g).to(dtype) if bias else None
    return x, wt, b


@pytest.mark.parametrize("c", V3_C)
@pytest.mark.parametrize("hw", V3_HW, ids=lambda hw: f"{hw[0]}x{hw[1]}")
@pytest.mark.parametrize("ks", V3_KS, ids=lambda ks: f"k{ks[0]}s{ks[1]}")
@pytest.mark.parametrize("dtype", V3_DTYPES, ids=str)
def test_nhwc_v3_forward_matches_float64(dtype, ks, hw, c):
    k, s = ks
    h, w = hw
    for n in (1, 3):
        for bias in (True, False):
            x, wt, b = _v3_tensors(n, c, h, w, k, dtype, bias)
            _v3_check(x, wt, b, s, k // 2)


# Shapes whose tiles hold several bands of rows (several cp.async commit groups per block), and
# two MobileNetV2 / EfficientNet-B0 layers at batch 64.
V3_LARGE = [
    (8, 96, 112, 115, 3, 1),
    (16, 96, 112, 115, 3, 2),
    (8, 96, 112, 115, 5, 1),
    (32, 24, 112, 115, 7, 1),
    (2, 144, 56, 56, 5, 2),
    (64, 144, 56, 56, 3, 1),
    (64, 240, 28, 28, 5, 1),
]


@pytest.mark.parametrize("case", V3_LARGE, ids=lambda t: "{}x{}x{}x{}-k{}-s{}".format(*t))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_nhwc_v3_forward_large_tiles(dtype, case):
    n, c, h, w, k, s = case
    x, wt, b = _v3_tensors(n, c, h, w, k, dtype, bias=True)
    _v3_check(x, wt, b, s, k // 2)


@pytest.mark.parametrize("offset", [1, 4, 8])  # elements: 2, 8 and 16 bytes for 16-bit types
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_nhwc_v3_forward_storage_offset(dtype, offset):
    # A channels_last view at a storage offset: only the 16-byte multiple keeps the 16-byte paths.
    n, c, h, w = 2, 16, 11, 13
    buf = torch.randn(n * c * h * w + offset, device=DEV).to(dtype)
    x = torch.as_strided(buf, (n, c, h, w), (h * w * c, 1, w * c, c), offset)
    assert x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    assert (x.data_ptr() % 16 == 0) == (offset * x.element_size() % 16 == 0)
    g = torch.Generator(device=DEV).manual_seed(4)
    for k, s in ((3, 1), (3, 2), (5, 1), (7, 2)):
        wt = torch.randn(c, 1, k, k, device=DEV, generator=g).to(dtype)
        b = torch.randn(c, device=DEV, generator=g).to(dtype)
        _v3_check(x, wt, b, s, k // 2, impls=V3_IMPLS + ["tiled_v1", "direct"])


def _cuda_kernel_names(fn) -> list[str]:
    """Names of the events (CUDA kernels among them) the profiler records while fn runs."""
    from torch.profiler import ProfilerActivity, profile

    fn()  # errors of fn itself surface here, outside the profiler
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return [e.key for e in prof.key_averages()]
    except (RuntimeError, AssertionError) as exc:  # profiler unavailable in this environment
        pytest.skip(f"torch.profiler could not record CUDA kernels: {exc}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_auto_channels_last_forward_kernel_policy(dtype):
    """impl=auto on channels_last: nhwc_v4 for 16-bit types wherever it applies (C % 8 == 0,
    16-byte aligned), unless CUDADOCTOR_OPS_DW_V4=0 in this process, which gives the previous
    policy: nhwc_v3 on the shapes where it beat v2. Never a 16-byte kernel on unaligned data."""
    v4_on = os.environ.get("CUDADOCTOR_OPS_DW_V4", "") != "0"
    fast = "fwd_nhwc_v4" if v4_on else "fwd_nhwc_v3"

    def names(c, offset=0, hw=28, k=3, stride=1):
        buf = torch.randn(2 * c * hw * hw + offset, device=DEV).to(dtype)
        x = torch.as_strided(buf, (2, c, hw, hw), (hw * hw * c, 1, hw * c, c), offset)
        wt = torch.randn(c, 1, k, k, device=DEV).to(dtype)
        return _cuda_kernel_names(lambda: depthwise_conv2d(x, wt, None, stride, k // 2))

    got = names(16)
    if not any("fwd" in n for n in got):
        pytest.skip(f"the profiler recorded no forward kernel (kernels seen: {got})")
    assert any(fast in n for n in got) == (dtype != torch.float32), got
    # C % 8 != 0 and a 2-byte offset: never the 16-byte kernels.
    for c, offset in ((12, 0), (16, 1)):
        got = names(c, offset)
        assert not any("fwd_nhwc_v3" in n or "fwd_nhwc_v4" in n for n in got), (c, offset, got)
    if v4_on:
        for hw, k, stride in ((14, 3, 1), (28, 3, 2), (14, 5, 1), (9, 7, 2)):
            got = names(16, hw=hw, k=k, stride=stride)
            assert any("fwd_nhwc_v4" in n for n in got) == (dtype != torch.float32), (hw, k, stride, got)
        return
    # the shapes where the second-generation kernel was faster: 3x3 on 14x14, 3x3 at stride 2
    for hw, k, stride in ((14, 3, 1), (28, 3, 2)):
        got = names(16, hw=hw, k=k, stride=stride)
        assert not any("fwd_nhwc_v3" in n for n in got), (hw, k, stride, got)
    if dtype != torch.float32:
        assert any("fwd_nhwc_v3" in n for n in names(16, hw=14, k=5)), "5x5 on 14x14 runs nhwc_v3"


# ---- errors raised by the compiled op itself (no Python-side checks in front) -----------------

# Runs in a child process: a crash there (a signal) must fail this test, not kill pytest. Each
# entry calls torch.ops.cudadoctor_ops.<op> directly with one bad argument and expects a
# RuntimeError whose message contains the given text.
_RAW_OP_ERRORS_SCRIPT = r"""
import sys
import torch
import cudadoctor_ops  # noqa: F401  (registers the ops)

ops = torch.ops.cudadoctor_ops
x = torch.randn(2, 4, 8, 8, device="cuda")
w = torch.randn(4, 1, 3, 3, device="cuda")
g = torch.randn(2, 4, 8, 8, device="cuda")
one, pad = [1, 1], [1, 1]
cases = [
    ("weight [4,2,3,3]", "weight must have shape",
     lambda: ops.depthwise_conv2d(x, torch.randn(4, 2, 3, 3, device="cuda"), None, one, pad, one)),
    ("weight [6,1,3,3]", "weight must have shape",
     lambda: ops.depthwise_conv2d(x, torch.randn(6, 1, 3, 3, device="cuda"), None, one, pad, one)),
    ("negative padding", "padding must be non-negative",
     lambda: ops.depthwise_conv2d(x, w, None, one, [-1, 1], one)),
    ("zero stride", "stride must be positive",
     lambda: ops.depthwise_conv2d(x, w, None, [0, 1], pad, one)),
    ("dtype mismatch", "does not match input dtype",
     lambda: ops.depthwise_conv2d(x, w.half(), None, one, pad, one)),
    ("bias shape", "bias must have shape",
     lambda: ops.depthwise_conv2d(x, w, torch.randn(5, device="cuda"), one, pad, one)),
    ("3-D input", "input must be 4-D",
     lambda: ops.depthwise_conv2d(x[0], w, None, one, pad, one)),
    ("bad impl", "impl must be",
     lambda: ops.depthwise_conv2d(x, w, None, one, pad, one, 9)),
    ("grad_output shape", "grad_output must have sizes",
     lambda: ops.depthwise_conv2d_backward_input(g[:, :2], x, w, one, pad, one)),
    ("grad_output shape (weight)", "grad_output must have sizes",
     lambda: ops.depthwise_conv2d_backward_weight(g[:1], x, w, one, pad, one, True)),
]
failed = 0
for name, text, fn in cases:
    try:
        fn()
        torch.cuda.synchronize()
    except RuntimeError as exc:
        msg = str(exc)
        if text in msg:
            print(f"ok: {name}: RuntimeError", flush=True)
        else:
            failed += 1
            print(f"WRONG MESSAGE: {name}: {msg.splitlines()[0] if msg else msg!r}", flush=True)
    else:
        failed += 1
        print(f"NO ERROR: {name}", flush=True)
sys.exit(1 if failed else 0)
"""


# A C++ exception raised by torch itself (no cudadoctor_ops code on the stack), before and after
# the extension is loaded: tells a crash of the process-wide unwinding (the loaded shared object's
# unwind data) apart from one in the op's own code path.
_TORCH_ERROR_SCRIPT = r"""
import sys
import torch
if sys.argv[1] == "with_ops":
    import cudadoctor_ops  # noqa: F401
try:
    torch.empty(2, device="cuda").view(3)
except RuntimeError as exc:
    print("ok: torch RuntimeError:", str(exc).splitlines()[0], flush=True)
"""


def _run_child(code: str, *args: str):
    import os
    import pathlib
    import subprocess
    import sys

    pkg_parent = str(pathlib.Path(cudadoctor_ops.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = pkg_parent + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code, *args],
                          capture_output=True, text=True, timeout=300, env=env)
    report = f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr (tail):\n{proc.stderr[-3000:]}"
    return proc, report


@pytest.mark.parametrize("mode", ["without_ops", "with_ops"])
def test_torch_cpp_exception_survives_in_subprocess(mode):
    proc, report = _run_child(_TORCH_ERROR_SCRIPT, mode)
    assert proc.returncode >= 0, f"child killed by signal {-proc.returncode} ({mode}):\n{report}"
    assert proc.returncode == 0 and "ok: torch RuntimeError" in proc.stdout, report


_CXX_RUNTIME_SYMBOLS = ("__cxa_throw", "__gxx_personality_v0", "_Unwind_RaiseException",
                        "_Unwind_Find_FDE")


def _extension_so():
    import pathlib

    found = sorted(pathlib.Path(cudadoctor_ops.__file__).parent.glob("_C*.so"))
    return found[0] if found else None


def _elf_facts(path) -> tuple[bool, list[str]]:
    """(has a PT_GNU_EH_FRAME segment, C++ runtime symbols the object itself defines).

    An extension linked with its own copy of libstdc++/libgcc (static runtime) defines
    __cxa_throw / __gxx_personality_v0 / the unwinder; exceptions then cross two C++ runtimes
    (torch's throws, the extension's frames are unwound by another copy), which ends the process
    instead of raising.
    """
    import struct

    data = path.read_bytes()
    phoff = struct.unpack_from("<Q", data, 0x20)[0]
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    types = {struct.unpack_from("<I", data, phoff + i * phentsize)[0] for i in range(phnum)}
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    wanted = {n.encode() for n in _CXX_RUNTIME_SYMBOLS}
    defined = set()
    for _name, typ, _flags, _addr, off, size, link, _info, _align, entsize in secs:
        if typ != 11 or not entsize:  # SHT_DYNSYM
            continue
        stroff = secs[link][4]
        for k in range(size // entsize):
            st_name, _st_info, _st_other, st_shndx, _value, _size = struct.unpack_from(
                "<IBBHQQ", data, off + k * entsize)
            start = stroff + st_name
            sym = data[start:data.index(b"\0", start)]
            if sym in wanted and st_shndx != 0:
                defined.add(sym.decode())
    return 0x6474E550 in types, sorted(defined)


def _unwind_facts() -> str:
    """Facts about the extension's unwind data and C++ runtime, for the message of a crash."""
    import pathlib

    so = _extension_so()
    if so is None:
        return "extension shared object not found"
    eh, defined = _elf_facts(so)
    facts = [f"{so.name}: PT_GNU_EH_FRAME {'present' if eh else 'MISSING'}",
             f"defines C++ runtime symbols: {defined or 'none'}"]
    try:
        maps = pathlib.Path("/proc/self/maps").read_text()
        libs = sorted({line.split()[-1] for line in maps.splitlines()
                       if "libstdc++" in line or "libgcc_s" in line})
        facts.append("loaded: " + ", ".join(libs))
    except OSError:
        pass
    return "; ".join(facts)


def test_extension_uses_the_process_cpp_runtime():
    # A C++ exception from the ops must be unwound by the same libstdc++/libgcc_s that torch uses:
    # the extension must import __cxa_throw, the personality routine and the unwinder, not carry
    # copies of them (as a toolchain that links its runtime statically produces).
    so = _extension_so()
    if so is None:
        pytest.skip("no _C*.so next to cudadoctor_ops (installed differently)")
    eh, defined = _elf_facts(so)
    assert eh, f"{so} has no PT_GNU_EH_FRAME segment: the unwinder cannot find its frames"
    assert not defined, (
        f"{so} defines its own C++ runtime symbols {defined}: it was linked with a static "
        "libstdc++/libgcc (check the host compiler's link: CUDAHOSTCXX / CXX, -static-libstdc++, "
        "-static-libgcc), so exceptions raised through it crash the process"
    )


def test_compiled_op_bad_arguments_raise_runtime_error_in_subprocess():
    proc, report = _run_child(_RAW_OP_ERRORS_SCRIPT)
    assert proc.returncode >= 0, (
        f"child killed by signal {-proc.returncode}:\n{report}\nunwind facts: {_unwind_facts()}"
    )
    assert proc.returncode == 0, report
    assert proc.stdout.count("ok: ") == 10, report


# ---- channels_last forward, fourth generation ---------------------------------------------------
# "nhwc_v4" runs the fourth-generation channels_last kernel (a direct kernel: 8 channels x RW
# outputs along W per thread, input read straight from global memory, weights staged in shared
# memory) for float16/bfloat16 where it applies (C % 8 == 0, 16-byte aligned input and output),
# else the second-generation kernel; "auto" tries it first for those dtypes (unless
# CUDADOCTOR_OPS_DW_V4=0), also in the stride-1 input gradient (the forward kernel on the flipped
# filter). Its block shape and outputs per thread come from CUDADOCTOR_OPS_DW_V4_CFG=0..4, read
# once per process: the in-process tests below check the configuration of this process (0 unless
# the variable is set), and one child process per configuration runs the same checks.

V4_AVAILABLE = "nhwc_v4" in _dw_module._IMPLS
V4_DTYPES = [torch.float16, torch.bfloat16]
V4_KS = [(3, 1), (3, 2), (5, 1), (5, 2), (7, 1), (7, 2)]
# Odd sizes, 3x3 / 5x5 (a 1x1 output plane at padding 0), one row, H smaller than the kernel, a
# row wider than one block's patch. A 1x1 input plane is contiguous as well as channels_last,
# so it takes the NCHW path (checked for the result only).
V4_HW = [(7, 9), (13, 13), (3, 3), (5, 5), (1, 5), (3, 9), (14, 14), (9, 23), (1, 1)]
# 200 channels = 25 vectors: not a multiple of the block's channel chunk.
V4_C = [8, 24, 72, 200]
# MobileNetV2 / EfficientNet-B0 layers at batch 2: several channel chunks and tiles per image.
V4_LARGE = [
    (2, 32, 112, 112, 3, 1),
    (2, 96, 112, 112, 3, 2),
    (2, 144, 56, 56, 3, 1),
    (2, 144, 56, 56, 5, 2),
    (2, 240, 28, 28, 5, 1),
    (2, 672, 14, 14, 5, 1),
    (2, 672, 14, 14, 5, 2),
    (2, 960, 7, 7, 3, 1),
    (2, 1152, 7, 7, 5, 1),
]
# (k, h, w, c) of the input-gradient checks; every padding in 0 .. k (k: a negative padding for
# the flipped-filter forward) that the input admits.
V4_BWD = [(3, 13, 11, 24), (5, 9, 14, 72), (7, 12, 10, 16), (3, 1, 6, 8), (5, 14, 14, 200)]
V4_GRAD_TOL = {torch.float16: 4e-3, torch.bfloat16: 2.5e-2}


def _v4_pads(k, h, w):
    return [p for p in sorted({0, k // 2, k - 1}) if h + 2 * p >= k and w + 2 * p >= k]


def _v4_rw(k, s, cfg):
    """Outputs per thread along W of configuration cfg (mirrors V4Rw in depthwise_fwd_v4.cu)."""
    small = s == 1 and k <= 5
    if cfg == 5 and k == 3 and s == 1:
        return 7
    if cfg == 4:
        return 7 if s == 1 else _v4_rw(k, s, 1)
    if cfg == 1:
        return 4 if small else 2
    if cfg == 3:
        return (8 if k == 3 else 4) if s == 1 else (4 if k <= 5 else 2)
    return 2 if small else 1


def _v4_auto_cfg(k, s, wo):
    """The configuration nhwc_v4 picks without CUDADOCTOR_OPS_DW_V4_CFG (mirrors v4_auto_cfg)."""
    if s == 1 and k == 3 and wo == 7:
        return 5
    if s == 1 and k <= 5 and wo % 7 == 0 and 14 <= wo <= 28:
        return 4
    if k == 3 and wo >= 14:
        return 3
    if k == 5 and s == 2:
        return 3
    return 1


def _v4_env_cfg():
    """CUDADOCTOR_OPS_DW_V4_CFG of this process, or None (choose by shape)."""
    v = os.environ.get("CUDADOCTOR_OPS_DW_V4_CFG", "")
    return int(v) if v in ("0", "1", "2", "3", "4", "5") else None


def _v4_hoist(k, s, wo):
    """Whether nhwc_v4 loads a thread's first kernel row before the weight barrier: forced by
    CUDADOCTOR_OPS_DW_V4_HOIST=0 / 1 in this process, else by shape (mirrors v4_auto_hoist)."""
    v = os.environ.get("CUDADOCTOR_OPS_DW_V4_HOIST", "")
    if v in ("0", "1"):
        return v == "1"
    return k <= 5 and (s == 2 or (k == 3 and wo >= 56))


def _v4_kernel_tag(dtype, k, s, cfg, wo):
    """The template arguments of the fwd_nhwc_v4 instantiation that configuration cfg runs for
    output rows of wo pixels."""
    t = "c10::Half" if dtype == torch.float16 else "c10::BFloat16"
    if cfg == 5 and not (k == 3 and s == 1):
        cfg = _v4_auto_cfg(k, s, wo)  # configuration 5 is 3x3 stride 1 only
    if cfg == 4 and s != 1:
        cfg = 1  # configuration 4 is 1 at stride 2
    nt, minb = {0: (128, 8), 1: (128, 5), 2: (256, 4), 3: (128, 3), 4: (128, 3), 5: (256, 2)}[cfg]
    hoist = "true" if _v4_hoist(k, s, wo) else "false"
    return f"fwd_nhwc_v4<{t}, {k}, {s}, {_v4_rw(k, s, cfg)}, {nt}, {minb}, {hoist}>"


def _v4_forward_errors(dtype, k, s, h, w, c, n=2, pads=None, impls=("nhwc_v4", "auto"), seed=7):
    """Forward of every impl in `impls` against F.conv2d in float64; returns the failures."""
    errs = []
    for p in _v4_pads(k, h, w) if pads is None else pads:
        for bias in (True, False):
            x, wt, b = _v3_tensors(n, c, h, w, k, dtype, bias, seed=seed + p)
            ref = F.conv2d(x.double(), wt.double(), None if b is None else b.double(), s, p, 1,
                           groups=c)
            for impl in impls:
                tag = f"{impl} {dtype} {(n, c, h, w)} k{k} s{s} p{p} bias={bias}"
                out = depthwise_conv2d(x, wt, b, s, p, impl=impl)
                if out.shape != ref.shape or out.dtype != dtype:
                    errs.append(f"{tag}: shape {tuple(out.shape)} {out.dtype}")
                    continue
                if not x.is_contiguous() and not out.is_contiguous(
                        memory_format=torch.channels_last):
                    errs.append(f"{tag}: output not channels_last")
                err = _rel_err(out, ref)
                if not err < FWD_TOL[dtype]:
                    errs.append(f"{tag}: relative error {err:.2e} against float64")
    return errs


def _v4_backward_errors(dtype, k, h, w, c, n=2, seed=11):
    """Input gradient through impl=auto (stride 1: the forward kernel on the flipped filter)
    against float64 autograd, every padding 0 .. k; returns the failures."""
    errs = []
    for p in range(k + 1):
        if h + 2 * p < k or w + 2 * p < k:
            continue
        x, wt, b = _v3_tensors(n, c, h, w, k, dtype, True, seed=seed + p)
        for t in (x, wt, b):
            t.requires_grad_(True)
        out = depthwise_conv2d(x, wt, b, 1, p)
        g = torch.randn(out.shape, device=DEV, generator=torch.Generator(device=DEV).manual_seed(p))
        g = g.to(dtype).contiguous(memory_format=torch.channels_last)
        out.backward(g)
        xd, wd, bd, ref = _ref(x, wt, b, 1, p, 1)
        ref.backward(g.double())
        tag = f"grad_input {dtype} {(n, c, h, w)} k{k} p{p}"
        if x.grad is None or x.grad.shape != x.shape:
            errs.append(f"{tag}: missing or misshapen gradient")
            continue
        err = _rel_err(x.grad, xd.grad)
        if not err < V4_GRAD_TOL[dtype]:
            errs.append(f"{tag}: relative error {err:.2e} against float64 autograd")
    return errs


def _v4_sweep():
    """Every forward and input-gradient check of this section; returns the failures."""
    errs = []
    for dtype in V4_DTYPES:
        for k, s in V4_KS:
            for h, w in V4_HW:
                for c in V4_C:
                    errs += _v4_forward_errors(dtype, k, s, h, w, c)
        for n, c, h, w, k, s in V4_LARGE:
            errs += _v4_forward_errors(dtype, k, s, h, w, c, n=n, pads=[k // 2])
        for k, h, w, c in V4_BWD:
            errs += _v4_backward_errors(dtype, k, h, w, c)
    return errs


def _v4_instantiation_failures(kernel_names, label, plane_sizes, cfg=None, hoist=None):
    """For every dtype and (k, stride) of this section on square planes of each size in
    plane_sizes: the fwd_nhwc_v4 instantiation impl="nhwc_v4" should run (configuration cfg, or
    the one chosen by shape), checked against the kernel names the profiler recorded
    (kernel_names(fn), None where the profiler is unavailable). hoist: the first-row hoist the
    expected instantiation must have (True / False), or None for no such check. Returns the
    failures, each prefixed with label."""
    failures = []
    for dtype in V4_DTYPES:
        for k, s in V4_KS:
            for hw in plane_sizes:
                x, wt, b = _v3_tensors(2, 16, hw, hw, k, dtype, True)
                wo = (hw + 2 * (k // 2) - k) // s + 1
                tag = _v4_kernel_tag(dtype, k, s, _v4_auto_cfg(k, s, wo) if cfg is None else cfg, wo)
                if hoist is not None and tag.endswith("true>") != hoist:
                    failures.append(f"{label}: the expected kernel {tag} disagrees with the setting")
                keys = kernel_names(lambda: depthwise_conv2d(x, wt, b, s, k // 2, impl="nhwc_v4"))
                if keys and any("fwd" in key for key in keys) and not any(tag in key for key in keys):
                    failures.append(f"{label}: {tag} did not run; kernels: {keys}")
    return failures


needs_v4 = pytest.mark.skipif(not V4_AVAILABLE, reason="this build has no nhwc_v4 impl")


@needs_v4
@pytest.mark.parametrize("c", V4_C)
@pytest.mark.parametrize("hw", V4_HW, ids=lambda hw: f"{hw[0]}x{hw[1]}")
@pytest.mark.parametrize("ks", V4_KS, ids=lambda ks: f"k{ks[0]}s{ks[1]}")
@pytest.mark.parametrize("dtype", V4_DTYPES, ids=str)
def test_nhwc_v4_forward_matches_float64(dtype, ks, hw, c):
    k, s = ks
    h, w = hw
    errs = _v4_forward_errors(dtype, k, s, h, w, c)
    assert not errs, "\n".join(errs)


@needs_v4
@pytest.mark.parametrize("case", V4_LARGE, ids=lambda t: "{}x{}x{}x{}-k{}-s{}".format(*t))
@pytest.mark.parametrize("dtype", V4_DTYPES, ids=str)
def test_nhwc_v4_forward_large(dtype, case):
    n, c, h, w, k, s = case
    errs = _v4_forward_errors(dtype, k, s, h, w, c, n=n, pads=[k // 2])
    assert not errs, "\n".join(errs)


# Configuration 5 (3x3 stride 1 on rows of 7 outputs by default): block shapes from the wave
# planner, which depend on the batch and the channel count. Network layers at batch 64 and 128,
# and channel counts whose vectors (C / 8) are prime or leave a ragged last chunk.
V4_WAVE = [(64, 1152, 7, 7), (64, 960, 7, 7), (128, 960, 7, 7), (3, 136, 7, 7), (5, 8, 7, 7),
           (64, 392, 7, 7), (1, 2048, 7, 7), (64, 184, 7, 9)]


@needs_v4
@pytest.mark.parametrize("case", V4_WAVE, ids=lambda t: "{}x{}x{}x{}".format(*t))
@pytest.mark.parametrize("dtype", V4_DTYPES, ids=str)
def test_nhwc_v4_wave_planned_layers_match_float64(dtype, case):
    n, c, h, w = case
    errs = _v4_forward_errors(dtype, 3, 1, h, w, c, n=n, pads=[1, 0] if w == 9 else [1])
    errs += _v4_backward_errors(dtype, 3, h, w, c, n=n)
    assert not errs, "\n".join(errs)


@needs_v4
@pytest.mark.parametrize("dtype", V4_DTYPES, ids=str)
def test_nhwc_v4_wave_kernel_runs_on_7x7_planes(dtype):
    """By default (or with CUDADOCTOR_OPS_DW_V4_CFG=5) a 3x3 stride-1 layer with rows of 7 outputs
    whose configuration-1 grid takes more than one wave of blocks (64 x 960 channels: 840 blocks
    of 128 threads, against at most 5 x 132 resident on an H200) runs configuration 5's kernel,
    forward and input gradient; a smaller one (8 x 960: one wave on any GPU of 16 SMs or more) and
    14x14 planes do not, unless configuration 5 is forced."""
    if os.environ.get("CUDADOCTOR_OPS_DW_V4", "") == "0":
        pytest.skip("CUDADOCTOR_OPS_DW_V4=0 keeps impl=auto off nhwc_v4 in this process")
    cfg = _v4_env_cfg()
    x, wt, b = _v3_tensors(64, 960, 7, 7, 3, dtype, True)
    got = _cuda_kernel_names(lambda: depthwise_conv2d(x, wt, b, 1, 1))
    if not any("fwd" in n for n in got):
        pytest.skip(f"the profiler recorded no forward kernel (kernels seen: {got})")
    wave = f"fwd_nhwc_v4<{'c10::Half' if dtype == torch.float16 else 'c10::BFloat16'}, 3, 1, 7, 256, 2,"
    expect = cfg in (None, 5)
    assert any(wave in n for n in got) == expect, (cfg, got)
    xg = x.detach().requires_grad_(True)
    out = depthwise_conv2d(xg, wt, b, 1, 1)
    g = torch.randn_like(out)
    got = _cuda_kernel_names(lambda: torch.autograd.grad(out, xg, g, retain_graph=True))
    assert any(wave in n for n in got) == expect, ("input gradient", cfg, got)
    for shape in ((8, 960, 7, 7), (8, 96, 14, 14)):
        xs, wts, bs = _v3_tensors(*shape, 3, dtype, True)
        got = _cuda_kernel_names(lambda: depthwise_conv2d(xs, wts, bs, 1, 1))  # noqa: B023
        assert any(wave in n for n in got) == (cfg == 5), (shape, cfg, got)


@needs_v4
@pytest.mark.parametrize("case", V4_BWD, ids=lambda t: "k{}-{}x{}-c{}".format(*t))
@pytest.mark.parametrize("dtype", V4_DTYPES, ids=str)
def test_nhwc_v4_input_gradient_through_auto(dtype, case):
    k, h, w, c = case
    errs = _v4_backward_errors(dtype, k, h, w, c)
    assert not errs, "\n".join(errs)


@needs_v4
@pytest.mark.parametrize("dtype", V4_DTYPES, ids=str)
def test_nhwc_v4_unaligned_weight_and_tensors(dtype):
    # A weight one element into its storage: contiguous, but not 16-byte aligned (the kernel
    # stages it element by element). Input / output views at a 2-byte offset: the 16-byte
    # kernels step aside.
    n, c, h, w = 2, 24, 11, 13
    g = torch.Generator(device=DEV).manual_seed(8)
    for k, s in V4_KS:
        buf = torch.randn(c * k * k + 1, device=DEV, generator=g).to(dtype)
        wt = buf[1:].view(c, 1, k, k)
        assert wt.is_contiguous() and wt.data_ptr() % 16 != 0
        b = torch.randn(c, device=DEV, generator=g).to(dtype)
        x = torch.randn(n, c, h, w, device=DEV, generator=g).to(dtype)
        x = x.contiguous(memory_format=torch.channels_last)
        _v3_check(x, wt, b, s, k // 2, impls=["nhwc_v4", "auto"])
        for offset in (1, 8):
            xb = torch.randn(n * c * h * w + offset, device=DEV, generator=g).to(dtype)
            xo = torch.as_strided(xb, (n, c, h, w), (h * w * c, 1, w * c, c), offset)
            _v3_check(xo, wt, b, s, k // 2, impls=["nhwc_v4", "auto"])


@needs_v4
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_nhwc_v4_kernel_runs_where_it_applies(dtype):
    import os

    def names(c, impl, offset=0, k=3, stride=1, backward=False):
        hw = 14
        buf = torch.randn(2 * c * hw * hw + offset, device=DEV).to(dtype)
        x = torch.as_strided(buf, (2, c, hw, hw), (hw * hw * c, 1, hw * c, c), offset)
        wt = torch.randn(c, 1, k, k, device=DEV).to(dtype)
        if not backward:
            return _cuda_kernel_names(lambda: depthwise_conv2d(x, wt, None, stride, k // 2,
                                                               impl=impl))
        # The backward alone (the forward runs outside the profiler).
        x = x.detach().requires_grad_(True)
        out = depthwise_conv2d(x, wt, None, stride, k // 2, impl=impl)
        g = torch.randn_like(out)
        return _cuda_kernel_names(lambda: torch.autograd.grad(out, x, g, retain_graph=True))

    got = names(16, "nhwc_v4")
    if not any("fwd" in n for n in got):
        pytest.skip(f"the profiler recorded no forward kernel (kernels seen: {got})")
    sixteen_bit = dtype != torch.float32
    assert any("fwd_nhwc_v4" in n for n in got) == sixteen_bit, got
    if sixteen_bit:
        cfg = _v4_env_cfg()
        if cfg is None:
            cfg = _v4_auto_cfg(3, 1, 14)  # names() runs 14x14 planes
        tag = _v4_kernel_tag(dtype, 3, 1, cfg, 14)
        assert any(tag in n for n in got), (tag, got)
    # C % 8 != 0 and a 2-byte offset: never the 16-byte kernel.
    for c, offset in ((12, 0), (16, 1)):
        got = names(c, "nhwc_v4", offset)
        assert not any("fwd_nhwc_v4" in n for n in got), (c, offset, got)
    if sixteen_bit and os.environ.get("CUDADOCTOR_OPS_DW_V4") != "0":
        for k, stride in ((3, 1), (3, 2), (5, 1), (7, 2)):
            got = names(16, "auto", k=k, stride=stride)
            assert any("fwd_nhwc_v4" in n for n in got), ("auto", k, stride, got)
        # The stride-1 input gradient runs the forward kernel on the flipped filter.
        got = names(16, "auto", backward=True)
        assert any("fwd_nhwc_v4" in n for n in got), got


# One child process per CUDADOCTOR_OPS_DW_V4_CFG value: the whole sweep above, and a check that
# the kernel of that configuration is the one that runs.
_V4_CHILD_SCRIPT = r"""
import os
import sys

sys.path.insert(0, sys.argv[1])
import torch
import test_depthwise as t


def kernel_names(fn):
    fn()  # errors of fn itself surface here, outside the profiler
    torch.cuda.synchronize()
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return [e.key for e in prof.key_averages()]
    except (RuntimeError, AssertionError) as exc:
        print(f"note: profiler unavailable ({exc}); kernel names not checked", flush=True)
        return None


cfg = int(os.environ["CUDADOCTOR_OPS_DW_V4_CFG"])
failures = t._v4_sweep() + t._v4_instantiation_failures(kernel_names, f"cfg {cfg}", (14,), cfg=cfg)
for f in failures:
    print("FAIL:", f, flush=True)
print(f"done: cfg {cfg}, {len(failures)} failures", flush=True)
sys.exit(1 if failures else 0)
"""

# One child process per CUDADOCTOR_OPS_DW_V4_HOIST value (the configuration chosen by shape): the
# whole sweep, and a check that the kernel with or without the hoisted first row is the one that
# runs, on 14x14 planes (by default without at stride 1, with at stride 2) and 56x56 ones (by
# default with at 3x3).
_V4_HOIST_SCRIPT = _V4_CHILD_SCRIPT[: _V4_CHILD_SCRIPT.index("cfg = int(")] + r"""
hoist = os.environ["CUDADOCTOR_OPS_DW_V4_HOIST"]
failures = t._v4_sweep() + t._v4_instantiation_failures(kernel_names, f"hoist {hoist}", (14, 56),
                                                        hoist=hoist == "1")
for f in failures:
    print("FAIL:", f, flush=True)
print(f"done: hoist {hoist}, {len(failures)} failures", flush=True)
sys.exit(1 if failures else 0)
"""

# With CUDADOCTOR_OPS_DW_V4=0, "auto" must not run the fourth-generation kernel (and stays
# correct); impl="nhwc_v4" still does.
_V4_OFF_SCRIPT = _V4_CHILD_SCRIPT[: _V4_CHILD_SCRIPT.index("cfg = int(")] + r"""
failures = []
for dtype in t.V4_DTYPES:
    failures += t._v4_forward_errors(dtype, 3, 1, 13, 13, 24, impls=("auto",))
    failures += t._v4_backward_errors(dtype, 3, 13, 11, 24)
    x, wt, b = t._v3_tensors(2, 16, 28, 28, 3, dtype, True)
    for impl, expect in (("auto", False), ("nhwc_v4", True)):
        keys = kernel_names(lambda: t.depthwise_conv2d(x, wt, b, 1, 1, impl=impl))
        if keys and any("fwd" in key for key in keys) and (
                any("fwd_nhwc_v4" in key for key in keys) != expect):
            failures.append(f"CUDADOCTOR_OPS_DW_V4=0, impl={impl}: kernels {keys}")
for f in failures:
    print("FAIL:", f, flush=True)
print(f"done: {len(failures)} failures", flush=True)
sys.exit(1 if failures else 0)
"""


def _run_child_env(code: str, env_extra: dict):
    import os
    import pathlib
    import subprocess
    import sys

    pkg_parent = str(pathlib.Path(cudadoctor_ops.__file__).resolve().parents[1])
    env = dict(os.environ)
    env.update(env_extra)
    env["PYTHONPATH"] = pkg_parent + os.pathsep + env.get("PYTHONPATH", "")
    tests_dir = str(pathlib.Path(__file__).resolve().parent)
    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code, tests_dir],
                          capture_output=True, text=True, timeout=900, env=env)
    report = f"rc={proc.returncode}\nstdout:\n{proc.stdout[-6000:]}\nstderr (tail):\n{proc.stderr[-3000:]}"
    return proc, report


@needs_v4
@pytest.mark.parametrize("cfg", [0, 1, 2, 3, 4, 5])
def test_nhwc_v4_every_config_in_subprocess(cfg):
    proc, report = _run_child_env(_V4_CHILD_SCRIPT, {"CUDADOCTOR_OPS_DW_V4_CFG": str(cfg)})
    assert proc.returncode >= 0, f"child killed by signal {-proc.returncode}:\n{report}"
    assert proc.returncode == 0 and f"done: cfg {cfg}, 0 failures" in proc.stdout, report


@needs_v4
@pytest.mark.parametrize("hoist", ["0", "1"])
def test_nhwc_v4_hoist_setting_in_subprocess(hoist):
    proc, report = _run_child_env(_V4_HOIST_SCRIPT, {"CUDADOCTOR_OPS_DW_V4_HOIST": hoist})
    assert proc.returncode >= 0, f"child killed by signal {-proc.returncode}:\n{report}"
    assert proc.returncode == 0 and f"done: hoist {hoist}, 0 failures" in proc.stdout, report


@needs_v4
def test_auto_without_nhwc_v4_in_subprocess():
    proc, report = _run_child_env(_V4_OFF_SCRIPT, {"CUDADOCTOR_OPS_DW_V4": "0"})
    assert proc.returncode >= 0, f"child killed by signal {-proc.returncode}:\n{report}"
    assert proc.returncode == 0 and "done: 0 failures" in proc.stdout, report


# fwd_nchw_v2's staging (the switches are read once per process, hence a child): by default it
# stages aligned float32 tiles with cp.async; CUDADOCTOR_OPS_DW_V2_ASYNC=0 keeps the register
# staging, CUDADOCTOR_OPS_DW_V2_ROWS=8 forces the tall tiles wherever they fit (small images
# included; =4, float32 only, the 4-row tiles), CUDADOCTOR_OPS_DW_V2_LEAN=1 runs the cp.async kernel's LEAN build (filter taps at
# constant offsets, reversed in registers for the input gradient; incremental staging offsets),
# the cp.async kernel runs its stride-1 build with 4 consecutive columns per thread by default
# (16-byte shared loads and stores; the cases cover every window offset 0..3) and
# CUDADOCTOR_OPS_DW_V2_COLV=0 the strided columns. Each setting runs the float32 contiguous forward cases above (chunk copies where
# W % 4 == 0, element loads elsewhere), every forward+backward case (the stride-1 input gradient
# runs the same kernel on the flipped filter) and a misaligned data pointer, against float64.
# The default ("auto") runs 3x3 planes of W % 4 == 0 on fwd_nchw_shfl instead (a warp per 4 output
# rows x 128 columns, no shared memory), so the settings of fwd_nchw_v2 come with
# CUDADOCTOR_OPS_DW_V2_SHFL=0; =2 / 8 run the warp kernel with that many rows, and 5x5 on it too.
_V2_STAGING_SCRIPT = r"""
import os
import sys

sys.path.insert(0, sys.argv[1])
import torch
import test_depthwise as t

print("settings:", {k: v for k, v in os.environ.items() if k.startswith("CUDADOCTOR_OPS_DW_V2_")})
failures = []
checks = [(f"forward {t._fwd_id(c)}", lambda c=c: t.test_forward_kernels_match_float64_and_direct(
    c, torch.float32, "nchw")) for c in t.FWD_FAST_CASES]
checks += [(f"forward+backward {t._case_id(c)}", lambda c=c: t.test_forward_backward_match_float64(
    c, torch.float32, "nchw", "auto")) for c in t.CASES]
checks.append(("misaligned", lambda: t.test_forward_misaligned_data_pointer(torch.float32, "nchw")))
for name, check in checks:
    try:
        check()
    except AssertionError as exc:
        failures.append(f"{name}: {exc}")
# the kernel this setting runs for a 3x3 stride-1 padding-1 aligned float32 plane (16 x 16)
expect = os.environ.get("DW_EXPECT_KERNEL", "")
impl = os.environ.get("DW_EXPECT_IMPL", "auto")
if expect:
    x = torch.randn(2, 16, 16, 16, device="cuda")
    w = torch.randn(16, 1, 3, 3, device="cuda")
    t.depthwise_conv2d(x, w, None, 1, 1, impl=impl)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t.depthwise_conv2d(x, w, None, 1, 1, impl=impl)
        torch.cuda.synchronize()
    keys = [e.key for e in prof.key_averages()]
    if not any(expect in k for k in keys):
        failures.append(f"{expect} did not run; kernels: {keys}")
for f in failures:
    print("FAIL:", f, flush=True)
print(f"done: {len(checks)} checks, {len(failures)} failures", flush=True)
sys.exit(1 if failures else 0)
"""

# (setting, the fwd_nchw_v2 instantiation it runs on the child's 3x3 stride-1 plane: type, K, S,
# rows, columns per thread, ASYNC, LEAN, COLV window offset or -1). LEAN runs at stride 1
# only without COLV, hence COLV=0 in its settings.
_V2 = "fwd_nchw_v2<float, 3, 1, "
_NOSH = {"CUDADOCTOR_OPS_DW_V2_SHFL": "0"}  # fwd_nchw_v2 on 3x3 (else fwd_nchw_shfl by default)
_LEAN = {"CUDADOCTOR_OPS_DW_V2_LEAN": "1", "CUDADOCTOR_OPS_DW_V2_COLV": "0"}
_V2_STAGING = {
    "register-staging": ({"CUDADOCTOR_OPS_DW_V2_ASYNC": "0", **_NOSH}, _V2 + "2, 4, false, false, -1>"),
    "async-rows-8": ({"CUDADOCTOR_OPS_DW_V2_ROWS": "8", **_NOSH}, _V2 + "8, 4, true, false, 3>"),
    "register-rows-8": ({"CUDADOCTOR_OPS_DW_V2_ASYNC": "0", "CUDADOCTOR_OPS_DW_V2_ROWS": "8", **_NOSH},
                        _V2 + "8, 4, false, false, -1>"),
    "lean": (dict(_LEAN, **_NOSH), _V2 + "2, 4, true, true, -1>"),
    "lean-rows-8": (dict(_LEAN, CUDADOCTOR_OPS_DW_V2_ROWS="8", **_NOSH), _V2 + "8, 4, true, true, -1>"),
    "lean-rows-4": (dict(_LEAN, CUDADOCTOR_OPS_DW_V2_ROWS="4", **_NOSH), _V2 + "4, 4, true, true, -1>"),
    "async-rows-4": ({"CUDADOCTOR_OPS_DW_V2_ROWS": "4", **_NOSH}, _V2 + "4, 4, true, false, 3>"),
    "strided-columns": ({"CUDADOCTOR_OPS_DW_V2_COLV": "0", **_NOSH}, _V2 + "2, 4, true, false, -1>"),
    "colv-rows-8": ({"CUDADOCTOR_OPS_DW_V2_COLV": "1", "CUDADOCTOR_OPS_DW_V2_ROWS": "8", **_NOSH},
                    _V2 + "8, 4, true, false, 3>"),
    "colv-rows-4": ({"CUDADOCTOR_OPS_DW_V2_COLV": "1", "CUDADOCTOR_OPS_DW_V2_ROWS": "4", **_NOSH},
                    _V2 + "4, 4, true, false, 3>"),
    # fwd_nchw_shfl (float32, stride 1, padding (K-1)/2 along W, W % 4 == 0; by default 4 rows
    # for 3x3, impl "auto" only): a warp per 2 / 4 / 8 output rows x 128 columns, neighbouring
    # columns by shuffles
    "default": ({}, "fwd_nchw_shfl<3, 4>"),
    "shfl-rows-2": ({"CUDADOCTOR_OPS_DW_V2_SHFL": "2"}, "fwd_nchw_shfl<3, 2>"),
    "shfl-rows-8": ({"CUDADOCTOR_OPS_DW_V2_SHFL": "8"}, "fwd_nchw_shfl<3, 8>"),
    "shfl-off": (_NOSH, _V2 + "2, 4, true, false, 3>"),
    # impl="v2" (the bench's previous-kernel column) runs fwd_nchw_v2, never the warp kernel
    "impl-v2": ({"DW_EXPECT_IMPL": "v2"}, _V2 + "2, 4, true, false, 3>"),
}


@pytest.mark.parametrize("setting", list(_V2_STAGING))
def test_nchw_v2_staging_settings_in_subprocess(setting):
    env, kernel = _V2_STAGING[setting]
    proc, report = _run_child_env(_V2_STAGING_SCRIPT, dict(env, DW_EXPECT_KERNEL=kernel))
    assert proc.returncode >= 0, f"child killed by signal {-proc.returncode}:\n{report}"
    n = len(FWD_FAST_CASES) + len(CASES) + 1
    assert proc.returncode == 0 and f"done: {n} checks, 0 failures" in proc.stdout, report


# ---- channels_last backward: second-generation weight gradient and stride-2 input gradient ----
# auto runs, for channels_last tensors, the second-generation weight gradient (16- or 8-byte
# channel vectors, one kernel row per thread, partials reduced in a fixed order) wherever C is a
# multiple of its vector (8 for 16-bit 3x3, else 4) and both tensors are aligned to it, and at
# stride 2 the second-generation input gradient (2 x 2 input pixels x 16 bytes of channels per
# thread, both parities of rows and columns) where C % (16 / element size) == 0 and grad_output and
# grad_input are 16-byte aligned. CUDADOCTOR_OPS_DW_WGRAD_V1=1 / CUDADOCTOR_OPS_DW_DGRAD_V1=1 (read
# once per process, hence the child processes below) keep the first-generation kernels;
# impl="tiled_v1" also keeps the first-generation stride-2 input gradient.

# (N, C, H, W, k, stride, padding)
BWD2_CASES = [
    # stride 2, odd sizes: first and last block rows / columns of both parities
    (2, 8, 7, 9, 3, 2, 1),
    (2, 24, 13, 13, 3, 2, 0),
    (1, 72, 15, 15, 3, 2, 2),
    (2, 200, 13, 13, 3, 2, 1),
    (2, 200, 15, 15, 5, 2, 2),
    (2, 8, 13, 13, 5, 2, 0),
    (1, 24, 15, 15, 5, 2, 4),
    (2, 24, 7, 9, 7, 2, 3),
    (1, 72, 15, 15, 7, 2, 6),
    (2, 8, 9, 7, 7, 2, 0),
    # H or W smaller than the kernel
    (2, 24, 3, 4, 5, 2, 2),
    (2, 8, 2, 5, 7, 2, 3),
    (2, 8, 3, 4, 5, 1, 2),
    (1, 72, 2, 3, 7, 1, 6),
    (2, 8, 1, 1, 3, 1, 1),
    # stride 1
    (2, 8, 7, 9, 3, 1, 1),
    (2, 72, 13, 13, 3, 1, 0),
    (1, 200, 15, 15, 3, 1, 2),
    (2, 24, 13, 13, 5, 1, 2),
    (1, 72, 7, 9, 5, 1, 4),
    (2, 8, 15, 15, 7, 1, 3),
    (1, 24, 9, 7, 7, 1, 0),
    (1, 200, 13, 13, 7, 1, 6),
    # long rows: several groups of K columns per row (the weight gradient's column loop and its
    # prefetch of the next group), then a tail
    (1, 24, 5, 64, 5, 1, 2),
    (1, 16, 9, 40, 7, 2, 3),
    (2, 16, 4, 35, 3, 1, 1),
    # C % 8 != 0 (16-bit: first-generation kernels); C = 4 (16-bit 5x5: 4-channel vectors)
    (2, 12, 9, 9, 3, 2, 1),
    (2, 12, 9, 9, 3, 1, 1),
    (2, 4, 11, 11, 5, 1, 2),
    (2, 4, 11, 11, 5, 2, 2),
]
# Larger: several units per block, column segments, several row tiles, many channel groups.
BWD2_LARGE = [
    (8, 144, 56, 56, 3, 1, 1),
    (4, 96, 112, 112, 3, 2, 1),
    (8, 240, 28, 28, 5, 1, 2),
    (16, 1152, 7, 7, 5, 1, 2),
    (8, 32, 112, 112, 3, 1, 1),
    (8, 144, 56, 56, 5, 2, 2),
    (16, 576, 14, 14, 3, 2, 1),
    # the shared-memory weight gradient: 28x28 in bands (the last one shorter), 7x7 planes of many
    # channel groups in units of several images (the last unit one image short), 14x14 with
    # padding 2 (column segments)
    (16, 192, 28, 28, 3, 1, 1),
    (31, 960, 7, 7, 3, 1, 1),
    (8, 80, 14, 14, 3, 1, 2),
]
BWD2_DTYPES = [torch.float16, torch.bfloat16, torch.float32]

# Shared by the in-process tests and the child processes (exec'd in both).
_BWD2_SRC = r'''
import torch
import torch.nn.functional as F
from cudadoctor_ops import depthwise_conv2d


def bwd2_run(case, dtype, impl="auto", seed=5):
    """Channels_last forward and backward through depthwise_conv2d: (x, wt, b, gy, gx, gw, gb)."""
    n, c, h, w, k, s, p = case
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, c, h, w, device="cuda", generator=gen).to(dtype)
    x = x.contiguous(memory_format=torch.channels_last).requires_grad_(True)
    wt = torch.randn(c, 1, k, k, device="cuda", generator=gen).to(dtype).requires_grad_(True)
    b = torch.randn(c, device="cuda", generator=gen).to(dtype).requires_grad_(True)
    out = depthwise_conv2d(x, wt, b, s, p, impl=impl)
    gy = torch.randn(out.shape, device="cuda", generator=gen).to(dtype)
    gy = gy.contiguous(memory_format=torch.channels_last)
    gx, gw, gb = torch.autograd.grad(out, (x, wt, b), gy)
    return x, wt, b, gy, gx, gw, gb


def bwd2_errors(case, dtype, impl="auto", seed=5):
    """[rel err grad_input, grad_weight, grad_bias, grad_input kept channels_last] against float64."""
    n, c, h, w, k, s, p = case
    x, wt, b, gy, gx, gw, gb = bwd2_run(case, dtype, impl, seed)
    xd = x.detach().double().requires_grad_(True)
    wd = wt.detach().double().requires_grad_(True)
    bd = b.detach().double().requires_grad_(True)
    ref = F.conv2d(xd, wd, bd, s, p, 1, groups=c)
    rx, rw, rb = torch.autograd.grad(ref, (xd, wd, bd), gy.double())

    def rel(a, r):
        scale = r.abs().max().item() or 1.0
        return (a.double() - r).abs().max().item() / scale

    return [rel(gx, rx), rel(gw, rw), rel(gb, rb),
            bool(gx.is_contiguous(memory_format=torch.channels_last))]


def cuda_kernel_names(fn):
    """Event names (CUDA kernels among them) recorded while fn runs; None without a profiler."""
    fn()
    torch.cuda.synchronize()
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return [e.key for e in prof.key_averages()]
    except Exception:  # profiler unavailable in this environment
        return None
'''
exec(_BWD2_SRC, globals())


def _bwd2_id(case) -> str:
    n, c, h, w, k, s, p = case
    return f"{n}x{c}x{h}x{w}-k{k}-s{s}-p{p}"


def _bwd2_check(res, dtype, what):
    ex, ew, eb, kept = res
    tol = TOL[dtype]
    assert ex < tol, f"{what}: grad input relative error {ex:.2e} >= {tol}"
    assert ew < tol, f"{what}: grad weight relative error {ew:.2e} >= {tol}"
    assert eb < tol, f"{what}: grad bias relative error {eb:.2e} >= {tol}"
    assert kept, f"{what}: grad input lost the channels_last layout"


@pytest.mark.parametrize("impl", ["auto", "tiled_v1"])
@pytest.mark.parametrize("dtype", BWD2_DTYPES, ids=str)
@pytest.mark.parametrize("case", BWD2_CASES + BWD2_LARGE, ids=_bwd2_id)
def test_bwd2_channels_last_grads_match_float64(case, dtype, impl):
    _bwd2_check(bwd2_errors(case, dtype, impl), dtype, f"{_bwd2_id(case)} {dtype} {impl}")


# MobileNetV2 / EfficientNet-B0 layers at batch 64 (the shapes of the H200 profile).
BWD2_NET = [
    ((64, 144, 56, 56, 3, 1, 1), torch.float16),
    ((64, 96, 112, 112, 3, 2, 1), torch.float16),
    ((64, 576, 14, 14, 3, 1, 1), torch.bfloat16),
    ((64, 1152, 7, 7, 5, 1, 2), torch.float16),
    ((64, 240, 28, 28, 5, 1, 2), torch.float16),
    ((64, 144, 56, 56, 5, 2, 2), torch.bfloat16),
]


@pytest.mark.parametrize("case,dtype", BWD2_NET, ids=[f"{_bwd2_id(c)}-{d}" for c, d in BWD2_NET])
def test_bwd2_network_layers_match_float64(case, dtype):
    _bwd2_check(bwd2_errors(case, dtype), dtype, f"{_bwd2_id(case)} {dtype}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", [(8, 144, 28, 28, 3, 1, 1), (4, 240, 28, 28, 5, 2, 2),
                                  (4, 72, 20, 20, 7, 1, 3)], ids=_bwd2_id)
def test_bwd2_weight_grad_is_deterministic(case, dtype):
    n, c, h, w, k, s, p = case
    gen = torch.Generator(device=DEV).manual_seed(7)
    x = torch.randn(n, c, h, w, device=DEV, generator=gen).to(dtype)
    x = x.contiguous(memory_format=torch.channels_last)
    wt = torch.randn(c, 1, k, k, device=DEV, generator=gen).to(dtype)
    out = depthwise_conv2d(x, wt, None, s, p)
    g = torch.randn(out.shape, device=DEV, generator=gen).to(dtype)
    g = g.contiguous(memory_format=torch.channels_last)
    sp, pp = [s, s], [p, p]
    runs = [ops.depthwise_conv2d_backward_weight(g, x, wt, sp, pp, [1, 1], True, 0)
            for _ in range(3)]
    for gw, gb in runs[1:]:
        assert torch.equal(gw, runs[0][0]) and torch.equal(gb, runs[0][1])


@pytest.mark.parametrize("offset", [1, 4, 8])  # elements: 2, 8 and 16 bytes for 16-bit types
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_bwd2_storage_offset(dtype, offset):
    # grad_output (and, for the weight gradient, the input) as channels_last views at a storage
    # offset: the 16-byte kernels step aside unless the offset keeps 16-byte alignment.
    def view(shape, seed):
        n, c, h, w = shape
        gen = torch.Generator(device=DEV).manual_seed(seed)
        buf = torch.randn(n * c * h * w + offset, device=DEV, generator=gen).to(dtype)
        t = torch.as_strided(buf, shape, (h * w * c, 1, w * c, c), offset)
        assert t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()
        return t

    for (n, c, h, w, k, s, p) in [(2, 16, 11, 13, 3, 2, 1), (2, 16, 9, 10, 5, 2, 2),
                                  (2, 16, 11, 13, 3, 1, 1), (2, 16, 9, 10, 7, 1, 3)]:
        x = view((n, c, h, w), 11)
        wt = torch.randn(c, 1, k, k, device=DEV).to(dtype)
        ho, wo = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
        g = view((n, c, ho, wo), 12)
        sp, pp, dp = [s, s], [p, p], [1, 1]
        gx = ops.depthwise_conv2d_backward_input(g, x, wt, sp, pp, dp, 0)
        gw, gb = ops.depthwise_conv2d_backward_weight(g, x, wt, sp, pp, dp, True, 0)
        xd = x.detach().double().requires_grad_(True)
        wd = wt.double().requires_grad_(True)
        bd = torch.zeros(c, device=DEV, dtype=torch.float64, requires_grad=True)
        ref = F.conv2d(xd, wd, bd, s, p, 1, groups=c)
        rx, rw, rb = torch.autograd.grad(ref, (xd, wd, bd), g.double())
        what = f"{(n, c, h, w, k, s, p)} offset {offset}"
        assert gx.is_contiguous(memory_format=torch.channels_last), what
        assert _rel_err(gx, rx) < TOL[dtype], f"{what}: grad input"
        assert _rel_err(gw, rw) < TOL[dtype], f"{what}: grad weight"
        assert _rel_err(gb, rb) < TOL[dtype], f"{what}: grad bias"


# One child process per switch setting: the grads of every BWD2_CASES case for each dtype and of
# the BWD2_LARGE cases in float16 against float64, and the names of the kernels one float16
# stride-2 forward + backward runs (None where the profiler cannot record CUDA kernels).
_BWD2_CHILD = _BWD2_SRC + r'''
import json
import sys

import cudadoctor_ops  # noqa: F401

small, large = json.loads(sys.argv[1])
dtypes = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
res = {}
for case in small:
    for name, dt in dtypes.items():
        res[f"{case}|{name}"] = bwd2_errors(tuple(case), dt)
for case in large:
    res[f"{case}|float16"] = bwd2_errors(tuple(case), torch.float16)
names = cuda_kernel_names(lambda: bwd2_run((2, 24, 13, 13, 3, 2, 1), torch.float16))
names_s1 = cuda_kernel_names(lambda: bwd2_run((2, 24, 13, 13, 5, 1, 2), torch.float16))
names_s1k3 = cuda_kernel_names(lambda: bwd2_run((2, 72, 13, 13, 3, 1, 0), torch.float16))
print(json.dumps({"errors": res, "kernels": names, "kernels_s1": names_s1, "kernels_s1k3": names_s1k3}))
'''

_BWD2_SWITCHES = [
    {},
    {"CUDADOCTOR_OPS_DW_WGRAD_V1": "1"},
    {"CUDADOCTOR_OPS_DW_DGRAD_V1": "1"},
    {"CUDADOCTOR_OPS_DW_WGRAD_V1": "1", "CUDADOCTOR_OPS_DW_DGRAD_V1": "1"},
    {"CUDADOCTOR_OPS_DW_WGRAD_V1": "0", "CUDADOCTOR_OPS_DW_DGRAD_V1": "0"},
    {"CUDADOCTOR_OPS_DW_WGRAD_PF": "0"},
    {"CUDADOCTOR_OPS_DW_WGRAD_PF": "1"},
    {"CUDADOCTOR_OPS_DW_WGRAD_PF": "2"},
    {"CUDADOCTOR_OPS_DW_WGRAD_SMEM": "1"},
    {"CUDADOCTOR_OPS_DW_WGRAD_SMEM": "0"},
    {"CUDADOCTOR_OPS_DW_WGRAD_V3_DB": "1"},
    {"CUDADOCTOR_OPS_DW_WGRAD_V3_AK": "0"},
    {"CUDADOCTOR_OPS_DW_WGRAD_V3_DB": "1", "CUDADOCTOR_OPS_DW_WGRAD_V3_AK": "0"},
    {"CUDADOCTOR_OPS_DW_WGRAD_V3_DB": "1", "CUDADOCTOR_OPS_DW_WGRAD_V3_KB": "96"},
    {"CUDADOCTOR_OPS_DW_WGRAD_V3_KB": "48"},
    {"CUDADOCTOR_OPS_DW_WGRAD_V3_UPB": "1"},
    {"CUDADOCTOR_OPS_DW_WGRAD_V3_IMGS": "1"},
    {"CUDADOCTOR_OPS_DW_WGRAD_V3_IMGS": "3"},
    {"CUDADOCTOR_OPS_DW_WGRAD_V3_AK": "1"},
    {"CUDADOCTOR_OPS_DW_WGRAD_V3_AK": "2"},
    {"CUDADOCTOR_OPS_DW_WGRAD_V3_AK": "2", "CUDADOCTOR_OPS_DW_WGRAD_V3_KB": "48"},
]


@pytest.mark.parametrize("switches", _BWD2_SWITCHES,
                         ids=["default"] + ["-".join(f"{k[18:]}={v}" for k, v in sw.items())
                                            for sw in _BWD2_SWITCHES[1:]])
def test_bwd2_kernel_switches_in_subprocess(switches):
    """Every backward kernel choice against float64 (the switches are read once per process)."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    # every switch of the list (and the impl override) comes from this test's setting alone
    clear = {k for sw in _BWD2_SWITCHES for k in sw} | {"CUDADOCTOR_OPS_DEPTHWISE_IMPL"}
    env = {k: v for k, v in os.environ.items() if k not in clear}
    env.update(switches)
    pkg_parent = str(pathlib.Path(cudadoctor_ops.__file__).resolve().parents[1])
    env["PYTHONPATH"] = pkg_parent + os.pathsep + env.get("PYTHONPATH", "")
    arg = json.dumps([BWD2_CASES, BWD2_LARGE])
    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _BWD2_CHILD, arg],
                          capture_output=True, text=True, timeout=600, env=env)
    report = f"rc={proc.returncode}\nstdout tail:\n{proc.stdout[-2000:]}\nstderr tail:\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, report
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    errors = out["errors"]
    assert len(errors) == 3 * len(BWD2_CASES) + len(BWD2_LARGE), report
    dtypes = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
    for key, res in errors.items():
        case, name = key.split("|")
        _bwd2_check(res, dtypes[name], f"{switches} {case} {name}")

    names = out["kernels"]
    ours = [n for n in names or []
            if "cudadoctor_ops" in n and ("wgrad" in n or "bwd_input" in n)]
    if not ours:
        pytest.skip(f"the profiler recorded no backward kernel (events: {names})")
    wgrad_v1 = switches.get("CUDADOCTOR_OPS_DW_WGRAD_V1") == "1"
    dgrad_v1 = switches.get("CUDADOCTOR_OPS_DW_DGRAD_V1") == "1"
    assert any("wgrad_nhwc_v2<" in n for n in ours) == (not wgrad_v1), ours
    assert any("wgrad_nhwc<" in n for n in ours) == wgrad_v1, ours
    assert any("bwd_input_nhwc_s2<" in n for n in ours) == (not dgrad_v1), ours
    assert any("bwd_input_nhwc<" in n for n in ours) == dgrad_v1, ours
    # the shared-memory weight gradient (stride 1, 16-bit): by default on planes up to 32x32
    # (the 13x13 case here), never with =0 or under the forced v1; the stride-2 case above stays
    # on v2 either way
    # wgrad_nhwc_v3<T, K, DB, AK>: two band buffers with _V3_DB=1; all kernel rows per thread
    # for 3x3 unless _V3_AK=0; for 5x5 with _V3_AK=2, and by default where the AK grid fits one
    # wave of resident blocks (the 2 x 24-channel 13x13 case here does on any GPU: 2 blocks)
    s1 = [n for n in out["kernels_s1"] or [] if "cudadoctor_ops" in n and "wgrad" in n]
    smem = switches.get("CUDADOCTOR_OPS_DW_WGRAD_SMEM") != "0" and not wgrad_v1
    db = "true" if switches.get("CUDADOCTOR_OPS_DW_WGRAD_V3_DB") == "1" else "false"
    ak = "false" if switches.get("CUDADOCTOR_OPS_DW_WGRAD_V3_AK") == "0" else "true"
    ak5 = "true" if switches.get("CUDADOCTOR_OPS_DW_WGRAD_V3_AK") in (None, "2") else "false"
    if s1:
        assert any("wgrad_nhwc_v3<c10::Half, 5," in n for n in s1) == smem, s1
        if smem:
            assert any(f"wgrad_nhwc_v3<c10::Half, 5, {db}, {ak5}>" in n for n in s1), s1
    s1k3 = [n for n in out["kernels_s1k3"] or [] if "cudadoctor_ops" in n and "wgrad" in n]
    if s1k3 and smem:
        assert any(f"wgrad_nhwc_v3<c10::Half, 3, {db}, {ak}>" in n for n in s1k3), s1k3
    pf = switches.get("CUDADOCTOR_OPS_DW_WGRAD_PF")
    if pf is not None:
        # wgrad_nhwc_v2<T, K, S, V, PF>: the float16 3x3 stride-2 case runs V = 8
        assert any(f"wgrad_nhwc_v2<c10::Half, 3, 2, 8, {pf}>" in n for n in ours), ours
