"""The whole stack as separate processes (verifier ranks, drafter, scheduler) over real gRPC and gloo.

Greedy outputs over the wire must equal the offline autoregressive output in every mode, with TP=1 and
TP=2, under concurrency, with requests arriving while others run.
"""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from minedraft.api import worker_pb2, worker_pb2_grpc
from minedraft.client import Client
from minedraft.config import EngineConfig
from minedraft.engine.engine import LLMEngine
from minedraft.sampling.params import SamplingParams
from minedraft.stack.local import LocalStack, engine_flags, free_port, scheduler_settings

from conftest import pard_draft, tiny_config
from services import QUICK_STOP, TWO_PROCESSES, children, overload_codes, serving, wait_serving, worker_info
from tiny_models import make_eagle3_head, make_eagle_head

MAX_MODEL_LEN = 128
MODES = {
    "ar": None,
    "sd": {"num_speculative_tokens": 3},
    "pearl": {"num_speculative_tokens": 3, "is_parallel": True, "force_pearl": True},
    "minedraft": {"num_speculative_tokens": 3, "is_parallel": True},
    "minedraft+tetris": {"num_speculative_tokens": 2, "is_parallel": True, "tetris": True, "tetris_capacity": 6},
}


def _config(pair, spec, **overrides) -> EngineConfig:
    # Strict kernels: every mode must equal the offline ar output token for token.
    return tiny_config(pair, spec, **{"max_num_seqs": 4, "max_model_len": MAX_MODEL_LEN, **overrides})


def _workload(n: int = 32) -> list[tuple[list[int], int]]:
    rng = random.Random(5)
    return [
        ([rng.randrange(320) for _ in range(rng.choice([1, 3, 9, 30]))], rng.choice([1, 5, 12, 24])) for _ in range(n)
    ]


@pytest.fixture(scope="module")
def expected(pair) -> list[list[int]]:
    """Offline autoregressive output of the target: the reference every mode must reproduce."""
    engine = LLMEngine.local(_config(pair, None))
    requests = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=m)) for p, m in _workload()]
    while engine.has_unfinished():
        engine.step()
    return [r.output_ids for r in requests]


def _generate_concurrently(address: str, work, stagger_s: float = 0.01) -> list[list[int]]:
    """32 streams at once; later ones start while earlier ones run."""
    with Client(address, timeout=120) as client:

        def one(i: int) -> list[int]:
            time.sleep(stagger_s * i)
            prompt, max_tokens = work[i]
            return client.generate(prompt, max_tokens=max_tokens, temperature=0).token_ids

        with ThreadPoolExecutor(len(work)) as pool:
            return list(pool.map(one, range(len(work))))


def _assert_idle(stack: LocalStack, timeout_s: float = 10.0) -> None:
    """Every KV block on every worker is free again."""
    addresses = [a for a in (stack.verifier_address, stack.drafter_address) if a]
    deadline = time.monotonic() + timeout_s
    while True:
        infos = [worker_info(a) for a in addresses]
        if all(i.num_active_sequences == 0 and i.num_free_blocks == i.num_blocks for i in infos):
            return
        assert time.monotonic() < deadline, f"KV blocks still held: {infos}"
        time.sleep(0.05)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_over_grpc_equals_offline_ar(pair, expected, mode: str, tp: int) -> None:
    with LocalStack(_config(pair, MODES[mode], tensor_parallel_size=tp), worker=TWO_PROCESSES) as stack:
        got = _generate_concurrently(stack.address, _workload())
        with Client(stack.address) as client:
            info = client.server_info()
        assert (info.mode, info.tensor_parallel_size) == (mode.split("+")[0], tp)
        _assert_idle(stack)
    assert got == expected


@pytest.mark.parametrize("mode", ["sd", "minedraft"])
def test_a_verifier_that_drafts_itself_equals_offline_ar(pair, expected, mode: str) -> None:
    """colocate_drafter: the verifier runs the draft model in its own process and no drafter service runs; the
    scheduler learns it from the verifier's info and speculates through it."""
    spec = {**MODES[mode], "adaptive": False}  # fixed k: it drafts whatever the random pair's acceptance
    with LocalStack(_config(pair, spec), worker=QUICK_STOP.model_copy(update={"colocate_drafter": True})) as stack:
        assert stack.drafter_address is None and "drafter" not in stack.commands
        assert worker_info(stack.verifier_address).draft_num_blocks > 0
        got = _generate_concurrently(stack.address, _workload())
        with Client(stack.address) as client:
            assert client.server_info().mode == mode
            drafted = client.generate([5, 17, 33], max_tokens=24, temperature=0).spec_decode_stats.num_draft_tokens
        assert drafted > 0
        _assert_idle(stack)
    assert got == expected


