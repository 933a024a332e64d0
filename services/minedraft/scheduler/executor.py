"""The engine's Executor over gRPC: each step's plan goes to the drafter and verifier rank 0 at once."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from minedraft.api import worker_pb2, worker_pb2_grpc
from minedraft.engine.plans import DraftPlan, SequenceSpec, StepResult, VerifyPlan
from minedraft.scheduler.step_deadline import StepDeadline
from minedraft.serving import grpc_options
from minedraft.wire import plan_to_proto, result_from_replies

# The step deadline before any step was observed: room for warm-up and a first long prefill.
DEFAULT_STEP_DEADLINE_FLOOR_S = 60.0


class WorkerClient:
    def __init__(self, address: str, role: str) -> None:
        self.address = address
        self.role = role
        self.channel = grpc.insecure_channel(address, options=grpc_options())
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def serving(self) -> bool:
        try:
            reply = self._health.Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def close(self) -> None:
        self.channel.close()


class RemoteExecutor:
    """Admissions and releases are batched into the next step's plan, so a step costs one round trip per
    worker; `flush` sends them when the engine has nothing else to run (freeing KV slots promptly)."""

    def __init__(self, verifier: str, drafter: str | None, step_deadline: StepDeadline | None = None) -> None:
        self.verifier = WorkerClient(verifier, "verifier")
        self.drafter = WorkerClient(drafter, "drafter") if drafter else None
        self.deadline = step_deadline or StepDeadline(floor_s=DEFAULT_STEP_DEADLINE_FLOOR_S)
        self._admit: list[SequenceSpec] = []
        self._release: list[str] = []
        self._step_id = 0
        self.scheduler_id = uuid.uuid4().hex  # this incarnation: workers drop older incarnations' requests
        self._calls = ThreadPoolExecutor(max_workers=2, thread_name_prefix="worker-call")

    @property
    def workers(self) -> list[WorkerClient]:
        return [w for w in (self.verifier, self.drafter) if w is not None]

    def wait_until_serving(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for worker in self.workers:
            while not worker.serving():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{worker.role} at {worker.address} is not SERVING after {timeout_s:.0f}s")
                time.sleep(0.2)

    def verifier_info(self) -> worker_pb2.WorkerInfo:
        return self.verifier.stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), timeout=10)

    def admit(self, seqs: list[SequenceSpec]) -> None:
        self._admit.extend(seqs)

    def release(self, request_ids: list[str]) -> None:
        self._release.extend(request_ids)

    def announce(self) -> None:
        """An empty step: tells the workers this scheduler's id, so that they drop any older one's requests."""
        self.step(None, None)

    def flush(self) -> None:
        if self._admit or self._release:
            self.step(None, None)

    def step(self, draft: DraftPlan | None, verify: VerifyPlan | None) -> StepResult:
        start = time.perf_counter()
        self._step_id += 1
        plan = plan_to_proto(self._step_id, self._admit, self._release, draft, verify)
        plan.scheduler_id = self.scheduler_id
        self._admit, self._release = [], []
        timeout = self.deadline.seconds()
        calls = {self._calls.submit(w.stub.Step, plan, timeout=timeout): w for w in self.workers}
        # A worker that fails leaves its peer blocked in the step-end exchange: do not wait for the peer.
        done, _ = wait(calls, return_when=FIRST_EXCEPTION)
        for call in done:
            if (exc := call.exception()) is not None:
                raise RuntimeError(_failure(calls[call], self._step_id, exc, timeout)) from exc
        result = result_from_replies([c.result() for c in calls])
        result.step_seconds = time.perf_counter() - start
        self.deadline.observe(result.step_seconds)
        return result

    def close(self) -> None:
        self._calls.shutdown(wait=False)
        for worker in self.workers:
            worker.close()


def _failure(worker: WorkerClient, step_id: int, exc: BaseException, timeout: float) -> str:
    if isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return (
            f"the {worker.role} at {worker.address} did not finish step {step_id} within the step deadline "
            f"({timeout:.1f}s): it is hung or cut off"
        )
    return f"the {worker.role} at {worker.address} failed step {step_id}: {_describe(exc)}"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)
