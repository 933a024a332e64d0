"""The engine's Executor over gRPC: each step's plan goes to the drafter and verifier rank 0 at once."""

from __future__ import annotations

import logging
import queue
import secrets
import socket
import time
from collections import deque
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from minedraft.api import worker_pb2, worker_pb2_grpc
from minedraft.config import EngineConfig, LoraModule, check_fits_one_request, config_differences
from minedraft.engine.detokenizer import Decoder
from minedraft.engine.engine import LLMEngine
from minedraft.engine.plans import DraftPlan, LoraChange, StepResult, VerifyPlan
from minedraft.engine.step import QueuedChanges, StepPlan, ordered
from minedraft.pool import check_poolable
from minedraft.pool.binding import DrafterPool
from minedraft.scheduler.step_deadline import StepDeadline
from minedraft.service.grpc_server import grpc_options
from minedraft.service.health import is_serving, probe
from minedraft.settings import SchedulerSettings
from minedraft.wire import lora_adapter_to_proto, plan_to_proto, result_from_replies

log = logging.getLogger("minedraft.scheduler")


class WorkerClient:
    def __init__(self, address: str, role: str) -> None:
        self.address = address
        self.role = role
        self.channel = grpc.insecure_channel(address, options=grpc_options())
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)

    def serving(self) -> bool:
        return is_serving(self.channel)

    def serving_later(self, timeout_s: float = 2.0) -> grpc.Future:
        """A health check that does not block: its future's result() is the reply (or raises)."""
        return health_pb2_grpc.HealthStub(self.channel).Check.future(health_pb2.HealthCheckRequest(), timeout=timeout_s)

    def close(self) -> None:
        self.channel.close()


class PlanStream:
    """One worker's `Steps` stream: plans go down in order, replies come back in the same order."""

    def __init__(self, worker: WorkerClient) -> None:
        self.worker = worker
        self._plans: queue.SimpleQueue[worker_pb2.StepPlan | None] = queue.SimpleQueue()
        self._replies = worker.stub.Steps(iter(self._plans.get, None))

    def send(self, plan: worker_pb2.StepPlan) -> None:
        self._plans.put(plan)

    def receive(self) -> worker_pb2.StepReply:
        return next(self._replies)

    def close(self) -> None:
        self._plans.put(None)
        self._replies.cancel()


class WorkerWorld(Protocol):
    """What the step loop drives to re-form the world (scheduler/loop.py): the configured workers, the world
    they form now, and forming a new one. `RemoteExecutor` is one."""

    verifier: WorkerClient
    drafter: WorkerClient | None
    pool: DrafterPool | None  # with a drafter pool: the drafter is the member bound to
    members: list[WorkerClient]  # the workers of the current world
    epoch: int

    @property
    def has_drafter(self) -> bool: ...

    def choose_drafter(self) -> bool:
        """Whether a drafter can join the next world (with a pool: bind to a member with room)."""
        ...

    def form_world(
        self, config: EngineConfig, with_drafter: bool, timeout_s: float
    ) -> dict[str, worker_pb2.WorkerInfo]: ...

    def flush(self) -> StepResult | None: ...


