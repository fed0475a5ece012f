"""cudadoctor_ops.batch_norm against a float64 pure-torch reference (GPU only)."""

from __future__ import annotations

import math
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

# every test takes the `ops` fixture (tests/ops/conftest.py): the cudadoctor_ops module, or a
# skip with the reason when there is no CUDA GPU or no build
pytestmark = pytest.mark.gpu

DEV = "cuda"
TOL = {  # (atol, rtol) for outputs / grads, relative to values of order 1
    torch.float32: (2e-4, 2e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (6e-2, 3e-2),
    torch.float64: (1e-9, 1e-9),
}


def reference(x, rm, rv, w, b, training, momentum, eps, activation):
    """float64 BatchNorm (+ReLU); returns out and the new running stats (or None)."""
    x64 = x.double()
    c = x.shape[1]
    dims = [0] + list(range(2, x.dim()))
    shape = [1, c] + [1] * (x.dim() - 2)
    new_rm = new_rv = None
    if training:
        mean = x64.mean(dims)
        var = x64.var(dims, unbiased=False)
        n = x.numel() // c
        if rm is not None:
            new_rm = (1 - momentum) * rm.double() + momentum * mean
            new_rv = (1 - momentum) * rv.double() + momentum * var * n / (n - 1)
    else:
        mean, var = rm.double(), rv.double()
    y = (x64 - mean.view(shape)) / torch.sqrt(var.view(shape) + eps)
    if w is not None:
        y = y * w.double().view(shape)
    if b is not None:
        y = y + b.double().view(shape)
    if activation == "relu":
        y = torch.relu(y)
    return y, new_rm, new_rv


def make(shape, dtype, layout, affine=True, pdtype=None, seed=0, loc=0.0, scale=1.0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    c = shape[1]
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * scale + loc).to(dtype)
    if layout == "nhwc":
        x = x.contiguous(memory_format=torch.channels_last if len(shape) == 4 else torch.channels_last_3d)
    x = x.to(DEV)
    pdtype = pdtype or dtype
    w = (torch.rand(c, generator=g, dtype=torch.float64) + 0.5).to(pdtype).to(DEV) if affine else None
    b = (torch.randn(c, generator=g, dtype=torch.float64) * 0.3).to(pdtype).to(DEV) if affine else None
    rm = (torch.randn(c, generator=g, dtype=torch.float64) * 0.1).to(pdtype).to(DEV)
    rv = (torch.rand(c, generator=g, dtype=torch.float64) + 0.5).to(pdtype).to(DEV)
    return x, w, b, rm, rv


def close(actual, expected, dtype, scale=1.0, what=""):
    atol, rtol = TOL[dtype]
    actual = actual.double()
    expected = expected.double()
    err = (actual - expected).abs()
    bound = atol * scale + rtol * expected.abs()
    bad = err > bound
    assert not bool(bad.any()), (
        f"{what}: {int(bad.sum())} of {err.numel()} values off; max abs err {float(err.max()):.3e} "
        f"(atol {atol * scale:.1e}, rtol {rtol:.1e})"
    )


SHAPES = [
    (8, 16, 8, 8),  # vector path
    (4, 3, 5, 7),  # odd H*W, scalar path
    (2, 1, 8, 8),  # C = 1
    (16, 24),  # 2-D (N, C)
    (3, 5, 9),  # 3-D, odd
    (2, 8, 3, 4, 6),  # 5-D
    (4, 64, 7, 7),  # 7x7 planes, many channels
    (2, 12, 64, 64),  # few channels, big planes (many blocks per channel)
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def layouts_for(shape):
    return ["nchw", "nhwc"] if len(shape) in (4, 5) else ["nchw"]


CASES = [(s, lay) for s in SHAPES for lay in layouts_for(s)]


class TestBatchNorm:
    @pytest.mark.parametrize("shape,layout", CASES, ids=[f"{s}-{lay}" for s, lay in CASES])
    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
    @pytest.mark.parametrize("activation", ["none", "relu"])
    def test_forward_backward_vs_float64(self, ops, shape, layout, dtype, training, activation):
        x, w, b, rm, rv = make(shape, dtype, layout)
        x.requires_grad_(True)
        w.requires_grad_(True)
        b.requires_grad_(True)
        rm0, rv0 = rm.clone(), rv.clone()
        out = ops.batch_norm(x, rm, rv, w, b, training, 0.1, 1e-5, activation)
        assert out.shape == x.shape and out.dtype == x.dtype
        if layout == "nhwc":
            assert out.is_contiguous(
                memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d
            )

        xr = x.detach().double().requires_grad_(True)
        wr = w.detach().double().requires_grad_(True)
        br = b.detach().double().requires_grad_(True)
        ref, new_rm, new_rv = reference(xr, rm0, rv0, wr, br, training, 0.1, 1e-5, activation)
        close(out, ref, dtype, what="output")
        if training:
            close(rm, new_rm, torch.float32 if dtype == torch.float32 else dtype, what="running_mean")
            close(rv, new_rv, torch.float32 if dtype == torch.float32 else dtype, what="running_var")
        else:
            assert torch.equal(rm, rm0) and torch.equal(rv, rv0)

        gy = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(DEV)
        out.backward(gy.to(dtype))
        ref.backward(gy)
        gscale = max(1.0, float(xr.grad.abs().max()))
        close(x.grad, xr.grad, dtype, scale=gscale, what="grad_input")
        # parameter grads are sums over N*HW values: scale the tolerance with sqrt(count)
        pscale = math.sqrt(x.numel() / shape[1]) * max(1.0, float(wr.grad.abs().max()) / 10)
        close(w.grad, wr.grad, dtype, scale=pscale, what="grad_weight")
        close(b.grad, br.grad, dtype, scale=pscale, what="grad_bias")

    @pytest.mark.parametrize("layout", ["nchw", "nhwc"])
    @pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
    def test_no_affine_and_float32_params_for_half(self, ops, layout, training):
        x, _, _, rm, rv = make((4, 8, 6, 6), torch.float16, layout, affine=False, pdtype=torch.float32)
        rm0, rv0 = rm.clone(), rv.clone()
        out = ops.batch_norm(x, rm, rv, None, None, training, 0.2, 1e-3)
        ref, new_rm, new_rv = reference(x, rm0, rv0, None, None, training, 0.2, 1e-3, "none")
        close(out, ref, torch.float16, what="output")
        if training:
            close(rm, new_rm, torch.float32, what="running_mean")
            close(rv, new_rv, torch.float32, what="running_var")
        # half input, float32 weight/bias
        w = torch.rand(8, device=DEV) + 0.5
        b = torch.randn(8, device=DEV)
        out = ops.batch_norm(x, rm0.clone(), rv0.clone(), w, b, training, 0.1, 1e-5, "relu")
        ref, _, _ = reference(x, rm0, rv0, w, b, training, 0.1, 1e-5, "relu")
        close(out, ref, torch.float16, what="output (fp32 params)")

    @pytest.mark.parametrize("layout", ["nchw", "nhwc"])
    @pytest.mark.parametrize("shape", [(8, 4, 32, 32), (8, 160, 8, 8)])  # the second: single-read NCHW
    def test_large_mean_small_std_is_stable(self, ops, layout, shape):
        # mean 1e4, std 1e-2 in float32: naive E[x^2] - E[x]^2 loses every digit.
        x, w, b, rm, rv = make(shape, torch.float32, layout, loc=1e4, scale=1e-2)
        rm0, rv0 = rm.clone(), rv.clone()
        xg = x.clone().requires_grad_(True)
        out = ops.batch_norm(xg, rm, rv, w, b, True, 0.1, 1e-5)
        xr = x.double().requires_grad_(True)
        ref, new_rm, new_rv = reference(xr, rm0, rv0, w, b, True, 0.1, 1e-5, "none")
        close(out, ref, torch.float32, scale=5, what="output")
        assert torch.allclose(rm.double(), new_rm, rtol=1e-6, atol=0)
        assert torch.allclose(rv.double(), new_rv, rtol=1e-3, atol=1e-9)
        gy = torch.randn_like(xr)
        out.backward(gy.float())
        ref.backward(gy)
        close(xg.grad, xr.grad, torch.float32, scale=float(xr.grad.abs().max()) * 10, what="grad_input")

    def test_non_contiguous_odd_strides_give_correct_result(self, ops):
        base = torch.randn(6, 10, 9, 11, device=DEV)
        x = base[::2, 1::3, :, 2:]  # odd strides everywhere
        assert not x.is_contiguous()
        c = x.shape[1]
        w, b = torch.rand(c, device=DEV) + 0.5, torch.randn(c, device=DEV)
        rm, rv = torch.zeros(c, device=DEV), torch.ones(c, device=DEV)
        out = ops.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5)
        ref, _, _ = reference(x, torch.zeros(c, device=DEV), torch.ones(c, device=DEV), w, b, True, 0.1, 1e-5, "none")
        close(out, ref, torch.float32, what="output")
        # permuted (dense, not a standard layout)
        xp = torch.randn(4, 6, 5, 3, device=DEV).permute(0, 3, 1, 2)
        out = ops.batch_norm(xp, None, None, None, None, True, 0.1, 1e-5)
        ref, _, _ = reference(xp, None, None, None, None, True, 0.1, 1e-5, "none")
        close(out, ref, torch.float32, what="output (permuted)")

    def test_grad_out_in_other_layout(self, ops):
        x, w, b, rm, rv = make((4, 16, 6, 6), torch.float32, "nhwc")
        x.requires_grad_(True)
        out = ops.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5)
        gy = torch.randn(out.shape, device=DEV)  # NCHW while out is channels_last
        (gx,) = torch.autograd.grad(out, x, gy)
        xr = x.detach().double().requires_grad_(True)
        ref, _, _ = reference(xr, rm, rv, w, b, True, 0.1, 1e-5, "none")
        ref.backward(gy.double())
        close(gx, xr.grad, torch.float32, what="grad_input")

    def test_empty_batch_matches_torch(self, ops):
        for training in (True, False):
            x = torch.randn(0, 4, 5, 5, device=DEV)
            rm, rv = torch.randn(4, device=DEV), torch.rand(4, device=DEV) + 1
            rm_t, rv_t = rm.clone(), rv.clone()
            w = torch.rand(4, device=DEV, requires_grad=True)
            b = torch.rand(4, device=DEV, requires_grad=True)
            ours = ops.batch_norm(x, rm, rv, w, b, training, 0.1, 1e-5)
            theirs = F.batch_norm(x, rm_t, rv_t, w, b, training, 0.1, 1e-5)
            assert ours.shape == theirs.shape
            assert torch.equal(rm, rm_t) and torch.equal(rv, rv_t)
            ours.sum().backward()
            assert w.grad is not None and torch.all(w.grad == 0)

    def test_one_value_per_channel_raises_like_torch(self, ops):
        x = torch.randn(1, 4, 1, 1, device=DEV)
        rm, rv = torch.zeros(4, device=DEV), torch.ones(4, device=DEV)
        with pytest.raises(ValueError) as theirs:
            F.batch_norm(x, rm, rv, training=True)
        with pytest.raises(ValueError) as ours:
            ops.batch_norm(x, rm, rv, training=True)
        assert str(ours.value) == str(theirs.value)
        # eval mode with one value is fine in both
        close(
            ops.batch_norm(x, rm, rv, training=False),
            F.batch_norm(x, rm, rv, training=False).double(),
            torch.float32,
            what="eval output",
        )

    def test_one_value_per_channel_over_batch_ok(self, ops):
        # N=2, H=W=1: two values per channel, allowed in training.
        x, w, b, rm, rv = make((2, 5, 1, 1), torch.float32, "nchw")
        rm0, rv0 = rm.clone(), rv.clone()
        out = ops.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5)
        ref, new_rm, new_rv = reference(x, rm0, rv0, w, b, True, 0.1, 1e-5, "none")
        close(out, ref, torch.float32, scale=10, what="output")
        close(rv, new_rv, torch.float32, what="running_var")

    def test_gradcheck_double(self, ops):
        for training in (True, False):
            for activation in ("none", "relu"):
                for layout in ("nchw", "nhwc"):
                    x, w, b, rm, rv = make((3, 4, 3, 5), torch.float64, layout)
                    x.requires_grad_(True)
                    w.requires_grad_(True)
                    b.requires_grad_(True)

                    def fn(x, w, b):
                        return ops.batch_norm(x, rm.clone(), rv.clone(), w, b, training, 0.1, 1e-5, activation)

                    assert torch.autograd.gradcheck(fn, (x, w, b), eps=1e-6, atol=1e-5, rtol=1e-4)

    def test_opcheck(self, ops):
        x, w, b, rm, rv = make((4, 8, 5, 5), torch.float32, "nchw")
        xl, wl, bl, rml, rvl = make((4, 8, 6, 6), torch.float16, "nhwc", pdtype=torch.float32)
        samples = [
            (x.requires_grad_(True), w.requires_grad_(True), b, None, None, True, 1e-5, "relu"),
            (x, w, b, rm, rv, False, 1e-5, "none"),
            (xl, wl, bl, None, None, True, 1e-3, "none"),
            (x, None, None, rm, rv, False, 1e-5, "relu"),
        ]
        for args in samples:
            torch.library.opcheck(torch.ops.cudadoctor_ops.batch_norm.default, args)
        out, sm, si, _ = torch.ops.cudadoctor_ops.batch_norm(x.detach(), w.detach(), b, None, None, True, 1e-5, "none")
        torch.library.opcheck(
            torch.ops.cudadoctor_ops.batch_norm_update_stats.default,
            (rm.clone(), rv.clone(), sm, si, 0.1, 1e-5, 100),
        )

    def test_errors_name_the_bad_argument(self, ops):
        x = torch.randn(4, 3, 5, 5, device=DEV)
        rm, rv = torch.zeros(3, device=DEV), torch.ones(3, device=DEV)
        with pytest.raises(RuntimeError, match="weight is on cpu"):
            ops.batch_norm(x, rm, rv, torch.ones(3), None, True)
        with pytest.raises(RuntimeError, match="weight has dtype Half but input has dtype Float"):
            ops.batch_norm(x, rm, rv, torch.ones(3, device=DEV, dtype=torch.half), None, True)
        with pytest.raises(RuntimeError, match="bias must have shape \\[3\\]"):
            ops.batch_norm(x, rm, rv, None, torch.ones(4, device=DEV), True)
        with pytest.raises(RuntimeError, match="running_var must have shape \\[3\\]"):
            ops.batch_norm(x, rm, torch.ones(3, 1, device=DEV), None, None, False)
        with pytest.raises(ValueError, match="CUDA tensors only"):
            ops.batch_norm(x.cpu(), rm.cpu(), rv.cpu(), training=True)
        with pytest.raises(ValueError, match="activation"):
            ops.batch_norm(x, rm, rv, training=True, activation="gelu")

    # On a build whose shared object carries its own C++ runtime (a compiler with only libstdc++.a:
    # see HOST_COMPILER_STATIC_LIBSTDCXX / EXT_STATIC_CXX_RUNTIME), these TORCH_CHECK exceptions kill
    # the child with SIGSEGV; tests/ops/test_depthwise.py::test_extension_uses_the_process_cpp_runtime
    # names that cause.
    def test_direct_op_errors_name_the_bad_argument(self, ops):
        # The C++ checks, called through torch.ops without the Python layer; in a child process
        # so that a crash is reported as a failure instead of ending the session.
        code = textwrap.dedent(
            """
            import torch, cudadoctor_ops
            bn = torch.ops.cudadoctor_ops.batch_norm
            x = torch.randn(4, 3, 5, 5, device="cuda")
            ok = lambda: torch.ones(3, device="cuda")
            cases = [
                ("weight is on cpu", (x, torch.ones(3), None, None, None, True, 1e-5, "none")),
                ("weight has dtype Half", (x, ok().half(), None, None, None, True, 1e-5, "none")),
                ("bias must have shape [3]", (x, None, torch.ones(4, device="cuda"), None, None, True, 1e-5, "none")),
                ("running_var must have shape [3]", (x, None, None, ok(), torch.ones(3, 1, device="cuda"), False, 1e-5, "none")),
                ("running_mean and running_var must be given", (x, None, None, None, None, False, 1e-5, "none")),
                ("input must be float32, float16, bfloat16", (x.int(), None, None, None, None, True, 1e-5, "none")),
                ("activation must be", (x, None, None, None, None, True, 1e-5, "gelu")),
            ]
            for want, args in cases:
                try:
                    bn(*args)
                except RuntimeError as exc:
                    assert want in str(exc), (want, str(exc))
                else:
                    raise AssertionError("no error for: " + want)
            print("all raised")
            """
        )
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(pathlib.Path(ops.__file__).parents[1]), env.get("PYTHONPATH", "")])
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0 and "all raised" in proc.stdout, (proc.returncode, proc.stdout, proc.stderr[-3000:])

    @pytest.mark.parametrize("layout", ["nchw", "nhwc"])
    @pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
    def test_parameter_grads_only(self, ops, layout, training):
        x, w, b, rm, rv = make((4, 8, 6, 6), torch.float32, layout)
        w.requires_grad_(True)
        b.requires_grad_(True)
        out = ops.batch_norm(x, rm.clone(), rv.clone(), w, b, training, 0.1, 1e-5, "relu")
        wr = w.detach().double().requires_grad_(True)
        br = b.detach().double().requires_grad_(True)
        ref, _, _ = reference(x, rm, rv, wr, br, training, 0.1, 1e-5, "relu")
        gy = torch.randn_like(ref)
        out.backward(gy.float())
        ref.backward(gy)
        close(w.grad, wr.grad, torch.float32, scale=20, what="grad_weight")
        close(b.grad, br.grad, torch.float32, scale=20, what="grad_bias")

    @pytest.mark.parametrize("layout", ["nchw", "nhwc"])
    def test_bias_without_weight(self, ops, layout):
        x, _, b, rm, rv = make((4, 6, 5, 5), torch.float32, layout)
        x.requires_grad_(True)
        b.requires_grad_(True)
        out = ops.batch_norm(x, rm.clone(), rv.clone(), None, b, True, 0.1, 1e-5, "relu")
        xr = x.detach().double().requires_grad_(True)
        br = b.detach().double().requires_grad_(True)
        ref, _, _ = reference(xr, rm, rv, None, br, True, 0.1, 1e-5, "relu")
        close(out, ref, torch.float32, what="output")
        gy = torch.randn_like(xr)
        out.backward(gy.float())
        ref.backward(gy)
        close(x.grad, xr.grad, torch.float32, scale=10, what="grad_input")
        close(b.grad, br.grad, torch.float32, scale=10, what="grad_bias")

    @pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.mem_get_info()[0] < 40 * 2**30,
        reason="needs ~40 GiB of free GPU memory",
    )
    def test_64bit_indexing(self, ops):
        # 2 * 2 * (2^29 + 8) halfs > 2^31 elements: offsets past 2^31 must be right.
        n = 2**29 + 8
        x = torch.empty(2, 2, n, device=DEV, dtype=torch.float16)
        x.normal_()
        x[1, 1, -8:] = 3.0
        rm, rv = torch.zeros(2, device=DEV), torch.ones(2, device=DEV)
        out = ops.batch_norm(x, rm, rv, None, None, True, 0.1, 1e-5)
        xs = x.float()
        mean = xs.mean(dim=(0, 2))
        var = xs.var(dim=(0, 2), unbiased=False)
        del xs
        expect_tail = ((3.0 - mean[1]) / torch.sqrt(var[1] + 1e-5)).item()
        assert abs(out[1, 1, -1].item() - expect_tail) < 2e-2 * max(1.0, abs(expect_tail))
        assert torch.allclose(rm, 0.1 * mean, rtol=1e-3, atol=1e-5)


