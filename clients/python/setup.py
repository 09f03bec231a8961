"""moeserve-client's build: the gRPC stubs are generated from proto/ while the wheel is built.

Metadata (pyproject.toml) declares the dependencies dynamic: they are computed here from the
stubs that this build's grpcio-tools generates, so the wheel pins the protobuf range (gencode
version up to the next major) and the grpcio floor that its generated code checks at import.
An sdist carries a copy of the protos in ./proto.
"""

import os
import shutil
import sys
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import build_stubs  # noqa: E402  (beside this file)

BASE_REQUIREMENTS = ["numpy>=1.23", "ml_dtypes>=0.2"]


def _requirements():
    with tempfile.TemporaryDirectory() as tmp:
        generated = build_stubs.generate(os.path.join(tmp, "gen"))
    return BASE_REQUIREMENTS + build_stubs.runtime_requirements(generated)


class BuildPyWithStubs(build_py):
    """build_py, plus moeserve_client/gen generated into the build (or, for an editable install,
    into the source tree, where the editable finder looks)."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            target = os.path.join(HERE, "moeserve_client", "gen")
        else:
            target = os.path.join(self.build_lib, "moeserve_client", "gen")
        if os.path.isdir(target):
            shutil.rmtree(target)
        build_stubs.generate(target)


class SdistWithProtos(sdist):
    """The sdist carries the protos (./proto) so that building from it needs no repository."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        root = build_stubs.proto_dir()
        for rel in build_stubs.PROTOS:
            dst = os.path.join(base_dir, "proto", rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copyfile(os.path.join(root, rel), dst)


setup(install_requires=_requirements(),
      cmdclass={"build_py": BuildPyWithStubs, "sdist": SdistWithProtos})
