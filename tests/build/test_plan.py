"""The build plan is pure: these tests need neither Docker nor a compiler."""

from __future__ import annotations

import json

import pytest

from cudadoctor.build import plan as P
from cudadoctor.errors import InputError, RefusedError


def spec(**kw):
    kw.setdefault("arch", "8.6,8.9")
    return P.TargetSpec(**kw)


# --- torch decides CUDA; published pairs only ------------------------------------------------------

@pytest.mark.parametrize(
    "torch, cuda, want_cuda, label",
    [
        ("2.14.1", None, "13.0", "cu130torch2.14"),
        ("2.14", None, "13.0", "cu130torch2.14"),
        ("2.14.1", "12.6", "12.6", "cu126torch2.14"),
        ("2.14.1", "13.2", "13.2", "cu132torch2.14"),
        ("2.10.0", None, "12.8", "cu128torch2.10"),
    ],
)
def test_torch_decides_cuda(torch, cuda, want_cuda, label):
    t = P.resolve_target(spec(torch=torch, cuda=cuda))
    assert t.cuda == want_cuda
    assert t.local_label == label


def test_default_torch_is_newest_pypi_default():
    rows = [r for r in P.torch_variants() if r.get("pypi_default")]
    newest = max(rows, key=lambda r: P.parse_version(str(r["torch"])))
    t = P.resolve_target(spec())
    assert t.torch == str(newest["torch"])
    assert t.cuda == str(newest["cuda"])


def test_unpublished_pair_refused_with_published_list():
    with pytest.raises(RefusedError) as e:
        P.resolve_target(spec(torch="2.14.1", cuda="12.1"))
    msg = str(e.value)
    assert "never published for CUDA 12.1" in msg
    assert "13.0" in msg and "12.6" in msg
    assert e.value.exit_code == 1


def test_unknown_torch_needs_cuda():
    with pytest.raises(RefusedError, match="pass --cuda"):
        P.resolve_target(spec(torch="9.9.0"))
    t = P.resolve_target(spec(torch="9.9.0", cuda="13.0"))
    assert t.cuda == "13.0" and t.local_label == "cu130torch9.9"


@pytest.mark.parametrize("bad", ["abc", "2"])
def test_bad_torch_version_is_input_error(bad):
    with pytest.raises(InputError):
        P.resolve_target(spec(torch=bad))


# --- archs nvcc cannot target ----------------------------------------------------------------------

def test_arch_removed_from_cuda13_refused_with_alternative():
    with pytest.raises(RefusedError) as e:
        P.resolve_target(spec(arch="3.5,8.6", cuda="13.0"))
    msg = str(e.value)
    assert "sm_35" in msg and "CUDA 13.0" in msg
    assert "Fix:" in msg and "drop 3.5" in msg
    assert "--cuda 11.8" in msg  # a torch/CUDA pair whose nvcc still targets sm_35


def test_arch_too_new_for_old_cuda_refused():
    with pytest.raises(RefusedError, match="sm_120"):
        P.resolve_target(spec(arch="12.0", torch="2.14.1", cuda="12.6"))


def test_bad_arch_text_is_input_error():
    with pytest.raises(InputError, match="cannot read architecture"):
        P.resolve_target(spec(arch="8.6,banana"))


def test_ptx_items_and_arch_list():
    t = P.resolve_target(spec(arch="8.0,9.0+PTX"))
    assert t.arch_list == "8.0;9.0+PTX"
    assert t.sass == ["sm_80", "sm_90"]
    assert t.ptx == ["compute_90"]


# --- host compiler nvcc rejects ---------------------------------------------------------------------

def test_local_gcc_too_new_refused():
    gmax = P.gcc_max_for("13.0")
    with pytest.raises(RefusedError) as e:
        P.resolve_target(spec(cuda="13.0"), backend="local", host_gcc=gmax + 1)
    assert f"g++ {gmax + 1}" in str(e.value)
    assert f"CUDAHOSTCXX=/usr/bin/g++-{gmax}" in str(e.value)


def test_image_gcc_too_new_refused():
    # ubuntu24.04 ships g++ 13; CUDA 12.0 accepts at most g++ 12
    with pytest.raises(RefusedError, match="rejects g\\+\\+ 13"):
        P.resolve_target(spec(torch="9.9", cuda="12.0", base_image="nvidia/cuda:12.0.1-devel-ubuntu24.04"))


