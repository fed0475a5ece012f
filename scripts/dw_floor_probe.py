"""Small depthwise forwards: GPU time after different L2 flushes, and host time per call.

    python scripts/dw_floor_probe.py

For each case, ours (cudadoctor_ops.depthwise_conv2d, the public function), the op alone
(torch.ops.cudadoctor_ops.depthwise_conv2d.default, no Python argument checks), torch's
F.conv2d(groups=C) and a plain copy of the input (x.clone(), the same bytes read and written):
  gpu us  median of 200 calls queued as triton's do_bench queues them (flush, event, call, event;
          no synchronisation between calls, so the host runs ahead and its time stays hidden
          while it is shorter than the GPU's per call), after each kind of flush:
            zero  a 256 MiB buffer written (as do_bench and the bench: L2 left full of dirty
                  lines, which the timed call's traffic must write back as it evicts them)
            read  a 256 MiB buffer read (L2 left full of clean lines)
  host us wall time of one call while the GPU is held by a sleep kernel (bench_cbr.host_gpu_ms),
          median of 50: the dispatch and launch cost an eager caller pays per call.

An earlier version synchronised after every call, so its times included the host's dispatch
whenever that outlasted the flush: ours read 17-23 us there against 11-12 for torch (H200,
2026-12-02), while `bench depthwise` in the same call read 12.0 / 12.5 us.
"""

from __future__ import annotations

import functools
import statistics
import sys

import cudadoctor_ops
import torch
import torch.nn.functional as F
from cudadoctor_ops.bench_cbr import host_gpu_ms

CASES = [  # N, C, H, W, K, dtype, channels_last
    (64, 960, 7, 7, 3, torch.float16, True),
    (64, 960, 7, 7, 3, torch.bfloat16, True),
    (64, 1152, 7, 7, 3, torch.float16, True),
    (1, 64, 128, 128, 3, torch.float32, False),
    (64, 192, 28, 28, 3, torch.float16, True),
]


def queued_us(fn, flush, reps: int = 200) -> float:
    for _ in range(5):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    torch.cuda.synchronize()
    for i in range(reps):
        flush()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1000.0 for a, b in zip(starts, ends))


def host_us(fn, reps: int = 50) -> float:
    fn()
    return statistics.median(host_gpu_ms(fn, 2.0)[0] for _ in range(reps)) * 1000.0


def main() -> int:
    print(torch.__version__, torch.cuda.get_device_name())
    torch.backends.cudnn.benchmark = True
    buf = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.float32, device="cuda")
    sink = torch.empty((), dtype=torch.float32, device="cuda")
    flushes = {"zero": buf.zero_, "read": functools.partial(torch.sum, buf, dim=0, out=sink)}
    op = torch.ops.cudadoctor_ops.depthwise_conv2d.default
    print("| case | call | gpu us, zero flush | gpu us, read flush | host us |")
    print("|---|---|---|---|---|")
    for n, c, h, w, k, dt, cl in CASES:
        x = torch.randn(n, c, h, w, device="cuda", dtype=dt)
        if cl:
            x = x.to(memory_format=torch.channels_last)
        wt = torch.randn(c, 1, k, k, device="cuda", dtype=dt)
        p = k // 2
        calls = {
            "ours": functools.partial(cudadoctor_ops.depthwise_conv2d, x, wt, None, 1, p, 1),
            "op alone": functools.partial(op, x, wt, None, [1, 1], [p, p], [1, 1], 0),
            "torch": functools.partial(F.conv2d, x, wt, None, 1, p, 1, c),
            "copy": functools.partial(x.clone, memory_format=torch.preserve_format),
        }
        ref = calls["torch"]().float()
        err = ((calls["ours"]().float() - ref).abs().max() / ref.abs().max()).item()
        lay = "nhwc" if cl else "nchw"
        label = f"{(n, c, h, w)} {k}x{k} {str(dt)[6:]} {lay}"
        # interleaved: every call once per flush kind, twice over; each call's lower median
        res = {name: [float("inf"), float("inf")] for name in calls}
        for _ in range(2):
            for name, fn in calls.items():
                for j, fl in enumerate(flushes.values()):
                    res[name][j] = min(res[name][j], queued_us(fn, fl))
        for name, fn in calls.items():
            print(f"| {label} | {name} | {res[name][0]:.1f} | {res[name][1]:.1f} | {host_us(fn):.1f} |",
                  flush=True)
        print(f"| {label} | max rel err ours vs torch {err:.1e} | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
