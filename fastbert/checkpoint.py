"""Checkpoints: transformers' directory layout and key names, safetensors only unless the caller opts in.

`from_pretrained(dir)` reads config.json + model.safetensors (or a sharded index); `save_pretrained(dir)` writes a
directory transformers' own `from_pretrained` loads. The file format is judged by its first bytes, not its name: a
pickle (zip or raw) is refused unless `allow_pickle=True`, and even then loaded with `weights_only=True`.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
from collections.abc import Collection, Mapping
from typing import Any, TypeVar

import torch
from torch import nn

from fastbert import adapters
from fastbert.config import BertConfig
from fastbert.families import family_of, to_fastbert_keys, to_hf_keys
from fastbert.model_methods import ModelMethods

log = logging.getLogger("fastbert.checkpoint")

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
PICKLE_NAMES = ("pytorch_model.bin", "model.pt", "model.bin")
# Buffers older transformers versions saved; they carry no information.
IGNORED_KEYS = ("embeddings.position_ids", "embeddings.token_type_ids")
# TF-era LayerNorm names still found in old checkpoints.
LEGACY_RENAMES = ((".gamma", ".weight"), (".beta", ".bias"))

M = TypeVar("M", bound="PreTrainedModel")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked (missing, mismatched or unexpected keys, a refused format)."""


def sniff_format(path: str | os.PathLike) -> str:
    """'safetensors', 'pickle' or 'unknown', from the file's header bytes."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) == 9:  # before the pickle test: a header length whose low byte is 0x80 starts with a pickle's byte
        n = int.from_bytes(head[:8], "little")
        if 0 < n <= size - 8 and head[8:9] == b"{":
            return "safetensors"
    if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":  # torch.save zip archive / raw pickle protocol 2+
        return "pickle"
    return "unknown"


def load_state_dict_file(path: str | os.PathLike, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """Read one weights file; safetensors always, pickle only with `allow_pickle=True`."""
    kind = sniff_format(path)
    if kind == "safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except SafetensorError as exc:  # truncated or corrupted: say which file, not only what safetensors saw
            raise CheckpointError(f"{path} is a damaged safetensors file (truncated or corrupted?): {exc}") from None
    if kind == "pickle":
        if not allow_pickle:
            raise CheckpointError(
                f"{path} is a pickle checkpoint; pickles can run code on load, so fastbert refuses them by default. "
                "Convert it to safetensors, or pass allow_pickle=True if you trust its source."
            )
        with open(path, "rb") as f:  # a file object: torch.load would otherwise judge by the name too
            state = torch.load(f, map_location="cpu", weights_only=True)
        return dict(state.get("state_dict", state)) if isinstance(state, Mapping) else state
    raise CheckpointError(f"{path} is neither a safetensors nor a torch checkpoint (unrecognised header)")


def load_checkpoint_dir(directory: str | os.PathLike, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of a transformers-style directory (single file, sharded index, or opted-in pickle)."""
    directory = os.fspath(directory)
    single, index = os.path.join(directory, WEIGHTS_NAME), os.path.join(directory, WEIGHTS_INDEX_NAME)
    if os.path.isfile(single):
        return load_state_dict_file(single, allow_pickle)
    if os.path.isfile(index):
        shards = _shards_of(index)
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_state_dict_file(os.path.join(directory, shard), allow_pickle))
        return state
    for name in PICKLE_NAMES:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return load_state_dict_file(path, allow_pickle)
    raise FileNotFoundError(f"no {WEIGHTS_NAME} (or {WEIGHTS_INDEX_NAME}) in {directory}")


