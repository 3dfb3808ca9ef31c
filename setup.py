"""Build script: maps the top-level stage folders into the one `stack` import namespace.

`data/` installs as `stack.data`, `models/` as `stack.models`, and so on, so no generic
top-level module named `data` or `models` lands in anyone's site-packages. Metadata and
dependencies live in pyproject.toml.

It also compiles csrc/ into `stack._C` (the custom ops): a CUDAExtension (CPU + CUDA
kernels for the GPUs users train and deploy on, `CUDA_ARCHS`, unless TORCH_CUDA_ARCH_LIST says otherwise) when
nvcc is found, a CppExtension (CPU kernels) when only a C++ compiler is, and nothing
when there is no compiler -- `stack.ops` then runs its pure-PyTorch reference and warns
once. A compile error fails the install. Build without isolation, after torch:
`MAX_JOBS=2 pip install --no-build-isolation -e .`
"""

import glob
import os
import shutil
import sys

from setuptools import find_packages, setup

CUDA_ARCHS = "8.0;9.0+PTX"
"""Machine code for 8.0 and 9.0, and PTX of 9.0 that the driver compiles for newer GPUs (Blackwell) at first load.
A cubin for compute capability X.y runs on every X.z with z >= y (CUDA C++ Programming Guide, "Binary
Compatibility"), so 8.0's runs on A100 (8.0), RTX 30xx / A10 / A40 (8.6), Jetson Orin (8.7) and L4 / L40 / RTX 40xx
(8.9); 9.0's on H100 / H200. The kernels are gathers and scatter-adds bound by memory traffic and use no feature
newer than 8.0 outside Hopper, so per-minor builds (8.6, 8.7, 8.9) bought nothing but compile time: nvcc took
90.4 s against 54.9 s for bev_pool_cuda.o at every install (docs/log/2026-11-27_two-cuda-architectures.md)."""

# import name -> folder in the repository
PACKAGE_ROOTS = {
    "stack": "stack",
    "stack.sim": "sim",
    "stack.data": "data",
    "stack.models": "models",
    "stack.train": "train",
    "stack.deploy": "deploy",
}


def all_packages() -> list[str]:
    """Every package under each mapped root, named in the `stack` namespace."""
    names = []
    for name, folder in PACKAGE_ROOTS.items():
        names.append(name)
        names.extend(f"{name}.{sub}" for sub in find_packages(folder))
    return names


def _skip(why: str) -> dict:
    print(f"stack: not building the stack._C extension ({why}); stack.ops will use its PyTorch reference",
          file=sys.stderr)
    return {}


def _cuda_include_dirs(torch) -> list[str]:
    """The CUDA wheel headers (cuBLAS, cuSPARSE, ...) that ATen/cuda includes and a bare toolkit may lack."""
    major = (torch.version.cuda or "").split(".")[0]
    import site

    roots = site.getsitepackages() + [site.getusersitepackages()]
    return sorted({d for root in roots for d in glob.glob(os.path.join(root, "nvidia", f"cu{major}", "include"))})


def _find_cuda_home() -> str | None:
    """The CUDA toolkit root: CUDA_HOME/CUDA_PATH, else the one nvcc belongs to (nvcc on PATH may be a
    wrapper script outside the toolkit, which misleads torch's own guess), else /usr/local/cuda."""
    nvcc = shutil.which("nvcc")
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
        with open(nvcc, "rb") as script:  # a wrapper such as `exec /usr/local/cuda-13.0/bin/nvcc "$@"`
            head = script.read(4096)
        if head.startswith(b"#!"):
            candidates += [os.path.dirname(os.path.dirname(word)) for word in head.decode(errors="ignore").split()
                           if word.endswith("/bin/nvcc")]
    candidates.append("/usr/local/cuda")
    for root in filter(None, candidates):
        if os.path.exists(os.path.join(root, "include", "cuda_runtime.h")) and os.path.exists(os.path.join(root, "bin", "nvcc")):
            return root
    return None


def _toolkit_matches(cuda_home: str, torch_cuda: str) -> bool:
    """nvcc's CUDA major version is torch's (torch refuses to build across majors)."""
    import re
    import subprocess

    version = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--version"], capture_output=True, text=True).stdout
    found = re.search(r"release (\d+)\.", version)
    if found and found.group(1) == torch_cuda.split(".")[0]:
        return True
    print(f"stack: building stack._C without CUDA kernels: nvcc in {cuda_home} is CUDA "
          f"{found.group(1) if found else '?'}, torch was built with CUDA {torch_cuda}", file=sys.stderr)
    return False


def _openmp_flags(torch) -> list:
    """-fopenmp when torch runs its CPU threads on OpenMP (Linux builds do).

    `at::parallel_for` is a header template: compiled without -fopenmp it takes its serial
    branch, and the kernels would run on one core whatever `torch.set_num_threads` says.
    """
    if sys.platform != "linux" or not torch.backends.openmp.is_available():
        return []
    return ["-fopenmp"]


def extension_args() -> dict:
    """`ext_modules` and `cmdclass` for stack._C, or {} where it cannot be built here."""
    sources = sorted(glob.glob("csrc/*.cpp"))
    if not sources:
        return {}
    cuda_home = _find_cuda_home()
    if cuda_home:
        os.environ["CUDA_HOME"] = cuda_home  # read when torch.utils.cpp_extension is imported
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        return _skip("torch is not importable at build time; install torch first and use --no-build-isolation")
    if not (shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")):
        return _skip("no C++ compiler found")
    openmp = _openmp_flags(torch)
    # -g1: line tables only (profilers and backtraces name file:line), in place of Python's -g, whose full debug
    # information for torch's templates tripled each file's compile (bev_pool.cpp: 47 s -g, 17 s -g1, one core of
    # an AMD EPYC); the code generated is the same (GCC's -g does not change it)
    compile_args = {"cxx": ["-O3", "-g1", *openmp]}
    headers = sorted(glob.glob("csrc/*.h"))  # rebuild when they change; shipped in sdists
    cuda_sources = sorted(glob.glob("csrc/*.cu"))
    if cuda_home and torch.version.cuda and cuda_sources and _toolkit_matches(cuda_home, torch.version.cuda):
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", CUDA_ARCHS)
        compile_args["nvcc"] = ["-O3", "-lineinfo", "--threads=2"]  # the architectures compile in parallel
        extension = cpp_extension.CUDAExtension("stack._C", sources + cuda_sources, extra_compile_args=compile_args,
                                                extra_link_args=openmp, include_dirs=_cuda_include_dirs(torch),
                                                depends=headers)
    else:
        extension = cpp_extension.CppExtension("stack._C", sources, extra_compile_args=compile_args,
                                               extra_link_args=openmp, depends=headers)
    return {"ext_modules": [extension], "cmdclass": {"build_ext": cpp_extension.BuildExtension}}


setup(
    packages=all_packages(),
    package_dir=PACKAGE_ROOTS,
    **extension_args(),
)