@pytest.mark.parametrize("mode", ["sd", "minedraft"])
def test_parallel_drafting_over_grpc_equals_offline_ar(pair, expected, mode: str, tmp_path) -> None:
    """PARD across the services: the drafter proposes each window in one forward; the verifier's two ranks
    get the drafts over the tensor channel as always."""
    spec = {**MODES[mode], "parallel_drafting": True}
    config = _config((pair[0], pard_draft(pair[1], tmp_path)), spec, tensor_parallel_size=2)
    with LocalStack(config, worker=TWO_PROCESSES) as stack:
        got = _generate_concurrently(stack.address, _workload())
        with Client(stack.address) as client:
            info = client.server_info()
        assert (info.mode, info.draft_method, info.speculative_config["parallel_drafting"]) == (mode, "pard", True)
        _assert_idle(stack)
    assert got == expected


@pytest.mark.parametrize("mode", ["sd", "pearl", "minedraft", "minedraft+p-eagle", "minedraft+eagle"])
def test_eagle_heads_over_grpc_with_two_verifier_ranks_equal_offline_ar(pair, expected, mode: str, tmp_path) -> None:
    """EAGLE across the services: verifier rank 0 sends the target's features of every committed position to
    the drafter over the tensor channel (gloo here, NCCL on GPUs); rank 1 follows the plans. An EAGLE-3 head
    (P-EAGLE: the same head drafting each window in one pass), and an EAGLE-1 head (+eagle), which reads the
    target's final normed state."""
    target_hidden = json.loads(Path(pair[0], "config.json").read_text())["hidden_size"]
    method = "eagle" if mode.endswith("+eagle") else "eagle3"
    if method == "eagle":
        head = make_eagle_head(tmp_path / "head", hidden_size=target_hidden, vocab_size=320, head_dim=16,
                               init_std=0.4, file_format="bin")  # fmt: skip
    else:
        head = make_eagle3_head(tmp_path / "head", hidden_size=target_hidden, vocab_size=320, head_dim=16,
                                aux_layers=[0, 1, 1], init_std=0.4, mask_token_id=7)  # fmt: skip
    # Fixed k: a random head's drafts are useless, and adaptive speculation would rightly stop drafting, while
    # what is tested here is that the features reach the head.
    spec = {**MODES[mode.split("+")[0]], "method": method, "parallel_drafting": mode.endswith("p-eagle"),
            "adaptive": False}
    config = _config((pair[0], str(head)), spec, tensor_parallel_size=2)
    work = _workload()
    with LocalStack(config, worker=TWO_PROCESSES) as stack:
        got = _generate_concurrently(stack.address, work)
        with Client(stack.address) as client:
            info = client.server_info()
            drafted = client.generate(work[3][0], max_tokens=12, temperature=0).spec_decode_stats.num_draft_tokens
        reported = "p-eagle" if "p-eagle" in mode else method
        assert (info.mode, info.draft_method) == (mode.split("+")[0], reported)
        assert drafted > 0, "the head drafted nothing: its features never reached the drafter"
        _assert_idle(stack)
    assert got == expected


