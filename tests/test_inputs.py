"""Bad input gives a clear error before any kernel runs; edge cases (empty batch, fully padded row) stay finite."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

import fastbert
from fastbert import BertConfig, BertModel

TINY = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


@pytest.fixture(scope="module")
def model() -> BertModel:
    return BertModel(BertConfig(**TINY, max_position_embeddings=16, type_vocab_size=2)).eval()


IDS = torch.randint(0, 50, (2, 6))


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (
            {"input_ids": IDS.clone().index_fill_(1, torch.tensor([2]), 50)},
            ValueError,
            r"input_ids contains 50, outside \[0, 50\) \(vocab_size=50\)",
        ),
        ({"input_ids": IDS.clone().index_fill_(1, torch.tensor([0]), -1)}, ValueError, r"input_ids contains -1"),
        (
            {"input_ids": torch.randint(0, 50, (1, 17))},
            ValueError,
            r"sequence length 17 is longer than max_position_embeddings=16",
        ),
        (
            {"input_ids": IDS, "token_type_ids": torch.full((2, 6), 2)},
            ValueError,
            r"token_type_ids contains 2, outside \[0, 2\)",
        ),
        (
            {"input_ids": IDS, "attention_mask": torch.ones(2, 5)},
            ValueError,
            r"attention_mask has shape \(2, 5\) but input_ids has shape \(2, 6\)",
        ),
        (
            {"input_ids": IDS, "token_type_ids": torch.zeros(2, 7, dtype=torch.long)},
            ValueError,
            r"token_type_ids has shape \(2, 7\)",
        ),
        ({"input_ids": torch.zeros(2, 0, dtype=torch.long)}, ValueError, "empty sequence length"),
        ({"input_ids": IDS.float()}, TypeError, r"input_ids must be an integer tensor.*torch.float32"),
        (
            {"input_ids": IDS, "token_type_ids": torch.zeros(2, 6)},
            TypeError,
            r"token_type_ids must be an integer tensor",
        ),
        (
            {"input_ids": IDS, "attention_mask": torch.full((2, 6), 2)},
            ValueError,
            "attention_mask must contain only 0 and 1",
        ),
        ({"input_ids": IDS, "position_ids": torch.full((2, 6), 16)}, ValueError, r"position_ids contains 16"),
        ({"input_ids": IDS[0]}, ValueError, r"input_ids must be 2-D"),
        ({}, ValueError, "exactly one of input_ids or inputs_embeds"),
        ({"input_ids": IDS, "inputs_embeds": torch.zeros(2, 6, 32)}, ValueError, "exactly one of"),
        ({"inputs_embeds": torch.zeros(2, 6, 31)}, ValueError, r"inputs_embeds must be \[batch, seqlen, 32\]"),
        ({"input_ids": IDS.to(torch.int8)}, TypeError, r"input_ids must be an integer tensor .*torch.int8"),
        ({"input_ids": IDS.to(torch.int16)}, TypeError, r"input_ids must be an integer tensor .*torch.int16"),
        ({"input_ids": IDS.to(torch.uint8)}, TypeError, r"input_ids must be an integer tensor .*torch.uint8"),
        (
            {"input_ids": IDS, "position_ids": torch.zeros(1, 5, dtype=torch.long)},
            ValueError,
            r"position_ids has shape",
        ),
        (
            {"input_ids": IDS, "position_ids": torch.zeros(3, 6, dtype=torch.long)},
            ValueError,
            r"position_ids has shape",
        ),
        ({"input_ids": IDS, "position_ids": torch.tensor(0)}, ValueError, r"position_ids has shape \(\)"),
        ({"input_ids": IDS, "position_ids": list(range(6))}, TypeError, r"position_ids must be a torch.Tensor"),
        ({"input_ids": IDS, "position_ids": torch.arange(6.0)}, TypeError, r"position_ids must be an integer"),
        ({"inputs_embeds": torch.zeros(2, 6, 32, dtype=torch.float64)}, TypeError, r"inputs_embeds has dtype .*64"),
        ({"inputs_embeds": torch.zeros(2, 6, 32).tolist()}, TypeError, r"inputs_embeds must be a torch.Tensor"),
    ],
    ids=[
        "id-too-large",
        "id-negative",
        "too-long",
        "token-type-range",
        "mask-shape",
        "token-type-shape",
        "empty-seq",
        "float-ids",
        "float-token-types",
        "mask-values",
        "position-range",
        "1-d-ids",
        "no-input",
        "both-inputs",
        "embeds-width",
        "int8-ids",
        "int16-ids",
        "uint8-ids",
        "position-short",
        "position-batch",
        "position-0-dim",
        "position-list",
        "position-float",
        "embeds-dtype",
        "embeds-list",
    ],
)
def test_bad_input_is_a_clear_error(model: BertModel, kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        model(**kwargs)


def test_accepted_position_id_shapes_agree(model: BertModel) -> None:
    with torch.no_grad():
        outs = [model(IDS, position_ids=p).last_hidden_state for p in (torch.arange(6), torch.arange(6)[None])]
        outs.append(model(IDS, position_ids=torch.arange(6).expand(2, 6).to(torch.int32)).last_hidden_state)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_pad_tokens_without_attention_mask_warn_as_in_transformers(model: BertModel) -> None:
    padded = torch.tensor([[5, 6, 7, 0, 0, 0], [5, 6, 7, 8, 9, 10]])  # pad_token_id 0 at the end of row 0
    with pytest.warns(UserWarning, match=r"pad_token_id \(0\) .* no attention_mask"):
        model(padded)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(padded, attention_mask=(padded != 0).long())  # a mask says what is padding: no warning
        model(padded[:, :3])  # no pad id at either end: no warning


def test_empty_batch_returns_empty_outputs(model: BertModel) -> None:
    out = model(torch.zeros(0, 6, dtype=torch.long), output_hidden_states=True)
    assert out.last_hidden_state.shape == (0, 6, 32) and out.pooler_output.shape == (0, 32)
    assert len(out.hidden_states) == 3


def test_fully_padded_row_is_finite_and_zero(model: BertModel) -> None:
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[1] = 0
    mask[2, 3:] = 0
    with torch.no_grad():
        out = model(torch.randint(0, 50, (3, 6)), attention_mask=mask, output_hidden_states=True)
    assert torch.isfinite(out.last_hidden_state).all() and torch.isfinite(out.pooler_output).all()
    assert (out.last_hidden_state[1] == 0).all() and (out.last_hidden_state[2, 3:] == 0).all()
    assert all(torch.isfinite(h).all() for h in out.hidden_states)


def test_every_row_fully_padded_is_finite(model: BertModel) -> None:
    with torch.no_grad():
        out = model(torch.randint(0, 50, (2, 4)), attention_mask=torch.zeros(2, 4))
    assert (out.last_hidden_state == 0).all() and torch.isfinite(out.pooler_output).all()


def test_padded_and_packed_outputs_agree(model: BertModel) -> None:
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    with torch.no_grad():
        padded = model(IDS[:, :4], attention_mask=mask).last_hidden_state
        packed = model(IDS[:, :4], attention_mask=mask, packed_output=True).last_hidden_state
    assert packed.shape == (7, 32)
    assert torch.equal(packed, padded[mask.bool()])


def test_config_errors_are_clear() -> None:
    with pytest.raises(ValueError, match=r"hidden_size \(30\) must be divisible by num_attention_heads \(4\)"):
        BertConfig(**{**TINY, "hidden_size": 30})
    with pytest.raises(ValueError, match="hidden_act must be one of"):
        BertConfig(**TINY, hidden_act="swish")


def test_forced_backend_that_cannot_run_raises() -> None:
    model = BertModel(BertConfig(**TINY)).train()  # native kernels are forward-only (or absent): both refuse
    with fastbert.use_backend("native"), pytest.raises(fastbert.BackendUnavailable, match="forced backend 'native'"):
        model(IDS)
    with fastbert.use_backend("torch"):
        model(IDS)
    assert "torch (forced)" in fastbert.explain()
    with pytest.raises(ValueError, match="unknown backend"), fastbert.use_backend("cuda-magic"):
        pass


def test_config_backend_forces_one_for_that_model() -> None:
    model = BertModel(BertConfig(**TINY, backend="native")).train()  # native is forward-only: it must refuse
    with pytest.raises(fastbert.BackendUnavailable, match="forced backend 'native'"):
        model(IDS)
    with fastbert.use_backend("torch"):  # the caller's choice wins over the config's
        model(IDS)


def test_excluded_backends_are_skipped_with_that_reason() -> None:
    model = BertModel(BertConfig(**TINY)).eval()
    with torch.no_grad(), fastbert.ops.exclude_backends("native", "onednn"):
        model(IDS)
    decisions = fastbert.ops.decisions()
    assert decisions["attention"].startswith("torch") and "native: excluded" in decisions["attention"]
    with pytest.raises(ValueError, match="unknown backend"), fastbert.ops.exclude_backends("nope"):
        pass


def test_import_needs_no_triton_no_gpu_no_native() -> None:
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['fastbert.native_ext'] = None\n"
        "import torch, fastbert\n"
        "m = fastbert.BertModel(fastbert.BertConfig(vocab_size=20, hidden_size=16, num_hidden_layers=1,"
        " num_attention_heads=2, intermediate_size=32)).eval()\n"
        "m(torch.randint(0, 20, (1, 4)))\n"
        "print(fastbert.explain())\n"
    )
    env = {"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "torch" in result.stdout
