"""Smoke cases of cudadoctor-ops, read by `cudadoctor smoke` (and usable by any test harness).

Each case is a dict: ``name`` ("op/variant"), ``op`` (table row), ``inputs()`` -> tuple of CPU
tensors (tiny: a few hundred elements, odd sizes so vector paths meet scalar tails), ``run(*inputs)``
-> the op's outputs with the inputs moved to the GPU, ``reference(*inputs)`` -> the same from plain
torch ops on CPU copies in float64, and ``atol`` / ``rtol``. Backward cases call ``backward``
themselves and return the gradients. Ops missing from this build get no cases.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["smoke_cases"]

_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2), torch.bfloat16: (6e-2, 3e-2)}


def _randn(*shape, dtype=torch.float32, channels_last=False, requires_grad=False, scale=1.0, shift=0.0):
    t = (torch.randn(*shape, dtype=torch.float64) * scale + shift).to(dtype)
    if channels_last:
        t = t.contiguous(memory_format=torch.channels_last if len(shape) == 4 else torch.channels_last_3d)
    return t.requires_grad_(requires_grad)


def _d(t):
    """A float64 leaf copy keeping requires_grad (for references)."""
    if t is None:
        return None
    return t.detach().double().requires_grad_(t.requires_grad)


def _grads(*ts):
    return tuple(t.grad for t in ts if t is not None)


# --- batch_norm ---------------------------------------------------------------------------------


def _bn_case(name, shape, *, training, backward, dtype=torch.float32, channels_last=False, activation="none",
             affine=True):
    c = shape[1]
    pdtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype

    def inputs():
        x = _randn(*shape, dtype=dtype, channels_last=channels_last, requires_grad=backward, shift=0.5)
        w = _randn(c, dtype=pdtype, requires_grad=backward and affine, scale=0.5, shift=1.0) if affine else None
        b = _randn(c, dtype=pdtype, requires_grad=backward and affine, scale=0.5) if affine else None
        rm = _randn(c, dtype=pdtype, scale=0.1)
        rv = _randn(c, dtype=pdtype, scale=0.1).abs() + 0.5
        g = _randn(*shape, dtype=dtype, channels_last=channels_last)
        return x, w, b, rm, rv, g

    def run(x, w, b, rm, rv, g):
        import cudadoctor_ops

        y = cudadoctor_ops.batch_norm(x, rm, rv, w, b, training=training, momentum=0.1, eps=1e-5,
                                      activation=activation)
        if not backward:
            return y, rm, rv
        y.backward(g)
        return _grads(x, *(t for t in (w, b) if t is not None)) + (rm, rv)

    def reference(x, w, b, rm, rv, g):
        x64, w64, b64, rm64, rv64 = _d(x), _d(w), _d(b), rm.double(), rv.double()
        y = F.batch_norm(x64, rm64, rv64, w64, b64, training=training, momentum=0.1, eps=1e-5)
        if activation == "relu":
            y = F.relu(y)
        if not backward:
            return y, rm64, rv64
        y.backward(g.double())
        return _grads(x64, *(t for t in (w64, b64) if t is not None)) + (rm64, rv64)

    atol, rtol = _TOL[dtype]
    return {"name": f"batch_norm/{name}", "op": "batch_norm", "inputs": inputs, "run": run,
            "reference": reference, "atol": atol, "rtol": rtol}


def _batch_norm_cases():
    return [
        _bn_case("train_fwd", (4, 3, 5, 7), training=True, backward=False),
        _bn_case("eval_fwd", (4, 3, 5, 7), training=False, backward=False),
        _bn_case("train_fwd_3d_input", (5, 6, 9), training=True, backward=False),
        _bn_case("train_fwd_relu_channels_last_fp16", (3, 8, 5, 5), training=True, backward=False,
                 dtype=torch.float16, channels_last=True, activation="relu"),
        _bn_case("train_bwd", (4, 3, 5, 7), training=True, backward=True),
        _bn_case("eval_bwd", (4, 3, 5, 7), training=False, backward=True),
        _bn_case("train_bwd_relu_channels_last", (2, 8, 3, 5), training=True, backward=True,
                 channels_last=True, activation="relu"),
        _bn_case("train_bwd_no_affine_bf16", (2, 4, 6, 6), training=True, backward=True, dtype=torch.bfloat16,
                 affine=False),
        # channels_last 16-bit without ReLU: bn_bwd_tile_nhwc (one grid barrier), 72 channels in
        # tiles of 32, the last one partly idle
        _bn_case("train_bwd_channels_last_fp16", (4, 72, 5, 7), training=True, backward=True,
                 dtype=torch.float16, channels_last=True),
        # more rows than a resident grid holds in registers (132,300 rows of 8 channels): on an
        # H200 bn_bwd_tile_nhwc keeps a row per thread in shared memory, filled by cp.async
        _bn_case("train_bwd_channels_last_fp16_stash", (3, 8, 210, 210), training=True, backward=True,
                 dtype=torch.float16, channels_last=True),
        # more rows than registers and shared memory hold (270,000 rows of 8 channels): on an H200
        # the streamed bn_bwd_tile_nhwc, which reads the 17th row of some threads twice
        _bn_case("train_bwd_channels_last_fp16_streamed", (3, 8, 300, 300), training=True, backward=True,
                 dtype=torch.float16, channels_last=True),
    ]


# --- depthwise_conv2d ---------------------------------------------------------------------------


def _dw_case(name, n, c, h, w, k, *, stride=1, padding=None, dilation=1, mult=1, backward=False,
             dtype=torch.float32, channels_last=False):
    pad = k // 2 if padding is None else padding

    def inputs():
        x = _randn(n, c, h, w, dtype=dtype, channels_last=channels_last, requires_grad=backward)
        wt = _randn(c * mult, 1, k, k, dtype=dtype, requires_grad=backward)
        b = _randn(c * mult, dtype=dtype, requires_grad=backward)
        return x, wt, b

    def run(x, wt, b):
        import cudadoctor_ops

        y = cudadoctor_ops.depthwise_conv2d(x, wt, b, stride, pad, dilation)
        if not backward:
            return y
        torch.manual_seed(1)
        g = torch.randn(y.shape, dtype=torch.float64).to(y.dtype).to(y.device)
        y.backward(g)
        return _grads(x, wt, b)

    def reference(x, wt, b):
        x64, w64, b64 = _d(x), _d(wt), _d(b)
        y = F.conv2d(x64, w64, b64, stride, pad, dilation, groups=c)
        if not backward:
            return y
        torch.manual_seed(1)
        g = torch.randn(y.shape, dtype=torch.float64).to(dtype).double()
        y.backward(g)
        return _grads(x64, w64, b64)

    atol, rtol = _TOL[dtype]
    if backward and dtype != torch.float32:
        atol, rtol = atol * 4, rtol * 4
    return {"name": f"depthwise_conv2d/{name}", "op": "depthwise_conv2d", "inputs": inputs, "run": run,
            "reference": reference, "atol": atol, "rtol": rtol}


def _depthwise_cases():
    return [
        _dw_case("fwd_3x3", 2, 8, 9, 10, 3),
        _dw_case("fwd_5x5_s2_channels_last", 2, 8, 11, 9, 5, stride=2, channels_last=True),
        _dw_case("fwd_7x7_fp16", 1, 16, 13, 11, 7, dtype=torch.float16),
        _dw_case("fwd_direct_dilated_mult2", 2, 4, 9, 8, 3, dilation=2, mult=2, padding=2),
        _dw_case("bwd_3x3", 2, 8, 9, 10, 3, backward=True),
        _dw_case("bwd_3x3_s2_channels_last_bf16", 2, 8, 10, 9, 3, stride=2, backward=True,
                 dtype=torch.bfloat16, channels_last=True),
        _dw_case("bwd_direct_4x4", 1, 8, 12, 12, 4, padding=2, backward=True),
        # float32 NCHW with W % 4 == 0 and 16-byte aligned planes at stride 1: 3x3 runs the warp
        # kernel (fwd_nchw_shfl: columns from neighbouring lanes by shuffles; W = 136 is two
        # 128-column segments), 5x5 the cp.async tile kernel (4 output columns per thread), each
        # forward and, on the flipped filter, for the input gradient; W = 10 above takes the
        # element-load kernels
        _dw_case("fwd_3x3_warp_shfl", 2, 8, 12, 16, 3),
        _dw_case("bwd_3x3_warp_shfl_two_segments", 1, 8, 9, 136, 3, backward=True),
        _dw_case("bwd_5x5_cp_async", 1, 8, 10, 16, 5, backward=True),
        # channels_last float16/bfloat16: the shared-memory tile kernel (nhwc_v3), odd sizes
        _dw_case("fwd_3x3_channels_last_fp16", 2, 24, 30, 37, 3, dtype=torch.float16, channels_last=True),
        _dw_case("fwd_5x5_channels_last_bf16", 1, 16, 17, 19, 5, dtype=torch.bfloat16, channels_last=True),
        _dw_case("fwd_7x7_s2_channels_last_fp16", 1, 8, 15, 13, 7, stride=2, dtype=torch.float16,
                 channels_last=True),
        # channels_last 16-bit stride-1 backward: the shared-memory weight gradient (wgrad_nhwc_v3).
        # 3x3 with all taps per thread: 7x7 planes of 9 channel groups x 64 images, more units than
        # one wave of blocks on an H200, so units of several images; 28x28 in two bands of 14 rows
        # (57.7 KB of shared memory, above the 48 KB default); 5x5 with one kernel row per thread
        # and a second channel group 8 channels wide
        _dw_case("bwd_3x3_channels_last_fp16_wgrad_images", 64, 288, 7, 7, 3, backward=True,
                 dtype=torch.float16, channels_last=True),
        # 3x3 stride 1 on 7x7 planes of 64 x 960 channels: the forward and, on the flipped filter,
        # the input gradient on nhwc_v4's configuration 5 (blocks from the wave planner)
        _dw_case("bwd_3x3_channels_last_fp16_7x7_one_wave", 64, 960, 7, 7, 3, backward=True,
                 dtype=torch.float16, channels_last=True),
        _dw_case("bwd_3x3_channels_last_bf16_wgrad_two_bands", 2, 64, 28, 28, 3, backward=True,
                 dtype=torch.bfloat16, channels_last=True),
        _dw_case("bwd_5x5_channels_last_fp16_wgrad_smem", 3, 40, 14, 14, 5, backward=True,
                 dtype=torch.float16, channels_last=True),
    ]


# --- conv_bn_relu -------------------------------------------------------------------------------


def _cbr_case(name, n, cin, cout, h, w, k, *, training, backward, groups=1, stride=1, dtype=torch.float32,
              channels_last=False, conv_bias=True, eval_impl="auto", tf32=None, residual=False):
    pad = k // 2
    ho, wo = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
    # TF32 products (the "tf32" inference kernel; float32 training on the TF32 kernel from 56x56):
    # allowed for this case only, with TF32's tolerance
    tf32 = eval_impl == "tf32" if tf32 is None else tf32

    def inputs():
        x = _randn(n, cin, h, w, dtype=dtype, channels_last=channels_last, requires_grad=backward)
        cw = _randn(cout, cin // groups, k, k, dtype=dtype, requires_grad=backward, scale=0.3)
        cb = _randn(cout, dtype=dtype, requires_grad=backward, scale=0.1) if conv_bias else None
        bw = _randn(cout, requires_grad=backward, scale=0.5, shift=1.0)
        bb = _randn(cout, requires_grad=backward, scale=0.5)
        rm = _randn(cout, scale=0.1)
        rv = _randn(cout, scale=0.1).abs() + 0.5
        # the residual (relu(bn(conv(x)) + r), a ResNet block's tail), in the output's layout
        r = (_randn(n, cout, ho, wo, dtype=dtype, channels_last=channels_last, requires_grad=backward)
             if residual else None)
        return x, cw, cb, bw, bb, rm, rv, r

    def run(x, cw, cb, bw, bb, rm, rv, r):
        import cudadoctor_ops

        torch.backends.cudnn.allow_tf32 = tf32  # else full fp32 convolutions, compared with the reference
        torch.backends.cuda.matmul.allow_tf32 = False
        g = incoming(x, cw, cb, bw, bb, rm, rv, r) if backward else None
        y = cudadoctor_ops.conv_bn_relu(x, cw, cb, bw, bb, rm, rv, training, 0.1, 1e-5, stride, pad, 1, groups,
                                        eval_impl=eval_impl, residual=r)
        if not backward:
            return y, rm, rv
        y.backward(g.to(y.dtype).to(y.device))
        return _grads(x, cw, cb, bw, bb, r) + (rm, rv)

    def incoming(x, cw, cb, bw, bb, rm, rv, r):
        # the output's gradient (float64 values that `dtype` holds exactly), zero where float64's
        # BatchNorm output lies within `kink` of the ReLU's kink: there a 16-bit (or TF32) forward's
        # mask and float64's may disagree, which moves every gradient by a full term (a few of a
        # million elements do)
        with torch.no_grad():
            z = F.batch_norm(F.conv2d(_d(x), _d(cw), _d(cb), stride, pad, 1, groups), rm.double(), rv.double(),
                             _d(bw), _d(bb), training=training, momentum=0.0, eps=1e-5)
            if r is not None:
                z = z + r.detach().double().to(z.device)
        torch.manual_seed(1)
        g = torch.randn(z.shape, dtype=torch.float64).to(dtype).double()
        kink = {torch.float16: 1e-2, torch.bfloat16: 5e-2}.get(dtype, 1e-2 if tf32 else 0.0)
        return torch.where(z.abs().cpu() > kink, g, torch.zeros_like(g)) if kink else g

    def reference(x, cw, cb, bw, bb, rm, rv, r):
        x64, cw64, cb64, bw64, bb64, r64 = (_d(t) for t in (x, cw, cb, bw, bb, r))
        rm64, rv64 = rm.double(), rv.double()
        z = F.batch_norm(F.conv2d(x64, cw64, cb64, stride, pad, 1, groups), rm64, rv64, bw64, bb64,
                         training=training, momentum=0.1, eps=1e-5)
        y = F.relu(z if r64 is None else z + r64)
        if not backward:
            return y, rm64, rv64
        y.backward(incoming(x, cw, cb, bw, bb, rm, rv, r).to(y.device))
        return _grads(x64, cw64, cb64, bw64, bb64, r64) + (rm64, rv64)

    atol, rtol = (1e-3, 1e-3) if tf32 else _TOL[dtype]
    return {"name": f"conv_bn_relu/{name}", "op": "conv_bn_relu", "inputs": inputs, "run": run,
            "reference": reference, "atol": atol * 10, "rtol": rtol * 10}


def _conv_bn_relu_cases():
    return [
        _cbr_case("train_fwd", 2, 4, 8, 7, 9, 3, training=True, backward=False),
        _cbr_case("eval_fwd", 2, 4, 8, 7, 9, 3, training=False, backward=False),
        _cbr_case("train_bwd", 2, 4, 8, 7, 9, 3, training=True, backward=True),
        # one block per channel (C >= the SM count of current GPUs) over 7x7 planes: the rows of
        # neighbouring channels share mask words (zeroed first, then atomicOr)
        _cbr_case("train_bwd_one_block_per_channel", 2, 4, 160, 7, 7, 3, training=True, backward=True),
        _cbr_case("train_fwd_depthwise_channels_last", 2, 8, 8, 9, 9, 3, training=True, backward=False,
                  groups=8, channels_last=True),
        # channels_last float16: the backward on bn_bwd_tile_nhwc with the mask (a tile of 64). No
        # conv bias: against the float64 reference a bias shifts the 16-bit convolution output and
        # its rounding then shows in the batch statistics beyond float16's tolerance (on torch's
        # Conv2d -> BatchNorm2d -> ReLU as on ours)
        _cbr_case("train_bwd_channels_last_fp16", 2, 8, 64, 7, 9, 3, training=True, backward=True,
                  dtype=torch.float16, channels_last=True, conv_bias=False),
        # the same with rows in shared memory (see batch_norm's stash case): the masked backward
        _cbr_case("train_bwd_channels_last_fp16_stash", 3, 8, 8, 210, 210, 3, training=True, backward=True,
                  dtype=torch.float16, channels_last=True, conv_bias=False),
        # float32 NCHW 3x3 inference on the direct TF32 kernel: rows of 12 floats (16-byte loads)
        # and of 9 (one float each); 64 / 128 output channels (one / two blocks of 64), tiles that
        # end past the image
        _cbr_case("eval_fwd_tf32", 2, 8, 64, 7, 12, 3, training=False, backward=False, eval_impl="tf32"),
        _cbr_case("eval_fwd_tf32_odd_rows", 1, 16, 128, 11, 9, 3, training=False, backward=False,
                  eval_impl="tf32"),
        # float32 NCHW training on 56x56 with TF32 allowed: the convolution on the TF32 kernel
        # without its ReLU, then the BatchNorm kernels, and the backward
        _cbr_case("train_bwd_tf32", 1, 8, 64, 56, 56, 3, training=True, backward=True, tf32=True),
        # Conv -> BN -> + residual -> ReLU (a ResNet block's tail): float32 NCHW with odd planes,
        # channels_last float16, and eval (the folded convolution, then the sum and the ReLU). The
        # float16 case convolves 3x3, not 1x1 as ResNet's tails do: initcheck does not see cuDNN's
        # 1x1 kernels on sm_90 initialise their output and flags every later read of it, torch's
        # own kernels' included (scripts/initcheck_probe.py); the kernels after the convolution
        # are the same for both
        _cbr_case("train_bwd_residual", 2, 4, 8, 7, 9, 3, training=True, backward=True, residual=True),
        _cbr_case("train_bwd_residual_channels_last_fp16", 2, 8, 16, 6, 10, 3, training=True, backward=True,
                  dtype=torch.float16, channels_last=True, conv_bias=False, residual=True),
        _cbr_case("eval_fwd_residual", 2, 4, 8, 7, 9, 3, training=False, backward=False, residual=True),
        # a channels_last tail past the one-launch backward kernels (a 34.1 MB float32 output): the
        # backward's three launches, whose apply kernel (bn_bwd_apply_nhwc) also writes the
        # residual's gradient. Depthwise, so that the sanitizers spend their time on these kernels
        # rather than on a large convolution
        _cbr_case("train_bwd_residual_channels_last_three_launch", 2, 8, 8, 730, 730, 3, training=True,
                  backward=True, groups=8, channels_last=True, conv_bias=False, residual=True),
    ]


def smoke_cases() -> list[dict]:
    """Cases for every op this build provides."""
    import cudadoctor_ops

    cases: list[dict] = []
    if hasattr(cudadoctor_ops, "batch_norm"):
        cases += _batch_norm_cases()
    if hasattr(cudadoctor_ops, "depthwise_conv2d"):
        cases += _depthwise_cases()
    if hasattr(cudadoctor_ops, "conv_bn_relu"):
        cases += _conv_bn_relu_cases()
    return cases