@pytest.mark.parametrize("mode", ["ar", "minedraft"])
def test_small_kv_budget_over_grpc_equals_offline_ar(pair, expected, mode: str) -> None:
    """32 concurrent requests through a KV pool with room for one of max_model_len: admission waits for blocks,
    requests are preempted and prefilled again, and every output is still the offline ar output."""
    # 2 layers x (k, v) x 2 kv heads x 8 tokens x 32 dims x 4 bytes per target block; the drafter's are smaller
    per_block = 2 * 2 * 2 * 8 * 32 * 4
    config = _config(pair, MODES[mode], block_size=8, kv_cache_memory_bytes=16 * per_block)
    # The longest requests first and all at once: those running together outgrow the pool whatever the timing
    work = _workload()
    order = sorted(range(len(work)), key=lambda i: -(len(work[i][0]) + work[i][1]))
    with LocalStack(config, worker=TWO_PROCESSES, scheduler=scheduler_settings(metrics_port=free_port())) as stack:
        got = _generate_concurrently(stack.address, [work[i] for i in order], stagger_s=0)
        with Client(stack.address) as client:
            info = client.server_info()
        assert (info.num_kv_blocks, info.kv_block_size) == (16, 8)  # one request of max_model_len
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics_port}/metrics", timeout=10).read().decode()
        preemptions = float(re.search(r"^minedraft:num_preemptions_total (\S+)$", metrics, re.M).group(1))
        assert preemptions > 0, "the budget is meant to force preemption"
        _assert_idle(stack)
    assert got == [expected[i] for i in order]


@pytest.mark.parametrize("budget_blocks", [None, 16])
def test_a_drafter_that_sits_out_steps_drafts_from_every_token(pair, budget_blocks) -> None:
    """One-batch sd (fixed k): the drafter sits out each verification half and gets its results with the next
    step that drafts. Had it lost a token, its windows would be drafted after the wrong text and rejected: the
    served drafts are accepted as often as the offline engine's (whose drafter gets every step's results at
    once), also through a KV budget that preempts requests and admits them again under their ids."""
    spec = {"num_speculative_tokens": 3, "adaptive": False}
    per_block = 2 * 2 * 2 * 8 * 32 * 4  # as in test_small_kv_budget_over_grpc_equals_offline_ar
    budget = {"block_size": 8, "kv_cache_memory_bytes": budget_blocks * per_block} if budget_blocks else {}
    work = _workload(16)
    engine = LLMEngine.local(_config(pair, spec, **budget))
    offline = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=m)) for p, m in work]
    while engine.has_unfinished():
        engine.step()
    metrics = scheduler_settings(metrics_port=free_port())
    with LocalStack(_config(pair, spec, **budget), worker=TWO_PROCESSES, scheduler=metrics) as stack, \
            Client(stack.address, timeout=120) as client:
        def one(i: int):
            time.sleep(0.01 * i)
            return client.generate(work[i][0], max_tokens=work[i][1], temperature=0)

        with ThreadPoolExecutor(len(work)) as pool:
            served = list(pool.map(one, range(len(work))))
        text = urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics_port}/metrics", timeout=10).read().decode()
        preemptions = float(re.search(r"^minedraft:num_preemptions_total (\S+)$", text, re.M).group(1))
        assert (preemptions > 0) == bool(budget_blocks)
        _assert_idle(stack)
    assert [r.token_ids for r in served] == [r.output_ids for r in offline]
    # Served windows are planned ahead and start where offline ones need not, so the counts differ a little (76
    # against 66 here); a drafter that lost the tokens of the steps it sat out got 5.
    accepted = sum(r.spec_decode_stats.num_accepted_tokens for r in served)
    assert accepted >= 0.8 * sum(r.stats.num_accepted_tokens for r in offline) > 0


@pytest.fixture(scope="module")
def stack(pair):
    """One MineDraft stack for the lifecycle tests below."""
    small_queue = scheduler_settings(max_waiting_requests=8)
    config = _config(pair, MODES["minedraft"], max_num_seqs=2)
    with LocalStack(config, worker=TWO_PROCESSES, scheduler=small_queue) as running:
        yield running


def test_stream_deltas_add_up_to_the_final_text(stack) -> None:
    with Client(stack.address, timeout=60) as client:
        for prompt in ("héllo wörld → 世界", "def f(x):\n    return x", [7, 8, 9]):
            deltas = list(client.stream(prompt, max_tokens=24, temperature=0, ignore_eos=True))
            full = client.generate(prompt, max_tokens=24, temperature=0, ignore_eos=True)
            assert "".join(d.text for d in deltas) == full.text
            assert [t for d in deltas for t in d.token_ids] == full.token_ids
            assert deltas[-1].finish_reason == "length" and deltas[-1].usage.completion_tokens == 24


