"""The decoding and serving settings of a tree drafter: a `GenerationConfig`, saved as `generation_config.json`.

A drafter's config (`TreeDrafterConfig`) describes its architecture and the target it reads; how it drafts (tree
budget, "auto", the shape of its trees, free candidates, suffix cache, online adaptation, compiling) lives in its
`generation_config`, as an assistant's decoding settings do in transformers: one class per drafter family
(`SpecBlockGenerationConfig`, `Eagle3GenerationConfig`, `DFlashGenerationConfig`, `LookupTreeGenerationConfig`), each
holding the settings every tree drafter reads and the tree-shape settings of its family. A setting of another family,
or a field of transformers' `GenerationConfig` that a drafter never reads (`max_new_tokens`, `do_sample`: they belong
to the target's `generate` call), draws a warning and is not saved. Every check runs in `validate()`, so
`update`, `save_pretrained`, `from_pretrained` and per-call settings refuse an invalid value with the same message.
`generate(..., assistant_model=drafter, tree_budget=16)` overrides a setting for one call;
`drafter.tree_settings(tree_budget=16)` for a block.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, ClassVar

from transformers import GenerationConfig

from .setting_checks import AUTO, check_choice, check_count, check_number, check_tree_budget, is_count

DEFAULT_CANDIDATES = (0, 2, 4, 8, 16, 24, 32, 48, 64)
DEFAULT_EXPLORE_INTERVAL = 32  # verified steps between two trees drafted above the chosen budget
DEFAULT_EXPLORE_SHARE = 0.02  # ... at least; and at most this share of the decoding time goes to exploring
DEFAULT_MIN_GAIN = 0.05  # speculating must promise 5% more tokens per second than plain decoding
DEFAULT_WARMUP_COST = 2.0  # the warm-up's trees cost the target at most two plain steps (a GPU: the largest budget)
# online_adaptation policies: no update / whole drafter after every call (OSD-style) / output side after every call /
# cost-aware choice between skip and whole drafter / cost-aware choice between skip, output side and whole drafter
ADAPTATION_POLICIES = ("off", "always", "head_only", "full", "bandit")
# how a drafter grows its trees: this package's way, or as the drafter's reference implementation does (SpecBlock)
TREE_CONSTRUCTIONS = ("package", "reference")
# how a drafter reads the committed context: this package's way, or as the drafter's reference harness does (SpecBlock)
CONTEXT_FEEDINGS = ("package", "reference")
# how SpecBlock lays out the last round's blocks: candidates under the greedy chain only, or best first under every node
BLOCK_EXPANSIONS = ("chain", "best_first")
# how SpecBlock gives each slot its candidates: by the rank head's predicted class, or a fixed width (an ablation)
TREE_POLICIES = ("rank", "fixed")
# name -> default of every drafting setting (`TreeGenerationConfig`)
DRAFTING_DEFAULTS: dict[str, Any] = {
    "tree_budget": AUTO,
    "tree_construction": "package",
    "context_feeding": "package",
    "max_blocks": 2,
    "max_followups": 4,
    "block_expansion": "chain",
    "branch_widths": [2, 4, 6, 4],
    "tree_policy": "rank",
    "fixed_width": 3,
    "tree_top_k": 10,
    "tree_depth": 7,
    "auto_budget_candidates": list(DEFAULT_CANDIDATES),
    "auto_budget_warmup": 8,
    "auto_budget_warmup_cost": DEFAULT_WARMUP_COST,
    "auto_budget_explore_interval": DEFAULT_EXPLORE_INTERVAL,
    "auto_budget_explore_share": DEFAULT_EXPLORE_SHARE,
    "auto_budget_min_gain": DEFAULT_MIN_GAIN,
    "auto_budget_cost_cache": True,
    "prompt_lookup_num_tokens": 0,
    "prompt_lookup_max_ngram_size": 3,
    "prompt_lookup_min_ngram_size": 1,
    "prompt_lookup_branches": 4,
    "ngram_cache_num_tokens": 0,
    "ngram_cache_order": 2,
    "suffix_cache_num_tokens": 0,
    "suffix_local_num_tokens": 0,
    "suffix_cache_spec_factor": 4.0,
    "suffix_cache_min_token_prob": 0.1,
    "suffix_cache_max_tokens": 65536,
    "suffix_cache_max_requests": 256,
    "online_adaptation": "off",
    "adaptation_learning_rate": 2e-2,
    "adaptation_head_learning_rate": 1e-3,
    "adaptation_buffer_size": 256,
    "adaptation_top_k": 32,
    "adaptation_context": 8,
    "compile_drafter": False,
}
DRAFTING_SETTINGS = tuple(DRAFTING_DEFAULTS)
# the tree-shape settings of each drafter family (the other settings apply to every tree drafter with weights)
SPECBLOCK_SHAPE_SETTINGS = (
    "tree_construction", "context_feeding", "max_blocks", "max_followups", "block_expansion", "branch_widths",
    "tree_policy", "fixed_width",
)  # fmt: skip
SHAPE_SETTINGS = (*SPECBLOCK_SHAPE_SETTINGS, "tree_top_k", "tree_depth")
ADAPTATION_SETTINGS = tuple(name for name in DRAFTING_SETTINGS if "adaptation" in name)
# fields of transformers' GenerationConfig that are bookkeeping, not settings, and the special-token ids `Trainer`
# copies from the tokenizer into every model's generation config (none is read by a drafter, none is saved)
_METADATA = ("transformers_version", "_from_model_config", "_commit_hash", "_original_object_hash")
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")
LIST_SETTINGS = ("auto_budget_candidates", "branch_widths")  # kept as lists (JSON reads a tuple back as a list)


class TreeGenerationConfig(GenerationConfig):
    r"""How a tree drafter drafts: the settings of `DRAFTING_DEFAULTS`, on top of transformers' `GenerationConfig`.

    Args:
        tree_budget: Nodes the target verifies per iteration at most (the root not counted), or "auto": time the
            target once per model and device and pick, among `auto_budget_candidates`, the budget maximising
            tau / (T_M + T_D), with tau learnt from the verified trees (the first `auto_budget_warmup` ones at the
            largest candidate the target verifies for at most `auto_budget_warmup_cost` plain steps, then over a
            window of recent steps). A candidate 0 means "do not speculate" and wins
            where no tree pays for itself (a weak drafter on a slow device).
        tree_construction: How the drafter grows a tree: "package" (default) or "reference", as the drafter's
            reference implementation does where the drafter has one (SpecBlock: the authors' inference harness at its
            defaults, `generation/candidate_generators/specblock_reference_tree.py`; `tree_budget`, `max_blocks` and
            `branch_widths` apply, `max_followups` and `tree_policy` do not); a drafter without one refuses it.
        context_feeding: How the drafter reads the committed positions: "package" (default: each position i once, its
            target features with token x_{i+1} at its own rotary position) or "reference", as the drafter's reference
            inference harness feeds them where the drafter has one (SpecBlock: the prompt's last position twice, the
            copy one rotary position further; after a step that accepted nothing the last position read is replaced
            by the new one; after a step that accepted tokens the features of the root and the accepted tokens paired
            with the tokens one further, the bonus token twice; rotary positions counted as the harness counts them).
            It reproduces that harness's decoding step for step (docs/design.md: its measured effect on tau) and
            needs a fixed `tree_budget`; a drafter without a reference harness refuses it.
        Tree shape, SpecBlock:
        max_blocks: Block rounds per iteration (1 = block 1 only; each further round is one batched drafter forward).
        max_followups: Follow-up blocks drafted per round at most (all in one batched drafter forward).
        block_expansion: How the last round's blocks (whose nodes start no follow-up block) become nodes: "chain"
            (the method's: the greedy token of every slot in a chain, slot k's other candidates under slot k - 1's
            greedy token) or "best_first" (slot k's candidates under every node of slot k - 1, the `tree_budget` best
            by summed draft log-probability, as DDTree grows a block drafter's tree). Both draft the same blocks; with
            "best_first" a tree above a few nodes also continues the branches that leave the greedy chain.
        branch_widths: Candidates drafted at a slot (greedy token included) per predicted rank class, one width per
            class of the drafter's rank head; 0 ends the branch at that slot. The default (2, 4, 6, 4) is the
            method's tuned widths: (2, 4, 6, 0), where class 3 (rank > 10) gives up, drafts almost nothing with a
            young drafter (docs/lab-notes/training-log.md).
        tree_policy: "rank" (rank-guided widths) or "fixed" (`fixed_width` candidates at every slot; an ablation).
        fixed_width: Candidates per slot when `tree_policy="fixed"`.
        Tree shape, EAGLE-3 and DFlash:
        tree_top_k: EAGLE-3: children kept per expanded node and frontier width per depth level (EAGLE's default
            10). DFlash: candidates per block position the best-first tree may use (its drafters' default 8).
        tree_depth: EAGLE-3: expansion rounds after the root's top-k (one drafter forward each; EAGLE's default 7),
            so a tree is at most `tree_depth + 1` levels deep.
        auto_budget_warmup_cost: With tree_budget="auto", the warm-up drafts with the largest candidate whose tree
            the target verifies for at most this many plain steps, by the measured cost curve (on a GPU the largest
            candidate; on a CPU, where a large tree costs several steps, a smaller one, so a first call does not pay
            for trees that cannot pay); candidates above it are measured when exploring reaches them.
        auto_budget_explore_interval: With tree_budget="auto", every this many verified steps one tree is drafted
            above the chosen budget (also when the choice is 0), so larger budgets keep being measured and the
            choice can move up again.
        auto_budget_explore_share: ... and an exploring tree waits until the steps since the previous one took
            1 / share times the seconds it is expected to cost beyond a step at the chosen budget, so exploring
            takes at most about this share of the time (where a tree costs several plain steps, e.g. in float32 on
            a CPU, explorations are further apart than the interval).
        auto_budget_min_gain: With tree_budget="auto", a budget that speculates (a drafted tree, or the free
            candidates' tree alone) is chosen only where it promises at least this much more tokens per second than
            plain decoding (0.05: 5%): the estimates are noisy, and a marginal gain is not worth the risk of a loss.
        auto_budget_cost_cache: With tree_budget="auto", keep the target's measured cost curves and what each
            chooser learnt on disk (in `$XDG_CACHE_HOME/transformers_specblock/`, per hardware, target architecture,
            dtype, device, batch size and, for the learnt estimates, drafter weights and settings), so a new process
            reads them instead of timing the target and warming up again, once they are checked against the machine
            now (a curve timed where the machine ran slower is timed again, a chooser's state learnt then is not
            restored: docs/how-to/caches.md); False starts afresh in every process and writes nothing.
        prompt_lookup_num_tokens: Free candidates from prompt lookup (0 = off): where the text's last n-gram occurred
            before (in the prompt or the generated text), the up to this many tokens that followed it become a chain
            of the tree, beside the drafter's nodes (merged where they agree).
        prompt_lookup_max_ngram_size / prompt_lookup_min_ngram_size: n-gram lengths matched, longest first.
        prompt_lookup_branches: At most this many distinct lookup chains per tree (most recent matches first).
        ngram_cache_num_tokens: Free candidates from a per-sequence n-gram cache (0 = off): a chain of up to this many
            tokens, walking what most often followed each `ngram_cache_order`-gram of the committed text.
        ngram_cache_order: Tokens of context of the n-gram cache.
        suffix_cache_num_tokens: Free candidates from the suffix cache (0 = off): a bounded memory of the prompts and
            answers this drafter object served, shared by all its calls (`generation.suffix_cache`); each step the
            longest earlier occurrence of the text's end proposes a frequency-scored tree of up to this many nodes.
        suffix_local_num_tokens: The same matching within the current prompt and answer (0 = off).
        suffix_cache_spec_factor: A suffix-cache tree has at most this many nodes per matched token (SuffixDecoding's
            `max_spec_factor`): a long match is drafted long. 4 (SuffixDecoding's default is 1): the learnt scores
            and the tree budget prune what is proposed, and short matches proposing more measured higher tau on
            every request stream (docs/benchmarks.md).
        suffix_cache_min_token_prob: Suffix-cache nodes whose frequency-estimated probability falls below this are
            left out.
        suffix_cache_max_tokens / suffix_cache_max_requests: Bounds of the memory (tokens and requests kept; the
            oldest requests are evicted first). It is never saved with the drafter (it holds users' text):
            `suffix_cache_for(drafter).save(path)` writes it when asked.
        Free candidates cost no drafter call; their nodes are scored by the acceptance rate each source earned in
        this `generate` call, so pruning to `tree_budget` (and "auto") weighs them with the drafter's nodes.
        online_adaptation: Learn from the verifier while serving (`generation.adaptation`): "off" (default); "always"
            (update the whole drafter after every `generate` call, OSD-style); "head_only" (train a candidate output
            side, `lm_head`, after every call, served once it has beaten the served one on the next two calls; no
            new candidate while one that won once awaits its second test); "full" (a
            cost-aware bandit choosing between skipping and a whole-drafter update); "bandit" (the cost-aware bandit
            over skip / output side / whole drafter). DFlash drafters draft with the target's output layer: no
            "head_only", and their "bandit" chooses between skip and whole drafter. The signal is the target
            distribution the verification already computed; outputs are unchanged.
        adaptation_learning_rate: Learning rate of a whole-drafter update's plain gradient steps (its output side
            moves at half of it, the other weights at a twentieth).
        adaptation_head_learning_rate: Adam learning rate of a head-only update (the candidate `lm_head`).
        adaptation_buffer_size: Signal samples kept (the most recent; each holds the target's top-k and one drafter
            state, and a replay context of `adaptation_context` positions for whole-drafter updates).
        adaptation_top_k: Target probabilities kept per sample (the soft label of the update).
        adaptation_context: Committed positions a whole-drafter update replays before each sample's position.
        compile_drafter: Run the drafter's forwards under `torch.compile` (inductor on a CPU, CUDA graphs through
            mode="reduce-overhead" on a GPU; shapes marked dynamic, so the growing cache and the changing number of
            tree rows reuse one graph). Drafts are the same; the first calls pay the compilation. Off by default:
            see docs/benchmarks.md for where it pays.
    """

    # the tree-shape settings this family reads (`SHAPE_SETTINGS` of other families keep their defaults), the
    # online_adaptation policies its drafters accept ("off" alone: they do not adapt) and whether they have a forward
    # to compile
    shape_settings: ClassVar[tuple[str, ...]] = SHAPE_SETTINGS
    adaptation_policies: ClassVar[tuple[str, ...]] = ADAPTATION_POLICIES
    compiles: ClassVar[bool] = True
    no_adaptation: ClassVar[str] = ""  # why a family refuses the policies it does not accept

    def __init__(self, **kwargs: Any) -> None:
        settings = {name: kwargs.pop(name, default) for name, default in DRAFTING_DEFAULTS.items()}
        super().__init__(**kwargs)
        for name, value in settings.items():
            setattr(self, name, list(value) if name in LIST_SETTINGS else value)
        self.validate()

    @classmethod
    def applies(cls, name: str) -> bool:
        """Whether drafters of this family read the drafting setting `name`."""
        if name in SHAPE_SETTINGS:
            return name in cls.shape_settings
        if name in ADAPTATION_SETTINGS:
            return len(cls.adaptation_policies) > 1
        return cls.compiles or name != "compile_drafter"

    def drafting_settings(self, names: Any = DRAFTING_SETTINGS) -> dict[str, Any]:
        """{name: value} of the drafting settings `names` (all by default)."""
        return {name: getattr(self, name) for name in names}

    def changed_settings(self) -> dict[str, Any]:
        """{name: value} of the drafting settings that differ from the package's defaults (what a model card lists)."""
        return {name: value for name, value in self.drafting_settings().items() if value != DRAFTING_DEFAULTS[name]}

    def validate(self, *args: Any, **kwargs: Any) -> None:
        """transformers' checks, then the drafting settings' (a ValueError naming the first inconsistent one), then a
        warning naming settings this family does not read. `save_pretrained`, `update` and `from_pretrained` call it."""
        super().validate(*args, **kwargs)
        if "tree_budget" not in self.__dict__:  # transformers' __init__ validates before the drafting settings exist
            return
        self.validate_settings()
        unread = self.unread_settings()
        if unread:
            warnings.warn(
                f"{type(self).__name__} does not read {unread}: they are settings of another drafter family or of the "
                "target's generate call (pass max_new_tokens, do_sample, ... to target.generate); they are not saved.",
                UserWarning,
                stacklevel=3,
            )

    def unread_settings(self) -> list[str]:
        """Settings set away from their defaults that drafters of this family never read."""
        unread = [n for n in DRAFTING_SETTINGS if not self.applies(n) and getattr(self, n) != DRAFTING_DEFAULTS[n]
                  and n != "online_adaptation"]  # (refused where it does not apply)  # fmt: skip
        stock = _stock_defaults()
        return unread + [
            name for name, value in self.__dict__.items()
            if name in stock and name not in (*DRAFTING_DEFAULTS, *_METADATA, *_TOKEN_IDS) and value not in stock[name]
        ]  # fmt: skip

    def update(self, **kwargs: Any) -> dict[str, Any]:
        """`GenerationConfig.update`, all or nothing: a value `validate` refuses leaves the config as it was."""
        before = copy.deepcopy(self.__dict__)
        try:
            return super().update(**kwargs)
        except ValueError:
            self.__dict__.clear()
            self.__dict__.update(before)
            raise

    def to_dict(self) -> dict[str, Any]:
        """`GenerationConfig.to_dict` without the settings this family does not read."""
        return {name: value for name, value in super().to_dict().items() if not self._unread_key(name)}

    def _unread_key(self, name: str) -> bool:
        if name in DRAFTING_DEFAULTS:
            return not self.applies(name)
        return name in _stock_defaults() and name not in _METADATA

    def validate_settings(self) -> None:
        """Raise a ValueError naming the first inconsistent drafting setting."""
        check_tree_budget(self.tree_budget)
        check_choice("tree_construction", self.tree_construction, TREE_CONSTRUCTIONS)
        check_choice("context_feeding", self.context_feeding, CONTEXT_FEEDINGS)
        if self.context_feeding == "reference" and self.tree_budget == AUTO:
            raise ValueError('context_feeding="reference" reads every step as the reference harness does: set a fixed '
                             "tree_budget (not \"auto\", which may skip steps).")
        if not self.auto_budget_candidates or not all(is_count(b, 0) for b in self.auto_budget_candidates):
            raise ValueError(
                "auto_budget_candidates must be a non-empty list of ints >= 0 (0 = do not speculate), got "
                f"{self.auto_budget_candidates}."
            )
        check_count("auto_budget_explore_interval", self.auto_budget_explore_interval, 1)
        check_number("auto_budget_explore_share", self.auto_budget_explore_share, lambda x: 0 < x <= 1, "in (0, 1]")
        check_number("auto_budget_warmup_cost", self.auto_budget_warmup_cost, lambda x: x >= 1, ">= 1")
        check_number("auto_budget_min_gain", self.auto_budget_min_gain, lambda x: x >= 0, ">= 0")
        for name in ("compile_drafter", "auto_budget_cost_cache"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        self._validate_tree_shape_settings()
        self._validate_lookup_settings()
        self._validate_adaptation_settings()

    def _validate_tree_shape_settings(self) -> None:
        """The checks that need no drafter (a drafter checks `branch_widths` against its rank classes and vocabulary)."""
        least = {"max_blocks": 1, "max_followups": 1, "fixed_width": 1, "tree_top_k": 1, "tree_depth": 0}
        for name, smallest in least.items():
            check_count(name, getattr(self, name), smallest)
        check_choice("block_expansion", self.block_expansion, BLOCK_EXPANSIONS)
        check_choice("tree_policy", self.tree_policy, TREE_POLICIES)
        widths = self.branch_widths
        if not isinstance(widths, (list, tuple)) or not widths or not all(is_count(w, 0) for w in widths):
            raise ValueError(f"branch_widths must be a non-empty list of ints >= 0, got {widths!r}.")

    def _validate_lookup_settings(self) -> None:
        counts = {
            "prompt_lookup_num_tokens": (self.prompt_lookup_num_tokens, 0),
            "prompt_lookup_max_ngram_size": (self.prompt_lookup_max_ngram_size, 1),
            "prompt_lookup_min_ngram_size": (self.prompt_lookup_min_ngram_size, 1),
            "prompt_lookup_branches": (self.prompt_lookup_branches, 1),
            "ngram_cache_num_tokens": (self.ngram_cache_num_tokens, 0),
            "ngram_cache_order": (self.ngram_cache_order, 1),
            "suffix_cache_num_tokens": (self.suffix_cache_num_tokens, 0),
            "suffix_local_num_tokens": (self.suffix_local_num_tokens, 0),
            "suffix_cache_max_tokens": (self.suffix_cache_max_tokens, 1),
            "suffix_cache_max_requests": (self.suffix_cache_max_requests, 1),
        }
        for name, (value, least) in counts.items():
            check_count(name, value, least)
        if self.prompt_lookup_min_ngram_size > self.prompt_lookup_max_ngram_size:
            raise ValueError(
                f"prompt_lookup_min_ngram_size ({self.prompt_lookup_min_ngram_size}) must not exceed "
                f"prompt_lookup_max_ngram_size ({self.prompt_lookup_max_ngram_size})."
            )

        check_number("suffix_cache_spec_factor", self.suffix_cache_spec_factor, lambda x: x > 0, "> 0")
        probability = self.suffix_cache_min_token_prob
        check_number("suffix_cache_min_token_prob", probability, lambda x: 0 <= x <= 1, "in [0, 1]", "a probability")

    def _validate_adaptation_settings(self) -> None:
        check_choice("online_adaptation", self.online_adaptation, ADAPTATION_POLICIES)
        if self.online_adaptation not in self.adaptation_policies:
            allowed = " or ".join(repr(p) for p in self.adaptation_policies)
            raise ValueError(f"{self.no_adaptation}: set online_adaptation={allowed}.")
        for name in ("adaptation_learning_rate", "adaptation_head_learning_rate"):
            rate = getattr(self, name)
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
                raise ValueError(f"{name} must be a float > 0, got {rate!r}.")
        for name in ("adaptation_buffer_size", "adaptation_top_k", "adaptation_context"):
            check_count(name, getattr(self, name), 1)


class SpecBlockGenerationConfig(TreeGenerationConfig):
    """The decoding settings of a SpecBlock drafter: `TreeGenerationConfig`'s, with SpecBlock's tree shape (blocks,
    follow-ups, rank-guided widths, tree construction and context feeding)."""

    shape_settings = SPECBLOCK_SHAPE_SETTINGS


class Eagle3GenerationConfig(TreeGenerationConfig):
    """The decoding settings of an EAGLE-3 drafter: `TreeGenerationConfig`'s, with EAGLE's tree shape (`tree_top_k`,
    `tree_depth`)."""

    shape_settings = ("tree_top_k", "tree_depth")


class DFlashGenerationConfig(TreeGenerationConfig):
    """The decoding settings of a DFlash drafter: `TreeGenerationConfig`'s, with `tree_top_k` (candidates per block
    position); online adaptation updates the whole drafter (no "head_only": its output layer is the target's)."""

    shape_settings = ("tree_top_k",)
    adaptation_policies = ("off", "always", "full", "bandit")
    no_adaptation = (
        "online_adaptation='head_only' does not apply to DFlash drafters: they draft with the target's own output "
        "layer, which adaptation never changes, so a DFlash update is a whole-drafter one ('bandit' chooses between "
        "it and skipping)"
    )


class LookupTreeGenerationConfig(TreeGenerationConfig):
    """The decoding settings of the weightless lookup tree: the budget and the free candidates (prompt lookup, n-gram
    cache, suffix cache); no tree shape, online adaptation or compiling."""

    shape_settings = ()
    adaptation_policies = ("off",)
    compiles = False
    no_adaptation = "LookupTreeModel has no weights to adapt (its free candidates learn their scores while serving)"


_STOCK_DEFAULTS: dict[str, list[Any]] = {}


def _stock_defaults() -> dict[str, list[Any]]:
    """Each field of transformers' `GenerationConfig` -> the values it holds unless a user set it: its unset value
    and the global default `generate` fills in (computed once)."""
    if not _STOCK_DEFAULTS:
        stock = GenerationConfig()
        filled = stock._get_default_generation_params()
        _STOCK_DEFAULTS.update({name: [value, filled.get(name, value)] for name, value in stock.to_dict().items()})
    return _STOCK_DEFAULTS