class RemoteExecutor(QueuedChanges):
    """Admissions and releases are batched into the next step's plan; `flush` sends them when the engine
    has nothing else to run (freeing KV blocks promptly). Plans travel on one stream per worker and world,
    and the engine sends the next step's plan while a step runs (`max_in_flight` 2), so no round trip
    stands between two steps on a worker.

    The workers compute in a world that this executor forms (`form_world`): the verifier, and the drafter
    when it is alive. Every formation is a new epoch; the workers drop all request state when they join
    one, so a new scheduler, or one whose worker died and came back, starts from free caches.
    """

    def __init__(self, verifier: str, drafter: str | None, settings: SchedulerSettings,
                 drafter_pool: list[str] | None = None) -> None:  # fmt: skip
        """`drafter_pool`: the members' HOST:PORT specs; the group then drafts with one of them (`drafter` unused)."""
        super().__init__()
        self.max_in_flight = settings.max_steps_in_flight
        self.verifier = WorkerClient(verifier, "verifier")
        self.pool = DrafterPool(drafter_pool, lambda address: WorkerClient(address, "drafter")) if (
            drafter_pool) else None  # fmt: skip
        self.drafter = WorkerClient(drafter, "drafter") if drafter and self.pool is None else None
        self.group = f"{socket.gethostname()}/{secrets.token_hex(3)}"  # how a pool drafter names this group
        self.deadline = StepDeadline(floor_s=settings.step_deadline_floor)
        self.members: list[WorkerClient] = []  # the workers of the current world
        self.kv_pool: tuple[int, int] | None = None  # (blocks, block size) of the verifier of the world
        self.draft_kv_blocks: int | None = None  # the drafter's blocks, when the world has one
        self._verifier_drafts = False  # the verifier of the world runs the draft model too (colocate_drafter)
        self._shares_cores = False  # ... on one CPU whose cores its two stages share (engine/step.py, `ordered`)
        self.epoch = secrets.randbits(62)  # random: a restarted scheduler never reuses its predecessor's epochs
        # The LoRA adapters served now (lora_modules, then the run-time changes): each new world's workers get
        # exactly these at their join, so a restarted worker serves what the group serves.
        self.loras: dict[str, LoraModule] | None = None
        self._step_id = 0
        self._calls = ThreadPoolExecutor(max_workers=4, thread_name_prefix="worker-call")  # joins beside hung steps
        self._streams: dict[str, PlanStream] = {}  # per member, for the life of a world
        self._submitted: deque[tuple[int, float, StepPlan]] = deque()  # (step id, when sent, plan) in flight
        self._last_collected = 0.0

    @property
    def workers(self) -> list[WorkerClient]:
        """Every worker this scheduler is configured with, in the world or not."""
        return [w for w in (self.verifier, self.drafter) if w is not None]

    @property
    def has_drafter(self) -> bool:
        """Whether the world drafts: a drafter service in it, or a verifier that runs the draft model itself."""
        return self.drafter is not None and self.drafter in self.members or self._verifier_drafts

    def choose_drafter(self) -> bool:
        if self.pool is None:
            return self.drafter is not None and self.drafter.serving()
        bound = self.pool.bind()
        self.drafter = bound or self.pool.candidate()
        return bound is not None

    def probe_pool(self, drafting: bool):
        """In the background: whether binding again would change something (pool/binding.py). A future."""
        assert self.pool is not None
        return self._calls.submit(self.pool.wants_binding, drafting)

    def form_world(
        self, config: EngineConfig, with_drafter: bool, timeout_s: float
    ) -> dict[str, worker_pb2.WorkerInfo]:
        """Form a new world of the verifier (and the drafter): every member drops its request state. Returns
        each member's info by role and sets `kv_pool` to what all of them hold. Raises if a member does not
        run `config`, their pool cannot hold one request, or a member does not join in time. A pool drafter
        that cannot take this group (it filled up, as when groups start together, or died since it was chosen)
        leaves the group target-only meanwhile, rather than waiting or failing."""
        try:
            return self._form(config, with_drafter, timeout_s)
        except Exception as exc:
            if not (with_drafter and self.pool is not None and self.drafter is not None):
                raise
            log.warning("the pool drafter at %s could not take this group (%s): target-only until one can",
                        self.drafter.address, exc)  # fmt: skip
            return self._form(config, False, timeout_s)

    def _form(self, config: EngineConfig, with_drafter: bool, timeout_s: float) -> dict[str, worker_pb2.WorkerInfo]:
        members = [self.verifier] + ([self.drafter] if with_drafter and self.drafter else [])
        self.members = []
        self._close_streams()  # the steps in flight belong to the old world
        infos = self.check_config(config, members)
        block_size = infos["verifier"].block_size
        if any(i.block_size != block_size for i in infos.values()):
            sizes = {role: info.block_size for role, info in infos.items()}
            raise RuntimeError(f"the workers' KV blocks differ in size: {sizes}")
        # A drafter without a model keeps no KV pool (num_blocks 0): the verifier's alone bounds admission.
        smallest = min(i.num_blocks for i in infos.values() if i.num_blocks)
        check_fits_one_request(smallest, block_size, infos["verifier"].max_model_len,
                               "the smallest KV pool in the world")  # fmt: skip
        kv_pool = infos["verifier"].num_blocks, block_size
        draft_kv_blocks = (infos["drafter"].num_blocks or None) if "drafter" in infos else None
        verifier_drafts = infos["verifier"].drafts  # colocate_drafter: one process drafts and verifies
        if verifier_drafts:
            draft_kv_blocks = infos["verifier"].draft_num_blocks or None
        self.epoch += 1
        if self.loras is None:
            self.loras = {m.name: m for m in config.lora_modules}
        calls = {self._calls.submit(w.stub.Join, join, timeout=timeout_s): w for w, join in self._joins(members)}
        for call, worker in calls.items():
            try:
                call.result()
            except grpc.RpcError as exc:
                raise RuntimeError(f"the {worker.role} at {worker.address} could not join: {_describe(exc)}") from exc
        self.members = members
        self.kv_pool, self.draft_kv_blocks = kv_pool, draft_kv_blocks
        self._verifier_drafts = verifier_drafts
        self._shares_cores = verifier_drafts and infos["verifier"].stages_share_cores
        self.clear_changes()  # the join brought the adapters' changes
        return infos

    def _joins(self, members: list[WorkerClient]) -> list[tuple[WorkerClient, worker_pb2.JoinRequest]]:
        """What each member is told to join: a world of all (drafts and results as tensors), or, with a pool
        drafter, the verifier's world and the drafter's place for this group (hand-overs by Exchange calls)."""
        adapters = [lora_adapter_to_proto(m) for m in self.loras.values()]
        if self.pool is None or len(members) == 1:
            join = worker_pb2.JoinRequest(epoch=self.epoch, has_drafter=len(members) > 1, lora_adapters=adapters)
            return [(w, join) for w in members]
        verifier, drafter = members
        return [
            (verifier, worker_pb2.JoinRequest(epoch=self.epoch, lora_adapters=adapters,
                                              drafter_address=drafter.address)),
            (drafter, worker_pb2.JoinRequest(epoch=self.epoch, has_drafter=True, group=self.group,
                                             verifier_address=verifier.address)),
        ]  # fmt: skip

    def wait_until_serving(self, timeout_s: float) -> None:
        """Probed on channels of their own: each worker's kept channel first connects once it serves, rather than
        waiting out the backoff of the connections refused while it started."""
        deadline = time.monotonic() + timeout_s
        for worker in self.workers:
            while not probe(worker.address):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{worker.role} at {worker.address} is not SERVING after {timeout_s:.0f}s")
                time.sleep(0.1)

    def check_config(
        self, config: EngineConfig, workers: list[WorkerClient] | None = None
    ) -> dict[str, worker_pb2.WorkerInfo]:
        """Every worker must run exactly this engine config (a setting that differs inside a group is a wrong
        answer or a hang, not a detail). Returns each one's info by role; raises ValueError naming the fields."""
        infos = {}
        for worker in workers or self.workers:
            info = worker.stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), timeout=10)
            differences = config_differences(config, EngineConfig.model_validate_json(info.engine_config_json))
            if differences:
                raise ValueError(
                    f"the {worker.role} at {worker.address} runs another engine config than this process "
                    f"(ours vs its): {'; '.join(differences)}. Start every service of the group with the same "
                    "engine settings (one --engine-config / ConfigMap)."
                )
            infos[worker.role] = info
        return infos

    def make_engine(
        self, config: EngineConfig, tokenizer: Decoder, infos: dict[str, worker_pb2.WorkerInfo]
    ) -> LLMEngine:
        """The engine over the world just formed (`infos`: its members', from `form_world`)."""
        verifier = infos["verifier"]
        return LLMEngine(config, self, tokenizer, list(verifier.eos_token_ids), verifier.max_model_len)

    def change_loras(self, changes: list[LoraChange]) -> None:
        super().change_loras(changes)
        assert self.loras is not None, "a world is formed before the engine changes adapters"
        for change in changes:
            if isinstance(change, str):
                self.loras.pop(change, None)
            else:
                self.loras[change.name] = change

    def flush(self) -> StepResult | None:
        if self.has_changes:
            return self.step(None, None)
        return None

    def step(self, draft: DraftPlan | None, verify: VerifyPlan | None) -> StepResult:
        self.submit(draft, verify)
        return self.collect()

    def submit(self, draft: DraftPlan | None, verify: VerifyPlan | None) -> None:
        """Send the step's plan down each member's stream (opened once per world); it waits there, received,
        while the step before it runs."""
        if not self.members:
            raise RuntimeError("no world is formed (form_world)")
        if not self._streams:
            self._streams = {w.role: PlanStream(w) for w in self.members}
        self._step_id += 1
        plan = self.take_changes(ordered(draft, verify, self._shares_cores), verify)
        message = plan_to_proto(self._step_id, plan)
        message.epoch = self.epoch
        for stream in self._streams.values():
            stream.send(message)
        self._submitted.append((self._step_id, time.perf_counter(), plan))

    def collect(self) -> StepResult:
        """The oldest step's replies, merged. Raises if a worker fails it or does not answer by the deadline
        (a worker that fails leaves its peer blocked in the step-end exchange: the peer is not waited for)."""
        step_id, submitted_at, plan = self._submitted.popleft()
        replies = {self._calls.submit(stream.receive): stream.worker for stream in self._streams.values()}
        done, pending = wait(replies, timeout=self.deadline.seconds(), return_when=FIRST_EXCEPTION)
        for call in done:
            if call.exception() is not None:
                worker = replies[call]
                raise RuntimeError(
                    f"the {worker.role} at {worker.address} failed step {step_id}: {_describe(call.exception())}"
                ) from call.exception()
        if pending:
            late = ", ".join(f"the {replies[c].role} at {replies[c].address}" for c in pending)
            raise TimeoutError(f"{late} did not answer step {step_id} within {self.deadline.seconds():.0f}s")
        result = result_from_replies({w.role: c.result() for c, w in replies.items()}, plan)
        # A step's time is from the end of the one before it (or its own submission, if later) to its end:
        # with the next plan sent ahead, that is what each step costs.
        now = time.perf_counter()
        result.step_seconds = now - max(submitted_at, self._last_collected)
        self._last_collected = now
        self.deadline.observe(result.step_seconds)
        return result

    def _close_streams(self) -> None:
        for stream in self._streams.values():
            stream.close()
        self._streams = {}
        self._submitted.clear()

    def close(self) -> None:
        self._close_streams()
        self._calls.shutdown(wait=False)
        for worker in self.workers:
            worker.close()
        if self.pool is not None:
            self.pool.close()


