"""diagnose(): report shape, error-text ranking, survival on arbitrary facts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from cudadoctor.doctor import diagnose, implicated_ids

sys.path.insert(0, str(Path(__file__).parent / "rules"))
from factsbuilder import facts  # noqa: E402

MESSAGES = {
    "CUDA error: no kernel image is available for execution on the device": "TORCH_NO_KERNEL_IMAGE",
    "RuntimeError: CUDA driver version is insufficient for CUDA runtime version": "DRIVER_TOO_OLD",
    "The NVIDIA driver on your system is too old (found version 11040)": "DRIVER_TOO_OLD",
    "The detected CUDA version (11.8) mismatches the version that was used to compile PyTorch (12.1)":
        "NVCC_TORCH_MAJOR_MISMATCH",
    "#error -- unsupported GNU version! gcc versions later than 12 are not supported!": "HOST_COMPILER_UNSUPPORTED",
    "ImportError: _C.so: undefined symbol: _ZN3c104cuda9SetDeviceEi": "EXT_ABI_MISMATCH",
    "Failed to initialize NVML: Driver/library version mismatch": "DRIVER_LIBRARY_MISMATCH",
    "fatal error: cusparse.h: No such file or directory": "TOOLKIT_INCOMPLETE",
    "nvcc fatal   : Unsupported gpu architecture 'compute_70'": "ARCH_LIST_UNSUPPORTED",
    "bash: nvidia-smi: command not found": "CONTAINER_NO_GPU",
    "RuntimeError: Found no NVIDIA driver on your system.": "NO_DRIVER",
}


def test_messages_map_to_findings():
    for text, fid in MESSAGES.items():
        assert fid in implicated_ids(text), text
    assert implicated_ids("") == [] and implicated_ids(None) == []


def test_report_shape_and_error_text_stored():
    rep = diagnose(facts(), error_text="something odd")
    assert rep["schema"] == "cudadoctor.report/1"
    assert rep["status"] == "ok"
    assert rep["facts"]["error_text"] == "something odd"
    assert rep["torch_cuda_arch_list"] == "8.9"
    json.dumps(rep)


def test_error_text_reranks_errors():
    # two errors: a too-new gcc and an arch list nvcc 12.0 cannot target; the compiler error is
    # ranked first by priority, the pasted nvcc message moves the arch finding ahead of it
    f = facts(toolkits=[{"root": "/usr/local/cuda-12.4", "nvcc": "12.4.131", "via": ["PATH", "CUDA_HOME"]}],
              host_compiler={"version": "14.2.0"}, env={"TORCH_CUDA_ARCH_LIST": "3.5;8.9"})
    plain = [x["id"] for x in diagnose(f)["findings"]]
    assert plain.index("HOST_COMPILER_UNSUPPORTED") < plain.index("ARCH_LIST_UNSUPPORTED")
    ranked = diagnose(f, error_text="nvcc fatal   : Value 'sm_35' is not defined for option 'gpu-architecture'")
    ids = [x["id"] for x in ranked["findings"]]
    assert ids[0] == "ARCH_LIST_UNSUPPORTED"
    assert ranked["error_implicates"] == ["ARCH_LIST_UNSUPPORTED"]


def test_input_not_mutated():
    f = facts()
    before = json.dumps(f, sort_keys=True)
    diagnose(f, error_text="x")
    assert json.dumps(f, sort_keys=True) == before


def test_non_dict_facts():
    for bad in (None, [], "x", 3):
        rep = diagnose(bad)
        assert rep["status"] == "ok" and rep["findings"] == []


SECTIONS = ["host", "driver", "gpus", "toolkits", "host_compiler", "python", "torch", "env", "tools", "extensions"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 99999), st.text(max_size=12),
                    st.sampled_from(["12.1", "V12.1.105", "cu121", "2.7.0.dev20250310+cu124", "550.54.15",
                                     "sm_86", "8.9+PTX", "-1", "", "docker", "/usr/lib/wsl/lib/libcuda.so.1"]))
values = st.recursive(scalars, lambda c: st.one_of(st.lists(c, max_size=3),
                                                   st.dictionaries(st.sampled_from(
                                                       ["version", "cuda", "cc", "nvcc", "root", "via", "name",
                                                        "libcuda", "arch_list", "wsl", "container", "kernel_module",
                                                        "TORCH_CUDA_ARCH_LIST", "CUDA_VISIBLE_DEVICES",
                                                        "LD_LIBRARY_PATH", "ninja", "headers_missing",
                                                        "NVIDIA_DRIVER_CAPABILITIES"]), c, max_size=5)), max_leaves=12)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.sampled_from(SECTIONS), values, max_size=8), st.one_of(st.none(), st.text(max_size=40)))
def test_never_crashes_on_arbitrary_facts(data, text):
    rep = diagnose(data, error_text=text)
    assert rep["status"] in ("ok", "warn", "fail")
    assert not [f for f in rep["findings"] if f["id"] == "INTERNAL_RULE_ERROR"], rep["findings"]
    json.dumps(rep)


SCENARIOS = sorted((Path(__file__).parent / "fixtures" / "scenarios").glob("*.json"))


def test_scenarios_survive_any_section_broken():
    """Every scenario with any one section null, {}, [], a string, or deleted still gives a report."""
    for path in SCENARIOS:
        base = json.loads(path.read_text(encoding="utf-8"))["facts"]
        for section in SECTIONS + ["error_text"]:
            for bad in (None, {}, [], "garbage", 7, "__delete__"):
                doc = dict(base)
                if bad == "__delete__":
                    doc.pop(section, None)
                else:
                    doc[section] = bad
                rep = diagnose(doc)
                internal = [f for f in rep["findings"] if f["id"] == "INTERNAL_RULE_ERROR"]
                assert not internal, (path.name, section, bad, internal)
