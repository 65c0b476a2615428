"""Helpers shared by test modules: importable under plain ``pytest`` (``from helpers import ...``),
since pytest puts the ``tests/`` folder on ``sys.path`` for its rootdir-less test modules."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

#: torch.compile's CPU backend (inductor) builds C++: tests of a compiled propose need a compiler
needs_cxx = pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++") or os.environ.get("CXX")),
                               reason="torch.compile on the CPU needs a C++ compiler (g++ or $CXX)")


def tiny_llama(path, device, **kw):
    """A random Llama (vocab 64, EOS 63, 96 positions, 2 layers unless ``kw`` says otherwise) saved as a
    real HF checkpoint under ``path`` and loaded back as a specdec target on ``device``."""
    import transformers

    from specdec.target import load_target

    torch.manual_seed(0)
    cfg = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=96, eos_token_id=63)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**cfg, **kw})).save_pretrained(path)
    return load_target(path, device=device)


def run_interpreted(test_file: str, deselect: str, timeout: int = 600) -> None:
    """Re-run ``test_file`` with ``TRITON_INTERPRET=1`` (its kernels built for Triton's CPU interpreter)
    and assert that it passed with every selected test run, none skipped.

    Args:
        deselect: the ``-k`` expression that leaves out the interpreter suite itself (and any
            test the interpreter cannot run).
    """
    import os
    import re
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", test_file, "-m", "not gpu", "-k", deselect,
           "-p", "no:cacheprovider", "-x", "-rs"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    # Every selected test ran there: passed, none skipped (a warning is fine).
    assert re.search(r"\b\d+ passed, \d+ deselected(, \d+ warnings?)? in\b", done.stdout), done.stdout[-3000:]
