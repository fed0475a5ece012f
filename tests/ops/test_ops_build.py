"""Builds the cudadoctor-ops wheel for one arch, without a GPU, so compile errors never land.

One build per run (a module-scoped fixture): `pip wheel --no-build-isolation --no-deps` of a
copy of opsrc/ with TORCH_CUDA_ARCH_LIST=9.0, then checks of the wheel that need no GPU: the
extension is in it with sm_90 code, it imports, the op schemas are registered and the fake
kernels give the right shapes, layouts and dtypes on meta tensors.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest

pytestmark = pytest.mark.compile

REPO = pathlib.Path(__file__).resolve().parents[2]
OPSRC = REPO / "opsrc"
ARCH = "9.0"


def _cuda_home() -> str | None:
    for cand in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if cand and os.path.exists(os.path.join(cand, "bin", "nvcc")):
            return cand
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = os.path.realpath(nvcc)
        return os.path.dirname(os.path.dirname(real))
    return None


@pytest.fixture(scope="module")
def built_wheel(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
    pytest.importorskip("torch", reason="building the extension needs torch")
    cuda_home = _cuda_home()
    if cuda_home is None:
        pytest.skip("no nvcc found (CUDA_HOME, /usr/local/cuda, PATH)")
    tmp = tmp_path_factory.mktemp("opsbuild")
    src = tmp / "opsrc"
    shutil.copytree(
        OPSRC, src, ignore=shutil.ignore_patterns("build", "*.so", "__pycache__", "*.egg-info", "dist")
    )
    env = dict(os.environ, TORCH_CUDA_ARCH_LIST=ARCH, CUDA_HOME=cuda_home)
    env.setdefault("MAX_JOBS", str(max(1, min(2, os.cpu_count() or 1))))
    dist = tmp / "dist"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w", str(dist), str(src)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"building opsrc failed (rc {proc.returncode}):\n{log[-6000:]}"
    wheels = sorted(dist.glob("cudadoctor_ops-*.whl"))
    assert len(wheels) == 1, f"expected one cudadoctor_ops wheel in {dist}, found {wheels}"
    site = tmp / "site"
    with zipfile.ZipFile(wheels[0]) as zf:
        zf.extractall(site)
    return wheels[0], site


def test_wheel_holds_the_extension_for_the_arch(built_wheel):
    wheel, site = built_wheel
    sos = sorted((site / "cudadoctor_ops").glob("_C.*.so"))
    assert len(sos) == 1, f"no cudadoctor_ops/_C.*.so in {wheel.name}"
    so = sos[0]
    assert so.read_bytes()[:4] == b"\x7fELF"
    names = zipfile.ZipFile(wheel).namelist()
    for mod in ("__init__.py", "batch_norm.py", "bench.py", "sanitize.py"):
        assert f"cudadoctor_ops/{mod}" in names
    cuobjdump = os.path.join(_cuda_home() or "", "bin", "cuobjdump")
    if os.path.exists(cuobjdump):
        listing = subprocess.run([cuobjdump, "--list-elf", str(so)], capture_output=True, text=True, timeout=120)
        assert "sm_90" in listing.stdout, listing.stdout + listing.stderr


def test_wheel_holds_the_sm90a_module_with_sm90a_code_only(built_wheel):
    """Built for 9.0, the wheel carries cudadoctor_ops._C_sm90a (csrc_sm90a/: wgmma), whose device
    code is sm_90a SASS alone, beside the portable _C with sm_90; the builder's verification counts
    it as an arch-specific module of a requested arch."""
    from cudadoctor.build.verify import missing, shared_object_archs

    wheel, site = built_wheel
    sos = sorted((site / "cudadoctor_ops").glob("_C_sm90a.*.so"))
    assert len(sos) == 1, f"no cudadoctor_ops/_C_sm90a.*.so in {wheel.name}"
    archs = shared_object_archs(wheel)
    sm90a = [v for k, v in archs.items() if "_C_sm90a" in k]
    main = [v for k, v in archs.items() if "_C_sm90a" not in k and "/_C." in k]
    assert sm90a == [{"sass": ["sm_90a"], "ptx": []}], archs
    assert main and main[0]["sass"] == ["sm_90"], archs
    assert missing(archs, ["sm_90"], []) == {}


def test_wheel_imports_and_fakes_work_without_gpu(built_wheel):
    _, site = built_wheel
    check = textwrap.dedent(
        """
        import sys
        sys.path.insert(0, sys.argv[1])
        import torch
        import cudadoctor_ops
        assert cudadoctor_ops.__file__.startswith(sys.argv[1]), cudadoctor_ops.__file__
        ns = torch.ops.cudadoctor_ops
        for name in ("batch_norm", "batch_norm_backward", "batch_norm_update_stats"):
            assert hasattr(ns, name), name
        x = torch.empty(4, 8, 5, 5, device="meta", dtype=torch.float16)
        w = torch.empty(8, device="meta")
        out, sm, si, rs = ns.batch_norm(x, w, w, None, None, True, 1e-5, "relu")
        assert out.shape == x.shape and out.dtype == torch.float16, out
        assert sm.shape == (8,) and sm.dtype == torch.float32 and rs.shape == (8,)
        xl = x.contiguous(memory_format=torch.channels_last)
        out = ns.batch_norm(xl, None, None, None, None, True, 1e-5, "none")[0]
        assert out.is_contiguous(memory_format=torch.channels_last)
        gi, gw, gb = ns.batch_norm_backward(out, xl, w, w, sm, si, rs, True, "relu", [True, True, False])
        assert gi.shape == x.shape and gw.shape == (8,) and gb.shape == (0,)
        # batch_norm's autograd is a C++ Function: run it through forward and backward on meta
        for name in ("batch_norm", "batch_norm_forward"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"cudadoctor_ops::{name}", "Autograd" if name == "batch_norm" else "CompositeImplicitAutograd"), name
        xg = torch.empty(4, 8, 5, 5, device="meta", dtype=torch.float16, requires_grad=True)
        wg = torch.empty(8, device="meta", requires_grad=True)
        bg = torch.empty(8, device="meta", requires_grad=True)
        rm, rv = torch.empty(8, device="meta"), torch.empty(8, device="meta")
        for training in (True, False):
            y = ns.batch_norm_forward(xg, wg, bg, rm, rv, training, 0.1, 1e-5, "relu")
            assert y.shape == xg.shape and y.requires_grad and y.grad_fn is not None, (training, y)
            gx, gw_, gb_ = torch.autograd.grad(y, (xg, wg, bg), torch.empty_like(y))
            assert gx.shape == xg.shape and gx.dtype == torch.float16, gx
            assert gw_.shape == (8,) and gb_.shape == (8,), (gw_, gb_)
        # no weight/bias: the gradient edges of absent optional inputs are skipped
        y = ns.batch_norm_forward(xg, None, None, None, None, True, 0.1, 1e-5, "none")
        (gx,) = torch.autograd.grad(y, (xg,), torch.empty_like(y))
        assert gx.shape == xg.shape
        y = ns.batch_norm_forward(xg, None, bg, None, None, True, 0.1, 1e-5, "none")
        (gb_,) = torch.autograd.grad(y, (bg,), torch.empty_like(y))
        assert gb_.shape == (8,)
        # the composite traces under torch.compile (fullgraph) to batch_norm + the stats update
        torch._dynamo.reset()
        y = torch.compile(lambda *a: ns.batch_norm_forward(*a, True, 0.1, 1e-5, "relu"), fullgraph=True,
                          backend="aot_eager")(xg, wg, bg, rm, rv)
        assert y.shape == xg.shape and y.grad_fn is not None, y
        gx, = torch.autograd.grad(y, (xg,), torch.empty_like(y))
        assert gx.shape == xg.shape
        # depthwise_conv2d's autograd is a C++ Function too
        assert torch._C._dispatch_has_kernel_for_dispatch_key("cudadoctor_ops::depthwise_conv2d", "Autograd")
        xd = torch.empty(2, 8, 9, 9, device="meta", requires_grad=True)
        wd = torch.empty(8, 1, 3, 3, device="meta", requires_grad=True)
        for bd in (torch.empty(8, device="meta", requires_grad=True), None):
            yd = ns.depthwise_conv2d(xd, wd, bd, [2, 2], [1, 1], [1, 1], 0)
            assert yd.shape == (2, 8, 5, 5) and yd.grad_fn is not None, yd
            wanted = (xd, wd) + ((bd,) if bd is not None else ())
            gs = torch.autograd.grad(yd, wanted, torch.empty_like(yd))
            assert [tuple(g.shape) for g in gs] == [tuple(t.shape) for t in wanted], gs
        # the sm_90a module loads and registers its CUDA kernel; the fake gives y and the sums
        import cudadoctor_ops._C_sm90a
        assert torch._C._dispatch_has_kernel_for_dispatch_key("cudadoctor_ops::conv3x3_wgmma_stats", "CUDA")
        xw = torch.empty(2, 64, 9, 11, device="meta", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
        yw, sw = ns.conv3x3_wgmma_stats(xw, torch.empty(64, 64, 3, 3, device="meta", dtype=torch.float16), None)
        assert yw.shape == xw.shape and yw.is_contiguous(memory_format=torch.channels_last), yw
        assert sw.shape == (2, 64) and sw.dtype == torch.float32, sw
        m = cudadoctor_ops.BatchNorm2d(8, activation="relu")
        assert isinstance(m, torch.nn.BatchNorm2d)
        assert m.state_dict().keys() == torch.nn.BatchNorm2d(8).state_dict().keys()
        print("ok")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", check, str(site)], capture_output=True, text=True, timeout=300, cwd=str(site)
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr
