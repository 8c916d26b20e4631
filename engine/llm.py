"""LLM: offline batch generation (vLLM's LLM class)."""

from collections.abc import Sequence as Seq

from tqdm import tqdm

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.lora.request import LoRARequest
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str = "default", **config) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **config))
        self._counter = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | dict | Seq[str | dict],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Outputs in the order of the prompts. A request the engine failed comes back
        finished, with RequestOutput.error set and finish_reason "error"."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        n = len(prompts)
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, Seq) else [params] * n
        loras = list(lora_request) if isinstance(lora_request, Seq) else [lora_request] * n
        if len(params) != n or len(loras) != n:
            raise ValueError("sampling_params and lora_request lists must match the prompts")
        ids = []
        try:
            for prompt, p, lora in zip(prompts, params, loras, strict=True):
                rid = f"llm-{self._counter}"
                self._counter += 1
                self.engine.add_request(rid, prompt, p, lora)
                ids.append(rid)
        except Exception:  # one invalid prompt: run none of them (they would run unread)
            self.engine.abort_request(ids)
            raise
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=n, desc="generate", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[i] for i in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        batch = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [self.engine.input_processor.apply_chat_template(m) for m in batch]
        return self.generate(prompts, sampling_params, lora_request)
