#!/usr/bin/env python3
"""Makes DEST importable-from (PYTHONPATH) for clients/python/examples/bench_client.py on a
machine without network or pip access: unpacks the carried wheels in WHEELS into DEST.

  py_deps.py WHEELS DEST

The moeserve_client wheel (pure Python, its gRPC stubs generated at build time) is always
unpacked. grpcio / protobuf / ml_dtypes / numpy / typing_extensions are unpacked only when this
Python lacks a usable one (protobuf >= 6.31.1 for the stubs, numpy >= 2 for the carried
ml_dtypes), and only wheels whose tags fit this Python (cp3XY or abi3, linux x86_64). torch must
already be installed. Exit 1 if, afterwards, the client or torch does not import.
"""

import glob
import importlib
import os
import subprocess
import sys
import zipfile


def usable(module, min_version=None):
    try:
        m = importlib.import_module(module)
    except Exception:  # noqa: BLE001  (any import failure means: not usable)
        return False
    if min_version is None:
        return True
    have = tuple(int(x) for x in m.__version__.split(".")[:3] if x.isdigit())
    return have >= min_version


def fits(wheel):
    name = os.path.basename(wheel)
    if name.endswith("-none-any.whl"):
        return True
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    return (f"-{tag}-" in name or "-abi3-" in name) and "x86_64" in name


def main():
    wheels, dest = sys.argv[1], sys.argv[2]
    os.makedirs(dest, exist_ok=True)
    needs = {
        "grpcio": not usable("grpc", (1, 80, 1)),
        "protobuf": not usable("google.protobuf", (6, 31, 1)),
        "ml_dtypes": not usable("ml_dtypes"),
        # The carried ml_dtypes needs numpy 2 (torch for CUDA 13 is built against numpy 2).
        "numpy": not usable("numpy", (2, 0, 0)),
        "typing_extensions": not usable("typing_extensions"),
        "moeserve_client": True,
    }
    for project, need in needs.items():
        if not need:
            continue
        found = [w for w in glob.glob(os.path.join(wheels, f"{project}-*.whl")) if fits(w)]
        if not found:
            print(f"py_deps: no {project} wheel for Python {sys.version.split()[0]} in {wheels}")
            continue
        with zipfile.ZipFile(sorted(found)[-1]) as z:
            z.extractall(dest)
        print(f"py_deps: unpacked {os.path.basename(sorted(found)[-1])}")
    # Check in a fresh interpreter, with DEST first on the path as the benchmark will have it.
    env = dict(os.environ, PYTHONPATH=dest + os.pathsep + os.environ.get("PYTHONPATH", ""))
    probe = ("import grpc, google.protobuf, numpy, ml_dtypes, moeserve_client; "
             "print('py_deps: grpcio', grpc.__version__, 'protobuf', google.protobuf.__version__, "
             "'numpy', numpy.__version__, 'client', moeserve_client.__file__); "
             "import torch; print('py_deps: torch', torch.__version__, 'cuda', "
             "torch.cuda.is_available())")
    return subprocess.call([sys.executable, "-c", probe], env=env)


if __name__ == "__main__":
    sys.exit(main())
