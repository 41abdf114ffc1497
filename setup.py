"""mfqat: multi-format quantization-aware training (OCP Microscaling) with an MLX export path."""
import os
import sys

from setuptools import find_packages, setup

MLX = "mlx[cpu]>=0.32" if sys.platform.startswith("linux") else "mlx>=0.32"


def skipped(why):
    """Say on stderr (pip shows it with -v, and on failure) that the wheel carries no C++ kernels."""
    print(f"WARNING: mfqat C++ extension skipped: {why}. The package still works on the pure-PyTorch "
          "reference (slower on CPU); `mfqat --version` says which backends are active. To build the kernels: "
          "install CPU torch first, then `pip install --no-build-isolation .`", file=sys.stderr)
    return [], {}


CXX_FLAGS = ["-O3", "-fopenmp", "-march=x86-64-v2", "-ffp-contract=off", "-std=c++20"]
# nvcc: no fused multiply-add (PyTorch rounds products and sums separately), subnormals kept (no fast math)
NVCC_FLAGS = ["-O3", "--fmad=false", "-std=c++17"]
CUDA_SOURCES = [os.path.join("csrc", "cuda", "mx_kernels.cu"), os.path.join("csrc", "cuda", "mx_cuda_ops.cpp")]


def cuda_plan():
    """(CUDA_HOME, why) when the CUDA op can be built (torch has CUDA, nvcc found), else (None, why not)."""
    if os.environ.get("MFQAT_NO_CUDA") == "1":
        return None, "MFQAT_NO_CUDA=1"
    import torch
    from torch.utils import cpp_extension

    if not torch.version.cuda:
        return None, f"torch {torch.__version__} has no CUDA"
    home = cpp_extension.CUDA_HOME
    if home is None or not os.path.exists(os.path.join(home, "bin", "nvcc")):
        return None, f"torch has CUDA {torch.version.cuda} but nvcc was not found (set CUDA_HOME)"
    return home, f"torch CUDA {torch.version.cuda}, nvcc in {home}"


def cpp_extensions():
    """Build csrc/ as torch custom ops when torch and a compiler are present (never fatal); with the
    CUDA op (csrc/cuda/) when torch has CUDA and nvcc is found, else the CPU kernels alone."""
    if os.environ.get("MFQAT_NO_EXT") == "1":
        return skipped("MFQAT_NO_EXT=1")
    if not os.path.isdir("csrc"):
        return skipped("no csrc/ folder in this source tree")
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
    except Exception as exc:  # torch not importable at build time: the pure-PyTorch path is used
        return skipped(f"torch is not importable at build time ({type(exc).__name__}: {exc}; under pip's build "
                       "isolation only pyproject.toml's build requirements are installed)")
    sources = sorted(os.path.join("csrc", f) for f in os.listdir("csrc") if f.endswith(".cpp"))
    if not sources:
        return skipped("no .cpp file in csrc/")
    headers = sorted(os.path.join("csrc", f) for f in os.listdir("csrc") if f.endswith(".h"))
    cuda_home, why = cuda_plan()
    if cuda_home is not None and all(os.path.exists(f) for f in CUDA_SOURCES):
        print(f"mfqat: building the C++ CPU kernels and the CUDA op ({why})", file=sys.stderr)
        cuda_headers = sorted(os.path.join("csrc", "cuda", f) for f in os.listdir(os.path.join("csrc", "cuda"))
                              if f.endswith((".h", ".cuh")))
        ext = CUDAExtension("mfqat._C", sources + CUDA_SOURCES, depends=headers + cuda_headers,
                            extra_compile_args={"cxx": CXX_FLAGS, "nvcc": NVCC_FLAGS}, extra_link_args=["-fopenmp"])
        ext.mfqat_cpu_sources = sources  # what a failed CUDA build falls back to
    else:
        print(f"mfqat: building the C++ CPU kernels only; CUDA op not built: {why}", file=sys.stderr)
        ext = CppExtension("mfqat._C", sources, depends=headers, extra_compile_args=CXX_FLAGS,
                           extra_link_args=["-fopenmp"])

    class OptionalBuildExtension(BuildExtension):
        """Never fail the install over the extension: warn, and mfqat uses the reference path."""

        def run(self):
            try:
                super().run()
            except Exception as exc:  # no compiler, no Python headers, ...
                print(f"WARNING: mfqat C++ extension not built ({exc}); the pure-PyTorch reference is used")

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
                return
            except Exception as exc:
                failure = exc
            cpu_sources = getattr(ext, "mfqat_cpu_sources", None)
            if cpu_sources is not None:  # the CUDA op failed to build: keep the CPU kernels
                print(f"WARNING: mfqat CUDA op not built ({failure}); building the C++ CPU kernels alone")
                args = ext.extra_compile_args  # with the flags BuildExtension added to its "cxx" list
                ext.sources, ext.mfqat_cpu_sources = cpu_sources, None
                ext.extra_compile_args = args["cxx"] if isinstance(args, dict) else args
                self.build_extension(ext)
                return
            print(f"WARNING: mfqat C++ extension not built ({failure}); the pure-PyTorch reference is used")

    return [ext], {"build_ext": OptionalBuildExtension.with_options(no_python_abi_suffix=True)}


ext_modules, cmdclass = cpp_extensions()

setup(
    name="mfqat",
    version="0.1.0",
    description="Multi-format quantization-aware training in MX formats, with Slice-and-Scale and MLX export",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["mfqat", "mfqat.*"]),
    package_data={"mfqat": ["configs/*.yaml", "configs/accelerate/*.yaml"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "safetensors>=0.4",
        "transformers>=5.2",  # conversion_mapping / core_model_loading from 5.0; Qwen3.5 from 5.2
        "accelerate>=1.0",
        "peft>=0.13",
        "tqdm",
        "PyYAML",
        "matplotlib",
        "numpy",
        "gguf>=0.10",
    ],
    extras_require={
        "mlx": [MLX, "mlx-lm>=0.30"],
        "kernels": ["triton>=3.0"],
        "test": ["pytest", "pytest-xdist", "hypothesis", "torchao>=0.10", "bitsandbytes>=0.45", "triton>=3.0",
                 "tensorboard"],
        "all": [MLX, "mlx-lm>=0.30", "triton>=3.0", "bitsandbytes>=0.45", "torchao>=0.10"],
    },
    entry_points={"console_scripts": ["mfqat=mfqat.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
