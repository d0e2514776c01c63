"""Shared pieces of reading and writing drafter checkpoints in other tools' layouts (EAGLE, SpecForge / SGLang,
vLLM speculators, the SpecBlock reference): file access (a local folder or a Hub id), strict key / shape matching,
draft-vocabulary offsets, the target-layer id conventions and RoPE settings. The layouts themselves live next to
each drafter (`models/eagle3/convert_eagle3.py`, `models/specblock/convert_specblock.py`).
"""

from __future__ import annotations

import inspect
import json
import os
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import PretrainedConfig, PreTrainedModel
from transformers.utils import cached_file

from ...hub.shipped import resolve_drafter_path
from .generation_config import DRAFTING_SETTINGS

HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "revision", "subfolder", "token", "proxies")
"""`from_pretrained` keyword arguments that only say where files come from (passed to `cached_file`)."""


def split_hub_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(file-access kwargs, the rest)."""
    hub = {name: kwargs[name] for name in HUB_KWARGS if name in kwargs}
    return hub, {name: value for name, value in kwargs.items() if name not in HUB_KWARGS}


def resolve_file(path_or_id: str | os.PathLike, filename: str, hub_kwargs: Mapping[str, Any]) -> str | None:
    """Local path of `filename` in a folder or Hub repository, or None when it has no such file."""
    if os.path.isdir(path_or_id):
        path = os.path.join(path_or_id, hub_kwargs.get("subfolder", ""), filename)
        return path if os.path.isfile(path) else None
    return cached_file(
        str(path_or_id),
        filename,
        _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False,
        **hub_kwargs,
    )


def read_config_dict(path_or_id: str | os.PathLike, hub_kwargs: Mapping[str, Any]) -> dict[str, Any] | None:
    """The `config.json` of a checkpoint as a dict (None when there is none)."""
    path = resolve_file(path_or_id, "config.json", hub_kwargs)
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_tensor_pickle(path: str) -> dict[str, Any]:
    """`torch.load(path, weights_only=True)`: tensors and plain containers only. A pickle holding any other object
    (which could run code when unpickled) is refused with a ValueError naming the file."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise ValueError(
            f"{path} is a pickle that holds objects other than tensors, so it is not loaded (unpickling it could run "
            f"arbitrary code). Re-save it as a dict of tensors (torch.save({{name: tensor}})) or as safetensors. "
            f"Detail: {str(error).splitlines()[0]}"
        ) from error


def read_state_dict(
    path_or_id: str | os.PathLike, hub_kwargs: Mapping[str, Any]
) -> tuple[dict[str, torch.Tensor], str]:
    """(state dict, file name) of a single-file checkpoint: `model.safetensors`, else `pytorch_model.bin` (read with
    `weights_only=True`). Drafters are small; a sharded checkpoint is refused."""
    for sharded in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if resolve_file(path_or_id, sharded, hub_kwargs) is not None:
            raise ValueError(f"{path_or_id} holds a sharded checkpoint ({sharded}); drafters are read from one file.")
    path = resolve_file(path_or_id, "model.safetensors", hub_kwargs)
    if path is not None:
        return load_file(path), "model.safetensors"
    path = resolve_file(path_or_id, "pytorch_model.bin", hub_kwargs)
    if path is None:
        raise ValueError(f"{path_or_id} holds neither model.safetensors nor pytorch_model.bin.")
    state_dict = load_tensor_pickle(path)
    if not isinstance(state_dict, dict) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise ValueError(f"{path} does not hold a flat dict of tensors (a state dict).")
    return state_dict, "pytorch_model.bin"


