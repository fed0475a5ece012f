"""Arch specs, nvcc target ranges, GPU names and the run-on rules."""

import pytest

from cudadoctor.archs import (
    Arch,
    cc_from_name,
    describe_nvcc_range,
    gencode_flags,
    nvcc_can_target,
    nvcc_target_range,
    parse_arch_list,
    parse_spec,
    ptx_runs_on,
    runs_on,
    sass_runs_on,
    torch_arch_list,
)
from cudadoctor.errors import InputError

SPECS = [
    ("8.6,8.9", "8.6;8.9"),
    ("8.6;8.9 9.0", "8.6;8.9;9.0"),
    ("86", "8.6"),
    ("sm_86", "8.6"),
    ("compute_86", "8.6+PTX"),
    ("8.9+PTX", "8.9+PTX"),
    ("8.9+ptx", "8.9+PTX"),
    ("9.0a", "9.0a"),
    ("10.0f", "10.0f"),
    ("Ampere", "8.0;8.6+PTX"),
    ("ada", "8.9+PTX"),
    ("Hopper", "9.0+PTX"),
    ("Blackwell", "10.0;10.3;12.0;12.1+PTX"),
    ("Ampere+Tegra", "8.7"),
    ("  8.6 ;; 8.6, 8.0 ", "8.0;8.6"),
]


@pytest.mark.parametrize("spec,want", SPECS)
def test_spec_forms(spec, want):
    assert torch_arch_list(parse_spec(spec)) == want


def test_compute_only_is_ptx_only_in_gencode():
    assert gencode_flags(parse_spec("compute_86")) == ["-gencode=arch=compute_86,code=compute_86"]
    assert gencode_flags(parse_spec("8.9+PTX")) == [
        "-gencode=arch=compute_89,code=sm_89",
        "-gencode=arch=compute_89,code=compute_89",
    ]
    assert gencode_flags(parse_spec("9.0a")) == ["-gencode=arch=compute_90a,code=sm_90a"]


def test_native_uses_present_gpus_with_ptx_on_highest():
    items = parse_spec("native", gpus=["8.9", "8.6", "8.9"])
    assert torch_arch_list(items) == "8.6;8.9+PTX"
    assert parse_spec("native", gpus=[]) == []


def test_all_follows_nvcc():
    on13 = torch_arch_list(parse_spec("all", nvcc_version="13.0"))
    assert on13.startswith("7.5;8.0") and "7.0" not in on13 and on13.endswith("12.1+PTX")
    on118 = [i.cc for i in parse_spec("all", nvcc_version="11.8")]
    assert "3.5" in on118 and "9.0" in on118 and "12.0" not in on118


@pytest.mark.parametrize("bad", ["8.5", "sm_8", "Amperes", "9.0x", "lto_90", "8.6,foo", "", "   "])
def test_bad_spec_quotes_input_and_lists_forms(bad):
    with pytest.raises(InputError) as ei:
        parse_spec(bad)
    msg = str(ei.value)
    assert repr(bad) in msg or repr(bad.strip()) in msg
    assert "Valid forms" in msg and "compute_86" in msg
    assert ei.value.exit_code == 2


def test_lenient_parser_skips_garbage():
    items = parse_arch_list("8.6; garbage ;9.0+PTX")
    assert [(i.cc, i.sass, i.ptx) for i in items] == [("8.6", True, False), ("9.0", True, True)]
    assert parse_arch_list(None) == [] and parse_arch_list(3.5) == []


@pytest.mark.parametrize(
    "arch,nvcc,ok",
    [
        ("12.0", "12.1", False),
        ("12.0", "12.8", True),
        ("sm_120", "V12.8.61", True),
        ("3.5", "11.8", True),
        ("3.5", "12.0", False),
        ("7.0", "12.9", True),
        ("7.0", "13.0", False),
        ("9.0a", "11.8", False),
        ("9.0a", "12.0", True),
        ("10.0f", "12.8", False),
        ("10.0f", "12.9", True),
        ("11.0", "12.9", False),
        ("8.6", None, True),
        ("8.5", "12.4", False),
    ],
)
def test_nvcc_can_target(arch, nvcc, ok):
    assert nvcc_can_target(arch, nvcc) is ok