class TestModules:
    @pytest.mark.parametrize(
        "cls,torch_cls,shape",
        [
            ("BatchNorm1d", torch.nn.BatchNorm1d, (8, 6, 10)),
            ("BatchNorm2d", torch.nn.BatchNorm2d, (8, 6, 5, 5)),
            ("BatchNorm3d", torch.nn.BatchNorm3d, (4, 6, 3, 4, 5)),
        ],
    )
    @pytest.mark.parametrize("momentum", [0.1, None])
    def test_drop_in_for_torch_module(self, ops, cls, torch_cls, shape, momentum):
        ours = getattr(ops, cls)(6, momentum=momentum, activation="relu").to(DEV)
        ref = torch_cls(6, momentum=momentum).to(DEV)
        assert isinstance(ours, torch_cls)
        assert ours.state_dict().keys() == ref.state_dict().keys()
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5)
            ref.bias.normal_()
        ours.load_state_dict(ref.state_dict())
        for _ in range(3):
            x = torch.randn(shape, device=DEV)
            close(ours(x), torch.relu(ref(x)).double(), torch.float32, what="train output")
        for k, v in ref.state_dict().items():
            close(ours.state_dict()[k], v.double(), torch.float32, what=k)
        ours.eval()
        ref.eval()
        x = torch.randn(shape, device=DEV)
        close(ours(x), torch.relu(ref(x)).double(), torch.float32, what="eval output")
        assert "activation='relu'" in repr(ours)

    @pytest.mark.parametrize(
        "cls,shape", [("BatchNorm1d", (8, 6, 10)), ("BatchNorm2d", (8, 6, 5, 5)), ("BatchNorm3d", (4, 6, 3, 4, 5))]
    )
    @pytest.mark.parametrize("activation", ["none", "relu"])
    @pytest.mark.parametrize("momentum", [0.1, None])
    def test_modules_off_cuda_run_torch(self, ops_built, cls, shape, activation, momentum):
        """On CPU tensors (no CUDA kernel there) the modules are torch's: the same output, input
        and parameter gradients, running statistics and num_batches_tracked as torch's module
        (+ ReLU), bit for bit, over training steps and eval; no GPU needed."""
        torch.manual_seed(0)
        ours = getattr(ops_built, cls)(6, momentum=momentum, activation=activation)
        ref = getattr(torch.nn, cls)(6, momentum=momentum)
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5)
            ref.bias.normal_()
            ref.running_mean.normal_()
        ours.load_state_dict(ref.state_dict())
        for step, training in enumerate((True, True, False)):
            ours.train(training)
            ref.train(training)
            x = torch.randn(shape) * 2 + 1
            xo, xr = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
            y, yr = ours(xo), ref(xr)
            if activation == "relu":
                yr = torch.relu(yr)
            assert torch.equal(y, yr), (step, (y - yr).abs().max())
            g = torch.randn_like(y)
            y.backward(g)
            yr.backward(g)
            assert torch.equal(xo.grad, xr.grad), step
            for name in ("weight", "bias"):
                assert torch.equal(getattr(ours, name).grad, getattr(ref, name).grad), (step, name)
                getattr(ours, name).grad = getattr(ref, name).grad = None
            for k, v in ref.state_dict().items():
                assert torch.equal(ours.state_dict()[k], v), (step, k)
        assert int(ours.num_batches_tracked) == 2

    def test_torch_compile_fullgraph(self, ops):
        torch.manual_seed(0)

        def build():
            torch.manual_seed(0)
            return torch.nn.Sequential(
                torch.nn.Conv2d(3, 16, 3, padding=1),
                ops.BatchNorm2d(16, activation="relu"),
                torch.nn.Conv2d(16, 8, 3, padding=1),
                ops.BatchNorm2d(8),
            ).to(DEV)

        eager, compiled_src = build(), build()
        try:
            import triton  # noqa: F401

            backend = "inductor"
        except ImportError:
            backend = "aot_eager"
        compiled = torch.compile(compiled_src, fullgraph=True, backend=backend)
        x = torch.randn(4, 3, 12, 12, device=DEV)
        for _ in range(2):
            ye = eager(x)
            yc = compiled(x)
            close(yc, ye.double(), torch.float32, what="compiled output")
            ye.square().sum().backward()
            yc.square().sum().backward()
        for (name, pe), pc in zip(eager.named_parameters(), compiled_src.parameters()):
            close(pc.grad, pe.grad.double(), torch.float32, scale=10, what=f"grad {name}")
        for (name, be), bc in zip(eager.named_buffers(), compiled_src.buffers()):
            close(bc, be.double(), torch.float32, what=f"buffer {name}")
        eager.eval()
        compiled_src.eval()
        close(compiled(x), eager(x).double(), torch.float32, what="compiled eval output")


