"""Base class of the feature-level tree drafters (SpecBlock, EAGLE-3) driven by the package's generate loop."""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import transformers
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.generation import GenerationMixin

from ...hub.modelcard import build_model_card
from ...hub.provenance import resolve_base_model_id
from ...hub.shipped import resolve_drafter_path
from ...utils import PATCH_FREE_ROUTE, SUPPORTED_TRANSFORMERS
from .checkpoint_io import split_hub_kwargs
from .configuration_tree_drafter import TreeDrafterConfig
from .drafting_settings import DraftingSettingsMixin
from .generation_config import DRAFTING_SETTINGS
from .serving_state import ServingState, ServingStates


def training_stat_names(num_slots: int) -> list[str]:
    """Layout of the detached metric sums a drafter's training forward returns (`stats`); EAGLE-3 uses one "slot"
    per training-time-test step, so both drafters are logged by the same code."""
    return (
        ["loss_draft", "loss_rank", "batches", "tokens"]
        + [f"correct_slot{k}" for k in range(num_slots)]
        + [f"counted_slot{k}" for k in range(num_slots)]
        + [f"ce_sum_slot{k}" for k in range(num_slots)]
        + [f"ce_count_slot{k}" for k in range(num_slots)]
        + ["accept_sum", "accept_count", "rank_correct", "rank_count"]
    )


