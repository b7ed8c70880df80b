"""What the sentence-encoder recipes share: the corpus (STS-B train sentences and WikiText-2), STS-B dev scoring,
the encode workload (sentences in length-sorted batches of 32, as sentence-transformers' encode runs them) and the
sentence-transformers files that make a student folder load as a SentenceTransformer."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import statistics
import time

import torch

from fastbert.checkpoint import PreTrainedModel
from fastbert.distill.losses import mean_pool
from fastbert.tokenization import WordPieceTokenizer
from fastbert.train.optim import WarmupLinear


def _detokenise(text: str) -> str:
    text = text.replace("<unk>", "").replace(" @-@ ", "-").replace(" @,@ ", ",").replace(" @.@ ", ".")
    text = re.sub(r" ([,.;:!?)'%])", r"\1", text)
    return re.sub(r"\s+", " ", text.replace("( ", "(")).strip()


def wikitext_sentences(path: str, min_words: int = 4) -> list[str]:
    """Sentences of a WikiText file: headings dropped, paragraphs split at ' . ', light detokenisation."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("="):
                continue
            for part in line.split(" . "):
                sentence = _detokenise(part.rstrip(" .") + " .")
                if len(sentence.split()) >= min_words:
                    out.append(sentence)
    return out


def read_sts(path: str) -> tuple[list[str], list[str], list[float]]:
    """STS Benchmark rows: genre, file, year, id, score, sentence1, sentence2 (tab-separated)."""
    a, b, scores = [], [], []
    with open(path, encoding="utf-8") as f:
        for row in csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE):
            if len(row) >= 7:
                a.append(row[5])
                b.append(row[6])
                scores.append(float(row[4]))
    return a, b, scores


def build_corpus(data: str) -> list[str]:
    """Unique sentences: STS-B train (both sides) then WikiText-2 valid + test, in a fixed shuffled order."""
    a, b, _ = read_sts(os.path.join(data, "stsb", "sts-train.csv"))
    wiki = [s for name in ("valid.txt", "test.txt") for s in wikitext_sentences(os.path.join(data, "wikitext-2", name))]
    unique = list(dict.fromkeys(a + b + wiki))
    order = torch.randperm(len(unique), generator=torch.Generator().manual_seed(0)).tolist()
    return [unique[i] for i in order]


@torch.no_grad()
def embed(model: PreTrainedModel, tokenizer: WordPieceTokenizer, texts: list[str], batch: int = 64) -> torch.Tensor:
    """Mean-pooled embeddings [N, H], in input order."""
    out = []
    for i in range(0, len(texts), batch):
        enc = tokenizer(texts[i : i + batch], max_length=128)
        inputs = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
        if model.config.family.token_types:
            inputs["token_type_ids"] = enc["token_type_ids"]
        out.append(mean_pool(model(**inputs).last_hidden_state, enc["attention_mask"]))
    return torch.cat(out)


def sts_spearman(model: PreTrainedModel, tokenizer: WordPieceTokenizer, path: str) -> float:
    """Spearman correlation (x100) between cosine similarities and gold scores."""
    from scipy.stats import spearmanr

    a, b, gold = read_sts(path)
    cos = torch.cosine_similarity(embed(model, tokenizer, a), embed(model, tokenizer, b)).numpy()
    return 100.0 * float(spearmanr(cos, gold).statistic)


@torch.no_grad()
def encode(model: PreTrainedModel, tokenizer: WordPieceTokenizer, sentences: list[str], batch: int = 32):
    """sentence-transformers' encode: longest first, batches of `batch`, mean pooling; [N, H] in input order."""
    order = sorted(range(len(sentences)), key=lambda i: -len(sentences[i]))
    out = torch.empty(len(sentences), model.config.hidden_size)
    for start in range(0, len(order), batch):
        idx = order[start : start + batch]
        out[idx] = embed(model, tokenizer, [sentences[i] for i in idx], batch).float()
    return out


