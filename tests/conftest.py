"""Shared fixtures: the real SmolLM2 target (loaded once) and tiny HF checkpoints."""

from __future__ import annotations

import pytest
import torch

from specdec.attention.metadata import plan_step
from specdec.kvcache import KVCacheManager, KVPool

# Two cores shared with other work: one intra-op thread avoids OpenMP barrier stalls
# that make a step 100x slower when the other core is busy.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct, fp32 on the CPU (converted once, then cached)."""
    from specdec.target import load_target

    return load_target("smollm2-135m")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random 2-layer Llama (vocab 64, EOS 63, 96 positions) written as a real checkpoint (no
    tokenizer: token-id prompts)."""
    import transformers

    from specdec.target import load_target

    path = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96,
                                   eos_token_id=63)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return load_target(path)


class PagedRunner:
    """Feeds chunks of tokens through a target over its own paged cache, like the engine does."""

    def __init__(self, target, num_pages: int = 64, tokens_per_block: int = 4):
        self.target, self.tpb = target, tokens_per_block
        self.pool = KVPool(target.layer_specs(), num_pages, tokens_per_block, device=target.device)
        self.manager = KVCacheManager(num_pages, tokens_per_block)

    def step(self, chunks: dict[str, list[int]], context: set[str] = frozenset()) -> dict[str, torch.Tensor]:
        """Append ``chunks[req]`` to each request; return logits ``[len(chunk), vocab]`` per request."""
        ids, pos, slots, ctx, gen, order = [], [], [], [], [], []
        for phase_ctx in (True, False):
            for req, toks in chunks.items():
                if (req in context) != phase_ctx:
                    continue
                if req not in self.manager:
                    self.manager.allocate(req, 0)
                start = self.manager.length(req)
                self.manager.append(req, len(toks))
                ids += toks
                pos += range(start, start + len(toks))
                slots += self.manager.slots(req, start, start + len(toks))
                (ctx if phase_ctx else gen).append((len(toks), start + len(toks), tuple(self.manager.page_table(req))))
                order.append((req, len(toks)))
        shape_of = lambda phase, q, mixed: self.target.attn_shape(phase, q, self.tpb, mixed)  # noqa: E731
        attn = plan_step(ctx, gen, torch.tensor(slots), shape_of, self.tpb)
        with torch.inference_mode():
            hidden, _ = self.target.forward(torch.tensor(ids), torch.tensor(pos), attn, self.pool)
            logits = self.target.compute_logits(hidden)
        out, row = {}, 0
        for req, n in order:
            out[req] = logits[row:row + n]
            row += n
        return out


@pytest.fixture
def paged_runner():
    return PagedRunner


@pytest.fixture(scope="module")
def fixed_triton_interpreter():
    """Triton's CPU interpreter with its known bugs fixed for one test module; yields the bugs seen before.

    See ``specdec.attention.backends.triton_interp``; restored when the module's tests are done.
    """
    pytest.importorskip("triton")
    from specdec.attention.backends.triton_interp import fixed_interpreter

    with fixed_interpreter() as bugs_before:
        yield bugs_before
