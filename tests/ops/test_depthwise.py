"""cudadoctor_ops.depthwise_conv2d against a float64 F.conv2d reference.

Every test needs a CUDA GPU and the built extension; without them the module skips with the reason.
"""

from __future__ import annotations

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
    with pytest.raises(RuntimeError, match="input dtype must be"):
        depthwise_conv2d(x.int(), w.int())