def encode_speed(systems: dict[str, tuple], sentences: list[str], passes: int = 3) -> dict[str, dict]:
    """Sentences/s of each (model, tokenizer) on the encode workload, tokenisation included; passes interleaved
    system by system after a warm-up, the median kept (a neighbour's burst hits one pass, not one system)."""
    times: dict[str, list[float]] = {name: [] for name in systems}
    for model, tok in systems.values():
        encode(model, tok, sentences[:256])
    for _ in range(passes):
        for name, (model, tok) in systems.items():
            start = time.perf_counter()
            encode(model, tok, sentences)
            times[name].append(time.perf_counter() - start)
    return {name: {"sentences_per_s": len(sentences) / statistics.median(t), "seconds": t} for name, t in times.items()}


PIPELINE_FILES = ("modules.json", "sentence_bert_config.json", "tokenizer_config.json", "special_tokens_map.json")


def copy_pipeline(source: str, student_dir: str, width: int) -> None:
    """Make `student_dir` a sentence-transformers folder like `source` (modules.json, pooling and normalisation, its
    tokenizer's settings), the pooling's width set to the student's, so `SentenceTransformer(student_dir)` loads it."""
    for name in PIPELINE_FILES:
        if os.path.isfile(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(student_dir, name))
    modules_file = os.path.join(source, "modules.json")
    if not os.path.isfile(modules_file):
        raise FileNotFoundError(f"{source} is not a sentence-transformers folder (no modules.json)")
    with open(modules_file, encoding="utf-8") as f:
        modules = json.load(f)
    for module in modules:
        if not module["path"]:
            continue
        os.makedirs(os.path.join(student_dir, module["path"]), exist_ok=True)
        config = os.path.join(source, module["path"], "config.json")
        if os.path.isfile(config):
            with open(config, encoding="utf-8") as f:
                values = json.load(f)
            if "word_embedding_dimension" in values:
                values["word_embedding_dimension"] = width
            with open(os.path.join(student_dir, module["path"], "config.json"), "w", encoding="utf-8") as f:
                json.dump(values, f, indent=2)


def fit_gold(
    student_dir: str, train_csv: str, epochs: float = 1.0, lr: float = 1e-5, batch: int = 32, max_length: int = 128,
    max_steps: int | None = None, seed: int = 0,
) -> list[dict]:
    """Fine-tune a sentence encoder in place on STS-B train's gold scores: the MSE between each pair's cosine and
    score / 5 (sentence-transformers' CosineSimilarityLoss), word embeddings frozen, 10 % linear warm-up then linear
    decay, fp32. The folder is replaced only when the stage ends (a killed run repeats the stage from the model it
    had). Returns the loss per step."""
    from tqdm import tqdm

    from fastbert import BertModel

    a, b, scores = read_sts(train_csv)
    gold = torch.tensor(scores) / 5.0
    steps = max(1, int(epochs * len(a) // batch)) if max_steps is None else max_steps
    tokenizer, model = WordPieceTokenizer.from_pretrained(student_dir), BertModel.from_pretrained(student_dir)
    model.embeddings.word_embeddings.weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupLinear(steps, warmup))
    gen, history, step = torch.Generator().manual_seed(seed), [], 0
    model.train()
    with tqdm(total=steps, desc="gold", unit="step", mininterval=5) as bar:
        while step < steps:
            order = torch.randperm(len(a), generator=gen).tolist()
            for start in range(0, len(order) - batch + 1, batch):
                if step >= steps:
                    break
                idx = order[start : start + batch]
                enc = tokenizer([a[i] for i in idx] + [b[i] for i in idx], max_length=max_length)
                out = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                            token_type_ids=enc["token_type_ids"]).last_hidden_state  # fmt: skip
                emb = mean_pool(out, enc["attention_mask"])
                loss = torch.nn.functional.mse_loss(torch.cosine_similarity(emb[:batch], emb[batch:]), gold[idx])
                loss.backward()
                optimizer.step()
                schedule.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                value = loss.detach().item()
                history.append({"step": step, "loss": value})
                bar.update(1)
                bar.set_postfix(loss=f"{value:.4f}")
    model.eval()
    staging = student_dir.rstrip(os.sep) + ".gold"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(student_dir, staging)  # tokenizer and sentence-transformers files as they were
    model.save_pretrained(staging)
    previous = student_dir.rstrip(os.sep) + ".distilled"
    shutil.rmtree(previous, ignore_errors=True)
    os.replace(student_dir, previous)
    os.replace(staging, student_dir)
    return history
