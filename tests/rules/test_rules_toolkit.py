"""Toolkit rules: nvcc presence, nvcc vs torch CUDA, conflicting toolkits, headers, host compiler."""

import pytest

from factsbuilder import facts, finding, ids


def test_nvcc_missing_when_probed_empty():
    f = facts(toolkits=[])
    fd = finding(f, "NVCC_MISSING")
    assert fd["severity"] == "warning"
    assert any("cuda-toolkit-12-4" in x for x in fd["fix"])


def test_nvcc_missing_from_error_text_when_unprobed():
    f = facts(toolkits=None, error_text="OSError: CUDA_HOME environment variable is not set.")
    assert ids(f)[0] == "NVCC_MISSING"


def test_nvcc_not_missing_when_unprobed():
    assert "NVCC_MISSING" not in ids(facts(toolkits=None))


def test_major_mismatch_prefers_installed_matching_toolkit():
    f = facts(toolkits=[{"root": "/usr/local/cuda-11.8", "nvcc": "V11.8.89", "via": ["CUDA_HOME"]},
                        {"root": "/usr/local/cuda-12.4", "nvcc": "12.4.131", "via": ["PATH"]}])
    fd = finding(f, "NVCC_TORCH_MAJOR_MISMATCH")
    assert ids(f)[0] == "NVCC_TORCH_MAJOR_MISMATCH"
    assert fd["fix"][0].startswith("export CUDA_HOME=/usr/local/cuda-12.4 PATH=/usr/local/cuda-12.4/bin:$PATH")
    assert any("pip install torch==2.5.1 --index-url https://download.pytorch.org/whl/cu118" in x for x in fd["fix"])
    assert "TOOLKIT_CONFLICT" in ids(f)


def test_major_mismatch_without_alternative_installs_toolkit():
    f = facts(toolkits=[{"root": None, "nvcc": "11.8", "via": []}], torch={"version": None, "cuda": "12.1"})
    fd = finding(f, "NVCC_TORCH_MAJOR_MISMATCH")
    assert any("cuda-toolkit-12-1" in x for x in fd["fix"])


def test_minor_mismatch_is_warning():
    f = facts(toolkits=[{"root": "/usr/local/cuda-12.1", "nvcc": "12.1.105", "via": ["PATH"]}])
    fd = finding(f, "NVCC_TORCH_MINOR_MISMATCH")
    assert fd["severity"] == "warning"
    assert "NVCC_TORCH_MAJOR_MISMATCH" not in ids(f)


def test_same_version_clean():
    got = ids(facts())
    assert not {"NVCC_TORCH_MAJOR_MISMATCH", "NVCC_TORCH_MINOR_MISMATCH", "TOOLKIT_CONFLICT"} & set(got)


def test_conflict_same_release_is_not_reported():
    f = facts(toolkits=[{"root": "/usr/local/cuda", "nvcc": "12.4.131", "via": ["CUDA_HOME"]},
                        {"root": "/usr/local/cuda-12.4", "nvcc": "12.4.131", "via": ["PATH"]}])
    assert "TOOLKIT_CONFLICT" not in ids(f)


def test_incomplete_toolkit_points_at_pip_headers():
    site = "/venv/lib/python3.11/site-packages/nvidia/cu13"
    f = facts(torch={"version": "2.14.1", "cuda": "13.0", "arch_list": ["sm_75", "sm_80", "sm_86", "sm_90"]},
              driver={"version": "580.65.06", "kernel_module": "580.65.06", "cuda": "13.0"},
              toolkits=[{"root": "/usr/local/cuda", "nvcc": "13.0.88", "via": ["PATH"],
                         "headers_missing": ["cusparse.h", "cublas_v2.h"],
                         "headers_elsewhere": {"cusparse.h": [f"{site}/include/cusparse.h"],
                                               "cublas_v2.h": [f"{site}/include/cublas_v2.h"]}},
                        {"root": site, "nvcc": "13.0.88", "via": ["pip"], "headers_missing": []}])
    fd = finding(f, "TOOLKIT_INCOMPLETE")
    assert ids(f)[0] == "TOOLKIT_INCOMPLETE"
    assert fd["fix"][0].startswith(f"export CPATH={site}/include:$CPATH")


def test_incomplete_resolved_by_include_path():
    f = facts(toolkits=[{"root": "/usr/local/cuda", "nvcc": "12.4.131", "via": ["PATH"],
                         "headers_missing": ["cusparse.h"], "headers_unresolved": []}])
    assert "TOOLKIT_INCOMPLETE" not in ids(f)


def test_incomplete_from_error_text():
    f = facts(error_text="fatal error: cusparse.h: No such file or directory")
    fd = finding(f, "TOOLKIT_INCOMPLETE")
    assert "CPATH" in fd["fix"][0]