_FUSED_CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    import cudadoctor_ops
    nhwc = sys.argv[1] == "nhwc"
    out = {}
    # shapes: odd sizes, a big-plane one (several slices per channel), one value per plane, and
    # (NCHW) more channels than resident blocks (several channels per block in the one launch);
    # the bfloat16 case keeps its running statistics in bfloat16
    for shape, dtype in (((8, 16, 9, 11), torch.float16), ((3, 24, 5, 7), torch.float32),
                         ((64, 256, 14, 14), torch.bfloat16), ((2, 8, 1, 1), torch.float32),
                         ((4, 8, 64, 64), torch.float32), ((4, 4096, 3, 3), torch.float16),
                         # channels_last one-launch at 8 rows per thread (V = 8, 1, 4) and a
                         # tensor that needs more (the register-persistent kernel falls back)
                         ((64, 2048, 7, 7), torch.float16), ((8, 100, 28, 28), torch.float16),
                         ((64, 1024, 7, 7), torch.float32), ((16, 4096, 10, 10), torch.float16)):
        torch.manual_seed(0)
        x = (torch.randn(shape, device="cuda") * 3 + 1).to(dtype)
        if nhwc:
            x = x.contiguous(memory_format=torch.channels_last)
        x.requires_grad_(True)
        c = shape[1]
        w = (torch.rand(c, device="cuda") + 0.5).requires_grad_(True)
        b = torch.randn(c, device="cuda").requires_grad_(True)
        pdt = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        rm, rv = torch.zeros(c, device="cuda", dtype=pdt), torch.ones(c, device="cuda", dtype=pdt)
        y = cudadoctor_ops.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5, activation="relu")
        g = torch.randn_like(y)
        gx, gw, gb = torch.autograd.grad(y, (x, w, b), g)
        x64 = x.detach().double().requires_grad_(True)
        w64, b64 = w.detach().double().requires_grad_(True), b.detach().double().requires_grad_(True)
        rm64, rv64 = torch.zeros(c, dtype=torch.float64, device="cuda"), torch.ones(c, dtype=torch.float64, device="cuda")
        y64 = torch.relu(torch.nn.functional.batch_norm(x64, rm64, rv64, w64, b64, True, 0.1, 1e-5))
        r = torch.autograd.grad(y64, (x64, w64, b64), g.double())
        err = lambda a, e: ((a.double() - e).abs().max() / e.abs().max().clamp_min(1)).item()
        out[str(shape)] = [err(y, y64), err(gx, r[0]), err(gw, r[1]), err(gb, r[2]),
                           err(rm, rm64), err(rv, rv64),
                           y.is_contiguous(memory_format=torch.channels_last if nhwc else torch.contiguous_format)]
    print(json.dumps(out))
    """
)


_NO_TILE = {"CUDADOCTOR_OPS_BN_NHWC_TILE": "0"}  # the persist / fused choices below
_SWITCH_CASES = [
    ("nhwc", {"CUDADOCTOR_OPS_BN_FUSED": "0"}),
    ("nhwc", {"CUDADOCTOR_OPS_BN_FUSED": "0", "CUDADOCTOR_OPS_BN_FIN_BLOCK": "0"}),
    # 11 rows per thread: two whole groups of the pipelined statistics loop and a tail of 3
    ("nhwc", {"CUDADOCTOR_OPS_BN_FUSED": "0", "CUDADOCTOR_OPS_BN_NHWC_ROWS": "11"}),
    ("nhwc", {"CUDADOCTOR_OPS_BN_FUSED": "0", "CUDADOCTOR_OPS_BN_NHWC_ROWS": "11", "CUDADOCTOR_OPS_BN_STATS_PIPE": "0"}),
    ("nhwc", {"CUDADOCTOR_OPS_BN_FUSED": "1"}),
    ("nhwc", {"CUDADOCTOR_OPS_BN_FUSED": "1", **_NO_TILE}),
    ("nhwc", {"CUDADOCTOR_OPS_BN_FUSED": "1", "CUDADOCTOR_OPS_BN_NHWC_PERSIST": "0", **_NO_TILE}),
    ("nhwc", {"CUDADOCTOR_OPS_BN_FUSED": "1", "CUDADOCTOR_OPS_BN_NHWC_PERSIST_ROWS": "8", **_NO_TILE}),
    ("nhwc", {"CUDADOCTOR_OPS_BN_FUSED": "1", "CUDADOCTOR_OPS_BN_NHWC_PERSIST_ROWS": "1", **_NO_TILE}),
    ("nhwc", {"CUDADOCTOR_OPS_BN_FUSED": "1", "CUDADOCTOR_OPS_BN_NHWC_TILE_CT": "32"}),
    ("nhwc", {"CUDADOCTOR_OPS_BN_FUSED": "1", "CUDADOCTOR_OPS_BN_NHWC_TILE_CT": "64"}),
    ("nchw", {"CUDADOCTOR_OPS_BN_SINGLEREAD": "0", "CUDADOCTOR_OPS_BN_FUSED_NCHW": "0"}),
    ("nchw", {"CUDADOCTOR_OPS_BN_SINGLEREAD": "0", "CUDADOCTOR_OPS_BN_FUSED_NCHW": "1"}),
    ("nchw", {"CUDADOCTOR_OPS_BN_SINGLEREAD": "1"}),
]


@pytest.mark.parametrize("layout,switches", _SWITCH_CASES,
                         ids=[f"{lay}-" + "-".join(f"{k[18:]}={v}" for k, v in sw.items()) for lay, sw in _SWITCH_CASES])
def test_training_forward_kernel_choices(ops, layout, switches):
    """Every training-forward kernel choice must match float64, running statistics included:
    channels_last with CUDADOCTOR_OPS_BN_FUSED=1 (one cooperative launch: the channel-tiled kernel
    where it fits, its tile width forced with _TILE_CT=32 / 64; with _NHWC_TILE=0 the
    register-persistent kernel, with CUDADOCTOR_OPS_BN_NHWC_PERSIST=0 the previous one,
    _PERSIST_ROWS=8 / 1 its widest / finest grid) or 0 (stats -> finalize -> apply, the finalize
    with one block per channel or, with CUDADOCTOR_OPS_BN_FIN_BLOCK=0, one warp; the statistics
    at 11 rows per thread with _NHWC_ROWS=11, pipelined or, with _STATS_PIPE=0, not); contiguous with CUDADOCTOR_OPS_BN_SINGLEREAD=1 (one block per channel
    held in shared memory), or without it CUDADOCTOR_OPS_BN_FUSED_NCHW=1 / 0 (one cooperative
    launch / stats -> apply). The switches are read once per process, hence a child."""
    env = dict(os.environ, **switches)
    proc = subprocess.run([sys.executable, "-c", _FUSED_CHILD, layout], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import json

    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(res) == 10
    for shape, (ey, egx, egw, egb, erm, erv, kept) in res.items():
        low = not ("3, 24" in shape or "2, 8" in shape or "4, 8, 64" in shape or "64, 1024" in shape)  # half / bf16
        tol = 3e-2 if low else 1e-4
        assert max(ey, egx, erm, erv) <= tol, (shape, ey, egx, erm, erv)
        assert max(egw, egb) <= tol * 10, (shape, egw, egb)
        assert kept, f"{shape}: output lost the input's layout"


_TILE_CHILD = textwrap.dedent(
    """
    import json, re, sys
    import torch
    import cudadoctor_ops
    from torch.profiler import ProfilerActivity, profile

    bn_op = torch.ops.cudadoctor_ops.batch_norm.default
    # channels_last shapes for the channel-tiled one-launch kernel: C a multiple of 64, of 32 only
    # (C = 200, 72: a partly idle last tile), fewer channels than one tile (24), rows fewer than a
    # block (2 * 5 * 7), float32 (4 channels per pack, C = 40)
    cases = [((64, 512, 7, 7), torch.float16), ((64, 256, 14, 14), torch.float16),
             ((8, 64, 56, 56), torch.bfloat16), ((2, 24, 5, 7), torch.float16),
             ((32, 200, 14, 14), torch.float32), ((16, 72, 28, 28), torch.bfloat16),
             ((64, 512, 7, 7), torch.float32), ((4, 40, 9, 9), torch.float32),
             # too many rows per thread for registers alone: the stash variant (16-bit types)
             ((40, 256, 28, 28), torch.float16), ((64, 64, 56, 56), torch.float16),
             ((64, 64, 56, 56), torch.bfloat16)]
    out = {}
    for shape, dtype in cases:
        c = shape[1]
        g = torch.Generator(device="cpu").manual_seed(0)
        x = (torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 0.5).to(dtype).cuda()
        x = x.contiguous(memory_format=torch.channels_last)
        x64 = x.double()
        mean = x64.mean((0, 2, 3))
        var = x64.var((0, 2, 3), unbiased=False)
        n = x.numel() // c
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            bn_op(x, None, None, None, None, True, 1e-5, "none")
            torch.cuda.synchronize()
        used = any("bn_tile_nhwc" in e.name for e in prof.events())
        # bn_tile_nhwc<T, CT, THREADS, MAXR, MB, ONCE, SR>: ONCE "true" merges each channel once,
        # SR > 0 keeps rows in shared memory
        targs = [re.search(r"bn_tile_nhwc<([^>]*)>", e.name) for e in prof.events()]
        targs = [[a.strip() for a in m.group(1).split(",")] for m in targs if m]
        once = any(a[5] == "true" for a in targs)
        stash = any(int(a[6]) > 0 for a in targs)
        for relu in (False, True):
            act = "relu" if relu else "none"
            for affine in (False, True):
                # running statistics: none, float32, the input's dtype
                for rs in (None, torch.float32, dtype):
                    w = b = None
                    if affine:
                        w = (torch.rand(c, generator=g, dtype=torch.float64) + 0.5).to(dtype).cuda()
                        b = (torch.randn(c, generator=g, dtype=torch.float64) * 0.3).to(dtype).cuda()
                    rm = rv = None
                    if rs is not None:
                        rm = (torch.randn(c, generator=g, dtype=torch.float64) * 0.1).to(rs).cuda()
                        rv = (torch.rand(c, generator=g, dtype=torch.float64) + 0.5).to(rs).cuda()
                        rm64, rv64 = rm.double(), rv.double()
                    xg = x.clone().requires_grad_(True)
                    wg = w.clone().requires_grad_(True) if affine else None
                    bg = b.clone().requires_grad_(True) if affine else None
                    y = cudadoctor_ops.batch_norm(xg, rm, rv, wg, bg, True, 0.3, 1e-5, activation=act)
                    # reference
                    xr = x64.clone().requires_grad_(True)
                    wr = w.double().requires_grad_(True) if affine else None
                    br = b.double().requires_grad_(True) if affine else None
                    yr = torch.nn.functional.batch_norm(xr, None, None, wr, br, True, 0.0, 1e-5)
                    if relu:
                        yr = torch.relu(yr)
                    gy = torch.randn(shape, generator=g, dtype=torch.float64).cuda()
                    ins = [xg] + ([wg, bg] if affine else [])
                    grads = torch.autograd.grad(y, ins, gy.to(dtype).contiguous(memory_format=torch.channels_last))
                    refs = torch.autograd.grad(yr, [xr] + ([wr, br] if affine else []), gy)
                    err = lambda a, e: ((a.double() - e).abs().max() / e.abs().max().clamp_min(1)).item()
                    r = {"y": err(y, yr), "gx": err(grads[0], refs[0])}
                    if affine:
                        r["gw"] = err(grads[1], refs[1])
                        r["gb"] = err(grads[2], refs[2])
                    if rs is not None:
                        r["rm"] = err(rm, 0.7 * rm64 + 0.3 * mean)
                        r["rv"] = err(rv, 0.7 * rv64 + 0.3 * var * n / (n - 1))
                    # the op's saved statistics (same kernel, no running statistics)
                    yo, sm, si, res = bn_op(x, w, b, None, None, True, 1e-5, act)
                    r["y_op"] = err(yo, yr)
                    r["save_mean"] = ((sm.double() - mean).abs() / (mean.abs() + var.sqrt())).max().item()
                    r["save_invstd"] = ((si.double() / (var + 1e-5).rsqrt()) - 1).abs().max().item()
                    # reserve: what save_mean's rounding lost, a rounding error of the data's scale
                    r["reserve"] = (res.double().abs() / (mean.abs() + var.sqrt())).max().item()
                    r["cl"] = bool(y.is_contiguous(memory_format=torch.channels_last)
                                   and yo.is_contiguous(memory_format=torch.channels_last))
                    out[f"{shape}-{str(dtype)[6:]}-{act}-affine{int(affine)}-rs{str(rs)[6:]}"] = r
        out[f"{shape}-{str(dtype)[6:]}-tile"] = used
        out[f"{shape}-{str(dtype)[6:]}-once"] = once
        out[f"{shape}-{str(dtype)[6:]}-stash"] = stash
    print(json.dumps(out))
    """
)

_TILE_SWITCHES = [
    {},
    {"CUDADOCTOR_OPS_BN_NHWC_TILE_CT": "32"},
    {"CUDADOCTOR_OPS_BN_NHWC_TILE_CT": "64"},
    {"CUDADOCTOR_OPS_BN_NHWC_TILE_SPLITS": "3"},
    {"CUDADOCTOR_OPS_BN_NHWC_TILE": "0"},
    {"CUDADOCTOR_OPS_BN_NHWC_TILE_MB": "4"},
    {"CUDADOCTOR_OPS_BN_NHWC_TILE_MB": "16"},
    {"CUDADOCTOR_OPS_BN_NHWC_TILE_ONCE": "1"},
    {"CUDADOCTOR_OPS_BN_NHWC_TILE_ONCE": "0"},
    {"CUDADOCTOR_OPS_BN_NHWC_TILE_STASH": "0"},
]


@pytest.mark.parametrize("switches", _TILE_SWITCHES,
                         ids=["default"] + ["-".join(f"{k[18:]}={v}" for k, v in sw.items()) for sw in _TILE_SWITCHES[1:]])
def test_tile_nhwc_forward_matches_float64(ops, switches):
    """The channel-tiled channels_last training forward (bn_tile_nhwc: one cooperative launch, one
    grid barrier) against float64 over shapes that fit it: output, running statistics (float32 or
    the input's dtype, or none), saved mean / invstd / reserve, gradients through the backward,
    with and without ReLU and affine parameters; with CUDADOCTOR_OPS_BN_NHWC_TILE_CT=32 / 64 (tile
    width forced), _SPLITS=3 (splits forced where 3 fit: several rows per thread), _MB=4 / 16
    (16-bit: partials per load batch of the merge; default 8), _ONCE=1 (each channel merged once,
    then a second grid barrier, where splits >= the tile width) and _NHWC_TILE=0 (the kernels before it, for
    comparison). The switches are read once per process,
    hence a child; the profiler tells which kernel ran."""
    env = dict(os.environ, **switches)
    env["PYTHONPATH"] = os.pathsep.join([str(pathlib.Path(ops.__file__).parents[1]), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _TILE_CHILD], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    import json

    res = json.loads(proc.stdout.strip().splitlines()[-1])
    tile_on = switches.get("CUDADOCTOR_OPS_BN_NHWC_TILE") != "0"
    once_set = switches.get("CUDADOCTOR_OPS_BN_NHWC_TILE_ONCE")
    stash_on = tile_on and switches.get("CUDADOCTOR_OPS_BN_NHWC_TILE_STASH") != "0"
    once_ran = [key for key, r in res.items() if key.endswith("-once") and r]
    stash_ran = [key for key, r in res.items() if key.endswith("-stash") and r]
    # (8,64,56,56) bfloat16: one tile of 64 over 25088 rows, >= 98 splits on any GPU that fits
    # it (>= 128 with 128 SMs or more, where ONCE is the default). The stash runs only where no
    # register-only grid fits, and then ONCE is forced only above 256 splits.
    small_once = [k for k in once_ran if not k.startswith(("(40, 256", "(64, 64, 56"))]
    # the stash is float16 only
    assert not [k for k in stash_ran if "bfloat16" in k], stash_ran
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ct = switches.get("CUDADOCTOR_OPS_BN_NHWC_TILE_CT")
    forced_splits = "CUDADOCTOR_OPS_BN_NHWC_TILE_SPLITS" in switches
    if once_set == "1" or (once_set is None and tile_on and sms >= 128 and ct != "32"
                           and not forced_splits):
        assert any(k.startswith("(8, 64, 56, 56)") for k in once_ran), once_ran
    elif once_set == "0" or not tile_on:
        assert not once_ran, once_ran
    elif ct == "32":
        # tiles of 32 take ONCE by default only above 256 splits
        assert not small_once, small_once
    if stash_on and "CUDADOCTOR_OPS_BN_NHWC_TILE_SPLITS" not in switches:
        # (40,256,28,28) float16: 10 rows per thread on 132 SMs, 17 on 80
        assert any(k.startswith("(40, 256") or k == "(64, 64, 56, 56)-float16-stash"
                   for k in stash_ran), stash_ran
    if not stash_on:
        assert not stash_ran, stash_ran
    for key, r in res.items():
        if key.endswith(("-once", "-stash")):
            continue
        if key.endswith("-tile"):
            # every shape here fits a resident grid on any GPU with cooperative launches, save the
            # two largest, which need ~128+ SMs
            if not tile_on:
                assert r is False, f"{key}: bn_tile_nhwc ran with CUDADOCTOR_OPS_BN_NHWC_TILE=0"
            elif "(2, 24" in key or "(4, 40" in key or "(16, 72" in key:
                assert r is True, f"{key}: bn_tile_nhwc did not run"
            continue
        low = key.split("-")[1] != "float32"  # the input's dtype (not the running statistics')
        tol = 3e-2 if low else 1e-4
        for k in ("y", "gx", "y_op", "rm", "rv"):
            if k in r:
                assert r[k] <= tol, (key, k, r[k])
        for k in ("gw", "gb"):
            if k in r:
                assert r[k] <= tol * 10, (key, k, r[k])
        # the saved statistics are float32 whatever the input: float32 accuracy on the exact input
        assert r["save_mean"] <= 1e-5, (key, r["save_mean"])
        assert r["save_invstd"] <= 1e-4, (key, r["save_invstd"])
        assert r["reserve"] <= 1e-6, (key, r["reserve"])
        assert r["cl"], f"{key}: output lost the channels_last layout"


_WIDE_CHILD = textwrap.dedent(
    """
    import json, re
    import torch
    import cudadoctor_ops
    from torch.profiler import ProfilerActivity, profile

    shape = (32, 64, 56, 56)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 0.5)
    x = x.to(torch.float16).cuda().contiguous(memory_format=torch.channels_last)
    w = (torch.rand(64, generator=g, dtype=torch.float64) + 0.5).float().cuda()
    b = (torch.randn(64, generator=g, dtype=torch.float64) * 0.3).float().cuda()
    rm = torch.zeros(64, device="cuda")
    rv = torch.ones(64, device="cuda")
    cudadoctor_ops.batch_norm(x, rm.clone(), rv.clone(), w, b, True, 0.1, 1e-5, activation="relu")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        y = cudadoctor_ops.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5, activation="relu")
        torch.cuda.synchronize()
    targs = [re.search(r"bn_tile_nhwc<([^>]*)>", e.name) for e in prof.events()]
    targs = [[a.strip() for a in m.group(1).split(",")] for m in targs if m]
    x64 = x.double()
    mean = x64.mean((0, 2, 3))
    var = x64.var((0, 2, 3), unbiased=False)
    n = x.numel() // 64
    yr = torch.relu((x64 - mean[None, :, None, None]) / (var[None, :, None, None] + 1e-5).sqrt()
                    * w.double()[None, :, None, None] + b.double()[None, :, None, None])
    out = {
        "kernels": targs,
        "y": ((y.double() - yr).abs().max() / yr.abs().max()).item(),
        "rm": ((rm.double() - 0.1 * mean).abs().max()).item(),
        "rv": ((rv.double() - (0.9 + 0.1 * var * n / (n - 1))).abs().max()).item(),
        "cl": y.is_contiguous(memory_format=torch.channels_last),
    }
    print(json.dumps(out))
    """
)


@pytest.mark.parametrize("wide", [None, "1", "0"], ids=["default", "WIDE=1", "WIDE=0"])
def test_tile_nhwc_grids_above_256_splits(ops, wide):
    """(32,64,56,56) float16 channels_last: one tile of 64 channels over 100352 rows fits <= 8 rows
    per thread only above 256 splits (>= 392 blocks). By default (and with
    CUDADOCTOR_OPS_BN_NHWC_TILE_WIDE=1) that grid runs with ONCE (each channel merged once);
    with =0 it is declined and the tiles of 32 run (two tiles, >= 196 splits). Output and running
    statistics against float64 either way. A GPU holding fewer than 392 blocks of the kernel runs
    the tiles of 32 in every setting, and then the wide cases skip."""
    env = dict(os.environ)
    for var in ("CUDADOCTOR_OPS_BN_NHWC_TILE_SPLITS", "CUDADOCTOR_OPS_BN_NHWC_TILE_CT",
                "CUDADOCTOR_OPS_BN_NHWC_TILE_ONCE", "CUDADOCTOR_OPS_BN_NHWC_TILE",
                "CUDADOCTOR_OPS_BN_NHWC_TILE_WIDE"):
        env.pop(var, None)
    if wide is not None:
        env["CUDADOCTOR_OPS_BN_NHWC_TILE_WIDE"] = wide
    env["PYTHONPATH"] = os.pathsep.join([str(pathlib.Path(ops.__file__).parents[1]), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _WIDE_CHILD], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    import json

    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["y"] <= 3e-2, res["y"]
    assert res["rm"] <= 1e-5 and res["rv"] <= 1e-4, (res["rm"], res["rv"])
    assert res["cl"]
    if not res["kernels"]:
        pytest.skip("the profiler recorded no bn_tile_nhwc kernel here")
    # <T, CT, THREADS, MAXR, MB, ONCE, SR>
    if wide == "0":
        assert all(k[1] == "32" for k in res["kernels"]), res["kernels"]
        return
    if all(k[1] == "32" for k in res["kernels"]):
        pytest.skip("this GPU holds fewer than 392 blocks of bn_tile_nhwc: the tiles of 32 ran")
    assert all(k[1] == "64" and k[5] == "true" and k[6] == "0" for k in res["kernels"]), res["kernels"]


class _Passthrough(TorchDispatchMode):
    """Runs every op unchanged; its presence makes batch_norm take the dispatched two-op path."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_eager_update_matches_the_dispatched_path(ops, layout, dtype):
    """Eager training calls update the running statistics inside the forward's launch; under a
    dispatch mode (as under torch.compile or opcheck) the ops batch_norm + batch_norm_update_stats
    run instead. Both give the same output and running statistics, and both bump the running
    statistics' version counters."""
    x, w, b, rm, rv = make((8, 16, 9, 9), dtype, layout, pdtype=torch.float32, loc=2.0)
    rm0, rv0 = rm.clone(), rv.clone()
    rm2, rv2 = rm.clone(), rv.clone()
    versions = (rm._version, rv._version)
    y1 = ops.batch_norm(x, rm, rv, w, b, True, 0.3, 1e-5, activation="relu")
    assert rm._version > versions[0] and rv._version > versions[1]
    with _Passthrough():
        y2 = ops.batch_norm(x, rm2, rv2, w, b, True, 0.3, 1e-5, activation="relu")
    assert torch.equal(y1, y2)
    torch.testing.assert_close(rm, rm2, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rv, rv2, rtol=1e-5, atol=1e-6)
    _, erm, erv = reference(x, rm0, rv0, w, b, True, 0.3, 1e-5, "relu")
    close(rm, erm, torch.float32, what="running_mean")
    close(rv, erv, torch.float32, what="running_var")


def test_eval_with_running_stats_of_two_dtypes(ops):
    """Half input, running_mean in float32 and running_var in float16 (each may be either)."""
    x, w, b, rm, rv = make((4, 8, 5, 5), torch.float16, "nchw", pdtype=torch.float32)
    rv16 = rv.half()
    y = ops.batch_norm(x, rm, rv16, w, b, False, 0.1, 1e-5)
    ey, _, _ = reference(x, rm, rv16.float(), w, b, False, 0.1, 1e-5, "none")
    close(y, ey, torch.float16, what="eval output")


def test_bad_momentum_writes_nothing(ops):
    x, w, b, rm, rv = make((4, 8, 5, 5), torch.float32, "nchw")
    before = (rm.clone(), rv.clone())
    for bad in (float("nan"), float("inf"), None):
        with pytest.raises(ValueError, match="momentum must be a finite float"):
            ops.batch_norm(x, rm, rv, w, b, True, bad, 1e-5)
    assert torch.equal(rm, before[0]) and torch.equal(rv, before[1])
