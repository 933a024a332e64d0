"""The offline API: `LLM(...).generate(prompts, SamplingParams(...))`, as vLLM users know it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from minedraft.config import EngineConfig, SpeculativeConfig
from minedraft.engine.engine import LLMEngine
from minedraft.engine.outputs import RequestOutput
from minedraft.engine.request import Request
from minedraft.sampling.params import SamplingParams

if TYPE_CHECKING:
    from minedraft.frontends.chat import ChatTemplate

PromptInput = str | list[int]


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's shape of a request's adapter: its name among the engine's lora_modules (id and path are
    accepted for compatibility; the adapter's folder is the one lora_modules names)."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str | None = None


class LLM:
    """Load a target (and optionally a draft) model in this process and generate with them.

    `model=None` loads the bundled target; `speculative_config=None` decodes autoregressively; a
    speculative config without `model` drafts with the bundled draft.
    """

    def __init__(
        self,
        model: str | None = None,
        speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None,
        **engine_args: Any,
    ) -> None:
        """`engine_args`: any other `EngineConfig` field (tensor_parallel_size, max_num_seqs, max_model_len,
        dtype, device, seed, batch_invariant, draft_support_size, ...), with its defaults; an unknown name is
        an error."""
        self.config = EngineConfig(model=model, speculative_config=speculative_config, **engine_args)
        self._workers = None
        self._template = None  # the chat template, loaded by the first chat()
        if self.config.tensor_parallel_size > 1:
            self.engine = self._tensor_parallel_engine()
        else:
            self.engine = LLMEngine.local(self.config)
        self.tokenizer = self.engine.tokenizer

    def _tensor_parallel_engine(self) -> LLMEngine:
        """Tensor parallelism needs one process per rank: start the verifier ranks (and the drafter) as
        local worker processes, exactly as the services run, and drive them from this process."""
        from minedraft.model.tokenizer import load_tokenizer
        from minedraft.scheduler.remote_executor import start_remote_engine
        from minedraft.stack.local import LocalStack

        self._workers = LocalStack(self.config, workers_only=True)
        self._workers.start()
        try:
            return start_remote_engine(
                self.config, load_tokenizer(self.config.tokenizer_path), self._workers.verifier_address,
                self._workers.drafter_address, startup_timeout_s=600, join_timeout_s=120,
            )  # fmt: skip
        except BaseException:
            self._workers.stop()
            raise

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | str | Sequence[LoRARequest | str | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, or a list of token ids); outputs come back in prompt order.
        lora_request: the LoRA adapter (of lora_modules, by name) every prompt runs through, or one per prompt
        (None: the base model), as vLLM takes them.

        Every prompt is validated before any is run, so one bad prompt fails the call cleanly.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = self._params_per_prompt(sampling_params, len(prompts))
        loras = self._loras_per_prompt(lora_request, len(prompts))
        requests = [self._make_request(i, p, sp, lora)
                    for i, (p, sp, lora) in enumerate(zip(prompts, params, loras, strict=True))]
        for request in requests:
            self.engine.enqueue(request)
        with tqdm(total=len(requests), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished() or self.engine.in_flight:  # planned ahead over worker processes
                finished = sum(r.finished for r in self.engine.advance() or [])
                bar.update(finished)
        return [RequestOutput.from_request(r) for r in requests]

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or several, rendered
        with the target's chat template as the HTTP chat endpoint renders them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        template = self._chat_template()
        kwargs = chat_template_kwargs or {}
        prompts = [
            self.tokenizer.encode(template.render(list(c), add_generation_prompt, **kwargs), add_special_tokens=False)
            for c in conversations
        ]  # the template holds its special tokens already
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _chat_template(self) -> ChatTemplate:
        from minedraft.frontends.chat import ChatTemplate

        if self._template is None:
            self._template = ChatTemplate.from_checkpoint(self.config.tokenizer_path)
            if self._template is None:
                raise ValueError(f"{self.config.target_path} has no chat template: use generate()")
        return self._template

    def close(self) -> None:
        self.engine.executor.close()
        if self._workers is not None:
            self._workers.stop()
            self._workers = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _make_request(self, index: int, prompt: PromptInput, params: SamplingParams,
                      lora: str | None = None) -> Request:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        try:
            return self.engine.make_request(ids, params, prompt=prompt if isinstance(prompt, str) else None,
                                            lora=lora)
        except ValueError as exc:
            raise ValueError(f"prompt {index}: {exc}") from None

    @staticmethod
    def _loras_per_prompt(
        lora_request: LoRARequest | str | Sequence[LoRARequest | str | None] | None, n: int
    ) -> list[str | None]:
        def name(one: LoRARequest | str | None) -> str | None:
            return one.lora_name if isinstance(one, LoRARequest) else one

        if lora_request is None or isinstance(lora_request, (str, LoRARequest)):
            return [name(lora_request)] * n
        if len(lora_request) != n:
            raise ValueError(f"got {len(lora_request)} lora requests for {n} prompts")
        return [name(one) for one in lora_request]

    @staticmethod
    def _params_per_prompt(
        sampling_params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if len(sampling_params) != n:
            raise ValueError(f"got {len(sampling_params)} sampling params for {n} prompts")
        return list(sampling_params)
