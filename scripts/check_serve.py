"""Check a running raylora app (`make serve`) with the official OpenAI client.

For the base model and each demo adapter: a completion and a streamed chat completion, both
greedy, compared with the engine's offline output for the same adapter and prompt.

    python scripts/check_serve.py [--base-url http://127.0.0.1:8000/v1]
"""

import argparse
import sys

from openai import OpenAI

from engine import LLM, LoRARequest, SamplingParams
from engine.lora.demo import DEMO_ADAPTERS, demo_adapter_dir

PROMPT = "The capital of France is"
QUESTION = "Name a fruit that is yellow."


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key="none")
    models = [m.id for m in client.models.list()]
    print("models:", models)
    base = models[0]
    llm = LLM(model="default", max_loras=2)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    failures = 0
    for i, name in enumerate([None, *DEMO_ADAPTERS]):
        model = name or base
        lora = LoRARequest(name, i, str(demo_adapter_dir(name))) if name else None
        comp = (
            client.completions.create(
                model=model, prompt=PROMPT, temperature=0, max_tokens=args.max_tokens
            )
            .choices[0]
            .text
        )
        offline = llm.generate(PROMPT, params, lora)[0].outputs[0].text
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": QUESTION}],
            temperature=0,
            max_tokens=args.max_tokens,
            stream=True,
        )
        chat = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        offline_chat = (
            llm.chat([{"role": "user", "content": QUESTION}], params, lora)[0].outputs[0].text
        )
        ok = comp == offline and chat == offline_chat
        failures += not ok
        print(
            f"[{model}] {'OK ' if ok else 'DIFF'} completion={comp!r}\n"
            f"{'':>{len(model) + 7}}chat={chat!r}"
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
