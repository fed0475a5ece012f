"""A minimal ELF reader: header, section table and section names, over bytes or an mmap.

Reads only what it is asked for; every offset is checked against the buffer, so a truncated
or damaged file raises BinaryFormatError instead of IndexError/struct.error.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from cudadoctor.binary.errors import BinaryFormatError

ELF_MAGIC = b"\x7fELF"
EM_CUDA = 190
MAX_SECTIONS = 1 << 16


@dataclass(frozen=True)
class Section:
    name: str
    type: int
    offset: int
    size: int


@dataclass(frozen=True)
class ElfFile:
    bits: int  # 32 or 64
    endian: str  # "<" or ">"
    type: int  # e_type: 1 REL, 2 EXEC, 3 DYN
    machine: int
    flags: int
    abi_version: int
    sections: tuple[Section, ...]

    def section(self, name: str) -> Section | None:
        for s in self.sections:
            if s.name == name:
                return s
        return None


def _unpack(fmt: str, buf, off: int, what: str):
    try:
        if off < 0:
            raise struct.error("negative offset")
        return struct.unpack_from(fmt, buf, off)
    except (struct.error, OverflowError) as exc:
        raise BinaryFormatError(f"truncated ELF file: cannot read the {what} at offset {off}.") from exc


def parse_elf(buf, *, name: str = "file") -> ElfFile:
    """Parse the ELF header and the section table of ``buf`` (bytes, bytearray, mmap)."""
    size = len(buf)
    if size < 52 or bytes(buf[:4]) != ELF_MAGIC:
        raise BinaryFormatError(f"{name} is not an ELF file (or is truncated before its header).")
    ei_class, ei_data = buf[4], buf[5]
    if ei_class not in (1, 2) or ei_data not in (1, 2):
        raise BinaryFormatError(f"{name}: ELF header has an invalid class/data byte ({ei_class}, {ei_data}).")
    bits = 32 if ei_class == 1 else 64
    e = "<" if ei_data == 1 else ">"
    abi_version = buf[8]
    if bits == 64:
        if size < 64:
            raise BinaryFormatError(f"{name}: truncated ELF header.")
        (e_type, e_machine, _v, _entry, _phoff, shoff, flags, _ehsize, _phes, _phn, shentsize, shnum, shstrndx) = (
            _unpack(e + "HHIQQQIHHHHHH", buf, 16, "ELF header")
        )
        sh_fmt = e + "IIQQQQIIQQ"
    else:
        (e_type, e_machine, _v, _entry, _phoff, shoff, flags, _ehsize, _phes, _phn, shentsize, shnum, shstrndx) = (
            _unpack(e + "HHIIIIIHHHHHH", buf, 16, "ELF header")
        )
        sh_fmt = e + "IIIIIIIIII"
    sections: list[Section] = []
    if shoff:
        need = struct.calcsize(sh_fmt)
        if shentsize < need:
            raise BinaryFormatError(f"{name}: ELF section header size {shentsize} is too small.")
        raw0 = _unpack(sh_fmt, buf, shoff, "section table")
        if shnum == 0:
            shnum = raw0[5]  # extended numbering: count in section 0's sh_size
        if shstrndx == 0xFFFF:
            shstrndx = raw0[6]
        if shnum > MAX_SECTIONS or shoff + shnum * shentsize > size:
            raise BinaryFormatError(f"{name}: ELF section table ({shnum} entries at {shoff}) runs past the end of the file.")
        raw = [_unpack(sh_fmt, buf, shoff + i * shentsize, "section header") for i in range(shnum)]
        strtab = b""
        if 0 < shstrndx < shnum:
            st = raw[shstrndx]
            s_off, s_size = st[4], st[5]
            if st[1] != 8:  # not NOBITS
                if s_off + s_size > size:
                    raise BinaryFormatError(f"{name}: ELF section-name table runs past the end of the file.")
                strtab = bytes(buf[s_off : s_off + s_size])
        for r in raw:
            sh_name, sh_type, off, sz = r[0], r[1], r[4], r[5]
            nm = ""
            if strtab and sh_name < len(strtab):
                end = strtab.find(b"\0", sh_name)
                nm = strtab[sh_name : end if end >= 0 else len(strtab)].decode("latin-1")
            if sh_type != 8 and sz and off + sz > size:  # NOBITS occupies no file space
                raise BinaryFormatError(f"{name}: ELF section {nm or '?'} runs past the end of the file.")
            sections.append(Section(nm, sh_type, off, 0 if sh_type == 8 else sz))
    return ElfFile(bits, e, e_type, e_machine, flags, abi_version, tuple(sections))


def cubin_arch(elf: ElfFile) -> tuple[int, str] | None:
    """(sm number, suffix) of a CUDA ELF (cubin) from e_flags, or None when it is not one.

    ELF ABI 7 (CUDA <= 12): SM in bits 0-7, EF_CUDA_ACCELERATORS_V1 (0x800) marks 'a'.
    ELF ABI 8 (CUDA >= 13): SM in bits 8-15, EF_CUDA_ACCELERATORS (0x8) marks 'a'.
    The 'f' suffix is not recorded in e_flags.
    """
    if elf.machine != EM_CUDA:
        return None
    f = elf.flags
    if elf.abi_version >= 8:
        sm, acc = (f >> 8) & 0xFF, bool(f & 0x8)
    else:
        sm, acc = f & 0xFF, bool(f & 0x800)
    if sm < 10:
        return None
    return sm, ("a" if acc else "")
