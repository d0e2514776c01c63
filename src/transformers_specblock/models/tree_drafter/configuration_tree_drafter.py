"""Configuration shared by the feature-level tree drafters (SpecBlock, EAGLE-3).

`TreeDrafterConfig` holds what every drafter of a frozen target needs: the target it reads (vocabulary, sizes, the
three feature layers), the Llama-style decoder settings of its own layers, the draft vocabulary and the tree budget
(a fixed size or "auto"). Each drafter's config adds its own tree shape and training settings.
"""

from __future__ import annotations

from typing import Any, Callable

from transformers import PretrainedConfig

from ...hub.shipped import resolve_drafter_path

AUTO = "auto"
DEFAULT_CANDIDATES = (0, 2, 4, 8, 16, 24, 32, 48, 64)
DEFAULT_EXPLORE_INTERVAL = 32  # verified steps between two trees drafted above the chosen budget
DEFAULT_EXPLORE_SHARE = 0.02  # ... at least; and at most this share of the decoding time goes to exploring
DEFAULT_MIN_GAIN = 0.05  # speculating must promise 5% more tokens per second than plain decoding
DEFAULT_WARMUP_COST = 2.0  # the warm-up's trees cost the target at most two plain steps (a GPU: the largest budget)
# online_adaptation policies: no update / whole drafter after every call (OSD-style) / output side after every call /
# cost-aware choice between skip and whole drafter / cost-aware choice between skip, output side and whole drafter
ADAPTATION_POLICIES = ("off", "always", "head_only", "full", "bandit")
# The decoding and serving settings (not architecture): `generate(..., assistant_model=drafter, <name>=value)` sets
# them for one call, `drafter.tree_settings(<name>=value)` for a block of calls.
DRAFTING_SETTINGS = (
    "tree_budget", "auto_budget_candidates", "auto_budget_warmup", "auto_budget_warmup_cost",
    "auto_budget_explore_interval", "auto_budget_explore_share", "auto_budget_min_gain",
    "prompt_lookup_num_tokens", "prompt_lookup_max_ngram_size", "prompt_lookup_min_ngram_size",
    "prompt_lookup_branches", "ngram_cache_num_tokens", "ngram_cache_order",
    "suffix_cache_num_tokens", "suffix_local_num_tokens", "suffix_cache_spec_factor", "suffix_cache_min_token_prob",
    "suffix_cache_max_tokens", "suffix_cache_max_requests",
    "online_adaptation", "adaptation_learning_rate", "adaptation_head_learning_rate", "adaptation_buffer_size",
    "adaptation_top_k", "adaptation_context", "compile_drafter",
)  # fmt: skip
# Target families whose decoder stack and hidden-state layout the drafters understand.
SUPPORTED_TARGET_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3")


def check_tree_budget(value: int | str) -> None:
    """A tree budget is a positive int or "auto"."""
    if value != AUTO and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f'tree_budget must be a positive int or "auto", got {value!r}.')