class TreeDraftModel(DraftingSettingsMixin, PreTrainedModel):
    """A drafter that reads a frozen target's hidden states and proposes token trees.

    Its config names the target it was built for (`vocab_size`, `target_hidden_size`, `target_num_hidden_layers`,
    `target_layer_ids`); its token path reads the TARGET's input embedding, bound with `bind_target` and never saved
    with the drafter. `generate(assistant_model=<TreeDraftModel>)` runs the package's tree loop with the candidate
    generator registered for the config's `model_type` (`generation.candidate_generators`).
    """

    config_class = TreeDrafterConfig
    main_input_name = "input_ids"
    _supports_sdpa = True
    # Only the additive float tree masks of eager / sdpa attention express a token tree.
    _supports_flash_attn = False
    _supports_flex_attn = False

    # plain attributes that reference the bound target (weakly) or cache derived tensors: not copied or pickled
    _unpickled_attributes = ("_target_embedding", "_slot_inputs")

    def __init__(self, config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.__dict__["_target_embedding"] = None  # a weak reference to the target's embedding, once bound
        self.serving_states = ServingStates()  # what serving learns and keeps (`serving_state`), never saved
        # the class defaults, checked against the architecture when set or used (a drafter may be built with a draft
        # vocabulary too small for them and given its own settings next)
        self.__dict__["_generation_config"] = self.default_generation_config(config)
        self.last_stats = None

        # draft id -> target id, and which target ids the draft vocabulary holds (saved with the weights)
        self.register_buffer("d2t", torch.arange(config.draft_vocab_size), persistent=True)
        self.register_buffer("t2d", torch.arange(config.vocab_size) < config.draft_vocab_size, persistent=True)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, TreeDraftModel):  # the identity draft vocabulary until training sets one
            init.copy_(module.d2t, torch.arange(self.config.draft_vocab_size))
            init.copy_(module.t2d, torch.arange(self.config.vocab_size) < self.config.draft_vocab_size)

    @classmethod
    def from_target(cls, target: PreTrainedModel, **overrides: Any) -> "TreeDraftModel":
        """A freshly initialised drafter sized for `target` (see the config's `from_target_config`)."""
        settings = {name: overrides.pop(name) for name in DRAFTING_SETTINGS if name in overrides}
        config = cls.config_class.from_target_config(target.config, **overrides)
        config.target_name_or_path = target.name_or_path or target.config.get_text_config().model_type
        config.base_model_id = resolve_base_model_id(target.name_or_path)  # a Hub id or None, never a path
        drafter = cls(config).to(device=target.device, dtype=target.dtype).eval()
        drafter.set_drafting_settings(**settings)
        drafter.bind_target(target)
        return drafter

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: Any, *args: Any, strict: bool = True, **kwargs: Any
    ) -> "TreeDraftModel":
        """`PreTrainedModel.from_pretrained`, strict, then a check that the draft vocabulary maps to distinct ids.

        Strict (the default): a weight the checkpoint lacks, holds in excess or holds in another shape is a ValueError
        naming the keys (transformers alone would initialise a missing weight afresh and only log it: a drafter that
        runs and accepts nothing). `strict=False` opts out (transformers' own rules and load report); so does
        `ignore_mismatched_sizes=True` for shapes alone. `pretrained_model_name_or_path` may also be a shipped
        drafter's name (``"specblock-smollm2-135m-instruct"``, see `transformers_specblock.hub.SHIPPED_DRAFTERS`): a
        local folder of that name wins; a Hub id or any other value is passed through unchanged
        (`hub.shipped.resolve_drafter_path`).
        """
        path = resolve_drafter_path(pretrained_model_name_or_path)
        settings = {name: kwargs.pop(name) for name in DRAFTING_SETTINGS if name in kwargs}
        hub_kwargs, _ = split_hub_kwargs(kwargs)
        if not strict:
            model = super().from_pretrained(path, *args, **kwargs)
            loaded = model[0] if isinstance(model, tuple) else model
        else:
            wants_info = kwargs.pop("output_loading_info", False)
            shapes_tolerated = kwargs.get("ignore_mismatched_sizes", False)
            kwargs["ignore_mismatched_sizes"] = True  # report a misshapen weight by name instead of a RuntimeError
            loaded, info = super().from_pretrained(path, *args, output_loading_info=True, **kwargs)
            check_loading_info(info, cls.__name__, str(pretrained_model_name_or_path), shapes_tolerated)
            model = (loaded, info) if wants_info else loaded
        loaded.check_draft_vocab()
        loaded.load_generation_config(path, **hub_kwargs)
        loaded.set_drafting_settings(**settings)
        return model

    def check_draft_vocab(self) -> None:
        """Raise a ValueError unless `d2t` holds `draft_vocab_size` distinct target ids and `t2d` marks exactly them
        (a duplicate would draft two identical siblings, which the acceptors assume never happens)."""
        d2t, t2d = self.d2t, self.t2d
        vocab, draft_vocab = self.config.vocab_size, self.config.draft_vocab_size
        problem = None
        if d2t.shape != (draft_vocab,) or d2t.is_floating_point():
            problem = f"d2t must be an integer tensor of shape [{draft_vocab}], got {tuple(d2t.shape)} {d2t.dtype}"
        elif draft_vocab and (int(d2t.min()) < 0 or int(d2t.max()) >= vocab):
            problem = f"d2t holds ids outside the target vocabulary [0, {vocab})"
        elif torch.unique(d2t).numel() != draft_vocab:
            problem = f"d2t maps {draft_vocab - torch.unique(d2t).numel()} draft ids to an already used target id"
        elif t2d.shape != (vocab,) or int(t2d.sum()) != draft_vocab or not bool(t2d[d2t].all()):
            problem = "t2d does not mark exactly the target ids listed in d2t"
        if problem is not None:
            raise ValueError(
                f"Invalid draft vocabulary in this {type(self).__name__}: {problem}. The checkpoint is corrupted or was "
                "written by other code; rebuild the vocabulary (training's `set_draft_vocab`) or re-export it."
            )

    def save_pretrained(
        self, save_directory: str | os.PathLike, *args: Any, save_adapted: bool = False, **kwargs: Any
    ) -> Any:
        """`PreTrainedModel.save_pretrained`, plus the decoding settings (`generation_config.json`), the training record
        (`training_record.json`: provenance, training settings, evaluation; see `hub.provenance`) and a generated Hub
        model card (`README.md`). A README.md already in the folder that this package did not generate (the user's own
        card) is kept as it is.

        A drafter changed by online adaptation writes the weights it was loaded with unless `save_adapted=True`.
        """
        from ...hub.modelcard import write_model_card
        from ...hub.provenance import save_training_record

        with self.loaded_weights_in_place(not save_adapted):
            result = super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            self.generation_config.save_pretrained(save_directory)
            save_training_record(self.config.training_record, save_directory)
            write_model_card(build_model_card(self), os.path.join(save_directory, "README.md"))
        return result

    def remember_loaded_weights(self) -> None:
        """Keep a copy of the weights as they are now (once: the first online update calls it), for
        `reset_adaptation` and for `save_pretrained` without `save_adapted`."""
        if self.serving_states.loaded_weights is None:
            self.serving_states.loaded_weights = {n: p.detach().clone() for n, p in self.named_parameters()}

    @torch.no_grad()
    def reset_adaptation(self) -> None:
        """Undo online adaptation: the weights the drafter was loaded with (bit for bit), a fresh adaptation state."""
        loaded, self.serving_states.loaded_weights = self.serving_states.loaded_weights, None
        if loaded is not None:
            for name, param in self.named_parameters():
                param.copy_(loaded[name])
        self.serving_states.drop_adaptation()  # buffer, bandit, optimizers (`generation.adaptation`)

    @contextmanager
    def loaded_weights_in_place(self, active: bool) -> Iterator[None]:
        """Temporarily put the loaded weights back (when `active` and the drafter was adapted by online adaptation)."""
        loaded = self.serving_states.loaded_weights if active else None
        if loaded is None:
            yield
            return
        adapted = {n: p.detach().clone() for n, p in self.named_parameters()}
        with torch.no_grad():
            for name, param in self.named_parameters():
                param.copy_(loaded[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for name, param in self.named_parameters():
                    param.copy_(adapted[name])

    def check_target(self, target: PreTrainedModel) -> None:
        """Raise a ValueError naming both values if `target` is not the model this drafter was built for."""
        text_config = target.config.get_text_config()
        checks = [
            ("vocab_size", self.config.vocab_size, target.get_input_embeddings().num_embeddings),
            ("hidden_size", self.config.target_hidden_size, text_config.hidden_size),
            ("num_hidden_layers", self.config.target_num_hidden_layers, text_config.num_hidden_layers),
        ]
        for name, expected, actual in checks:
            if expected != actual:
                raise ValueError(
                    f"This drafter was built for a target with {name}={expected}, but the target model has "
                    f"{name}={actual}. Load a drafter trained for this target, or build one with "
                    f"`{type(self).__name__}.from_target(target)`."
                )

    def bind_target(self, target: PreTrainedModel, place: bool = True) -> None:
        """Use `target`'s (frozen) input embedding as the drafter's token path (held weakly: the drafter keeps no
        target alive).

        With `place` the drafter moves to the device where the target's input embedding runs (for a target spread
        over devices with `device_map`: where its first layers run) and its floating-point weights are cast to the
        target's dtype, so it drafts at the target's precision with no cross-device copy of the features. A drafter
        or target on the meta device (no weights) is refused. `generate` does not place the user's drafter: it drafts
        with `served_for(target)`. Training passes `place=False`: its Trainer places the drafter and keeps float32
        weights.
        """
        self.check_target(target)
        embedding = target.get_input_embeddings()
        if place:
            device = self._placement(target)
            dtype = target.dtype
            tensors = [*self.parameters(), *self.buffers()]
            if any(t.device != device or (t.is_floating_point() and t.dtype != dtype) for t in tensors):
                self.to(device=device, dtype=dtype)
        self.__dict__["_target_embedding"] = weakref.ref(embedding)

    def _placement(self, target: PreTrainedModel) -> torch.device:
        """Where the drafter drafts for `target` (the device of its input embedding); refuses meta tensors."""
        device = _execution_device(target.get_input_embeddings())
        if device.type == "meta":
            raise ValueError(
                "The target's input embedding is on the meta device (no weights): load the target's weights "
                "(from_pretrained) before binding a drafter or generating."
            )
        if any(t.device.type == "meta" for t in [*self.parameters(), *self.buffers()]):
            raise ValueError(
                f"This {type(self).__name__}'s weights are on the meta device (no data), so it cannot follow its "
                f"target to {device}: load them first (from_pretrained, or to_empty + load_state_dict)."
            )
        return device

    def serving_state(self, target: PreTrainedModel | None = None) -> ServingState:
        """What this drafter keeps while serving `target` (`serving_state.ServingState`: "auto" choosers and cost
        curves, source scores, online adaptation; made on first use); without `target`, the state of the target
        served last."""
        if target is not None:
            return self.serving_states.for_target(target)
        state = self.serving_states.latest
        if state is None:
            raise ValueError(
                f"This {type(self).__name__} has not served a target that is still alive: pass the target, "
                "`drafter.serving_state(target)`."
            )
        return state

    def reset_serving_state(self) -> None:
        """Forget everything serving learnt and kept (choosers, cost curves, source scores, suffix cache, online
        adaptation's state, cast copies); the weights stay as they are (`reset_adaptation` restores loaded ones)."""
        self.serving_states.clear()

    def serve(self, target: PreTrainedModel) -> ServingState:
        """Bind this drafter to `target` for a `generate` call, in one call: the target is checked, and its serving
        state (made on first use) comes back holding everything the loop needs, `state.drafter` among it: the drafter
        that drafts, bound to the target (this one where its weights already have the target's dtype and device, else
        a copy cast there, kept and made again when these weights change; the user's drafter is never cast or moved
        by serving)."""
        self.check_target(target)
        state = self.serving_states.for_target(target)
        state.drafter = state.served_drafter(self, self._placement(target), target.dtype)
        state.drafter.bind_target(target, place=False)
        return state

    def served_for(self, target: PreTrainedModel) -> "TreeDraftModel":
        """The drafter that drafts for `target` (`serve(target).drafter`)."""
        return self.serve(target).drafter

    def __getstate__(self) -> dict[str, Any]:
        """Pickling and `copy.deepcopy`: weights, config and statistics; no binding to a target, no serving state."""
        state = dict(super().__getstate__())
        for name in self._unpickled_attributes:
            if name in state:
                state[name] = None
        return state

    def __getattr__(self, name: str) -> Any:
        # transformers' stock assisted decoding calls generation methods (`generate`, ...) of its assistant, which a
        # tree drafter does not have: say what to do instead of a bare AttributeError (hasattr() still answers False)
        if hasattr(GenerationMixin, name) and not name.startswith("__"):
            raise AttributeError(
                f"{type(self).__name__} is a tree drafter: transformers' stock assisted decoding cannot run it. "
                "`transformers_specblock.install()` (done on import) routes generate() to the tree loop on "
                f"transformers {SUPPORTED_TRANSFORMERS} (this is {transformers.__version__}); on any transformers use the "
                f"patch-free route, {PATCH_FREE_ROUTE}."
            )
        return super().__getattr__(name)

    @property
    def bound_embedding(self) -> nn.Module | None:
        """The bound target's input embedding (None if unbound, or if that target was deleted)."""
        ref = self.__dict__.get("_target_embedding")
        return ref() if ref is not None else None

    @property
    def target_embedding(self) -> nn.Module:
        embedding = self.bound_embedding
        if embedding is None:
            raise RuntimeError(
                "The drafter is not bound to a target: call `drafter.bind_target(target)` (generate() does it)."
            )
        return embedding

    def embed_target_tokens(self, input_ids: torch.LongTensor) -> torch.Tensor:
        """Target token embeddings (no gradient: the target's embedding stays frozen)."""
        with torch.no_grad():
            emb = self.target_embedding(input_ids.to(_execution_device(self.target_embedding)))
        return emb.to(device=self.device, dtype=self.dtype)


def check_loading_info(info: dict[str, Any], class_name: str, source: str, shapes_tolerated: bool = False) -> None:
    """Raise a ValueError naming the missing, unexpected and misshapen keys (and load errors) of a load report."""
    problems = []
    for kind in ("missing", "unexpected"):
        keys = sorted(info.get(f"{kind}_keys") or ())
        if keys:
            problems.append(f"{len(keys)} {kind} key(s) {keys[:8]}")
    mismatched = sorted(info.get("mismatched_keys") or ()) if not shapes_tolerated else []
    if mismatched:
        shown = [f"{key} (checkpoint {list(saved)}, model {list(model)})" for key, saved, model in mismatched[:8]]
        problems.append(f"{len(mismatched)} misshapen key(s) {shown}")
    if info.get("error_msgs"):
        problems.append(f"load errors {list(info['error_msgs'])[:4]}")
    if problems:
        raise ValueError(
            f"{source} does not fit a {class_name} with its config.json: {'; '.join(problems)}. Loading is strict "
            "(a freshly initialised weight would give a drafter that runs and accepts nothing): the checkpoint is "
            "incomplete, or was written by other code or for another config. Pass strict=False to load it anyway "
            "(missing weights initialised afresh, extra ones dropped)."
        )


def _execution_device(module: nn.Module) -> torch.device:
    """Where `module` computes: its accelerate hook's execution device (set for offloaded weights under a
    `device_map`), else the device of its weight."""
    hook = getattr(module, "_hf_hook", None)
    for part in getattr(hook, "hooks", [hook]):
        device = getattr(part, "execution_device", None)
        if device is not None:
            return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return module.weight.device
