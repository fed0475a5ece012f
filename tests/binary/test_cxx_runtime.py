"""The reader reports which C++ runtime entry points a shared object defines in its dynamic symbol
table, and what it links (DT_NEEDED): a library linked with -static-libstdc++ defines __cxa_throw
itself, one linked against libstdc++.so.6 only imports it."""

import struct
from pathlib import Path

import pytest

from cudadoctor.binary import BinaryFormatError, read_binary, read_buffer
from cudadoctor.binary.elf import Section
from cudadoctor.binary.reader import CXX_RUNTIME_SYMBOLS, defined_symbols
from cudadoctor.inspect import inspect_path

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "binaries"


def test_static_runtime_library_defines_the_exception_entry_points():
    info = read_binary(FIX / "libstatic_rt.so")
    assert info.format == "shared-object"
    assert info.cxx_runtime_defined == ["__cxa_throw", "__gxx_personality_v0", "__cxa_begin_catch"]
    assert "libstdc++.so.6" not in info.needed and "libc.so.6" in info.needed


def test_shared_runtime_library_only_imports_them():
    info = read_binary(FIX / "libshared_rt.so")
    assert info.cxx_runtime_defined == []
    assert "libstdc++.so.6" in info.needed


def test_nvcc_built_extension_links_libstdcxx():
    (e,) = inspect_path(FIX / "libkern_sm86_sm89_ptx89.so")
    assert e["cxx_runtime_defined"] == [] and "libstdc++.so.6" in e["needed"]


def test_extension_entries_carry_the_fields():
    (e,) = inspect_path(FIX / "libstatic_rt.so")
    assert e["cxx_runtime_defined"] == list(CXX_RUNTIME_SYMBOLS)
    assert e["needed"] == ["libc.so.6", "ld-linux-x86-64.so.2"]
    (o,) = inspect_path(FIX / "sm86_sm89_ptx89.o")  # a relocatable object has no .dynsym
    assert o["cxx_runtime_defined"] == []


def _sym64(name_off, shndx, e="<"):
    return struct.pack(e + "IBBHQQ", name_off, 0x12, 0, shndx, 0x1000, 16)


def _sym32(name_off, shndx, e="<"):
    return struct.pack(e + "IIIBBH", name_off, 0x1000, 16, 0x12, 0, shndx)


@pytest.mark.parametrize("bits,e,sym", [(64, "<", _sym64), (64, ">", _sym64), (32, "<", _sym32), (32, ">", _sym32)])
def test_defined_means_a_section_index_other_than_undef(bits, e, sym):
    strtab = b"\0__cxa_throw\0x__gxx_personality_v0\0__cxa_begin_catch\0"
    throw, pers, catch = strtab.index(b"__cxa_throw"), strtab.index(b"__gxx_personality_v0"), strtab.index(b"__cxa_begin_catch")
    # null symbol, defined __cxa_throw, tail-merged personality (st_name inside "x__gxx..."), undefined catch
    table = sym(0, 0, e) + sym(throw, 12, e) + sym(pers, 0xFFF1, e) + sym(catch, 0, e)
    buf = b"PAD!" + table + b"\x01\x02"  # a torn trailing entry is ignored
    got = defined_symbols(buf, Section(".dynsym", 11, 4, len(table) + 2), strtab, bits, e, CXX_RUNTIME_SYMBOLS)
    assert got == ["__cxa_throw", "__gxx_personality_v0"]


def test_names_absent_from_the_string_table_skip_the_scan():
    assert defined_symbols(b"", Section(".dynsym", 11, 0, 10**9), b"\0malloc\0", 64, "<", CXX_RUNTIME_SYMBOLS) == []


def test_dynsym_running_past_the_end_is_a_typed_error():
    data = bytearray((FIX / "libstatic_rt.so").read_bytes())
    info = read_buffer(bytes(data), "ok.so")
    assert info.cxx_runtime_defined  # sanity: the intact file
    # find .dynsym's section header and make its size run past the end of the file
    e_shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    for i in range(shnum):
        off = e_shoff + i * shentsize
        if struct.unpack_from("<I", data, off + 4)[0] == 11:  # SHT_DYNSYM
            struct.pack_into("<Q", data, off + 32, len(data) * 4)
            break
    else:
        pytest.fail("no .dynsym in the fixture")
    with pytest.raises(BinaryFormatError, match="runs past the end"):
        read_buffer(bytes(data), "bad.so")