def check_number(name: str, value: Any, valid: Callable[[float], bool], expected: str, kind: str = "a number") -> None:
    """Raise a ValueError unless `value` is an int or float (not a bool) that is `valid`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not valid(value):
        raise ValueError(f"{name} must be {kind} {expected}, got {value!r}.")


def default_target_layer_ids(num_target_layers: int) -> list[int]:
    """EAGLE-3's low / middle / high feature layers: the inputs of layers 2, L//2 and L-3.

    The ids index the target's `hidden_states` tuple (index 0 is the embedding output, i.e. the input of layer 0).
    """
    if num_target_layers < 4:
        raise ValueError(f"A feature-level drafter needs a target with at least 4 layers, got {num_target_layers}.")
    return [2, num_target_layers // 2, num_target_layers - 3]


class TreeDrafterConfig(PretrainedConfig):
    r"""Settings every tree drafter of a frozen target shares (subclassed by each drafter's config).

    Args:
        vocab_size: Target vocabulary size (the drafter reads the target's input embedding).
        hidden_size: Drafter hidden size (defaults to the target's).
        target_hidden_size: Target hidden size.
        target_num_hidden_layers: Number of decoder layers of the target.
        target_layer_ids: Indices into the target's `hidden_states` tuple used as low/middle/high features
            (default: the inputs of layers 2, L//2 and L-3, as EAGLE-3).
        target_model_type: `model_type` of the target the drafter was built for.
        num_hidden_layers / num_attention_heads / num_key_value_heads / head_dim / intermediate_size / hidden_act /
        rms_norm_eps / rope_parameters / max_position_embeddings / attention_bias / attention_dropout / mlp_bias:
            Llama-style decoder settings of the drafter.
        draft_vocab_size: Size of the reduced draft vocabulary (`None` = the full target vocabulary).
        tree_budget: Nodes the target verifies per iteration at most (the root not counted), or "auto": time the
            target once per model and device and pick, among `auto_budget_candidates`, the budget maximising
            tau / (T_M + T_D), with tau learnt from the verified trees (the first `auto_budget_warmup` ones at the
            largest candidate the target verifies for at most `auto_budget_warmup_cost` plain steps, then over a
            window of recent steps). A candidate 0 means "do not speculate" and wins
            where no tree pays for itself (a weak drafter on a slow device).
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
            side, `lm_head`, after every call, served once it beats the served one on the next call); "full" (a
            cost-aware bandit choosing between skipping and a whole-drafter update); "bandit" (the cost-aware bandit
            over skip / output side / whole drafter). The signal is the target distribution the verification already
            computed; outputs are unchanged.
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

    drafter_name = "tree"

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 4096,
        target_hidden_size: int | None = None,
        target_num_hidden_layers: int = 32,
        target_layer_ids: list[int] | None = None,
        target_model_type: str | None = None,
        num_hidden_layers: int = 1,
        num_attention_heads: int = 32,
        num_key_value_heads: int = 8,
        head_dim: int | None = None,
        intermediate_size: int | None = None,
        hidden_act: str = "silu",
        rms_norm_eps: float = 1e-6,
        rope_parameters: dict[str, Any] | None = None,
        max_position_embeddings: int = 8192,
        attention_bias: bool = False,
        attention_dropout: float = 0.0,
        mlp_bias: bool = False,
        initializer_range: float = 0.02,
        draft_vocab_size: int | None = None,
        tree_budget: int | str = AUTO,
        auto_budget_candidates: list[int] | tuple[int, ...] = DEFAULT_CANDIDATES,
        auto_budget_warmup: int = 8,
        auto_budget_warmup_cost: float = DEFAULT_WARMUP_COST,
        auto_budget_explore_interval: int = DEFAULT_EXPLORE_INTERVAL,
        auto_budget_explore_share: float = DEFAULT_EXPLORE_SHARE,
        auto_budget_min_gain: float = DEFAULT_MIN_GAIN,
        prompt_lookup_num_tokens: int = 0,
        prompt_lookup_max_ngram_size: int = 3,
        prompt_lookup_min_ngram_size: int = 1,
        prompt_lookup_branches: int = 4,
        ngram_cache_num_tokens: int = 0,
        ngram_cache_order: int = 2,
        suffix_cache_num_tokens: int = 0,
        suffix_local_num_tokens: int = 0,
        suffix_cache_spec_factor: float = 4.0,
        suffix_cache_min_token_prob: float = 0.1,
        suffix_cache_max_tokens: int = 65536,
        suffix_cache_max_requests: int = 256,
        online_adaptation: str = "off",
        adaptation_learning_rate: float = 2e-2,
        adaptation_head_learning_rate: float = 1e-3,
        adaptation_buffer_size: int = 256,
        adaptation_top_k: int = 32,
        adaptation_context: int = 8,
        compile_drafter: bool = False,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("tie_word_embeddings", False)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.target_hidden_size = target_hidden_size if target_hidden_size is not None else hidden_size
        self.target_num_hidden_layers = target_num_hidden_layers
        self.target_layer_ids = (
            list(target_layer_ids) if target_layer_ids is not None else default_target_layer_ids(target_num_hidden_layers)
        )
        self.target_model_type = target_model_type
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_attention_heads
        self.intermediate_size = intermediate_size if intermediate_size is not None else 4 * hidden_size
        self.hidden_act = hidden_act
        self.rms_norm_eps = rms_norm_eps
        self.rope_parameters = dict(rope_parameters) if rope_parameters else {"rope_type": "default", "rope_theta": 1e4}
        self.max_position_embeddings = max_position_embeddings
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout
        self.mlp_bias = mlp_bias
        self.initializer_range = initializer_range
        self.draft_vocab_size = draft_vocab_size if draft_vocab_size is not None else vocab_size
        self.tree_budget = tree_budget
        self.auto_budget_candidates = list(auto_budget_candidates)
        self.auto_budget_warmup = auto_budget_warmup
        self.auto_budget_warmup_cost = auto_budget_warmup_cost
        self.auto_budget_explore_interval = auto_budget_explore_interval
        self.auto_budget_explore_share = auto_budget_explore_share
        self.auto_budget_min_gain = auto_budget_min_gain
        self.prompt_lookup_num_tokens = prompt_lookup_num_tokens
        self.prompt_lookup_max_ngram_size = prompt_lookup_max_ngram_size
        self.prompt_lookup_min_ngram_size = prompt_lookup_min_ngram_size
        self.prompt_lookup_branches = prompt_lookup_branches
        self.ngram_cache_num_tokens = ngram_cache_num_tokens
        self.ngram_cache_order = ngram_cache_order
        self.suffix_cache_num_tokens = suffix_cache_num_tokens
        self.suffix_local_num_tokens = suffix_local_num_tokens
        self.suffix_cache_spec_factor = suffix_cache_spec_factor
        self.suffix_cache_min_token_prob = suffix_cache_min_token_prob
        self.suffix_cache_max_tokens = suffix_cache_max_tokens
        self.suffix_cache_max_requests = suffix_cache_max_requests
        self.online_adaptation = online_adaptation
        self.adaptation_learning_rate = adaptation_learning_rate
        self.adaptation_head_learning_rate = adaptation_head_learning_rate
        self.adaptation_buffer_size = adaptation_buffer_size
        self.adaptation_top_k = adaptation_top_k
        self.adaptation_context = adaptation_context
        self.compile_drafter = compile_drafter
        super().__init__(**kwargs)
        self.validate_settings()

    def validate_settings(self) -> None:
        """Raise a ValueError naming the first inconsistent shared setting (subclasses check their own after)."""
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, vocab_size={self.vocab_size}], got {self.draft_vocab_size}.")
        check_tree_budget(self.tree_budget)
        if not self.auto_budget_candidates or any(
            not isinstance(b, int) or isinstance(b, bool) or b < 0 for b in self.auto_budget_candidates
        ):
            raise ValueError(
                "auto_budget_candidates must be a non-empty list of ints >= 0 (0 = do not speculate), got "
                f"{self.auto_budget_candidates}."
            )
        interval = self.auto_budget_explore_interval
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise ValueError(f"auto_budget_explore_interval must be an int >= 1, got {interval!r}.")
        check_number("auto_budget_explore_share", self.auto_budget_explore_share, lambda x: 0 < x <= 1, "in (0, 1]")
        check_number("auto_budget_warmup_cost", self.auto_budget_warmup_cost, lambda x: x >= 1, ">= 1")
        check_number("auto_budget_min_gain", self.auto_budget_min_gain, lambda x: x >= 0, ">= 0")
        if not isinstance(self.compile_drafter, bool):
            raise ValueError(f"compile_drafter must be True or False, got {self.compile_drafter!r}.")
        self._validate_lookup_settings()
        self._validate_adaptation_settings()
        self._validate_target_layer_ids()

    @property
    def feature_layers(self) -> list[int]:
        """Indices into the target's `hidden_states` tuple the drafter reads (index 0 = the embedding output)."""
        return list(self.target_layer_ids)

    def _validate_target_layer_ids(self) -> None:
        if len(self.target_layer_ids) != 3:
            raise ValueError(f"target_layer_ids must name 3 hidden states, got {self.target_layer_ids}.")
        if max(self.target_layer_ids) > self.target_num_hidden_layers or min(self.target_layer_ids) < 0:
            raise ValueError(
                f"target_layer_ids {self.target_layer_ids} fall outside the target's hidden states "
                f"0..{self.target_num_hidden_layers}."
            )

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
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name} must be an int >= {least}{' (0 = off)' if least == 0 else ''}, got {value!r}.")
        if self.prompt_lookup_min_ngram_size > self.prompt_lookup_max_ngram_size:
            raise ValueError(
                f"prompt_lookup_min_ngram_size ({self.prompt_lookup_min_ngram_size}) must not exceed "
                f"prompt_lookup_max_ngram_size ({self.prompt_lookup_max_ngram_size})."
            )

        check_number("suffix_cache_spec_factor", self.suffix_cache_spec_factor, lambda x: x > 0, "> 0")
        check_number("suffix_cache_min_token_prob", self.suffix_cache_min_token_prob, lambda x: 0 <= x <= 1, "in [0, 1]",
                     kind="a probability")  # fmt: skip

    def _validate_adaptation_settings(self) -> None:
        if self.online_adaptation not in ADAPTATION_POLICIES:
            raise ValueError(
                f"online_adaptation must be one of {ADAPTATION_POLICIES}, got {self.online_adaptation!r}."
            )
        for name in ("adaptation_learning_rate", "adaptation_head_learning_rate"):
            rate = getattr(self, name)
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
                raise ValueError(f"{name} must be a float > 0, got {rate!r}.")
        for name in ("adaptation_buffer_size", "adaptation_top_k", "adaptation_context"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}.")

    @classmethod
    def from_target_config(cls, target_config: PretrainedConfig, **overrides: Any) -> "TreeDrafterConfig":
        """Derive a drafter config for a Llama-, Mistral-, Qwen2/3- or Gemma3-family target config: the drafter's
        decoder copies the target's attention / MLP shape; `overrides` win."""
        return cls(**derive_from_target(target_config, cls.drafter_name, overrides))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any) -> "TreeDrafterConfig":
        """`PretrainedConfig.from_pretrained`; a shipped drafter's name resolves as in `TreeDraftModel.from_pretrained`
        (a local folder of that name wins; a Hub id is passed through unchanged)."""
        return super().from_pretrained(resolve_drafter_path(pretrained_model_name_or_path), *args, **kwargs)


