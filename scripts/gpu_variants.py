"""Kernel choices of cudadoctor_ops timed side by side, one child process per environment setting
(the switches are read once per process), against torch in the same child.

    python scripts/gpu_variants.py [bn] [cbr] [cbrb] [dw] [dwb]

    bn   BatchNorm channels_last training forward (CUDADOCTOR_OPS_BN_NHWC_TILE_STASH=0, _ONCE=0)
    bnf  the same forward, eager and CUDA-graph replay, on the shapes of the three-kernel path
         (CUDADOCTOR_OPS_BN_FIN_BLOCK=0: one warp per channel in the finalize)
    bns  the same forward and shapes, CUDADOCTOR_OPS_BN_STATS_PIPE=0 / 2 (the statistics kernel without
         its pipelined loop / with groups of 2 rows instead of 4), and float16 built for other
         blocks per SM (CUDADOCTOR_OPS_BN_STATS_MB: 4 rows at 2, 2 rows at 3)
    bnp  BatchNorm channels_last float16 training backward, eager and CUDA-graph replay
         (CUDADOCTOR_OPS_BN_BWD_TILE_STASH=0: bn_bwd_tile_nhwc only where registers hold every
         row; CUDADOCTOR_OPS_BN_BWD_TILE_CT=32: its tiles of 32 channels everywhere;
         CUDADOCTOR_OPS_BN_BWD_TILE=0: without bn_bwd_tile_nhwc, i.e. the one-launch
         bn_bwd_fused_nhwc up to 32 MiB; CUDADOCTOR_OPS_BN_BWD_GROUPS=0: bn_bwd_tile_nhwc without
         its group partials)
    bnnr the same backward with CUDADOCTOR_OPS_BN_BWD_NR=0 (the channels-last reduce and apply
         kernels that test for ReLU at run time, 2 blocks per SM), CUDADOCTOR_OPS_BN_FIN_BLOCK=0
         (one warp per channel in the finalize)
    cbr  Conv+BN+ReLU training forward and fwd+bwd, channels_last 16-bit (CUDADOCTOR_OPS_BN_NHWC_TILE_WIDE=0,
         _STASH=0, CUDADOCTOR_OPS_CBR_TILE=0)
    cbra Conv+BN+ReLU training forward (eager and CUDA-graph replay) and fwd+bwd (graph) on the
         channels-last blocks of CBR_CASES, default against CUDADOCTOR_OPS_CBR_APPLY_V5=0 (the
         apply from sums computing its coefficients in every thread, cbr_apply_sums_nhwc_v3) and
         CUDADOCTOR_OPS_BN_BWD_GROUPS=0 (the masked backward's bn_bwd_tile_nhwc without group
         partials), each twice, interleaved
    cbrb Conv+BN+ReLU fwd+bwd in CUDA-graph replay on the channels-last blocks of CBR_CASES
         (CUDADOCTOR_OPS_BN_BWD_TILE_STASH=0 / _CT=32 as for bnp; CUDADOCTOR_OPS_BN_BWD_TILE=0: the
         masked backward on bn_bwd_fused_nhwc instead of bn_bwd_tile_nhwc)
    cbrst Conv+BN+ReLU fwd+bwd in CUDA-graph replay on blocks whose outputs are past the stash of
         bn_bwd_tile_nhwc, default against CUDADOCTOR_OPS_BN_BWD_STREAM=1 (the masked backward on
         its streamed variant), each twice, interleaved
    cbrs the same on the bench's fp16 and bf16 blocks, eager, CUDA-graph replay and host time per
         call, with the batch statistics from cuDNN's convolution epilogue
         (CUDADOCTOR_OPS_CBR_CUDNN_STATS=1; with CUDADOCTOR_OPS_CBR_SUMS_FUSED=0 the finalize +
         apply pair); the row names say which backend (c++ / python) ran and how often
    dw   depthwise channels_last forward (CUDADOCTOR_OPS_DW_V4*, against impl=nhwc_v3 and v2)
    dwb  depthwise channels_last backward dX + dW (CUDADOCTOR_OPS_DW_WGRAD_SMEM=0 / 1; CUDADOCTOR_OPS_DW_WGRAD_V1 /
         _DGRAD_V1 / _V4)
    dw7  depthwise channels-last 3x3 stride-1 layers on 7x7 planes (and two 14x14 ones, which
         configuration 5 leaves alone), forward and backward (dX + dW), the automatic choice:
         default (configuration 5, the wave planner, on 7x7 planes) against
         CUDADOCTOR_OPS_DW_V4_CFG=1 (the choice before it there) and =4, and against
         CUDADOCTOR_OPS_DW_V4_WAVE_CB=18 / 9 (blocks of 18 / 9 channel vectors where balanced);
         default and CFG=1 twice, interleaved
    dw7q the same layers, default against CUDADOCTOR_OPS_DW_V4_CFG=1 only, each twice, interleaved
    dwb4 the same backward, default against CUDADOCTOR_OPS_DW_V4_CFG=4 (the stride-1 input gradient
         runs the forward kernel on the flipped filter, here with groups of 7 columns)
    dwn  depthwise float32 NCHW forward and backward (dX + dW) on the issue's target shapes
         (default, then fwd_nchw_v2 with CUDADOCTOR_OPS_DW_V2_SHFL=0 and: 2-row tiles forced; CUDADOCTOR_OPS_DW_V2_COLV=0: strided columns
         instead of 4 consecutive ones per thread at stride 1; CUDADOCTOR_OPS_DW_V2_LEAN=1: the cp.async kernel's LEAN
         build, which runs only with COLV=0 at stride 1;
         also settable: CUDADOCTOR_OPS_DW_V2_ASYNC=0 (tiles staged through registers),
         _ROWS=8 / 4 / 2 (4 for float32 only))
    bnst BatchNorm channels_last float16 / bfloat16 backward (no ReLU, all gradients), eager and
         CUDA-graph replay, on tensors past the stash of bn_bwd_tile_nhwc: default (its streamed
         variant up to 128 MiB) against CUDADOCTOR_OPS_BN_BWD_STREAM=0 (bn_bwd_fused_nhwc up to 32
         MiB, else reduce -> finalize -> apply), each twice, interleaved
    dwn4 the same float32 NCHW cases, default against CUDADOCTOR_OPS_DW_V2_ROWS=4, each setting twice
         (interleaved)
    dwh  depthwise channels_last forward (the automatic choice only), default against
         CUDADOCTOR_OPS_DW_V4_HOIST=0 / 1 (nhwc_v4's first kernel row loaded before or after the
         weight barrier everywhere), each twice, interleaved
    dwbh the same settings for the channels-last backward
    dwsh the float32 NCHW forward cases of dwn, CUDADOCTOR_OPS_DW_V2_SHFL=0 (fwd_nchw_v2) / 4 / 8
         (fwd_nchw_shfl: a warp per 4 / 8 rows x 128 columns, no shared memory; 4 is the 3x3
         default), each twice, interleaved
    dww  depthwise channels_last weight gradient alone (CUDADOCTOR_OPS_DW_WGRAD_SMEM=0 / 1, _PF), against
         torch's convolution_backward for the weight alone
    dwv3 the layers of the shared-memory weight gradient (stride 1, planes up to 32x32), backward
         (dX + dW) and weight gradient alone: default against CUDADOCTOR_OPS_DW_WGRAD_V3_IMGS=1 (one
         image per unit where a band is the whole image), _AK=0 with _IMGS=1 (one kernel row per
         thread, one image per unit: the kernel before both), then default again (also settable:
         _IMGS=2.., _DB=1, _KB, _UPB)
    dwv3q the same layers, default against _IMGS=1 only
    hmma the 16-bit channels_last 3x3 convolution on the tensor-core kernel (csrc/conv3x3_hmma.cu)
         against cuDNN, per layer (Conv+BN+ReLU's two headline blocks, ResNet-50's stride-1 3x3
         layers at batch 64, float16 and bfloat16): conv + ReLU (conv_bias_relu impl 3 against
         impl 0, same child), and the Conv+BN+ReLU training forward and fwd+bwd in CUDA graphs
         against eager, default against CUDADOCTOR_OPS_CBR_HMMA_TRAIN=1, each twice, interleaved
    dwv5 the 5x5 layers of dwv3: default (all 25 taps per thread where that grid fits one wave,
         else one kernel row per thread) against _AK=1 (one kernel row per thread for 5x5, 48 KB),
         _AK=2 (all taps per thread for every 5x5 launch, 96 KB), then default again

Each line: the case, then ms per setting and torch's ms, and the ratio torch / ours per setting.
Timing as the bench (cudadoctor_ops.bench.Timer: triton do_bench medians, L2 flush before each
call). A setting whose result differs from torch's beyond the bench tolerance is marked "!".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

BN_SHAPES = [(64, 512, 7, 7), (64, 256, 14, 14), (64, 512, 14, 14), (64, 128, 28, 28),
             (64, 256, 28, 28), (64, 1024, 14, 14), (64, 2048, 7, 7), (64, 64, 56, 56),
             (64, 128, 56, 56), (256, 64, 56, 56), (64, 64, 112, 112), (64, 256, 56, 56)]
BN_SETTINGS = [{}, {"CUDADOCTOR_OPS_BN_NHWC_TILE_STASH": "0"}, {"CUDADOCTOR_OPS_BN_NHWC_TILE_ONCE": "0"}]
BNF_SHAPES = [(256, 64, 56, 56), (64, 64, 112, 112), (64, 256, 56, 56), (64, 128, 56, 56)]
BNF_SETTINGS = [{}, {"CUDADOCTOR_OPS_BN_FIN_BLOCK": "0"}]
BNS_SETTINGS = [{}, {"CUDADOCTOR_OPS_BN_STATS_PIPE": "0"}, {"CUDADOCTOR_OPS_BN_STATS_PIPE": "2"},
                {"CUDADOCTOR_OPS_BN_STATS_PIPE": "4", "CUDADOCTOR_OPS_BN_STATS_MB": "2"},
                {"CUDADOCTOR_OPS_BN_STATS_PIPE": "2", "CUDADOCTOR_OPS_BN_STATS_MB": "3"}]
# the backward's shapes: register-only tile grids, the stash (6.4M elements), and 12.8M (neither)
BNP_SHAPES = [(64, 256, 14, 14), (64, 512, 7, 7), (64, 128, 28, 28), (32, 64, 56, 56), (64, 512, 14, 14),
              (64, 64, 56, 56)]
BNP_SETTINGS = [{}, {"CUDADOCTOR_OPS_BN_BWD_TILE_STASH": "0"}, {"CUDADOCTOR_OPS_BN_BWD_TILE_CT": "32"},
                {"CUDADOCTOR_OPS_BN_BWD_TILE": "0"}, {"CUDADOCTOR_OPS_BN_BWD_GROUPS": "0"}]
BNNR_SETTINGS = [{}, {"CUDADOCTOR_OPS_BN_FIN_BLOCK": "0"}, {"CUDADOCTOR_OPS_BN_BWD_NR": "0"}]
BNST_SHAPES = [(64, 64, 56, 56), (64, 256, 28, 28), (64, 1024, 14, 14), (64, 128, 56, 56), (64, 512, 28, 28),
               (256, 64, 56, 56), (64, 64, 112, 112), (64, 256, 56, 56)]
_ST0 = {"CUDADOCTOR_OPS_BN_BWD_STREAM": "0"}
BNST_SETTINGS = [{}, _ST0, {}, _ST0]
CBR_CASES = [((32, 64, 56, 56), 64, "float16"), ((64, 128, 28, 28), 128, "bfloat16"),
             ((64, 64, 56, 56), 64, "bfloat16"), ((64, 256, 14, 14), 256, "bfloat16"),
             ((64, 512, 7, 7), 512, "bfloat16")]
CBR_SETTINGS = [{}, {"CUDADOCTOR_OPS_BN_NHWC_TILE_WIDE": "0"}, {"CUDADOCTOR_OPS_BN_NHWC_TILE_STASH": "0"},
                {"CUDADOCTOR_OPS_CBR_TILE": "0"}]
_V50 = {"CUDADOCTOR_OPS_CBR_APPLY_V5": "0"}
_G0 = {"CUDADOCTOR_OPS_BN_BWD_GROUPS": "0"}
CBRA_SETTINGS = [{}, _V50, _G0, {}, _V50, _G0]
CBRB_SETTINGS = [{}, {"CUDADOCTOR_OPS_BN_BWD_TILE_STASH": "0"}, {"CUDADOCTOR_OPS_BN_BWD_TILE_CT": "32"},
                 {"CUDADOCTOR_OPS_BN_BWD_TILE": "0"}]
# cbrst: Conv+BN+ReLU blocks whose outputs are past bn_bwd_tile_nhwc's stash (12.8M and 25.7M
# elements), fwd+bwd in CUDA-graph replay, default (the masked backward on bn_bwd_fused_nhwc /
# reduce -> finalize -> apply) against CUDADOCTOR_OPS_BN_BWD_STREAM=1 (on the streamed tile
# kernel), each twice, interleaved
CBRST_CASES = [((64, 64, 56, 56), 64, "bfloat16"), ((64, 64, 56, 56), 64, "float16"),
               ((64, 128, 56, 56), 128, "bfloat16"), ((64, 256, 28, 28), 256, "float16")]
_ST1 = {"CUDADOCTOR_OPS_BN_BWD_STREAM": "1"}
CBRST_SETTINGS = [{}, _ST1, {}, _ST1]
CBRS_SETTINGS = [{}, {"CUDADOCTOR_OPS_CBR_CUDNN_STATS": "1"},
                 {"CUDADOCTOR_OPS_CBR_CUDNN_STATS": "1", "CUDADOCTOR_OPS_CBR_SUMS_FUSED": "0"}]
DW_SETTINGS = [{}, {"CUDADOCTOR_OPS_DW_V4_CFG": "1"}, {"CUDADOCTOR_OPS_DW_V4_CFG": "3"},
               {"CUDADOCTOR_OPS_DW_V4_CFG": "4"}]
# the settings of fwd_nchw_v2 itself, with CUDADOCTOR_OPS_DW_V2_SHFL=0 (3x3 runs fwd_nchw_shfl by default)
_NOSH = {"CUDADOCTOR_OPS_DW_V2_SHFL": "0"}
DWN_SETTINGS = [{}, _NOSH, {"CUDADOCTOR_OPS_DW_V2_ROWS": "2", **_NOSH}, {"CUDADOCTOR_OPS_DW_V2_COLV": "0", **_NOSH},
                {"CUDADOCTOR_OPS_DW_V2_LEAN": "1", "CUDADOCTOR_OPS_DW_V2_COLV": "0", **_NOSH}]
DWN_CASES = [(1, 64, 128, 128, 3), (8, 64, 128, 128, 3), (1, 256, 128, 128, 3), (32, 12, 112, 112, 5),
             (64, 32, 112, 112, 3)]
# dwn4: the same cases, default against 4-row tiles (the default takes 2 rows where 8-row tiles
# leave fewer than 256 blocks, e.g. (1,64,128,128)), each twice, interleaved
DWN4_SETTINGS = [_NOSH, {"CUDADOCTOR_OPS_DW_V2_ROWS": "4", **_NOSH}, _NOSH, {"CUDADOCTOR_OPS_DW_V2_ROWS": "4", **_NOSH}]
DWB_SETTINGS = [{}, {"CUDADOCTOR_OPS_DW_WGRAD_SMEM": "0"}, {"CUDADOCTOR_OPS_DW_WGRAD_SMEM": "1"},
                {"CUDADOCTOR_OPS_DW_WGRAD_V1": "1", "CUDADOCTOR_OPS_DW_DGRAD_V1": "1", "CUDADOCTOR_OPS_DW_V4": "0"}]

DWB4_SETTINGS = [{}, {"CUDADOCTOR_OPS_DW_V4_CFG": "4"}]
DW7_LAYERS = [(64, 960, 7, 7), (64, 1152, 7, 7), (32, 1152, 7, 7), (128, 960, 7, 7), (64, 384, 7, 7),
              (64, 384, 14, 14), (64, 576, 14, 14)]
_C1 = {"CUDADOCTOR_OPS_DW_V4_CFG": "1"}
DW7_SETTINGS = [{}, _C1, {"CUDADOCTOR_OPS_DW_V4_CFG": "4"}, {"CUDADOCTOR_OPS_DW_V4_WAVE_CB": "18"},
                {"CUDADOCTOR_OPS_DW_V4_WAVE_CB": "9"}, {}, _C1]
DW7Q_SETTINGS = [{}, _C1, {}, _C1]
# dwh / dwbh: the channels-last forward (automatic choice only) / backward, default (the hoisted
# first kernel row by shape) against CUDADOCTOR_OPS_DW_V4_HOIST=0 and =1, each twice, interleaved
_H0 = {"CUDADOCTOR_OPS_DW_V4_HOIST": "0"}
_H1 = {"CUDADOCTOR_OPS_DW_V4_HOIST": "1"}
DWH_SETTINGS = [{}, _H0, _H1, {}, _H0, _H1]
DWBH_SETTINGS = [{}, _H0, _H1, {}, _H0, _H1]
_SH4 = {"CUDADOCTOR_OPS_DW_V2_SHFL": "4"}
_SH8 = {"CUDADOCTOR_OPS_DW_V2_SHFL": "8"}
DWSH_SETTINGS = [_NOSH, _SH4, _SH8, _NOSH, _SH4, _SH8]
_AK0 = {"CUDADOCTOR_OPS_DW_WGRAD_V3_AK": "0"}
_IM1 = {"CUDADOCTOR_OPS_DW_WGRAD_V3_IMGS": "1"}
DWV3_SETTINGS = [{}, _IM1, {**_AK0, **_IM1}, {}]
DWV3Q_SETTINGS = [{}, _IM1]
_AK2 = {"CUDADOCTOR_OPS_DW_WGRAD_V3_AK": "2"}
_HMMA = {"CUDADOCTOR_OPS_CBR_HMMA_TRAIN": "1"}
HMMA_SETTINGS = [{}, _HMMA, {}, _HMMA]
DWV5_SETTINGS = [{}, {"CUDADOCTOR_OPS_DW_WGRAD_V3_AK": "1"}, _AK2, {}]
DWW_SETTINGS = [{}, {"CUDADOCTOR_OPS_DW_WGRAD_SMEM": "0"}, {"CUDADOCTOR_OPS_DW_WGRAD_SMEM": "1"}, {"CUDADOCTOR_OPS_DW_WGRAD_PF": "1"},
                {"CUDADOCTOR_OPS_DW_WGRAD_PF": "2"}]


def _cbr_blocks(cases, err):
    """Per (shape, C_out, dtype): a channels_last Conv3x3 -> BatchNorm2d -> ReLU block in training
    mode, its fused copy (fuse_conv_bn_relu), an input, the same input requiring grad, an output
    gradient and the fused block's error against the block."""
    import copy

    import torch

    import cudadoctor_ops

    for shape, k, dts in cases:
        dt = getattr(torch, dts)
        torch.manual_seed(0)
        ref = torch.nn.Sequential(torch.nn.Conv2d(shape[1], k, 3, padding=1, bias=False),
                                  torch.nn.BatchNorm2d(k), torch.nn.ReLU()).cuda()
        ref = ref.to(dt).to(memory_format=torch.channels_last)
        fused = cudadoctor_ops.fuse_conv_bn_relu(torch.nn.Sequential(*[m for m in copy.deepcopy(ref)]))
        x = torch.randn(shape, device="cuda", dtype=dt).to(memory_format=torch.channels_last)
        xg = x.clone().requires_grad_()
        e = err(fused(x), ref(x))
        g = torch.randn_like(ref(x))
        yield shape, k, dts, fused, ref, x, xg, g, e