def start_remote_engine(
    config: EngineConfig, tokenizer: Decoder, verifier: str, drafter: str | None, *, startup_timeout_s: float,
    join_timeout_s: float, settings: SchedulerSettings | None = None, drafter_pool: list[str] | None = None,
) -> LLMEngine:  # fmt: skip
    """An engine over worker services (the scheduler's, and the offline API's with tensor parallelism): wait
    until the workers serve, form a world (a new epoch: they drop whatever an earlier scheduler left), and
    build the engine over it. The engine holds no model. `settings`: its step deadline and steps in flight
    (none: the scheduler's defaults). `drafter_pool`: draft with a member of this pool (none serving yet: the
    group starts target-only and binds when one serves)."""
    drafter = drafter if config.speculative_config is not None else None
    if drafter_pool:
        check_poolable(config)
    executor = RemoteExecutor(verifier, drafter, settings or SchedulerSettings(), drafter_pool=drafter_pool)
    try:
        executor.wait_until_serving(startup_timeout_s)
        infos = executor.form_world(config, with_drafter=executor.choose_drafter() or executor.pool is None,
                                    timeout_s=join_timeout_s)  # fmt: skip
        if config.speculative_config is not None and not executor.has_drafter and executor.pool is None:
            raise ValueError(f"a speculative config needs a drafter: the verifier at {verifier} does not draft "
                             "(--colocate-drafter) and no drafter address was given (--drafter)")
        engine = executor.make_engine(config, tokenizer, infos)
        if config.speculative_config is not None and not executor.has_drafter:  # no pool drafter serves yet
            engine.restart(speculate=False, may_run=lambda request_id: True)
        return engine
    except BaseException:
        executor.close()
        raise


# A worker that answers a step with one of these is alive: the step itself failed (not the worker).
_ANSWERED = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INVALID_ARGUMENT}


def workers_answered(exc: BaseException) -> bool:
    """Whether a failed step was answered with an error by a live worker, rather than cut short by a worker
    that died, hung or is not in the world (those are not the requests' doing)."""
    cause = exc.__cause__
    return isinstance(cause, grpc.RpcError) and cause.code() in _ANSWERED


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)