def derive_from_target(target_config: PretrainedConfig, drafter_name: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """Config values a drafter takes from its target (vocab, sizes, attention shape, RoPE, special ids); `overrides`
    win. The drafter's decoder copies the target's attention / MLP shape."""
    text_config = target_config.get_text_config()
    model_type = text_config.model_type
    if model_type not in SUPPORTED_TARGET_TYPES:
        raise ValueError(
            f"{drafter_name} drafters support targets of type {SUPPORTED_TARGET_TYPES}, got '{model_type}'. "
            "Open an issue with the model's config if it is a Llama-like decoder."
        )
    hidden = text_config.hidden_size
    num_heads = text_config.num_attention_heads
    derived: dict[str, Any] = {
        "vocab_size": text_config.vocab_size,
        "hidden_size": hidden,
        "target_hidden_size": hidden,
        "target_num_hidden_layers": text_config.num_hidden_layers,
        "target_model_type": model_type,
        "num_attention_heads": num_heads,
        "num_key_value_heads": getattr(text_config, "num_key_value_heads", None) or num_heads,
        "head_dim": getattr(text_config, "head_dim", None) or hidden // num_heads,
        "intermediate_size": text_config.intermediate_size,
        "rms_norm_eps": getattr(text_config, "rms_norm_eps", 1e-6),
        "max_position_embeddings": text_config.max_position_embeddings,
        "rope_parameters": _plain_rope_parameters(text_config),
        "pad_token_id": text_config.pad_token_id,
        "bos_token_id": text_config.bos_token_id,
        "eos_token_id": text_config.eos_token_id,
    }
    derived.update(overrides)
    if "hidden_size" in overrides and "head_dim" not in overrides:
        derived["head_dim"] = derived["hidden_size"] // derived["num_attention_heads"]
    return derived


def _plain_rope_parameters(text_config: PretrainedConfig) -> dict[str, Any]:
    """The target's default-RoPE theta (Gemma3 keeps one per attention type; the global one is used)."""
    rope = getattr(text_config, "rope_parameters", None) or {}
    if "full_attention" in rope:  # per-layer-type rope parameters (Gemma3)
        rope = rope["full_attention"]
    return {"rope_type": "default", "rope_theta": float(rope.get("rope_theta", 1e4))}