def _shards_of(index: str) -> list[str]:
    """The shard files a safetensors index names; an index without a weight_map is a CheckpointError naming it."""
    with open(index, encoding="utf-8") as f:
        try:
            values = json.load(f)
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            raise CheckpointError(f"{index}: not a JSON index file ({exc})") from None
    weight_map = values.get("weight_map") if isinstance(values, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(
            f"{index}: no weight_map (an object of tensor name -> shard file) in this index; write the index again "
            f"or remove it and keep a single {WEIGHTS_NAME}"
        )
    return sorted(set(weight_map.values()))


MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header


def safetensors_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in a safetensors file, from its JSON header alone (no tensor data is read)."""
    with open(path, "rb") as f:
        head = f.read(8)
        size = os.fstat(f.fileno()).st_size
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        if not 0 < n <= min(size - 8, MAX_HEADER_BYTES):
            raise CheckpointError(
                f"{path} is a damaged safetensors file (truncated or corrupted?): header of {n} bytes"
            )
        try:
            header = json.loads(f.read(n))
            return {k: tuple(int(d) for d in v["shape"]) for k, v in header.items() if k != "__metadata__"}
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
            raise CheckpointError(f"{path} is a damaged safetensors file (truncated or corrupted?): {exc}") from None


def checkpoint_shapes(directory: str | os.PathLike) -> tuple[str, dict[str, tuple[int, ...]]] | None:
    """(the weights file's name, every tensor's shape) of a safetensors checkpoint directory, single or sharded,
    read from the headers only; None for any other layout (a pickle: its shapes are known only once loaded)."""
    directory = os.fspath(directory)
    single, index = os.path.join(directory, WEIGHTS_NAME), os.path.join(directory, WEIGHTS_INDEX_NAME)
    if os.path.isfile(single):
        files, name = [single], WEIGHTS_NAME
    elif os.path.isfile(index):
        files, name = [os.path.join(directory, shard) for shard in _shards_of(index)], WEIGHTS_INDEX_NAME
    else:
        return None
    if any(not os.path.isfile(file) or sniff_format(file) != "safetensors" for file in files):
        return None  # loading says what is wrong with it
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        shapes.update(safetensors_shapes(file))
    return name, shapes


_LAYER_KEY = re.compile(r"^encoder\.layer\.(\d+)\.")
# (config field, fastbert key (LAYER: the first layer the checkpoint has), shape dimension it sets)
_SIZED_KEYS = (
    ("vocab_size", "embeddings.word_embeddings.weight", 0),
    ("max_position_embeddings", "embeddings.position_embeddings.weight", 0),
    ("type_vocab_size", "embeddings.token_type_embeddings.weight", 0),
    ("hidden_size", "LAYER.attention.self.query.weight", 0),
    ("intermediate_size", "LAYER.intermediate.dense.weight", 0),
)


def check_sizes(
    directory: str | os.PathLike, config: BertConfig, head_kind: str = "model", given: Collection[str] = ()
) -> None:
    """Check `config`'s sizes against the checkpoint's tensors (safetensors headers: nothing is loaded) and this
    machine's memory, before a model is built from it: an untrusted config.json (`"num_hidden_layers": 100000` beside
    6 layers of weights) fails in one line naming the file and the field, instead of allocating gigabytes first.

    `given`: fields the caller set over config.json's (named as such). Raises CheckpointError (or ValueError for a
    model too large for the machine); a checkpoint whose shapes are unknown before loading is checked for memory only.
    """
    source = os.path.join(os.fspath(directory), "config.json")

    def where(field: str) -> str:
        return f"{source} (with {field} given)" if field in given else source

    found = checkpoint_shapes(directory)
    hf_names = dict((fb, hf) for hf, fb in config.family.config_names)
    if found is not None:
        weights, shapes = found
        state = to_fastbert_keys(_normalise_keys(shapes), config, head_kind)
        prefix = PreTrainedModel.base_model_prefix + "."
        originals = to_fastbert_keys(_normalise_keys({k: k for k in shapes}), config, head_kind)  # -> the file's name
        base = {k.removeprefix(prefix): k for k in state}
        layers = sorted({int(m.group(1)) for k in base if (m := _LAYER_KEY.match(k))})
        field = "num_hidden_groups" if config.layer_sharing == "all" else "num_hidden_layers"
        if layers and len(layers) < getattr(config, field):  # fewer asked for: the loader names the extra keys
            hf_layers = next((hf for hf, fb in config.family.keys if fb == "encoder.layer"), "encoder.layer")
            numbers = f"{layers[0]}..{layers[-1]}" if layers[-1] - layers[0] == len(layers) - 1 else str(layers)
            span = f"{hf_layers}.{numbers}" if "*" not in hf_layers else f"groups {numbers}"
            raise CheckpointError(
                f"{where(field)}: {hf_names.get(field, field)}={getattr(config, field)} but {weights} has "
                f"{len(layers)} layers ({span})"
            )
        for field, key, dim in _SIZED_KEYS:
            key = key.replace("LAYER", f"encoder.layer.{layers[0]}") if layers else key
            if key not in base:
                continue
            shape, want = state[base[key]], getattr(config, field)
            if len(shape) > dim and shape[dim] != want:
                raise CheckpointError(
                    f"{where(field)}: {hf_names.get(field, field)}={want} but {weights} has {shape[dim]} "
                    f"({originals[base[key]]} {list(shape)})"
                )
    config.check_fits(where)


def _normalise_keys(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        for old, new in LEGACY_RENAMES:
            if key.endswith(old) and "LayerNorm" in key:
                key = key[: -len(old)] + new
        out[key] = value
    return out


# from_pretrained's keywords that are not the model's or its config's: the Hub's (refused: a local directory is
# read) and loader hints with nothing to do in fastbert (ignored)
HUB_KEYWORDS = ("token", "use_auth_token", "cache_dir", "revision", "force_download", "resume_download", "proxies")
IGNORED_KEYWORDS = ("local_files_only", "trust_remote_code", "low_cpu_mem_usage", "use_safetensors",
                    "attn_implementation", "_fast_init")  # fmt: skip


def _as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | str | None:
    """A torch.dtype, "auto", or None; a name ("bfloat16", "torch.float16") is read as its dtype."""
    if dtype is None or dtype == "auto" or isinstance(dtype, torch.dtype):
        return dtype
    found = _floating_dtype(dtype)
    if found is None:
        raise TypeError(f"dtype must be a floating torch.dtype, its name, 'auto' or None, got {dtype!r}")
    return found


def _recorded_dtype(config: BertConfig) -> torch.dtype | None:
    """The dtype config.json records (transformers writes `dtype`, formerly `torch_dtype`), if a floating one."""
    return _floating_dtype(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None))


def _floating_dtype(name: object) -> torch.dtype | None:
    """The floating torch.dtype a name ("bfloat16", "torch.float16") names, else None."""
    found = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
    return found if isinstance(found, torch.dtype) and found.is_floating_point else None


def _device_of(device_map: object) -> torch.device | str | None:
    """transformers' device_map for one device: a device (or its name or index); "auto": the GPU when there is one."""
    if device_map is None or isinstance(device_map, (str, int, torch.device)):
        if device_map == "auto":
            return "cuda" if torch.cuda.is_available() else None
        return device_map
    raise ValueError(f"device_map={device_map!r:.80}: fastbert places a model on one device; pass a device")