def _cbr_graph_rows(timer, shape, k, dts, fused, ref, x, xg, g, e, eager_fwd=False):
    """Rows [name, ours ms, torch ms, same result] of a _cbr_blocks block: the training forward
    (eagerly too with eager_fwd) and forward+backward in CUDA-graph replay."""
    from cudadoctor_ops.bench_cbr import graph_ms

    fwd_o, fwd_r = (lambda: fused(x)), (lambda: ref(x))
    fb_o, fb_r = (lambda: fused(xg).backward(g)), (lambda: ref(xg).backward(g))
    rows = [[f"cbr train fwd {shape}->{k} {dts}", timer(fwd_o), timer(fwd_r), e < 2e-2]] if eager_fwd else []
    rows.append([f"cbr train fwd {shape}->{k} {dts} (graph)", graph_ms(timer, fwd_o) or float("nan"),
                 graph_ms(timer, fwd_r) or float("nan"), e < 2e-2])
    rows.append([f"cbr fwd+bwd {shape}->{k} {dts} (graph)", graph_ms(timer, fb_o) or float("nan"),
                 graph_ms(timer, fb_r) or float("nan"), e < 2e-2])
    return rows


def _dw_grad_rows(name, g, x, wt, st, pd, dl, timer, err, what):
    """Rows [name, ours ms, torch ms, same result] of a depthwise channels-last case: the backward
    (dX + dW, what="bwd") or the weight gradient alone (what="wgrad"), against torch's
    convolution_backward asked for the same gradients."""
    import torch

    from cudadoctor_ops.bench_depthwise import backward_calls

    if what == "bwd":
        ours, theirs = backward_calls(g, x, wt, st, pd, dl)
        a, b = ours(), theirs()
        return [name, timer(ours), timer(theirs), max(err(a[0], b[0]), err(a[1], b[1])) < 2e-2]
    c = x.shape[1]

    def ours_w():
        return torch.ops.cudadoctor_ops.depthwise_conv2d_backward_weight(g, x, wt, st, pd, dl, False, 0)[0]

    def theirs_w():
        return torch.ops.aten.convolution_backward(
            g, x, wt, None, st, pd, dl, False, [0, 0], c, [False, True, False])[1]

    return [name, timer(ours_w), timer(theirs_w), err(ours_w(), theirs_w()) < 2e-2]