def test_stop_strings_over_the_wire(stack) -> None:
    with Client(stack.address, timeout=60) as client:
        full = client.generate([11, 12, 13], max_tokens=40, temperature=0, ignore_eos=True)
        stop = full.text[10:13]
        assert len(stop) == 3
        cut = client.generate([11, 12, 13], max_tokens=40, temperature=0, ignore_eos=True, stop=[stop])
        streamed = "".join(
            d.text for d in client.stream([11, 12, 13], max_tokens=40, temperature=0, ignore_eos=True, stop=stop)
        )
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)] == streamed
    assert full.token_ids[: len(cut.token_ids)] == cut.token_ids


def test_cancelled_and_expired_streams_free_their_kv(stack) -> None:
    with Client(stack.address, retries=0) as client:
        for _ in range(6):  # cancel after the first delta
            stream = client.stream([1, 2, 3], max_tokens=100, temperature=0, ignore_eos=True)
            next(iter(stream))
            stream.close()
        errors = []

        def expire() -> None:
            try:
                # 100 tokens take dozens of steps: far more than 0.1 s on any machine.
                client.generate([4, 5, 6], max_tokens=100, temperature=0, ignore_eos=True, timeout=0.1)
            except grpc.RpcError as exc:
                errors.append(exc.code())

        threads = [threading.Thread(target=expire) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors and all(code == grpc.StatusCode.DEADLINE_EXCEEDED for code in errors)
    _assert_idle(stack)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "temperature": -0.5}, "temperature"),
        ({"prompt": "x", "top_p": 1.5}, "top_p"),
        ({"prompt": [1] * MAX_MODEL_LEN}, "max_model_len"),
    ],
)
def test_bad_input_is_invalid_argument_and_harms_nobody(stack, kwargs, message) -> None:
    with Client(stack.address, timeout=60, retries=0) as client, ThreadPoolExecutor(1) as pool:
        bystander = pool.submit(client.generate, [3, 4, 5], max_tokens=24, temperature=0, ignore_eos=True)
        time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as info:
            client.generate(**kwargs)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in info.value.details()
        assert len(bystander.result().token_ids) == 24


def test_overload_is_resource_exhausted(stack) -> None:
    """max_num_seqs=2 x two batches run; 8 may wait; the rest are turned away, not queued forever."""
    codes = overload_codes(stack.address)
    assert "RESOURCE_EXHAUSTED" in codes and "ok" in codes
    assert set(codes) <= {"ok", "RESOURCE_EXHAUSTED"}


def test_a_worker_serves_alone_and_steps_only_in_a_world(pair) -> None:
    """A worker is SERVING once its model is loaded, without its peer: the scheduler forms the world (an
    epoch) later. Until then, and for a plan of another epoch, it refuses steps with FAILED_PRECONDITION."""
    config = _config(pair, MODES["sd"])
    verifier_port, dist_port = free_port(), free_port()
    verifier = subprocess.Popen([
        sys.executable, "-m", "minedraft", "verifier", *engine_flags(config), "--dist-addr", "127.0.0.1",
        "--dist-port", str(dist_port), "--host", "127.0.0.1", "--port", str(verifier_port),
    ])  # fmt: skip
    try:
        wait_serving(f"127.0.0.1:{verifier_port}")
        assert worker_info(f"127.0.0.1:{verifier_port}").epoch == 0
        with grpc.insecure_channel(f"127.0.0.1:{verifier_port}") as channel, pytest.raises(grpc.RpcError) as info:
            worker_pb2_grpc.WorkerStub(channel).Step(worker_pb2.StepPlan(step_id=1, epoch=7), timeout=10)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "epoch 7" in info.value.details()
    finally:
        verifier.terminate()
        verifier.wait(timeout=30)


@pytest.mark.parametrize(
    "spec, message",
    [
        ('{"num_speculative_tokens": 2, "bogus_key": 1}', "Extra inputs are not permitted"),
        ('{"draft_tensor_parallel_size": 2}', "draft_tensor_parallel_size\n  Input should be 1"),
        ('{"method": "medusa"}', "Input should be 'draft_model', 'eagle', 'eagle3', 'ngram' or 'suffix'"),
    ],
    ids=["unknown-key", "draft-tp", "unknown-method"],
)
def test_a_speculative_config_we_do_not_implement_fails_at_startup(pair, spec, message) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "minedraft", "up", "--model", pair[0], "--speculative-config", spec],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert message in result.stderr


