"""The host-compiler probe records which C++ runtime a compiler links into shared objects
(-print-file-name=libstdc++.so / .a), sees through wrapper scripts, and, when a compiler has only
libstdc++.a, records the other compilers on the machine that have the shared one."""

import threading

from fakes.runner import ScriptedRunner, recorded
from fakes.trees import EXE

from cudadoctor.probes._fs import Root
from cudadoctor.probes.compiler import probe_host_compiler, runtime_facts, wrapper_of
from cudadoctor.runner import Result

WRAPPER = recorded("opt-gcc-bin-gpp-wrapper-h200.sh")
# the --version line of the /opt/gcc compiler was not part of the observation; any gcc 13 line will do
OPT_GCC_VERSION = "g++ (GCC) 13.2.0\nCopyright (C) 2023 Free Software Foundation, Inc.\n"
UBUNTU_GCC13_VERSION = "g++ (Ubuntu 13.3.0-6ubuntu2~24.04) 13.3.0\nCopyright (C) 2023 Free Software Foundation, Inc.\n"
SO, A = "-print-file-name=libstdc++.so", "-print-file-name=libstdc++.a"


def h200_tree(tree, extra=None):
    files = {"/opt/gcc/bin/g++": (WRAPPER, 0o755), "/opt/gcc/bin/g++-real": EXE,
             "/usr/bin/x86_64-linux-gnu-g++-13": EXE, "/usr/bin/x86_64-linux-gnu-gcc-13": EXE}
    files.update(extra or {})
    return tree(files, links={"/usr/bin/g++-13": "x86_64-linux-gnu-g++-13", "/usr/bin/g++": "g++-13",
                              "/usr/bin/gcc-13": "x86_64-linux-gnu-gcc-13", "/usr/bin/gcc": "gcc-13"})


def h200_runner():
    return ScriptedRunner([
        (("opt/gcc/bin/g++", "--version"), OPT_GCC_VERSION),
        (("opt/gcc/bin/g++", "-dumpfullversion", "-dumpversion"), "13.2.0\n"),
        (("opt/gcc/bin/g++", SO), recorded("gpp-print-file-name-libstdcxx-so-opt-gcc-wrapper-h200.txt")),
        (("opt/gcc/bin/g++", A), recorded("gpp-print-file-name-libstdcxx-a-opt-gcc-wrapper-h200.txt")),
        (("usr/bin/x86_64-linux-gnu-g++-13", "--version"), UBUNTU_GCC13_VERSION),
        (("usr/bin/x86_64-linux-gnu-g++-13", "-dumpfullversion", "-dumpversion"), "13.3.0\n"),
        (("usr/bin/x86_64-linux-gnu-g++-13", SO), recorded("gpp-print-file-name-libstdcxx-so-usr-bin-gpp13-h200.txt")),
        (("usr/bin/x86_64-linux-gnu-g++-13", A), recorded("gpp-print-file-name-libstdcxx-a-usr-bin-gpp13-h200.txt")),
    ])


H200_ENV = {"PATH": "/opt/gcc/bin:/usr/bin", "CXX": "/opt/gcc/bin/g++", "CC": "/opt/gcc/bin/g++",
            "CUDAHOSTCXX": "/opt/gcc/bin/g++"}


def test_h200_wrapper_with_only_static_libstdcxx(tree):
    root = h200_tree(tree)
    hc = probe_host_compiler(h200_runner(), Root(str(root)), H200_ENV)
    assert (hc["path"], hc["via"], hc["version"]) == ("/opt/gcc/bin/g++", "CUDAHOSTCXX", "13.2.0")
    assert hc["shared_libstdcxx"] is None
    assert hc["static_libstdcxx"] == "/opt/gcc/lib/gcc/x86_64-linux-gnu/13/libstdc++.a"
    assert hc["links_static_libstdcxx"] is True
    assert hc["wrapper_of"] == "/opt/gcc/bin/g++-real"
    assert "link_compiler" not in hc  # CXX is the same compiler
    assert hc["nvcc_ccbin"]["links_static_libstdcxx"] is True  # CC too
    # the replacement: /usr/bin/g++ (one entry for g++, g++-13 and the triplet name: one real file)
    cands = hc["candidates"]
    assert [c["path"] for c in cands] == ["/usr/bin/g++"]
    best = cands[0]
    assert best["links_static_libstdcxx"] is False
    assert best["shared_libstdcxx"] == "/usr/lib/gcc/x86_64-linux-gnu/13/libstdc++.so"
    assert best["version"] == "13.3.0" and best["cc"] == "/usr/bin/gcc"


def test_runtime_calls_have_a_timeout_and_run_concurrently(tree):
    root = h200_tree(tree)
    barrier = threading.Barrier(2, timeout=5)
    seen = []

    class BarrierRunner(ScriptedRunner):
        def run(self, argv, *, timeout=None, env=None, input=None):
            if str(argv[-1]).startswith("-print-file-name="):
                seen.append(timeout)
                barrier.wait()  # both questions must be in flight at once, or this times out
            return super().run(argv, timeout=timeout, env=env, input=input)

    r = BarrierRunner(h200_runner().rules)
    out = runtime_facts(r, Root(str(root)), "/opt/gcc/bin/g++")
    assert out["links_static_libstdcxx"] is True and not barrier.broken
    assert len(seen) == 2 and all(t is not None and 0 < t <= 10 for t in seen)


