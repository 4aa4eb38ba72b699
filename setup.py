"""Build script: setup.py -> CMake -> ninja, compiling `deepinfer_ops._C` against the installed torch.

Build-time environment variables (all optional; see README "Environment variables"):
  DEEPINFER_BUILD_CUDA   auto (default: build CUDA when torch has CUDA and nvcc is found), 1 (require), 0 (CPU only)
  DEEPINFER_CUDA_ARCHS   semicolon list of CUDA archs, default "90a" (e.g. "90a;100a")
  DEEPINFER_BUILD_DIR    CMake build folder, default build/<python tag>
  MAX_JOBS               parallel compile jobs (default: number of CPUs)
  CMAKE_BUILD_TYPE       default Release
"""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        out_path = Path(self.get_ext_fullpath(ext.name)).resolve()
        out_dir = out_path.parent
        out_dir.mkdir(parents=True, exist_ok=True)
        tag = f"py{sys.version_info.major}{sys.version_info.minor}"
        build_dir = Path(os.environ.get("DEEPINFER_BUILD_DIR", ROOT / "build" / tag)).resolve()
        build_dir.mkdir(parents=True, exist_ok=True)
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        cfg = os.environ.get("CMAKE_BUILD_TYPE", "Release")
        ext_suffix = sysconfig.get_config_var("EXT_SUFFIX")
        args = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
            f"-DCMAKE_BUILD_TYPE={cfg}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DDEEPINFER_OUTPUT_DIR={out_dir}",
            f"-DDEEPINFER_EXT_SUFFIX={ext_suffix}",
            f"-DDEEPINFER_BUILD_CUDA={os.environ.get('DEEPINFER_BUILD_CUDA', 'auto')}",
            f"-DDEEPINFER_CUDA_ARCHS={os.environ.get('DEEPINFER_CUDA_ARCHS', '90a')}",
        ]
        subprocess.run(args, check=True)
        subprocess.run(["cmake", "--build", str(build_dir), "-j", jobs], check=True)
        if not out_path.exists():
            raise RuntimeError(f"CMake build finished but {out_path} was not produced")


setup(
    packages=find_packages("python") + find_packages("engine"),
    package_dir={"deepinfer_ops": "python/deepinfer_ops", "deepinfer": "engine/deepinfer"},
    package_data={"deepinfer": ["presets/*.json"]},
    ext_modules=[CMakeExtension("deepinfer_ops._C")],
    cmdclass={"build_ext": CMakeBuild},
)