def test_python_not_in_image_refused():
    with pytest.raises(RefusedError, match="ships python 3.11"):
        P.resolve_target(spec(python="3.12", toolkit="pip", base_image="cudadoctor/base:bookworm-abc"))
    t = P.resolve_target(spec(python="3.11", toolkit="pip", base_image="cudadoctor/base:bookworm-abc"))
    assert t.python == "3.11"


# --- image recipe -----------------------------------------------------------------------------------

def test_default_image_is_nvidia_cuda_devel_and_torch_index():
    plan = P.make_plan(spec(torch="2.14.1", cuda="12.6"), source="/s", out="/o")
    assert plan.image.base == "nvidia/cuda:12.6.0-devel-ubuntu24.04"
    env = dict(plan.image.setup_env)
    assert "https://download.pytorch.org/whl/cu126" in env["PIP_EXTRA_INDEX_URL"]
    assert "torch==2.14.1" in env["CUDADOCTOR_REQUIREMENTS"]
    assert plan.image.cuda_home == "/usr/local/cuda"


def test_pip_toolkit_requirements_cuda13_and_12():
    assert P.toolkit_requirements("13.0") == [
        "nvidia-cuda-nvcc==13.0.*", "nvidia-cuda-runtime==13.0.*", "nvidia-cuda-cccl==13.0.*",
        "nvidia-cuda-crt==13.0.*", "nvidia-nvvm==13.0.*",
    ]
    assert P.toolkit_requirements("12.6")[0] == "nvidia-cuda-nvcc-cu12==12.6.*"
    plan = P.make_plan(spec(toolkit="pip"), source="/s", out="/o")
    reqs = plan.image.requirements
    assert "nvidia-cuda-nvcc==13.0.*" in reqs and plan.image.cuda_home == P.PIP_CUDA_HOME


def test_image_tag_is_content_hashed():
    a = P.make_plan(spec(toolkit="pip"), source="/s", out="/o").image.tag
    assert a == P.make_plan(spec(toolkit="pip", arch="9.0"), source="/x", out="/y").image.tag  # archs: build-time only
    b = P.make_plan(spec(toolkit="pip"), source="/s", out="/o",
                    pip=P.PipSettings(extra_index_urls=("file:///mirror/simple",))).image.tag
    c = P.make_plan(spec(toolkit="pip"), source="/s", out="/o", script_digest="other").image.tag
    d = P.make_plan(spec(toolkit="pip", torch="2.14.1", cuda="12.6"), source="/s", out="/o").image.tag
    assert len({a, b, c, d}) == 4
    assert a.startswith("cudadoctor/build:cu130-torch2.14.1-pip-")


def test_ca_bundle_and_index_settings_reach_the_image_env():
    pip = P.PipSettings(index_url="https://mirror/simple", find_links=("/opt/wheels",),
                        ca_bundle="/etc/ssl/certs/ca-certificates.crt")
    plan = P.make_plan(spec(toolkit="pip"), source="/s", out="/o", pip=pip)
    env = dict(plan.image.setup_env)
    assert env["PIP_CERT"] == "/etc/cudadoctor/ca-bundle.crt"
    assert env["PIP_INDEX_URL"] == "https://mirror/simple"
    assert env["PIP_FIND_LINKS"] == "/opt/wheels"


def test_dockerfile_rendering():
    text = P.make_plan(spec(toolkit="pip"), source="/s", out="/o").image.dockerfile()
    assert text.startswith("FROM debian:bookworm\n")
    assert "RUN sh /opt/cudadoctor/setup_toolchain.sh" in text


# --- pip settings from the host ----------------------------------------------------------------------

def test_pip_settings_from_config_and_env():
    config = (
        "global.cert='/etc/ssl/certs/ca-certificates.crt'\n"
        "global.constraint='/etc/xdg/pip/constraints.txt'\n"
        "global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'\n"
        "global.find-links='/opt/wheels'\n"
        ":env:.default-timeout='180'\n"
    )
    pip = P.pip_settings_from_config(config, {"SSL_CERT_FILE": "/x/ca.pem"})
    assert pip.extra_index_urls == ("file:///opt/pypi/simple", "file:///opt/pypi-more/simple")
    assert pip.find_links == ("/opt/wheels",)
    assert pip.constraints == ("/etc/xdg/pip/constraints.txt",)
    assert pip.ca_bundle == "/x/ca.pem"  # SSL_CERT_FILE wins over the config's cert
    assert pip.local_paths() == ["/opt/pypi", "/opt/pypi-more", "/opt/wheels", "/etc/xdg/pip/constraints.txt"]
    assert P.pip_settings_from_config("", {"PIP_CERT": "/p.pem", "REQUESTS_CA_BUNDLE": "/r.pem"}).ca_bundle == "/p.pem"
    assert P.pip_settings_from_config("", {"REQUESTS_CA_BUNDLE": "/r.pem"}).ca_bundle == "/r.pem"


