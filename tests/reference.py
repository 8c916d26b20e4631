"""Independent references: HF transformers (and PEFT) greedy decoding, with the near-tie rule."""

import torch

TIE_GAP = 1e-3


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """Greedy continuation with HF's own generate (batch of one, no padding)."""
    out = model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=sorted(eos_ids),
        pad_token_id=sorted(eos_ids)[0],
        top_p=None,
        top_k=None,
        temperature=None,
    )
    return out[0, len(prompt_ids) :].tolist()


@torch.inference_mode()
def hf_greedy_no_eos(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding with HF's model and its own KV cache, never stopping early (the
    reference for requests with ignore_eos=True)."""
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    past, ids = out.past_key_values, []
    for _ in range(max_new_tokens):
        ids.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([[ids[-1]]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
    return ids


@torch.inference_mode()
def assert_greedy_match(model, prompt_ids: list[int], ours: list[int], ref: list[int]) -> bool:
    """ours == ref, except that they may part at a step where the reference's top-2 logit gap
    is below TIE_GAP (checked here). Returns True if they matched exactly."""
    n = min(len(ours), len(ref))
    for i in range(n):
        if ours[i] != ref[i]:
            logits = model(torch.tensor([prompt_ids + ref[:i]])).logits[0, -1].float()
            top2 = logits.topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < TIE_GAP, (
                f"diverged at new token {i}: ours {ours[i]} vs reference {ref[i]}, "
                f"reference top-2 gap {gap:.2e} is not a near-tie\nours={ours}\nref ={ref}"
            )
            return False
    assert len(ours) == len(ref), f"lengths differ: ours {len(ours)} vs reference {len(ref)}"
    return True