class PreTrainedModel(ModelMethods, nn.Module):
    """Loading, saving and initialisation shared by BertModel and every head (transformers' other model methods:
    fastbert.model_methods)."""

    base_model_prefix = "bert"  # fastbert's attribute for the encoder in every family; keys are renamed on load/save
    model_type = "bert"  # the family this class is named for; BertModel and the Bert heads build any family's config
    head_kind = "model"  # which of the family's head key renames apply (fastbert.families)
    # Parameters tied to another one; a checkpoint may omit them (transformers does) or carry an equal copy.
    tied_keys: tuple[str, ...] = ()

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        if not isinstance(config, BertConfig):
            raise TypeError(
                f"{type(self).__name__} takes a fastbert.BertConfig, got {type(config).__module__}."
                f"{type(config).__name__}: convert transformers' with fastbert.BertConfig.from_hf(config), or a live "
                f"transformers model with {type(self).__name__}.from_hf(model)"
            )
        if type(self).model_type != "bert":
            _check_family(type(self), config)
        self.config = config

    # ------------------------------------------------------------ initialisation
    def post_init(self) -> None:
        self.apply(self._init_weights)
        self.tie_weights()

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, std)
            if module.padding_idx is not None:
                with torch.no_grad():
                    module.weight[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            if module.bias is not None:  # ModernBERT's norms have none
                nn.init.zeros_(module.bias)
        elif hasattr(module, "init_family_weights"):  # after its children: a family's own tables (DistilBERT's)
            module.init_family_weights()

    def tie_weights(self) -> None:
        """Heads with an MLM decoder tie it to the word embeddings here."""

    # ---------------------------------------------------------------- placement
    @property
    def device(self) -> torch.device:
        """The device of the first parameter, as transformers defines it (`inputs.to(model.device)`)."""
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the first floating-point parameter (else the first parameter's), as in transformers."""
        first = next(self.parameters())
        return next((p.dtype for p in self.parameters() if p.is_floating_point()), first.dtype)

    # ------------------------------------------------------------------ counting
    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Unique parameters (shared ALBERT layers and tied decoders count once)."""
        return sum(
            p.numel() for name, p in self.named_parameters() if not (exclude_embeddings and "embeddings." in name)
        )

    # --------------------------------------------------------------- state dicts
    def unique_state_dict(self) -> dict[str, torch.Tensor]:
        """State dict with each shared tensor once, under its first name (how transformers saves tied weights)."""
        seen: set[tuple[int, int]] = set()
        out = {}
        for key, value in self.state_dict().items():
            ident = (value.untyped_storage().data_ptr(), value.storage_offset())
            if ident in seen:
                continue
            seen.add(ident)
            out[key] = value
        return out

    def _adapt_prefix(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Move between a bare BertModel's keys and a head's `bert.`-prefixed ones, as transformers does."""
        prefix = self.base_model_prefix + "."
        own = self.state_dict().keys()
        has_prefix = any(k.startswith(prefix) for k in own)
        ckpt_prefixed = any(k.startswith(prefix) for k in state)
        if has_prefix and not ckpt_prefixed:
            return {prefix + k: v for k, v in state.items()}
        if not has_prefix and ckpt_prefixed:
            return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        return state

    def load_checkpoint_state(self, state: Mapping[str, torch.Tensor], strict_heads: bool = False) -> None:
        """Load a transformers-keyed state dict; missing, unexpected or mis-shaped keys raise with names and shapes.

        A checkpoint without any head weights (a bare encoder) leaves the head freshly initialised, as transformers
        does for fine-tuning; `strict_heads=True` makes that an error too.
        """
        state = self._adapt_prefix(to_fastbert_keys(_normalise_keys(state), self.config, self.head_kind))
        state = {k: v for k, v in state.items() if not k.endswith(IGNORED_KEYS)}
        own = self.state_dict()
        dropped = self.config.family.ignored_keys  # DeBERTa-v3's unused position table, an RTD head's extras
        state = {k: v for k, v in state.items() if k in own or not any(part in k for part in dropped)}
        unique = self.unique_state_dict()
        aliases = set(own) - set(unique)  # other names of shared/tied tensors
        prefix = self.base_model_prefix + "."
        head_keys = {k for k in unique if not _is_base_key(k.removeprefix(prefix))}
        pooler = {k for k in unique if k.removeprefix(prefix).startswith("pooler.")}
        if not pooler & set(state):  # an MLM/QA checkpoint has no pooler: it starts fresh, as in transformers
            head_keys |= pooler
        unexpected = sorted(k for k in state if k not in own)
        # a pooler the model lacks (token classification, QA, MLM heads) is dropped, as transformers does
        base_foreign = [
            k
            for k in unexpected
            if _is_base_key(k.removeprefix(prefix)) and not k.removeprefix(prefix).startswith("pooler.")
        ]
        if base_foreign:
            raise CheckpointError(f"unexpected keys in the checkpoint: {base_foreign[:20]}")
        if unexpected:
            log.info("ignoring checkpoint keys this model has no place for: %s", unexpected[:20])
        mismatched = [
            f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
            for k in state
            if k in own and state[k].shape != own[k].shape
        ]
        if mismatched:
            raise CheckpointError("shape mismatch between checkpoint and model:\n  " + "\n  ".join(mismatched))
        missing = sorted(k for k in unique if k not in state and not _alias_present(k, state, aliases, self))
        fresh_heads = [k for k in missing if k in head_keys]
        if fresh_heads and (strict_heads or any(k in state for k in head_keys)):
            raise CheckpointError(f"missing keys in the checkpoint: {fresh_heads}")
        missing = [k for k in missing if k not in head_keys]
        if missing:
            shapes = [f"{k} {tuple(unique[k].shape)}" for k in missing[:20]]
            raise CheckpointError(f"missing keys in the checkpoint ({len(missing)}): {shapes}")
        if fresh_heads:
            log.warning("newly initialised (not in the checkpoint): %s", fresh_heads)
        with torch.no_grad():
            for key, value in own.items():
                if key in state and key not in aliases:
                    value.copy_(state[key])
                elif key in unique and key not in state:
                    source = _alias_present(key, state, aliases, self)
                    if source:
                        value.copy_(state[source])
        self.tie_weights()

    # ------------------------------------------------------------ public API
    @classmethod
    def from_pretrained(
        cls: type[M],
        directory: str | os.PathLike,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        allow_pickle: bool = False,
        strict_heads: bool = False,
        lora_task: str | None = None,
        torch_dtype: torch.dtype | str | None = None,
        **overrides: Any,
    ) -> M:
        """Load a transformers- or fastbert-saved directory; `dtype`/`device` cast after loading (`dtype="auto"`: the
        dtype config.json records, else the weights'; a name such as "bfloat16" works too; `torch_dtype`: transformers
        4's name, which `dtype` overrides). `lora_task`: in a checkpoint with task LoRA adapters (jina-embeddings-v3's
        original files), the task whose update is merged into the weights (fastbert.adapters); None runs the base
        weights. Further keywords go where transformers sends them: the model's own arguments (`add_pooling_layer`) to
        its constructor, config fields over config.json's as a config built with them would take them (`num_labels=5`
        alone gives five labels LABEL_0..LABEL_4); `subfolder` and `device_map` (one device) are read, loader hints
        with nothing to do here ignored, the Hub's keywords refused (a local directory is read), any other refused."""
        hub = sorted(k for k in overrides if k in HUB_KEYWORDS)
        if hub:
            raise ValueError(f"{', '.join(hub)}: fastbert reads a local directory; fetch the checkpoint first "
                             "(huggingface_hub.snapshot_download(repo_id) returns its path)")  # fmt: skip
        for hint in IGNORED_KEYWORDS:
            overrides.pop(hint, None)
        directory = os.path.join(directory, overrides.pop("subfolder", ""))
        device = _device_of(overrides.pop("device_map", None)) if device is None else device
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"checkpoint directory {directory} does not exist")
        config = BertConfig.from_pretrained(directory)
        dtype = _as_dtype(dtype if dtype is not None else torch_dtype)
        _check_family(cls, config)
        own = set(inspect.signature(cls.__init__).parameters) - {"self", "config"}
        model_args = {k: v for k, v in overrides.items() if k in own}
        config_overrides = {k: v for k, v in overrides.items() if k not in own}
        unknown = sorted(set(config_overrides) - config.field_names())
        if unknown:
            raise TypeError(f"{cls.__name__}.from_pretrained got keyword(s) {unknown}: neither the model's arguments "
                            f"({', '.join(sorted(own))}) nor fields of its config")  # fmt: skip
        recorded = _recorded_dtype(config)
        if config_overrides:
            config = config.updated(**config_overrides)
        fastbert_name = dict(config.family.config_names)  # DistilBERT's n_layers given: num_hidden_layers
        check_sizes(directory, config, cls.head_kind, {fastbert_name.get(k, k) for k in config_overrides})
        model = cls(config, **model_args)
        state = load_checkpoint_dir(directory, allow_pickle)
        if dtype == "auto":
            dtype = recorded or next((t.dtype for t in state.values() if t.is_floating_point()), None)
        if adapters.present(state) or lora_task is not None:
            with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
                state = adapters.merged(state, lora_task, json.load(f))
        model.load_checkpoint_state(state, strict_heads=strict_heads)
        model.eval()
        return model.to(device=device, dtype=dtype) if dtype is not None or device is not None else model

    def save_pretrained(self, directory: str | os.PathLike, safe_serialization: bool = True) -> None:
        """Write config.json + model.safetensors that transformers (and fastbert) load.

        `safe_serialization` is transformers' keyword (sentence-transformers' `save` passes it); fastbert writes
        safetensors only, so False is refused rather than silently ignored.
        """
        from safetensors.torch import save_file

        if not safe_serialization:
            raise ValueError(
                "fastbert saves safetensors only (pickles can run code on load): pass safe_serialization=True"
            )
        os.makedirs(directory, exist_ok=True)
        config = self.config.to_dict()
        config["architectures"] = [type(self).__name__]
        dtype = next(self.parameters()).dtype
        config["dtype"] = str(dtype).removeprefix("torch.")
        text = json.dumps(config, indent=2, sort_keys=True)  # a field JSON cannot write fails before a file is touched
        state = to_hf_keys(self.unique_state_dict(), self.config, self.head_kind)
        tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
        weights, config_path = os.path.join(directory, WEIGHTS_NAME), os.path.join(directory, "config.json")
        try:  # both written beside, then each moved over its old file: a save that fails leaves the last one
            save_file(tensors, weights + ".tmp", metadata={"format": "pt"})
            with open(config_path + ".tmp", "w", encoding="utf-8") as f:
                f.write(text)
        except BaseException:
            for path in (weights + ".tmp", config_path + ".tmp"):
                if os.path.exists(path):
                    os.remove(path)
            raise
        os.replace(weights + ".tmp", weights)
        os.replace(config_path + ".tmp", config_path)

    @classmethod
    def from_hf(cls: type[M], hf_model: nn.Module) -> M:
        """Convert a live transformers model (a supported family, any head) into this fastbert class, weights copied."""
        config = BertConfig.from_hf(hf_model.config)
        _check_family(cls, config)
        param = next(hf_model.parameters())
        model = built_like(cls, config, hf_model)
        model.load_checkpoint_state(hf_model.state_dict())
        return model.to(device=param.device, dtype=param.dtype).train(hf_model.training)


def built_like(cls: type[M], config: BertConfig, source: nn.Module) -> M:
    """`cls(config)`, without a pooler where `cls` is a bare model class and `source` a bare model built without one
    (transformers' add_pooling_layer=False): nothing to copy into it, and no pooler_output, as the source's."""
    if getattr(source, "pooler", True) is None and "add_pooling_layer" in inspect.signature(cls).parameters:
        return cls(config, add_pooling_layer=False)
    return cls(config)


def _check_family(cls: type, config: BertConfig) -> None:
    """A class named for one family takes only that family's configs (BertModel only BERT's, when loading)."""
    if config.model_type != cls.model_type:
        name = config.family.name + cls.__name__.removeprefix(family_of(cls.model_type).name)
        raise CheckpointError(
            f"{cls.__name__} takes a {cls.model_type!r} model, but the config describes a {config.model_type!r} one: "
            f"use fastbert.{name} or fastbert.AutoModel"
        )


def _is_base_key(key: str) -> bool:
    return key.startswith(("embeddings.", "encoder.", "pooler."))


def _alias_present(key: str, state: Mapping[str, torch.Tensor], aliases: set[str], model: nn.Module) -> str | None:
    """If `key` shares storage with a name the checkpoint does carry, return that name."""
    own = model.state_dict()
    target = own[key]
    for alias in aliases | set(own):
        if alias != key and alias in state and own[alias].data_ptr() == target.data_ptr():
            return alias
    return None

