from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoRARequest:
    """Names an adapter for a request (vLLM's LoRARequest).

    lora_path: a local PEFT folder (adapter_config.json + adapter_model.safetensors)
    or a Hugging Face Hub repo id. Two LoRARequests are equal when their names are.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("LoRARequest.lora_name must be a non-empty string")
        if self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be >= 1, got {self.lora_int_id}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and other.lora_name == self.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
