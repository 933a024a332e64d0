"""OpenAI-compatible servers side by side: `minedraft up --http-port` in each mode, vLLM's OpenAI server (`vllm
serve`, from its CPU build's venv: `vllm_env`) and llama.cpp's `llama-server` (built from PyPI: `llama_cpp`), with
the same models (`ServedModels`: the bundled pair, or SmolLM2 and its shipped draft), the same draft settings
(draft model, k tokens) and as many requests running at once (MineDraft: two batches of half that).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from minedraft.bench.vllm_env import peer_environment
from minedraft.config import BUNDLED_DRAFT, BUNDLED_MODELS_DIR, BUNDLED_TARGET, REPO_ROOT, packaged_model
from minedraft.stack.local import free_port

SERVED_NAME = "minedraft-target"
NGRAM = {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 5}  # vLLM's keys, ours alike
LLAMA_NGRAM_N = 3  # llama-server's lookup length (--spec-ngram-*-size-n): a fixed n between NGRAM's 2 and 5
# name -> (server, speculative config of ours / extra keys of vLLM's / llama-server's draft, None: plain decoding)
SERVERS: dict[str, tuple[str, dict | None]] = {
    "vllm-ar": ("vllm", None),
    "vllm-sd": ("vllm", {"method": "draft_model"}),
    # llama-server on the target's GGUF as shipped (SmolLM2: Q4_1), on a bfloat16 GGUF of the weights we serve, and
    # with the draft model's GGUF (`-md`, k = --spec-draft-n-max)
    "llama-ar": ("llama", None),
    "llama-ar-bf16": ("llama", None),
    "llama-sd": ("llama", {}),
    "llama-sd-bf16": ("llama", {}),
    "ar": ("ours", None),
    "sd": ("ours", {}),
    "sd-fixed": ("ours", {"adaptive": False}),
    "sd-k2-fixed": ("ours", {"adaptive": False, "num_speculative_tokens": 2}),
    "minedraft-fixed": ("ours", {"is_parallel": True, "adaptive": False}),
    "pearl": ("ours", {"is_parallel": True, "force_pearl": True}),
    "minedraft": ("ours", {"is_parallel": True}),
    # The verifier runs the draft model in its own process (`--colocate-drafter`, on CPU the default of `up`), or a
    # drafter service runs beside it (`--no-colocate-drafter`, as pods run them).
    "sd-fixed-colocated": ("ours", {"adaptive": False}),
    "minedraft-colocated": ("ours", {"is_parallel": True}),
    "sd-fixed-separate": ("ours", {"adaptive": False}),
    "minedraft-fixed-separate": ("ours", {"is_parallel": True, "adaptive": False}),
    "minedraft-separate": ("ours", {"is_parallel": True}),
    "sd+eagle3": ("ours", {"method": "eagle3"}),
    "minedraft+eagle3": ("ours", {"is_parallel": True, "method": "eagle3"}),
    # Drafting without a draft model (the lookup workloads, `minedraft.bench.lookup`): n-gram prompt lookup with
    # vLLM's keys and meanings, k = --k or 8; suffix decoding; and OpenAI's predicted outputs, sent by the client to
    # the servers named +prediction only (the peers take no `prediction`).
    "ngram": ("ours", NGRAM),
    "ngram-k8": ("ours", {**NGRAM, "num_speculative_tokens": 8}),
    "suffix": ("ours", {"method": "suffix"}),
    "suffix-k8": ("ours", {"method": "suffix", "num_speculative_tokens": 8}),
    "ar+prediction": ("ours", None),
    "ngram+prediction": ("ours", NGRAM),
    "vllm-ngram": ("vllm", NGRAM),
    "vllm-ngram-k8": ("vllm", {**NGRAM, "num_speculative_tokens": 8}),
    "vllm-suffix": ("vllm", {"method": "suffix"}),  # needs arctic-inference in vLLM's venv
    "vllm-suffix-k8": ("vllm", {"method": "suffix", "num_speculative_tokens": 8}),
    # llama-server's own lookups on the bfloat16 GGUF (--spec-type): ngram-simple and ngram-map-k match the last
    # LLAMA_NGRAM_N tokens in the context and draft the k after the match; ngram-mod (a hashed n-gram pool, its
    # defaults: 24-token matches, drafts of 48 to 64) and ngram-cache (drafts of 8) run as they ship.
    "llama-ngram-simple-bf16": ("llama", {"spec_type": "ngram-simple"}),
    "llama-ngram-map-k-bf16": ("llama", {"spec_type": "ngram-map-k"}),
    "llama-ngram-mod-bf16": ("llama", {"spec_type": "ngram-mod"}),
    "llama-ngram-cache-bf16": ("llama", {"spec_type": "ngram-cache"}),
}
DRAFTS_FROM_TEXT = ("ngram", "suffix")  # methods that need no draft model (vLLM gets none)


@dataclass(frozen=True)
class ServedModels:
    """The models every server of a run serves, each in the form its server reads. `ours`: our --model (its draft
    and EAGLE head are the registry's, or the bundled ones); `target_hf`, `draft_hf`: Hugging Face folders (vLLM,
    and the clients' tokenizer); `vllm_dtype`; `gguf`: llama-server's files by role ("target" as shipped,
    "bf16", "draft"), made when a llama server is asked for; `prompts`: a JSON-lines file of prompts and whether
    the clients send them rendered with the chat template (SmolLM2 is a chat model)."""

    ours: str
    target_hf: Path
    draft_hf: Path
    vllm_dtype: str
    prompts: Path
    chat: bool
    gguf: dict[str, Path] = field(default_factory=dict)


BUNDLED = ServedModels(str(BUNDLED_TARGET), BUNDLED_TARGET, BUNDLED_DRAFT, "float32",
                       BUNDLED_MODELS_DIR / "prompts" / "heldout.jsonl", chat=False)  # fmt: skip
MODELS_DIR = REPO_ROOT / ".bench-models"  # what the peers read of a packaged model (HF folder, GGUF files)


def packaged_models(name: str, llama: bool) -> ServedModels:
    """A packaged model (the registry's name) and its draft as every server reads them: the GGUF saved as a
    bfloat16 HF folder of exactly the weights dtype auto serves (model/gguf.py, `save_hf_folder`), and with
    `llama`, GGUF files of that folder and of the draft by llama.cpp's converter."""
    from minedraft.bench.llama_cpp import to_gguf
    from minedraft.model.checkpoint import resolve_checkpoint
    from minedraft.model.gguf import save_hf_folder

    entry = packaged_model(name)
    gguf = resolve_checkpoint(name)
    target_hf = save_hf_folder(gguf, MODELS_DIR / name)
    draft_hf = entry.drafts["draft_model"]
    files = {}
    if llama:
        files = {"target": gguf, "bf16": to_gguf(target_hf, MODELS_DIR / f"{name}.bf16.gguf"),
                 "draft": to_gguf(draft_hf, MODELS_DIR / f"{draft_hf.name}.bf16.gguf")}  # fmt: skip
    return ServedModels(name, target_hf, draft_hf, "bfloat16", BUNDLED_MODELS_DIR / "prompts" / "chat-heldout.jsonl",
                        chat=True, gguf=files)  # fmt: skip


@dataclass
class Server:
    """A server process and the rounds measured against it (each a client's result JSON, vLLM's keys)."""

    name: str
    process: subprocess.Popen
    url: str
    rounds: list[dict] = field(default_factory=list)
    ours: list[dict] = field(default_factory=list)  # the same rounds measured by `minedraft bench`
    by_load: dict[int, list[dict]] = field(default_factory=dict)  # rounds per load (requests in flight)
    crowded: bool = False  # its rounds run beside a busy neighbour process (the same server as its quiet twin)

    def beside_a_neighbour(self) -> Server:
        """The same server, for rounds run beside a busy neighbour process: its results kept apart."""
        return Server(f"{self.name}+neighbour", self.process, self.url, crowded=True)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def median(self, key: str, ours: bool = False) -> float:
        values = [r[key] for r in (self.ours if ours else self.rounds) if r.get(key) is not None]
        return statistics.median(values) if values else float("nan")


def start_server(name: str, *, k: int, max_num_seqs: int, vllm_python: str, logs: Path,
                 prefix_caching: bool = False, label: str | None = None, models: ServedModels = BUNDLED,
                 llama_server: Path | None = None, max_model_len: int = 2048) -> Server:  # fmt: skip
    """Server `name` of SERVERS on a free port, logging to `logs/label.log` (`label` names the server too;
    default `name`). `prefix_caching` off by default: benchmark rounds repeat their prompts. `max_model_len`:
    the context each request may use (llama-server: per slot)."""
    kind, spec = SERVERS[name]
    port = free_port()
    caching = "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "services")}
    if kind == "ours":
        spec_json = json.dumps({"num_speculative_tokens": k, **spec}) if spec is not None else "null"
        batch = max_num_seqs // 2 if name.startswith("minedraft") else max_num_seqs  # as many at once, two batches
        command = [sys.executable, "-m", "minedraft", "up", "--http-port", str(port), "--port", str(free_port()),
                   "--metrics-port", "0", "--speculative-config", spec_json, "--max-num-seqs", str(batch),
                   "--log-level", "WARNING", caching, "--served-model-name", SERVED_NAME, *_drafter_placement(name)]
        if models is not BUNDLED:
            command += ["--model", models.ours, "--max-model-len", str(max_model_len)]
    elif kind == "vllm":
        command = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(models.target_hf),
                   "--served-model-name", SERVED_NAME, "--port", str(port), "--host", "127.0.0.1",
                   "--max-num-seqs", str(max_num_seqs), "--dtype", models.vllm_dtype, caching]  # fmt: skip
        if models is not BUNDLED:
            command += ["--max-model-len", str(max_model_len)]
        if spec is not None:
            draft = {} if spec.get("method") in DRAFTS_FROM_TEXT else {"model": str(models.draft_hf)}
            command += ["--speculative-config", json.dumps({"num_speculative_tokens": k, **spec, **draft})]
        env = peer_environment()
    else:
        command = _llama_command(name, models, llama_server, port, k, max_num_seqs, max_model_len, prefix_caching)
    label = label or name
    log = open(logs / f"{label}.log", "w")  # noqa: SIM115 (closed with the process)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    return Server(label, process, f"http://127.0.0.1:{port}")


def _llama_command(name: str, models: ServedModels, binary: Path | None, port: int, k: int, slots: int,
                   max_model_len: int, prefix_caching: bool) -> list[str]:  # fmt: skip
    """llama-server with `slots` parallel slots of `max_model_len` tokens each, on every core, continuous batching;
    `-bf16` servers on the bfloat16 GGUF, `-sd` ones with the draft model drafting k tokens, `-ngram-*` ones with
    that lookup of llama-server's (`--spec-type`; simple and map-k draft k tokens after an LLAMA_NGRAM_N match)."""
    if binary is None or not models.gguf:
        raise ValueError(f"{name} needs llama-server and GGUF files (packaged_models(..., llama=True))")
    target = models.gguf["bf16" if name.endswith("-bf16") else "target"]
    command = [str(binary), "-m", str(target), "--host", "127.0.0.1", "--port", str(port), "--alias", SERVED_NAME,
               "-np", str(slots), "-c", str(slots * max_model_len), "-t", str(os.cpu_count() or 1), "-cb",
               "--no-webui", "--metrics"]  # fmt: skip
    if not prefix_caching:
        command += ["--cache-reuse", "0", "--no-cache-prompt"]
    spec = SERVERS[name][1]
    if spec is None:
        return command
    kind = spec.get("spec_type")
    if kind is None:
        return command + ["-md", str(models.gguf["draft"]), "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0"]
    command += ["--spec-type", kind]
    if kind in ("ngram-simple", "ngram-map-k"):
        option = f"--spec-ngram-{kind.removeprefix('ngram-')}"
        command += [f"{option}-size-n", str(LLAMA_NGRAM_N), f"{option}-size-m", str(k), f"{option}-min-hits", "1"]
    return command


def _drafter_placement(name: str) -> list[str]:
    """`up`'s flag for where a server of ours runs its draft model (none: `up`'s default)."""
    if name.endswith("-colocated"):
        return ["--colocate-drafter"]
    return ["--no-colocate-drafter"] if name.endswith("-separate") else []


def wait_healthy(server: Server, timeout: float, logs: Path) -> None:
    """Until `server` answers /health, or SystemExit when it exits or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise SystemExit(f"{server.name} exited; see {logs / (server.name + '.log')}")
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"{server.name} was not healthy within {timeout:.0f}s; see {logs / (server.name + '.log')}")
