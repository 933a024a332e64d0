"""The peers' set-up in the served benchmark: llama.cpp built for what the CPU lists (never AMX), and the
llama-server command each named server runs (its file, its draft, its slots)."""

from __future__ import annotations

from pathlib import Path

import pytest

from minedraft.bench.llama_cpp import cpu_options
from minedraft.bench.servers import BUNDLED, SERVED_NAME, ServedModels, _llama_command

CPUINFO = "processor\t: 0\nflags\t\t: fpu sse avx avx2 fma f16c avx512f avx512_bf16 amx_tile amx_bf16 amx_int8\n"


def test_llama_cpp_targets_the_listed_instruction_sets_and_never_amx() -> None:
    options = cpu_options(CPUINFO)
    assert "-DGGML_NATIVE=OFF" in options
    assert {"-DGGML_AVX512=ON", "-DGGML_AVX512_BF16=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON"} <= set(options)
    assert {"-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX_VNNI=OFF", "-DGGML_BMI2=OFF"} <= set(options)
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(options)
    assert not any("AMX" in o and o.endswith("=ON") for o in options)
    assert "-DGGML_AVX=OFF" in cpu_options("flags\t: sse sse2\n")


def test_each_llama_server_runs_its_file_and_draft(tmp_path) -> None:
    files = {role: tmp_path / f"{role}.gguf" for role in ("target", "bf16", "draft")}
    models = ServedModels("m", tmp_path, tmp_path, "bfloat16", tmp_path / "p.jsonl", chat=True, gguf=files)
    binary = Path("llama-server")

    def command(name: str) -> list[str]:
        return _llama_command(name, models, binary, 8080, k=3, slots=8, max_model_len=1024, prefix_caching=False)

    ar, sd_bf16 = command("llama-ar"), command("llama-sd-bf16")
    assert ar[ar.index("-m") + 1] == str(files["target"]) and "-md" not in ar
    assert sd_bf16[sd_bf16.index("-m") + 1] == str(files["bf16"])
    assert sd_bf16[sd_bf16.index("-md") + 1] == str(files["draft"])
    assert sd_bf16[sd_bf16.index("--spec-draft-n-max") + 1] == "3"
    assert ar[ar.index("-np") + 1] == "8" and ar[ar.index("-c") + 1] == str(8 * 1024)
    assert ar[ar.index("--alias") + 1] == SERVED_NAME and "--no-cache-prompt" in ar
    with pytest.raises(ValueError, match="needs llama-server and GGUF files"):
        _llama_command("llama-ar", BUNDLED, binary, 8080, 3, 8, 1024, False)
