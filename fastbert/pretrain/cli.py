"""`fastbert pretrain`: MLM + NSP/SOP pretraining of a BERT or ALBERT-style model on text files."""

from __future__ import annotations

import argparse

from fastbert.errors import ranged
from fastbert.pretrain.data import MIN_LENGTH
from fastbert.tokenization import SPECIAL_TOKENS
from fastbert.train import add_loop_arguments, loop_options, print_summary

# flag -> BertConfig field for the model shape (used when neither --init-from nor --config gives it)
MODEL_FLAGS = {
    "layers": ("num_hidden_layers", ranged(int, 1)),
    "hidden": ("hidden_size", ranged(int, 1)),
    "heads": ("num_attention_heads", ranged(int, 1)),
    "intermediate": ("intermediate_size", ranged(int, 1)),
    "embedding_size": ("embedding_size", ranged(int, 1)),
    "layer_sharing": ("layer_sharing", str),
    "hidden_groups": ("num_hidden_groups", ranged(int, 1)),
    "max_position": ("max_position_embeddings", ranged(int, 1)),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--train", nargs="+", required=True, help="text files (WikiText, or blank-line documents)")
    parser.add_argument("--heldout", help="held-out text file (default: --heldout-fraction of the documents)")
    parser.add_argument("--heldout-fraction", type=ranged(float, 0, 1, high_open=True), default=0.05)
    parser.add_argument("--max-heldout-pairs", type=ranged(int, 0), default=1000)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--tokenizer", help="tokenizer.json / vocab.txt or its directory (default: learn one)")
    vocab = ranged(int, len(SPECIAL_TOKENS) + 1)
    parser.add_argument("--vocab-size", type=vocab, default=8000, help="size of a newly learnt WordPiece vocabulary")
    parser.add_argument("--objective", choices=["nsp", "sop"], default="nsp", help="BERT's NSP or ALBERT's SOP")
    parser.add_argument("--whole-word", action="store_true", help="mask whole words, not single pieces")
    parser.add_argument("--mlm-probability", type=ranged(float, 0, 1, low_open=True, high_open=True), default=0.15)
    parser.add_argument("--max-length", type=ranged(int, MIN_LENGTH), default=128, help="tokens per sentence pair")
    parser.add_argument("--batch-size", type=ranged(int, 1), default=32)
    parser.add_argument("--seed", type=ranged(int, 0), default=0)
    parser.add_argument("--init-from", help="checkpoint directory to continue pretraining from")
    parser.add_argument("--config", help="config.json giving the model shape")
    shape = parser.add_argument_group("model shape (BertConfig fields; ALBERT: --embedding-size, --layer-sharing)")
    for flag, (field, kind) in MODEL_FLAGS.items():
        shape.add_argument("--" + flag.replace("_", "-"), type=kind, help=field)
    shape.add_argument(
        "--dropout",
        type=ranged(float, 0, 1, high_open=True),
        help="hidden_dropout_prob and attention_probs_dropout_prob",
    )
    add_loop_arguments(parser, lr=5e-4, epochs=10.0)


def run(args: argparse.Namespace) -> int:
    from fastbert.pretrain import pretrain

    model_options = {field: getattr(args, flag) for flag, (field, _) in MODEL_FLAGS.items()}
    if args.dropout is not None:
        model_options.update(hidden_dropout_prob=args.dropout, attention_probs_dropout_prob=args.dropout)
    result = pretrain(
        args.train,
        args.output_dir,
        heldout=args.heldout,
        heldout_fraction=args.heldout_fraction,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        objective=args.objective,
        whole_word=args.whole_word,
        mlm_probability=args.mlm_probability,
        max_length=args.max_length,
        batch_size=args.batch_size,
        max_heldout_pairs=args.max_heldout_pairs,
        init_from=args.init_from,
        config=args.config,
        model_options={k: v for k, v in model_options.items() if v is not None},
        seed=args.seed,
        device=args.device,
        loop=loop_options(args),
    )
    print_summary(result)
    return 0