def _child(part: str) -> None:
    import torch
    import torch.nn.functional as F

    import cudadoctor_ops  # noqa: F401
    from cudadoctor_ops.bench import Timer
    from cudadoctor_ops.bench_depthwise import MOBILE_LAYERS, backward_calls

    timer = Timer()
    ops = torch.ops.cudadoctor_ops
    out = []

    def err(a, b):
        a, b = a.float(), b.float()
        return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-6)

    if part in ("bn", "bnf", "bns"):
        for shape in BN_SHAPES if part == "bn" else BNF_SHAPES:
            for dt in (torch.float16, torch.bfloat16):
                # from the CPU generator: CUDA random numbers after a graph capture of torch's
                # BatchNorm fail ("Offset increment outside graph capture")
                x = torch.randn(shape, dtype=dt).cuda().to(memory_format=torch.channels_last)
                c = shape[1]
                w = torch.rand(c).cuda() + 0.5
                b = torch.randn(c).cuda()
                rm, rv = torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")
                rm2, rv2 = rm.clone(), rv.clone()
                ours = lambda: cudadoctor_ops.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5)  # noqa: E731
                theirs = lambda: F.batch_norm(x, rm2, rv2, w, b, True, 0.1, 1e-5)  # noqa: E731
                e = err(ours(), theirs())
                out.append([f"bn train fwd {shape} {str(dt)[6:]} nhwc", timer(ours), timer(theirs),
                            e < 2e-2])
                if part in ("bnf", "bns"):
                    from cudadoctor_ops.bench_cbr import graph_ms

                    out.append([f"bn train fwd {shape} {str(dt)[6:]} nhwc (graph)",
                                graph_ms(timer, ours) or float("nan"), graph_ms(timer, theirs) or float("nan"),
                                e < 2e-2])
    elif part in ("bnp", "bnnr", "bnst"):
        from cudadoctor_ops.bench_cbr import graph_ms

        if part == "bnst":
            cases = [(s_, d_) for s_ in BNST_SHAPES for d_ in (torch.float16, torch.bfloat16)]
        else:
            cases = [(s_, torch.float16) for s_ in (BNP_SHAPES if part == "bnp" else BN_SHAPES)]
        for shape, dt in cases:
            # tensors from the CPU generator: CUDA random numbers after a graph capture of torch's
            # BatchNorm fail ("Offset increment outside graph capture")
            x = torch.randn(shape, dtype=dt).cuda().to(memory_format=torch.channels_last)
            c = shape[1]
            w = torch.rand(c).cuda() + 0.5
            b = torch.randn(c).cuda()
            rm, rv = torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")
            xg, wg, bg = (t.detach().requires_grad_(True) for t in (x, w, b))
            gy = torch.randn(shape, dtype=dt).cuda().to(memory_format=torch.channels_last)
            yo = cudadoctor_ops.batch_norm(xg, rm.clone(), rv.clone(), wg, bg, True, 0.1, 1e-5)
            yt = F.batch_norm(xg, rm.clone(), rv.clone(), wg, bg, True, 0.1, 1e-5)
            bo = lambda: torch.autograd.grad(yo, (xg, wg, bg), gy, retain_graph=True)  # noqa: E731
            bt = lambda: torch.autograd.grad(yt, (xg, wg, bg), gy, retain_graph=True)  # noqa: E731
            ok = all(err(a, b_) < 2e-2 for a, b_ in zip(bo(), bt()))
            dn = str(dt)[6:]
            out.append([f"bn backward {shape} {dn} nhwc", timer(bo), timer(bt), ok])
            out.append([f"bn backward {shape} {dn} nhwc (graph)", graph_ms(timer, bo) or float("nan"),
                        graph_ms(timer, bt) or float("nan"), ok])
            if part == "bnnr":
                # host time per call (no synchronisation in the loop; GPU time where that is longer)
                from gpu_profile import host_us  # scripts/ is sys.path[0] when run as a script

                out.append([f"bn backward {shape} {dn} nhwc (host)", host_us(bo) / 1e3, host_us(bt) / 1e3, ok])
            del x, xg, gy, yo, yt
            torch.cuda.empty_cache()
    elif part == "cbr":
        for shape, k, dts, fused, ref, x, xg, g, e in _cbr_blocks(CBR_CASES, err):
            out.append([f"cbr train fwd {shape}->{k} {dts} nhwc", timer(lambda: fused(x)),
                        timer(lambda: ref(x)), e < 2e-2])

            def fb(m):
                return lambda: m(xg).backward(g)

            out.append([f"cbr fwd+bwd {shape}->{k} {dts} nhwc", timer(fb(fused)), timer(fb(ref)),
                        e < 2e-2])
    elif part == "hmma":
        cases = list(CBR_CASES[:2]) + [((64, c, h, h), c, d) for c, h in ((64, 56), (128, 28), (256, 14), (512, 7))
                                        for d in ("float16", "bfloat16")]
        for shape, k, dts, fused, ref, x, xg, g, e in _cbr_blocks(cases, err):
            w = ref[0].weight

            def conv_relu(impl, x=x, w=w):
                return lambda: ops.conv_bias_relu(x, w, None, [1, 1], [1, 1], [1, 1], 1, impl)

            same = err(conv_relu(3)(), conv_relu(0)()) < 2e-2
            out.append([f"conv+relu hmma / cuDNN {shape}->{k} {dts}", timer(conv_relu(3)), timer(conv_relu(0)), same])
            out += _cbr_graph_rows(timer, shape, k, dts, fused, ref, x, xg, g, e)
            del fused, ref, x, xg, g
            torch.cuda.empty_cache()
    elif part == "cbra":
        for shape, k, dts, fused, ref, x, xg, g, e in _cbr_blocks(CBR_CASES, err):
            out += _cbr_graph_rows(timer, shape, k, dts, fused, ref, x, xg, g, e, eager_fwd=True)
            del fused, ref, x, xg, g
            torch.cuda.empty_cache()
    elif part in ("cbrb", "cbrst"):
        from cudadoctor_ops.bench_cbr import graph_ms

        for shape, k, dts, fused, ref, x, xg, g, e in _cbr_blocks(CBRST_CASES if part == "cbrst" else CBR_CASES, err):
            fb_o, fb_r = (lambda: fused(xg).backward(g)), (lambda: ref(xg).backward(g))
            out.append([f"cbr fwd+bwd {shape}->{k} {dts} nhwc (graph)", graph_ms(timer, fb_o) or float("nan"),
                        graph_ms(timer, fb_r) or float("nan"), e < 2e-2])
    elif part == "cbrs":
        from cudadoctor_ops import cudnn_stats
        from cudadoctor_ops.bench_cbr import graph_ms
        from gpu_profile import host_us  # scripts/ is sys.path[0] when run as a script

        before = cudnn_stats.calls
        for shape, k, dts, fused, ref, x, xg, g, e in _cbr_blocks(CBR_CASES[:2], err):
            fwd_o, fwd_r = (lambda: fused(x)), (lambda: ref(x))
            fb_o, fb_r = (lambda: fused(xg).backward(g)), (lambda: ref(xg).backward(g))
            rows = [("train fwd", fwd_o, fwd_r), ("fwd+bwd", fb_o, fb_r)]
            for kind, o, r in rows:
                name = f"cbr {kind} {shape}->{k} {dts} nhwc"
                out.append([name, timer(o), timer(r), e < 2e-2])
                out.append([name + " (graph)", graph_ms(timer, o) or float("nan"),
                            graph_ms(timer, r) or float("nan"), e < 2e-2])
                out.append([name + " (host)", host_us(o) / 1e3, host_us(r) / 1e3, e < 2e-2])
            st = cudnn_stats.status()
            # a note row: the setting's backend and how often the path ran (printed per setting)
            out.append([f"cbr {shape}->{k} {dts} cudnn_stats", float("nan"), float("nan"), True,
                        f"backend {st['backend']}, {st['calls'] - before} calls so far, "
                        f"{len(st['declined'])} shapes declined"])
    elif part in ("dwn", "dwsh"):
        from cudadoctor_ops.bench_cbr import graph_ms

        for n, c, h, w_, k in DWN_CASES:
            x = torch.randn(n, c, h, w_, device="cuda")
            wt = torch.randn(c, 1, k, k, device="cuda")
            p = k // 2
            f_ours = lambda: cudadoctor_ops.depthwise_conv2d(x, wt, None, 1, p)  # noqa: E731
            f_torch = lambda: F.conv2d(x, wt, None, 1, p, 1, c)  # noqa: E731
            ok = err(f_ours(), f_torch()) < 1e-4
            name = f"dw fwd k{k} {(n, c, h, w_)} float32 nchw"
            out.append([name, timer(f_ours), timer(f_torch), ok])
            out.append([name + " (graph)", graph_ms(timer, f_ours) or float("nan"),
                        graph_ms(timer, f_torch) or float("nan"), ok])
            if part == "dwn":  # dwsh: the forward only
                g = torch.randn_like(f_torch())
                b_ours, b_torch = backward_calls(g, x, wt, [1, 1], [p, p], [1, 1])
                a, b_ = b_ours(), b_torch()
                okb = max(err(a[0], b_[0]), err(a[1], b_[1])) < 1e-4
                out.append([f"dw bwd k{k} {(n, c, h, w_)} float32 nchw", timer(b_ours), timer(b_torch), okb])
                del g
            del x, wt
            torch.cuda.empty_cache()
    elif part in ("dwv3", "dwv5"):
        for _, n, c, h, w_, k, s in MOBILE_LAYERS:
            if s != 1 or h * w_ > 32 * 32 or (part == "dwv5" and k != 5):
                continue
            for dt in (torch.float16, torch.bfloat16):
                x = torch.randn(n, c, h, w_, device="cuda", dtype=dt).to(memory_format=torch.channels_last)
                wt = torch.randn(c, 1, k, k, device="cuda", dtype=dt)
                p = k // 2
                st, pd, dl = [1, 1], [p, p], [1, 1]
                g = torch.randn_like(F.conv2d(x, wt, None, 1, p, 1, c))
                for what in ("bwd", "wgrad"):
                    out.append(_dw_grad_rows(f"dw {what} k{k} {(n, c, h, w_)} {str(dt)[6:]}", g, x, wt, st, pd,
                                             dl, timer, err, what))
                del x, wt, g
                torch.cuda.empty_cache()
    elif part == "dw7":
        for n, c, h, w_ in DW7_LAYERS:
            for dt in (torch.float16, torch.bfloat16):
                x = torch.randn(n, c, h, w_, device="cuda", dtype=dt).to(memory_format=torch.channels_last)
                wt = torch.randn(c, 1, 3, 3, device="cuda", dtype=dt)
                st, pd, dl = [1, 1], [1, 1], [1, 1]
                ref = F.conv2d(x, wt, None, 1, 1, 1, c)
                def f(x=x, wt=wt, st=st, pd=pd, dl=dl):
                    return ops.depthwise_conv2d(x, wt, None, st, pd, dl)

                def t(x=x, wt=wt, c=c):
                    return F.conv2d(x, wt, None, 1, 1, 1, c)

                name = f"dw fwd k3s1 {(n, c, h, w_)} {str(dt)[6:]}"
                out.append([name, timer(f), timer(t), err(f(), ref) < 2e-2])
                out.append(_dw_grad_rows(name.replace("fwd", "bwd"), torch.randn_like(ref), x, wt, st,
                                         pd, dl, timer, err, "bwd"))
                del x, wt, ref
                torch.cuda.empty_cache()
    elif part in ("dw", "dwa", "dwb", "dww"):
        for _, n, c, h, w_, k, s in MOBILE_LAYERS:
            for dt in (torch.float16, torch.bfloat16):
                x = torch.randn(n, c, h, w_, device="cuda", dtype=dt).to(memory_format=torch.channels_last)
                wt = torch.randn(c, 1, k, k, device="cuda", dtype=dt)
                p = k // 2
                st, pd, dl = [s, s], [p, p], [1, 1]
                ref = F.conv2d(x, wt, None, s, p, 1, c)
                what = {"dw": "fwd", "dwa": "fwd", "dwb": "bwd", "dww": "wgrad"}[part]
                name = f"dw {what} k{k}s{s} {(n, c, h, w_)} {str(dt)[6:]}"
                if part == "dw":
                    row = [name]
                    for impl in (0, 3, 4):
                        f = lambda impl=impl: ops.depthwise_conv2d(x, wt, None, st, pd, dl, impl)  # noqa: E731
                        row += [timer(f), err(f(), ref) < 2e-2]
                    row.append(timer(lambda: F.conv2d(x, wt, None, s, p, 1, c)))
                    out.append(row)
                elif part == "dwa":
                    f = lambda: ops.depthwise_conv2d(x, wt, None, st, pd, dl)  # noqa: E731
                    ok = err(f(), ref) < 2e-2
                    out.append([name, timer(f), timer(lambda: F.conv2d(x, wt, None, s, p, 1, c)), ok])
                else:
                    g = torch.randn_like(ref)
                    out.append(_dw_grad_rows(name, g, x, wt, st, pd, dl, timer, err,
                                             "wgrad" if part == "dww" else "bwd"))
                del x, wt, ref
                torch.cuda.empty_cache()
    print("JSON " + json.dumps(out))


