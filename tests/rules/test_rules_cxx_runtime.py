"""C++ runtime rules: a compiler with only libstdc++.a, and extensions that carry their own runtime."""

import pytest

from factsbuilder import facts, finding, ids

from cudadoctor.cxx_runtime import fix_env, linking_static, shared_alternative, static_compilers

OPT = {"name": "gcc", "version": "13.3.0", "path": "/opt/gcc/bin/g++", "shared_libstdcxx": None,
       "static_libstdcxx": "/opt/gcc/lib/gcc/x86_64-linux-gnu/13/libstdc++.a", "links_static_libstdcxx": True,
       "wrapper_of": "/opt/gcc/bin/g++-real"}
USR = {"name": "gcc", "version": "13.3.0", "path": "/usr/bin/g++",
       "shared_libstdcxx": "/usr/lib/gcc/x86_64-linux-gnu/13/libstdc++.so",
       "static_libstdcxx": "/usr/lib/gcc/x86_64-linux-gnu/13/libstdc++.a", "links_static_libstdcxx": False,
       "wrapper_of": None, "cc": "/usr/bin/gcc"}
EXT = {"path": "/venv/site-packages/cudadoctor_ops/_C.so", "sass": ["sm_89"], "ptx": [],
       "cxx_runtime_defined": ["__cxa_throw", "__gxx_personality_v0", "__cxa_begin_catch"],
       "needed": ["libc10.so", "libgcc_s.so.1", "libc.so.6"]}


def static_host(**extra):
    return dict(OPT, via="CXX", candidates=[dict(USR)], **extra)


def test_static_compiler_with_alternative_names_both_and_the_exports():
    f = facts(host_compiler=static_host(), env={"CXX": "/opt/gcc/bin/g++"})
    fd = finding(f, "HOST_COMPILER_STATIC_LIBSTDCXX")
    assert fd["severity"] == "error" and fd["area"] == "compiler"
    assert "/opt/gcc/bin/g++" in fd["detail"] and "/opt/gcc/lib/gcc/x86_64-linux-gnu/13/libstdc++.a" in fd["detail"]
    assert "a wrapper of /opt/gcc/bin/g++-real" in fd["detail"] and "SIGSEGV" in fd["detail"]
    assert fd["fix"][0].startswith("export CXX=/usr/bin/g++")
    assert fd["fix"][1].startswith('export LDSHARED="/usr/bin/g++ -shared"')
    assert "host_compiler.links_static_libstdcxx" in fd["facts"] and "host_compiler.candidates" in fd["facts"]
    assert ids(f)[0] == "HOST_COMPILER_STATIC_LIBSTDCXX"


def test_without_alternative_the_fix_installs_one():
    f = facts(host_compiler=dict(OPT, via="PATH"))
    fd = finding(f, "HOST_COMPILER_STATIC_LIBSTDCXX")
    assert "apt-get install -y g++" in fd["fix"][0] and "LDSHARED" in fd["fix"][1]
    assert "g++ on PATH" in fd["detail"]


def test_cc_and_cudahostcxx_follow_when_they_name_the_static_compiler():
    hc = dict(OPT, via="CUDAHOSTCXX", nvcc_ccbin=dict(OPT, path="/opt/gcc/bin/gcc"), candidates=[dict(USR)])
    env = {"CXX": "/opt/gcc/bin/g++", "CUDAHOSTCXX": "/opt/gcc/bin/g++", "CC": "/opt/gcc/bin/gcc"}
    assert fix_env(hc, env) == {"CXX": "/usr/bin/g++", "LDSHARED": "/usr/bin/g++ -shared", "CC": "/usr/bin/gcc",
                                "CUDAHOSTCXX": "/usr/bin/g++"}
    fd = finding(facts(host_compiler=hc, env=env), "HOST_COMPILER_STATIC_LIBSTDCXX")
    assert any(x.startswith("export CC=/usr/bin/gcc CUDAHOSTCXX=/usr/bin/g++") for x in fd["fix"])
    assert fd["detail"].startswith("/opt/gcc/bin/g++ (CXX, CUDAHOSTCXX; a wrapper of /opt/gcc/bin/g++-real); "
                                   "/opt/gcc/bin/gcc (CC; a wrapper of /opt/gcc/bin/g++-real): ")


def test_cc_without_c_sibling_falls_back_to_the_cxx_driver():
    hc = dict(OPT, via="CXX", nvcc_ccbin=dict(OPT), candidates=[dict(USR, cc=None)])
    assert fix_env(hc, {"CC": "/opt/gcc/bin/g++"})["CC"] == "/usr/bin/g++"


