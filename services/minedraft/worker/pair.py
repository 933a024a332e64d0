"""A verifier that runs the draft model too, in one process (`WorkerSettings.colocate_drafter`).

On one machine's CPU the drafter and the verifier share the cores anyway; as two services, every step also
crosses between them (the drafts to the verifier, the results back, each process waking the other) and that
costs more than the small model's work at low load. Here both models live in this process and a step runs as
the offline engine runs it (`LocalExecutor`: one part alone on the caller's thread, both parts overlapped on a
thread each), while the scheduler drives it over the same Worker API as a lone verifier: it learns from
`WorkerInfo.drafts` that this worker drafts too.
"""

from __future__ import annotations

import logging

from minedraft.api import worker_pb2
from minedraft.config import EngineConfig, num_slots
from minedraft.engine.local_executor import LocalExecutor, build_local_executor
from minedraft.wire import lora_adapter_from_proto, plan_from_proto, step_reply
from minedraft.worker.node import check_epoch, worker_info

log = logging.getLogger("minedraft.verifier")


class PairNode:
    def __init__(self, config: EngineConfig) -> None:
        if config.speculative_config is None or config.tensor_parallel_size != 1:
            raise ValueError("colocate_drafter needs a speculative config and tensor_parallel_size 1")
        self.config = config
        self.executor: LocalExecutor
        self.executor, self.runner = build_local_executor(config, num_slots=num_slots(config))
        self.epoch: int | None = None

    def join(self, request: worker_pb2.JoinRequest) -> None:
        """Drop every request; this worker's world is itself."""
        self._reset()
        adapters = [lora_adapter_from_proto(m) for m in request.lora_adapters]
        for worker in self._workers():
            for name, error in worker.set_loras(adapters).items():
                log.error("the colocated %s cannot serve LoRA adapter %r: %s", type(worker).__name__, name, error)
        self.epoch = request.epoch

    def step(self, plan: worker_pb2.StepPlan) -> worker_pb2.StepReply:
        """The plan's parts as the in-process engine runs them (the scheduler orders a part that only prefills
        after the verification, as that engine does: WorkerInfo.stages_share_cores)."""
        check_epoch(self.epoch, plan)
        return step_reply(plan.step_id, self.executor.run(plan_from_proto(plan)), "verifier")

    def info(self) -> worker_pb2.WorkerInfo:
        info = worker_info("verifier", str(self.config.target_path), self.executor.verifier, 0, self.config,
                           self.epoch)  # fmt: skip
        info.draft_num_blocks = self.executor.draft_kv_blocks or 0
        info.drafts = self.executor.drafter is not None
        info.stages_share_cores = self.executor.shares_cores
        return info

    def stop_followers(self) -> None:
        """No other ranks (tensor_parallel_size 1)."""

    def close(self) -> None:
        self._reset()
        self.executor.close()

    def _workers(self) -> list:
        return [w for w in (self.executor.verifier, self.executor.drafter) if w is not None]

    def _reset(self) -> None:
        for worker in self._workers():
            worker.reset()
