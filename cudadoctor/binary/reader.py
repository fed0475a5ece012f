"""Read one file: a host ELF (.so/.o/executable) carrying CUDA fat binaries, a bare cubin, or a
.fatbin. The file is memory-mapped, so a 1 GB libtorch_cuda.so is read header by header, never
loaded whole."""

from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass, field

from cudadoctor.binary.elf import ELF_MAGIC, cubin_arch, parse_elf
from cudadoctor.binary.errors import BinaryFormatError
from cudadoctor.binary.fatbin import FATBIN_MAGIC_BYTES, FatbinEntry, iter_containers

FATBIN_SECTIONS = (".nv_fatbin", "__nv_relfatbin")
_DT_NEEDED = 1
_CUDART = re.compile(r"libcudart\.so\.(\d+)")
# The C++ runtime's exception entry points. A shared object that defines them (linked with
# -static-libstdc++, or by a compiler that has only libstdc++.a) throws with its own private copy of
# the runtime, which the process's catch sites do not recognise.
CXX_RUNTIME_SYMBOLS = ("__cxa_throw", "__gxx_personality_v0", "__cxa_begin_catch")
_SHN_UNDEF = 0


@dataclass
class BinaryInfo:
    path: str
    format: str  # "shared-object", "object", "executable", "cubin", "fatbin"
    entries: list[FatbinEntry] = field(default_factory=list)
    needed: list[str] = field(default_factory=list)  # DT_NEEDED of a shared object
    cxx11_abi: bool | None = None  # from the C++ symbols it imports, when they tell
    cxx_runtime_defined: list[str] = field(default_factory=list)  # CXX_RUNTIME_SYMBOLS it defines (.dynsym)

    @property
    def sass(self) -> list[str]:
        return _sorted_unique(e.arch for e in self.entries if e.kind == "sass")

    @property
    def ptx(self) -> list[str]:
        return _sorted_unique(e.arch for e in self.entries if e.kind == "ptx")

    @property
    def lto(self) -> list[str]:
        return _sorted_unique(e.arch for e in self.entries if e.kind == "lto")

    @property
    def cuda_major(self) -> str | None:
        for lib in self.needed:
            m = _CUDART.match(lib)
            if m:
                return m.group(1)
        return None


def arch_sort_key(name: str) -> tuple:
    m = re.match(r"(?:sm|compute|lto)_(\d+)([af]?)$", name)
    return (int(m.group(1)), m.group(2)) if m else (10**6, name)


def _sorted_unique(names) -> list[str]:
    return sorted(set(names), key=arch_sort_key)


def read_buffer(buf, path: str) -> BinaryInfo:
    """Parse bytes / an mmap holding one binary file."""
    head = bytes(buf[:4])
    if head == FATBIN_MAGIC_BYTES:
        return BinaryInfo(path, "fatbin", list(iter_containers(buf, 0, len(buf), name=path)))
    if head != ELF_MAGIC:
        raise BinaryFormatError(
            f"{path} is not an ELF file, a cubin or a CUDA fat binary (it starts with {head!r}).",
            hint="Give a .so, .o, .cubin, .fatbin, .whl or a folder.",
        )
    elf = parse_elf(buf, name=path)
    cub = cubin_arch(elf)
    if cub is not None:
        sm, suffix = cub
        entry = FatbinEntry("sass", f"sm_{sm}{suffix}", len(buf), 0, 0, None, None, False)
        return BinaryInfo(path, "cubin", [entry])
    fmt = {1: "object", 2: "executable", 3: "shared-object"}.get(elf.type, "elf")
    info = BinaryInfo(path, fmt)
    for sec in elf.sections:
        if sec.name in FATBIN_SECTIONS and sec.size:
            info.entries.extend(iter_containers(buf, sec.offset, sec.offset + sec.size, name=f"{path} {sec.name}"))
    dynstr = elf.section(".dynstr")
    dynamic = elf.section(".dynamic")
    if dynstr is not None and dynstr.size:
        strtab = buf[dynstr.offset : dynstr.offset + dynstr.size]
        if dynamic is not None and dynamic.size:
            info.needed = _needed(buf, dynamic, bytes(strtab), elf.bits, elf.endian)
        info.cxx11_abi = _cxx11_abi(strtab)
        dynsym = elf.section(".dynsym")
        if dynsym is not None and dynsym.size:
            info.cxx_runtime_defined = defined_symbols(buf, dynsym, bytes(strtab), elf.bits, elf.endian,
                                                       CXX_RUNTIME_SYMBOLS)
    return info


def defined_symbols(buf, dynsym, strtab: bytes, bits: int, e: str, names) -> list[str]:
    """Which of ``names`` the symbol table ``dynsym`` defines (st_shndx != SHN_UNDEF), in the order
    of ``names``. Only whole entries inside the section are read (parse_elf checked it lies in the file)."""
    wanted: dict[int, str] = {}
    for n in names:
        # a string table may share tails ("x__cxa_throw" serving "__cxa_throw"), so every place the
        # name ends with its NUL can be a symbol's st_name
        for m in re.finditer(re.escape(n.encode("ascii")) + b"\0", strtab):
            wanted[m.start()] = n
    if not wanted:
        return []
    if bits == 64:
        fmt, name_i, shndx_i = e + "IBBHQQ", 0, 3
    else:
        fmt, name_i, shndx_i = e + "IIIBBH", 0, 5
    step = struct.calcsize(fmt)
    count = dynsym.size // step
    found: set[str] = set()
    view = memoryview(buf)[dynsym.offset : dynsym.offset + count * step]
    try:
        for sym in struct.iter_unpack(fmt, view):
            n = wanted.get(sym[name_i])
            if n is not None and sym[shndx_i] != _SHN_UNDEF:
                found.add(n)
    finally:
        view.release()
    return [n for n in names if n in found]


def _needed(buf, dynamic, strtab: bytes, bits: int, e: str) -> list[str]:
    fmt = e + ("qQ" if bits == 64 else "iI")
    step = struct.calcsize(fmt)
    out = []
    for off in range(dynamic.offset, dynamic.offset + dynamic.size - step + 1, step):
        tag, val = struct.unpack_from(fmt, buf, off)
        if tag == 0:
            break
        if tag == _DT_NEEDED and val < len(strtab):
            end = strtab.find(b"\0", val)
            out.append(strtab[val : end if end >= 0 else len(strtab)].decode("latin-1"))
    return out


def _cxx11_abi(strtab) -> bool | None:
    """True when imported c10/torch symbols use std::__cxx11 types, False when they use the
    pre-C++11 std::string (mangled ``Ss``), None when the symbols do not say."""
    if strtab.find(b"St7__cxx11") >= 0 and strtab.find(b"_ZN3c10") >= 0:
        return True
    if re.search(rb"_ZN(?:3c10|5torch|2at)\w*?(?:RKSs|Ss[EI0-9])", strtab):
        return False
    return None


def read_binary(path: str | os.PathLike) -> BinaryInfo:
    """Read one file from disk (memory-mapped)."""
    p = os.fspath(path)
    try:
        with open(p, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size == 0:
                raise BinaryFormatError(f"{p} is empty.")
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                return read_buffer(mm, p)
    except BinaryFormatError:
        raise
    except IsADirectoryError as exc:
        raise BinaryFormatError(f"{p} is a folder, not a file.") from exc
    except OSError as exc:
        raise BinaryFormatError(f"cannot read {p}: {exc.strerror or exc}.") from exc