def test_nvcc_target_range_and_wording():
    assert nvcc_target_range("12.0") == ("12.8", None)
    assert nvcc_target_range("sm_35") == ("7.0", "11.8")
    assert nvcc_target_range("7.0")[1] == "12.9"
    assert "CUDA >= 12.8" in describe_nvcc_range("12.0")
    assert "<= 11.8" in describe_nvcc_range("3.5")
    assert "removed in CUDA 13.0" in describe_nvcc_range("7.0")
    with pytest.raises(InputError):
        nvcc_target_range("8.5")


@pytest.mark.parametrize(
    "name,cc",
    [
        ("NVIDIA GeForce RTX 4090", "8.9"),
        ("NVIDIA GeForce RTX 5090 D", "12.0"),
        ("NVIDIA GeForce GTX 1070", "6.1"),
        ("NVIDIA H200", "9.0"),
        ("NVIDIA GH200 480GB", "9.0"),
        ("NVIDIA A100-SXM4-80GB", "8.0"),
        ("NVIDIA A10G", "8.6"),
        ("NVIDIA RTX A6000", "8.6"),
        ("NVIDIA RTX 6000 Ada Generation", "8.9"),
        ("Quadro RTX 6000", "7.5"),
        ("Tesla T4", "7.5"),
        ("Tesla V100-SXM2-16GB", "7.0"),
        ("NVIDIA L40S", "8.9"),
        ("NVIDIA B200", "10.0"),
        ("NVIDIA GeForce RTX 3060 Laptop GPU", "8.6"),
        ("Tesla K80", "3.7"),
        ("Orin", "8.7"),
        ("Some Unknown Accelerator", None),
        ("", None),
        (None, None),
    ],
)
def test_cc_from_name(name, cc):
    assert cc_from_name(name) == cc


@pytest.mark.parametrize(
    "code,cc,sass,ptx",
    [
        ("sm_86", "8.9", True, True),   # 8.6 SASS runs on 8.9
        ("sm_86", "8.0", False, False),  # 8.6 SASS not on 8.0
        ("sm_80", "9.0", False, True),   # SASS stays in its major; PTX JITs upward
        ("sm_90a", "9.0", True, True),
        ("sm_90a", "10.0", False, False),  # 9.0a on 9.0 only
        ("sm_87", "8.7", True, True),
        ("sm_87", "8.9", False, True),   # Jetson SASS only on exactly 8.7
        ("sm_80", "8.7", False, True),   # and nothing else's SASS on a Jetson
        ("sm_100f", "10.3", True, True),
        ("sm_100f", "12.0", False, False),
        ("sm_103f", "10.0", False, False),
    ],
)
def test_run_rules(code, cc, sass, ptx):
    assert sass_runs_on(code, cc) is sass
    assert ptx_runs_on(code.replace("sm_", "compute_"), cc) is ptx


def test_runs_on_prefers_sass():
    assert runs_on(["sm_86"], ["compute_89"], "8.9") == (True, "sass")
    assert runs_on([], ["compute_80"], "9.0") == (True, "ptx")
    assert runs_on(["sm_86"], [], "8.0") == (False, None)
    assert Arch.parse("compute_90a") == Arch(9, 0, "a")


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SPEC_ALPHABET = st.sampled_from(list("0123456789.,; +afxPTXsmcompute_AmpereAdaHopperBlackwellnativeall\t"))


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.text(SPEC_ALPHABET, max_size=40), st.text(max_size=40)))
def test_spec_parsers_never_crash(text):
    items = parse_arch_list(text)
    assert all(isinstance(i.arch, Arch) for i in items)
    try:
        strict = parse_spec(text)
    except InputError as exc:
        assert "Valid forms" in str(exc)
    else:
        assert torch_arch_list(strict) == torch_arch_list(parse_arch_list(text))
