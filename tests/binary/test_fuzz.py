"""Fuzzing: truncated, bit-flipped and random inputs give a typed error or an answer; never an
unhandled exception, never a hang. A seeded loop over mutations of the real nvcc fixtures."""

import io
import json
import random
import time
import zipfile
from pathlib import Path

import pytest

from cudadoctor.binary import BinaryFormatError, BinaryInfo, read_buffer
from cudadoctor.errors import InputError
from cudadoctor.inspect import entry_from_info, inspect_path

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "binaries"
SEEDS = sorted(p for p in FIX.iterdir() if p.suffix in (".o", ".so", ".cubin", ".fatbin"))
PER_FILE = 3000


def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    op = rng.randrange(6)
    if op == 0:  # truncate
        return bytes(b[: rng.randrange(len(b))])
    if op == 1:  # flip bits anywhere
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    elif op == 2:  # flip bits in the headers, where the structure lives
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(min(len(b), 128))
            b[i] ^= 1 << rng.randrange(8)
    elif op == 3:  # overwrite a 4/8-byte field with an extreme value
        i = rng.randrange(max(1, len(b) - 8))
        b[i : i + 8] = rng.choice([b"\xff" * 8, b"\x00" * 8, (2**63).to_bytes(8, "little"), rng.randbytes(8)])
    elif op == 4:  # random bytes spliced in
        i = rng.randrange(len(b))
        b[i:i] = rng.randbytes(rng.randint(1, 64))
    else:  # flip bits inside the fatbin payload region: look for the container magic
        at = bytes(b).find(b"\x50\xed\x55\xba")
        if at >= 0:
            for _ in range(rng.randint(1, 6)):
                i = at + rng.randrange(min(256, len(b) - at))
                b[i] ^= 1 << rng.randrange(8)
    return bytes(b)


def _check(data: bytes) -> None:
    t0 = time.perf_counter()
    try:
        info = read_buffer(data, "fuzz")
    except BinaryFormatError as exc:
        assert str(exc) and isinstance(exc, InputError)
    else:
        assert isinstance(info, BinaryInfo)
        e = entry_from_info(info)
        json.dumps(e)
        for a in e["sass"]:
            assert a.startswith("sm_")
        for a in e["ptx"]:
            assert a.startswith("compute_")
    assert time.perf_counter() - t0 < 2.0, "reader took too long on a mutated input"


@pytest.mark.parametrize("seed_file", SEEDS, ids=lambda p: p.name)
def test_mutations_of_real_binaries(seed_file):
    data = seed_file.read_bytes()
    rng = random.Random(f"cudadoctor-{seed_file.name}")
    for _ in range(PER_FILE):
        _check(_mutate(rng, data))


def test_random_inputs():
    rng = random.Random(20261129)
    prefixes = [b"", b"\x7fELF", b"\x7fELF\x02\x01\x01A", b"\x7fELF\x01\x02\x01", b"\x50\xed\x55\xba\x01\x00\x10\x00"]
    for _ in range(3000):
        _check(rng.choice(prefixes) + rng.randbytes(rng.randint(0, 600)))


def test_mutated_wheels(tmp_path):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.write(FIX / "libkern_sm87.so", "pkg/_C.so")
        z.writestr("pkg-1.dist-info/cudadoctor_build.json", '{"torch": "2.14.1"}')
    data = buf.getvalue()
    rng = random.Random(7)
    whl = tmp_path / "m.whl"
    for _ in range(300):
        whl.write_bytes(_mutate(rng, data))
        try:
            entries = inspect_path(whl)
        except BinaryFormatError:
            continue
        json.dumps(entries)