# --- fast-build settings ----------------------------------------------------------------------------

@pytest.mark.parametrize(
    "cores, mem, jobs, targets, want",
    [
        (2, 20.0, None, 2, (2, 1)),
        (16, 120.0, None, 4, (8, 4)),
        (16, 120.0, None, 2, (16, 2)),
        (16, 120.0, None, 1, (16, 1)),
        (16, 6.0, None, 4, (1, 4)),  # memory-bound
        (8, None, None, 4, (8, 2)),
        (16, 100.0, 3, 4, (3, 4)),
    ],
)
def test_parallelism(cores, mem, jobs, targets, want):
    assert P.parallelism(cores, mem, jobs, targets) == want


def test_build_env_flags():
    plan = P.make_plan(spec(arch="8.6,8.9+PTX"), source="/s", out="/o", cores=16, mem_gib=100)
    env = dict(plan.env)
    assert env["TORCH_CUDA_ARCH_LIST"] == "8.6;8.9+PTX"
    assert env["MAX_JOBS"] == "10"  # 3 device targets -> 3 threads; 2 x 16 cores / 3
    assert env["NVCC_APPEND_FLAGS"] == "--threads=3 -Xfatbin -compress-all"
    assert "-gencode=arch=compute_89,code=compute_89" in plan.nvcc_flags
    plain = P.make_plan(spec(), source="/s", out="/o", compress=False)
    assert dict(plain.env)["NVCC_APPEND_FLAGS"].endswith("--no-compress")  # undoes a project's -compress-all


def test_wheel_name_has_local_label():
    plan = P.make_plan(spec(), source="/s", out="/o")
    assert plan.wheel_name("cudadoctor-ops", "0.1.0") == "cudadoctor_ops-0.1.0+cu130torch2.14-cp311-cp311-linux_x86_64.whl"
    assert P.relabel_version("1.2+local", "cu126torch2.14") == "1.2+cu126torch2.14"


def test_plan_is_json_serialisable():
    d = P.make_plan(spec(), source="/s", out="/o").to_dict()
    assert json.loads(json.dumps(d))["target"]["local_label"] == "cu130torch2.14"


def test_unknown_backend_and_toolkit():
    with pytest.raises(InputError):
        P.make_plan(spec(), source="/s", out="/o", backend="podman")
    with pytest.raises(InputError):
        P.resolve_target(spec(toolkit="conda"))


# --- matrix files and GitHub matrix -------------------------------------------------------------------

MATRIX = """
[defaults]
arch = "8.0,8.6,8.9,9.0"
toolkit = "pip"

[[target]]
torch = "2.14.1"

[[target]]
torch = "2.14.1"
cuda = "12.6"
arch = "8.6"
"""


def test_read_matrix_and_github_matrix():
    specs = P.read_matrix(MATRIX)
    assert [s.cuda for s in specs] == [None, "12.6"]
    assert specs[1].arch == "8.6" and specs[0].arch == "8.0,8.6,8.9,9.0"
    targets = [P.resolve_target(s) for s in specs]
    gh = P.github_matrix(targets)
    assert [e["label"] for e in gh["include"]] == ["cu130torch2.14", "cu126torch2.14"]
    assert gh["include"][0]["arch"] == "8.0,8.6,8.9,9.0"
    assert gh["include"][1]["cuda"] == "12.6"


def test_github_matrix_arch_tokens_round_trip():
    t = P.resolve_target(spec(arch="Ampere,compute_90,8.9+PTX"))
    arch = P.github_matrix([t])["include"][0]["arch"]
    assert P.resolve_target(spec(arch=arch)).archs == tuple(
        type(i)(i.arch, i.sass, i.ptx, tok) for i, tok in zip(t.archs, arch.split(",")))
    assert "compute_90" in arch.split(",") and "8.9+PTX" in arch.split(",")


@pytest.mark.parametrize(
    "text, match",
    [
        ("[[target]\n", "not valid TOML"),
        ("[defaults]\narch='8.6'\n", "no \\[\\[target\\]\\]"),
        ("[[target]]\ntorch='2.14.1'\n", "has no arch"),
        ("[[target]]\narch='8.6'\ncolour='red'\n", "unknown key"),
    ],
)
def test_bad_matrix(text, match):
    with pytest.raises(InputError, match=match):
        P.read_matrix(text)