def check_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    expected: Mapping[str, tuple[int, ...]],
    source: str,
    layout: str,
    their_name: Callable[[str], str] = str,
) -> None:
    """Raise a ValueError naming the first missing key, unexpected key or wrong shape (strict loading: a drafter
    with a misnamed or misshapen weight would run and accept nothing). Keys are ours; `their_name` gives the name
    the checkpoint uses, for the messages."""
    missing = [their_name(key) for key in expected if key not in state_dict]
    unexpected = [their_name(key) for key in state_dict if key not in expected]
    if missing:
        raise ValueError(
            f"{source}: key {missing[0]!r} is missing ({len(missing)} missing in all: {missing[:8]}) for the {layout} "
            "layout with this config. The file is incomplete or its config.json describes another model."
        )
    if unexpected:
        raise ValueError(
            f"{source}: unexpected key {unexpected[0]!r} ({len(unexpected)} unexpected in all: {unexpected[:8]}) for "
            f"the {layout} layout with this config. The file holds weights this drafter has no place for; its "
            "config.json probably does not match it."
        )
    for key, shape in expected.items():
        if tuple(state_dict[key].shape) != tuple(shape):
            raise ValueError(
                f"{source}: key {their_name(key)!r} has shape {list(state_dict[key].shape)}, but the config (and the "
                f"target) need {list(shape)}. The checkpoint was built for another target or its config.json is wrong."
            )


REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_attention_heads", "intermediate_size")
"""Llama config fields every published layout writes (the rest have each tool's defaults)."""


def require_fields(config: Mapping[str, Any], source: str) -> None:
    """Raise a ValueError naming the first of `REQUIRED_FIELDS` a published `config.json` lacks."""
    missing = [name for name in REQUIRED_FIELDS if not isinstance(config.get(name), int)]
    if missing:
        raise ValueError(f"{source}: config.json has no integer {missing[0]!r} (needed: {list(REQUIRED_FIELDS)}).")


def check_fits_target(
    vocab_size: int, target_hidden_size: int, target_config: PretrainedConfig, source: str
) -> None:
    """Raise a ValueError unless a checkpoint's vocabulary and target hidden size are the target's."""
    text = target_config.get_text_config()
    checks = (("vocab_size", vocab_size, text.vocab_size), ("target_hidden_size", target_hidden_size, text.hidden_size))
    for name, theirs, target in checks:
        if theirs != target:
            raise ValueError(
                f"{source}: the checkpoint's {name} is {theirs}, the target's is {target}: it was trained for another "
                "target model."
            )


