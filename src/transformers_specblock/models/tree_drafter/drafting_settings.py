"""The decoding settings of a tree drafter as a model sees them: its `generation_config` (its family's
`TreeGenerationConfig`), its class's defaults, the checks that depend on its architecture, and the three scopes of a
change (for good, for a block of code, for one `generate` call)."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from transformers.utils import GENERATION_CONFIG_NAME, logging

from .checkpoint_io import resolve_file
from .configuration_tree_drafter import TreeDrafterConfig
from .generation_config import DRAFTING_SETTINGS, TreeGenerationConfig

logger = logging.get_logger(__name__)


class DraftingSettingsMixin:
    """`generation_config` handling of `TreeDraftModel` (mixed into it before `PreTrainedModel`)."""

    config: TreeDrafterConfig
    generation_config_class: type[TreeGenerationConfig] = TreeGenerationConfig  # the family's decoding settings
    # this drafter class's decoding defaults, over `TreeGenerationConfig`'s (a checkpoint without
    # generation_config.json gets them)
    generation_defaults: dict[str, Any] = {}
    tree_constructions: tuple[str, ...] = ("package",)  # the `tree_construction` values this drafter can draft with

    @classmethod
    def default_generation_config(cls, config: TreeDrafterConfig) -> TreeGenerationConfig:
        """The decoding settings of a drafter with no `generation_config.json`: this class's defaults, then the
        decoding settings an older `config.json` still holds (read once, with a deprecation warning)."""
        legacy = getattr(config, "legacy_drafting_settings", None) or {}
        if legacy:
            logger.warning_once(
                f"{sorted(legacy)} in a drafter's config.json are decoding settings, read into its `generation_config` "
                "(saved as generation_config.json). Save the drafter again to move them there; config.json keys will "
                "not be read in a future version."
            )
        return cls.generation_config_class(**{**cls.generation_defaults, **legacy})

    @property
    def generation_config(self) -> TreeGenerationConfig | None:
        """The drafter's decoding settings (its family's `TreeGenerationConfig`, saved as generation_config.json)."""
        return self.__dict__.get("_generation_config")

    @generation_config.setter
    def generation_config(self, settings: TreeGenerationConfig | None) -> None:
        if settings is None and self.__dict__.get("_generation_config") is None:  # PreTrainedModel.__init__
            return
        if not isinstance(settings, TreeGenerationConfig):
            raise TypeError(
                f"{type(self).__name__}.generation_config holds its decoding settings, a "
                f"{self.generation_config_class.__name__}, got {type(settings).__name__}. Change settings with "
                "`drafter.generation_config.update(tree_budget=16)` or `drafter.set_drafting_settings(...)`; the "
                "target's settings (max_new_tokens, do_sample, ...) go to `target.generate`."
            )
        if not isinstance(settings, self.generation_config_class):  # another family's class: its own settings, ours
            settings = self.generation_config_class(**settings.drafting_settings())
        self.check_drafting_settings(settings)
        self.__dict__["_generation_config"] = settings

    def check_drafting_settings(self, settings: TreeGenerationConfig) -> None:
        """Raise a ValueError naming the first setting of `settings` this drafter cannot draft with (subclasses add
        their own checks)."""
        settings.validate_settings()
        if settings.tree_construction not in self.tree_constructions:
            raise ValueError(
                f"{type(self).__name__} grows trees with tree_construction in {self.tree_constructions}, "
                f"got {settings.tree_construction!r}."
            )
        if settings.context_feeding != "package" and "reference" not in self.tree_constructions:
            raise ValueError(f'{type(self).__name__} has no reference harness: context_feeding must be "package".')

    def set_drafting_settings(self, **settings: Any) -> None:
        """Change decoding settings of `generation_config` for good (validated; `tree_settings` changes them for a
        block of code, `generate(..., <name>=value)` for one call)."""
        unknown = sorted(set(settings) - set(DRAFTING_SETTINGS))
        if unknown:
            raise ValueError(f"{unknown} are not decoding settings; known: {list(DRAFTING_SETTINGS)}.")
        updated = copy.deepcopy(self.generation_config)
        for name, value in settings.items():
            setattr(updated, name, value)
        updated.validate()  # the same checks and warnings as `update` and `save_pretrained`
        self.generation_config = updated

    def load_generation_config(self, pretrained_model_name_or_path: Any, **hub_kwargs: Any) -> None:
        """Read the drafter's `generation_config.json` where the checkpoint has one (older checkpoints and published
        layouts keep `default_generation_config`); a setting the file lacks (written before the setting existed, or
        before it moved there from `config.json`) keeps its value from `default_generation_config`."""
        path = resolve_file(pretrained_model_name_or_path, GENERATION_CONFIG_NAME, hub_kwargs)
        if path is None:
            return
        with open(path, encoding="utf-8") as f:
            written = json.load(f)
        loaded = self.generation_config_class.from_pretrained(pretrained_model_name_or_path, **hub_kwargs)
        for name in DRAFTING_SETTINGS:
            if name not in written:
                setattr(loaded, name, getattr(self.generation_config, name))
        self.check_drafting_settings(loaded)
        self.generation_config = loaded

    @contextmanager
    def tree_settings(self, **settings: Any) -> Iterator["DraftingSettingsMixin"]:
        """Temporarily change decoding settings (`generation_config`), e.g. `with drafter.tree_settings(tree_budget=16,
        max_blocks=1): ...`, or settings of the config that do not change the weights' meaning (`prefill_chunk_size`);
        both are restored on exit."""
        decoding = {name: value for name, value in settings.items() if name in DRAFTING_SETTINGS}
        architecture = {name: value for name, value in settings.items() if name not in decoding}
        unknown = [name for name in architecture if not hasattr(self.config, name)]
        if unknown:
            raise ValueError(f"{type(self.config).__name__} has no setting(s) {unknown}.")
        saved_generation_config = self.generation_config
        saved = {name: getattr(self.config, name) for name in architecture}
        try:
            if decoding:
                self.set_drafting_settings(**decoding)
            for name, value in architecture.items():
                setattr(self.config, name, value)
            self.config.validate_settings()
            self.check_drafting_settings(self.generation_config)
            yield self
        finally:
            self.__dict__["_generation_config"] = saved_generation_config  # valid before: restored unchecked
            for name, value in saved.items():
                setattr(self.config, name, value)
