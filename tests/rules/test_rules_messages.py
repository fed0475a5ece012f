"""Rules read off pasted error messages: extension loaded before torch, compiler killed for memory,
an old libstdc++ loaded first."""

from factsbuilder import facts, finding, ids

LIBC10 = "ImportError: libc10.so: cannot open shared object file: No such file or directory"


def test_extension_loaded_before_torch_says_import_torch_first():
    fd = finding(facts(error_text=LIBC10, torch={"lib_dir": "/venv/lib/python3.11/site-packages/torch/lib"}),
                 "EXT_LOADED_BEFORE_TORCH")
    assert fd["severity"] == "error" and "loaded before torch" in fd["title"]
    assert "import torch" in fd["fix"][0]
    assert "LD_LIBRARY_PATH=/venv/lib/python3.11/site-packages/torch/lib:" in fd["fix"][1]


def test_extension_libtorch_split_cuda_means_built_against_torch_1_10_to_1_12():
    text = "ImportError: libtorch_cuda_cu.so: cannot open shared object file: No such file or directory"
    fd = finding(facts(error_text=text), "EXT_LOADED_BEFORE_TORCH")
    assert "1.10-1.12" in fd["title"] and fd["fix"][0].startswith("rebuild it against the torch installed now")
    # on torch 1.12 itself the library exists: then it is the import order again
    fd = finding(facts(error_text=text, torch={"version": "1.12.1+cu116", "cuda": "11.6"}), "EXT_LOADED_BEFORE_TORCH")
    assert "loaded before torch" in fd["title"]


def test_extension_cuda_library_next_to_a_cpu_torch():
    text = "ImportError: libc10_cuda.so: cannot open shared object file: No such file or directory"
    fd = finding(facts(error_text=text, torch={"version": "2.5.1+cpu", "cuda": None}), "EXT_LOADED_BEFORE_TORCH")
    assert "CPU build" in fd["title"] and "download.pytorch.org" in fd["fix"][0]


def test_extension_loaded_before_torch_not_when_torch_itself_fails_or_nothing_said():
    assert "EXT_LOADED_BEFORE_TORCH" not in ids(facts(error_text=LIBC10, torch={"import_error": LIBC10}))
    assert "EXT_LOADED_BEFORE_TORCH" not in ids(facts())
    assert "EXT_LOADED_BEFORE_TORCH" not in ids(facts(error_text="libcudnn.so.9: cannot open shared object file"))


def test_build_out_of_memory_sizes_max_jobs_from_the_free_memory():
    text = "nvcc error   : 'cicc' died due to signal 9 (Kill signal)"
    fd = finding(facts(error_text=text, host={"cpus": 32, "mem_available_gib": 12.0}), "BUILD_OUT_OF_MEMORY")
    assert fd["fix"][0].startswith("export MAX_JOBS=4 ") and "34 here" in fd["detail"]
    fd = finding(facts(error_text=text, host={"cpus": 2, "mem_available_gib": 60.0}), "BUILD_OUT_OF_MEMORY")
    assert fd["fix"][0].startswith("export MAX_JOBS=2 ")  # never more jobs than CPUs
    # MAX_JOBS already set and still killed: half of it
    fd = finding(facts(error_text="c++: fatal error: Killed signal terminated program cc1plus",
                       env={"MAX_JOBS": "6"}), "BUILD_OUT_OF_MEMORY")
    assert fd["fix"][0].startswith("export MAX_JOBS=3 ") and "MAX_JOBS=6 was still too many" in fd["fix"][0]
    assert "cc1plus" in fd["title"]


def test_build_out_of_memory_needs_the_message():
    assert "BUILD_OUT_OF_MEMORY" not in ids(facts(host={"mem_available_gib": 0.5}))
    assert "BUILD_OUT_OF_MEMORY" not in ids(facts(error_text="killed by signal 11 (SIGSEGV) while importing torch"))


def test_gcc_for_glibcxx_labels_from_the_table():
    from cudadoctor.knowledge import load_table
    from cudadoctor.rules.messages import _gcc_for

    assert _gcc_for("3.4.30") == "12.1.0" and _gcc_for("3.4.32") == "13.2.0" and _gcc_for("3.4.29") == "11.1.0"
    assert _gcc_for("3.4.10") is None  # older than the table: no claim
    assert _gcc_for("3.4.40") == "14.1.0"  # newer than the table: at least its newest row
    rows = load_table("libstdcxx")
    assert all(r["source"] for r in rows) and [r["glibcxx"] for r in rows] == sorted(
        (r["glibcxx"] for r in rows), key=lambda v: tuple(map(int, v.split("."))))


def test_libstdcxx_conda_environment_copy_too_old_for_an_extension():
    text = ("ImportError: /opt/conda/envs/a/lib/libstdc++.so.6: version `GLIBCXX_3.4.32' not found "
            "(required by /work/ext/_C.so)")
    f = facts(error_text=text, host_compiler={"shared_libstdcxx": "/usr/lib/gcc/x86_64-linux-gnu/13/libstdc++.so"})
    fd = finding(f, "LIBSTDCXX_TOO_OLD")
    assert "GCC 13.2.0" in fd["title"] and "/work/ext/_C.so needs GLIBCXX_3.4.32" in fd["detail"]
    assert fd["fix"][0].startswith("conda install -c conda-forge 'libstdcxx-ng>=13'")
    assert fd["fix"][1] == ("or export LD_PRELOAD=/usr/lib/gcc/x86_64-linux-gnu/13/libstdc++.so   "
                            "(the libstdc++ of the compiler that built it)")