@pytest.mark.parametrize("nvcc,gcc,top", [("12.0.140", "14", 12), ("V11.8.89", "12.3.0", 11), ("12.4", "14.1.0", 13)])
def test_gcc_too_new(nvcc, gcc, top):
    f = facts(toolkits=[{"root": "/usr/local/cuda", "nvcc": nvcc, "via": ["PATH"]}],
              torch={"version": None, "cuda": None, "cuda_available": None}, host_compiler={"version": gcc})
    fd = finding(f, "HOST_COMPILER_UNSUPPORTED")
    assert f"export CUDAHOSTCXX=/usr/bin/g++-{top}" in fd["fix"][0]


def test_clang_limit():
    f = facts(host_compiler={"name": "clang", "version": "19.1.0", "path": "/usr/bin/clang++"},
              toolkits=[{"root": "/usr/local/cuda", "nvcc": "12.4.131", "via": ["PATH"]}])
    assert "export CUDAHOSTCXX=/usr/bin/clang++-17" in finding(f, "HOST_COMPILER_UNSUPPORTED")["fix"][0]


@pytest.mark.parametrize("nvcc,gcc", [("12.4.131", "13.2.0"), ("13.0.88", "14.2.0"), ("10.0.130", "5.4")])
def test_gcc_accepted(nvcc, gcc):
    f = facts(toolkits=[{"root": "/usr/local/cuda", "nvcc": nvcc, "via": ["PATH"]}], host_compiler={"version": gcc})
    assert "HOST_COMPILER_UNSUPPORTED" not in ids(f)


def _no_headers(**py):
    return {"version": "3.11.2", "executable": "/usr/bin/python3", "include_dir": "/usr/include/python3.11",
            "has_python_h": False, **py}


def test_python_headers_missing_on_a_distribution_python_names_its_dev_package():
    fd = finding(facts(python=_no_headers(), host={"distro_id": "debian", "distro": "Debian GNU/Linux 12"}),
                 "PYTHON_HEADERS_MISSING")
    assert fd["severity"] == "error" and fd["area"] == "compiler"
    assert "/usr/include/python3.11 has no Python.h" in fd["detail"]
    assert fd["fix"][0].startswith("sudo apt-get install -y python3.11-dev")
    assert not any("dnf" in x for x in fd["fix"])
    fd = finding(facts(python=_no_headers(), host={"distro_id": "rocky", "distro": "Rocky Linux 9.3"}),
                 "PYTHON_HEADERS_MISSING")
    assert fd["fix"][0].startswith("sudo dnf install -y python3.11-devel")
    # distribution unknown: both package managers' commands
    fd = finding(facts(python=_no_headers(), host={"distro_id": None, "distro": None}), "PYTHON_HEADERS_MISSING")
    assert any("apt-get" in x for x in fd["fix"]) and any("dnf" in x for x in fd["fix"])


def test_python_headers_missing_outside_usr_asks_for_a_python_that_ships_them():
    fd = finding(facts(python=_no_headers(executable="/opt/py311/bin/python3",
                                          include_dir="/opt/py311/include/python3.11")), "PYTHON_HEADERS_MISSING")
    assert "/opt/py311 was installed without its headers" in fd["fix"][0]
    assert not any("apt-get" in x for x in fd["fix"]) and "-dev / -devel" not in fd["detail"]


def test_python_headers_missing_is_a_warning_where_nothing_can_be_built_yet():
    fd = finding(facts(python=_no_headers(), toolkits=[]), "PYTHON_HEADERS_MISSING")
    assert fd["severity"] == "warning" and "No nvcc was found" in fd["detail"]


def test_python_headers_from_a_pasted_error_and_never_without_evidence():
    text = "torch/csrc/python_headers.h:9:10: fatal error: Python.h: No such file or directory"
    py = {"version": "3.8.10", "executable": "/usr/bin/python3"}
    f = facts(python=py, toolkits=None, error_text=text)
    assert ids(f)[0] == "PYTHON_HEADERS_MISSING"
    assert "python3.8-dev" in finding(f, "PYTHON_HEADERS_MISSING")["fix"][0]
    assert "PYTHON_HEADERS_MISSING" not in ids(facts(python=py))  # not probed, nothing said
    assert "PYTHON_HEADERS_MISSING" not in ids(facts(python=_no_headers(has_python_h=True)))
    # the probed interpreter has them: the failing build used another one; not this finding
    assert "PYTHON_HEADERS_MISSING" not in ids(facts(python=_no_headers(has_python_h=True), error_text=text))


def test_python_headers_missing_blocks_the_local_build():
    from cudadoctor.build import local_backend as L
    from cudadoctor.doctor import diagnose

    rep = diagnose(facts(python=_no_headers()))
    assert "PYTHON_HEADERS_MISSING" in [f["id"] for f in L.blocking_findings(rep)]