def _run(part: str, env: dict) -> list:
    e = dict(os.environ)
    e.update(env)
    p = subprocess.run([sys.executable, __file__, "--child", part], env=e, capture_output=True,
                       text=True, timeout=600)
    for line in p.stdout.splitlines():
        if line.startswith("JSON "):
            return json.loads(line[5:])
    print(f"  [{part} {env}] failed (exit {p.returncode}): {p.stderr.strip()[-800:]}")
    return []


def _label(env: dict) -> str:
    return ",".join(f"{k.replace('CUDADOCTOR_OPS_', '')}={v}" for k, v in env.items()) or "default"


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        _child(argv[1])
        return 0
    parts = argv or ["bn", "cbr", "dw", "dwb"]
    for part in parts:
        settings = {"bn": BN_SETTINGS, "bnf": BNF_SETTINGS, "bns": BNS_SETTINGS, "bnp": BNP_SETTINGS, "bnnr": BNNR_SETTINGS,
                    "bnst": BNST_SETTINGS,
                    "cbr": CBR_SETTINGS, "cbra": CBRA_SETTINGS, "cbrb": CBRB_SETTINGS, "cbrs": CBRS_SETTINGS, "cbrst": CBRST_SETTINGS,
                    "dw": DW_SETTINGS, "dwn": DWN_SETTINGS, "dwn4": DWN4_SETTINGS,
                    "dwb": DWB_SETTINGS, "dwb4": DWB4_SETTINGS, "dww": DWW_SETTINGS,
                    "dwh": DWH_SETTINGS, "dwbh": DWBH_SETTINGS, "dw7": DW7_SETTINGS, "dw7q": DW7Q_SETTINGS,
                    "dwsh": DWSH_SETTINGS, "dwv3": DWV3_SETTINGS,
                    "dwv3q": DWV3Q_SETTINGS, "dwv5": DWV5_SETTINGS, "hmma": HMMA_SETTINGS}[part]
        child = {"dwb4": "dwb", "dwn4": "dwn", "dwh": "dwa", "dwbh": "dwb", "dwv3q": "dwv3", "dw7q": "dw7"}.get(part, part)
        results = [(_label(env), _run(child, env)) for env in settings]
        results = [(lab, r) for lab, r in results if r]
        if not results:
            continue
        print(f"== {part}: " + " | ".join(lab for lab, _ in results))
        base = results[0][1]
        for i in range(len(base)):
            name = base[i][0]
            cells = []
            for lab, r in results:
                if i >= len(r):
                    continue
                row = r[i]
                if part == "dw":
                    # auto, nhwc_v3, v2, torch
                    t = row[7]
                    cells.append(f"{lab}: auto {row[1]*1e3:.1f}{'' if row[2] else '!'} ({t/row[1]:.2f}x)")
                    if lab == results[0][0]:
                        cells.append(f"v3 {row[3]*1e3:.1f}{'' if row[4] else '!'} ({t/row[3]:.2f}x) "
                                     f"v2 {row[5]*1e3:.1f}{'' if row[6] else '!'} ({t/row[5]:.2f}x) "
                                     f"torch {t*1e3:.1f}")
                elif len(row) > 4:  # a note row
                    cells.append(f"{lab}: {row[4]}")
                else:
                    cells.append(f"{lab}: {row[1]*1e3:.1f}{'' if row[3] else '!'} us "
                                 f"({row[2]/row[1]:.2f}x of torch {row[2]*1e3:.1f})")
            print(f"  {name:<44} " + " | ".join(cells))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
