"""Can cuDNN compute BatchNorm's batch statistics inside the convolution? A probe for the
Conv+BN+ReLU training forward, run on a CUDA machine:

    python scripts/cudnn_fusion_probe.py [-v]       (needs torch and nvidia-cudnn-frontend; 1.14.1
                                                     has no dependencies beyond the cuDNN that torch
                                                     loads: pip install --no-deps)

For each block shape it builds cuDNN graphs (cudnn-frontend's Python API) that produce the
convolution output Y together with per-channel sum(Y) and sum(Y*Y) in float32, and reports for
each: whether cuDNN supports it on this GPU (else the error), the engine, the largest error
against torch (Y against F.conv2d, sums against float64 sums of torch's Y), and its time against
torch's convolution alone, from CUDA events around 50 back-to-back calls (host included) and from
the profiler's kernel durations (device only). Graphs:

  genstats        conv_fprop -> genstats
  reduce2         conv_fprop -> reduction(ADD) over N,H,W, and mul(Y, Y) -> reduction(ADD)
  prologue        scale/bias/ReLU of the input -> conv_fprop -> genstats (the pattern of a fused
                  ResNet chain, where the previous block's BatchNorm apply + ReLU moves into the
                  next convolution's prologue)

Nothing here runs in the package: it answers whether a fused convolution + statistics engine
exists and what it costs, before any of it is written in C++.
"""

from __future__ import annotations

import sys
import traceback

CASES = [  # (N, C, H, W) -> K, 3x3 stride 1 pad 1, channels_last: the Conv+BN+ReLU bench's
    ((32, 64, 56, 56), 64, "float16"),  # channels_last headline blocks and a ResNet-50 layer
    ((64, 128, 28, 28), 128, "bfloat16"),
    ((64, 256, 14, 14), 256, "float16"),
]


