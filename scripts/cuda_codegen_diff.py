#!/usr/bin/env python3
"""Whether a CUDA source compiles to the same machine code as at another revision.

    scripts/cuda_codegen_diff.py kernels/cuda/moe_gemm.cu [REV (default HEAD)] [--build build]

Compiles the working tree's file and REV's with the build's own nvcc command
(compile_commands.json) to cubins, without line info (moved lines would differ), and compares
each kernel's code byte for byte (registers are named in every instruction) and its shared and
constant memory (.nv.shared, .nv.constant0). Not .nv.info: it names other symbols by index, so one
kernel added or removed would make every kernel differ.
Prints the kernels that differ; exit 0 when none does. For refactors of device code where no GPU
is at hand: identical code needs no device run. Needs pyelftools (pip install pyelftools).
"""

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile

from elftools.elf.elffile import ELFFile

_KEPT = (".text.", ".nv.shared.", ".nv.constant0.")


def _command(build, source):
    with open(os.path.join(build, "compile_commands.json")) as f:
        for entry in json.load(f):
            if os.path.realpath(entry["file"]) == os.path.realpath(source):
                return entry["directory"], shlex.split(entry["command"])
    sys.exit(f"{source} is not in {build}/compile_commands.json")


def _cubin(directory, argv, source, out):
    args = [argv[0]]
    skip = False
    for a in argv[1:]:
        if skip:
            skip = False
            continue
        if a in ("-o", "-c"):
            skip = a == "-o"
            continue
        if a in ("-g", "-lineinfo", "-G") or a.endswith(".cu"):
            continue
        # one real architecture: a cubin holds one
        args.append(re.sub(r"code=\[compute_(\w+),sm_\w+\]", r"code=[sm_\1]", a))
    args += ["-cubin", source, "-o", out]
    subprocess.run(args, cwd=directory, check=True)


def _sections(path, stem):
    # A file-local anonymous namespace is named after the file (and a hash): drop it.
    anon = re.compile(r"\d+_GLOBAL__N__[0-9a-f]+_\d+_" + re.escape(stem) + r"_cu_[0-9a-f]+")
    out = {}
    with open(path, "rb") as f:
        for s in ELFFile(f).iter_sections():
            if s.name.startswith(_KEPT):
                name = anon.sub("ANON", s.name)
                out[name] = s.data() if s["sh_type"] != "SHT_NOBITS" else s["sh_size"]
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source")
    p.add_argument("rev", nargs="?", default="HEAD")
    p.add_argument("--build", default="build")
    a = p.parse_args()
    directory, argv = _command(a.build, a.source)
    rel = os.path.relpath(os.path.realpath(a.source), os.path.realpath("."))
    with tempfile.TemporaryDirectory() as tmp:
        # Both copies compile as the same file name, so that their anonymous namespaces match.
        stem = os.path.splitext(os.path.basename(a.source))[0]
        old_dir, new_dir = os.path.join(tmp, "old"), os.path.join(tmp, "new")
        os.makedirs(old_dir)
        os.makedirs(new_dir)
        old_src = os.path.join(old_dir, os.path.basename(a.source))
        with open(old_src, "wb") as f:
            f.write(subprocess.run(["git", "show", f"{a.rev}:{rel}"], check=True,
                                   capture_output=True).stdout)
        new_src = os.path.join(new_dir, os.path.basename(a.source))
        with open(a.source, "rb") as f, open(new_src, "wb") as g:
            g.write(f.read())
        for d, src in ((old_dir, old_src), (new_dir, new_src)):
            _cubin(directory, argv, src, os.path.join(d, "k.cubin"))
        old = _sections(os.path.join(old_dir, "k.cubin"), stem)
        new = _sections(os.path.join(new_dir, "k.cubin"), stem)
    kernels = sorted({k.split(".", 3)[-1] for k in set(old) | set(new)})
    differ = [k for k in kernels
              if any(old.get(p + k) != new.get(p + k) for p in _KEPT)]
    print(f"{rel}: {len(kernels)} kernels at {a.rev} and in the working tree; "
          f"{len(differ)} differ")
    for k in differ:
        print("  differs:", k)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
