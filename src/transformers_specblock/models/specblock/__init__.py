from .configuration_specblock import SpecBlockConfig
from .modeling_specblock import SpecBlockDraftModel, SpecBlockOutput

__all__ = ["SpecBlockConfig", "SpecBlockDraftModel", "SpecBlockOutput"]
