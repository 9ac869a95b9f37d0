"""Self-speculative decoding: the target drafts with a subset of its own decoder layers and verifies with
all of them (Draft & Verify, Zhang et al. 2023; SWIFT, Xia et al. 2024). *Early exit* -- the first k
layers, then the model's final norm and LM head -- is the case that skips a suffix of the layers.

Glossary (this package):

- *skip set*: the decoder layers a draft forward leaves out; the residual stream passes them unchanged.
  The other layers are *kept*.
- *draft cost*: one draft forward in one-token target forwards. Decoding on a CPU is bound by reading the
  weights, so it is the share of the weights a one-token target forward reads that the draft still reads
  (kept layers, final norm, LM head; `SkippedLayers.relative_cost`).
- *agreement*: the fraction of positions where the draft's argmax is the full model's argmax.

The package, by concept: `layers` runs a subset of the layers over the target's cache (`SkippedLayers`, the
draft model); `scoring` predicts a skip set's speedup on calibration prompts; `search` finds the best skip
set or exit layer and caches it; `drafter` holds the drafters and their builders.
"""

# The public names. Module constants and the cache path are not re-exported: patch them where they are used
# (`drafter.SEARCH_SECONDS`, `search.cache_path`), since a patch here would change nothing.
from specdecode.drafters.self_speculative.drafter import (
    EarlyExitDrafter, LayerSkipDrafter, build_earlyexit, build_layerskip, calibration_prompts,
)
from specdecode.drafters.self_speculative.layers import SkippedLayers, check_layer_skipping, run_layers
from specdecode.drafters.self_speculative.scoring import (
    CalibrationSet, Scorer, SearchResult, SkipChoice, block_influence, chain_speedup,
)
from specdecode.drafters.self_speculative.search import search_exit, search_skip

__all__ = [
    "CalibrationSet", "EarlyExitDrafter", "LayerSkipDrafter", "Scorer", "SearchResult", "SkipChoice", "SkippedLayers",
    "block_influence", "build_earlyexit", "build_layerskip", "calibration_prompts", "chain_speedup",
    "check_layer_skipping", "run_layers", "search_exit", "search_skip",
]
