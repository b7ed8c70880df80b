"""Every BERT head, with transformers' module names, outputs and loss semantics.

With ALBERT options the same classes serve: the MLM transform maps H -> E before the decoder tied to the E-wide
word embeddings, and `BertForPreTraining`'s second head is sentence-order prediction when trained on SOP pairs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastbert import reference
from fastbert.checkpoint import PreTrainedModel
from fastbert.config import BertConfig
from fastbert.masking import IGNORE_INDEX
from fastbert.modeling import ACT_OF_CONFIG, BertModel
from fastbert.outputs import (
    BaseModelOutputWithPooling,
    MaskedLMOutput,
    ModelOutput,
    MultipleChoiceModelOutput,
    NextSentencePredictorOutput,
    PreTrainingOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
    return_dict_of,
)


class BertPredictionHeadTransform(nn.Module):
    """dense -> act -> LayerNorm; ModernBERT's `head` with its own activation and biases."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        modern = config.family.head_transform
        bias = bool(getattr(config, "classifier_bias", False)) if modern else True
        self.dense = nn.Linear(config.hidden_size, config.embedding_dim, bias=bias)
        act = getattr(config, "classifier_activation", "gelu") if modern else config.family.mlm_act or config.hidden_act
        self.act = ACT_OF_CONFIG[act]  # RoBERTa's, ELECTRA's MLM: always gelu
        norm_bias = bool(getattr(config, "norm_bias", True))
        self.LayerNorm = nn.LayerNorm(config.embedding_dim, eps=config.layer_norm_eps, bias=norm_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = reference.activation(self.dense(x), self.act)
        return reference.layer_norm(x, self.LayerNorm.weight, self.LayerNorm.bias, self.LayerNorm.eps)


class BertLMPredictionHead(nn.Module):
    """transform -> decoder; EuroBERT's (Llama's) `lm_head` is the decoder alone, with a bias only where `mlp_bias`."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        llama = config.family.llama_layers
        self.transform = nn.Identity() if llama else BertPredictionHeadTransform(config)
        self.decoder = nn.Linear(config.embedding_dim, config.vocab_size, bias=True)
        has_bias = bool(getattr(config, "mlp_bias", False)) if llama else True
        self.bias = nn.Parameter(torch.zeros(config.vocab_size)) if has_bias else None
        self.decoder.bias = self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.transform(x)
        if _row_sparse_backward_applies(self.decoder, x):
            return _VocabProjection.apply(x, self.decoder.weight, self.decoder.bias)
        return self.decoder(x)


# Below this many multiply-adds per decoder GEMM the dense backward is as fast (measured on a 2-core Zen 4: even at
# 4 Mi, faster by 2x at 125 Mi with 15% of the rows labelled), and rounding stays that of F.linear.
ROW_SPARSE_MIN_MACS = 2**23


def _row_sparse_backward_applies(decoder: nn.Module, x: torch.Tensor) -> bool:
    """Whether the decoder runs as `_VocabProjection`: a plain, hook-free Linear large enough to gain, in an eager
    autograd step (not a trace, export or compile, which take the nn.Linear as it is)."""
    return (
        torch.is_grad_enabled()
        and x.device.type == "cpu"  # on a GPU its row scan is a host sync per step: kept to CPU until timed there
        and x.numel() * decoder.out_features >= ROW_SPARSE_MIN_MACS
        and type(decoder) is nn.Linear
        and not (decoder._forward_hooks or decoder._forward_pre_hooks or decoder._backward_hooks)
        and (x.requires_grad or decoder.weight.requires_grad)
        and not torch.jit.is_tracing()
        and not torch.compiler.is_compiling()
    )


def _live_rows(grad: torch.Tensor) -> torch.Tensor | None:
    """Indices of the rows of a 2-D gradient with any bit set (NaN and -0.0 count as live); None when all are.

    A bitwise test on an integer view: one read of the gradient, several times faster than a float comparison.
    """
    grad = grad.contiguous()
    wide = (grad.shape[1] * grad.element_size()) % 4 == 0
    live = grad.view(torch.int32 if wide else torch.int16).any(dim=1).nonzero().squeeze(1)  # one host sync
    return None if live.numel() == grad.shape[0] else live


class _VocabProjection(torch.autograd.Function):
    """The MLM decoder, logits = x W^T + b, as F.linear computes it (autocast's casts included), whose backward
    multiplies only the gradient rows that are not all zero.

    An MLM loss reads the ~15% labelled positions, so the rest of the logits' gradient is zero and the two backward
    GEMMs over the vocabulary (the largest of the step) shrink by as much; a caller who also differentiates the
    logits makes every row live and gets the dense GEMMs. Exact either way: a zero row adds nothing.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        x, weight = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        g = grad.reshape(-1, grad.shape[-1]).to(weight.dtype)
        rows_x = x.reshape(-1, x.shape[-1])
        live = _live_rows(g)
        if live is not None:
            g, rows_x = g[live], rows_x[live]
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = g @ weight
            if live is not None:
                grad_x = grad_x.new_zeros(x.numel() // x.shape[-1], x.shape[-1]).index_copy(0, live, grad_x)
            grad_x = grad_x.view(x.shape).to(x_dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (g.t() @ rows_x).to(w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0).to(b_dtype)
        return grad_x, grad_w, grad_b


class BertOnlyMLMHead(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.predictions = BertLMPredictionHead(config)

    def forward(self, sequence_output: torch.Tensor) -> torch.Tensor:
        return self.predictions(sequence_output)


class BertOnlyNSPHead(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.seq_relationship = nn.Linear(config.hidden_size, 2)

    def forward(self, pooled_output: torch.Tensor) -> torch.Tensor:
        return self.seq_relationship(pooled_output)


class BertPreTrainingHeads(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.predictions = BertLMPredictionHead(config)
        self.seq_relationship = nn.Linear(config.hidden_size, 2)

    def forward(self, sequence_output: torch.Tensor, pooled_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.predictions(sequence_output), self.seq_relationship(pooled_output)


def _finish(model: PreTrainedModel, output: ModelOutput, return_dict: bool | None) -> ModelOutput | tuple:
    """The output, or its tuple where `return_dict` (None: the config's `return_dict`, default True) says so."""
    return output if return_dict_of(model.config, return_dict) else output.to_tuple()


def _encode(
    model: PreTrainedModel,
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    token_type_ids: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    kwargs: dict,
) -> BaseModelOutputWithPooling:
    """The head's encoder pass on transformers' inputs (their order in every head's forward, as Trainer's column
    filter reads them); further encoder arguments as given; the head decides the return type itself."""
    return model.bert(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                      **{**kwargs, "return_dict": True})  # fmt: skip


class _WithMLMDecoder(PreTrainedModel):
    """Ties `cls.predictions.decoder.weight` to the word embeddings, as transformers does."""

    def tie_weights(self) -> None:
        config = self.config  # DeBERTa's lm_predictions head reads the word embeddings whatever the config says
        if getattr(config, "tie_word_embeddings", True) or (config.family.modern_mlm_keys and config.legacy is False):
            self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight
        self.cls.predictions.decoder.bias = self.cls.predictions.bias

    def get_output_embeddings(self) -> nn.Linear:
        return self.cls.predictions.decoder


def _mlm_loss(logits: torch.Tensor, labels: torch.Tensor | None, vocab: int) -> torch.Tensor | None:
    """Mean cross-entropy over the labelled positions, as transformers' (ignore_index -100), with the upcast and the
    log-softmax on those rows only: the others would be computed over the whole vocabulary and then ignored.
    Under torch.compile every row goes in (the row count is data: a graph break), and the compiler fuses it; on a GPU
    too (selecting rows would sync the host every step)."""
    if labels is None:
        return None
    labels = labels.reshape(-1)
    if torch.compiler.is_compiling() or logits.device.type != "cpu":  # the row selection is a host sync on a GPU
        return F.cross_entropy(logits.reshape(-1, vocab).float(), labels, ignore_index=IGNORE_INDEX)
    labelled = labels != IGNORE_INDEX
    return F.cross_entropy(logits.reshape(-1, vocab)[labelled].float(), labels[labelled])


class BertForMaskedLM(_WithMLMDecoder):
    head_kind = "mlm"

    def __init__(self, config: BertConfig) -> None:
        super().__init__(config)
        self.bert = BertModel(config, add_pooling_layer=False)
        self.cls = BertOnlyMLMHead(config)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        return_dict=None,
        **kwargs,
    ) -> MaskedLMOutput | tuple:
        """`labels` [B, S]: token ids at masked positions, -100 elsewhere."""
        out = _encode(self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, kwargs)
        logits = self.cls(out.last_hidden_state)
        loss = _mlm_loss(logits, labels, self.config.vocab_size)
        result = MaskedLMOutput(loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions)
        return _finish(self, result, return_dict)


class BertForPreTraining(_WithMLMDecoder):
    """MLM + NSP (BERT) or MLM + SOP (ALBERT): the second head predicts `next_sentence_label` either way."""

    head_kind = "pretraining"

    def __init__(self, config: BertConfig) -> None:
        super().__init__(config)
        self.bert = BertModel(config)
        self.cls = BertPreTrainingHeads(config)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        next_sentence_label=None,
        return_dict=None,
        **kwargs,
    ) -> PreTrainingOutput | tuple:
        out = _encode(self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, kwargs)
        prediction, relationship = self.cls(out.last_hidden_state, out.pooler_output)
        loss = None
        if labels is not None and next_sentence_label is not None:
            loss = _mlm_loss(prediction, labels, self.config.vocab_size) + F.cross_entropy(
                relationship.view(-1, 2).float(), next_sentence_label.view(-1)
            )
        result = PreTrainingOutput(
            loss=loss,
            prediction_logits=prediction,
            seq_relationship_logits=relationship,
            hidden_states=out.hidden_states,
            attentions=out.attentions,
        )
        return _finish(self, result, return_dict)


class BertForNextSentencePrediction(PreTrainedModel):
    head_kind = "nsp"

    def __init__(self, config: BertConfig) -> None:
        super().__init__(config)
        self.bert = BertModel(config)
        self.cls = BertOnlyNSPHead(config)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        return_dict=None,
        **kwargs,
    ):
        """`labels` [B]: 0 = B follows A, 1 = B is random."""
        out = _encode(self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, kwargs)
        logits = self.cls(out.pooler_output)
        loss = None if labels is None else F.cross_entropy(logits.view(-1, 2).float(), labels.view(-1))
        result = NextSentencePredictorOutput(
            loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions
        )
        return _finish(self, result, return_dict)


def _classifier_dropout(config: BertConfig, head: str = "") -> float:
    """The head's dropout: the family's own field (DistilBERT's seq_classif_dropout, qa_dropout) or BERT's rule."""
    own = config.family.dropouts.get(head)
    if own is not None and getattr(config, own, None) is not None:  # DeBERTa's cls_dropout may be unset
        return getattr(config, own)
    if head == "qa" and not config.family.head_transform:  # BERT's QA head has none; ModernBERT's: classifier_dropout
        return 0.0
    return config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob


def _head(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """ModernBERT's head transform on the tokens (its token and span heads), else the tokens."""
    head = model._modules.get("head")
    return hidden if head is None else head(hidden)


def masked_mean(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:  # [B, S, X], [B, S] -> [B, X]
    """The mean over each row's real positions (all of them without a mask); a fully padded row gives zeros
    (transformers': NaN)."""
    if mask is None:
        return values.mean(dim=1)
    mask = mask.to(values.dtype).unsqueeze(-1)
    return (values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)


def pool(config: BertConfig, hidden: torch.Tensor, mask: torch.Tensor | None, first_real: bool) -> torch.Tensor:
    """[B, S, H] -> [B, H] by `classifier_pooling`: the mean over real tokens, or the first token (the first real one
    where `first_real`: ModernBERT's multiple-choice head, which finds it under left padding too). The export graph
    pools with it too."""
    if getattr(config, "classifier_pooling", "cls") == "mean":
        return masked_mean(hidden, mask)
    if first_real and mask is not None:
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), mask.argmax(dim=-1)]
    return hidden[:, 0]


class ClassificationHead(nn.Module):
    """RoBERTa's, ELECTRA's and DistilBERT's sentence head on the first token: dense -> act -> dropout -> out_proj."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.act = config.family.classifier_act
        self.dropout_first = config.family.classifier_dropout_first
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(_classifier_dropout(config, "sequence"))
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, first_token: torch.Tensor) -> torch.Tensor:  # [B, H] -> [B, num_labels]
        x = self.dropout(first_token) if self.dropout_first else first_token
        x = self.dense(x)
        x = torch.tanh(x) if self.act == "tanh" else reference.activation(x, ACT_OF_CONFIG[self.act])
        return self.out_proj(self.dropout(x))


class BertForSequenceClassification(PreTrainedModel):
    """Single-label (CE), regression (num_labels == 1, MSE) or multi-label (BCE), picked as transformers does.

    BERT and ALBERT classify the pooler's output; RoBERTa, ELECTRA and DistilBERT the first token through their
    own `ClassificationHead` (no pooler).
    """

    head_kind = "sequence"

    def __init__(self, config: BertConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        if config.family.llama_layers:  # EuroBERT: pooled (bos or mean) or every token ("late") -> dense -> GELU
            self.bert = BertModel(config, add_pooling_layer=False)
            self.dense = nn.Linear(config.hidden_size, config.hidden_size)
            self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        elif config.family.head_transform:  # ModernBERT: pooled (cls or mean) -> head -> drop -> classifier
            self.bert = BertModel(config, add_pooling_layer=False)
            self.head = BertPredictionHeadTransform(config)
            self.dropout = nn.Dropout(_classifier_dropout(config, "sequence"))
            self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        elif config.family.classifier_act is None:
            self.bert = BertModel(config, context_pooler=True)
            self.dropout = nn.Dropout(_classifier_dropout(config, "sequence"))
            self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        else:
            self.bert = BertModel(config, add_pooling_layer=False)
            self.classifier = ClassificationHead(config)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        return_dict=None,
        **kwargs,
    ):
        out = _encode(self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, kwargs)
        if isinstance(self.classifier, ClassificationHead):
            logits = self.classifier(out.last_hidden_state[:, 0])
        elif self.config.family.llama_layers:
            logits = self._llama_logits(out.last_hidden_state, attention_mask)
        elif self.config.family.head_transform:
            pooled = pool(self.config, out.last_hidden_state, attention_mask, first_real=False)
            logits = self.classifier(self.dropout(self.head(pooled)))
        else:
            logits = self.classifier(self.dropout(out.pooler_output))
        loss = None if labels is None else self._loss(logits, labels)
        result = SequenceClassifierOutput(
            loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions
        )
        return _finish(self, result, return_dict)

    def _llama_logits(self, hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """EuroBERT's head: dense -> GELU -> classifier on the pooled state ("bos": the first token, "mean"), or on
        every token with the logits averaged over the real ones ("late")."""
        pooling = getattr(self.config, "classifier_pooling", "late")
        if pooling != "late":
            hidden = hidden[:, 0] if pooling == "bos" else pool(self.config, hidden, mask, first_real=False)
        logits = self.classifier(F.gelu(self.dense(hidden)))
        return logits if pooling != "late" else masked_mean(logits, mask)

    def output_layer(self) -> nn.Linear:
        """The Linear that writes the logits (BERT's classifier, or the family head's out_proj)."""
        return self.classifier.out_proj if isinstance(self.classifier, ClassificationHead) else self.classifier

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.config.problem_type is None and self.config.family.context_pooler:
            return _deberta_loss(logits, labels, self.num_labels)
        if self.config.problem_type is None:
            if self.num_labels == 1:
                self.config.problem_type = "regression"
            elif labels.dtype in (torch.long, torch.int):
                self.config.problem_type = "single_label_classification"
            else:
                self.config.problem_type = "multi_label_classification"
        kind = self.config.problem_type
        if kind == "regression":
            if self.num_labels == 1:
                return F.mse_loss(logits.squeeze().float(), labels.squeeze().to(torch.float32))
            return F.mse_loss(logits.float(), labels.float())
        if kind == "single_label_classification":
            return F.cross_entropy(logits.view(-1, self.num_labels).float(), labels.view(-1))
        if kind == "multi_label_classification":
            return F.binary_cross_entropy_with_logits(logits.float(), labels.float())
        raise ValueError(f"unknown problem_type {kind!r}")


def _deberta_loss(logits: torch.Tensor, labels: torch.Tensor, num_labels: int) -> torch.Tensor:
    """DeBERTa's own rule where no problem_type is set: regression for one label; class ids with the negative ones
    skipped (0 when all are); else soft labels (a distribution per row)."""
    if num_labels == 1:
        return F.mse_loss(logits.view(-1).to(labels.dtype), labels.view(-1))
    if labels.dim() == 1 or labels.size(-1) == 1:
        labels = labels.view(-1)
        kept = labels >= 0
        if not bool(kept.any()):
            return logits.new_zeros(())
        return F.cross_entropy(logits[kept].float(), labels[kept].long())
    return -(F.log_softmax(logits, dim=-1) * labels).sum(-1).mean()


class BertForTokenClassification(PreTrainedModel):
    head_kind = "token"

    def __init__(self, config: BertConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = BertModel(config, add_pooling_layer=False)
        if config.family.head_transform:  # ModernBERT's head before the dropout
            self.head = BertPredictionHeadTransform(config)
        self.dropout = nn.Dropout(_classifier_dropout(config))
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        return_dict=None,
        **kwargs,
    ):
        """`labels` [B, S]: a class per token, -100 where no loss is wanted."""
        out = _encode(self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, kwargs)
        logits = self.classifier(self.dropout(_head(self, out.last_hidden_state)))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.view(-1, self.num_labels).float(), labels.view(-1))
        result = TokenClassifierOutput(
            loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions
        )
        return _finish(self, result, return_dict)


class BertForQuestionAnswering(PreTrainedModel):
    head_kind = "qa"

    def __init__(self, config: BertConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = BertModel(config, add_pooling_layer=False)
        if config.family.head_transform:  # ModernBERT's head before the dropout
            self.head = BertPredictionHeadTransform(config)
        self.dropout = nn.Dropout(_classifier_dropout(config, "qa"))  # DistilBERT's qa_dropout; 0 elsewhere
        self.qa_outputs = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        start_positions=None,
        end_positions=None,
        return_dict=None,
        **kwargs,
    ):
        """Span positions outside the input are ignored in the loss (clamped to S, the ignore index)."""
        out = _encode(self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, kwargs)
        logits = self.qa_outputs(self.dropout(_head(self, out.last_hidden_state)))
        start_logits, end_logits = (t.squeeze(-1).contiguous() for t in logits.split(1, dim=-1))
        loss = None
        if start_positions is not None and end_positions is not None:
            ignored = start_logits.size(1)
            start = start_positions.view(-1).clamp(0, ignored)
            end = end_positions.view(-1).clamp(0, ignored)
            loss = 0.5 * (
                F.cross_entropy(start_logits.float(), start, ignore_index=ignored)
                + F.cross_entropy(end_logits.float(), end, ignore_index=ignored)
            )
        result = QuestionAnsweringModelOutput(
            loss=loss,
            start_logits=start_logits,
            end_logits=end_logits,
            hidden_states=out.hidden_states,
            attentions=out.attentions,
        )
        return _finish(self, result, return_dict)


class BertForMultipleChoice(PreTrainedModel):
    """Inputs [B, num_choices, S]; one score per choice."""

    head_kind = "choice"

    def __init__(self, config: BertConfig) -> None:
        super().__init__(config)
        self.bert = BertModel(config, context_pooler=True)
        if config.family.head_transform:  # ModernBERT: pooled (first real token or mean) -> head -> drop -> classifier
            self.head = BertPredictionHeadTransform(config)
        self.dropout = nn.Dropout(_classifier_dropout(config, "choice"))
        self.classifier = nn.Linear(config.hidden_size, 1)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        return_dict=None,
        **kwargs,
    ):
        lead = input_ids if input_ids is not None else inputs_embeds
        if lead is None or lead.dim() < 3:
            raise ValueError("BertForMultipleChoice takes inputs of shape [batch, num_choices, seqlen]")
        num_choices = lead.shape[1]

        def flat(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.reshape(-1, *t.shape[2:])

        out = _encode(
            self, *map(flat, (input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)), kwargs
        )
        if self.config.family.head_transform:
            pooled = self.head(pool(self.config, out.last_hidden_state, flat(attention_mask), first_real=True))
        else:
            pooled = out.pooler_output
        logits = self.classifier(self.dropout(pooled)).view(-1, num_choices)
        loss = None if labels is None else F.cross_entropy(logits.float(), labels.view(-1))
        result = MultipleChoiceModelOutput(
            loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions
        )
        return _finish(self, result, return_dict)


HEADS = {
    cls.__name__: cls
    for cls in (
        BertModel,
        BertForMaskedLM,
        BertForPreTraining,
        BertForNextSentencePrediction,
        BertForSequenceClassification,
        BertForTokenClassification,
        BertForQuestionAnswering,
        BertForMultipleChoice,
    )
}
