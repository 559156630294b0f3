"""Check a built wheel: manylinux tag, contents (package data too), stripped extension, what it links, no
accelerator libraries.

Run by ``make wheel`` after ``auditwheel repair`` and ``check-wheel-contents``::

    python tools/check_wheel.py dist/mesharray-*.whl

Prints one line per wheel (tag, size, each extension's size and the libraries
it links) and exits 1 with the reasons if a check fails.

What the extensions may link (``DT_NEEDED``): ``mesharray._core`` the C library
only (:data:`SYSTEM_LIBS`). ``mesharray.transport._ucp``, the UCX data plane, is
built only where UCX is installed (the ``ucx`` extra in a development venv, never
in the isolated build of a release wheel); if a wheel has it, it links
``libucp.so.0`` and ``libucs.so.0`` (:data:`UCX_LIBS`) from the user's ``libucx``
wheel, and those must not be grafted into the wheel (no ``mesharray.libs/libuc*``):
UCX comes from the ``libucx`` wheel, one copy per environment.
"""

from __future__ import annotations

import struct
import sys
import zipfile

#: libraries a wheel must not link: engines use whatever torch the user has
ACCELERATOR_LIBS = (b"libcuda", b"libcudart", b"libnccl", b"libtorch", b"libamdhip64", b"librccl", b"libtpu")
#: files every wheel must hold: package data included, not only the Python modules
REQUIRED = ("mesharray/__init__.py", "mesharray/_core.pyi", "mesharray/py.typed", "mesharray/observe/static/index.html")
#: what any extension may link: the C library and its parts
SYSTEM_LIBS = ("libc.so", "libm.so", "libpthread.so", "libdl.so", "librt.so", "ld-linux")
#: what the UCX extension links besides: UCX's own libraries, from the libucx wheel
UCX_LIBS = ("libucp.so", "libucs.so")


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


def elf_needed(data: bytes) -> list[str]:
    """The ``DT_NEEDED`` entries (linked libraries) of a 64-bit little-endian ELF file."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, _ = struct.unpack_from("<HHH", data, 0x3A)
    sections = []
    for i in range(shnum):
        _, kind, _, _, offset, size, link = struct.unpack_from("<IIQQQQI", data, shoff + i * shentsize)
        sections.append((kind, offset, size, link))
    out = []
    for kind, offset, size, link in sections:
        if kind != 6:  # SHT_DYNAMIC
            continue
        str_off = sections[link][1]
        for pos in range(offset, offset + size, 16):
            tag, val = struct.unpack_from("<qQ", data, pos)
            if tag == 0:
                break
            if tag == 1:  # DT_NEEDED
                start = str_off + val
                out.append(data[start:data.index(b"\0", start)].decode())
    return out


def check_links(name: str, so: str, needed: list[str]) -> list[str]:
    """Problems with what extension ``so`` links (see the module docstring)."""
    allowed = SYSTEM_LIBS + (UCX_LIBS if so.rsplit("/", 1)[-1].startswith("_ucp") else ())
    return [f"{name}: {so} links {lib}, which it must not (allowed: {', '.join(allowed)})"
            for lib in needed if not lib.startswith(allowed)]


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
            if n.startswith("mesharray.libs/libuc"):
                problems.append(f"{name}: grafts {n}: UCX must come from the libucx wheel, not from this one")
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
                needed = elf_needed(data)
                sizes[-1] += f" (links {', '.join(needed) or 'nothing'})"
                problems += check_links(name, so, needed)
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
