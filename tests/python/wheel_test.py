#!/usr/bin/env python3
"""clients/python builds into a wheel that carries stubs generated at build time and pins the
protobuf range and grpcio floor that those stubs check at import, with ml_dtypes and numpy as
dependencies; the installed wheel imports with no generate_stubs.sh run and no source tree.

Cheap and offline: a copy of clients/python (without any generated stubs) is built with
`pip wheel --no-deps --no-build-isolation` (the build requirements, setuptools and
grpcio-tools, are the ones installed), installed with `pip install --no-deps --target`, and
imported from there by a fresh interpreter.

  wheel_test.py --source-dir REPO
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--source-dir", required=True)
    args = p.parse_args()
    args.source_dir = os.path.abspath(args.source_dir)
    pkg = os.path.join(args.source_dir, "clients", "python")
    with tempfile.TemporaryDirectory(prefix="moeserve_wheel_") as tmp:
        src = os.path.join(tmp, "src")
        shutil.copytree(pkg, src, ignore=shutil.ignore_patterns(
            "gen", ".gen.*", "build", "*.egg-info", "__pycache__", "dist"))
        env = dict(os.environ, MOESERVE_PROTO_DIR=os.path.join(args.source_dir, "proto"))
        dist = os.path.join(tmp, "dist")
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "-q", "-w", dist, src], check=True, env=env)
        wheels = [f for f in os.listdir(dist) if f.endswith(".whl")]
        assert len(wheels) == 1, wheels
        wheel = os.path.join(dist, wheels[0])
        with zipfile.ZipFile(wheel) as z:
            names = set(z.namelist())
            for need in ("moeserve_client/gen/moeserve/v1/moeserve_pb2.py",
                         "moeserve_client/gen/moeserve/v1/moeserve_pb2_grpc.py",
                         "moeserve_client/gen/grpc/health/v1/health_pb2.py",
                         "moeserve_client/torch_client.py", "moeserve_client/wire.py"):
                assert need in names, f"{need} not in the wheel: {sorted(names)}"
            meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
            meta = z.read(meta_name).decode()
            pb2 = z.read("moeserve_client/gen/moeserve/v1/moeserve_pb2.py").decode()
            grpc_py = z.read("moeserve_client/gen/moeserve/v1/moeserve_pb2_grpc.py").decode()
        requires = re.findall(r"^Requires-Dist: (.*)$", meta, re.M)
        print("Requires-Dist:", requires)
        v = re.search(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*"
                      r"(\d+),\s*(\d+),\s*(\d+)", pb2)
        assert v, "generated code has no protobuf runtime check (grpcio-tools too old?)"
        major, minor, patch = v.groups()
        want_pb = f"protobuf<{int(major) + 1},>={major}.{minor}.{patch}"
        g = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", grpc_py).group(1)
        norm = {r.replace(" ", "") for r in requires}
        assert want_pb in norm or f"protobuf>={major}.{minor}.{patch},<{int(major) + 1}" in norm, \
            f"protobuf pin: want {want_pb} in {requires}"
        assert f"grpcio>={g}" in norm, f"grpcio floor {g} not in {requires}"
        assert any(r.startswith("ml_dtypes") or r.startswith("ml-dtypes") for r in norm), requires
        assert any(r.startswith("numpy") for r in norm), requires
        assert any(r.startswith("torch") and "extra" in r for r in norm), requires
        # Installable beside tritonclient[grpc] (the KServe client the README uses): its protobuf
        # range must admit the wheel's floor. (The isolated build, `pip install clients/python`,
        # holds grpcio-tools below protobuf-7 gencode in pyproject.toml, as scripts/setup.sh.)
        try:
            import importlib.metadata as md
            from packaging.requirements import Requirement
            triton = [Requirement(r) for r in md.requires("tritonclient") or []]
        except Exception as e:  # noqa: BLE001  tritonclient or packaging absent: nothing to check
            print(f"tritonclient coexistence not checked: {e}")
            triton = []
        floor = f"{major}.{minor}.{patch}"
        for r in triton:
            if r.name == "protobuf" and r.marker is not None and r.marker.evaluate({"extra": "grpc"}):
                assert r.specifier.contains(floor), \
                    f"the wheel needs protobuf>={floor}, tritonclient[grpc] wants {r.specifier}"
                print(f"beside tritonclient[grpc]: protobuf {r.specifier} admits {floor}")

        site = os.path.join(tmp, "site")
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                        site, wheel], check=True)
        code = ("import moeserve_client, moeserve_client.wire as w;"
                "from moeserve_client.gen.moeserve.v1 import moeserve_pb2 as pb;"
                "assert pb.ModelInfo.DESCRIPTOR.fields_by_name['server_routing'];"
                "print(moeserve_client.__file__)")
        out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                             text=True, cwd=tmp,
                             env=dict(os.environ, PYTHONPATH=site)).stdout.strip()
        assert out.startswith(site), f"imported from {out}, not the installed wheel"
        print(f"wheel {wheels[0]} imports from {out}")
    print("wheel_test: 1 passed, 0 failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
