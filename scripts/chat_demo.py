"""Terminal demo: stream a chat answer from the engine, optionally through a demo adapter.

python scripts/chat_demo.py "What is the capital of France?"
python scripts/chat_demo.py --lora caps "What is the capital of France?"
"""

import argparse
import asyncio
import sys

from engine import AsyncLLMEngine, EngineConfig, LoRARequest, SamplingParams
from engine.lora.demo import DEMO_ADAPTERS, demo_adapter_dir


async def main(args: argparse.Namespace) -> None:
    engine = AsyncLLMEngine(EngineConfig(model=args.model, max_loras=2, max_num_seqs=8))
    lora = None
    if args.lora:
        lora = LoRARequest(args.lora, 1, str(demo_adapter_dir(args.lora)))
    prompt = engine.apply_chat_template([{"role": "user", "content": args.question}])
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    print(f"[{args.lora or 'base model'}] ", end="", flush=True)
    shown = 0
    async for out in engine.generate(prompt, params, lora_request=lora):
        text = out.outputs[0].text
        sys.stdout.write(text[shown:])
        sys.stdout.flush()
        shown = len(text)
    print()
    await engine.shutdown()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("question")
    p.add_argument("--lora", choices=sorted(DEMO_ADAPTERS), default=None)
    p.add_argument("--model", default="default")
    p.add_argument("--max-tokens", type=int, default=64)
    asyncio.run(main(p.parse_args()))
