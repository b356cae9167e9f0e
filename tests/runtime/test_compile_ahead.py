"""Engine._compile_ahead: a call's dry pass hands every kernel its prefill, first draw and decode
steps launch to compilation (kernels.compile_ahead) before anything runs, and changes no id. On
the CPU the interpreter compiles nothing, so there the pass is switched on with nothing to
compile, and the test checks what it covers and that it runs nothing."""
import sys

import pytest

from kernels import _tuning
from minillm import LLM, SamplingParams
from tests.conftest import ON_GPU
from tests.models import build_checkpoint

# on a GPU a vocabulary's width: the heads that fit their programs to their compiled registers
# (vocab_fma, vocab_screen) are in the pass
SIZE = dict(n_layer=2, n_head=2, n_embd=64, vocab_size=50257, n_positions=128) if ON_GPU else \
    dict(n_layer=1, n_head=2, n_embd=32, vocab_size=256, n_positions=64)
DTYPE = "float16" if ON_GPU else "float32"
PARAMS = [SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True),
          SamplingParams(max_new_tokens=5, temperature=0.8, top_k=20, repetition_penalty=1.3, seed=2,
                         ignore_eos=True)]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    p = tmp_path_factory.mktemp("ahead")
    build_checkpoint(p, seed=6, **SIZE)
    return str(p)


def _record(monkeypatch):
    """Every launch from here on as (kernel name, its plain keyword arguments: constexprs and
    options), in `dry` inside a dry pass and in `real` after the first dry pass (launches before
    it, such as the load-time check of the sampler's noise, come before any compiling ahead)."""
    dry, real = [], []
    launch = _tuning.launch

    def recording(kernel, grid, *args, **kwargs):
        name = getattr(kernel, "__name__", None) or kernel.fn.__name__  # (an autotuner: its kernel)
        sig = (name, tuple(sorted((k, v) for k, v in kwargs.items() if isinstance(v, (bool, int, float, str)))))
        if _tuning.compiling_ahead():
            dry.append(sig)
        elif dry:
            real.append(sig)
        return launch(kernel, grid, *args, **kwargs)

    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("kernels") and getattr(mod, "launch", None) is launch:
            monkeypatch.setattr(mod, "launch", recording)
    return dry, real


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "sampled-penalty"])
def test_dry_pass_covers_every_launch_and_changes_no_id(path, monkeypatch, params):
    if not ON_GPU:
        monkeypatch.setattr(_tuning, "INTERPRET", False)  # the pass on: its warmups compile nothing here
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7]]
    monkeypatch.setattr(_tuning, "COMPILE_AHEAD", False)
    expect = [r.token_ids for r in LLM(path, dtype=DTYPE, backend="triton").generate(prompts, params)]

    monkeypatch.setattr(_tuning, "COMPILE_AHEAD", True)
    dry, real = _record(monkeypatch)
    llm = LLM(path, dtype=DTYPE, backend="triton")
    assert [r.token_ids for r in llm.generate(prompts, params)] == expect
    assert dry, "no dry pass"
    assert set(real) <= set(dry), f"launched, not compiled ahead: {sorted(set(real) - set(dry))}"
    assert any(name == "_append_tokens_kernel" for name, _ in dry)

    n = len(dry)
    assert [r.token_ids for r in llm.generate(prompts, params)] == expect
    assert len(dry) == n, "a second call of the same shapes compiled ahead again"
    longer = [list(range(1, 40)), [7, 7]]  # a new prefill length for the same decode state: only it
    llm.generate(longer, params)
    names = {name for name, _ in dry[n:]}
    assert names and "_append_tokens_kernel" not in names and set(real) <= set(dry), names
