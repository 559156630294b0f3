"""Check a built wheel: manylinux tag, contents (package data too), stripped extension, no accelerator libraries.

Run by ``make wheel`` after ``auditwheel repair`` and ``check-wheel-contents``::

    python tools/check_wheel.py dist/mesharray-*.whl

Prints one line per wheel (tag, size, the extension's size) and exits 1 with
the reasons if a check fails.
"""

from __future__ import annotations

import struct
import sys
import zipfile

#: libraries a wheel must not link: engines use whatever torch the user has
ACCELERATOR_LIBS = (b"libcuda", b"libcudart", b"libnccl", b"libtorch", b"libamdhip64", b"librccl", b"libtpu")
#: files every wheel must hold: package data included, not only the Python modules
REQUIRED = ("mesharray/__init__.py", "mesharray/_core.pyi", "mesharray/py.typed", "mesharray/observe/static/index.html")


def elf_sections(data: bytes) -> list[str]:
    """Section names of a 64-bit little-endian ELF file (enough for the wheels built here)."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    def header(i: int) -> tuple[int, int, int]:
        name, _, _, _, offset, size = struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize)
        return name, offset, size
    _, str_off, str_size = header(shstrndx)
    names = data[str_off:str_off + str_size]
    out = []
    for i in range(shnum):
        n = header(i)[0]
        out.append(names[n:names.index(b"\0", n)].decode())
    return out


def check(path: str) -> list[str]:
    problems = []
    name = path.rsplit("/", 1)[-1]
    if "manylinux2014" not in name and "macosx" not in name:
        problems.append(f"{name}: not tagged manylinux2014 (auditwheel repair did not run?)")
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        for req in REQUIRED:
            if req not in names:
                problems.append(f"{name}: {req} missing")
        if not any(n.endswith(".dist-info/licenses/LICENSE") for n in names):
            problems.append(f"{name}: no LICENSE in the dist-info")
        for n in names:
            if n.endswith(".c"):
                problems.append(f"{name}: ships generated C source {n}")
        sos = [n for n in names if n.endswith(".so") and n.startswith("mesharray/")]
        if not sos:
            problems.append(f"{name}: no compiled extension")
        sizes = []
        for so in sos:
            data = z.read(so)
            sizes.append(f"{so.rsplit('/', 1)[-1]} {len(data) / 1024:.0f} KiB")
            if name.endswith(".whl") and "linux" in name:
                sections = elf_sections(data)
                debug = [s for s in sections if s.startswith(".debug") or s == ".symtab"]
                if debug:
                    problems.append(f"{name}: {so} is not stripped (sections {debug})")
            for lib in ACCELERATOR_LIBS:
                if lib in data:
                    problems.append(f"{name}: {so} references {lib.decode()}: the wheel must stay accelerator-agnostic")
    import os

    print(f"{name}: {os.path.getsize(path) / 1024:.0f} KiB; {', '.join(sizes)}; {len(names)} files")
    return problems


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: check_wheel.py WHEEL...", file=sys.stderr)
        return 2
    problems = [p for w in argv for p in check(w)]
    for p in problems:
        print("FAIL:", p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