def test_debian12_gpp_has_shared_libstdcxx_and_no_candidates_are_probed(tree):
    root = tree({"/usr/bin/g++": EXE, "/usr/bin/clang++": EXE})
    runner = ScriptedRunner([
        (("usr/bin/g++", "--version"), recorded("gpp-version-debian12.txt")),
        (("usr/bin/g++", "-dumpfullversion", "-dumpversion"), "12.2.0\n"),
        (("usr/bin/g++", SO), recorded("gpp-print-file-name-libstdcxx-so-debian12.txt")),
        (("usr/bin/g++", A), recorded("gpp-print-file-name-libstdcxx-a-debian12.txt")),
    ])
    hc = probe_host_compiler(runner, Root(str(root)), {"PATH": "/usr/bin"})
    assert hc["shared_libstdcxx"] == "/usr/lib/gcc/x86_64-linux-gnu/12/libstdc++.so"
    assert hc["static_libstdcxx"] == "/usr/lib/gcc/x86_64-linux-gnu/12/libstdc++.a"
    assert hc["links_static_libstdcxx"] is False and hc["wrapper_of"] is None
    assert "candidates" not in hc
    assert not any("clang++" in c[0] for c in runner.calls)  # nothing else was asked


def test_unknown_when_the_compiler_does_not_answer(tree):
    root = tree({"/usr/bin/g++": EXE})
    runner = ScriptedRunner([
        (("usr/bin/g++", "--version"), recorded("gpp-version-debian12.txt")),
        (("usr/bin/g++", SO), Result((), None, error="g++: timed out after 5s")),
        (("usr/bin/g++", A), (1, "", "g++: error: unrecognized option")),
    ])
    hc = probe_host_compiler(runner, Root(str(root)), {"PATH": "/usr/bin"})
    assert hc["links_static_libstdcxx"] is None and hc["shared_libstdcxx"] is None
    assert "timed out" in hc["runtime_error"] and "exited 1" in hc["runtime_error"]
    assert "candidates" not in hc


def test_neither_library_found_is_not_called_static(tree):
    root = tree({"/usr/bin/g++": EXE})
    runner = ScriptedRunner([(("usr/bin/g++", "--version"), recorded("gpp-version-debian12.txt")),
                             (("usr/bin/g++", SO), "libstdc++.so\n"), (("usr/bin/g++", A), "libstdc++.a\n")])
    hc = probe_host_compiler(runner, Root(str(root)), {"PATH": "/usr/bin"})
    assert (hc["shared_libstdcxx"], hc["static_libstdcxx"], hc["links_static_libstdcxx"]) == (None, None, None)


def test_cudahostcxx_fine_but_cxx_static_is_the_link_compiler(tree):
    root = h200_tree(tree)
    env = {"PATH": "/usr/bin", "CUDAHOSTCXX": "/usr/bin/g++-13", "CXX": "/opt/gcc/bin/g++"}
    hc = probe_host_compiler(h200_runner(), Root(str(root)), env)
    assert hc["path"] == "/usr/bin/g++-13" and hc["links_static_libstdcxx"] is False
    link = hc["link_compiler"]
    assert (link["path"], link["via"], link["links_static_libstdcxx"]) == ("/opt/gcc/bin/g++", "CXX", True)
    assert hc["candidates"][0]["links_static_libstdcxx"] is False


def test_candidates_rank_shared_first_then_same_major(tree):
    root = h200_tree(tree, {"/usr/bin/g++-12": EXE, "/usr/local/bin/clang++": EXE})
    r = h200_runner()
    r.add(("usr/bin/g++-12", "--version"), "g++-12 (Ubuntu 12.3.0-17ubuntu1) 12.3.0\n")
    r.add(("usr/bin/g++-12", "-dumpfullversion", "-dumpversion"), "12.3.0\n")
    r.add(("usr/bin/g++-12", SO), "/usr/lib/gcc/x86_64-linux-gnu/12/libstdc++.so\n")
    r.add(("usr/bin/g++-12", A), "/usr/lib/gcc/x86_64-linux-gnu/12/libstdc++.a\n")
    r.add(("usr/local/bin/clang++", "--version"), recorded("clang-version-17.txt"))
    r.add(("usr/local/bin/clang++", SO), "libstdc++.so\n")
    r.add(("usr/local/bin/clang++", A), "/opt/x/libstdc++.a\n")
    hc = probe_host_compiler(r, Root(str(root)), H200_ENV)
    got = [(c["path"], c["links_static_libstdcxx"]) for c in hc["candidates"]]
    assert got == [("/usr/bin/g++", False), ("/usr/bin/g++-12", False), ("/usr/local/bin/clang++", True)]


def test_wrapper_of_variants(tree):
    root = tree({
        "/a/plain": ('#!/bin/sh\nexec /opt/real/g++ "$@"\n', 0o755),
        "/a/quoted": ("#!/bin/bash\n# comment\nset -e\nexec '/opt/my gcc/g++' -B/x \"$@\"\n", 0o755),
        "/a/exec-a": ('#!/bin/sh\nexec -a g++ /opt/real/g++ "$@"\n', 0o755),
        "/a/no-exec": EXE,
        "/a/binary": ("\x7fELF....", 0o755),
        "/a/huge": ("#!/bin/sh\n" + "#" * 9000 + "\nexec /x/g++\n", 0o755),
    })
    r = Root(str(root))
    assert wrapper_of(r, "/a/plain") == "/opt/real/g++"
    assert wrapper_of(r, "/a/quoted") == "/opt/my gcc/g++"
    assert wrapper_of(r, "/a/exec-a") == "/opt/real/g++"
    assert wrapper_of(r, "/a/no-exec") is None
    assert wrapper_of(r, "/a/binary") is None
    assert wrapper_of(r, "/a/huge") is None
    assert wrapper_of(r, "/a/missing") is None