def _adapter(pair) -> Path:
    """A LoRA adapter of the pair's target, made once beside it."""
    from test_lora import make_adapter

    folder = Path(pair[0]).parent / "lora-a"
    return folder if folder.exists() else make_adapter(Path(pair[0]), folder, seed=1)


def _every_field_off_default(pair) -> EngineConfig:
    config = _config(
        pair, {"num_speculative_tokens": 2, "is_parallel": True, "tetris": True}, tensor_parallel_size=2,
        max_num_seqs=3, max_model_len=96, dtype="float32", seed=7, draft_support_size=8,
        kv_cache_memory_bytes=8 << 20, gpu_memory_utilization=0.5, block_size=8, max_num_batched_tokens=512,
        max_prediction_tokens=100, prediction_draft_tokens=5,
        enable_prefix_caching=False, enforce_eager=True, enable_lora=True, max_loras=2, max_cpu_loras=3,
        max_lora_rank=8, lora_modules=[{"name": "a", "path": str(_adapter(pair))}], allow_runtime_lora_updating=True,
        lora_root=str(_adapter(pair).parent), tokenizer=str(pair[0]),
    )  # fmt: skip
    fields = EngineConfig.model_fields
    assert [n for n, f in fields.items() if getattr(config, n) == f.default] == [], "set every field off its default"
    return config


@pytest.fixture(scope="module")
def every_field(pair):
    """A group whose every engine setting is off its default (two verifier ranks, a drafter service)."""
    with LocalStack(_every_field_off_default(pair), worker=TWO_PROCESSES) as stack:
        yield stack


def test_every_engine_setting_reaches_every_process(every_field) -> None:
    """Each worker runs exactly the launcher's config (every field off its default, so a dropped one shows);
    the scheduler, which refuses workers that differ from it, comes up SERVING."""
    stack = every_field
    for address in (stack.verifier_address, stack.drafter_address):
        assert EngineConfig.model_validate_json(worker_info(address).engine_config_json) == stack.config
    assert serving(stack.address)


def test_scheduler_refuses_workers_with_other_settings(every_field) -> None:
    """Workers started with draft_support_size=8, a second scheduler with the default: it exits with a message
    naming the field, instead of running a group that disagrees (it compares before it forms a world, so the
    group's own scheduler serves on)."""
    stack = every_field
    mine = stack.config.model_copy(update={"draft_support_size": 64})
    result = subprocess.run(
        [sys.executable, "-m", "minedraft", "scheduler", *engine_flags(mine), "--port", str(free_port()),
         "--metrics-port", "0", "--verifier", stack.verifier_address, "--drafter", stack.drafter_address],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "draft_support_size: 64 vs 8" in result.stderr and "Traceback" not in result.stderr
    assert serving(stack.address)


def test_offline_api_with_tensor_parallelism(pair, expected) -> None:
    """`LLM(tensor_parallel_size=2)` runs its verifier ranks as worker processes and gives the same tokens."""
    from minedraft import LLM

    work = _workload()
    target, draft = pair
    spec = {**MODES["minedraft"], "model": draft}
    with LLM(target, spec, tensor_parallel_size=2, max_num_seqs=4, max_model_len=MAX_MODEL_LEN, device="cpu",
             batch_invariant=True) as llm:
        params = [SamplingParams(temperature=0, max_tokens=m) for _, m in work]
        outputs = llm.generate([p for p, _ in work], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_up_stops_every_service_on_a_signal(pair, sig) -> None:
    port = free_port()
    up = subprocess.Popen(
        [sys.executable, "-m", "minedraft", "up", "--model", pair[0], "--port", str(port), "--metrics-port", "0",
         "--speculative-config", json.dumps({**MODES["minedraft"], "model": pair[1]}), "--device", "cpu"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_serving(f"127.0.0.1:{port}")
        assert "is serving on" in up.stdout.readline()
        services = children(up.pid)
        assert len(services) == 2  # verifier (on CPU it runs the draft model too) and scheduler
        up.send_signal(sig)
        assert up.wait(timeout=60) == 0
        assert [pid for pid in services if Path(f"/proc/{pid}").exists()] == [], "services outlived minedraft up"
    finally:
        if up.poll() is None:
            up.kill()