def main() -> int:
    import torch
    import torch.nn.functional as F

    try:
        import cudnn
    except Exception as e:  # noqa: BLE001
        print(f"cudnn frontend not importable: {e}")
        return 2
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"cuDNN backend {cudnn.backend_version()}  frontend {getattr(cudnn, '__version__', '?')}")
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)

    def cdt(dt):
        return {torch.float16: cudnn.data_type.HALF, torch.bfloat16: cudnn.data_type.BFLOAT16,
                torch.float32: cudnn.data_type.FLOAT}[dt]

    def timed(fn, n=50):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        res = []
        for _ in range(3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(n):
                fn()
            b.record()
            torch.cuda.synchronize()
            res.append(a.elapsed_time(b) * 1000 / n)
        return min(res)

    def kernel_us(fn, n=20):
        from torch.profiler import ProfilerActivity, profile
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                fn()
            torch.cuda.synchronize()
        names = {}
        total = 0.0
        for e in prof.events():
            dev = getattr(e, "device_type", None)
            if dev is not None and "CUDA" not in str(dev):
                continue
            d = getattr(e, "device_time", None) or getattr(e, "cuda_time", 0) or 0
            if d:
                total += d
                names[e.name[:70]] = names.get(e.name[:70], 0) + 1
        return total / n, sorted(names, key=lambda k: -names[k])[:3]

    for (N, C, H, W), K, dts in CASES:
        dt = getattr(torch, dts)
        g = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(N, C, H, W, generator=g).to(dt).cuda().contiguous(memory_format=torch.channels_last)
        w = (torch.randn(K, C, 3, 3, generator=g) * (1.0 / (9 * C) ** 0.5)).to(dt).cuda()
        w = w.contiguous(memory_format=torch.channels_last)
        y_ref = F.conv2d(x, w, padding=1)
        y64 = y_ref.double()
        s_ref = y64.sum((0, 2, 3))
        q_ref = (y64 * y64).sum((0, 2, 3))
        t_conv = timed(lambda: F.conv2d(x, w, padding=1))
        k_conv, _ = kernel_us(lambda: F.conv2d(x, w, padding=1))

        def torch_stats():
            y = F.conv2d(x, w, padding=1)
            return torch.var_mean(y, dim=(0, 2, 3), correction=0)

        t_ts = timed(torch_stats)
        print(f"\n== ({N},{C},{H},{W})->{K} {dts} channels_last: torch conv {t_conv:.1f} us "
              f"(kernels {k_conv:.1f}), conv + var_mean {t_ts:.1f} us")

        for variant in ("genstats", "reduce2", "prologue"):
            try:
                graph = cudnn.pygraph(io_data_type=cdt(dt), intermediate_data_type=cudnn.data_type.FLOAT,
                                      compute_data_type=cudnn.data_type.FLOAT, handle=handle)
                X = graph.tensor(name="X", dim=list(x.size()), stride=list(x.stride()), data_type=cdt(dt))
                Wt = graph.tensor(name="W", dim=list(w.size()), stride=list(w.stride()), data_type=cdt(dt))
                feeds = {}
                conv_in = X
                if variant == "prologue":
                    sc = torch.ones(1, C, 1, 1, device="cuda", dtype=dt)
                    bi = torch.full((1, C, 1, 1), 4.0, device="cuda", dtype=dt)  # x + 4 > 0: ReLU keeps it
                    S = graph.tensor(name="S", dim=[1, C, 1, 1], stride=[C, 1, C, C], data_type=cdt(dt))
                    B = graph.tensor(name="B", dim=[1, C, 1, 1], stride=[C, 1, C, C], data_type=cdt(dt))
                    conv_in = graph.relu(name="relu", input=graph.bias(name="bias", input=graph.scale(
                        name="scale", input=X, scale=S), bias=B))
                    feeds[S], feeds[B] = sc, bi
                Y = graph.conv_fprop(image=conv_in, weight=Wt, padding=[1, 1], stride=[1, 1], dilation=[1, 1])
                Y.set_output(True).set_data_type(cdt(dt))
                if variant in ("genstats", "prologue"):
                    SUM, SQ = graph.genstats(name="genstats", input=Y)
                else:
                    SUM = graph.reduction(input=Y, mode=cudnn.reduction_mode.ADD)
                    SQ = graph.reduction(input=graph.mul(a=Y, b=Y), mode=cudnn.reduction_mode.ADD)
                for t in (SUM, SQ):
                    t.set_output(True).set_data_type(cudnn.data_type.FLOAT).set_dim([1, K, 1, 1]).set_stride([K, 1, K, K])
                graph.validate()
                graph.build_operation_graph()
                graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
                graph.check_support()
                graph.build_plans()
                y = torch.empty_like(y_ref)
                s = torch.empty(1, K, 1, 1, device="cuda", dtype=torch.float32)
                q = torch.empty_like(s)
                ws = torch.empty(max(graph.get_workspace_size(), 1), device="cuda", dtype=torch.uint8)
                feeds.update({X: x, Wt: w, Y: y, SUM: s, SQ: q})
                run = lambda: graph.execute(feeds, ws, handle=handle)  # noqa: E731
                run()
                torch.cuda.synchronize()
                if variant == "prologue":
                    yr = F.conv2d(torch.relu(x + 4), w, padding=1).double()
                    sr, qr = yr.sum((0, 2, 3)), (yr * yr).sum((0, 2, 3))
                else:
                    yr, sr, qr = y64, s_ref, q_ref
                ey = ((y.double() - yr).abs().max() / yr.abs().max()).item()
                es = ((s.double().flatten() - sr).abs().max() / sr.abs().max()).item()
                eq = ((q.double().flatten() - qr).abs().max() / qr.abs().max()).item()
                t = timed(run)
                kt, kn = kernel_us(run)
                engine = ""
                try:
                    engine = str(graph.get_plan_name_at_index(0))
                except Exception:  # noqa: BLE001
                    pass
                print(f"  {variant:9s} supported  {t:7.1f} us per call (kernels {kt:.1f} us: "
                      f"{kt / k_conv:.2f}x of torch's conv)  rel err y {ey:.1e} sum {es:.1e} sqsum {eq:.1e}"
                      f"  engine {engine}  kernels {kn}")
            except Exception as e:  # noqa: BLE001
                msg = str(e).strip().splitlines()
                print(f"  {variant:9s} NOT supported: {type(e).__name__}: {' | '.join(msg[:3])[:300]}")
                if "-v" in sys.argv:
                    traceback.print_exc()
    return 0


if __name__ == "__main__":
    sys.exit(main())