def test_libstdcxx_system_copy_in_front_of_conda_and_torch_import_defers():
    err = ("ImportError: /lib/x86_64-linux-gnu/libstdc++.so.6: version `GLIBCXX_3.4.30' not found (required by "
           "/c/envs/e/lib/python3.10/site-packages/torch/lib/libtorch_python.so) while importing torch")
    f = facts(torch={"import_error": err, "version": None}, env={"CONDA_PREFIX": "/c/envs/e"})
    found = ids(f)
    assert "LIBSTDCXX_TOO_OLD" in found and "TORCH_IMPORT_FAILED" not in found
    fd = finding(f, "LIBSTDCXX_TOO_OLD")
    assert "torch itself needs" in fd["detail"] and "found before the conda environment's own" in fd["detail"]
    assert fd["fix"][1] == "export LD_LIBRARY_PATH=/c/envs/e/lib:$LD_LIBRARY_PATH"


def test_libstdcxx_system_copy_too_old_for_an_extension_built_elsewhere():
    text = "OSError: /usr/lib64/libstdc++.so.6: version `GLIBCXX_3.4.29' not found (required by /srv/ext.so)"
    fd = finding(facts(error_text=text), "LIBSTDCXX_TOO_OLD")
    assert "oldest distribution it must run on" in fd["fix"][0] and "GCC 11" in fd["fix"][0]
    assert "LIBSTDCXX_TOO_OLD" not in ids(facts(error_text="undefined symbol: _ZN3c1010Error"))


CXX20 = "ATen/ATen.h:5:2: error: #error C++20 or later compatible compiler is required to use ATen."


def test_cxx_standard_too_old_names_the_standard_and_where_it_is_pinned():
    fd = finding(facts(error_text=CXX20, torch={"version": "2.14.1+cu130", "cuda": "13.0"}), "CXX_STANDARD_TOO_OLD")
    assert "C++20" in fd["title"] and "torch 2.14.1+cu130" in fd["title"]
    assert "'-std=c++20' in both" in fd["fix"][0] and fd["fix"][1] == (
        "CMake: set(CMAKE_CXX_STANDARD 20) and set(CMAKE_CUDA_STANDARD 20)")
    assert any("CUDA 12.0 or newer" in x for x in fd["fix"])
    assert not any("too old" in x for x in fd["fix"])  # g++ 11.4 of the healthy facts knows C++20


def test_cxx_standard_too_old_with_a_compiler_that_cannot_do_it():
    fd = finding(facts(error_text="#error You need C++17 to compile PyTorch",
                       host_compiler={"name": "gcc", "version": "7.5.0"}), "CXX_STANDARD_TOO_OLD")
    assert any("g++ 7.5.0 is too old; g++ 9 or newer" in x for x in fd["fix"])
    fd = finding(facts(error_text=CXX20, host_compiler={"name": "gcc", "version": "9.4.0"}), "CXX_STANDARD_TOO_OLD")
    assert any("g++ 9.4.0 is too old; g++ 10 or newer" in x for x in fd["fix"])
    assert "CXX_STANDARD_TOO_OLD" not in ids(facts(error_text="error: 'optional' in namespace 'std' does not name a type"))


def test_a_message_rule_comes_first_when_the_message_names_it():
    from cudadoctor.doctor import diagnose

    rep = diagnose(facts(torch={"version": "2.14.1+cu130", "cuda": "13.0"}), error_text=CXX20)
    errors = [f["id"] for f in rep["findings"] if f["severity"] == "error"]
    assert errors[0] == "CXX_STANDARD_TOO_OLD", errors


def test_libstdcxx_older_than_the_compilers_is_a_warning_before_any_message():
    f = facts(python={"libstdcxx": "/opt/conda/envs/a/lib/libstdc++.so.6.0.29", "libstdcxx_glibcxx": "3.4.29"},
              host_compiler={"name": "gcc", "version": "13.2.0",
                             "shared_libstdcxx": "/usr/lib/gcc/x86_64-linux-gnu/13/libstdc++.so",
                             "shared_libstdcxx_glibcxx": "3.4.32"})
    fd = finding(f, "LIBSTDCXX_TOO_OLD")
    assert fd["severity"] == "warning" and "GLIBCXX_3.4.32" in fd["title"]
    assert "stops at GLIBCXX_3.4.29" in fd["detail"] and "conda environment's" in fd["detail"]
    assert fd["fix"][0].startswith("conda install -c conda-forge 'libstdcxx-ng>=13'")
    assert fd["fix"][1].startswith("or export LD_PRELOAD=/usr/lib/gcc/x86_64-linux-gnu/13/libstdc++.so")
    same = facts(python={"libstdcxx": "/usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.30", "libstdcxx_glibcxx": "3.4.30"},
                 host_compiler={"shared_libstdcxx_glibcxx": "3.4.30"})
    assert "LIBSTDCXX_TOO_OLD" not in ids(same)
    newer = facts(python={"libstdcxx": "/c/lib/libstdc++.so.6", "libstdcxx_glibcxx": "3.4.33"},
                  host_compiler={"shared_libstdcxx_glibcxx": "3.4.30"})
    assert "LIBSTDCXX_TOO_OLD" not in ids(newer)  # the process's copy is the newer one: fine