def draft_vocab_from_offsets(
    d2t: torch.Tensor | None, t2d: torch.Tensor | None, vocab_size: int, draft_vocab_size: int, source: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Published `d2t` holds OFFSETS (target id = draft id + d2t[draft id]); ours holds the target ids. Returns our
    (d2t [Vd] int64 target ids, t2d [V] bool), refusing a mapping that does not fit the target vocabulary."""
    if d2t is None:
        if draft_vocab_size != vocab_size:
            raise ValueError(
                f"{source}: key 'd2t' is missing, but draft_vocab_size={draft_vocab_size} < vocab_size={vocab_size} "
                "needs the draft -> target id map."
            )
        d2t = torch.zeros(draft_vocab_size, dtype=torch.long)
    if d2t.is_floating_point() or d2t.dim() != 1 or d2t.numel() != draft_vocab_size:
        raise ValueError(
            f"{source}: key 'd2t' must be an integer tensor [{draft_vocab_size}], got {d2t.dtype} {list(d2t.shape)}."
        )
    target_ids = torch.arange(draft_vocab_size) + d2t.long()
    marked = torch.zeros(vocab_size, dtype=torch.bool)
    fits = bool((target_ids >= 0).all() and (target_ids < vocab_size).all())
    if fits:
        marked[target_ids] = True
    if t2d is not None:
        if t2d.dim() != 1 or t2d.numel() != vocab_size:
            raise ValueError(f"{source}: key 't2d' must be a tensor [{vocab_size}], got {list(t2d.shape)}.")
        t2d = t2d.bool()
        absolute = d2t.long()
        looks_absolute = bool((absolute >= 0).all() and (absolute < vocab_size).all()) and bool(t2d[absolute].all())
        if not fits or not torch.equal(marked, t2d):
            hint = (
                " It holds absolute target ids instead: convert with d2t = ids - torch.arange(len(ids))."
                if looks_absolute and int(t2d.sum()) == draft_vocab_size
                else ""
            )
            raise ValueError(
                f"{source}: key 'd2t' does not hold offsets matching 't2d' (draft id i must map to target id "
                f"i + d2t[i], the ids t2d marks).{hint}"
            )
    if not fits:
        raise ValueError(
            f"{source}: key 'd2t' maps draft ids outside the target vocabulary [0, {vocab_size}) (it must hold "
            "offsets: target id = draft id + d2t[draft id])."
        )
    if int(marked.sum()) != draft_vocab_size:
        raise ValueError(f"{source}: key 'd2t' maps two draft ids to the same target id.")
    return target_ids, marked


def offsets_from_draft_vocab(d2t: torch.Tensor) -> torch.Tensor:
    """Our target-id `d2t` -> the published offsets (target id = draft id + offset)."""
    return (d2t.long() - torch.arange(d2t.numel(), device=d2t.device)).cpu()


def hf_layer_ids_from(config: Mapping[str, Any], source: str) -> list[int] | None:
    """The captured target layers as HF `hidden_states` indices, read from an EAGLE-3 config (None when it names none).

    SGLang / SpecForge write `eagle_config.eagle_aux_hidden_state_layer_ids` as OUTPUT-of-layer ids (+1 gives the HF
    index); vLLM reads a top-level `eagle_aux_hidden_state_layer_ids` as INPUT-of-layer ids (= HF indices). When both
    are present they must name the same layers.
    """
    eagle_config = config.get("eagle_config") or {}
    sglang = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    vllm = config.get("eagle_aux_hidden_state_layer_ids")
    from_sglang = [int(i) + 1 for i in sglang] if sglang else None
    from_vllm = [int(i) for i in vllm] if vllm else None
    if from_sglang and from_vllm and from_sglang != from_vllm:
        raise ValueError(
            f"{source}: eagle_config.eagle_aux_hidden_state_layer_ids={sglang} (output-of-layer ids, SGLang) and "
            f"eagle_aux_hidden_state_layer_ids={vllm} (input-of-layer ids, vLLM) name different layers "
            f"(HF hidden_states {from_sglang} vs {from_vllm}). Fix the one the tool that trained it did not write."
        )
    return from_vllm or from_sglang


def layer_id_fields(hf_layer_ids: list[int]) -> dict[str, Any]:
    """Both engines' layer-id fields for HF `hidden_states` indices (see `hf_layer_ids_from`)."""
    if min(hf_layer_ids) < 1:
        raise ValueError(
            f"target_layer_ids {hf_layer_ids} include hidden_states[0] (the embedding output), which SGLang's "
            "output-of-layer ids cannot name; such a drafter cannot be exported in the EAGLE-3 layout."
        )
    return {
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in hf_layer_ids],
            "use_aux_hidden_state": True,
        },
        "eagle_aux_hidden_state_layer_ids": list(hf_layer_ids),
    }


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters_from(
    config: Mapping[str, Any], source: str, ignore_scaling_except_llama3: bool = False
) -> dict[str, Any]:
    """Our `rope_parameters` from a Llama-style config's `rope_theta` (default 10000, as every published loader) and
    `rope_scaling` / `rope_parameters`. Types other than default / linear / llama3 are refused: the published
    implementations of dynamic NTK and YaRN do not compute what transformers' do. With
    `ignore_scaling_except_llama3` a non-llama3 scaling is dropped (the SpecBlock reference code does exactly that)."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if ignore_scaling_except_llama3 and rope_type != "llama3":
        rope_type = "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{source}: RoPE scaling {rope_type!r} is not supported (only {SUPPORTED_ROPE_TYPES}): the drafter's code "
            "and transformers' implement it differently, so the loaded drafter would not compute what it was trained "
            "with."
        )
    parameters: dict[str, Any] = {"rope_type": rope_type, "rope_theta": theta}
    if rope_type == "linear":
        parameters["factor"] = float(rope["factor"])
    elif rope_type == "llama3":
        for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            parameters[name] = rope[name]
    return parameters


def rope_fields(rope_parameters: Mapping[str, Any]) -> dict[str, Any]:
    """Config fields `rope_theta` / `rope_scaling` (the spelling SGLang, vLLM and older transformers read)."""
    scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    if scaling.get("rope_type") == "default":
        scaling = None
    elif scaling:
        scaling["type"] = scaling["rope_type"]
    return {"rope_theta": rope_parameters["rope_theta"], "rope_scaling": scaling}


def checkpoint_dtype(state_dict: Mapping[str, torch.Tensor]) -> torch.dtype:
    """The dtype of the first floating-point tensor (what `dtype="auto"` loads)."""
    return next((t.dtype for t in state_dict.values() if t.is_floating_point()), torch.float32)


def write_checkpoint(folder: str | os.PathLike, config: dict[str, Any], state_dict: Mapping[str, torch.Tensor]) -> None:
    """Write `config.json` and `model.safetensors` (contiguous CPU copies) into `folder`."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    tensors = {name: t.detach().cpu().contiguous() for name, t in state_dict.items()}
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def expected_shapes(model_class: type, config: PretrainedConfig) -> dict[str, tuple[int, ...]]:
    """Our state-dict key -> shape for a drafter of `model_class` built from `config` (on the meta device)."""
    with torch.device("meta"):
        model = model_class(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def setting_names(config_class: type[PretrainedConfig]) -> set[str]:
    """The keyword arguments a config class (and its bases) takes by name."""
    names: set[str] = set()
    for klass in config_class.__mro__:
        if "__init__" in vars(klass):
            parameters = inspect.signature(klass.__init__).parameters.values()
            names |= {p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD or p.kind is p.KEYWORD_ONLY}
    return names - {"self"}


@dataclass
class PublishedCheckpoint:
    """A published checkpoint as read: where from, its layout, its `config.json` and its weights."""

    path: str | os.PathLike  # local folder or Hub id
    source: str  # path and weight file, for error messages
    layout: str
    config: dict[str, Any]
    state_dict: dict[str, torch.Tensor]
    hub_kwargs: dict[str, Any]
    target_embedding: torch.Tensor | None = None  # the target's input embedding weight, when `target` is given


class PublishedCheckpointMixin:
    """`from_pretrained` / `save_pretrained` of a drafter that also read / write other tools' checkpoint layouts.

    A drafter class sets `detect_published_layout` (config dict -> layout name or None), `convert_published`
    (model class, `PublishedCheckpoint`, target config, config overrides -> (our config, our state dict)),
    `published_drafting_settings` (config dict -> the decoding settings it describes, where it describes any) and
    `checkpoint_writers` (`checkpoint_format` name -> writer(drafter, folder)).
    """

    detect_published_layout: Callable[[dict[str, Any]], str | None] | None = None
    convert_published: Callable[..., tuple[PretrainedConfig, dict[str, torch.Tensor]]] | None = None
    published_drafting_settings: Callable[[dict[str, Any]], dict[str, Any]] = staticmethod(lambda config_dict: {})
    checkpoint_writers: dict[str, Callable[[Any, str | os.PathLike], None]] = {}

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: Any,
        *args: Any,
        target: PreTrainedModel | None = None,
        target_config: PretrainedConfig | None = None,
        **kwargs: Any,
    ) -> Any:
        """Load this package's own layout, or a published layout detected from `config.json` (see the drafter's
        `convert_*` module). A published checkpoint does not describe its target, so it needs `target` (the model:
        the drafter is then bound to it) or `target_config`; loading is strict (a missing, unexpected or misshapen
        weight, or a draft vocabulary that does not fit, is a ValueError naming the key). `dtype` ("auto": the
        checkpoint's) and the file-access arguments apply; decoding settings (e.g. `tree_budget=16`) go to the
        drafter's `generation_config`, other keyword arguments override config settings (e.g. `tree_top_k=8`)."""
        path = resolve_drafter_path(pretrained_model_name_or_path)
        hub_kwargs, rest = split_hub_kwargs(kwargs)
        config_dict = None
        if isinstance(path, (str, os.PathLike)) and "config" not in kwargs:
            config_dict = read_config_dict(path, hub_kwargs)
        layout = cls.detect_published_layout(config_dict) if config_dict and cls.detect_published_layout else None
        if layout is None:
            model = super().from_pretrained(path, *args, **kwargs)
            if target is not None:
                (model[0] if isinstance(model, tuple) else model).bind_target(target)
            return model
        if args:
            raise ValueError(f"Loading a published {layout} checkpoint takes keyword arguments only, got {args}.")
        if target is None and target_config is None:
            raise ValueError(
                f"{path} is a published {layout} checkpoint, whose config does not describe the target model: pass "
                "`target=<the target model>` (or `target_config=AutoConfig.from_pretrained(<target>)`)."
            )
        target_config = target.config if target is not None else target_config
        dtype = rest.pop("dtype", rest.pop("torch_dtype", "auto"))
        device = rest.pop("device_map", None)
        settings = {name: rest.pop(name) for name in DRAFTING_SETTINGS if name in rest}
        unknown = [name for name in rest if name not in setting_names(cls.config_class)]
        if unknown:
            raise ValueError(
                f"Loading a published {layout} checkpoint: {unknown} are neither file-access arguments, dtype, "
                f"device_map, decoding settings nor settings of {cls.config_class.__name__}."
            )
        state_dict, filename = read_state_dict(path, hub_kwargs)
        checkpoint = PublishedCheckpoint(path, f"{path} ({filename})", layout, config_dict, state_dict, hub_kwargs)
        if target is not None:
            checkpoint.target_embedding = target.get_input_embeddings().weight
        config, ours = cls.convert_published(cls, checkpoint, target_config, rest)
        config.target_name_or_path = getattr(target_config, "_name_or_path", None) or config.target_model_type
        model = cls(config)
        model.load_state_dict(ours, strict=True)
        model.to(dtype=checkpoint_dtype(state_dict) if dtype in (None, "auto") else dtype)
        if device is not None:
            model.to(device)
        model.check_draft_vocab()
        model.set_drafting_settings(**{**cls.published_drafting_settings(config_dict), **settings})
        model.eval()
        if target is not None:
            model.bind_target(target)
        return model

    def save_pretrained(
        self, save_directory: str | os.PathLike, *args: Any, checkpoint_format: str | None = None, **kwargs: Any
    ) -> Any:
        """`save_pretrained` in this package's layout (`checkpoint_format=None`) or in a published one (one of
        `checkpoint_writers`, e.g. "eagle3"): then `config.json` + `model.safetensors` as that tool writes them."""
        if checkpoint_format is None:
            return super().save_pretrained(save_directory, *args, **kwargs)
        writer = self.checkpoint_writers.get(checkpoint_format)
        if writer is None:
            raise ValueError(
                f"checkpoint_format={checkpoint_format!r} is not one {type(self).__name__} writes: use None (this "
                f"package's layout) or one of {sorted(self.checkpoint_writers)}."
            )
        save_adapted = kwargs.pop("save_adapted", False)  # as in this package's layout: the loaded weights unless asked
        if args or kwargs:
            raise ValueError(f"checkpoint_format={checkpoint_format!r} takes no other arguments, got {args} {kwargs}.")
        with self.loaded_weights_in_place(not save_adapted):
            writer(self, save_directory)