def test_only_cudahostcxx_static_is_not_reported():
    hc = dict(OPT, via="CUDAHOSTCXX", link_compiler=dict(USR, via="CXX"), candidates=[dict(USR)])
    f = facts(host_compiler=hc, env={"CUDAHOSTCXX": "/opt/gcc/bin/g++", "CXX": "/usr/bin/g++"})
    assert "HOST_COMPILER_STATIC_LIBSTDCXX" not in ids(f)
    assert static_compilers(hc, {"CUDAHOSTCXX": "/opt/gcc/bin/g++"})[0].links is False


def test_static_link_compiler_behind_a_shared_cudahostcxx_is_reported():
    hc = dict(USR, via="CUDAHOSTCXX", link_compiler=dict(OPT, via="CXX"), candidates=[dict(USR)])
    fd = finding(facts(host_compiler=hc), "HOST_COMPILER_STATIC_LIBSTDCXX")
    assert "host_compiler.link_compiler.links_static_libstdcxx" in fd["facts"]
    assert fd["title"].startswith("/opt/gcc/bin/g++ ")


def test_shared_alternative_skips_static_and_unknown_candidates():
    hc = static_host()
    hc["candidates"] = [dict(OPT, path="/opt/other/g++"), dict(USR, links_static_libstdcxx=None, path="/x/g++"),
                        dict(USR)]
    assert shared_alternative(hc)["path"] == "/usr/bin/g++"


@pytest.mark.parametrize("hc", [None, {}, "gcc", [], {"links_static_libstdcxx": "yes"},
                                {"path": None, "links_static_libstdcxx": True},
                                {"path": "/usr/bin/g++", "links_static_libstdcxx": None},
                                {"path": "/usr/bin/g++", "links_static_libstdcxx": True, "candidates": "x",
                                 "link_compiler": 3, "nvcc_ccbin": "y"}])
def test_odd_host_compiler_sections_never_crash(hc):
    f = facts(host_compiler=hc, extensions=[None, 1, {"path": 2}, {"path": "/a.so", "cxx_runtime_defined": "x"}])
    got = ids(f)
    assert "INTERNAL_RULE_ERROR" not in got
    assert "EXT_STATIC_CXX_RUNTIME" not in got
    linking_static(hc), fix_env(hc)


def test_extension_defining_the_runtime_is_an_error_with_the_rebuild_command():
    f = facts(host_compiler=static_host(), env={"CXX": "/opt/gcc/bin/g++"}, extensions=[dict(EXT)])
    fd = finding(f, "EXT_STATIC_CXX_RUNTIME")
    assert fd["area"] == "extensions"
    assert "__cxa_throw, __gxx_personality_v0, __cxa_begin_catch" in fd["detail"]
    assert "does not link libstdc++.so.6" in fd["detail"] and "SIGSEGV" in fd["detail"]
    assert 'export CXX=/usr/bin/g++ LDSHARED="/usr/bin/g++ -shared"' in fd["fix"][0]
    assert "pip install --no-build-isolation" in fd["fix"][0]
    assert fd["facts"] == ["extensions[0].cxx_runtime_defined", "extensions[0].needed"]
    assert ids(f)[:2] == ["HOST_COMPILER_STATIC_LIBSTDCXX", "EXT_STATIC_CXX_RUNTIME"]  # the cause first


def test_extension_rebuild_names_the_current_compiler_when_it_is_fine():
    f = facts(extensions=[dict(EXT, needed=None)])
    fd = finding(f, "EXT_STATIC_CXX_RUNTIME")
    assert 'export CXX=/usr/bin/g++ LDSHARED="/usr/bin/g++ -shared"' in fd["fix"][0]
    assert fd["facts"] == ["extensions[0].cxx_runtime_defined"]


@pytest.mark.parametrize("defined", [[], ["__cxa_begin_catch"], ["__cxa_throw_bad_array_new_length"]])
def test_extension_importing_the_runtime_is_fine(defined):
    f = facts(extensions=[dict(EXT, cxx_runtime_defined=defined, needed=["libstdc++.so.6"])])
    assert "EXT_STATIC_CXX_RUNTIME" not in ids(f)


def test_damaged_extension_entry_is_skipped():
    assert "EXT_STATIC_CXX_RUNTIME" not in ids(facts(extensions=[dict(EXT, error="truncated ELF file")]))


def test_human_report_shows_them_under_host_compiler_and_extensions():
    from cudadoctor.doctor import diagnose
    from cudadoctor.render import human

    f = facts(host_compiler=static_host(), env={"CXX": "/opt/gcc/bin/g++"}, extensions=[dict(EXT)])
    out = human(diagnose(f), verbose=True, ascii_only=True)
    comp = out.index("Host compiler:")
    arch = out.index("Arch list:")
    ext = out.index("Extensions:")
    assert comp < out.index("[HOST_COMPILER_STATIC_LIBSTDCXX, #1]") < arch
    assert ext < out.index("[EXT_STATIC_CXX_RUNTIME, #2]")
    assert "libstdc++: static only (/opt/gcc/lib/gcc/x86_64-linux-gnu/13/libstdc++.a)" in out[comp:arch]
